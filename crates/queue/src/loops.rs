//! What the fleet's background loops (executor, completer, lease renewals, listener,
//! maintenance) share, below the fleet that starts them: the state they read, how each one
//! waits for the stop, pauses and backs off after a failure.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;

use super::QueuesConfig;
use super::lease::Leases;
use super::registry::Registry;

/// What the fleet's loops share.
pub(crate) struct Shared {
    /// The jobs themselves.
    pub pool: PgPool,
    /// Claims (one per queue at once: a queue's claimers take turns) and the next due time of
    /// an empty queue, on connections of their own, one per queue: a few that stay warm,
    /// rather than whichever of the jobs' pool comes next (each new backend parses and plans
    /// the claim, and compiles its walk, anew), and never held up by jobs that hold that pool.
    pub claims: PgPool,
    /// The fleet's own bookkeeping (listener, completions, lease renewals, rescue, pruning), on
    /// connections of its own: busy handlers must never starve the renewals, or leases would
    /// expire under running jobs and another worker would run them a second time.
    pub control: PgPool,
    pub registry: Registry,
    pub config: QueuesConfig,
    pub worker_id: String,
    pub leases: Arc<Leases>,
    pub observer: Option<Arc<dyn crate::RunObserver>>,
    /// The queues an operator paused, as last read (`queue_pauses`, twice a second).
    pub paused: watch::Receiver<Pauses>,
}

/// The paused queues as last read; `None` until this worker has read them once, and a worker
/// that has not claims nothing: one started while an operator holds a queue paused (a deploy
/// during an incident) must not run that queue's jobs before it knows.
pub type Pauses = Option<Arc<std::collections::HashSet<String>>>;

/// Whether `pauses` hold `queue` back: it is paused, or the pauses were not read yet.
pub(crate) fn holds_back(pauses: &Pauses, queue: &str) -> bool {
    pauses.as_ref().is_none_or(|p| p.contains(queue))
}

/// Resolves once the fleet is told to stop (or its handle is gone).
pub(crate) async fn stop_requested(stopped: &mut watch::Receiver<bool>) {
    loop {
        if *stopped.borrow_and_update() {
            return;
        }
        if stopped.changed().await.is_err() {
            return;
        }
    }
}

/// Sleeps, unless the fleet is told to stop first. Returns false when stopping.
pub(crate) async fn pause(stopped: &mut watch::Receiver<bool>, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = stop_requested(stopped) => false,
    }
}

pub(crate) fn backoff(failures: u32) -> Duration {
    Duration::from_millis((100u64 << failures.min(6)).min(5_000))
}

/// How often each worker reads the paused queues.
const PAUSES_EVERY: std::time::Duration = std::time::Duration::from_millis(500);
/// How long failed reads may leave a worker's last reading before it warns.
const PAUSES_STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(10);
/// How often failed reads are warned about while they last.
const PAUSES_WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads `queue_pauses` twice a second into `paused`, until stopped. A failed read keeps the last
/// one (a database outage pauses nothing new and resumes nothing). Failures are warned about
/// while they hold a worker back (no reading yet: it claims nothing) or leave its reading stale
/// for [`PAUSES_STALE_AFTER`] (a pause set meanwhile is not seen), once when they begin and then
/// every [`PAUSES_WARN_EVERY`]: a worker that does no work, or ignores an operator's pause, says
/// so in its log and not only at `debug`.
pub(crate) async fn watch_pauses(
    pool: PgPool,
    paused: Arc<watch::Sender<Pauses>>,
    mut stopped: watch::Receiver<bool>,
) {
    // The last good reading, and the last warning of the failures since.
    let mut last_read = tokio::time::Instant::now();
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        match sqlx::query_scalar::<_, String>("SELECT queue FROM queue_pauses")
            .fetch_all(&pool)
            .await
        {
            Ok(queues) => {
                let now: std::collections::HashSet<String> = queues.into_iter().collect();
                paused.send_if_modified(|current| {
                    if current.as_deref() == Some(&now) {
                        return false;
                    }
                    *current = Some(Arc::new(now));
                    true
                });
                if warned.take().is_some() {
                    tracing::info!("the paused queues are read again");
                }
                last_read = tokio::time::Instant::now();
            }
            Err(e) => {
                let never_read = paused.borrow().is_none();
                let stale = last_read.elapsed() >= PAUSES_STALE_AFTER;
                let due = warned.is_none_or(|at| at.elapsed() >= PAUSES_WARN_EVERY);
                if (never_read || stale) && due {
                    warned = Some(tokio::time::Instant::now());
                    if never_read {
                        tracing::warn!(error = %e, "cannot read the paused queues: this worker claims nothing until it has read them");
                    } else {
                        tracing::warn!(error = %e, unread_for = ?last_read.elapsed(), "cannot read the paused queues: a queue paused since is not seen by this worker");
                    }
                } else {
                    tracing::debug!(error = %e, "cannot read the paused queues; keeping the last reading");
                }
            }
        }
        if !pause(&mut stopped, PAUSES_EVERY).await {
            return;
        }
    }
}
