-- What of a payment's disputes ended as a refund only refunds recorded before them cover: the
-- part the ledger counts as covered (every recorded refund covers a dispute ended as a refund,
-- one refund one dispute: ledger::sales::settle_take_backs) that the buyer may still have through
-- a dispute, its own refund not recorded yet. Per payment, as the ledger counts it:
--   taken     = LEAST(paid, R + open or lost disputes + GREATEST(E - R, 0))
--   if strict = LEAST(paid, R + open or lost disputes + GREATEST(E - GREATEST(R - B, 0), 0))
-- where R is the payment's recorded refunds, E its disputes ended as a refund, and B the most
-- any of those disputes found refunded when first recorded (migration 0086; unknown: 0): only
-- refunds recorded after the latest of them count as their own. That over-counts what is at
-- stake when several disputes came between refunds, and never under-counts it; never beyond
-- what the sale can still give back. The payouts hold it back while a dispute of the payment
-- ended as a refund in the last 30 days (ledger::payouts), and the consistency check
-- `dispute_refund_unrecorded` reports it from a week after the last such dispute ended to 30
-- days after.
CREATE FUNCTION payment_dispute_refund_unrecorded(payment bigint) RETURNS numeric
LANGUAGE sql STABLE
AS $$
    SELECT GREATEST(
               LEAST(p.paid, r.refunded + d.held + GREATEST(d.ended - GREATEST(r.refunded - d.before, 0), 0))
             - LEAST(p.paid, r.refunded + d.held + GREATEST(d.ended - r.refunded, 0)),
             0)
    FROM (SELECT po.amount AS paid FROM payment_orders po WHERE po.id = payment) p,
         (SELECT COALESCE(sum(x.amount), 0) AS refunded FROM payment_refunds x
           WHERE x.payment_order_id = payment) r,
         (SELECT COALESCE(sum(y.amount) FILTER (WHERE y.status IN ('open', 'lost')), 0) AS held,
                 COALESCE(sum(y.amount) FILTER (WHERE y.status = 'refunded'), 0) AS ended,
                 COALESCE(max(y.refunded_before) FILTER (WHERE y.status = 'refunded'), 0) AS before
            FROM payment_disputes y WHERE y.payment_order_id = payment) d
$$;
