-- What the payment's recorded refunds had given back when a dispute of it was first recorded. A
-- dispute that ends as a refund is covered only by refunds recorded after it: a partial refund
-- made before the dispute opened gave the buyer other money, and counting it as the dispute's
-- refund gave the seller back, to be paid out, the part of the disputed amount the buyer had
-- through the dispute (ledger::sales::settle_take_backs). NULL: recorded before this column,
-- read as nothing given back before (the rule until now).
ALTER TABLE payment_disputes ADD COLUMN refunded_before numeric(20, 4)
    CONSTRAINT payment_disputes_refunded_before_valid CHECK (refunded_before >= 0);
