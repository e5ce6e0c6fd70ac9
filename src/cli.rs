//! The command line: one subcommand per process role, plus the operator's and benchmark tools.

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio::net::TcpListener;

use crate::{bench, demo, progress, soak};
use payfleet::config::Config;
use payfleet::db;
use payfleet::payments::events::{self, Replayed};
use payfleet::startup::{self, Roles};
use payfleet_queue::{JobId, admin};

#[derive(Parser)]
#[command(
    name = "payfleet",
    version,
    about = "Background job worker fleet for marketplace payments"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply the database migrations (the Procfile's release phase).
    Migrate,
    /// Run the HTTP receiver (webhooks, health, metrics).
    Serve,
    /// Run a worker process: every queue of jobs/queues.toml (or those of --queues), with the
    /// file's concurrency (or --concurrency's). With PAYFLEET_WORKER_BIND set, it serves
    /// /healthz, /readyz and /metrics there.
    Work {
        /// Only these queues, comma-separated (`--queues events,payments`).
        #[arg(long, value_delimiter = ',')]
        queues: Vec<String>,
        /// A queue's concurrency, `QUEUE=N`; repeatable (`--concurrency events=16`).
        #[arg(long)]
        concurrency: Vec<String>,
    },
    /// Everything in one process, migrations included: the local default. It runs the payment
    /// simulator and development credentials, so it listens only on this machine unless told
    /// `--public`.
    Up {
        /// Listen on a PAYFLEET_BIND that is not a loopback address (a preview others reach).
        #[arg(long)]
        public: bool,
    },
    /// Inspect and repair the job queue.
    Jobs {
        #[command(subcommand)]
        action: Option<JobsAction>,
    },
    /// Stored payment events that are not processed, and replaying them.
    Events {
        #[command(subcommand)]
        action: EventsAction,
    },
    /// Order messages: those their consumers gave up on (dead), those the broker has not
    /// confirmed yet (unpublished), and sending them again.
    Messages {
        #[command(subcommand)]
        action: Option<MessagesAction>,
    },
    /// The ledger's runs, by hand (the workers also run them on their own), payouts waiting
    /// for the bank, and the ledger's invariants.
    Money {
        #[command(subcommand)]
        action: MoneyAction,
    },
    /// The consistency findings still open; `--run` checks the invariants first.
    Consistency {
        #[arg(long)]
        run: bool,
        /// Only this check's findings (each check's count is printed first).
        #[arg(long)]
        check: Option<String>,
    },
    /// Drive the fleet `up` started: a catalogue, checkouts, payments, an expiry, each order's
    /// journey.
    Demo(demo::DemoArgs),
    /// The fleet under fire: a seeded scenario with faults (kill -9, PostgreSQL restarts, the
    /// broker cut, lost and repeated webhooks), checked against a model of its own (in a
    /// scratch database).
    Soak(soak::SoakArgs),
    /// Print the HTTP API's OpenAPI 3.1 description (what `GET /openapi.json` serves;
    /// `payfleet openapi > docs/openapi.json` refreshes the committed copy).
    Openapi,
    /// Benchmarks against the configured database server (in a scratch database).
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Subcommand)]
enum JobsAction {
    /// Jobs by queue and state (the default).
    Counts,
    /// Discarded jobs with their last error.
    Dead {
        #[arg(long)]
        queue: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Run a discarded, cancelled or retryable job again now.
    Retry { id: i64 },
    /// Discard a waiting job.
    Discard { id: i64 },
    /// Pause a queue: no worker claims from it within a second (runs under way end as usual).
    Pause { queue: String },
    /// Resume a paused queue.
    Resume { queue: String },
    /// The worker processes of the fleet's census and the queues each works (a row not renewed
    /// for ten seconds is a worker that died without stopping).
    Workers,
}

#[derive(Subcommand)]
enum EventsAction {
    /// Events not processed, oldest first: pending (no outcome yet), waiting (for their
    /// payment) or rejected (with the reason), and the state of their processing job.
    Unprocessed {
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Process an event again (by the ID `events unprocessed` shows), or every unprocessed one.
    Replay {
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<i64>,
        #[arg(long)]
        all: bool,
    },
    /// End an event that will never apply (waiting for a payment no order has, rejected for
    /// good): recorded ignored, with the reason, so it no longer shows as unprocessed.
    Dismiss {
        id: i64,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
enum MessagesAction {
    /// Messages a consumer failed to handle on every attempt (the default).
    Dead {
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Send a dead message again, once its consumer is fixed (one written more than 30 days ago,
    /// longer than consumers keep their records of the messages they handled, only with
    /// `--force`: a consumer that handled it would handle it again).
    Replay {
        consumer: String,
        message_id: String,
        #[arg(long)]
        force: bool,
    },
    /// Messages not yet confirmed by the broker, oldest first: how often the broker refused
    /// each, its last answer, and when the relay tries it next.
    Unpublished {
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Send an order message now: one the broker refused, without waiting for its next attempt
    /// (once the cause is gone), or one published already, again (to a service that binds its
    /// type since; a consumer that handled it drops it by its id, for 30 days: one published
    /// longer ago only with `--force`); `--refused`: every message the broker refused.
    Send {
        #[arg(required_unless_present = "refused", conflicts_with = "refused")]
        message_id: Option<String>,
        #[arg(long)]
        refused: bool,
        #[arg(long, conflicts_with = "refused")]
        force: bool,
    },
}

#[derive(Subcommand)]
enum MoneyAction {
    /// Move the sales whose holding period has passed from pending to available.
    Release,
    /// Pay every seller due on DATE (default today in the `payouts` schedule's time zone; not a
    /// date to come): once per seller and period.
    Payouts {
        #[arg(long)]
        date: Option<chrono::NaiveDate>,
    },
    /// Payouts waiting for the bank's answer.
    Pending,
    /// Invoice the commission of an ended MONTH (YYYY-MM; default: every ended month not
    /// invoiced yet, up to a year back): once per seller and month.
    Invoices {
        #[arg(long)]
        month: Option<String>,
    },
    /// Check that every account's entries sum to its balance and every currency sums to zero.
    Check,
    /// Give back again a payment its order could not take (late, or extra: the order paid
    /// already) whose give-back ended dead (`payment_not_given_back`): its job again, asking the
    /// gateway under the give-back's idempotency key (a new one after the gateway refused it
    /// outright).
    GiveBack {
        gateway: String,
        session: String,
        /// The payment, when the session has several (a second payment on it).
        #[arg(long)]
        payment: Option<String>,
    },
    /// Settle a buyer's coin reservation whose order no longer waits for it
    /// (`coin_reservation_unsettled`): spent when the order was paid with it, else given back.
    SettleCoins { reservation: String },
    /// Post again the sale of ORDER the ledger refused (`sale_without_credit`, with its reason),
    /// after the fix its reason asks for.
    Repost { order: i64 },
    /// Say that the buyer of REFUND (of GATEWAY), recorded as done and then reported failed by
    /// the gateway, was paid back another way: its finding `refund_failed_after_done` closes.
    RefundRepaid { gateway: String, refund: String },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Signed webhooks per second and latency at 1, 8 and 32 senders, beside pgbench; the CPU
    /// cost of refusing the worst request a sender can make.
    Ingest(bench::IngestArgs),
    /// Enqueue and drain rates, and enqueue-to-start latency.
    Queue(bench::QueueArgs),
    /// Checkouts and payment effects per second through the HTTP API (one seller's flash sale,
    /// many sellers) and receipt-to-effect latency, beside pgbench's TPC-B at as many clients.
    E2e(bench::E2eArgs),
    /// The receiver under a sustained load of signed webhooks (10 % repeats) for minutes, with
    /// workers processing them: throughput, latency to p99.9, each process's memory, the
    /// tables' sizes after pruning, beside pgbench's inserts.
    Load(bench::LoadArgs),
    /// A worker process of `bench queue --workers N` (started by it).
    #[command(hide = true)]
    DrainWorker(bench::DrainWorkerArgs),
}

impl Cli {
    /// The process's role, as its traces name it (`serve`, `work`, `up`, or the command).
    pub fn role(&self) -> &'static str {
        match self.command {
            Command::Serve => "serve",
            Command::Work { .. } => "work",
            Command::Up { .. } => "up",
            Command::Soak(_) => "soak",
            Command::Bench { .. } => "bench",
            _ => "command",
        }
    }

    /// The role whose runtime the process gets (`config::runtime_threads`): its own, except
    /// that `bench queue`'s drain workers stand for `work` processes and run as they would.
    pub fn runtime_role(&self) -> &'static str {
        match &self.command {
            Command::Bench {
                which: BenchCommand::DrainWorker(_),
            } => "work",
            _ => self.role(),
        }
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Command::Openapi = cli.command {
        println!(
            "{}",
            serde_json::to_string_pretty(&payfleet::http::openapi::document())?
        );
        return Ok(());
    }
    let config = Config::from_env()?;
    match cli.command {
        Command::Migrate => {
            let (url, locking) = config.migrations_url();
            let working = progress::spinner("applying migrations");
            db::migrate_at(url, locking).await?;
            working.finish_and_clear();
            println!("migrations applied");
            Ok(())
        }
        Command::Serve => serve(config, Roles::SERVE).await,
        Command::Work {
            queues,
            concurrency,
        } => {
            let mut config = config;
            if !queues.is_empty() {
                config.queues.only(&queues)?;
            }
            for c in &concurrency {
                config.queues.set_concurrency(c)?;
            }
            serve(config, Roles::WORK).await
        }
        Command::Up { public } => up(config, public).await,
        Command::Jobs { action } => jobs(config, action.unwrap_or(JobsAction::Counts)).await,
        Command::Events { action } => events_command(config, action).await,
        Command::Messages { action } => {
            messages_command(
                config,
                action.unwrap_or(MessagesAction::Dead { limit: 100 }),
            )
            .await
        }
        Command::Money { action } => money_command(config, action).await,
        Command::Consistency { run, check } => consistency_command(config, run, check).await,
        Command::Demo(args) => demo::run(&config, args).await,
        Command::Soak(args) => soak::run(&config, args).await,
        Command::Openapi => Ok(()),
        Command::Bench { which } => match which {
            BenchCommand::Ingest(args) => bench::ingest(&config, args).await,
            BenchCommand::Queue(args) => bench::queue(&config, args).await,
            BenchCommand::E2e(args) => bench::e2e(&config, args).await,
            BenchCommand::Load(args) => bench::load(&config, args).await,
            BenchCommand::DrainWorker(args) => bench::drain_worker(&config, args).await,
        },
    }
}

/// `serve` and `work`: connect, start the roles, run until SIGTERM.
async fn serve(config: Config, roles: Roles) -> anyhow::Result<()> {
    // Settings unsafe together (the simulator beside live credentials, say) stop the process
    // before it touches any database.
    config.gateways.check()?;
    let pool = db::connect(&config.database_url, config.db_pool_size, roles.name()).await?;
    let bind = if roles.serve {
        Some(config.bind)
    } else {
        config.worker_bind
    };
    let listener = match bind {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?,
        ),
        None => None,
    };
    let running = startup::start(&config, pool, roles, listener)?;
    tracing::info!(
        database = %config.database_url,
        address = ?running.addr(),
        webhooks = %names(&config.gateways.signature_checks().enabled()),
        serve = roles.serve,
        work = roles.work,
        "payfleet started"
    );
    running.until(startup::shutdown_signal()).await
}

async fn up(config: Config, public: bool) -> anyhow::Result<()> {
    // Checked before anything is done: a development set-up is not put on a network by mistake.
    if !config.bind.ip().is_loopback() && !public {
        anyhow::bail!(
            "PAYFLEET_BIND={} is not a loopback address: `up` runs the payment simulator with development credentials, so it listens only on this machine unless told `up --public`",
            config.bind
        );
    }
    // `up` turns the payment simulator on and makes development credentials: never beside a
    // gateway whose money is real, where its pay button would confirm orders no money paid.
    // Live API credentials count too, webhook secret or not: checked here, before the
    // migrations and the development credentials touch whatever database DATABASE_URL names.
    let mut real = config.gateways.real_money();
    for g in config.gateways.live() {
        if !real.contains(&g) {
            real.push(g);
        }
    }
    if !real.is_empty() {
        anyhow::bail!(
            "`up` runs the payment simulator with development credentials, so it runs only where no money is real, and these gateways move real money here: {}. Run `payfleet serve` and `payfleet work` (README, \"Process roles\") or unset them",
            names(&real)
        );
    }
    startup::check_public_url(&config, Roles::UP)?;
    let (url, locking) = config.migrations_url();
    let working = progress::spinner("applying migrations");
    db::migrate_at(url, locking).await?;
    working.finish_and_clear();
    let pool = db::connect(&config.database_url, config.db_pool_size, Roles::UP.name()).await?;
    let (config, shown) = demo::development_config(&pool, config).await?;
    for (name, value) in &shown {
        println!("development setting: {name}={value}");
    }
    if !shown.is_empty() {
        println!(
            "(an admin token printed here is new at every start and kept nowhere; the webhook secrets and the API key are kept in the database for restarts and `payfleet demo`)"
        );
    }
    let listener = TcpListener::bind(config.bind)
        .await
        .with_context(|| format!("cannot listen on {}", config.bind))?;
    let running = startup::start(&config, pool, Roles::UP, Some(listener))?;
    println!(
        "payfleet is up on http://{} (gateways: {})",
        config.bind,
        names(&config.gateways.signature_checks().enabled())
    );
    running.until(startup::shutdown_signal()).await
}

fn names(gateways: &[payfleet::gateways::GatewayName]) -> String {
    payfleet::gateways::joined(gateways, ", ")
}

async fn jobs(config: Config, action: JobsAction) -> anyhow::Result<()> {
    let pool = db::connect(&config.database_url, 2, "jobs").await?;
    match action {
        JobsAction::Workers => {
            let workers = payfleet_queue::census::workers(&pool).await?;
            if workers.is_empty() {
                println!("no workers");
            }
            for w in workers {
                println!(
                    "{}\t{}\tstarted {}\tseen {}\t{}",
                    w.id,
                    if w.live { "live" } else { "gone" },
                    w.started_at.to_rfc3339(),
                    w.seen_at.to_rfc3339(),
                    w.queues.join(",")
                );
            }
        }
        JobsAction::Counts => {
            let counts = admin::counts(&pool).await?;
            if counts.is_empty() {
                println!("no jobs");
            }
            println!("{:<20} {:<12} {:>10}", "QUEUE", "STATE", "JOBS");
            for c in counts {
                println!("{:<20} {:<12} {:>10}", c.queue, c.state, c.count);
            }
        }
        JobsAction::Dead { queue, limit } => {
            let dead = admin::dead(&pool, queue.as_deref(), limit).await?;
            if dead.is_empty() {
                println!("no dead jobs");
            }
            for j in dead {
                println!(
                    "{}\t{}\t{}\tattempt {}/{}\t{}\t{}",
                    j.id,
                    j.queue,
                    j.kind,
                    j.attempt,
                    j.max_attempts,
                    j.finished_at.map(|t| t.to_rfc3339()).unwrap_or_default(),
                    j.last_error.unwrap_or_default()
                );
            }
        }
        JobsAction::Retry { id } => {
            admin::retry(&pool, JobId(id)).await?;
            println!("job {id} will run again now");
        }
        JobsAction::Discard { id } => {
            admin::discard(&pool, JobId(id)).await?;
            println!("job {id} discarded");
        }
        JobsAction::Pause { queue } => {
            // A mistyped name would pause nothing while the operator believes the queue stopped.
            if !config.queues.queues.contains_key(&queue) {
                anyhow::bail!(
                    "no queue {queue:?} in jobs/queues.toml: the fleet's queues are {}",
                    config
                        .queues
                        .queues
                        .keys()
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            admin::pause(&pool, &queue).await?;
            println!("queue {queue} is paused: no worker claims from it within a second");
        }
        JobsAction::Resume { queue } => {
            admin::resume(&pool, &queue).await?;
            println!("queue {queue} is resumed");
        }
    }
    pool.close().await;
    Ok(())
}

async fn events_command(config: Config, action: EventsAction) -> anyhow::Result<()> {
    let pool = db::connect(&config.database_url, 2, "events").await?;
    match action {
        EventsAction::Unprocessed { limit } => {
            let list = events::unprocessed(&pool, limit).await?;
            if list.is_empty() {
                println!("every stored event is processed");
            } else {
                println!(
                    "{:<8} {:<12} {:<32} {:<26} {:<9} {:<10} DETAIL",
                    "ID", "GATEWAY", "EVENT", "RECEIVED", "STATE", "JOB"
                );
            }
            for e in list {
                println!(
                    "{:<8} {:<12} {:<32} {:<26} {:<9} {:<10} {}",
                    e.id,
                    e.gateway,
                    e.event_id,
                    e.received_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    e.state(),
                    e.job.map_or("none", |s| s.as_str()),
                    e.detail.unwrap_or_default()
                );
            }
        }
        EventsAction::Replay { id: Some(id), .. } => match events::replay(&pool, id).await? {
            Replayed::Queued => println!("event {id} will be processed again"),
            Replayed::AlreadyQueued => {
                println!("event {id} already has a processing job waiting or running")
            }
        },
        EventsAction::Dismiss { id, reason } => {
            events::dismiss(&pool, id, &reason).await?;
            println!("event {id} dismissed: {reason}");
        }
        EventsAction::Replay { id: None, .. } => {
            let working = progress::spinner("queueing every unprocessed event");
            let n = events::replay_all(&pool).await?;
            working.finish_and_clear();
            println!("{n} unprocessed events will be processed again");
        }
    }
    pool.close().await;
    Ok(())
}

async fn messages_command(config: Config, action: MessagesAction) -> anyhow::Result<()> {
    use payfleet::messaging::orders as messages;
    let pool = db::connect(&config.database_url, 2, "messages").await?;
    match action {
        MessagesAction::Dead { limit } => {
            let dead = messages::dead_messages(&pool, limit).await?;
            if dead.is_empty() {
                println!("no dead order messages");
            }
            for m in dead {
                println!(
                    "{}\t{}\t{}\t{} attempts\tdead since {}\t{}",
                    m.consumer,
                    m.message_id,
                    m.routing_key,
                    m.attempts,
                    m.dead_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    m.last_error
                );
            }
        }
        MessagesAction::Replay {
            consumer,
            message_id,
            force,
        } => {
            messages::replay_dead(
                &pool,
                &payfleet::orders::outbox::OrderOutbox,
                &consumer,
                &message_id,
                force,
            )
            .await?;
            println!("message {message_id} goes to {consumer} again");
        }
        MessagesAction::Unpublished { limit } => {
            let waiting = payfleet::orders::outbox::unpublished(&pool, limit).await?;
            if waiting.is_empty() {
                println!("every order message is published");
            }
            let time = |t: chrono::DateTime<chrono::Utc>| {
                t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            };
            for m in waiting {
                let refused = match (m.attempts, m.next_attempt) {
                    (0, _) => "not refused".to_owned(),
                    (n, Some(next)) => format!("refused {n} times, next attempt {}", time(next)),
                    (n, None) => format!("refused {n} times, due now"),
                };
                println!(
                    "{}\t{}\torder {}\twritten {}\t{}\t{}",
                    m.message_id,
                    m.routing_key,
                    m.order_number,
                    time(m.created_at),
                    refused,
                    m.last_error.unwrap_or_default()
                );
            }
        }
        MessagesAction::Send {
            message_id: Some(message_id),
            force,
            ..
        } => {
            payfleet::orders::outbox::send_now(&pool, &message_id, force).await?;
            println!("message {message_id} goes with the relay's next batch");
        }
        MessagesAction::Send {
            message_id: None, ..
        } => {
            let n = payfleet::orders::outbox::send_refused_now(&pool).await?;
            println!("{n} refused messages go with the relay's next batches");
        }
    }
    pool.close().await;
    Ok(())
}

/// The first and the day after the last day of a `YYYY-MM` month.
fn month(text: &str) -> anyhow::Result<(chrono::NaiveDate, chrono::NaiveDate)> {
    let start = chrono::NaiveDate::parse_from_str(&format!("{}-01", text.trim()), "%Y-%m-%d")
        .map_err(|_| anyhow::anyhow!("--month takes YYYY-MM, not {text:?}"))?;
    let end = start
        .checked_add_months(chrono::Months::new(1))
        .ok_or_else(|| anyhow::anyhow!("--month {text:?} is out of range"))?;
    Ok((start, end))
}

async fn money_command(config: Config, action: MoneyAction) -> anyhow::Result<()> {
    use payfleet::ledger::{self, invoices, payouts, sales};
    // The payout run's day, as its recurring schedule counts days (its time zone).
    let payout_today = chrono::Utc::now()
        .with_timezone(
            &config
                .recurring
                .get("payouts")
                .map_or(chrono_tz::UTC, |s| s.timezone),
        )
        .date_naive();
    // Checked before connecting: a typo gets its message without a database.
    let period = match &action {
        MoneyAction::Invoices { month: Some(m) } => {
            let (start, end) = month(m)?;
            // An invoice is made once: a month still running (or whose last postings may
            // still be committing) would leave the rest uninvoiced.
            if !invoices::has_settled(end, config.ledger.invoice_timezone, chrono::Utc::now()) {
                anyhow::bail!(
                    "{m} has not ended yet (or ended less than {} minutes ago): only an ended month can be invoiced",
                    invoices::SETTLED_AFTER.num_minutes()
                );
            }
            Some((start, end))
        }
        MoneyAction::Payouts { date: Some(date) } => {
            // A run pays each seller once per period (the period its date falls in): a date to
            // come would use up that period before it has come, and its sales since then would
            // wait for the next.
            if *date > payout_today {
                anyhow::bail!(
                    "--date {date} has not come yet (today is {payout_today} in the payouts schedule's time zone, UTC without one): a payout run pays each seller once per period, so a date to come would pay that period before its sales are made"
                );
            }
            None
        }
        _ => None,
    };
    let pool = db::connect(&config.database_url, 2, "money").await?;
    match action {
        MoneyAction::Release => {
            let n = sales::release_matured(&pool, chrono::Utc::now()).await?;
            println!("{n} matured sales released to available");
        }
        MoneyAction::Payouts { date } => {
            let date = date.unwrap_or(payout_today);
            let made = payouts::run(&pool, date).await?;
            println!("{} payouts made for {date}: {made:?}", made.len());
        }
        MoneyAction::Pending => {
            let list = payouts::in_state(&pool, payouts::PayoutState::Pending).await?;
            if list.is_empty() {
                println!("no payout waits for the bank");
            }
            for p in list {
                println!(
                    "{}\t{}\t{} {}\tperiod {}\tsince {}",
                    p.id,
                    p.seller_id,
                    ledger::decimal_text(p.amount, &p.currency),
                    p.currency,
                    p.period_start,
                    p.created_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                );
            }
        }
        MoneyAction::Invoices { .. } => {
            let zone = config.ledger.invoice_timezone;
            match period {
                Some((start, end)) => {
                    let numbers = invoices::run(&pool, start, end, zone).await?;
                    println!(
                        "{} invoices for {start} to {end}: {numbers:?}",
                        numbers.len()
                    );
                }
                // What the recurring job does: every ended month not invoiced yet, a year back,
                // each only once it has settled (a month invoiced in its first minutes would
                // leave its last postings uninvoiced for ever).
                None => {
                    let numbers = invoices::run_due(&pool, chrono::Utc::now(), zone).await?;
                    println!(
                        "{} invoices for the ended months not invoiced yet: {numbers:?}",
                        numbers.len()
                    );
                }
            }
        }
        MoneyAction::GiveBack {
            gateway,
            session,
            payment,
        } => {
            let name: payfleet::gateways::GatewayName = gateway
                .parse()
                .map_err(|_| anyhow::anyhow!("unknown gateway {gateway:?}"))?;
            let given =
                payfleet::payments::give_back_again(&pool, name, &session, payment.as_deref())
                    .await;
            pool.close().await;
            let job = given?;
            println!(
                "{gateway} session {session}: its give-back is job {job} (payfleet jobs counts; the gateway is asked under the give-back's idempotency key, a new one after an outright refusal)"
            );
            return Ok(());
        }
        MoneyAction::SettleCoins { reservation } => {
            let settled = payfleet::orders::coin_payment::settle_again(&pool, &reservation).await;
            pool.close().await;
            let spent = settled?;
            println!(
                "coin reservation {reservation}: {} by the next settle_coins job",
                if spent { "spent" } else { "given back" }
            );
            return Ok(());
        }
        MoneyAction::Repost { order } => match ledger::poster::repost(&pool, order).await? {
            ledger::poster::Reposted::Posted => println!("order {order}: its sale is posted"),
            ledger::poster::Reposted::RefusedAgain(reason) => {
                pool.close().await;
                anyhow::bail!("order {order}: the ledger refused its sale again: {reason}");
            }
            ledger::poster::Reposted::NotRefused => {
                pool.close().await;
                anyhow::bail!("order {order} has no sale the ledger refused");
            }
        },
        MoneyAction::RefundRepaid { gateway, refund } => {
            let name: payfleet::gateways::GatewayName = gateway
                .parse()
                .map_err(|_| anyhow::anyhow!("unknown gateway {gateway:?}"))?;
            if payfleet::payments::order_refunds::repaid_elsewhere(&pool, name, &refund).await? {
                println!(
                    "refund {refund} of {gateway}: its buyer was paid back another way; its finding closes at the next consistency run"
                );
            } else {
                pool.close().await;
                anyhow::bail!(
                    "no refund {refund} of {gateway} was recorded done and then reported failed (or it was marked repaid before)"
                );
            }
        }
        MoneyAction::Check => {
            let (accounts, currencies) = ledger::check(&pool).await?;
            if accounts.is_empty() && currencies.is_empty() {
                println!(
                    "the ledger holds: every account's entries sum to its balance, every currency to zero"
                );
            } else {
                pool.close().await;
                anyhow::bail!(
                    "the ledger does not hold: accounts {accounts:?} differ from their entries; currencies {currencies:?} do not sum to zero"
                );
            }
        }
    }
    pool.close().await;
    Ok(())
}

async fn consistency_command(
    config: Config,
    run: bool,
    check: Option<String>,
) -> anyhow::Result<()> {
    if let Some(name) = check.as_deref()
        && !payfleet::consistency::CHECKS.contains(&name)
    {
        anyhow::bail!(
            "no consistency check {name:?} (they are: {})",
            payfleet::consistency::CHECKS.join(", ")
        );
    }
    let pool = db::connect(&config.database_url, 2, "consistency").await?;
    if run {
        let r = payfleet::consistency::run(&pool, config.consistency.grace).await?;
        println!(
            "checked: {} violations ({} new), {} resolved",
            r.open, r.new, r.resolved
        );
    }
    let counts: Vec<(&str, i64)> = payfleet::consistency::counts(&pool)
        .await?
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    if !counts.is_empty() {
        let each: Vec<String> = counts.iter().map(|(c, n)| format!("{c} {n}")).collect();
        println!("open: {}", each.join(", "));
    }
    let findings = match check.as_deref() {
        Some(name) => payfleet::consistency::open_of(&pool, name, 1000).await?,
        None => payfleet::consistency::open(&pool, 1000).await?,
    };
    if findings.is_empty() {
        println!("no open consistency findings");
    }
    for f in findings {
        println!(
            "{}\t{}\t{}\tsince {}\t{}",
            f.id,
            f.check_name,
            f.subject,
            f.first_seen
                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            f.detail
        );
    }
    pool.close().await;
    Ok(())
}
