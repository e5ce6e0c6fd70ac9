//! The operator's view of the queue: counts, dead jobs, retry and discard.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::JobId;

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StateCount {
    pub queue: String,
    pub state: String,
    pub count: i64,
}

/// Jobs by queue and state.
pub async fn counts(pool: &PgPool) -> Result<Vec<StateCount>, sqlx::Error> {
    sqlx::query_as("SELECT queue, state, count(*) AS count FROM jobs GROUP BY queue, state ORDER BY queue, state")
        .fetch_all(pool)
        .await
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
    sqlx::query_as(
        "SELECT id, queue, kind, key, attempt, max_attempts, finished_at, errors -> -1 ->> 'error' AS last_error
         FROM jobs
         WHERE state = 'discarded' AND ($1::text IS NULL OR queue = $1)
         ORDER BY finished_at DESC, id DESC
         LIMIT $2",
    )
    .bind(queue)
    .bind(limit)
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
        state: String,
        allowed: &'static str,
        action: &'static str,
    },
    #[error("job {id} has key {key:?}, which another unfinished job holds now")]
    KeyTaken { id: JobId, key: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Makes a discarded, cancelled or retryable job run again now. A job that used its attempts
/// gets one more.
pub async fn retry(pool: &PgPool, id: JobId) -> Result<(), AdminError> {
    let mut tx = pool.begin().await?;
    let row: Option<(String, Option<String>)> =
        sqlx::query_as("SELECT state, key FROM jobs WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
    let (state, key) = row.ok_or(AdminError::NotFound(id))?;
    if !matches!(state.as_str(), "discarded" | "cancelled" | "retryable") {
        return Err(AdminError::WrongState {
            id,
            state,
            allowed: "discarded, cancelled or retryable",
            action: "retried",
        });
    }
    let updated = sqlx::query(
        "UPDATE jobs SET state = 'available', run_at = now(), finished_at = NULL,
             max_attempts = greatest(max_attempts, attempt + 1)
         WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *tx)
    .await;
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

/// Ends a waiting job as discarded, keeping it for inspection. A running job cannot be
/// discarded from outside: cancel its key instead, or wait for its run to end.
pub async fn discard(pool: &PgPool, id: JobId) -> Result<(), AdminError> {
    let mut tx = pool.begin().await?;
    let state: Option<String> =
        sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
    let state = state.ok_or(AdminError::NotFound(id))?;
    if !matches!(state.as_str(), "available" | "retryable") {
        return Err(AdminError::WrongState {
            id,
            state,
            allowed: "available or retryable",
            action: "discarded",
        });
    }
    sqlx::query(
        "UPDATE jobs SET state = 'discarded', finished_at = now(),
             errors = errors || jsonb_build_array(jsonb_build_object(
                 'attempt', attempt, 'at', now(), 'error', 'discarded by an operator'))
         WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}
