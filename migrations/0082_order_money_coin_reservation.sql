-- The order side's view for the other contexts (0046) gains the order's coin reservation: the
-- `coin_reservation_unsettled` check reads which step a held reservation needs from it.
CREATE OR REPLACE VIEW order_money AS
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
       (o.status NOT IN ('expired', 'cancelled') AND o.paid_at IS NOT NULL) AS is_sale,
       -- The buyer's coin reservation it asked for, if any (paid with it when paid_with_coins).
       o.coin_reservation
FROM orders o;
