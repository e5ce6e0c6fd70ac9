-- The ledger's barriers of 0037, checked once per statement instead of once per row.
-- A batch of a hundred sales writes four hundred entries in one statement: per row, each ran a
-- trigger function at once and another at commit, each re-checking its whole transfer (three
-- checks per transfer), which cost more than writing the entries. The rules are the same:
--
-- 1. Each transfer is exactly two entries summing to zero, on its own two accounts, in its
--    currency. Every transfer that a statement of entries touches is checked whole when that
--    statement ends (the code writes both entries of a transfer in one statement: an entry
--    written alone, or a third one later, is refused at once). At commit, every new transfer
--    must have entries: with the check above, that makes it whole.
-- 2. Each entry starts where its account's previous one ended (0 for its first).
DROP TRIGGER ledger_entries_balanced ON ledger_entries;
DROP TRIGGER ledger_entries_follow ON ledger_entries;
DROP FUNCTION ledger_transfer_balanced_on_entry();
DROP FUNCTION ledger_entry_follows();

CREATE FUNCTION ledger_entries_hold() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    -- 2. Each entry starts where the account's previous one ended: the statement's own previous
    --    entry of the account, or, for the account's first here, the last one written before.
    SELECT n.account_id, n.balance_before, n.previous INTO bad
      FROM (SELECT w.account_id, w.balance_before,
                   COALESCE(CASE WHEN w.rn = 1 THEN (SELECT e.balance_after FROM ledger_entries e
                                                      WHERE e.account_id = w.account_id AND e.id < w.id
                                                      ORDER BY e.id DESC LIMIT 1)
                                 ELSE w.prev END, 0) AS previous
              FROM (SELECT id, account_id, balance_before,
                           lag(balance_after) OVER a AS prev, row_number() OVER a AS rn
                      FROM new_entries WINDOW a AS (PARTITION BY account_id ORDER BY id)) w) n
     WHERE n.previous <> n.balance_before
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'an entry of account % starts at %, where its last one ended at %',
            bad.account_id, bad.balance_before, bad.previous
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_entries_follow';
    END IF;
    -- 1. The entries a statement writes for a transfer are all of it: another entry of it,
    --    written before or after, would be on one of its two accounts (refused by
    --    ledger_entries_once_per_account) or make a statement of its own with one entry of it
    --    (refused here).
    SELECT x.transfer_id, x.source_key, x.why INTO bad FROM (
        SELECT g.transfer_id, t.source_key,
               CASE
                 WHEN g.entries <> 2 THEN format('%s entries, not 2', g.entries)
                 WHEN g.total <> 0 THEN format('entries summing to %s, not 0', g.total)
                 WHEN g.currencies <> ARRAY[t.currency::text] THEN 'an entry on an account of another currency'
                 WHEN g.debit <> -t.amount OR g.credit <> t.amount
                   OR NOT (t.from_account = ANY(g.debited) AND t.to_account = ANY(g.credited))
                   THEN 'entries that are not its accounts'' debit and credit'
               END AS why
          FROM (SELECT e.transfer_id, count(*) AS entries, sum(e.amount) AS total,
                       array_agg(DISTINCT (SELECT a.currency::text FROM ledger_accounts a WHERE a.id = e.account_id)) AS currencies,
                       array_agg(e.account_id) FILTER (WHERE e.amount < 0) AS debited,
                       array_agg(e.account_id) FILTER (WHERE e.amount > 0) AS credited,
                       min(e.amount) AS debit, max(e.amount) AS credit
                  FROM new_entries e GROUP BY e.transfer_id) g
          -- Each transfer by its key (LIMIT: never a scan of every transfer).
          CROSS JOIN LATERAL (SELECT * FROM ledger_transfers t WHERE t.id = g.transfer_id LIMIT 1) t) x
     WHERE x.why IS NOT NULL
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'transfer % (%) has %', bad.transfer_id, bad.source_key, bad.why
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transfer_balanced';
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER ledger_entries_hold AFTER INSERT ON ledger_entries
    REFERENCING NEW TABLE AS new_entries
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_entries_hold();

-- At commit, a transfer without entries is refused; one with entries was checked whole when
-- they were written.
CREATE OR REPLACE FUNCTION ledger_transfer_balanced_on_transfer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM ledger_entries WHERE transfer_id = NEW.id) THEN
        RAISE EXCEPTION 'transfer % (%) has no entries', NEW.id, NEW.source_key
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transfer_balanced';
    END IF;
    RETURN NULL;
END;
$$;

DROP FUNCTION ledger_transfer_balanced(bigint);

-- 3. An account's kind, owner and currency are fixed and its balance is always its last
--    entry's: checked once per statement of updates (a batch of sales moves a hundred and
--    fifty accounts' balances in one), not by a query per account. Deletes stay refused row
--    by row.
DROP TRIGGER ledger_accounts_guard ON ledger_accounts;

CREATE FUNCTION ledger_accounts_hold() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    IF EXISTS (SELECT 1 FROM new_accounts n JOIN old_accounts o ON o.id = n.id
                WHERE n.kind <> o.kind OR n.owner <> o.owner OR n.currency <> o.currency) THEN
        RAISE EXCEPTION 'a ledger account''s kind, owner and currency are fixed'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_accounts_fixed';
    END IF;
    SELECT n.id, n.balance, l.balance_after AS last INTO bad
      FROM new_accounts n JOIN old_accounts o ON o.id = n.id
      LEFT JOIN LATERAL (SELECT e.balance_after FROM ledger_entries e
                          WHERE e.account_id = n.id ORDER BY e.id DESC LIMIT 1) l ON true
     WHERE n.balance <> o.balance AND (l.balance_after IS NULL OR l.balance_after <> n.balance)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'account % would hold %, not its last entry''s balance %',
            bad.id, bad.balance, bad.last
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_accounts_balance_is_entries';
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER ledger_accounts_hold AFTER UPDATE ON ledger_accounts
    REFERENCING OLD TABLE AS old_accounts NEW TABLE AS new_accounts
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_accounts_hold();

CREATE FUNCTION ledger_accounts_never_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger accounts are never deleted' USING ERRCODE = 'raise_exception';
END;
$$;

CREATE TRIGGER ledger_accounts_never_deleted BEFORE DELETE ON ledger_accounts
    FOR EACH ROW EXECUTE FUNCTION ledger_accounts_never_deleted();

DROP FUNCTION ledger_account_guard();
