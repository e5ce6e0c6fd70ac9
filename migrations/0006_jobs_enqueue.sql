-- The one way jobs are inserted, so business statements can write their rows and their jobs in
-- a single round trip (see webhooks::EventWriter) with the same rules as queue::enqueue. A key
-- held by an unfinished job means nothing is written for that job, and the caller's
-- transaction goes on. Returns the ids of the jobs written.
CREATE FUNCTION jobs_enqueue_many(p_queues text[], p_kinds text[], p_keys text[], p_payloads jsonb[],
                                  p_run_ats timestamptz[], p_max_attempts integer[])
RETURNS SETOF bigint LANGUAGE sql AS $$
    INSERT INTO jobs (queue, kind, key, payload, run_at, max_attempts)
    SELECT q, k, key, p, COALESCE(r, now()), m
    FROM unnest(p_queues, p_kinds, p_keys, p_payloads, p_run_ats, p_max_attempts) AS t(q, k, key, p, r, m)
    ON CONFLICT (key) WHERE key IS NOT NULL AND state IN ('available', 'running', 'retryable')
    DO NOTHING
    RETURNING id
$$;
