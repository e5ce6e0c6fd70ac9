-- The payment simulator's refunds name the payment they give back: a session's own payment (the
-- one its page decided), or another payment of the session that the gateway's signed events
-- reported (a second payment, a late one), which the platform gives back through the same
-- simulator. Rows from before named only the session's own payment.
ALTER TABLE internal_refunds ADD COLUMN payment_id text;
