-- What of a payment's disputes ended as a refund only refunds recorded before them cover: the
-- part the ledger counts as covered (every recorded refund covers a dispute ended as a refund,
-- one refund one dispute: ledger::sales::settle_take_backs) that the buyer may still have through
-- the dispute, its own refund not recorded yet. Per payment, as the ledger counts it:
--   taken     = LEAST(paid, R + open or lost disputes + GREATEST(E - R, 0))
--   if strict = LEAST(paid, R + open or lost disputes + GREATEST(E - GREATEST(R - B, 0), 0))
-- where R is the payment's recorded refunds, E its disputes ended as a refund, and B the least
-- of what those disputes found refunded when first recorded (migration 0086; unknown: 0). The
-- payouts hold it back for 30 days after the last such dispute ended (ledger::payouts), and
-- the consistency check `dispute_refund_unrecorded` reports it after a week.
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
                 COALESCE(min(COALESCE(y.refunded_before, 0)) FILTER (WHERE y.status = 'refunded'), 0) AS before
            FROM payment_disputes y WHERE y.payment_order_id = payment) d
$$;
