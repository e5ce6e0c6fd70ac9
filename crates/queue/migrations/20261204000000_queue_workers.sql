-- The fleet's census: a row per running worker process and the queues it works, written when it
-- starts and renewed every second (`census.rs`), deleted when it stops. A worker killed without
-- stopping leaves its row behind; a row not renewed for ten seconds is not counted, and the next
-- renewal of any worker deletes it. Workers size what they share by it (payfleet's payment-event
-- batches in flight), and an operator reads it (`payfleet jobs workers`). Idempotent, as every
-- migration of the queue's (see 20261202000001_queue_pauses.sql).
CREATE TABLE IF NOT EXISTS queue_workers (
    id         text        PRIMARY KEY CHECK (id <> '' AND length(id) <= 200),
    queues     text[]      NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    seen_at    timestamptz NOT NULL DEFAULT now()
);
