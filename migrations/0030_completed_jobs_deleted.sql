-- A run that completes deletes its job, instead of updating the row to 'completed' and keeping
-- it a day for the prune (measured in batches of 500 ends after a checkpoint: the update cost
-- 20 us a job, the delete 5 to 7; and the completed rows were most of the table). What a
-- completion did is recorded where it matters, by the job's own writes (an event's outcome,
-- a ledger entry, an order message); the queue keeps what an operator acts on: waiting,
-- running, dead and cancelled jobs. Retries, snoozes, cancels and reschedules update the row
-- as before.
--
-- No job is written as completed from now on. Rows completed before this migration stay until
-- the prune takes them (so the check is NOT VALID: it holds for every write, not for them).
ALTER TABLE jobs ADD CONSTRAINT jobs_completed_are_deleted CHECK (state <> 'completed') NOT VALID;

CREATE OR REPLACE FUNCTION jobs_end_runs(p_ids bigint[], p_tokens bigint[], p_outcomes text[], p_delays_ms bigint[], p_errors text[],
                              p_skip_locked boolean DEFAULT true)
RETURNS TABLE (job_id bigint, new_state text) LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[] := p_ids;
    tokens bigint[] := p_tokens;
    outcomes text[] := p_outcomes;
    delays_ms bigint[] := p_delays_ms;
    errors_ text[] := p_errors;
    completed bigint[];
BEGIN
    IF p_skip_locked THEN
        -- Keep the runs whose row this transaction can lock now, locked in id order (as every
        -- other multi-row writer of running jobs locks): no deadlocks, no waiting.
        SELECT coalesce(array_agg(x.id ORDER BY x.id), '{}'), coalesce(array_agg(x.token ORDER BY x.id), '{}'),
               coalesce(array_agg(x.outcome ORDER BY x.id), '{}'), coalesce(array_agg(x.delay_ms ORDER BY x.id), '{}'),
               coalesce(array_agg(x.error ORDER BY x.id), '{}')
        INTO ids, tokens, outcomes, delays_ms, errors_
        FROM (
            SELECT d.id, d.token, d.outcome, d.delay_ms, d.error
            FROM unnest(p_ids, p_tokens, p_outcomes, p_delays_ms, p_errors) AS d(id, token, outcome, delay_ms, error)
            JOIN jobs l ON l.id = d.id AND l.lease_token = d.token
            ORDER BY d.id
            FOR UPDATE OF l SKIP LOCKED
        ) x;
    END IF;
    -- A completed job is done with: its row goes, with its index entries (a delete writes no
    -- new row version and no index entry, where the update to 'completed' wrote both).
    WITH gone AS (
        DELETE FROM jobs j
        USING unnest(ids, tokens, outcomes) AS d(id, token, outcome)
        WHERE j.id = d.id AND j.lease_token = d.token
          AND jobs_next_state(j.pending, d.outcome, j.attempt, j.max_attempts) = 'completed'
        RETURNING j.id
    )
    SELECT coalesce(array_agg(id), '{}') INTO completed FROM gone;
    RETURN QUERY SELECT unnest(completed), 'completed'::text;
    -- Every other end (a retry, a snooze, a cancel, a reschedule asked during the run) keeps its
    -- row: the rules below, unchanged. Skipped when the batch was all completions, the usual
    -- case; a completed job's row is gone for this statement, so it is not met twice.
    IF cardinality(completed) = cardinality(ids) THEN
        RETURN;
    END IF;
    RETURN QUERY
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
    FROM unnest(ids, tokens, outcomes, delays_ms, errors_) AS d(id, token, outcome, delay_ms, error)
    WHERE j.id = d.id AND j.lease_token = d.token
    RETURNING j.id, j.state;
END;
$$;
