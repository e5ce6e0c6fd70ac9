-- no-transaction
-- A payment's refunds, read by every refund's barrier (payment_refunds_within), every payment
-- event's ledger sync (payments::apply), the disputes' hold (payment_dispute_refund_unrecorded)
-- and the `taken_back_beyond_payment` check: without it each read scanned every refund ever
-- made. Built CONCURRENTLY: the refunds keep being recorded meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_refunds_payment ON payment_refunds (payment_order_id);
