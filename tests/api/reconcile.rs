//! Missed-webhook reconciliation: a payment whose webhook was lost confirms its order once the
//! gateway is asked, the webhook arriving too changes nothing twice, each gateway is asked at
//! its pace and within its share per run, and a gateway that does not answer is reported.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Path;
use axum::routing::get;
use payfleet::payments::reconcile::{self, Settings};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::checkout::{Shop, payment_side};
use crate::helpers::*;

pub(crate) fn settings(per_run: usize, pace_ms: u64) -> Settings {
    Settings {
        grace: Duration::ZERO,
        per_run,
        pace: Duration::from_millis(pace_ms),
    }
}

/// What `sql` (a `count(*)`) counts.
async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn order_events(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT kind FROM order_events ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_lost_webhook_is_found_by_asking_the_gateway_and_the_late_one_changes_nothing(
    pool: PgPool,
) {
    let shop = Shop {
        app: Arc::new(spawn_app(pool.clone()).await),
    };
    payment_side(&pool, &shop.app.config);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seller = shop.seller("S").await;
    let product = shop.product(&seller, "25.00", "BRL").await;
    let (status, answer) = shop
        .checkout(
            Some("k"),
            json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    let order = &answer["orders"][0];
    let n = order["number"].as_i64().unwrap();
    // The buyer pays; the gateway's webhook is not delivered (its delivery job is not run).
    let (paid, _) = shop
        .app
        .pay(order["payment"]["url"].as_str().unwrap(), "succeeded")
        .await;
    assert_eq!(paid, 200);
    process_events_with(&pool, &shop.app.config).await;
    assert_eq!(shop.order(n).await["status"], "awaiting_payment");

    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let report = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!((report.asked, report.found), (1, 1));
    process_events_with(&pool, &shop.app.config).await;
    let o = shop.order(n).await;
    assert_eq!(
        (o["status"].as_str(), o["payment_status"].as_str()),
        (Some("paid"), Some("succeeded"))
    );

    // The webhook arrives after all, and reconciliation runs again: nothing changes twice.
    step(&pool, &shop.app.config, "payments").await;
    process_events_with(&pool, &shop.app.config).await;
    let again = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!(
        (again.asked, again.found),
        (0, 0),
        "a paid order is not asked about"
    );
    assert_eq!(order_events(&pool).await, vec!["created", "paid"]);
    let sources: Vec<(String, String)> =
        sqlx::query_as("SELECT source, outcome FROM payment_events ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        sources,
        vec![
            ("reconciliation".into(), "applied".into()),
            ("webhook".into(), "ignored".into())
        ]
    );
    let metrics = shop.app.metrics().await;
    assert!(
        metrics.contains(
            "payfleet_reconciliation_findings{gateway=\"internal\",outcome=\"succeeded\"} 1"
        ),
        "{metrics}"
    );
}

/// A Stripe stand-in: `cs_paid*` sessions are paid (10.00 BRL), the others unpaid; its
/// events list (`delivery_success=false` only) holds `undelivered`.
async fn stripe_stand_in(asked: Arc<AtomicUsize>, undelivered: Vec<Value>) -> String {
    let app = Router::new()
        .route(
            "/v1/events",
            get(
                move |axum::extract::Query(q): axum::extract::Query<
                    std::collections::HashMap<String, String>,
                >| {
                    let undelivered = undelivered.clone();
                    async move {
                        if q.get("delivery_success").map(String::as_str) != Some("false")
                            || !q.contains_key("created[gte]")
                        {
                            return (
                                axum::http::StatusCode::BAD_REQUEST,
                                axum::Json(json!({"error": {"type": "invalid_request_error", "message": "stand-in: ask for undelivered events"}})),
                            );
                        }
                        (
                            axum::http::StatusCode::OK,
                            axum::Json(json!({"object": "list", "data": undelivered, "has_more": false})),
                        )
                    }
                },
            ),
        )
        .route(
        "/v1/checkout/sessions/{id}",
        get(move |Path(id): Path<String>| {
            let asked = asked.clone();
            async move {
                asked.fetch_add(1, Ordering::SeqCst);
                let paid = id.starts_with("cs_paid");
                axum::Json(json!({
                    "id": id,
                    "object": "checkout.session",
                    "payment_status": if paid { "paid" } else { "unpaid" },
                    "amount_total": 1000,
                    "currency": "brl",
                    "payment_intent": if paid { Value::from(format!("pi_{id}")) } else { Value::Null },
                }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn with_stripe(base_url: &str) -> payfleet::config::Config {
    let mut config = test_config();
    config.gateways.stripe.api = Some(payfleet::gateways::stripe::Api {
        base_url: base_url.to_owned(),
        secret_key: payfleet::secret::Secret::new("sk_test_reconcile"),
    });
    config
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn each_gateway_is_asked_at_its_pace_within_its_share_and_an_outage_is_reported(
    pool: PgPool,
) {
    let asked = Arc::new(AtomicUsize::new(0));
    let config = with_stripe(&stripe_stand_in(asked.clone(), vec![]).await);
    orders_for(
        &pool,
        "stripe",
        &[
            "cs_open_1",
            "cs_paid_1",
            "cs_open_2",
            "cs_open_3",
            "cs_paid_2",
        ],
        "10.00",
        "BRL",
    )
    .await;
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    // Two sessions per run, 100 ms apart: three runs ask all five, least recently asked first.
    let mut found = 0;
    for _ in 0..3 {
        let before = asked.load(Ordering::SeqCst);
        let start = Instant::now();
        let r = reconcile::run(&pool, &gateways, &settings(2, 100))
            .await
            .unwrap();
        let this_run = asked.load(Ordering::SeqCst) - before;
        assert!(this_run <= 2, "{this_run} questions in one run");
        if this_run == 2 {
            assert!(start.elapsed() >= Duration::from_millis(100), "paced");
        }
        found += r.found;
    }
    // Six questions: all five sessions, then the least recently asked again.
    assert_eq!(asked.load(Ordering::SeqCst), 6);
    let unasked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payment_sessions WHERE checked_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(unasked, 0);
    assert_eq!(found, 2, "each paid session found once");
    process_events_with(&pool, &config).await;
    let paid: Vec<String> = sqlx::query_scalar(
        "SELECT session_id FROM orders WHERE status = 'paid' ORDER BY session_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(paid, vec!["cs_paid_1", "cs_paid_2"]);

    // Stripe goes away: the run stops asking it, reports it, and stores no event.
    let events_before: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    let down = with_stripe("http://127.0.0.1:9");
    let (gateways, _) = payfleet::startup::gateways(&down, &pool).unwrap();
    let r = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!(r.unreachable, vec![payfleet::gateways::GatewayName::Stripe]);
    assert_eq!(
        r.asked, 1,
        "no more questions to a gateway that does not answer"
    );
    let events_after: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(events_after, events_before);
    let findings = reconcile::findings(&pool, 10).await.unwrap();
    assert_eq!(findings[0].outcome, "unreachable");
    assert_eq!(findings[0].gateway, "stripe");
}

/// What Stripe's events list holds for a Checkout Session paid and never delivered.
fn completed_event(id: &str, session: &str) -> Value {
    json!({
        "id": id,
        "object": "event",
        "type": "checkout.session.completed",
        "created": now(),
        "data": {"object": {
            "id": session,
            "object": "checkout.session",
            "payment_status": "paid",
            "payment_intent": format!("pi_{session}"),
            "amount_total": 1000,
            "currency": "brl",
        }},
    })
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn stripes_undelivered_events_are_stored_as_their_webhooks_and_the_late_webhook_is_a_duplicate(
    pool: PgPool,
) {
    let asked = Arc::new(AtomicUsize::new(0));
    let event = completed_event("evt_lost_1", "cs_lost_1");
    let config = with_stripe(&stripe_stand_in(asked.clone(), vec![event.clone()]).await);
    orders_for(&pool, "stripe", &["cs_lost_1", "cs_open_1"], "10.00", "BRL").await;
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let r = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    // One list question and one session question: the session the event settled is not asked.
    assert_eq!((r.asked, r.found), (2, 1));
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    let stored: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT event_id, coalesce(event_type, ''), source FROM payment_events ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        stored,
        [(
            "evt_lost_1".to_owned(),
            "checkout.session.completed".to_owned(),
            "reconciliation".to_owned()
        )]
    );
    process_events_with(&pool, &config).await;
    assert_eq!(
        order_status(&pool, "stripe", "cs_lost_1").await,
        Some(("paid".to_owned(), Some("succeeded".to_owned())))
    );
    let findings = reconcile::findings(&pool, 10).await.unwrap();
    assert_eq!(findings[0].outcome, "succeeded");
    assert!(
        findings[0].detail.contains("evt_lost_1"),
        "{}",
        findings[0].detail
    );

    // Stripe finally delivers it: the same event id, a duplicate that changes nothing. The
    // next run finds nothing new either.
    let app = spawn_app_with(pool.clone(), config.clone()).await;
    let (status, body) = app.deliver(&stripe(&event.to_string(), now())).await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("duplicate")),
        "{body}"
    );
    let r = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!(r.found, 0);
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(events, 1);
}

/// Mercado Pago (as Razorpay) takes several attempts at one checkout: a payment refused, then
/// one approved whose notification is lost. The refusal must not stop reconciliation from
/// asking about the checkout: the approved payment confirms the order.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_approved_after_a_refused_attempt_is_still_looked_for(pool: PgPool) {
    let (payments, config) = crate::processing::mercadopago_config().await;
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "mercadopago", &["pref_7"], "50.00", "BRL").await;
    let set = |id: i64, status: &str| {
        payments.lock().unwrap().insert(
            id.to_string(),
            json!({
                "id": id, "status": status, "transaction_amount": 50, "currency_id": "BRL",
                "external_reference": "pref_7", "refunds": []
            }),
        );
    };
    set(701, "rejected");
    app.deliver(&mercadopago("701", "req-701", now() * 1000))
        .await;
    process_events_with(&pool, &config).await;
    let state = async || -> (String, String) {
        sqlx::query_as(
            "SELECT o.status, po.status FROM orders o
             JOIN payment_orders po ON po.gateway = o.gateway AND po.session_id = o.session_id
             WHERE o.session_id = 'pref_7'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(state().await, ("payment_failed".into(), "failed".into()));
    // Asked while the refusal is all there is: the failure its webhook reported is no finding.
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let r = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!((r.asked, r.found), (1, 0));
    let findings: i64 = sqlx::query_scalar("SELECT count(*) FROM reconciliation_findings")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(findings, 0, "nothing a webhook had not said");

    // The buyer tries again in the same checkout; this approval's notification never comes.
    set(702, "approved");
    let r = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!((r.asked, r.found), (1, 1), "the checkout is asked about");
    process_events_with(&pool, &config).await;
    assert_eq!(state().await, ("paid".into(), "succeeded".into()));
    let again = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!((again.asked, again.found), (0, 0), "a paid order is not");
}

/// A Mercado Pago payment whose every notification was lost, refunded since: reconciliation
/// finds it `refunded`, which counts as paid, and reads the payment again whole, as its lost
/// notification would have been: the order is paid and refunded, the refund recorded. Before,
/// the bare success confirmed the order and posted its sale on money the buyer had back, and
/// nothing ever recorded the refund.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_found_refunded_is_recorded_with_its_refund(pool: PgPool) {
    let (payments, config) = crate::processing::mercadopago_config().await;
    let _app = spawn_app(pool.clone()).await;
    orders_for(&pool, "mercadopago", &["pref_8"], "50.00", "BRL").await;
    payments.lock().unwrap().insert(
        "801".to_owned(),
        json!({
            "id": 801, "status": "refunded", "transaction_amount": 50, "currency_id": "BRL",
            "external_reference": "pref_8",
            "refunds": [{"id": 9801, "amount": 50, "status": "approved"}]
        }),
    );
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let r = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!((r.asked, r.found), (1, 1));
    process_events_with(&pool, &config).await;
    let (status, refunded): (String, rust_decimal::Decimal) =
        sqlx::query_as("SELECT status, amount_refunded FROM orders WHERE session_id = 'pref_8'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), refunded),
        ("refunded", "50".parse().unwrap())
    );
}

/// An order paid one way (another attempt's session, its coins) while an earlier session of its
/// own was still open: that session is paid days later (a voucher, a boleto) and its webhooks are
/// lost. Reconciliation goes on asking about a paid order's other sessions as it does about an
/// expired order's (ten days, every six hours), so the second payment is found and given back.
/// Before, a paid order's sessions were never asked about, and the buyer who paid twice kept
/// paying twice.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_second_payment_of_a_paid_order_whose_webhooks_were_lost_is_found_and_given_back(
    pool: PgPool,
) {
    let asked = Arc::new(AtomicUsize::new(0));
    let config = with_stripe(&stripe_stand_in(asked.clone(), vec![]).await);
    orders_for(&pool, "stripe", &["cs_card"], "10.00", "BRL").await;
    // The order's first attempt's session (a voucher, paid at Stripe since), and the order
    // paid through the card's.
    for statement in [
        "INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee)
         SELECT number, 2, 'stripe', 'cs_paid_voucher', 'http://pay/v', 10, 'BRL', 0 FROM orders",
        "INSERT INTO payment_orders (gateway, session_id, payment_id, status, amount, currency, succeeded_at)
         VALUES ('stripe', 'cs_card', 'pi_card', 'succeeded', 10, 'BRL', now() - interval '2 days')",
        "UPDATE orders SET status = 'paid', payment_status = 'succeeded', paid_at = now() - interval '2 days'",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let r = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!(r.found, 1);
    let checked: Vec<String> =
        sqlx::query_scalar("SELECT session_id FROM payment_sessions WHERE checked_at IS NOT NULL")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        checked,
        ["cs_paid_voucher"],
        "the voucher's session, not the card's"
    );
    process_events_with(&pool, &config).await;
    let extra = count(
        &pool,
        "SELECT count(*) FROM order_events WHERE kind = 'extra_payment'",
    )
    .await;
    assert_eq!(extra, 1, "the second payment is the order's message");
    let give_backs = count(
        &pool,
        "SELECT count(*) FROM jobs WHERE kind = 'refund_payment'",
    )
    .await;
    assert_eq!(give_backs, 1, "and goes back to the buyer");
    assert_eq!(
        order_status(&pool, "stripe", "cs_card").await,
        Some(("paid".to_owned(), Some("succeeded".to_owned())))
    );
    // Asked again only six hours later, and not once found.
    let again = reconcile::run(&pool, &gateways, &settings(10, 0))
        .await
        .unwrap();
    assert_eq!((again.asked, again.found), (0, 0));
}

/// A session the gateway refuses to tell about (an account deauthorized, say) goes to the back
/// of the line like any answered one: with room for one question a run, the next run asks the
/// next session instead of the refused one again.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_session_the_gateway_refuses_to_tell_about_does_not_crowd_out_the_others(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    orders_for(&pool, "internal", &["cs_gone_1"], "10.00", "BRL").await;
    orders_for(&pool, "internal", &["cs_gone_2"], "10.00", "BRL").await;
    sqlx::query(
        "UPDATE payment_sessions SET created_at = created_at - interval '1 minute'
         WHERE session_id = 'cs_gone_1'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (gateways, _) = payfleet::startup::gateways(&app.config, &pool).unwrap();
    for _ in 0..2 {
        let r = reconcile::run(&pool, &gateways, &settings(1, 0))
            .await
            .unwrap();
        assert_eq!((r.asked, r.found), (1, 0));
    }
    let asked: Vec<(String, String)> =
        sqlx::query_as("SELECT session_id, outcome FROM reconciliation_findings ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        asked,
        vec![
            ("cs_gone_1".into(), "refused".into()),
            ("cs_gone_2".into(), "refused".into())
        ]
    );
}

/// A voucher (a boleto) paid days after its order expired, each of its webhooks lost: the
/// session is asked about for ten days after the expiry, at most every six hours and within a
/// quarter of a run's share, so the payment is found and given back to the buyer as a late
/// payment; abandoned checkouts do not crowd out the current ones, nor are they asked forever.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_voucher_paid_days_after_its_order_expired_is_found_and_given_back(pool: PgPool) {
    let asked = Arc::new(AtomicUsize::new(0));
    let config = with_stripe(&stripe_stand_in(asked.clone(), vec![]).await);
    let open = ["cs_open_1", "cs_open_2", "cs_open_3", "cs_open_4"];
    let late = ["cs_paid_late", "cs_late_unpaid", "cs_paid_too_late"];
    orders_for(
        &pool,
        "stripe",
        &[&open[..], &late[..]].concat(),
        "10.00",
        "BRL",
    )
    .await;
    for (session, days_ago) in [
        ("cs_paid_late", 3),
        ("cs_late_unpaid", 2),
        ("cs_paid_too_late", 11),
    ] {
        sqlx::query(
            "UPDATE orders SET status = 'expired', expired_at = now() - make_interval(days => $2)
             WHERE session_id = $1",
        )
        .bind(session)
        .bind(days_ago)
        .execute(&pool)
        .await
        .unwrap();
    }
    // Asked seven hours ago, nothing paid then: due again.
    sqlx::query(
        "UPDATE payment_sessions SET checked_at = now() - interval '7 hours'
         WHERE session_id = 'cs_late_unpaid'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let run = async |per_run: usize| -> Vec<String> {
        let before = asked.load(Ordering::SeqCst);
        sqlx::query("UPDATE payment_sessions SET checked_at = checked_at - interval '1 second'")
            .execute(&pool)
            .await
            .unwrap();
        reconcile::run(&pool, &gateways, &settings(per_run, 0))
            .await
            .unwrap();
        let checked: Vec<String> = sqlx::query_scalar(
            "SELECT session_id FROM payment_sessions WHERE checked_at > now() - interval '1 second'
             ORDER BY session_id",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(asked.load(Ordering::SeqCst) - before, checked.len());
        checked
    };

    // A run of four: three current sessions and one late one, the one never asked.
    let first = run(4).await;
    assert_eq!(first.len(), 4, "{first:?}");
    assert!(first.contains(&"cs_paid_late".to_owned()), "{first:?}");
    assert_eq!(first.iter().filter(|s| s.starts_with("cs_open")).count(), 3);
    process_events_with(&pool, &config).await;
    let late_payments: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE o.session_id = 'cs_paid_late' AND e.kind = 'late_payment'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(late_payments, 1, "the late payment is the order's message");
    let give_backs = count(
        &pool,
        "SELECT count(*) FROM jobs WHERE kind = 'refund_payment'",
    )
    .await;
    assert_eq!(give_backs, 1, "and goes back to the buyer");
    assert_eq!(
        order_status(&pool, "stripe", "cs_paid_late").await,
        Some(("expired".to_owned(), Some("succeeded".to_owned())))
    );

    // The next run: the other late one, due again after six hours; then none, until six hours
    // have passed, and never the one expired eleven days ago.
    let second = run(4).await;
    assert!(second.contains(&"cs_late_unpaid".to_owned()), "{second:?}");
    assert_eq!(second.len(), 4);
    let third = run(10).await;
    assert_eq!(third, open, "only the current ones");
}
