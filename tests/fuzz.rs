//! Fuzzing of every parser that reads what a sender chooses, on stable Rust (proptest's
//! generators driven for a time budget): the receiver's verification of each gateway's
//! deliveries (signature headers, query and body), each gateway's event interpreter and the
//! fields the receiver reads from a body, money amounts, the checkout body, and the
//! configuration files. Each target must only ever answer with a clean error (a panic fails
//! it, printing the input), and its refusals must stay cheap: each target prints the worst time
//! one input took and that input's start.
//!
//! `cargo test --test fuzz` runs each target for `PAYFLEET_FUZZ_SECS` (2 s by default, CI's
//! short run); `PAYFLEET_FUZZ_SECS=600 cargo test --release --test fuzz -- --nocapture
//! --test-threads 1` is the long run (10 minutes a target). `PAYFLEET_FUZZ_SEED` replays a run.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use payfleet::gateways::signature::hex_hmac;
use payfleet::gateways::{self, Delivery, GatewayName, SignatureChecks};
use payfleet::money::Money;
use payfleet::secret::{Secret, StandardSecret};
use payfleet::webhooks::Webhook;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rust_decimal::Decimal;

/// How long each target runs.
fn budget() -> Duration {
    let secs = std::env::var("PAYFLEET_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

/// A runner seeded by `PAYFLEET_FUZZ_SEED` (printed, so a failure can be replayed), else at
/// random.
fn runner(target: &str) -> TestRunner {
    let seed: u64 = std::env::var("PAYFLEET_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{target}: PAYFLEET_FUZZ_SEED={seed}");
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    )
}

/// Feeds `target` inputs from `strategy` until the budget is spent. A panic fails the test with
/// the input; the slowest input is reported (and must stay under `limit`).
fn fuzz<S: Strategy>(name: &str, strategy: S, limit: Duration, target: impl Fn(&S::Value))
where
    S::Value: std::fmt::Debug,
{
    let mut runner = runner(name);
    let (start, budget) = (Instant::now(), budget());
    let (mut tried, mut worst, mut worst_input) = (0u64, Duration::ZERO, String::new());
    // At least one input, whatever the budget.
    while tried == 0 || start.elapsed() < budget {
        let input = strategy
            .new_tree(&mut runner)
            .expect("the strategy generates")
            .current();
        let began = Instant::now();
        if catch_unwind(AssertUnwindSafe(|| target(&input))).is_err() {
            panic!("{name} panicked on {input:?}");
        }
        let mut took = began.elapsed();
        // A slow input is timed again: the least of three is its cost (on a shared machine one
        // run can be preempted).
        if took > worst && took > limit / 4 {
            for _ in 0..2 {
                let again = Instant::now();
                target(&input);
                took = took.min(again.elapsed());
            }
        }
        if took > worst {
            worst = took;
            worst_input = format!("{input:?}").chars().take(160).collect();
        }
        tried += 1;
    }
    eprintln!(
        "{name}: {tried} inputs in {:.1} s; the slowest took {:.3} ms: {worst_input}",
        start.elapsed().as_secs_f64(),
        worst.as_secs_f64() * 1e3
    );
    assert!(
        worst < limit,
        "{name}: an input took {worst:?} (limit {limit:?}): {worst_input}"
    );
}

/// A refusal must cost no more than this (debug builds are ten times slower than release).
fn cheap() -> Duration {
    if cfg!(debug_assertions) {
        Duration::from_millis(50)
    } else {
        Duration::from_millis(5)
    }
}

const STRIPE: &str = "whsec_fuzz_stripe";
const MP: &str = "fuzz_mercadopago";
const RAZORPAY: &str = "fuzz_razorpay";
const INTERNAL: &str = "whsec_ZnV6ei1pbnRlcm5hbC1zZWNyZXQtMzJieXRlcyE=";

fn checks() -> SignatureChecks {
    let mut g = payfleet::config::Config::from(&[("PAYFLEET_RECURRING", "off")])
        .expect("the defaults")
        .gateways;
    g.stripe.webhook_secret = Some(Secret::new(STRIPE));
    g.mercadopago.webhook_secret = Some(Secret::new(MP));
    g.razorpay.webhook_secret = Some(Secret::new(RAZORPAY));
    g.hosted.internal = Some(StandardSecret::parse(INTERNAL).expect("a Standard Webhooks secret"));
    g.hosted.mock = Some(StandardSecret::parse(INTERNAL).expect("a Standard Webhooks secret"));
    g.signature_checks()
}

/// Text a sender might put in a header: short or long, printable or not, and near-valid
/// shapes of each scheme (many entries, huge numbers, odd separators).
fn header_text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,64}",
        "[ -~]{0,4096}",
        "(t=[0-9]{1,20},v1=[0-9a-f]{0,64},?){1,200}",
        "(ts=[0-9]{1,20},v1=[0-9a-f]{0,64};?){1,100}",
        "(v1,[A-Za-z0-9+/=]{0,64} ?){1,200}",
        "[0-9a-f]{0,128}",
        "[0-9]{0,30}",
    ]
}

/// JSON built from the words the gateways' events use, nested, so interpreters meet their own
/// field names with every type and shape.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let words = vec![
        "id",
        "type",
        "event",
        "data",
        "object",
        "payload",
        "entity",
        "payment",
        "refund",
        "dispute",
        "subscription",
        "amount",
        "amount_total",
        "amount_paid",
        "amount_received",
        "currency",
        "status",
        "session_id",
        "payment_id",
        "payment_intent",
        "metadata",
        "account",
        "lines",
        "period",
        "start",
        "end",
        "billing_reason",
        "mode",
        "refunds",
        "order_id",
        "invoice_id",
        "notes",
        "current_start",
        "current_end",
        "contains",
        "created_at",
        "parent",
        "subscription_details",
        "application_fee_amount",
    ];
    let key = prop_oneof![
        prop::sample::select(words).prop_map(str::to_owned),
        ".{0,8}",
    ];
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        prop_oneof![
            Just("payment.succeeded".to_string()),
            Just("checkout.session.completed".to_string()),
            Just("invoice.paid".to_string()),
            Just("invoice.payment_failed".to_string()),
            Just("subscription.charged".to_string()),
            Just("subscription.renewed".to_string()),
            Just("charge.refunded".to_string()),
            Just("charge.dispute.created".to_string()),
            Just("refund.processed".to_string()),
            Just("payment.captured".to_string()),
            Just("succeeded".to_string()),
            Just("paid".to_string()),
            Just("subscription".to_string()),
            Just("BRL".to_string()),
            Just("brl".to_string()),
            "[0-9]{1,30}(\\.[0-9]{0,10})?",
            ".{0,32}",
        ]
        .prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(6, 96, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::vec((key.clone(), inner), 0..8)
                .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A body: arbitrary bytes, or JSON of the events' words, or very deep JSON.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..2048),
        json_value().prop_map(|v| v.to_string().into_bytes()),
        (1usize..20_000).prop_map(|depth| {
            let mut s = "[".repeat(depth);
            s.push_str(&"]".repeat(depth));
            s.into_bytes()
        }),
        (1usize..10_000)
            .prop_map(|n| format!("{{\"data\":{{\"id\":\"{}\"}}}}", "9".repeat(n)).into_bytes()),
    ]
}

fn gateway() -> impl Strategy<Value = GatewayName> {
    prop::sample::select(GatewayName::ALL.to_vec())
}

fn delivery(
    gateway: GatewayName,
    headers: &[(String, String)],
    query: &[(String, String)],
    body: &[u8],
) -> Delivery {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::from_str(value),
        ) {
            map.append(n, v);
        }
    }
    Delivery {
        gateway,
        headers: map,
        query: query.iter().cloned().collect::<HashMap<_, _>>(),
        body: Bytes::copy_from_slice(body),
    }
}

/// The headers each scheme reads, and some it does not.
fn header_names() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("stripe-signature"),
        Just("x-signature"),
        Just("x-request-id"),
        Just("x-razorpay-signature"),
        Just("x-razorpay-event-id"),
        Just("webhook-id"),
        Just("webhook-timestamp"),
        Just("webhook-signature"),
        Just("content-type"),
    ]
    .prop_map(str::to_owned)
}

#[test]
fn every_delivery_is_verified_or_refused_cleanly_and_cheaply() {
    let checks = checks();
    let now = chrono::Utc::now().timestamp();
    let strategy = (
        gateway(),
        prop::collection::vec((header_names(), header_text()), 0..8),
        prop::collection::vec(
            (
                prop_oneof![
                    Just("data.id".to_owned()),
                    Just("type".to_owned()),
                    ".{0,8}"
                ],
                ".{0,64}",
            ),
            0..4,
        ),
        body(),
    );
    fuzz(
        "deliveries",
        strategy,
        cheap(),
        |(g, headers, query, body)| {
            let d = delivery(*g, headers, query, body);
            // Random input is refused (nothing here knows a secret).
            assert!(Webhook::verify(&d, &checks, now, 300).is_err());
        },
    );
}

/// Header or query names and values.
type Pairs = Vec<(String, String)>;

/// A signed delivery of each scheme, as its gateway would send it.
fn signed(gateway: GatewayName, body: &[u8], now: i64) -> Delivery {
    let text = std::str::from_utf8(body).unwrap_or("");
    let (headers, query): (Pairs, Pairs) = match gateway {
        GatewayName::Stripe => {
            let sig = hex_hmac(STRIPE.as_bytes(), &[now.to_string().as_bytes(), b".", body]);
            (
                vec![("stripe-signature".into(), format!("t={now},v1={sig}"))],
                vec![],
            )
        }
        GatewayName::Razorpay => (
            vec![
                (
                    "x-razorpay-signature".into(),
                    hex_hmac(RAZORPAY.as_bytes(), &[body]),
                ),
                ("x-razorpay-event-id".into(), "evt".into()),
            ],
            vec![],
        ),
        GatewayName::MercadoPago => {
            let manifest = format!("id:42;request-id:r-1;ts:{};", now * 1000);
            let sig = hex_hmac(MP.as_bytes(), &[manifest.as_bytes()]);
            (
                vec![
                    ("x-signature".into(), format!("ts={},v1={sig}", now * 1000)),
                    ("x-request-id".into(), "r-1".into()),
                ],
                vec![("data.id".into(), "42".into())],
            )
        }
        GatewayName::Internal | GatewayName::Mock => {
            let secret = StandardSecret::parse(INTERNAL).expect("a Standard Webhooks secret");
            let signature = secret.sign("msg_1", now, text.as_bytes());
            (
                vec![
                    ("webhook-id".into(), "msg_1".into()),
                    ("webhook-timestamp".into(), now.to_string()),
                    ("webhook-signature".into(), signature),
                ],
                vec![],
            )
        }
    };
    delivery(gateway, &headers, &query, body)
}

/// A correctly signed body of any content (what a gateway, or one who holds its secret, may
/// send) is read by the receiver and by the event interpreter without a panic, cheaply; one
/// byte changed in it and its signature no longer holds.
#[test]
fn signed_bodies_of_any_shape_are_read_or_refused_cleanly() {
    let checks = checks();
    let strategy = (
        gateway(),
        json_value().prop_map(|v| v.to_string().into_bytes()),
        any::<prop::sample::Index>(),
    );
    fuzz("signed bodies", strategy, cheap(), |(g, body, at)| {
        let now = chrono::Utc::now().timestamp();
        let d = signed(*g, body, now);
        if let Ok(webhook) = Webhook::verify(&d, &checks, now, 300) {
            let _ = webhook;
            let _ = gateways::interpret(*g, body);
        }
        // Mercado Pago signs the id, not the body: a changed body is its lookup's business.
        if *g != GatewayName::MercadoPago && !body.is_empty() {
            let mut changed = body.clone();
            let i = at.index(changed.len());
            changed[i] ^= 0x01;
            let mut tampered = d;
            tampered.body = Bytes::from(changed);
            assert!(Webhook::verify(&tampered, &checks, now, 300).is_err());
        }
    });
}

#[test]
fn every_event_interpreter_reads_any_body_cleanly() {
    let strategy = (gateway(), body());
    fuzz("event interpreters", strategy, cheap(), |(g, body)| {
        let _ = gateways::interpret(*g, body);
        if let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) {
            let format = gateways::format(*g);
            let _ = format.event_type(&json);
            let _ = format.seller_hint(&json);
            let _ = format.account(&json);
        }
        let _ = payfleet::payments::reconcile::interpret(*g, body);
    });
}

#[test]
fn money_text_is_read_or_refused_cleanly() {
    let strategy = (
        prop_oneof![
            ".{0,40}",
            "-?[0-9]{0,40}(\\.[0-9]{0,40})?",
            "[0-9]{1,3}(e[0-9]{1,5})?"
        ],
        prop_oneof!["[A-Za-z]{0,5}", ".{0,5}"],
        any::<i64>(),
    );
    fuzz("money", strategy, cheap(), |(amount, currency, minor)| {
        if let Ok(m) = Money::parse(amount, currency) {
            // What is read is written back the same.
            assert_eq!(
                Money::parse(&m.amount().to_string(), currency).ok(),
                Some(m)
            );
            assert!(!m.amount().is_sign_negative() || m.amount().is_zero());
        }
        let _ = Money::from_minor(*minor, currency);
    });
}

#[test]
fn checkout_bodies_are_read_or_refused_cleanly() {
    let strategy = prop_oneof![
        body(),
        json_value().prop_map(|v| {
            serde_json::json!({"buyer_id": v, "gateway": "internal", "items": [{"product_id": "x", "quantity": 1}]})
                .to_string()
                .into_bytes()
        }),
    ];
    fuzz("checkout bodies", strategy, cheap(), |body| {
        let _ = serde_json::from_slice::<payfleet::orders::checkout::CheckoutRequest>(body);
    });
}

#[test]
fn configuration_files_are_read_or_refused_with_their_line() {
    let queues = std::fs::read_to_string("jobs/queues.toml").expect("jobs/queues.toml");
    let recurring = std::fs::read_to_string("jobs/recurring.toml").expect("jobs/recurring.toml");
    let strategy = (
        prop_oneof![
            Just(queues),
            Just(recurring),
            "[ -~\n]{0,512}",
            "(\\[[a-z_]{0,12}\\]\n([a-z_]{1,12} = (\"[ -~]{0,20}\"|[0-9]{1,12}|true)\n){0,4}){0,6}",
        ],
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    );
    fuzz("configuration files", strategy, cheap(), |(text, edits)| {
        let mut bytes = text.clone().into_bytes();
        for (at, byte) in edits {
            if !bytes.is_empty() {
                let i = at.index(bytes.len());
                bytes[i] = *byte;
            }
        }
        let text = String::from_utf8_lossy(&bytes);
        if let Err(e) = payfleet_queue::QueuesConfig::parse(&text, "fuzz.toml") {
            refused_with_its_place(&e);
        }
        if let Err(e) = payfleet::recurring::Schedules::parse(&text, "fuzz.toml") {
            refused_with_its_place(&e);
        }
    });
}

/// A refused file is named, and a syntax error (the TOML reader's, its source) says its line.
fn refused_with_its_place(e: &dyn std::error::Error) {
    let said = e.to_string();
    assert!(said.contains("fuzz.toml"), "{said}");
    if let Some(source) = e.source() {
        let detail = source.to_string();
        assert!(detail.contains("line"), "{said}: {detail}");
    }
}

/// Money arithmetic: whatever a sale's total and fee, and however what is taken back from it
/// grows (partial refunds and disputes in any amounts), the seller's share of the running total
/// never goes back, never exceeds it, and taking back the whole payment returns exactly the
/// net: no step creates or loses a cent.
#[test]
fn take_backs_are_split_without_creating_or_losing_a_cent() {
    let strategy = (
        1i64..=1_000_000_000,
        0u32..=100,
        prop::collection::vec(1i64..=1_000_000_000, 0..8),
    )
        .prop_map(|(total, fee_percent, steps)| (total, fee_percent, steps));
    fuzz(
        "take-back splits",
        strategy,
        cheap(),
        |(total, fee_percent, steps)| {
            let money = |minor: i64| Money::from_minor(minor, "BRL").expect("an amount");
            let total_m = money(*total);
            let fee = total_m
                .percent(Decimal::from(*fee_percent))
                .expect("a fee that fits");
            let net = total_m.checked_sub(&fee).expect("the net");
            let (mut taken, mut seller_so_far) = (0i64, money(0));
            for step in steps {
                taken = (taken + step).min(*total);
                let share = money(taken).share(&net, &total_m).expect("a share");
                assert!(
                    share.amount() >= seller_so_far.amount(),
                    "the seller's share went back"
                );
                assert!(share.amount() <= money(taken).amount() && share.amount() <= net.amount());
                let platform = money(taken).checked_sub(&share).expect("the fee's part");
                assert!(
                    platform.amount() <= fee.amount(),
                    "the platform gave back more than its fee"
                );
                seller_so_far = share;
            }
            let all = total_m.share(&net, &total_m).expect("a share");
            assert_eq!(all, net, "a full refund returns exactly the net");
        },
    );
}
