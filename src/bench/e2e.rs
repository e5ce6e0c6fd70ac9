//! `payfleet bench e2e`: the work the fleet exists for, measured from outside through the HTTP
//! API, beside pgbench's TPC-B-like transactions at the same number of clients in the same run.
//!
//! 0. The baseline, first: `pgbench -i` at scale `clients`, then its TPC-B-like script at
//!    `clients`; its tables are dropped before the fleet starts.
//! 1. Checkouts: `clients` backends each check out one order at a time (a new Idempotency-Key
//!    each, the payment link made over the RabbitMQ RPC), for one seller's product and then
//!    for fifty sellers' products.
//! 2. Payment effects, per scenario (one seller: a flash sale; fifty sellers): with the
//!    workers stopped, a signed `payment.succeeded` of the internal gateway arrives for every
//!    order (a backlog); the workers start, and the clock runs until every order is paid, its
//!    sale and fee posted and its order message written. Effects per second.
//! 3. Receipt to effect: with the workers running, payments arrive at a steady pace over fifty
//!    sellers, by default half the target rate (the one-seller target is as many effects a
//!    second as pgbench's transactions in 0), and each one's time from the webhook's sending
//!    to its sale credit's writing is taken.
//!
//! The ledger is checked afterwards (every balance its entries, every currency zero) and every
//! paid order must have its sale credit.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::net::TcpListener;

use super::cpu::{self, Usage};
use super::{percentile, send_all, which_pgbench};
use crate::scratch::{self, free_port, stop, wait_ready};

/// The one-seller effects target, as a ratio to pgbench's TPC-B rate: the latency phase runs at
/// half of it.
const ONE_SELLER_TARGET: f64 = 1.0;
use payfleet::config::Config;
use payfleet::secret::StandardSecret;
use payfleet::startup::{self, Roles};
use payfleet::{auth, catalogue, ledger};

#[derive(clap::Args, Debug)]
pub struct E2eArgs {
    /// Orders per scenario (one seller, fifty sellers).
    #[arg(long, default_value_t = 3000)]
    pub orders: usize,
    /// Concurrent clients: checkout backends, webhook senders, and pgbench's clients.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Sellers of the many-sellers scenario.
    #[arg(long, default_value_t = 50)]
    pub sellers: usize,
    /// Payments sent at a steady pace for the receipt-to-effect latency (0 skips it).
    #[arg(long, default_value_t = 1000)]
    pub latency_samples: usize,
    /// Their pace, payments per second (default: half the target rate, the one-seller target
    /// of issue 19 being as many effects a second as the same run's pgbench transactions).
    #[arg(long)]
    pub pace: Option<f64>,
    /// Keep-alive connections the paced payments share, each payment sent at its tick by
    /// whichever is free, as a gateway's delivery workers (0: a new connection for every
    /// payment, as a sender that keeps none).
    #[arg(long, default_value_t = 16)]
    pub paced_connections: usize,
    /// How long pgbench runs.
    #[arg(long, default_value_t = 20)]
    pub pgbench_secs: u64,
    /// Run the fleet as processes of this binary, as deployed: one `serve` and this many
    /// `work` processes, each on its own default pool (0: receiver and workers in the bench's
    /// own process, on one pool).
    #[arg(long, default_value_t = 0)]
    pub worker_processes: usize,
}

/// The fleet under test: in the bench's process, or child processes of this binary.
enum Fleet {
    InProcess {
        app: Box<Config>,
        pool: PgPool,
        running: Option<Box<startup::Running>>,
    },
    Processes {
        env: Vec<(String, String)>,
        count: usize,
        children: Vec<tokio::process::Child>,
    },
}

impl Fleet {
    /// Starts the workers; returns once they are started (the processes: once each answers
    /// its health check).
    async fn start_workers(&mut self) -> anyhow::Result<()> {
        match self {
            Self::InProcess { app, pool, running } => {
                *running = Some(Box::new(startup::start(
                    app,
                    pool.clone(),
                    Roles::WORK,
                    None,
                )?));
            }
            Self::Processes {
                env,
                count,
                children,
            } => {
                let mut health = Vec::new();
                for _ in 0..*count {
                    let port = free_port()?;
                    let mut env = env.clone();
                    env.push(("PAYFLEET_WORKER_BIND".into(), format!("127.0.0.1:{port}")));
                    children.push(scratch::spawn(&env, "work", None)?);
                    health.push(port);
                }
                for port in health {
                    wait_ready(port).await?;
                }
            }
        }
        Ok(())
    }

    /// Stops the workers (SIGTERM for the processes) and waits for them.
    async fn stop_workers(&mut self) -> anyhow::Result<()> {
        match self {
            Self::InProcess { running, .. } => {
                if let Some(r) = running.take() {
                    r.stop().await;
                }
            }
            Self::Processes { children, .. } => {
                for mut child in children.drain(..) {
                    stop(&mut child).await?;
                }
            }
        }
        Ok(())
    }
}

/// The receiver: in the bench's process, or a child `payfleet serve`.
enum Receiver {
    InProcess(Option<startup::Running>),
    Process(tokio::process::Child),
}

impl Receiver {
    async fn stop(&mut self) -> anyhow::Result<()> {
        match self {
            Self::InProcess(r) => {
                if let Some(r) = r.take() {
                    r.stop().await;
                }
                Ok(())
            }
            Self::Process(child) => stop(child).await,
        }
    }
}

/// An order awaiting its payment: its number and its internal gateway session.
struct Awaiting {
    number: i64,
    session: String,
}

pub async fn e2e(config: &Config, args: E2eArgs) -> anyhow::Result<()> {
    if args.orders == 0 || args.clients == 0 || args.sellers == 0 {
        bail!("--orders, --clients and --sellers must be positive");
    }
    let pgbench = which_pgbench().context("pgbench is needed for the PostgreSQL baseline (Debian: apt-get install postgresql-15 or postgresql-contrib)")?;
    let (pool, url) = scratch::database(config, "bench", config.db_pool_size.max(40)).await?;
    let (app, secret, secret_text) = scratch::simulated(config, "bench");
    let (_, api_key) = auth::api_keys::create(
        &pool,
        auth::NewApiKey {
            name: "bench e2e".into(),
            seller_id: None,
        },
    )
    .await?;
    let flash = products(&pool, 1, "flash").await?;
    let many = products(&pool, args.sellers, "shop").await?;

    // 0. The baseline, first: the latency phase's default pace is half the target rate, and
    // the target is a ratio to it. Its tables are dropped after it (the phases below do not
    // share the buffers with them).
    let phase = crate::progress::spinner("pgbench's TPC-B baseline");
    let (tps, baseline_cpu) =
        tpc_b(&pgbench, url.expose(), args.clients, args.pgbench_secs).await?;
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS pgbench_accounts, pgbench_branches, pgbench_history, pgbench_tellers",
    )
    .execute(&pool)
    .await?;
    eprintln!(
        "pgbench: TPC-B-like at {} clients: {tps:.0} tps{}",
        args.clients,
        baseline_cpu
            .map(|u| format!(
                " (the cores {:.0} % busy, PostgreSQL {:.0} %)",
                u.busy * 100.0,
                u.postgres * 100.0
            ))
            .unwrap_or_default()
    );
    phase.finish_and_clear();

    // The receiver, and the fleet whose workers the bench stops and starts.
    let (addr, mut receiver, mut fleet) = if args.worker_processes == 0 {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let receiver = startup::start(&app, pool.clone(), Roles::SERVE, Some(listener))?;
        let fleet = Fleet::InProcess {
            app: Box::new(app.clone()),
            pool: pool.clone(),
            running: None,
        };
        (addr, Receiver::InProcess(Some(receiver)), fleet)
    } else {
        // The bench's own broker queues, the rest of the configuration as deployed: each process
        // its default pool.
        let env: Vec<(String, String)> = vec![
            ("DATABASE_URL".into(), url.expose().to_owned()),
            ("INTERNAL_WEBHOOK_SECRET".into(), secret_text),
            ("PAYFLEET_PAYMENT_SIMULATOR".into(), "on".into()),
            (
                "PAYFLEET_AMQP_NAMESPACE".into(),
                app.messaging.namespace.clone(),
            ),
            ("PAYFLEET_AMQP_QUEUE_TTL_MS".into(), "600000".into()),
            (
                "PAYFLEET_AMQP_QUORUM".into(),
                payfleet::env::on_off(app.messaging.queues.quorum).into(),
            ),
            (
                "PAYFLEET_AMQP_RPC_QUORUM".into(),
                payfleet::env::on_off(app.messaging.queues.rpc_quorum).into(),
            ),
            ("AMQP_URL".into(), app.amqp_url.expose().to_owned()),
        ];
        let port = free_port()?;
        let mut serve_env = env.clone();
        serve_env.push(("PAYFLEET_BIND".into(), format!("127.0.0.1:{port}")));
        let child = scratch::spawn(&serve_env, "serve", None)?;
        wait_ready(port).await?;
        let fleet = Fleet::Processes {
            env,
            count: args.worker_processes,
            children: Vec::new(),
        };
        (
            SocketAddr::from(([127, 0, 0, 1], port)),
            Receiver::Process(child),
            fleet,
        )
    };
    fleet.start_workers().await?;
    let mut lines = vec![format!("pgbench_tpcb_c{}_tps={tps:.0}", args.clients)];
    if let Some(u) = baseline_cpu {
        lines.push(format!("pgbench_cpu_busy={:.2}", u.busy));
    }

    // 1. Checkouts.
    let phase = crate::progress::spinner(format!("{} checkouts", 2 * args.orders));
    let wal_before = wal_position(&pool).await?;
    let started = Instant::now();
    let cpu_before = cpu::sample();
    let (flash_orders, mut timed) =
        checkouts(addr, &api_key, &flash, args.orders, args.clients).await?;
    let (many_orders, timed_many) =
        checkouts(addr, &api_key, &many, args.orders, args.clients).await?;
    let secs = started.elapsed().as_secs_f64();
    timed.extend(timed_many);
    let mut lat: Vec<Duration> = timed.iter().map(|t| t.took).collect();
    lat.sort();
    let checkouts_per_s = (2 * args.orders) as f64 / secs;
    eprintln!(
        "e2e: {} checkouts at {} clients: {checkouts_per_s:.0}/s, p50 {:.1} ms, p99 {:.1} ms",
        2 * args.orders,
        args.clients,
        percentile(&lat, 0.5),
        percentile(&lat, 0.99)
    );
    for (stage, times) in checkout_stages(&pool, &timed).await? {
        eprintln!(
            "e2e:   {stage}: p50 {:.1} ms, p99 {:.1} ms",
            percentile(&times, 0.5),
            percentile(&times, 0.99)
        );
    }
    report_cpu("checkouts", cpu_before, 2 * args.orders, &mut lines);
    report_wal("checkouts", &pool, &wal_before, 2 * args.orders, &mut lines).await?;
    phase.finish_and_clear();
    lines.push(format!("e2e_checkouts_per_s={checkouts_per_s:.0}"));
    lines.push(format!("e2e_checkout_p50_ms={:.1}", percentile(&lat, 0.5)));
    lines.push(format!("e2e_checkout_p99_ms={:.1}", percentile(&lat, 0.99)));
    fleet.stop_workers().await?;

    // 2. Payment effects from a backlog.
    let mut next_event = 0usize;
    let mut rates = Vec::new();
    for (name, orders) in [
        ("one_seller", &flash_orders),
        ("many_sellers", &many_orders),
    ] {
        let phase =
            crate::progress::spinner(format!("{name}: {} payments to effect", orders.len()));
        // Their receipt alone, the workers stopped: what a payment's webhook costs before its
        // processing, which the drain's figures below leave out and a paced payment's include.
        let cpu_before = cpu::sample();
        let sending = Instant::now();
        pay_all(addr, &secret, orders, args.clients, &mut next_event).await?;
        let secs = sending.elapsed().as_secs_f64().max(1e-3);
        eprintln!(
            "e2e: {name}: {} payments received in {secs:.2} s: {:.0}/s",
            orders.len(),
            orders.len() as f64 / secs
        );
        report_cpu(
            &format!("receipt_{name}"),
            cpu_before,
            orders.len(),
            &mut lines,
        );
        let wal_before = wal_position(&pool).await?;
        let started = chrono::Utc::now();
        let cpu_before = cpu::sample();
        fleet.start_workers().await?;
        let numbers: Vec<i64> = orders.iter().map(|o| o.number).collect();
        let Drained {
            first,
            last,
            cpu_unfinished,
        } = effected(&pool, &numbers).await?;
        let cpu_after = cpu_unfinished.or_else(cpu::sample);
        let since = |at: chrono::DateTime<chrono::Utc>| {
            (at - started)
                .to_std()
                .unwrap_or_default()
                .as_secs_f64()
                .max(1e-3)
        };
        let secs = since(last);
        let rate = orders.len() as f64 / secs;
        eprintln!(
            "e2e: {name}: {} payments to effect in {secs:.2} s: {rate:.0}/s (the first at {:.0} ms)",
            orders.len(),
            since(first) * 1000.0
        );
        report_usage(
            &format!("effects_{name}"),
            cpu::between(cpu_before, cpu_after),
            orders.len(),
            &mut lines,
        );
        report_wal(
            &format!("effects_{name}"),
            &pool,
            &wal_before,
            orders.len(),
            &mut lines,
        )
        .await?;
        phase.finish_and_clear();
        lines.push(format!("e2e_effects_{name}_per_s={rate:.0}"));
        rates.push((name, rate));
        if name == "one_seller" {
            fleet.stop_workers().await?;
        }
    }

    // 3. Receipt to effect at a steady pace, the workers running.
    if args.latency_samples > 0 {
        let pace = args.pace.unwrap_or(tps * ONE_SELLER_TARGET / 2.0).max(1.0);
        let orders = {
            // Fresh orders over the many sellers, the workers running (their links made).
            let (o, _) =
                checkouts(addr, &api_key, &many, args.latency_samples, args.clients).await?;
            o
        };
        let cpu_before = cpu::sample();
        let (lat, written, stages) = paced(
            &pool,
            addr,
            &secret,
            &orders,
            (pace, args.paced_connections),
            &mut next_event,
        )
        .await?;
        let cpu_after = cpu::sample();
        eprintln!(
            "e2e: receipt to effect at {pace:.0} payments/s: p50 {:.1} ms, p99 {:.1} ms (to the sale credit's writing, before its commit: p50 {:.1} ms, p99 {:.1} ms)",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            percentile(&written, 0.5),
            percentile(&written, 0.99)
        );
        for (stage, times) in [
            (
                "sent to stored (the request, the receiver's writer)",
                &stages.to_stored,
            ),
            (
                "stored to its batch's start (commit, notification, claim, a free batch)",
                &stages.to_batch,
            ),
            (
                "batch's start to the sale credit's writing (reads and writes before the posting)",
                &stages.to_accounts,
            ),
            (
                "writing to seen committed (the wait for the accounts, the posting, the commit, the watcher)",
                &stages.to_visible,
            ),
        ] {
            eprintln!(
                "e2e:   {stage}: p50 {:.1} ms, p99 {:.1} ms",
                percentile(times, 0.5),
                percentile(times, 0.99)
            );
        }
        report_usage(
            "paced",
            cpu::between(cpu_before, cpu_after),
            orders.len(),
            &mut lines,
        );
        lines.push(format!("e2e_paced_per_s={pace:.0}"));
        lines.push(format!("e2e_paced_connections={}", args.paced_connections));
        lines.push(format!(
            "e2e_receipt_to_effect_p50_ms={:.1}",
            percentile(&lat, 0.5)
        ));
        lines.push(format!(
            "e2e_receipt_to_effect_p99_ms={:.1}",
            percentile(&lat, 0.99)
        ));
    }
    fleet.stop_workers().await?;
    receiver.stop().await?;
    check_ledger(&pool).await?;

    lines.push(format!(
        "e2e_checkouts_vs_pgbench={:.2}",
        checkouts_per_s / tps
    ));
    for (name, rate) in rates {
        lines.push(format!("e2e_effects_{name}_vs_pgbench={:.2}", rate / tps));
    }
    pool.close().await;
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

/// `sellers` sellers (weekly payouts, no holding period) with one 19.90 BRL product each.
async fn products(pool: &PgPool, sellers: usize, name: &str) -> anyhow::Result<Vec<String>> {
    let mut ids = Vec::with_capacity(sellers);
    for i in 0..sellers {
        let seller = catalogue::create_seller(
            pool,
            catalogue::NewSeller {
                name: format!("{name} {i}"),
                payout_frequency: "weekly".parse()?,
                payout_minimum: "0".into(),
                holding_days: Some(0),
                stripe_account: None,
                payout_minimums: Default::default(),
            },
        )
        .await?;
        let product = catalogue::create_product(
            pool,
            catalogue::NewProduct {
                seller_id: seller.id.to_string(),
                name: format!("{name} {i} item"),
                kind: "one_off".parse()?,
                price: "19.90".into(),
                currency: "BRL".into(),
                interval: None,
            },
        )
        .await?;
        ids.push(product.id.to_string());
    }
    Ok(ids)
}

/// An order's number and three of its rows' timestamps, in the order its stages reached them.
type Stamps = (
    i64,
    chrono::DateTime<chrono::Utc>,
    chrono::DateTime<chrono::Utc>,
    chrono::DateTime<chrono::Utc>,
);

/// The time from one timestamp to a later one (none if the clock says it came first).
fn span(from: chrono::DateTime<chrono::Utc>, to: chrono::DateTime<chrono::Utc>) -> Duration {
    (to - from).to_std().unwrap_or_default()
}

/// A checkout as its client saw it: its order, how long it took, and when (the wall clock,
/// which the database's timestamps share on this machine) it was sent and answered.
struct Timed {
    number: i64,
    took: Duration,
    sent: chrono::DateTime<chrono::Utc>,
    answered: chrono::DateTime<chrono::Utc>,
}

/// Where each checkout's time went, stage by stage, from the rows' own timestamps (each the
/// start of the transaction that wrote it, `now()`): the checkout's `created_at` (the writer's
/// statement), its payment session's `created_at` (the payment side storing the session), its
/// order's `updated_at` (the store of its link and answer).
async fn checkout_stages(
    pool: &PgPool,
    timed: &[Timed],
) -> anyhow::Result<Vec<(&'static str, Vec<Duration>)>> {
    let numbers: Vec<i64> = timed.iter().map(|t| t.number).collect();
    let stamps: Vec<Stamps> = sqlx::query_as(
        "SELECT o.number, c.created_at, s.created_at, o.updated_at
         FROM unnest($1::bigint[]) AS x(number)
         JOIN orders o ON o.number = x.number
         JOIN checkouts c ON c.id = o.checkout_id
         JOIN payment_sessions s ON s.order_number = o.number AND s.attempt = o.payment_attempt",
    )
    .bind(&numbers)
    .fetch_all(pool)
    .await?;
    let at: std::collections::HashMap<i64, &Timed> = timed.iter().map(|t| (t.number, t)).collect();
    let mut stages: [(&'static str, Vec<Duration>); 4] = [
        (
            "sent to written (the request, the wait for the writer's batch)",
            Vec::new(),
        ),
        (
            "written to its session made (the writer's statement and commit, the wait for the link batch, the broker, the gateway's insert)",
            Vec::new(),
        ),
        (
            "session made to its link stored (the session's insert, the broker's reply, the wait for the store's batch)",
            Vec::new(),
        ),
        (
            "link stored to answered (the store's statement and commit, the answer)",
            Vec::new(),
        ),
    ];
    for (number, written, session, stored) in stamps {
        let Some(t) = at.get(&number) else {
            continue;
        };
        for (stage, (from, to)) in stages.iter_mut().zip([
            (t.sent, written),
            (written, session),
            (session, stored),
            (stored, t.answered),
        ]) {
            stage.1.push(span(from, to));
        }
    }
    for (_, times) in &mut stages {
        times.sort();
    }
    Ok(stages.into_iter().collect())
}

/// `count` checkouts by `clients` backends at once, round robin over `products`. Returns the
/// orders and each checkout's time.
async fn checkouts(
    addr: SocketAddr,
    api_key: &str,
    products: &[String],
    count: usize,
    clients: usize,
) -> anyhow::Result<(Vec<Awaiting>, Vec<Timed>)> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(clients)
        .build()?;
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (http, key) = (http.clone(), api_key.to_owned());
            let mine: Vec<(usize, String)> = (0..count)
                .filter(|i| i % clients == c)
                .map(|i| (i, products[i % products.len()].clone()))
                .collect();
            tokio::spawn(async move {
                let mut out = Vec::with_capacity(mine.len());
                for (i, product) in mine {
                    let t = Instant::now();
                    let sent = chrono::Utc::now();
                    let idempotency_key = format!("bench-{:032x}-{i}", rand::random::<u128>());
                    let mut tries = 0;
                    let body = loop {
                        let resp = http
                            .post(format!("http://{addr}/checkout"))
                            .bearer_auth(&key)
                            .header("idempotency-key", &idempotency_key)
                            .json(
                                &json!({"buyer_id": format!("buyer-{i}"), "gateway": "internal",
                                          "items": [{"product_id": product, "quantity": 1}]}),
                            )
                            .send()
                            .await?;
                        let status = resp.status();
                        let body: Value = resp.json().await.unwrap_or(Value::Null);
                        match status.as_u16() {
                            201 => break body,
                            // The payment side is not reachable yet (a fleet just started): the
                            // same request again, as the answer says and a client would.
                            503 if tries < 100 => {
                                tries += 1;
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            _ => bail!("a checkout answered {status}: {body}"),
                        }
                    };
                    let took = t.elapsed();
                    let answered = chrono::Utc::now();
                    let order = &body["orders"][0];
                    let (Some(number), Some(session)) = (
                        order["number"].as_i64(),
                        order["payment"]["session_id"].as_str(),
                    ) else {
                        bail!("a checkout's answer has no order with its payment session: {body}");
                    };
                    out.push((
                        Awaiting {
                            number,
                            session: session.to_owned(),
                        },
                        Timed {
                            number,
                            took,
                            sent,
                            answered,
                        },
                    ));
                }
                anyhow::Ok(out)
            })
        })
        .collect();
    let mut orders = Vec::with_capacity(count);
    let mut timed = Vec::with_capacity(count);
    for t in tasks {
        for (o, d) in t.await?? {
            orders.push(o);
            timed.push(d);
        }
    }
    Ok((orders, timed))
}

/// The webhook id of the bench's `n`th payment.
fn event_id(n: usize) -> String {
    format!("msg_e2e_{n}")
}

/// A signed `payment.succeeded` of the internal gateway for `order`, as delivery `n`.
fn payment(
    addr: SocketAddr,
    secret: &StandardSecret,
    order: &Awaiting,
    n: usize,
) -> anyhow::Result<hyper::Request<http_body_util::Full<axum::body::Bytes>>> {
    let body = format!(
        r#"{{"type":"payment.succeeded","data":{{"session_id":"{}","payment_id":"pay_{}","amount":"19.90","currency":"BRL"}}}}"#,
        order.session, order.session
    );
    let id = event_id(n);
    let ts = chrono::Utc::now().timestamp();
    let sig = secret.sign(&id, ts, body.as_bytes());
    Ok(hyper::Request::post("/webhooks/internal")
        .header("host", addr.to_string())
        .header("webhook-id", id)
        .header("webhook-timestamp", ts.to_string())
        .header("webhook-signature", sig)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(axum::body::Bytes::from(body)))?)
}

/// Every order's payment, sent by `clients` senders at once (the backlog).
async fn pay_all(
    addr: SocketAddr,
    secret: &StandardSecret,
    orders: &[Awaiting],
    clients: usize,
    next: &mut usize,
) -> anyhow::Result<()> {
    let mut senders: Vec<Vec<_>> = (0..clients).map(|_| Vec::new()).collect();
    for (i, o) in orders.iter().enumerate() {
        senders[i % clients].push(payment(addr, secret, o, *next)?);
        *next += 1;
    }
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|r| tokio::spawn(send_all(addr, r)))
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// An order's payment seen taking effect: its number and its time from sending.
type Seen = (i64, Duration);

/// The payments sent whose effect is not seen yet: each order's number, and when its payment
/// was sent (the bench's clock, and the wall clock the database's timestamps are on).
type OnTheWay = std::sync::Arc<
    std::sync::Mutex<std::collections::HashMap<i64, (Instant, chrono::DateTime<chrono::Utc>)>>,
>;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Where a paced payment's time went, stage by stage, each stage's times sorted.
struct Stages {
    /// Sent until the receiver's transaction storing it began (`received_at`): the request and
    /// the receiver's writer.
    to_stored: Vec<Duration>,
    /// Stored until the transaction that applied it began (`processed_at`): the receiver's
    /// commit, the job's notification and claim, a free batch.
    to_batch: Vec<Duration>,
    /// That transaction's start until its sale credit's writing (stamped as the posting begins,
    /// before its wait for the accounts: migration 0061): the batch's reads and writes before
    /// the posting.
    to_accounts: Vec<Duration>,
    /// The sale credit's writing until it was seen committed: the wait for the accounts, the
    /// posting, the commit, and the watcher's poll.
    to_visible: Vec<Duration>,
}

/// Sends a payment for each order at `per_s` and times each from its sending until its effect
/// is visible from outside: its sale credit committed. Returns those times, each payment's
/// time to its sale credit's writing (the posting's clock, in the batch's transaction before its
/// commit), and the stages in between, read from the rows' own timestamps.
async fn paced(
    pool: &PgPool,
    addr: SocketAddr,
    secret: &StandardSecret,
    orders: &[Awaiting],
    (per_s, connections): (f64, usize),
    next: &mut usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>, Stages)> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let gap = Duration::from_secs_f64(1.0 / per_s);
    let on_the_way = OnTheWay::default();
    let sending = Arc::new(AtomicBool::new(true));
    let watcher = watch_effects(pool, on_the_way.clone(), sending.clone())?;
    let mut tick = tokio::time::interval(gap);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // With kept connections, each payment waits in one queue for the first free one: its
    // clock starts at its tick, so a wait for a connection counts against it.
    let (queue, taken) = tokio::sync::mpsc::unbounded_channel();
    let taken = Arc::new(tokio::sync::Mutex::new(taken));
    let senders: Vec<_> = (0..connections)
        .map(|_| tokio::spawn(send_from(addr, taken.clone())))
        .collect();
    let mut tasks = Vec::with_capacity(orders.len());
    let mut events = Vec::with_capacity(orders.len());
    let mut sent_at = std::collections::HashMap::with_capacity(orders.len());
    for o in orders {
        tick.tick().await;
        let req = payment(addr, secret, o, *next)?;
        events.push((event_id(*next), o.number));
        *next += 1;
        let sent = chrono::Utc::now();
        lock(&on_the_way).insert(o.number, (Instant::now(), sent));
        sent_at.insert(o.number, sent);
        if connections == 0 {
            tasks.push(tokio::spawn(send_all(addr, vec![req])));
        } else {
            queue
                .send(req)
                .map_err(|_| anyhow::anyhow!("every paced sender failed"))?;
        }
    }
    drop(queue);
    for t in tasks {
        t.await??;
    }
    for s in senders {
        s.await??;
    }
    sending.store(false, Ordering::Release);
    let visible = tokio::task::spawn_blocking(move || watcher.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the effects' watcher panicked"))??;
    let (ids, numbers): (Vec<String>, Vec<i64>) = events.into_iter().unzip();
    let stamps: Vec<Stamps> = sqlx::query_as(
        "SELECT x.number, e.received_at, e.processed_at, t.created_at
         FROM unnest($1::text[], $2::bigint[]) AS x(event_id, number)
         JOIN payment_events e ON e.gateway = 'internal' AND e.event_id = x.event_id
         JOIN ledger_transfers t ON t.order_number = x.number AND t.kind = 'sale_credit'
         WHERE e.processed_at IS NOT NULL",
    )
    .bind(&ids)
    .bind(&numbers)
    .fetch_all(pool)
    .await?;
    let seen: std::collections::HashMap<i64, Duration> = visible.iter().copied().collect();
    let mut written = Vec::with_capacity(stamps.len());
    let mut stages = Stages {
        to_stored: Vec::with_capacity(stamps.len()),
        to_batch: Vec::with_capacity(stamps.len()),
        to_accounts: Vec::with_capacity(stamps.len()),
        to_visible: Vec::with_capacity(stamps.len()),
    };
    for (number, received, processed, credited) in stamps {
        let Some(&sent) = sent_at.get(&number) else {
            continue;
        };
        let to_credit = span(sent, credited);
        written.push(to_credit);
        stages.to_stored.push(span(sent, received));
        stages.to_batch.push(span(received, processed));
        stages.to_accounts.push(span(processed, credited));
        if let Some(&visible) = seen.get(&number) {
            stages.to_visible.push(visible.saturating_sub(to_credit));
        }
    }
    for v in [
        &mut written,
        &mut stages.to_stored,
        &mut stages.to_batch,
        &mut stages.to_accounts,
        &mut stages.to_visible,
    ] {
        v.sort();
    }
    let mut visible: Vec<Duration> = visible.into_iter().map(|(_, d)| d).collect();
    visible.sort();
    Ok((visible, written, stages))
}

/// One paced sender: a connection of its own, kept, sending the payments it takes from the
/// shared queue one at a time until the queue ends.
async fn send_from(
    addr: SocketAddr,
    taken: std::sync::Arc<
        tokio::sync::Mutex<
            tokio::sync::mpsc::UnboundedReceiver<
                hyper::Request<http_body_util::Full<axum::body::Bytes>>,
            >,
        >,
    >,
) -> anyhow::Result<()> {
    let mut connection = super::Connection::open(addr).await?;
    loop {
        let Some(req) = taken.lock().await.recv().await else {
            connection.close().await;
            return Ok(());
        };
        connection.send(req, 200).await?;
    }
}

/// Watches for the effects of the payments on their way and returns each one's time from its
/// sending to its sale credit being seen, once nothing is being sent and every one was seen.
/// It asks every few milliseconds on one connection of its own, for the credits written since
/// the oldest of those payments was sent (a few hundred at a paced rate), by index. It runs on
/// a thread and runtime of its own: on the fleet's runtime (the bench runs the fleet in its
/// process) it would see an effect when a busy runtime let it, not when the effect became
/// visible.
fn watch_effects(
    pool: &PgPool,
    on_the_way: OnTheWay,
    sending: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<std::thread::JoinHandle<anyhow::Result<Vec<Seen>>>> {
    const EVERY: Duration = Duration::from_millis(4);
    const GIVE_UP: Duration = Duration::from_secs(120);
    let options = pool.connect_options();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(std::thread::spawn(move || {
        runtime.block_on(async move {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect_with(&options).await?;
            // The credits' times are the database server's clock, the sending times this
            // process's: where the server is another machine, its clock may be off. Read once,
            // at the least it can be (the server's time against this clock's after the answer
            // came), less a margin, so no credit written after its payment was sent falls
            // before the range asked.
            let server_now: chrono::DateTime<chrono::Utc> =
                sqlx::query_scalar("SELECT clock_timestamp()")
                    .fetch_one(&mut conn)
                    .await?;
            let offset = server_now - chrono::Utc::now() - chrono::Duration::milliseconds(50);
            let mut lat = Vec::new();
            let mut tick = tokio::time::interval(EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_seen = Instant::now();
            loop {
                tick.tick().await;
                // The oldest payment on its way: every credit the watcher waits for was
                // written after it was sent.
                let Some(since) = lock(&on_the_way).values().map(|(_, at)| *at + offset).min()
                else {
                    if !sending.load(std::sync::atomic::Ordering::Acquire) {
                        return Ok(lat);
                    }
                    continue;
                };
                // The credits written since, read in the order they were written (the time
                // index, a few hundred rows at a paced rate), not looked up one by one: asking
                // for each payment on its way (`order_number = ANY($1)`) took 2 to 8 ms a poll on
                // the loaded machine, a fifth of it, which the payments it timed waited for. Not
                // prepared: planned for the time given, the range is read by its index.
                let found: Vec<i64> = sqlx::query_scalar(
                    "SELECT order_number FROM ledger_transfers
                     WHERE created_at >= $1 AND kind = 'sale_credit'",
                )
                .bind(since)
                .persistent(false)
                .fetch_all(&mut conn)
                .await?;
                let seen = Instant::now();
                let mut waiting = lock(&on_the_way);
                let before = waiting.len();
                for number in found {
                    if let Some((sent, _)) = waiting.remove(&number) {
                        lat.push((number, seen - sent));
                    }
                }
                if waiting.len() < before {
                    last_seen = seen;
                } else if seen - last_seen > GIVE_UP {
                    bail!(
                        "{} payments without their effect for two minutes",
                        waiting.len()
                    );
                }
            }
        })
    }))
}

/// What [`effected`] saw: when the first and the last effects were written, and the machine's
/// CPU counters at the last poll that found the drain unfinished (none if the first poll found
/// it done), so the drain's CPU is read over a window it kept busy throughout, not one that
/// ends up to a poll's interval after its last effect.
struct Drained {
    first: chrono::DateTime<chrono::Utc>,
    last: chrono::DateTime<chrono::Utc>,
    cpu_unfinished: Option<cpu::Sample>,
}

/// Waits until every order's effect is whole (its sale credit is posted, which only a paid
/// order has) and returns when the first and last ones were written (their statements' time,
/// the clock the bench reads too). The polls run beside the work they measure: rare, each
/// asking only for the orders not seen yet, and the time they notice it is not the time
/// measured.
async fn effected(pool: &PgPool, numbers: &[i64]) -> anyhow::Result<Drained> {
    let mut pending: std::collections::HashSet<i64> = numbers.iter().copied().collect();
    let (mut earliest, mut last) = (chrono::Utc::now(), chrono::Utc::now());
    let mut first = true;
    let mut cpu_unfinished = None;
    loop {
        let asked: Vec<i64> = pending.iter().copied().collect();
        let found: Vec<(i64, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
            "SELECT order_number, created_at FROM ledger_transfers
             WHERE order_number = ANY($1) AND kind = 'sale_credit'",
        )
        .bind(&asked)
        // Planned for the numbers given each time: a generic plan for `= ANY($1)` may scan
        // every transfer (the paced phase's watcher did).
        .persistent(false)
        .fetch_all(pool)
        .await?;
        for (number, at) in found {
            pending.remove(&number);
            (earliest, last) = if first {
                (at, at)
            } else {
                (earliest.min(at), last.max(at))
            };
            first = false;
        }
        if pending.is_empty() {
            return Ok(Drained {
                first: earliest,
                last,
                cpu_unfinished,
            });
        }
        cpu_unfinished = cpu::sample();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The ledger after the run: every balance is its entries, every currency sums to zero, every
/// paid order has its sale credit and an order message.
async fn check_ledger(pool: &PgPool) -> anyhow::Result<()> {
    let (accounts, currencies) = ledger::check(pool).await?;
    if !accounts.is_empty() || !currencies.is_empty() {
        bail!("the ledger does not hold: accounts {accounts:?}, currencies {currencies:?}");
    }
    let (paid, credited): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE EXISTS (
                    SELECT 1 FROM ledger_transfers t WHERE t.source_key = 'sale:' || o.number))
         FROM orders o WHERE o.paid_at IS NOT NULL",
    )
    .fetch_one(pool)
    .await?;
    if paid != credited {
        bail!("{paid} orders are paid but {credited} have their sale credit");
    }
    eprintln!("e2e: the ledger holds; {paid} paid orders, each with its sale credit");
    Ok(())
}

/// pgbench's TPC-B-like transactions at `clients` clients for `secs`, at scale `clients` (one
/// branch row per client: its own hot rows, as pgbench intends), and the CPU its run used.
async fn tpc_b(
    pgbench: &std::path::Path,
    url: &str,
    clients: usize,
    secs: u64,
) -> anyhow::Result<(f64, Option<Usage>)> {
    let init = tokio::process::Command::new(pgbench)
        .env("PGSSLMODE", "disable")
        .args(["-i", "-q", "-s", &clients.to_string()])
        .arg(url)
        .output()
        .await
        .context("cannot run pgbench -i")?;
    if !init.status.success() {
        bail!(
            "pgbench -i failed: {}",
            String::from_utf8_lossy(&init.stderr)
        );
    }
    let before = cpu::sample();
    let tps = super::pgbench_tps(
        pgbench,
        &[
            "-c",
            &clients.to_string(),
            "-j",
            &clients.min(2).to_string(),
            "-T",
            &secs.to_string(),
        ],
        url,
    )
    .await?;
    let usage = cpu::between(before, cpu::sample());
    Ok((tps, usage))
}

/// Prints where the machine's CPU went in `phase` since `before` (`count` pieces of work), and
/// adds its busy share and cost a piece to the result lines.
fn report_cpu(phase: &str, before: Option<cpu::Sample>, count: usize, lines: &mut Vec<String>) {
    let usage = cpu::between(before, cpu::sample());
    report_usage(phase, usage, count, lines);
}

/// PostgreSQL's write-ahead log position now: what a phase made the database write is the log
/// it wrote, a figure the machine's pace does not move as it moves the rates (a checkpoint in
/// the window does: the pages written first after it go to the log whole).
async fn wal_position(pool: &PgPool) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?)
}

/// Prints the log written since `from`, per payment (or checkout) of the phase: everything the
/// database wrote meanwhile, the workers' start-up and the outbox relay's marks included.
async fn report_wal(
    phase: &str,
    pool: &PgPool,
    from: &str,
    count: usize,
    lines: &mut Vec<String>,
) -> anyhow::Result<()> {
    let bytes: f64 =
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8")
            .bind(from)
            .fetch_one(pool)
            .await?;
    let per = bytes / count.max(1) as f64;
    eprintln!("e2e:   WAL: {per:.0} bytes each");
    lines.push(format!("e2e_wal_bytes_{phase}={per:.0}"));
    Ok(())
}

fn report_usage(phase: &str, usage: Option<Usage>, count: usize, lines: &mut Vec<String>) {
    if let Some(u) = usage {
        let each = u.each(count);
        eprintln!("e2e:   CPU: {u}; {each}");
        lines.push(format!("e2e_cpu_busy_{phase}={:.2}", u.busy));
        lines.push(format!("e2e_cpu_ms_each_{phase}={:.2}", each.busy));
    }
}
