//! What a sender chooses, sent to the running receiver: wrong content types, invalid UTF-8,
//! deep and huge JSON, missing, duplicated and oversized headers, bodies over the limit. Each
//! gets the 4xx the README states (as `{"error": {"code", "message"}}`), nothing is stored, and
//! the process's memory stays flat however many are sent.

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;
use sqlx::PgPool;

use crate::helpers::*;

/// Rows of what a request could store.
async fn stored(pool: &PgPool) -> (i64, i64, i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM payment_events), (SELECT count(*) FROM orders),
                (SELECT count(*) FROM checkouts), (SELECT count(*) FROM idempotency_keys),
                (SELECT count(*) FROM jobs)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// This process's resident memory, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// One bad request: where, with which headers and body, and the status and error code the
/// README states for it (`None`: any code, as the status alone is stated).
struct Case {
    what: &'static str,
    path: &'static str,
    headers: Vec<(&'static str, Vec<u8>)>,
    body: Vec<u8>,
    status: u16,
    code: Option<&'static str>,
}

fn cases() -> Vec<Case> {
    let json = |s: &str| s.as_bytes().to_vec();
    let key = |k: &[u8]| ("idempotency-key", k.to_vec());
    let cart = json(
        r#"{"buyer_id":"b","gateway":"internal","items":[{"product_id":"00000000-0000-0000-0000-000000000000","quantity":1}]}"#,
    );
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes();
    let huge = format!(
        r#"{{"buyer_id":"{}","gateway":"internal","items":[]}}"#,
        "b".repeat(70 * 1024)
    )
    .into_bytes();
    let webhook_huge = vec![b'{'; 2 * 1024 * 1024];
    vec![
        Case {
            what: "a checkout without its key",
            path: "/checkout",
            headers: vec![],
            body: cart.clone(),
            status: 400,
            code: Some("missing_idempotency_key"),
        },
        Case {
            what: "a checkout with an oversized key",
            path: "/checkout",
            headers: vec![key(&vec![b'k'; 8 * 1024])],
            body: cart.clone(),
            status: 400,
            code: Some("invalid_idempotency_key"),
        },
        Case {
            what: "a checkout with a key that is not text",
            path: "/checkout",
            headers: vec![key(b"\xff\xfe")],
            body: cart.clone(),
            status: 400,
            code: Some("invalid_idempotency_key"),
        },
        Case {
            what: "a checkout with two keys",
            path: "/checkout",
            headers: vec![key(b"one"), key(b"two")],
            body: cart.clone(),
            status: 400,
            code: Some("invalid_idempotency_key"),
        },
        Case {
            what: "a checkout that is not JSON (text/plain)",
            path: "/checkout",
            headers: vec![key(b"k-text"), ("content-type", b"text/plain".to_vec())],
            body: b"buy everything".to_vec(),
            status: 415,
            code: Some("unsupported_media_type"),
        },
        Case {
            what: "a checkout in invalid UTF-8",
            path: "/checkout",
            headers: vec![key(b"k-utf8")],
            body: b"{\"buyer_id\":\"\xff\xfe\",\"gateway\":\"internal\",\"items\":[]}".to_vec(),
            status: 400,
            code: Some("bad_request"),
        },
        Case {
            what: "a checkout of deep JSON",
            path: "/checkout",
            headers: vec![key(b"k-deep")],
            body: deep.clone(),
            status: 413,
            code: None,
        },
        Case {
            what: "a checkout of JSON nested 20,000 deep, within the size limit",
            path: "/checkout",
            headers: vec![key(b"k-nested")],
            body: format!("{}{}", "[".repeat(20_000), "]".repeat(20_000)).into_bytes(),
            status: 400,
            code: Some("bad_request"),
        },
        Case {
            what: "a checkout over 64 KiB",
            path: "/checkout",
            headers: vec![key(b"k-huge")],
            body: huge,
            status: 413,
            code: None,
        },
        Case {
            what: "a webhook without its signature",
            path: "/webhooks/stripe",
            headers: vec![],
            body: json(r#"{"id":"evt_1","type":"payment_intent.succeeded"}"#),
            status: 401,
            code: None,
        },
        Case {
            what: "a webhook with two signatures",
            path: "/webhooks/stripe",
            headers: vec![
                ("stripe-signature", b"t=1,v1=00".to_vec()),
                ("stripe-signature", b"t=2,v1=11".to_vec()),
            ],
            body: json(r#"{"id":"evt_1"}"#),
            status: 401,
            code: None,
        },
        Case {
            what: "a webhook with an oversized signature header",
            path: "/webhooks/stripe",
            headers: vec![(
                "stripe-signature",
                format!("t=1,{}", "v1=00,".repeat(2000)).into_bytes(),
            )],
            body: json(r#"{"id":"evt_1"}"#),
            status: 401,
            code: None,
        },
        Case {
            what: "a webhook of invalid UTF-8 with a signature that is not text",
            path: "/webhooks/internal",
            headers: vec![
                ("webhook-id", b"\xff".to_vec()),
                ("webhook-timestamp", b"1".to_vec()),
                ("webhook-signature", b"v1,\xff".to_vec()),
            ],
            body: b"\xff\xfe\xfd".to_vec(),
            status: 401,
            code: None,
        },
        Case {
            what: "a webhook of deep JSON",
            path: "/webhooks/razorpay",
            headers: vec![("x-razorpay-signature", b"00".to_vec())],
            body: deep,
            status: 401,
            code: None,
        },
        Case {
            what: "a webhook over the limit",
            path: "/webhooks/mercadopago",
            headers: vec![],
            body: webhook_huge,
            status: 413,
            code: None,
        },
        Case {
            what: "a webhook to a gateway that does not exist",
            path: "/webhooks/paypal",
            headers: vec![],
            body: json("{}"),
            status: 404,
            code: None,
        },
        Case {
            what: "a webhook to a gateway whose name is not UTF-8",
            path: "/webhooks/%FF",
            headers: vec![],
            body: json("{}"),
            status: 400,
            code: Some("bad_request"),
        },
        Case {
            what: "a payment page's form for a session whose id is not UTF-8",
            path: "/pay/ips_%C3%28",
            headers: vec![(
                "content-type",
                b"application/x-www-form-urlencoded".to_vec(),
            )],
            body: json("outcome=succeeded"),
            status: 400,
            code: Some("bad_request"),
        },
    ]
}

async fn send(app: &TestApp, case: &Case) -> (u16, Value) {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    for (name, value) in &case.headers {
        let name = HeaderName::from_static(name);
        let value = HeaderValue::from_bytes(value).expect("a header value the client can send");
        if name == "content-type" {
            headers.insert(name, value);
        } else {
            headers.append(name, value);
        }
    }
    let resp = app
        .http
        .post(format!("http://{}{}", app.addr, case.path))
        .headers(headers)
        .body(case.body.clone())
        .send()
        .await;
    match resp {
        Ok(resp) => {
            let status = resp.status().as_u16();
            (status, resp.json().await.unwrap_or(Value::Null))
        }
        // Cut off before the answer (a body over the limit, refused while it streams).
        Err(e) => panic!("{}: no answer: {e}", case.what),
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn every_bad_request_gets_its_stated_4xx_stores_nothing_and_costs_no_memory(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    let before = stored(&pool).await;
    for case in cases() {
        let (status, body) = send(&app, &case).await;
        assert_eq!(status, case.status, "{}: {body}", case.what);
        if status != 404 || body != Value::Null {
            assert!(
                body["error"]["code"].is_string() && body["error"]["message"].is_string(),
                "{}: the error as JSON: {body}",
                case.what
            );
        }
        if let Some(code) = case.code {
            assert_eq!(body["error"]["code"], code, "{}", case.what);
        }
    }
    assert_eq!(stored(&pool).await, before, "a refusal stored something");

    // Many more of the same: the process's memory stays flat (what a request held is given
    // back). Measured after a first round, so the allocator's own warm-up is not counted.
    let cases = cases();
    for case in &cases {
        send(&app, case).await;
    }
    let warm = rss_kib();
    for _ in 0..20 {
        for case in &cases {
            send(&app, case).await;
        }
    }
    let after = rss_kib();
    assert!(
        after < warm + 64 * 1024,
        "memory grew from {warm} KiB to {after} KiB over {} bad requests",
        20 * cases.len()
    );
    assert_eq!(stored(&pool).await, before);
}

/// A method an endpoint does not take is answered like any other refusal: 405 with the JSON
/// error (`method_not_allowed`), and the `Allow` header naming the methods it takes. Axum's own
/// answer was an empty body.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_method_an_endpoint_does_not_take_gets_405_with_the_json_error_and_allow(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    for (method, path, allowed) in [
        (reqwest::Method::GET, "/checkout", "POST"),
        (reqwest::Method::DELETE, "/webhooks/internal", "POST"),
        (reqwest::Method::POST, "/admin/workers", "GET"),
    ] {
        let resp = app
            .anon
            .request(method.clone(), format!("http://{}{path}", app.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 405, "{method} {path}");
        let allow = resp
            .headers()
            .get("allow")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        assert!(allow.contains(allowed), "{method} {path}: Allow {allow:?}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(
            body["error"]["code"], "method_not_allowed",
            "{method} {path}: {body}"
        );
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    assert_eq!(stored(&pool).await, (0, 0, 0, 0, 0), "nothing stored");
}
