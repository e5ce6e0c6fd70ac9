//! The fleet's census: which worker processes are running and which queues each works, in
//! `queue_workers`. Each fleet writes its row when it starts, renews it every second and deletes
//! it when it stops; a worker killed without stopping stops being counted ten seconds after its
//! last renewal. A joining or leaving worker notifies the others, so a fleet started at once
//! counts itself whole within a round trip, not a renewal later.
//!
//! What a process shares with the other workers of a queue can be sized by it ([`Census`]):
//! payfleet runs fewer payment-event batches at once in each worker when several post to the same
//! accounts. An operator reads it with [`workers`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::sync::{Notify, watch};

use super::loops::stop_requested;

/// The channel on which a joining or leaving worker tells the others to count again.
pub(crate) const CHANNEL: &str = "payfleet_workers";

/// How often a worker renews its row and counts the others.
const EVERY: Duration = Duration::from_secs(1);

/// A row not renewed for this long is a worker that died without stopping: not counted, and
/// deleted by the next renewal of any worker.
const GONE_AFTER: Duration = Duration::from_secs(10);

/// Worker processes per queue, this one included.
pub type Counts = BTreeMap<String, usize>;

/// How many worker processes work each queue, as this process last counted them; cheap to
/// clone. A [`Fleet`](crate::Fleet) given one ([`Fleet::census`](crate::Fleet::census)) keeps
/// it; anything else in the process may read it or follow its changes.
#[derive(Clone)]
pub struct Census {
    counts: Arc<watch::Sender<Option<Arc<Counts>>>>,
}

impl Default for Census {
    fn default() -> Self {
        Self {
            counts: Arc::new(watch::channel(None).0),
        }
    }
}

impl std::fmt::Debug for Census {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Census")
            .field("counts", &*self.counts.borrow())
            .finish()
    }
}

impl Census {
    /// Worker processes working `queue` (this one included), or `None` until the first count.
    pub fn workers_on(&self, queue: &str) -> Option<usize> {
        self.counts
            .borrow()
            .as_ref()
            .map(|c| c.get(queue).copied().unwrap_or(0))
    }

    /// Follows the counts: the receiver sees each count that differs from the one before.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Counts>>> {
        self.counts.subscribe()
    }

    /// Records a count (the census loop of a fleet does, at each renewal); the followers see it
    /// if it differs from the last one.
    pub fn record(&self, counts: Counts) {
        self.counts.send_if_modified(|current| {
            if current.as_deref() == Some(&counts) {
                return false;
            }
            *current = Some(Arc::new(counts));
            true
        });
    }
}

/// Keeps this worker's row and counts the fleet, every [`EVERY`] and whenever `recount` is
/// notified (another worker joined or left, or the listener reconnected and may have missed
/// that), until stopped; then deletes the row. A failed renewal keeps the last count.
pub(crate) async fn keep(
    pool: PgPool,
    worker: String,
    queues: Vec<String>,
    census: Census,
    recount: Arc<Notify>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        match renew(&pool, &worker, &queues).await {
            Ok(others) => census.record(count(&queues, &others)),
            Err(e) => {
                tracing::debug!(error = %e, "cannot renew this worker's census row; keeping the last count")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = recount.notified() => {}
            _ = stop_requested(&mut stopped) => break,
        }
    }
    // Stopping: the others may take this worker's share now, not ten seconds later.
    if let Err(e) = leave(&pool, &worker).await {
        tracing::debug!(error = %e, "cannot delete this worker's census row; it stops being counted in ten seconds");
    }
}

/// Each queue's workers: this one's queues and the other live workers'.
fn count(mine: &[String], others: &[Vec<String>]) -> Counts {
    let mut counts = Counts::new();
    for q in mine.iter().chain(others.iter().flatten()) {
        *counts.entry(q.clone()).or_default() += 1;
    }
    counts
}

/// The live workers of `workers` per queue, counted as a worker's census counts them.
pub fn live_counts(workers: &[WorkerRow]) -> Counts {
    let live: Vec<Vec<String>> = workers
        .iter()
        .filter(|w| w.live)
        .map(|w| w.queues.clone())
        .collect();
    count(&[], &live)
}

/// Writes or renews this worker's row, deletes rows of workers gone, and returns the queues of
/// every other live worker. A worker whose row was new (it is starting, or its row was deleted
/// while it could not renew it) tells the others, in the same statement.
async fn renew(
    pool: &PgPool,
    worker: &str,
    queues: &[String],
) -> Result<Vec<Vec<String>>, sqlx::Error> {
    // Rows of the others, read in the statement's snapshot (before its own writes): this
    // worker's own row is left out and counted from `queues`. Stale rows are deleted by one
    // worker at a time (SKIP LOCKED), never waited on.
    let (_told, others): (i64, sqlx::types::Json<Vec<Vec<String>>>) = sqlx::query_as(
        "WITH me AS (
             INSERT INTO queue_workers AS w (id, queues) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET seen_at = now(), queues = EXCLUDED.queues
             RETURNING (w.xmax = 0) AS joined),
         gone AS (
             DELETE FROM queue_workers WHERE id IN (
                 SELECT id FROM queue_workers
                  WHERE seen_at < now() - make_interval(secs => $3) AND id <> $1
                    FOR UPDATE SKIP LOCKED)),
         told AS (SELECT pg_notify($4, $1) FROM me WHERE joined)
         SELECT (SELECT count(*) FROM told),
                (SELECT COALESCE(jsonb_agg(o.queues), '[]') FROM queue_workers o
                  WHERE o.id <> $1 AND o.seen_at >= now() - make_interval(secs => $3))",
    )
    .bind(worker)
    .bind(queues)
    .bind(GONE_AFTER.as_secs_f64())
    .bind(CHANNEL)
    .fetch_one(pool)
    .await?;
    Ok(others.0)
}

/// Deletes this worker's row and tells the others.
async fn leave(pool: &PgPool, worker: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH gone AS (DELETE FROM queue_workers WHERE id = $1 RETURNING id)
         SELECT pg_notify($2, id) FROM gone",
    )
    .bind(worker)
    .bind(CHANNEL)
    .execute(pool)
    .await?;
    Ok(())
}

/// A worker process as the census holds it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct WorkerRow {
    /// `<host>-<pid>-<random>`, as stored with its claims and errors.
    pub id: String,
    pub queues: Vec<String>,
    pub started_at: DateTime<Utc>,
    pub seen_at: DateTime<Utc>,
    /// Renewed within the last ten seconds: running. A row not renewed is a worker that died
    /// without stopping (its jobs are rescued when their leases expire), deleted by the next
    /// renewal of a live worker.
    pub live: bool,
}

/// The worker processes of the census, live ones first, then by start.
pub async fn workers(pool: &PgPool) -> Result<Vec<WorkerRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, queues, started_at, seen_at,
                seen_at >= now() - make_interval(secs => $1) AS live
           FROM queue_workers ORDER BY live DESC, started_at, id",
    )
    .bind(GONE_AFTER.as_secs_f64())
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_queue_counts_this_worker_and_every_other_that_works_it() {
        let mine = vec!["events".to_owned(), "orders".to_owned()];
        let others = vec![
            vec!["events".to_owned()],
            vec!["events".to_owned(), "payments".to_owned()],
        ];
        let counts = count(&mine, &others);
        assert_eq!(counts.get("events"), Some(&3));
        assert_eq!(counts.get("orders"), Some(&1));
        assert_eq!(counts.get("payments"), Some(&1));
        assert_eq!(counts.len(), 3);
    }

    #[test]
    fn live_counts_leave_out_the_workers_gone_without_stopping() {
        let row = |id: &str, queues: &[&str], live: bool| WorkerRow {
            id: id.to_owned(),
            queues: queues.iter().map(|q| (*q).to_owned()).collect(),
            started_at: Utc::now(),
            seen_at: Utc::now(),
            live,
        };
        let counts = live_counts(&[
            row("a", &["events", "orders"], true),
            row("b", &["events"], true),
            row("dead", &["events", "payments"], false),
        ]);
        assert_eq!(counts.get("events"), Some(&2));
        assert_eq!(counts.get("orders"), Some(&1));
        assert_eq!(counts.get("payments"), None, "only a dead worker works it");
    }

    #[test]
    fn a_census_not_yet_counted_knows_no_number_and_a_new_count_is_told_only_if_it_differs() {
        let census = Census::default();
        assert_eq!(census.workers_on("events"), None);
        let mut seen = census.subscribe();
        census.record(count(&["events".to_owned()], &[]));
        assert!(seen.has_changed().unwrap());
        seen.borrow_and_update();
        assert_eq!(census.workers_on("events"), Some(1));
        assert_eq!(census.workers_on("orders"), Some(0));
        census.record(count(&["events".to_owned()], &[]));
        assert!(!seen.has_changed().unwrap());
        census.record(count(&["events".to_owned()], &[vec!["events".to_owned()]]));
        assert!(seen.has_changed().unwrap());
        assert_eq!(census.workers_on("events"), Some(2));
    }
}
