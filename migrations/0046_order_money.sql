-- The orders context's published read of its orders' money, for the contexts that must read
-- orders in SQL (the ledger's postings, reconciliation, the consistency checks). What makes an
-- order a sale, or still worth a payment, is the orders context's rule: it is written here
-- once, and the readers use the view, never the orders table. A plain view: the planner inlines
-- it, so a read through it costs what the same read of the table does.
CREATE VIEW order_money AS
SELECT o.number,
       o.seller_id,
       o.gateway,
       o.paid_with_coins,
       o.status,
       o.total,
       o.platform_fee,
       o.seller_net,
       o.currency,
       o.paid_at,
       -- It can still be paid (docs/state_machine.md: awaiting or failed, not expired).
       o.status IN ('awaiting_payment', 'payment_failed') AS payable,
       -- When it expired, if it did (and was not paid or cancelled since).
       CASE WHEN o.status = 'expired' THEN o.expired_at END AS expired_at,
       -- A sale: paid, and kept (an expired or cancelled order's late payment is given back).
       (o.status NOT IN ('expired', 'cancelled') AND o.paid_at IS NOT NULL) AS is_sale
FROM orders o;
