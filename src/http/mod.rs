//! The HTTP surface: one file per area, each with its routes and its own state, with only what
//! its handlers use (`webhooks`, `orders`, `ledger`, `admin`, `dashboard`, `pay`, `health`,
//! `metrics`), who may call them (`callers`), the one error type (`error`), the server and its
//! limits (`server`), and the assembly below.

mod admin;
pub mod callers;
mod dashboard;
mod error;
mod health;
mod html;
mod ledger;
pub mod metrics;
pub mod openapi;
mod orders;
mod pay;
pub mod server;
mod webhooks;

use std::sync::Arc;

use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::routing::MethodRouter;
use serde::de::DeserializeOwned;
use sqlx::PgPool;

pub use callers::Callers;
pub use error::ApiError;
pub use health::Readiness;
pub use metrics::WebhookCounters;

use crate::gateways::hosted::HostedGateway;
use crate::orders::checkout::Checkout;
use crate::telemetry::Telemetry;
use crate::webhooks::{EventWriter, Verifier};

/// What the receiver is built from. No handler sees all of it: [`router`] gives each area's
/// router its own state, with only what that area's handlers use.
pub struct AppState {
    pub pool: PgPool,
    pub verifier: Verifier,
    pub events: EventWriter,
    pub webhook_body_limit: usize,
    pub readiness: Readiness,
    pub counters: Arc<WebhookCounters>,
    pub checkout: Checkout,
    /// The hosted gateways (internal, mock) whose payment pages this receiver serves: none
    /// unless the payment simulator is on.
    pub hosted: Vec<HostedGateway>,
    /// Where buyers reach this receiver (`PAYFLEET_PUBLIC_URL`): the only origin the payment
    /// page takes a form from.
    pub public_url: String,
    pub callers: Callers,
    /// How long a reading of the metrics' database gauges is served.
    pub metrics_refresh: std::time::Duration,
    pub razorpay_key_id: Option<String>,
    /// The gateways this receiver may call itself (an operator's refund).
    pub gateways: crate::gateways::GatewayRegistry,
    /// The order side's RPC client (payment links, coins).
    pub rpc: crate::messaging::rpc::RpcClient,
    /// The fleet's recurring jobs, for the admin API.
    pub recurring: crate::recurring::Schedules,
    /// The dashboard's session cookie is `Secure` (the public URL is https).
    pub secure_cookies: bool,
    /// This process's histograms (each answer's time is one of them).
    pub telemetry: crate::telemetry::Telemetry,
}

/// The caller extractors (`callers`: `Operator`, `Backend`, `MetricsReader`) take the
/// credentials and the failure limiter from the state of any area whose routes use them: one
/// `Callers`, shared by every area.
macro_rules! callers_in {
    ($($state:ty),+ $(,)?) => {
        $(impl axum::extract::FromRef<$state> for Callers {
            fn from_ref(state: &$state) -> Self {
                state.callers.clone()
            }
        })+
    };
}

callers_in!(
    orders::OrdersState,
    ledger::LedgerState,
    admin::AdminState,
    dashboard::DashboardState,
    metrics::MetricsState,
);

/// A router that keeps the path of every route it is given, so that the whole surface can be
/// walked (a test sends every route a request without credentials, and fails on any that is
/// not on the short public list and does not answer 401).
pub struct Routes<S = ()> {
    router: Router<S>,
    paths: Vec<&'static str>,
}

impl<S: Clone + Send + Sync + 'static> Default for Routes<S> {
    fn default() -> Self {
        Self {
            router: Router::new(),
            paths: Vec::new(),
        }
    }
}

impl<S: Clone + Send + Sync + 'static> Routes<S> {
    pub fn route(mut self, path: &'static str, handlers: MethodRouter<S>) -> Self {
        self.router = self.router.route(path, handlers);
        self.paths.push(path);
        self
    }

    pub fn merge(mut self, other: Routes<S>) -> Self {
        self.router = self.router.merge(other.router);
        self.paths.extend(other.paths);
        self
    }

    pub fn with_state<S2>(self, state: S) -> Routes<S2> {
        Routes {
            router: self.router.with_state(state),
            paths: self.paths,
        }
    }
}

impl Routes {
    /// The router to serve, and the paths it answers; each answer timed in `telemetry`.
    fn finish(self, telemetry: Telemetry) -> (Router, Vec<&'static str>) {
        let router = self
            .router
            .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
            // After every route: it applies to the routes registered so far. Axum adds the
            // `Allow` header.
            .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
            .layer(axum::middleware::from_fn(utf8_path))
            .layer(axum::middleware::from_fn_with_state(
                telemetry,
                request_span,
            ));
        (router, self.paths)
    }
}

/// The receiver's API, and its paths.
pub fn router(state: AppState) -> (Router, Vec<&'static str>) {
    let webhooks = webhooks::WebhookState {
        verifier: state.verifier,
        events: state.events,
        counters: state.counters.clone(),
        body_limit: state.webhook_body_limit,
    };
    let orders = orders::OrdersState {
        pool: state.pool.clone(),
        checkout: state.checkout,
        rpc: state.rpc,
        callers: state.callers.clone(),
        gateways: state.gateways.clone(),
    };
    let admin = admin::AdminState {
        pool: state.pool.clone(),
        simulates_renewals: state
            .hosted
            .iter()
            .any(|g| g.name() == crate::gateways::GatewayName::Internal),
        gateways: state.gateways,
        recurring: state.recurring.clone(),
        callers: state.callers.clone(),
    };
    let dashboard = dashboard::DashboardState {
        pool: state.pool.clone(),
        callers: state.callers.clone(),
        public_url: state.public_url.clone(),
        recurring: state.recurring,
        secure_cookies: state.secure_cookies,
    };
    let pay = pay::PayState {
        pool: state.pool.clone(),
        hosted: state.hosted,
        public_url: state.public_url,
        razorpay_key_id: state.razorpay_key_id,
    };
    let ledger = ledger::LedgerState {
        pool: state.pool.clone(),
        callers: state.callers.clone(),
    };
    Routes::default()
        .merge(webhooks::routes(webhooks))
        .merge(orders::routes(orders))
        .merge(admin::routes(admin))
        .merge(dashboard::routes(dashboard))
        .merge(pay::routes(pay))
        .merge(ledger::routes(ledger))
        .merge(health::routes(state.readiness))
        .merge(openapi::routes())
        .merge(metrics::routes(
            state.pool.clone(),
            Some(state.counters.clone()),
            state.callers.clone(),
            state.metrics_refresh,
            state.telemetry.clone(),
        ))
        .finish(state.telemetry)
}

/// A path that is not UTF-8 once percent-decoded (`/orders/%FF`) names nothing a route
/// serves: refused here in the one error shape, where a route's `Path` would answer in plain
/// text.
async fn utf8_path(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if percent_encoding::percent_decode_str(req.uri().path())
        .decode_utf8()
        .is_err()
    {
        return axum::response::IntoResponse::into_response(ApiError::BadRequest {
            code: "bad_request",
            message: "the request's path is not UTF-8 once percent-decoded".into(),
        });
    }
    next.run(req).await
}

/// A request's id as the server gave it before routing (`server`), for the request span.
#[derive(Clone)]
pub(super) struct RequestId(pub(super) String);

/// When the server answers a request 503 `answer_timeout` and drops its handler (`server`).
#[derive(Clone, Copy)]
pub(super) struct AnswerBy(pub(super) std::time::Instant);

/// Counts a request the server stopped at its answer timeout, as the 503 it was answered: the
/// server's answer is made outside the router, where the route is not known, and the request
/// span's own count never runs (its future is dropped). A request dropped before its time (the
/// client went away) was answered nothing, and is not counted.
struct CountedIfStopped<'a> {
    telemetry: &'a Telemetry,
    route: &'a str,
    started: std::time::Instant,
    answer_by: Option<std::time::Instant>,
    answered: bool,
}

impl Drop for CountedIfStopped<'_> {
    fn drop(&mut self) {
        if !self.answered
            && self
                .answer_by
                .is_some_and(|by| std::time::Instant::now() >= by)
        {
            self.telemetry
                .http_answered(self.route, 503, self.started.elapsed());
        }
    }
}

/// A request's id: the caller's `x-request-id` when it sends a sane one, else a new one.
pub(super) fn request_id(headers: &axum::http::HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()))
}

/// One span per request, with its method, route and id (the caller's `x-request-id` when it
/// sends a sane one, else a new one), echoed in the answer's `x-request-id`; its time observed
/// by route template and status class.
async fn request_span(
    axum::extract::State(telemetry): axum::extract::State<Telemetry>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let started = std::time::Instant::now();
    let id = req
        .extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_else(|| request_id(req.headers()));
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    // Exported as a server span named by its route template (`traces`), continuing the
    // caller's trace when it sends a well-formed `traceparent`.
    let span = tracing::info_span!(
        "request",
        method = %req.method(),
        route = %route,
        request_id = %id,
        otel.name = tracing::field::Empty,
        otel.kind = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    let traced = crate::traces::on();
    if traced {
        span.record("otel.name", format!("{} {route}", req.method()));
        span.record("otel.kind", "server");
        let caller = req
            .headers()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .filter(|v| crate::traces::is_traceparent(v));
        crate::traces::continue_trace(&span, caller);
    }
    let mut stopped = CountedIfStopped {
        telemetry: &telemetry,
        route: &route,
        started,
        answer_by: req.extensions().get::<AnswerBy>().map(|a| a.0),
        answered: false,
    };
    let mut resp = error::REQUEST_ID
        .scope(
            id.clone(),
            tracing::Instrument::instrument(next.run(req), span.clone()),
        )
        .await;
    stopped.answered = true;
    if traced {
        span.record("http.response.status_code", resp.status().as_u16());
    }
    span.in_scope(|| tracing::debug!(status = resp.status().as_u16(), "answered"));
    telemetry.http_answered(&route, resp.status().as_u16(), started.elapsed());
    if let Ok(v) = axum::http::HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// A worker process's own endpoints: health and metrics.
pub fn worker_router(
    pool: PgPool,
    readiness: Readiness,
    callers: Callers,
    metrics_refresh: std::time::Duration,
    telemetry: Telemetry,
) -> Router {
    Routes::default()
        .merge(health::routes(readiness))
        .merge(metrics::routes(
            pool,
            None,
            callers,
            metrics_refresh,
            telemetry.clone(),
        ))
        .finish(telemetry)
        .0
}

/// A JSON body, refused with the one error shape: 415 when it is not sent as JSON, 400 when it
/// does not read as JSON, 422 when it is JSON of the wrong shape.
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
            Err(JsonRejection::BytesRejection(r)) => Err(ApiError::from_body(r, None)),
            Err(e @ JsonRejection::MissingJsonContentType(_)) => {
                Err(ApiError::UnsupportedMediaType(e.body_text()))
            }
            Err(other) => Err(ApiError::bad_request(other.body_text())),
        }
    }
}
