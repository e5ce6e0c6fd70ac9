//! The completer: writes run ends in batches, whatever has queued up while the previous batch
//! was written.
//! - An outage is waited out, never dropped.
//! - An end the database refuses (bad data in an error text, say) is written alone, so it cannot
//!   block the others; if it still fails, its lease is let go and the rescue records the run as
//!   a failed attempt.
//! - A batch is first written without locking its rows beforehand (the cheaper statement),
//!   waiting at most 50 ms for a row another transaction holds. A batch that met such a row,
//!   and any batch carrying a run skipped before, is written skipping the rows others hold
//!   (one long transaction must not stall every completion); a skipped run is written again
//!   shortly.
//! - An end refused by its fencing token (the run had lost its lease) is reported, never
//!   dropped silently.
//! - A panic while writing a batch is caught: those runs' leases are let go (the rescue ends
//!   them) and the completer goes on.

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::loops::{Shared, backoff};
use super::store::LockedRows;
use super::{BookkeepingCommit, Ended, JobId, end_runs_as, store};

/// How soon ends skipped for a locked row are tried again.
const LOCKED_RETRY: Duration = Duration::from_millis(100);

pub(crate) async fn complete(shared: Arc<Shared>, mut ended: mpsc::Receiver<Ended>) {
    let max = shared.config.fleet.complete_batch as usize;
    let mut batch: Vec<Ended> = Vec::with_capacity(max);
    let mut open = true;
    // Once the fleet stops, ends skipped for a locked row are tried until the shutdown timeout.
    let mut give_up_at: Option<Instant> = None;
    loop {
        // Runs skipped before for a locked row: their rows may still be held.
        let carried_over = !batch.is_empty();
        let room = max.saturating_sub(batch.len());
        if open && room > 0 {
            if batch.is_empty() {
                open = ended.recv_many(&mut batch, room).await > 0;
            } else if let Ok(n) =
                tokio::time::timeout(LOCKED_RETRY, ended.recv_many(&mut batch, room)).await
            {
                open = n > 0;
            }
        }
        if batch.is_empty() {
            if open {
                continue;
            }
            return;
        }
        if !open {
            let deadline = *give_up_at
                .get_or_insert_with(|| Instant::now() + shared.config.fleet.shutdown_timeout());
            if Instant::now() >= deadline {
                tracing::error!(
                    runs = batch.len(),
                    "stopping with run ends still blocked by locked rows; the rescue will end those runs"
                );
                return;
            }
            tokio::time::sleep(LOCKED_RETRY).await;
        }
        batch.sort_by_key(|e| e.id); // a stable lock order
        let locked = if carried_over {
            LockedRows::Skip
        } else {
            LockedRows::WaitBriefly
        };
        let skipped = match AssertUnwindSafe(write_batch(&shared, &batch, locked))
            .catch_unwind()
            .await
        {
            Ok(skipped) => skipped,
            Err(_) => {
                tracing::error!(
                    runs = batch.len(),
                    "the completer panicked writing a batch; the rescue will end those runs"
                );
                HashSet::new()
            }
        };
        shared.leases.release(
            batch
                .iter()
                .filter(|e| !skipped.contains(&e.id))
                .map(|e| (e.id, e.lease_token)),
        );
        batch.retain(|e| skipped.contains(&e.id));
    }
}

/// Writes a batch; returns the runs skipped because another transaction held their row.
async fn write_batch(shared: &Shared, batch: &[Ended], locked: LockedRows) -> HashSet<JobId> {
    let commit = shared.config.fleet.bookkeeping_synchronous_commit;
    match write_ends(&shared.control, batch, commit, locked).await {
        Ok(applied) => sort_out_missing(&shared.control, batch, &applied).await,
        Err(e) => {
            tracing::warn!(error = %e, jobs = batch.len(), "a run end was refused; writing them one by one");
            let mut skipped = HashSet::new();
            for end in batch {
                let one = std::slice::from_ref(end);
                match write_ends(&shared.control, one, commit, LockedRows::Skip).await {
                    Ok(applied) => {
                        skipped.extend(sort_out_missing(&shared.control, one, &applied).await)
                    }
                    Err(e) => {
                        tracing::error!(job = %end.id, error = %e, "run end refused; the rescue will end this run")
                    }
                }
            }
            skipped
        }
    }
}

/// An end missing from the database's answer was either skipped (its row was locked by another
/// transaction: it still holds its lease) or refused by its fencing token (the run had lost its
/// lease: another worker may have run the job, so this outcome does not count).
async fn sort_out_missing(
    pool: &PgPool,
    batch: &[Ended],
    applied: &HashSet<JobId>,
) -> HashSet<JobId> {
    let (ids, tokens): (Vec<i64>, Vec<i64>) = batch
        .iter()
        .filter(|e| !applied.contains(&e.id))
        .map(|e| (e.id.0, e.lease_token))
        .unzip();
    if ids.is_empty() {
        return HashSet::new();
    }
    let held: HashSet<JobId> = match store::still_held(pool, &ids, &tokens).await {
        Ok(h) => h.into_iter().collect(),
        // Cannot tell: try them again; a refused one is refused again.
        Err(_) => return ids.into_iter().map(JobId).collect(),
    };
    for e in batch
        .iter()
        .filter(|e| !applied.contains(&e.id) && !held.contains(&e.id))
    {
        tracing::warn!(job = %e.id, lease_token = e.lease_token, "run end refused: the run had lost its lease (the job was rescued or claimed by another worker); its outcome is not recorded");
    }
    held
}

/// Writes ends, waiting out outages; returns the jobs whose end was applied, or a refusal.
async fn write_ends(
    pool: &PgPool,
    batch: &[Ended],
    commit: BookkeepingCommit,
    mut locked: LockedRows,
) -> Result<HashSet<JobId>, sqlx::Error> {
    let mut failures = 0;
    loop {
        match end_runs_as(pool, batch, commit, locked).await {
            Ok(rows) => {
                for (id, state) in &rows {
                    tracing::debug!(job = %id, %state, "run ended");
                }
                return Ok(rows.into_iter().map(|(id, _)| id).collect());
            }
            Err(e) if locked == LockedRows::WaitBriefly && is_lock_timeout(&e) => {
                // Another transaction holds a row of the batch: nothing was written; write it
                // again skipping the rows others hold.
                tracing::debug!(
                    jobs = batch.len(),
                    "a run's row is locked by another transaction; writing the batch skipping it"
                );
                locked = LockedRows::Skip;
            }
            Err(e) if crate::pg::is_transient(&e) => {
                failures += 1;
                let wait = backoff(failures);
                tracing::warn!(error = %e, jobs = batch.len(), retry_in = ?wait, "could not record job outcomes");
                tokio::time::sleep(wait).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// PostgreSQL's lock_not_available: a lock timeout ran out.
fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}
