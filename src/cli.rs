//! The command line: one subcommand per process role, plus the operator's and benchmark tools.

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio::net::TcpListener;

use crate::config::Config;
use crate::messaging::Broker;
use crate::queue::{JobId, admin};
use crate::{bench, db, startup};

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
    /// Run a worker process: every queue of jobs/queues.toml.
    Work,
    /// Everything in one process, migrations included: the local default.
    Up,
    /// Inspect and repair the job queue.
    Jobs {
        #[command(subcommand)]
        action: Option<JobsAction>,
    },
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
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Signed webhooks per second and latency at 1, 8 and 32 senders, beside pgbench.
    Ingest(bench::IngestArgs),
    /// Enqueue and drain rates, and enqueue-to-start latency.
    Queue(bench::QueueArgs),
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    startup::install_tls_provider();
    let config = Config::from_env()?;
    match cli.command {
        Command::Migrate => {
            let pool = db::connect(&config.database_url, 2).await?;
            db::migrate(&pool).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Serve => serve(config).await,
        Command::Work => work(config).await,
        Command::Up => up(config).await,
        Command::Jobs { action } => jobs(config, action.unwrap_or(JobsAction::Counts)).await,
        Command::Bench { which } => match which {
            BenchCommand::Ingest(args) => bench::ingest(&config, args).await,
            BenchCommand::Queue(args) => bench::queue(&config, args).await,
        },
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let pool = db::connect(&config.database_url, config.db_pool_size).await?;
    let (broker, _supervisor) = Broker::start(config.amqp_url.clone());
    let listener = TcpListener::bind(config.bind)
        .await
        .with_context(|| format!("cannot listen on {}", config.bind))?;
    tracing::info!(address = %config.bind, gateways = ?enabled(&config), "serving");
    startup::serve(
        listener,
        startup::app_state(&config, pool, broker),
        startup::shutdown_signal(),
    )
    .await?;
    Ok(())
}

async fn work(config: Config) -> anyhow::Result<()> {
    let pool = db::connect(&config.database_url, config.db_pool_size).await?;
    let fleet = startup::start_fleet(
        pool,
        startup::registry(startup::processor()?)?,
        config.queues.clone(),
    );
    startup::shutdown_signal().await;
    fleet.shutdown().await;
    Ok(())
}

async fn up(config: Config) -> anyhow::Result<()> {
    let mut config = config;
    let (secrets, made) = config.webhooks.clone().with_development_defaults();
    config.webhooks = secrets;
    for (name, value) in made {
        println!("development secret (set {name} to keep it): {name}={value}");
    }
    let pool = db::connect(&config.database_url, config.db_pool_size).await?;
    db::migrate(&pool).await?;
    let (broker, _supervisor) = Broker::start(config.amqp_url.clone());
    let fleet = startup::start_fleet(
        pool.clone(),
        startup::registry(startup::processor()?)?,
        config.queues.clone(),
    );
    let listener = TcpListener::bind(config.bind)
        .await
        .with_context(|| format!("cannot listen on {}", config.bind))?;
    println!(
        "payfleet is up on http://{} (gateways: {:?})",
        config.bind,
        enabled(&config)
    );
    startup::serve(
        listener,
        startup::app_state(&config, pool, broker),
        startup::shutdown_signal(),
    )
    .await?;
    fleet.shutdown().await;
    Ok(())
}

fn enabled(config: &Config) -> Vec<&'static str> {
    crate::gateways::GatewayName::ALL
        .iter()
        .filter(|g| config.webhooks.enabled(**g))
        .map(|g| g.as_str())
        .collect()
}

async fn jobs(config: Config, action: JobsAction) -> anyhow::Result<()> {
    let pool = db::connect(&config.database_url, 2).await?;
    match action {
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
    }
    pool.close().await;
    Ok(())
}
