-- Every way a run ends goes through these two functions, so the rules live in one place:
-- the worker's batched completions, the rescue of expired leases and the release at shutdown.

-- Exponential backoff with jitter: about 2^attempt seconds, capped at an hour, +-25%.
CREATE FUNCTION jobs_backoff(attempt integer) RETURNS interval LANGUAGE sql VOLATILE AS $$
    SELECT make_interval(secs => least(power(2, least(attempt, 20))::float8, 3600) * (0.75 + random() * 0.5))
$$;

-- The state a running job moves to. A reschedule or cancel that arrived while it ran wins over
-- the run's own outcome: the replaced run can never run again.
CREATE FUNCTION jobs_next_state(pending text, outcome text, attempt integer, max_attempts integer)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN pending = 'cancel' THEN 'cancelled'
        WHEN pending = 'reschedule' THEN 'available'
        WHEN outcome = 'complete' THEN 'completed'
        WHEN outcome = 'cancel' THEN 'cancelled'
        WHEN outcome IN ('snooze', 'release') THEN 'available'
        WHEN outcome = 'retry' AND attempt < max_attempts THEN 'retryable'
        ELSE 'discarded'
    END
$$;

-- Ends the runs named by (id, lease token). A run whose token no longer matches (its lease
-- expired and the job was rescued or claimed again) is left alone.
-- outcome: complete | retry | fail | snooze | cancel | release
-- delay_ms: for snooze, and for retry when the handler asked for a specific delay.
CREATE FUNCTION jobs_end_runs(p_ids bigint[], p_tokens bigint[], p_outcomes text[], p_delays_ms bigint[], p_errors text[])
RETURNS TABLE (job_id bigint, new_state text) LANGUAGE sql AS $$
    -- Lock in id order, as every other multi-row writer of running jobs does: no deadlocks.
    SELECT 1 FROM jobs WHERE id = ANY (p_ids) ORDER BY id FOR UPDATE;
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
    FROM unnest(p_ids, p_tokens, p_outcomes, p_delays_ms, p_errors) AS d(id, token, outcome, delay_ms, error)
    WHERE j.id = d.id AND j.lease_token = d.token AND j.state = 'running'
    RETURNING j.id, j.state
$$;
