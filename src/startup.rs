//! Builds the parts of a process from its configuration: the pool (creating the database if
//! absent), the migrations, the job registry, the HTTP server and the worker fleet. Tests use the
//! same functions with a listener on port 0 and a database of their own.

use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio::net::TcpListener;

use crate::config::Config;
use crate::gateways::MercadoPagoClient;
use crate::http::{self, AppState};
use crate::messaging::Broker;
use crate::payments::{ProcessPaymentEvent, Processor};
use crate::queue::{Fleet, FleetHandle, JobContext, Notifier, QueuesConfig, Registry};
use crate::webhooks::EventWriter;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// One TLS provider (ring) for every client in the process: reqwest and lapin. Idempotent.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Opens the pool, creating the database first if the server does not have it.
pub async fn connect(database_url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(database_url)
        .context("DATABASE_URL is not a valid PostgreSQL URL")?;
    create_database_if_absent(&options).await?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        // Fail fast when the database is down: requests get a 503, workers back off.
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .context("cannot connect to PostgreSQL (DATABASE_URL)")
}

async fn create_database_if_absent(options: &PgConnectOptions) -> anyhow::Result<()> {
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    match options.connect().await {
        Ok(c) => {
            c.close().await.ok();
            return Ok(());
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {}
        Err(e) => return Err(e).context("cannot connect to PostgreSQL (DATABASE_URL)"),
    }
    let sql = format!("CREATE DATABASE {}", quote_ident(&name));
    match on_maintenance_database(options, sql).await {
        Ok(()) => tracing::info!(database = %name, "created the database"),
        // Another process created it meanwhile.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
        Err(e) => return Err(e).context("cannot create the database"),
    }
    Ok(())
}

/// Runs one statement on the server's `postgres` database: creating or dropping ours cannot be
/// done from inside it.
pub(crate) async fn on_maintenance_database(
    options: &PgConnectOptions,
    sql: String,
) -> Result<(), sqlx::Error> {
    let mut admin = options.clone().database("postgres").connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&mut admin)
        .await?;
    admin.close().await.ok();
    Ok(())
}

/// A database name as a quoted SQL identifier.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR.run(pool).await.context("migrations failed")
}

/// Every job kind this fleet runs, with its handler.
pub fn registry(processor: Processor) -> anyhow::Result<Registry> {
    let processor = Arc::new(processor);
    let mut registry = Registry::new();
    registry.register::<ProcessPaymentEvent, _, _>(move |ctx: JobContext, job: ProcessPaymentEvent| {
        let processor = processor.clone();
        async move {
            let result = processor.process(&ctx.pool, job.gateway, &job.event_id).await?;
            tracing::debug!(gateway = %job.gateway, event = %job.event_id, ?result, "payment event processed");
            Ok(())
        }
    })?;
    Ok(registry)
}

/// The processor as configured: Mercado Pago events need API access to read the payment.
pub fn processor() -> anyhow::Result<Processor> {
    let token = std::env::var("MERCADOPAGO_ACCESS_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    let base = std::env::var("MERCADOPAGO_API_URL")
        .unwrap_or_else(|_| "https://api.mercadopago.com".to_owned());
    let mercadopago = token
        .map(|t| MercadoPagoClient::new(&base, &t))
        .transpose()
        .context("MERCADOPAGO_API_URL")?;
    Ok(Processor { mercadopago })
}

/// Serves the HTTP API on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, http::router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Starts the event writers and the after-commit notifier, so call it inside the runtime.
pub fn app_state(config: &Config, pool: PgPool, broker: Broker) -> AppState {
    let pool_for_notifier = pool.clone();
    let pool_for_writer = pool.clone();
    AppState {
        pool,
        broker,
        secrets: Arc::new(config.webhooks.clone()),
        webhook_tolerance_secs: config.webhook_tolerance_secs,
        webhook_body_limit: config.webhook_body_limit,
        events: EventWriter::start(pool_for_writer, Some(Notifier::start(pool_for_notifier))),
    }
}

pub fn start_fleet(pool: PgPool, registry: Registry, queues: QueuesConfig) -> FleetHandle {
    Fleet::new(pool, registry, queues).start()
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}
