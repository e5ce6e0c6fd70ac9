//! `GET /metrics`, in the Prometheus text format, for the admin token or
//! `PAYFLEET_METRICS_TOKEN`. Counters are this process's (held by its app, not in globals);
//! gauges are read from the database (every process reports the same fleet-wide numbers), each
//! through a partial index, at most once per `PAYFLEET_METRICS_REFRESH_MS` (5 s) whatever the scrape rate: scrapes
//! in between get the last reading, and concurrent ones wait for the one reading under way, so
//! no scrape rate can take the pool's connections from checkouts.

use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use sqlx::PgPool;

use super::ApiError;
use super::callers::{Callers, MetricsReader};
use crate::gateways::GatewayName;
use crate::payments::events;
use crate::webhooks::Stored;
use payfleet_queue::{admin, census};

const GATEWAYS: usize = GatewayName::ALL.len();

/// Why a webhook was refused: the reasons of `SignatureError::reason`,
/// `RejectedWebhook::reason` and the receiver's own.
const REASONS: [&str; 12] = [
    "disabled",
    "missing_header",
    "malformed",
    "mismatch",
    "timestamp",
    "malformed_body",
    "too_large",
    "unreadable_body",
    "unavailable",
    "store_refused",
    "aborted",
    "other",
];

/// The receiver's webhook counters.
#[derive(Default)]
pub struct WebhookCounters {
    received: [[AtomicU64; 2]; GATEWAYS],
    refused: [[AtomicU64; REASONS.len()]; GATEWAYS],
}

fn gateway_index(gateway: GatewayName) -> usize {
    GatewayName::ALL
        .iter()
        .position(|x| *x == gateway)
        .unwrap_or(0)
}

impl WebhookCounters {
    pub fn received(&self, gateway: GatewayName, status: Stored) {
        let s = match status {
            Stored::Accepted => 0,
            Stored::Duplicate => 1,
        };
        self.received[gateway_index(gateway)][s].fetch_add(1, Ordering::Relaxed);
    }

    pub fn refused(&self, gateway: GatewayName, reason: &str) {
        let r = REASONS
            .iter()
            .position(|x| *x == reason)
            .unwrap_or(REASONS.len() - 1);
        self.refused[gateway_index(gateway)][r].fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String) {
        out.push_str("# HELP payfleet_webhooks_total Verified webhooks stored (accepted) or recognised as repeats (duplicate).\n");
        out.push_str("# TYPE payfleet_webhooks_total counter\n");
        for (gi, g) in GatewayName::ALL.iter().enumerate() {
            for (si, s) in ["accepted", "duplicate"].iter().enumerate() {
                let n = self.received[gi][si].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "payfleet_webhooks_total{{gateway=\"{g}\",status=\"{s}\"}} {n}"
                );
            }
        }
        out.push_str("# HELP payfleet_webhooks_refused_total Webhooks answered with an error, by gateway and reason (mismatch: a wrong secret or a forged request).\n");
        out.push_str("# TYPE payfleet_webhooks_refused_total counter\n");
        for (gi, g) in GatewayName::ALL.iter().enumerate() {
            for (ri, r) in REASONS.iter().enumerate() {
                let n = self.refused[gi][ri].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "payfleet_webhooks_refused_total{{gateway=\"{g}\",reason=\"{r}\"}} {n}"
                );
            }
        }
    }
}

/// The last reading of the gauges, with when it was made.
type Reading = Option<(Instant, Arc<str>)>;

#[derive(Clone)]
pub(super) struct MetricsState {
    pool: PgPool,
    webhooks: Option<Arc<WebhookCounters>>,
    pub(super) callers: Callers,
    /// How long a reading of the gauges is served before it is read again.
    refresh: Duration,
    gauges: Arc<tokio::sync::Mutex<Reading>>,
    telemetry: crate::telemetry::Telemetry,
}

/// `webhooks`: the receiver's counters, when this process receives webhooks.
pub(super) fn routes(
    pool: PgPool,
    webhooks: Option<Arc<WebhookCounters>>,
    callers: Callers,
    refresh: Duration,
    telemetry: crate::telemetry::Telemetry,
) -> super::Routes {
    super::Routes::default()
        .route("/metrics", get(metrics_text))
        .with_state(MetricsState {
            pool,
            webhooks,
            callers,
            refresh,
            gauges: Arc::default(),
            telemetry,
        })
}

#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus' text format: README.md's Metrics.", content_type = "text/plain; version=0.0.4", body = String)),
    security(("metrics_token" = [])),
)]
async fn metrics_text(
    _caller: MetricsReader,
    State(state): State<MetricsState>,
) -> Result<impl IntoResponse, ApiError> {
    let mut body = String::new();
    if let Some(w) = &state.webhooks {
        w.render(&mut body);
    }
    // Formatting into a String cannot fail.
    let _ = state.telemetry.render(&mut body);
    // The database's gauges may be unreadable (an outage): the process's own counters are
    // still answered, what the outage itself counts (webhooks refused 503, RPC failures), with
    // the gauges left out and `payfleet_database_gauges_read` at 0 for an alert to see.
    body.push_str("# HELP payfleet_database_gauges_read Whether this scrape could read the gauges kept in the database (1) or not (0: they are left out of it).\n# TYPE payfleet_database_gauges_read gauge\n");
    // Within a time of their own too: a database that takes the statements and never answers
    // (a table locked by a migration or a `VACUUM FULL`, connections half-open after a
    // partition) would otherwise hold every scrape, and the counters that show the outage,
    // past Prometheus' own timeout.
    // The read runs in a task of its own, holding the readings' lock: a scrape that stops
    // waiting leaves it to finish (its connection is busy until the database answers anyway),
    // and the scrapes after it wait for that one read instead of each starting another on a
    // connection of the pool.
    let reading = tokio::spawn({
        let state = state.clone();
        async move { cached_gauges(&state).await }
    });
    let read = match tokio::time::timeout(GAUGES_WITHIN, reading).await {
        Ok(Ok(read)) => Ok(read),
        Ok(Err(_panicked)) => Ok(Err(sqlx::Error::WorkerCrashed)),
        Err(elapsed) => Err(elapsed),
    };
    match read {
        Ok(Ok(gauges)) => {
            body.push_str("payfleet_database_gauges_read 1\n");
            body.push_str(&gauges);
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "metrics: the database's gauges cannot be read; answering the process's own");
            body.push_str("payfleet_database_gauges_read 0\n");
        }
        Err(_) => {
            tracing::warn!(
                within_secs = GAUGES_WITHIN.as_secs(),
                "metrics: the database did not answer the gauges in time; answering the process's own"
            );
            body.push_str("payfleet_database_gauges_read 0\n");
        }
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body))
}

/// How long a scrape waits for the database's gauges (the lock of a read under way included)
/// before it answers without them: well within Prometheus' default scrape timeout (10 s).
const GAUGES_WITHIN: Duration = Duration::from_secs(3);

/// The gauges as last read, read again when older than `refresh`. The lock is held over
/// the reading: scrapes that arrive meanwhile wait for it instead of reading too.
async fn cached_gauges(state: &MetricsState) -> Result<Arc<str>, sqlx::Error> {
    let mut cached = state.gauges.lock().await;
    if let Some((at, text)) = cached.as_ref()
        && at.elapsed() < state.refresh
    {
        return Ok(text.clone());
    }
    let mut text = String::new();
    gauges(&state.pool, &mut text).await?;
    let text: Arc<str> = text.into();
    *cached = Some((Instant::now(), text.clone()));
    Ok(text)
}

async fn gauges(pool: &PgPool, out: &mut String) -> Result<(), sqlx::Error> {
    out.push_str("# HELP payfleet_jobs Jobs waiting, running and dead, by queue and state.\n# TYPE payfleet_jobs gauge\n");
    for c in admin::live_counts(pool).await? {
        let _ = writeln!(
            out,
            "payfleet_jobs{{queue=\"{}\",state=\"{}\"}} {}",
            c.queue, c.state, c.count
        );
    }
    out.push_str("# HELP payfleet_queue_due_jobs Jobs due now and not started, by queue (scheduled jobs are not counted until due).\n# TYPE payfleet_queue_due_jobs gauge\n");
    out.push_str("# HELP payfleet_queue_oldest_due_seconds How long the oldest due job of each queue has waited to start.\n# TYPE payfleet_queue_oldest_due_seconds gauge\n");
    for q in admin::due_by_queue(pool).await? {
        let _ = writeln!(
            out,
            "payfleet_queue_due_jobs{{queue=\"{}\"}} {}",
            q.queue, q.due
        );
        let _ = writeln!(
            out,
            "payfleet_queue_oldest_due_seconds{{queue=\"{}\"}} {:.3}",
            q.queue, q.oldest_due_secs
        );
    }
    out.push_str("# HELP payfleet_queue_workers Live worker processes working each queue, from the fleet's census (GET /admin/workers); a queue no live worker works has no series.\n# TYPE payfleet_queue_workers gauge\n");
    let working = census::live_counts(&census::workers(pool).await?);
    for (queue, workers) in working {
        let _ = writeln!(out, "payfleet_queue_workers{{queue=\"{queue}\"}} {workers}");
    }
    let (p50, p99, max) = events::processing_lag(pool).await?;
    // A gauge of the window's percentiles (`percentile`, not `quantile`: that label is a
    // summary's, whose sum and count would have to be cumulative, which a window's are not).
    out.push_str("# HELP payfleet_payment_events_processing_lag_seconds Receipt to processing of the last 1,000 processed events, by percentile (50, 99, 100).\n# TYPE payfleet_payment_events_processing_lag_seconds gauge\n");
    for (q, v) in [("50", p50), ("99", p99), ("100", max)] {
        let _ = writeln!(
            out,
            "payfleet_payment_events_processing_lag_seconds{{percentile=\"{q}\"}} {v:.3}"
        );
    }
    let backlog = events::backlog(pool).await?;
    out.push_str("# HELP payfleet_payment_events_unprocessed Stored events not processed, by state (pending: no outcome yet; waiting: for their payment; rejected: need a fix and a replay).\n");
    out.push_str("# TYPE payfleet_payment_events_unprocessed gauge\n");
    out.push_str("# HELP payfleet_payment_events_oldest_unprocessed_seconds Age of the oldest unprocessed event, by state.\n");
    out.push_str("# TYPE payfleet_payment_events_oldest_unprocessed_seconds gauge\n");
    for state in ["pending", "waiting", "rejected"] {
        let b = backlog.iter().find(|b| b.state == state);
        let _ = writeln!(
            out,
            "payfleet_payment_events_unprocessed{{state=\"{state}\"}} {}",
            b.map_or(0, |b| b.count)
        );
        let _ = writeln!(
            out,
            "payfleet_payment_events_oldest_unprocessed_seconds{{state=\"{state}\"}} {:.3}",
            b.map_or(0.0, |b| b.oldest_age_secs)
        );
    }
    out.push_str("# HELP payfleet_reconciliation_findings What reconciliation found in the last day, by gateway and outcome (succeeded or failed: a payment no webhook reported; dispute_decided: a dispute's decision no webhook reported; unreachable, refused: the gateway did not answer).\n");
    out.push_str("# TYPE payfleet_reconciliation_findings gauge\n");
    for (gateway, outcome, n) in crate::payments::reconcile::recent_counts(pool).await? {
        let _ = writeln!(
            out,
            "payfleet_reconciliation_findings{{gateway=\"{gateway}\",outcome=\"{outcome}\"}} {n}"
        );
    }
    out.push_str("# HELP payfleet_consistency_violations Open consistency findings, by check (GET /admin/consistency lists them).
");
    out.push_str(
        "# TYPE payfleet_consistency_violations gauge
",
    );
    for (check, n) in crate::consistency::counts(pool).await? {
        let _ = writeln!(
            out,
            "payfleet_consistency_violations{{check=\"{check}\"}} {n}"
        );
    }
    let (due, refused, oldest_due) = crate::ledger::poster::due(pool).await?;
    out.push_str("# HELP payfleet_ledger_sales_due Confirmed sales not yet posted to the ledger, by state (due: the poster's next batch; refused: kept for an operator, payfleet money repost after a fix).\n# TYPE payfleet_ledger_sales_due gauge\n");
    let _ = writeln!(out, "payfleet_ledger_sales_due{{state=\"due\"}} {due}");
    let _ = writeln!(
        out,
        "payfleet_ledger_sales_due{{state=\"refused\"}} {refused}"
    );
    out.push_str("# HELP payfleet_ledger_oldest_sale_due_seconds Age of the oldest confirmed sale not yet posted (the poster keeps it at milliseconds).\n# TYPE payfleet_ledger_oldest_sale_due_seconds gauge\n");
    let _ = writeln!(
        out,
        "payfleet_ledger_oldest_sale_due_seconds {oldest_due:.3}"
    );
    let backlog = crate::orders::outbox::backlog(pool).await?;
    out.push_str("# HELP payfleet_outbox_unpublished Order messages written and not yet confirmed by the broker.\n# TYPE payfleet_outbox_unpublished gauge\n");
    let _ = writeln!(out, "payfleet_outbox_unpublished {}", backlog.unpublished);
    out.push_str("# HELP payfleet_outbox_oldest_unpublished_seconds Age of the oldest unpublished order message.\n# TYPE payfleet_outbox_oldest_unpublished_seconds gauge\n");
    let _ = writeln!(
        out,
        "payfleet_outbox_oldest_unpublished_seconds {:.3}",
        backlog.oldest_secs
    );
    out.push_str("# HELP payfleet_recurring_runs_troubled Periods of the last week of each recurring job that failed (with no later period completed), retry after an error, or are unfinished an hour after they were scheduled (GET /admin/recurring/{name}/runs shows why).\n# TYPE payfleet_recurring_runs_troubled gauge\n");
    for (name, n) in crate::recurring::troubled(pool).await? {
        let _ = writeln!(
            out,
            "payfleet_recurring_runs_troubled{{name=\"{name}\"}} {n}"
        );
    }
    out.push_str("# HELP payfleet_outbox_refused Unpublished order messages the broker refused, each waiting for its next attempt (payfleet messages unpublished).\n# TYPE payfleet_outbox_refused gauge\n");
    let _ = writeln!(out, "payfleet_outbox_refused {}", backlog.refused);
    Ok(())
}
