-- The ledger's foreign keys, checked once per statement instead of once per row. A sale is two
-- transfers and four entries; their four foreign keys ran twelve referential checks per sale
-- (each a query of its own, and a row lock), inside the window in which the posting holds the
-- sellers' accounts: posting a hundred sales took 44 to 48 ms with them, 19 to 23 ms without
-- (README, "Where the time goes now"). What they refused is refused still, by the barriers of
-- 0044 that already run once per statement:
-- - an entry's transfer must exist ('no such transfer', ledger_transfer_balanced), and an
--   entry's account must exist (below: ledger_entries_account_exists);
-- - a transfer's two accounts must exist: its entries are on exactly those accounts
--   (ledger_transfer_balanced), and it must have entries when its statement ends; below, the
--   transfers' own check says so at once (ledger_transfers_accounts_exist);
-- - what the keys kept from being deleted stays: accounts are never deleted, transfers and
--   entries are immutable (row triggers of 0013 and 0044), and none of the three tables can be
--   truncated (below), which the keys also refused.
-- The payouts' keys to their transfers stay (a payout is rare, and they guard its own rows).

ALTER TABLE ledger_entries DROP CONSTRAINT ledger_entries_transfer_id_fkey,
                           DROP CONSTRAINT ledger_entries_account_id_fkey;
ALTER TABLE ledger_transfers DROP CONSTRAINT ledger_transfers_from_account_fkey,
                             DROP CONSTRAINT ledger_transfers_to_account_fkey;

CREATE OR REPLACE FUNCTION ledger_entries_hold() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    -- Every entry on an account that exists (the foreign key's check, once per statement).
    SELECT n.account_id INTO bad FROM new_entries n
     WHERE NOT EXISTS (SELECT 1 FROM ledger_accounts a WHERE a.id = n.account_id)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'an entry is on account %, which does not exist', bad.account_id
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'ledger_entries_account_exists';
    END IF;
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


CREATE OR REPLACE FUNCTION ledger_transfers_have_entries() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    SELECT n.id, n.source_key, n.from_account, n.to_account INTO bad FROM new_transfers n
     WHERE NOT EXISTS (SELECT 1 FROM ledger_accounts a WHERE a.id = n.from_account)
        OR NOT EXISTS (SELECT 1 FROM ledger_accounts a WHERE a.id = n.to_account)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'transfer % (%) is between accounts % and %, and one of them does not exist',
            bad.id, bad.source_key, bad.from_account, bad.to_account
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'ledger_transfers_accounts_exist';
    END IF;
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

-- What the foreign keys also refused: emptying a table others point into.
CREATE FUNCTION ledger_never_truncated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is never truncated: the ledger only grows', TG_TABLE_NAME
        USING ERRCODE = 'raise_exception';
END;
$$;

CREATE TRIGGER ledger_accounts_never_truncated BEFORE TRUNCATE ON ledger_accounts
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_never_truncated();
CREATE TRIGGER ledger_transfers_never_truncated BEFORE TRUNCATE ON ledger_transfers
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_never_truncated();
CREATE TRIGGER ledger_entries_never_truncated BEFORE TRUNCATE ON ledger_entries
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_never_truncated();
