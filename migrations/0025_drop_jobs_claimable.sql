-- no-transaction
-- Replaced by jobs_claimable_unkeyed and jobs_claimable_keyed; kept, it would cost every waiting
-- job a third index entry.
DROP INDEX CONCURRENTLY IF EXISTS jobs_claimable;
