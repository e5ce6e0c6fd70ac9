-- Sales whose postings are due. A payment's effect (the order confirmed, its message in the
-- outbox) records its sale here in its own transaction, without the seller's accounts; the
-- seller's poster posts the sales due in batches right after (ledger::poster), so that the
-- payments of one seller's flash sale do not wait on the seller's accounts one transaction at
-- a time. A row is deleted in the transaction that posts its sale.
CREATE TABLE ledger_sales_due (
    order_number bigint      PRIMARY KEY REFERENCES orders (number),
    seller_id    uuid        NOT NULL REFERENCES sellers (id),
    -- The gateway the order was paid through, or 'coins'.
    channel      text        NOT NULL CHECK (channel <> ''),
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- Why its posting was refused (it is then left for an operator, and skipped until the
    -- order's event is replayed).
    failure      text
);

CREATE INDEX ledger_sales_due_seller ON ledger_sales_due (seller_id, order_number);

ALTER TABLE ledger_sales_due SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000);
