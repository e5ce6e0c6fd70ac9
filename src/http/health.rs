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
use serde_json::{Map, Value, json};
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
    /// Running workers: the fleet must be running.
    pub fleet: Option<FleetProbe>,
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

async fn healthz(_caller: Anyone) -> impl IntoResponse {
    axum::Json(json!({"status": "ok"}))
}

async fn readyz(_caller: Anyone, State(r): State<Readiness>) -> impl IntoResponse {
    let mut checks = Map::new();
    let mut ready = true;
    let mut check = |name: &str, ok: bool| {
        ready &= ok;
        checks.insert(
            name.to_owned(),
            Value::String(if ok { "ok" } else { "unavailable" }.to_owned()),
        );
    };
    let db = r.database.answers(&r.pool).await;
    check("database", db);
    if let Some(events) = &r.events {
        check("event_writer", events.is_alive());
    }
    if let Some(fleet) = &r.fleet {
        check("workers", fleet.is_running());
    }
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(Value::Object(checks)))
}
