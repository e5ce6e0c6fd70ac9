//! `GET /healthz` (the process is up) and `GET /readyz` (it can do its work). What "ready"
//! means depends on the process's role: a receiver needs the database and a live event
//! writer, not RabbitMQ (webhooks must land while the broker is down); a worker needs the
//! database and a running fleet.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use sqlx::PgPool;

use super::callers::Anyone;
use crate::webhooks::EventWriter;
use payfleet_queue::FleetProbe;

/// What `/readyz` checks in this process.
#[derive(Clone)]
pub struct Readiness {
    pub pool: PgPool,
    /// Serving webhooks: the writer must be alive.
    pub events: Option<EventWriter>,
    /// Running workers: the fleet must be running and have read the paused queues (until then
    /// it claims nothing).
    pub fleet: Option<FleetProbe>,
    /// Running workers: the broker must be connected (they answer the payment-link and coins
    /// RPC and relay the order messages). A receiver alone does without it: webhooks land
    /// while RabbitMQ is down.
    pub broker: Option<crate::messaging::Broker>,
    /// The database's last answer: anyone may probe, so the database is asked at most once a
    /// second whatever the pace of the probes.
    pub database: DatabaseProbe,
}

/// The last time the database was asked, and whether it answered.
#[derive(Clone, Default)]
pub struct DatabaseProbe(Arc<tokio::sync::Mutex<Option<(Instant, bool)>>>);

impl DatabaseProbe {
    const FRESH: Duration = Duration::from_secs(1);

    async fn answers(&self, pool: &PgPool) -> bool {
        // Probes that arrive while one asks wait for its answer.
        let mut last = self.0.lock().await;
        if let Some((at, ok)) = *last
            && at.elapsed() < Self::FRESH
        {
            return ok;
        }
        // A probe must answer fast even when the database is gone.
        let ok = tokio::time::timeout(
            Duration::from_secs(1),
            sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(pool),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        *last = Some((Instant::now(), ok));
        ok
    }
}

/// Public: a probe carries no credential, and the answers say only "ok" or "unavailable".
pub(super) fn routes(readiness: Readiness) -> super::Routes {
    super::Routes::default()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(readiness)
}

/// The process is up.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Alive {
    /// `ok`.
    status: String,
}

/// What a process needs, each `ok` or `unavailable`: a receiver's database and event writer,
/// a worker's database, fleet and broker.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Checks {
    database: Check,
    #[serde(skip_serializing_if = "Option::is_none")]
    event_writer: Option<Check>,
    #[serde(skip_serializing_if = "Option::is_none")]
    workers: Option<Check>,
    #[serde(skip_serializing_if = "Option::is_none")]
    broker: Option<Check>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub(super) enum Check {
    Ok,
    Unavailable,
}

impl From<bool> for Check {
    fn from(ok: bool) -> Self {
        if ok { Check::Ok } else { Check::Unavailable }
    }
}

#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "The process runs.", body = Alive)),
)]
async fn healthz(_caller: Anyone) -> impl IntoResponse {
    axum::Json(Alive {
        status: "ok".into(),
    })
}

#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "The process can do its work.", body = Checks),
        (status = 503, description = "It cannot: what is missing is `unavailable`.", body = Checks),
    ),
)]
async fn readyz(_caller: Anyone, State(r): State<Readiness>) -> impl IntoResponse {
    let database = r.database.answers(&r.pool).await;
    let event_writer = r.events.as_ref().map(EventWriter::is_alive);
    let workers = r.fleet.as_ref().map(FleetProbe::is_claiming);
    let broker = r
        .broker
        .as_ref()
        .map(crate::messaging::Broker::is_connected);
    let ready =
        database && event_writer != Some(false) && workers != Some(false) && broker != Some(false);
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let checks = Checks {
        database: database.into(),
        event_writer: event_writer.map(Check::from),
        workers: workers.map(Check::from),
        broker: broker.map(Check::from),
    };
    (status, axum::Json(checks))
}
