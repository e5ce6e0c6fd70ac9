//! The completer: writes run ends in batches, whatever has queued up while the previous batch
//! was written. An outage is waited out, never dropped. An end the database refuses (bad data
//! in an error text, say) is written alone, so it cannot block the others; if it still fails,
//! its lease is let go and the rescue records the run as a failed attempt. An end refused by its
//! fencing token (the run had lost its lease) is reported, never dropped silently.

use std::collections::HashSet;
use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::mpsc;

use super::fleet::{Shared, backoff};
use super::{Ended, JobId, end_runs};

pub(crate) async fn complete(shared: Arc<Shared>, mut ended: mpsc::Receiver<Ended>) {
    let max = shared.config.fleet.complete_batch as usize;
    let mut batch: Vec<Ended> = Vec::with_capacity(max);
    while ended.recv_many(&mut batch, max).await > 0 {
        batch.sort_by_key(|e| e.id); // a stable lock order
        match write_ends(&shared.control, &batch).await {
            Ok(applied) => report_refused(&batch, &applied),
            Err(e) => {
                tracing::warn!(error = %e, jobs = batch.len(), "a run end was refused; writing them one by one");
                for end in &batch {
                    match write_ends(&shared.control, std::slice::from_ref(end)).await {
                        Ok(applied) => report_refused(std::slice::from_ref(end), &applied),
                        Err(e) => {
                            tracing::error!(job = %end.id, error = %e, "run end refused; the rescue will end this run")
                        }
                    }
                }
            }
        }
        shared
            .leases
            .release(batch.iter().map(|e| (e.id, e.lease_token)));
        batch.clear();
    }
}

/// Ends missing from the database's answer belonged to runs that had lost their lease: another
/// worker may have run (or be running) the job, so this run's outcome does not count.
fn report_refused(batch: &[Ended], applied: &HashSet<JobId>) {
    for e in batch.iter().filter(|e| !applied.contains(&e.id)) {
        tracing::warn!(job = %e.id, lease_token = e.lease_token, "run end refused: the run had lost its lease (the job was rescued or claimed by another worker); its outcome is not recorded");
    }
}

/// Writes ends, waiting out outages; returns the jobs whose end was applied, or a refusal.
async fn write_ends(pool: &PgPool, batch: &[Ended]) -> Result<HashSet<JobId>, sqlx::Error> {
    let mut failures = 0;
    loop {
        match end_runs(pool, batch).await {
            Ok(rows) => {
                for (id, state) in &rows {
                    tracing::debug!(job = %id, %state, "run ended");
                }
                return Ok(rows.into_iter().map(|(id, _)| id).collect());
            }
            Err(e) if crate::db::is_transient(&e) => {
                failures += 1;
                let wait = backoff(failures);
                tracing::warn!(error = %e, jobs = batch.len(), retry_in = ?wait, "could not record job outcomes");
                tokio::time::sleep(wait).await;
            }
            Err(e) => return Err(e),
        }
    }
}
