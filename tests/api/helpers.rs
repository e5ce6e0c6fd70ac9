use std::net::SocketAddr;
use std::sync::Arc;

use payfleet::gateways::GatewayName;
use payfleet::http::AppState;
use payfleet::messaging::Broker;
use payfleet::payments::{ProcessPaymentEvent, Processor};
use payfleet::queue::{Job, QueueSettings, Registry, work_until_idle};
use payfleet::startup;
use payfleet::webhooks::signature::{StandardSecret, hex_hmac};
use payfleet::webhooks::{EventWriter, WebhookSecrets};
use sqlx::PgPool;
use tokio::net::TcpListener;

pub const STRIPE_SECRET: &str = "whsec_test_stripe_secret";
pub const MP_SECRET: &str = "mp-test-secret";
pub const RAZORPAY_SECRET: &str = "rzp-test-secret";
pub const INTERNAL_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
pub const MOCK_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

pub fn all_secrets() -> WebhookSecrets {
    WebhookSecrets {
        stripe: Some(STRIPE_SECRET.into()),
        mercadopago: Some(MP_SECRET.into()),
        razorpay: Some(RAZORPAY_SECRET.into()),
        internal: Some(StandardSecret::parse(INTERNAL_SECRET).unwrap()),
        mock: Some(StandardSecret::parse(MOCK_SECRET).unwrap()),
    }
}

pub struct TestApp {
    pub addr: SocketAddr,
    pub pool: PgPool,
    pub http: reqwest::Client,
}

pub async fn spawn_app(pool: PgPool) -> TestApp {
    spawn_app_with(pool, all_secrets(), 1024 * 1024).await
}

pub async fn spawn_app_with(pool: PgPool, secrets: WebhookSecrets, body_limit: usize) -> TestApp {
    startup::install_tls_provider();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = AppState {
        pool: pool.clone(),
        broker: Broker::default(),
        secrets: Arc::new(secrets),
        webhook_tolerance_secs: 300,
        webhook_body_limit: body_limit,
        events: EventWriter::start(
            pool.clone(),
            Some(payfleet::queue::Notifier::start(pool.clone())),
        ),
    };
    tokio::spawn(startup::serve(listener, state, std::future::pending()));
    TestApp {
        addr,
        pool,
        http: reqwest::Client::new(),
    }
}

pub fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// A signed delivery, as each gateway sends it.
pub struct Delivery {
    pub gateway: GatewayName,
    pub headers: Vec<(String, String)>,
    pub query: String,
    pub body: Vec<u8>,
}

pub fn standard(gateway: GatewayName, id: &str, ts: i64, body: &str) -> Delivery {
    let secret = if gateway == GatewayName::Internal {
        INTERNAL_SECRET
    } else {
        MOCK_SECRET
    };
    let sig = StandardSecret::parse(secret)
        .unwrap()
        .sign(id, ts, body.as_bytes());
    Delivery {
        gateway,
        headers: vec![
            ("webhook-id".into(), id.into()),
            ("webhook-timestamp".into(), ts.to_string()),
            ("webhook-signature".into(), sig),
        ],
        query: String::new(),
        body: body.as_bytes().to_vec(),
    }
}

pub fn internal(id: &str, body: &str) -> Delivery {
    standard(GatewayName::Internal, id, now(), body)
}

pub fn stripe(body: &str, ts: i64) -> Delivery {
    let sig = hex_hmac(
        STRIPE_SECRET.as_bytes(),
        &[ts.to_string().as_bytes(), b".", body.as_bytes()],
    );
    Delivery {
        gateway: GatewayName::Stripe,
        headers: vec![("stripe-signature".into(), format!("t={ts},v1={sig}"))],
        query: String::new(),
        body: body.as_bytes().to_vec(),
    }
}

pub fn razorpay(event_id: &str, body: &str) -> Delivery {
    let sig = hex_hmac(RAZORPAY_SECRET.as_bytes(), &[body.as_bytes()]);
    Delivery {
        gateway: GatewayName::Razorpay,
        headers: vec![
            ("x-razorpay-signature".into(), sig),
            ("x-razorpay-event-id".into(), event_id.into()),
        ],
        query: String::new(),
        body: body.as_bytes().to_vec(),
    }
}

pub fn mercadopago(data_id: &str, request_id: &str, ts_ms: i64) -> Delivery {
    let manifest = format!("id:{data_id};request-id:{request_id};ts:{ts_ms};");
    let sig = hex_hmac(MP_SECRET.as_bytes(), &[manifest.as_bytes()]);
    let body = format!(
        r#"{{"action":"payment.updated","api_version":"v1","data":{{"id":"{data_id}"}},"id":987,"type":"payment"}}"#
    );
    Delivery {
        gateway: GatewayName::MercadoPago,
        headers: vec![
            ("x-signature".into(), format!("ts={ts_ms},v1={sig}")),
            ("x-request-id".into(), request_id.into()),
        ],
        query: format!("?data.id={data_id}&type=payment"),
        body: body.into_bytes(),
    }
}

pub fn payment_body(kind: &str, session: &str, amount: &str) -> String {
    format!(
        r#"{{"type":"{kind}","data":{{"session_id":"{session}","payment_id":"pay_{session}","amount":"{amount}","currency":"BRL"}}}}"#
    )
}

pub fn refund_body(session: &str, refund: &str, amount: &str) -> String {
    format!(
        r#"{{"type":"refund.succeeded","data":{{"session_id":"{session}","payment_id":"pay_{session}","refund_id":"{refund}","amount":"{amount}","currency":"BRL"}}}}"#
    )
}

impl TestApp {
    pub async fn deliver(&self, d: &Delivery) -> (u16, serde_json::Value) {
        let mut req = self
            .http
            .post(format!(
                "http://{}/webhooks/{}{}",
                self.addr, d.gateway, d.query
            ))
            .header("content-type", "application/json")
            .body(d.body.clone());
        for (k, v) in &d.headers {
            req = req.header(k, v);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.json().await.unwrap_or(serde_json::Value::Null);
        (status, body)
    }

    pub async fn events(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payment_events")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// The fleet's handlers, as `work` registers them.
pub fn registry(processor: Processor) -> Registry {
    startup::registry(processor).unwrap()
}

/// Steps the event workers: runs every due processing job now, in this task.
pub async fn process_events(pool: &PgPool, processor: Processor) -> usize {
    let settings = QueueSettings {
        concurrency: 10,
        timeout_ms: 30_000,
    };
    work_until_idle(
        pool,
        &registry(processor),
        ProcessPaymentEvent::QUEUE,
        &settings,
    )
    .await
    .unwrap()
}

pub async fn order_status(
    pool: &PgPool,
    gateway: &str,
    session: &str,
) -> Option<(String, Option<String>)> {
    sqlx::query_as(
        "SELECT o.status, po.status FROM orders o LEFT JOIN payment_orders po ON po.order_id = o.id
         WHERE o.gateway = $1 AND o.session_id = $2",
    )
    .bind(gateway)
    .bind(session)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// The URL of the test's own database, for child processes.
pub fn database_url(pool: &PgPool) -> String {
    let o = pool.connect_options();
    let host = if o.get_host().starts_with('/') {
        "127.0.0.1"
    } else {
        o.get_host()
    };
    format!(
        "postgres://{}@{}:{}/{}",
        o.get_username(),
        host,
        o.get_port(),
        o.get_database().unwrap_or("postgres")
    )
}

/// A queue catalogue file for child worker processes, with short leases so tests are quick.
pub fn queues_file(name: &str, events_concurrency: u32) -> std::path::PathBuf {
    let path =
        std::env::temp_dir().join(format!("payfleet-test-{name}-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "[fleet]\nlease_ms = 1000\nrescue_interval_ms = 200\nshutdown_timeout_ms = 2000\n\
             [queues.default]\nconcurrency = 4\ntimeout_ms = 5000\n\
             [queues.events]\nconcurrency = {events_concurrency}\ntimeout_ms = 5000\n"
        ),
    )
    .unwrap();
    path
}

/// `payfleet <args>` against the test's database.
pub fn payfleet(pool: &PgPool, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_payfleet"));
    cmd.args(args)
        .env("DATABASE_URL", database_url(pool))
        .env("RUST_LOG", "warn")
        .env_remove("PAYFLEET_QUEUES")
        .kill_on_drop(true);
    cmd
}

pub async fn processed_events(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payment_events WHERE processed_at IS NOT NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Delivers `n` payment webhooks for sessions `sess_0..n`, 16 at a time.
pub async fn deliver_payments(app: &std::sync::Arc<TestApp>, n: usize) {
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..16 {
        let app = app.clone();
        tasks.spawn(async move {
            for i in (w..n).step_by(16) {
                let d = internal(
                    &format!("msg_{i}"),
                    &payment_body("payment.succeeded", &format!("sess_{i}"), "10.00"),
                );
                let (status, body) = app.deliver(&d).await;
                assert_eq!(status, 200, "{body}");
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
}
