-- The jobs table turns over fast: every job is inserted, updated twice and deleted a day later,
-- and each claim steps over the claim-index entries of jobs claimed since the last vacuum.
-- Autovacuum's defaults wait for a fifth of the table to be dead (two million rows of a ten
-- million row table); these wait for a fixed number instead, and vacuum without pausing. The
-- fleet also vacuums the table itself past `vacuum_dead_rows` (jobs/queues.toml), for servers
-- whose autovacuum is off or busy elsewhere.
ALTER TABLE jobs SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 50000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 100000,
    autovacuum_vacuum_cost_delay = 0
);
