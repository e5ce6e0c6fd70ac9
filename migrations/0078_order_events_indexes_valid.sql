-- The relay's indexes (0076, 0077) are built CONCURRENTLY: a build interrupted (the release
-- stopped, two migrations at once) leaves an invalid index, which `IF NOT EXISTS` would then skip
-- on the next run. The index they replace is dropped (0081) only once both are valid; until
-- then this stops the migration, saying what to do.
DO $$
BEGIN
    IF (SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE c.relname IN ('order_events_to_publish', 'order_events_put_off') AND i.indisvalid) <> 2 THEN
        RAISE EXCEPTION 'order_events_to_publish or order_events_put_off is missing or invalid (an interrupted CONCURRENTLY build): DROP INDEX CONCURRENTLY it, remove its row from _sqlx_migrations (0076 or 0077), and run the migrations again';
    END IF;
END
$$;
