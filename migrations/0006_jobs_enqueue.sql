-- The one way a job is inserted, so a business statement can write its row and its job in a
-- single round trip (see webhooks::store) with the same rules as queue::enqueue. A key held by an
-- unfinished job means nothing is written: NULL comes back and the caller's transaction goes on.
CREATE FUNCTION jobs_enqueue(p_queue text, p_kind text, p_key text, p_payload jsonb, p_run_at timestamptz, p_max_attempts integer)
RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO jobs (queue, kind, key, payload, run_at, max_attempts)
    VALUES (p_queue, p_kind, p_key, p_payload, COALESCE(p_run_at, now()), p_max_attempts)
    ON CONFLICT (key) WHERE key IS NOT NULL AND state IN ('available', 'running', 'retryable')
    DO NOTHING
    RETURNING id
$$;
