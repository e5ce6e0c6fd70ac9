//! The database as the last barrier: each money rule, broken straight in SQL (as a future bug or
//! a hand-written statement would), is refused by the schema itself.

use payfleet::ledger::{self, AccountKind, AccountRef, Transfer, TransferKind};
use payfleet::money::Money;
use sqlx::PgPool;

use crate::helpers::*;

/// The error's message and the constraint it names.
fn described(e: sqlx::Error) -> String {
    match &e {
        sqlx::Error::Database(d) => format!("{} [{}]", d.message(), d.constraint().unwrap_or("")),
        _ => e.to_string(),
    }
}

/// Runs `statements` in one transaction and commits it: the error the schema gave, if any.
async fn attempt(pool: &PgPool, statements: &[&str]) -> Option<String> {
    let mut tx = pool.begin().await.unwrap();
    for sql in statements {
        if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&mut *tx)
            .await
        {
            return Some(described(e));
        }
    }
    tx.commit().await.err().map(described)
}

async fn refused(pool: &PgPool, statements: &[&str], because: &str) {
    let e = attempt(pool, statements)
        .await
        .unwrap_or_else(|| panic!("the schema took {statements:?}"));
    assert!(e.contains(because), "{because} not in: {e}");
}

/// A real posting, 5.00 from the internal gateway's clearing to seller x's pending balance.
async fn one_posting(pool: &PgPool) {
    let c = "BRL".parse().unwrap();
    let mut tx = pool.begin().await.unwrap();
    ledger::post(
        &mut tx,
        &Transfer {
            source_key: "t1".into(),
            kind: TransferKind::Adjustment,
            from: AccountRef::new(AccountKind::GatewayClearing, "internal:x", c),
            to: AccountRef::new(AccountKind::SellerPending, "x", c),
            amount: Money::parse("5.00", "BRL").unwrap(),
            available_at: None,
            order_number: None,
            reference: None,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

const ACCOUNTS: &str = "INSERT INTO ledger_accounts (id, kind, owner, currency) VALUES
    (101, 'gateway_clearing', 'internal:y', 'BRL'), (102, 'seller_pending', 'y', 'BRL'),
    (103, 'seller_pending', 'y', 'USD')";

/// A transfer (900, 5.00 BRL, from 101 to `to`) written with `entries`, in one statement, as
/// the code writes them.
fn with_entries(id: i64, to: i64, entries: &str) -> String {
    format!(
        "WITH t AS (INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency)
                    VALUES ({id}, 'bad{id}', 'adjustment', 101, {to}, 5, 'BRL') RETURNING id)
         INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
         SELECT t.id, e.account, e.amount, e.before, e.after FROM t,
                (VALUES {entries}) AS e(account, amount, before, after)"
    )
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_transfer_is_two_entries_summing_to_zero_in_its_currency(pool: PgPool) {
    sqlx::query(ACCOUNTS).execute(&pool).await.unwrap();
    let transfer = "INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency)
                    VALUES (900, 'bad', 'adjustment', 101, 102, 5, 'BRL')";
    // Entries that do not sum to zero.
    refused(
        &pool,
        &[&with_entries(900, 102, "(101, -5, 0, -5), (102, 4, 0, 4)")],
        "entries summing to -1",
    )
    .await;
    // No entries at all.
    refused(&pool, &[transfer], "ledger_transfer_balanced").await;
    // Its entries written by a statement of their own: the transfer stood without them.
    refused(
        &pool,
        &[
            transfer,
            "INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
             VALUES (900, 101, -5, 0, -5), (900, 102, 5, 0, 5)",
        ],
        "has no entries",
    )
    .await;
    // One entry only.
    refused(
        &pool,
        &[&with_entries(900, 102, "(101, -5, 0, -5)")],
        "1 entries, not 2",
    )
    .await;
    // An entry on an account of another currency.
    refused(
        &pool,
        &[&with_entries(901, 103, "(101, -5, 0, -5), (103, 5, 0, 5)")],
        "another currency",
    )
    .await;
    // Entries on accounts the transfer does not name.
    refused(
        &pool,
        &[&with_entries(900, 102, "(102, -5, 0, -5), (101, 5, 0, 5)")],
        "ledger_transfer_balanced",
    )
    .await;
    // Written as the code writes it, it holds; a third entry of it, later, is refused.
    one_posting(&pool).await;
    refused(
        &pool,
        &["INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
           SELECT t.id, 101, 1, 0, 1 FROM ledger_transfers t WHERE t.source_key = 't1'"],
        "ledger_transfer_balanced",
    )
    .await;
}

/// The ledger's rows point only at rows that exist, and none of its tables is ever emptied: what
/// its foreign keys refused, now checked once per statement (migration 0054).
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_ledger_points_only_at_rows_that_exist(pool: PgPool) {
    sqlx::query(ACCOUNTS).execute(&pool).await.unwrap();
    // A transfer to an account that does not exist, its entries on it.
    refused(
        &pool,
        &[&with_entries(900, 999, "(101, -5, 0, -5), (999, 5, 0, 5)")],
        "does not exist",
    )
    .await;
    // A transfer to an account that does not exist, its entries on accounts that do.
    refused(
        &pool,
        &[&with_entries(900, 999, "(101, -5, 0, -5), (102, 5, 0, 5)")],
        "ledger_transfers_accounts_exist",
    )
    .await;
    // Entries of a transfer that does not exist.
    refused(
        &pool,
        &["INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
           VALUES (777, 101, -5, 0, -5), (777, 102, 5, 0, 5)"],
        "no such transfer",
    )
    .await;
    // An entry on an account that does not exist, of a transfer that does.
    one_posting(&pool).await;
    refused(
        &pool,
        &["INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
           SELECT t.id, 999, 1, 0, 1 FROM ledger_transfers t WHERE t.source_key = 't1'"],
        "ledger_entries_account_exists",
    )
    .await;
    for table in ["ledger_entries", "ledger_transfers", "ledger_accounts"] {
        refused(
            &pool,
            &[&format!("TRUNCATE {table} CASCADE")],
            "never truncated",
        )
        .await;
    }
    // Nothing of the above was kept: the one posting stands, whole.
    let (transfers, entries): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM ledger_transfers), (SELECT count(*) FROM ledger_entries)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((transfers, entries), (1, 2));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_balance_moves_only_with_its_entries(pool: PgPool) {
    one_posting(&pool).await;
    refused(
        &pool,
        &["UPDATE ledger_accounts SET balance = balance + 1 WHERE kind = 'seller_pending'"],
        "ledger_accounts_balance_is_entries",
    )
    .await;
    refused(
        &pool,
        &["UPDATE ledger_accounts SET currency = 'USD' WHERE kind = 'seller_pending'"],
        "ledger_accounts_fixed",
    )
    .await;
    // Another id, with another balance, is no way around the balance's rule either.
    refused(
        &pool,
        &["UPDATE ledger_accounts SET id = 999, balance = 1000 WHERE kind = 'seller_pending'"],
        "ledger_accounts_fixed",
    )
    .await;
    refused(
        &pool,
        &["DELETE FROM ledger_accounts WHERE kind = 'seller_pending'"],
        "never deleted",
    )
    .await;
    // Nor an account opened holding what no entry put there.
    refused(
        &pool,
        &["INSERT INTO ledger_accounts (kind, owner, currency, balance) VALUES ('seller_pending', 'z', 'BRL', 100)"],
        "ledger_accounts_balance_is_entries",
    )
    .await;
    // An entry that does not start where the account's last one ended (the pending account
    // holds 5.00).
    let skip = "WITH t AS (INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency)
                           SELECT 902, 'skip', 'adjustment', a.id, b.id, 1, 'BRL'
                           FROM ledger_accounts a, ledger_accounts b
                           WHERE a.kind = 'gateway_clearing' AND b.kind = 'seller_pending' RETURNING *)
                INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
                SELECT id, from_account, -1, -5, -6 FROM t UNION ALL SELECT id, to_account, 1, BEFORE, AFTER FROM t";
    refused(
        &pool,
        &[&skip.replace("BEFORE, AFTER", "0, 1")],
        "ledger_entries_follow",
    )
    .await;
    // Entries written below their accounts' last ones (ids from before them), each starting
    // where the entry before its id ended (there is none: 0).
    refused(
        &pool,
        &["WITH t AS (INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency)
                      SELECT 903, 'below', 'adjustment', a.id, b.id, 1, 'BRL'
                      FROM ledger_accounts a, ledger_accounts b
                      WHERE a.kind = 'gateway_clearing' AND b.kind = 'seller_pending' RETURNING *)
           INSERT INTO ledger_entries (id, transfer_id, account_id, amount, balance_before, balance_after)
           SELECT -2, id, from_account, -1, 0, -1 FROM t UNION ALL SELECT -1, id, to_account, 1, 0, 1 FROM t"],
        "ledger_entries_follow",
    )
    .await;
    // Two transfers to one account in one statement, the second not starting where the first
    // ended (each checked against the account's last entry alone would pass).
    refused(
        &pool,
        &["WITH t AS (INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency)
                      SELECT 903 + g, 'twice' || g, 'adjustment', a.id, b.id, 1, 'BRL'
                      FROM ledger_accounts a, ledger_accounts b, generate_series(1, 2) g
                      WHERE a.kind = 'gateway_clearing' AND b.kind = 'seller_pending' RETURNING *)
           INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
           SELECT id, from_account, -1, CASE id WHEN 904 THEN -5 ELSE -6 END, CASE id WHEN 904 THEN -6 ELSE -7 END FROM t
           UNION ALL SELECT id, to_account, 1, 5, 6 FROM t ORDER BY 1, 3"],
        "ledger_entries_follow",
    )
    .await;
    // Written as the code writes it, the same posting holds.
    let (clearing, pending): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT id FROM ledger_accounts WHERE kind = 'gateway_clearing'),
                (SELECT id FROM ledger_accounts WHERE kind = 'seller_pending')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        attempt(
            &pool,
            &[&skip.replace("BEFORE, AFTER", "5, 6"),
              &format!("UPDATE ledger_accounts SET balance = CASE id WHEN {clearing} THEN -6 ELSE 6 END WHERE id IN ({clearing}, {pending})")]
        )
        .await
        .is_none(),
        "a posting that follows its accounts' last entries holds"
    );
    refused(
        &pool,
        &["UPDATE ledger_entries SET amount = 6"],
        "immutable",
    )
    .await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn refunds_never_exceed_the_payment_nor_requests_the_capture(pool: PgPool) {
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    sqlx::query(
        "INSERT INTO payment_orders (id, gateway, session_id, payment_id, status, amount, currency, succeeded_at)
         VALUES (50, 'internal', 'sess_a', 'pay_a', 'succeeded', 10, 'BRL', now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    refused(
        &pool,
        &[
            "INSERT INTO payment_refunds (payment_order_id, gateway, refund_id, amount, currency) VALUES (50, 'internal', 'r1', 6, 'BRL')",
            "INSERT INTO payment_refunds (payment_order_id, gateway, refund_id, amount, currency) VALUES (50, 'internal', 'r2', 5, 'BRL')",
        ],
        "payment_refunds_within_payment",
    )
    .await;
    assert_eq!(
        attempt(&pool, &["INSERT INTO payment_refunds (payment_order_id, gateway, refund_id, amount, currency) VALUES (50, 'internal', 'r1', 6, 'BRL')"]).await,
        None
    );
    refused(
        &pool,
        &["UPDATE payment_refunds SET amount = 1"],
        "immutable",
    )
    .await;
    // Within the payment's amount, but in another currency.
    refused(
        &pool,
        &["INSERT INTO payment_refunds (payment_order_id, gateway, refund_id, amount, currency) VALUES (50, 'internal', 'r3', 1, 'USD')"],
        "payment_refunds_within_payment",
    )
    .await;
    refused(
        &pool,
        &[
            "INSERT INTO refund_requests (idempotency_key, order_number, gateway, session_id, payment_id, amount, currency)
             VALUES ('k3', 1, 'internal', 'sess_a', 'pay_a', 1, 'USD')",
        ],
        "refund_requests_within_capture",
    )
    .await;
    refused(
        &pool,
        &[
            "INSERT INTO refund_requests (idempotency_key, order_number, gateway, session_id, payment_id, amount, currency)
             VALUES ('k1', 1, 'internal', 'sess_a', 'pay_a', 7, 'BRL'), ('k2', 1, 'internal', 'sess_a', 'pay_a', 4, 'BRL')",
        ],
        "refund_requests_within_capture",
    )
    .await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn payouts_and_invoices_are_written_once(pool: PgPool) {
    sqlx::query(
        "INSERT INTO sellers (id, name, payout_frequency, payout_minimum)
         VALUES ('00000000-0000-0000-0000-000000000001', 'S', 'daily', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    // A payout without its debit in the ledger.
    refused(
        &pool,
        &[
            "INSERT INTO payouts (seller_id, currency, period_start, amount)
           VALUES ('00000000-0000-0000-0000-000000000001', 'BRL', '2026-11-30', 10)",
        ],
        "payouts_have_their_debit",
    )
    .await;
    // A payout made and decided by the code: linked to its transfers, decided once.
    let c = "BRL".parse().unwrap();
    let seller = "00000000-0000-0000-0000-000000000001";
    let mut tx = pool.begin().await.unwrap();
    ledger::post(
        &mut tx,
        &Transfer {
            source_key: "fund".into(),
            kind: TransferKind::Adjustment,
            from: AccountRef::new(AccountKind::GatewayClearing, "internal:s", c),
            to: AccountRef::new(AccountKind::SellerAvailable, seller, c),
            amount: Money::parse("10.00", "BRL").unwrap(),
            available_at: None,
            order_number: None,
            reference: None,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let made = ledger::payouts::run(&pool, chrono::Utc::now().date_naive())
        .await
        .unwrap();
    assert_eq!(made.len(), 1);
    ledger::payouts::decide(&pool, made[0], None).await.unwrap();
    let linked: (bool, bool) = sqlx::query_as(
        "SELECT debit_transfer_id IS NOT NULL, decided_transfer_id IS NOT NULL FROM payouts",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(linked, (true, true));
    refused(
        &pool,
        &["UPDATE payouts SET state = 'failed', failure = 'changed our mind'"],
        "payouts_decided_once",
    )
    .await;
    refused(
        &pool,
        &["UPDATE payouts SET amount = 1"],
        "payouts_decided_once",
    )
    .await;
    refused(&pool, &["DELETE FROM payouts"], "never deleted").await;
    refused(
        &pool,
        &[
            "INSERT INTO invoices (number, seller_id, period_start, period_end)
           VALUES (1, '00000000-0000-0000-0000-000000000001', '2026-10-01', '2026-11-01')",
            "UPDATE invoices SET period_end = '2026-12-01'",
        ],
        "immutable",
    )
    .await;
}

/// A coin reservation is decided once (a released marker with no amount too), what it holds
/// never changes, and none is deleted.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn coin_reservations_are_decided_once(pool: PgPool) {
    sqlx::raw_sql(
        "INSERT INTO coin_reservations (id, buyer_id, amount, currency, order_number) VALUES
             ('held', 'b', 5, 'BRL', 1), ('spent', 'b', 5, 'BRL', 2);
         INSERT INTO coin_reservations (id, state, decided_at) VALUES ('released early', 'released', now());
         UPDATE coin_reservations SET state = 'approved', decided_at = now() WHERE id = 'spent'",
    )
    .execute(&pool)
    .await
    .unwrap();
    for sql in [
        "UPDATE coin_reservations SET state = 'released' WHERE id = 'spent'",
        "UPDATE coin_reservations SET state = 'approved' WHERE id = 'released early'",
        "UPDATE coin_reservations SET buyer_id = 'b', amount = 5, currency = 'BRL' WHERE id = 'released early'",
        "UPDATE coin_reservations SET amount = 50 WHERE id = 'held'",
        "UPDATE coin_reservations SET buyer_id = 'someone else' WHERE id = 'held'",
    ] {
        refused(&pool, &[sql], "coin_reservations_decided_once").await;
    }
    refused(
        &pool,
        &["DELETE FROM coin_reservations WHERE id = 'held'"],
        "never deleted",
    )
    .await;
    assert!(
        attempt(
            &pool,
            &["UPDATE coin_reservations SET state = 'released', decided_at = now() WHERE id = 'held'"]
        )
        .await
        .is_none(),
        "a held reservation is decided"
    );
}

/// A dispute is decided once, from open; nothing else of it changes and none is deleted: the
/// ledger's take-backs read a decided one as final.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn disputes_are_decided_once_and_keep_what_they_dispute(pool: PgPool) {
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    sqlx::raw_sql(
        "INSERT INTO payment_orders (id, gateway, session_id, payment_id, status, amount, currency, succeeded_at)
         VALUES (50, 'internal', 'sess_a', 'pay_a', 'succeeded', 10, 'BRL', now());
         INSERT INTO payment_disputes (payment_order_id, gateway, dispute_id, status, amount, currency)
         VALUES (50, 'internal', 'open', 'open', 10, 'BRL'), (50, 'internal', 'won', 'won', 10, 'BRL');
         INSERT INTO second_payments (id, gateway, session_id, payment_id, amount, currency)
         VALUES (70, 'internal', 'sess_a', 'pay_b', 10, 'BRL');
         INSERT INTO second_payment_disputes (second_payment_id, gateway, dispute_id, status, amount, currency)
         VALUES (70, 'internal', 'second', 'lost', 10, 'BRL')",
    )
    .execute(&pool)
    .await
    .unwrap();
    for sql in [
        "UPDATE payment_disputes SET status = 'open' WHERE dispute_id = 'won'",
        "UPDATE payment_disputes SET status = 'lost' WHERE dispute_id = 'won'",
        "UPDATE payment_disputes SET amount = 5 WHERE dispute_id = 'open'",
        "UPDATE payment_disputes SET currency = 'USD' WHERE dispute_id = 'open'",
        "UPDATE payment_disputes SET refunded_before = 3 WHERE dispute_id = 'open'",
        "UPDATE second_payment_disputes SET status = 'won' WHERE dispute_id = 'second'",
    ] {
        refused(&pool, &[sql], "disputes_decided_once").await;
    }
    for table in ["payment_disputes", "second_payment_disputes"] {
        refused(&pool, &[&format!("DELETE FROM {table}")], "never deleted").await;
    }
    for sql in [
        "UPDATE payment_disputes SET checked_at = now() WHERE dispute_id = 'won'",
        "UPDATE payment_disputes SET status = 'lost', updated_at = now() WHERE dispute_id = 'open'",
    ] {
        assert_eq!(attempt(&pool, &[sql]).await, None, "{sql}");
    }
}

/// An order has `paid_at` exactly when it is paid; a payment's amount comes with its currency
/// and is never below what was refunded of it; a sale credit names its order and its date.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn paid_means_paid_at_and_amounts_come_whole(pool: PgPool) {
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    refused(
        &pool,
        &["UPDATE orders SET paid_at = now()"],
        "orders_paid_at_only_when_paid",
    )
    .await;
    refused(
        &pool,
        &["INSERT INTO payment_orders (gateway, session_id, status, amount) VALUES ('internal', 'sess_a', 'pending', 10)"],
        "payment_orders_amount_with_currency",
    )
    .await;
    refused(
        &pool,
        &["INSERT INTO payment_orders (gateway, session_id, status, amount, currency, amount_refunded)
           VALUES ('internal', 'sess_a', 'refunded', 10, 'BRL', 11)"],
        "payment_orders_refunded_within_amount",
    )
    .await;
    sqlx::query(ACCOUNTS).execute(&pool).await.unwrap();
    for (available_at, order_number) in [("NULL", "1"), ("now()", "NULL")] {
        refused(
            &pool,
            &[&format!(
                "INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency, available_at, order_number)
                 VALUES (900, 'sale:1', 'sale_credit', 101, 102, 5, 'BRL', {available_at}, {order_number})"
            )],
            "ledger_transfers_sale_credit_complete",
        )
        .await;
    }
}
