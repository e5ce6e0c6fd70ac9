-- no-transaction
-- The claim of jobs without a key (one group, oldest first). Every waiting job is in exactly one
-- of the two claim indexes, so neither claim reads past the other's jobs: a flood of one
-- seller's keyed jobs costs the claim of unkeyed jobs nothing.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_claimable_unkeyed ON jobs (queue, run_at, id)
    WHERE state IN ('available', 'retryable') AND fairness_key IS NULL;
