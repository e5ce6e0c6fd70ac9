-- Posting in one round trip (ledger::post_many): the transfers' accounts locked in id order,
-- then one statement writes the new transfers (a source key posted before posts nothing) with
-- their entries and each account's running balance, then the balances move. Everything from the
-- lock to the commit holds the accounts; with four statements, each a round trip to the client,
-- a flash sale's postings spent most of that time waiting for the client to send the next one.
--
-- The arrays describe one transfer per index. `floored`: the accounts that may never go below
-- zero (after any entry, not only the last): a posting that would take one below is refused
-- with ledger_accounts_wallet_not_negative, its account's id as the detail. Returns the
-- transfers written, with their keys.
CREATE FUNCTION ledger_post(
    keys text[], kinds text[], froms bigint[], tos bigint[], amounts numeric[], currencies text[],
    available timestamptz[], orders bigint[], refs text[], floored bigint[])
RETURNS TABLE (posted_id bigint, posted_key text)
LANGUAGE plpgsql AS $$
DECLARE
    stamp timestamptz;
    new_ids bigint[];
    new_keys text[];
    moved_ids bigint[];
    moved_to numeric[];
    below bigint;
BEGIN
    PERFORM 1 FROM ledger_accounts a WHERE a.id = ANY(froms || tos) ORDER BY a.id FOR UPDATE;
    -- Stamped when written, after the wait for the accounts.
    stamp := clock_timestamp();

    -- The transfers and their entries in one statement (a transfer is written with its
    -- entries, 0044), entries in the order the transfers were written (the
    -- debit, then the credit), each account's starting where its previous one ended.
    WITH t AS (
        INSERT INTO ledger_transfers AS lt (source_key, kind, from_account, to_account, amount, currency,
                                            available_at, order_number, reference, created_at)
        SELECT x.k, x.kd, x.f, x.t, x.am, x.c, x.av, x.o, x.r, stamp
          FROM unnest(keys, kinds, froms, tos, amounts, currencies, available, orders, refs)
               WITH ORDINALITY AS x(k, kd, f, t, am, c, av, o, r, i)
         ORDER BY x.i
        ON CONFLICT ON CONSTRAINT ledger_transfers_source_key_key DO NOTHING
        RETURNING lt.id, lt.source_key, lt.from_account, lt.to_account, lt.amount),
    legs AS (
        SELECT t.id AS transfer_id, t.from_account AS account_id, -t.amount AS amount, 0 AS leg FROM t
        UNION ALL
        SELECT t.id, t.to_account, t.amount, 1 FROM t),
    running AS (
        SELECT l.transfer_id, l.account_id, l.amount, l.leg,
               (SELECT a.balance FROM ledger_accounts a WHERE a.id = l.account_id)
                 + COALESCE(sum(l.amount) OVER (PARTITION BY l.account_id ORDER BY l.transfer_id, l.leg
                                                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
          FROM legs l),
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
             WHERE b.account_id = ANY(floored) AND b.balance_after < 0 ORDER BY b.id LIMIT 1)
      INTO new_ids, new_keys, moved_ids, moved_to, below;
    IF new_ids IS NULL THEN
        RETURN;
    END IF;
    IF below IS NOT NULL THEN
        RAISE EXCEPTION 'the balance of account % would go below zero', below
            USING ERRCODE = 'check_violation', CONSTRAINT = 'ledger_accounts_wallet_not_negative',
                  DETAIL = below::text;
    END IF;

    UPDATE ledger_accounts a SET balance = m.balance, updated_at = now()
      FROM unnest(moved_ids, moved_to) AS m(id, balance)
     WHERE a.id = ANY(moved_ids) AND a.id = m.id;
    RETURN QUERY SELECT * FROM unnest(new_ids, new_keys);
END;
$$;
