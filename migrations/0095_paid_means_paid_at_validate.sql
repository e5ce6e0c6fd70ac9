-- Checks the rows already there against 0094's constraints. VALIDATE CONSTRAINT takes a lock
-- that lets reads and writes go on (SHARE UPDATE EXCLUSIVE) while it scans.
ALTER TABLE orders VALIDATE CONSTRAINT orders_paid_at_only_when_paid;
ALTER TABLE payment_orders VALIDATE CONSTRAINT payment_orders_amount_with_currency;
ALTER TABLE payment_orders VALIDATE CONSTRAINT payment_orders_refunded_within_amount;
ALTER TABLE ledger_transfers VALIDATE CONSTRAINT ledger_transfers_sale_credit_complete;
