use payfleet::gateways::GatewayName;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::helpers::*;

const RAZORPAY_CAPTURED: &str = r#"{"entity":"event","event":"payment.captured","contains":["payment"],"payload":{"payment":{"entity":{"id":"pay_1","amount":50000,"currency":"INR","status":"captured","order_id":"order_1"}}},"created_at":1700000000}"#;

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn every_gateway_accepts_its_signed_webhook_and_stores_it_with_its_job(pool: PgPool) {
    let app = spawn_app(pool).await;
    let deliveries = [
        stripe(
            r#"{"id":"evt_1","type":"checkout.session.completed","data":{"object":{"id":"cs_1"}}}"#,
            now(),
        ),
        mercadopago("123456", "req-1", now() * 1000),
        razorpay("evt_rzp_1", RAZORPAY_CAPTURED),
        internal("msg_1", &payment_body("payment.succeeded", "s1", "10.00")),
        standard(
            GatewayName::Mock,
            "msg_1",
            now(),
            &payment_body("payment.succeeded", "s1", "10.00"),
        ),
    ];
    for d in &deliveries {
        let (status, body) = app.deliver(d).await;
        assert_eq!(
            (status, body["status"].as_str()),
            (200, Some("accepted")),
            "{}: {body}",
            d.gateway
        );
    }
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT e.gateway, e.event_id, (SELECT count(*) FROM jobs j WHERE j.key = 'payment_event:' || e.gateway || ':' || e.event_id)
         FROM payment_events e ORDER BY e.id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let expected = [
        ("stripe", "evt_1"),
        ("mercadopago", "123456:req-1"),
        ("razorpay", "payment.captured:pay_1:1700000000"),
        ("internal", "msg_1"),
        ("mock", "msg_1"),
    ];
    assert_eq!(rows.len(), 5);
    for ((g, id, jobs), (eg, eid)) in rows.iter().zip(expected) {
        assert_eq!((g.as_str(), id.as_str(), *jobs), (eg, eid, 1));
    }
    // The raw bytes are kept exactly as signed.
    let raw: Vec<u8> =
        sqlx::query_scalar("SELECT raw_body FROM payment_events WHERE gateway = 'razorpay'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(raw, RAZORPAY_CAPTURED.as_bytes());
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn bad_signatures_and_stale_timestamps_are_401_and_store_nothing(pool: PgPool) {
    let app = spawn_app(pool).await;
    let body = payment_body("payment.succeeded", "s1", "10.00");

    let mut tampered = internal("msg_1", &body);
    tampered.body = body.replace("10.00", "99.00").into_bytes();
    // Well beyond the 300 s tolerance: a loaded machine may take seconds to send them.
    let stale = standard(GatewayName::Internal, "msg_2", now() - 3600, &body);
    let future = standard(GatewayName::Internal, "msg_3", now() + 3600, &body);
    let mut unsigned = internal("msg_4", &body);
    unsigned.headers.retain(|(k, _)| k != "webhook-signature");
    let mut empty_sig = internal("msg_5", &body);
    empty_sig.headers.retain(|(k, _)| k != "webhook-signature");
    empty_sig
        .headers
        .push(("webhook-signature".into(), "v1,".into()));
    let stripe_stale = stripe(r#"{"id":"evt_1"}"#, now() - 400);
    let mut stripe_v0 = stripe(r#"{"id":"evt_2"}"#, now());
    stripe_v0.headers[0].1 = stripe_v0.headers[0].1.replace("v1=", "v0=");
    let mut rzp_newline = razorpay("evt_1", r#"{"event":"payment.captured"}"#);
    rzp_newline.body.push(b'\n');
    let mut mp_wrong_id = mercadopago("123456", "req-1", now() * 1000);
    mp_wrong_id.query = "?data.id=999999".into();

    for d in [
        tampered,
        stale,
        future,
        unsigned,
        empty_sig,
        stripe_stale,
        stripe_v0,
        rzp_newline,
        mp_wrong_id,
    ] {
        let (status, body) = app.deliver(&d).await;
        assert_eq!(status, 401, "{}: {body}", d.gateway);
        assert_eq!(body["error"]["code"], "unauthenticated");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    assert_eq!(app.events().await, 0);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_repeated_event_is_a_duplicate_even_hours_later(pool: PgPool) {
    let app = spawn_app(pool).await;
    let body = payment_body("payment.succeeded", "s1", "10.00");
    let (_, first) = app.deliver(&internal("msg_1", &body)).await;
    assert_eq!(first["status"], "accepted");
    // Re-signed later with a fresh timestamp: same event id, so a duplicate.
    let (status, again) = app
        .deliver(&standard(GatewayName::Internal, "msg_1", now() + 60, &body))
        .await;
    assert_eq!((status, again["status"].as_str()), (200, Some("duplicate")));
    assert_eq!(app.events().await, 1);
}

/// Mercado Pago signs an alphanumeric `data.id` lowercased, so one captured notification is
/// validly signed under every spelling of its id's case: each spelling must be the same event,
/// not one more stored event and job (and one more API lookup) per spelling.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_mercadopago_notification_resent_with_its_id_in_another_case_is_a_duplicate(
    pool: PgPool,
) {
    let app = spawn_app(pool).await;
    let first = mercadopago_topic(
        "subscription_preapproval",
        "2c93abc9",
        "req-7",
        now() * 1000,
    );
    let (_, answer) = app.deliver(&first).await;
    assert_eq!(answer["status"], "accepted", "{answer}");
    for spelling in ["2C93ABC9", "2c93Abc9"] {
        let mut resent = first.clone();
        resent.query = resent.query.replace("2c93abc9", spelling);
        resent.body = String::from_utf8(resent.body)
            .unwrap()
            .replace("2c93abc9", spelling)
            .into_bytes();
        let (status, answer) = app.deliver(&resent).await;
        assert_eq!(
            (status, answer["status"].as_str()),
            (200, Some("duplicate")),
            "{spelling}: {answer}"
        );
    }
    assert_eq!(app.events().await, 1);
    let jobs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'process_payment_event'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(jobs, 1);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn concurrent_duplicate_deliveries_store_one_row_and_all_get_200(pool: PgPool) {
    let app = spawn_app(pool).await;
    let d = internal(
        "msg_same",
        &payment_body("payment.succeeded", "s1", "10.00"),
    );
    let mut tasks = Vec::new();
    let app = std::sync::Arc::new(app);
    for _ in 0..20 {
        let app = app.clone();
        let d = Delivery {
            gateway: d.gateway,
            headers: d.headers.clone(),
            query: d.query.clone(),
            body: d.body.clone(),
        };
        tasks.push(tokio::spawn(async move { app.deliver(&d).await }));
    }
    let mut accepted = 0;
    for t in tasks {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 200, "{body}");
        if body["status"] == "accepted" {
            accepted += 1;
        } else {
            assert_eq!(body["status"], "duplicate");
        }
    }
    assert_eq!(accepted, 1);
    assert_eq!(app.events().await, 1);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 1);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn unknown_and_disabled_gateways_are_404(pool: PgPool) {
    let mut config = test_config();
    // Only the internal gateway's webhooks are taken.
    let g = &mut config.gateways;
    g.stripe.webhook_secret = None;
    g.mercadopago.webhook_secret = None;
    g.razorpay.webhook_secret = None;
    g.hosted.mock = None;
    let app = spawn_app_with(pool, config).await;
    let resp = app
        .http
        .post(format!("http://{}/webhooks/paypal", app.addr))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found");
    let (status, _) = app.deliver(&stripe(r#"{"id":"evt_1"}"#, now())).await;
    assert_eq!(status, 404);
    assert_eq!(app.events().await, 0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_oversized_body_is_413_and_a_signed_non_json_body_is_400(pool: PgPool) {
    let mut config = test_config();
    config.webhooks.body_limit = 1024;
    let app = spawn_app_with(pool, config).await;
    let big = format!(
        r#"{{"type":"payment.succeeded","pad":"{}"}}"#,
        "x".repeat(2000)
    );
    let (status, body) = app.deliver(&internal("msg_big", &big)).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (413, Some("payload_too_large"))
    );
    let (status, body) = app.deliver(&internal("msg_bad", "not json")).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("bad_request"))
    );
    let (status, _) = app.deliver(&stripe(r#"{"type":"no id"}"#, now())).await;
    assert_eq!(status, 400);
    let mut swapped = mercadopago("123456", "req-1", now() * 1000);
    swapped.body = br#"{"type":"payment","data":{"id":"999"}}"#.to_vec();
    let (status, body) = app.deliver(&swapped).await;
    assert_eq!(
        status, 400,
        "an unsigned body naming another payment: {body}"
    );
    assert_eq!(app.events().await, 0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_database_down_is_503(_pool: PgPool) {
    // Nothing listens on port 1: every connection attempt fails at once.
    let dead = PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(1))
        .connect_lazy("postgres://postgres@127.0.0.1:1/nowhere")
        .unwrap();
    let app = spawn_app(dead).await;
    let (status, body) = app
        .deliver(&internal(
            "msg_1",
            &payment_body("payment.succeeded", "s1", "1.00"),
        ))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("unavailable")),
        "{body}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn when_the_job_cannot_be_written_the_event_is_not_stored_either(pool: PgPool) {
    // Make every job insert fail, after the event insert has succeeded in the same transaction.
    sqlx::query("ALTER TABLE jobs ADD CONSTRAINT refuse_all CHECK (false) NOT VALID")
        .execute(&pool)
        .await
        .unwrap();
    let app = spawn_app(pool).await;
    let (status, _) = app
        .deliver(&internal(
            "msg_1",
            &payment_body("payment.succeeded", "s1", "1.00"),
        ))
        .await;
    assert!(status >= 500, "{status}");
    assert_eq!(app.events().await, 0, "no half-written event");
    // The gateway resends once we are healthy again, and the event is stored then.
    sqlx::query("ALTER TABLE jobs DROP CONSTRAINT refuse_all")
        .execute(&app.pool)
        .await
        .unwrap();
    let (status, body) = app
        .deliver(&internal(
            "msg_1",
            &payment_body("payment.succeeded", "s1", "1.00"),
        ))
        .await;
    assert_eq!((status, body["status"].as_str()), (200, Some("accepted")));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn stored_events_are_immutable(pool: PgPool) {
    let app = spawn_app(pool).await;
    app.deliver(&internal(
        "msg_1",
        &payment_body("payment.succeeded", "s1", "1.00"),
    ))
    .await;
    let err = sqlx::query("UPDATE payment_events SET raw_body = 'x'")
        .execute(&app.pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("immutable"), "{err}");
    let err = sqlx::query("DELETE FROM payment_events")
        .execute(&app.pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("append-only"), "{err}");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_event_the_database_refuses_does_not_fail_the_others_written_with_it(pool: PgPool) {
    sqlx::query(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.event_id = 'poison' THEN RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("CREATE TRIGGER refuse_poison BEFORE INSERT ON payment_events FOR EACH ROW EXECUTE FUNCTION refuse_poison()")
        .execute(&pool)
        .await
        .unwrap();
    let app = std::sync::Arc::new(spawn_app(pool).await);
    // Sent at once, so they are likely written in the same batch.
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let app = app.clone();
            let id = if i == 7 {
                "poison".to_owned()
            } else {
                format!("msg_{i}")
            };
            tokio::spawn(async move {
                let d = internal(
                    &id,
                    &payment_body("payment.succeeded", &format!("s{i}"), "1.00"),
                );
                (id, app.deliver(&d).await)
            })
        })
        .collect();
    for t in tasks {
        let (id, (status, body)) = t.await.unwrap();
        if id == "poison" {
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (500, Some("internal")),
                "{body}"
            );
        } else {
            assert_eq!(
                (status, body["status"].as_str()),
                (200, Some("accepted")),
                "{id}: {body}"
            );
        }
    }
    assert_eq!(app.events().await, 23);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 23);
}

/// A Standard Webhooks delivery with a fresh timestamp, a `body` and `n` wrong signatures.
fn forged(id: &str, n: usize, body: Vec<u8>) -> Delivery {
    let wrong = payfleet::secret::StandardSecret::parse(MOCK_SECRET)
        .unwrap()
        .sign(id, now(), b"{}");
    Delivery {
        gateway: GatewayName::Internal,
        headers: vec![
            ("webhook-id".into(), id.into()),
            ("webhook-timestamp".into(), now().to_string()),
            (
                "webhook-signature".into(),
                vec![wrong.as_str(); n].join(" "),
            ),
        ],
        query: String::new(),
        body,
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_worst_request_a_sender_can_make_is_refused_cheaply(pool: PgPool) {
    let app = spawn_app(pool).await;
    let body = vec![b'{'; 1024 * 1024 - 1024];
    // 8,000 signatures (about 380 KB of header, under hyper's limit) and a 1 MiB body: once
    // 8,000 HMACs over the body (seconds of CPU); now refused before any hashing.
    let started = std::time::Instant::now();
    let (status, resp) = app.deliver(&forged("m1", 8000, body.clone())).await;
    let took = started.elapsed();
    assert_eq!(status, 401, "{resp}");
    assert!(
        resp["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("longer than 2048 bytes")),
        "{resp}"
    );
    assert!(took < std::time::Duration::from_secs(1), "took {took:?}");
    // The most signatures accepted, a fresh timestamp and a 1 MiB body: one HMAC, then 401.
    let started = std::time::Instant::now();
    let (status, resp) = app
        .deliver(&forged(
            "m2",
            payfleet::gateways::signature::MAX_CANDIDATES,
            body,
        ))
        .await;
    let took = started.elapsed();
    assert_eq!(status, 401, "{resp}");
    assert!(took < std::time::Duration::from_secs(1), "took {took:?}");
    assert_eq!(app.events().await, 0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_replayed_razorpay_delivery_under_a_fresh_event_id_is_a_duplicate(pool: PgPool) {
    let app = spawn_app(pool).await;
    let (status, body) = app
        .deliver(&razorpay("evt_original", RAZORPAY_CAPTURED))
        .await;
    assert_eq!((status, body["status"].as_str()), (200, Some("accepted")));
    // Someone who captured the delivery sends it again with a new (unsigned) event id header.
    for fresh in ["evt_replay_1", "evt_replay_2"] {
        let (status, body) = app.deliver(&razorpay(fresh, RAZORPAY_CAPTURED)).await;
        assert_eq!(
            (status, body["status"].as_str()),
            (200, Some("duplicate")),
            "{body}"
        );
    }
    assert_eq!(app.events().await, 1);
    // A body without what identifies it cannot be stored.
    let (status, body) = app
        .deliver(&razorpay(
            "evt_x",
            r#"{"event":"payment.captured","payload":{}}"#,
        ))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("bad_request"))
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_redelivery_re_drives_an_event_whose_job_died(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["sess_1"], "10.00", "BRL").await;
    let body = payment_body("payment.succeeded", "sess_1", "10.00");
    app.deliver(&internal("msg_1", &body)).await;
    // Its job died (attempts used up during a long outage) and the event is not processed.
    sqlx::query("UPDATE jobs SET state = 'discarded', finished_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(process_events(&pool).await, 0);
    // The gateway resends: still a duplicate for the sender, but the event is processed again.
    let (status, resp) = app.deliver(&internal("msg_1", &body)).await;
    assert_eq!((status, resp["status"].as_str()), (200, Some("duplicate")));
    let states: Vec<String> = sqlx::query_scalar("SELECT state FROM jobs ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(states, vec!["discarded", "available"]);
    // A resend while a job is still waiting adds nothing.
    app.deliver(&internal("msg_1", &body)).await;
    assert_eq!(process_events(&pool).await, 1);
    assert_eq!(
        order_status(&pool, "internal", "sess_1").await.unwrap().0,
        "paid"
    );
    // Once processed, a resend enqueues nothing: the dead job is all that is left (the one that
    // completed was deleted).
    app.deliver(&internal("msg_1", &body)).await;
    let states: Vec<String> = sqlx::query_scalar("SELECT state FROM jobs ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(states, ["discarded"]);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_events_job_carries_its_seller_as_fairness_key_the_gateways_account_first(pool: PgPool) {
    let app = spawn_app(pool).await;
    let deliveries = [
        stripe(
            r#"{"id":"evt_s","type":"checkout.session.completed","data":{"object":{"id":"cs_9","metadata":{"seller_id":"seller-7"}}}}"#,
            now(),
        ),
        stripe(
            r#"{"id":"evt_c","account":"acct_42","type":"checkout.session.completed","data":{"object":{"id":"cs_8"}}}"#,
            now(),
        ),
        stripe(
            r#"{"id":"evt_n","type":"checkout.session.completed","data":{"object":{"id":"cs_7"}}}"#,
            now(),
        ),
        // A connected seller writes its own objects' metadata: naming another seller there
        // must not put its events in that seller's group.
        stripe(
            r#"{"id":"evt_f","account":"acct_43","type":"checkout.session.completed","data":{"object":{"id":"cs_6","metadata":{"seller_id":"seller-7"}}}}"#,
            now(),
        ),
    ];
    for d in &deliveries {
        assert_eq!(app.deliver(d).await.0, 200);
    }
    let keys: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT key, fairness_key FROM jobs WHERE kind = 'process_payment_event' ORDER BY id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        keys,
        vec![
            (
                "payment_event:stripe:evt_s".into(),
                Some("seller:seller-7".into())
            ),
            (
                "payment_event:stripe:evt_c".into(),
                Some("stripe:acct_42".into())
            ),
            ("payment_event:stripe:evt_n".into(), None),
            (
                "payment_event:stripe:evt_f".into(),
                Some("stripe:acct_43".into())
            ),
        ]
    );
}
