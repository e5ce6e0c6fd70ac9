//! Money at the edges: the second of anything. A second late payment, a second payment on one
//! session, a success that says no amount, and facts from a session that did not pay: each is
//! given back once or leaves the order alone, and none is absorbed.

use serde_json::json;
use sqlx::PgPool;

use crate::helpers::*;

/// An internal-gateway event of `kind` about `session` and its payment `payment`.
fn about(kind: &str, session: &str, payment: &str, amount: Option<&str>) -> String {
    let extra = amount.map_or(json!({}), |a| json!({"amount": a, "currency": "BRL"}));
    about_with(kind, session, payment, extra)
}

/// The same, with `extra` fields in its data (a refund's or a dispute's id and amount).
fn about_with(kind: &str, session: &str, payment: &str, extra: serde_json::Value) -> String {
    let mut data = json!({"session_id": session, "payment_id": payment});
    for (k, v) in extra.as_object().into_iter().flatten() {
        data[k] = v.clone();
    }
    json!({"type": kind, "data": data}).to_string()
}

/// Waits (up to 30 s) until `sql`'s one text value is `want`.
async fn until_text(pool: &PgPool, what: &str, sql: &'static str, want: &str) {
    wait_for(what, std::time::Duration::from_secs(30), async || {
        sqlx::query_scalar::<_, String>(sql)
            .fetch_optional(pool)
            .await
            .unwrap()
            .as_deref()
            == Some(want)
    })
    .await;
}

async fn deliver(app: &TestApp, id: &str, body: &str) {
    deliver_ending(app, id, body, &["applied", "ignored"]).await;
}

/// [`deliver`], the event's processing ending in one of `outcomes` (checked: a failing run only
/// becomes retryable, and "nothing changed" would hold of an event never applied); none named,
/// not checked (a running fleet processes it when it does).
async fn deliver_ending(app: &TestApp, id: &str, body: &str, outcomes: &[&str]) {
    let (status, answer) = app.deliver(&internal(id, body)).await;
    assert_eq!(status, 200, "{answer}");
    process_events(&app.pool).await;
    if outcomes.is_empty() {
        return;
    }
    let outcome: Option<String> =
        sqlx::query_scalar("SELECT outcome FROM payment_events WHERE event_id = $1")
            .bind(id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(
        outcome.as_deref().is_some_and(|o| outcomes.contains(&o)),
        "{id}: {outcome:?}"
    );
}

/// Pays `order` on its payment page and waits until it is paid.
/// Refund request `id` as if asked of its gateway `hours` ago with its answer lost, its job
/// not running now.
async fn asked_unanswered(pool: &PgPool, id: i64, hours: i32) {
    sqlx::query("DELETE FROM jobs WHERE kind = 'carry_out_refund'")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE refund_requests SET first_asked_at = now() - $2 * interval '1 hour' WHERE id = $1",
    )
    .bind(id)
    .bind(hours)
    .execute(pool)
    .await
    .unwrap();
}

async fn pay_and_wait(shop: &crate::checkout::Shop, order: &serde_json::Value) {
    let number = order["number"].as_i64().unwrap();
    let url = order["payment"]["url"].as_str().unwrap();
    assert_eq!(shop.app.pay(url, "succeeded").await.0, 200);
    wait_for(
        "the order to be paid",
        std::time::Duration::from_secs(30),
        async || shop.order(number).await["status"] == "paid",
    )
    .await;
}

/// Order 1 of `amount` BRL on the internal gateway's `session`, with the simulator's own record
/// of that session, for its refunds of what its signed events reported.
async fn simulated_order(pool: &PgPool, session: &str, amount: &str) {
    orders_for(pool, "internal", &[session], amount, "BRL").await;
    sqlx::query(
        "INSERT INTO internal_payments (session_id, gateway, order_number, attempt, amount, currency, metadata)
         VALUES ($1, 'internal', 1, 1, $2::numeric, 'BRL', '{}')",
    )
    .bind(session)
    .bind(amount)
    .execute(pool)
    .await
    .unwrap();
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
    // And B's session takes a second payment (a preference paid twice): late too, not an
    // "extra" payment of an order that was never paid.
    deliver(
        &app,
        "b_paid_twice",
        &about("payment.succeeded", "sess_b", "pay_b2", Some("10.00")),
    )
    .await;
    let events = events_of_order(&pool).await;
    assert_eq!(
        events.iter().filter(|k| *k == "late_payment").count(),
        3,
        "{events:?}"
    );
    assert!(!events.iter().any(|k| k == "extra_payment"), "{events:?}");
    assert_eq!(refund_jobs(&pool).await.len(), 3);
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
        &about_with(
            "refund.succeeded",
            "sess_a",
            "pay_second",
            json!({"refund_id": "rf_second", "amount": "10.00", "currency": "BRL"}),
        ),
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
    // Refunded before its give-back ran (at the gateway's dashboard, or reported with the
    // payment, as a Mercado Pago lookup does): the give-back asks the gateway for nothing
    // more, and ends done, not dead.
    step(&pool, &app.config, "payments").await;
    let (jobs, asked): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM jobs WHERE kind = 'refund_payment'),
                (SELECT count(*) FROM internal_refunds)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((jobs, asked), (0, 0));
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
        &about_with(
            "refund.succeeded",
            "sess_a",
            "pay_first",
            json!({"refund_id": "rf_first", "amount": "4.00", "currency": "BRL"}),
        ),
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

/// A refund or a dispute naming a payment other than the session's own (a Razorpay order's
/// second attempt, authorised and then voided; a second payment not known yet) is that
/// payment's, never the order's: it waits for that payment, and the order and the seller's
/// money stay as they are. Once the payment is known (a second payment, given back), its
/// refund is recorded against it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_or_a_dispute_of_another_payment_on_the_session_is_not_the_orders(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "first",
        &about("payment.succeeded", "sess_a", "pay_first", Some("10.00")),
    )
    .await;
    let paid = (
        "paid".to_owned(),
        "succeeded".to_owned(),
        "0.0000".to_owned(),
    );
    assert_eq!(order(&pool).await, paid);
    // What the ledger took back from the seller: refunds' and disputes' transfers.
    let taken_from_seller = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM ledger_transfers WHERE source_key LIKE 'refund:%' OR source_key LIKE 'dispute:%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    deliver_ending(
        &app,
        "other_refunded",
        &about_with(
            "refund.succeeded",
            "sess_a",
            "pay_other",
            json!({"refund_id": "rf_other", "amount": "10.00", "currency": "BRL"}),
        ),
        &["waiting"],
    )
    .await;
    deliver_ending(
        &app,
        "other_disputed",
        &about_with(
            "dispute.created",
            "sess_a",
            "pay_other",
            json!({"dispute_id": "dp_other", "amount": "10.00", "currency": "BRL"}),
        ),
        &["waiting"],
    )
    .await;
    assert_eq!(order(&pool).await, paid, "the order's payment is untouched");
    assert_eq!(
        taken_from_seller().await,
        0,
        "nothing taken from the seller"
    );
    let taken_back: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM payment_refunds), (SELECT count(*) FROM payment_disputes)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(taken_back, (0, 0));
    let waiting: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT event_id, waiting_for FROM payment_events WHERE outcome = 'waiting' ORDER BY event_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        waiting,
        [
            (
                "other_disputed".to_owned(),
                Some("payment:pay_other".to_owned())
            ),
            (
                "other_refunded".to_owned(),
                Some("payment:pay_other".to_owned())
            )
        ]
    );

    // The payment turns out to have been taken: a second payment, given back; the refund that
    // waited for it is its own.
    deliver(
        &app,
        "other_paid",
        &about("payment.succeeded", "sess_a", "pay_other", Some("10.00")),
    )
    .await;
    process_events(&pool).await;
    until_text(
        &pool,
        "the second payment's refund recorded against it",
        "SELECT amount_refunded::text FROM second_payments WHERE payment_id = 'pay_other'",
        "10.0000",
    )
    .await;
    assert_eq!(order(&pool).await, paid);
    assert_eq!(taken_from_seller().await, 0);
    let refunds: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_refunds")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refunds, 0, "none against the order's payment");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_success_without_an_amount_confirms_only_once_the_gateway_says_it(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver_ending(
        &app,
        "no_amount",
        &about("payment.succeeded", "sess_a", "pay_a", None),
        &["rejected"],
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
        &about_with(
            "refund.succeeded",
            "sess_b",
            "pay_b",
            json!({"refund_id": "rf_b", "amount": "3.00", "currency": "BRL"}),
        ),
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

/// Found by `payfleet soak`: a payment the simulator's page never took, reported by events its
/// secret signed (how a client paying by webhook, or a gateway's second charge, looks), could not
/// be given back: the simulator refused the refund and the job died. Now the simulator gives
/// back what its signed events reported: the second payment automatically, and the order's own
/// payment when the operator refunds it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn payments_reported_only_by_signed_events_are_given_back_by_the_simulator(pool: PgPool) {
    let shop = crate::checkout::shop(pool.clone()).await;
    let order = shop.one_order("20.00").await;
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    for (id, payment) in [("paid", "pay_signed"), ("paid_twice", "pay_twice")] {
        let body = about("payment.succeeded", &session, payment, Some("20.00"));
        let (status, answer) = shop.app.deliver(&internal(id, &body)).await;
        assert_eq!(status, 200, "{answer}");
    }
    until_text(
        &pool,
        "the second payment to be given back",
        "SELECT amount_refunded::text FROM second_payments WHERE payment_id = 'pay_twice'",
        "20.0000",
    )
    .await;
    assert_eq!(shop.order(1).await["status"], "paid");
    // The operator refunds part of the order's own payment: the simulator takes it.
    let refunded = shop
        .app
        .anon
        .post(format!("http://{}/admin/orders/1/refunds", shop.app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .header("idempotency-key", "rf-1")
        .json(&json!({"amount": "5.00"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refunded.status(), 201, "{}", refunded.text().await.unwrap());
    let given: Vec<(String, String)> =
        sqlx::query_as("SELECT payment_id, amount::text FROM internal_refunds ORDER BY payment_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        given,
        vec![
            ("pay_signed".to_owned(), "5.0000".to_owned()),
            ("pay_twice".to_owned(), "20.0000".to_owned())
        ]
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'discarded'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(dead, 0, "no refund job died");
}

/// A payment in another currency than its order's, reported by a signed event: no order takes
/// it, and the simulator gives it back whole (the refund is in the payment's currency).
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_in_another_currency_is_given_back_whole(pool: PgPool) {
    let shop = crate::checkout::shop(pool.clone()).await;
    let order = shop.one_order("20.00").await;
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    let body = json!({"type": "payment.succeeded", "data": {"session_id": session, "payment_id": "pay_usd", "amount": "20.00", "currency": "USD"}});
    let (status, answer) = shop.app.deliver(&internal("usd", &body.to_string())).await;
    assert_eq!(status, 200, "{answer}");
    until_text(
        &pool,
        "the payment to be given back",
        "SELECT amount::text FROM internal_refunds WHERE payment_id = 'pay_usd'",
        "20.0000",
    )
    .await;
    assert_eq!(shop.order(1).await["status"], "awaiting_payment");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn concurrent_refunds_with_one_key_give_every_caller_the_one_outcome(pool: PgPool) {
    let shop = crate::checkout::shop(pool.clone()).await;
    let order = shop.one_order("20.00").await;
    let url = order["payment"]["url"].as_str().unwrap();
    assert_eq!(shop.app.pay(url, "succeeded").await.0, 200);
    wait_for(
        "the order to be paid",
        std::time::Duration::from_secs(20),
        async || shop.order(1).await["status"] == "paid",
    )
    .await;
    let refund = |key: String| {
        shop.app
            .anon
            .post(format!("http://{}/admin/orders/1/refunds", shop.app.addr))
            .bearer_auth(ADMIN_TOKEN)
            .header("idempotency-key", key)
            .json(&json!({"amount": "1.00"}))
            .send()
    };
    // The internal gateway asked for one refund (one idempotency key) by many at once: one
    // refund, the same answer to each.
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let internal = gateways
        .get(payfleet::gateways::GatewayName::Internal)
        .unwrap();
    let (session, payment): (String, String) = sqlx::query_as(
        "SELECT session_id, payment_id FROM internal_payments WHERE status = 'succeeded'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let ask = payfleet::gateways::api::RefundRequest {
        session_id: session,
        payment_id: payment,
        amount: payfleet::money::Money::parse("1.00", "BRL").unwrap(),
        seller_account: None,
        idempotency_key: "one-refund".into(),
    };
    let answers = futures_util::future::join_all((0..8).map(|_| internal.refund(&ask))).await;
    let ids: std::collections::BTreeSet<String> = answers
        .into_iter()
        .map(|a| a.expect("every caller gets the refund").refund_id)
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    // The refund itself carried out by many at once (the request, its job, a repeat): the
    // gateway refunds once, and every one of them records that one refund.
    let new = payfleet::payments::order_refunds::NewRefund {
        amount: Some("1.00".into()),
        reason: String::new(),
    };
    let (request, _) = payfleet::payments::order_refunds::request(&pool, 1, "rf-direct", &new)
        .await
        .unwrap();
    let carried = futures_util::future::join_all(
        (0..8).map(|_| payfleet::payments::order_refunds::carry_out(&pool, &gateways, request.id)),
    )
    .await;
    for c in carried {
        match c.unwrap() {
            payfleet::payments::order_refunds::CarriedOut::Answered(v) => {
                assert_eq!(v.state.as_str(), "succeeded", "{v:?}")
            }
            other => panic!("{other:?}"),
        }
    }
    // Several rounds of eight callers at once, each round with a key of its own.
    for round in 0..5 {
        let key = format!("rf-{round}");
        let answers = futures_util::future::join_all((0..8).map(|_| refund(key.clone()))).await;
        let mut statuses = Vec::new();
        for a in answers {
            let a = a.unwrap();
            let status = a.status().as_u16();
            let body: serde_json::Value = a.json().await.unwrap();
            if status == 409 {
                assert_eq!(body["error"]["code"], "idempotency_key_in_use", "{body}");
            }
            statuses.push((status, body["error"]["message"].clone()));
        }
        assert!(
            statuses.iter().all(|(s, _)| [201, 202, 409].contains(s)),
            "no caller is told the refund was refused: {statuses:?}"
        );
        // Once it has an outcome, every repeat gets it: the one refund, recorded.
        let again = refund(key).await.unwrap();
        assert_eq!(again.status(), 201, "round {round}");
        let view: serde_json::Value = again.json().await.unwrap();
        assert_eq!(view["state"], "succeeded", "{view}");
    }
    let refunds: i64 = sqlx::query_scalar("SELECT count(*) FROM internal_refunds")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refunds, 7, "the gateway refunded once per key");
    wait_for(
        "the refund to be recorded",
        std::time::Duration::from_secs(20),
        async || shop.order(1).await["amount_refunded"] == "7.00",
    )
    .await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_the_gateway_fails_later_ends_failed_and_frees_its_amount(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "paid",
        &about("payment.succeeded", "sess_a", "pay_a", Some("10.00")),
    )
    .await;
    // The gateway accepted a refund of the whole amount; it will report its outcome later.
    sqlx::query(
        "INSERT INTO refund_requests (idempotency_key, order_number, gateway, session_id, payment_id, amount, currency, state, refund_id)
         VALUES ('rf-1', 1, 'internal', 'sess_a', 'pay_a', 10, 'BRL', 'accepted', 'rf_late')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let ask = |key: &'static str| {
        let req = payfleet::payments::order_refunds::NewRefund {
            amount: Some("10.00".into()),
            reason: String::new(),
        };
        let pool = pool.clone();
        async move { payfleet::payments::order_refunds::request(&pool, 1, key, &req).await }
    };
    assert!(
        matches!(
            ask("rf-2").await,
            Err(payfleet::payments::order_refunds::RefundError::Exceeds { .. })
        ),
        "the accepted refund holds its amount"
    );
    deliver(
        &app,
        "refund_failed",
        &about_with(
            "refund.failed",
            "sess_a",
            "pay_a",
            json!({"refund_id": "rf_late"}),
        ),
    )
    .await;
    let (state, failure): (String, Option<String>) =
        sqlx::query_as("SELECT state, failure FROM refund_requests WHERE idempotency_key = 'rf-1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state, "failed");
    assert!(failure.unwrap().contains("failed"));
    // A report of its success delivered late (a retry from before it failed) changes nothing:
    // a refund the gateway ended never moves money.
    deliver(
        &app,
        "refund_succeeded_late",
        &about_with(
            "refund.succeeded",
            "sess_a",
            "pay_a",
            json!({"refund_id": "rf_late", "amount": "10.00", "currency": "BRL"}),
        ),
    )
    .await;
    assert_eq!(
        order(&pool).await,
        ("paid".into(), "succeeded".into(), "0.0000".into()),
        "nothing was refunded"
    );
    // Its amount is free: the whole payment may be refunded again.
    let (again, written) = ask("rf-3").await.unwrap();
    assert!(written);
    assert_eq!(again.amount.to_string(), "10.00");
    assert_eq!(
        findings_of(&pool, "refund_failed_after_done").await,
        vec![],
        "no refund recorded done was reported failed"
    );
}

/// The other order: a refund recorded as done (the seller debited, the order refunded), which
/// the gateway then reports failed. The buyer may not have the money back, and the platform
/// holds it: the consistency check shows it to an operator, with the order and the refund.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_reported_failed_after_it_was_recorded_done_is_shown_to_an_operator(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "paid",
        &about("payment.succeeded", "sess_a", "pay_a", Some("10.00")),
    )
    .await;
    deliver(
        &app,
        "refunded",
        &about_with(
            "refund.succeeded",
            "sess_a",
            "pay_a",
            json!({"refund_id": "rf_1", "amount": "4.00", "currency": "BRL"}),
        ),
    )
    .await;
    for (name, kind) in [
        ("failed", "refund.failed"),
        ("failed_again", "refund.failed"),
    ] {
        deliver(
            &app,
            name,
            &about_with(kind, "sess_a", "pay_a", json!({"refund_id": "rf_1"})),
        )
        .await;
    }
    let found = findings_of(&pool, "refund_failed_after_done").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, "order 1, internal refund rf_1");
    assert!(found[0].1.contains("reported failed"), "{}", found[0].1);
    // The operator pays the buyer back another way and says so: the finding closes, once.
    let repaid = |refund: &'static str| {
        let pool = pool.clone();
        async move {
            payfleet::payments::order_refunds::repaid_elsewhere(
                &pool,
                payfleet::gateways::GatewayName::Internal,
                refund,
            )
            .await
            .unwrap()
        }
    };
    assert!(!repaid("rf_unknown").await, "no such refund");
    assert!(repaid("rf_1").await);
    assert!(!repaid("rf_1").await, "once");
    assert_eq!(
        findings_of(&pool, "refund_failed_after_done").await,
        vec![],
        "no refund recorded done was reported failed"
    );
}

/// A second payment's give-back the gateway reports failed is ended for good too: a report of
/// its success delivered after that records nothing against the second payment.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_second_payments_refund_reported_failed_is_not_recorded_by_a_late_success(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "first",
        &about("payment.succeeded", "sess_a", "pay_first", Some("10.00")),
    )
    .await;
    deliver(
        &app,
        "second",
        &about("payment.succeeded", "sess_a", "pay_second", Some("10.00")),
    )
    .await;
    deliver(
        &app,
        "second_refund_failed",
        &about_with(
            "refund.failed",
            "sess_a",
            "pay_second",
            json!({"refund_id": "rf_second"}),
        ),
    )
    .await;
    deliver(
        &app,
        "second_refunded_late",
        &about_with(
            "refund.succeeded",
            "sess_a",
            "pay_second",
            json!({"refund_id": "rf_second", "amount": "10.00", "currency": "BRL"}),
        ),
    )
    .await;
    let (refunded, ended): (String, i64) = sqlx::query_as(
        "SELECT (SELECT amount_refunded::text FROM second_payments WHERE payment_id = 'pay_second'),
                (SELECT count(*) FROM refunds_ended WHERE refund_id = 'rf_second')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((refunded.as_str(), ended), ("0.0000", 1));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_late_payment_given_back_is_recorded_even_when_its_webhook_is_lost(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    // The internal gateway took the payment (its record), after the order expired.
    sqlx::query(
        "INSERT INTO internal_payments (session_id, gateway, order_number, attempt, amount, currency, metadata, status, payment_id, decided_at)
         VALUES ('sess_a', 'internal', 1, 1, 10, 'BRL', '{}', 'succeeded', 'pay_a', now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    payfleet::orders::expire_now(&pool, 1).await.unwrap();
    step(&pool, &app.config, "orders").await;
    deliver(
        &app,
        "late",
        &about("payment.succeeded", "sess_a", "pay_a", Some("10.00")),
    )
    .await;
    // The refund job runs where the gateway's events go nowhere: its webhook is lost for good.
    let mut lost = app.config.clone();
    lost.gateways.hosted.internal_webhook_url = "http://127.0.0.1:9/webhooks/internal".into();
    step(&pool, &lost, "payments").await;
    let refunds: i64 = sqlx::query_scalar("SELECT count(*) FROM internal_refunds")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refunds, 1, "the buyer has the money back");
    let o = order(&pool).await;
    assert_eq!(
        (o.0.as_str(), o.1.as_str()),
        ("expired", "refunded"),
        "and the order says so, without the refund's webhook"
    );
    let refunded: String = sqlx::query_scalar(
        "SELECT amount_refunded::text FROM payment_orders WHERE session_id = 'sess_a'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(refunded, "10.0000");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_of_the_wrong_amount_is_given_back_once_whatever_follows(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "short",
        &about("payment.succeeded", "sess_a", "pay_a", Some("1.00")),
    )
    .await;
    assert_eq!(
        refund_jobs(&pool).await,
        vec!["refund_payment:internal:sess_a"]
    );
    // The refund job ran (its row is gone), then more events of the session arrive.
    sqlx::query("DELETE FROM jobs WHERE kind = 'refund_payment'")
        .execute(&pool)
        .await
        .unwrap();
    deliver(
        &app,
        "short_again",
        &about("payment.succeeded", "sess_a", "pay_a", Some("1.00")),
    )
    .await;
    deliver(
        &app,
        "dispute",
        &about_with(
            "dispute.created",
            "sess_a",
            "pay_a",
            json!({"dispute_id": "dp_1", "amount": "1.00", "currency": "BRL"}),
        ),
    )
    .await;
    assert!(
        refund_jobs(&pool).await.is_empty(),
        "not asked for again: {:?}",
        refund_jobs(&pool).await
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dispute_left_open_past_any_decision_is_shown_to_an_operator(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "paid",
        &about("payment.succeeded", "sess_a", "pay_a", Some("10.00")),
    )
    .await;
    for (id, dispute) in [("d1", "dp_old"), ("d2", "dp_new")] {
        deliver(
            &app,
            id,
            &about_with(
                "dispute.created",
                "sess_a",
                "pay_a",
                json!({"dispute_id": dispute, "amount": "2.00", "currency": "BRL"}),
            ),
        )
        .await;
    }
    sqlx::query("UPDATE payment_disputes SET updated_at = now() - interval '80 days' WHERE dispute_id = 'dp_old'")
        .execute(&pool)
        .await
        .unwrap();
    let findings = payfleet::consistency::check(&pool, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    let undecided: Vec<&str> = findings
        .iter()
        .filter(|f| f.check == "dispute_undecided")
        .map(|f| f.subject.as_str())
        .collect();
    assert_eq!(undecided, vec!["internal dispute dp_old"]);
}

/// Found by the hour-long soak: an order paid in time was expired when its payment's
/// processing came after its expiry (workers restarting, the database away). Its expiry now
/// waits while events received before its time are unprocessed (of any gateway: an internal
/// order collected through Stripe is paid by Stripe's), so the payment confirms it; an event
/// stuck for longer than the grace (ten minutes) holds nothing back.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_received_before_expiry_confirms_the_order_even_when_processed_after(
    pool: PgPool,
) {
    use payfleet::orders::expiry::{Expiry, expire};
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a", "sess_b"], "10.00", "BRL").await;
    // Order 1's payment is received (stored, not processed yet), then its time passes.
    let (status, answer) = app
        .deliver(&internal(
            "in_time",
            &about("payment.succeeded", "sess_a", "pay_a", Some("10.00")),
        ))
        .await;
    assert_eq!(status, 200, "{answer}");
    sqlx::query(
        "UPDATE orders SET expires_at = (SELECT received_at FROM payment_events WHERE event_id = 'in_time') + interval '1 millisecond'
         WHERE number IN (1, 2)",
    )
    .execute(&pool)
    .await
    .unwrap();
    for number in [1, 2] {
        assert!(
            matches!(expire(&pool, number).await.unwrap(), Expiry::NotYet(_)),
            "order {number} waits for the events received before its time"
        );
    }
    process_events(&pool).await;
    assert_eq!(order(&pool).await.0, "paid");
    // Order 2 had no payment among them: once they are processed it expires.
    assert_eq!(expire(&pool, 2).await.unwrap(), Expiry::Expired);

    // An event stuck (unprocessed) for longer than the grace holds no expiry back.
    orders_for(&pool, "internal", &["sess_c"], "10.00", "BRL").await;
    sqlx::query(
        "INSERT INTO payment_events (gateway, event_id, event_type, raw_body, received_at)
         VALUES ('internal', 'stuck', 'payment.succeeded', '\\x7b7d', now() - interval '30 minutes')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE orders SET expires_at = now() - interval '20 minutes' WHERE number = 3")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(expire(&pool, 3).await.unwrap(), Expiry::Expired);
    // Nor, within the grace, one received before the order existed: it cannot be its payment.
    orders_for(&pool, "internal", &["sess_d"], "10.00", "BRL").await;
    sqlx::query(
        "UPDATE orders SET created_at = now() - interval '5 minutes', expires_at = now() - interval '1 minute'
         WHERE number = 4",
    )
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(expire(&pool, 4).await.unwrap(), Expiry::Expired);
}

/// An internal order collected through Stripe is paid by Stripe's events, stored under
/// Stripe's name until processing tells whose they are: one received in time holds the order's
/// expiry back as its own gateway's would.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_event_of_another_gateway_received_in_time_holds_the_expiry_back_too(pool: PgPool) {
    use payfleet::orders::expiry::{Expiry, expire};
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    sqlx::query(
        "UPDATE orders SET created_at = now() - interval '30 minutes', expires_at = now() - interval '30 seconds'
         WHERE number = 1",
    )
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO payment_events (gateway, event_id, event_type, raw_body, received_at)
         VALUES ('stripe', 'evt_in_time', 'checkout.session.completed', '\\x7b7d', now() - interval '1 minute')",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert!(matches!(expire(&pool, 1).await.unwrap(), Expiry::NotYet(_)));
}

/// A refund asked for while its payment was paid, whose gateway did not answer at once (its job
/// asks again later), may meet a dispute opened meanwhile. Asked then, the gateway would give
/// the buyer the refund beside the chargeback: the refund waits while the dispute is open, is
/// made once it is won, or lost for only part of the payment with room left for the refund, and
/// ends failed, never asked, once a lost dispute leaves it no room.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_asked_for_before_a_dispute_waits_for_its_end(pool: PgPool) {
    use payfleet::payments::order_refunds::{self, CarriedOut, NewRefund};
    let shop = crate::checkout::shop(pool.clone()).await;
    let first = shop.one_order("20.00").await;
    let product = first["items"][0]["product_id"].as_str().unwrap().to_owned();
    let (status, second) = shop
        .checkout(
            Some("k-second"),
            json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{second}");
    let second = second["orders"][0].clone();
    let (status, third) = shop
        .checkout(
            Some("k-third"),
            json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{third}");
    let third = third["orders"][0].clone();
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let refunds = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM internal_refunds")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let mut asked = Vec::new();
    for (order, outcome) in [(&first, "won"), (&second, "lost"), (&third, "lost-in-part")] {
        let number = order["number"].as_i64().unwrap();
        let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
        pay_and_wait(&shop, order).await;
        let new = NewRefund {
            amount: Some("5.00".into()),
            reason: String::new(),
        };
        let (request, written) =
            order_refunds::request(&pool, number, &format!("rf-{outcome}"), &new)
                .await
                .unwrap();
        assert!(written);
        let payment: String =
            sqlx::query_scalar("SELECT payment_id FROM internal_payments WHERE session_id = $1")
                .bind(&session)
                .fetch_one(&pool)
                .await
                .unwrap();
        asked.push((request.id, session, payment, outcome));
    }
    // Of the 20.00 paid, the dispute takes all, or 10.00 (leaving room for the 5.00 refund).
    let dispute = |kind: &str, session: &str, payment: &str, outcome: &str| {
        let amount = if outcome == "lost-in-part" {
            "10.00"
        } else {
            "20.00"
        };
        about_with(
            kind,
            session,
            payment,
            json!({"dispute_id": format!("dp_{session}"), "amount": amount, "currency": "BRL"}),
        )
    };
    let dispute_is = async |session: &str, status: &str| {
        let want = status.to_owned();
        wait_for(
            "the dispute's state",
            std::time::Duration::from_secs(30),
            async || {
                let got: Option<String> = sqlx::query_scalar(
                    "SELECT status FROM payment_disputes WHERE dispute_id = 'dp_' || $1",
                )
                .bind(session)
                .fetch_optional(&pool)
                .await
                .unwrap();
                got.as_deref() == Some(want.as_str())
            },
        )
        .await;
    };
    for (id, session, payment, outcome) in &asked {
        let (status, answer) = shop
            .app
            .deliver(&internal(
                &format!("open-{outcome}"),
                &dispute("dispute.created", session, payment, outcome),
            ))
            .await;
        assert_eq!(status, 200, "{answer}");
        dispute_is(session, "open").await;
        // Open: the gateway is not asked, and the request still waits.
        match order_refunds::carry_out(&pool, &gateways, *id)
            .await
            .unwrap()
        {
            CarriedOut::Held(view) => assert_eq!(view.state.as_str(), "requested"),
            other => panic!("{other:?}"),
        }
        assert_eq!(refunds().await, 0);
    }
    for (id, session, payment, outcome) in &asked {
        let ended = if *outcome == "won" { "won" } else { "lost" };
        let (status, answer) = shop
            .app
            .deliver(&internal(
                &format!("end-{outcome}"),
                &dispute(&format!("dispute.{ended}"), session, payment, outcome),
            ))
            .await;
        assert_eq!(status, 200, "{answer}");
        dispute_is(session, ended).await;
        let view = match order_refunds::carry_out(&pool, &gateways, *id)
            .await
            .unwrap()
        {
            CarriedOut::Answered(view) => view,
            other => panic!("{other:?}"),
        };
        match *outcome {
            // Won, or lost in part with room left: the refund is made.
            "won" | "lost-in-part" => assert_eq!(view.state.as_str(), "succeeded", "{view:?}"),
            // Lost: the chargeback gave the buyer the money; the refund is never asked for.
            _ => {
                assert_eq!(view.state.as_str(), "failed", "{view:?}");
                assert!(
                    view.failure
                        .as_deref()
                        .is_some_and(|f| f.contains("dispute")),
                    "{view:?}"
                );
            }
        }
    }
    assert_eq!(refunds().await, 2, "the lost dispute's refund was not made");
}

/// A refund asked of the gateway whose answer was lost, and then a dispute of the payment that
/// the seller lost: the refund may have been made before the chargeback took the money too. The
/// request is not asked again (that could give the buyer the money a second time), and it is
/// not ended as a refund never made either: it ends unanswered, reported for an operator and
/// held back from the seller's payouts as every unanswered refund is.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_asked_unanswered_before_a_lost_dispute_stays_reported(pool: PgPool) {
    use payfleet::payments::order_refunds::{self, CarriedOut, NewRefund};
    let shop = crate::checkout::shop(pool.clone()).await;
    let order = shop.one_order("20.00").await;
    pay_and_wait(&shop, &order).await;
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    let new = NewRefund {
        amount: Some("5.00".into()),
        reason: String::new(),
    };
    let (request, _) = order_refunds::request(&pool, 1, "rf-lost-ask", &new)
        .await
        .unwrap();
    // Asked an hour ago, its answer lost; its job is not running now.
    asked_unanswered(&pool, request.id, 1).await;
    let payment: String =
        sqlx::query_scalar("SELECT payment_id FROM internal_payments WHERE session_id = $1")
            .bind(&session)
            .fetch_one(&pool)
            .await
            .unwrap();
    for (id, kind) in [("dp-open", "dispute.created"), ("dp-lost", "dispute.lost")] {
        let body = about_with(
            kind,
            &session,
            &payment,
            json!({"dispute_id": "dp_1", "amount": "20.00", "currency": "BRL"}),
        );
        deliver_ending(&shop.app, id, &body, &[]).await;
    }
    wait_for(
        "the dispute lost",
        std::time::Duration::from_secs(30),
        async || {
            sqlx::query_scalar::<_, String>("SELECT status FROM payment_disputes")
                .fetch_optional(&pool)
                .await
                .unwrap()
                .as_deref()
                == Some("lost")
        },
    )
    .await;
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let view = match order_refunds::carry_out(&pool, &gateways, request.id)
        .await
        .unwrap()
    {
        CarriedOut::Answered(view) => view,
        other => panic!("{other:?}"),
    };
    assert_eq!(view.state.as_str(), "failed", "{view:?}");
    assert!(view.unanswered(), "{view:?}");
    let refunds: i64 = sqlx::query_scalar("SELECT count(*) FROM internal_refunds")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refunds, 0, "the gateway was asked again");
    let found = findings_of(&pool, "refund_unconfirmed").await;
    assert_eq!(found.len(), 1, "{found:?}");
}

/// A refund the gateway took but kept pending past its settling job's attempts, whose event was
/// then lost, stays `accepted`, its amount held from the seller's payouts. Asking for it again
/// (its Idempotency-Key) re-drives it: the gateway is asked about it again.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_accepted_refund_whose_job_ended_is_asked_about_again_when_asked_for_again(
    pool: PgPool,
) {
    let shop = crate::checkout::shop(pool.clone()).await;
    let order = shop.one_order("20.00").await;
    pay_and_wait(&shop, &order).await;
    let new = payfleet::payments::order_refunds::NewRefund {
        amount: Some("5.00".into()),
        reason: String::new(),
    };
    let (request, _) = payfleet::payments::order_refunds::request(&pool, 1, "rf-slow", &new)
        .await
        .unwrap();
    // As the gateway left it: accepted, pending, and no job asking about it any more.
    sqlx::query(
        "UPDATE refund_requests SET state = 'accepted', refund_id = 'rf_pending' WHERE id = $1",
    )
    .bind(request.id)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM jobs WHERE kind IN ('carry_out_refund', 'settle_refund')")
        .execute(&pool)
        .await
        .unwrap();
    let settling = async || -> Vec<String> {
        sqlx::query_scalar(
            "SELECT key FROM jobs WHERE kind = 'settle_refund' AND state IN ('available', 'running', 'retryable')",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    assert!(settling().await.is_empty());
    let again = shop
        .app
        .anon
        .post(format!("http://{}/admin/orders/1/refunds", shop.app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .header("idempotency-key", "rf-slow")
        .json(&json!({"amount": "5.00"}))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 202);
    let view: serde_json::Value = again.json().await.unwrap();
    assert_eq!(view["state"], "accepted", "{view}");
    assert_eq!(settling().await, vec!["settle_refund:internal:rf_pending"]);
    // Asked again while that job waits: still one.
    let (_, _) = payfleet::payments::order_refunds::request(&pool, 1, "rf-slow", &new)
        .await
        .unwrap();
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    payfleet::payments::order_refunds::carry_out(&pool, &gateways, request.id)
        .await
        .unwrap();
    assert_eq!(settling().await.len(), 1);
}

/// A refund request whose gateway answer never came is asked again, under the same key, only
/// while the gateway still keeps that key: asked again past it (an operator's job retry a day
/// later, a dispute's hold ending), the gateway may have forgotten the key and would make a
/// second refund of one the first ask made. So past it the request ends failed, saying why, and
/// the gateway is not asked.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_whose_answer_never_came_is_not_asked_again_once_the_gateway_may_forget_its_key(
    pool: PgPool,
) {
    let shop = crate::checkout::shop(pool.clone()).await;
    let order = shop.one_order("20.00").await;
    pay_and_wait(&shop, &order).await;
    let new = payfleet::payments::order_refunds::NewRefund {
        amount: Some("5.00".into()),
        reason: String::new(),
    };
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let refunds = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payment_refunds")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    // Each asked once before, its answer lost: one an hour ago, one 21 hours ago.
    let mut requests = Vec::new();
    for hours in [1i32, 21] {
        let (request, _) =
            payfleet::payments::order_refunds::request(&pool, 1, &format!("rf-lost-{hours}"), &new)
                .await
                .unwrap();
        asked_unanswered(&pool, request.id, hours).await;
        requests.push(request.id);
    }
    let state_of = async |id: i64| -> (String, Option<String>) {
        sqlx::query_as("SELECT state, failure FROM refund_requests WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let first_asked = async |id: i64| -> Option<chrono::DateTime<chrono::Utc>> {
        sqlx::query_scalar("SELECT first_asked_at FROM refund_requests WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = first_asked(requests[0]).await;
    // Within the window: asked again, and made; its first ask stays the first.
    payfleet::payments::order_refunds::carry_out(&pool, &gateways, requests[0])
        .await
        .unwrap();
    assert_eq!(state_of(requests[0]).await.0, "succeeded");
    assert_eq!(refunds().await, 1);
    assert_eq!(first_asked(requests[0]).await, before);
    // Past it: not asked; ended for an operator, saying why.
    payfleet::payments::order_refunds::carry_out(&pool, &gateways, requests[1])
        .await
        .unwrap();
    let (state, failure) = state_of(requests[1]).await;
    assert_eq!(state, "failed");
    let failure = failure.unwrap_or_default();
    assert!(
        failure.contains("idempotency key") && failure.contains("refund twice"),
        "{failure}"
    );
    assert_eq!(refunds().await, 1, "the gateway was asked again");
    // Shown to an operator, who looks at the gateway.
    let found = findings_of(&pool, "refund_unconfirmed").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        found[0].0,
        format!("order 1, refund request {}", requests[1])
    );
    // Asked for again with its key: told it ended unconfirmed, not that the gateway refused.
    let again = shop
        .app
        .anon
        .post(format!("http://{}/admin/orders/1/refunds", shop.app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .header("idempotency-key", "rf-lost-21")
        .json(&json!({"amount": "5.00"}))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 422);
    let body: serde_json::Value = again.json().await.unwrap();
    assert_eq!(body["error"]["code"], "refund_unconfirmed", "{body}");
    assert_eq!(refunds().await, 1, "the gateway was asked again");
    // A request never asked is asked however old it is, and its first ask is stamped.
    let (third, _) = payfleet::payments::order_refunds::request(&pool, 1, "rf-new", &new)
        .await
        .unwrap();
    assert_eq!(first_asked(third.id).await, None);
    sqlx::query("UPDATE refund_requests SET created_at = now() - interval '2 days' WHERE id = $1")
        .bind(third.id)
        .execute(&pool)
        .await
        .unwrap();
    payfleet::payments::order_refunds::carry_out(&pool, &gateways, third.id)
        .await
        .unwrap();
    assert_eq!(state_of(third.id).await.0, "succeeded");
    assert_eq!(refunds().await, 2);
    assert!(first_asked(third.id).await.is_some());
    // Another request's refund of the same amount is that request's: still shown.
    assert_eq!(findings_of(&pool, "refund_unconfirmed").await.len(), 1);
    // The gateway's event for the refund the lost ask made: recorded, and the finding goes.
    let session = order["payment"]["session_id"].as_str().unwrap();
    let payment: String = sqlx::query_scalar("SELECT payment_id FROM payment_orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    deliver_ending(
        &shop.app,
        "refund-of-the-lost-ask",
        &about_with(
            "refund.succeeded",
            session,
            &payment,
            json!({"refund_id": "irf_lost", "amount": "5.00", "currency": "BRL"}),
        ),
        &[],
    )
    .await;
    wait_for(
        "the lost ask's refund recorded",
        std::time::Duration::from_secs(30),
        async || refunds().await == 3,
    )
    .await;
    assert!(findings_of(&pool, "refund_unconfirmed").await.is_empty());
}

/// A refund request still under way days after it last moved (its jobs ran out of attempts, its
/// event was lost) holds its amount from the seller's payouts: it is a finding, with how to
/// re-drive it, until it is recorded; one held on purpose by an open dispute is not.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_under_way_for_days_is_shown_to_an_operator_until_it_is_recorded(pool: PgPool) {
    let shop = crate::checkout::shop(pool.clone()).await;
    let order = shop.one_order("20.00").await;
    pay_and_wait(&shop, &order).await;
    let new = payfleet::payments::order_refunds::NewRefund {
        amount: Some("5.00".into()),
        reason: String::new(),
    };
    let (request, _) = payfleet::payments::order_refunds::request(&pool, 1, "rf-stuck", &new)
        .await
        .unwrap();
    assert!(
        findings_of(&pool, "refund_under_way_too_long")
            .await
            .is_empty()
    );
    // Its jobs gave up long ago.
    sqlx::query("DELETE FROM jobs WHERE kind = 'carry_out_refund'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE refund_requests SET created_at = now() - interval '4 days', updated_at = now() - interval '4 days' WHERE id = $1")
        .bind(request.id)
        .execute(&pool)
        .await
        .unwrap();
    let found = findings_of(&pool, "refund_under_way_too_long").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        found[0].0,
        format!("order 1, refund request {}", request.id)
    );
    assert!(found[0].1.contains("Idempotency-Key rf-stuck"), "{found:?}");
    // Asked for again with its key: the gateway is asked, the refund recorded, the finding gone.
    let again = shop
        .app
        .anon
        .post(format!("http://{}/admin/orders/1/refunds", shop.app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .header("idempotency-key", "rf-stuck")
        .json(&json!({"amount": "5.00"}))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 201);
    assert!(
        findings_of(&pool, "refund_under_way_too_long")
            .await
            .is_empty()
    );
    // One held on purpose, its payment's dispute open, is not reported.
    let (held, _) = payfleet::payments::order_refunds::request(&pool, 1, "rf-held", &new)
        .await
        .unwrap();
    sqlx::query("DELETE FROM jobs WHERE kind = 'carry_out_refund'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE refund_requests SET created_at = now() - interval '4 days', updated_at = now() - interval '4 days' WHERE id = $1")
        .bind(held.id)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        findings_of(&pool, "refund_under_way_too_long").await.len(),
        1
    );
    let session = order["payment"]["session_id"].as_str().unwrap();
    let payment: String =
        sqlx::query_scalar("SELECT payment_id FROM internal_payments WHERE session_id = $1")
            .bind(session)
            .fetch_one(&pool)
            .await
            .unwrap();
    let (status, answer) = shop
        .app
        .deliver(&internal(
            "held-dispute",
            &about_with(
                "dispute.created",
                session,
                &payment,
                json!({"dispute_id": "dp_held", "amount": "5.00", "currency": "BRL"}),
            ),
        ))
        .await;
    assert_eq!(status, 200, "{answer}");
    wait_for(
        "the dispute open",
        std::time::Duration::from_secs(30),
        async || {
            findings_of(&pool, "refund_under_way_too_long")
                .await
                .is_empty()
        },
    )
    .await;
}

/// A payment to give back (late, extra, of the wrong amount) that its buyer disputed before the
/// give-back reached the gateway: while the dispute is open the gateway is not asked, and once
/// the chargeback has taken it back there is nothing left to give.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_give_back_waits_for_its_payments_dispute_and_gives_nothing_once_it_is_lost(
    pool: PgPool,
) {
    use payfleet::payments::RefundPayment;
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    deliver(
        &app,
        "paid",
        &about("payment.succeeded", "sess_a", "pay_a", Some("10.00")),
    )
    .await;
    let (gateways, _) = payfleet::startup::gateways(&app.config, &pool).unwrap();
    let give_back = RefundPayment {
        gateway: payfleet::gateways::GatewayName::Internal,
        order_number: Some(1),
        session_id: "sess_a".into(),
        payment_id: Some("pay_a".into()),
        amount: Some(payfleet::money::Money::parse("10.00", "BRL").unwrap()),
        seller_account: None,
        reason: "a payment after the order expired".into(),
        of_payment: false,
    };
    let dispute = |kind: &str| {
        about_with(
            kind,
            "sess_a",
            "pay_a",
            json!({"dispute_id": "dp_a", "amount": "10.00", "currency": "BRL"}),
        )
    };
    deliver(&app, "opened", &dispute("dispute.created")).await;
    match give_back.run(&pool, &gateways).await {
        Err(payfleet_queue::JobError::Snooze(_)) => {}
        other => panic!("held while the dispute is open: {other:?}"),
    }
    deliver(&app, "lost", &dispute("dispute.lost")).await;
    give_back.run(&pool, &gateways).await.unwrap();
    let refunds: i64 = sqlx::query_scalar("SELECT count(*) FROM internal_refunds")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        refunds, 0,
        "the chargeback gave it back; the gateway was never asked"
    );
}

/// A payment taken twice is what buyers dispute. A second payment's dispute is recorded against
/// it, never against the order (the seller's sale is the first payment's): while it is open the
/// second payment's give-back waits, once won the give-back is made, once lost nothing is given
/// (the chargeback gave it). A dispute of a second payment given back already is shown to an
/// operator, to contest with the refund; one open for months too. Before, a second payment's
/// disputes were dropped: the give-back paid the buyer beside the chargeback, unseen.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_second_payments_dispute_holds_its_give_back_and_is_seen_once_it_was_given_back(
    pool: PgPool,
) {
    use payfleet::payments::RefundPayment;
    let app = spawn_app(pool.clone()).await;
    simulated_order(&pool, "sess_a", "10.00").await;
    deliver(
        &app,
        "first",
        &about("payment.succeeded", "sess_a", "pay_first", Some("10.00")),
    )
    .await;
    let (gateways, _) = payfleet::startup::gateways(&app.config, &pool).unwrap();
    let give_back = |payment: &str| RefundPayment {
        gateway: payfleet::gateways::GatewayName::Internal,
        order_number: Some(1),
        session_id: "sess_a".into(),
        payment_id: Some(payment.into()),
        amount: Some(payfleet::money::Money::parse("10.00", "BRL").unwrap()),
        seller_account: None,
        reason: format!("a second payment ({payment}) on session sess_a"),
        of_payment: true,
    };
    let dispute = |kind: &str, payment: &str, id: &str| {
        about_with(
            kind,
            "sess_a",
            payment,
            json!({"dispute_id": id, "amount": "10.00", "currency": "BRL"}),
        )
    };
    let given_back = async |payment: &str| -> Vec<String> {
        sqlx::query_scalar("SELECT amount::text FROM internal_refunds WHERE payment_id = $1")
            .bind(payment)
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    for (payment, decided) in [("pay_second", "dispute.won"), ("pay_third", "dispute.lost")] {
        deliver(
            &app,
            &format!("{payment}_paid"),
            &about("payment.succeeded", "sess_a", payment, Some("10.00")),
        )
        .await;
        let id = format!("dp_{payment}");
        deliver(
            &app,
            &format!("{payment}_disputed"),
            &dispute("dispute.created", payment, &id),
        )
        .await;
        let status: String =
            sqlx::query_scalar("SELECT status FROM second_payment_disputes WHERE dispute_id = $1")
                .bind(&id)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(status, "open");
        match give_back(payment).run(&pool, &gateways).await {
            Err(payfleet_queue::JobError::Snooze(_)) => {}
            other => panic!("held while its dispute is open: {other:?}"),
        }
        assert!(given_back(payment).await.is_empty());
        deliver(
            &app,
            &format!("{payment}_decided"),
            &dispute(decided, payment, &id),
        )
        .await;
        give_back(payment).run(&pool, &gateways).await.unwrap();
    }
    assert_eq!(
        given_back("pay_second").await,
        vec!["10.0000"],
        "won: given back"
    );
    assert!(
        given_back("pay_third").await.is_empty(),
        "lost: the chargeback gave it back; the gateway was never asked"
    );
    // None of it was the order's: its payment and the seller's sale stand.
    assert_eq!(
        order(&pool).await,
        ("paid".into(), "succeeded".into(), "0.0000".into())
    );
    let order_disputes: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_disputes")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(order_disputes, 0);
    assert!(
        !events_of_order(&pool)
            .await
            .contains(&"charged_back".to_owned())
    );
    // Each payment's disputes are its own: one open on pay_fifth holds nothing of pay_sixth's.
    // And a dispute lost for part of a payment leaves the rest to give back.
    for payment in ["pay_fifth", "pay_sixth", "pay_seventh"] {
        deliver(
            &app,
            &format!("{payment}_paid"),
            &about("payment.succeeded", "sess_a", payment, Some("10.00")),
        )
        .await;
    }
    deliver(
        &app,
        "fifth_disputed",
        &dispute("dispute.created", "pay_fifth", "dp_fifth"),
    )
    .await;
    give_back("pay_sixth").run(&pool, &gateways).await.unwrap();
    assert_eq!(given_back("pay_sixth").await, vec!["10.0000"]);
    deliver(
        &app,
        "seventh_lost_in_part",
        &about_with(
            "dispute.lost",
            "sess_a",
            "pay_seventh",
            json!({"dispute_id": "dp_seventh", "amount": "4.00", "currency": "BRL"}),
        ),
    )
    .await;
    give_back("pay_seventh")
        .run(&pool, &gateways)
        .await
        .unwrap();
    assert_eq!(given_back("pay_seventh").await, vec!["6.0000"]);
    match give_back("pay_fifth").run(&pool, &gateways).await {
        Err(payfleet_queue::JobError::Snooze(_)) => {}
        other => panic!("held while its dispute is open: {other:?}"),
    }

    // Given back, then disputed: the buyer would be paid twice. An operator sees it.
    deliver(
        &app,
        "fourth_paid",
        &about("payment.succeeded", "sess_a", "pay_fourth", Some("10.00")),
    )
    .await;
    deliver(
        &app,
        "fourth_given_back",
        &about_with(
            "refund.succeeded",
            "sess_a",
            "pay_fourth",
            json!({"refund_id": "rf_fourth", "amount": "10.00", "currency": "BRL"}),
        ),
    )
    .await;
    assert!(
        findings_of(&pool, "taken_back_beyond_payment")
            .await
            .is_empty()
    );
    deliver(
        &app,
        "fourth_disputed",
        &dispute("dispute.created", "pay_fourth", "dp_fourth"),
    )
    .await;
    let found = findings_of(&pool, "taken_back_beyond_payment").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].0.contains("pay_fourth"), "{found:?}");
    // Open for over a week (reconciliation does not ask about it): its decision's event was
    // lost, and its give-back waits.
    assert!(findings_of(&pool, "dispute_undecided").await.is_empty());
    sqlx::query(
        "UPDATE second_payment_disputes SET updated_at = now() - interval '8 days' WHERE dispute_id = 'dp_fourth'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let undecided = findings_of(&pool, "dispute_undecided").await;
    assert!(
        undecided.len() == 1 && undecided[0].0.contains("dp_fourth"),
        "{undecided:?}"
    );
}

/// A payment no order could take (here of the wrong amount) is given back once, as it comes;
/// once that give-back's job ended dead and was deleted, the unmatched payment is the finding
/// and `payfleet money give-back` asks the gateway again, under the first give-back's key.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_of_the_wrong_amount_not_given_back_is_given_back_again_by_an_operator(
    pool: PgPool,
) {
    use payfleet::gateways::GatewayName;
    use payfleet::payments::{GiveBackError, give_back_again};
    let app = spawn_app(pool.clone()).await;
    simulated_order(&pool, "sess_w", "19.90").await;
    deliver(
        &app,
        "wrong",
        &about("payment.succeeded", "sess_w", "pay_w", Some("1.00")),
    )
    .await;
    assert_eq!(refund_jobs(&pool).await.len(), 1);
    // Its give-back died, and its dead job was deleted a week later.
    sqlx::query("DELETE FROM jobs WHERE kind = 'refund_payment'")
        .execute(&pool)
        .await
        .unwrap();
    let found = findings_of(&pool, "captured_payment_unconfirmed").await;
    assert!(
        found
            .iter()
            .any(|(s, d)| s.contains("sess_w")
                && d.contains("payfleet money give-back internal sess_w")),
        "{found:?}"
    );
    give_back_again(&pool, GatewayName::Internal, "sess_w", None)
        .await
        .unwrap();
    match give_back_again(&pool, GatewayName::Internal, "sess_w", None).await {
        Err(GiveBackError::UnderWay) => {}
        other => panic!("asked twice: {other:?}"),
    }
    step(&pool, &app.config, "payments").await;
    process_events(&pool).await;
    let given: Vec<(String, String)> =
        sqlx::query_as("SELECT payment_id, amount::text FROM internal_refunds")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(given, vec![("pay_w".to_owned(), "1.0000".to_owned())]);
    // Asked again once it is given back: nothing more to give.
    step(&pool, &app.config, "payments").await;
    process_events(&pool).await;
    match give_back_again(&pool, GatewayName::Internal, "sess_w", None).await {
        Err(GiveBackError::NotToGiveBack { .. }) => {}
        other => panic!("given back whole, asked again: {other:?}"),
    }
}

/// A payment its order could not take (the order paid already) whose give-back ended dead, and
/// whose dead job was deleted a week later: the payment itself is the `payment_not_given_back`
/// finding, and `payfleet money give-back` asks the gateway again, once, for those payments only.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_not_given_back_is_shown_and_given_back_again_by_an_operator(pool: PgPool) {
    use payfleet::gateways::GatewayName;
    use payfleet::payments::{GiveBackError, give_back_again};
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    sqlx::raw_sql(
        "INSERT INTO internal_payments (session_id, gateway, order_number, attempt, amount, currency, metadata)
         VALUES ('sess_a', 'internal', 1, 1, 10, 'BRL', '{}'), ('sess_b', 'internal', 1, 2, 10, 'BRL', '{}');
         INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee)
         VALUES (1, 2, 'internal', 'sess_b', 'http://pay/sess_b', 10, 'BRL', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    deliver(
        &app,
        "first",
        &about("payment.succeeded", "sess_a", "pay_first", Some("10.00")),
    )
    .await;
    // Paid twice more: on its session, and through its other session.
    deliver(
        &app,
        "second",
        &about("payment.succeeded", "sess_a", "pay_second", Some("10.00")),
    )
    .await;
    deliver(
        &app,
        "other",
        &about("payment.succeeded", "sess_b", "pay_other", Some("10.00")),
    )
    .await;
    assert_eq!(refund_jobs(&pool).await.len(), 2);
    assert!(
        findings_of(&pool, "payment_not_given_back")
            .await
            .is_empty(),
        "while their give-backs are under way, no finding"
    );
    // Their give-backs died, and their dead jobs were deleted a week later.
    sqlx::query("DELETE FROM jobs WHERE kind = 'refund_payment'")
        .execute(&pool)
        .await
        .unwrap();
    let found = findings_of(&pool, "payment_not_given_back").await;
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found.iter().any(|(s, d)| s.contains("pay_second")
        && d.contains("payfleet money give-back internal sess_a --payment pay_second")));
    assert!(
        found
            .iter()
            .any(|(s, _)| s.contains("sess_b") && s.contains("pay_other"))
    );
    // The order's own payment is not one to give back, nor a session of no order.
    for (session, payment) in [("sess_a", Some("pay_first")), ("sess_x", None)] {
        match give_back_again(&pool, GatewayName::Internal, session, payment).await {
            Err(GiveBackError::NotToGiveBack { .. }) => {}
            other => panic!("{session} {payment:?}: {other:?}"),
        }
    }
    // An extra payment whose event named no payment (as a Stripe subscription-mode session's
    // completion does): the operator names it, and the gateway would refund whatever id it is
    // told. Another session's payment (the order's own) or one the session does not have is
    // refused; nothing is asked.
    sqlx::query(
        "UPDATE order_events SET payload = payload - 'payment_id' WHERE payload ->> 'session_id' = 'sess_b'",
    )
    .execute(&pool)
    .await
    .unwrap();
    for (named, why) in [
        ("pay_first", "it is session sess_a's"),
        (
            "pay_made_up",
            "the session's payments recorded here are others",
        ),
    ] {
        match give_back_again(&pool, GatewayName::Internal, "sess_b", Some(named)).await {
            Err(e @ GiveBackError::NotTheSessions { .. }) => {
                assert!(e.to_string().contains(why), "{e}")
            }
            other => panic!("{named}: {other:?}"),
        }
    }
    assert!(refund_jobs(&pool).await.is_empty());
    give_back_again(&pool, GatewayName::Internal, "sess_a", Some("pay_second"))
        .await
        .unwrap();
    give_back_again(&pool, GatewayName::Internal, "sess_b", None)
        .await
        .unwrap();
    match give_back_again(&pool, GatewayName::Internal, "sess_b", None).await {
        Err(GiveBackError::UnderWay) => {}
        other => panic!("asked twice: {other:?}"),
    }
    step(&pool, &app.config, "payments").await;
    process_events(&pool).await;
    let given: Vec<(String, String)> =
        sqlx::query_as("SELECT payment_id, amount::text FROM internal_refunds ORDER BY payment_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        given,
        vec![
            ("pay_other".to_owned(), "10.0000".to_owned()),
            ("pay_second".to_owned(), "10.0000".to_owned())
        ]
    );
    assert!(
        findings_of(&pool, "payment_not_given_back")
            .await
            .is_empty()
    );
    assert_eq!(order(&pool).await.0, "paid");
}
