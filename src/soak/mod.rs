//! `payfleet soak`: the real fleet under fire, checked against a model of its own.
//!
//! The soak starts one receiver and several workers (child processes of this binary) on a
//! scratch database and broker queues of their own, and drives a seeded scenario through the
//! HTTP API and the payment simulator's page (`scenario`): checkouts with coupons and repeated
//! Idempotency-Keys, payments, failures and reopenings, expiries, late payments, refunds (the
//! operator's, and the gateway dashboard's before the payment's own event), disputes in and out
//! of order, coin payments, subscriptions renewing, payouts decided by the "bank". The gateway's
//! deliveries pass through a relay that loses, fails, delays and repeats them (`relay`).
//! Meanwhile faults fire on a seeded schedule: `kill -9` of workers and of the receiver,
//! PostgreSQL connections terminated, one PostgreSQL restart, the broker connections cut
//! (`fleet`). Then the soak lets the fleet settle and checks every promise (`checks`) against
//! its own model of the money (`model`), and prints the table; a violation prints the seed and
//! the schedule that replay it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use sqlx::{PgConnection, PgPool};

use payfleet::config::Config;
use payfleet::messaging::Broker;
use payfleet::messaging::orders::{self as messages, Handled, OrderMessage};
use payfleet::secret::SecretUrl;
use payfleet::{auth, catalogue};

mod api;
mod checks;
mod fleet;
mod model;
mod relay;
mod scenario;

use api::{Api, Who};
use fleet::{Fleet, TcpProxy};
use relay::Relay;
use scenario::{Catalogue, Product, Shared};

#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    /// The scenario's and the faults' seed (default: a new one, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Buyers' journeys, spread over the run (default: 200 a minute).
    #[arg(long)]
    pub orders: Option<usize>,
    /// How long journeys start and faults fire; the fleet then settles and is checked.
    #[arg(long, default_value_t = 1.0)]
    pub minutes: f64,
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Leave PostgreSQL running (the soak otherwise restarts the machine's cluster once).
    #[arg(long)]
    pub no_pg_restart: bool,
}

/// A fault the schedule fires.
#[derive(Debug, Clone, Copy)]
enum Fault {
    KillWorker(usize),
    KillReceiver,
    TerminateBackends,
    CutBroker,
    RestartPostgres,
}

impl Fault {
    fn kind(self) -> &'static str {
        match self {
            Self::KillWorker(_) => "kill -9 a worker",
            Self::KillReceiver => "kill -9 the receiver",
            Self::TerminateBackends => "PostgreSQL connections terminated",
            Self::CutBroker => "broker connections cut",
            Self::RestartPostgres => "PostgreSQL restarted",
        }
    }
}

/// A fault as it fired: when (seconds from the start), what, and what it did.
struct Fired {
    at: f64,
    fault: Fault,
    detail: String,
}

/// The faults' times from the start, drawn from the seed.
fn schedule(seed: u64, run: Duration, workers: usize, pg_restart: bool) -> Vec<(Duration, Fault)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_fa17);
    let mut at = Duration::from_secs(3);
    let mut out = Vec::new();
    while at < run {
        let fault = match rng.random_range(0..100) {
            0..=39 => Fault::KillWorker(rng.random_range(0..workers.max(1))),
            40..=54 => Fault::KillReceiver,
            55..=77 => Fault::TerminateBackends,
            _ => Fault::CutBroker,
        };
        out.push((at, fault));
        at += Duration::from_millis(rng.random_range(3_000..9_000));
    }
    if pg_restart {
        let when = run.mul_f64(0.55);
        let i = out.iter().position(|(t, _)| *t > when).unwrap_or(out.len());
        out.insert(i, (when, Fault::RestartPostgres));
    }
    out
}

/// The recurring jobs on the soak's short schedules.
const RECURRING: &str = r#"
[payouts]
cron = "*/10 * * * * *"
[invoices]
cron = "0 * * * * *"
[holding_release]
cron = "*/5 * * * * *"
[reconcile]
cron = "*/3 * * * * *"
[consistency]
cron = "*/20 * * * * *"
[prune]
cron = "*/30 * * * * *"
[subscription_billing]
cron = "*/2 * * * * *"
"#;

/// How long an order waits for its payment in the soak's fleet.
const EXPIRY_SECS: u64 = 45;

pub async fn run(config: &Config, args: SoakArgs) -> anyhow::Result<()> {
    if !(args.minutes > 0.0 && args.minutes <= 24.0 * 60.0) {
        bail!("--minutes must be above 0 and at most a day");
    }
    let orders = args
        .orders
        .unwrap_or((args.minutes * 200.0).ceil() as usize);
    if orders == 0 || args.workers == 0 {
        bail!("--orders and --workers must be positive");
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let replay = format!(
        "payfleet soak --seed {seed} --orders {orders} --minutes {} --workers {}{}",
        args.minutes,
        args.workers,
        if args.no_pg_restart {
            " --no-pg-restart"
        } else {
            ""
        }
    );
    let run_for = Duration::from_secs_f64(args.minutes * 60.0);
    let faults = schedule(seed, run_for, args.workers, !args.no_pg_restart);
    eprintln!(
        "soak: seed {seed}: {orders} journeys over {:.1} min, {} workers, {} faults (replay: {replay})",
        args.minutes,
        args.workers,
        faults.len()
    );

    // The fleet's world: a database, broker queues, a secret and credentials of its own.
    let (pool, url) = crate::scratch::database(config, "soak", 8).await?;
    let (app, secret, secret_text) = crate::scratch::simulated(config, "soak");
    checks::prepare(&pool).await?;
    let (_, api_key) = auth::api_keys::create(
        &pool,
        auth::NewApiKey {
            name: "soak".into(),
            seller_id: None,
        },
    )
    .await?;
    let admin_token = format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    );
    let catalogue = catalogue_for(&pool).await?;

    let broker_addr = amqp_address(&app.amqp_url)?;
    let amqp = TcpProxy::start(broker_addr.clone()).await?;
    let receiver_port = crate::scratch::free_port()?;
    let base = format!("http://127.0.0.1:{receiver_port}");
    let (relay, relay_port) =
        Relay::start(format!("{base}/webhooks/internal"), secret.clone(), seed).await?;
    let recurring = std::env::temp_dir().join(format!("payfleet-soak-{seed}-recurring.toml"));
    std::fs::write(&recurring, RECURRING)?;
    let log = std::env::temp_dir().join(format!("payfleet-soak-{seed}.log"));
    let _ = std::fs::remove_file(&log);
    let env: Vec<(String, String)> = [
        ("DATABASE_URL", url.expose().to_owned()),
        ("PAYFLEET_DB_POOL_SIZE", "10".into()),
        ("AMQP_URL", proxied(&app.amqp_url, amqp.port)?),
        ("PAYFLEET_AMQP_NAMESPACE", app.messaging.namespace.clone()),
        ("PAYFLEET_AMQP_QUEUE_TTL_MS", "3600000".into()),
        (
            "PAYFLEET_AMQP_QUORUM",
            payfleet::env::on_off(app.messaging.queues.quorum).into(),
        ),
        (
            "PAYFLEET_AMQP_RPC_QUORUM",
            payfleet::env::on_off(app.messaging.queues.rpc_quorum).into(),
        ),
        ("INTERNAL_WEBHOOK_SECRET", secret_text),
        ("PAYFLEET_PAYMENT_SIMULATOR", "on".into()),
        ("PAYFLEET_ADMIN_TOKEN", admin_token.clone()),
        ("PAYFLEET_PUBLIC_URL", base.clone()),
        (
            "PAYFLEET_INTERNAL_WEBHOOK_URL",
            format!("http://127.0.0.1:{relay_port}/webhooks/internal"),
        ),
        ("PAYFLEET_ORDER_EXPIRY_SECS", EXPIRY_SECS.to_string()),
        // Periods of 20 s in a short run, longer in a long one (the billing's load stays that of
        // a few renewals a second).
        (
            "PAYFLEET_SUBSCRIPTION_PERIOD_SECS",
            (20.0f64).max(args.minutes * 2.0).round().to_string(),
        ),
        ("PAYFLEET_RECONCILE_GRACE_SECS", "5".into()),
        ("PAYFLEET_RECONCILE_PACE_MS", "10".into()),
        ("PAYFLEET_RECONCILE_PER_RUN", "500".into()),
        ("PAYFLEET_CONSISTENCY_GRACE_SECS", "120".into()),
        ("PAYFLEET_RECURRING", recurring.display().to_string()),
        (
            "PAYFLEET_PLATFORM_FEE_PERCENT",
            app.orders.platform_fee_percent.to_string(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();

    // The order messages' consumer: another service, on the broker directly.
    let broker = Broker::start_with(
        app.amqp_url.clone(),
        &app.messaging.namespace,
        Some(3_600_000),
        app.messaging.queues,
    );
    for service in ["fulfilment", "subscriptions"] {
        tokio::spawn(messages::consume(
            broker.clone(),
            pool.clone(),
            service.to_owned(),
            "soak".to_owned(),
            record_message,
        ));
    }

    let fleet = Fleet::start(env, receiver_port, args.workers, log.clone())
        .await
        .with_context(|| format!("the fleet did not start (its log: {})", log.display()))?;
    let fleet = Arc::new(tokio::sync::Mutex::new(fleet));
    let api = Api::new(base.clone(), api_key, admin_token, secret.clone())?;
    for (code, body) in scenario::coupons() {
        let a = api
            .post("/admin/coupons", Who::Operator, None, &body)
            .await?;
        if a.status != 201 {
            bail!("creating coupon {code}: {} {}", a.status, a.body);
        }
    }
    let shared = Arc::new(Shared {
        api: api.clone(),
        relay: relay.clone(),
        pool: pool.clone(),
        catalogue,
        fee_percent: app.orders.platform_fee_percent,
        seed,
        in_time_margin: chrono::Duration::seconds(25),
        model: Mutex::default(),
        subscriptions: Mutex::default(),
        failures: Mutex::default(),
        journeys: Mutex::default(),
    });

    // Under fire.
    let started = Instant::now();
    let (calm_tx, calm) = tokio::sync::watch::channel(false);
    let fired = Arc::new(Mutex::new(Vec::<Fired>::new()));
    let injector = tokio::spawn(inject(
        fleet.clone(),
        amqp.clone(),
        pool.clone(),
        faults.clone(),
        started,
        fired.clone(),
        calm.clone(),
    ));
    let resender = tokio::spawn(resend(relay.clone(), seed, calm.clone()));
    let bank = tokio::spawn(bank(api.clone(), seed, calm.clone()));
    let mut journeys = tokio::task::JoinSet::new();
    let drive = run_for.mul_f64(0.8);
    let done = crate::progress::bar(orders as u64, "journeys ended");
    for n in 0..orders {
        let at = drive.mul_f64(n as f64 / orders as f64);
        tokio::time::sleep_until((started + at).into()).await;
        let (shared, done) = (shared.clone(), done.clone());
        journeys.spawn(async move {
            scenario::journey(shared, n).await;
            done.inc(1);
        });
    }
    tokio::time::sleep_until((started + run_for).into()).await;
    calm_tx.send(true)?;
    injector.await??;
    eprintln!(
        "soak: faults over ({} fired); waiting for the journeys",
        fired.lock().map(|f| f.len()).unwrap_or(0)
    );
    while journeys.join_next().await.is_some() {}
    done.finish_and_clear();

    // Settle: every process up, the relay quiet, the subscriptions ended, the bank answered.
    {
        let mut f = fleet.lock().await;
        f.revive()?;
        f.ready().await?;
    }
    relay.calm();
    let mut rng = StdRng::seed_from_u64(seed ^ 0xcafe);
    relay.resend_some(&mut rng, 20).await?;
    let subscriptions: Vec<String> = shared
        .subscriptions
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default();
    for id in &subscriptions {
        let a = api
            .post(
                &format!("/subscriptions/{id}/cancel"),
                Who::Backend,
                None,
                &json!({"at_period_end": false}),
            )
            .await?;
        if a.status != 200 {
            shared
                .failures
                .lock()
                .map(|mut f| {
                    f.push(format!(
                        "cancelling subscription {id}: {} {}",
                        a.status, a.body
                    ))
                })
                .ok();
        }
    }
    resender.await?;
    bank.await??;
    let working = crate::progress::spinner("the fleet settles");
    let settled = settle(&pool, &api, Duration::from_secs(300)).await?;
    working.finish_and_clear();
    eprintln!(
        "soak: {} in {:.0} s",
        if settled { "settled" } else { "NOT settled" },
        started.elapsed().as_secs_f64()
    );

    // The checks.
    let mut crashes = {
        let mut f = fleet.lock().await;
        f.notice_crashes();
        f.crashes.clone()
    };
    if !settled {
        crashes.push("the fleet did not settle within 5 minutes of the faults' end".into());
    }
    // Every journey has ended: the model is whole, and taken out of its lock.
    let model = std::mem::take(
        &mut *shared
            .model
            .lock()
            .map_err(|_| anyhow::anyhow!("the model's lock is poisoned"))?,
    );
    let failures = shared
        .failures
        .lock()
        .map(|f| f.clone())
        .unwrap_or_default();
    let rows = checks::run(checks::Inputs {
        pool: &pool,
        api: &api,
        model: &model,
        failures: &failures,
        journeys: orders,
        subscriptions: &subscriptions,
        crashes: &crashes,
        fee_percent: app.orders.platform_fee_percent,
    })
    .await?;
    fleet.lock().await.stop().await?;
    broker.stop();
    pool.close().await;

    let journeys = shared
        .journeys
        .lock()
        .map(|j| j.clone())
        .unwrap_or_default();
    println!(
        "journeys: {}",
        journeys
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let tally = relay.tally();
    println!(
        "gateway deliveries: {} passed, {} withheld for good, {} answered 500, {} timed out, {} doubled, {} held back, {} sent again later",
        tally.passed,
        tally.withheld,
        tally.failed_500,
        tally.timed_out,
        tally.doubled,
        tally.held,
        tally.resent
    );
    let fired: Vec<Fired> = fired
        .lock()
        .map(|mut f| f.drain(..).collect())
        .unwrap_or_default();
    println!("faults fired: {}", summary(&fired));
    println!();
    println!("{:<72} {:>8} {:>10}", "CHECK", "COUNT", "VIOLATIONS");
    let mut violated = 0;
    for r in &rows {
        println!("{:<72} {:>8} {:>10}", r.name, r.count, r.violations.len());
        violated += r.violations.len();
    }
    if violated == 0 {
        println!("\nsoak: every check holds (seed {seed})");
        let _ = std::fs::remove_file(&recurring);
        return Ok(());
    }
    println!();
    for r in rows.iter().filter(|r| !r.violations.is_empty()) {
        println!("{}:", r.name);
        for v in r.violations.iter().take(15) {
            println!("  {v}");
        }
        if r.violations.len() > 15 {
            println!("  ... and {} more", r.violations.len() - 15);
        }
    }
    println!("\nfault schedule (seconds from the start):");
    for f in &fired {
        println!("  {:>6.1}  {}", f.at, f.detail);
    }
    println!("the fleet's log: {}", log.display());
    // A 5xx tells its caller only a request id: the log's lines under it say what happened,
    // printed here because a CI machine's log is gone with it.
    let ids: Vec<&str> = rows
        .iter()
        .flat_map(|r| r.violations.iter())
        .filter_map(|v| request_id(v))
        .collect();
    if !ids.is_empty()
        && let Ok(text) = std::fs::read_to_string(&log)
    {
        for id in ids.iter().take(5) {
            println!("\nthe log under request {id}:");
            for line in text.lines().filter(|l| l.contains(id)).take(20) {
                println!("  {line}");
            }
        }
    }
    bail!("{violated} violations; replay with: {replay}")
}

/// The request id an error answer quoted in a violation's text, if any.
fn request_id(violation: &str) -> Option<&str> {
    const MARK: &str = "\"request_id\":\"";
    let rest = &violation[violation.find(MARK)? + MARK.len()..];
    rest.split('"').next().filter(|id| !id.is_empty())
}

/// The soak's consumer's handler: a row per handling, so a message handled twice shows.
fn record_message(m: OrderMessage, tx: &mut PgConnection) -> Handled<'_> {
    Box::pin(async move {
        sqlx::query(
            "INSERT INTO soak_received (consumer, message_id, routing_key) VALUES ('soak', $1, $2)",
        )
        .bind(&m.message_id)
        .bind(m.routing_key())
        .execute(&mut *tx)
        .await?;
        Ok(())
    })
}

/// Six sellers (half without a holding period), two products each, two subscriptions.
async fn catalogue_for(pool: &PgPool) -> anyhow::Result<Catalogue> {
    const PRICES: [&str; 12] = [
        "7.77", "19.90", "33.33", "101.01", "12.35", "8.05", "49.99", "15.15", "64.10", "9.95",
        "23.45", "1.25",
    ];
    let mut c = Catalogue::default();
    for s in 0..6 {
        let seller = catalogue::create_seller(
            pool,
            catalogue::NewSeller {
                name: format!("soak seller {s}"),
                payout_frequency: "daily".parse()?,
                payout_minimum: "0".into(),
                holding_days: Some(if s % 2 == 0 { 0 } else { 14 }),
                stripe_account: None,
                payout_minimums: Default::default(),
            },
        )
        .await?;
        let mut products = Vec::new();
        for k in 0..2 {
            let price = PRICES[s * 2 + k];
            let p = catalogue::create_product(
                pool,
                catalogue::NewProduct {
                    seller_id: seller.id.to_string(),
                    name: format!("soak item {s}-{k}"),
                    kind: "one_off".parse()?,
                    price: price.into(),
                    currency: "BRL".into(),
                    interval: None,
                },
            )
            .await?;
            products.push(Product {
                id: p.id.to_string(),
                seller: seller.id.to_string(),
                price: price.parse()?,
            });
        }
        if s < 2 {
            let price = "29.90";
            let p = catalogue::create_product(
                pool,
                catalogue::NewProduct {
                    seller_id: seller.id.to_string(),
                    name: format!("soak plan {s}"),
                    kind: "subscription".parse()?,
                    price: price.into(),
                    currency: "BRL".into(),
                    interval: Some("month".parse()?),
                },
            )
            .await?;
            c.subscriptions.push(Product {
                id: p.id.to_string(),
                seller: seller.id.to_string(),
                price: price.parse()?,
            });
        }
        c.one_off.push(products);
    }
    Ok(c)
}

/// `host:port` of an AMQP URL.
fn amqp_address(url: &SecretUrl) -> anyhow::Result<String> {
    let u = reqwest::Url::parse(url.expose()).context("AMQP_URL is not a URL")?;
    Ok(format!(
        "{}:{}",
        u.host_str().unwrap_or("127.0.0.1"),
        u.port().unwrap_or(5672)
    ))
}

/// The AMQP URL through the soak's proxy on `port`.
fn proxied(url: &SecretUrl, port: u16) -> anyhow::Result<String> {
    let mut u = reqwest::Url::parse(url.expose()).context("AMQP_URL is not a URL")?;
    u.set_host(Some("127.0.0.1"))?;
    u.set_port(Some(port))
        .map_err(|()| anyhow::anyhow!("AMQP_URL cannot take a port"))?;
    Ok(u.to_string())
}

/// Fires the schedule until it ends or the soak calms down; each fired fault is logged.
async fn inject(
    fleet: Arc<tokio::sync::Mutex<Fleet>>,
    amqp: TcpProxy,
    pool: PgPool,
    schedule: Vec<(Duration, Fault)>,
    started: Instant,
    fired: Arc<Mutex<Vec<Fired>>>,
    mut calm: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(schedule.len() as u64);
    for (at, fault) in schedule {
        tokio::select! {
            _ = tokio::time::sleep_until((started + at).into()) => {}
            _ = calm.wait_for(|c| *c) => break,
        }
        let what = match fault {
            Fault::KillWorker(i) => {
                let mut f = fleet.lock().await;
                let i = i % f.workers();
                f.kill(Some(i)).await?;
                drop(f);
                let down = rng.random_range(200..3_000);
                tokio::time::sleep(Duration::from_millis(down)).await;
                fleet.lock().await.revive()?;
                format!("kill -9 worker {i}, restarted {down} ms later")
            }
            Fault::KillReceiver => {
                fleet.lock().await.kill(None).await?;
                let down = rng.random_range(200..2_000);
                tokio::time::sleep(Duration::from_millis(down)).await;
                fleet.lock().await.revive()?;
                format!("kill -9 the receiver, restarted {down} ms later")
            }
            Fault::TerminateBackends => {
                let n: Option<i64> = sqlx::query_scalar(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .fetch_one(&pool)
                .await
                .ok();
                format!("pg_terminate_backend: {} connections", n.unwrap_or(0))
            }
            Fault::CutBroker => format!("broker connections cut: {}", amqp.cut()),
            Fault::RestartPostgres => match fleet::restart_postgres().await {
                Ok(()) => "PostgreSQL restarted".to_owned(),
                Err(e) => format!("PostgreSQL restart not done: {e:#}"),
            },
        };
        // A process that died on its own is a finding; it is started again so the run goes on.
        fleet.lock().await.revive()?;
        if let Ok(mut f) = fired.lock() {
            f.push(Fired {
                at: (Instant::now() - started).as_secs_f64(),
                fault,
                detail: what,
            });
        }
    }
    Ok(())
}

/// Until calm: every few seconds, a few deliveries that went through are sent again.
async fn resend(relay: Relay, seed: u64, mut calm: tokio::sync::watch::Receiver<bool>) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x4e5e);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(4)) => {}
            _ = calm.wait_for(|c| *c) => return,
        }
        let _ = relay.resend_some(&mut rng, 3).await;
    }
}

/// The bank: answers each payout waiting for it, mostly paid, sometimes failed; once calm,
/// answers what is left and stops.
async fn bank(api: Api, seed: u64, calm: tokio::sync::watch::Receiver<bool>) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xba4c);
    loop {
        let last = *calm.borrow();
        let a = api.get("/admin/payouts", Who::Operator).await?;
        for p in a.body["payouts"].as_array().cloned().unwrap_or_default() {
            let Some(id) = p["id"].as_i64() else { continue };
            let (path, body) = if rng.random_bool(0.8) {
                (format!("/admin/payouts/{id}/paid"), json!({}))
            } else {
                (
                    format!("/admin/payouts/{id}/failed"),
                    json!({"reason": "soak: the bank refused"}),
                )
            };
            api.post(&path, Who::Operator, None, &body).await?;
        }
        if last {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
}

/// Waits until nothing moves any more: every event processed, no order waiting for payment,
/// no job due or retrying, every order message published and handled, no refund or payout
/// waiting, no sale waiting for its poster, no charge the gateway made that the fleet has not
/// heard of yet. False if `within` passes first.
async fn settle(pool: &PgPool, api: &Api, within: Duration) -> anyhow::Result<bool> {
    let started = Instant::now();
    let mut quiet_polls = 0;
    loop {
        let moving: Result<Vec<(String, i64)>, sqlx::Error> = sqlx::query_as(
            "SELECT what, n FROM (VALUES
               ('events unprocessed', (SELECT count(*) FROM payment_events WHERE processed_at IS NULL)),
               ('orders awaiting payment', (SELECT count(*) FROM orders WHERE status = 'awaiting_payment')),
               ('messages unpublished', (SELECT count(*) FROM order_events WHERE published_at IS NULL)),
               ('messages not handled', (SELECT count(*) FROM order_events e WHERE NOT EXISTS (
                    SELECT 1 FROM soak_received r WHERE r.message_id = 'order-event-' || e.id))),
               ('jobs due or retrying', (SELECT count(*) FROM jobs WHERE state = 'retryable'
                    OR (state IN ('available', 'running') AND run_at < now() - interval '5 seconds'))),
               ('refunds in flight', (SELECT count(*) FROM refund_requests WHERE state NOT IN ('succeeded', 'failed', 'canceled'))),
               ('payouts waiting', (SELECT count(*) FROM payouts WHERE state = 'pending')),
               ('sales due', (SELECT count(*) FROM ledger_sales_due)),
               -- A charge whose every delivery the relay withheld is the fleet's once
               -- reconciliation asks about it, a grace period after it was made: a renewal
               -- charged as the subscriptions were cancelled at the end is otherwise unknown
               -- when the checks run, and not given back.
               ('gateway payments not known yet', (SELECT count(*) FROM internal_payments p
                    WHERE p.status = 'succeeded'
                      AND NOT EXISTS (SELECT 1 FROM payment_orders po WHERE po.gateway = p.gateway
                                        AND po.session_id = p.session_id AND po.succeeded_at IS NOT NULL)
                      AND NOT EXISTS (SELECT 1 FROM unmatched_payments u WHERE u.gateway = p.gateway
                                        AND u.session_id = p.session_id)))
             ) AS m(what, n) WHERE n > 0",
        )
        .fetch_all(pool)
        .await;
        match moving {
            Ok(m) if m.is_empty() => {
                quiet_polls += 1;
                if quiet_polls >= 3 {
                    return Ok(true);
                }
            }
            Ok(m) => {
                quiet_polls = 0;
                if started.elapsed() > within {
                    eprintln!("soak: still moving: {m:?}");
                    return Ok(false);
                }
                // The bank answers payouts made while settling.
                if m.iter().any(|(w, _)| w == "payouts waiting") {
                    let a = api.get("/admin/payouts", Who::Operator).await?;
                    for p in a.body["payouts"].as_array().cloned().unwrap_or_default() {
                        if let Some(id) = p["id"].as_i64() {
                            api.post(
                                &format!("/admin/payouts/{id}/paid"),
                                Who::Operator,
                                None,
                                &json!({}),
                            )
                            .await?;
                        }
                    }
                }
            }
            Err(_) => quiet_polls = 0,
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// `kill -9 a worker x3, ...`: the faults fired, by kind.
fn summary(fired: &[Fired]) -> String {
    let mut counts: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for f in fired {
        *counts.entry(f.fault.kind()).or_default() += 1;
    }
    counts
        .iter()
        .map(|(k, v)| format!("{k} x{v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::request_id;

    #[test]
    fn a_violation_quoting_an_error_answer_gives_its_request_id() {
        let v = r#"checkout k: 500 {"error":{"code":"internal","message":"m","request_id":"1a556d4204518639"}}"#;
        assert_eq!(request_id(v), Some("1a556d4204518639"));
        assert_eq!(request_id("order 7 confirmed twice"), None);
        assert_eq!(request_id(r#"{"request_id":""}"#), None);
    }
}
