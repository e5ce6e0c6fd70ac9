-- Every refund request reaches a final state: a refund the gateway took and later failed or
-- canceled ends `failed` or `canceled`, with the gateway's refund id kept and its amount free
-- to refund again (only requested and accepted ones hold theirs).
ALTER TABLE refund_requests DROP CONSTRAINT refund_requests_state_check;
ALTER TABLE refund_requests ADD CONSTRAINT refund_requests_state_check
    CHECK (state IN ('requested', 'accepted', 'succeeded', 'failed', 'canceled'));
ALTER TABLE refund_requests DROP CONSTRAINT refund_requests_answered;
ALTER TABLE refund_requests ADD CONSTRAINT refund_requests_answered
    CHECK (CASE state WHEN 'requested' THEN refund_id IS NULL
                      WHEN 'failed' THEN true
                      ELSE refund_id IS NOT NULL END);
ALTER TABLE refund_requests DROP CONSTRAINT refund_requests_failure_reason;
ALTER TABLE refund_requests ADD CONSTRAINT refund_requests_failure_reason
    CHECK ((state IN ('failed', 'canceled')) = (failure IS NOT NULL));
