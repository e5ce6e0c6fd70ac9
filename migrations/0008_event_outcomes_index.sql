-- no-transaction
-- Waiting events by what they wait for. Built CONCURRENTLY (outside a transaction), so webhooks
-- keep landing while the table is scanned.
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_events_waiting
    ON payment_events (gateway, waiting_for) WHERE outcome = 'waiting';
