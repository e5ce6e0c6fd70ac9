-- no-transaction
-- The relay's new messages: unpublished and not put off (migration 0074), in id order. The
-- messages the broker refused leave it while they are put off, so a read of the new ones never
-- walks past them however many pile up (a service's queue refusing for an hour). It replaces
-- `order_events_unpublished` (dropped in 0081, once 0078 has found both new indexes valid): one index per new message, as before. Built
-- CONCURRENTLY, so messages keep being written while the table is scanned.
CREATE INDEX CONCURRENTLY IF NOT EXISTS order_events_to_publish
    ON order_events (id) WHERE published_at IS NULL AND publish_after IS NULL;
