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

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_transfer_is_two_entries_summing_to_zero_in_its_currency(pool: PgPool) {
    sqlx::query(ACCOUNTS).execute(&pool).await.unwrap();
    let transfer = "INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency)
                    VALUES (900, 'bad', 'adjustment', 101, 102, 5, 'BRL')";
    // Entries that do not sum to zero.
    refused(
        &pool,
        &[
            transfer,
            "INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
             VALUES (900, 101, -5, 0, -5), (900, 102, 4, 0, 4)",
        ],
        "ledger_transfer_balanced",
    )
    .await;
    // No entries at all.
    refused(&pool, &[transfer], "ledger_transfer_balanced").await;
    // An entry on an account of another currency.
    refused(
        &pool,
        &[
            "INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency)
             VALUES (901, 'bad2', 'adjustment', 101, 103, 5, 'BRL')",
            "INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
             VALUES (901, 101, -5, 0, -5), (901, 103, 5, 0, 5)",
        ],
        "another currency",
    )
    .await;
    // Entries on accounts the transfer does not name.
    refused(
        &pool,
        &[
            transfer,
            "INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
             VALUES (900, 102, -5, 0, -5), (900, 101, 5, 0, 5)",
        ],
        "ledger_transfer_balanced",
    )
    .await;
    // Written as the code writes it, it holds.
    one_posting(&pool).await;
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
    refused(
        &pool,
        &["DELETE FROM ledger_accounts WHERE kind = 'seller_pending'"],
        "never deleted",
    )
    .await;
    // An entry that does not start where the account's last one ended.
    refused(
        &pool,
        &[
            "INSERT INTO ledger_transfers (id, source_key, kind, from_account, to_account, amount, currency)
             SELECT 902, 'skip', 'adjustment', a.id, b.id, 1, 'BRL'
             FROM ledger_accounts a, ledger_accounts b WHERE a.kind = 'gateway_clearing' AND b.kind = 'seller_pending'",
            "INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
             SELECT 902, id, 1, 0, 1 FROM ledger_accounts WHERE kind = 'seller_pending'",
        ],
        "ledger_entries_follow",
    )
    .await;
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
