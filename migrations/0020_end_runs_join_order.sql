-- Ending a batch of runs could cost a second or more per 2,000 ends: the planner cannot know an
-- unnest's size (it guesses 10 rows) and, when the statistics saw no running job, it also
-- believes one row matches `state = 'running'`; so it drove the join from the partial index of
-- running jobs and read the batch once per job (4 million rows). The batch now drives the
-- join, each row finding its job by primary key, and the running state is checked through the
-- lease token alone (a token is set exactly while a job runs: jobs_lease_iff_running), which
-- no partial index can answer, so the primary key is the only way in.
CREATE OR REPLACE FUNCTION jobs_end_runs(p_ids bigint[], p_tokens bigint[], p_outcomes text[], p_delays_ms bigint[], p_errors text[])
RETURNS TABLE (job_id bigint, new_state text) LANGUAGE sql AS $$
    -- Lock in id order, as every other multi-row writer of running jobs does: no deadlocks.
    WITH locked AS (
        SELECT d.id, d.token, d.outcome, d.delay_ms, d.error
        FROM unnest(p_ids, p_tokens, p_outcomes, p_delays_ms, p_errors) AS d(id, token, outcome, delay_ms, error)
        JOIN jobs l ON l.id = d.id AND l.lease_token = d.token
        ORDER BY d.id
        FOR UPDATE OF l SKIP LOCKED
    )
    UPDATE jobs j SET
        state = jobs_next_state(j.pending, d.outcome, j.attempt, j.max_attempts),
        attempt = CASE
            WHEN j.pending = 'reschedule' THEN 0
            WHEN j.pending IS NULL AND d.outcome IN ('snooze', 'release') THEN j.attempt - 1
            ELSE j.attempt END,
        run_at = CASE
            WHEN j.pending IS NOT NULL THEN j.run_at
            WHEN d.outcome = 'release' THEN now()
            WHEN d.outcome IN ('snooze', 'retry') AND d.delay_ms IS NOT NULL
                THEN now() + d.delay_ms * interval '1 millisecond'
            WHEN d.outcome = 'retry' THEN now() + jobs_backoff(j.attempt)
            ELSE j.run_at END,
        finished_at = CASE
            WHEN jobs_next_state(j.pending, d.outcome, j.attempt, j.max_attempts)
                 IN ('completed', 'discarded', 'cancelled') THEN now() END,
        errors = CASE
            WHEN d.error IS NULL THEN j.errors
            ELSE j.errors || jsonb_build_array(jsonb_build_object(
                'attempt', j.attempt, 'at', now(), 'worker', j.locked_by, 'error', d.error)) END,
        lease_token = NULL,
        lease_expires_at = NULL,
        locked_by = NULL,
        pending = NULL
    FROM locked d
    WHERE j.id = d.id
    RETURNING j.id, j.state
$$;
