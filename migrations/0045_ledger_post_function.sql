-- Posting in one round trip (ledger::post_many): the transfers' accounts locked in id order,
-- the new transfers written (a source key posted before posts nothing), their entries with
-- each account's running balance, the balances moved. Everything from the lock to the commit
-- holds the accounts; with four statements, each a round trip to the client, a flash sale's
-- postings spent most of that time waiting for the client to send the next one.
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
    new_ids bigint[];
    new_keys text[];
    new_froms bigint[];
    new_tos bigint[];
    new_amounts numeric[];
    moved_ids bigint[];
    moved_to numeric[];
    below bigint;
BEGIN
    PERFORM 1 FROM ledger_accounts a WHERE a.id = ANY(froms || tos) ORDER BY a.id FOR UPDATE;

    -- Stamped when written: a posting may have waited for its accounts. The transfers written
    -- here get their entries in this call: their commit-time check (below) is not queued.
    PERFORM set_config('payfleet.posting', 'ledger_post', true);
    WITH t AS (
        INSERT INTO ledger_transfers AS lt (source_key, kind, from_account, to_account, amount, currency,
                                            available_at, order_number, reference, created_at)
        SELECT x.k, x.kd, x.f, x.t, x.am, x.c, x.av, x.o, x.r, statement_timestamp()
          FROM unnest(keys, kinds, froms, tos, amounts, currencies, available, orders, refs)
               WITH ORDINALITY AS x(k, kd, f, t, am, c, av, o, r, i)
         ORDER BY x.i
        ON CONFLICT ON CONSTRAINT ledger_transfers_source_key_key DO NOTHING
        RETURNING lt.id, lt.source_key, lt.from_account, lt.to_account, lt.amount)
    SELECT array_agg(t.id ORDER BY t.id), array_agg(t.source_key ORDER BY t.id),
           array_agg(t.from_account ORDER BY t.id), array_agg(t.to_account ORDER BY t.id),
           array_agg(t.amount ORDER BY t.id)
      INTO new_ids, new_keys, new_froms, new_tos, new_amounts
      FROM t;
    PERFORM set_config('payfleet.posting', '', true);
    IF new_ids IS NULL THEN
        RETURN;
    END IF;

    -- Entries in the order the transfers were written (the debit, then the credit), each
    -- account's starting where its previous one ended.
    WITH legs AS (
        SELECT x.id AS transfer_id, x.a AS account_id, -x.am AS amount, 0 AS leg
          FROM unnest(new_ids, new_froms, new_amounts) AS x(id, a, am)
        UNION ALL
        SELECT x.id, x.a, x.am, 1
          FROM unnest(new_ids, new_tos, new_amounts) AS x(id, a, am)),
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
    SELECT array_agg(w.account_id), array_agg(w.balance_after),
           (SELECT b.account_id FROM written b
             WHERE b.account_id = ANY(floored) AND b.balance_after < 0 ORDER BY b.id LIMIT 1)
      INTO moved_ids, moved_to, below
      FROM (SELECT DISTINCT ON (e.account_id) e.account_id, e.balance_after
              FROM written e ORDER BY e.account_id, e.id DESC) w;
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

-- A transfer must have entries by commit (0044): checked for every transfer written outside
-- ledger_post, which writes the entries of its own in the same call (a deferred check per
-- transfer was a third of a sale's posting).
DROP TRIGGER ledger_transfers_balanced ON ledger_transfers;
CREATE CONSTRAINT TRIGGER ledger_transfers_balanced AFTER INSERT ON ledger_transfers
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (current_setting('payfleet.posting', true) IS DISTINCT FROM 'ledger_post')
    EXECUTE FUNCTION ledger_transfer_balanced_on_transfer();
