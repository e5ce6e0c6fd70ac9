-- The queue's schema as payfleet's migrations 0001 to 0031 left it, in one step. On a database
-- those migrations built (payfleet migrate checks that its history reaches 0031) the table
-- exists: then only the functions are replaced, by the same text, which locks no table, and
-- the table, its indexes and trigger, and the database's jit setting are left as they are (a
-- CREATE INDEX IF NOT EXISTS would still lock the table against writes until this commits, and
-- an operator may have turned jit back on). The state machine a job's row follows is
-- docs/state_machine.md; the rules of a run's end are `jobs_end_runs` and `jobs_next_state`
-- below, so the worker, the rescue and a shutdown's release cannot disagree.

-- The functions first: the table's trigger calls one. (The PL/pgSQL ones read the table only
-- when they run.)
CREATE OR REPLACE FUNCTION jobs_notify()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM pg_notify('payfleet_jobs', NEW.queue);
    RETURN NULL;
END;
$function$

;

CREATE OR REPLACE FUNCTION jobs_backoff(attempt integer)
 RETURNS interval
 LANGUAGE sql
AS $function$
    SELECT make_interval(secs => least(power(2, least(attempt, 20))::float8, 3600) * (0.75 + random() * 0.5))
$function$

;

CREATE OR REPLACE FUNCTION jobs_unknown_run_end(pending text, outcome text)
 RETURNS text
 LANGUAGE plpgsql
 IMMUTABLE
AS $function$
BEGIN
    RAISE EXCEPTION 'unknown run end (pending %, outcome %)', pending, outcome
        USING ERRCODE = 'invalid_parameter_value';
END;
$function$

;

CREATE OR REPLACE FUNCTION jobs_next_state(pending text, outcome text, attempt integer, max_attempts integer)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT CASE
        WHEN outcome IS NULL OR outcome NOT IN ('complete', 'retry', 'fail', 'snooze', 'cancel', 'release')
             OR (pending IS NOT NULL AND pending NOT IN ('cancel', 'reschedule'))
            THEN jobs_unknown_run_end(pending, outcome)
        WHEN pending = 'cancel' THEN 'cancelled'
        WHEN pending = 'reschedule' THEN 'available'
        WHEN outcome = 'complete' THEN 'completed'
        WHEN outcome = 'cancel' THEN 'cancelled'
        WHEN outcome IN ('snooze', 'release') THEN 'available'
        WHEN outcome = 'retry' AND attempt < max_attempts THEN 'retryable'
        ELSE 'discarded'
    END
$function$

;

CREATE OR REPLACE FUNCTION jobs_end_runs(p_ids bigint[], p_tokens bigint[], p_outcomes text[], p_delays_ms bigint[], p_errors text[], p_skip_locked boolean DEFAULT true)
 RETURNS TABLE(job_id bigint, new_state text)
 LANGUAGE plpgsql
AS $function$
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
$function$

;

CREATE OR REPLACE FUNCTION jobs_fair_walk(p_queue text, p_after text, p_want integer, p_max integer, p_unkeyed_after timestamp with time zone DEFAULT NULL::timestamp with time zone, p_unkeyed_after_id bigint DEFAULT NULL::bigint, p_keys text[] DEFAULT '{}'::text[], p_key_run_ats timestamp with time zone[] DEFAULT '{}'::timestamp with time zone[], p_key_ids bigint[] DEFAULT '{}'::bigint[])
 RETURNS TABLE(grp text, due boolean, pos integer, head timestamp with time zone, head_id bigint)
 LANGUAGE plpgsql
 STABLE ROWS 4
AS $function$
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
$function$

;

DO $schema$
BEGIN
    IF to_regclass('jobs') IS NOT NULL THEN
        RETURN;
    END IF;

    -- States (docs/state_machine.md):
    --   available  waiting for its run_at; claimable once run_at <= now()
    --   running    claimed by a worker that holds a lease until lease_expires_at
    --   retryable  failed an attempt; claimable again at run_at (the stored backoff)
    --   discarded, cancelled: finished; kept until pruned. A run that completes deletes its job:
    --   what it did is recorded by the job's own writes; the queue keeps what an operator acts on.
    CREATE TABLE jobs (
        id bigserial PRIMARY KEY,
        queue text NOT NULL CHECK (queue <> ''),
        kind text NOT NULL CHECK (kind <> ''),
        -- At most one unfinished job per key (jobs_key_unfinished): enqueueing under a held key
        -- writes nothing, rescheduling replaces.
        key text CHECK (key <> ''),
        payload jsonb NOT NULL DEFAULT '{}'::jsonb,
        state text NOT NULL DEFAULT 'available',
        attempt integer NOT NULL DEFAULT 0,
        max_attempts integer NOT NULL DEFAULT 25,
        run_at timestamptz NOT NULL DEFAULT now(),
        created_at timestamptz NOT NULL DEFAULT now(),
        attempted_at timestamptz,
        finished_at timestamptz,
        -- The lease: a fencing token that changes on every claim, so a worker that lost its lease
        -- (and maybe its job to another worker) can never finish someone else's run.
        lease_token bigint,
        lease_expires_at timestamptz,
        locked_by text,
        -- What an operator asked of a running job, applied when its run ends.
        pending text,
        -- One entry per failed attempt: {"attempt", "at", "worker", "error"}.
        errors jsonb NOT NULL DEFAULT '[]'::jsonb,
        -- Claims take turns between keys within a queue (jobs_fair_walk).
        fairness_key text,
        CONSTRAINT jobs_attempted_before_retry CHECK (state <> 'retryable' OR attempt > 0),
        CONSTRAINT jobs_attempts_valid CHECK (max_attempts > 0 AND attempt >= 0 AND attempt <= max_attempts),
        CONSTRAINT jobs_fairness_key_valid CHECK (fairness_key <> '' AND length(fairness_key) <= 200),
        CONSTRAINT jobs_finished_iff_final
            CHECK ((state IN ('completed', 'discarded', 'cancelled')) = (finished_at IS NOT NULL)),
        CONSTRAINT jobs_lease_iff_running
            CHECK ((state = 'running') = (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL AND locked_by IS NOT NULL)),
        CONSTRAINT jobs_pending_only_while_running
            CHECK (pending IS NULL OR (state = 'running' AND pending IN ('reschedule', 'cancel'))),
        CONSTRAINT jobs_state_valid
            CHECK (state IN ('available', 'running', 'retryable', 'completed', 'discarded', 'cancelled')),
        -- A completed job's row is deleted by its run's end (a delete writes no new row version
        -- and no index entry, where an update to 'completed' wrote both).
        CONSTRAINT jobs_completed_are_deleted CHECK (state <> 'completed')
    )
    -- The table turns over its whole content all day: vacuum by counts, not by a fraction of a
    -- size that swings between empty and a backlog, and without the cost delay.
    WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50000,
          autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 100000,
          autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 100000,
          autovacuum_vacuum_cost_delay = 0);

    -- A run's fencing token: every claim takes the next one.
    CREATE SEQUENCE jobs_lease_token_seq;

    -- The claim: per queue, unkeyed jobs in due order, and keyed ones per key in due order (the
    -- claim steps from one key to the next with one probe each).
    CREATE INDEX jobs_claimable_unkeyed ON jobs (queue, run_at, id)
        WHERE state IN ('available', 'retryable') AND fairness_key IS NULL;
    CREATE INDEX jobs_claimable_keyed ON jobs (queue, fairness_key, run_at, id)
        WHERE state IN ('available', 'retryable') AND fairness_key IS NOT NULL;
    CREATE INDEX jobs_finished ON jobs (state, finished_at) WHERE finished_at IS NOT NULL;
    CREATE UNIQUE INDEX jobs_key_unfinished ON jobs (key)
        WHERE key IS NOT NULL AND state IN ('available', 'running', 'retryable');
    CREATE INDEX jobs_running_lease ON jobs (lease_expires_at) WHERE state = 'running';

    -- A job that becomes claimable wakes the LISTENing workers of its queue (the insert notifies
    -- in its own statement).
    CREATE TRIGGER jobs_notify_update AFTER UPDATE OF state, run_at ON jobs
        FOR EACH ROW WHEN (NEW.state IN ('available', 'retryable')
                           AND (OLD.state IS DISTINCT FROM NEW.state OR OLD.run_at IS DISTINCT FROM NEW.run_at))
        EXECUTE FUNCTION jobs_notify();

    -- The queue's statements are short (a claim: milliseconds), and PostgreSQL compiles a plan with
    -- LLVM when its estimated cost passes jit_above_cost, which a large table's statistics pass
    -- easily: the compilation then costs hundreds of milliseconds on a statement that runs in two.
    -- Off for this database's new sessions; a role without the right gets a notice.
    BEGIN
        EXECUTE format('ALTER DATABASE %I SET jit = off', current_database());
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE NOTICE 'jit stays on for database %: %', current_database(), SQLERRM;
    END;
END
$schema$;
