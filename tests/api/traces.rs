//! Traces: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, a receiver and a worker (child processes, as
//! deployed) export their spans over OTLP/HTTP to a stand-in collector that reads the protobuf
//! the protocol specifies, and the trace context crosses each hop: a checkout's trace reaches
//! the payment-link RPC's answering span; a webhook's trace reaches its processing job in the
//! worker and the order message it writes, whose RabbitMQ headers carry it to consumers.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::helpers::*;

/// A span as the collector received it.
#[derive(Debug, Clone)]
struct Exported {
    trace: String,
    name: String,
    /// The exporting process's `payfleet.role`.
    role: String,
}

type Received = Arc<Mutex<Vec<Exported>>>;

/// An OTLP/HTTP collector on port 0: `POST /v1/traces` with an `ExportTraceServiceRequest`.
async fn collector() -> (std::net::SocketAddr, Received) {
    async fn export(State(received): State<Received>, body: Bytes) -> axum::http::StatusCode {
        let Ok(request) = ExportTraceServiceRequest::decode(body) else {
            return axum::http::StatusCode::BAD_REQUEST;
        };
        let mut got = received.lock().unwrap();
        for resource in request.resource_spans {
            let role = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "payfleet.role")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    AnyValue::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    got.push(Exported {
                        trace: hex::encode(&span.trace_id),
                        name: span.name,
                        role: role.clone(),
                    });
                }
            }
        }
        axum::http::StatusCode::OK
    }
    let received = Received::default();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(export))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, received)
}

fn spans_of(received: &Received, trace: &str) -> Vec<Exported> {
    received
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.trace == trace)
        .cloned()
        .collect()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn one_payment_is_one_trace_across_processes_and_rabbitmq(pool: PgPool) {
    payfleet::tls::install_provider();
    let (otlp, received) = collector().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base = format!("http://127.0.0.1:{port}");
    let namespace = format!("test-{:016x}", rand::random::<u64>());
    let fleet = |role: &str| {
        let mut cmd = payfleet(&pool, &[role]);
        cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{otlp}"))
            // The batch exporter's pace: a tenth of a second, for the test's sake.
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env("PAYFLEET_BIND", format!("127.0.0.1:{port}"))
            .env("PAYFLEET_AMQP_NAMESPACE", &namespace)
            .env("PAYFLEET_AMQP_QUEUE_TTL_MS", "60000")
            .env("INTERNAL_WEBHOOK_SECRET", INTERNAL_SECRET)
            .env("PAYFLEET_PAYMENT_SIMULATOR", "on")
            .env("PAYFLEET_ADMIN_TOKEN", ADMIN_TOKEN)
            .env("PAYFLEET_QUEUES", "jobs/queues.toml");
        cmd.spawn().unwrap()
    };
    let _serve = fleet("serve");
    let _work = fleet("work");
    let http = reqwest::Client::new();
    wait_for("the receiver", Duration::from_secs(60), async || {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;

    // A consumer of every order message, to read the headers they carry.
    let connection = lapin::Connection::connect(
        payfleet::config::DEFAULT_AMQP_URL,
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("{namespace}.trace-test");
    channel
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let exchange = format!("{namespace}.orders");
    wait_for("the orders exchange", Duration::from_secs(60), async || {
        let probe = connection.create_channel().await.unwrap();
        let declared = probe
            .exchange_declare(
                exchange.as_str().into(),
                lapin::ExchangeKind::Topic,
                lapin::options::ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .is_ok();
        let _ = probe.close(200, "done".into()).await;
        declared
    })
    .await;
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();

    // A checkout, in a trace the backend started: its payment link is asked over the RPC.
    let admin = |path: &str, body: Value| {
        http.post(format!("{base}{path}"))
            .bearer_auth(ADMIN_TOKEN)
            .json(&body)
            .send()
    };
    let seller: Value = admin(
        "/admin/sellers",
        json!({"name": "Traced", "payout_frequency": "weekly", "payout_minimum": "1.00"}),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let product: Value = admin(
        "/admin/products",
        json!({"seller_id": seller["id"], "name": "p", "kind": "one_off", "price": "10.00", "currency": "BRL"}),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let checkout_trace = format!("{:032x}", rand::random::<u128>());
    let answer: Value = http
        .post(format!("{base}/checkout"))
        .bearer_auth(api_key(&pool, None).await)
        .header("idempotency-key", "traced")
        .header(
            "traceparent",
            format!("00-{checkout_trace}-00f067aa0ba902b7-01"),
        )
        .json(&json!({"buyer_id": "b", "gateway": "internal",
                      "items": [{"product_id": product["id"], "quantity": 1}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let session = answer["orders"][0]["payment"]["session_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{answer}"))
        .to_owned();

    // The gateway's webhook, in a trace of its own.
    let payment_trace = format!("{:032x}", rand::random::<u128>());
    let d = internal(
        "evt-traced",
        &payment_body("payment.succeeded", &session, "10.00"),
    );
    let mut req = http
        .post(format!("{base}/webhooks/internal"))
        .header("content-type", "application/json")
        .header(
            "traceparent",
            format!("00-{payment_trace}-b7ad6b7169203331-01"),
        )
        .body(d.body.clone());
    for (name, value) in &d.headers {
        req = req.header(name, value);
    }
    assert_eq!(req.send().await.unwrap().status(), 200);

    // The order's messages carry their traces to whoever consumes them: `created` the
    // checkout's, `paid` the payment's.
    let mut carried = std::collections::HashMap::new();
    wait_for(
        "the order's two messages",
        Duration::from_secs(60),
        async || {
            while let Some(m) = channel
                .basic_get(
                    queue.as_str().into(),
                    lapin::options::BasicGetOptions { no_ack: true },
                )
                .await
                .unwrap()
            {
                let kind = m.delivery.properties.kind().as_ref().map(|k| k.to_string());
                let headers = m.delivery.properties.headers().clone().unwrap_or_default();
                let header = match headers.inner().get("traceparent") {
                    Some(lapin::types::AMQPValue::LongString(v)) => {
                        String::from_utf8_lossy(v.as_bytes()).into_owned()
                    }
                    other => format!("{other:?}"),
                };
                carried.insert(kind.unwrap_or_default(), header);
            }
            carried.contains_key("created") && carried.contains_key("paid")
        },
    )
    .await;
    assert!(
        carried["paid"].contains(&payment_trace),
        "the paid message continues the payment's trace: {carried:?}"
    );
    assert!(
        carried["created"].contains(&checkout_trace),
        "the created message continues the checkout's trace: {carried:?}"
    );

    // Each process exported its part of each trace.
    wait_for(
        "the spans of both traces",
        Duration::from_secs(30),
        async || {
            let payment = spans_of(&received, &payment_trace);
            let checkout = spans_of(&received, &checkout_trace);
            payment
                .iter()
                .any(|s| s.name == "POST /webhooks/{gateway}" && s.role == "serve")
                && payment
                    .iter()
                    .any(|s| s.name == "payment_event" && s.role == "work")
                && checkout
                    .iter()
                    .any(|s| s.name == "POST /checkout" && s.role == "serve")
                && checkout.iter().any(|s| s.name == "rpc")
        },
    )
    .await;
    let _ = connection.close(200, "done".into()).await;
}
