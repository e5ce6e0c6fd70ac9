//! The processing state of stored events, for the processor and for operators: marking an
//! outcome, listing what is not processed (and why), replaying, and the backlog the metrics
//! report. No stored event may stay unprocessed unnoticed.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use super::{EventOutcome, ProcessPaymentEvent, Processed};
use crate::gateways::GatewayName;
use payfleet_queue::{self as queue, JobState, QueueError};

/// Records what processing concluded, in the processing transaction. Applied and ignored are
/// final; waiting and rejected leave the event to be processed again.
pub(crate) async fn mark(
    tx: &mut PgConnection,
    event: i64,
    result: &Processed,
) -> Result<(), sqlx::Error> {
    let (outcome, detail, waiting_for) = match result {
        Processed::Applied => (EventOutcome::Applied, None, None),
        Processed::Ignored(reason) => (EventOutcome::Ignored, Some(reason.clone()), None),
        Processed::Waiting(key) => (
            EventOutcome::Waiting,
            Some(format!("waiting for {key} to be known as paid")),
            Some(key.as_str()),
        ),
        Processed::Rejected(reason) => (EventOutcome::Rejected, Some(reason.clone()), None),
        Processed::AlreadyProcessed => return Ok(()),
    };
    let final_outcome = matches!(outcome, EventOutcome::Applied | EventOutcome::Ignored);
    sqlx::query(
        "UPDATE payment_events SET outcome = $2, outcome_detail = $3, waiting_for = $4,
             processed_at = CASE WHEN $5 THEN now() END
         WHERE id = $1 AND processed_at IS NULL",
    )
    .bind(event)
    .bind(outcome)
    .bind(detail)
    .bind(waiting_for)
    .bind(final_outcome)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Marks an event rejected with its reason, outside the (rolled back) processing transaction.
pub(crate) async fn mark_rejected(
    pool: &PgPool,
    event: i64,
    reason: &str,
) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    mark(&mut conn, event, &Processed::Rejected(reason.to_owned())).await
}

/// Per minute since `since`: events received, events processed (of those received since an hour
/// before `since`), and events rejected (by their receipt).
pub async fn per_minute(
    pool: &PgPool,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<Vec<(chrono::DateTime<chrono::Utc>, i64, i64, i64)>, sqlx::Error> {
    sqlx::query_as(
        "WITH recent AS (
             SELECT received_at, processed_at, outcome FROM payment_events
             WHERE received_at >= $1 - interval '1 hour'),
         received AS (
             SELECT date_trunc('minute', received_at) AS m, count(*) AS n,
                    count(*) FILTER (WHERE outcome = 'rejected') AS rejected
             FROM recent WHERE received_at >= $1 GROUP BY 1),
         processed AS (
             SELECT date_trunc('minute', processed_at) AS m, count(*) AS n
             FROM recent WHERE processed_at >= $1 GROUP BY 1)
         SELECT m, COALESCE(r.n, 0), COALESCE(p.n, 0), COALESCE(r.rejected, 0)
         FROM received r FULL JOIN processed p USING (m) ORDER BY m",
    )
    .bind(since)
    .fetch_all(pool)
    .await
}

/// A stored event that is not processed, with why.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct UnprocessedEvent {
    pub id: i64,
    pub gateway: GatewayName,
    pub event_id: String,
    pub event_type: Option<String>,
    pub received_at: DateTime<Utc>,
    /// `None`: no outcome yet (its job has not run, is retrying after an outage, or died).
    pub outcome: Option<EventOutcome>,
    pub detail: Option<String>,
    /// The state of its latest processing job, if one is left: `None` means nothing will
    /// process it unless it is replayed (or redelivered).
    #[sqlx(skip)]
    pub job: Option<JobState>,
}

impl UnprocessedEvent {
    /// `pending`, `waiting` or `rejected`.
    pub fn state(&self) -> &'static str {
        self.outcome.map(|o| o.as_str()).unwrap_or("pending")
    }
}

/// The oldest unprocessed events first.
pub async fn unprocessed(pool: &PgPool, limit: i64) -> Result<Vec<UnprocessedEvent>, sqlx::Error> {
    let mut events: Vec<UnprocessedEvent> = sqlx::query_as(
        "SELECT id, gateway, event_id, event_type, received_at, outcome, outcome_detail AS detail
         FROM payment_events WHERE processed_at IS NULL
         ORDER BY received_at, id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    for e in &mut events {
        e.job = queue::latest_state_of_key(pool, &ProcessPaymentEvent::key(e.gateway, &e.event_id))
            .await?;
    }
    Ok(events)
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("no payment event {0}")]
    NotFound(i64),
    #[error("payment event {id} is already processed ({outcome}); there is nothing to replay")]
    AlreadyProcessed { id: i64, outcome: EventOutcome },
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// What a replay did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replayed {
    /// A processing job was enqueued.
    Queued,
    /// Its processing job is still waiting or running: nothing to add.
    AlreadyQueued,
}

/// An event row as a replay reads it.
#[derive(sqlx::FromRow)]
struct ReplayRow {
    gateway: GatewayName,
    event_id: String,
    outcome: Option<EventOutcome>,
    processed: bool,
    raw_body: Vec<u8>,
}

/// Enqueues the processing of one unprocessed event (by its row id).
pub async fn replay(pool: &PgPool, id: i64) -> Result<Replayed, ReplayError> {
    let row: Option<ReplayRow> = sqlx::query_as(
        "SELECT gateway, event_id, outcome, processed_at IS NOT NULL AS processed, raw_body
         FROM payment_events WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    let ReplayRow {
        gateway,
        event_id,
        outcome,
        processed,
        raw_body: body,
    } = row.ok_or(ReplayError::NotFound(id))?;
    if processed {
        return Err(ReplayError::AlreadyProcessed {
            id,
            outcome: outcome.unwrap_or(EventOutcome::Applied),
        });
    }
    let job = ProcessPaymentEvent::job_for_body(gateway, &event_id, &body)?;
    Ok(match queue::enqueue(pool, job).await? {
        Some(_) => Replayed::Queued,
        None => Replayed::AlreadyQueued,
    })
}

/// Enqueues the processing of every unprocessed event that has no unfinished job. Returns how
/// many were enqueued.
pub async fn replay_all(pool: &PgPool) -> Result<u64, ReplayError> {
    let mut after = 0i64;
    let mut queued = 0;
    loop {
        // The bodies come along for the jobs' fairness keys: a small batch bounds the memory.
        let batch: Vec<(i64, GatewayName, String, Vec<u8>)> = sqlx::query_as(
            "SELECT id, gateway, event_id, raw_body FROM payment_events
             WHERE processed_at IS NULL AND id > $1 ORDER BY id LIMIT 100",
        )
        .bind(after)
        .fetch_all(pool)
        .await?;
        let Some(last) = batch.last() else {
            return Ok(queued);
        };
        after = last.0;
        let jobs = batch
            .iter()
            .map(|(_, g, e, body)| ProcessPaymentEvent::job_for_body(*g, e, body))
            .collect::<Result<Vec<_>, _>>()?;
        queued += queue::enqueue_many(pool, &jobs).await?;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DismissError {
    #[error("no payment event {0}")]
    NotFound(i64),
    #[error("payment event {id} is already processed ({outcome}); there is nothing to dismiss")]
    AlreadyProcessed { id: i64, outcome: EventOutcome },
    #[error(
        "payment event {0} has a processing job waiting or running: let it end first (`payfleet jobs` shows it)"
    )]
    BeingProcessed(i64),
    #[error("a dismissal needs its reason (1 to 500 characters), recorded with the event")]
    Reason,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// An operator ends an event that will never apply (waiting for a payment no order of ours
/// has, as a Stripe connected account's own sales; rejected for good), with the reason: it is
/// recorded `ignored`, `dismissed by an operator: <reason>`, so it no longer counts as
/// unprocessed (`event_unprocessed`) nor crowds out the ones that still matter. One whose
/// processing job is waiting or running is left to that job.
pub async fn dismiss(pool: &PgPool, id: i64, reason: &str) -> Result<(), DismissError> {
    let reason = reason.trim();
    if reason.is_empty() || reason.chars().count() > 500 {
        return Err(DismissError::Reason);
    }
    let mut tx = pool.begin().await?;
    let row: Option<(GatewayName, String, Option<EventOutcome>, bool)> = sqlx::query_as(
        "SELECT gateway, event_id, outcome, processed_at IS NOT NULL FROM payment_events
         WHERE id = $1 FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let (gateway, event_id, outcome, processed) = row.ok_or(DismissError::NotFound(id))?;
    if processed {
        return Err(DismissError::AlreadyProcessed {
            id,
            outcome: outcome.unwrap_or(EventOutcome::Applied),
        });
    }
    let job =
        queue::latest_state_of_key(&mut *tx, &ProcessPaymentEvent::key(gateway, &event_id)).await?;
    if matches!(
        job,
        Some(JobState::Available | JobState::Running | JobState::Retryable)
    ) {
        return Err(DismissError::BeingProcessed(id));
    }
    sqlx::query(
        "UPDATE payment_events SET processed_at = now(), outcome = 'ignored', waiting_for = NULL,
             outcome_detail = 'dismissed by an operator: ' || $2
         WHERE id = $1",
    )
    .bind(id)
    .bind(reason)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::warn!(event = id, %gateway, event_id, reason, "payment event dismissed by an operator");
    Ok(())
}

/// Unprocessed events by state, with the age of the oldest of each. Reads the partial index of
/// unprocessed events only.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Backlog {
    pub state: String,
    pub count: i64,
    pub oldest_age_secs: f64,
}

pub async fn backlog(pool: &PgPool) -> Result<Vec<Backlog>, sqlx::Error> {
    sqlx::query_as(
        "SELECT COALESCE(outcome, 'pending') AS state, count(*) AS count,
                COALESCE(extract(epoch FROM now() - min(received_at)), 0)::float8 AS oldest_age_secs
         FROM payment_events WHERE processed_at IS NULL
         GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await
}

/// Receipt-to-processing time of the latest events (the last 1,000 received and processed,
/// read through the primary key): the median, the 99th percentile and the slowest, in seconds.
pub async fn processing_lag(pool: &PgPool) -> Result<(f64, f64, f64), sqlx::Error> {
    sqlx::query_as(
        "SELECT COALESCE(percentile_cont(0.5) WITHIN GROUP (ORDER BY lag), 0)::float8,
                COALESCE(percentile_cont(0.99) WITHIN GROUP (ORDER BY lag), 0)::float8,
                COALESCE(max(lag), 0)::float8
         FROM (SELECT extract(epoch FROM processed_at - received_at) AS lag
               FROM (SELECT processed_at, received_at FROM payment_events ORDER BY id DESC LIMIT 1000) latest
               WHERE processed_at IS NOT NULL) l",
    )
    .fetch_one(pool)
    .await
}

/// A payment no checkout asked for.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct UnmatchedPayment {
    pub id: i64,
    pub gateway: GatewayName,
    pub session_id: String,
    pub payment_id: Option<String>,
    pub status: String,
    pub amount: Option<String>,
    pub currency: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Payments no checkout asked for, newest first.
pub async fn unmatched(pool: &PgPool, limit: i64) -> Result<Vec<UnmatchedPayment>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, gateway, session_id, payment_id, status, amount::text AS amount, currency::text AS currency,
                created_at, updated_at
         FROM unmatched_payments ORDER BY updated_at DESC, id DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}
