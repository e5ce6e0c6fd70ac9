-- Paused queues: an operator's pause, honoured by every worker process within a second (each
-- reads this table twice a second and claims nothing from a paused queue; runs already started
-- end as usual). Resuming deletes the row.
CREATE TABLE queue_pauses (
    queue     text        PRIMARY KEY CHECK (queue <> ''),
    paused_at timestamptz NOT NULL DEFAULT now()
);
