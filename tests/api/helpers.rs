use std::net::SocketAddr;

use payfleet::auth::{self, Token};
use payfleet::config::Config;
use payfleet::gateways::GatewayName;
use payfleet::gateways::signature::hex_hmac;
use payfleet::payments::ProcessPaymentEvent;
use payfleet::secret::Secret;
use payfleet::secret::StandardSecret;
use payfleet::startup::{self, Roles, Running};
use payfleet_queue::{Job, QueueSettings, Registry, work_until_idle};
use sqlx::PgPool;
use tokio::net::TcpListener;

pub const STRIPE_SECRET: &str = "whsec_test_stripe_secret";
pub const MP_SECRET: &str = "mp-test-secret";
pub const RAZORPAY_SECRET: &str = "rzp-test-secret";
pub const INTERNAL_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
pub const MOCK_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

/// Every gateway's webhook secret, and no other.
pub fn with_all_secrets(config: &mut Config) {
    let g = &mut config.gateways;
    g.stripe.webhook_secret = Some(Secret::new(STRIPE_SECRET));
    g.stripe.platform_webhook_secret = None;
    g.mercadopago.webhook_secret = Some(Secret::new(MP_SECRET));
    g.razorpay.webhook_secret = Some(Secret::new(RAZORPAY_SECRET));
    g.hosted.internal = Some(StandardSecret::parse(INTERNAL_SECRET).unwrap());
    g.hosted.mock = Some(StandardSecret::parse(MOCK_SECRET).unwrap());
}

pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789-abcdefghij";

/// The configuration of a test process: the built-in defaults, every gateway's webhooks
/// enabled, an admin token, and RabbitMQ queues of its own (dropped by the broker a minute
/// after the test stops using them).
pub fn test_config() -> Config {
    let mut config = Config::from(&[
        ("PAYFLEET_QUEUES", "jobs/queues.toml"),
        // Patient: the whole suite runs in parallel on two cores, each test with a fleet and
        // broker queues of its own (the services' quorum queues), and a payment link took more than 3 s there at times (the
        // buyer's 503 failed tests that expect the link). A test that times the 503 sets its own.
        ("PAYFLEET_RPC_TIMEOUT_MS", "10000"),
        ("PAYFLEET_AMQP_QUEUE_TTL_MS", "60000"),
        // Tests step the recurring runs themselves.
        ("PAYFLEET_RECURRING", "off"),
    ])
    .unwrap();
    with_all_secrets(&mut config);
    config.admin_token = Some(Token::parse(ADMIN_TOKEN).unwrap());
    // Tests pay on the simulated gateways' pages.
    config.gateways.hosted.simulator = true;
    // Tests read the gauges right after what changes them.
    config.metrics_refresh = std::time::Duration::ZERO;
    // A test's buyers reach its own receiver, whose address each spawn writes here (a worker
    // spawned alone keeps the default, which its checks do not follow).
    config.public_url_given = true;
    config.messaging.namespace = format!("test-{:016x}", rand::random::<u64>());
    config
}

pub struct TestApp {
    pub addr: SocketAddr,
    pub pool: PgPool,
    /// The marketplace backend: every request carries its API key (of no seller) unless it
    /// sets another `Authorization` of its own.
    pub http: reqwest::Client,
    /// A caller with no credential at all (an attacker, a buyer's browser).
    pub anon: reqwest::Client,
    /// The backend's API key.
    pub api_key: String,
    /// The configuration it runs with (its public URL is its own address).
    pub config: Config,
    /// Keeps the server (and its event writer) for the test's duration.
    _running: Running,
}

pub async fn spawn_app(pool: PgPool) -> TestApp {
    spawn_app_with(pool, test_config()).await
}

/// Starts the receiver as `payfleet serve` does, on port 0 against the test's database.
pub async fn spawn_app_with(pool: PgPool, config: Config) -> TestApp {
    spawn_roles(pool, config, Roles::SERVE).await
}

/// Starts the receiver and the workers in one process, as `payfleet up` does.
pub async fn spawn_fleet(pool: PgPool, config: Config) -> TestApp {
    spawn_roles(pool, config, Roles::UP).await
}

pub async fn spawn_roles(pool: PgPool, mut config: Config, roles: Roles) -> TestApp {
    payfleet::tls::install_provider();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // Payment pages and the hosted gateway's deliveries point at this server.
    config.public_url = format!("http://{addr}");
    config.gateways.hosted.internal_webhook_url = format!("http://{addr}/webhooks/internal");
    config.gateways.hosted.mock_webhook_url = format!("http://{addr}/webhooks/mock");
    let running = startup::start(&config, pool.clone(), roles, Some(listener)).unwrap();
    // On the real broker, tests start once this process is on it, its RPC client's channel is
    // set up and its RPC consumers take requests (a loaded machine may take a while: a first
    // checkout met a client not set up yet 300 ms after the connection, and a first payment
    // with coins a consumer whose queue was not declared yet; each got a 503), so a first call
    // does not meet a connection, a channel or a consumer still being made. Tests that cut the
    // broker on purpose use a proxy and are not held up.
    if config.amqp_url.expose() == payfleet::config::DEFAULT_AMQP_URL {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !(running.broker().is_connected() && running.rpc_ready())
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        // The other channels and consumers (the order messages' relay and queues) are set up
        // right after the connection.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    // An outage test may start the app with its database already cut off: its backend then
    // holds a key of the right shape that nobody could look up (its requests meet the outage).
    let api_key = match tokio::time::timeout(
        std::time::Duration::from_secs(5),
        auth::api_keys::create(
            &pool,
            auth::NewApiKey {
                name: "tests".into(),
                seller_id: None,
            },
        ),
    )
    .await
    {
        Ok(Ok((_, key))) => key,
        _ => format!("pfk_{}", "u".repeat(43)),
    };
    TestApp {
        addr: running.addr().unwrap(),
        pool,
        http: backend_client(&api_key),
        anon: reqwest::Client::new(),
        api_key,
        config,
        _running: running,
    }
}

/// An API key made as `POST /admin/api-keys` makes one.
/// A worker process's roles, once its RPC consumers take requests (the payment side, the
/// coins), and a receiver beside it: a first checkout finds its link answered. The worker's
/// handle stops it.
pub async fn worker_then_receiver(
    pool: &PgPool,
    config: &Config,
    patience: std::time::Duration,
) -> (Running, TestApp) {
    let running = startup::start(config, pool.clone(), Roles::WORK, None).unwrap();
    wait_for(
        "the worker's RPC consumers (payment links, their batches, coins)",
        patience,
        async || running.rpc_ready(),
    )
    .await;
    let receiver = spawn_roles(pool.clone(), config.clone(), Roles::SERVE).await;
    (running, receiver)
}

pub async fn api_key(pool: &PgPool, seller: Option<&str>) -> String {
    auth::api_keys::create(
        pool,
        auth::NewApiKey {
            name: "tests".into(),
            seller_id: seller.map(str::to_owned),
        },
    )
    .await
    .unwrap()
    .1
}

/// A client whose every request carries `key` (unless it sets its own `Authorization`).
pub fn backend_client(key: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {key}").parse().unwrap(),
    );
    reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap()
}

/// An answer's status and text, checked against the API's description
/// (`openapi::check_answer`).
pub async fn checked(
    method: reqwest::Method,
    path: &str,
    resp: reqwest::Response,
) -> (u16, String) {
    let (status, content_type, text) = read_answer(resp).await;
    crate::openapi::check_answer(&method, path, status, &content_type, &text);
    (status, text)
}

/// An answer's status, media type and text.
pub async fn read_answer(resp: reqwest::Response) -> (u16, String, String) {
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (status, content_type, resp.text().await.unwrap())
}

/// The form token a payment page renders.
pub fn form_token(page: &str) -> String {
    let start = page
        .find("name=\"token\" value=\"")
        .expect("a payment form")
        + 20;
    let rest = &page[start..];
    rest[..rest.find('"').unwrap()].to_owned()
}

impl TestApp {
    /// A buyer on a payment page: opens it and posts its form (with the page's token) for
    /// `outcome`. Returns the post's status and page.
    pub async fn pay(&self, url: &str, outcome: &str) -> (u16, String) {
        let page = self
            .anon
            .get(url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let resp = self
            .anon
            .post(url)
            .form(&[("outcome", outcome), ("token", &form_token(&page))])
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.text().await.unwrap())
    }

    /// `GET /metrics` as Prometheus scrapes it (with the admin token): its text.
    pub async fn metrics(&self) -> String {
        let resp = self
            .anon
            .get(format!("http://{}/metrics", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap()
    }

    /// The route paths the receiver serves.
    pub fn paths(&self) -> &[&'static str] {
        self._running.paths()
    }
}

pub fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// A signed delivery, as each gateway sends it.
#[derive(Clone)]
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
    stripe_signed(STRIPE_SECRET, body, ts)
}

/// A Stripe delivery signed with `secret` (an endpoint's own).
pub fn stripe_signed(secret: &str, body: &str, ts: i64) -> Delivery {
    let sig = hex_hmac(
        secret.as_bytes(),
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
    mercadopago_topic("payment", data_id, request_id, ts_ms)
}

/// A Mercado Pago notification of `kind` (`payment`, `subscription_authorized_payment`,
/// `subscription_preapproval`) naming `data_id`.
pub fn mercadopago_topic(kind: &str, data_id: &str, request_id: &str, ts_ms: i64) -> Delivery {
    let manifest = format!("id:{data_id};request-id:{request_id};ts:{ts_ms};");
    let sig = hex_hmac(MP_SECRET.as_bytes(), &[manifest.as_bytes()]);
    let body = format!(
        r#"{{"action":"{kind}.updated","api_version":"v1","data":{{"id":"{data_id}"}},"id":987,"type":"{kind}"}}"#
    );
    Delivery {
        gateway: GatewayName::MercadoPago,
        headers: vec![
            ("x-signature".into(), format!("ts={ts_ms},v1={sig}")),
            ("x-request-id".into(), request_id.into()),
        ],
        query: format!("?data.id={data_id}&type={kind}"),
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
        let path = format!("/webhooks/{}", d.gateway);
        let (status, text) = checked(reqwest::Method::POST, &path, resp).await;
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
        )
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = self
            .http
            .get(format!("http://{}{path}", self.addr))
            .send()
            .await
            .unwrap();
        checked(reqwest::Method::GET, path, resp).await
    }

    pub async fn events(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payment_events")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// Steps the event workers: runs every due processing job now, in this task.
pub async fn process_events(pool: &PgPool) -> usize {
    process_events_with(pool, &test_config()).await
}

/// Steps a queue's workers, as `work` would run them with `config`.
pub async fn step(pool: &PgPool, config: &Config, queue: &str) -> usize {
    let settings = QueueSettings {
        concurrency: 10,
        timeout_ms: 30_000,
        claimers: 1,
        fetch_cooldown_ms: 0,
        claim_batch: None,
    };
    let registry: Registry = startup::registry(config, pool).unwrap();
    work_until_idle(pool, &registry, queue, &settings)
        .await
        .unwrap()
}

pub async fn process_events_with(pool: &PgPool, config: &Config) -> usize {
    step(pool, config, ProcessPaymentEvent::QUEUE).await
}

/// Orders as checkout would have made them, one per session, each with the payment side's
/// session record, so that events for these sessions find their orders.
pub async fn orders_for(
    pool: &PgPool,
    gateway: &str,
    sessions: &[&str],
    total: &str,
    currency: &str,
) {
    sqlx::query(
        "WITH s AS (INSERT INTO sellers (name, payout_frequency, payout_minimum)
                    VALUES ('Fixture seller', 'weekly', 0) RETURNING id),
              c AS (INSERT INTO checkouts (buyer_id, gateway) VALUES ('fixture-buyer', $1) RETURNING id),
              n AS (UPDATE order_numbers SET last = last + cardinality($2::text[]) RETURNING last),
              o AS (INSERT INTO orders (number, checkout_id, seller_id, buyer_id, kind, currency, subtotal, total,
                                        platform_fee, seller_net, gateway, session_id, payment_url, expires_at)
                    SELECT n.last - cardinality($2::text[]) + t.i, c.id, s.id, 'fixture-buyer', 'one_off', $4,
                           $3::numeric, $3::numeric, 0, $3::numeric, $1, t.session, 'http://pay/' || t.session,
                           now() + interval '1 hour'
                    FROM unnest($2::text[]) WITH ORDINALITY AS t(session, i), n, c, s
                    RETURNING number, session_id)
         INSERT INTO payment_sessions (order_number, attempt, gateway, session_id, url, amount, currency, platform_fee)
         SELECT number, 1, $1, session_id, 'http://pay/' || session_id, $3::numeric, $4, 0 FROM o",
    )
    .bind(gateway)
    .bind(sessions)
    .bind(total)
    .bind(currency)
    .execute(pool)
    .await
    .unwrap();
}

pub async fn order_status(
    pool: &PgPool,
    gateway: &str,
    session: &str,
) -> Option<(String, Option<String>)> {
    sqlx::query_as(
        "SELECT o.status, po.status FROM orders o
         LEFT JOIN payment_orders po ON po.gateway = o.gateway AND po.session_id = o.session_id
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
    queues_file_leased(name, events_concurrency, 1000)
}

/// [`queues_file`] with leases of `lease_ms`: long enough, a loaded machine never has a run's
/// lease expire (and the job claimed again) while its worker lives.
pub fn queues_file_leased(
    name: &str,
    events_concurrency: u32,
    lease_ms: u64,
) -> std::path::PathBuf {
    let path =
        std::env::temp_dir().join(format!("payfleet-test-{name}-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "[fleet]\nlease_ms = {lease_ms}\nrescue_interval_ms = 200\nshutdown_timeout_ms = 2000\n\
             [queues.default]\nconcurrency = 4\ntimeout_ms = 5000\n\
             [queues.events]\nconcurrency = {events_concurrency}\ntimeout_ms = 5000\n\
             [queues.orders]\nconcurrency = 4\ntimeout_ms = 5000\n\
             [queues.payments]\nconcurrency = 4\ntimeout_ms = 5000\n\
             [queues.recurring]\nconcurrency = 2\ntimeout_ms = 30000\n"
        ),
    )
    .unwrap();
    path
}

/// The error output of `cmd`, a process expected to refuse to start: it must end, unsuccessful,
/// within 30 s (one that starts instead runs until the test's timeout says so).
pub async fn refused_at_start(cmd: &mut tokio::process::Command) -> String {
    let out = tokio::time::timeout(std::time::Duration::from_secs(30), cmd.output())
        .await
        .expect("the process stops at start")
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `payfleet <args>` against the test's database.
pub fn payfleet(pool: &PgPool, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_payfleet"));
    cmd.args(args)
        .env("DATABASE_URL", database_url(pool))
        .env("RUST_LOG", "warn")
        // Recurring runs would come and go; these tests count jobs to their end.
        .env("PAYFLEET_RECURRING", "off")
        .env_remove("PAYFLEET_QUEUES")
        .kill_on_drop(true);
    cmd
}

/// How many claims the queue has made in this database: every claim of a job takes a new lease
/// token from one sequence. (A completed job's row is deleted, so its attempts are not left to
/// count.)
pub async fn claims_made(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM jobs_lease_token_seq",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

pub async fn processed_events(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payment_events WHERE processed_at IS NOT NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Delivers `n` payment webhooks for the orders of sessions `sess_0..n` (made here), 16 at a
/// time.
pub async fn deliver_payments(app: &std::sync::Arc<TestApp>, n: usize) {
    let sessions: Vec<String> = (0..n).map(|i| format!("sess_{i}")).collect();
    let names: Vec<&str> = sessions.iter().map(String::as_str).collect();
    orders_for(&app.pool, "internal", &names, "10.00", "BRL").await;
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

/// A TCP proxy in front of PostgreSQL or RabbitMQ, so a test can make them really unreachable
/// for the app under test while other tests keep using the servers.
pub struct TcpProxy {
    pub addr: SocketAddr,
    link: tokio::sync::watch::Sender<Link>,
}

/// The proxy in front of the test's PostgreSQL server.
pub type DbProxy = TcpProxy;

impl TcpProxy {
    pub async fn for_database(pool: &PgPool) -> TcpProxy {
        let o = pool.connect_options();
        let host = if o.get_host().starts_with('/') {
            "127.0.0.1".to_owned()
        } else {
            o.get_host().to_owned()
        };
        Self::start(&format!("{host}:{}", o.get_port())).await
    }

    pub async fn start(upstream: &str) -> TcpProxy {
        let upstream = upstream.to_owned();
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
        TcpProxy { addr, link }
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

#[path = "../../crates/queue/tests/support/wait.rs"]
mod wait;
pub use wait::wait_for;

/// Runs `rabbitmqctl` with `args` (`-n <node>` first for a node other than the main broker's)
/// and returns what it printed; fails the test if it fails.
pub fn rabbitmqctl(args: &[&str]) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What the consistency check `check` finds now (no grace): each finding's subject and detail.
pub async fn findings_of(pool: &PgPool, check: &str) -> Vec<(String, String)> {
    payfleet::consistency::check(pool, std::time::Duration::ZERO)
        .await
        .unwrap()
        .into_iter()
        .filter(|v| v.check == check)
        .map(|v| (v.subject, v.detail))
        .collect()
}
