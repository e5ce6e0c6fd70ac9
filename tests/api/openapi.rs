//! The OpenAPI description: the committed `docs/openapi.json` is what this build describes and
//! serves, it names every route, and real answers of the running fleet hold to it: every status
//! an operation answers is one it lists, every JSON body validates against its schema (by an
//! independent JSON Schema 2020-12 validator, formats checked, no property the schema does not
//! name), and every error code is one that status lists.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use payfleet::http::openapi::document;
use reqwest::Method;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::helpers::*;

fn committed() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("docs/openapi.json")).unwrap()
}

#[test]
fn the_committed_description_is_this_builds() {
    assert!(
        committed() == document(),
        "docs/openapi.json is not what this build describes: \
         `cargo run --quiet -- openapi > docs/openapi.json` refreshes it"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_receiver_serves_it_to_anyone_and_describes_every_route(pool: PgPool) {
    let app = spawn_app(pool).await;
    let resp = app
        .anon
        .get(format!("http://{}/openapi.json", app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let served: Value = resp.json().await.unwrap();
    assert!(served == committed(), "served and committed differ");
    let described: BTreeSet<&str> = served["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let routed: BTreeSet<&str> = app.paths().iter().copied().collect();
    assert_eq!(
        described, routed,
        "the description's paths are the router's, no more, no fewer"
    );
}

/// The description as a validator reads it: every object schema that is not composed into
/// another (`allOf`) refuses properties it does not name, so an answer cannot grow fields the
/// description lacks.
fn strict(mut doc: Value) -> Value {
    let text = doc.to_string();
    let composed: BTreeSet<String> = doc["components"]["schemas"]
        .as_object()
        .unwrap()
        .keys()
        .filter(|name| {
            text.contains(&format!(
                "\"allOf\":[{{\"$ref\":\"#/components/schemas/{name}\"}}"
            ))
        })
        .cloned()
        .collect();
    for (name, schema) in doc["components"]["schemas"].as_object_mut().unwrap() {
        if schema.get("properties").is_some() && !composed.contains(name) {
            schema["unevaluatedProperties"] = json!(false);
        }
    }
    doc["$schema"] = json!("https://json-schema.org/draft/2020-12/schema");
    doc
}

/// Answers checked against the description, and what they covered.
struct Checker {
    doc: Value,
    validators: BTreeMap<String, jsonschema::Validator>,
    /// (method path, status, error code) seen.
    seen: BTreeSet<(String, u16, String)>,
}

fn pointer_escape(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

impl Checker {
    fn new() -> Self {
        Self {
            doc: strict(committed()),
            validators: BTreeMap::new(),
            seen: BTreeSet::new(),
        }
    }

    /// Checks one answer of `method route` (the route's template): what is wrong with it, if
    /// anything.
    fn check(
        &mut self,
        method: &Method,
        route: &str,
        status: u16,
        content_type: &str,
        body: &str,
    ) -> Result<(), String> {
        let op = format!(
            "/paths/{}/{}",
            pointer_escape(route),
            method.as_str().to_ascii_lowercase()
        );
        let what = format!("{method} {route} answered {status}");
        let response = self
            .doc
            .pointer(&format!("{op}/responses/{status}"))
            .ok_or_else(|| format!("{what}, a status its description does not list: {body}"))?
            .clone();
        let mut code = String::new();
        if let Some(content) = response.get("content") {
            let media = content_type.split(';').next().unwrap_or_default().trim();
            let declared = content
                .as_object()
                .unwrap()
                .keys()
                .any(|k| k.split(';').next().unwrap().trim() == media);
            if !declared {
                return Err(format!(
                    "{what} as {content_type}, not as described: {content}"
                ));
            }
            if media == "application/json" {
                let instance: Value = serde_json::from_str(body)
                    .map_err(|e| format!("{what}: not JSON ({e}): {body}"))?;
                // A URI fragment: the template's braces percent-encoded.
                let at = format!(
                    "#{op}/responses/{status}/content/{}/schema",
                    pointer_escape("application/json")
                )
                .replace('{', "%7B")
                .replace('}', "%7D");
                if !self.validators.contains_key(&at) {
                    let mut schema = self.doc.clone();
                    schema["$ref"] = json!(at);
                    let validator = jsonschema::draft202012::options()
                        .should_validate_formats(true)
                        .build(&schema)
                        .map_err(|e| format!("{what}: its schema does not compile: {e}"))?;
                    self.validators.insert(at.clone(), validator);
                }
                let errors: Vec<String> = self.validators[&at]
                    .iter_errors(&instance)
                    .map(|e| format!("{} at {}", e, e.instance_path()))
                    .collect();
                if !errors.is_empty() {
                    return Err(format!(
                        "{what}, not as described: {errors:#?}\n{instance:#}"
                    ));
                }
                code = instance["error"]["code"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
            }
        }
        self.seen
            .insert((format!("{method} {route}"), status, code));
        Ok(())
    }
}

#[test]
fn the_checker_refuses_what_the_description_does_not_say() {
    let mut c = Checker::new();
    let json = "application/json";
    let get = Method::GET;
    c.check(&get, "/healthz", 200, json, r#"{"status":"ok"}"#)
        .unwrap();
    let refused = [
        (
            "/healthz",
            418,
            json,
            r#"{"status":"ok"}"#,
            "a status it does not list",
        ),
        ("/healthz", 200, json, r#"{"status":5}"#, "a wrong type"),
        ("/healthz", 200, json, r#"{}"#, "a missing property"),
        (
            "/healthz",
            200,
            json,
            r#"{"status":"ok","extra":1}"#,
            "a property it does not name",
        ),
        (
            "/healthz",
            200,
            "text/html",
            "<p>ok</p>",
            "another media type",
        ),
        (
            "/orders/{number}",
            404,
            json,
            r#"{"error":{"code":"forbidden","message":"m"}}"#,
            "an error code that status does not list",
        ),
        (
            "/orders/{number}",
            200,
            json,
            r#"{"number":1}"#,
            "an order missing its fields",
        ),
        (
            "/sellers/{id}/balances",
            200,
            json,
            r#"{"seller_id":"not-a-uuid","balances":[]}"#,
            "a malformed id",
        ),
    ];
    for (route, status, content_type, body, why) in refused {
        assert!(
            c.check(&get, route, status, content_type, body).is_err(),
            "{why} passed: {route} {status} {body}"
        );
    }
}

impl Checker {
    /// The described route a concrete path takes (`/orders/12` is `/orders/{number}`), with
    /// `method`: of those that match, the one with the most fixed segments, as the router
    /// picks. None for a path the description has no route for (the fallback's 404).
    fn route_of(&self, method: &Method, path: &str) -> Option<String> {
        let path = path.split('?').next().unwrap_or_default();
        let segments: Vec<&str> = path.split('/').collect();
        let method = method.as_str().to_ascii_lowercase();
        self.doc["paths"]
            .as_object()?
            .iter()
            .filter(|(_, item)| item.get(&method).is_some())
            .filter_map(|(template, _)| {
                let parts: Vec<&str> = template.split('/').collect();
                let fits = parts.len() == segments.len()
                    && parts
                        .iter()
                        .zip(&segments)
                        .all(|(p, s)| p.starts_with('{') || p == s);
                fits.then(|| {
                    let fixed = parts.iter().filter(|p| !p.starts_with('{')).count();
                    (fixed, template.clone())
                })
            })
            .max()
            .map(|(_, t)| t)
    }
}

/// The suite's helpers check every answer they read against the description too (a path the
/// description has no route for, the fallback's, is left to its test).
pub fn check_answer(method: &Method, path: &str, status: u16, content_type: &str, body: &str) {
    static CHECKER: std::sync::LazyLock<std::sync::Mutex<Checker>> =
        std::sync::LazyLock::new(|| std::sync::Mutex::new(Checker::new()));
    let mut checker = CHECKER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(route) = checker.route_of(method, path) else {
        return;
    };
    if let Err(e) = checker.check(method, &route, status, content_type, body) {
        panic!("{e}");
    }
}

#[test]
fn concrete_paths_take_their_routes() {
    let c = Checker::new();
    let route = |m: Method, p: &str| c.route_of(&m, p);
    assert_eq!(
        route(Method::GET, "/orders/12").as_deref(),
        Some("/orders/{number}")
    );
    assert_eq!(
        route(Method::GET, "/orders/paid").as_deref(),
        Some("/orders/paid")
    );
    assert_eq!(
        route(Method::GET, "/sellers/x/ledger?limit=2").as_deref(),
        Some("/sellers/{id}/ledger")
    );
    assert_eq!(route(Method::DELETE, "/orders/12"), None);
    assert_eq!(route(Method::GET, "/nowhere"), None);
}

/// A caller of the running fleet whose every answer is checked.
struct Tour {
    app: Arc<TestApp>,
    checker: std::sync::Mutex<Checker>,
}

struct Call<'a> {
    method: Method,
    route: &'a str,
    path: String,
    bearer: Option<String>,
    headers: Vec<(String, String)>,
    body: Option<(String, &'static str)>,
    /// A source address of its own (the receiver trusts `x-forwarded-for` here), so that the
    /// tour's own failures never lock its other calls out.
    from: Option<String>,
}

impl<'a> Call<'a> {
    fn new(method: Method, route: &'a str, path: impl Into<String>) -> Self {
        Self {
            method,
            route,
            path: path.into(),
            bearer: Some(ADMIN_TOKEN.into()),
            headers: Vec::new(),
            body: None,
            from: None,
        }
    }
    fn get(route: &'a str, path: impl Into<String>) -> Self {
        Self::new(Method::GET, route, path)
    }
    fn post(route: &'a str, path: impl Into<String>) -> Self {
        Self::new(Method::POST, route, path)
    }
    fn bearer(mut self, b: Option<&str>) -> Self {
        self.bearer = b.map(str::to_owned);
        self
    }
    fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
    fn json(mut self, v: Value) -> Self {
        self.body = Some((v.to_string(), "application/json"));
        self
    }
    fn raw(mut self, body: impl Into<String>, content_type: &'static str) -> Self {
        self.body = Some((body.into(), content_type));
        self
    }
    fn from(mut self, address: &str) -> Self {
        self.from = Some(address.into());
        self
    }
}

impl Tour {
    async fn call(&self, c: Call<'_>) -> (u16, Value) {
        let mut req = self.app.anon.request(
            c.method.clone(),
            format!("http://{}{}", self.app.addr, c.path),
        );
        if let Some(b) = &c.bearer {
            req = req.bearer_auth(b);
        }
        for (name, value) in &c.headers {
            req = req.header(name.as_str(), value);
        }
        if let Some((body, content_type)) = c.body {
            req = req.header("content-type", content_type).body(body);
        }
        if let Some(from) = &c.from {
            req = req.header("x-forwarded-for", from);
        }
        let resp = req.send().await.unwrap();
        let (status, content_type, text) = read_answer(resp).await;
        if let Err(e) =
            self.checker
                .lock()
                .unwrap()
                .check(&c.method, c.route, status, &content_type, &text)
        {
            panic!("{e}");
        }
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// The call, which must answer `status`; its body.
    async fn expect(&self, status: u16, c: Call<'_>) -> Value {
        let what = format!("{} {}", c.method, c.path);
        let (got, body) = self.call(c).await;
        assert_eq!(got, status, "{what}: {body}");
        body
    }

    /// The call, which must answer `status` with error `code`.
    async fn refused(&self, status: u16, code: &str, c: Call<'_>) {
        let body = self.expect(status, c).await;
        assert_eq!(body["error"]["code"], code, "{body}");
    }
}

/// The fleet driven through every JSON endpoint, its answers checked as they come: the
/// successes, and the errors the README lists for each endpoint that a single fleet can be
/// brought to (the broker's and the gateways' outages are other tests').
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn live_answers_hold_to_the_description(pool: PgPool) {
    let mut config = test_config();
    config.http.client_address_header = Some("x-forwarded-for".parse().unwrap());
    let app = Arc::new(spawn_fleet(pool.clone(), config).await);
    let t = Tour {
        app: app.clone(),
        checker: std::sync::Mutex::new(Checker::new()),
    };
    let key = app.api_key.clone();
    let backend = || Some(key.as_str());

    // Operations.
    t.expect(200, Call::get("/healthz", "/healthz").bearer(None))
        .await;
    t.expect(200, Call::get("/readyz", "/readyz").bearer(None))
        .await;
    t.expect(
        200,
        Call::get("/openapi.json", "/openapi.json").bearer(None),
    )
    .await;
    t.expect(200, Call::get("/metrics", "/metrics")).await;
    t.refused(
        401,
        "unauthenticated",
        Call::get("/metrics", "/metrics").bearer(None),
    )
    .await;

    // The catalogue.
    let seller = t
        .expect(
            201,
            Call::post("/admin/sellers", "/admin/sellers").json(json!({
                "name": "Tour", "payout_frequency": "daily", "payout_minimum": "1.00",
                "holding_days": 0, "payout_minimums": {"JPY": "500"}
            })),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    t.refused(
        422,
        "invalid_request",
        Call::post("/admin/sellers", "/admin/sellers")
            .json(json!({"name": "", "payout_frequency": "daily", "payout_minimum": "x"})),
    )
    .await;
    t.refused(
        422,
        "invalid_request",
        Call::post("/admin/sellers", "/admin/sellers").json(json!({"name": 5})),
    )
    .await;
    t.refused(
        400,
        "bad_request",
        Call::post("/admin/sellers", "/admin/sellers").raw("{", "application/json"),
    )
    .await;
    t.refused(
        415,
        "unsupported_media_type",
        Call::post("/admin/sellers", "/admin/sellers").raw("name=x", "text/plain"),
    )
    .await;
    t.refused(
        403,
        "forbidden",
        Call::post("/admin/sellers", "/admin/sellers")
            .bearer(backend())
            .json(json!({})),
    )
    .await;
    let product = |price: &str, kind: &str| {
        let mut body = json!({"seller_id": seller, "name": format!("p{price}"), "kind": kind, "price": price, "currency": "BRL"});
        if kind == "subscription" {
            body["interval"] = json!("month");
        }
        Call::post("/admin/products", "/admin/products").json(body)
    };
    let one_off = t.expect(201, product("10.00", "one_off")).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let monthly = t.expect(201, product("19.90", "subscription")).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    t.refused(
        422,
        "unknown_seller",
        Call::post("/admin/products", "/admin/products").json(json!({
            "seller_id": "00000000-0000-4000-8000-000000000000", "name": "x", "kind": "one_off",
            "price": "1.00", "currency": "BRL"
        })),
    )
    .await;
    t.expect(
        201,
        Call::post("/admin/coupons", "/admin/coupons")
            .json(json!({"code": "TOUR10", "percent_off": "10"})),
    )
    .await;
    t.expect(
        201,
        Call::post("/admin/coupons", "/admin/coupons").json(
            json!({"code": "TOUR5", "amount_off": "5.00", "currency": "BRL", "max_redemptions": 3}),
        ),
    )
    .await;
    t.refused(
        409,
        "coupon_code_taken",
        Call::post("/admin/coupons", "/admin/coupons")
            .json(json!({"code": "tour10", "percent_off": "5"})),
    )
    .await;
    t.refused(
        422,
        "unknown_product",
        Call::post("/admin/coupons", "/admin/coupons").json(
            json!({"code": "NOPE", "percent_off": "5", "product_id": "00000000-0000-4000-8000-000000000000"}),
        ),
    )
    .await;

    // API keys.
    let made = t
        .expect(
            201,
            Call::post("/admin/api-keys", "/admin/api-keys")
                .json(json!({"name": "seller's", "seller_id": seller})),
        )
        .await;
    let seller_key = made["key"].as_str().unwrap().to_owned();
    t.refused(
        422,
        "unknown_seller",
        Call::post("/admin/api-keys", "/admin/api-keys")
            .json(json!({"name": "x", "seller_id": "00000000-0000-4000-8000-000000000000"})),
    )
    .await;
    let spare = t
        .expect(
            201,
            Call::post("/admin/api-keys", "/admin/api-keys").json(json!({"name": "spare"})),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    t.expect(200, Call::get("/admin/api-keys", "/admin/api-keys"))
        .await;
    t.expect(
        200,
        Call::new(
            Method::DELETE,
            "/admin/api-keys/{id}",
            format!("/admin/api-keys/{spare}"),
        ),
    )
    .await;
    t.refused(
        404,
        "not_found",
        Call::new(
            Method::DELETE,
            "/admin/api-keys/{id}",
            "/admin/api-keys/00000000-0000-4000-8000-000000000000",
        ),
    )
    .await;

    // Checkouts.
    let cart = |product: &str, coupon: Option<&str>| {
        json!({"buyer_id": "tour-buyer", "gateway": "internal", "coupon": coupon,
               "items": [{"product_id": product, "quantity": 1}]})
    };
    let checkout = |k: &str, body: Value| {
        Call::post("/checkout", "/checkout")
            .bearer(Some(&key))
            .header("idempotency-key", k)
            .json(body)
    };
    let first = t
        .expect(201, checkout("tour-1", cart(&one_off, Some("TOUR10"))))
        .await;
    let again = t
        .expect(201, checkout("tour-1", cart(&one_off, Some("TOUR10"))))
        .await;
    assert_eq!(first, again);
    let paid = first["orders"][0]["number"].as_i64().unwrap();
    let url = first["orders"][0]["payment"]["url"]
        .as_str()
        .unwrap()
        .to_owned();
    t.refused(
        422,
        "idempotency_key_reused",
        checkout("tour-1", cart(&one_off, None)),
    )
    .await;
    t.refused(
        400,
        "missing_idempotency_key",
        Call::post("/checkout", "/checkout")
            .bearer(backend())
            .json(cart(&one_off, None)),
    )
    .await;
    t.refused(
        400,
        "invalid_idempotency_key",
        checkout(&"k".repeat(256), cart(&one_off, None)),
    )
    .await;
    t.refused(
        422,
        "unknown_product",
        checkout("tour-2", cart("00000000-0000-4000-8000-000000000000", None)),
    )
    .await;
    t.refused(
        422,
        "coupon_unavailable",
        checkout("tour-3", cart(&one_off, Some("NOSUCH"))),
    )
    .await;
    t.refused(
        422,
        "invalid_items",
        checkout(
            "tour-4",
            json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": one_off, "quantity": 0}]}),
        ),
    )
    .await;
    t.refused(
        422,
        "gateway_unavailable",
        checkout(
            "tour-5",
            json!({"buyer_id": "b", "gateway": "paypal", "items": [{"product_id": one_off, "quantity": 1}]}),
        ),
    )
    .await;
    t.refused(
        400,
        "bad_request",
        checkout("tour-6", json!({"buyer_id": "b"})),
    )
    .await;
    t.refused(
        413,
        "payload_too_large",
        Call::post("/checkout", "/checkout")
            .bearer(backend())
            .header("idempotency-key", "tour-7")
            .raw(
                format!("{{\"pad\":\"{}\"}}", "x".repeat(70_000)),
                "application/json",
            ),
    )
    .await;
    t.refused(
        415,
        "unsupported_media_type",
        Call::post("/checkout", "/checkout")
            .bearer(backend())
            .header("idempotency-key", "tour-8")
            .raw("{}", "text/plain"),
    )
    .await;
    t.refused(
        403,
        "forbidden",
        checkout("tour-9", cart(&one_off, None)).bearer(Some(&seller_key)),
    )
    .await;
    t.refused(
        401,
        "unauthenticated",
        checkout("tour-10", cart(&one_off, None)).bearer(None),
    )
    .await;
    let unpaid = t
        .expect(201, checkout("tour-11", cart(&one_off, Some("TOUR5"))))
        .await["orders"][0]["number"]
        .as_i64()
        .unwrap();
    let sub_order = t
        .expect(201, checkout("tour-12", cart(&monthly, None)))
        .await;
    let sub_number = sub_order["orders"][0]["number"].as_i64().unwrap();
    let sub_url = sub_order["orders"][0]["payment"]["url"]
        .as_str()
        .unwrap()
        .to_owned();

    // The payment pages.
    let session = url.rsplit('/').next().unwrap().to_owned();
    let page = app.anon.get(&url).send().await.unwrap();
    let ct = page.headers()["content-type"].to_str().unwrap().to_owned();
    let html = page.text().await.unwrap();
    t.checker
        .lock()
        .unwrap()
        .check(&Method::GET, "/pay/{session}", 200, &ct, &html)
        .unwrap();
    t.refused(
        404,
        "not_found",
        Call::get("/pay/{session}", "/pay/nosuchsession").bearer(None),
    )
    .await;
    t.refused(
        422,
        "invalid_outcome",
        Call::post("/pay/{session}", format!("/pay/{session}"))
            .bearer(None)
            .header("origin", format!("http://{}", app.addr))
            .raw("outcome=maybe&token=x", "application/x-www-form-urlencoded"),
    )
    .await;
    let paid_form = format!("outcome=succeeded&token={}", form_token(&html));
    t.expect(
        200,
        Call::post("/pay/{session}", format!("/pay/{session}"))
            .bearer(None)
            .header("origin", format!("http://{}", app.addr))
            .raw(paid_form, "application/x-www-form-urlencoded"),
    )
    .await;
    app.pay(&sub_url, "succeeded").await;
    t.expect(200, Call::get("/orders/paid", "/orders/paid").bearer(None))
        .await;
    // Razorpay Checkout's return, a form POST (what it says is not read).
    t.expect(
        200,
        Call::post("/orders/paid", "/orders/paid").bearer(None).raw(
            "razorpay_payment_id=pay_1&razorpay_order_id=order_1&razorpay_signature=x",
            "application/x-www-form-urlencoded",
        ),
    )
    .await;
    t.expect(
        200,
        Call::get("/orders/cancelled", "/orders/cancelled").bearer(None),
    )
    .await;
    wait_for(
        "the two orders paid",
        std::time::Duration::from_secs(30),
        async || {
            status_of(&pool, paid).await == "paid" && status_of(&pool, sub_number).await == "paid"
        },
    )
    .await;

    // Orders.
    let order = |n: i64| Call::get("/orders/{number}", format!("/orders/{n}")).bearer(Some(&key));
    t.expect(200, order(paid)).await;
    let sub = t.expect(200, order(sub_number)).await["subscription_id"]
        .as_str()
        .unwrap()
        .to_owned();
    t.expect(200, order(paid).bearer(Some(&seller_key))).await;
    t.refused(404, "not_found", order(999_999)).await;
    t.refused(
        401,
        "unauthenticated",
        order(paid).bearer(Some(&format!("pfk_{}", "x".repeat(43)))),
    )
    .await;
    let reopen = |n: i64| {
        Call::post("/orders/{number}/payment", format!("/orders/{n}/payment")).bearer(Some(&key))
    };
    t.refused(409, "order_not_payable", reopen(paid)).await;
    t.expect(200, reopen(unpaid)).await;
    t.refused(403, "forbidden", reopen(unpaid).bearer(Some(&seller_key)))
        .await;
    let coins = |n: i64| {
        Call::post("/orders/{number}/coins", format!("/orders/{n}/coins")).bearer(Some(&key))
    };
    t.refused(422, "coins_insufficient", coins(unpaid)).await;
    t.refused(409, "order_not_payable", coins(paid)).await;

    // Subscriptions.
    let subscription = |id: &str| {
        Call::get("/subscriptions/{id}", format!("/subscriptions/{id}")).bearer(Some(&key))
    };
    t.expect(200, subscription(&sub)).await;
    t.refused(404, "not_found", subscription("nope")).await;
    t.expect(
        200,
        Call::post(
            "/admin/subscriptions/{id}/simulate",
            format!("/admin/subscriptions/{sub}/simulate"),
        )
        .json(json!({"renewals": "fail"})),
    )
    .await;
    t.refused(
        422,
        "invalid_request",
        Call::post(
            "/admin/subscriptions/{id}/simulate",
            format!("/admin/subscriptions/{sub}/simulate"),
        )
        .json(json!({"renewals": "sometimes"})),
    )
    .await;
    t.refused(
        404,
        "not_found",
        Call::post(
            "/admin/subscriptions/{id}/simulate",
            "/admin/subscriptions/00000000-0000-4000-8000-000000000000/simulate",
        )
        .json(json!({"renewals": "fail"})),
    )
    .await;
    let cancel = Call::post(
        "/subscriptions/{id}/cancel",
        format!("/subscriptions/{sub}/cancel"),
    )
    .bearer(Some(&key))
    .json(json!({"at_period_end": true}));
    t.expect(200, cancel).await;
    t.refused(
        422,
        "invalid_request",
        Call::post(
            "/subscriptions/{id}/cancel",
            format!("/subscriptions/{sub}/cancel"),
        )
        .bearer(Some(&key))
        .json(json!({"when": "now"})),
    )
    .await;

    // Refunds and coins.
    let refund = |k: &str, body: Value| {
        Call::post(
            "/admin/orders/{number}/refunds",
            format!("/admin/orders/{paid}/refunds"),
        )
        .header("idempotency-key", k)
        .json(body)
    };
    t.refused(
        422,
        "refund_exceeds_payment",
        refund("r-1", json!({"amount": "1000.00", "reason": "too much"})),
    )
    .await;
    t.expect(
        201,
        refund("r-2", json!({"amount": "1.00", "reason": "partial"})),
    )
    .await;
    t.refused(
        422,
        "idempotency_key_reused",
        refund("r-2", json!({"amount": "2.00", "reason": "partial"})),
    )
    .await;
    t.refused(
        400,
        "missing_idempotency_key",
        Call::post(
            "/admin/orders/{number}/refunds",
            format!("/admin/orders/{paid}/refunds"),
        )
        .json(json!({})),
    )
    .await;
    t.refused(
        409,
        "order_not_refundable",
        Call::post(
            "/admin/orders/{number}/refunds",
            format!("/admin/orders/{unpaid}/refunds"),
        )
        .header("idempotency-key", "r-3")
        .json(json!({})),
    )
    .await;
    t.expect(
        200,
        Call::get(
            "/admin/orders/{number}/refunds",
            format!("/admin/orders/{paid}/refunds"),
        ),
    )
    .await;
    let grant = |k: &str, body: Value| {
        Call::post(
            "/admin/wallets/{buyer}/grants",
            "/admin/wallets/tour-buyer/grants",
        )
        .header("idempotency-key", k)
        .json(body)
    };
    t.expect(
        201,
        grant("g-1", json!({"amount": "50.00", "currency": "BRL"})),
    )
    .await;
    t.refused(
        422,
        "invalid_request",
        grant("g-2", json!({"amount": "-1", "currency": "BRL"})),
    )
    .await;
    t.expect(
        200,
        Call::get("/wallets/{buyer}", "/wallets/tour-buyer").bearer(Some(&key)),
    )
    .await;
    t.refused(
        403,
        "forbidden",
        Call::get("/wallets/{buyer}", "/wallets/tour-buyer").bearer(Some(&seller_key)),
    )
    .await;
    t.expect(200, coins(unpaid)).await;

    // Expiry.
    let third = t
        .expect(201, checkout("tour-13", cart(&one_off, None)))
        .await["orders"][0]["number"]
        .as_i64()
        .unwrap();
    t.expect(
        202,
        Call::post(
            "/admin/orders/{number}/expire",
            format!("/admin/orders/{third}/expire"),
        ),
    )
    .await;
    t.refused(
        409,
        "order_not_payable",
        Call::post(
            "/admin/orders/{number}/expire",
            format!("/admin/orders/{paid}/expire"),
        ),
    )
    .await;

    // The seller's money.
    let sellers = |what: &'static str, path: String| Call::get(what, path).bearer(Some(&key));
    t.expect(
        200,
        sellers(
            "/sellers/{id}/balances",
            format!("/sellers/{seller}/balances"),
        ),
    )
    .await;
    t.expect(
        200,
        sellers(
            "/sellers/{id}/balances",
            format!("/sellers/{seller}/balances"),
        )
        .bearer(Some(&seller_key)),
    )
    .await;
    t.refused(
        404,
        "not_found",
        sellers(
            "/sellers/{id}/balances",
            "/sellers/00000000-0000-4000-8000-000000000000/balances".into(),
        ),
    )
    .await;
    t.refused(
        403,
        "forbidden",
        sellers(
            "/sellers/{id}/balances",
            "/sellers/00000000-0000-4000-8000-000000000000/balances".into(),
        )
        .bearer(Some(&seller_key)),
    )
    .await;
    let ledger = t
        .expect(
            200,
            sellers(
                "/sellers/{id}/ledger",
                format!("/sellers/{seller}/ledger?limit=2"),
            ),
        )
        .await;
    assert_eq!(ledger["entries"].as_array().unwrap().len(), 2, "{ledger}");
    t.refused(
        400,
        "bad_request",
        sellers(
            "/sellers/{id}/ledger",
            format!("/sellers/{seller}/ledger?limit=0"),
        ),
    )
    .await;
    t.expect(
        200,
        sellers(
            "/sellers/{id}/payouts",
            format!("/sellers/{seller}/payouts"),
        ),
    )
    .await;
    t.expect(
        200,
        sellers(
            "/sellers/{id}/invoices",
            format!("/sellers/{seller}/invoices"),
        ),
    )
    .await;
    t.refused(
        404,
        "not_found",
        sellers(
            "/sellers/{id}/invoices/{number}",
            format!("/sellers/{seller}/invoices/1"),
        ),
    )
    .await;

    // Payouts: a run pays the seller's available balance (no holding days).
    payfleet::ledger::sales::release_matured(&pool, chrono::Utc::now())
        .await
        .unwrap();
    let run = payfleet::ledger::payouts::run(&pool, chrono::Utc::now().date_naive())
        .await
        .unwrap();
    let payouts = t
        .expect(200, Call::get("/admin/payouts", "/admin/payouts"))
        .await;
    let payout = payouts["payouts"][0]["id"].as_i64();
    assert!(payout.is_some(), "a payout to decide: {payouts} ({run:?})");
    let payout = payout.unwrap();
    t.refused(
        422,
        "invalid_request",
        Call::post(
            "/admin/payouts/{id}/failed",
            format!("/admin/payouts/{payout}/failed"),
        )
        .json(json!({"reason": ""})),
    )
    .await;
    t.expect(
        200,
        Call::post(
            "/admin/payouts/{id}/paid",
            format!("/admin/payouts/{payout}/paid"),
        ),
    )
    .await;
    t.refused(
        409,
        "payout_decided",
        Call::post(
            "/admin/payouts/{id}/failed",
            format!("/admin/payouts/{payout}/failed"),
        )
        .json(json!({"reason": "closed account"})),
    )
    .await;
    t.refused(
        404,
        "not_found",
        Call::post("/admin/payouts/{id}/paid", "/admin/payouts/999999/paid"),
    )
    .await;

    // The operator's lists.
    for route in [
        "/admin/unmatched-payments",
        "/admin/consistency",
        "/admin/reconciliation",
        "/admin/recurring",
        "/admin/workers",
    ] {
        t.expect(200, Call::get(route, route)).await;
    }
    t.refused(
        404,
        "not_found",
        Call::get(
            "/admin/recurring/{name}/runs",
            "/admin/recurring/nosuch/runs",
        ),
    )
    .await;

    // Webhooks.
    let body = payment_body("payment.succeeded", "tour-unknown-session", "10.00");
    let d = internal("tour-evt-1", &body);
    for expected in ["accepted", "duplicate"] {
        let mut c = Call::post("/webhooks/{gateway}", "/webhooks/internal")
            .bearer(None)
            .raw(
                String::from_utf8(d.body.clone()).unwrap(),
                "application/json",
            );
        for (name, value) in &d.headers {
            c = c.header(name.clone(), value.clone());
        }
        assert_eq!(t.expect(200, c).await["status"], expected);
    }
    t.refused(
        401,
        "unauthenticated",
        Call::post("/webhooks/{gateway}", "/webhooks/internal")
            .bearer(None)
            .raw(body.clone(), "application/json"),
    )
    .await;
    t.refused(
        404,
        "not_found",
        Call::post("/webhooks/{gateway}", "/webhooks/paypal")
            .bearer(None)
            .raw(body.clone(), "application/json"),
    )
    .await;
    t.refused(
        413,
        "payload_too_large",
        Call::post("/webhooks/{gateway}", "/webhooks/internal")
            .bearer(None)
            .raw("x".repeat(1_100_000), "application/json"),
    )
    .await;

    // The credentials' limiter: ten wrong ones from an address, then 429 for it.
    for _ in 0..10 {
        t.call(
            Call::get("/admin/consistency", "/admin/consistency")
                .bearer(Some("wrong-admin-token"))
                .from("10.9.9.9"),
        )
        .await;
    }
    t.refused(
        429,
        "too_many_requests",
        Call::get("/admin/consistency", "/admin/consistency").from("10.9.9.9"),
    )
    .await;

    let checker = t.checker.lock().unwrap();
    let statuses: BTreeSet<u16> = checker.seen.iter().map(|(_, s, _)| *s).collect();
    for s in [200, 201, 202, 400, 401, 403, 404, 409, 413, 415, 422, 429] {
        assert!(statuses.contains(&s), "the tour never met a {s}");
    }
    let operations: BTreeSet<&str> = checker.seen.iter().map(|(op, _, _)| op.as_str()).collect();
    assert!(
        operations.len() >= 40,
        "the tour covers the API: {operations:#?}"
    );
}

async fn status_of(pool: &PgPool, number: i64) -> String {
    sqlx::query_scalar("SELECT status::text FROM orders WHERE number = $1")
        .bind(number)
        .fetch_one(pool)
        .await
        .unwrap()
}
