-- Where sequential scans are off (20261206000000), compiling is off too: a scan that no index can
-- serve is then priced far past jit_above_cost, and a statement so planned would be compiled by
-- LLVM at every call, tens of milliseconds for a statement of a few. The run's end reaches its
-- jobs by key, so none is planned so today. Idempotent, as every migration of the queue's.
ALTER FUNCTION jobs_end_runs(bigint[], bigint[], text[], bigint[], text[], boolean)
    SET jit = off;
