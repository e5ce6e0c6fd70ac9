-- A job made claimable by an update (a reschedule replacing a waiting job, a retry's backoff, an
-- operator's retry) wakes the workers only if it is due within a minute, as an insert does
-- (store.rs): every worker looks again within its poll interval (kept under a minute), and a
-- transaction that notifies takes PostgreSQL's database-wide notification lock at commit, which
-- a reopened order moving its expiry half an hour ahead should not queue behind. Replacing the
-- trigger's function takes no lock on the table. Idempotent, as every migration of the queue's.
CREATE OR REPLACE FUNCTION jobs_notify()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF NEW.run_at <= now() + interval '1 minute' THEN
        PERFORM pg_notify('payfleet_jobs', NEW.queue);
    END IF;
    RETURN NULL;
END;
$function$;
