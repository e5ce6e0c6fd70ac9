-- The job queue. States (see docs/state_machine.md):
--   available  waiting for its run_at; claimable once run_at <= now()
--   running    claimed by a worker that holds a lease until lease_expires_at
--   retryable  failed an attempt; claimable again at run_at (the stored backoff)
--   completed, discarded, cancelled: finished; kept until pruned
CREATE TABLE jobs (
    id               bigserial PRIMARY KEY,
    queue            text        NOT NULL CHECK (queue <> ''),
    kind             text        NOT NULL CHECK (kind <> ''),
    -- Caller-chosen key, unique among unfinished jobs (index below).
    key              text        CHECK (key <> ''),
    payload          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    state            text        NOT NULL DEFAULT 'available',
    attempt          integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL DEFAULT 25,
    run_at           timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    attempted_at     timestamptz,
    finished_at      timestamptz,
    -- The lease: a fencing token that changes on every claim, so a worker that lost its
    -- lease (and maybe its job to another worker) can never finish someone else's run.
    lease_token      bigint,
    lease_expires_at timestamptz,
    locked_by        text,
    -- What a reschedule or cancel asked of a job while it was running; applied when the run ends.
    pending          text,
    -- One entry per failed attempt: {"attempt", "at", "error"}.
    errors           jsonb       NOT NULL DEFAULT '[]'::jsonb,

    CONSTRAINT jobs_state_valid
        CHECK (state IN ('available', 'running', 'retryable', 'completed', 'discarded', 'cancelled')),
    CONSTRAINT jobs_attempts_valid
        CHECK (max_attempts > 0 AND attempt >= 0 AND attempt <= max_attempts),
    CONSTRAINT jobs_lease_iff_running
        CHECK ((state = 'running') = (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL AND locked_by IS NOT NULL)),
    CONSTRAINT jobs_finished_iff_final
        CHECK ((state IN ('completed', 'discarded', 'cancelled')) = (finished_at IS NOT NULL)),
    CONSTRAINT jobs_pending_only_while_running
        CHECK (pending IS NULL OR (state = 'running' AND pending IN ('reschedule', 'cancel'))),
    CONSTRAINT jobs_attempted_before_retry
        CHECK (state <> 'retryable' OR attempt > 0)
);

CREATE SEQUENCE jobs_lease_token_seq;

-- The key is unique among jobs that are not finished: scheduling with a key replaces the
-- earlier job instead of adding a second one.
CREATE UNIQUE INDEX jobs_key_unfinished ON jobs (key)
    WHERE key IS NOT NULL AND state IN ('available', 'running', 'retryable');

-- Claiming: the oldest due jobs of one queue.
CREATE INDEX jobs_claimable ON jobs (queue, run_at, id) WHERE state IN ('available', 'retryable');

-- Rescue: running jobs whose lease ran out.
CREATE INDEX jobs_running_lease ON jobs (lease_expires_at) WHERE state = 'running';

-- Pruning and the operator's list of dead jobs.
CREATE INDEX jobs_finished ON jobs (state, finished_at) WHERE finished_at IS NOT NULL;

-- Wake sleeping workers of a queue when a waiting job gets a new state or run time (retries,
-- snoozes, reschedules, operator retries). New jobs are announced by the enqueue statements
-- themselves (src/queue/mod.rs), or after commit by queue::Notifier on hot paths: a NOTIFY
-- holds a global lock through commit, which would serialise every webhook's commit.
CREATE FUNCTION jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('payfleet_jobs', NEW.queue);
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_notify_update AFTER UPDATE OF state, run_at ON jobs
    FOR EACH ROW WHEN (NEW.state IN ('available', 'retryable')
                       AND (OLD.state IS DISTINCT FROM NEW.state OR OLD.run_at IS DISTINCT FROM NEW.run_at))
    EXECUTE FUNCTION jobs_notify();
