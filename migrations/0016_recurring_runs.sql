-- One row per recurring job and period: the period's run. The primary key is what makes each
-- period run once however many worker processes look at the schedule: the first to insert the
-- row enqueues the run, the others find it.
CREATE TABLE recurring_runs (
    name        text        NOT NULL CHECK (name <> ''),
    -- The scheduled time this run stands for.
    period      timestamptz NOT NULL,
    -- scheduled: its job is enqueued; running; completed; failed (its job died, the error
    -- kept); skipped: the previous run was still going when this period came.
    state       text        NOT NULL DEFAULT 'scheduled'
                            CHECK (state IN ('scheduled', 'running', 'completed', 'failed', 'skipped')),
    job_id      bigint,
    error       text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    started_at  timestamptz,
    finished_at timestamptz,
    PRIMARY KEY (name, period),
    CONSTRAINT recurring_runs_finished CHECK ((state IN ('completed', 'failed', 'skipped')) = (finished_at IS NOT NULL)),
    CONSTRAINT recurring_runs_failure_reason CHECK (state NOT IN ('failed', 'skipped') OR error IS NOT NULL)
);

-- The latest runs of a job, for the admin API.
CREATE INDEX recurring_runs_latest ON recurring_runs (name, period DESC);
