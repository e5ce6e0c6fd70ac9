-- A run's end reaches its jobs by their primary key whatever the table's size when it was
-- planned. It is planned once per connection (20261205000000); planned while `jobs` was small (a
-- fleet's first runs on a new database), a scan of every job looked cheaper than a probe per
-- job, and that plan was kept while the table grew. With sequential scans off in the function,
-- the plan is the index's whatever the sizes the planner saw. Idempotent, as every migration of
-- the queue's.
ALTER FUNCTION jobs_end_runs(bigint[], bigint[], text[], bigint[], text[], boolean)
    SET enable_seqscan = off;
