-- A posting and the ledger's barriers reach their rows through keys whatever the tables' sizes
-- when they were planned. Their statements are planned once per connection (0060) and the plans
-- kept for its life; planned while `ledger_accounts` was a page or two (a new database), every
-- statement that finds accounts by id scanned the table whole, and kept doing so while each
-- posting left new versions of its accounts' rows behind: 19 pages of 153 accounts and 602 dead
-- versions after a `payfleet bench e2e` run, read by five statements of every posting. With
-- sequential scans off in the functions, an index is taken wherever one serves.
ALTER FUNCTION ledger_post(text[], text[], bpchar[], int[], text[], text[], int[], int[], numeric[], text[],
                           timestamptz[], bigint[], text[])
    SET enable_seqscan = off;
ALTER FUNCTION ledger_post_ids(text[], text[], bigint[], bigint[], numeric[], text[], timestamptz[], bigint[],
                               text[], bigint[], bigint[])
    SET enable_seqscan = off;
ALTER FUNCTION ledger_accounts_of(text[], text[], bpchar[])
    SET enable_seqscan = off;
ALTER FUNCTION ledger_entries_hold() SET enable_seqscan = off;
ALTER FUNCTION ledger_transfers_have_entries() SET enable_seqscan = off;
ALTER FUNCTION ledger_accounts_hold() SET enable_seqscan = off;
