-- no-transaction
-- The payouts still waiting for the bank: the `payout_undecided` consistency check reads them
-- every run without reading every payout ever made. A payout's state changes once, so the
-- update it costs is not a hot path's.
CREATE INDEX CONCURRENTLY IF NOT EXISTS payouts_pending
    ON payouts (created_at) WHERE state = 'pending';
