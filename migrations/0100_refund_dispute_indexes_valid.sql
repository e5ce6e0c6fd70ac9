-- 0096 and 0097 build their indexes CONCURRENTLY: a build interrupted (the release stopped, two
-- migrations at once) leaves an invalid index, which `IF NOT EXISTS` would then skip on the
-- next run while recording the migration as done. This stops the migration, saying what to do.
DO $$
BEGIN
    IF (SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE c.relname IN ('payment_refunds_payment', 'payment_disputes_payment') AND i.indisvalid) <> 2 THEN
        RAISE EXCEPTION 'payment_refunds_payment or payment_disputes_payment is missing or invalid (an interrupted CONCURRENTLY build): DROP INDEX CONCURRENTLY it, remove its row from _sqlx_migrations (0096 or 0097), and run the migrations again';
    END IF;
END
$$;
