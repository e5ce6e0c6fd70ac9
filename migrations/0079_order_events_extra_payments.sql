-- no-transaction
-- The order messages that record a payment its order could not take and gives back (rare): the
-- `payment_not_given_back` consistency check reads them every run without reading the table.
CREATE INDEX CONCURRENTLY IF NOT EXISTS order_events_extra_payments
    ON order_events (id) WHERE kind = 'extra_payment';
