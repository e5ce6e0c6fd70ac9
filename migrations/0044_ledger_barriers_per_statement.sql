-- The ledger's barriers of 0037, checked once per statement instead of once per row. A batch of
-- a hundred sales writes two hundred transfers and four hundred entries in one statement and
-- moves a hundred and fifty balances in another: per row, each entry ran a trigger function at
-- once and another at commit, and each transfer one more at commit, each re-checking its whole
-- transfer, which cost more than writing the rows. The rules:
--
-- 1. A transfer is exactly two entries summing to zero, on its own two accounts, in its
--    currency, written with it in the same statement (the code writes both in one statement:
--    ledger_post, 0045). Every transfer a statement writes must have entries when it ends, and
--    every transfer a statement writes entries for is checked whole then: an entry written
--    later, alone or as a third, is refused at once.
-- 2. Each entry starts where its account's previous one (by id) ended, 0 for its first, and is
--    its account's newest: nothing is written before an account's last entry.
-- 3. An account's id, kind, owner and currency are fixed, its balance is always its last
--    entry's, and it is never deleted.

-- 1 and 2: entries.
DROP TRIGGER ledger_entries_balanced ON ledger_entries;
DROP TRIGGER ledger_entries_follow ON ledger_entries;
DROP FUNCTION ledger_transfer_balanced_on_entry();
DROP FUNCTION ledger_entry_follows();

CREATE FUNCTION ledger_entries_hold() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    -- Each entry after its predecessor by id, whichever statement wrote that one; and every
    -- account's newest entry is one of this statement's.
    SELECT n.account_id, n.balance_before, COALESCE(p.balance_after, 0) AS previous INTO bad
      FROM new_entries n
      LEFT JOIN LATERAL (SELECT e.balance_after FROM ledger_entries e
                          WHERE e.account_id = n.account_id AND e.id < n.id
                          ORDER BY e.id DESC LIMIT 1) p ON true
     WHERE COALESCE(p.balance_after, 0) <> n.balance_before
     LIMIT 1;
    IF NOT FOUND THEN
        SELECT a.account_id, NULL::numeric AS balance_before, NULL::numeric AS previous INTO bad
          FROM (SELECT account_id, max(id) AS newest FROM new_entries GROUP BY account_id) a
         WHERE (SELECT e.id FROM ledger_entries e WHERE e.account_id = a.account_id
                ORDER BY e.id DESC LIMIT 1) <> a.newest
         LIMIT 1;
    END IF;
    IF FOUND THEN
        RAISE EXCEPTION 'an entry of account % starts at %, not where its last one ended (%), or is not its last',
            bad.account_id, bad.balance_before, bad.previous
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_entries_follow';
    END IF;
    -- The entries a statement writes for a transfer are all of it: another entry of it, written
    -- before or after, would be on one of its two accounts (refused by
    -- ledger_entries_once_per_account) or make a statement of its own with one entry of it
    -- (refused here).
    SELECT x.transfer_id, x.source_key, x.why INTO bad FROM (
        SELECT g.transfer_id, t.source_key,
               CASE
                 WHEN t.id IS NULL THEN 'no such transfer'
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
          LEFT JOIN LATERAL (SELECT * FROM ledger_transfers t WHERE t.id = g.transfer_id LIMIT 1) t ON true) x
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

-- 1: transfers, written with their entries.
DROP TRIGGER ledger_transfers_balanced ON ledger_transfers;
DROP FUNCTION ledger_transfer_balanced_on_transfer();
DROP FUNCTION ledger_transfer_balanced(bigint);

CREATE FUNCTION ledger_transfers_have_entries() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    SELECT n.id, n.source_key INTO bad FROM new_transfers n
     WHERE NOT EXISTS (SELECT 1 FROM ledger_entries e WHERE e.transfer_id = n.id)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'transfer % (%) has no entries: a transfer is written with its entries, in one statement',
            bad.id, bad.source_key
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transfer_balanced';
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER ledger_transfers_have_entries AFTER INSERT ON ledger_transfers
    REFERENCING NEW TABLE AS new_transfers
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_transfers_have_entries();

-- 3: accounts. Id, kind, owner and currency are checked row by row, but only when one of them
-- changes (the condition is evaluated without calling anything); the balance once per
-- statement, over every account it moved. Deletes are refused row by row.
DROP TRIGGER ledger_accounts_guard ON ledger_accounts;
DROP FUNCTION ledger_account_guard();

CREATE FUNCTION ledger_accounts_fixed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'ledger accounts are never deleted'
            USING ERRCODE = 'raise_exception';
    END IF;
    RAISE EXCEPTION 'a ledger account''s id, kind, owner and currency are fixed'
        USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_accounts_fixed';
END;
$$;

CREATE TRIGGER ledger_accounts_fixed BEFORE UPDATE ON ledger_accounts
    FOR EACH ROW
    WHEN (NEW.id <> OLD.id OR NEW.kind <> OLD.kind OR NEW.owner <> OLD.owner OR NEW.currency <> OLD.currency)
    EXECUTE FUNCTION ledger_accounts_fixed();

CREATE TRIGGER ledger_accounts_never_deleted BEFORE DELETE ON ledger_accounts
    FOR EACH ROW EXECUTE FUNCTION ledger_accounts_fixed();

-- With ids fixed, the statement's old and new rows pair by id.
CREATE FUNCTION ledger_accounts_hold() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
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
