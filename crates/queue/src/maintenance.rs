//! Maintenance: rescues runs whose lease expired (every worker, `SKIP LOCKED` keeping two of
//! them from doing the same rows), vacuums the jobs table when enough of it is dead (one worker
//! at a time: `SKIP_LOCKED`), and the pruning of finished jobs past their retention that the
//! `prune` recurring job runs once per period for the whole fleet.

use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::watch;

use super::loops::{Shared, stop_requested};
use super::{Ended, RunEnd, end_runs, store};

const RESCUE_BATCH: i64 = 1000;
const PRUNE_BATCH: i64 = 5000;
const VACUUM_GAP: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) async fn maintain(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let fleet = &shared.config.fleet;
    // The first pass one interval after the start, not at it: a worker started on a backlog
    // gives its first moments to its first claims, where this pass costs a backend of its own
    // and a statement planned afresh. A lease expires only one lease after its last renewal,
    // so a dead worker's runs wait for that anyway.
    let mut rescue_every = tokio::time::interval_at(
        tokio::time::Instant::now() + fleet.rescue_interval(),
        fleet.rescue_interval(),
    );
    rescue_every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_vacuum: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            _ = rescue_every.tick() => {
                match rescue_expired(&shared.control).await {
                    Ok(0) => {}
                    Ok(n) => tracing::warn!(jobs = n, "rescued jobs whose worker stopped renewing the lease"),
                    Err(e) => tracing::warn!(error = %e, "rescue failed"),
                }
                // Not more often than every VACUUM_GAP: rows an old snapshot still sees stay
                // dead (and counted) whatever a vacuum does.
                if fleet.vacuum_dead_rows > 0
                    && last_vacuum.is_none_or(|at| at.elapsed() >= VACUUM_GAP)
                {
                    match vacuum_if_dead(&shared.control, fleet.vacuum_dead_rows).await {
                        Ok(true) => last_vacuum = Some(std::time::Instant::now()),
                        Ok(false) => {}
                        Err(e) => tracing::warn!(error = %e, "vacuum of the jobs table failed"),
                    }
                }
            }
            _ = stop_requested(&mut stopped) => return,
        }
    }
}

/// Ends, as a failed attempt, every run whose lease has expired: the job is retried, or
/// discarded once it has used its attempts, so a job that keeps killing workers cannot loop.
pub async fn rescue_expired(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let mut rescued = 0;
    loop {
        let mut tx = pool.begin().await?;
        let expired = store::lock_expired(&mut *tx, RESCUE_BATCH).await?;
        if expired.is_empty() {
            return Ok(rescued);
        }
        let batch: Vec<Ended> = expired
            .iter()
            .map(|(id, token, worker, expired_at)| Ended {
                id: *id,
                lease_token: *token,
                end: RunEnd::Retry {
                    error: format!("lease expired at {expired_at}: worker {worker} stopped renewing it (it died or stalled)"),
                    after: None,
                },
            })
            .collect();
        end_runs(&mut *tx, &batch).await?;
        tx.commit().await?;
        rescued += batch.len() as u64;
        if (batch.len() as i64) < RESCUE_BATCH {
            return Ok(rescued);
        }
    }
}

/// Vacuums the jobs table when at least `threshold` of its rows are dead (by the statistics
/// collector's count), unless another worker is vacuuming it already. Returns whether it did.
pub async fn vacuum_if_dead(pool: &PgPool, threshold: u64) -> Result<bool, sqlx::Error> {
    let dead: Option<i64> = sqlx::query_scalar(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'jobs'::regclass",
    )
    .fetch_optional(pool)
    .await?;
    if dead.unwrap_or(0) < i64::try_from(threshold).unwrap_or(i64::MAX) {
        return Ok(false);
    }
    let started = std::time::Instant::now();
    sqlx::query("VACUUM (SKIP_LOCKED) jobs")
        .execute(pool)
        .await?;
    tracing::info!(dead_rows = dead, took = ?started.elapsed(), "vacuumed the jobs table");
    Ok(true)
}

/// Deletes finished jobs older than their retention, in bounded batches.
pub async fn prune(
    pool: &PgPool,
    completed_retention_secs: u64,
    discarded_retention_secs: u64,
) -> Result<u64, sqlx::Error> {
    let mut pruned = 0;
    loop {
        let n = store::prune_batch(
            pool,
            completed_retention_secs,
            discarded_retention_secs,
            PRUNE_BATCH,
        )
        .await?;
        pruned += n;
        if (n as i64) < PRUNE_BATCH {
            return Ok(pruned);
        }
    }
}
