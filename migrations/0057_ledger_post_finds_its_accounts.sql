-- Posting in one round trip, its accounts included. ledger::post_many found (or created) the
-- transfers' accounts in a statement of its own, then called ledger_post (0045) with their ids:
-- two round trips on every posting, inside a batch of payments whose earlier locks are held
-- meanwhile. The accounts are now found by the database, in the call that posts:
--
-- - ledger_accounts_of: the ids of accounts named by (kind, owner, currency), in the order
--   given, creating the missing ones first (in one order whoever creates them, so two
--   transactions creating the same accounts cannot deadlock on the unique index). Its last read
--   is a statement of its own, which sees accounts another transaction committed meanwhile
--   (the insert's snapshot may not). ledger::accounts calls it too: one copy of the rule.
-- - ledger_post_ids: 0045's posting, the one copy of it from now on, its floor refusal naming
--   the account by its place in `places` when given (else by its id, as before).
-- - ledger_post with the accounts by name (what this release calls): finds them, then posts with
--   `places` = their ids, so a refusal names the account's place (1-based) and the caller can
--   say whose it was.
-- - ledger_post with ids (0045's signature, for processes of the previous release while they are
--   replaced: README, "Upgrading"): now the same posting, refusals named by id as before.
CREATE FUNCTION ledger_accounts_of(account_kinds text[], account_owners text[], account_currencies bpchar[])
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[];
BEGIN
    SELECT array_agg(a.id ORDER BY r.i) INTO ids
      FROM unnest(account_kinds, account_owners, account_currencies) WITH ORDINALITY AS r(kind, owner, currency, i)
      LEFT JOIN ledger_accounts a ON a.kind = r.kind AND a.owner = r.owner AND a.currency = r.currency;
    IF ids IS NULL OR array_position(ids, NULL) IS NULL THEN
        RETURN COALESCE(ids, '{}');
    END IF;
    INSERT INTO ledger_accounts (kind, owner, currency)
    SELECT m.kind, m.owner, m.currency
      FROM (SELECT DISTINCT r.kind, r.owner, r.currency
              FROM unnest(account_kinds, account_owners, account_currencies) AS r(kind, owner, currency)) m
     ORDER BY m.kind COLLATE "C", m.owner COLLATE "C", m.currency COLLATE "C"
    ON CONFLICT ON CONSTRAINT ledger_accounts_key DO NOTHING;
    SELECT array_agg(a.id ORDER BY r.i) INTO ids
      FROM unnest(account_kinds, account_owners, account_currencies) WITH ORDINALITY AS r(kind, owner, currency, i)
      LEFT JOIN ledger_accounts a ON a.kind = r.kind AND a.owner = r.owner AND a.currency = r.currency;
    IF array_position(ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'account % % % was neither found nor created',
            account_kinds[array_position(ids, NULL)], account_owners[array_position(ids, NULL)],
            account_currencies[array_position(ids, NULL)]
            USING ERRCODE = 'no_data_found';
    END IF;
    RETURN ids;
END;
$$;

CREATE FUNCTION ledger_post_ids(
    keys text[], kinds text[], from_ids bigint[], to_ids bigint[], amounts numeric[], currencies text[],
    available timestamptz[], orders bigint[], refs text[], floored_ids bigint[], places bigint[])
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
    PERFORM 1 FROM ledger_accounts a WHERE a.id = ANY(from_ids || to_ids) ORDER BY a.id FOR UPDATE;
    -- Stamped when written, after the wait for the accounts.
    stamp := clock_timestamp();

    -- The transfers and their entries in one statement (a transfer is written with its
    -- entries, 0044), entries in the order the transfers were written (the
    -- debit, then the credit), each account's starting where its previous one ended.
    WITH t AS (
        INSERT INTO ledger_transfers AS lt (source_key, kind, from_account, to_account, amount, currency,
                                            available_at, order_number, reference, created_at)
        SELECT x.k, x.kd, x.f, x.t, x.am, x.c, x.av, x.o, x.r, stamp
          FROM unnest(keys, kinds, from_ids, to_ids, amounts, currencies, available, orders, refs)
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

CREATE FUNCTION ledger_post(
    account_kinds text[], account_owners text[], account_currencies bpchar[], floored int[],
    keys text[], kinds text[], froms int[], tos int[], amounts numeric[], currencies text[],
    available timestamptz[], orders bigint[], refs text[])
RETURNS TABLE (posted_id bigint, posted_key text)
LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[];
BEGIN
    ids := ledger_accounts_of(account_kinds, account_owners, account_currencies);
    RETURN QUERY SELECT * FROM ledger_post_ids(
        keys, kinds,
        ARRAY(SELECT ids[f.at] FROM unnest(froms) WITH ORDINALITY AS f(at, i) ORDER BY f.i),
        ARRAY(SELECT ids[t.at] FROM unnest(tos) WITH ORDINALITY AS t(at, i) ORDER BY t.i),
        amounts, currencies, available, orders, refs,
        ARRAY(SELECT ids[f.at] FROM unnest(floored) AS f(at)),
        ids);
END;
$$;

CREATE OR REPLACE FUNCTION ledger_post(
    keys text[], kinds text[], froms bigint[], tos bigint[], amounts numeric[], currencies text[],
    available timestamptz[], orders bigint[], refs text[], floored bigint[])
RETURNS TABLE (posted_id bigint, posted_key text)
LANGUAGE sql AS $$
    SELECT * FROM ledger_post_ids(keys, kinds, froms, tos, amounts, currencies, available, orders, refs, floored, NULL)
$$;
