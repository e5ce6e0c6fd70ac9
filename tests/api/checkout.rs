//! Catalogue, checkout and orders over HTTP, with the payment links asked over the real
//! RabbitMQ from the payment side running in the same process (as `payfleet up`), or not
//! running at all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use payfleet::startup::Roles;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::helpers::*;

/// A marketplace's front end and admin, talking to a test fleet.
pub struct Shop {
    pub app: Arc<TestApp>,
}

impl Shop {
    /// One order of `price` BRL from a new seller's product, on the internal gateway: its answer.
    pub async fn one_order(&self, price: &str) -> Value {
        let seller = self.seller("S").await;
        let product = self.product(&seller, price, "BRL").await;
        let (status, answer) = self
            .checkout(
                Some("k"),
                json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]}),
            )
            .await;
        assert_eq!(status, 201, "{answer}");
        answer["orders"][0].clone()
    }

    pub async fn post(&self, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
        let mut req = self
            .app
            .http
            .post(format!("http://{}{path}", self.app.addr))
            .json(&body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.unwrap();
        let (status, text) = checked(reqwest::Method::POST, path, resp).await;
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub async fn admin(&self, path: &str, body: Value) -> Value {
        let (status, body) = self.post(path, Some(ADMIN_TOKEN), body).await;
        assert_eq!(status, 201, "{path}: {body}");
        body
    }

    pub async fn seller(&self, name: &str) -> String {
        let s = self
            .admin(
                "/admin/sellers",
                json!({"name": name, "payout_frequency": "weekly", "payout_minimum": "50.00"}),
            )
            .await;
        s["id"].as_str().unwrap().to_owned()
    }

    pub async fn product(&self, seller: &str, price: &str, currency: &str) -> String {
        let p = self
            .admin(
                "/admin/products",
                json!({"seller_id": seller, "name": format!("p{price}"), "kind": "one_off", "price": price, "currency": currency}),
            )
            .await;
        // Written back with the currency's minor-unit digits, as every amount is (not as stored).
        assert_eq!(p["price"], price, "{p}");
        p["id"].as_str().unwrap().to_owned()
    }

    pub async fn checkout(&self, key: Option<&str>, body: Value) -> (u16, Value) {
        let mut req = self
            .app
            .http
            .post(format!("http://{}/checkout", self.app.addr))
            .json(&body);
        if let Some(k) = key {
            req = req.header("Idempotency-Key", k);
        }
        let resp = req.send().await.unwrap();
        let (status, text) = checked(reqwest::Method::POST, "/checkout", resp).await;
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub async fn order(&self, number: i64) -> Value {
        let (status, body) = self.app.get(&format!("/orders/{number}")).await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }
}

pub async fn shop(pool: PgPool) -> Shop {
    Shop {
        app: Arc::new(spawn_fleet(pool, test_config()).await),
    }
}

fn cart(items: &[(&str, i64)]) -> Value {
    json!({
        "buyer_id": "buyer-1",
        "gateway": "internal",
        "items": items.iter().map(|(p, q)| json!({"product_id": p, "quantity": q, "price": "0.01"})).collect::<Vec<_>>(),
    })
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    count_where(pool, table, "true").await
}

async fn count_where(pool: &PgPool, table: &str, condition: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE {condition}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_admin_api_needs_its_token_and_is_off_without_one(pool: PgPool) {
    let mut config = test_config();
    config.admin_token = None;
    let off = Shop {
        app: Arc::new(spawn_app_with(pool.clone(), config).await),
    };
    let body = json!({"name": "A", "payout_frequency": "weekly", "payout_minimum": "1"});
    let (status, answer) = off
        .post("/admin/sellers", Some(ADMIN_TOKEN), body.clone())
        .await;
    assert_eq!(status, 403);
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("PAYFLEET_ADMIN_TOKEN"),
        "{answer}"
    );

    let on = Shop {
        app: Arc::new(spawn_app(pool.clone()).await),
    };
    let anonymous = on
        .app
        .anon
        .post(format!("http://{}/admin/sellers", on.app.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    let (status, _) = on
        .post("/admin/sellers", Some("not-the-token-at-all"), body.clone())
        .await;
    assert_eq!(status, 403);
    assert_eq!(count(&pool, "sellers").await, 0);
    let (status, seller) = on.post("/admin/sellers", Some(ADMIN_TOKEN), body).await;
    assert_eq!(status, 201, "{seller}");
    assert_eq!(seller["holding_days"], 14);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn catalogue_input_is_refused_field_by_field_and_stores_nothing(pool: PgPool) {
    let shop = Shop {
        app: Arc::new(spawn_app(pool.clone()).await),
    };
    let seller = shop.seller("Chips").await;
    for (path, body, code) in [
        (
            "/admin/sellers",
            json!({"name": "", "payout_frequency": "weekly", "payout_minimum": "1"}),
            "invalid_request",
        ),
        (
            "/admin/sellers",
            json!({"name": "B\u{0}", "payout_frequency": "weekly", "payout_minimum": "1"}),
            "invalid_request",
        ),
        (
            "/admin/sellers",
            json!({"name": "B", "payout_frequency": "yearly", "payout_minimum": "1"}),
            "invalid_request",
        ),
        (
            "/admin/sellers",
            json!({"name": "B", "payout_frequency": "daily", "payout_minimum": "-1"}),
            "invalid_request",
        ),
        (
            "/admin/sellers",
            json!({"name": "B", "payout_frequency": "daily", "payout_minimum": "1", "stripe_account": "nope"}),
            "invalid_request",
        ),
        (
            "/admin/products",
            json!({"seller_id": "00000000-0000-0000-0000-000000000000", "name": "x", "kind": "one_off", "price": "1.00", "currency": "BRL"}),
            "unknown_seller",
        ),
        (
            "/admin/products",
            json!({"seller_id": seller, "name": "x", "kind": "subscription", "price": "1.00", "currency": "BRL"}),
            "invalid_request",
        ),
        (
            "/admin/products",
            json!({"seller_id": seller, "name": "x", "kind": "one_off", "price": "1.001", "currency": "BRL"}),
            "invalid_request",
        ),
        (
            "/admin/products",
            json!({"seller_id": seller, "name": "x", "kind": "one_off", "price": "0", "currency": "BRL"}),
            "invalid_request",
        ),
        // An exponent, a separator: rust_decimal's own parser takes both.
        (
            "/admin/products",
            json!({"seller_id": seller, "name": "x", "kind": "one_off", "price": "1e2", "currency": "BRL"}),
            "invalid_request",
        ),
        (
            "/admin/products",
            json!({"seller_id": seller, "name": "x", "kind": "one_off", "price": "1_000", "currency": "BRL"}),
            "invalid_request",
        ),
        (
            "/admin/products",
            json!({"seller_id": seller, "name": "x", "kind": "one_off", "price": "1.00", "currency": "RS"}),
            "invalid_request",
        ),
        (
            "/admin/coupons",
            json!({"code": "BOTH", "percent_off": "10", "amount_off": "5.00", "currency": "BRL"}),
            "invalid_request",
        ),
        (
            "/admin/coupons",
            json!({"code": "NOCUR", "amount_off": "5.00"}),
            "invalid_request",
        ),
        (
            "/admin/coupons",
            json!({"code": "TOOMUCH", "percent_off": "101"}),
            "invalid_request",
        ),
        (
            "/admin/coupons",
            json!({"code": "bad code!", "percent_off": "5"}),
            "invalid_request",
        ),
    ] {
        let (status, answer) = shop.post(path, Some(ADMIN_TOKEN), body.clone()).await;
        assert_eq!(
            (status, answer["error"]["code"].as_str()),
            (422, Some(code)),
            "{body}: {answer}"
        );
    }
    assert_eq!(
        (
            count(&pool, "sellers").await,
            count(&pool, "products").await,
            count(&pool, "coupons").await
        ),
        (1, 0, 0)
    );
    shop.admin(
        "/admin/coupons",
        json!({"code": "Spring", "percent_off": "10"}),
    )
    .await;
    let (status, answer) = shop
        .post(
            "/admin/coupons",
            Some(ADMIN_TOKEN),
            json!({"code": "SPRING", "amount_off": "1.00", "currency": "BRL"}),
        )
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("coupon_code_taken")),
        "{answer}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_checkout_prices_on_the_server_and_makes_one_order_per_seller_and_kind(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let (a, b) = (shop.seller("A").await, shop.seller("B").await);
    let a1 = shop.product(&a, "10.00", "BRL").await;
    let b1 = shop.product(&b, "0.25", "BRL").await;
    let sub = shop
        .admin(
            "/admin/products",
            json!({"seller_id": a, "name": "club", "kind": "subscription", "price": "19.90", "currency": "BRL", "interval": "month"}),
        )
        .await;
    shop.admin(
        "/admin/coupons",
        json!({"code": "AONLY", "percent_off": "15", "seller_id": a}),
    )
    .await;
    let mut body = cart(&[(&a1, 2), (&b1, 1), (sub["id"].as_str().unwrap(), 1)]);
    body["coupon"] = json!("aonly");
    let (status, answer) = shop.checkout(Some("key-1"), body).await;
    assert_eq!(status, 201, "{answer}");
    let orders = answer["orders"].as_array().unwrap();
    let summary: Vec<String> = orders
        .iter()
        .map(|o| {
            [
                "number",
                "kind",
                "subtotal",
                "discount",
                "total",
                "platform_fee",
                "seller_net",
                "status",
            ]
            .iter()
            .map(|f| match &o[*f] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .collect::<Vec<_>>()
            .join(" ")
        })
        .collect();
    // The client's prices (0.01) are not read. 10 % fee, half-even: 10 % of 0.25 is 0.02.
    assert_eq!(
        summary,
        vec![
            "1 one_off 20.00 3.00 17.00 1.70 15.30 awaiting_payment",
            "2 one_off 0.25 0.00 0.25 0.02 0.23 awaiting_payment",
            "3 subscription 19.90 2.98 16.92 1.69 15.23 awaiting_payment",
        ]
    );
    for o in orders {
        let url = o["payment"]["url"].as_str().unwrap();
        let session = o["payment"]["session_id"].as_str().unwrap();
        assert_eq!(o["payment"]["gateway"], "internal");
        assert!(url.ends_with(&format!("/pay/{session}")), "{url}");
        // The payment page shows the order's amount.
        let page = reqwest::get(url).await.unwrap().text().await.unwrap();
        assert!(
            page.contains(&format!("{} BRL", o["total"].as_str().unwrap())),
            "{page}"
        );
        // A form that is not a decision gets the JSON error, and decides nothing.
        let answer = reqwest::Client::new()
            .post(url)
            .header("content-type", "application/x-www-form-urlencoded")
            .body("nonsense=1")
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 400);
        let answer: Value = answer.json().await.unwrap();
        assert_eq!(answer["error"]["code"], "invalid_form", "{answer}");
    }
    // An order number that is not one is a JSON 404 on the admin side too.
    let (status, answer) = shop
        .post("/admin/orders/abc/expire", Some(ADMIN_TOKEN), json!({}))
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (404, Some("not_found")),
        "{answer}"
    );
    // Order and payment state side by side.
    let first = shop.order(1).await;
    assert_eq!(
        (first["status"].as_str(), first["payment_status"].as_str()),
        (Some("awaiting_payment"), Some("pending"))
    );
    assert_eq!(first["items"][0]["quantity"], 2);
    let redemptions: i32 = sqlx::query_scalar("SELECT redemptions FROM coupons")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(redemptions, 2, "one per order the coupon applied to");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_idempotency_key_gives_the_first_answer_and_refuses_other_bodies(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    let (status, first) = shop.checkout(Some("same-key"), cart(&[(&p, 1)])).await;
    assert_eq!(status, 201, "{first}");
    // The same body, written differently (spacing, key order): the first answer.
    let (status, again) = shop
        .checkout(Some("same-key"), json!({"items": [{"quantity": 1, "price": "0.01", "product_id": p}], "gateway": "internal", "buyer_id": "buyer-1"}))
        .await;
    assert_eq!((status, &again), (201, &first));
    let (status, answer) = shop.checkout(Some("same-key"), cart(&[(&p, 2)])).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("idempotency_key_reused"))
    );
    // Another body that would be refused on its own: the key's refusal comes first, as it
    // does for any other body.
    let missing = "00000000-0000-4000-8000-000000000000";
    let (status, answer) = shop.checkout(Some("same-key"), cart(&[(missing, 1)])).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("idempotency_key_reused"))
    );
    let (status, answer) = shop.checkout(None, cart(&[(&p, 1)])).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (400, Some("missing_idempotency_key"))
    );
    // A first request still running holds its key.
    sqlx::query(
        "INSERT INTO idempotency_keys (owner, key, request_hash, locked_until)
         SELECT 'key:' || id, 'busy', $1, now() + interval '1 minute' FROM api_keys",
    )
    .bind(sha256_of(&cart(&[(&p, 1)])))
    .execute(&pool)
    .await
    .unwrap();
    let (status, answer) = shop.checkout(Some("busy"), cart(&[(&p, 1)])).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("idempotency_key_in_use"))
    );
    // One that crashed lets go after its lock: the repeat does the work.
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' WHERE key = 'busy'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (status, answer) = shop.checkout(Some("busy"), cart(&[(&p, 1)])).await;
    assert_eq!(status, 201, "{answer}");
    assert_eq!(count(&pool, "orders").await, 2);
}

fn sha256_of(body: &Value) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(body.to_string().as_bytes()).to_vec()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn bad_carts_get_their_422_and_store_nothing(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    let s = shop.seller("A").await;
    let brl = shop.product(&s, "5.00", "BRL").await;
    let usd = shop.product(&s, "5.00", "USD").await;
    let huge = shop.product(&s, "999999999999.00", "BRL").await;
    shop.admin(
        "/admin/coupons",
        json!({"code": "OLD", "percent_off": "10", "valid_until": "2020-01-01T00:00:00Z"}),
    )
    .await;
    let with_coupon = |code: &str| {
        let mut c = cart(&[(&brl, 1)]);
        c["coupon"] = json!(code);
        c
    };
    let mut other_gateway = cart(&[(&brl, 1)]);
    other_gateway["gateway"] = json!("paypal");
    let mut control_buyer = cart(&[(&brl, 1)]);
    control_buyer["buyer_id"] = json!("buyer\u{1b}[2J");
    for (body, code) in [
        (cart(&[]), "invalid_items"),
        (cart(&[(&brl, 0)]), "invalid_items"),
        (cart(&[(&brl, -3)]), "invalid_items"),
        (cart(&[(&brl, 1), (&usd, 1)]), "invalid_items"),
        (cart(&[(&huge, 2)]), "invalid_items"),
        (
            cart(&[("00000000-0000-0000-0000-000000000000", 1)]),
            "unknown_product",
        ),
        (cart(&[("not-an-id", 1)]), "unknown_product"),
        (with_coupon("NOPE"), "coupon_unavailable"),
        (with_coupon("OLD"), "coupon_unavailable"),
        (other_gateway, "gateway_unavailable"),
        (control_buyer, "invalid_request"),
        (with_coupon("OLD\n"), "coupon_unavailable"),
    ] {
        let (status, answer) = shop.checkout(Some("k"), body.clone()).await;
        assert_eq!(
            (status, answer["error"]["code"].as_str()),
            (422, Some(code)),
            "{body}: {answer}"
        );
    }
    let (status, _) = shop.checkout(Some("k"), json!({"items": "many"})).await;
    assert_eq!(status, 400);
    for table in [
        "orders",
        "checkouts",
        "idempotency_keys",
        "order_items",
        "jobs",
    ] {
        assert_eq!(count(&pool, table).await, 0, "{table}");
    }
    // The key was not used up by the refusals.
    let (status, answer) = shop.checkout(Some("k"), cart(&[(&brl, 1)])).await;
    assert_eq!(status, 201, "{answer}");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn retries_racing_a_refused_checkout_on_its_key_are_each_refused_never_a_500(pool: PgPool) {
    // A refusal lets its key go (deletes it) at once: a retry that found the key taken must
    // not then trip over its absence. The cart is one a coupon makes free, refused after the
    // key is claimed and the catalogue read, as a backend's retries race their first request.
    let shop = Arc::new(shop(pool.clone()).await);
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    shop.admin(
        "/admin/coupons",
        json!({"code": "FREE", "amount_off": "5.00", "currency": "BRL"}),
    )
    .await;
    let mut body = cart(&[(&p, 1)]);
    body["coupon"] = json!("FREE");
    // Eight backends each retrying the one key, so that some request is always between its
    // attempt to claim the key and its read of it when another's refusal lets the key go.
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (shop, body) = (shop.clone(), body.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for _ in 0..40 {
                    answers.push(shop.checkout(Some("k"), body.clone()).await);
                }
                answers
            })
        })
        .collect();
    let mut refused = 0;
    for t in tasks {
        for (status, answer) in t.await.unwrap() {
            let code = answer["error"]["code"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            match (status, code.as_str()) {
                (422, "invalid_items") => refused += 1,
                (409, "idempotency_key_in_use") => {}
                _ => panic!("{status} {answer}"),
            }
        }
    }
    assert!(refused > 0);
    assert_eq!(count(&pool, "orders").await, 0);
    assert_eq!(
        count(&pool, "idempotency_keys").await,
        0,
        "every refusal let its key go"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn concurrent_checkouts_number_orders_without_gaps_and_never_pass_a_coupon_limit(
    pool: PgPool,
) {
    let shop = Arc::new(shop(pool.clone()).await);
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    shop.admin(
        "/admin/coupons",
        json!({"code": "FIVE", "percent_off": "50", "max_redemptions": 5}),
    )
    .await;
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let (shop, p) = (shop.clone(), p.clone());
            tokio::spawn(async move {
                let mut body = cart(&[(&p, 1)]);
                // Half try the coupon; a refused one must not use up a number.
                if i % 2 == 0 {
                    body["coupon"] = json!("FIVE");
                }
                shop.checkout(Some(&format!("key-{i}")), body).await
            })
        })
        .collect();
    let mut used_coupon = 0;
    let mut refused = 0;
    for t in tasks {
        let (status, answer) = t.await.unwrap();
        match status {
            201 if answer["orders"][0]["discount"] == "2.50" => used_coupon += 1,
            201 => {}
            422 => {
                assert_eq!(answer["error"]["code"], "coupon_unavailable", "{answer}");
                refused += 1;
            }
            other => panic!("{other}: {answer}"),
        }
    }
    assert_eq!((used_coupon, refused), (5, 7));
    let numbers: Vec<i64> = sqlx::query_scalar("SELECT number FROM orders ORDER BY number")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(numbers, (1..=17).collect::<Vec<_>>());
    let redemptions: i32 = sqlx::query_scalar("SELECT redemptions FROM coupons")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(redemptions, 5);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn without_the_payment_side_the_buyer_gets_a_503_and_the_order_waits(pool: PgPool) {
    let mut config = test_config();
    // The buyer waits this long, then hears 503.
    config.messaging.rpc_timeout = Duration::from_secs(3);
    // Only the order side runs: nobody answers payment-link requests.
    let receiver = Shop {
        app: Arc::new(spawn_app_with(pool.clone(), config.clone()).await),
    };
    let s = receiver.seller("A").await;
    let p = receiver.product(&s, "5.00", "BRL").await;
    tokio::time::sleep(Duration::from_millis(500)).await; // the RPC client's channel
    let started = Instant::now();
    let (status, answer) = receiver.checkout(Some("k"), cart(&[(&p, 1)])).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (503, Some("payment_link_unavailable")),
        "{answer}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    let order = receiver.order(1).await;
    assert_eq!(
        (order["status"].as_str(), &order["payment"]),
        (Some("awaiting_payment"), &Value::Null)
    );

    // The payment side comes up (a worker process): the same request gets the links.
    let _workers = spawn_roles(pool.clone(), config, Roles::WORK).await;
    let mut answer = Value::Null;
    for _ in 0..50 {
        let (status, a) = receiver.checkout(Some("k"), cart(&[(&p, 1)])).await;
        answer = a;
        if status == 201 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        answer["orders"][0]["payment"]["url"].is_string(),
        "{answer}"
    );
    assert_eq!(count(&pool, "orders").await, 1);
    // Asking again for the same order gives the same session.
    let (status, reopened) = receiver.post("/orders/1/payment", None, json!({})).await;
    assert_eq!(status, 200, "{reopened}");
    assert_eq!(reopened["payment"], answer["orders"][0]["payment"]);
    assert_eq!(count(&pool, "payment_sessions").await, 1);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn both_sides_of_the_rpc_survive_losing_the_broker(pool: PgPool) {
    let amqp = TcpProxy::start("127.0.0.1:5672").await;
    let mut config = test_config();
    config.amqp_url =
        payfleet::secret::SecretUrl::new(format!("amqp://guest:guest@{}/%2f", amqp.addr));
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config).await),
    };
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    let until_created = async |key: &str| {
        let start = Instant::now();
        loop {
            let (status, answer) = shop.checkout(Some(key), cart(&[(&p, 1)])).await;
            if status == 201 {
                return answer;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{status}: {answer}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    until_created("before").await;
    // The broker goes away (every connection cut, the port closed): the buyer hears it at once.
    amqp.set(Link::Refused);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, answer) = shop.checkout(Some("during"), cart(&[(&p, 1)])).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (503, Some("payment_link_unavailable")),
        "{answer}"
    );
    // Back: both sides reconnect by themselves and the kept order gets its link.
    amqp.set(Link::Up);
    let answer = until_created("during").await;
    assert!(answer["orders"][0]["payment"]["url"].is_string());
    until_created("after").await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_unpaid_order_expires_once_and_reopening_moves_its_one_expiry_job(pool: PgPool) {
    let mut config = test_config();
    config.orders.expiry = Duration::from_secs(2);
    let shop = Shop {
        app: Arc::new(spawn_app_with(pool.clone(), config.clone()).await),
    };
    // The payment side answers links; the queues are stepped by hand.
    let _links = payment_side(&pool, &shop.app.config);
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    shop.admin(
        "/admin/coupons",
        json!({"code": "ONE", "percent_off": "10", "max_redemptions": 1}),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut body = cart(&[(&p, 1)]);
    body["coupon"] = json!("ONE");
    let (status, answer) = shop.checkout(Some("k"), body.clone()).await;
    assert_eq!(status, 201, "{answer}");
    let expiry_jobs = async || -> Vec<(String, f64)> {
        sqlx::query_as("SELECT state, extract(epoch FROM run_at - now())::float8 FROM jobs WHERE key = 'order_expiry:1'")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    let jobs = expiry_jobs().await;
    assert_eq!(jobs.len(), 1);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // Reopened a second later: the same job, two seconds from now again.
    let (status, order) = shop.post("/orders/1/payment", None, json!({})).await;
    assert_eq!(
        (status, order["status"].as_str()),
        (200, Some("awaiting_payment"))
    );
    let jobs = expiry_jobs().await;
    assert_eq!(jobs.len(), 1, "scheduling again replaced the job");
    assert!(jobs[0].1 > 1.5, "{jobs:?}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    step(&pool, &config, "orders").await;
    assert_eq!(
        shop.order(1).await["status"],
        "awaiting_payment",
        "its old time passed: not expired"
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    step(&pool, &config, "orders").await;
    let order = shop.order(1).await;
    assert_eq!(order["status"], "expired");
    let (status, answer) = shop.post("/orders/1/payment", None, json!({})).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("order_not_payable"))
    );
    // Its coupon redemption is back: another buyer can use it.
    let redemptions: i32 = sqlx::query_scalar("SELECT redemptions FROM coupons")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(redemptions, 0);
    let (status, answer) = shop.checkout(Some("k2"), body).await;
    assert_eq!(status, 201, "{answer}");
    let events: Vec<String> = sqlx::query_scalar(
        "SELECT e.kind FROM order_events e JOIN orders o ON o.id = e.order_id WHERE o.number = 1 ORDER BY e.id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(events, vec!["created", "reopened", "expired"]);
}

/// Runs the payment side's RPC consumer (not the workers) for `config`'s queues.
pub fn payment_side(
    pool: &PgPool,
    config: &payfleet::config::Config,
) -> tokio::task::JoinHandle<()> {
    let broker = payfleet::messaging::Broker::start(
        config.amqp_url.clone(),
        &config.messaging.namespace,
        config.messaging.queue_ttl_ms,
    );
    let (gateways, _) = payfleet::startup::gateways(config, pool).unwrap();
    let links = Arc::new(payfleet::payments::links::LinkService {
        pool: pool.clone(),
        gateways,
        in_flight: Default::default(),
    });
    payfleet::payments::links::serve(&broker, links, 4);
    // Kept (with the broker) until the test ends.
    tokio::spawn(async move {
        let _broker = broker;
        std::future::pending::<()>().await
    })
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn checkouts_written_together_each_keep_their_own_orders_refusals_and_keys(pool: PgPool) {
    let shop = Arc::new(shop(pool.clone()).await);
    let (a, b) = (shop.seller("A").await, shop.seller("B").await);
    let (pa, pb) = (
        shop.product(&a, "5.00", "BRL").await,
        shop.product(&b, "7.00", "BRL").await,
    );
    let missing = "00000000-0000-4000-8000-000000000000";
    // Thirty checkouts at once (the writer takes them in batches): some for one seller, some
    // for two (two orders), some for a product that does not exist; one key sent twice.
    let tasks: Vec<_> = (0..31)
        .map(|i| {
            let (shop, pa, pb) = (shop.clone(), pa.clone(), pb.clone());
            tokio::spawn(async move {
                let n = if i == 30 { 3 } else { i };
                let mut body = match n % 5 {
                    0 => cart(&[(missing, 1)]),
                    1 => cart(&[(&pa, 1), (&pb, 2)]),
                    _ => cart(&[(&pa, n)]),
                };
                body["buyer_id"] = json!(format!("buyer-{n}"));
                let (status, answer) = shop.checkout(Some(&format!("key-{n}")), body).await;
                (n, status, answer)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let mut orders_answered = 0;
    for (n, status, answer) in &answers {
        match (n % 5, *status) {
            (0, 422) => assert_eq!(answer["error"]["code"], "unknown_product", "{answer}"),
            (1, 201) => {
                assert_eq!(answer["orders"].as_array().unwrap().len(), 2, "{answer}");
                orders_answered += 2;
            }
            (_, 201) => {
                let o = &answer["orders"][0];
                assert_eq!(o["buyer_id"], format!("buyer-{n}"), "{answer}");
                assert_eq!(
                    o["total"].as_str().unwrap(),
                    format!("{}.00", 5 * n),
                    "{answer}"
                );
                orders_answered += 1;
            }
            // The same key twice at once: the second waits for the first or is told it runs.
            (_, 409) if *n == 3 => {
                assert_eq!(answer["error"]["code"], "idempotency_key_in_use")
            }
            other => panic!("{other:?}: {answer}"),
        }
    }
    // The repeat of key-3 answered the same orders, or 409: the orders exist once.
    let key3: Vec<&Value> = answers
        .iter()
        .filter(|(n, s, _)| *n == 3 && *s == 201)
        .map(|(_, _, a)| a)
        .collect();
    assert!(key3.windows(2).all(|w| w[0] == w[1]), "{key3:?}");
    let orders_answered = orders_answered - (key3.len() as i64 - 1);
    let numbers: Vec<i64> = sqlx::query_scalar("SELECT number FROM orders ORDER BY number")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        numbers,
        (1..=orders_answered).collect::<Vec<_>>(),
        "no gaps"
    );
    // Every order sits in the checkout its key names, with its buyer; a refused key is free.
    let mismatched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM orders o JOIN idempotency_keys k ON k.checkout_id = o.checkout_id
         WHERE o.buyer_id <> 'buyer-' || split_part(k.key, '-', 2)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(mismatched, 0);
    let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys ORDER BY key")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(keys.len(), 24, "the six refused keys are free: {keys:?}");
    assert!(keys.iter().all(|k| !k.ends_with('0') && !k.ends_with('5')));
    assert_eq!(count(&pool, "checkouts").await, 24);
    let expiries: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'expire_order'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(expiries, orders_answered, "one expiry job per order");
    // Their links and answers were stored together too: every order has its link, every key
    // its answer, unlocked, the very answer its request was given.
    assert_eq!(
        count_where(&pool, "orders", "session_id IS NULL OR payment_url IS NULL").await,
        0
    );
    for (n, status, answer) in &answers {
        if *status != 201 {
            continue;
        }
        let (stored, locked, checkout): (Option<Value>, Option<String>, i64) = sqlx::query_as(
            "SELECT response, locked_by, checkout_id FROM idempotency_keys WHERE key = $1",
        )
        .bind(format!("key-{n}"))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(stored.as_ref(), Some(answer), "key-{n}");
        assert_eq!(locked, None, "key-{n}");
        // The answer, built from the orders as the batch wrote them, is what reading them back
        // gives.
        let read = payfleet::orders::checkout::CheckoutAnswer {
            orders: payfleet::orders::of_checkout(&pool, checkout)
                .await
                .unwrap(),
        };
        assert_eq!(&serde_json::to_value(read).unwrap(), answer, "key-{n}");
    }
}

/// Twelve checkouts at once of one 5.00 BRL product (keys `key-0` to `key-11`, buyer `boom` for
/// `key-5`), with a rule of the schema the code cannot see coming: a trigger `when` (`BEFORE
/// INSERT ON checkouts`, say) refuses the row for which `refuses` holds. Only `key-5` fails
/// (500); the eleven others are answered.
async fn twelve_at_once_one_refused(pool: &PgPool, when: &str, refuses: &str) {
    let shop = Arc::new(shop(pool.clone()).await);
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF {refuses} THEN
                 RAISE EXCEPTION 'no' USING ERRCODE = 'check_violation';
             END IF;
             RETURN NEW;
         END $$"
    )))
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TRIGGER refuse_one {when} FOR EACH ROW EXECUTE FUNCTION refuse_one()"
    )))
    .execute(pool)
    .await
    .unwrap();
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let (shop, p) = (shop.clone(), p.clone());
            tokio::spawn(async move {
                let mut body = cart(&[(&p, 1)]);
                if i == 5 {
                    body["buyer_id"] = json!("boom");
                }
                shop.checkout(Some(&format!("key-{i}")), body).await.0
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert_eq!(statuses[5], 500, "{statuses:?}");
    assert_eq!(
        statuses.iter().filter(|s| **s == 201).count(),
        11,
        "{statuses:?}"
    );
}

/// Answers are stored many to a statement: one that fails its batch (a rule of the schema the
/// code cannot see coming) is stored alone, where only it fails, and lets its key go.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn an_answer_that_fails_its_batch_is_stored_alone_and_holds_up_no_other(pool: PgPool) {
    twelve_at_once_one_refused(
        &pool,
        "BEFORE UPDATE ON idempotency_keys",
        "NEW.key = 'key-5' AND NEW.response IS NOT NULL",
    )
    .await;
    // Its order is kept without its link (the failed statement stored nothing), its key free
    // for the same request again.
    let (response, locked, link): (Option<Value>, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT k.response, k.locked_by, o.session_id FROM idempotency_keys k
             JOIN orders o ON o.checkout_id = k.checkout_id WHERE k.key = 'key-5'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((response, locked, link), (None, None, None));
    assert_eq!(
        count_where(&pool, "orders", "session_id IS NULL").await,
        1,
        "the other eleven have their links"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_checkout_that_fails_its_batch_is_written_alone_and_holds_up_no_other(pool: PgPool) {
    twelve_at_once_one_refused(&pool, "BEFORE INSERT ON checkouts", "NEW.buyer_id = 'boom'").await;
    let numbers: Vec<i64> = sqlx::query_scalar("SELECT number FROM orders ORDER BY number")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(numbers, (1..=11).collect::<Vec<_>>(), "no gaps");
}

/// The broker's side is counted: a checkout's payment link is one RPC call answered, and its
/// order's messages are published and confirmed, once each.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn rpc_calls_and_order_messages_are_counted(pool: PgPool) {
    let shop = shop(pool.clone()).await;
    shop.one_order("20.00").await;
    wait_for(
        "the order's messages to be published",
        std::time::Duration::from_secs(20),
        async || {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM order_events WHERE published_at IS NULL",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM order_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(events >= 1);
    let text = shop.app.metrics().await;
    let value = |series: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    };
    assert_eq!(
        value("payfleet_rpc_calls_total{rpc=\"payment_links\",result=\"answered\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        value("payfleet_amqp_messages_total{event=\"published\"}"),
        events as f64,
        "{text}"
    );
    assert_eq!(
        value("payfleet_amqp_messages_total{event=\"confirmed\"}"),
        events as f64,
        "{text}"
    );
}

/// Payment links asked while others are on their way travel together (one request message
/// each way, the payment side's statements once for many), and each checkout still gets its
/// own order's link.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn payment_links_asked_at_once_are_made_together_each_for_its_own_order(pool: PgPool) {
    let shop = Arc::new(shop(pool.clone()).await);
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    for (i, status, answer) in checkouts_at_once(&shop, &p, 30).await {
        assert_eq!(status, 201, "{answer}");
        let order = &answer["orders"][0];
        assert_eq!(order["total"], format!("{}.00", 5 * i), "{answer}");
        // The link answered is the one the payment side keeps for this order, at its amount.
        let (session, url, amount): (String, String, String) = sqlx::query_as(
            "SELECT session_id, url, amount::text FROM payment_sessions WHERE order_number = $1",
        )
        .bind(order["number"].as_i64().unwrap())
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(order["payment"]["session_id"], session.as_str(), "{answer}");
        assert_eq!(order["payment"]["url"], url.as_str(), "{answer}");
        assert_eq!(amount, format!("{}.0000", 5 * i));
    }
    assert_eq!(count(&pool, "payment_sessions").await, 30);
    assert_eq!(count(&pool, "internal_payments").await, 30);
    // Made together: the sessions were written by fewer statements (transactions) than links.
    let writes: i64 = sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM payment_sessions")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(writes < 30, "{writes} transactions wrote 30 sessions");
    // Each link is still counted as a call answered.
    let text = shop.app.metrics().await;
    assert!(
        text.contains("payfleet_rpc_calls_total{rpc=\"payment_links\",result=\"answered\"} 30"),
        "{text}"
    );
}

/// One session the database refuses fails only its own checkout (its order kept without a
/// link): the batch it was made in (by the gateway) is made again one by one.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_session_that_fails_its_batch_is_made_alone_and_holds_up_no_other(pool: PgPool) {
    // The gateway's refusal is not one that asking again mends: 422.
    let (shop, p) =
        twelve_links_one_refused(&pool, "internal_payments", (422, "payment_link_refused")).await;
    assert_eq!(count(&pool, "internal_payments").await, 11);
    assert_eq!(count(&pool, "payment_sessions").await, 11);
    // A refused request changes nothing: its order ended at once (not after its half hour)...
    let ended = "session_id IS NULL AND status = 'expired' AND expired_at IS NOT NULL";
    assert_eq!(count_where(&pool, "orders", ended).await, 1);
    assert_eq!(
        count_where(&pool, "orders", "status = 'awaiting_payment'").await,
        11
    );
    // ... and its key is free: the same request again is a new checkout (refused again here).
    let (status, answer) = shop.checkout(Some("key-7"), cart(&[(&p, 7)])).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("payment_link_refused")),
        "{answer}"
    );
    assert_eq!(count_where(&pool, "orders", ended).await, 2);
}

/// The same when the payment side's own record of the sessions refuses one: stored again one
/// by one, and that checkout told to ask again (503).
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_session_that_fails_its_batch_is_stored_alone_and_holds_up_no_other(pool: PgPool) {
    twelve_links_one_refused(&pool, "payment_sessions", (503, "payment_link_unavailable")).await;
    assert_eq!(count(&pool, "internal_payments").await, 12);
    assert_eq!(count(&pool, "payment_sessions").await, 11);
}

/// Twelve checkouts at once, the one of 35.00 refused by `table`'s trigger and answered
/// `refused` (status and code).
async fn twelve_links_one_refused(
    pool: &PgPool,
    table: &str,
    refused: (u16, &str),
) -> (Arc<Shop>, String) {
    let shop = Arc::new(shop(pool.clone()).await);
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.amount = 35 THEN
                 RAISE EXCEPTION 'no' USING ERRCODE = 'check_violation';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_one BEFORE INSERT ON {table}
             FOR EACH ROW EXECUTE FUNCTION refuse_one();"
    )))
    .execute(pool)
    .await
    .unwrap();
    for (i, status, answer) in checkouts_at_once(&shop, &p, 12).await {
        if i == 7 {
            assert_eq!(
                (status, answer["error"]["code"].as_str()),
                (refused.0, Some(refused.1)),
                "{answer}"
            );
        } else {
            assert_eq!(status, 201, "{answer}");
            assert!(
                answer["orders"][0]["payment"]["url"].is_string(),
                "{answer}"
            );
        }
    }
    assert_eq!(count_where(pool, "orders", "session_id IS NULL").await, 1);
    (shop, p)
}

/// The payment side answers a batch of links each in its place: a session stored before is
/// given again (not made twice), one order asked twice in a batch is one session, and a gateway
/// not enabled refuses only its own.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_payment_side_answers_a_batch_of_links_each_in_its_place(pool: PgPool) {
    use payfleet::gateways::GatewayName;
    use payfleet::messaging::rpc::{PaymentLinkReply, PaymentLinkRequest};
    let config = test_config();
    let (gateways, _) = payfleet::startup::gateways(&config, &pool).unwrap();
    let enabled = gateways.names();
    let disabled = [
        GatewayName::Stripe,
        GatewayName::MercadoPago,
        GatewayName::Razorpay,
        GatewayName::Mock,
    ]
    .into_iter()
    .find(|g| !enabled.contains(g))
    .expect("a gateway the tests do not enable");
    let service = payfleet::payments::links::LinkService {
        pool: pool.clone(),
        gateways,
        in_flight: Default::default(),
    };
    let request = |number: i64, amount: &str, gateway: GatewayName| PaymentLinkRequest {
        order_number: number,
        gateway,
        amount: payfleet::money::Money::parse(amount, "BRL").unwrap(),
        platform_fee: payfleet::money::Money::parse("1.00", "BRL").unwrap(),
        seller_id: "seller".into(),
        seller_account: None,
        buyer_id: "buyer".into(),
        description: format!("Order {number}"),
        recurring_interval: None,
        attempt: 1,
        link_key: format!("key-{number}"),
        expires_at: chrono::Utc::now() + chrono::Duration::minutes(30),
        renews_at: None,
        renews_fee: None,
        answer_within_ms: None,
    };
    let created = |reply: &PaymentLinkReply| match reply {
        PaymentLinkReply::Created { session_id, .. } => session_id.clone(),
        other => panic!("{other:?}"),
    };
    let first = created(
        &service
            .link(request(1, "10.00", GatewayName::Internal))
            .await,
    );
    let replies = service
        .links(vec![
            request(2, "20.00", GatewayName::Internal),
            request(1, "10.00", GatewayName::Internal),
            request(3, "30.00", disabled),
            request(4, "40.00", GatewayName::Internal),
            request(4, "40.00", GatewayName::Internal),
        ])
        .await;
    assert_eq!(replies.len(), 5);
    let two = created(&replies[0]);
    assert_eq!(created(&replies[1]), first, "the stored session, again");
    assert!(
        matches!(&replies[2], PaymentLinkReply::Failed { code, retryable: false, .. } if code == "gateway_unavailable"),
        "{:?}",
        replies[2]
    );
    let four = created(&replies[3]);
    assert_eq!(
        created(&replies[4]),
        four,
        "one order asked twice: one session"
    );
    assert!(two != first && two != four && four != first);
    let kept: Vec<(i64, String, String)> = sqlx::query_as(
        "SELECT s.order_number, s.session_id, s.amount::text FROM payment_sessions s
         JOIN internal_payments p USING (session_id) ORDER BY s.order_number",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        kept,
        vec![
            (1, first, "10.0000".into()),
            (2, two, "20.0000".into()),
            (4, four, "40.0000".into()),
        ]
    );
    assert_eq!(count(&pool, "internal_payments").await, 3);
}

/// `n` checkouts sent at once, the i-th (from 1) for `i` of `product` under key `key-i`: each
/// with its status and answer, in order.
async fn checkouts_at_once(shop: &Arc<Shop>, product: &str, n: i64) -> Vec<(i64, u16, Value)> {
    let tasks: Vec<_> = (1..=n)
        .map(|i| {
            let (shop, p) = (shop.clone(), product.to_owned());
            tokio::spawn(async move {
                let (status, answer) = shop
                    .checkout(Some(&format!("key-{i}")), cart(&[(&p, i)]))
                    .await;
                (i, status, answer)
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(tasks.len());
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    answers
}

/// A statement that never returns (here the order counter held by a transaction that never
/// ends: a lock waited on, as after a failover a connection left half-open) does not hold the
/// buyer for ever, nor the checkouts behind it: each hears 503 by the checkout's deadline,
/// its key is let go, and once the database answers again the same request is served.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_checkout_whose_statement_never_returns_gets_a_503_in_time(pool: PgPool) {
    let mut config = test_config();
    config.messaging.rpc_timeout = Duration::from_secs(1);
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config).await),
    };
    let s = shop.seller("A").await;
    let p = shop.product(&s, "5.00", "BRL").await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT last FROM order_numbers FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let started = Instant::now();
    let answers = futures_util::future::join_all(
        ["k1", "k2"].map(|k| shop.checkout(Some(k), cart(&[(&p, 1)]))),
    )
    .await;
    for (status, answer) in &answers {
        assert_eq!(
            (*status, answer["error"]["code"].as_str()),
            (503, Some("unavailable")),
            "{answer}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    holder.rollback().await.unwrap();
    // The database answers again: a new checkout is served at once (the writer was not left
    // stuck), and the same request too, once the key its first statement claimed late (it
    // committed when the counter came free) has let go, as a crashed request's does.
    let (status, answer) = shop.checkout(Some("k3"), cart(&[(&p, 1)])).await;
    assert_eq!(status, 201, "{answer}");
    let mut served = (0, Value::Null);
    for _ in 0..200 {
        served = shop.checkout(Some("k1"), cart(&[(&p, 1)])).await;
        if served.0 == 201 {
            break;
        }
        assert_eq!(served.0, 409, "{}", served.1);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(served.0, 201, "{}", served.1);
}
