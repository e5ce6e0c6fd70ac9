-- The order's expiry the first asking sent, kept with it: a retry under the same idempotency
-- key must send the same parameters, and an order reopened since (its expiry moved on) would
-- otherwise send another, which Stripe refuses under that key for a day (`idempotency_error`):
-- the order could then never get its link. Rows of the previous release keep none (a retry of
-- theirs sends the order's expiry, as before).
ALTER TABLE payment_link_asks ADD COLUMN expires_at timestamptz;
