-- no-transaction
-- The claim of keyed jobs: per queue, the keys in order (the claim steps from one key to the
-- next with one probe each), and within a key its oldest due jobs. Built concurrently: writes
-- go on while it builds. One statement per file: a concurrent build cannot share a transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_claimable_keyed ON jobs (queue, fairness_key, run_at, id)
    WHERE state IN ('available', 'retryable') AND fairness_key IS NOT NULL;
