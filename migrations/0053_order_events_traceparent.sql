-- The trace an order message continues (a W3C traceparent), when the fleet exports traces: the
-- outbox relay sends it as the message's `traceparent` header. A writer names it, or the
-- transaction's `payfleet.traceparent` setting gives it; NULL when traces are off.
-- Two steps, so that no existing row is rewritten: the column, then the default for new rows.
ALTER TABLE order_events ADD COLUMN traceparent text;
ALTER TABLE order_events ALTER COLUMN traceparent
    SET DEFAULT NULLIF(current_setting('payfleet.traceparent', true), '');
