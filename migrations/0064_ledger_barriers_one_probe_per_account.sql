-- The ledger's entry barrier (0044, 0054, 0056) asks what it asked before, in one statement and
-- with one look at each account's index instead of three. It runs at the end of a posting's
-- statement, while the posting holds its sellers' accounts, so every other batch of those
-- sellers waits for it. It was four statements: the accounts' existence (a probe each), the
-- entries' chain (the account's entry before this statement's first: a probe each), whether the
-- statement's entries are the account's newest (a count from the first: a probe each), and the
-- transfers' balance (each entry's account's currency: a probe per entry, not per account, as
-- PostgreSQL placed that sub-select above the join).
--
-- Now each account is read once (its existence and currency) and its index looked at once:
-- the entry just below this statement's `here` newest (OFFSET here). That entry must be below
-- the statement's first (else some other entry of the account is at or after the first: the
-- count's rule) and must end where the first starts (the chain's rule; no such entry: 0). Within
-- the statement, each entry starts where the one before it ended, as before. The rules, their
-- constraints and messages, and their order when several are broken, are the same.
--
-- `jit = off`: PostgreSQL cannot estimate an OFFSET taken from a column, and prices the look as
-- a tenth of the account's entries; past jit_above_cost PostgreSQL compiled the statement at every
-- call (a posting of 31 sales took 45 ms instead of 6). A barrier of a few milliseconds never
-- gains from compiling.
--
-- The transfers' barrier is one statement too (it was two), and looks up each account its
-- transfers name once, not once per transfer and side.
CREATE OR REPLACE FUNCTION ledger_entries_hold() RETURNS trigger LANGUAGE plpgsql
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    bad record;
BEGIN
    WITH acc AS MATERIALIZED (
        SELECT n.account_id, min(n.id) AS first, count(*) AS here
          FROM new_entries n GROUP BY n.account_id
    ), known AS MATERIALIZED (
        -- Each account once: whether it exists, its currency, and the entry just below this
        -- statement's own (the account's newest `here` entries are this statement's, if the
        -- rules hold).
        SELECT acc.account_id, acc.first, a.id IS NOT NULL AS found, a.currency::text AS currency,
               below.id AS below_id, COALESCE(below.balance_after, 0) AS below_after
          FROM acc
          LEFT JOIN ledger_accounts a ON a.id = acc.account_id
          LEFT JOIN LATERAL (SELECT e.id, e.balance_after FROM ledger_entries e
                              WHERE e.account_id = acc.account_id
                              ORDER BY e.id DESC OFFSET acc.here LIMIT 1) below ON true
    ), chain AS (
        SELECT e.account_id, e.balance_before, lag(e.balance_after) OVER w AS before_here,
               row_number() OVER w = 1 AS opens
          FROM new_entries e WINDOW w AS (PARTITION BY e.account_id ORDER BY e.id)
    ), transfers AS (
        SELECT e.transfer_id, count(*) AS entries, sum(e.amount) AS total,
               array_agg(DISTINCT k.currency) AS currencies,
               array_agg(e.account_id) FILTER (WHERE e.amount < 0) AS debited,
               array_agg(e.account_id) FILTER (WHERE e.amount > 0) AS credited,
               min(e.amount) AS debit, max(e.amount) AS credit
          FROM new_entries e JOIN known k ON k.account_id = e.account_id
         GROUP BY e.transfer_id
    )
    SELECT v.* INTO bad FROM (
        -- 1: every entry on an account that exists.
        SELECT 1 AS rule, k.account_id, NULL::numeric AS balance_before, NULL::numeric AS previous,
               NULL::bigint AS transfer_id, NULL::text AS source_key, NULL::text AS why
          FROM known k WHERE NOT k.found
        UNION ALL
        -- 2: each entry after its predecessor by id, whichever statement wrote that one; and
        -- nothing else of the account at or after this statement's first (then the last here is
        -- the account's last).
        SELECT 2, c.account_id,
               CASE WHEN k.below_id >= k.first THEN NULL ELSE c.balance_before END,
               CASE WHEN k.below_id >= k.first THEN NULL ELSE COALESCE(c.before_here, k.below_after) END,
               NULL, NULL, NULL
          FROM chain c JOIN known k ON k.account_id = c.account_id
         WHERE (c.opens AND (k.below_id >= k.first OR k.below_after <> c.balance_before))
            OR (NOT c.opens AND c.before_here <> c.balance_before)
        UNION ALL
        -- 3: the entries a statement writes for a transfer are all of it: another entry of it,
        -- written before or after, would be on one of its two accounts (refused by
        -- ledger_entries_once_per_account) or make a statement of its own with one entry of it
        -- (refused here).
        SELECT 3, NULL, NULL, NULL, x.transfer_id, x.source_key, x.why FROM (
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
              FROM transfers g
              -- Each transfer by its key (LIMIT: never a scan of every transfer).
              LEFT JOIN LATERAL (SELECT * FROM ledger_transfers t WHERE t.id = g.transfer_id LIMIT 1) t ON true) x
         WHERE x.why IS NOT NULL
    ) v ORDER BY v.rule LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF bad.rule = 1 THEN
        RAISE EXCEPTION 'an entry is on account %, which does not exist', bad.account_id
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'ledger_entries_account_exists';
    ELSIF bad.rule = 2 THEN
        RAISE EXCEPTION 'an entry of account % starts at %, not where its last one ended (%), or is not its last',
            bad.account_id, bad.balance_before, bad.previous
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_entries_follow';
    ELSE
        RAISE EXCEPTION 'transfer % (%) has %', bad.transfer_id, bad.source_key, bad.why
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transfer_balanced';
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION ledger_transfers_have_entries() RETURNS trigger LANGUAGE plpgsql
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    bad record;
BEGIN
    WITH missing AS MATERIALIZED (
        -- Each account the statement's transfers name, looked up once.
        SELECT x.id FROM (SELECT DISTINCT u.id FROM new_transfers n,
                                 LATERAL (VALUES (n.from_account), (n.to_account)) AS u(id)) x
         WHERE NOT EXISTS (SELECT 1 FROM ledger_accounts a WHERE a.id = x.id)
    )
    SELECT v.* INTO bad FROM (
        -- 1: both accounts exist.
        SELECT 1 AS rule, n.id, n.source_key, n.from_account, n.to_account
          FROM new_transfers n
         WHERE EXISTS (SELECT 1 FROM missing)
           AND (n.from_account IN (SELECT id FROM missing) OR n.to_account IN (SELECT id FROM missing))
        UNION ALL
        -- 2: a transfer is written with its entries, in one statement.
        SELECT 2, n.id, n.source_key, n.from_account, n.to_account
          FROM new_transfers n
         WHERE NOT EXISTS (SELECT 1 FROM ledger_entries e WHERE e.transfer_id = n.id)
    ) v ORDER BY v.rule LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF bad.rule = 1 THEN
        RAISE EXCEPTION 'transfer % (%) is between accounts % and %, and one of them does not exist',
            bad.id, bad.source_key, bad.from_account, bad.to_account
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'ledger_transfers_accounts_exist';
    ELSE
        RAISE EXCEPTION 'transfer % (%) has no entries: a transfer is written with its entries, in one statement',
            bad.id, bad.source_key
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_transfer_balanced';
    END IF;
END;
$$;
