//! The operator's view of the queue: counts, dead jobs, retry and discard.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::{JobId, JobState, store};

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StateCount {
    pub queue: String,
    pub state: JobState,
    pub count: i64,
}

/// Every job by queue and state: a full count of the table, for the command line.
pub async fn counts(pool: &PgPool) -> Result<Vec<StateCount>, sqlx::Error> {
    sqlx::query_as(store::ALL_COUNTS).fetch_all(pool).await
}

/// The statements of [`live_counts`] and [`due_by_queue`], for checking their plans.
pub const LIVE_COUNT_QUERIES: [&str; 3] = [
    store::UNFINISHED_COUNTS,
    store::DEAD_COUNTS,
    store::DUE_BY_QUEUE,
];

/// A queue's backlog: jobs due and not yet started, and how long the oldest has waited.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct QueueDue {
    pub queue: String,
    pub due: i64,
    pub oldest_due_secs: f64,
}

/// The backlog of every queue that has one.
pub async fn due_by_queue(pool: &PgPool) -> Result<Vec<QueueDue>, sqlx::Error> {
    sqlx::query_as(store::DUE_BY_QUEUE).fetch_all(pool).await
}

/// Waiting, running and dead jobs by queue and state, read through partial indexes only: what
/// a metrics scrape can afford however many finished jobs the table keeps.
pub async fn live_counts(pool: &PgPool) -> Result<Vec<StateCount>, sqlx::Error> {
    let mut counts = Vec::new();
    for sql in [store::UNFINISHED_COUNTS, store::DEAD_COUNTS] {
        counts.extend(sqlx::query_as::<_, StateCount>(sql).fetch_all(pool).await?);
    }
    Ok(counts)
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadJob {
    pub id: JobId,
    pub queue: String,
    pub kind: String,
    pub key: Option<String>,
    pub attempt: i32,
    pub max_attempts: i32,
    pub finished_at: Option<DateTime<Utc>>,
    /// The last recorded error.
    pub last_error: Option<String>,
}

/// Discarded jobs, newest first.
pub async fn dead(
    pool: &PgPool,
    queue: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadJob>, sqlx::Error> {
    sqlx::query_as(store::DEAD)
        .bind(queue)
        .bind(limit)
        .fetch_all(pool)
        .await
}

/// A job that failed: `retryable` (it runs again at `at`) or `discarded` (dead since `at`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct FailedJob {
    pub id: JobId,
    pub queue: String,
    pub kind: String,
    pub key: Option<String>,
    pub state: JobState,
    pub attempt: i32,
    pub max_attempts: i32,
    pub at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

/// Up to `limit` jobs waiting to retry (soonest first), then up to `limit` dead ones (newest
/// first).
pub async fn failed(pool: &PgPool, limit: i64) -> Result<Vec<FailedJob>, sqlx::Error> {
    sqlx::query_as(store::FAILED)
        .bind(limit)
        .fetch_all(pool)
        .await
}

/// A running job whose lease ran out: its worker stopped without saying so, and no sweep has
/// taken it back yet.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StuckJob {
    pub id: i64,
    pub queue: String,
    pub kind: String,
    pub locked_by: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
}

/// Up to 1,000 running jobs whose lease expired more than `grace` ago, oldest first.
pub async fn stuck(
    pool: &PgPool,
    grace: std::time::Duration,
) -> Result<Vec<StuckJob>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, queue, kind, locked_by, lease_expires_at FROM jobs
         WHERE state = 'running' AND lease_expires_at < now() - make_interval(secs => $1)
         ORDER BY id LIMIT 1000",
    )
    .bind(grace.as_secs_f64())
    .fetch_all(pool)
    .await
}

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("no job {0}")]
    NotFound(JobId),
    #[error("job {id} is {state}; only {allowed} jobs can be {action}")]
    WrongState {
        id: JobId,
        state: JobState,
        allowed: &'static str,
        action: &'static str,
    },
    #[error("job {id} has key {key:?}, which another unfinished job holds now")]
    KeyTaken { id: JobId, key: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Locks job `id`'s row in `tx` and checks that its state is one of `allowed` (named `names`)
/// for `action`; returns its key.
async fn lock_in_state(
    tx: &mut sqlx::PgConnection,
    id: JobId,
    allowed: &[JobState],
    names: &'static str,
    action: &'static str,
) -> Result<Option<String>, AdminError> {
    let row: Option<(JobState, Option<String>)> = sqlx::query_as(store::LOCK_STATE_AND_KEY)
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
    let (state, key) = row.ok_or(AdminError::NotFound(id))?;
    if !allowed.contains(&state) {
        return Err(AdminError::WrongState {
            id,
            state,
            allowed: names,
            action,
        });
    }
    Ok(key)
}

/// Makes a discarded, cancelled or retryable job run again now. A job that used its attempts
/// gets one more.
pub async fn retry(pool: &PgPool, id: JobId) -> Result<(), AdminError> {
    let mut tx = pool.begin().await?;
    let key = lock_in_state(
        &mut tx,
        id,
        &[
            JobState::Discarded,
            JobState::Cancelled,
            JobState::Retryable,
        ],
        "discarded, cancelled or retryable",
        "retried",
    )
    .await?;
    let updated = sqlx::query(store::RETRY).bind(id).execute(&mut *tx).await;
    match updated {
        Ok(_) => {}
        Err(sqlx::Error::Database(e)) if e.constraint() == Some("jobs_key_unfinished") => {
            return Err(AdminError::KeyTaken {
                id,
                key: key.unwrap_or_default(),
            });
        }
        Err(e) => return Err(e.into()),
    }
    tx.commit().await?;
    Ok(())
}

/// One job as an operator opens it: its arguments, each failed attempt's error, who holds it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct JobDetail {
    pub id: JobId,
    pub queue: String,
    pub kind: String,
    pub key: Option<String>,
    pub fairness_key: Option<String>,
    pub state: JobState,
    pub attempt: i32,
    pub max_attempts: i32,
    pub payload: serde_json::Value,
    /// One entry per failed attempt: `{"attempt", "at", "worker", "error"}`.
    pub errors: serde_json::Value,
    pub run_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub attempted_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// The worker holding its lease while it runs.
    pub locked_by: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
}

/// The columns of a [`JobDetail`], from `jobs`.
macro_rules! job_detail {
    () => {
        "SELECT id, queue, kind, key, fairness_key, state, attempt, max_attempts,
                payload, errors, run_at, created_at, attempted_at, finished_at, locked_by,
                lease_expires_at
         FROM jobs"
    };
}

/// Job `id`, if it is still kept (a completed job's row is deleted as it completes).
pub async fn job(pool: &PgPool, id: JobId) -> Result<Option<JobDetail>, sqlx::Error> {
    sqlx::query_as(concat!(job_detail!(), " WHERE id = $1"))
        .bind(id)
        .fetch_optional(pool)
        .await
}

/// The keys among `keys` an unfinished job holds (waiting, running, or to be retried): work
/// under way, which a check of its outcome leaves alone.
pub async fn unfinished_keys(pool: &PgPool, keys: &[String]) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT key FROM jobs WHERE key = ANY($1) AND state IN ('available', 'running', 'retryable')",
    )
    .bind(keys)
    .fetch_all(pool)
    .await
}

/// The payloads of `kind`'s unfinished jobs on `queue`.
pub async fn unfinished_payloads(
    pool: &PgPool,
    queue: &str,
    kind: &str,
) -> Result<Vec<serde_json::Value>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT payload FROM jobs
         WHERE queue = $1 AND kind = $2 AND state IN ('available', 'running', 'retryable')",
    )
    .bind(queue)
    .bind(kind)
    .fetch_all(pool)
    .await
}

/// Jobs by queue, kind, state and key (each optional; the key as a prefix), newest first,
/// `limit` from after id `before` (paging: the last id of the page before).
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    pub queue: Option<String>,
    pub kind: Option<String>,
    pub state: Option<JobState>,
    pub key_prefix: Option<String>,
    pub before: Option<JobId>,
}

pub async fn list(pool: &PgPool, f: &JobFilter, limit: i64) -> Result<Vec<JobDetail>, sqlx::Error> {
    sqlx::query_as(concat!(
        job_detail!(),
        " WHERE ($1::text IS NULL OR queue = $1) AND ($2::text IS NULL OR kind = $2)
           AND ($3::text IS NULL OR state = $3)
           AND ($4::text IS NULL OR starts_with(key, $4))
           AND ($5::bigint IS NULL OR id < $5)
         ORDER BY id DESC LIMIT $6"
    ))
    .bind(f.queue.as_deref())
    .bind(f.kind.as_deref())
    .bind(f.state)
    .bind(f.key_prefix.as_deref())
    .bind(f.before)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Failed attempts per minute since `since` (each kept job's error entries by their time: a job
/// that failed and later completed is deleted, and its failures with it).
pub async fn failures_per_minute(
    pool: &PgPool,
    since: DateTime<Utc>,
) -> Result<Vec<(DateTime<Utc>, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT date_trunc('minute', at) AS minute, count(*)
         FROM (SELECT (e->>'at')::timestamptz AS at
               FROM jobs, jsonb_array_elements(errors) AS e
               WHERE jsonb_array_length(errors) > 0
                 AND e->>'at' ~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9:.]+(Z|[+-][0-9:]+)?$') f
         WHERE at >= $1
         GROUP BY 1 ORDER BY 1",
    )
    .bind(since)
    .fetch_all(pool)
    .await
}

/// Pauses `queue`: no worker claims from it within a second (runs already started end as
/// usual; jobs keep arriving and wait). Pausing a paused queue changes nothing.
pub async fn pause(pool: &PgPool, queue: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO queue_pauses (queue) VALUES ($1) ON CONFLICT (queue) DO NOTHING")
        .bind(queue)
        .execute(pool)
        .await?;
    Ok(())
}

/// Resumes `queue`, and wakes its workers.
pub async fn resume(pool: &PgPool, queue: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH r AS (DELETE FROM queue_pauses WHERE queue = $1 RETURNING queue)
         SELECT pg_notify('payfleet_jobs', queue) FROM r",
    )
    .bind(queue)
    .execute(pool)
    .await?;
    Ok(())
}

/// The paused queues, with when each was paused.
pub async fn paused(pool: &PgPool) -> Result<Vec<(String, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as("SELECT queue, paused_at FROM queue_pauses ORDER BY queue")
        .fetch_all(pool)
        .await
}

/// Makes a waiting job (scheduled for later, or retrying) due now.
pub async fn run_now(pool: &PgPool, id: JobId) -> Result<(), AdminError> {
    let mut tx = pool.begin().await?;
    lock_in_state(
        &mut tx,
        id,
        &[JobState::Available, JobState::Retryable],
        "available or retryable",
        "run now",
    )
    .await?;
    sqlx::query(
        "WITH j AS (UPDATE jobs SET run_at = now() WHERE id = $1 RETURNING queue)
         SELECT pg_notify('payfleet_jobs', queue) FROM j",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Ends a waiting job as discarded, keeping it for inspection. A running job cannot be
/// discarded from outside: cancel its key instead, or wait for its run to end.
pub async fn discard(pool: &PgPool, id: JobId) -> Result<(), AdminError> {
    let mut tx = pool.begin().await?;
    lock_in_state(
        &mut tx,
        id,
        &[JobState::Available, JobState::Retryable],
        "available or retryable",
        "discarded",
    )
    .await?;
    sqlx::query(store::DISCARD)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// How long until the earliest waiting job of `queue` is due (zero if one is due now; `None`
/// when nothing waits): the workers' own question, through the claim indexes.
pub async fn next_due_in(
    pool: &PgPool,
    queue: &str,
) -> Result<Option<std::time::Duration>, sqlx::Error> {
    store::next_due_in(pool, queue).await
}

/// The plan of a claim of `want` jobs of `queue` as it runs (`EXPLAIN (ANALYZE, BUFFERS)`), in
/// a transaction rolled back afterwards: the jobs it claims stay due. For a slow claim, the
/// question is which index it walks and how many rows it meets.
pub async fn explain_claim(
    pool: &PgPool,
    queue: &str,
    want: i32,
) -> Result<Vec<String>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let plan = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, BUFFERS) {}",
        store::CLAIM
            // From the highest: "$1" is also the start of "$10".
            .replace("$12", "'{}'::bigint[]")
            .replace("$11", "'{}'::timestamptz[]")
            .replace("$10", "'{}'::text[]")
            .replace("$9", "NULL::bigint")
            .replace("$8", "NULL::timestamptz")
            .replace("$7", "'off'")
            .replace("$6", "256")
            .replace("$5", "NULL")
            .replace("$4", "'explain'")
            .replace("$3", "30000")
            .replace("$2", &want.to_string())
            .replace("$1", &quote_literal(queue))
    )))
    .fetch_all(&mut *tx)
    .await?;
    tx.rollback().await?;
    Ok(plan)
}

/// `text` as an SQL string literal.
fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}
