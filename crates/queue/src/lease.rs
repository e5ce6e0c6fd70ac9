//! The lease keeper: renews the lease of every run this process holds, and tells a run whose
//! lease is lost to stop, so that no job runs twice at once.
//!
//! A lease can be lost two ways. Another worker took the job (the lease expired and the job was
//! rescued, or claimed again): the database no longer has our token. Or we could not renew for
//! a whole lease (a database failover, a row held locked by a long transaction): another worker
//! may take it at any moment. Either way the run is cancelled with a warning; its end would be
//! refused by its fencing token anyway, and the completer says so.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::JobId;
use super::store;

struct Lease {
    token: i64,
    /// When the lease runs out as far as this process can tell: measured from before the
    /// statement that set it was sent, so it is never later than the database's expiry.
    deadline: Instant,
    /// Tells the run to stop; taken when it is used. A run that has ended has dropped the
    /// other side: its end is on its way to the completer.
    cancel: Option<oneshot::Sender<String>>,
    lost: bool,
}

/// The runs of this process that hold a lease, by job.
#[derive(Default)]
pub(crate) struct Leases(Mutex<HashMap<JobId, Lease>>);

impl Leases {
    fn map(&self) -> MutexGuard<'_, HashMap<JobId, Lease>> {
        // Every operation is one short call; the map stays consistent even after a panic.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the claimed runs of a batch. Each receiver fires with a reason if its run must
    /// stop. A lease is renewed until the run's end is written (an outage may delay that).
    pub(crate) fn hold(
        &self,
        runs: impl Iterator<Item = (JobId, i64)>,
        deadline: Instant,
    ) -> Vec<oneshot::Receiver<String>> {
        let mut map = self.map();
        runs.map(|(id, token)| {
            let (tx, rx) = oneshot::channel();
            let held = map.insert(
                id,
                Lease {
                    token,
                    deadline,
                    cancel: Some(tx),
                    lost: false,
                },
            );
            // The job claimed again while a run of ours still held it under another token (a
            // claim lost in a database crash): that run's lease is gone, and it must stop, not
            // be left with no keeper to tell it.
            if let Some(old) = held.filter(|old| old.token != token)
                && let Some(cancel) = old.cancel
                && cancel
                    .send("the job was claimed again under another lease".to_owned())
                    .is_ok()
            {
                tracing::warn!(job = %id, "the job was claimed again while a run of this process held an older lease; cancelling that run");
            }
            rx
        })
        .collect()
    }

    /// These runs' ends are written (or refused): their leases are no longer ours to keep.
    pub(crate) fn release(&self, runs: impl Iterator<Item = (JobId, i64)>) {
        let mut map = self.map();
        for (id, token) in runs {
            if map.get(&id).is_some_and(|l| l.token == token) {
                map.remove(&id);
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }

    fn to_renew(&self) -> (Vec<i64>, Vec<i64>) {
        self.map()
            .iter()
            .filter(|(_, l)| !l.lost)
            .map(|(id, l)| (id.0, l.token))
            .unzip()
    }

    fn renewed(&self, ids: &[JobId], deadline: Instant) {
        let mut map = self.map();
        for id in ids {
            if let Some(l) = map.get_mut(id) {
                l.deadline = deadline;
            }
        }
    }

    /// Marks a run's lease lost and cancels the run if it is still running.
    fn lose(&self, id: JobId, token: i64, why: &str) {
        let mut map = self.map();
        let Some(l) = map.get_mut(&id).filter(|l| l.token == token && !l.lost) else {
            return;
        };
        l.lost = true;
        let told = l
            .cancel
            .take()
            .is_some_and(|c| c.send(why.to_owned()).is_ok());
        if told {
            tracing::warn!(job = %id, reason = why, "lease lost; cancelling the run so the job cannot run twice at once");
        } else {
            // The run has ended: if its end is refused, the completer says so.
            tracing::debug!(job = %id, reason = why, "lease of an ended run no longer held");
        }
    }

    /// Runs whose lease ran out here before any renewal could extend it.
    fn expired(&self, now: Instant) -> Vec<(JobId, i64)> {
        self.map()
            .iter()
            .filter(|(_, l)| !l.lost && l.deadline <= now)
            .map(|(id, l)| (*id, l.token))
            .collect()
    }
}

/// Renews every third of the lease, each round bounded in time and run beside the deadline
/// checks (a renewal stuck on a dead connection must not keep runs going past their lease);
/// when a round failed or met locked rows, tries again at the next check. Checks the local
/// deadlines every tenth of the lease, so a run is stopped before the database's expiry lets
/// another worker take its job. `pool` is the keeper's own: nothing else can use up its
/// connections. Runs until the fleet aborts it.
pub(crate) async fn keep(pool: PgPool, leases: Arc<Leases>, lease: Duration) {
    let tick = (lease / 10).max(Duration::from_millis(10));
    let mut every = tokio::time::interval(tick);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_renewal = Instant::now() + lease / 3;
    let mut round: Option<tokio::task::JoinHandle<bool>> = None;
    loop {
        every.tick().await;
        let now = Instant::now();
        if round.as_ref().is_some_and(|r| r.is_finished())
            && let Some(r) = round.take()
        {
            // A failed, timed-out or panicked round, or locked rows: try again at the next check.
            if !matches!(r.await, Ok(true)) {
                next_renewal = now;
            }
        }
        if round.is_none() && now >= next_renewal {
            next_renewal = now + lease / 3;
            let (pool, leases) = (pool.clone(), leases.clone());
            round = Some(tokio::spawn(async move {
                match tokio::time::timeout(lease / 4, renew(&pool, &leases, lease)).await {
                    Ok(done) => done,
                    Err(_) => {
                        tracing::warn!(timeout = ?(lease / 4), "lease renewal timed out");
                        false
                    }
                }
            }));
        }
        // A margin of one tick: the check itself runs only once a tick.
        for (id, token) in leases.expired(Instant::now() + tick) {
            leases.lose(
                id,
                token,
                "the lease could not be renewed in time (database unreachable, or the job's row held locked)",
            );
        }
    }
}

/// One renewal round. Returns whether every lease held was renewed (false: a failure, or rows
/// locked by another transaction, to try again soon).
async fn renew(control: &PgPool, leases: &Leases, lease: Duration) -> bool {
    let (ids, tokens) = leases.to_renew();
    if ids.is_empty() {
        return true;
    }
    let sent = Instant::now();
    let renewed = match store::renew_leases(control, &ids, &tokens, lease).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, runs = ids.len(), "could not renew leases");
            return false;
        }
    };
    leases.renewed(&renewed, sent + lease);
    if renewed.len() == ids.len() {
        return true;
    }
    let renewed: HashSet<JobId> = renewed.into_iter().collect();
    let (missing_ids, missing_tokens): (Vec<i64>, Vec<i64>) = ids
        .iter()
        .zip(&tokens)
        .filter(|(id, _)| !renewed.contains(&JobId(**id)))
        .map(|(id, t)| (*id, *t))
        .unzip();
    let held: HashSet<JobId> = match store::still_held(control, &missing_ids, &missing_tokens).await
    {
        Ok(h) => h.into_iter().collect(),
        Err(e) => {
            tracing::warn!(error = %e, "could not check leases that were not renewed");
            return false;
        }
    };
    for (id, token) in missing_ids.iter().zip(&missing_tokens) {
        let id = JobId(*id);
        if held.contains(&id) {
            tracing::debug!(job = %id, "job row locked by another transaction; lease renewal retried soon");
        } else {
            leases.lose(
                id,
                *token,
                "another worker holds the job now (its lease expired and it was rescued or claimed again)",
            );
        }
    }
    held.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim lost in a database crash, and the job claimed again by this process: the run
    /// that held the lost claim is told to stop, and the new run's lease is the one kept.
    #[test]
    fn a_job_claimed_again_under_another_token_cancels_the_run_that_held_it() {
        let leases = Leases::default();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut first = leases.hold([(JobId(7), 1)].into_iter(), deadline);
        let mut second = leases.hold([(JobId(7), 2)].into_iter(), deadline);
        assert!(first.pop().unwrap().try_recv().is_ok());
        assert!(second.pop().unwrap().try_recv().is_err());
        assert_eq!(leases.to_renew(), (vec![7], vec![2]));
    }
}
