-- An operator's refund request ended `failed` because the gateway never answered it within its
-- idempotency window (payments::order_refunds::ASK_AGAIN_WITHIN): the gateway may have made the
-- refund or not. For 30 days after it ended, until a refund of the same payment and amount that
-- no other request made is recorded since its first ask, it is
-- - reported (consistency check `refund_unconfirmed`), and
-- - held back from the seller's payouts as a refund under way is (ledger::payouts): were the
--   refund made, its late event would take the seller's share from money already paid out.
-- The failure's opening words are payments::order_refunds::UNANSWERED, which writes them; the
-- test of the check reads a request that code ended, so the two cannot part unseen.
CREATE FUNCTION refund_request_unconfirmed(q refund_requests) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT q.state = 'failed' AND starts_with(q.failure, 'the gateway never answered this refund')
       AND q.updated_at > now() - interval '30 days'
       AND NOT EXISTS (SELECT 1 FROM payment_refunds r
                       JOIN payment_orders po ON po.id = r.payment_order_id
                       WHERE po.gateway = q.gateway AND po.session_id = q.session_id
                         AND r.amount = q.amount AND r.created_at >= q.first_asked_at
                         AND NOT EXISTS (SELECT 1 FROM refund_requests o
                                         WHERE o.gateway = r.gateway AND o.refund_id = r.refund_id))
$$;

-- The failed requests by when they ended: a payout run reads the last 30 days' of its seller's
-- orders, not every request that ever failed.
CREATE INDEX refund_requests_failed ON refund_requests (order_number, updated_at) WHERE state = 'failed';
