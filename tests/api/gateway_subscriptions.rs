//! Subscriptions the gateways bill themselves: each period's charge they report is one renewal
//! order, one sale with the gateway's fee, once, whatever the duplicates and their order; their
//! failures make it past due, their ends end it; cancelling asks the gateway first. Driven
//! through the HTTP API and signed webhooks against stand-ins that speak each gateway's API.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::http::{Method, StatusCode};
use chrono::Datelike;
use payfleet::config::Config;
use payfleet::secret::Secret;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::checkout::Shop;
use crate::gateways::{Log, stand_in, stripe_api};
use crate::helpers::*;
use crate::subscriptions::{cancel, steps};

const MONTH: i64 = 30 * 24 * 3600;

/// A fleet with `gateway`'s API at the stand-in `api`, a seller (with a Stripe account) and a
/// subscription product of theirs at 19.90 `currency` a month, and a paid-for-nothing-yet
/// subscription order on `gateway`: the shop and the order.
async fn subscription_order(
    pool: &PgPool,
    gateway: &str,
    currency: &str,
    configure: impl FnOnce(&mut Config),
) -> (Shop, Value) {
    let mut config = test_config();
    configure(&mut config);
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config).await),
    };
    let seller = shop
        .admin(
            "/admin/sellers",
            json!({"name": "Club", "payout_frequency": "weekly", "payout_minimum": "0", "stripe_account": "acct_seller1"}),
        )
        .await;
    let club = shop
        .admin(
            "/admin/products",
            json!({"seller_id": seller["id"], "name": "club", "kind": "subscription", "price": "19.90", "currency": currency, "interval": "month"}),
        )
        .await;
    let cart = json!({"buyer_id": "buyer-9", "gateway": gateway, "items": [{"product_id": club["id"], "quantity": 1}]});
    // The payment side's RPC consumer may still be starting.
    let mut answer = Value::Null;
    for _ in 0..50 {
        let (status, a) = shop.checkout(Some("sub"), cart.clone()).await;
        answer = a;
        if status == 201 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let order = answer["orders"][0].clone();
    assert!(order["payment"]["session_id"].is_string(), "{answer}");
    (shop, order)
}

async fn deliver(shop: &Shop, d: &Delivery) {
    let (status, body) = shop.app.deliver(d).await;
    assert_eq!(status, 200, "{body}");
}

/// How the stored event `event_id` (of `gateway`) ended, once processed.
async fn outcome(pool: &PgPool, gateway: &str, event_id: &str) -> (String, Option<String>) {
    let mut found = None;
    wait_for("the event processed", Duration::from_secs(30), async || {
        found = sqlx::query_as(
            "SELECT outcome, waiting_for FROM payment_events
             WHERE gateway = $1 AND event_id = $2 AND outcome IS NOT NULL",
        )
        .bind(gateway)
        .bind(event_id)
        .fetch_optional(pool)
        .await
        .unwrap();
        found.is_some()
    })
    .await;
    found.unwrap()
}

async fn subscription_of(shop: &Shop, number: i64) -> Value {
    wait_for("the subscription", Duration::from_secs(30), async || {
        shop.order(number).await["subscription_id"].is_string()
    })
    .await;
    let id = shop.order(number).await["subscription_id"].clone();
    let (status, body) = shop
        .app
        .get(&format!("/subscriptions/{}", id.as_str().unwrap()))
        .await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

async fn wait_subscription(shop: &Shop, number: i64, what: &str, done: impl Fn(&Value) -> bool) {
    wait_for(what, Duration::from_secs(30), async || {
        done(&subscription_of(shop, number).await)
    })
    .await;
}

/// Each renewal order: (number, status, platform fee, seller net, sales posted for it).
async fn renewals(pool: &PgPool) -> Vec<(i64, String, String, String, i64)> {
    sqlx::query_as(
        "SELECT o.number, o.status, o.platform_fee::text, o.seller_net::text,
                (SELECT count(*) FROM ledger_transfers t WHERE t.source_key = 'sale:' || o.number)
         FROM orders o WHERE o.renews IS NOT NULL ORDER BY o.period_start",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

fn with_stripe(base: String) -> impl FnOnce(&mut Config) {
    move |config: &mut Config| {
        config.gateways.stripe.api = Some(payfleet::gateways::stripe::Api {
            base_url: base,
            secret_key: Secret::new("sk_test_123"),
        });
    }
}

fn with_mercadopago(base: String) -> impl FnOnce(&mut Config) {
    move |config: &mut Config| {
        config.gateways.mercadopago.api = Some(payfleet::gateways::mercadopago::Api {
            base_url: base,
            access_token: Secret::new("TEST-token"),
        });
    }
}

/// A Stripe invoice event of subscription `sub_1` (on the seller's connected account).
fn invoice(event: &str, kind: &str, invoice: &str, pi: &str, reason: &str, start: i64) -> String {
    json!({"id": event, "type": kind, "account": "acct_seller1", "data": {"object": {
        "id": invoice, "object": "invoice", "subscription": "sub_1", "billing_reason": reason,
        "payment_intent": pi, "amount_paid": if kind == "invoice.payment_failed" { 0 } else { 1990 },
        "amount_due": 1990, "currency": "brl", "application_fee_amount": 199,
        "lines": {"data": [{"period": {"start": start, "end": start + MONTH}}]}}}})
    .to_string()
}

fn session_completed(event: &str, session: &str, subscription: Option<&str>) -> String {
    json!({"id": event, "type": "checkout.session.completed", "account": "acct_seller1", "data": {"object": {
        "id": session, "object": "checkout.session", "mode": "subscription", "subscription": subscription,
        "payment_intent": null, "invoice": "in_1", "amount_total": 1990, "currency": "brl",
        "payment_status": "paid"}}})
    .to_string()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn stripe_renewals_are_one_sale_per_period_whatever_their_order_and_duplicates(pool: PgPool) {
    let base = stand_in(stripe_api(), Log::default()).await;
    let (shop, order) = subscription_order(&pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    let t0 = chrono::Utc::now().timestamp();
    let (p2, p3, p4) = (t0 + MONTH, t0 + 2 * MONTH, t0 + 3 * MONTH);

    // The second period's invoice arrives before the checkout's own event: it waits for it.
    let early = invoice(
        "evt_p2",
        "invoice.paid",
        "in_2",
        "pi_2",
        "subscription_cycle",
        p2,
    );
    deliver(&shop, &stripe(&early, now())).await;
    assert_eq!(
        outcome(&pool, "stripe", "evt_p2").await,
        ("waiting".into(), Some("subscription:sub_1".into()))
    );
    deliver(
        &shop,
        &stripe(&session_completed("evt_1", &session, Some("sub_1")), now()),
    )
    .await;
    wait_subscription(&shop, number, "the early renewal paid", |s| {
        s["renewals"][0]["state"] == "paid"
    })
    .await;
    let sub = subscription_of(&shop, number).await;
    assert_eq!(sub["gateway"], "stripe");
    assert_eq!(sub["status"], "active");
    assert_eq!(
        chrono::DateTime::parse_from_rfc3339(sub["current_period_start"].as_str().unwrap())
            .unwrap()
            .timestamp(),
        p2,
        "the renewed period is current: {sub}"
    );

    // The invoice of the first period is the checkout's payment: it teaches it its
    // PaymentIntent (which its refunds name), and is no renewal.
    let first = invoice(
        "evt_in1",
        "invoice.paid",
        "in_1",
        "pi_1",
        "subscription_create",
        t0,
    );
    deliver(&shop, &stripe(&first, now())).await;
    outcome(&pool, "stripe", "evt_in1").await;
    let pi: Option<String> = sqlx::query_scalar(
        "SELECT payment_id FROM payment_orders WHERE gateway = 'stripe' AND session_id = $1",
    )
    .bind(&session)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(pi.as_deref(), Some("pi_1"));

    // Duplicates under other event ids, and Stripe's second event type for the same invoice.
    let again = invoice(
        "evt_p2b",
        "invoice.paid",
        "in_2",
        "pi_2",
        "subscription_cycle",
        p2,
    );
    let succeeded = invoice(
        "evt_p2c",
        "invoice.payment_succeeded",
        "in_2",
        "pi_2",
        "subscription_cycle",
        p2,
    );
    deliver(&shop, &stripe(&again, now())).await;
    deliver(&shop, &stripe(&succeeded, now())).await;
    outcome(&pool, "stripe", "evt_p2b").await;
    outcome(&pool, "stripe", "evt_p2c").await;

    // The third period's charge fails, then Stripe's retry of the same invoice succeeds.
    let failed = invoice(
        "evt_p3f",
        "invoice.payment_failed",
        "in_3",
        "pi_3a",
        "subscription_cycle",
        p3,
    );
    deliver(&shop, &stripe(&failed, now())).await;
    wait_subscription(&shop, number, "past due", |s| s["status"] == "past_due").await;
    let sub = subscription_of(&shop, number).await;
    assert_eq!(sub["renewals"][1]["state"], "failed", "{sub}");
    let retried = invoice(
        "evt_p3",
        "invoice.paid",
        "in_3",
        "pi_3b",
        "subscription_cycle",
        p3,
    );
    deliver(&shop, &stripe(&retried, now())).await;
    wait_subscription(&shop, number, "active again", |s| s["status"] == "active").await;
    assert_eq!(steps(&pool, number).await, ["past_due", "reactivated"]);
    let paid = renewals(&pool).await;
    assert_eq!(paid.len(), 2, "{paid:?}");
    for (renewal, status, fee, net, sales) in &paid {
        // The platform's commission on each renewal is the invoice's application fee.
        assert_eq!(
            (status.as_str(), fee.as_str(), net.as_str(), *sales),
            ("paid", "1.9900", "17.9100", 1),
            "renewal {renewal}"
        );
    }

    // This month's commission invoice carries each renewal as a line of its own, at the
    // invoice's application fee.
    let today = chrono::Utc::now().date_naive();
    let month = today.with_day(1).unwrap();
    let next_month = month.checked_add_months(chrono::Months::new(1)).unwrap();
    let numbers = payfleet::ledger::invoices::run(&pool, month, next_month, chrono_tz::UTC)
        .await
        .unwrap();
    let lines: Vec<(i64, String)> = sqlx::query_as(
        "SELECT l.order_number, l.commission::text FROM invoice_lines l
         JOIN invoices i ON i.id = l.invoice_id WHERE i.number = ANY($1) ORDER BY l.order_number",
    )
    .bind(&numbers)
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut want = vec![(number, "1.9900".to_owned())];
    want.extend(paid.iter().map(|r| (r.0, "1.9900".to_owned())));
    assert_eq!(lines, want);

    // A renewal is refunded as any order: Stripe's refund names the PaymentIntent.
    let refunded = json!({"id": "evt_r3", "type": "charge.refunded", "account": "acct_seller1", "data": {"object": {
        "id": "ch_3", "payment_intent": "pi_3b", "refunds": {"data": [{"id": "re_3", "amount": 1990, "currency": "brl", "status": "succeeded"}]}}}});
    deliver(&shop, &stripe(&refunded.to_string(), now())).await;
    wait_subscription(&shop, number, "the renewal refunded", |s| {
        s["renewals"][1]["state"] == "refunded"
    })
    .await;

    // Stripe's changes: cancelled at the period's end, then ended.
    let updated = json!({"id": "evt_u", "type": "customer.subscription.updated", "account": "acct_seller1",
        "data": {"object": {"id": "sub_1", "status": "active", "cancel_at_period_end": true}}});
    deliver(&shop, &stripe(&updated.to_string(), now())).await;
    wait_subscription(&shop, number, "cancel at period end", |s| {
        s["cancel_at_period_end"] == true
    })
    .await;
    let deleted = json!({"id": "evt_d", "type": "customer.subscription.deleted", "account": "acct_seller1",
        "data": {"object": {"id": "sub_1", "status": "canceled"}}});
    deliver(&shop, &stripe(&deleted.to_string(), now())).await;
    wait_subscription(&shop, number, "canceled", |s| s["status"] == "canceled").await;
    assert_eq!(
        steps(&pool, number).await,
        ["past_due", "reactivated", "canceled"]
    );

    // A charge for a period after the end is no sale: its order is cancelled and the money
    // goes back to the buyer.
    let late = invoice(
        "evt_p4",
        "invoice.paid",
        "in_4",
        "pi_4",
        "subscription_cycle",
        p4,
    );
    deliver(&shop, &stripe(&late, now())).await;
    outcome(&pool, "stripe", "evt_p4").await;
    let all = renewals(&pool).await;
    assert_eq!(all.len(), 3, "{all:?}");
    assert_eq!((all[2].1.as_str(), all[2].4), ("cancelled", 0), "{all:?}");
    let given_back: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE o.number = $1 AND e.kind = 'late_payment'",
    )
    .bind(all[2].0)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(given_back, 1);
    // Every event ended applied or known; none was rejected.
    let rejected: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM payment_events WHERE outcome IN ('rejected', 'waiting')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rejected, 0);
}

/// A Stripe invoice event as API versions since 2025-03-31 ("basil") write it: the subscription
/// under `parent.subscription_details`, and no `payment_intent`, `payments` or
/// `application_fee_amount` (an Invoice's payments are a list of their own).
fn basil_invoice(event: &str, invoice: &str, reason: &str, start: i64) -> String {
    json!({"id": event, "type": "invoice.paid", "account": "acct_seller1", "data": {"object": {
        "id": invoice, "object": "invoice", "billing_reason": reason,
        "parent": {"type": "subscription_details", "subscription_details": {"subscription": "sub_1"}},
        "amount_paid": 1990, "amount_due": 1990, "currency": "brl", "status": "paid",
        "lines": {"data": [{"period": {"start": start, "end": start + MONTH}}]}}}})
    .to_string()
}

/// The Stripe stand-in with `GET /v1/invoice_payments`: each invoice's payments, the
/// PaymentIntent expanded when asked (`expand[]=data.payment.payment_intent`). `in_2` was
/// attempted twice: its first PaymentIntent failed, its second paid with an application fee of
/// 1.50 (not what the platform's percentage would make of 19.90).
fn stripe_with_invoice_payments() -> Router<Log> {
    async fn list(
        axum::extract::RawQuery(query): axum::extract::RawQuery,
    ) -> (StatusCode, axum::Json<Value>) {
        let query = query.unwrap_or_default();
        // Asked about `in_3` after the platform's key was rotated.
        if query.contains("invoice=in_3") {
            return (
                StatusCode::UNAUTHORIZED,
                axum::Json(json!({"error": {"type": "invalid_request_error",
                    "message": "Invalid API Key provided: sk_live_****1234"}})),
            );
        }
        let expanded = query.contains("expand%5B%5D=data.payment.payment_intent")
            || query.contains("expand[]=data.payment.payment_intent");
        let intent = |id: &str, fee: i64| {
            if expanded {
                json!({"id": id, "object": "payment_intent", "application_fee_amount": fee, "currency": "brl"})
            } else {
                json!(id)
            }
        };
        let payment = |id: &str, status: &str, fee: i64| {
            json!({"object": "invoice_payment", "status": status,
                   "payment": {"type": "payment_intent", "payment_intent": intent(id, fee)}})
        };
        let data = if query.contains("invoice=in_1") {
            vec![payment("pi_1", "paid", 199)]
        } else if query.contains("invoice=in_2") {
            vec![
                payment("pi_2b", "paid", 150),
                payment("pi_2a", "canceled", 150),
            ]
        } else {
            vec![]
        };
        (
            StatusCode::OK,
            axum::Json(json!({"object": "list", "data": data, "has_more": false})),
        )
    }
    stripe_api().route("/v1/invoice_payments", axum::routing::get(list))
}

/// On API versions since 2025-03-31 a paid invoice's event names neither its PaymentIntent nor
/// the fee Stripe took: both are asked of Stripe (`GET /v1/invoice_payments`, on the seller's
/// account), so the first period's payment and each renewal know the PaymentIntent their
/// refunds and disputes name, and the renewal's commission is the fee Stripe took. A dispute
/// of the renewal then takes the renewal's money back from the seller.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_basil_invoice_learns_its_payment_and_fee_from_stripe(pool: PgPool) {
    let log = Log::default();
    let base = stand_in(stripe_with_invoice_payments(), log.clone()).await;
    let (shop, order) = subscription_order(&pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    let t0 = chrono::Utc::now().timestamp();
    deliver(
        &shop,
        &stripe(&session_completed("evt_1", &session, Some("sub_1")), now()),
    )
    .await;
    subscription_of(&shop, number).await;
    // The first period's invoice: the checkout's payment learns its PaymentIntent.
    let first = basil_invoice("evt_in1", "in_1", "subscription_create", t0);
    deliver(&shop, &stripe(&first, now())).await;
    outcome(&pool, "stripe", "evt_in1").await;
    let pi: Option<String> = sqlx::query_scalar(
        "SELECT payment_id FROM payment_orders WHERE gateway = 'stripe' AND session_id = $1",
    )
    .bind(&session)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(pi.as_deref(), Some("pi_1"));
    // The second period's: one renewal, its fee Stripe's.
    let renewal = basil_invoice("evt_in2", "in_2", "subscription_cycle", t0 + MONTH);
    deliver(&shop, &stripe(&renewal, now())).await;
    assert_eq!(outcome(&pool, "stripe", "evt_in2").await.0, "applied");
    let paid = renewals(&pool).await;
    assert_eq!(paid.len(), 1, "{paid:?}");
    assert_eq!(
        (paid[0].1.as_str(), paid[0].2.as_str(), paid[0].4),
        ("paid", "1.5000", 1),
        "{paid:?}"
    );
    let asked: Vec<_> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.uri.starts_with("/v1/invoice_payments"))
        .map(|s| (s.uri.clone(), s.header("stripe-account").map(str::to_owned)))
        .collect();
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(
        asked
            .iter()
            .all(|(uri, account)| uri.contains("expand")
                && account.as_deref() == Some("acct_seller1")),
        "{asked:?}"
    );
    // A dispute of the renewal names its PaymentIntent only: it is applied, not left waiting.
    let disputed = json!({"id": "evt_dp", "type": "charge.dispute.created", "account": "acct_seller1",
        "data": {"object": {"id": "dp_2", "payment_intent": "pi_2b", "amount": 1990, "currency": "brl",
                            "status": "needs_response"}}});
    deliver(&shop, &stripe(&disputed.to_string(), now())).await;
    assert_eq!(outcome(&pool, "stripe", "evt_dp").await.0, "applied");
    let disputes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM payment_disputes d JOIN payment_orders po ON po.id = d.payment_order_id
         WHERE po.payment_id = 'pi_2b'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(disputes, 1);
    // Asked with a key Stripe refuses: the event is rejected, to replay once the key is
    // mended, not recorded without the payment its refunds will name.
    let third = basil_invoice("evt_in3", "in_3", "subscription_cycle", t0 + 2 * MONTH);
    deliver(&shop, &stripe(&third, now())).await;
    assert_eq!(outcome(&pool, "stripe", "evt_in3").await.0, "rejected");
    assert_eq!(renewals(&pool).await.len(), 1);
}

/// The Stripe stand-in, with its subscriptions' cancellation (`POST` with
/// `cancel_at_period_end`, `DELETE`) and retrieval, answering 500 while `down` is set. As at
/// Stripe, a subscription deleted is ended: deleting it again answers 404 `resource_missing`,
/// changing it 400, and retrieving it says `canceled`.
fn stripe_with_subscriptions(down: Arc<AtomicBool>) -> Router<Log> {
    let ended: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let answer = move |id: String, method: Method| {
        let (down, ended) = (down.clone(), ended.clone());
        async move {
            if down.load(Ordering::SeqCst) {
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    axum::Json(json!({"error": {"type": "api_error", "message": "try again"}})),
                );
            }
            let mut ended = ended.lock().unwrap();
            let was_ended = ended.contains(&id);
            match method {
                Method::DELETE if was_ended => (
                    StatusCode::NOT_FOUND,
                    axum::Json(
                        json!({"error": {"type": "invalid_request_error", "code": "resource_missing",
                        "message": format!("No such subscription: '{id}'")}}),
                    ),
                ),
                Method::POST if was_ended => (
                    StatusCode::BAD_REQUEST,
                    axum::Json(json!({"error": {"type": "invalid_request_error",
                        "message": "A canceled subscription can only update its cancellation_details and metadata."}})),
                ),
                method => {
                    if method == Method::DELETE {
                        ended.insert(id.clone());
                    }
                    let status = if was_ended || method == Method::DELETE {
                        "canceled"
                    } else {
                        "active"
                    };
                    (
                        StatusCode::OK,
                        axum::Json(json!({"id": id, "object": "subscription", "status": status})),
                    )
                }
            }
        }
    };
    let (get, post, delete) = (answer.clone(), answer.clone(), answer);
    stripe_api().route(
        "/v1/subscriptions/{id}",
        axum::routing::get(move |Path(id): Path<String>| get(id, Method::GET))
            .post(move |Path(id): Path<String>| post(id, Method::POST))
            .delete(move |Path(id): Path<String>| delete(id, Method::DELETE)),
    )
}

/// A Stripe subscription `sub_1` started by its order's paid checkout, against the stand-in
/// with subscriptions (its requests in `log`, down while `down` is set): the shop, the order's
/// number, the subscription's id here and the stand-in's base URL.
async fn stripe_subscription_started(
    pool: &PgPool,
    log: &Log,
    down: Arc<AtomicBool>,
) -> (Shop, i64, String, String) {
    let base = stand_in(stripe_with_subscriptions(down), log.clone()).await;
    let (shop, order) = subscription_order(pool, "stripe", "BRL", with_stripe(base.clone())).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap();
    deliver(
        &shop,
        &stripe(&session_completed("evt_1", session, Some("sub_1")), now()),
    )
    .await;
    let id = subscription_of(&shop, number).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    (shop, number, id, base)
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_stripe_subscription_is_cancelled_at_stripe_first_then_here_once(pool: PgPool) {
    let log = Log::default();
    let down = Arc::new(AtomicBool::new(false));
    let (shop, number, id, _) = stripe_subscription_started(&pool, &log, down.clone()).await;
    let to_subscriptions = || {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.uri.starts_with("/v1/subscriptions/"))
            .cloned()
            .collect::<Vec<_>>()
    };

    // Stripe cannot be asked: 503, and nothing changed here.
    down.store(true, Ordering::SeqCst);
    let (status, body) = cancel(&shop, &id, json!({"at_period_end": true})).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("gateway_unavailable")),
        "{body}"
    );
    assert_eq!(
        subscription_of(&shop, number).await["cancel_at_period_end"],
        false
    );

    down.store(false, Ordering::SeqCst);
    let (status, sub) = cancel(&shop, &id, json!({"at_period_end": true})).await;
    assert_eq!(status, 200, "{sub}");
    assert_eq!(
        (
            sub["status"].as_str(),
            sub["cancel_at_period_end"].as_bool()
        ),
        (Some("active"), Some(true))
    );
    let sent = to_subscriptions();
    let last = sent.last().unwrap();
    assert_eq!(
        (&last.method, last.uri.as_str()),
        (&Method::POST, "/v1/subscriptions/sub_1")
    );
    assert_eq!(
        last.form().get("cancel_at_period_end").map(String::as_str),
        Some("true")
    );
    assert_eq!(last.header("stripe-account"), Some("acct_seller1"));
    // Setting the flag is idempotent in itself. Under a key of the subscription's own, a second
    // cancellation within Stripe's day (the buyer having resumed it at Stripe since) would be a
    // replay of this answer, setting nothing at Stripe.
    assert_eq!(last.header("idempotency-key"), None);

    let (status, sub) = cancel(&shop, &id, json!({})).await;
    assert_eq!(
        (status, sub["status"].as_str()),
        (200, Some("canceled")),
        "{sub}"
    );
    let sent = to_subscriptions();
    assert_eq!(
        (
            &sent.last().unwrap().method,
            sent.last().unwrap().uri.as_str()
        ),
        (&Method::DELETE, "/v1/subscriptions/sub_1")
    );
    // Once: a canceled subscription is answered as it is, and Stripe is not asked again.
    let asked = sent.len();
    let (status, sub) = cancel(&shop, &id, json!({})).await;
    assert_eq!((status, sub["status"].as_str()), (200, Some("canceled")));
    assert_eq!(to_subscriptions().len(), asked);
    // Stripe's own event of the end changes nothing more.
    let deleted = json!({"id": "evt_d", "type": "customer.subscription.deleted", "account": "acct_seller1",
        "data": {"object": {"id": "sub_1", "status": "canceled"}}});
    deliver(&shop, &stripe(&deleted.to_string(), now())).await;
    outcome(&pool, "stripe", "evt_d").await;
    assert_eq!(steps(&pool, number).await, ["canceled"]);

    // Billed all the same for a period after the end (a gateway that did not keep to it): the
    // charge is given back, and Stripe is asked once more to stop billing; its answer that the
    // subscription has ended already ends that ask done, not dead.
    let deletes = || {
        to_subscriptions()
            .iter()
            .filter(|s| s.method == Method::DELETE)
            .count()
    };
    let before = deletes();
    let after = chrono::Utc::now().timestamp() + MONTH;
    // Its first attempt fails (the renewal order opens, cancelled), Stripe's retry succeeds.
    let failed = invoice(
        "evt_after_failed",
        "invoice.payment_failed",
        "in_after",
        "pi_after",
        "subscription_cycle",
        after,
    );
    deliver(&shop, &stripe(&failed, now())).await;
    outcome(&pool, "stripe", "evt_after_failed").await;
    let charged = invoice(
        "evt_after",
        "invoice.paid",
        "in_after",
        "pi_after",
        "subscription_cycle",
        after,
    );
    for _ in 0..2 {
        deliver(&shop, &stripe(&charged, now())).await;
        outcome(&pool, "stripe", "evt_after").await;
    }
    let refunded = || {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.method == Method::POST && s.uri == "/v1/refunds")
            .filter(|s| s.form().get("payment_intent").map(String::as_str) == Some("pi_after"))
            .count()
    };
    wait_for("the charge given back, the stop asked", Duration::from_secs(30), async || {
        refunded() == 1
            && deletes() == before + 1
            && sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM jobs WHERE kind IN ('stop_unstarted_subscription', 'refund_payment')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
    })
    .await;
    assert_eq!((refunded(), deletes()), (1, before + 1));
}

/// Stripe ended the subscription and its event of the end was lost: a cancellation at the
/// period's end asked here finds it ended there (Stripe refuses to change it; read, it says
/// `canceled`), so it ends here now, rather than wait for an end no event will bring.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_subscription_stripe_ended_unannounced_ends_here_when_cancelled(pool: PgPool) {
    let log = Log::default();
    let (shop, number, id, base) = stripe_subscription_started(&pool, &log, Arc::default()).await;
    // Stripe ends it (its dunning gave up, say); the event saying so never comes.
    let ended = reqwest::Client::new()
        .delete(format!("{base}/v1/subscriptions/sub_1"))
        .send()
        .await
        .unwrap();
    assert!(ended.status().is_success());
    let (status, sub) = cancel(&shop, &id, json!({"at_period_end": true})).await;
    assert_eq!(
        (status, sub["status"].as_str()),
        (200, Some("canceled")),
        "{sub}"
    );
    assert_eq!(steps(&pool, number).await, ["canceled"]);
}

/// A Stripe subscription order (its stand-in's requests in `log`) that expired unpaid: the shop,
/// its number and its Checkout Session.
async fn expired_stripe_subscription_order(pool: &PgPool, log: &Log) -> (Shop, i64, String) {
    let base = stand_in(stripe_with_subscriptions(Arc::default()), log.clone()).await;
    let (shop, order) = subscription_order(pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    payfleet::orders::expire_now(pool, number).await.unwrap();
    wait_for("the order expired", Duration::from_secs(30), async || {
        shop.order(number).await["status"] == "expired"
    })
    .await;
    (shop, number, session)
}

/// A subscription's first payment that no order takes (here it comes after its order expired)
/// is given back, and the subscription Stripe started with it is cancelled there, once: the
/// buyer is not billed every period for a subscription that never started here.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_subscription_whose_first_payment_no_order_took_is_cancelled_at_stripe(pool: PgPool) {
    let log = Log::default();
    let (shop, number, session) = expired_stripe_subscription_order(&pool, &log).await;
    let cancellations = || {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.method == Method::DELETE && s.uri == "/v1/subscriptions/sub_1")
            .cloned()
            .collect::<Vec<_>>()
    };
    for event in ["evt_late", "evt_late_again"] {
        deliver(
            &shop,
            &stripe(&session_completed(event, &session, Some("sub_1")), now()),
        )
        .await;
        outcome(&pool, "stripe", event).await;
    }
    wait_for("cancelled at Stripe", Duration::from_secs(30), async || {
        !cancellations().is_empty()
    })
    .await;
    let sent = cancellations();
    assert_eq!(sent[0].header("stripe-account"), Some("acct_seller1"));
    let order = shop.order(number).await;
    assert_eq!(order["status"], "expired", "{order}");
    assert!(order["subscription_id"].is_null(), "{order}");
    // Once: the job is done, and the event sent again asked for nothing more.
    wait_for("the job done", Duration::from_secs(30), async || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM jobs WHERE kind = 'stop_unstarted_subscription'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == 0
    })
    .await;
    assert_eq!(cancellations().len(), 1);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_subscription_that_never_started_here_has_every_charge_given_back_once(pool: PgPool) {
    let log = Log::default();
    let (shop, number, session) = expired_stripe_subscription_order(&pool, &log).await;
    let refunds = || {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.method == Method::POST && s.uri == "/v1/refunds")
            .map(|s| {
                let form = s.form();
                (
                    form.get("payment_intent").cloned().unwrap_or_default(),
                    form.get("amount").cloned().unwrap_or_default(),
                    s.header("stripe-account").unwrap_or_default().to_owned(),
                )
            })
            .collect::<Vec<_>>()
    };
    // The late checkout names no PaymentIntent (a subscription's is its first invoice's): the
    // give-back waits for the invoice's event to name it, rather than ending dead.
    deliver(
        &shop,
        &stripe(
            &session_completed("evt_late", &session, Some("sub_1")),
            now(),
        ),
    )
    .await;
    outcome(&pool, "stripe", "evt_late").await;
    let t0 = chrono::Utc::now().timestamp();
    let first = invoice(
        "evt_in1",
        "invoice.paid",
        "in_1",
        "pi_1",
        "subscription_create",
        t0,
    );
    deliver(&shop, &stripe(&first, now())).await;
    wait_for(
        "the first payment given back",
        Duration::from_secs(60),
        async || !refunds().is_empty(),
    )
    .await;
    assert_eq!(
        refunds(),
        vec![("pi_1".into(), "1990".into(), "acct_seller1".into())]
    );

    // Stripe charged the next period before it stopped billing: that charge is no sale here
    // either, and goes back to the buyer, once, however often its event comes.
    let renewal = invoice(
        "evt_p2",
        "invoice.paid",
        "in_2",
        "pi_2",
        "subscription_cycle",
        t0 + MONTH,
    );
    for _ in 0..2 {
        deliver(&shop, &stripe(&renewal, now())).await;
        outcome(&pool, "stripe", "evt_p2").await;
    }
    wait_for(
        "the renewal given back",
        Duration::from_secs(30),
        async || refunds().len() == 2,
    )
    .await;
    assert_eq!(
        refunds()[1],
        ("pi_2".into(), "1990".into(), "acct_seller1".into())
    );
    wait_for("the give-backs done", Duration::from_secs(30), async || {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM jobs WHERE kind = 'refund_payment'")
            .fetch_one(&pool)
            .await
            .unwrap()
            == 0
    })
    .await;
    let given_back: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT session_id, status, payment_id FROM unmatched_payments
         WHERE given_back_at IS NOT NULL ORDER BY session_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        given_back,
        vec![("in_2".into(), "refunded".into(), Some("pi_2".into()))],
        "the renewal is an unmatched payment, refunded"
    );
    let order = shop.order(number).await;
    assert_eq!(order["status"], "expired", "{order}");
    assert!(order["subscription_id"].is_null(), "{order}");
    let sales: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_entries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(sales, 0, "no money moved in the ledger");
    assert_eq!(refunds().len(), 2);
    // The late checkout (no PaymentIntent yet) and its first invoice (naming it) are one
    // payment: one late_payment message, its subscription stopped once.
    let late: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE o.number = $1 AND e.kind = 'late_payment'",
    )
    .bind(number)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(late, 1, "one payment, one late_payment message");
    // Stripe billed the subscription after it was asked to stop it: it is asked again, once for
    // that charge however often its event came, and Stripe's answer that it has ended already
    // (404 on a deleted subscription, its retrieval saying `canceled`) ends the job done, not
    // dead.
    wait_for("the stops done", Duration::from_secs(30), async || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM jobs WHERE kind = 'stop_unstarted_subscription'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == 0
    })
    .await;
    let stops = log
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.method == Method::DELETE && s.uri.starts_with("/v1/subscriptions/sub_1"))
        .count();
    assert_eq!(
        stops, 2,
        "asked to stop once, and once more for the charge after it"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_stripe_subscription_whose_id_never_arrived_is_not_cancelled_here_alone(pool: PgPool) {
    let base = stand_in(stripe_with_subscriptions(Arc::default()), Log::default()).await;
    let (shop, order) = subscription_order(&pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap();
    deliver(
        &shop,
        &stripe(&session_completed("evt_1", session, None), now()),
    )
    .await;
    let id = subscription_of(&shop, number).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, body) = cancel(&shop, &id, json!({})).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("cancel_not_supported")),
        "{body}"
    );
    assert_eq!(subscription_of(&shop, number).await["status"], "active");
}

/// A period's charge that fails first opens its renewal order at what Stripe says is due (here
/// less than the plan's price: a coupon or a proration on the invoice), so Stripe's retry that
/// succeeds pays exactly that order: one sale, nothing given back as a wrong amount.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_renewal_that_fails_first_costs_what_stripe_says_is_due(pool: PgPool) {
    let base = stand_in(stripe_api(), Log::default()).await;
    let (shop, order) = subscription_order(&pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    deliver(
        &shop,
        &stripe(&session_completed("evt_1", &session, Some("sub_1")), now()),
    )
    .await;
    subscription_of(&shop, number).await;
    let start = chrono::Utc::now().timestamp() + MONTH;
    let charge = |event: &str, kind: &str, pi: &str| {
        let paid = if kind == "invoice.payment_failed" {
            0
        } else {
            1791
        };
        json!({"id": event, "type": kind, "account": "acct_seller1", "data": {"object": {
            "id": "in_2", "object": "invoice", "subscription": "sub_1",
            "billing_reason": "subscription_cycle", "payment_intent": pi, "amount_paid": paid,
            "amount_due": 1791, "currency": "brl", "application_fee_amount": 179,
            "lines": {"data": [{"period": {"start": start, "end": start + MONTH}}]}}}})
        .to_string()
    };
    deliver(
        &shop,
        &stripe(&charge("evt_f", "invoice.payment_failed", "pi_2a"), now()),
    )
    .await;
    wait_subscription(&shop, number, "past due", |s| s["status"] == "past_due").await;
    // Past its period's end, the failed renewal still waits for Stripe's retries (its dunning
    // goes on for weeks): no expiry job of ours decides it, and no finding says one did not run.
    let move_expiry = async |by: &str| {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE orders SET expires_at = expires_at + interval '{by}' WHERE renews IS NOT NULL"
        )))
        .execute(&pool)
        .await
        .unwrap();
    };
    move_expiry("-70 days").await;
    let found = payfleet::consistency::check(&pool, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        found.iter().all(|f| f.check != "order_expiry_overdue"),
        "{found:?}"
    );
    move_expiry("70 days").await;
    deliver(
        &shop,
        &stripe(&charge("evt_p", "invoice.paid", "pi_2b"), now()),
    )
    .await;
    assert_eq!(outcome(&pool, "stripe", "evt_p").await.0, "applied");
    wait_subscription(&shop, number, "active again", |s| s["status"] == "active").await;
    assert_eq!(
        renewals(&pool).await,
        vec![(
            number + 1,
            "paid".to_owned(),
            "1.7900".to_owned(),
            "16.1200".to_owned(),
            1
        )]
    );
    let (unmatched, refunds): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM unmatched_payments),
                (SELECT count(*) FROM jobs WHERE kind = 'refund_payment')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((unmatched, refunds), (0, 0), "nothing is given back");

    // Stripe charges the same period again on an invoice of its own (reissued, or made by
    // hand): the period keeps its one sale, and that payment is an extra one, given back.
    let again = charge("evt_again", "invoice.paid", "pi_2x").replace("\"in_2\"", "\"in_2x\"");
    deliver(&shop, &stripe(&again, now())).await;
    assert_eq!(outcome(&pool, "stripe", "evt_again").await.0, "applied");
    let extra: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE o.number = $1 AND e.kind = 'extra_payment' AND e.payload ->> 'session_id' = 'in_2x'",
    )
    .bind(number + 1)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        extra, 1,
        "the second charge of the period is an extra payment"
    );
    // Its give-back under way (its job) or done (its refund recorded).
    given_back(&pool, "in_2x").await;
    let unmatched: i64 = sqlx::query_scalar("SELECT count(*) FROM unmatched_payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(unmatched, 0, "given back, not left unmatched");
    assert_eq!(renewals(&pool).await.len(), 1, "one renewal, one sale");
    assert_eq!(renewals(&pool).await[0].4, 1);
}

/// A Stripe subscription's first payment whose `checkout.session.completed` never came is found
/// by reconciliation, with the subscription it started there, as the session's own event would
/// have said: the renewals Stripe reports name it and apply (not wait for it for ever), and it
/// is cancelled at Stripe.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_subscription_whose_first_payment_was_reconciled_knows_its_stripe_subscription(
    pool: PgPool,
) {
    let log = Log::default();
    let api = stripe_with_subscriptions(Arc::default()).route(
        "/v1/events",
        axum::routing::get(|| async {
            axum::Json(json!({"object": "list", "data": [], "has_more": false}))
        }),
    );
    let base = stand_in(api, log.clone()).await;
    let (shop, order) = subscription_order(&pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let t0 = chrono::Utc::now().timestamp();

    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let r =
        payfleet::payments::reconcile::run(&pool, &gateways, &crate::reconcile::settings(10, 0))
            .await
            .unwrap();
    assert_eq!(r.found, 1, "{r:?}");
    wait_for("the order paid", Duration::from_secs(30), async || {
        shop.order(number).await["status"] == "paid"
    })
    .await;
    let id = subscription_of(&shop, number).await["id"]
        .as_str()
        .unwrap()
        .to_owned();

    deliver(
        &shop,
        &stripe(
            &invoice(
                "evt_r2",
                "invoice.paid",
                "in_2",
                "pi_2",
                "subscription_cycle",
                t0 + MONTH,
            ),
            now(),
        ),
    )
    .await;
    assert_eq!(outcome(&pool, "stripe", "evt_r2").await.0, "applied");
    let sold: Vec<i64> = renewals(&pool).await.into_iter().map(|r| r.4).collect();
    assert_eq!(sold, vec![1], "the second period is one sale");

    let (status, sub) = cancel(&shop, &id, json!({})).await;
    assert_eq!(
        (status, sub["status"].as_str()),
        (200, Some("canceled")),
        "{sub}"
    );
    let last = log.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        (&last.method, last.uri.as_str()),
        (&Method::DELETE, "/v1/subscriptions/sub_1")
    );
}

/// A Razorpay `subscription.*` event of `sub_R1` (created with the first order's session in its
/// notes), with the charge of Razorpay order `order` when given.
fn razorpay_subscription(
    event: &str,
    created_at: i64,
    first: &str,
    charge: Option<(&str, &str, i64)>,
) -> String {
    let mut payload = json!({"subscription": {"entity": {"id": "sub_R1", "entity": "subscription",
        "status": "active", "current_start": charge.map_or(0, |c| c.2), "current_end": charge.map_or(0, |c| c.2 + MONTH),
        "notes": {"session_id": first}}}});
    let mut contains = vec!["subscription"];
    if let Some((order, payment, _)) = charge {
        payload["payment"] = json!({"entity": {"id": payment, "entity": "payment", "amount": 1990,
            "currency": "INR", "status": "captured", "order_id": order, "invoice_id": "inv_2"}});
        contains.push("payment");
    }
    json!({"entity": "event", "event": event, "contains": contains, "created_at": created_at, "payload": payload})
        .to_string()
}

/// A Razorpay subscription order of the first session `order_first` (its stand-in's requests in
/// `log`; `paid`: the payments its orders list). As Razorpay's API keeps subscriptions,
/// cancelling one cancelled already is refused (400), and reading it says `cancelled`.
async fn razorpay_subscription_order(
    pool: &PgPool,
    log: &Log,
    paid: Arc<Mutex<Vec<Value>>>,
) -> (Shop, Value) {
    let cancelled = Arc::new(AtomicBool::new(false));
    let (on_cancel, on_read) = (cancelled.clone(), cancelled.clone());
    let api = Router::new()
        .route(
            "/v1/orders/{id}/payments",
            axum::routing::get(move |Path(id): Path<String>| {
                let items: Vec<Value> = paid
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|p| p["order_id"] == id.as_str())
                    .cloned()
                    .collect();
                async move { axum::Json(json!({"entity": "collection", "count": items.len(), "items": items})) }
            }),
        )
        .route(
            "/v1/orders",
            axum::routing::post(|| async {
                axum::Json(json!({"id": "order_first", "entity": "order", "amount": 1990, "currency": "INR", "status": "created"}))
            }),
        )
        .route(
            "/v1/payments/{id}/refund",
            axum::routing::post(|Path(id): Path<String>| async move {
                axum::Json(json!({"id": format!("rfnd_{id}"), "entity": "refund", "amount": 1990,
                    "currency": "INR", "payment_id": id, "status": "processed"}))
            }),
        )
        .route(
            "/v1/subscriptions/{id}/cancel",
            axum::routing::post(move |Path(id): Path<String>| {
                let was = on_cancel.swap(true, Ordering::SeqCst);
                async move {
                    if was {
                        return (
                            StatusCode::BAD_REQUEST,
                            axum::Json(json!({"error": {"code": "BAD_REQUEST_ERROR",
                                "description": "Subscription is not cancellable in cancelled status."}})),
                        );
                    }
                    (
                        StatusCode::OK,
                        axum::Json(json!({"id": id, "entity": "subscription", "status": "cancelled"})),
                    )
                }
            }),
        )
        .route(
            "/v1/subscriptions/{id}",
            axum::routing::get(move |Path(id): Path<String>| {
                let status = if on_read.load(Ordering::SeqCst) { "cancelled" } else { "halted" };
                async move { axum::Json(json!({"id": id, "entity": "subscription", "status": status})) }
            }),
        );
    let base = stand_in(api, log.clone()).await;
    subscription_order(pool, "razorpay", "INR", |config| {
        config.gateways.razorpay.api = Some(payfleet::gateways::razorpay::Api {
            base_url: base,
            key_id: "rzp_test_key".into(),
            key_secret: Secret::new("rzp_secret"),
        });
    })
    .await
}

/// A second subscription made at Razorpay for the same order (the front end's create call
/// retried), naming the same first payment: that payment started the order's subscription,
/// `sub_R1`, not this one. Its charges are given back, not booked as a second sale each cycle,
/// Razorpay is asked to stop it, and its end does not cancel the buyer's subscription here.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_second_gateway_subscription_naming_the_same_first_payment_starts_nothing(pool: PgPool) {
    let log = Log::default();
    let (shop, order) = razorpay_subscription_order(&pool, &log, Arc::default()).await;
    let number = order["number"].as_i64().unwrap();
    let next = chrono::Utc::now().timestamp() + MONTH;
    let captured = json!({"entity": "event", "event": "payment.captured", "contains": ["payment"], "created_at": 90,
        "payload": {"payment": {"entity": {"id": "pay_1", "entity": "payment", "amount": 1990, "currency": "INR",
            "status": "captured", "order_id": "order_first"}}}})
    .to_string();
    deliver(&shop, &razorpay("rzp-evt-0", &captured)).await;
    let charged = razorpay_subscription(
        "subscription.charged",
        100,
        "order_first",
        Some(("order_c2", "pay_2", next)),
    );
    deliver(&shop, &razorpay("rzp-evt-1", &charged)).await;
    wait_subscription(&shop, number, "the renewal paid", |s| {
        s["renewals"][0]["state"] == "paid"
    })
    .await;
    // The second subscription's charge, of its own cycle (made three days after the first).
    let second = |event: &str, created_at: i64, charge: Option<(&str, &str, i64)>| {
        razorpay_subscription(event, created_at, "order_first", charge)
            .replace("sub_R1", "sub_R2")
            .replace("inv_2", "inv_r2")
    };
    let charged_twice = second(
        "subscription.charged",
        110,
        Some(("order_r2", "pay_r2", next + 3 * 86_400)),
    );
    deliver(&shop, &razorpay("rzp-evt-2", &charged_twice)).await;
    assert_eq!(
        outcome(&pool, "razorpay", "subscription.charged:sub_R2:110")
            .await
            .0,
        "applied"
    );
    let paid = renewals(&pool).await;
    assert_eq!(
        (paid.len(), paid[0].4),
        (1, 1),
        "one renewal, one sale: {paid:?}"
    );
    given_back(&pool, "order_r2").await;
    // Its end is its own: the buyer's subscription stays.
    let halted = second("subscription.halted", 111, None);
    deliver(&shop, &razorpay("rzp-evt-3", &halted)).await;
    outcome(&pool, "razorpay", "subscription.halted:sub_R2:111").await;
    assert_eq!(subscription_of(&shop, number).await["status"], "active");
    let reference: Option<String> = sqlx::query_scalar(
        "SELECT subscription_ref FROM payment_orders WHERE session_id = 'order_first'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(reference.as_deref(), Some("sub_R1"));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_razorpay_subscription_charge_is_one_renewal_and_waits_for_the_first_payment(
    pool: PgPool,
) {
    let log = Log::default();
    let (shop, order) = razorpay_subscription_order(&pool, &log, Arc::default()).await;
    let number = order["number"].as_i64().unwrap();
    assert_eq!(order["payment"]["session_id"], "order_first");
    let next = chrono::Utc::now().timestamp() + MONTH;

    // The next cycle's charge arrives before the first payment's event: it waits for it.
    let charged = razorpay_subscription(
        "subscription.charged",
        100,
        "order_first",
        Some(("order_c2", "pay_2", next)),
    );
    deliver(&shop, &razorpay("rzp-evt-1", &charged)).await;
    let (state, waiting) = outcome(&pool, "razorpay", "subscription.charged:sub_R1:100").await;
    assert_eq!(
        (state.as_str(), waiting.as_deref()),
        ("waiting", Some("session:order_first"))
    );
    let captured = json!({"entity": "event", "event": "payment.captured", "contains": ["payment"], "created_at": 90,
        "payload": {"payment": {"entity": {"id": "pay_1", "entity": "payment", "amount": 1990, "currency": "INR",
            "status": "captured", "order_id": "order_first"}}}})
    .to_string();
    deliver(&shop, &razorpay("rzp-evt-0", &captured)).await;
    wait_subscription(&shop, number, "the renewal paid", |s| {
        s["renewals"][0]["state"] == "paid"
    })
    .await;

    // The invoice's own payment event, and the charge again (Razorpay retries): nothing more.
    let invoice_payment = json!({"entity": "event", "event": "payment.captured", "contains": ["payment"], "created_at": 101,
        "payload": {"payment": {"entity": {"id": "pay_2", "entity": "payment", "amount": 1990, "currency": "INR",
            "status": "captured", "order_id": "order_c2", "invoice_id": "inv_2"}}}})
    .to_string();
    deliver(&shop, &razorpay("rzp-evt-2", &invoice_payment)).await;
    let again = razorpay_subscription(
        "subscription.charged",
        102,
        "order_first",
        Some(("order_c2", "pay_2", next)),
    );
    deliver(&shop, &razorpay("rzp-evt-3", &again)).await;
    assert_eq!(
        outcome(&pool, "razorpay", "payment.captured:pay_2:101")
            .await
            .0,
        "ignored"
    );
    outcome(&pool, "razorpay", "subscription.charged:sub_R1:102").await;
    let paid = renewals(&pool).await;
    assert_eq!(paid.len(), 1, "{paid:?}");
    // No gateway fee reported: the platform's configured commission (as at checkout).
    let first_fee: String =
        sqlx::query_scalar("SELECT platform_fee::text FROM orders WHERE number = $1")
            .bind(number)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (paid[0].1.as_str(), paid[0].2.as_str(), paid[0].4),
        ("paid", first_fee.as_str(), 1)
    );
    let unmatched: i64 = sqlx::query_scalar("SELECT count(*) FROM unmatched_payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(unmatched, 0);

    let halted = razorpay_subscription("subscription.halted", 103, "order_first", None);
    deliver(&shop, &razorpay("rzp-evt-4", &halted)).await;
    wait_subscription(&shop, number, "canceled", |s| s["status"] == "canceled").await;

    // The buyer takes the halted subscription up again at Razorpay, which charges the next
    // cycle: ended here, that charge is given back, and Razorpay is asked to stop billing,
    // once for the charge however often it is reported; the next charge asks again, and
    // Razorpay's refusal to cancel what it has cancelled already ends that ask done.
    let asked = |uri: &'static str| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.method == Method::POST && s.uri.starts_with(uri))
            .count()
    };
    let cycles = [
        ("order_c3", "pay_3", next + MONTH, 104),
        ("order_c4", "pay_4", next + 2 * MONTH, 106),
    ];
    for (i, (order, payment, start, at)) in cycles.into_iter().enumerate() {
        let charged = razorpay_subscription(
            "subscription.charged",
            at,
            "order_first",
            Some((order, payment, start)),
        );
        for again in 0..2 {
            deliver(&shop, &razorpay(&format!("rzp-evt-{at}-{again}"), &charged)).await;
        }
        outcome(
            &pool,
            "razorpay",
            &format!("subscription.charged:sub_R1:{at}"),
        )
        .await;
        wait_for("given back, and the stop asked", Duration::from_secs(30), async || {
            asked("/v1/payments/") == i + 1
                && asked("/v1/subscriptions/sub_R1/cancel") == i + 1
                && sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM jobs WHERE kind IN ('stop_unstarted_subscription', 'refund_payment')",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
                    == 0
        })
        .await;
    }
    let sold: Vec<(String, i64)> = renewals(&pool)
        .await
        .into_iter()
        .map(|r| (r.1, r.4))
        .collect();
    assert_eq!(
        sold,
        [
            ("paid".to_owned(), 1),
            ("cancelled".to_owned(), 0),
            ("cancelled".to_owned(), 0)
        ],
        "one sale: the cycles after the end are no sales"
    );
}

/// A Razorpay subscription halted while a cycle's charge had failed: the buyer takes it up
/// again, Razorpay charges that cycle, and its webhook is lost, so reconciliation finds the
/// charge. Given back as the expired renewal's, it asks Razorpay to stop billing too, as the
/// same charge's webhook would have.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_charge_after_the_end_found_by_reconciliation_stops_the_subscription_too(pool: PgPool) {
    let log = Log::default();
    let paid: Arc<Mutex<Vec<Value>>> = Arc::default();
    let (shop, order) = razorpay_subscription_order(&pool, &log, paid.clone()).await;
    let number = order["number"].as_i64().unwrap();
    let next = chrono::Utc::now().timestamp() + MONTH;
    let captured = json!({"entity": "event", "event": "payment.captured", "contains": ["payment"], "created_at": 90,
        "payload": {"payment": {"entity": {"id": "pay_1", "entity": "payment", "amount": 1990, "currency": "INR",
            "status": "captured", "order_id": "order_first"}}}})
    .to_string();
    deliver(&shop, &razorpay("rzp-evt-0", &captured)).await;
    outcome(&pool, "razorpay", "payment.captured:pay_1:90").await;
    let failed = razorpay_subscription(
        "subscription.pending",
        100,
        "order_first",
        Some(("order_c2", "pay_2", next)),
    );
    deliver(&shop, &razorpay("rzp-evt-1", &failed)).await;
    outcome(&pool, "razorpay", "subscription.pending:sub_R1:100").await;
    let halted = razorpay_subscription("subscription.halted", 103, "order_first", None);
    deliver(&shop, &razorpay("rzp-evt-2", &halted)).await;
    wait_subscription(&shop, number, "canceled", |s| s["status"] == "canceled").await;

    paid.lock()
        .unwrap()
        .push(json!({"id": "pay_2b", "entity": "payment", "amount": 1990,
        "currency": "INR", "status": "captured", "order_id": "order_c2"}));
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let r =
        payfleet::payments::reconcile::run(&pool, &gateways, &crate::reconcile::settings(10, 0))
            .await
            .unwrap();
    assert_eq!(r.found, 1, "{r:?}");
    let asked = |uri: &'static str| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.method == Method::POST && s.uri.starts_with(uri))
            .count()
    };
    wait_for("given back, and the stop asked", Duration::from_secs(30), async || {
        asked("/v1/payments/pay_2b/refund") == 1
            && asked("/v1/subscriptions/sub_R1/cancel") == 1
            && sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM jobs WHERE kind IN ('stop_unstarted_subscription', 'refund_payment')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
    })
    .await;
    let sold: Vec<i64> = renewals(&pool).await.into_iter().map(|r| r.4).collect();
    assert_eq!(sold, [0], "no sale of a cycle after the end");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_mercadopago_preapproval_charge_is_one_renewal_and_its_payment_no_second_one(
    pool: PgPool,
) {
    // The stand-in answers with the first order's session once the checkout made it.
    let first: Arc<Mutex<String>> = Arc::default();
    // The preapproval charge's state at Mercado Pago.
    let charge: Arc<Mutex<&'static str>> = Arc::new(Mutex::new("approved"));
    let debit = (chrono::Utc::now() + chrono::Duration::days(30)).to_rfc3339();
    let api = {
        let (f1, f2, f3) = (first.clone(), first.clone(), first.clone());
        let state = charge.clone();
        Router::new()
            .route(
                "/checkout/preferences",
                axum::routing::post(|| async { axum::Json(json!({"id": "pref-1", "init_point": "https://mp.test/checkout?pref_id=pref-1"})) }),
            )
            .route(
                "/v1/payments/{id}",
                axum::routing::get(move |Path(id): Path<String>| {
                    let reference = f1.lock().unwrap().clone();
                    async move {
                        // 5002 is the preapproval's charge: Mercado Pago gives it the
                        // preapproval's external_reference too.
                        let mut p = json!({"id": id.parse::<i64>().unwrap(), "status": "approved", "transaction_amount": 19.9,
                            "currency_id": "BRL", "external_reference": reference});
                        if id == "5002" {
                            p["point_of_interaction"] = json!({"type": "SUBSCRIPTIONS",
                                "transaction_data": {"subscription_id": "pre_1", "invoice_id": 7001}});
                            let now = *state.lock().unwrap();
                            p["status"] = json!(now);
                            if now == "refunded" {
                                p["refunds"] = json!([{"id": 9001, "amount": 19.9, "status": "approved"}]);
                            }
                        }
                        axum::Json(p)
                    }
                }),
            )
            .route(
                "/authorized_payments/{id}",
                axum::routing::get(move |Path(id): Path<String>| {
                    let reference = f2.lock().unwrap().clone();
                    let debit = debit.clone();
                    async move {
                        axum::Json(json!({"id": id.parse::<i64>().unwrap(), "type": "scheduled", "preapproval_id": "pre_1",
                            "external_reference": reference, "transaction_amount": 19.9, "currency_id": "BRL",
                            "debit_date": debit, "status": "processed", "payment": {"id": 5002, "status": "approved"}}))
                    }
                }),
            )
            .route(
                "/preapproval/{id}",
                axum::routing::get(move |Path(id): Path<String>| {
                    let reference = f3.lock().unwrap().clone();
                    async move { axum::Json(json!({"id": id, "status": "cancelled", "external_reference": reference})) }
                }),
            )
    };
    let base = stand_in(api, Log::default()).await;
    let (shop, order) =
        subscription_order(&pool, "mercadopago", "BRL", with_mercadopago(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    *first.lock().unwrap() = session.clone();
    let ts = chrono::Utc::now().timestamp_millis();

    // The preapproval's charge is reported before the first payment: it waits for it.
    deliver(
        &shop,
        &mercadopago_topic("subscription_authorized_payment", "7001", "req-1", ts),
    )
    .await;
    let (state, waiting) = outcome(&pool, "mercadopago", "7001:req-1").await;
    assert_eq!(
        (state.as_str(), waiting),
        ("waiting", Some(format!("session:{session}")))
    );
    deliver(&shop, &mercadopago("5001", "req-2", ts)).await;
    wait_subscription(&shop, number, "the renewal paid", |s| {
        s["renewals"][0]["state"] == "paid"
    })
    .await;
    // The charge's own payment notification is no second payment of the first order.
    deliver(&shop, &mercadopago("5002", "req-3", ts)).await;
    assert_eq!(
        outcome(&pool, "mercadopago", "5002:req-3").await.0,
        "ignored"
    );
    deliver(
        &shop,
        &mercadopago_topic("subscription_authorized_payment", "7001", "req-4", ts),
    )
    .await;
    outcome(&pool, "mercadopago", "7001:req-4").await;
    let paid = renewals(&pool).await;
    assert_eq!(
        (paid.len(), paid[0].1.as_str(), paid[0].4),
        (1, "paid", 1),
        "{paid:?}"
    );
    let extra: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_events WHERE kind IN ('extra_payment', 'late_payment')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(extra, 0);

    // The seller refunds the charge at Mercado Pago: its payment's notification is the only one
    // that says so, and the renewal is refunded, its sale taken back from the seller, once.
    // The buyer opens a mediation of the charge: it holds the renewal's sale. Won, the charge
    // is approved again, which every charge's notification says: that notification decides
    // nothing, and reconciliation, asking about the mediation still open here a week later,
    // records it won.
    let mediation = async || -> String {
        sqlx::query_scalar("SELECT status FROM payment_disputes WHERE dispute_id = 'mp-5002'")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    *charge.lock().unwrap() = "in_mediation";
    deliver(&shop, &mercadopago("5002", "req-m1", ts)).await;
    outcome(&pool, "mercadopago", "5002:req-m1").await;
    assert_eq!(mediation().await, "open");
    *charge.lock().unwrap() = "approved";
    deliver(&shop, &mercadopago("5002", "req-m2", ts)).await;
    assert_eq!(
        outcome(&pool, "mercadopago", "5002:req-m2").await.0,
        "ignored"
    );
    sqlx::query("UPDATE payment_disputes SET updated_at = now() - interval '8 days'")
        .execute(&pool)
        .await
        .unwrap();
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    payfleet::payments::reconcile::run(&pool, &gateways, &crate::reconcile::settings(10, 0))
        .await
        .unwrap();
    wait_for("the mediation won", Duration::from_secs(30), async || {
        mediation().await == "won"
    })
    .await;

    *charge.lock().unwrap() = "refunded";
    for request in ["req-6", "req-7"] {
        deliver(&shop, &mercadopago("5002", request, ts)).await;
        outcome(&pool, "mercadopago", &format!("5002:{request}")).await;
    }
    let refunded = renewals(&pool).await;
    assert_eq!(refunded[0].1, "refunded", "{refunded:?}");
    // One refund, taken back once: its two legs (the seller's debit, the platform's fee).
    let taken_back = async || -> Vec<String> {
        sqlx::query_scalar(
            "SELECT source_key FROM ledger_transfers WHERE source_key LIKE 'refund:%' ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    wait_for("the sale taken back", Duration::from_secs(30), async || {
        taken_back().await.len() == 2
    })
    .await;
    assert_eq!(
        taken_back().await,
        [
            "refund:mercadopago:9001:fee",
            "refund:mercadopago:9001:seller"
        ]
    );
    let extra: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_events WHERE kind IN ('extra_payment', 'late_payment')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(extra, 0);

    deliver(
        &shop,
        &mercadopago_topic("subscription_preapproval", "pre_1", "req-5", ts),
    )
    .await;
    wait_subscription(&shop, number, "canceled", |s| s["status"] == "canceled").await;
}

/// A preapproval's charge that failed, then succeeded on Mercado Pago's retry, whose
/// notification was lost: reconciliation asks about the renewal's session (the authorized
/// payment, not a search by a reference its charges do not carry), and the period's payment is
/// one sale, its subscription active again.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_mercadopago_renewal_retried_and_paid_unannounced_is_found_by_reconciliation(
    pool: PgPool,
) {
    let first: Arc<Mutex<String>> = Arc::default();
    // The authorized payment's charge at Mercado Pago: rejected, then approved by a retry.
    let charged: Arc<Mutex<Value>> =
        Arc::new(Mutex::new(json!({"id": 5002, "status": "rejected"})));
    let debit = (chrono::Utc::now() + chrono::Duration::days(30)).to_rfc3339();
    let api = {
        let f2 = first.clone();
        let state = charged.clone();
        mercadopago_checkout(first.clone())
            // A search by the renewal's session finds nothing: its charges carry the
            // subscription's reference.
            .route(
                "/v1/payments/search",
                axum::routing::get(|| async { axum::Json(json!({"results": []})) }),
            )
            .route(
                "/authorized_payments/{id}",
                axum::routing::get(move |Path(id): Path<String>| {
                    let reference = f2.lock().unwrap().clone();
                    let debit = debit.clone();
                    let payment = state.lock().unwrap().clone();
                    async move {
                        axum::Json(json!({"id": id.parse::<i64>().unwrap(), "type": "scheduled", "preapproval_id": "pre_1",
                            "external_reference": reference, "transaction_amount": 19.9, "currency_id": "BRL",
                            "debit_date": debit, "status": "processed", "payment": payment}))
                    }
                }),
            )
    };
    let base = stand_in(api, Log::default()).await;
    let (shop, order) =
        subscription_order(&pool, "mercadopago", "BRL", with_mercadopago(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    *first.lock().unwrap() = session.clone();
    let ts = chrono::Utc::now().timestamp_millis();
    deliver(&shop, &mercadopago("5001", "req-1", ts)).await;
    subscription_of(&shop, number).await;
    // The period's charge is rejected: its renewal failed, the subscription past due.
    deliver(
        &shop,
        &mercadopago_topic("subscription_authorized_payment", "7001", "req-2", ts),
    )
    .await;
    wait_subscription(&shop, number, "past due", |s| s["status"] == "past_due").await;
    // Mercado Pago's retry succeeds; its notification never comes.
    *charged.lock().unwrap() = json!({"id": 5003, "status": "approved"});
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let report =
        payfleet::payments::reconcile::run(&pool, &gateways, &crate::reconcile::settings(10, 0))
            .await
            .unwrap();
    assert_eq!(report.found, 1, "{report:?}");
    wait_subscription(&shop, number, "active again", |s| s["status"] == "active").await;
    let paid = renewals(&pool).await;
    assert_eq!(
        (paid.len(), paid[0].1.as_str(), paid[0].4),
        (1, "paid", 1),
        "{paid:?}"
    );
    let payment: Option<String> = sqlx::query_scalar(
        "SELECT payment_id FROM payment_orders WHERE session_id = 'authorized_payment:7001'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(payment.as_deref(), Some("5003"));
}

/// Waits until the payment on `session` is being given back (its job) or was (its refund
/// recorded).
async fn given_back(pool: &PgPool, session: &str) {
    wait_for(
        &format!("the payment on {session} given back"),
        Duration::from_secs(30),
        async || {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM jobs WHERE kind = 'refund_payment' AND key LIKE '%' || $1 || '%')
                     OR EXISTS (SELECT 1 FROM payment_refunds r JOIN payment_orders po ON po.id = r.payment_order_id
                                WHERE po.session_id = $1)",
            )
            .bind(session)
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
}

/// Mercado Pago's stand-in for a subscription order's checkout: its preference, and its first
/// payments, approved, naming `first` (the first order's session, once the checkout made it).
fn mercadopago_checkout(first: Arc<Mutex<String>>) -> Router<Log> {
    Router::new()
        .route(
            "/checkout/preferences",
            axum::routing::post(|| async { axum::Json(json!({"id": "pref-1", "init_point": "https://mp.test/checkout?pref_id=pref-1"})) }),
        )
        .route(
            "/v1/payments/{id}",
            axum::routing::get(move |Path(id): Path<String>| {
                let reference = first.lock().unwrap().clone();
                async move {
                    axum::Json(json!({"id": id.parse::<i64>().unwrap(), "status": "approved", "transaction_amount": 19.9,
                        "currency_id": "BRL", "external_reference": reference}))
                }
            }),
        )
}

/// Without the `account` of a connected account: an event on the platform's own Stripe
/// account.
fn on_platform(event: &str) -> String {
    let mut v: Value = serde_json::from_str(event).unwrap();
    v.as_object_mut().unwrap().remove("account");
    let object = v["data"]["object"].as_object_mut().unwrap();
    object.remove("application_fee_amount");
    v.to_string()
}

/// The platform's own Stripe endpoint's secret, where the internal gateway collects through
/// Stripe.
const PLATFORM_SECRET: &str = "whsec_platform_endpoint_secret";

/// A subscription order on the internal gateway collected through Stripe on the platform's
/// account (its stand-in's requests in `log`): the shop and the order.
async fn acquirer_subscription_order(pool: &PgPool, log: &Log) -> (Shop, Value) {
    acquirer_subscription_order_on(pool, log, stripe_with_subscriptions(Arc::default())).await
}

/// [`acquirer_subscription_order`] against the stand-in `api`.
async fn acquirer_subscription_order_on(
    pool: &PgPool,
    log: &Log,
    api: Router<Log>,
) -> (Shop, Value) {
    let base = stand_in(api, log.clone()).await;
    subscription_order(pool, "internal", "BRL", |config| {
        with_stripe(base)(config);
        crate::gateways::collecting_through_stripe(config, PLATFORM_SECRET);
    })
    .await
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_internal_gateways_subscriptions_collected_through_stripe_are_billed_by_stripe(
    pool: PgPool,
) {
    let log = Log::default();
    let (shop, order) = acquirer_subscription_order(&pool, &log).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap();
    let checkout = log.lock().unwrap()[0].clone();
    assert_eq!(
        checkout.header("stripe-account"),
        None,
        "the platform's account"
    );
    assert_eq!(
        checkout.form().get("mode").map(String::as_str),
        Some("subscription")
    );
    let signed = |body: &str| stripe_signed(PLATFORM_SECRET, body, now());
    deliver(
        &shop,
        &signed(&on_platform(&session_completed(
            "evt_1",
            session,
            Some("sub_1"),
        ))),
    )
    .await;
    let sub = subscription_of(&shop, number).await;
    assert_eq!(sub["gateway"], "internal");

    // Stripe bills the next period on the platform's account: the internal gateway's renewal,
    // with the platform's configured commission (no application fee there).
    let p2 = chrono::Utc::now().timestamp() + MONTH;
    let paid = on_platform(&invoice(
        "evt_p2",
        "invoice.paid",
        "in_2",
        "pi_2",
        "subscription_cycle",
        p2,
    ));
    deliver(&shop, &signed(&paid)).await;
    wait_subscription(&shop, number, "the renewal paid", |s| {
        s["renewals"][0]["state"] == "paid"
    })
    .await;
    let fee_of = |n: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT platform_fee::text FROM orders WHERE number = $1",
            )
            .bind(n)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let renewal = renewals(&pool).await[0].clone();
    assert_eq!(renewal.2, fee_of(number).await);
    assert_eq!(renewal.4, 1, "one sale");

    // Cancelled at the period's end: asked of Stripe on the platform's account.
    let (status, sub) = cancel(
        &shop,
        sub["id"].as_str().unwrap(),
        json!({"at_period_end": true}),
    )
    .await;
    assert_eq!(
        (status, sub["cancel_at_period_end"].as_bool()),
        (200, Some(true)),
        "{sub}"
    );
    let asked = log.lock().unwrap().last().unwrap().clone();
    assert_eq!(asked.uri, "/v1/subscriptions/sub_1");
    assert_eq!(asked.header("stripe-account"), None);
}

/// The internal gateway's subscription collected through Stripe is billed by Stripe: while no
/// event has named its Stripe subscription, cancelling it is refused (409), not done here
/// alone while Stripe goes on charging the buyer.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_acquirer_billed_subscription_whose_id_never_arrived_is_not_cancelled_here_alone(
    pool: PgPool,
) {
    let log = Log::default();
    let (shop, order) = acquirer_subscription_order(&pool, &log).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap();
    deliver(
        &shop,
        &stripe_signed(
            PLATFORM_SECRET,
            &on_platform(&session_completed("evt_1", session, None)),
            now(),
        ),
    )
    .await;
    let id = subscription_of(&shop, number).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, body) = cancel(&shop, &id, json!({})).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("cancel_not_supported")),
        "{body}"
    );
    assert_eq!(subscription_of(&shop, number).await["status"], "active");
    assert!(
        log.lock()
            .unwrap()
            .iter()
            .all(|s| !s.uri.starts_with("/v1/subscriptions/")),
        "Stripe was not asked about a subscription it never named"
    );
}

/// A subscription bought through Stripe with a coupon: the coupon discounts the first period
/// only, as the fleet's own billing does (the subscription's charge is the subtotal), so
/// Stripe is asked for the full price every period and a coupon for the first invoice.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_coupon_on_a_stripe_subscription_discounts_its_first_period_only(pool: PgPool) {
    let log = Log::default();
    let base = stand_in(stripe_api(), log.clone()).await;
    let mut config = test_config();
    with_stripe(base)(&mut config);
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config).await),
    };
    let seller = shop
        .admin(
            "/admin/sellers",
            json!({"name": "Club", "payout_frequency": "weekly", "payout_minimum": "0", "stripe_account": "acct_seller1"}),
        )
        .await;
    let club = shop
        .admin(
            "/admin/products",
            json!({"seller_id": seller["id"], "name": "club", "kind": "subscription", "price": "19.90", "currency": "BRL", "interval": "month"}),
        )
        .await;
    shop.admin(
        "/admin/coupons",
        json!({"code": "FIRSTMONTH", "percent_off": "10"}),
    )
    .await;
    let cart = json!({"buyer_id": "buyer-9", "gateway": "stripe", "coupon": "FIRSTMONTH",
                      "items": [{"product_id": club["id"], "quantity": 1}]});
    let mut answer = Value::Null;
    for _ in 0..50 {
        let (status, a) = shop.checkout(Some("sub"), cart.clone()).await;
        answer = a;
        if status == 201 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(answer["orders"][0]["total"], "17.91", "{answer}");
    let sent = log.lock().unwrap().clone();
    let coupon = sent
        .iter()
        .find(|s| s.uri == "/v1/coupons")
        .expect("a coupon for the first period")
        .form();
    assert_eq!(
        (coupon["amount_off"].as_str(), coupon["duration"].as_str()),
        ("199", "once")
    );
    let session = sent
        .iter()
        .find(|s| s.uri == "/v1/checkout/sessions")
        .unwrap()
        .form();
    assert_eq!(session["line_items[0][price_data][unit_amount]"], "1990");
    assert!(session.contains_key("discounts[0][coupon]"), "{session:?}");
    // Each period's commission is the configured 10 % of its 19.90, not the first period's
    // 1.79 of 17.91 (9.99 %) carried into every renewal.
    assert_eq!(session["subscription_data[application_fee_percent]"], "10");
}

/// `api` answering `GET /v1/invoices/{id}` with `invoice` (its `id` the one asked for), as
/// Stripe's billing has it now.
fn with_invoice(api: Router<Log>, invoice: Arc<Mutex<Value>>) -> Router<Log> {
    api.route(
        "/v1/invoices/{id}",
        axum::routing::get(move |Path(id): Path<String>| {
            let mut answer = invoice.lock().unwrap().clone();
            async move {
                answer["id"] = json!(id);
                answer["object"] = json!("invoice");
                axum::Json(answer)
            }
        }),
    )
}

/// Stripe's retry of a period's failed charge (Smart Retries charge the same invoice again)
/// succeeds, and its `invoice.paid` is lost. Renewal `number + 1` failed, its subscription
/// past due; `invoice` is what the stand-in says of `in_2`; `signed` signs an event as the
/// endpoint expects, `on` places it on the account it comes from. Reconciliation asks Stripe
/// about the renewal's invoice, not about a Checkout Session: while it is open, nothing is
/// found; once paid, its payment is the period's one sale and the subscription is active
/// again; the late `invoice.paid` changes nothing.
async fn a_retried_renewal_is_found_paid(
    pool: &PgPool,
    shop: &Shop,
    number: i64,
    invoice: &Mutex<Value>,
    log: &Log,
    signed: impl Fn(&str) -> crate::helpers::Delivery,
    on: impl Fn(String) -> String,
) {
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, pool).unwrap();
    let reconcile = async || {
        payfleet::payments::reconcile::run(pool, &gateways, &crate::reconcile::settings(10, 0))
            .await
            .unwrap()
    };
    // Still open: Stripe will retry it; nothing to find.
    *invoice.lock().unwrap() =
        json!({"status": "open", "amount_paid": 0, "currency": "brl", "payment_intent": "pi_2a"});
    let report = reconcile().await;
    assert_eq!(report.found, 0, "{report:?}");
    assert!(
        log.lock()
            .unwrap()
            .iter()
            .any(|s| s.method == Method::GET && s.uri.starts_with("/v1/invoices/in_2")),
        "the renewal's invoice was asked about"
    );
    assert!(
        !log.lock()
            .unwrap()
            .iter()
            .any(|s| s.uri.starts_with("/v1/checkout/sessions/in_")),
        "an invoice is no Checkout Session"
    );
    // The retry succeeded; its event never came.
    *invoice.lock().unwrap() = json!({"status": "paid", "amount_paid": 1990, "currency": "brl", "payment_intent": "pi_2b"});
    let report = reconcile().await;
    assert_eq!(report.found, 1, "{report:?}");
    wait_subscription(shop, number, "active again", |s| s["status"] == "active").await;
    let paid = renewals(pool).await;
    assert_eq!(
        (paid.len(), paid[0].0, paid[0].1.as_str(), paid[0].4),
        (1, number + 1, "paid", 1),
        "{paid:?}"
    );
    let payment: Option<String> = sqlx::query_scalar(
        "SELECT payment_id FROM payment_orders WHERE session_id = 'in_2' AND succeeded_at IS NOT NULL",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        payment.as_deref(),
        Some("pi_2b"),
        "what the period's refunds name"
    );
    // The lost event after all: the same payment, no second sale, nothing given back.
    let late = on(invoice_event("evt_late", "invoice.paid", "in_2", "pi_2b"));
    the_lost_event_adds_nothing(pool, shop, signed(&late), number + 1).await;
    // Paid: not asked about again.
    let report = reconcile().await;
    assert_eq!(report.asked, 0, "{report:?}");
}

/// The lost event `evt_late` delivered after all: renewal `renewal`'s one sale stays one,
/// nothing is unmatched, nothing given back.
async fn the_lost_event_adds_nothing(
    pool: &PgPool,
    shop: &Shop,
    late: crate::helpers::Delivery,
    renewal: i64,
) {
    deliver(shop, &late).await;
    outcome(pool, "stripe", "evt_late").await;
    let (sales, unmatched, refunds): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM ledger_transfers WHERE source_key = 'sale:' || $1::bigint),
                (SELECT count(*) FROM unmatched_payments),
                (SELECT count(*) FROM jobs WHERE kind = 'refund_payment')",
    )
    .bind(renewal)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((sales, unmatched, refunds), (1, 0, 0));
}

/// The second period's invoice event on the seller's account (its period a month from now).
fn invoice_event(event: &str, kind: &str, invoice: &str, pi: &str) -> String {
    let start = chrono::Utc::now().timestamp() + MONTH;
    self::invoice(event, kind, invoice, pi, "subscription_cycle", start)
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_stripe_renewal_retried_and_paid_unannounced_is_found_by_reconciliation(pool: PgPool) {
    let log = Log::default();
    let invoice: Arc<Mutex<Value>> = Arc::default();
    let base = stand_in(with_invoice(stripe_api(), invoice.clone()), log.clone()).await;
    let (shop, order) = subscription_order(&pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    deliver(
        &shop,
        &stripe(&session_completed("evt_1", &session, Some("sub_1")), now()),
    )
    .await;
    subscription_of(&shop, number).await;
    let failed = invoice_event("evt_f", "invoice.payment_failed", "in_2", "pi_2a");
    deliver(&shop, &stripe(&failed, now())).await;
    wait_subscription(&shop, number, "past due", |s| s["status"] == "past_due").await;
    a_retried_renewal_is_found_paid(
        &pool,
        &shop,
        number,
        &invoice,
        &log,
        |b| stripe(b, now()),
        |e| e,
    )
    .await;
    let asked = log
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.uri.starts_with("/v1/invoices/in_2"))
        .cloned()
        .unwrap();
    assert_eq!(
        asked.header("stripe-account"),
        Some("acct_seller1"),
        "the seller's account"
    );
}

/// The same for the internal gateway collecting through Stripe, on the platform's account.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_acquirer_billed_renewal_retried_and_paid_unannounced_is_found_by_reconciliation(
    pool: PgPool,
) {
    let log = Log::default();
    let invoice: Arc<Mutex<Value>> = Arc::default();
    let api = with_invoice(stripe_with_subscriptions(Arc::default()), invoice.clone());
    let (shop, order) = acquirer_subscription_order_on(&pool, &log, api).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    let signed = |body: &str| stripe_signed(PLATFORM_SECRET, body, now());
    let completed = on_platform(&session_completed("evt_1", &session, Some("sub_1")));
    deliver(&shop, &signed(&completed)).await;
    subscription_of(&shop, number).await;
    let failed = on_platform(&invoice_event(
        "evt_f",
        "invoice.payment_failed",
        "in_2",
        "pi_2a",
    ));
    deliver(&shop, &signed(&failed)).await;
    wait_subscription(&shop, number, "past due", |s| s["status"] == "past_due").await;
    a_retried_renewal_is_found_paid(&pool, &shop, number, &invoice, &log, signed, |e| {
        on_platform(&e)
    })
    .await;
    let asked = log
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.uri.starts_with("/v1/invoices/in_2"))
        .cloned()
        .unwrap();
    assert_eq!(
        asked.header("stripe-account"),
        None,
        "the platform's account"
    );
}

/// `api` answering Stripe's invoices list (`GET /v1/invoices?subscription=…`) with `invoices`.
fn with_invoice_list(api: Router<Log>, invoices: Arc<Mutex<Vec<Value>>>) -> Router<Log> {
    api.route(
        "/v1/invoices",
        axum::routing::get(move || {
            let data = invoices.lock().unwrap().clone();
            async move { axum::Json(json!({"object": "list", "data": data, "has_more": false})) }
        }),
    )
}

/// The Invoice object of `event` (an invoice event as `on` places it), as Stripe's invoices
/// list shows it: `status`, charged `attempts` times.
fn listed(event: String, status: &str, attempts: i64) -> Value {
    let event: Value = serde_json::from_str(&event).unwrap();
    let mut invoice = event["data"]["object"].clone();
    invoice["status"] = json!(status);
    invoice["attempt_count"] = json!(attempts);
    invoice
}

/// A subscription's period ended three hours ago and its renewal's `invoice.paid` was lost: no
/// renewal order, no sale, nothing pending to ask about. Reconciliation asks Stripe for the
/// subscription's invoices since the period ended, stores the paid one as the event that was
/// lost, and the period gets its renewal and its one sale; the webhook arriving after all
/// changes nothing. Renewal `number + 1`; `signed` and `on` as for
/// [`a_retried_renewal_is_found_paid`].
async fn a_lost_renewal_is_found_by_asking_about_its_period(
    pool: &PgPool,
    shop: &Shop,
    number: i64,
    invoices: &Mutex<Vec<Value>>,
    signed: impl Fn(&str) -> crate::helpers::Delivery,
    on: impl Fn(String) -> String,
) {
    let end: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "UPDATE subscriptions SET current_period_start = now() - interval '1 month 3 hours',
                current_period_end = date_trunc('second', now() - interval '3 hours')
         WHERE order_number = $1 RETURNING current_period_end",
    )
    .bind(number)
    .fetch_one(pool)
    .await
    .unwrap();
    let start = end.timestamp();
    let first = on(self::invoice(
        "evt_x1",
        "invoice.paid",
        "in_1",
        "pi_1",
        "subscription_create",
        start - MONTH,
    ));
    // A change within the last period (an upgrade invoiced at once): no period's renewal.
    let change = on(self::invoice(
        "evt_xc",
        "invoice.paid",
        "in_c",
        "pi_c",
        "subscription_update",
        start - 86_400,
    ));
    let renewal = on(self::invoice(
        "evt_x2",
        "invoice.paid",
        "in_2",
        "pi_2",
        "subscription_cycle",
        start,
    ));
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, pool).unwrap();
    let reconcile = async || {
        payfleet::payments::reconcile::run(pool, &gateways, &crate::reconcile::settings(10, 0))
            .await
            .unwrap()
    };
    // Charged and still open (a bank debit processing, or a card Stripe will retry): nothing
    // reported, no failure invented.
    *invoices.lock().unwrap() = vec![
        listed(renewal.clone(), "open", 1),
        listed(change.clone(), "paid", 1),
        listed(first.clone(), "paid", 1),
    ];
    let report = reconcile().await;
    assert_eq!(report.found, 0, "{report:?}");
    assert!(renewals(pool).await.is_empty());
    assert_eq!(subscription_of(shop, number).await["status"], "active");
    // Paid, and asked again an hour later (the period's last asking moved back an hour).
    sqlx::query(
        "UPDATE subscription_period_checks SET checked_at = checked_at - interval '61 minutes'",
    )
    .execute(pool)
    .await
    .unwrap();
    *invoices.lock().unwrap() = vec![
        listed(renewal.clone(), "paid", 2),
        listed(change, "paid", 1),
        listed(first, "paid", 1),
    ];
    let report = reconcile().await;
    assert_eq!(report.found, 1, "{report:?}");
    wait_subscription(shop, number, "the period renewed", |s| {
        s["renewals"][0]["state"] == "paid"
    })
    .await;
    let paid = renewals(pool).await;
    assert_eq!(
        (paid.len(), paid[0].0, paid[0].1.as_str(), paid[0].4),
        (1, number + 1, "paid", 1),
        "{paid:?}"
    );
    let moved: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT current_period_start FROM subscriptions WHERE order_number = $1",
    )
    .bind(number)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(moved, end, "the subscription is in its new period");
    // The lost webhook after all: the same charge, no second sale, nothing given back.
    the_lost_event_adds_nothing(
        pool,
        shop,
        signed(&renewal.replace("evt_x2", "evt_late")),
        number + 1,
    )
    .await;
    // Renewed: nothing is asked about any more.
    let report = reconcile().await;
    assert_eq!(report.asked, 0, "{report:?}");
}

/// An invoice Stripe bills for a change within a period (a plan upgraded and invoiced at once)
/// is no period's renewal: it opens no second renewal, books no sale and leaves the period as
/// it is. Its payment is one no order asked for, kept for an operator (not given back: it is
/// the seller's), and reported.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_invoice_for_a_change_within_a_period_is_kept_for_an_operator_not_a_renewal(
    pool: PgPool,
) {
    let base = stand_in(stripe_api(), Log::default()).await;
    let (shop, order) = subscription_order(&pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    deliver(
        &shop,
        &stripe(&session_completed("evt_1", &session, Some("sub_1")), now()),
    )
    .await;
    let before = subscription_of(&shop, number).await;
    let upgrade = invoice_event("evt_up", "invoice.paid", "in_up", "pi_up")
        .replace("subscription_cycle", "subscription_update");
    deliver(&shop, &stripe(&upgrade, now())).await;
    assert_eq!(outcome(&pool, "stripe", "evt_up").await.0, "applied");
    assert!(renewals(&pool).await.is_empty(), "no renewal");
    let after = subscription_of(&shop, number).await;
    assert_eq!(
        after["current_period_start"],
        before["current_period_start"]
    );
    let (unmatched, given_back, refunds): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM unmatched_payments WHERE session_id = 'in_up'),
                (SELECT count(*) FROM unmatched_payments WHERE given_back_at IS NOT NULL),
                (SELECT count(*) FROM jobs WHERE kind = 'refund_payment')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((unmatched, given_back, refunds), (1, 0, 0));
    let found = payfleet::consistency::check(&pool, Duration::ZERO)
        .await
        .unwrap();
    assert!(
        found
            .iter()
            .any(|f| f.check == "captured_payment_unconfirmed" && f.subject.contains("in_up")),
        "{found:?}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_stripe_renewal_whose_event_was_lost_is_found_by_reconciliation(pool: PgPool) {
    let log = Log::default();
    let invoices: Arc<Mutex<Vec<Value>>> = Arc::default();
    let base = stand_in(
        with_invoice_list(stripe_api(), invoices.clone()),
        log.clone(),
    )
    .await;
    let (shop, order) = subscription_order(&pool, "stripe", "BRL", with_stripe(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    deliver(
        &shop,
        &stripe(&session_completed("evt_1", &session, Some("sub_1")), now()),
    )
    .await;
    subscription_of(&shop, number).await;
    a_lost_renewal_is_found_by_asking_about_its_period(
        &pool,
        &shop,
        number,
        &invoices,
        |b| stripe(b, now()),
        |e| e,
    )
    .await;
    let asked = log
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.uri.starts_with("/v1/invoices?"))
        .cloned()
        .unwrap();
    assert!(asked.uri.contains("subscription=sub_1"), "{}", asked.uri);
    assert_eq!(
        asked.header("stripe-account"),
        Some("acct_seller1"),
        "the seller's account"
    );
}

/// The same for the internal gateway collecting through Stripe, billed on the platform's
/// account: its charges are the internal gateway's renewals.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_acquirer_billed_renewal_whose_event_was_lost_is_found_by_reconciliation(pool: PgPool) {
    let log = Log::default();
    let invoices: Arc<Mutex<Vec<Value>>> = Arc::default();
    let api = with_invoice_list(stripe_with_subscriptions(Arc::default()), invoices.clone());
    let (shop, order) = acquirer_subscription_order_on(&pool, &log, api).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    let signed = |body: &str| stripe_signed(PLATFORM_SECRET, body, now());
    let completed = on_platform(&session_completed("evt_1", &session, Some("sub_1")));
    deliver(&shop, &signed(&completed)).await;
    subscription_of(&shop, number).await;
    a_lost_renewal_is_found_by_asking_about_its_period(
        &pool,
        &shop,
        number,
        &invoices,
        signed,
        |e| on_platform(&e),
    )
    .await;
    let sub = subscription_of(&shop, number).await;
    assert_eq!(sub["gateway"], "internal");
    let asked = log
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.uri.starts_with("/v1/invoices?"))
        .cloned()
        .unwrap();
    assert_eq!(
        asked.header("stripe-account"),
        None,
        "the platform's account"
    );
}

/// A Mercado Pago preapproval's period ended three hours ago and the notification of its
/// charge was lost: nothing names the authorized payment to look up. Reconciliation lists the
/// preapproval's charges since the period ended and stores the approved one as the
/// notification that was lost: looked up and read as the period's renewal, one sale.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_mercadopago_renewal_whose_notification_was_lost_is_found_by_reconciliation(
    pool: PgPool,
) {
    let first: Arc<Mutex<String>> = Arc::default();
    let debit: Arc<Mutex<String>> = Arc::default();
    let log = Log::default();
    let api = {
        let (f2, f3) = (first.clone(), first.clone());
        let (d1, d2) = (debit.clone(), debit.clone());
        // The period's charge, approved, as both the search and the lookup show it.
        let charge = move |reference: String, debit: String| {
            json!({"id": 7002, "type": "scheduled", "preapproval_id": "pre_1", "status": "processed",
                "external_reference": reference, "transaction_amount": 19.9, "currency_id": "BRL",
                "debit_date": debit, "payment": {"id": 5002, "status": "approved"}})
        };
        mercadopago_checkout(first.clone())
            .route(
                "/authorized_payments/search",
                axum::routing::get(move || {
                    let found = charge(f2.lock().unwrap().clone(), d1.lock().unwrap().clone());
                    async move {
                        axum::Json(json!({"paging": {"offset": 0, "limit": 50, "total": 1}, "results": [found]}))
                    }
                }),
            )
            .route(
                "/authorized_payments/{id}",
                axum::routing::get(move |Path(_id): Path<String>| {
                    let found = charge(f3.lock().unwrap().clone(), d2.lock().unwrap().clone());
                    async move { axum::Json(found) }
                }),
            )
    };
    let base = stand_in(api, log.clone()).await;
    let (shop, order) =
        subscription_order(&pool, "mercadopago", "BRL", with_mercadopago(base)).await;
    let number = order["number"].as_i64().unwrap();
    let session = order["payment"]["session_id"].as_str().unwrap().to_owned();
    *first.lock().unwrap() = session.clone();
    let ts = chrono::Utc::now().timestamp_millis();
    deliver(&shop, &mercadopago("5001", "req-1", ts)).await;
    subscription_of(&shop, number).await;
    // Its preapproval known, as an earlier period's charge named it (a first payment's
    // notification does not: until a charge or the preapproval's own notification names it,
    // there is nothing to list, and the period is `subscription_period_overdue`'s).
    sqlx::query("UPDATE payment_orders SET subscription_ref = 'pre_1'")
        .execute(&pool)
        .await
        .unwrap();
    let end: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "UPDATE subscriptions SET current_period_start = now() - interval '1 month 3 hours',
                current_period_end = date_trunc('second', now() - interval '3 hours')
         WHERE order_number = $1 RETURNING current_period_end",
    )
    .bind(number)
    .fetch_one(&pool)
    .await
    .unwrap();
    *debit.lock().unwrap() = end.to_rfc3339();
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let report =
        payfleet::payments::reconcile::run(&pool, &gateways, &crate::reconcile::settings(10, 0))
            .await
            .unwrap();
    assert_eq!(report.found, 1, "{report:?}");
    wait_subscription(&shop, number, "the period renewed", |s| {
        s["renewals"][0]["state"] == "paid"
    })
    .await;
    let paid = renewals(&pool).await;
    assert_eq!(
        (paid.len(), paid[0].0, paid[0].1.as_str(), paid[0].4),
        (1, number + 1, "paid", 1),
        "{paid:?}"
    );
    assert!(
        log.lock().unwrap().iter().any(|s| s
            .uri
            .starts_with("/authorized_payments/search?preapproval_id=pre_1")),
        "the preapproval's charges were listed"
    );
    // The lost notification after all: the same charge, no second sale.
    deliver(
        &shop,
        &mercadopago_topic("subscription_authorized_payment", "7002", "req-late", ts),
    )
    .await;
    wait_for("the late notification processed", Duration::from_secs(30), async || {
        sqlx::query_scalar::<_, bool>(
            "SELECT bool_and(outcome IS NOT NULL) FROM payment_events WHERE gateway = 'mercadopago'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
    assert_eq!(renewals(&pool).await[0].4, 1, "one sale");
}
