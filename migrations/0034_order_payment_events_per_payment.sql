-- A payment no order can take is given back once per payment, however many arrive for one
-- order: a late payment of each session (session A fails, B is paid after the expiry, then A
-- succeeds after all: two late payments, two refunds) and each extra payment (another session's,
-- or a second payment on the same session). The index that kept one `late_payment` per order
-- now leaves those two kinds to one of their own: one per (order, session, payment).
CREATE UNIQUE INDEX order_events_once_per_payment
    ON order_events (order_id, kind, (COALESCE(payload ->> 'session_id', '')), (COALESCE(payload ->> 'payment_id', '')))
    WHERE kind IN ('late_payment', 'extra_payment');
DROP INDEX order_events_once;
CREATE UNIQUE INDEX order_events_once ON order_events (order_id, kind)
    WHERE kind NOT IN ('reopened', 'extra_payment', 'late_payment');
