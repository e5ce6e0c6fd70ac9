//! From a payment to exactly one confirmed order: the internal gateway's page, its signed
//! event delivered to the receiver, processing; duplicates, crashes, a payment after expiry, a
//! payment no checkout asked for. The workers are stepped by hand so each step is seen.

use std::sync::Arc;

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::checkout::{Shop, payment_side};
use crate::helpers::*;

/// A receiver, the payment side's RPC consumer, a seller and a product; queues stepped by hand.
async fn marketplace(pool: &PgPool) -> (Shop, String) {
    let shop = Shop {
        app: Arc::new(spawn_app(pool.clone()).await),
    };
    payment_side(pool, &shop.app.config);
    let s = shop.seller("A").await;
    let p = shop.product(&s, "19.90", "BRL").await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    (shop, p)
}

async fn checkout_one(shop: &Shop, key: &str, product: &str) -> Value {
    let (status, answer) = shop
        .checkout(
            Some(key),
            json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    answer["orders"][0].clone()
}

/// The order's payment page as a buyer opens it: its URL and the form's token.
async fn open_page(order: &Value) -> (String, String) {
    let url = order["payment"]["url"].as_str().unwrap().to_owned();
    let page = reqwest::get(&url).await.unwrap().text().await.unwrap();
    (url, form_token(&page))
}

/// The buyer posts the page's form.
async fn post_form((url, token): &(String, String), outcome: &str) -> u16 {
    reqwest::Client::new()
        .post(url)
        .form(&[("outcome", outcome), ("token", token)])
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn pay(order: &Value, outcome: &str) -> u16 {
    post_form(&open_page(order).await, outcome).await
}

/// Delivers what the hosted gateway emitted, then processes the events.
async fn settle(pool: &PgPool, shop: &Shop) {
    step(pool, &shop.app.config, "payments").await;
    process_events_with(pool, &shop.app.config).await;
}

async fn order_events(pool: &PgPool, number: i64) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id WHERE o.number = $1 ORDER BY e.id",
    )
    .bind(number)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_paid_order_is_confirmed_once_whatever_the_duplicates(pool: PgPool) {
    let (shop, product) = marketplace(&pool).await;
    let order = checkout_one(&shop, "k", &product).await;
    let n = order["number"].as_i64().unwrap();
    let page = open_page(&order).await;
    assert_eq!(post_form(&page, "succeeded").await, 200);
    // Paying twice (a double click, a second tab) decides nothing more.
    assert_eq!(post_form(&page, "succeeded").await, 200);
    settle(&pool, &shop).await;
    let o = shop.order(n).await;
    assert_eq!(
        (o["status"].as_str(), o["payment_status"].as_str()),
        (Some("paid"), Some("succeeded"))
    );

    // The gateway's event again (a resend), and the same facts under a new id (a gateway that
    // re-emits), processed concurrently: nothing changes.
    let (id, body): (String, Value) =
        sqlx::query_as("SELECT id, body FROM internal_events ORDER BY created_at LIMIT 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    let text = body.to_string();
    let (status, answer) = shop.app.deliver(&internal(&id, &text)).await;
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("duplicate"))
    );
    let (status, _) = shop.app.deliver(&internal("msg_reemitted", &text)).await;
    assert_eq!(status, 200);
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                payfleet::payments::Processor::default()
                    .process(
                        &pool,
                        payfleet::gateways::GatewayName::Internal,
                        "msg_reemitted",
                    )
                    .await
                    .unwrap()
            })
        })
        .collect();
    for r in runs {
        r.await.unwrap();
    }
    process_events_with(&pool, &shop.app.config).await;
    assert_eq!(order_events(&pool, n).await, vec!["created", "paid"]);
    let paid_at: Vec<Option<chrono::DateTime<chrono::Utc>>> =
        sqlx::query_scalar("SELECT paid_at FROM orders")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(paid_at.len(), 1);
    assert!(paid_at[0].is_some());
    // The receiver's metrics count the duplicate.
    let metrics = shop.app.metrics().await;
    assert!(
        metrics.contains(r#"payfleet_webhooks_total{gateway="internal",status="duplicate"} 1"#),
        "{metrics}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_that_dies_while_confirming_leaves_the_order_confirmed_once(pool: PgPool) {
    let (shop, product) = marketplace(&pool).await;
    let order = checkout_one(&shop, "k", &product).await;
    let n = order["number"].as_i64().unwrap();
    pay(&order, "succeeded").await;
    step(&pool, &shop.app.config, "payments").await;
    // A worker claimed the event's job and died half-way: its transaction never committed.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("UPDATE orders SET status = 'paid', paid_at = now() WHERE number = $1")
        .bind(n)
        .execute(&mut *tx)
        .await
        .unwrap();
    drop(tx);
    sqlx::query(
        "UPDATE jobs SET state = 'running', attempt = 1, lease_token = nextval('jobs_lease_token_seq'),
             lease_expires_at = now() - interval '1 second', locked_by = 'dead-worker'
         WHERE queue = 'events'",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(payfleet_queue::rescue_expired(&pool).await.unwrap(), 1);
    sqlx::query("UPDATE jobs SET run_at = now() WHERE queue = 'events'")
        .execute(&pool)
        .await
        .unwrap();
    process_events_with(&pool, &shop.app.config).await;
    assert_eq!(shop.order(n).await["status"], "paid");
    assert_eq!(order_events(&pool, n).await, vec!["created", "paid"]);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_failed_payment_marks_the_order_and_it_still_expires(pool: PgPool) {
    let (shop, product) = marketplace(&pool).await;
    let order = checkout_one(&shop, "k", &product).await;
    let n = order["number"].as_i64().unwrap();
    pay(&order, "failed").await;
    settle(&pool, &shop).await;
    let o = shop.order(n).await;
    assert_eq!(
        (o["status"].as_str(), o["payment_status"].as_str()),
        (Some("payment_failed"), Some("failed"))
    );
    payfleet::orders::expire_now(&pool, n).await.unwrap();
    step(&pool, &shop.app.config, "orders").await;
    assert_eq!(shop.order(n).await["status"], "expired");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_that_arrives_after_expiry_is_refunded_automatically(pool: PgPool) {
    let (shop, product) = marketplace(&pool).await;
    let order = checkout_one(&shop, "k", &product).await;
    let n = order["number"].as_i64().unwrap();
    // Paid at the gateway just before the deadline; its event is still on its way when the
    // order expires.
    assert_eq!(pay(&order, "succeeded").await, 200);
    payfleet::orders::expire_now(&pool, n).await.unwrap();
    step(&pool, &shop.app.config, "orders").await;
    assert_eq!(shop.order(n).await["status"], "expired");
    settle(&pool, &shop).await;
    // The order stays expired; the refund is asked of the gateway once...
    let o = shop.order(n).await;
    assert_eq!(
        (o["status"].as_str(), o["payment_status"].as_str()),
        (Some("expired"), Some("succeeded"))
    );
    let refund_jobs: Vec<String> =
        sqlx::query_scalar("SELECT key FROM jobs WHERE kind = 'refund_payment'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(refund_jobs.len(), 1, "{refund_jobs:?}");
    step(&pool, &shop.app.config, "payments").await; // refund, then deliver its event
    settle(&pool, &shop).await;
    // ...and its event records it like any refund: the money went back.
    let o = shop.order(n).await;
    assert_eq!(
        (o["status"].as_str(), o["payment_status"].as_str()),
        (Some("expired"), Some("refunded"))
    );
    let refunds: i64 = sqlx::query_scalar("SELECT count(*) FROM internal_refunds")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refunds, 1);
    assert_eq!(
        order_events(&pool, n).await,
        vec!["created", "expired", "late_payment"]
    );
    // The payment page does not take a payment for an expired order.
    let page = reqwest::get(order["payment"]["url"].as_str().unwrap())
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("payment is succeeded") || page.contains("cannot be paid"),
        "{page}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_no_checkout_asked_for_is_recorded_for_an_operator_not_made_an_order(
    pool: PgPool,
) {
    let app = spawn_app(pool.clone()).await;
    let (status, _) = app
        .deliver(&internal(
            "msg_1",
            &payment_body("payment.succeeded", "sess_nobody", "42.00"),
        ))
        .await;
    assert_eq!(status, 200);
    process_events(&pool).await;
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(orders, 0, "no order made up from nothing");
    let resp = app
        .http
        .get(format!("http://{}/admin/unmatched-payments", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    let list: Value = resp.json().await.unwrap();
    let row = &list["unmatched_payments"][0];
    assert_eq!(
        (
            row["session_id"].as_str(),
            row["status"].as_str(),
            row["currency"].as_str()
        ),
        (Some("sess_nobody"), Some("succeeded"), Some("BRL")),
        "{list}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_of_the_wrong_amount_confirms_nothing_and_is_given_back(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_1"], "19.90", "BRL").await;
    app.deliver(&internal(
        "msg_1",
        &payment_body("payment.succeeded", "sess_1", "1.00"),
    ))
    .await;
    process_events(&pool).await;
    assert_eq!(
        order_status(&pool, "internal", "sess_1").await.unwrap().0,
        "awaiting_payment"
    );
    // Kept for an operator, and refunded.
    let (status, amount): (String, String) =
        sqlx::query_as("SELECT status, amount::text FROM unmatched_payments")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), amount.as_str()), ("succeeded", "1.0000"));
    let reason: String =
        sqlx::query_scalar("SELECT payload ->> 'reason' FROM jobs WHERE kind = 'refund_payment'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(reason, "paid 1.00 BRL for an order of 19.90 BRL");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn after_a_failed_payment_reopening_gives_a_new_session(pool: PgPool) {
    let (shop, product) = marketplace(&pool).await;
    let order = checkout_one(&shop, "k", &product).await;
    let n = order["number"].as_i64().unwrap();
    pay(&order, "failed").await;
    settle(&pool, &shop).await;
    assert_eq!(shop.order(n).await["status"], "payment_failed");
    // The failed session is spent: reopening gives the next attempt its own.
    let (status, reopened) = shop
        .post(&format!("/orders/{n}/payment"), None, json!({}))
        .await;
    assert_eq!(status, 200, "{reopened}");
    assert_eq!(reopened["payment_attempt"], 2);
    assert_ne!(
        reopened["payment"]["session_id"],
        order["payment"]["session_id"]
    );
    assert_eq!(pay(&reopened, "succeeded").await, 200);
    settle(&pool, &shop).await;
    let o = shop.order(n).await;
    assert_eq!(
        (o["status"].as_str(), o["payment_status"].as_str()),
        (Some("paid"), Some("succeeded"))
    );
    assert_eq!(
        order_events(&pool, n).await,
        vec!["created", "reopened", "paid"]
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_second_payment_of_a_paid_order_through_another_session_is_given_back(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_a"], "10.00", "BRL").await;
    // The order's first attempt (sess_a) and a second one (sess_b) both taken by the buyer.
    sqlx::query(
        "INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee)
         VALUES (1, 2, 'internal', 'sess_b', 'http://pay/sess_b', 10, 'BRL', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    app.deliver(&internal(
        "m_a",
        &payment_body("payment.succeeded", "sess_a", "10.00"),
    ))
    .await;
    app.deliver(&internal(
        "m_b",
        &payment_body("payment.succeeded", "sess_b", "10.00"),
    ))
    .await;
    process_events(&pool).await;
    assert_eq!(
        order_status(&pool, "internal", "sess_a").await.unwrap().0,
        "paid"
    );
    let refunds: Vec<(String, String)> =
        sqlx::query_as("SELECT key, payload ->> 'reason' FROM jobs WHERE kind = 'refund_payment'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        refunds,
        vec![(
            "refund_payment:internal:sess_b".into(),
            "extra_payment".into()
        )]
    );
    // Seen again (a resend, reprocessing): not refunded twice.
    let (status, _) = app
        .deliver(&internal(
            "m_b2",
            &payment_body("payment.succeeded", "sess_b", "10.00"),
        ))
        .await;
    assert_eq!(status, 200);
    process_events(&pool).await;
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'refund_payment'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, 1);
}
