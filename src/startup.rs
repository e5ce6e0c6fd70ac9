//! Builds the parts of a process from its configuration: the job registry, the HTTP server and
//! the worker fleet. Tests use the same functions with a listener on port 0 and a database of
//! their own (see `db` for the pool and the migrations).

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::gateways::MercadoPagoClient;
use crate::http::{self, AppState};
use crate::messaging::Broker;
use crate::payments::{ProcessPaymentEvent, Processor};
use crate::queue::{Fleet, FleetHandle, JobContext, Notifier, QueuesConfig, Registry};
use crate::webhooks::EventWriter;

/// One TLS provider (ring) for every client in the process: reqwest and lapin. Idempotent.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
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
