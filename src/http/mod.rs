//! The HTTP surface: assembles each context's routes with health and metrics.

mod error;
pub mod metrics;

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::json;
use sqlx::PgPool;

pub use error::ApiError;

use crate::messaging::Broker;
use crate::webhooks::{self, EventWriter, WebhookSecrets, WebhookState};

/// Everything the HTTP handlers share.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub broker: Broker,
    pub secrets: Arc<WebhookSecrets>,
    pub webhook_tolerance_secs: i64,
    pub webhook_body_limit: usize,
    pub events: EventWriter,
}

pub fn router(state: AppState) -> Router {
    let webhooks = webhooks::routes(WebhookState {
        events: state.events.clone(),
        secrets: state.secrets.clone(),
        tolerance_secs: state.webhook_tolerance_secs,
        body_limit: state.webhook_body_limit,
    });
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(state)
        .merge(webhooks)
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
}

async fn healthz() -> impl IntoResponse {
    axum::Json(json!({"status": "ok"}))
}

/// Ready when PostgreSQL answers and the broker connection is up.
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let db = sqlx::query_scalar::<_, i32>("SELECT 1")
        .fetch_one(&state.pool)
        .await
        .is_ok();
    let broker = state.broker.is_connected();
    let status = if db && broker {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let word = |ok: bool| if ok { "ok" } else { "unavailable" };
    (
        status,
        axum::Json(json!({"database": word(db), "broker": word(broker)})),
    )
}

async fn metrics_text(State(state): State<AppState>) -> Result<impl IntoResponse, ApiError> {
    let body = metrics::render(&state.pool).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body))
}
