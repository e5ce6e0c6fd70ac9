-- A transaction left open by a client that vanished (a worker cut off by a network partition,
-- its TCP connection half-open) keeps its locks until PostgreSQL notices the client is gone,
-- after its TCP keepalive: two hours by default. The sellers' accounts, the advisory turns and
-- the order rows it holds stall those sellers' payments, balances and refunds meanwhile. Every
-- new session of this database ends a transaction left idle for five minutes; no transaction
-- of the fleet's waits that long between two statements (the longest, the relay's, waits for
-- the broker's confirms, and is sent again if it is ended). Best effort: a role that may not
-- alter its database keeps the server's setting, and the migration warns (a NOTICE would be
-- filtered out of the log).
DO $$
BEGIN
    EXECUTE format('ALTER DATABASE %I SET idle_in_transaction_session_timeout = %L',
                   current_database(), '5min');
EXCEPTION WHEN insufficient_privilege THEN
    RAISE WARNING 'idle_in_transaction_session_timeout is not set for this database (%): ask its owner to set it', SQLERRM;
END
$$;
