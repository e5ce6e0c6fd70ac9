-- Whether a refund request waits on purpose: not asked of the gateway yet (`requested`) while a
-- dispute of its payment is open, the gateway is not asked (`payments::order_refunds::carry_out`
-- holds it until the dispute ends). Neither the payouts' hold on refunds under way (the open
-- dispute has taken the seller's share already) nor the check `refund_under_way_too_long` counts
-- such a request; both ask this one function.
CREATE FUNCTION refund_request_held(state text, gateway text, session_id text)
    RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT state = 'requested'
       AND EXISTS (SELECT 1 FROM payment_disputes d
                   JOIN payment_orders po ON po.id = d.payment_order_id
                   WHERE po.gateway = refund_request_held.gateway
                     AND po.session_id = refund_request_held.session_id
                     AND d.status = 'open')
$$;
