use axum::Json;
use axum::extract::Path;
use axum::routing::get;
use payfleet::gateways::{GatewayName, MercadoPagoClient};
use payfleet::payments::{Processed, Processor};
use payfleet::queue::rescue_expired;
use sqlx::PgPool;

use crate::helpers::*;

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_paid_event_becomes_one_paid_order(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    app.deliver(&internal(
        "msg_1",
        &payment_body("payment.succeeded", "sess_1", "19.90"),
    ))
    .await;
    // Redelivered later: stored once, processed once.
    app.deliver(&standard(
        GatewayName::Internal,
        "msg_1",
        now() + 5,
        &payment_body("payment.succeeded", "sess_1", "19.90"),
    ))
    .await;
    assert_eq!(process_events(&pool, Processor::default()).await, 1);

    let (order, payment) = order_status(&pool, "internal", "sess_1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("paid", Some("succeeded"))
    );
    let (total, paid_at_set): (rust_decimal::Decimal, bool) =
        sqlx::query_as("SELECT total, paid_at IS NOT NULL FROM orders WHERE session_id = 'sess_1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((total, paid_at_set), ("19.90".parse().unwrap(), true));
    let (outcome, job_state): (String, String) = sqlx::query_as(
        "SELECT e.outcome, j.state FROM payment_events e JOIN jobs j ON j.key = 'payment_event:' || e.gateway || ':' || e.event_id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (outcome.as_str(), job_state.as_str()),
        ("applied", "completed")
    );

    // Processing the same event again changes nothing.
    assert_eq!(
        Processor::default()
            .process(&pool, GatewayName::Internal, "msg_1")
            .await
            .unwrap(),
        Processed::AlreadyProcessed
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_second_paid_event_for_the_same_payment_is_one_effect(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    // Two different event ids saying the same thing (a gateway that re-emits).
    app.deliver(&internal(
        "msg_a",
        &payment_body("payment.succeeded", "sess_1", "10.00"),
    ))
    .await;
    app.deliver(&internal(
        "msg_b",
        &payment_body("payment.succeeded", "sess_1", "10.00"),
    ))
    .await;
    process_events(&pool, Processor::default()).await;
    let outcomes: Vec<String> =
        sqlx::query_scalar("SELECT outcome FROM payment_events ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(outcomes, vec!["applied", "ignored"]);
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(orders, 1);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_before_its_payment_ends_refunded(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    app.deliver(&internal(
        "msg_refund",
        &refund_body("sess_1", "ref_1", "25.00"),
    ))
    .await;
    process_events(&pool, Processor::default()).await;
    app.deliver(&internal(
        "msg_paid",
        &payment_body("payment.succeeded", "sess_1", "25.00"),
    ))
    .await;
    process_events(&pool, Processor::default()).await;
    let (order, payment) = order_status(&pool, "internal", "sess_1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("refunded", Some("refunded"))
    );

    // A partial refund on another payment, in the usual order.
    app.deliver(&internal(
        "msg_p2",
        &payment_body("payment.succeeded", "sess_2", "30.00"),
    ))
    .await;
    app.deliver(&internal(
        "msg_r2",
        &refund_body("sess_2", "ref_2", "10.00"),
    ))
    .await;
    app.deliver(&internal(
        "msg_r2_again",
        &refund_body("sess_2", "ref_2", "10.00"),
    ))
    .await;
    process_events(&pool, Processor::default()).await;
    let (order, _) = order_status(&pool, "internal", "sess_2").await.unwrap();
    assert_eq!(order, "partially_refunded");
    let refunded: rust_decimal::Decimal =
        sqlx::query_scalar("SELECT amount_refunded FROM orders WHERE session_id = 'sess_2'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        refunded,
        "10.00".parse().unwrap(),
        "the same refund twice is one refund"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_failed_attempt_then_success_ends_paid_and_a_late_failure_does_not_undo_it(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    app.deliver(&internal(
        "m1",
        &payment_body("payment.failed", "sess_1", "5.00"),
    ))
    .await;
    process_events(&pool, Processor::default()).await;
    assert_eq!(
        order_status(&pool, "internal", "sess_1").await.unwrap().0,
        "payment_failed"
    );
    app.deliver(&internal(
        "m2",
        &payment_body("payment.succeeded", "sess_1", "5.00"),
    ))
    .await;
    app.deliver(&internal(
        "m3",
        &payment_body("payment.failed", "sess_1", "5.00"),
    ))
    .await;
    process_events(&pool, Processor::default()).await;
    assert_eq!(
        order_status(&pool, "internal", "sess_1").await.unwrap().0,
        "paid"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dispute_decided_before_it_was_opened_stays_decided(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let dispute = |kind: &str| {
        format!(
            r#"{{"type":"{kind}","data":{{"session_id":"s","payment_id":"p","dispute_id":"dp_1","amount":"8.00","currency":"BRL"}}}}"#
        )
    };
    app.deliver(&internal(
        "m1",
        &payment_body("payment.succeeded", "s", "8.00"),
    ))
    .await;
    app.deliver(&internal("m2", &dispute("dispute.lost"))).await;
    app.deliver(&internal("m3", &dispute("dispute.created")))
        .await;
    process_events(&pool, Processor::default()).await;
    assert_eq!(
        order_status(&pool, "internal", "s").await.unwrap().0,
        "charged_back"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn concurrent_processing_of_one_event_applies_it_once(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    app.deliver(&internal(
        "msg_1",
        &payment_body("payment.succeeded", "sess_1", "10.00"),
    ))
    .await;
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                Processor::default()
                    .process(&pool, GatewayName::Internal, "msg_1")
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut applied = 0;
    for r in runs {
        if r.await.unwrap() == Processed::Applied {
            applied += 1;
        }
    }
    assert_eq!(applied, 1);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_that_died_mid_way_leaves_the_event_to_be_processed_again(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    app.deliver(&internal(
        "msg_1",
        &payment_body("payment.succeeded", "sess_1", "10.00"),
    ))
    .await;
    // The dead worker claimed the job and got half-way through the effects: its transaction
    // never committed, so only its claim is left, with a lease nobody renews.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (gateway, session_id, status) VALUES ('internal', 'sess_1', 'awaiting_payment')")
        .execute(&mut *tx)
        .await
        .unwrap();
    drop(tx);
    sqlx::query(
        "UPDATE jobs SET state = 'running', attempt = 1, lease_token = nextval('jobs_lease_token_seq'),
             lease_expires_at = now() - interval '1 second', locked_by = 'dead-worker'",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        process_events(&pool, Processor::default()).await,
        0,
        "a leased job is not claimable"
    );

    assert_eq!(rescue_expired(&pool).await.unwrap(), 1);
    sqlx::query("UPDATE jobs SET run_at = now()")
        .execute(&pool)
        .await
        .unwrap(); // skip the backoff
    assert_eq!(process_events(&pool, Processor::default()).await, 1);
    let (order, _) = order_status(&pool, "internal", "sess_1").await.unwrap();
    assert_eq!(order, "paid");
    let (attempt, errors): (i32, serde_json::Value) =
        sqlx::query_as("SELECT attempt, errors FROM jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(attempt, 2);
    assert!(
        errors[0]["error"]
            .as_str()
            .unwrap()
            .contains("lease expired"),
        "{errors}"
    );
    let processed: bool = sqlx::query_scalar(
        "SELECT processed_at IS NOT NULL FROM payment_events WHERE event_id = 'msg_1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(processed);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn stripe_refund_before_the_checkout_waits_for_it(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let refund = r#"{"id":"evt_r","type":"charge.refunded","data":{"object":{"id":"ch_1","payment_intent":"pi_1","refunds":{"data":[{"id":"re_1","amount":1990,"currency":"brl","status":"succeeded"}]}}}}"#;
    let paid = r#"{"id":"evt_p","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    app.deliver(&stripe(refund, now())).await;
    process_events(&pool, Processor::default()).await;
    let (state, error): (String, String) =
        sqlx::query_as("SELECT state, errors -> 0 ->> 'error' FROM jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state, "retryable");
    assert!(error.contains("pi_1 is not known yet"), "{error}");

    app.deliver(&stripe(paid, now())).await;
    process_events(&pool, Processor::default()).await;
    assert_eq!(
        order_status(&pool, "stripe", "cs_1").await.unwrap().0,
        "paid"
    );
    sqlx::query("UPDATE jobs SET run_at = now() WHERE state = 'retryable'")
        .execute(&pool)
        .await
        .unwrap();
    process_events(&pool, Processor::default()).await;
    let (order, payment) = order_status(&pool, "stripe", "cs_1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("refunded", Some("refunded"))
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn razorpay_captured_payment_confirms_the_order(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let authorized = r#"{"entity":"event","event":"payment.authorized","payload":{"payment":{"entity":{"id":"pay_1","amount":50000,"currency":"INR","status":"authorized","order_id":"order_1"}}}}"#;
    let captured = r#"{"entity":"event","event":"payment.captured","payload":{"payment":{"entity":{"id":"pay_1","amount":50000,"currency":"INR","status":"captured","order_id":"order_1"}}}}"#;
    app.deliver(&razorpay("evt_a", authorized)).await;
    process_events(&pool, Processor::default()).await;
    assert_eq!(
        order_status(&pool, "razorpay", "order_1").await.unwrap().0,
        "awaiting_payment",
        "authorized is not money yet"
    );
    app.deliver(&razorpay("evt_c", captured)).await;
    process_events(&pool, Processor::default()).await;
    assert_eq!(
        order_status(&pool, "razorpay", "order_1").await.unwrap().0,
        "paid"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn mercadopago_events_are_checked_against_the_api(pool: PgPool) {
    // A stand-in for the Payments API, answering as Mercado Pago documents.
    let api = axum::Router::new().route(
        "/v1/payments/{id}",
        get(|Path(id): Path<String>| async move {
            Json(serde_json::json!({
                "id": id.parse::<i64>().unwrap(), "status": "approved", "transaction_amount": 120.5,
                "currency_id": "BRL", "external_reference": "pref_1", "refunds": []
            }))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, api).await });

    let app = spawn_app(pool.clone()).await;
    app.deliver(&mercadopago("777", "req-1", now() * 1000))
        .await;
    // Without API access the event waits (retry), it is not lost.
    process_events(&pool, Processor::default()).await;
    let state: String = sqlx::query_scalar("SELECT state FROM jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "retryable");
    sqlx::query("UPDATE jobs SET run_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let processor = Processor {
        mercadopago: Some(MercadoPagoClient::new(&base, "TEST-token").unwrap()),
    };
    process_events(&pool, processor).await;
    let (order, payment) = order_status(&pool, "mercadopago", "pref_1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("paid", Some("succeeded"))
    );
}
