-- Where sequential scans are off (0062, 0063, 0064), compiling is off too. A scan that no index
-- can serve is then priced at PostgreSQL's disable_cost (ten billion), far past jit_above_cost,
-- and a statement so planned is compiled by LLVM at every run: tens of milliseconds for a
-- statement of a few (README, "The ledger's barriers look once per account"). These functions'
-- statements reach their rows by key, so none is planned so today; one added or changed later
-- costs a plan, not a compilation at every call.
ALTER FUNCTION ledger_post(text[], text[], bpchar[], int[], text[], text[], int[], int[], numeric[], text[],
                           timestamptz[], bigint[], text[])
    SET jit = off;
ALTER FUNCTION ledger_post_ids(text[], text[], bigint[], bigint[], numeric[], text[], timestamptz[], bigint[],
                               text[], bigint[], bigint[])
    SET jit = off;
ALTER FUNCTION ledger_accounts_of(text[], text[], bpchar[]) SET jit = off;
ALTER FUNCTION ledger_accounts_hold() SET jit = off;
ALTER FUNCTION checkout_store_answers(int[], bigint[], int[], text[], text[], int[], text[], text[], text[],
                                      jsonb[], int[])
    SET jit = off;
