-- What the payment's recorded refunds had given back when a dispute of it was first recorded. A
-- dispute that ends as a refund is covered in the ledger by the payment's recorded refunds,
-- whenever they came: our order of recording is not the gateway's, and a refund wrongly taken
-- for an earlier one would leave its dispute taken from the seller for ever. But a partial
-- refund made before the dispute opened gave the buyer other money, and if the dispute's own
-- refund is still to be recorded, the seller was given back, to be paid out, money the buyer
-- has. So the part of such a dispute that only refunds recorded before it cover is held back
-- from the seller's payouts for 30 days after it ended, or until refunds recorded after it
-- cover it (ledger::payouts). NULL: recorded before this column, held back nothing.
-- Every payment event's transaction reads this table and the previous release's workers go on
-- running meanwhile: the column and its check (nothing to validate in a new column) wait at most
-- 2 s for the table, and the migration is retried rather than queue the fleet behind it.
SET LOCAL lock_timeout = '2s';
ALTER TABLE payment_disputes ADD COLUMN refunded_before numeric(20, 4);
ALTER TABLE payment_disputes ADD CONSTRAINT payment_disputes_refunded_before_valid
    CHECK (refunded_before >= 0) NOT VALID;

-- The disputes a payout run holds back for: ended as a refund in the last 30 days, with
-- refunds recorded before them.
CREATE INDEX payment_disputes_refunded ON payment_disputes (updated_at)
    WHERE status = 'refunded' AND refunded_before > 0;
