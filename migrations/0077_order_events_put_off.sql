-- no-transaction
-- The messages the broker refused, by when each goes again: the relay takes the due ones
-- through it, and it holds no other row (empty while the broker takes every message).
CREATE INDEX CONCURRENTLY IF NOT EXISTS order_events_put_off
    ON order_events (publish_after) WHERE published_at IS NULL AND publish_after IS NOT NULL;
