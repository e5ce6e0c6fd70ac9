-- Paused queues: an operator's pause, honoured by every worker process within a second (each
-- reads this table twice a second and claims nothing from a paused queue; runs already started
-- end as usual). Resuming deletes the row. Idempotent, as every migration of the queue's: a
-- database made by the combined migrator (`payfleet::db::MIGRATOR`, the tests') records it in
-- the application's table, and the queue's own migrator runs it again.
CREATE TABLE IF NOT EXISTS queue_pauses (
    queue     text        PRIMARY KEY CHECK (queue <> ''),
    paused_at timestamptz NOT NULL DEFAULT now()
);
