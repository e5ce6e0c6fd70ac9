-- The outbox: order events are published to RabbitMQ by a relay after the transaction that
-- wrote them commits. Events written before the relay existed count as published (their
-- consumers never expected them): the default marks them without rewriting the table (no long
-- exclusive lock), and is then dropped so new events start unpublished.
ALTER TABLE order_events ADD COLUMN published_at timestamptz DEFAULT '-infinity';
ALTER TABLE order_events ALTER COLUMN published_at DROP DEFAULT;
CREATE INDEX order_events_unpublished ON order_events (id) WHERE published_at IS NULL;

-- Messages no service's queue binds, kept by the legacy queue's consumer.
CREATE TABLE unrouted_messages (
    message_id  text        PRIMARY KEY,
    routing_key text        NOT NULL,
    order_kind  text        NOT NULL,
    body        jsonb       NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);

-- The messages each consumer has handled, so a message delivered twice is handled once.
CREATE TABLE consumed_messages (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    consumed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
-- The `prune` recurring job deletes records older than a month through this index.
CREATE INDEX consumed_messages_age ON consumed_messages (consumed_at);
