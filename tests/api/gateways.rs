//! The outside gateways against local stand-ins that speak their documented APIs: what we send
//! (form or JSON, headers, idempotency keys) and how we read their answers and errors.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use payfleet::gateways::api::{GatewayError, PaymentState, RefundRequest, SessionRequest};
use payfleet::gateways::{
    GatewayName, MercadoPagoClient, PaymentGateway, PaymentStatus, RazorpayGateway, StripeConnect,
};
use payfleet::money::Money;
use payfleet::secret::Secret;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::checkout::Shop;
use crate::helpers::*;

/// What a stand-in received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub uri: String,
    pub headers: HeaderMap,
    pub body: String,
}

pub type Log = Arc<Mutex<Vec<Seen>>>;

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn form(&self) -> HashMap<String, String> {
        url_pairs(&self.body)
    }
}

fn url_pairs(s: &str) -> HashMap<String, String> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

/// Percent-decoding of a form field.
fn decode(s: &str) -> String {
    let bytes = s.replace('+', " ").into_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

/// Serves `router` on port 0, recording every request; returns its base URL.
pub async fn stand_in(router: Router<Log>, log: Log) -> String {
    let recording = log.clone();
    let app = router
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let log = recording.clone();
                async move {
                    let (parts, body) = req.into_parts();
                    let bytes = axum::body::to_bytes(body, 1 << 20)
                        .await
                        .unwrap_or_default();
                    log.lock().unwrap().push(Seen {
                        method: parts.method.clone(),
                        uri: parts.uri.to_string(),
                        headers: parts.headers.clone(),
                        body: String::from_utf8_lossy(&bytes).into_owned(),
                    });
                    next.run(axum::extract::Request::from_parts(
                        parts,
                        axum::body::Body::from(bytes),
                    ))
                    .await
                }
            },
        ))
        .with_state(log);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

fn brl(s: &str) -> Money {
    Money::parse(s, "BRL").unwrap()
}

fn session_request(account: Option<&str>, interval: Option<&str>) -> SessionRequest {
    SessionRequest {
        order_number: 7,
        attempt: 1,
        reference: "pf-token-1".into(),
        expires_at: chrono::Utc::now() + chrono::Duration::hours(1),
        first_asked_at: chrono::Utc::now(),
        amount: brl("19.90"),
        platform_fee: brl("1.99"),
        seller_account: account.map(str::to_owned),
        description: "Order 7".into(),
        recurring_interval: interval.map(str::to_owned),
        recurring_amount: None,
        recurring_fee: None,
        metadata: BTreeMap::from([("order_number".to_owned(), "7".to_owned())]),
        idempotency_key: "payfleet-order-7".into(),
    }
}

/// A Stripe stand-in: Checkout Sessions, refunds (each succeeded at once), and Stripe's error
/// JSON for a bad account.
pub fn stripe_api() -> Router<Log> {
    async fn create(headers: HeaderMap, body: Bytes) -> impl IntoResponse {
        if headers.get("stripe-account").and_then(|v| v.to_str().ok()) == Some("acct_gone") {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(
                    json!({"error": {"type": "invalid_request_error", "code": "account_invalid", "message": "No such account: 'acct_gone'"}}),
                ),
            );
        }
        let form = url_pairs(std::str::from_utf8(&body).unwrap());
        let id = format!(
            "cs_test_{}",
            form.get("client_reference_id").cloned().unwrap_or_default()
        );
        (
            StatusCode::OK,
            axum::Json(
                json!({"id": id, "object": "checkout.session", "url": format!("https://checkout.stripe.test/c/pay/{id}"), "payment_status": "unpaid"}),
            ),
        )
    }
    Router::new()
        .route("/v1/checkout/sessions", axum::routing::post(create))
        // A coupon, named after the idempotency key it was made under.
        .route(
            "/v1/coupons",
            axum::routing::post(|headers: HeaderMap| async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                axum::Json(json!({"id": format!("co_{key}"), "object": "coupon"}))
            }),
        )
        .route(
            "/v1/checkout/sessions/{id}",
            // Paid; a session made in subscription mode answers as Stripe's do: the
            // subscription it started (`sub_1`), no PaymentIntent (its first invoice has it).
            axum::routing::get(
                |axum::extract::State(log): axum::extract::State<Log>, Path(id): Path<String>| async move {
                    // Stripe's Checkout Session ids; anything else (an invoice's `in_…`) is
                    // no session of this endpoint's.
                    if !id.starts_with("cs_") {
                        return (
                            StatusCode::NOT_FOUND,
                            axum::Json(json!({"error": {"type": "invalid_request_error", "code": "resource_missing",
                                "message": format!("No such checkout.session: '{id}'")}})),
                        );
                    }
                    // As the latest request that made this session asked.
                    let subscription = log
                        .lock()
                        .unwrap()
                        .iter()
                        .rev()
                        .map(|seen| (seen, url_pairs(&seen.body)))
                        .find(|(seen, form)| {
                            seen.method == Method::POST
                                && seen.uri.ends_with("/v1/checkout/sessions")
                                && format!(
                                    "cs_test_{}",
                                    form.get("client_reference_id").cloned().unwrap_or_default()
                                ) == id
                        })
                        .is_some_and(|(_, form)| {
                            form.get("mode").map(String::as_str) == Some("subscription")
                        });
                    (StatusCode::OK, axum::Json(if subscription {
                        json!({"id": id, "object": "checkout.session", "mode": "subscription", "subscription": "sub_1", "payment_status": "paid", "payment_intent": null, "invoice": "in_1", "amount_total": 1990, "currency": "brl"})
                    } else {
                        json!({"id": id, "object": "checkout.session", "mode": "payment", "payment_status": "paid", "payment_intent": "pi_1", "amount_total": 1990, "currency": "brl"})
                    }))
                },
            ),
        )
        .route(
            "/v1/refunds",
            // One refund per PaymentIntent, named after it (`pi_1`'s is `re_1`).
            axum::routing::post(|body: Bytes| async move {
                let form = url_pairs(std::str::from_utf8(&body).unwrap());
                let pi = form.get("payment_intent").cloned().unwrap_or_default();
                axum::Json(json!({"id": format!("re_{}", pi.trim_start_matches("pi_")), "object": "refund", "status": "succeeded"}))
            }),
        )
}

/// A coupon discounts a subscription's first period only: Stripe's recurring price is what
/// every period charges, and the first period's discount a coupon applied once, made on the
/// seller's account under a key of the session's own.
#[tokio::test]
async fn a_discounted_first_period_is_a_coupon_stripe_applies_once() {
    let log = Log::default();
    let base = stand_in(stripe_api(), log.clone()).await;
    let stripe = StripeConnect::new(&base, Secret::new("sk_test_123"), "http://shop.test").unwrap();
    let mut request = session_request(Some("acct_1"), Some("month"));
    request.amount = brl("17.91");
    request.platform_fee = brl("1.79");
    request.recurring_amount = Some(brl("19.90"));
    request.recurring_fee = Some(brl("1.99"));
    stripe.create_session(&request).await.unwrap();
    let sent = log.lock().unwrap().clone();
    assert_eq!(
        sent.iter().map(|s| s.uri.as_str()).collect::<Vec<_>>(),
        ["/v1/coupons", "/v1/checkout/sessions"]
    );
    let coupon = sent[0].form();
    for (k, v) in [
        ("amount_off", "199"),
        ("currency", "brl"),
        ("duration", "once"),
        ("max_redemptions", "1"),
    ] {
        assert_eq!(
            coupon.get(k).map(String::as_str),
            Some(v),
            "{k} in {coupon:?}"
        );
    }
    assert_eq!(sent[0].header("stripe-account"), Some("acct_1"));
    assert_eq!(
        sent[0].header("idempotency-key"),
        Some("payfleet-order-7-first-period")
    );
    let session = sent[1].form();
    for (k, v) in [
        ("mode", "subscription"),
        ("line_items[0][price_data][unit_amount]", "1990"),
        ("discounts[0][coupon]", "co_payfleet-order-7-first-period"),
        // The later periods' commission, 1.99 of 19.90: not the discounted first period's
        // 1.79 of 17.91 (9.99 %), which every period after it would carry.
        ("subscription_data[application_fee_percent]", "10"),
    ] {
        assert_eq!(
            session.get(k).map(String::as_str),
            Some(v),
            "{k} in {session:?}"
        );
    }
    // Not discounted: one price, no coupon.
    log.lock().unwrap().clear();
    let mut plain = session_request(Some("acct_1"), Some("month"));
    plain.recurring_amount = Some(brl("19.90"));
    stripe.create_session(&plain).await.unwrap();
    let sent = log.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    assert!(!sent[0].form().contains_key("discounts[0][coupon]"));
}

#[tokio::test]
async fn stripe_connect_speaks_stripes_documented_api() {
    let log = Log::default();
    let base = stand_in(stripe_api(), log.clone()).await;
    let stripe = StripeConnect::new(&base, Secret::new("sk_test_123"), "http://shop.test").unwrap();

    let session = stripe
        .create_session(&session_request(Some("acct_1"), None))
        .await
        .unwrap();
    assert_eq!(session.session_id, "cs_test_7");
    assert_eq!(session.url, "https://checkout.stripe.test/c/pay/cs_test_7");
    let sent = log.lock().unwrap()[0].clone();
    assert_eq!(
        (sent.method.as_str(), sent.uri.as_str()),
        ("POST", "/v1/checkout/sessions")
    );
    assert_eq!(sent.header("authorization"), Some("Bearer sk_test_123"));
    assert_eq!(
        sent.header("stripe-account"),
        Some("acct_1"),
        "a direct charge on the seller's account"
    );
    assert_eq!(sent.header("idempotency-key"), Some("payfleet-order-7"));
    assert_eq!(
        sent.header("content-type"),
        Some("application/x-www-form-urlencoded")
    );
    let form = sent.form();
    for (k, v) in [
        ("mode", "payment"),
        ("line_items[0][price_data][currency]", "brl"),
        ("line_items[0][price_data][unit_amount]", "1990"),
        ("line_items[0][quantity]", "1"),
        ("payment_intent_data[application_fee_amount]", "199"),
        ("payment_intent_data[metadata][order_number]", "7"),
        ("metadata[order_number]", "7"),
        ("client_reference_id", "7"),
    ] {
        assert_eq!(form.get(k).map(String::as_str), Some(v), "{k} in {form:?}");
    }

    // A subscription takes the fee as a percentage of each invoice.
    stripe
        .create_session(&session_request(Some("acct_1"), Some("month")))
        .await
        .unwrap();
    let form = log.lock().unwrap()[1].form();
    assert_eq!(form.get("mode").map(String::as_str), Some("subscription"));
    assert_eq!(
        form.get("line_items[0][price_data][recurring][interval]")
            .map(String::as_str),
        Some("month")
    );
    assert_eq!(
        form.get("subscription_data[application_fee_percent]")
            .map(String::as_str),
        Some("10")
    );

    // Made last in subscription mode: paid, with the subscription it started (its first
    // invoice names the PaymentIntent, the session none).
    let state = stripe.status("cs_test_7", Some("acct_1")).await.unwrap();
    assert_eq!(
        state,
        PaymentState {
            status: PaymentStatus::Succeeded,
            payment_id: None,
            amount: Some(brl("19.90")),
            subscription: Some("sub_1".into()),
        }
    );
    assert_eq!(
        log.lock().unwrap()[2].header("stripe-account"),
        Some("acct_1")
    );

    let receipt = stripe
        .refund(&RefundRequest {
            session_id: "cs_test_7".into(),
            payment_id: "pi_1".into(),
            amount: brl("5.00"),
            seller_account: Some("acct_1".into()),
            idempotency_key: "refund-1".into(),
        })
        .await
        .unwrap();
    assert_eq!(
        (receipt.refund_id.as_str(), receipt.succeeded),
        ("re_1", true)
    );
    let sent = log.lock().unwrap()[3].clone();
    assert_eq!(sent.header("idempotency-key"), Some("refund-1"));
    assert_eq!(sent.form().get("amount").map(String::as_str), Some("500"));
    assert_eq!(
        sent.form().get("payment_intent").map(String::as_str),
        Some("pi_1")
    );

    // Stripe's error JSON becomes a typed error; a seller without an account is refused here.
    let e = stripe
        .create_session(&session_request(Some("acct_gone"), None))
        .await
        .unwrap_err();
    let GatewayError::Api {
        status,
        code,
        message,
        ..
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!((*status, code.as_deref()), (400, Some("account_invalid")));
    assert!(message.contains("No such account"), "{message}");
    assert!(!e.is_transient());
    assert!(matches!(
        stripe.create_session(&session_request(None, None)).await,
        Err(GatewayError::Refused(_))
    ));
    assert_eq!(
        stripe.map_status("a_new_status"),
        PaymentStatus::Pending,
        "unknown: the safe default"
    );
}

/// The tests' configuration with Stripe's API on a stand-in at `base`.
/// `PAYFLEET_INTERNAL_ACQUIRER=stripe` on `config` (whose Stripe API is set): the internal
/// gateway collects on the platform's Stripe account, its facts from Stripe only (no
/// internal-gateway webhook secret), the platform endpoint's events signed with `secret`.
pub fn collecting_through_stripe(config: &mut payfleet::config::Config, secret: &str) {
    config.gateways.hosted.internal_acquirer = payfleet::gateways::hosted::InternalAcquirer::Stripe;
    config.gateways.hosted.internal = None;
    config.gateways.stripe.platform_webhook_secret = Some(Secret::new(secret));
}

pub fn config_with_stripe(base: String) -> payfleet::config::Config {
    let mut config = test_config();
    config.gateways.stripe.api = Some(payfleet::gateways::stripe::Api {
        base_url: base,
        secret_key: Secret::new("sk_test_123"),
    });
    config
}

/// A fleet with Stripe Connect on a stand-in of Stripe's API, and a seller with a connected
/// account (`acct_seller1`) whose 19.90 BRL product is in `product`.
async fn stripe_connect_shop(pool: &PgPool, log: Log) -> (Shop, String) {
    let base = stand_in(stripe_api(), log).await;
    let config = config_with_stripe(base);
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config).await),
    };
    let product = connected_product(&shop).await;
    (shop, product)
}

/// A seller with a connected Stripe account (`acct_seller1`) and their 19.90 BRL product: the
/// product's id.
pub async fn connected_product(shop: &Shop) -> String {
    let seller = shop
        .admin(
            "/admin/sellers",
            json!({"name": "Connected", "payout_frequency": "weekly", "payout_minimum": "0", "stripe_account": "acct_seller1"}),
        )
        .await;
    shop.product(seller["id"].as_str().unwrap(), "19.90", "BRL")
        .await
}

pub fn stripe_cart(product: &str) -> Value {
    json!({"buyer_id": "b", "gateway": "stripe", "items": [{"product_id": product, "quantity": 1}]})
}

/// Checks `product` out on Stripe (trying again while the payment side starts) and returns
/// the answer.
async fn stripe_checkout(shop: &Shop, product: &str) -> Value {
    let mut answer = Value::Null;
    for _ in 0..50 {
        let (status, a) = shop.checkout(Some("k"), stripe_cart(product)).await;
        answer = a;
        if status == 201 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_eq!(
        answer["orders"][0]["payment"]["session_id"], "cs_test_1",
        "{answer}"
    );
    answer
}

/// The Checkout Sessions asked of the Stripe stand-in, in order.
fn sessions_asked(log: &Log) -> Vec<Seen> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|s| s.uri == "/v1/checkout/sessions")
        .cloned()
        .collect()
}

/// Stripe's Checkout Sessions, failing the first asking (a 500: it may have made the session)
/// and answering `cs_test_1` to every one after it.
fn failing_once() -> Router<Log> {
    sessions_failing_first(StatusCode::INTERNAL_SERVER_ERROR, false)
}

/// Stripe's Checkout Sessions: the first asking answered `first` (nothing made), every one
/// after it `cs_test_1`; with `checking_expiry`, a session's expiry checked as Stripe does (at
/// least 30 minutes after its creation by Stripe's clock, or a 400 that saves nothing under the
/// idempotency key).
fn sessions_failing_first(first: StatusCode, checking_expiry: bool) -> Router<Log> {
    let first_asking = Arc::new(std::sync::atomic::AtomicBool::new(true));
    Router::new().route(
        "/v1/checkout/sessions",
        axum::routing::post(
            move |axum::extract::Form(form): axum::extract::Form<HashMap<String, String>>| {
                let first_asking = first_asking.clone();
                async move {
                    if first_asking.swap(false, std::sync::atomic::Ordering::SeqCst) {
                        return (
                            first,
                            axum::Json(json!({"error": {"type": "api_error", "message": "try again"}})),
                        );
                    }
                    let expires: i64 = form
                        .get("expires_at")
                        .and_then(|e| e.parse().ok())
                        .unwrap_or(0);
                    if checking_expiry && expires < chrono::Utc::now().timestamp() + 30 * 60 {
                        return (
                            StatusCode::BAD_REQUEST,
                            axum::Json(json!({"error": {"type": "invalid_request_error", "code": "parameter_invalid_integer",
                                "param": "expires_at", "message": "The `expires_at` timestamp must be at least 30 minutes from Checkout Session creation."}})),
                        );
                    }
                    (
                        StatusCode::OK,
                        axum::Json(json!({"id": "cs_test_1", "object": "checkout.session",
                            "url": "https://checkout.stripe.test/c/pay/cs_test_1", "payment_status": "unpaid"})),
                    )
                }
            },
        ),
    )
}

/// A link whose first asking got no answer (Stripe may have made the session, and the answer
/// was lost) is asked again, later, with the same idempotency key and exactly the same
/// parameters: Stripe answers that with the session it made, where a key reused with other
/// parameters (an expiry counted from each call's own time) is refused for a day.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_stripe_link_asked_again_asks_exactly_the_same(pool: PgPool) {
    let log = Log::default();
    let base = stand_in(failing_once(), log.clone()).await;
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config_with_stripe(base)).await),
    };
    let product = connected_product(&shop).await;
    let asked = || sessions_asked(&log);
    for _ in 0..50 {
        let (status, answer) = shop.checkout(Some("k"), stripe_cart(&product)).await;
        if !asked().is_empty() {
            assert_eq!(
                (status, answer["error"]["code"].as_str()),
                (503, Some("payment_link_unavailable")),
                "{answer}"
            );
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // Long enough that an expiry counted from each call's own time would differ.
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    let (status, answer) = shop.checkout(Some("k"), stripe_cart(&product)).await;
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["orders"][0]["payment"]["session_id"], "cs_test_1");
    let sent = asked();
    assert_eq!(sent.len(), 2);
    assert_eq!(
        sent[0].header("idempotency-key"),
        sent[1].header("idempotency-key")
    );
    assert!(sent[0].header("idempotency-key").is_some());
    assert_eq!(sent[0].form(), sent[1].form());
    let expires: i64 = sent[0].form()["expires_at"].parse().unwrap();
    let in_minutes = (expires - chrono::Utc::now().timestamp()) / 60;
    assert!((28..=31).contains(&in_minutes), "{in_minutes}");
}

/// The same, when the buyer reopens the order (as the 503 says to) rather than repeating the
/// checkout: the reopening moves the order's expiry on, and a retry sending the new one under
/// the same key would be refused by Stripe for a day (`idempotency_error`), the order never
/// getting its link. The retry sends the expiry of the first asking.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_stripe_link_asked_again_for_a_reopened_order_asks_exactly_the_same(pool: PgPool) {
    let log = Log::default();
    let base = stand_in(failing_once(), log.clone()).await;
    let mut config = config_with_stripe(base);
    // Orders wait two hours: an expiry Stripe takes as it is, to the second.
    config.orders.expiry = std::time::Duration::from_secs(2 * 3600);
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config).await),
    };
    let product = connected_product(&shop).await;
    let asked = || sessions_asked(&log);
    let (status, answer) = shop.checkout(Some("k"), stripe_cart(&product)).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (503, Some("payment_link_unavailable")),
        "{answer}"
    );
    assert_eq!(asked().len(), 1);
    let number: i64 = sqlx::query_scalar("SELECT max(number) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    let (status, order) = shop
        .post(&format!("/orders/{number}/payment"), None, json!({}))
        .await;
    assert_eq!(status, 200, "{order}");
    assert_eq!(order["payment"]["session_id"], "cs_test_1", "{order}");
    let sent = asked();
    assert_eq!(sent.len(), 2);
    assert_eq!(
        sent[0].header("idempotency-key"),
        sent[1].header("idempotency-key")
    );
    assert_eq!(sent[0].form(), sent[1].form());
}

/// A link whose first asking never reached Stripe (an outage) and whose buyer comes back five
/// minutes later: its expiry, counted from that first asking, is now less than the 30 minutes
/// Stripe asks of a new session, and Stripe refuses it, saving nothing under the key. The
/// payment side then asks afresh under the same key, its expiry counted from now, and the
/// buyer gets the link (before, every retry was refused until the order expired).
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_stripe_link_first_asked_before_an_outage_is_asked_afresh_when_refused(pool: PgPool) {
    let log = Log::default();
    let base = stand_in(
        // The first asking fails without reaching the API (a 502 from a proxy).
        sessions_failing_first(StatusCode::BAD_GATEWAY, true),
        log.clone(),
    )
    .await;
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config_with_stripe(base)).await),
    };
    let product = connected_product(&shop).await;
    let asked = || sessions_asked(&log);
    for _ in 0..50 {
        let (status, answer) = shop.checkout(Some("k"), stripe_cart(&product)).await;
        if !asked().is_empty() {
            assert_eq!(
                (status, answer["error"]["code"].as_str()),
                (503, Some("payment_link_unavailable")),
                "{answer}"
            );
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // Five minutes later: every time the fleet holds moved back by as much.
    for moved in [
        "UPDATE payment_link_asks SET first_asked_at = first_asked_at - interval '5 minutes', expires_at = expires_at - interval '5 minutes'",
        "UPDATE orders SET created_at = created_at - interval '5 minutes', expires_at = expires_at - interval '5 minutes'",
    ] {
        sqlx::query(moved).execute(&pool).await.unwrap();
    }
    let (status, answer) = shop.checkout(Some("k"), stripe_cart(&product)).await;
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["orders"][0]["payment"]["session_id"], "cs_test_1");
    let sent = asked();
    assert_eq!(
        sent.len(),
        3,
        "the outage's, the refused and the fresh asking"
    );
    assert!(
        sent.iter()
            .all(|s| s.header("idempotency-key") == sent[0].header("idempotency-key"))
    );
    assert_ne!(sent[1].form()["expires_at"], sent[2].form()["expires_at"]);
    // The fresh asking is what a retry sends from now on.
    let expires: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM payment_link_asks")
            .fetch_one(&pool)
            .await
            .unwrap();
    let order_expires: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM orders")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(expires, order_expires);
}

async fn wait_until_paid(shop: &Shop, number: i64) {
    let start = std::time::Instant::now();
    while shop.order(number).await["status"] != "paid" {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "not confirmed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_stripe_checkout_is_paid_on_the_sellers_account_and_confirmed_by_its_event(pool: PgPool) {
    let log = Log::default();
    let (shop, p) = stripe_connect_shop(&pool, log.clone()).await;
    let no_account = shop.seller("No account").await;
    let q = shop.product(&no_account, "5.00", "BRL").await;
    let (status, answer) = shop.checkout(Some("no-account"), stripe_cart(&q)).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("gateway_unavailable")),
        "{answer}"
    );
    stripe_checkout(&shop, &p).await;
    let sent = log.lock().unwrap()[0].clone();
    assert_eq!(sent.header("stripe-account"), Some("acct_seller1"));
    assert_eq!(
        sent.form()
            .get("payment_intent_data[application_fee_amount]")
            .map(String::as_str),
        Some("199")
    );

    let completed = r#"{"id":"evt_1","type":"checkout.session.completed","data":{"object":{"id":"cs_test_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    let (status, _) = shop.app.deliver(&stripe(completed, now())).await;
    assert_eq!(status, 200);
    wait_until_paid(&shop, 1).await;
}

/// Whoever makes a PaymentIntent writes its metadata, and every connected account's events
/// reach the Connect endpoint with a genuine signature. A PaymentIntent another seller made
/// (the money in its own account), or the seller itself (without the platform's fee), naming
/// an order's session in its metadata, confirms nothing: a PaymentIntent is known by its own
/// id, which only the session's own events name.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_intent_naming_a_session_in_its_metadata_confirms_no_order(pool: PgPool) {
    let (shop, p) = stripe_connect_shop(&pool, Log::default()).await;
    stripe_checkout(&shop, &p).await;
    for (event, account) in [("evt_other", "acct_other"), ("evt_own", "acct_seller1")] {
        let forged = json!({"id": event, "type": "payment_intent.succeeded", "account": account,
            "data": {"object": {"id": format!("pi_{event}"), "object": "payment_intent", "status": "succeeded",
                "amount_received": 1990, "currency": "brl", "metadata": {"session_id": "cs_test_1"}}}});
        let (status, body) = shop.app.deliver(&stripe(&forged.to_string(), now())).await;
        assert_eq!(status, 200, "{body}");
    }
    let start = std::time::Instant::now();
    loop {
        let outcomes: Vec<(String, String)> = sqlx::query_as(
            "SELECT event_id, outcome::text FROM payment_events
             WHERE event_id IN ('evt_other', 'evt_own') AND outcome IS NOT NULL ORDER BY event_id",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        if outcomes.len() == 2 {
            assert_eq!(
                outcomes,
                [
                    ("evt_other".to_owned(), "waiting".to_owned()),
                    ("evt_own".to_owned(), "waiting".to_owned())
                ],
                "each waits for its PaymentIntent to be known, which no session names"
            );
            break;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "not processed: {outcomes:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let order = shop.order(1).await;
    assert_eq!(order["status"], "awaiting_payment", "{order}");
    let credits: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger_transfers WHERE kind = 'sale_credit'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(credits, 0, "no sale posted");

    // The session's own event still confirms it, with its own PaymentIntent.
    let completed = r#"{"id":"evt_1","type":"checkout.session.completed","account":"acct_seller1","data":{"object":{"id":"cs_test_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    let (status, _) = shop.app.deliver(&stripe(completed, now())).await;
    assert_eq!(status, 200);
    wait_until_paid(&shop, 1).await;
    let payments: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT session_id, payment_id FROM payment_orders ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        payments,
        [("cs_test_1".to_owned(), Some("pi_1".to_owned()))],
        "one payment, the session's own"
    );
}

/// With the internal gateway collecting through Stripe, its links are Stripe's sessions: each is
/// asked on its own, as an outside gateway's, and not batched with others, where one slow
/// Stripe call would hold up (and time out) every checkout in its batch and the ones queued
/// behind it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_acquirers_slow_link_holds_up_no_other_checkout(pool: PgPool) {
    let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let api = Router::new().route(
        "/v1/checkout/sessions",
        axum::routing::post(move |body: String| {
            let made = made.clone();
            async move {
                // A 29.90 order's session takes Stripe six seconds.
                if body.contains("=2990") {
                    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
                }
                let n = made.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                axum::Json(json!({"id": format!("cs_test_{n}"), "object": "checkout.session",
                    "url": format!("https://checkout.stripe.test/c/pay/cs_test_{n}"), "payment_status": "unpaid"}))
            }
        }),
    );
    let base = stand_in(api, Log::default()).await;
    let mut config = test_config();
    config.gateways.stripe.api = Some(payfleet::gateways::stripe::Api {
        base_url: base,
        secret_key: Secret::new("sk_test_platform"),
    });
    collecting_through_stripe(&mut config, "whsec_platform");
    config.messaging.rpc_timeout = std::time::Duration::from_secs(4);
    let shop = Arc::new(Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config).await),
    });
    let seller = shop.seller("Merchant of record's seller").await;
    let cart = |p: &str| json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": p, "quantity": 1}]});
    let p = shop.product(&seller, "19.90", "BRL").await;
    let slow_product = shop.product(&seller, "29.90", "BRL").await;
    // The payment side's consumers are up once a first link is made.
    for i in 0.. {
        let (status, _) = shop.checkout(Some(&format!("first-{i}")), cart(&p)).await;
        if status == 201 {
            break;
        }
        assert!(i < 50, "no payment side");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let slow = {
        let shop = shop.clone();
        let cart = cart(&slow_product);
        tokio::spawn(async move { shop.checkout(Some("slow"), cart).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let others = futures_util::future::join_all((0..4).map(|i| {
        let shop = shop.clone();
        let cart = cart(&p);
        async move {
            let asked = std::time::Instant::now();
            let answer = shop.checkout(Some(&format!("fast-{i}")), cart).await;
            (answer, asked.elapsed())
        }
    }))
    .await;
    for ((status, answer), took) in &others {
        assert_eq!(*status, 201, "{answer}");
        // Batched behind the slow link, each would wait for its batch's timeout (4 s).
        assert!(
            *took < std::time::Duration::from_secs(2),
            "{took:?}: held up by another checkout's link"
        );
    }
    let (status, answer) = slow.await.unwrap();
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (503, Some("payment_link_unavailable")),
        "{answer}"
    );
}

/// Stripe hangs: each of its links is waited for only as long as its caller waits (not Stripe's
/// own longer timeout), and it holds at most its share of the payment side's places, so
/// another gateway's links are made meanwhile.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_hung_gateway_holds_its_share_of_the_payment_side_and_no_more(pool: PgPool) {
    use payfleet::messaging::rpc::{PaymentLinkReply, PaymentLinkRequest};
    let hung = Router::new().route(
        "/v1/checkout/sessions",
        axum::routing::post(|| async {
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            StatusCode::GATEWAY_TIMEOUT
        }),
    );
    let mp = Router::new().route(
        "/checkout/preferences",
        axum::routing::post(|| async {
            axum::Json(
                json!({"id": "pref-1", "init_point": "https://mp.test/checkout?pref_id=pref-1"}),
            )
        }),
    );
    let mut config = config_with_stripe(stand_in(hung, Log::default()).await);
    config.gateways.mercadopago.api = Some(payfleet::gateways::mercadopago::Api {
        base_url: stand_in(mp, Log::default()).await,
        access_token: Secret::new("TEST-123"),
    });
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let service = Arc::new(payfleet::payments::links::LinkService {
        pool: pool.clone(),
        gateways,
        in_flight: Default::default(),
    });
    let request = |number: i64, gateway: GatewayName| PaymentLinkRequest {
        order_number: number,
        gateway,
        amount: Money::parse("10.00", "BRL").unwrap(),
        platform_fee: Money::parse("1.00", "BRL").unwrap(),
        seller_id: "seller".into(),
        seller_account: Some("acct_seller1".into()),
        buyer_id: "buyer".into(),
        description: format!("Order {number}"),
        recurring_interval: None,
        attempt: 1,
        link_key: format!("key-{number}"),
        expires_at: chrono::Utc::now() + chrono::Duration::minutes(30),
        renews_at: None,
        renews_fee: None,
        answer_within_ms: Some(1_500),
    };
    let share = payfleet::payments::links::GATEWAY_SHARE;
    let started = std::time::Instant::now();
    let stripes: Vec<_> = (0..share as i64)
        .map(|n| {
            let service = service.clone();
            let r = request(n + 1, GatewayName::Stripe);
            tokio::spawn(async move { service.link(r).await })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Its share taken: another Stripe link waits for a place until its caller stops waiting
    // (a second here), then is refused, to be asked again later.
    let waiting = {
        let service = service.clone();
        let r = PaymentLinkRequest {
            answer_within_ms: Some(1_000),
            ..request(100, GatewayName::Stripe)
        };
        tokio::spawn(async move { service.link(r).await })
    };
    // Mercado Pago's links are made meanwhile, more at once than a share: they wait for a
    // place, not refused.
    let made = futures_util::future::join_all(
        (0..12).map(|n| service.link(request(200 + n, GatewayName::MercadoPago))),
    )
    .await;
    for made in &made {
        assert!(
            matches!(made, PaymentLinkReply::Created { url, .. } if url.contains("pref-1")),
            "{made:?}"
        );
    }
    assert!(started.elapsed() < std::time::Duration::from_millis(1_200));
    let refused = waiting.await.unwrap();
    assert!(
        matches!(&refused, PaymentLinkReply::Failed { code, retryable: true, message } if code == "unavailable" && message.contains("answering slowly")),
        "{refused:?}"
    );
    // Each Stripe link is given up when its caller stops waiting, not after Stripe's own 15 s.
    for s in stripes {
        let reply = s.await.unwrap();
        assert!(
            matches!(&reply, PaymentLinkReply::Failed { code, retryable: true, message } if code == "unavailable" && message.contains("did not answer in time")),
            "{reply:?}"
        );
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // Its places are given back: the next Stripe link is asked (and waited for) again.
    let again = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        service.link(request(300, GatewayName::Stripe)),
    )
    .await
    .unwrap();
    assert!(
        matches!(&again, PaymentLinkReply::Failed { message, .. } if message.contains("did not answer in time")),
        "{again:?}"
    );

    // The internal gateway collecting through Stripe is Stripe's calls too: its links count in
    // Stripe's share, or a Stripe outage would take two shares, every slot.
    let mut config = config;
    collecting_through_stripe(&mut config, "whsec_platform");
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let service = Arc::new(payfleet::payments::links::LinkService {
        pool: pool.clone(),
        gateways,
        in_flight: payfleet::payments::links::InFlight::new(Some(GatewayName::Stripe)),
    });
    let stripes: Vec<_> = (0..share as i64)
        .map(|n| {
            let service = service.clone();
            let r = request(400 + n, GatewayName::Stripe);
            tokio::spawn(async move { service.link(r).await })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let internal = PaymentLinkRequest {
        seller_account: None,
        answer_within_ms: Some(1_000),
        ..request(500, GatewayName::Internal)
    };
    let refused = service.link(internal).await;
    assert!(
        matches!(&refused, PaymentLinkReply::Failed { message, .. } if message.contains("answering slowly")),
        "{refused:?}"
    );
    for s in stripes {
        s.await.unwrap();
    }
}

/// `PAYFLEET_INTERNAL_ACQUIRER=stripe`: the internal gateway (the platform as merchant of
/// record) collects on the platform's own Stripe account, and Stripe's events on that account
/// confirm, refund and dispute through the same processing path, settled in the seller's ledger.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_internal_gateway_collects_through_stripe_on_the_platforms_account(pool: PgPool) {
    let log = Log::default();
    let base = stand_in(stripe_api(), log.clone()).await;
    let mut config = test_config();
    config.gateways.stripe.api = Some(payfleet::gateways::stripe::Api {
        base_url: base,
        secret_key: Secret::new("sk_test_platform"),
    });
    // The platform account's endpoint signs with a secret of its own.
    const PLATFORM_SECRET: &str = "whsec_platform_endpoint_secret";
    collecting_through_stripe(&mut config, PLATFORM_SECRET);
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config).await),
    };
    let seller = shop.seller("Merchant of record's seller").await;
    let p = shop.product(&seller, "19.90", "BRL").await;
    let mut answer = Value::Null;
    for _ in 0..50 {
        let (status, a) = shop
            .checkout(
                Some("k"),
                json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": p, "quantity": 1}]}),
            )
            .await;
        answer = a;
        if status == 201 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let order = &answer["orders"][0];
    assert_eq!(order["payment"]["session_id"], "cs_test_1", "{answer}");
    assert_eq!(
        order["payment"]["url"], "https://checkout.stripe.test/c/pay/cs_test_1",
        "the buyer pays on Stripe, not on a simulator page"
    );
    let sent = log.lock().unwrap()[0].clone();
    assert_eq!(
        sent.header("authorization"),
        Some("Bearer sk_test_platform")
    );
    assert_eq!(
        sent.header("stripe-account"),
        None,
        "collected on the platform's own account"
    );
    let form = sent.form();
    assert!(
        !form.keys().any(|k| k.contains("application_fee")),
        "no fee on the charge: the split is the ledger's: {form:?}"
    );
    for (k, v) in [
        ("metadata[seller_id]", seller.as_str()),
        ("metadata[platform_fee]", "1.99"),
        ("metadata[seller_net]", "17.91"),
        ("line_items[0][price_data][unit_amount]", "1990"),
    ] {
        assert_eq!(form.get(k).map(String::as_str), Some(v), "{k} in {form:?}");
    }
    // Its page is Stripe's: no simulator page for this session here, and no internal-gateway
    // webhook can speak for it.
    let (status, _) = shop.app.get("/pay/cs_test_1").await;
    assert_eq!(status, 404);
    let (status, _) = shop
        .app
        .deliver(&internal(
            "forged",
            &payment_body("payment.succeeded", "cs_test_1", "19.90"),
        ))
        .await;
    assert_eq!(status, 404, "the internal gateway's webhook is off");

    // Stripe's event on the platform account (no `account`) confirms it.
    let completed = r#"{"id":"evt_p1","type":"checkout.session.completed","data":{"object":{"id":"cs_test_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid","metadata":{"seller_id":"x"}}}}"#;
    let (status, _) = shop
        .app
        .deliver(&stripe_signed("whsec_someone_elses", completed, now()))
        .await;
    assert_eq!(status, 401, "neither endpoint's secret");
    let (status, _) = shop
        .app
        .deliver(&stripe_signed(PLATFORM_SECRET, completed, now()))
        .await;
    assert_eq!(status, 200);
    let balances = |s: String| {
        let app = shop.app.clone();
        async move {
            let (_, body) = app.get(&format!("/sellers/{s}/balances")).await;
            let v: Value = serde_json::from_str(&body).unwrap();
            v["balances"][0]["pending"]
                .as_str()
                .unwrap_or("none")
                .to_owned()
        }
    };
    wait_for(
        "the order to be paid",
        std::time::Duration::from_secs(20),
        async || shop.order(1).await["status"] == "paid",
    )
    .await;
    assert_eq!(
        balances(seller.clone()).await,
        "17.91",
        "the seller's net is owed by the platform, as for any internal-gateway sale"
    );

    // An operator's refund goes to Stripe on the platform's account, with its idempotency key.
    let refund = shop
        .app
        .anon
        .post(format!("http://{}/admin/orders/1/refunds", shop.app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .header("idempotency-key", "rf-1")
        .json(&json!({"amount": "5.00"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refund.status(), 201);
    let sent = log
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.uri == "/v1/refunds")
        .cloned()
        .unwrap();
    assert_eq!(sent.header("stripe-account"), None);
    assert!(sent.header("idempotency-key").is_some());
    let form = sent.form();
    assert_eq!(form.get("payment_intent").map(String::as_str), Some("pi_1"));
    assert_eq!(form.get("amount").map(String::as_str), Some("500"));
    assert_eq!(form.get("refund_application_fee"), None);
    // Stripe's own report of that refund, and a dispute, arrive as platform events.
    let refunded = r#"{"id":"evt_p2","type":"refund.updated","data":{"object":{"id":"re_1","payment_intent":"pi_1","amount":500,"currency":"brl","status":"succeeded"}}}"#;
    let disputed = r#"{"id":"evt_p3","type":"charge.dispute.created","data":{"object":{"id":"dp_1","payment_intent":"pi_1","amount":1490,"currency":"brl","status":"needs_response"}}}"#;
    for body in [refunded, disputed] {
        let (status, _) = shop
            .app
            .deliver(&stripe_signed(PLATFORM_SECRET, body, now()))
            .await;
        assert_eq!(status, 200);
    }
    wait_for(
        "the dispute to be recorded",
        std::time::Duration::from_secs(20),
        async || shop.order(1).await["status"] == "disputed",
    )
    .await;
    let order = shop.order(1).await;
    assert_eq!(
        order["amount_refunded"], "5.00",
        "the refund is counted once: {order}"
    );
    // 17.91 net: 4.50 back for the refund of 5.00, 13.41 held for the dispute of 14.90.
    assert_eq!(balances(seller).await, "0.00");
}

#[tokio::test]
async fn mercadopago_preferences_payments_and_refunds_as_documented() {
    let log = Log::default();
    let api = Router::new()
        .route(
            "/checkout/preferences",
            axum::routing::post(|| async { axum::Json(json!({"id": "pref-123", "init_point": "https://mp.test/checkout?pref_id=pref-123"})) }),
        )
        .route(
            "/v1/payments/search",
            axum::routing::get(|uri: Uri| async move {
                assert!(uri.query().unwrap_or("").contains("external_reference=pf-token-1"), "{uri}");
                axum::Json(json!({"results": [
                    {"id": 1001, "status": "rejected", "transaction_amount": 19.9, "currency_id": "BRL"},
                    {"id": 1002, "status": "approved", "transaction_amount": 19.9, "currency_id": "BRL"}
                ]}))
            }),
        )
        .route(
            "/v1/payments/{id}/refunds",
            axum::routing::post(|Path(id): Path<String>, State(_): State<Log>| async move {
                assert_eq!(id, "1002");
                axum::Json(json!({"id": 555, "payment_id": 1002, "amount": 5, "status": "approved"}))
            }),
        );
    let base = stand_in(api, log.clone()).await;
    let mp = MercadoPagoClient::new(&base, Secret::new("APP_USR-token")).unwrap();
    let session = mp
        .create_session(&session_request(None, None))
        .await
        .unwrap();
    assert_eq!(session.session_id, "pf-token-1");
    assert_eq!(session.url, "https://mp.test/checkout?pref_id=pref-123");
    let sent = log.lock().unwrap()[0].clone();
    assert_eq!(sent.header("authorization"), Some("Bearer APP_USR-token"));
    assert_eq!(sent.header("x-idempotency-key"), Some("payfleet-order-7"));
    let body: Value = serde_json::from_str(&sent.body).unwrap();
    assert_eq!(body["external_reference"], "pf-token-1");
    assert_eq!(body["expires"], true);
    assert_eq!(body["items"][0]["unit_price"], json!(19.90));
    assert_eq!(body["items"][0]["currency_id"], "BRL");
    assert_eq!(body["marketplace_fee"], json!(1.99));

    let state = mp.status("pf-token-1", None).await.unwrap();
    assert_eq!(
        state,
        PaymentState {
            status: PaymentStatus::Succeeded,
            payment_id: Some("1002".into()),
            amount: Some(brl("19.90")),
            subscription: None,
        }
    );
    let receipt = mp
        .refund(&RefundRequest {
            session_id: "pf-token-1".into(),
            payment_id: "1002".into(),
            amount: brl("5.00"),
            seller_account: None,
            idempotency_key: "r-1".into(),
        })
        .await
        .unwrap();
    assert_eq!(
        (receipt.refund_id.as_str(), receipt.succeeded),
        ("555", true)
    );
    assert_eq!(
        log.lock().unwrap()[2].header("x-idempotency-key"),
        Some("r-1")
    );
}

#[tokio::test]
async fn razorpay_orders_payments_and_refunds_as_documented() {
    let log = Log::default();
    let api = Router::new()
        .route(
            "/v1/orders",
            axum::routing::post(|| async { axum::Json(json!({"id": "order_Rz1", "entity": "order", "amount": 1990, "currency": "BRL", "status": "created"})) }),
        )
        .route(
            "/v1/orders/{id}/payments",
            axum::routing::get(|Path(id): Path<String>| async move {
                let payment = |pay: &str, status: &str| json!({"id": pay, "entity": "payment", "amount": 1990, "currency": "BRL", "status": status, "order_id": id});
                // order_Rz4: one payment, refunded; order_Rz5: a refunded one listed first, then
                // one captured.
                let items = match id.as_str() {
                    "order_Rz4" => vec![payment("pay_Rz4", "refunded")],
                    "order_Rz5" => vec![payment("pay_Rz5a", "refunded"), payment("pay_Rz5b", "captured")],
                    _ => vec![payment("pay_Rz1", "captured")],
                };
                axum::Json(json!({"entity": "collection", "count": items.len(), "items": items}))
            }),
        )
        .route(
            "/v1/payments/{id}/refund",
            axum::routing::post(|| async {
                (StatusCode::BAD_REQUEST, axum::Json(json!({"error": {"code": "BAD_REQUEST_ERROR", "description": "The refund amount exceeds the captured amount"}})))
            }),
        )
        // A subscription's invoices: inv_Rz2 paid, inv_Rz3 issued and not charged yet.
        .route(
            "/v1/invoices/{id}",
            axum::routing::get(|Path(id): Path<String>| async move {
                let paid = id == "inv_Rz2";
                axum::Json(json!({"id": id, "entity": "invoice", "subscription_id": "sub_Rz",
                    "status": if paid { "paid" } else { "issued" },
                    "payment_id": if paid { json!("pay_Rz2") } else { Value::Null },
                    "amount": 1990, "amount_paid": if paid { 1990 } else { 0 }, "currency": "INR"}))
            }),
        );
    let base = stand_in(api, log.clone()).await;
    let rzp = RazorpayGateway::new(
        &base,
        "rzp_test_key",
        Secret::new("rzp_secret"),
        "http://shop.test",
    )
    .unwrap();
    let session = rzp
        .create_session(&session_request(None, None))
        .await
        .unwrap();
    assert_eq!(session.session_id, "order_Rz1");
    assert_eq!(session.url, "http://shop.test/pay/razorpay/order_Rz1");
    let sent = log.lock().unwrap()[0].clone();
    // Basic auth with the key id and secret.
    assert_eq!(
        sent.header("authorization"),
        Some("Basic cnpwX3Rlc3Rfa2V5OnJ6cF9zZWNyZXQ=")
    );
    let body: Value = serde_json::from_str(&sent.body).unwrap();
    assert_eq!(
        (body["amount"].as_i64(), body["receipt"].as_str()),
        (Some(1990), Some("order-7"))
    );
    let state = rzp.status("order_Rz1", None).await.unwrap();
    assert_eq!(
        (state.status, state.payment_id.as_deref()),
        (PaymentStatus::Succeeded, Some("pay_Rz1"))
    );
    // A refunded payment (whole, or authorized and given back uncaptured) is not what an order
    // is confirmed on: the money is the buyer's again. One captured beside it is.
    let state = rzp.status("order_Rz4", None).await.unwrap();
    assert_eq!(
        (state.status, state.payment_id.as_deref()),
        (PaymentStatus::Pending, None)
    );
    let state = rzp.status("order_Rz5", None).await.unwrap();
    assert_eq!(
        (state.status, state.payment_id.as_deref()),
        (PaymentStatus::Succeeded, Some("pay_Rz5b"))
    );
    // A renewal charged without an order is named by its invoice: asked as one.
    let state = rzp.status("inv_Rz2", None).await.unwrap();
    assert_eq!(
        (state.status, state.payment_id.as_deref(), state.amount),
        (
            PaymentStatus::Succeeded,
            Some("pay_Rz2"),
            Some(Money::from_minor(1990, "INR").unwrap())
        )
    );
    let state = rzp.status("inv_Rz3", None).await.unwrap();
    assert_eq!(
        state.status,
        PaymentStatus::Pending,
        "issued: Razorpay may still charge it"
    );
    let e = rzp
        .refund(&RefundRequest {
            session_id: "order_Rz1".into(),
            payment_id: "pay_Rz1".into(),
            amount: brl("99.00"),
            seller_account: None,
            idempotency_key: "r-1".into(),
        })
        .await
        .unwrap_err();
    let GatewayError::Api { code, message, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!(code.as_deref(), Some("BAD_REQUEST_ERROR"));
    assert!(message.contains("exceeds the captured amount"));
    // The refund's idempotency key in Razorpay's documented alphabet: ten characters or more,
    // letters, digits, hyphens and underscores only (a second payment's give-back is keyed
    // `<session>:<payment>`; sent as it is, Razorpay refuses it, and the buyer is never paid back).
    let key = log
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.uri.ends_with("/refund"))
        .and_then(|s| s.header("x-refund-idempotency"))
        .map(str::to_owned);
    let key = key.expect("the refund carries its idempotency key");
    assert!(
        key.len() >= 10
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'),
        "{key}"
    );
    rzp.refund(&RefundRequest {
        session_id: "order_Rz1".into(),
        payment_id: "pay_Rz2".into(),
        amount: brl("99.00"),
        seller_account: None,
        idempotency_key: "payfleet-refund-razorpay-order_Rz1:pay_Rz2".into(),
    })
    .await
    .unwrap_err();
    assert_eq!(
        log.lock()
            .unwrap()
            .iter()
            .rfind(|s| s.uri.ends_with("/refund"))
            .and_then(|s| s.header("x-refund-idempotency")),
        Some("payfleet-refund-razorpay-order_Rz1--pay_Rz2")
    );
}

/// A gateway's refund endpoint as it behaves when our client gives up waiting: it processes
/// the first request whatever, answers it only after `delay`, and deduplicates on its documented
/// idempotency header (`header`), so a retry with the same key is the same refund. Returns the
/// stand-in's base URL and the number of refunds it really made.
async fn slow_refunds(
    path: &'static str,
    header: &'static str,
    delay: std::time::Duration,
    answer: fn(u32) -> Value,
) -> (String, Arc<Mutex<u32>>) {
    type Seen = Arc<Mutex<(u32, HashMap<String, u32>, bool)>>;
    let seen: Seen = Arc::default();
    let made = Arc::new(Mutex::new(0u32));
    let (seen2, made2) = (seen.clone(), made.clone());
    let api = Router::new().route(
        path,
        axum::routing::post(move |headers: HeaderMap| {
            let (seen, made) = (seen2.clone(), made2.clone());
            async move {
                let key = headers
                    .get(header)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let (id, first) = {
                    let mut s = seen.lock().unwrap();
                    let known = key.as_ref().and_then(|k| s.1.get(k).copied());
                    let id = match known {
                        Some(id) => id,
                        None => {
                            s.0 += 1;
                            *made.lock().unwrap() += 1;
                            let id = s.0;
                            if let Some(k) = key {
                                s.1.insert(k, id);
                            }
                            id
                        }
                    };
                    let first = !s.2;
                    s.2 = true;
                    (id, first)
                };
                if first {
                    tokio::time::sleep(delay).await;
                }
                axum::Json(answer(id))
            }
        }),
    );
    (stand_in(api, Log::default()).await, made)
}

#[tokio::test]
async fn a_refund_asked_again_after_a_timeout_is_one_refund_on_every_gateway() {
    let patience = std::time::Duration::from_millis(300);
    let slow = std::time::Duration::from_millis(1500);
    let request = |payment: &str| RefundRequest {
        session_id: "s".into(),
        payment_id: payment.into(),
        amount: brl("5.00"),
        seller_account: Some("acct_1".into()),
        idempotency_key: "refund-request-7".into(),
    };
    /// A gateway's name, its client, its stand-in's count of refunds made, a payment id.
    type Case = (
        &'static str,
        Arc<dyn PaymentGateway>,
        Arc<Mutex<u32>>,
        &'static str,
    );
    let cases: Vec<Case> =
        vec![
            {
                let (base, made) = slow_refunds("/v1/refunds", "idempotency-key", slow, |id| {
                json!({"id": format!("re_{id}"), "object": "refund", "status": "succeeded"})
            })
            .await;
                let g = StripeConnect::new(&base, Secret::new("sk_test"), "http://shop.test")
                    .unwrap()
                    .with_timeout(patience)
                    .unwrap();
                ("stripe", Arc::new(g), made, "pi_1")
            },
            {
                let (base, made) = slow_refunds(
                    "/v1/payments/{id}/refunds",
                    "x-idempotency-key",
                    slow,
                    |id| json!({"id": id, "payment_id": 1002, "amount": 5, "status": "approved"}),
                )
                .await;
                let g = MercadoPagoClient::new(&base, Secret::new("APP_USR-token"))
                    .unwrap()
                    .with_timeout(patience)
                    .unwrap();
                ("mercadopago", Arc::new(g), made, "1002")
            },
            {
                let (base, made) = slow_refunds(
                "/v1/payments/{id}/refund",
                "x-refund-idempotency",
                slow,
                |id| json!({"id": format!("rfnd_{id}"), "entity": "refund", "status": "processed"}),
            )
            .await;
                let g = RazorpayGateway::new(
                    &base,
                    "rzp_test_key",
                    Secret::new("rzp_secret"),
                    "http://shop.test",
                )
                .unwrap()
                .with_timeout(patience)
                .unwrap();
                ("razorpay", Arc::new(g), made, "pay_1")
            },
        ];
    for (name, gateway, made, payment) in cases {
        let first = gateway.refund(&request(payment)).await;
        assert!(
            matches!(&first, Err(e) if e.is_transient()),
            "{name}: the first answer comes after the client gave up: {first:?}"
        );
        // The refund job asks again with the same key (a moment later, as its backoff would).
        tokio::time::sleep(slow).await;
        let again = gateway.refund(&request(payment)).await.unwrap();
        assert!(again.succeeded, "{name}");
        assert_eq!(
            *made.lock().unwrap(),
            1,
            "{name}: the buyer is refunded once ({})",
            again.refund_id
        );
    }
}

/// A refund the gateway only accepted, whose outcome event never comes: the gateway is asked,
/// and the outcome recorded (done, or failed and its amount freed).
/// A stand-in of Stripe's refunds: each taken as pending; asked, each says `outcome`.
fn pending_refunds(status: Arc<Mutex<&'static str>>) -> Router<Log> {
    Router::new()
        .route(
            "/v1/refunds",
            axum::routing::post(|headers: HeaderMap| async move {
                // Its id from the idempotency key: a new refund per request, the same one again
                // for a retry.
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                let id = format!("re_{}", &key[key.len() - 8..]);
                axum::Json(json!({"id": id, "object": "refund", "status": "pending"}))
            }),
        )
        .route(
            "/v1/refunds/{id}",
            axum::routing::get(move |Path(id): Path<String>| {
                let status = status.clone();
                async move {
                    let s = *status.lock().unwrap();
                    axum::Json(json!({"id": id, "object": "refund", "status": s}))
                }
            }),
        )
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_whose_outcome_never_arrives_is_asked_of_the_gateway(pool: PgPool) {
    let outcome = Arc::new(Mutex::new("pending"));
    let log = Log::default();
    let base = stand_in(pending_refunds(outcome.clone()), log.clone()).await;
    let config = config_with_stripe(base);
    let app = spawn_app_with(pool.clone(), config.clone()).await;
    orders_for(&pool, "stripe", &["cs_1"], "10.00", "BRL").await;
    let paid = r#"{"id":"evt_paid","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1000,"currency":"brl","payment_status":"paid"}}}"#;
    assert_eq!(app.deliver(&stripe(paid, now())).await.0, 200);
    process_events_with(&pool, &config).await;
    let refund = |key: &'static str, amount: &'static str| {
        app.anon
            .post(format!("http://{}/admin/orders/1/refunds", app.addr))
            .bearer_auth(ADMIN_TOKEN)
            .header("idempotency-key", key)
            .json(&json!({"amount": amount}))
            .send()
    };
    let settle = async || {
        sqlx::query("UPDATE jobs SET run_at = now() WHERE kind = 'settle_refund'")
            .execute(&pool)
            .await
            .unwrap();
        step(&pool, &config, "payments").await
    };
    let state = async |key: &str| -> String {
        sqlx::query_scalar("SELECT state FROM refund_requests WHERE idempotency_key = $1")
            .bind(key)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    // Accepted; no event ever comes. Still under way when first asked: asked again later.
    assert_eq!(refund("rf-a", "4.00").await.unwrap().status(), 202);
    assert_eq!(state("rf-a").await, "accepted");
    settle().await;
    assert_eq!(state("rf-a").await, "accepted");
    assert!(
        log.lock()
            .unwrap()
            .iter()
            .any(|s| s.method == Method::GET && s.uri.starts_with("/v1/refunds/re_"))
    );
    // Then done: recorded as its event would have, the order partly refunded.
    *outcome.lock().unwrap() = "succeeded";
    settle().await;
    assert_eq!(state("rf-a").await, "succeeded");
    let refunded: String =
        sqlx::query_scalar("SELECT amount_refunded::text FROM orders WHERE number = 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(refunded, "4.0000");
    // Another that the gateway fails: the request fails and its amount is free again.
    *outcome.lock().unwrap() = "failed";
    assert_eq!(refund("rf-b", "6.00").await.unwrap().status(), 202);
    settle().await;
    assert_eq!(state("rf-b").await, "failed");
    assert_eq!(
        refund("rf-c", "6.00").await.unwrap().status(),
        202,
        "6.00 is free again"
    );
}

/// A request the gateway answered `pending` while the refund's own event was being recorded:
/// each transaction missed the other's row, so the event recorded the refund and the request
/// stayed `accepted`. Nothing reported it, and an operator who took it for never done would
/// refund again. Asking the gateway about it (its settle job) finds the refund recorded and
/// ends the request.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_request_left_accepted_beside_its_recorded_refund_is_ended_when_asked_again(
    pool: PgPool,
) {
    let outcome = Arc::new(Mutex::new("pending"));
    let base = stand_in(pending_refunds(outcome.clone()), Log::default()).await;
    let config = config_with_stripe(base);
    let app = spawn_app_with(pool.clone(), config.clone()).await;
    orders_for(&pool, "stripe", &["cs_1"], "10.00", "BRL").await;
    let paid = r#"{"id":"evt_paid","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1000,"currency":"brl","payment_status":"paid"}}}"#;
    assert_eq!(app.deliver(&stripe(paid, now())).await.0, 200);
    process_events_with(&pool, &config).await;
    let asked = app
        .anon
        .post(format!("http://{}/admin/orders/1/refunds", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .header("idempotency-key", "rf-race")
        .json(&json!({"amount": "4.00"}))
        .send()
        .await
        .unwrap();
    assert_eq!(asked.status(), 202);
    let refund_id: String = sqlx::query_scalar(
        "SELECT refund_id FROM refund_requests WHERE idempotency_key = 'rf-race'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let refunded = json!({"id": "evt_re", "type": "refund.updated", "data": {"object": {
        "id": refund_id, "payment_intent": "pi_1", "amount": 400, "currency": "brl", "status": "succeeded"}}});
    assert_eq!(
        app.deliver(&stripe(&refunded.to_string(), now())).await.0,
        200
    );
    process_events_with(&pool, &config).await;
    // The race's outcome: the refund recorded, its request still `accepted`.
    sqlx::query("UPDATE refund_requests SET state = 'accepted' WHERE idempotency_key = 'rf-race'")
        .execute(&pool)
        .await
        .unwrap();
    *outcome.lock().unwrap() = "succeeded";
    sqlx::query("UPDATE jobs SET run_at = now() WHERE kind = 'settle_refund'")
        .execute(&pool)
        .await
        .unwrap();
    step(&pool, &config, "payments").await;
    let (state, refunds, refunded): (String, i64, String) = sqlx::query_as(
        "SELECT (SELECT state FROM refund_requests WHERE idempotency_key = 'rf-race'),
                (SELECT count(*) FROM payment_refunds),
                (SELECT amount_refunded::text FROM orders WHERE number = 1)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), refunds, refunded.as_str()),
        ("succeeded", 1, "4.0000")
    );
}

/// A payment given back (here a late one) whose refund the gateway took as pending and then
/// failed: the buyer does not have the money back and no one's request says so. The job that
/// settles it ends dead, listed for an operator with what to do, never completed in silence.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_payment_given_back_whose_refund_fails_is_left_for_an_operator(pool: PgPool) {
    let outcome = Arc::new(Mutex::new("pending"));
    let base = stand_in(pending_refunds(outcome.clone()), Log::default()).await;
    let config = config_with_stripe(base);
    let app = spawn_app_with(pool.clone(), config.clone()).await;
    orders_for(&pool, "stripe", &["cs_1"], "10.00", "BRL").await;
    payfleet::orders::expire_now(&pool, 1).await.unwrap();
    step(&pool, &config, "orders").await;
    let paid = r#"{"id":"evt_late","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1000,"currency":"brl","payment_status":"paid"}}}"#;
    assert_eq!(app.deliver(&stripe(paid, now())).await.0, 200);
    process_events_with(&pool, &config).await;
    // Given back: the gateway takes the refund as pending, to be asked about later.
    step(&pool, &config, "payments").await;
    let settling = async || -> Vec<(String, i32)> {
        sqlx::query_as("SELECT state, attempt FROM jobs WHERE kind = 'settle_refund'")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    assert_eq!(settling().await, [("available".to_owned(), 0)]);
    *outcome.lock().unwrap() = "failed";
    sqlx::query("UPDATE jobs SET run_at = now() WHERE kind = 'settle_refund'")
        .execute(&pool)
        .await
        .unwrap();
    step(&pool, &config, "payments").await;
    let (state, error): (String, String) = sqlx::query_as(
        "SELECT state, errors -> -1 ->> 'error' FROM jobs WHERE kind = 'settle_refund'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(state, "discarded", "{error}");
    assert!(
        error.contains("does not have it back") && error.contains("by hand"),
        "{error}"
    );
}

/// A late payment of order 1 (session `cs_1`, 10.00 BRL, Stripe) to give back, against a
/// stand-in whose `/v1/refunds` answers as `refunds` does: the config and the stand-in's log.
/// Its give-back's job has not run yet.
async fn a_late_payment_to_give_back(
    pool: &PgPool,
    refunds: Router<Log>,
) -> (payfleet::config::Config, Log) {
    let log = Log::default();
    let base = stand_in(refunds, log.clone()).await;
    let config = config_with_stripe(base);
    let app = spawn_app_with(pool.clone(), config.clone()).await;
    orders_for(pool, "stripe", &["cs_1"], "10.00", "BRL").await;
    payfleet::orders::expire_now(pool, 1).await.unwrap();
    step(pool, &config, "orders").await;
    let paid = r#"{"id":"evt_late","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1000,"currency":"brl","payment_status":"paid"}}}"#;
    assert_eq!(app.deliver(&stripe(paid, now())).await.0, 200);
    process_events_with(pool, &config).await;
    (config, log)
}

/// Stripe's answer to a refund that could not be made: the balance too low.
fn balance_insufficient() -> (u16, Value) {
    (
        400,
        json!({"error": {"type": "invalid_request_error", "code": "balance_insufficient",
            "message": "Insufficient funds in the connected account's balance."}}),
    )
}

/// The idempotency keys the give-backs asked for refunds under, in order.
fn refund_keys(log: &Log) -> Vec<String> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|s| s.uri == "/v1/refunds")
        .filter_map(|s| s.header("idempotency-key").map(str::to_owned))
        .collect()
}

/// Its give-back job ended dead; the operator, the cause mended, deletes it and gives the
/// payment back again (`payfleet money give-back`), and the job runs.
async fn give_back_again_by_hand(pool: &PgPool, config: &payfleet::config::Config) {
    let state: String = sqlx::query_scalar("SELECT state FROM jobs WHERE kind = 'refund_payment'")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(state, "discarded");
    sqlx::query("DELETE FROM jobs WHERE kind = 'refund_payment'")
        .execute(pool)
        .await
        .unwrap();
    payfleet::payments::give_back_again(pool, GatewayName::Stripe, "cs_1", None)
        .await
        .unwrap();
    step(pool, config, "payments").await;
}

async fn refunded(pool: &PgPool) -> (i64, String) {
    sqlx::query_as("SELECT count(*), COALESCE(sum(amount), 0)::text FROM payment_refunds")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A give-back the gateway refused outright (here: the seller's balance too low to refund),
/// its job ended dead. Stripe keeps its answer under the request's idempotency key, so the
/// operator's re-drive once the cause is mended (`payfleet money give-back`) under the same key
/// would get the same refusal back for a day or more: it goes under a key of its own, and the
/// buyer gets the money back once.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_give_back_refused_outright_is_asked_again_under_a_new_key(pool: PgPool) {
    // Stripe's refunds, each key's first answer kept and given again for that key.
    let mended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answers: Arc<Mutex<HashMap<String, (u16, Value)>>> = Arc::default();
    let (m, kept) = (mended.clone(), answers.clone());
    let api = Router::new().route(
        "/v1/refunds",
        axum::routing::post(move |headers: HeaderMap| {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            let mut kept = kept.lock().unwrap();
            let n = kept.len();
            let (status, body) = kept
                .entry(key)
                .or_insert_with(|| {
                    if m.load(std::sync::atomic::Ordering::SeqCst) {
                        (200, json!({"id": format!("re_{n}"), "object": "refund", "status": "succeeded"}))
                    } else {
                        balance_insufficient()
                    }
                })
                .clone();
            async move { (StatusCode::from_u16(status).unwrap(), axum::Json(body)) }
        }),
    );
    let (config, log) = a_late_payment_to_give_back(&pool, api).await;
    // Refused: dead, for an operator.
    step(&pool, &config, "payments").await;
    mended.store(true, std::sync::atomic::Ordering::SeqCst);
    give_back_again_by_hand(&pool, &config).await;
    assert_eq!(
        refunded(&pool).await,
        (1, "10.0000".to_owned()),
        "given back once mended"
    );
    let keys = refund_keys(&log);
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_ne!(keys[0], keys[1], "a key of its own after the refusal");
}

/// A give-back whose ask timed out (here a 5xx) may have been made at the gateway under its
/// key: a refusal under that key afterwards (Razorpay's "different request with the same
/// idempotency key", say) does not move the key on, so no ask can make the refund a second
/// time. Every ask of it goes under the one key.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_give_back_asked_without_a_clear_answer_keeps_its_key(pool: PgPool) {
    // The gateway's answers, in turn: its trouble, a refusal, then the refund.
    let answers = Arc::new(Mutex::new(vec![
        (
            500,
            json!({"error": {"type": "api_error", "message": "try again"}}),
        ),
        balance_insufficient(),
        (
            200,
            json!({"id": "re_1", "object": "refund", "status": "succeeded"}),
        ),
    ]));
    let api = Router::new().route(
        "/v1/refunds",
        axum::routing::post(move || {
            let (status, body) = answers.lock().unwrap().remove(0);
            async move { (StatusCode::from_u16(status).unwrap(), axum::Json(body)) }
        }),
    );
    let (config, log) = a_late_payment_to_give_back(&pool, api).await;
    step(&pool, &config, "payments").await;
    let state: String = sqlx::query_scalar("SELECT state FROM jobs WHERE kind = 'refund_payment'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "retryable", "the gateway's trouble is asked again");
    sqlx::query("UPDATE jobs SET run_at = now() WHERE kind = 'refund_payment'")
        .execute(&pool)
        .await
        .unwrap();
    step(&pool, &config, "payments").await;
    // Refused under the kept key: dead, saying what to look at.
    let error: String = sqlx::query_scalar(
        "SELECT errors -> -1 ->> 'error' FROM jobs WHERE kind = 'refund_payment'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        error.contains("is kept since an earlier ask got no clear answer")
            && error.contains("by hand"),
        "{error}"
    );
    give_back_again_by_hand(&pool, &config).await;
    assert_eq!(refunded(&pool).await, (1, "10.0000".to_owned()));
    let keys = refund_keys(&log);
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
}

/// Where a dispute stands, asked of each gateway as its API documents it: Stripe's and
/// Razorpay's dispute objects, Mercado Pago's payment in mediation; a status we do not know
/// is no decision.
#[tokio::test]
async fn every_gateway_says_where_a_dispute_stands() {
    use payfleet::gateways::DisputeStatus;
    use payfleet::gateways::api::DisputeQuery;
    let status = Arc::new(Mutex::new("under_review"));
    let (s1, s2, s3) = (status.clone(), status.clone(), status.clone());
    // What Razorpay's payment says it refunded: a closed dispute is won unless it was refunded.
    let refunded = Arc::new(Mutex::new(0i64));
    let r1 = refunded.clone();
    let api = Router::new()
        .route(
            "/rzp/v1/payments/{id}",
            axum::routing::get(move |Path(id): Path<String>| {
                let r = *r1.lock().unwrap();
                async move {
                    axum::Json(json!({"id": id, "entity": "payment", "status": "captured", "amount": 1990, "currency": "INR", "amount_refunded": r}))
                }
            }),
        )
        .route(
            "/v1/disputes/{id}",
            axum::routing::get(move |Path(id): Path<String>| {
                let s = *s1.lock().unwrap();
                async move { axum::Json(json!({"id": id, "object": "dispute", "status": s})) }
            }),
        )
        .route(
            "/rzp/v1/disputes/{id}",
            axum::routing::get(move |Path(id): Path<String>| {
                let s = *s2.lock().unwrap();
                async move {
                    axum::Json(json!({"id": id, "entity": "dispute", "payment_id": "pay_Rz1", "amount": 1990, "currency": "INR", "status": s}))
                }
            }),
        )
        .route(
            "/mp/v1/payments/{id}",
            axum::routing::get(move |Path(id): Path<String>| {
                let s = *s3.lock().unwrap();
                async move { axum::Json(json!({"id": id.parse::<i64>().unwrap(), "status": s})) }
            }),
        );
    let log = Log::default();
    let base = stand_in(api, log.clone()).await;
    let stripe = StripeConnect::new(&base, Secret::new("sk_test_123"), "http://shop.test").unwrap();
    let rzp = RazorpayGateway::new(
        &format!("{base}/rzp"),
        "rzp_test_key",
        Secret::new("rzp_secret"),
        "http://shop.test",
    )
    .unwrap();
    let mp = MercadoPagoClient::new(&format!("{base}/mp"), Secret::new("APP_USR-token")).unwrap();
    let query = |dispute: &str, account: Option<&str>| DisputeQuery {
        session_id: "s_1".into(),
        payment_id: "1234".into(),
        dispute_id: dispute.into(),
        seller_account: account.map(str::to_owned),
    };
    let ask = async |raw: &'static str, gateway: &dyn PaymentGateway, q: DisputeQuery| {
        *status.lock().unwrap() = raw;
        gateway.dispute_status(&q).await.unwrap()
    };
    let cases: [(&str, &dyn PaymentGateway, &str, Option<DisputeStatus>); 11] = [
        ("needs_response", &stripe, "dp_1", Some(DisputeStatus::Open)),
        ("won", &stripe, "dp_1", Some(DisputeStatus::Won)),
        ("lost", &stripe, "dp_1", Some(DisputeStatus::Lost)),
        ("a_status_from_2030", &stripe, "dp_1", None),
        ("under_review", &rzp, "disp_1", Some(DisputeStatus::Open)),
        ("closed", &rzp, "disp_1", Some(DisputeStatus::Won)),
        ("lost", &rzp, "disp_1", Some(DisputeStatus::Lost)),
        ("in_mediation", &mp, "mp-1234", Some(DisputeStatus::Open)),
        ("approved", &mp, "mp-1234", Some(DisputeStatus::Won)),
        ("charged_back", &mp, "mp-1234", Some(DisputeStatus::Lost)),
        ("refunded", &mp, "mp-1234", Some(DisputeStatus::Refunded)),
    ];
    for (raw, gateway, dispute, want) in cases {
        assert_eq!(
            ask(raw, gateway, query(dispute, Some("acct_1"))).await,
            want,
            "{} {raw}",
            gateway.name()
        );
    }
    // Closed by a refund to the buyer: the refund's own event debits the seller, so the
    // dispute's take-back stays until it is recorded.
    *refunded.lock().unwrap() = 1990;
    assert_eq!(
        ask("closed", &rzp, query("disp_1", None)).await,
        Some(DisputeStatus::Refunded)
    );
    let seen = log.lock().unwrap().clone();
    let stripe_asked = seen.iter().find(|s| s.uri == "/v1/disputes/dp_1").unwrap();
    assert_eq!(stripe_asked.method, Method::GET);
    assert_eq!(stripe_asked.header("stripe-account"), Some("acct_1"));
    assert_eq!(
        stripe_asked.header("authorization"),
        Some("Bearer sk_test_123")
    );
    let rzp_asked = seen
        .iter()
        .find(|s| s.uri == "/rzp/v1/disputes/disp_1")
        .unwrap();
    assert!(
        rzp_asked
            .header("authorization")
            .is_some_and(|a| a.starts_with("Basic "))
    );
    assert!(seen.iter().any(|s| s.uri == "/mp/v1/payments/1234"
        && s.header("authorization") == Some("Bearer APP_USR-token")));
}

/// A dispute whose decision's event never came: once open a week, reconciliation asks the
/// gateway and records the decision as the lost event would have (won: the seller's money
/// comes back, once), and asks nothing more of a decided dispute.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dispute_whose_decision_never_arrives_is_asked_of_the_gateway(pool: PgPool) {
    let api = Router::new().route(
        "/v1/disputes/{id}",
        axum::routing::get(|Path(id): Path<String>| async move {
            if id == "dp_gone" {
                return (
                    StatusCode::NOT_FOUND,
                    axum::Json(json!({"error": {"type": "invalid_request_error", "code": "resource_missing", "message": "No such dispute: 'dp_gone'"}})),
                );
            }
            (
                StatusCode::OK,
                axum::Json(json!({"id": id, "object": "dispute", "status": "won"})),
            )
        }),
    );
    let log = Log::default();
    let base = stand_in(api, log.clone()).await;
    let config = config_with_stripe(base);
    let app = spawn_app_with(pool.clone(), config.clone()).await;
    orders_for(&pool, "stripe", &["cs_1", "cs_2"], "19.90", "BRL").await;
    let paid = r#"{"id":"evt_paid","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    let disputed = r#"{"id":"evt_dp","type":"charge.dispute.created","data":{"object":{"id":"dp_1","payment_intent":"pi_1","amount":1990,"currency":"brl","status":"needs_response"}}}"#;
    // Another, which the gateway will not find when asked.
    let paid_2 = r#"{"id":"evt_paid_2","type":"checkout.session.completed","data":{"object":{"id":"cs_2","payment_intent":"pi_2","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    let disputed_2 = r#"{"id":"evt_dp_2","type":"charge.dispute.created","data":{"object":{"id":"dp_gone","payment_intent":"pi_2","amount":1990,"currency":"brl","status":"needs_response"}}}"#;
    for body in [paid, disputed, paid_2, disputed_2] {
        assert_eq!(app.deliver(&stripe(body, now())).await.0, 200);
        process_events_with(&pool, &config).await;
    }
    let dispute = async || -> String {
        sqlx::query_scalar("SELECT status FROM payment_disputes WHERE dispute_id = 'dp_1'")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let order_status = async || -> String {
        sqlx::query_scalar("SELECT status FROM orders WHERE number = 1")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(
        (dispute().await, order_status().await),
        ("open".into(), "disputed".into())
    );
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let settings = crate::reconcile::settings(10, 0);
    // Open for a day only: its event may still come, nothing is asked.
    let r = payfleet::payments::reconcile::run(&pool, &gateways, &settings)
        .await
        .unwrap();
    assert_eq!(r.asked, 0);
    sqlx::query("UPDATE payment_disputes SET updated_at = now() - interval '8 days'")
        .execute(&pool)
        .await
        .unwrap();
    let r = payfleet::payments::reconcile::run(&pool, &gateways, &settings)
        .await
        .unwrap();
    assert_eq!((r.asked, r.found), (2, 1));
    process_events_with(&pool, &config).await;
    assert_eq!(
        (dispute().await, order_status().await),
        ("won".into(), "paid".into())
    );
    let findings: Vec<(String, String)> =
        sqlx::query_as("SELECT outcome, detail FROM reconciliation_findings ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(findings.len(), 2, "{findings:?}");
    assert!(
        findings
            .iter()
            .any(|(o, d)| o == "dispute_decided" && d.contains("dp_1")),
        "{findings:?}"
    );
    // The refused question is reported, and asked again tomorrow, not at every run.
    assert!(
        findings
            .iter()
            .any(|(o, d)| o == "refused" && d.contains("dp_gone")),
        "{findings:?}"
    );
    // The reversal is posted once, however often the decision is seen again.
    let again = payfleet::payments::reconcile::run(&pool, &gateways, &settings)
        .await
        .unwrap();
    assert_eq!(again.asked, 0, "a decided dispute is not asked about");
    let late = r#"{"id":"evt_won","type":"charge.dispute.closed","data":{"object":{"id":"dp_1","payment_intent":"pi_1","amount":1990,"currency":"brl","status":"won"}}}"#;
    assert_eq!(app.deliver(&stripe(late, now())).await.0, 200);
    process_events_with(&pool, &config).await;
    let reversals: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger_transfers WHERE kind = 'dispute_reversal'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(reversals, 1);
    assert_eq!(
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.uri == "/v1/disputes/dp_1")
            .count(),
        1
    );
}

/// A refund the gateway reported failed before its answer reached us (the answer replayed
/// under the same key after a timeout says it succeeded): the operator's request ends failed,
/// nothing is recorded refunded, and the whole amount may be refunded again.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_refund_answered_done_after_it_was_reported_failed_ends_failed(pool: PgPool) {
    let (shop, p) = stripe_connect_shop(&pool, Log::default()).await;
    stripe_checkout(&shop, &p).await;
    let completed = r#"{"id":"evt_1","type":"checkout.session.completed","data":{"object":{"id":"cs_test_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
    let (status, _) = shop.app.deliver(&stripe(completed, now())).await;
    assert_eq!(status, 200);
    wait_until_paid(&shop, 1).await;
    // Stripe's refund of pi_1 is re_1; its failure was reported first.
    let failed = r#"{"id":"evt_f","type":"refund.failed","account":"acct_seller1","data":{"object":{"id":"re_1","object":"refund","payment_intent":"pi_1","status":"failed","amount":1990,"currency":"brl"}}}"#;
    let (status, _) = shop.app.deliver(&stripe(failed, now())).await;
    assert_eq!(status, 200);
    let ended = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM refunds_ended WHERE refund_id = 're_1'")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let started = std::time::Instant::now();
    while ended().await == 0 {
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let new = payfleet::payments::order_refunds::NewRefund {
        amount: None,
        reason: String::new(),
    };
    let (request, _) = payfleet::payments::order_refunds::request(&pool, 1, "rf-late", &new)
        .await
        .unwrap();
    let (gateways, _) = payfleet::startup::gateways(&shop.app.config, &pool).unwrap();
    let view = match payfleet::payments::order_refunds::carry_out(&pool, &gateways, request.id)
        .await
        .unwrap()
    {
        payfleet::payments::order_refunds::CarriedOut::Answered(v) => v,
        other => panic!("{other:?}"),
    };
    assert_eq!(view.state.as_str(), "failed", "{view:?}");
    let refunded: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_refunds")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refunded, 0);
    assert_eq!(shop.order(1).await["status"], "paid");
    // Its amount is free again.
    let (again, written) = payfleet::payments::order_refunds::request(&pool, 1, "rf-again", &new)
        .await
        .unwrap();
    assert!(written);
    assert_eq!(again.amount.to_string(), "19.90");
}
