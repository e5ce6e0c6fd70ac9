//! The HTTP surface: one file per area, each with its router (`webhooks`, `health`,
//! `metrics`), the one error type (`error`), and the assembly below.

mod error;
mod health;
pub mod metrics;
mod webhooks;

use std::sync::Arc;

use axum::Router;
use sqlx::PgPool;

pub use error::ApiError;
pub use health::Readiness;
pub use metrics::WebhookCounters;

use crate::webhooks::{EventWriter, Verifier};

/// Everything the HTTP handlers share.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub verifier: Verifier,
    pub events: EventWriter,
    pub webhook_body_limit: usize,
    pub readiness: Readiness,
    pub counters: Arc<WebhookCounters>,
}

/// The receiver's API: webhooks, health and metrics.
pub fn router(state: AppState) -> Router {
    Router::new()
        .merge(webhooks::routes(state.clone()))
        .merge(health::routes(state.readiness.clone()))
        .merge(metrics::routes(
            state.pool.clone(),
            Some(state.counters.clone()),
        ))
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
}

/// A worker process's own endpoints: health and metrics.
pub fn worker_router(pool: PgPool, readiness: Readiness) -> Router {
    Router::new()
        .merge(health::routes(readiness))
        .merge(metrics::routes(pool, None))
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
}
