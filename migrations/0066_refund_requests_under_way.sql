-- The refunds under way (asked of the gateway, not answered, or accepted and not yet recorded):
-- a payout run holds back what they may take from each seller, reading them through this index
-- rather than every request ever made.
CREATE INDEX refund_requests_under_way ON refund_requests (order_number)
    WHERE state IN ('requested', 'accepted');
