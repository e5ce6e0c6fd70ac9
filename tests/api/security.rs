//! The trust boundary, tried from outside as an attacker would: every route without a
//! credential, with a revoked key, with another seller's key; the payment page without its
//! token and from another origin; a fleet with the simulator off; slow connections; oversized
//! carts; guessed tokens; metrics without a token; the text of a 5xx. Each test fails if its
//! protection is taken away.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::checkout::Shop;
use crate::health::metric;
use crate::helpers::*;

/// What anyone may call without a credential, and why (docs/security.md): gateways prove
/// themselves by their signature, probes carry nothing, buyers hold the payment URL, and the
/// dashboard's sign-in is where the admin token is given.
const PUBLIC: &[&str] = &[
    "/webhooks/{gateway}",
    "/healthz",
    "/readyz",
    "/openapi.json",
    "/pay/{session}",
    "/pay/razorpay/{order_id}",
    "/orders/paid",
    "/orders/cancelled",
    "/admin/ui",
    "/admin/ui/session",
];

/// A route's path with each parameter filled in.
fn concrete(path: &str) -> String {
    path.split('/')
        .map(|seg| if seg.starts_with('{') { "1" } else { seg })
        .collect::<Vec<_>>()
        .join("/")
}

/// A request from an address of its own (through the trusted proxy header), so that the walk's
/// many refusals never lock one address out.
async fn status_of(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    bearer: Option<&str>,
) -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut req = client
        .request(method, url)
        .header(
            "x-forwarded-for",
            format!("10.{}.{}.{}", n >> 16 & 255, n >> 8 & 255, n & 255),
        )
        .header("content-type", "application/json")
        .body("{}");
    if let Some(b) = bearer {
        req = req.bearer_auth(b);
    }
    req.send().await.unwrap().status().as_u16()
}

async fn shop(pool: &PgPool) -> Shop {
    Shop {
        app: Arc::new(spawn_fleet(pool.clone(), test_config()).await),
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn every_route_but_the_public_few_needs_a_credential(pool: PgPool) {
    let mut config = test_config();
    config.http.client_address_header = Some("x-forwarded-for".parse().unwrap());
    let app = spawn_app_with(pool.clone(), config).await;
    let paths = app.paths().to_vec();
    assert!(
        paths.len() > 30,
        "the walk sees the whole surface: {paths:?}"
    );
    for public in PUBLIC {
        assert!(paths.contains(public), "{public} is not a route any more");
    }
    let methods = [
        reqwest::Method::GET,
        reqwest::Method::POST,
        reqwest::Method::DELETE,
    ];
    let seller_key = {
        let s = crate::checkout::Shop {
            app: Arc::new(spawn_app(pool.clone()).await),
        };
        let seller = s.seller("Any").await;
        api_key(&pool, Some(&seller)).await
    };
    for path in paths.iter().filter(|p| !PUBLIC.contains(p)) {
        let url = format!("http://{}{}", app.addr, concrete(path));
        let mut guarded = false;
        for m in &methods {
            let anonymous = status_of(&app.anon, m.clone(), &url, None).await;
            // 405: no handler for this method at all.
            assert!(
                anonymous == 401 || anonymous == 405,
                "{m} {path} answered {anonymous} to a caller without a credential"
            );
            guarded |= anonymous == 401;
            if anonymous == 405 {
                continue;
            }
            let revoked = status_of(
                &app.anon,
                m.clone(),
                &url,
                Some(&format!("pfk_{}", "x".repeat(43))),
            )
            .await;
            assert!(
                revoked == 401 || revoked == 403,
                "{m} {path} answered {revoked} to a key that is not ours"
            );
            if path.starts_with("/admin/") && !path.starts_with("/admin/ui") {
                for key in [app.api_key.as_str(), seller_key.as_str()] {
                    let with_key = status_of(&app.anon, m.clone(), &url, Some(key)).await;
                    assert_eq!(with_key, 403, "{m} {path} with an API key");
                }
            }
        }
        assert!(guarded, "{path} has no method that asks for a credential");
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_sellers_key_reads_only_its_sellers_data_and_cannot_check_out(pool: PgPool) {
    let shop = shop(&pool).await;
    let mine = shop.seller("Mine").await;
    let theirs = shop.seller("Theirs").await;
    let product = shop.product(&theirs, "10.00", "BRL").await;
    let (status, answer) = shop
        .checkout(
            Some("k"),
            json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    let n = answer["orders"][0]["number"].as_i64().unwrap();
    let key = api_key(&pool, Some(&mine)).await;
    let seller_client = backend_client(&key);
    let get = |path: String| {
        let c = seller_client.clone();
        let addr = shop.app.addr;
        async move {
            let resp = c.get(format!("http://{addr}{path}")).send().await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    for area in ["balances", "ledger", "payouts", "invoices"] {
        assert_eq!(
            get(format!("/sellers/{mine}/{area}")).await.0,
            200,
            "{area}"
        );
        let (status, body) = get(format!("/sellers/{theirs}/{area}")).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (403, Some("forbidden")),
            "{area}: {body}"
        );
    }
    // Another seller's order answers as a missing one: numbers tell nothing.
    let (status, body) = get(format!("/orders/{n}")).await;
    assert_eq!(
        (status, body["error"]["message"].as_str()),
        (404, Some(format!("no order {n}").as_str())),
        "another seller's order: {body}"
    );
    let (status, missing) = get(format!("/orders/{}", n + 1000)).await;
    assert_eq!(
        (status, missing["error"]["code"].as_str()),
        (404, body["error"]["code"].as_str())
    );
    assert_eq!(get("/wallets/b".into()).await.0, 403);
    let checkout = seller_client
        .post(format!("http://{}/checkout", shop.app.addr))
        .header("idempotency-key", "mine-1")
        .json(&json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(checkout.status(), 403);
    for action in ["payment", "coins"] {
        let resp = seller_client
            .post(format!("http://{}/orders/{n}/{action}", shop.app.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 403, "{action}");
    }
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(orders, 1, "the refused checkout made nothing");
    // The key of the order's own seller reads it.
    let own = backend_client(&api_key(&pool, Some(&theirs)).await);
    let resp = own
        .get(format!("http://{}/orders/{n}", shop.app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_api_key_is_shown_once_kept_as_a_hash_and_revoked_everywhere_within_a_second(
    pool: PgPool,
) {
    let a = spawn_app(pool.clone()).await;
    let b = spawn_app(pool.clone()).await;
    let made = a
        .anon
        .post(format!("http://{}/admin/api-keys", a.addr))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"name": "storefront"}))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), 201);
    let made: Value = made.json().await.unwrap();
    let key = made["key"].as_str().unwrap().to_owned();
    assert!(key.starts_with("pfk_") && key.len() > 40, "{made}");
    let id = made["id"].as_str().unwrap().to_owned();
    // Kept only as its hash: no column holds the key.
    let rows: Vec<String> = sqlx::query_scalar("SELECT row_to_json(k)::text FROM api_keys k")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(rows.iter().all(|r| !r.contains(&key)), "{rows:?}");
    let listed: Value = a
        .anon
        .get(format!("http://{}/admin/api-keys", a.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(!listed.to_string().contains(&key), "{listed}");
    assert!(listed.to_string().contains(&id));

    let wallet = |app: &TestApp| {
        let url = format!("http://{}/wallets/someone", app.addr);
        let c = backend_client(&key);
        async move { c.get(url).send().await.unwrap().status().as_u16() }
    };
    // Both processes know the key (and b has it cached).
    assert_eq!(wallet(&a).await, 200);
    assert_eq!(wallet(&b).await, 200);
    let revoked = a
        .anon
        .delete(format!("http://{}/admin/api-keys/{id}", a.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(revoked.status(), 200);
    let at = Instant::now();
    while wallet(&b).await != 401 {
        assert!(
            at.elapsed() < Duration::from_secs(1),
            "the other process still takes the revoked key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resp = backend_client(&key)
        .get(format!("http://{}/wallets/someone", a.addr))
        .send()
        .await
        .unwrap();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unauthenticated", "{body}");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn idempotency_keys_belong_to_the_api_key_that_sent_them(pool: PgPool) {
    let shop = shop(&pool).await;
    let seller = shop.seller("S").await;
    let p = shop.product(&seller, "10.00", "BRL").await;
    let q = shop.product(&seller, "20.00", "BRL").await;
    let cart = |product: &str| json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]});
    let (status, first) = shop.checkout(Some("order-1"), cart(&p)).await;
    assert_eq!(status, 201, "{first}");
    // Another backend using the same Idempotency-Key neither gets the first answer nor is
    // refused for reusing it: its key space is its own.
    let other = backend_client(&api_key(&pool, None).await);
    let resp = other
        .post(format!("http://{}/checkout", shop.app.addr))
        .header("idempotency-key", "order-1")
        .json(&cart(&q))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let second: Value = resp.json().await.unwrap();
    assert_ne!(second["orders"][0]["number"], first["orders"][0]["number"]);
    assert_eq!(second["orders"][0]["total"], "20.00");
    // And the first backend's repeat still gets its own first answer.
    let (status, again) = shop.checkout(Some("order-1"), cart(&p)).await;
    assert_eq!((status, &again), (201, &first));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_payment_page_takes_only_its_own_form_from_its_own_origin(pool: PgPool) {
    let shop = shop(&pool).await;
    let seller = shop.seller("S").await;
    let p = shop.product(&seller, "10.00", "BRL").await;
    let (_, answer) = shop
        .checkout(
            Some("k"),
            json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": p, "quantity": 1}]}),
        )
        .await;
    let url = answer["orders"][0]["payment"]["url"]
        .as_str()
        .unwrap()
        .to_owned();
    let page = shop.app.anon.get(&url).send().await.unwrap();
    let headers = page.headers().clone();
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_eq!(headers["x-frame-options"], "DENY");
    assert_eq!(headers["cache-control"], "no-store");
    let token = form_token(&page.text().await.unwrap());
    // The pages a gateway sends the buyer back to, Razorpay's by a form POST: never framed, never
    // cached.
    let base = format!("http://{}", shop.app.addr);
    for req in [
        shop.app.anon.get(format!("{base}/orders/paid")),
        shop.app
            .anon
            .post(format!("{base}/orders/paid"))
            .form(&[("razorpay_payment_id", "pay_1")]),
        shop.app.anon.get(format!("{base}/orders/cancelled")),
    ] {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-frame-options"], "DENY");
        assert_eq!(resp.headers()["cache-control"], "no-store");
    }

    let post = |form: Vec<(&'static str, String)>, origin: Option<&'static str>| {
        let mut req = shop.app.anon.post(&url).form(&form);
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        async move { req.send().await.unwrap().status().as_u16() }
    };
    let outcome = || ("outcome", "succeeded".to_owned());
    assert_eq!(post(vec![outcome()], None).await, 403, "no token");
    assert_eq!(
        post(vec![outcome(), ("token", "123.abcd".into())], None).await,
        403,
        "a made-up token"
    );
    // Another session's token does not fit this one.
    let (_, other) = shop
        .checkout(
            Some("k2"),
            json!({"buyer_id": "c", "gateway": "internal", "items": [{"product_id": p, "quantity": 1}]}),
        )
        .await;
    let other_page = reqwest::get(other["orders"][0]["payment"]["url"].as_str().unwrap())
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        post(vec![outcome(), ("token", form_token(&other_page))], None).await,
        403,
        "another session's token"
    );
    assert_eq!(
        post(
            vec![outcome(), ("token", token.clone())],
            Some("https://evil.example")
        )
        .await,
        403,
        "a cross-site form"
    );
    let recorded: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM internal_payments WHERE status <> 'pending'),
                (SELECT count(*) FROM internal_events)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(recorded, (0, 0), "nothing refused was recorded");
    // The page's own form, from its own origin, is taken.
    let origin = format!("http://{}", shop.app.addr);
    let resp = shop
        .app
        .anon
        .post(&url)
        .header("origin", origin)
        .form(&[("outcome", "succeeded"), ("token", &token)])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_simulated_gateway_needs_the_simulator_on(pool: PgPool) {
    let mut config = test_config();
    config.gateways.hosted.simulator = false;
    for roles in [
        payfleet::startup::Roles::SERVE,
        payfleet::startup::Roles::WORK,
    ] {
        let e = payfleet::startup::start(&config, pool.clone(), roles, None)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("PAYFLEET_PAYMENT_SIMULATOR"), "{e}");
    }
    // Without the simulated gateways (the mock gone, the internal one collecting through
    // Stripe), the simulator is not needed; an internal-gateway webhook secret beside the Stripe
    // acquirer is refused (events signed with it would speak for real-money sessions).
    config.gateways.hosted.mock = None;
    config.gateways.hosted.internal_acquirer = payfleet::gateways::hosted::InternalAcquirer::Stripe;
    config.gateways.stripe.api = Some(payfleet::gateways::stripe::Api {
        base_url: "http://127.0.0.1:9".into(),
        secret_key: payfleet::secret::Secret::new("sk_test_x"),
    });
    let e = payfleet::startup::start(&config, pool.clone(), payfleet::startup::Roles::SERVE, None)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("INTERNAL_WEBHOOK_SECRET"), "{e}");
    config.gateways.hosted.internal = None;
    let running =
        payfleet::startup::start(&config, pool.clone(), payfleet::startup::Roles::SERVE, None)
            .unwrap();
    running.stop().await;
    // Where money is real, nothing sets how the simulator answers a subscription's renewals.
    let app = spawn_app_with(pool.clone(), config.clone()).await;
    let resp = app
        .http
        .post(format!(
            "http://{}/admin/subscriptions/{}/simulate",
            app.addr,
            uuid::Uuid::from_u128(rand::random())
        ))
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({"renewals": "succeed"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 409);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "simulator_off", "{body}");
    // Nor is there a payment page to answer for: 404 before the form or its origin is read.
    let page = format!("http://{}/pay/ips_0123456789abcdef01234567", app.addr);
    for (origin, outcome) in [
        ("https://evil.example", "succeeded"),
        ("https://evil.example", "x"),
        (config.public_url.as_str(), "x"),
    ] {
        let resp = app
            .anon
            .post(&page)
            .header("origin", origin)
            .form(&[("outcome", outcome)])
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 404, "{origin} {outcome}");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "not_found", "{body}");
    }

    // The command says so and stops.
    let out = payfleet(&pool, &["serve"])
        .env("INTERNAL_WEBHOOK_SECRET", INTERNAL_SECRET)
        .env("PAYFLEET_BIND", "127.0.0.1:0")
        .env_remove("PAYFLEET_PAYMENT_SIMULATOR")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("simulated") && stderr.contains("PAYFLEET_PAYMENT_SIMULATOR"),
        "{stderr}"
    );
}

/// The simulator's pay button moves no money: beside a gateway's live credentials (money is
/// real there), `serve` and `work` refuse to start with it on, naming both; beside sandbox
/// credentials (a preview) they start.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_simulator_never_runs_beside_a_gateways_live_credentials(pool: PgPool) {
    let live = |gateway: &str| {
        let mut config = test_config();
        assert!(config.gateways.hosted.simulator);
        match gateway {
            "stripe" => {
                config.gateways.stripe.api = Some(payfleet::gateways::stripe::Api {
                    base_url: "http://127.0.0.1:9".into(),
                    secret_key: payfleet::secret::Secret::new("rk_live_51Hxyz"),
                })
            }
            "razorpay" => {
                config.gateways.razorpay.api = Some(payfleet::gateways::razorpay::Api {
                    base_url: "http://127.0.0.1:9".into(),
                    key_id: "rzp_live_AbCdEf".into(),
                    key_secret: payfleet::secret::Secret::new("s"),
                })
            }
            _ => {
                config.gateways.mercadopago.api = Some(payfleet::gateways::mercadopago::Api {
                    base_url: "http://127.0.0.1:9".into(),
                    access_token: payfleet::secret::Secret::new("APP_USR-123-live"),
                })
            }
        }
        config
    };
    for gateway in ["stripe", "razorpay", "mercadopago"] {
        let config = live(gateway);
        for roles in [
            payfleet::startup::Roles::SERVE,
            payfleet::startup::Roles::WORK,
        ] {
            let e = payfleet::startup::start(&config, pool.clone(), roles, None)
                .err()
                .expect("refused");
            let e = e.to_string();
            assert!(
                e.contains("live credentials") && e.contains(gateway) && e.contains("simulated"),
                "{e}"
            );
        }
    }
    // Sandbox credentials beside the simulator: a preview, which starts.
    let mut config = test_config();
    config.gateways.stripe.api = Some(payfleet::gateways::stripe::Api {
        base_url: "http://127.0.0.1:9".into(),
        secret_key: payfleet::secret::Secret::new("sk_test_51Hxyz"),
    });
    let running =
        payfleet::startup::start(&config, pool.clone(), payfleet::startup::Roles::SERVE, None)
            .unwrap();
    running.stop().await;
    // Live credentials with no simulated gateway: production, which starts.
    let mut config = live("stripe");
    config.gateways.hosted.mock = None;
    config.gateways.hosted.internal = None;
    config.gateways.hosted.simulator = false;
    let running =
        payfleet::startup::start(&config, pool.clone(), payfleet::startup::Roles::SERVE, None)
            .unwrap();
    running.stop().await;
    // The command says so and stops, before it touches any database (none answers here).
    for role in ["serve", "work"] {
        let out = payfleet(&pool, &[role])
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
            .env("INTERNAL_WEBHOOK_SECRET", INTERNAL_SECRET)
            .env("PAYFLEET_PAYMENT_SIMULATOR", "on")
            .env("STRIPE_WEBHOOK_SECRET", "whsec_live_endpoint_x")
            .env("STRIPE_SECRET_KEY", "sk_live_x")
            .env("PAYFLEET_BIND", "127.0.0.1:0")
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("live credentials"), "{role}: {stderr}");
    }
}

#[tokio::test]
async fn up_listens_beyond_this_machine_only_when_told() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_payfleet"))
        .arg("up")
        .env("PAYFLEET_BIND", "0.0.0.0:0")
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--public"), "{stderr}");
}

/// `up` turns the payment simulator on: beside a gateway whose money is real, its pay button
/// would confirm orders no money paid. It refuses before it touches any database.
#[tokio::test]
async fn up_refuses_to_run_beside_a_gateway_whose_money_is_real() {
    // A webhook secret, or live API credentials alone (they used to get as far as the
    // migrations and the development credentials' writing, in whatever DATABASE_URL named).
    for env in [
        &[("STRIPE_WEBHOOK_SECRET", "whsec_live_endpoint_secret")][..],
        &[("RAZORPAY_WEBHOOK_SECRET", "razorpay-live-secret")],
        &[("STRIPE_SECRET_KEY", "sk_live_only_the_api")],
        &[("MERCADOPAGO_ACCESS_TOKEN", "APP_USR-only-the-api")],
        &[
            ("RAZORPAY_KEY_ID", "rzp_live_only"),
            ("RAZORPAY_KEY_SECRET", "only-the-api"),
        ],
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_payfleet"))
            .arg("up")
            .env("PAYFLEET_BIND", "127.0.0.1:0")
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
            .envs(env.iter().copied())
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{env:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("real money"), "{env:?}: {stderr}");
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn connections_that_never_finish_their_request_are_closed(pool: PgPool) {
    // One host here holds them all: beyond its share (unit-tested in `http::server`).
    let mut config = test_config();
    config.http.max_connections_per_client = config.http.max_connections;
    let app = spawn_app_with(pool, config).await;
    let mut slow = Vec::new();
    for _ in 0..300 {
        let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await
            .unwrap();
        slow.push(s);
    }
    // Meanwhile an honest request is served at once.
    let at = Instant::now();
    let (status, _) = app.get("/healthz").await;
    assert_eq!(status, 200);
    assert!(at.elapsed() < Duration::from_secs(2));
    // A body that never comes whole is refused too.
    let mut body = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    body.write_all(
        format!(
            "POST /webhooks/internal HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{}",
            "a".repeat(10)
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let mut closed = 0;
    for s in &mut slow {
        let mut buf = [0u8; 64];
        let left = Duration::from_secs(15).saturating_sub(start.elapsed());
        if let Ok(Ok(0)) = tokio::time::timeout(left, s.read(&mut buf)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, 300, "every slow head is cut off");
    assert!(start.elapsed() < Duration::from_secs(12));
    let mut answer = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(25), body.read_to_string(&mut answer)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
}

/// A delivery to a gateway this receiver does not take (an unknown name, one not enabled) is
/// refused from its head: its body, up to the webhook limit, is never waited for nor buffered.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_webhook_for_no_gateway_of_ours_is_refused_before_its_body_is_read(pool: PgPool) {
    let mut config = test_config();
    config.gateways.razorpay.webhook_secret = None;
    let app = spawn_app_with(pool, config).await;
    for gateway in ["nosuch", "razorpay"] {
        let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        s.write_all(
            format!(
                "POST /webhooks/{gateway} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: 1000000\r\n\r\n{{\"id\":"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut head = [0u8; 12];
        tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut head))
            .await
            .unwrap_or_else(|_| panic!("{gateway}: no answer before the body came"))
            .unwrap();
        assert_eq!(&head, b"HTTP/1.1 404", "{gateway}");
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_oversized_cart_is_refused_before_anything_is_stored(pool: PgPool) {
    let shop = shop(&pool).await;
    let seller = shop.seller("S").await;
    let p = shop.product(&seller, "1.00", "BRL").await;
    let lines = |n: usize| {
        json!({"buyer_id": "b", "gateway": "internal",
               "items": (0..n).map(|_| json!({"product_id": p, "quantity": 1})).collect::<Vec<_>>()})
    };
    let (status, answer) = shop.checkout(Some("big"), lines(101)).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("invalid_items")),
        "{answer}"
    );
    let (status, answer) = shop.checkout(Some("huge"), lines(1200)).await;
    assert_eq!(status, 413, "{answer}");
    let stored: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM idempotency_keys)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stored, (0, 0));
    // A hundred lines is a checkout, its lines written at once.
    let (status, answer) = shop.checkout(Some("full"), lines(100)).await;
    assert_eq!(status, 201, "{answer}");
    let items: i64 = sqlx::query_scalar("SELECT count(*) FROM order_items")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(items, 100);
}

/// Razorpay's payment page opens Checkout with the order id of its path inside a script: only
/// Razorpay's shape of id is put there, as a JavaScript string; anything else is no order.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_razorpay_page_puts_only_a_razorpay_order_id_in_its_script(pool: PgPool) {
    let mut config = test_config();
    config.gateways.razorpay.api = Some(payfleet::gateways::razorpay::Api {
        base_url: "http://127.0.0.1:9".into(),
        key_id: "rzp_test_AbCdEf".into(),
        key_secret: payfleet::secret::Secret::new("s"),
    });
    let app = spawn_app_with(pool.clone(), config).await;
    let page = |id: &'static str| {
        let req = app
            .anon
            .get(format!("http://{}/pay/razorpay/{id}", app.addr));
        async move {
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        }
    };
    let (status, body) = page("order_N8CkWcXvT2pLqQ").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(r#"new Razorpay({key:"rzp_test_AbCdEf",order_id:"order_N8CkWcXvT2pLqQ","#),
        "{body}"
    );
    for made_up in [
        "x%5C",
        "order_a%5C",
        "order_a%22%2Calert(1)%2C%22",
        "order_%3C%2Fscript%3E",
        "order_",
        "pay_N8CkWcXvT2pLqQ",
    ] {
        let (status, body) = page(made_up).await;
        assert_eq!(status, 404, "{made_up}: {body}");
        assert!(!body.contains("Razorpay("), "{made_up}: {body}");
    }
}

/// A scraper set up with one of our API keys instead of the metrics token is refused, and is no
/// guess: its address (shared with the operators' tools) is not locked out of the admin API.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_api_key_at_the_metrics_is_refused_not_counted_as_a_guess(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    for i in 0..15 {
        let resp = app
            .anon
            .get(format!("http://{}/metrics", app.addr))
            .bearer_auth(&app.api_key)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 403, "scrape {i}");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("an API key cannot read metrics"),
            "{body}"
        );
    }
    let resp = app
        .anon
        .get(format!("http://{}/admin/api-keys", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "the address is not locked out");
    // A wrong token is still a guess: ten lock the address out.
    for _ in 0..10 {
        let resp = app
            .anon
            .get(format!("http://{}/metrics", app.addr))
            .bearer_auth("not-the-metrics-token-at-all-0123456789")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 403);
    }
    let resp = app
        .anon
        .get(format!("http://{}/metrics", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn guessing_tokens_locks_the_address_out_for_its_window(pool: PgPool) {
    let mut config = test_config();
    config.http.client_address_header = Some("x-forwarded-for".parse().unwrap());
    let app = spawn_app_with(pool.clone(), config).await;
    let url = format!("http://{}/admin/api-keys", app.addr);
    let from = |addr: &'static str, token: String| {
        let req = app
            .anon
            .get(&url)
            .header("x-forwarded-for", addr)
            .bearer_auth(token);
        async move { req.send().await.unwrap() }
    };
    for i in 0..10 {
        let resp = from("203.0.113.5", format!("guess-{i}-{}", "x".repeat(30))).await;
        assert_eq!(resp.status(), 403, "guess {i}");
    }
    let locked = from("203.0.113.5", ADMIN_TOKEN.into()).await;
    assert_eq!(
        locked.status(),
        429,
        "even the right token, or guessing would go on"
    );
    let retry: u64 = locked.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((800..=900).contains(&retry), "{retry}");
    // Unknown API keys and failed sign-ins count the same, on business routes too: a key this
    // process has not seen in force is looked up only within the limit.
    let wallet = format!("http://{}/wallets/b", app.addr);
    let wallet_from = |addr: &'static str| {
        let req = app
            .anon
            .get(&wallet)
            .header("x-forwarded-for", addr)
            .bearer_auth(&app.api_key);
        async move { req.send().await.unwrap().status() }
    };
    assert_eq!(wallet_from("203.0.113.5").await, 429);
    // The marketplace's backend behind the same address (a NAT, a proxy) as the one guessing:
    // its key, once seen in force, is no guess, and is not locked out with the guesser, even
    // after the process's cache of it has lapsed.
    assert_eq!(wallet_from("192.0.2.200").await, 200);
    assert_eq!(wallet_from("203.0.113.5").await, 200);
    tokio::time::sleep(payfleet::auth::api_keys::CACHE_TTL * 2).await;
    assert_eq!(wallet_from("203.0.113.5").await, 200);
    assert_eq!(
        from("203.0.113.5", ADMIN_TOKEN.into()).await.status(),
        429,
        "the admin token is still no way past the lock"
    );
    for i in 0..10 {
        let resp = app
            .anon
            .post(format!("http://{}/admin/ui/session", app.addr))
            .header("x-forwarded-for", "198.51.100.7")
            .form(&[("token", format!("wrong-{i}"))])
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
    }
    assert_eq!(
        from("198.51.100.7", ADMIN_TOKEN.into()).await.status(),
        429,
        "sign-in failures lock the address too"
    );
    // A burst of made-up keys sent at once from a fresh address: the lookups in flight count
    // against the limit, so at most ten are tried.
    let burst = futures_util::future::join_all((0..40).map(|i| {
        app.anon
            .get(&wallet)
            .header("x-forwarded-for", "192.0.2.77")
            .bearer_auth(format!("pfk_{i:0>43}"))
            .send()
    }))
    .await;
    let statuses: Vec<u16> = burst
        .into_iter()
        .map(|r| r.unwrap().status().as_u16())
        .collect();
    let tried = statuses.iter().filter(|s| **s == 401).count();
    assert!(tried <= 10, "{tried} guesses tried at once: {statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 429),
        "{statuses:?}"
    );
    // Another address is not held up, and a webhook from a locked one still lands.
    assert_eq!(from("192.0.2.1", ADMIN_TOKEN.into()).await.status(), 200);
    let (status, _) = app
        .deliver(&internal(
            "m1",
            &payment_body("payment.succeeded", "s1", "1.00"),
        ))
        .await;
    assert_eq!(status, 200);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn metrics_need_a_token_and_read_the_database_at_most_every_few_seconds(pool: PgPool) {
    let mut config = test_config();
    config.metrics_token = Some(payfleet::auth::Token::parse(&"m".repeat(40)).unwrap());
    config.metrics_refresh = Duration::from_secs(5);
    let app = spawn_app_with(pool.clone(), config).await;
    let url = format!("http://{}/metrics", app.addr);
    let scrape = |token: Option<String>| {
        let mut req = app.anon.get(&url);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        async move {
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        }
    };
    assert_eq!(scrape(None).await.0, 401);
    assert_eq!(scrape(Some(app.api_key.clone())).await.0, 403);
    let (status, first) = scrape(Some("m".repeat(40))).await;
    assert_eq!(status, 200);
    assert_eq!(
        metric(
            &first,
            r#"payfleet_payment_events_unprocessed{state="pending"}"#
        ),
        0.0
    );
    assert_eq!(scrape(Some(ADMIN_TOKEN.into())).await.0, 200);
    // An event arrives; scrapes within the refresh period read no database: they show the
    // last reading, however many there are at once.
    let (status, _) = app
        .deliver(&internal(
            "m1",
            &payment_body("payment.succeeded", "s1", "1.00"),
        ))
        .await;
    assert_eq!(status, 200);
    let scrapes =
        futures_util::future::join_all((0..50).map(|_| scrape(Some("m".repeat(40))))).await;
    for (status, text) in &scrapes {
        assert_eq!(*status, 200);
        assert_eq!(
            metric(
                text,
                r#"payfleet_payment_events_unprocessed{state="pending"}"#
            ),
            0.0
        );
    }
    let at = Instant::now();
    loop {
        let (_, text) = scrape(Some("m".repeat(40))).await;
        if metric(
            &text,
            r#"payfleet_payment_events_unprocessed{state="pending"}"#,
        ) == 1.0
        {
            break;
        }
        assert!(at.elapsed() < Duration::from_secs(7), "never read again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_5xx_answer_says_nothing_of_the_internal_error_but_names_its_request(pool: PgPool) {
    let proxy = DbProxy::for_database(&pool).await;
    let app = spawn_app(proxy.pool(&pool)).await;
    let (status, _) = app.get("/healthz").await;
    assert_eq!(status, 200);
    proxy.set(Link::Refused);
    let resp = app
        .http
        .get(format!("http://{}/wallets/b", app.addr))
        .header("x-request-id", "req-under-test")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["request_id"], "req-under-test", "{body}");
    let message = body["error"]["message"].as_str().unwrap().to_lowercase();
    for internal in [
        "connection",
        "refused",
        "pool",
        "sqlx",
        "error communicating",
        "timed out",
    ] {
        assert!(!message.contains(internal), "{internal:?} in {message:?}");
    }
}

/// Another site's page cannot lock an operator out: a cross-site sign-in is refused and counts
/// as no guess, and a sign-in body is a token's size at most.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_cross_site_sign_in_is_refused_without_counting_as_a_guess(pool: PgPool) {
    let mut config = test_config();
    config.http.client_address_header = Some("x-forwarded-for".parse().unwrap());
    let app = spawn_app_with(pool.clone(), config).await;
    let browser = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let sign_in = |token: String, origin: Option<&'static str>| {
        let mut req = browser
            .post(format!("http://{}/admin/ui/session", app.addr))
            .header("x-forwarded-for", "198.51.100.9")
            .form(&[("token", token)]);
        if let Some(o) = origin {
            req = req
                .header("origin", o)
                .header("sec-fetch-site", "cross-site");
        }
        async move { req.send().await.unwrap().status().as_u16() }
    };
    for i in 0..20 {
        assert_eq!(
            sign_in(format!("wrong-{i}"), Some("https://evil.example")).await,
            403
        );
    }
    let api_key = app
        .anon
        .get(format!("http://{}/wallets/b", app.addr))
        .header("x-forwarded-for", "198.51.100.9")
        .bearer_auth(&app.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(api_key.status(), 200, "the address is not locked out");
    assert_eq!(sign_in(ADMIN_TOKEN.into(), None).await, 303);
    let big = app
        .anon
        .post(format!("http://{}/admin/ui/session", app.addr))
        .form(&[("token", "x".repeat(10_000))])
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), 413);
}

/// The probes and pages anyone may call do not reach the database at the caller's pace: with
/// the database gone, a payment page of no session is 404 at once, and `/readyz` asks the
/// database at most once a second.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn anonymous_pages_and_probes_spare_the_database(pool: PgPool) {
    let proxy = DbProxy::for_database(&pool).await;
    let app = spawn_app(proxy.pool(&pool)).await;
    assert_eq!(app.get("/readyz").await.0, 200);
    proxy.set(Link::Refused);
    // The answer of a moment ago stands for a second.
    assert_eq!(app.get("/readyz").await.0, 200);
    for junk in [
        "1",
        "ips_nothex",
        "ips_0123456789abcdef0123456",
        "ips_0123456789ABCDEF01234567",
    ] {
        let (status, body) = app.get(&format!("/pay/{junk}")).await;
        assert_eq!(status, 404, "{junk}: {body}");
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, body) = app.get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    // A well-formed id is looked up: the outage is a 503.
    let (status, _) = app.get("/pay/ips_0123456789abcdef01234567").await;
    assert_eq!(status, 503);
}

/// `payfleet up` keeps its development API key in plain text (for its restarts and `demo`):
/// anyone who reads a database `up` once ran on, or a copy of it, has that key. Only `up`'s
/// process takes it; `serve` answers 401, as for a revoked key, and its ordinary keys work.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_development_api_key_is_taken_by_up_alone(pool: PgPool) {
    let (_, development) = payfleet::auth::api_keys::create_development(
        &pool,
        payfleet::auth::NewApiKey {
            name: "development (payfleet up)".into(),
            seller_id: None,
        },
    )
    .await
    .unwrap();
    let served = spawn_app(pool.clone()).await;
    let wallet = |app: &TestApp| format!("http://{}/wallets/b", app.addr);
    let resp = served
        .anon
        .get(wallet(&served))
        .bearer_auth(&development)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unauthenticated", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("payfleet up")),
        "{body}"
    );
    // Its ordinary key works there.
    let resp = served
        .anon
        .get(wallet(&served))
        .bearer_auth(&served.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // `up`'s own process takes it.
    let mut config = test_config();
    config.development = true;
    let up = spawn_app_with(pool.clone(), config).await;
    let resp = up
        .anon
        .get(wallet(&up))
        .bearer_auth(&development)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

/// A worker makes the payment links: with outside gateways and no `PAYFLEET_PUBLIC_URL`, the
/// pages their buyers come back to would be on the worker's own loopback address. It refuses
/// to start, as a receiver listening on every address does without one.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_public_url_made_up_from_the_bind_address_is_refused_where_it_cannot_be_right(
    pool: PgPool,
) {
    let stderr = refused_at_start(
        payfleet(&pool, &["work"])
            .env("STRIPE_WEBHOOK_SECRET", "whsec_test_endpoint_secret")
            .env("STRIPE_SECRET_KEY", "sk_test_a_sandbox_key")
            .env("PAYFLEET_WORKER_BIND", "127.0.0.1:0")
            // A host of workers set up like its receivers' (a worker binds no PAYFLEET_BIND).
            .env("PAYFLEET_BIND", "10.0.0.5:8080")
            .env_remove("PAYFLEET_PUBLIC_URL"),
    )
    .await;
    assert!(
        stderr.contains("PAYFLEET_PUBLIC_URL is not set on this worker")
            && stderr.contains("stripe"),
        "{stderr}"
    );
    let stderr = refused_at_start(
        payfleet(&pool, &["serve"])
            .env("PAYFLEET_BIND", "0.0.0.0:0")
            .env_remove("PAYFLEET_PUBLIC_URL"),
    )
    .await;
    assert!(stderr.contains("listens on every address"), "{stderr}");
    // `up --public` on every address is told so before it migrates anything.
    let stderr = refused_at_start(
        payfleet(&pool, &["up", "--public"])
            .env("PAYFLEET_BIND", "0.0.0.0:0")
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
            .env_remove("PAYFLEET_PUBLIC_URL"),
    )
    .await;
    assert!(stderr.contains("listens on every address"), "{stderr}");
    // Given, the worker starts (stopped here once it answers its health probe).
    let mut worker = payfleet(&pool, &["work"])
        .env("STRIPE_WEBHOOK_SECRET", "whsec_test_endpoint_secret")
        .env("STRIPE_SECRET_KEY", "sk_test_a_sandbox_key")
        .env("PAYFLEET_PUBLIC_URL", "https://shop.example.com")
        .env("PAYFLEET_WORKER_BIND", "127.0.0.1:0")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        worker.try_wait().unwrap().is_none(),
        "the worker with its public URL keeps running"
    );
    worker.kill().await.unwrap();
}
