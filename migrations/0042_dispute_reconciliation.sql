-- A dispute open for long is asked about: its decision's event may have been lost. When it was
-- last asked, so each run asks the least recently checked first and none more than daily.
ALTER TABLE payment_disputes ADD COLUMN checked_at timestamptz;

-- What a gateway said of such a dispute, when it had decided it: a finding like a payment no
-- webhook reported.
ALTER TABLE reconciliation_findings DROP CONSTRAINT reconciliation_findings_outcome_check;
ALTER TABLE reconciliation_findings ADD CONSTRAINT reconciliation_findings_outcome_check
    CHECK (outcome IN ('succeeded', 'failed', 'unreachable', 'refused', 'dispute_decided'));
