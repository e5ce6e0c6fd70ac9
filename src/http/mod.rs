//! The HTTP surface: one file per area, each with its router (`webhooks`, `health`,
//! `metrics`), the one error type (`error`), and the assembly below.

mod admin;
mod dashboard;
mod error;
mod health;
mod html;
pub mod metrics;
mod money;
mod orders;
mod pay;
mod webhooks;

use std::sync::Arc;

use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use sqlx::PgPool;

pub use error::ApiError;
pub use health::Readiness;
pub use metrics::WebhookCounters;

use crate::gateways::hosted::HostedGateway;
use crate::orders::checkout::Checkout;
use crate::secret::Secret;
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
    pub checkout: Checkout,
    /// The hosted gateways (internal, mock) whose payment pages this receiver serves.
    pub hosted: Vec<HostedGateway>,
    pub admin_token: Option<Secret>,
    pub razorpay_key_id: Option<String>,
    /// The gateways this receiver may call itself (an operator's refund).
    pub gateways: crate::gateways::GatewayRegistry,
    /// The order side's RPC client (payment links, coins).
    pub rpc: crate::messaging::rpc::RpcClient,
    /// The fleet's recurring jobs, for the admin API.
    pub recurring: crate::recurring::Schedules,
    /// The dashboard's session cookie is `Secure` (the public URL is https).
    pub secure_cookies: bool,
}

/// The receiver's API: webhooks, health and metrics.
pub fn router(state: AppState) -> Router {
    Router::new()
        .merge(webhooks::routes(state.clone()))
        .merge(orders::routes(state.clone()))
        .merge(admin::routes(state.clone()))
        .merge(dashboard::routes(state.clone()))
        .merge(pay::routes(state.clone()))
        .merge(money::routes(state.clone()))
        .merge(health::routes(state.readiness.clone()))
        .merge(metrics::routes(
            state.pool.clone(),
            Some(state.counters.clone()),
        ))
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
        .layer(axum::middleware::from_fn(request_span))
}

/// One span per request, with its method, route and id (the caller's `x-request-id` when it
/// sends a sane one, else a new one), echoed in the answer's `x-request-id`.
async fn request_span(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    let span =
        tracing::info_span!("request", method = %req.method(), route = %route, request_id = %id);
    let mut resp = tracing::Instrument::instrument(next.run(req), span.clone()).await;
    span.in_scope(|| tracing::debug!(status = resp.status().as_u16(), "answered"));
    if let Ok(v) = axum::http::HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// A worker process's own endpoints: health and metrics.
pub fn worker_router(pool: PgPool, readiness: Readiness) -> Router {
    Router::new()
        .merge(health::routes(readiness))
        .merge(metrics::routes(pool, None))
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
}

/// A JSON body, refused with the one error shape: 400 when it is not JSON, 422 when it is JSON
/// of the wrong shape.
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(JsonBody(v)),
            Err(JsonRejection::JsonDataError(e)) => Err(ApiError::Unprocessable {
                code: "invalid_request",
                message: e.body_text(),
            }),
            Err(other) => Err(ApiError::bad_request(other.body_text())),
        }
    }
}
