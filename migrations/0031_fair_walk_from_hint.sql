-- The walk of fair claiming (0026), with two changes measured during `bench queue` with
-- pg_stat_statements (README, design notes):
-- - Each group's head comes back with its job's id (`head_id`), so the claim starts its scan at
--   that very entry, (run_at, id) >= (head, head_id), instead of at its run time: jobs enqueued
--   by one statement share a run time, and the claim stepped again over the entries of up to a
--   statement's worth of jobs claimed before.
-- - A group's probe may start after the last job the worker's previous claims took from it
--   (p_unkeyed_after and p_unkeyed_after_id for the unkeyed group; p_keys, p_key_run_ats and
--   p_key_ids, sorted by key, for keyed ones), instead of at the group's start: between two
--   vacuums the start of a group in the claim index holds the entries of every job of it
--   claimed since the first, and the probe stepped over all of them at every claim (1.9 ms of
--   a 9.3 ms claim of 475 jobs, mid-drain; a seller's flood of 600,000 drained at 0.72 of the
--   unkeyed rate). For a keyed group the walk first asks whether another key lies between the
--   previous group and the hinted one (that probe stops at the hinted key's first index page).
--   A job can be committed behind such a point (its transaction took its run time before the
--   previous claim and committed after it), so the fleet probes from the start whenever a job
--   was notified since its last such probe, after a claim that found nothing, and at least
--   every quarter second (src/queue/store.rs: FairCursor).
-- The old signature goes, in this migration's transaction; a call with four arguments still
-- resolves, to probes from the start, and reads the columns it names.
DROP FUNCTION jobs_fair_walk(text, text, int, int);

CREATE FUNCTION jobs_fair_walk(p_queue text, p_after text, p_want int, p_max int,
                               p_unkeyed_after timestamptz DEFAULT NULL,
                               p_unkeyed_after_id bigint DEFAULT NULL,
                               p_keys text[] DEFAULT '{}',
                               p_key_run_ats timestamptz[] DEFAULT '{}',
                               p_key_ids bigint[] DEFAULT '{}')
RETURNS TABLE (grp text, due boolean, pos int, head timestamptz, head_id bigint)
-- A few groups, for the planner (0026: a larger guess makes PostgreSQL compile the claim).
LANGUAGE plpgsql STABLE ROWS 4 AS $$
DECLARE
    at text := coalesce(p_after, '');  -- '' stands for the unkeyed group: the ring's end
    k text;
    k_head timestamptz;
    k_head_id bigint;
    hint int := 1;                     -- the first hinted key after `at`, once moved up to it
    nkeys int := coalesce(array_length(p_keys, 1), 0);
    lowest text;                       -- the lowest key, once a probe from the start found it
    lowest_head timestamptz;
    lowest_head_id bigint;
    unkeyed_head timestamptz;
    unkeyed_head_id bigint;
    unkeyed_probed boolean := false;
    seen text[] := '{}';
    ndue int := 0;
    -- How many groups the walk had found when it last went round past the ring's end: going
    -- round again without finding one more ends it (a hinted key with nothing after its hint
    -- moves the walk on without a probe from the ring's end that could say so).
    wrapped_at int := CASE WHEN coalesce(p_after, '') = '' THEN 0 ELSE -1 END;
BEGIN
    pos := 0;
    WHILE pos < p_max AND ndue < p_want LOOP
        -- Back where the walk started: the next group is the first one visited.
        EXIT WHEN pos > 0 AND at = coalesce(p_after, '');
        IF at = '' AND lowest IS NOT NULL THEN
            k := lowest;
            k_head := lowest_head;
            k_head_id := lowest_head_id;
        ELSE
            IF at = '' THEN
                hint := 1;
            END IF;
            WHILE hint <= nkeys AND p_keys[hint] <= at LOOP
                hint := hint + 1;
            END LOOP;
            k := NULL;
            IF hint <= nkeys THEN
                -- A key between here and the hinted one? (Stops at the hinted key's entries.)
                SELECT j.fairness_key, j.run_at, j.id INTO k, k_head, k_head_id FROM jobs j
                WHERE j.queue = p_queue AND j.state IN ('available', 'retryable')
                  AND j.fairness_key IS NOT NULL AND j.fairness_key > at
                  AND j.fairness_key < p_keys[hint]
                ORDER BY j.fairness_key, j.run_at, j.id
                LIMIT 1;
                IF NOT FOUND THEN
                    SELECT j.fairness_key, j.run_at, j.id INTO k, k_head, k_head_id FROM jobs j
                    WHERE j.queue = p_queue AND j.state IN ('available', 'retryable')
                      AND j.fairness_key = p_keys[hint]
                      AND (j.run_at, j.id) > (p_key_run_ats[hint], p_key_ids[hint])
                    ORDER BY j.run_at, j.id
                    LIMIT 1;
                    IF NOT FOUND THEN
                        -- Nothing after the hint: on to the next key, as if the group had none.
                        at := p_keys[hint];
                        CONTINUE;
                    END IF;
                END IF;
            ELSE
                SELECT j.fairness_key, j.run_at, j.id INTO k, k_head, k_head_id FROM jobs j
                WHERE j.queue = p_queue AND j.state IN ('available', 'retryable')
                  AND j.fairness_key IS NOT NULL AND j.fairness_key > at
                  ORDER BY j.fairness_key, j.run_at, j.id
                LIMIT 1;
            END IF;
            IF k IS NOT NULL AND at = '' THEN
                lowest := k;
                lowest_head := k_head;
                lowest_head_id := k_head_id;
            END IF;
        END IF;
        IF k IS NULL THEN
            -- Past the last key: the unkeyed group, if it has jobs waiting.
            IF NOT unkeyed_probed THEN
                IF p_unkeyed_after IS NULL THEN
                    SELECT j.run_at, j.id INTO unkeyed_head, unkeyed_head_id FROM jobs j
                    WHERE j.queue = p_queue AND j.state IN ('available', 'retryable')
                      AND j.fairness_key IS NULL
                    ORDER BY j.run_at, j.id
                    LIMIT 1;
                ELSE
                    SELECT j.run_at, j.id INTO unkeyed_head, unkeyed_head_id FROM jobs j
                    WHERE j.queue = p_queue AND j.state IN ('available', 'retryable')
                      AND j.fairness_key IS NULL
                      AND (j.run_at, j.id) > (p_unkeyed_after, p_unkeyed_after_id)
                    ORDER BY j.run_at, j.id
                    LIMIT 1;
                END IF;
                unkeyed_probed := true;
            END IF;
            IF at = '' OR unkeyed_head IS NULL THEN
                -- At the ring's end already, or no unkeyed job: round again, unless there is
                -- nothing at all to go round to.
                EXIT WHEN at = '' AND (unkeyed_head IS NULL OR '' = ANY (seen));
                IF at <> '' THEN
                    EXIT WHEN wrapped_at = pos;
                    wrapped_at := pos;
                    at := '';
                    CONTINUE;
                END IF;
            END IF;
            k := '';
            k_head := unkeyed_head;
            k_head_id := unkeyed_head_id;
        END IF;
        EXIT WHEN k = ANY (seen);
        seen := seen || k;
        pos := pos + 1;
        grp := k;
        head := k_head;
        head_id := k_head_id;
        due := k_head <= now();
        IF due THEN
            ndue := ndue + 1;
        END IF;
        RETURN NEXT;
        at := k;
    END LOOP;
END
$$;
