use axum::Json;
use axum::extract::Path;
use axum::response::IntoResponse;
use axum::routing::get;
use payfleet::gateways::GatewayName;
use payfleet::gateways::mercadopago::Api as MercadoPagoApi;
use payfleet::payments::{Processed, Processor};
use payfleet::secret::Secret;
use payfleet_queue::rescue_expired;
use sqlx::PgPool;

use crate::helpers::*;

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_paid_event_becomes_one_paid_order(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_1"], "19.90", "BRL").await;
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
    assert_eq!(process_events(&pool).await, 1);

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
        "SELECT e.outcome, coalesce(j.state, 'deleted') FROM payment_events e LEFT JOIN jobs j ON j.key = 'payment_event:' || e.gateway || ':' || e.event_id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (outcome.as_str(), job_state.as_str()),
        ("applied", "deleted")
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
    orders_for(&pool, "internal", &["sess_1"], "10.00", "BRL").await;
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
    process_events(&pool).await;
    let outcomes: Vec<String> =
        sqlx::query_scalar("SELECT outcome FROM payment_events ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(outcomes, vec!["applied", "ignored"]);
    // One effect: the order paid once, one payment recorded.
    let effects: (i64, i64, String) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM order_events WHERE kind = 'paid'),
                (SELECT count(*) FROM payment_orders),
                (SELECT status FROM orders)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(effects, (1, 1, "paid".to_owned()));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_before_its_payment_ends_refunded(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_1"], "25.00", "BRL").await;
    orders_for(&pool, "internal", &["sess_2"], "30.00", "BRL").await;
    app.deliver(&internal(
        "msg_refund",
        &refund_body("sess_1", "ref_1", "25.00"),
    ))
    .await;
    process_events(&pool).await;
    app.deliver(&internal(
        "msg_paid",
        &payment_body("payment.succeeded", "sess_1", "25.00"),
    ))
    .await;
    process_events(&pool).await;
    let (order, payment) = order_status(&pool, "internal", "sess_1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("refunded", Some("refunded"))
    );
    // A service that acts on `paid` learns the money went back, once.
    let messages = async |session: &str| -> Vec<String> {
        sqlx::query_scalar(
            "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id
             WHERE o.session_id = $1 AND e.kind IN ('paid', 'refunded', 'charged_back')
             ORDER BY e.id",
        )
        .bind(session)
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    assert_eq!(messages("sess_1").await, ["paid", "refunded"]);

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
    process_events(&pool).await;
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
    assert_eq!(
        messages("sess_2").await,
        ["paid"],
        "part of it went back only"
    );
    // A dispute lost: the money went back as a chargeback.
    app.deliver(&internal(
        "msg_d2",
        &serde_json::json!({"type": "dispute.created", "data": {"session_id": "sess_2", "payment_id": "pay_sess_2",
            "dispute_id": "dp_2", "amount": "20.00", "currency": "BRL"}})
        .to_string(),
    ))
    .await;
    app.deliver(&internal(
        "msg_d2_lost",
        &serde_json::json!({"type": "dispute.lost", "data": {"session_id": "sess_2", "payment_id": "pay_sess_2",
            "dispute_id": "dp_2", "amount": "20.00", "currency": "BRL"}})
        .to_string(),
    ))
    .await;
    process_events(&pool).await;
    assert_eq!(
        order_status(&pool, "internal", "sess_2").await.unwrap().0,
        "charged_back"
    );
    assert_eq!(messages("sess_2").await, ["paid", "charged_back"]);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_failed_attempt_then_success_ends_paid_and_a_late_failure_does_not_undo_it(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_1"], "5.00", "BRL").await;
    app.deliver(&internal(
        "m1",
        &payment_body("payment.failed", "sess_1", "5.00"),
    ))
    .await;
    process_events(&pool).await;
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
    process_events(&pool).await;
    assert_eq!(
        order_status(&pool, "internal", "sess_1").await.unwrap().0,
        "paid"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dispute_decided_before_it_was_opened_stays_decided(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["s"], "8.00", "BRL").await;
    let dispute = |kind: &str| {
        format!(
            r#"{{"type":"{kind}","data":{{"session_id":"s","payment_id":"pay_s","dispute_id":"dp_1","amount":"8.00","currency":"BRL"}}}}"#
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
    process_events(&pool).await;
    assert_eq!(
        order_status(&pool, "internal", "s").await.unwrap().0,
        "charged_back"
    );
    let seen: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT event_id, outcome FROM payment_events ORDER BY event_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        seen,
        [("m1", "applied"), ("m2", "applied"), ("m3", "ignored")]
            .map(|(e, o)| (e.to_owned(), Some(o.to_owned())))
    );
    let status: String = sqlx::query_scalar("SELECT status FROM payment_disputes")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(status, "lost");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn concurrent_processing_of_one_event_applies_it_once(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_1"], "10.00", "BRL").await;
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
    orders_for(&pool, "internal", &["sess_1"], "10.00", "BRL").await;
    app.deliver(&internal(
        "msg_1",
        &payment_body("payment.succeeded", "sess_1", "10.00"),
    ))
    .await;
    // The dead worker claimed the job and got half-way through the effects: its transaction
    // never committed, so only its claim is left, with a lease nobody renews.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("UPDATE orders SET status = 'paid', paid_at = now() WHERE session_id = 'sess_1'")
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
        process_events(&pool).await,
        0,
        "a leased job is not claimable"
    );

    // Rescued as a failed attempt, with the reason, and run again.
    assert_eq!(rescue_expired(&pool).await.unwrap(), 1);
    let (state, attempt, errors): (String, i32, serde_json::Value) =
        sqlx::query_as("SELECT state, attempt, errors FROM jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempt), ("retryable", 1));
    assert!(
        errors[0]["error"]
            .as_str()
            .unwrap()
            .contains("lease expired"),
        "{errors}"
    );
    sqlx::query("UPDATE jobs SET run_at = now()")
        .execute(&pool)
        .await
        .unwrap(); // skip the backoff
    assert_eq!(process_events(&pool).await, 1);
    let (order, _) = order_status(&pool, "internal", "sess_1").await.unwrap();
    assert_eq!(order, "paid");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the second attempt completed the job");
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
    orders_for(&pool, "stripe", &["cs_1"], "19.90", "BRL").await;
    let refund = r#"{"id":"evt_r","type":"charge.refunded","data":{"object":{"id":"ch_1","payment_intent":"pi_1","refunds":{"data":[{"id":"re_1","amount":1990,"currency":"brl","status":"succeeded"}]}}}}"#;
    let paid = r#"{"id":"evt_p","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    app.deliver(&stripe(refund, now())).await;
    process_events(&pool).await;
    // Kept, not retried: its job is done and the event says what it waits for.
    let (job_state, outcome, waiting_for): (String, String, String) = sqlx::query_as(
        "SELECT coalesce(j.state, 'deleted'), e.outcome, e.waiting_for FROM payment_events e
         LEFT JOIN jobs j ON j.key = 'payment_event:stripe:' || e.event_id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (job_state.as_str(), outcome.as_str(), waiting_for.as_str()),
        ("deleted", "waiting", "payment:pi_1")
    );

    // The payment arrives (days later, for all it matters): it confirms the order and brings
    // the waiting refund back, which then applies.
    app.deliver(&stripe(paid, now())).await;
    process_events(&pool).await;
    let (order, payment) = order_status(&pool, "stripe", "cs_1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("refunded", Some("refunded"))
    );
    let outcomes: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT outcome, waiting_for FROM payment_events ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        outcomes,
        vec![("applied".into(), None), ("applied".into(), None)]
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn razorpay_captured_payment_confirms_the_order(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "razorpay", &["order_1"], "500.00", "INR").await;
    let authorized = r#"{"entity":"event","event":"payment.authorized","contains":["payment"],"payload":{"payment":{"entity":{"id":"pay_1","amount":50000,"currency":"INR","status":"authorized","order_id":"order_1"}}},"created_at":1700000000}"#;
    let captured = r#"{"entity":"event","event":"payment.captured","contains":["payment"],"payload":{"payment":{"entity":{"id":"pay_1","amount":50000,"currency":"INR","status":"captured","order_id":"order_1"}}},"created_at":1700000060}"#;
    app.deliver(&razorpay("evt_a", authorized)).await;
    process_events(&pool).await;
    assert_eq!(
        order_status(&pool, "razorpay", "order_1").await.unwrap().0,
        "awaiting_payment",
        "authorized is not money yet"
    );
    app.deliver(&razorpay("evt_c", captured)).await;
    process_events(&pool).await;
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
    orders_for(&pool, "mercadopago", &["pref_1"], "120.50", "BRL").await;
    app.deliver(&mercadopago("777", "req-1", now() * 1000))
        .await;
    // Without API access the event cannot be read: rejected with the reason, kept, and
    // replayable once the access token is configured.
    process_events(&pool).await;
    let (job_state, outcome, detail): (String, String, String) = sqlx::query_as(
        "SELECT coalesce(j.state, 'deleted'), e.outcome, e.outcome_detail FROM payment_events e
         LEFT JOIN jobs j ON j.key = 'payment_event:mercadopago:' || e.event_id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (job_state.as_str(), outcome.as_str()),
        ("deleted", "rejected")
    );
    assert!(detail.contains("MERCADOPAGO_ACCESS_TOKEN"), "{detail}");
    let id: i64 = sqlx::query_scalar("SELECT id FROM payment_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        payfleet::payments::events::replay(&pool, id).await.unwrap(),
        payfleet::payments::events::Replayed::Queued
    );
    let mut config = test_config();
    config.gateways.mercadopago.api = Some(MercadoPagoApi {
        base_url: base.clone(),
        access_token: Secret::new("TEST-token"),
    });
    process_events_with(&pool, &config).await;
    let (order, payment) = order_status(&pool, "mercadopago", "pref_1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("paid", Some("succeeded"))
    );
}

/// An event's outcome and its job's state: 'deleted' once the job completed (a completed job's
/// row is deleted; one waiting to retry would still be there).
async fn event_outcome(pool: &PgPool, event_id: &str) -> (String, Option<String>, String) {
    sqlx::query_as(
        "SELECT e.outcome, e.outcome_detail, coalesce(j.state, 'deleted') FROM payment_events e
         LEFT JOIN jobs j ON j.key = 'payment_event:' || e.gateway || ':' || e.event_id
         WHERE e.event_id = $1",
    )
    .bind(event_id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn permanent_failures_are_rejected_at_once_with_their_reason(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["s1", "s2", "s3"], "10.00", "BRL").await;
    app.deliver(&internal(
        "paid",
        &payment_body("payment.succeeded", "s1", "10.00"),
    ))
    .await;
    app.deliver(&internal("too_much", &refund_body("s1", "r1", "15.00")))
        .await;
    app.deliver(&internal(
        "other_currency",
        r#"{"type":"refund.succeeded","data":{"session_id":"s1","payment_id":"pay_s1","refund_id":"r2","amount":"1.00","currency":"USD"}}"#,
    ))
    .await;
    app.deliver(&internal(
        "overflow",
        &payment_body("payment.succeeded", "s2", "100000000000000000000.00"),
    ))
    .await;
    // Another session claiming s1's payment id.
    app.deliver(&internal(
        "same_payment_id",
        r#"{"type":"payment.succeeded","data":{"session_id":"s3","payment_id":"pay_s1","amount":"10.00","currency":"BRL"}}"#,
    ))
    .await;
    process_events(&pool).await;

    for (event, reason) in [
        (
            "too_much",
            "would bring the refunds to 15.00 BRL, more than the 10.00 BRL paid",
        ),
        (
            "other_currency",
            "refund r2 is in USD but the payment is in BRL",
        ),
        ("overflow", "is too large"),
        (
            "same_payment_id",
            "payment pay_s1 belongs to session s1; this event names session s3",
        ),
    ] {
        let (outcome, detail, job_state) = event_outcome(&pool, event).await;
        assert_eq!(
            (outcome.as_str(), job_state.as_str()),
            ("rejected", "deleted"),
            "{event}: not retried"
        );
        let detail = detail.unwrap();
        assert!(detail.contains(reason), "{event}: {detail}");
    }
    // Nothing of them applied: the first payment is paid and not refunded.
    let refunded: rust_decimal::Decimal =
        sqlx::query_scalar("SELECT amount_refunded FROM orders WHERE session_id = 's1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(refunded, rust_decimal::Decimal::ZERO);
    assert_eq!(
        order_status(&pool, "internal", "s1").await.unwrap().0,
        "paid"
    );
    assert_eq!(
        order_status(&pool, "internal", "s2").await,
        Some(("awaiting_payment".into(), None))
    );

    // Replayed after a fix (here: a refund that fits once the payment is known larger), a
    // rejected event is processed again; one that still does not fit stays rejected.
    let id: i64 = sqlx::query_scalar("SELECT id FROM payment_events WHERE event_id = 'too_much'")
        .fetch_one(&pool)
        .await
        .unwrap();
    payfleet::payments::events::replay(&pool, id).await.unwrap();
    process_events(&pool).await;
    let (outcome, _, _) = event_outcome(&pool, "too_much").await;
    assert_eq!(outcome, "rejected");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_handler_error_that_is_not_an_outage_is_not_retried(pool: PgPool) {
    use payfleet_queue::{self as queue, Job, JobContext, NewJob, QueueSettings, Registry};
    #[derive(serde::Serialize, serde::Deserialize)]
    struct DividesByZero;
    impl Job for DividesByZero {
        const KIND: &'static str = "divides_by_zero";
        const QUEUE: &'static str = "test";
    }
    let mut registry = Registry::new();
    registry
        .register::<DividesByZero, _, _>(|ctx: JobContext, _job| async move {
            sqlx::query("SELECT 1 / 0").execute(&ctx.pool).await?;
            Ok(())
        })
        .unwrap();
    queue::enqueue(&pool, NewJob::of(&DividesByZero).unwrap())
        .await
        .unwrap();
    let settings = QueueSettings {
        concurrency: 1,
        timeout_ms: 5000,
        claimers: 1,
        fetch_cooldown_ms: 0,
        claim_batch: None,
    };
    queue::work_until_idle(&pool, &registry, "test", &settings)
        .await
        .unwrap();
    let (state, attempt, error): (String, i32, String) =
        sqlx::query_as("SELECT state, attempt, errors -> -1 ->> 'error' FROM jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempt), ("discarded", 1));
    assert!(error.contains("division by zero"), "{error}");
}

fn stripe_dispute(evt: &str, kind: &str, status: &str) -> String {
    format!(
        r#"{{"id":"{evt}","type":"charge.dispute.{kind}","data":{{"object":{{"id":"dp_1","payment_intent":"pi_1","amount":1990,"currency":"brl","status":"{status}"}}}}}}"#
    )
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn stripe_disputes_end_in_their_state_and_stay_decided(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "stripe", &["cs_1"], "19.90", "BRL").await;
    let paid = r#"{"id":"evt_p","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    let dispute_state = async || -> String {
        sqlx::query_scalar("SELECT status FROM payment_disputes WHERE dispute_id = 'dp_1'")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    app.deliver(&stripe(paid, now())).await;
    app.deliver(&stripe(
        &stripe_dispute("evt_d1", "created", "needs_response"),
        now(),
    ))
    .await;
    process_events(&pool).await;
    assert_eq!(
        order_status(&pool, "stripe", "cs_1").await.unwrap().0,
        "disputed"
    );
    // An inquiry that closes without a chargeback ends in the seller's favour.
    app.deliver(&stripe(
        &stripe_dispute("evt_d2", "closed", "warning_closed"),
        now(),
    ))
    .await;
    process_events(&pool).await;
    assert_eq!(dispute_state().await, "won");
    assert_eq!(
        order_status(&pool, "stripe", "cs_1").await.unwrap().0,
        "paid"
    );
    // Late and unknown statuses never reopen or change it.
    for (evt, kind, status) in [
        ("evt_d3", "created", "needs_response"),
        ("evt_d4", "updated", "a_status_from_the_future"),
        ("evt_d5", "closed", "lost"),
    ] {
        app.deliver(&stripe(&stripe_dispute(evt, kind, status), now()))
            .await;
        process_events(&pool).await;
        assert_eq!(dispute_state().await, "won", "{status}");
    }
    assert_eq!(
        order_status(&pool, "stripe", "cs_1").await.unwrap().0,
        "paid"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn every_stripe_closing_status_decides_the_dispute(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(
        &pool,
        "stripe",
        &["cs_0", "cs_1", "cs_2", "cs_3", "cs_4", "cs_5"],
        "19.90",
        "BRL",
    )
    .await;
    for (n, (status, dispute, order)) in [
        ("won", "won", "paid"),
        ("warning_closed", "won", "paid"),
        ("prevented", "refunded", "paid"),
        ("lost", "lost", "charged_back"),
        ("charge_refunded", "refunded", "paid"),
        ("a_status_from_the_future", "open", "disputed"),
    ]
    .into_iter()
    .enumerate()
    {
        let (cs, pi, dp) = (format!("cs_{n}"), format!("pi_{n}"), format!("dp_{n}"));
        let paid = format!(
            r#"{{"id":"evt_p{n}","type":"checkout.session.completed","data":{{"object":{{"id":"{cs}","payment_intent":"{pi}","amount_total":1990,"currency":"brl","payment_status":"paid"}}}}}}"#
        );
        let opened = format!(
            r#"{{"id":"evt_o{n}","type":"charge.dispute.created","data":{{"object":{{"id":"{dp}","payment_intent":"{pi}","amount":1990,"currency":"brl","status":"needs_response"}}}}}}"#
        );
        let closed = format!(
            r#"{{"id":"evt_c{n}","type":"charge.dispute.closed","data":{{"object":{{"id":"{dp}","payment_intent":"{pi}","amount":1990,"currency":"brl","status":"{status}"}}}}}}"#
        );
        for body in [paid, opened, closed] {
            app.deliver(&stripe(&body, now())).await;
            process_events(&pool).await;
        }
        let got: String =
            sqlx::query_scalar("SELECT status FROM payment_disputes WHERE dispute_id = $1")
                .bind(&dp)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(got, dispute, "{status}");
        assert_eq!(
            order_status(&pool, "stripe", &cs).await.unwrap().0,
            order,
            "{status}"
        );
    }
}

/// A Mercado Pago Payments API stand-in ([`mercadopago_api`]) and a test configuration that
/// asks it: (its payments, by id, for the test to change; the configuration).
pub(crate) async fn mercadopago_config() -> (
    std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, serde_json::Value>>>,
    payfleet::config::Config,
) {
    let payments = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let base = mercadopago_api(payments.clone()).await;
    let mut config = test_config();
    config.gateways.mercadopago.api = Some(MercadoPagoApi {
        base_url: base,
        access_token: Secret::new("TEST-token"),
    });
    (payments, config)
}

/// A Mercado Pago Payments API stand-in whose payments the test changes: each by its id, and
/// the search by `external_reference`, newest first (a payment's `date_created` is its id here).
pub(crate) async fn mercadopago_api(
    payments: std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<String, serde_json::Value>>,
    >,
) -> String {
    let searched = payments.clone();
    let api = axum::Router::new()
        .route(
            "/v1/payments/search",
            get(
                move |axum::extract::Query(q): axum::extract::Query<
                    std::collections::HashMap<String, String>,
                >| {
                    let payments = searched.clone();
                    async move {
                        let wanted = q.get("external_reference").cloned().unwrap_or_default();
                        let mut results: Vec<serde_json::Value> = payments
                            .lock()
                            .unwrap()
                            .values()
                            .filter(|p| p["external_reference"] == wanted.as_str())
                            .cloned()
                            .collect();
                        results.sort_by_key(|p| std::cmp::Reverse(p["id"].as_i64()));
                        Json(serde_json::json!({ "results": results }))
                    }
                },
            ),
        )
        .route(
            "/v1/payments/{id}",
            get(move |Path(id): Path<String>| {
                let payments = payments.clone();
                async move {
                    match payments.lock().unwrap().get(&id) {
                        Some(p) => Json(p.clone()).into_response(),
                        None => (
                            axum::http::StatusCode::NOT_FOUND,
                            Json(
                                serde_json::json!({"message": "Payment not found", "status": 404}),
                            ),
                        )
                            .into_response(),
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, api).await });
    base
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn mercadopago_mediations_end_won_or_as_a_refund(pool: PgPool) {
    let (payments, config) = mercadopago_config().await;
    let app = spawn_app(pool.clone()).await;
    orders_for(
        &pool,
        "mercadopago",
        &["pref_101", "pref_202", "pref_303"],
        "50.00",
        "BRL",
    )
    .await;
    let set = |id: &str, status: &str, refunds: serde_json::Value| {
        payments.lock().unwrap().insert(
            id.to_owned(),
            serde_json::json!({
                "id": id.parse::<i64>().unwrap(), "status": status, "transaction_amount": 50,
                "currency_id": "BRL", "external_reference": format!("pref_{id}"), "refunds": refunds
            }),
        );
    };
    let mut request = 0;
    let mut notify = async |id: &str| {
        request += 1;
        app.deliver(&mercadopago(id, &format!("req-{request}"), now() * 1000))
            .await;
        process_events_with(&pool, &config).await;
    };
    let dispute = async |id: &str| -> (String, String) {
        let state: String =
            sqlx::query_scalar("SELECT status FROM payment_disputes WHERE dispute_id = $1")
                .bind(format!("mp-{id}"))
                .fetch_one(&pool)
                .await
                .unwrap();
        (
            state,
            order_status(&pool, "mercadopago", &format!("pref_{id}"))
                .await
                .unwrap()
                .0,
        )
    };

    // Won: in mediation, then approved again.
    set("101", "approved", serde_json::json!([]));
    notify("101").await;
    set("101", "in_mediation", serde_json::json!([]));
    notify("101").await;
    assert_eq!(dispute("101").await, ("open".into(), "disputed".into()));
    set("101", "approved", serde_json::json!([]));
    notify("101").await;
    assert_eq!(dispute("101").await, ("won".into(), "paid".into()));

    // Lost as a refund: the refund carries the money, the dispute takes nothing more.
    set("202", "approved", serde_json::json!([]));
    notify("202").await;
    set("202", "in_mediation", serde_json::json!([]));
    notify("202").await;
    set(
        "202",
        "refunded",
        serde_json::json!([{"id": 9001, "amount": 50, "status": "approved"}]),
    );
    notify("202").await;
    assert_eq!(dispute("202").await, ("refunded".into(), "refunded".into()));
    let refunded: rust_decimal::Decimal =
        sqlx::query_scalar("SELECT amount_refunded FROM orders WHERE session_id = 'pref_202'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(refunded, "50".parse().unwrap());

    // A chargeback: lost.
    set("303", "approved", serde_json::json!([]));
    notify("303").await;
    set("303", "in_mediation", serde_json::json!([]));
    notify("303").await;
    set("303", "charged_back", serde_json::json!([]));
    notify("303").await;
    assert_eq!(dispute("303").await, ("lost".into(), "charged_back".into()));
    // A later approval does not undo a decided dispute.
    set("303", "approved", serde_json::json!([]));
    notify("303").await;
    assert_eq!(dispute("303").await, ("lost".into(), "charged_back".into()));
}

/// A chargeback stays `charged_back` at Mercado Pago from its start to its end; its
/// `status_detail` says where it stands. While `in_process` it holds the amount as an open
/// dispute (nothing taken for good), and `reimbursed` (Mercado Pago covered it) decides it for
/// the seller: the seller's balance is whole again. `settled` takes it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_mercadopago_chargeback_in_process_is_open_until_settled_or_reimbursed(pool: PgPool) {
    let (payments, config) = mercadopago_config().await;
    let app = spawn_app(pool.clone()).await;
    orders_for(
        &pool,
        "mercadopago",
        &["pref_501", "pref_502"],
        "50.00",
        "BRL",
    )
    .await;
    let set = |id: &str, status: &str, detail: &str| {
        payments.lock().unwrap().insert(
            id.to_owned(),
            serde_json::json!({
                "id": id.parse::<i64>().unwrap(), "status": status, "status_detail": detail,
                "transaction_amount": 50, "currency_id": "BRL",
                "external_reference": format!("pref_{id}"), "refunds": []
            }),
        );
    };
    let mut request = 0;
    let mut notify = async |id: &str| {
        request += 1;
        app.deliver(&mercadopago(id, &format!("req-{request}"), now() * 1000))
            .await;
        process_events_with(&pool, &config).await;
    };
    let dispute = async |id: &str| -> (String, String) {
        let state: String =
            sqlx::query_scalar("SELECT status FROM payment_disputes WHERE dispute_id = $1")
                .bind(format!("mp-{id}"))
                .fetch_one(&pool)
                .await
                .unwrap();
        (
            state,
            order_status(&pool, "mercadopago", &format!("pref_{id}"))
                .await
                .unwrap()
                .0,
        )
    };
    for id in ["501", "502"] {
        set(id, "approved", "accredited");
        notify(id).await;
        set(id, "charged_back", "in_process");
        notify(id).await;
        assert_eq!(
            dispute(id).await,
            ("open".into(), "disputed".into()),
            "{id}"
        );
    }
    set("501", "charged_back", "reimbursed");
    notify("501").await;
    assert_eq!(dispute("501").await, ("won".into(), "paid".into()));
    set("502", "charged_back", "settled");
    notify("502").await;
    assert_eq!(dispute("502").await, ("lost".into(), "charged_back".into()));
    // The seller bears the settled one only: one sale's net, not two.
    let taken: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ledger_transfers WHERE kind = 'dispute_debit'
         AND order_number IN (SELECT number FROM orders WHERE session_id = 'pref_501')
         AND NOT EXISTS (SELECT 1 FROM ledger_transfers r WHERE r.kind = 'dispute_reversal'
                         AND r.order_number = ledger_transfers.order_number)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(taken, 0, "the reimbursed chargeback took nothing for good");
}

/// A mediation ended by a refund, whose notification was lost: reconciliation asks about the
/// dispute a week on and reads the payment again whole, so the refund is recorded with the
/// decision (the dispute alone would give the seller back money the buyer got).
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_mercadopago_mediation_whose_end_was_never_notified_is_reconciled_with_its_refund(
    pool: PgPool,
) {
    let (payments, config) = mercadopago_config().await;
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "mercadopago", &["pref_404"], "50.00", "BRL").await;
    let set = |status: &str, refunds: serde_json::Value| {
        payments.lock().unwrap().insert(
            "404".to_owned(),
            serde_json::json!({
                "id": 404, "status": status, "transaction_amount": 50, "currency_id": "BRL",
                "external_reference": "pref_404", "refunds": refunds
            }),
        );
    };
    for (i, status) in ["approved", "in_mediation"].into_iter().enumerate() {
        set(status, serde_json::json!([]));
        app.deliver(&mercadopago("404", &format!("req-{i}"), now() * 1000))
            .await;
        process_events_with(&pool, &config).await;
    }
    let state = async || -> (String, String, String) {
        sqlx::query_as(
            "SELECT d.status, o.status, o.amount_refunded::text FROM payment_disputes d, orders o
             WHERE d.dispute_id = 'mp-404' AND o.session_id = 'pref_404'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(
        state().await,
        ("open".into(), "disputed".into(), "0.0000".into())
    );
    // Ended by a refund; its notification never comes.
    set(
        "refunded",
        serde_json::json!([{"id": 9004, "amount": 50, "status": "approved"}]),
    );
    sqlx::query("UPDATE payment_disputes SET updated_at = now() - interval '8 days'")
        .execute(&pool)
        .await
        .unwrap();
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let settings = crate::reconcile::settings(10, 0);
    let r = payfleet::payments::reconcile::run(&pool, &gateways, &settings)
        .await
        .unwrap();
    assert_eq!((r.asked, r.found), (1, 1));
    process_events_with(&pool, &config).await;
    assert_eq!(
        state().await,
        ("refunded".into(), "refunded".into(), "50.0000".into())
    );
    let refunds: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_refunds")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refunds, 1);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_and_its_payment_processed_in_one_batch_both_apply(pool: PgPool) {
    // The refund decides to wait while its own run is still being recorded, and the payment,
    // processed right after in the same batch, must still bring it back.
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "stripe", &["cs_1"], "19.90", "BRL").await;
    let refund = r#"{"id":"evt_r","type":"charge.refunded","data":{"object":{"id":"ch_1","payment_intent":"pi_1","refunds":{"data":[{"id":"re_1","amount":990,"currency":"brl","status":"succeeded"}]}}}}"#;
    let paid = r#"{"id":"evt_p","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    app.deliver(&stripe(refund, now())).await;
    app.deliver(&stripe(paid, now())).await;
    process_events(&pool).await;
    let (order, payment) = order_status(&pool, "stripe", "cs_1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("partially_refunded", Some("partially_refunded"))
    );
    let outcomes: Vec<String> =
        sqlx::query_scalar("SELECT outcome FROM payment_events ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(outcomes, vec!["applied", "applied"]);
}

// ---- payment events many to a transaction (payments::batch) ---------------------------------

/// Everything a payment's effect writes, for one session, without ids and times: the payment,
/// the order, its messages, its ledger postings, the event's outcome.
async fn effect_of(pool: &PgPool, session: &str) -> String {
    let row: (String, String, String, String, bool, String, String, bool, String, String) = sqlx::query_as(
        "SELECT po.status, po.amount::text, po.currency::text, coalesce(po.payment_id, ''), po.succeeded_at IS NOT NULL,
                o.status, o.payment_status, o.paid_at IS NOT NULL, o.payment_url, o.amount_refunded::text
         FROM orders o JOIN payment_orders po ON po.gateway = o.gateway AND po.session_id = o.session_id
         WHERE o.session_id = $1",
    )
    .bind(session)
    .fetch_one(pool)
    .await
    .unwrap();
    let messages: Vec<(String, serde_json::Value)> = sqlx::query_as(
        "SELECT e.kind, e.payload - 'number' FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE o.session_id = $1 ORDER BY e.id",
    )
    .bind(session)
    .fetch_all(pool)
    .await
    .unwrap();
    let postings: Vec<(String, String, String, String, String, bool)> = sqlx::query_as(
        "SELECT t.kind, t.amount::text, f.kind, a.kind, split_part(t.source_key, ':', 1),
                t.available_at IS NOT DISTINCT FROM o.paid_at + s.holding_days * interval '1 day'
         FROM ledger_transfers t JOIN orders o ON o.number = t.order_number JOIN sellers s ON s.id = o.seller_id
         JOIN ledger_accounts f ON f.id = t.from_account JOIN ledger_accounts a ON a.id = t.to_account
         WHERE o.session_id = $1 ORDER BY t.kind",
    )
    .bind(session)
    .fetch_all(pool)
    .await
    .unwrap();
    let entries: Vec<(String, String)> = sqlx::query_as(
        "SELECT a.kind, e.amount::text FROM ledger_entries e JOIN ledger_transfers t ON t.id = e.transfer_id
         JOIN ledger_accounts a ON a.id = e.account_id JOIN orders o ON o.number = t.order_number
         WHERE o.session_id = $1 ORDER BY a.kind, e.amount",
    )
    .bind(session)
    .fetch_all(pool)
    .await
    .unwrap();
    let event: (Option<String>, Option<String>, Option<String>, bool) = sqlx::query_as(
        "SELECT outcome, outcome_detail, waiting_for, processed_at IS NOT NULL FROM payment_events
         WHERE convert_from(raw_body, 'UTF8')::jsonb -> 'data' ->> 'session_id' = $1",
    )
    .bind(session)
    .fetch_one(pool)
    .await
    .unwrap();
    format!("{row:?} {messages:?} {postings:?} {entries:?} {event:?}")
}

/// Each session's first success, delivered (unprocessed) with its order of `total`.
async fn first_payments(app: &TestApp, sessions: &[&str], total: &str) {
    orders_for(&app.pool, "internal", sessions, total, "BRL").await;
    for s in sessions {
        app.deliver(&internal(
            &format!("msg_{s}"),
            &payment_body("payment.succeeded", s, total),
        ))
        .await;
    }
}

async fn batch(pool: &PgPool, sessions: &[&str]) -> Vec<bool> {
    let ids: Vec<String> = sessions.iter().map(|s| format!("msg_{s}")).collect();
    let events: Vec<(GatewayName, &str)> = ids
        .iter()
        .map(|id| (GatewayName::Internal, id.as_str()))
        .collect();
    payfleet::payments::batch::process_batch(
        &mut pool.acquire().await.unwrap(),
        None,
        &events,
        &[],
        &[],
        None,
    )
    .await
    .unwrap()
}

/// A batch's statements are planned once per connection, not for each batch's values: a
/// worker started on a backlog runs its first batches on new connections, where PostgreSQL
/// would plan each statement for its values five times before it considers the generic plan.
/// Three batches (two payments, one, then the two again, already processed) on one new
/// connection: every statement of theirs prepared there ran on its generic plan, and the
/// payments took effect as they do in any batch.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_batch_runs_on_plans_made_once_per_connection(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    first_payments(&app, &["g1", "g2", "g3"], "19.90").await;
    let mut conn =
        <sqlx::PgConnection as sqlx::Connection>::connect_with(pool.connect_options().as_ref())
            .await
            .unwrap();
    let mut run = async |sessions: &[&str]| {
        let ids: Vec<String> = sessions.iter().map(|s| format!("msg_{s}")).collect();
        let events: Vec<(GatewayName, &str)> = ids
            .iter()
            .map(|id| (GatewayName::Internal, id.as_str()))
            .collect();
        payfleet::payments::batch::process_batch(&mut conn, None, &events, &[], &[], None)
            .await
            .unwrap()
    };
    assert_eq!(run(&["g1", "g2"]).await, [true, true]);
    assert_eq!(run(&["g3"]).await, [true]);
    assert_eq!(
        run(&["g1", "g2"]).await,
        [false, false],
        "processed already"
    );
    let plans: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
         WHERE from_sql = false ORDER BY statement",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        plans.len() >= 6,
        "the batch's statements were prepared on this connection: {plans:?}"
    );
    assert!(
        plans.iter().all(|(_, _, custom)| *custom == 0),
        "none planned for its values: {plans:?}"
    );
    let statement = |fragment: &str| {
        plans
            .iter()
            .find(|(s, _, _)| s.contains(fragment))
            .map(|(_, generic, _)| *generic)
    };
    assert_eq!(
        statement("e.source, e.processed_at IS NULL"),
        Some(3),
        "the events' read, in every batch: {plans:?}"
    );
    assert_eq!(
        statement("INSERT INTO payment_orders"),
        Some(2),
        "the payments' record, in the batches that applied some: {plans:?}"
    );
    for s in ["g1", "g2", "g3"] {
        assert!(
            effect_of(&pool, s).await.contains("sale_credit"),
            "{s}: {}",
            effect_of(&pool, s).await
        );
    }
    let (accounts, currencies) = payfleet::ledger::check(&pool).await.unwrap();
    assert!(accounts.is_empty() && currencies.is_empty());
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn first_payments_applied_in_a_batch_end_as_one_event_at_a_time_would(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    // Two sellers' orders (the fixture gives each call its own seller), a fee on half of them.
    first_payments(&app, &["a1", "a2", "b1"], "19.90").await;
    first_payments(&app, &["a3", "a4", "b2"], "10.00").await;
    sqlx::query(
        "UPDATE orders SET platform_fee = 1.00, seller_net = total - 1.00 WHERE session_id IN ('a3', 'a4', 'b2')",
    )
    .execute(&pool)
    .await
    .unwrap();
    for s in ["a1", "a3"] {
        assert_eq!(
            Processor::default()
                .process(&pool, GatewayName::Internal, &format!("msg_{s}"))
                .await
                .unwrap(),
            Processed::Applied
        );
    }
    assert_eq!(batch(&pool, &["b1", "b2"]).await, [true, true]);
    assert_eq!(
        effect_of(&pool, "b1").await.replace("b1", "a1"),
        effect_of(&pool, "a1").await,
        "a batched payment is the same effect"
    );
    assert_eq!(
        effect_of(&pool, "b2").await.replace("b2", "a3"),
        effect_of(&pool, "a3").await,
        "with a fee too"
    );
    // Processed again, alone or in a batch, nothing more happens.
    assert_eq!(batch(&pool, &["b1", "b2"]).await, [false, false]);
    assert_eq!(
        Processor::default()
            .process(&pool, GatewayName::Internal, "msg_b1")
            .await
            .unwrap(),
        Processed::AlreadyProcessed
    );
    let (accounts, currencies) = payfleet::ledger::check(&pool).await.unwrap();
    assert!(accounts.is_empty() && currencies.is_empty());
}

/// The job that hands a first payment to a batch ends in the batch's transaction: its row goes
/// with the payment's effect, in one commit, and the fleet writes no end of its own after it.
/// An event processed alone (a refund) ends as every job does, after its run.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_batch_completes_the_jobs_of_the_payments_it_applies_in_its_transaction(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    first_payments(&app, &["c1", "c2"], "10.00").await;
    orders_for(&pool, "internal", &["r1"], "10.00", "BRL").await;
    app.deliver(&internal("msg_r1", &refund_body("r1", "ref_1", "1.00")))
        .await;
    // Each job's row as it goes, with the transaction that deletes it.
    for ddl in [
        "CREATE TABLE job_deletes (key text, xact bigint NOT NULL)",
        "CREATE FUNCTION note_job_delete() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO job_deletes VALUES (OLD.key, pg_current_xact_id()::text::bigint); RETURN NULL; END $$",
        "CREATE TRIGGER note_job_delete AFTER DELETE ON jobs FOR EACH ROW EXECUTE FUNCTION note_job_delete()",
    ] {
        sqlx::query(ddl).execute(&pool).await.unwrap();
    }
    process_events(&pool).await;
    // The event's row was last written (processed) by the transaction that applied it.
    let ended: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT e.event_id, e.outcome, d.xact % 4294967296 = e.xmin::text::bigint
         FROM payment_events e JOIN job_deletes d ON d.key = 'payment_event:internal:' || e.event_id
         ORDER BY e.event_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        ended,
        [
            ("msg_c1".into(), "applied".into(), true),
            ("msg_c2".into(), "applied".into(), true),
            ("msg_r1".into(), "waiting".into(), false),
        ]
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE queue = 'events'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_batch_leaves_every_case_but_a_plain_first_payment_to_the_one_event_path(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    first_payments(&app, &["plain", "known", "expired"], "10.00").await;
    orders_for(&pool, "internal", &["wrong", "refunded"], "10.00", "BRL").await;
    // Paid for the wrong amount; an order that expired; a payment known already (its first
    // event processed), delivered again under another id; a refund; an event of no session.
    app.deliver(&internal(
        "msg_wrong",
        &payment_body("payment.succeeded", "wrong", "9.00"),
    ))
    .await;
    sqlx::query(
        "UPDATE orders SET status = 'expired', expired_at = now() WHERE session_id = 'expired'",
    )
    .execute(&pool)
    .await
    .unwrap();
    Processor::default()
        .process(&pool, GatewayName::Internal, "msg_known")
        .await
        .unwrap();
    app.deliver(&internal(
        "msg_known_again",
        &payment_body("payment.succeeded", "known", "10.00"),
    ))
    .await;
    app.deliver(&internal(
        "msg_refunded",
        &refund_body("refunded", "ref_1", "10.00"),
    ))
    .await;
    app.deliver(&internal(
        "msg_nobody",
        &payment_body("payment.succeeded", "nobody", "10.00"),
    ))
    .await;
    // The same payment twice in one batch: the first only.
    app.deliver(&internal(
        "msg_plain_again",
        &payment_body("payment.succeeded", "plain", "10.00"),
    ))
    .await;
    let applied = batch(
        &pool,
        &[
            "wrong",
            "expired",
            "known_again",
            "refunded",
            "nobody",
            "plain",
            "plain_again",
        ],
    )
    .await;
    assert_eq!(applied, [false, false, false, false, false, true, false]);
    let untouched: Vec<String> = sqlx::query_scalar(
        "SELECT event_id FROM payment_events WHERE outcome IS NULL ORDER BY event_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        untouched,
        [
            "msg_expired",
            "msg_known_again",
            "msg_nobody",
            "msg_plain_again",
            "msg_refunded",
            "msg_wrong"
        ],
        "left as they were"
    );
    // Each then ends as the one-event path decides.
    process_events(&pool).await;
    let outcomes: Vec<(String, String)> =
        sqlx::query_as("SELECT event_id, outcome FROM payment_events ORDER BY event_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let outcome = |id: &str| {
        outcomes
            .iter()
            .find(|(e, _)| e == id)
            .map(|(_, o)| o.clone())
            .unwrap()
    };
    assert_eq!(outcome("msg_refunded"), "waiting");
    assert_eq!(outcome("msg_plain_again"), "ignored");
    assert_eq!(outcome("msg_known_again"), "ignored");
    let statuses: Vec<(String, String)> =
        sqlx::query_as("SELECT session_id, status FROM orders ORDER BY session_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        statuses,
        [
            ("expired".into(), "expired".into()),
            ("known".into(), "paid".into()),
            ("plain".into(), "paid".into()),
            ("refunded".into(), "awaiting_payment".into()),
            ("wrong".into(), "awaiting_payment".into()),
        ]
    );
    let give_backs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'refund_payment'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        give_backs, 2,
        "the late payment and the wrong amount go back"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_that_waited_is_woken_by_its_payment_applied_in_a_batch(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["s1"], "25.00", "BRL").await;
    app.deliver(&internal("msg_refund", &refund_body("s1", "ref_1", "5.00")))
        .await;
    process_events(&pool).await;
    app.deliver(&internal(
        "msg_s1",
        &payment_body("payment.succeeded", "s1", "25.00"),
    ))
    .await;
    assert_eq!(batch(&pool, &["s1"]).await, [true]);
    let woken: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE key = 'payment_event:internal:msg_refund' AND state = 'available'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(woken, 1, "the waiting refund is processed again");
    process_events(&pool).await;
    let (order, payment) = order_status(&pool, "internal", "s1").await.unwrap();
    assert_eq!(
        (order.as_str(), payment.as_deref()),
        ("partially_refunded", Some("partially_refunded"))
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn one_sellers_payments_in_concurrent_batches_post_each_sale_once(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let sessions: Vec<String> = (0..60).map(|i| format!("f{i}")).collect();
    let names: Vec<&str> = sessions.iter().map(String::as_str).collect();
    // One seller (one fixture call), a fee on each.
    first_payments(&app, &names, "19.90").await;
    sqlx::query("UPDATE orders SET platform_fee = 1.99, seller_net = 17.91")
        .execute(&pool)
        .await
        .unwrap();
    // Overlapping batches at once, as workers would run them; and the one-event path beside.
    let mut runs = Vec::new();
    for chunk in [&names[0..30], &names[20..50], &names[40..60], &names[..]] {
        let (pool, chunk): (PgPool, Vec<String>) =
            (pool.clone(), chunk.iter().map(|s| s.to_string()).collect());
        runs.push(tokio::spawn(async move {
            let chunk: Vec<&str> = chunk.iter().map(String::as_str).collect();
            batch(&pool, &chunk).await.iter().filter(|a| **a).count()
        }));
    }
    let alone = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut n = 0;
            for i in (0..60).step_by(7) {
                let p = Processor::default()
                    .process(&pool, GatewayName::Internal, &format!("msg_f{i}"))
                    .await
                    .unwrap();
                n += usize::from(p == Processed::Applied);
            }
            n
        })
    };
    let mut applied = alone.await.unwrap();
    for r in runs {
        applied += r.await.unwrap();
    }
    assert_eq!(applied, 60, "each payment applied once");
    let (credits, fees, pending, revenue): (i64, i64, String, String) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE t.kind = 'sale_credit'), count(*) FILTER (WHERE t.kind = 'fee'),
                (SELECT balance::text FROM ledger_accounts WHERE kind = 'seller_pending'),
                (SELECT balance::text FROM ledger_accounts WHERE kind = 'platform_revenue')
         FROM ledger_transfers t",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (credits, fees, pending.as_str(), revenue.as_str()),
        (60, 60, "1074.6000", "119.4000")
    );
    let (accounts, currencies) = payfleet::ledger::check(&pool).await.unwrap();
    assert!(accounts.is_empty() && currencies.is_empty());
    let paid_events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM order_events WHERE kind = 'paid'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(paid_events, 60, "one order message each");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_event_that_fails_its_batch_is_processed_alone_and_holds_up_no_other(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    first_payments(&app, &["ok1", "boom", "ok2"], "10.00").await;
    // A refusal the batch cannot see coming (a rule of the schema, say): its statement fails
    // for the whole batch.
    sqlx::query(
        "CREATE FUNCTION refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.session_id = 'boom' AND NEW.paid_at IS NOT NULL THEN
                 RAISE EXCEPTION 'no' USING ERRCODE = 'check_violation';
             END IF;
             RETURN NEW;
         END $$",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("CREATE TRIGGER refuse_boom BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION refuse_boom()")
        .execute(&pool)
        .await
        .unwrap();
    assert!(
        payfleet::payments::batch::process_batch(
            &mut pool.acquire().await.unwrap(),
            None,
            &[
                (GatewayName::Internal, "msg_ok1"),
                (GatewayName::Internal, "msg_boom"),
                (GatewayName::Internal, "msg_ok2"),
            ],
            &[],
            &[],
            None,
        )
        .await
        .is_err(),
        "the batch fails as a whole"
    );
    // The jobs: each event alone, the others applied, the refused one rejected with its reason.
    process_events(&pool).await;
    let outcomes: Vec<(String, String)> =
        sqlx::query_as("SELECT event_id, outcome FROM payment_events ORDER BY event_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        outcomes,
        [
            ("msg_boom".into(), "rejected".into()),
            ("msg_ok1".into(), "applied".into()),
            ("msg_ok2".into(), "applied".into()),
        ]
    );
    let credits: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger_transfers WHERE kind = 'sale_credit'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(credits, 2);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_event_with_no_turn_to_run_alone_is_given_back_busy(pool: PgPool) {
    use payfleet::payments::batch::{BatchSettings, Batcher, Handled};
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["s1", "s2"], "10.00", "BRL").await;
    // Two refunds: never a batch's, each is processed alone.
    app.deliver(&internal("msg_r1", &refund_body("s1", "ref_1", "1.00")))
        .await;
    app.deliver(&internal("msg_r2", &refund_body("s2", "ref_2", "1.00")))
        .await;
    let batcher = Batcher::start(
        pool.clone(),
        std::sync::Arc::new(Processor::default()),
        BatchSettings {
            alone: 1,
            alone_wait: std::time::Duration::from_millis(300),
            ..BatchSettings::default()
        },
        None,
    );
    // The first holds the one turn, stuck behind its payment's key (a long transaction holds it).
    let held = hold_session_key(&pool, "s1").await;
    let first = {
        let (batcher, pool) = (batcher.clone(), pool.clone());
        tokio::spawn(async move {
            batcher
                .process(&pool, GatewayName::Internal, "msg_r1")
                .await
                .unwrap()
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let second = batcher
        .process(&pool, GatewayName::Internal, "msg_r2")
        .await
        .unwrap();
    assert_eq!(
        second,
        Handled::Busy,
        "no turn within its wait: its slot back"
    );
    held.commit().await.unwrap();
    assert_eq!(
        first.await.unwrap(),
        Handled::Processed(Processed::Waiting("payment:pay_s1".into()))
    );
    // (Its job is snoozed: back in the queue, no attempt spent.) With a turn free, it runs.
    let second = batcher
        .process(&pool, GatewayName::Internal, "msg_r2")
        .await
        .unwrap();
    assert_eq!(
        second,
        Handled::Processed(Processed::Waiting("payment:pay_s2".into()))
    );
}

/// PostgreSQL's counts for `table` so far, this connection's included: its counts are flushed
/// to the shared ones first.
struct TableCounts {
    /// Rows read, sequentially and through indexes.
    read: i64,
    /// Rows updated.
    updated: i64,
    /// Of those, the updates that stayed on the row's page (HOT: no entry in any index).
    in_place: i64,
}

async fn table_counts(one: &PgPool, table: &str) -> TableCounts {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(one)
        .await
        .unwrap();
    let (read, updated, in_place) = sqlx::query_as(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0), coalesce(n_tup_upd, 0),
                coalesce(n_tup_hot_upd, 0)
         FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(one)
    .await
    .unwrap();
    TableCounts {
        read,
        updated,
        in_place,
    }
}

/// However many orders there are, and whatever the planner knows of them (a new database, or
/// a server without autovacuum: no statistics at all), a batch reads its own orders through
/// their keys: what it reads grows with the batch, not with the table. Asked as
/// `number = ANY($1)`, a planner without statistics read every order through the index of the
/// few orders paid with coins, at every batch.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_batch_reads_its_own_orders_not_every_order(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let others: Vec<String> = (0..3000).map(|i| format!("other{i}")).collect();
    let others: Vec<&str> = others.iter().map(String::as_str).collect();
    orders_for(&pool, "internal", &others, "10.00", "BRL").await;
    let mine: Vec<String> = (0..20).map(|i| format!("mine{i}")).collect();
    let mine: Vec<&str> = mine.iter().map(String::as_str).collect();
    first_payments(&app, &mine, "10.00").await;
    // One connection, so that its reads are the ones flushed.
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let before = table_counts(&one, "orders").await.read;
    assert!(batch(&one, &mine).await.into_iter().all(|applied| applied));
    let read = table_counts(&one, "orders").await.read - before;
    assert!(
        read <= 10 * mine.len() as i64,
        "{read} order rows read to apply a batch of {} payments beside 3,000 other orders",
        mine.len()
    );
    let (accounts, currencies) = payfleet::ledger::check(&pool).await.unwrap();
    assert!(accounts.is_empty() && currencies.is_empty());
}

/// Confirming a paid order changes none of the order's indexed columns, and the order's page
/// keeps room for the new version (`0058_room_for_updates_in_place`): the update stays on the
/// page, with no entry in any of the order's seven indexes, even for orders written as densely
/// as a single statement packs them. On full pages (the default fillfactor) every one of these
/// updates wrote its new version on another page, and an entry in each index.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_batch_confirms_its_orders_on_their_own_pages(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let sessions: Vec<String> = (0..200).map(|i| format!("dense{i}")).collect();
    let sessions: Vec<&str> = sessions.iter().map(String::as_str).collect();
    orders_for(&pool, "internal", &sessions, "10.00", "BRL").await;
    // Three orders from the first pages, the ones a later order could not have left room on.
    let paid = ["dense0", "dense40", "dense80"];
    for s in paid {
        app.deliver(&internal(
            &format!("msg_{s}"),
            &payment_body("payment.succeeded", s, "10.00"),
        ))
        .await;
    }
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let before = table_counts(&one, "orders").await;
    assert_eq!(batch(&one, &paid).await, [true, true, true]);
    let after = table_counts(&one, "orders").await;
    assert_eq!(
        after.updated - before.updated,
        3,
        "one update per confirmed order"
    );
    assert_eq!(
        after.in_place - before.in_place,
        3,
        "every confirmation stayed on its order's page"
    );
    let (accounts, currencies) = payfleet::ledger::check(&pool).await.unwrap();
    assert!(accounts.is_empty() && currencies.is_empty());
}

/// An internal-gateway order of 10.00 BRL for each of `sessions`, and its `payment.succeeded`
/// (`msg_<session>`) stored but not processed: for a batcher the test starts itself.
async fn paid_and_waiting(app: &TestApp, pool: &PgPool, sessions: &[String]) {
    let refs: Vec<&str> = sessions.iter().map(String::as_str).collect();
    orders_for(pool, "internal", &refs, "10.00", "BRL").await;
    for s in sessions {
        app.deliver(&internal(
            &format!("msg_{s}"),
            &payment_body("payment.succeeded", s, "10.00"),
        ))
        .await;
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_batcher_holds_no_connection_once_no_event_waits(pool: PgPool) {
    use payfleet::payments::batch::{BatchSettings, Batcher, Handled};
    let app = spawn_app(pool.clone()).await;
    let sessions: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    paid_and_waiting(&app, &pool, &sessions).await;
    // The batcher's own pool, whose connections can be counted.
    let batches = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let batcher = Batcher::start(
        batches.clone(),
        std::sync::Arc::new(Processor::default()),
        BatchSettings {
            events_in_batches: 8,
            ..BatchSettings::default()
        },
        None,
    );
    // Forty events at once: ten batches or more, one after the other on kept connections.
    let runs: Vec<_> = sessions
        .iter()
        .map(|s| {
            let (batcher, pool) = (batcher.clone(), batches.clone());
            let id = format!("msg_{s}");
            tokio::spawn(async move { batcher.process(&pool, GatewayName::Internal, &id).await })
        })
        .collect();
    for run in runs {
        assert_eq!(
            run.await.unwrap().unwrap(),
            Handled::Processed(Processed::Applied)
        );
    }
    // Idle: every connection the batches used is the pool's again, at once (well before the
    // batcher's idle wait would give back one it kept).
    assert!(batches.size() >= 1);
    crate::helpers::wait_for(
        "every connection idle in the pool",
        std::time::Duration::from_millis(200),
        async || batches.num_idle() == batches.size() as usize,
    )
    .await;
}

/// A worker's batches take `events_in_batches` together, each batch in flight its share: a lone
/// worker's two batches half each, a fleet's worker's one batch all of it. (Each batch is one
/// transaction: the events it applied carry its `xmin`.)
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn each_batch_in_flight_takes_its_share_of_the_events_in_batches(pool: PgPool) {
    use payfleet::payments::batch::{BatchSettings, Batcher, Handled};
    let app = spawn_app(pool.clone()).await;
    for (round, in_flight, share) in [("a", 2, 4), ("b", 1, 8)] {
        let sessions: Vec<String> = (0..12).map(|i| format!("{round}{i}")).collect();
        paid_and_waiting(&app, &pool, &sessions).await;
        let batcher = Batcher::start(
            pool.clone(),
            std::sync::Arc::new(Processor::default()),
            BatchSettings {
                events_in_batches: 8,
                in_flight,
                in_flight_in_fleet: in_flight,
                ..BatchSettings::default()
            },
            None,
        );
        // The first sessions' keys held, one for each batch in flight: every turn waits, and
        // the other events gather meanwhile.
        let mut held = pool.begin().await.unwrap();
        let mut runs = Vec::new();
        for (i, s) in sessions.iter().enumerate() {
            if i < in_flight {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT pg_advisory_xact_lock(hashtextextended('internal:session:{s}', 0))"
                )))
                .execute(&mut *held)
                .await
                .unwrap();
            }
            let (batcher, batches) = (batcher.clone(), pool.clone());
            let id = format!("msg_{s}");
            runs.push(tokio::spawn(async move {
                batcher.process(&batches, GatewayName::Internal, &id).await
            }));
            if i < in_flight {
                crate::helpers::wait_for(
                    "a batch waits for each held key",
                    std::time::Duration::from_secs(10),
                    async || {
                        sqlx::query_scalar::<_, i64>(
                            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                        )
                        .fetch_one(&pool)
                        .await
                        .unwrap()
                            == i as i64 + 1
                    },
                )
                .await;
            }
        }
        // Time for the other jobs to hand their events in (a send to the batcher's queue each).
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        held.rollback().await.unwrap();
        for run in runs {
            assert_eq!(
                run.await.unwrap().unwrap(),
                Handled::Processed(Processed::Applied)
            );
        }
        let ids: Vec<String> = sessions.iter().map(|s| format!("msg_{s}")).collect();
        let sizes: Vec<i64> = sqlx::query_scalar(
            "SELECT count(*) FROM payment_events WHERE event_id = ANY($1)
             GROUP BY xmin::text ORDER BY count(*) DESC",
        )
        .bind(&ids)
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(sizes.iter().sum::<i64>(), 12, "round {round}: {sizes:?}");
        assert_eq!(
            sizes[0], share,
            "round {round}: {in_flight} batches in flight, the largest takes its share: {sizes:?}"
        );
    }
}

/// A batch that never returns (here its payment's key held by a transaction that never ends;
/// after a failover, a connection left half-open) gives its turn up at its deadline: its
/// events go on alone, and the events behind it are processed meanwhile instead of waiting
/// for it for ever.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_batch_that_never_returns_does_not_hold_up_the_events_behind_it(pool: PgPool) {
    use payfleet::payments::batch::{BatchSettings, Batcher, Handled};
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["s1", "s2"], "10.00", "BRL").await;
    for s in ["s1", "s2"] {
        app.deliver(&internal(
            &format!("msg_{s}"),
            &payment_body("payment.succeeded", s, "10.00"),
        ))
        .await;
    }
    let batcher = Batcher::start(
        pool.clone(),
        std::sync::Arc::new(Processor::default()),
        BatchSettings {
            in_flight: 1,
            deadline: std::time::Duration::from_secs(1),
            ..BatchSettings::default()
        },
        None,
    );
    let held = hold_session_key(&pool, "s1").await;
    let first = {
        let (batcher, pool) = (batcher.clone(), pool.clone());
        tokio::spawn(async move {
            batcher
                .process(&pool, GatewayName::Internal, "msg_s1")
                .await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let second = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        batcher.process(&pool, GatewayName::Internal, "msg_s2"),
    )
    .await
    .expect("the second event is processed while the first's batch is stuck")
    .unwrap();
    assert_eq!(second, Handled::Processed(Processed::Applied));
    assert_eq!(
        order_status(&pool, "internal", "s2").await.unwrap().0,
        "paid"
    );
    assert_eq!(
        order_status(&pool, "internal", "s1").await.unwrap().0,
        "awaiting_payment"
    );
    held.commit().await.unwrap();
    assert_eq!(
        first.await.unwrap().unwrap(),
        Handled::Processed(Processed::Applied)
    );
    assert_eq!(
        order_status(&pool, "internal", "s1").await.unwrap().0,
        "paid"
    );
}

/// A transaction holding the payment key of internal session `session`, as a long transaction
/// processing it would: whatever processes that session's events waits for it to end.
async fn hold_session_key(
    pool: &PgPool,
    session: &str,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut held = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('internal:session:' || $1, 0))")
        .bind(session)
        .execute(&mut *held)
        .await
        .unwrap();
    held
}

/// An event that will never apply (here a refund waiting for a payment no order has) is ended
/// by an operator with a reason: recorded ignored, no longer unprocessed, and a payment that
/// comes later does not wake it. One still being processed, one processed already, and one
/// without a reason are refused, changing nothing.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_operator_dismisses_an_event_that_will_never_apply(pool: PgPool) {
    use payfleet::payments::events::{self, DismissError};
    let app = spawn_app(pool.clone()).await;
    app.deliver(&internal(
        "msg_orphan",
        &refund_body("sess_nobody", "ref_1", "25.00"),
    ))
    .await;
    // Not processed yet: its job is waiting.
    let id: i64 = sqlx::query_scalar("SELECT id FROM payment_events WHERE event_id = 'msg_orphan'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(matches!(
        events::dismiss(&pool, id, "never ours").await,
        Err(DismissError::BeingProcessed(i)) if i == id
    ));
    process_events(&pool).await;
    let unprocessed = events::unprocessed(&pool, 10).await.unwrap();
    assert_eq!(unprocessed.len(), 1);
    assert_eq!(unprocessed[0].state(), "waiting");
    for reason in ["", "   ", &"x".repeat(501)] {
        assert!(matches!(
            events::dismiss(&pool, id, reason).await,
            Err(DismissError::Reason)
        ));
    }
    assert!(matches!(
        events::dismiss(&pool, 99_999, "gone").await,
        Err(DismissError::NotFound(99_999))
    ));
    assert_eq!(events::unprocessed(&pool, 10).await.unwrap().len(), 1);

    events::dismiss(&pool, id, "a connected account's own sale")
        .await
        .unwrap();
    let (outcome, detail, waiting_for): (String, String, Option<String>) = sqlx::query_as(
        "SELECT outcome, outcome_detail, waiting_for FROM payment_events WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (outcome.as_str(), detail.as_str(), waiting_for),
        (
            "ignored",
            "dismissed by an operator: a connected account's own sale",
            None
        )
    );
    assert!(events::unprocessed(&pool, 10).await.unwrap().is_empty());
    assert!(matches!(
        events::dismiss(&pool, id, "again").await,
        Err(DismissError::AlreadyProcessed { .. })
    ));
}
