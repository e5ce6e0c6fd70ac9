use std::net::SocketAddr;

use payfleet::config::Config;
use payfleet::gateways::GatewayName;
use payfleet::payments::{ProcessPaymentEvent, Processor};
use payfleet::queue::{Job, QueueSettings, Registry, work_until_idle};
use payfleet::secret::Secret;
use payfleet::startup::{self, Roles, Running};
use payfleet::webhooks::WebhookSecrets;
use payfleet::webhooks::signature::{StandardSecret, hex_hmac};
use sqlx::PgPool;
use tokio::net::TcpListener;

pub const STRIPE_SECRET: &str = "whsec_test_stripe_secret";
pub const MP_SECRET: &str = "mp-test-secret";
pub const RAZORPAY_SECRET: &str = "rzp-test-secret";
pub const INTERNAL_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
pub const MOCK_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

pub fn all_secrets() -> WebhookSecrets {
    WebhookSecrets {
        stripe: Some(Secret::new(STRIPE_SECRET)),
        mercadopago: Some(Secret::new(MP_SECRET)),
        razorpay: Some(Secret::new(RAZORPAY_SECRET)),
        internal: Some(StandardSecret::parse(INTERNAL_SECRET).unwrap()),
        mock: Some(StandardSecret::parse(MOCK_SECRET).unwrap()),
    }
}

/// The configuration of a test process: the built-in defaults, every gateway enabled.
pub fn test_config() -> Config {
    let mut config = Config::from(&[("PAYFLEET_QUEUES", "jobs/queues.toml")]).unwrap();
    config.webhooks = all_secrets();
    config
}

pub struct TestApp {
    pub addr: SocketAddr,
    pub pool: PgPool,
    pub http: reqwest::Client,
    /// Keeps the server (and its event writer) for the test's duration.
    _running: Running,
}

pub async fn spawn_app(pool: PgPool) -> TestApp {
    spawn_app_with(pool, test_config()).await
}

/// Starts the receiver as `payfleet serve` does, on port 0 against the test's database.
pub async fn spawn_app_with(pool: PgPool, config: Config) -> TestApp {
    payfleet::tls::install_provider();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let running = startup::start(&config, pool.clone(), Roles::SERVE, Some(listener)).unwrap();
    TestApp {
        addr: running.addr().unwrap(),
        pool,
        http: reqwest::Client::new(),
        _running: running,
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

    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = self
            .http
            .get(format!("http://{}{path}", self.addr))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.text().await.unwrap())
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

/// How [`DbProxy`] treats connections to the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Bytes flow both ways.
    Up,
    /// The port is closed: connecting is refused at once, open connections are cut.
    Refused,
    /// Connections are accepted and then nothing ever answers (a partition, a hung server).
    Blackhole,
}

/// A TCP proxy in front of PostgreSQL, so a test can make the database really unreachable for
/// the app under test while other tests keep using the server.
pub struct DbProxy {
    pub addr: SocketAddr,
    link: tokio::sync::watch::Sender<Link>,
}

impl DbProxy {
    pub async fn start(pool: &PgPool) -> DbProxy {
        let o = pool.connect_options();
        let host = if o.get_host().starts_with('/') {
            "127.0.0.1".to_owned()
        } else {
            o.get_host().to_owned()
        };
        let upstream = format!("{host}:{}", o.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (link, mut watch) = tokio::sync::watch::channel(Link::Up);
        tokio::spawn(async move {
            let mut listener = Some(listener);
            loop {
                let mode = *watch.borrow_and_update();
                match (&listener, mode) {
                    (Some(_), Link::Refused) => listener = None,
                    (None, Link::Up | Link::Blackhole) => {
                        listener = Some(TcpListener::bind(addr).await.unwrap());
                    }
                    _ => {}
                }
                let Some(l) = &listener else {
                    if watch.changed().await.is_err() {
                        return;
                    }
                    continue;
                };
                tokio::select! {
                    accepted = l.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let mut cut = watch.clone();
                        let upstream = upstream.clone();
                        tokio::spawn(async move {
                            if mode == Link::Blackhole {
                                // Hold the socket, answer nothing, until the link changes.
                                let _ = cut.changed().await;
                                drop(client);
                                return;
                            }
                            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else { return };
                            let (mut cr, mut cw) = client.into_split();
                            let (mut sr, mut sw) = server.into_split();
                            tokio::select! {
                                _ = tokio::io::copy(&mut cr, &mut sw) => {}
                                _ = tokio::io::copy(&mut sr, &mut cw) => {}
                                _ = async { while cut.changed().await.is_ok() && *cut.borrow() == Link::Up {} } => {}
                            }
                        });
                    }
                    changed = watch.changed() => if changed.is_err() { return },
                }
            }
        });
        DbProxy { addr, link }
    }

    pub fn set(&self, link: Link) {
        self.link.send_replace(link);
    }

    /// A pool for the app under test that reaches the database through this proxy.
    pub fn pool(&self, pool: &PgPool) -> PgPool {
        let options = (*pool.connect_options())
            .clone()
            .host(&self.addr.ip().to_string())
            .port(self.addr.port());
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(std::time::Duration::from_secs(5))
            .connect_lazy_with(options)
    }
}
