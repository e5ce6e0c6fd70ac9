-- Fair claiming (src/queue/store.rs: CLAIM). The waiting jobs of a queue form groups: one per
-- fairness key, and one ('') for the jobs without a key. A claim walks the groups as a ring (the
-- keys in order, then the unkeyed group, then round again), starting after the group the
-- worker's previous claim ended on, and shares its batch between the groups that have a job
-- due: a seller's flood of 100,000 jobs is one group, and another seller's single job waits one
-- claim, not the flood.
--
-- The walk lands on each group's first index entry once: one probe gives the group and its
-- oldest run time, `head` (so whether it is due). A probe landing on a group also steps over
-- that group's entries left by jobs claimed since the last vacuum, so the walk never probes a
-- group twice (the lowest key is remembered for the wrap) and the unkeyed group at most once;
-- and the claim starts each group's scan at its head, stepping over them no more.
-- PL/pgSQL keeps the probes' plans for the session; a plain SQL function would be planned
-- again at every call.
CREATE FUNCTION jobs_fair_walk(p_queue text, p_after text, p_want int, p_max int)
RETURNS TABLE (grp text, due boolean, pos int, head timestamptz)
-- A few groups, for the planner: its default guess (1,000 rows) multiplies the claim's estimated
-- cost past the point where PostgreSQL compiles a plan with LLVM (jit_above_cost), which costs
-- 400 ms on a claim that runs in 2.
LANGUAGE plpgsql STABLE ROWS 4 AS $$
DECLARE
    at text := coalesce(p_after, '');  -- '' stands for the unkeyed group: the ring's end
    k text;
    k_head timestamptz;
    lowest text;                       -- the lowest key, once a probe from the start found it
    lowest_head timestamptz;
    unkeyed_head timestamptz;
    unkeyed_probed boolean := false;
    seen text[] := '{}';
    ndue int := 0;
BEGIN
    pos := 0;
    WHILE pos < p_max AND ndue < p_want LOOP
        -- Back where the walk started: the next group is the first one visited.
        EXIT WHEN pos > 0 AND at = coalesce(p_after, '');
        IF at = '' AND lowest IS NOT NULL THEN
            k := lowest;
            k_head := lowest_head;
        ELSE
            SELECT j.fairness_key, j.run_at INTO k, k_head FROM jobs j
            WHERE j.queue = p_queue AND j.state IN ('available', 'retryable')
              AND j.fairness_key IS NOT NULL AND j.fairness_key > at
            ORDER BY j.fairness_key, j.run_at
            LIMIT 1;
            IF NOT FOUND THEN
                k := NULL;
            ELSIF at = '' THEN
                lowest := k;
                lowest_head := k_head;
            END IF;
        END IF;
        IF k IS NULL THEN
            -- Past the last key: the unkeyed group, if it has jobs waiting.
            IF NOT unkeyed_probed THEN
                SELECT j.run_at INTO unkeyed_head FROM jobs j
                WHERE j.queue = p_queue AND j.state IN ('available', 'retryable')
                  AND j.fairness_key IS NULL
                ORDER BY j.run_at
                LIMIT 1;
                unkeyed_probed := true;
            END IF;
            IF at = '' OR unkeyed_head IS NULL THEN
                -- At the ring's end already, or no unkeyed job: round again, unless there is
                -- nothing at all to go round to.
                EXIT WHEN at = '' AND (unkeyed_head IS NULL OR '' = ANY (seen));
                IF at <> '' THEN
                    at := '';
                    CONTINUE;
                END IF;
            END IF;
            k := '';
            k_head := unkeyed_head;
        END IF;
        EXIT WHEN k = ANY (seen);
        seen := seen || k;
        pos := pos + 1;
        grp := k;
        head := k_head;
        due := k_head <= now();
        IF due THEN
            ndue := ndue + 1;
        END IF;
        RETURN NEXT;
        at := k;
    END LOOP;
END
$$;
