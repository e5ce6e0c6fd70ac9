-- A posting holds its accounts for its entries and balances only, not for its transfers too.
-- ledger_post_ids (0057) locked every account of the posting first, then wrote the transfers
-- and their entries in one statement: the transfers' rows and their five indexes were written
-- while the sellers' accounts were held, and every other batch of the same sellers waited for
-- them. Now one statement writes the transfers, then locks the accounts those transfers move
-- (in id order, as before: two postings cannot deadlock on them), then writes the entries from
-- the balances as locked, and the balances are moved as before.
--
-- Why the balances are right: under READ COMMITTED a statement's snapshot is taken before any
-- lock it waits for, so the entries' starting balances are not read from that snapshot; they
-- are the balances `FOR UPDATE` returns, which are the rows' newest versions once the locks
-- are held (PostgreSQL re-reads a row it waited for). The barriers read with snapshots of their
-- own, after the statement: an entry that did not start where its account's last one ended is
-- refused (ledger_entries_follow) as before.
--
-- Why it cannot deadlock where it could not before: the accounts are locked only after the
-- statement has written every transfer (the sort under the lock reads all of them first), and
-- a transfer's source key is held by its writer only; two postings of one key wait on it before
-- either locks an account of this statement.
CREATE OR REPLACE FUNCTION ledger_post_ids(
    keys text[], kinds text[], from_ids bigint[], to_ids bigint[], amounts numeric[], currencies text[],
    available timestamptz[], orders bigint[], refs text[], floored_ids bigint[], places bigint[])
RETURNS TABLE (posted_id bigint, posted_key text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
    new_ids bigint[];
    new_keys text[];
    moved_ids bigint[];
    moved_to numeric[];
    below bigint;
BEGIN
    -- The transfers, then their accounts locked, then the entries in the order the transfers
    -- were written (the debit, then the credit), each account's starting where its previous
    -- one ended.
    WITH t AS (
        INSERT INTO ledger_transfers AS lt (source_key, kind, from_account, to_account, amount, currency,
                                            available_at, order_number, reference, created_at)
        SELECT x.k, x.kd, x.f, x.t, x.am, x.c, x.av, x.o, x.r, stamp
          FROM unnest(keys, kinds, from_ids, to_ids, amounts, currencies, available, orders, refs)
               WITH ORDINALITY AS x(k, kd, f, t, am, c, av, o, r, i)
         ORDER BY x.i
        ON CONFLICT ON CONSTRAINT ledger_transfers_source_key_key DO NOTHING
        RETURNING lt.id, lt.source_key, lt.from_account, lt.to_account, lt.amount),
    held AS MATERIALIZED (
        SELECT a.id, a.balance FROM ledger_accounts a
         WHERE a.id IN (SELECT t.from_account FROM t UNION SELECT t.to_account FROM t)
         ORDER BY a.id FOR UPDATE),
    legs AS (
        SELECT t.id AS transfer_id, t.from_account AS account_id, -t.amount AS amount, 0 AS leg FROM t
        UNION ALL
        SELECT t.id, t.to_account, t.amount, 1 FROM t),
    running AS (
        SELECT l.transfer_id, l.account_id, l.amount, l.leg,
               h.balance
                 + COALESCE(sum(l.amount) OVER (PARTITION BY l.account_id ORDER BY l.transfer_id, l.leg
                                                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
          FROM legs l JOIN held h ON h.id = l.account_id),
    written AS (
        INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
        SELECT r.transfer_id, r.account_id, r.amount, r.before, r.before + r.amount
          FROM running r ORDER BY r.transfer_id, r.leg
        RETURNING ledger_entries.id, ledger_entries.account_id, ledger_entries.balance_after)
    SELECT (SELECT array_agg(t.id ORDER BY t.id) FROM t),
           (SELECT array_agg(t.source_key ORDER BY t.id) FROM t),
           (SELECT array_agg(w.account_id) FROM (SELECT DISTINCT ON (e.account_id) e.account_id
                                                   FROM written e ORDER BY e.account_id, e.id DESC) w),
           (SELECT array_agg(w.balance_after) FROM (SELECT DISTINCT ON (e.account_id) e.account_id, e.balance_after
                                                      FROM written e ORDER BY e.account_id, e.id DESC) w),
           (SELECT b.account_id FROM written b
             WHERE b.account_id = ANY(floored_ids) AND b.balance_after < 0 ORDER BY b.id LIMIT 1)
      INTO new_ids, new_keys, moved_ids, moved_to, below;
    IF new_ids IS NULL THEN
        RETURN;
    END IF;
    IF below IS NOT NULL THEN
        RAISE EXCEPTION 'the balance of account % would go below zero', below
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_accounts_wallet_not_negative',
                  DETAIL = COALESCE(array_position(places, below), below)::text;
    END IF;

    UPDATE ledger_accounts a SET balance = m.balance, updated_at = now()
      FROM unnest(moved_ids, moved_to) AS m(id, balance)
     WHERE a.id = ANY(moved_ids) AND a.id = m.id;
    RETURN QUERY SELECT * FROM unnest(new_ids, new_keys);
END;
$$;
