-- When the gateway was first asked for an operator's refund. A gateway keeps an idempotency key
-- for a limited time (Stripe: at least 24 hours, then it may forget it), so a request whose
-- answer never came is asked again only within that window: past it, the same key could make a
-- second refund (payments::order_refunds::ASK_AGAIN_WITHIN). NULL: not asked yet.
ALTER TABLE refund_requests ADD COLUMN first_asked_at timestamptz;
