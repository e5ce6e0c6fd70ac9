-- no-transaction
-- Replaced by `order_events_to_publish` and `order_events_put_off` (0076, 0077; 0078 found them valid), which hold the
-- same rows between them.
DROP INDEX CONCURRENTLY IF EXISTS order_events_unpublished;
