//! Money at the edges: the second of anything. A second late payment, a second payment on one
//! session, a success that says no amount, and facts from a session that did not pay: each is
//! given back once or leaves the order alone, and none is absorbed.

use serde_json::json;
use sqlx::PgPool;

use crate::helpers::*;

/// An internal-gateway event of `kind` about `session` and its payment `payment`.
fn about(kind: &str, session: &str, payment: &str, amount: Option<&str>) -> String {
    let mut data = json!({"session_id": session, "payment_id": payment});
    if let Some(a) = amount {
        data["amount"] = json!(a);
        data["currency"] = json!("BRL");
    }
    json!({"type": kind, "data": data}).to_string()
}

async fn deliver(app: &TestApp, id: &str, body: &str) {
    let (status, answer) = app.deliver(&internal(id, body)).await;
    assert_eq!(status, 200, "{answer}");
    process_events(&app.pool).await;
}

/// Order 1 on two sessions: its first attempt `sess_a`, and `sess_b`, made for its second
/// attempt after the first failed (the order's own session now).
async fn reopened_order(pool: &PgPool) {
    orders_for(pool, "internal", &["sess_a"], "10.00", "BRL").await;
    sqlx::query(
        "INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee)
         VALUES (1, 2, 'internal', 'sess_b', 'http://pay/sess_b', 10, 'BRL', 0)",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn order(pool: &PgPool) -> (String, String, String) {
    sqlx::query_as(
        "SELECT status, payment_status, amount_refunded::text FROM orders WHERE number = 1",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn refund_jobs(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT key FROM jobs WHERE kind = 'refund_payment' ORDER BY key")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn events_of_order(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id WHERE o.number = 1 ORDER BY e.id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn every_late_payment_of_an_expired_order_is_given_back(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    reopened_order(&pool).await;
    deliver(
        &app,
        "a_failed",
        &about("payment.failed", "sess_a", "pay_a", None),
    )
    .await;
    sqlx::query("UPDATE orders SET payment_attempt = 2, session_id = 'sess_b' WHERE number = 1")
        .execute(&pool)
        .await
        .unwrap();
    payfleet::orders::expire_now(&pool, 1).await.unwrap();
    step(&pool, &app.config, "orders").await;
    assert_eq!(order(&pool).await.0, "expired");
    // B is paid after the expiry: given back.
    deliver(
        &app,
        "b_paid",
        &about("payment.succeeded", "sess_b", "pay_b", Some("10.00")),
    )
    .await;
    assert_eq!(
        refund_jobs(&pool).await,
        vec!["refund_payment:internal:sess_b"]
    );
    // Then A, which had failed, succeeds after all (the gateway retried it): given back too.
    deliver(
        &app,
        "a_paid",
        &about("payment.succeeded", "sess_a", "pay_a", Some("10.00")),
    )
    .await;
    assert_eq!(
        refund_jobs(&pool).await,
        vec![
            "refund_payment:internal:sess_a",
            "refund_payment:internal:sess_b"
        ]
    );
    // Each once: their events again change nothing.
    deliver(
        &app,
        "a_paid_again",
        &about("payment.succeeded", "sess_a", "pay_a", Some("10.00")),
    )
    .await;
    let events = events_of_order(&pool).await;
    assert_eq!(
        events.iter().filter(|k| *k == "late_payment").count(),
        2,
        "{events:?}"
    );
    assert_eq!(order(&pool).await.0, "expired");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_second_payment_on_a_paid_session_is_given_back_not_absorbed(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "first",
        &about("payment.succeeded", "sess_a", "pay_first", Some("10.00")),
    )
    .await;
    assert_eq!(order(&pool).await.0, "paid");
    // The gateway took a second payment on the same session (a preference paid twice).
    deliver(
        &app,
        "second",
        &about("payment.succeeded", "sess_a", "pay_second", Some("10.00")),
    )
    .await;
    let payment: String =
        sqlx::query_scalar("SELECT payment_id FROM payment_orders WHERE session_id = 'sess_a'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(payment, "pay_first", "the session's payment is kept");
    assert_eq!(
        refund_jobs(&pool).await,
        vec!["refund_payment:internal:sess_a:pay_second"]
    );
    let extra: serde_json::Value =
        sqlx::query_scalar("SELECT e.payload FROM order_events e WHERE e.kind = 'extra_payment'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(extra["payment_id"], "pay_second", "{extra}");
    // The refund that gives it back is recorded against it, not against the order's payment.
    deliver(
        &app,
        "second_refunded",
        &json!({"type": "refund.succeeded", "data": {"session_id": "sess_a", "payment_id": "pay_second",
                "refund_id": "rf_second", "amount": "10.00", "currency": "BRL"}})
        .to_string(),
    )
    .await;
    assert_eq!(
        order(&pool).await,
        ("paid".into(), "succeeded".into(), "0.0000".into())
    );
    let given_back: String = sqlx::query_scalar(
        "SELECT amount_refunded::text FROM second_payments WHERE payment_id = 'pay_second'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(given_back, "10.0000");
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM payment_events WHERE processed_at IS NULL OR outcome = 'waiting'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(waiting, 0, "nothing is left waiting for a payment");
    // And the order's own payment can still be refunded.
    deliver(
        &app,
        "first_refunded",
        &json!({"type": "refund.succeeded", "data": {"session_id": "sess_a", "payment_id": "pay_first",
                "refund_id": "rf_first", "amount": "4.00", "currency": "BRL"}})
        .to_string(),
    )
    .await;
    assert_eq!(
        order(&pool).await,
        (
            "partially_refunded".into(),
            "partially_refunded".into(),
            "4.0000".into()
        )
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_success_without_an_amount_confirms_only_once_the_gateway_says_it(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "no_amount",
        &about("payment.succeeded", "sess_a", "pay_a", None),
    )
    .await;
    // The gateway knows no such payment: nothing is confirmed, the event waits for a replay.
    assert_eq!(order(&pool).await.0, "awaiting_payment");
    let (outcome, reason): (Option<String>, Option<String>) =
        sqlx::query_as("SELECT outcome, outcome_detail FROM payment_events")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(outcome.as_deref(), Some("rejected"));
    assert!(reason.unwrap_or_default().contains("without its amount"));
    // The gateway's record of it says 10.00: replayed, the event confirms the order with that.
    sqlx::query(
        "INSERT INTO internal_payments (session_id, gateway, order_number, attempt, amount, currency, metadata, status, payment_id, decided_at)
         VALUES ('sess_a', 'internal', 1, 1, 10, 'BRL', '{}', 'succeeded', 'pay_a', now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let id: i64 = sqlx::query_scalar("SELECT id FROM payment_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    payfleet::payments::events::replay(&pool, id).await.unwrap();
    process_events(&pool).await;
    assert_eq!(order(&pool).await.0, "paid");
    let amount: String =
        sqlx::query_scalar("SELECT amount::text FROM payment_orders WHERE session_id = 'sess_a'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(amount, "10.0000");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn facts_of_a_session_that_did_not_pay_leave_the_order_alone(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    reopened_order(&pool).await;
    sqlx::query("UPDATE orders SET payment_attempt = 2, session_id = 'sess_b' WHERE number = 1")
        .execute(&pool)
        .await
        .unwrap();
    // The first attempt's failure arrives while the order waits for its second one.
    deliver(
        &app,
        "a_failed",
        &about("payment.failed", "sess_a", "pay_a", None),
    )
    .await;
    assert_eq!(
        order(&pool).await,
        ("awaiting_payment".into(), "pending".into(), "0.0000".into())
    );
    // B pays; a partial refund of it; then another session's failure: nothing is reset.
    deliver(
        &app,
        "b_paid",
        &about("payment.succeeded", "sess_b", "pay_b", Some("10.00")),
    )
    .await;
    deliver(
        &app,
        "b_refund",
        &json!({"type": "refund.succeeded", "data": {"session_id": "sess_b", "payment_id": "pay_b",
                "refund_id": "rf_b", "amount": "3.00", "currency": "BRL"}})
        .to_string(),
    )
    .await;
    let paid = (
        "partially_refunded".to_owned(),
        "partially_refunded".to_owned(),
        "3.0000".to_owned(),
    );
    assert_eq!(order(&pool).await, paid);
    sqlx::query(
        "INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee)
         VALUES (1, 3, 'internal', 'sess_c', 'http://pay/sess_c', 10, 'BRL', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    for (id, session) in [("c_failed", "sess_c"), ("a_failed_again", "sess_a")] {
        deliver(&app, id, &about("payment.failed", session, "x", None)).await;
        assert_eq!(order(&pool).await, paid, "{session}'s failure");
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_coin_paid_order_ignores_its_gateway_sessions_failure(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    sqlx::query(
        "UPDATE orders SET status = 'paid', paid_at = now(), paid_with_coins = true, coin_reservation = 'res-1' WHERE number = 1",
    )
    .execute(&pool)
    .await
    .unwrap();
    deliver(
        &app,
        "a_failed",
        &about("payment.failed", "sess_a", "pay_a", None),
    )
    .await;
    assert_eq!(
        order(&pool).await,
        ("paid".into(), "pending".into(), "0.0000".into())
    );
}
