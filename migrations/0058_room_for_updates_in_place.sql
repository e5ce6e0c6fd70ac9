-- Rows that every payment updates get room on their own page for the new version, so that
-- PostgreSQL can write it there (a HOT update: no entry in any index) instead of on another
-- page with an entry in every index. With the pages full (fillfactor 100, the default), 2,000
-- checkouts and their payments (`bench e2e --orders 1000`) made 4,000 order updates of which
-- 1,535 were HOT, 2,189 of 4,000 key updates, and 294 of 1,197 account updates; an order's
-- non-HOT update writes an entry in each of its seven indexes. Confirming a paid order changes
-- no indexed column, nor does moving an account's balance or finishing a key, so each can stay
-- on its page when there is room. The setting applies to pages written from now on (new
-- orders, keys, accounts). The accounts are few and updated by every posting: half of each
-- page is left free.
ALTER TABLE orders SET (fillfactor = 80);
ALTER TABLE idempotency_keys SET (fillfactor = 80);
ALTER TABLE ledger_accounts SET (fillfactor = 50);
