-- When the gateway was first asked for an operator's refund. A gateway keeps an idempotency key
-- for a limited time (Stripe: at least 24 hours, then it may forget it), so a request whose
-- answer never came is asked again only within that window: past it, the same key could make a
-- second refund (payments::order_refunds::ASK_AGAIN_WITHIN). NULL: not asked yet.
ALTER TABLE refund_requests ADD COLUMN first_asked_at timestamptz;

-- A request still waiting for its answer was asked when it was made: the HTTP route asks the
-- gateway at once (its job a few seconds later where the receiver lacks the gateway). Those
-- are the requests an operator is told to ask for again, so they count from then, not from
-- their next ask.
UPDATE refund_requests SET first_asked_at = created_at WHERE state = 'requested';
