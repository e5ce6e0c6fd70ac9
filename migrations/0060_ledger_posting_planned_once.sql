-- A posting is planned once per connection, not at every call. PL/pgSQL plans a statement for
-- its variables' values five times, then keeps the generic plan unless that plan looks dearer;
-- the posting's statements take arrays whose sizes the planner sees in each call's values, so
-- the generic plan always looked dearer and every call was planned again. Over a deployed
-- `payfleet bench e2e` paced phase (`pg_stat_statements` with `track_planning`) a batch's
-- posting spent about 1.8 ms planning (0.6 ms of it the transfers' and entries' statement)
-- while it held the sellers' accounts; in a rolled-back transaction on an idle machine, one
-- sale's posting took 1.9 to 2.2 ms instead of 3.0 to 3.3 ms. Each statement finds its rows
-- through a key whatever the sizes (the accounts by id or by (kind, owner, currency), the
-- transfers by source key, an account's last entry by (account_id, id)), so the plan made once
-- is the plan for every call.
-- The SQL-language `ledger_post` with ids (kept for the previous release's processes) is left
-- as it is: a setting would stop it from being inlined, and it calls `ledger_post_ids`.
ALTER FUNCTION ledger_post(text[], text[], bpchar[], int[], text[], text[], int[], int[], numeric[], text[],
                           timestamptz[], bigint[], text[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION ledger_post_ids(text[], text[], bigint[], bigint[], numeric[], text[], timestamptz[], bigint[],
                               text[], bigint[], bigint[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION ledger_accounts_of(text[], text[], bpchar[])
    SET plan_cache_mode = force_generic_plan;
