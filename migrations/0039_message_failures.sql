-- Order messages a consumer could not handle: counted per consumer and message. After a few
-- failed attempts a message is dead: kept here with its body and last error (an operator lists
-- and replays it, `payfleet messages`), and no longer delivered again and again.
CREATE TABLE message_failures (
    consumer        text        NOT NULL,
    message_id      text        NOT NULL,
    routing_key     text        NOT NULL,
    body            jsonb       NOT NULL,
    attempts        integer     NOT NULL CHECK (attempts > 0),
    last_error      text        NOT NULL,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now(),
    dead_at         timestamptz,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX message_failures_dead ON message_failures (dead_at) WHERE dead_at IS NOT NULL;
