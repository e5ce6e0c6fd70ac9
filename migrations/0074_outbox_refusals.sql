-- A message the broker refuses (a nack: a queue it is routed to is full or has lost its
-- majority; or returned as routed nowhere) is tried again on a clock of its own, backing off, so
-- it holds up no other message; an operator sees how often it was refused and the broker's
-- last answer (`payfleet messages unpublished`, the `order_message_refused` check) and sends it
-- at once (`payfleet messages send`). Constant defaults and NULLs: no rewrite of the table.
ALTER TABLE order_events
    ADD COLUMN publish_attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN publish_error text,
    ADD COLUMN publish_after timestamptz;
