-- A payment of the wrong amount is given back once: when its refund was asked for is kept, so
-- the session's later events (its refund's own, a resend) do not ask again.
ALTER TABLE unmatched_payments ADD COLUMN given_back_at timestamptz;
