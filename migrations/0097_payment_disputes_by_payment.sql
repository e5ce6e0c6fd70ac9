-- no-transaction
-- A payment's disputes, read where its refunds are (0096): every dispute ever made scanned
-- otherwise.
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_disputes_payment ON payment_disputes (payment_order_id);
