-- 0079, 0080 and 0083 build their indexes CONCURRENTLY, with no check after them as 0078 and
-- 0100 are for theirs: a build cut off (the release stopped, or two migrators at once, which
-- deadlocked before the migrators' lock was taken without waiting in a statement) left an
-- invalid index that `IF NOT EXISTS` skipped while the migration was recorded as done. Every
-- write still maintains such an index and no read uses it. This stops the migration, saying
-- what to do.
DO $$
DECLARE
    bad text;
BEGIN
    SELECT string_agg(n.name, ', ') INTO bad
    FROM unnest(ARRAY['order_events_extra_payments', 'coin_reservations_held', 'payouts_pending']) AS n(name)
    WHERE NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                      WHERE c.relname = n.name AND i.indisvalid);
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION '% missing or invalid (an interrupted CONCURRENTLY build): DROP INDEX CONCURRENTLY it, remove its migration''s row from _sqlx_migrations (0079, 0080 or 0083), and run the migrations again', bad;
    END IF;
END
$$;
