//! The executor: a queue's claim loops (`claimers` of them, one by default) claim what its free
//! slots can take and run each job in its own task, under the queue's timeout, with panics
//! caught and a way to be cancelled when its lease is lost.

use std::any::Any;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::PgPool;
use tokio::sync::{Mutex, Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use tracing::Instrument;

use super::listener::QueueWaker;
use super::loops::{Shared, backoff, holds_back, pause, stop_requested};
use super::registry::{JobContext, Registry, RunClaim};
use super::store::{self, Claimed};
use super::{Ended, JobId, QueueSettings, RunEnd};

/// Runs one claimed job to its end: decode, run under the timeout, catch panics, stop if told
/// its lease is lost.
pub(crate) async fn run_one(
    pool: &PgPool,
    registry: &Registry,
    queue: &str,
    timeout: Duration,
    job: Claimed,
    lease_lost: Option<oneshot::Receiver<String>>,
) -> RunEnd {
    let Some(handler) = registry.get(&job.kind) else {
        // Maybe a newer release of the fleet knows this kind: retry rather than discard.
        return RunEnd::Retry {
            error: format!("no handler for job kind {:?} in this worker", job.kind),
            after: None,
        };
    };
    let claim = RunClaim::new(job.id, job.lease_token);
    let ctx = JobContext {
        id: job.id,
        kind: job.kind.clone(),
        queue: queue.to_owned(),
        attempt: job.attempt,
        max_attempts: job.max_attempts,
        pool: pool.clone(),
        run: claim.clone(),
    };
    let kind = job.kind;
    let payload = job.payload;
    // Every log line of the run carries the job's ids.
    let span = tracing::info_span!(
        "job",
        id = job.id.0,
        kind = kind.as_str(),
        queue,
        attempt = job.attempt
    );
    // The handler runs in the caller's task (a second task per job cost a spawn and a
    // cross-thread wake-up per run). Decoding and the handler's synchronous part run inside the
    // same guard as its future: a panic anywhere in it is caught, and dropping the future stops
    // it on a timeout or a lost lease.
    let run = AssertUnwindSafe(
        async move {
            match handler(ctx, payload) {
                Ok(future) => Ok(future.await),
                Err(e) => Err(e),
            }
        }
        .instrument(span),
    )
    .catch_unwind();
    let lost = async {
        match lease_lost {
            Some(rx) => match rx.await {
                Ok(reason) => reason,
                // The keeper is gone (the fleet is stopping): never a reason to stop a run.
                Err(_) => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    };
    let finished = tokio::select! {
        r = tokio::time::timeout(timeout, run) => r,
        reason = lost => {
            // The handler's transaction completed the job, and the row's absence looked like a
            // lost lease to a renewal before the run could return: it ended.
            if claim.is_completed() {
                return RunEnd::Completed;
            }
            // Dropping the run's future stops the handler.
            return RunEnd::Retry { error: format!("cancelled: {reason}"), after: None };
        }
    };
    match finished {
        Err(_) => RunEnd::Retry {
            error: format!("timed out after {timeout:?}"),
            after: None,
        },
        Ok(Err(panic)) => RunEnd::Retry {
            error: format!("handler panicked: {}", panic_text(panic)),
            after: None,
        },
        Ok(Ok(Err(e))) => RunEnd::Fail {
            error: format!("payload does not decode as a {kind} job: {e}"),
        },
        Ok(Ok(Ok(Ok(())))) if claim.is_completed() => RunEnd::Completed,
        Ok(Ok(Ok(result))) => RunEnd::from(result),
    }
}

fn panic_text(payload: Box<dyn Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// What the claim loops of one queue share. Its slots: each loop reserves the slots a claim may
/// fill before sending it, so together they never claim more than the queue runs. And its
/// fairness cursor, which they take turns with, so their claims never overlap: a claim that
/// started before another committed would find that one's jobs still waiting in its snapshot
/// and lock their newest versions, only to drop them (and hold up their ends until it commits).
/// Taking turns, one loop's claim runs in PostgreSQL while another starts the jobs of its own.
pub(crate) struct QueueShare {
    pub name: String,
    pub settings: QueueSettings,
    /// A job holds one from its claim until its end is queued for the completer.
    pub slots: Arc<Semaphore>,
    /// Held by the loop whose claim is in flight.
    pub turn: Mutex<store::FairCursor>,
    pub waker: Arc<QueueWaker>,
}

/// A claim loop of one queue: claim what the free slots can take, run each job in its own task,
/// sleep until a notification, the next run time or the poll interval. On stop: let running
/// jobs finish until the shutdown deadline, then release the rest for other workers.
///
/// A queue has `claimers` of these loops, sharing a [`QueueShare`].
pub(crate) async fn fetch(
    shared: Arc<Shared>,
    share: Arc<QueueShare>,
    ended: mpsc::Sender<Ended>,
    mut stopped: watch::Receiver<bool>,
) {
    let QueueShare {
        name: queue,
        settings,
        slots,
        turn,
        waker,
    } = &*share;
    let fleet = &shared.config.fleet;
    let mut running: JoinSet<()> = JoinSet::new();
    let mut runs: HashMap<tokio::task::Id, (JobId, i64)> = HashMap::new();
    let mut failures = 0u32;
    let mut last_claim: Option<Instant> = None;
    // Claims that met only locked rows, each back where the one before was (see below); where
    // the last of them ended; whether claims have gone on round the ring since, finding
    // nothing due.
    let mut locked = 0u32;
    let mut locked_at: Option<String> = None;
    let mut went_round = false;

    'work: loop {
        if *stopped.borrow() {
            break;
        }
        // Wait for a free slot, and keep it for this claim.
        let mut reserved = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break 'work, // the slots are never closed
            },
            _ = stop_requested(&mut stopped) => break 'work,
        };
        while let Some(done) = running.try_join_next_with_id() {
            match done {
                Ok((id, ())) => {
                    runs.remove(&id);
                }
                Err(e) => end_lost_run(&ended, runs.remove(&e.id()), &e).await,
            }
        }
        // An operator paused the queue, or this worker has not read the pauses yet: nothing is
        // claimed until it is resumed (or found not paused).
        if holds_back(&shared.paused.borrow(), queue) {
            drop(reserved);
            let mut paused = shared.paused.clone();
            tokio::select! {
                _ = paused.wait_for(|p| !holds_back(p, queue)) => {}
                _ = stop_requested(&mut stopped) => break 'work,
            }
            continue;
        }
        // Let the runs just started take their first step before counting free slots: a claim
        // sent while they start asks for a handful of jobs and pays a whole statement for them
        // (claims averaged half the queue's concurrency before this). With a cooldown, let the
        // slots free up until it has passed since the last claim.
        let cooldown = last_claim
            .map(|at| settings.fetch_cooldown().saturating_sub(at.elapsed()))
            .unwrap_or_default();
        if cooldown.is_zero() {
            tokio::task::yield_now().await;
        } else if !pause(&mut stopped, cooldown).await {
            break 'work;
        }
        let mut cursor = turn.lock().await;
        // Counted once this loop's turn has come: the sibling's claim just took what it could.
        let more = slots
            .available_permits()
            .min((settings.claim_batch(fleet.claim_batch) as usize).saturating_sub(1));
        if more > 0
            && let Ok(permits) = slots.clone().try_acquire_many_owned(more as u32)
        {
            reserved.merge(permits);
        }
        let want = reserved.num_permits();
        let claim_sent = Instant::now();
        last_claim = Some(claim_sent);
        let result = store::claim_seeing(
            &shared.claims,
            queue,
            want as i64,
            fleet.lease(),
            &shared.worker_id,
            &mut cursor,
            fleet.bookkeeping_synchronous_commit,
        )
        .await;
        let position = cursor.position().map(str::to_owned);
        // Committed (the statement's own transaction): the sibling's turn.
        drop(cursor);
        let met_only_locked;
        let claimed = match result {
            Ok(c) => {
                failures = 0;
                met_only_locked = c.only_locked;
                if c.only_locked {
                    // Back at the same locked rows (the walk ended where the last such claim
                    // did, or claims went round the ring since, finding nothing due) waits
                    // longer; a claim that moved straight on to more locked groups waits the
                    // least, so a run of locked groups costs 10 ms a claim, not a growing wait.
                    let again = locked > 0 && (went_round || position == locked_at);
                    locked = if again { locked + 1 } else { 1 };
                    locked_at = position;
                    went_round = false;
                } else if c.nothing_due_seen {
                    // Going on round the ring (at most `CLAIM_MAX_GROUPS` groups a walk): at
                    // once, as ever, keeping the count.
                    went_round = locked > 0;
                } else {
                    // Work found: the locks, if any, are somebody else's business now.
                    locked = 0;
                    locked_at = None;
                    went_round = false;
                }
                c.jobs
            }
            Err(e) => {
                failures += 1;
                let wait = backoff(failures);
                tracing::warn!(%queue, error = %e, retry_in = ?wait, "claim failed");
                if !pause(&mut stopped, wait).await {
                    break;
                }
                continue;
            }
        };
        let got = claimed.len();
        let full = got == want;
        let cancels = shared.leases.hold(
            claimed.iter().map(|job| (job.id, job.lease_token)),
            claim_sent + fleet.lease(),
        );
        for (job, lease_lost) in claimed.into_iter().zip(cancels) {
            let Some(permit) = reserved.split(1) else {
                // Cannot happen (a claim takes at most `want`); never drop a claimed job on the floor.
                tracing::error!(%queue, job = %job.id, "no free slot for a claimed job; releasing it");
                let _ = ended
                    .send(Ended {
                        id: job.id,
                        lease_token: job.lease_token,
                        end: RunEnd::Release,
                    })
                    .await;
                continue;
            };
            let (id, token) = (job.id, job.lease_token);
            let shared_run = shared.clone();
            let ended = ended.clone();
            let queue_name = queue.clone();
            let timeout = settings.timeout();
            let handle = running.spawn(async move {
                let (kind, due) = (job.kind.clone(), job.run_at);
                let started = Instant::now();
                let waited = (chrono::Utc::now() - due).to_std().unwrap_or_default();
                let end = run_one(
                    &shared_run.pool,
                    &shared_run.registry,
                    &queue_name,
                    timeout,
                    job,
                    Some(lease_lost),
                )
                .await;
                if let Some(observer) = &shared_run.observer {
                    observer.run_ended(&crate::RunReport {
                        queue: &queue_name,
                        kind: &kind,
                        outcome: end.outcome(),
                        took: started.elapsed(),
                        waited,
                    });
                }
                if let RunEnd::Retry { error, .. } | RunEnd::Fail { error } = &end {
                    tracing::warn!(queue = %queue_name, job = %id, %error, "job run failed");
                }
                // Completed in the handler's transaction: nothing to write, only the lease to
                // let go.
                if matches!(end, RunEnd::Completed) {
                    shared_run.leases.release(std::iter::once((id, token)));
                    drop(permit);
                    return;
                }
                // Holding the slot until the end is queued bounds the unwritten ends.
                let _ = ended
                    .send(Ended {
                        id,
                        lease_token: token,
                        end,
                    })
                    .await;
                drop(permit);
            });
            runs.insert(handle.id(), (id, token));
        }
        // The slots this claim did not fill are free again.
        drop(reserved);
        if met_only_locked {
            // Every due job it reached was locked by another transaction (an operator's
            // statement on `jobs`, a business transaction replacing a job by its key, another
            // worker's claim in flight): the question below would answer "due now" and the loop
            // claim again at once, spinning two statements at a time for as long as the lock
            // lasts (9,737 transactions in 3 s with one locked row). It waits instead, 10 ms
            // after the first such claim, doubling to at most 100 ms (so a job due meanwhile
            // waits no longer than that), or until a notification.
            let wait = locked_backoff(locked);
            tokio::select! {
                _ = waker.wait() => {}
                _ = tokio::time::sleep(wait) => {}
                _ = stop_requested(&mut stopped) => break 'work,
            }
            continue;
        }
        if full {
            // There may be more due right now. A full claim also wakes a sibling claimer, if it
            // sleeps, to claim beside this one.
            if settings.claimers > 1 {
                waker.nudge();
            }
            continue;
        }
        // A short or empty claim took what was due, unless its walk left some of a group's jobs
        // for the next turn. Whether anything is due is asked through the claim indexes, not
        // with another claim: a claim that finds nothing still walks the groups and runs its
        // update, about ten times the question (README, "A short claim asks before claiming
        // again"). Paced arrivals made every claim of one job a claim of nothing after it.
        loop {
            let nap = match store::next_due_in(&shared.claims, queue).await {
                Ok(Some(due)) => due.min(fleet.poll_interval()),
                Ok(None) => fleet.poll_interval(),
                Err(e) => {
                    tracing::warn!(%queue, error = %e, "could not read the next run time");
                    fleet.poll_interval()
                }
            };
            if nap.is_zero() {
                break;
            }
            tokio::select! {
                // A job was notified (also while this claim ran): claim it at once.
                _ = waker.wait() => break,
                // A job's run time, or the poll: ask again.
                _ = tokio::time::sleep(nap) => {},
                _ = stop_requested(&mut stopped) => break 'work,
            }
        }
    }

    // Graceful stop: let running jobs finish until the deadline, then release the rest.
    let deadline = Instant::now() + fleet.shutdown_timeout();
    while !running.is_empty() {
        match tokio::time::timeout_at(deadline, running.join_next_with_id()).await {
            Ok(Some(Ok((id, ())))) => {
                runs.remove(&id);
            }
            Ok(Some(Err(e))) => end_lost_run(&ended, runs.remove(&e.id()), &e).await,
            Ok(None) | Err(_) => break,
        }
    }
    if !running.is_empty() {
        running.abort_all();
        while let Some(done) = running.join_next_with_id().await {
            match done {
                Ok((id, ())) => {
                    runs.remove(&id);
                }
                // Aborted before its end was queued: hand the job back for another worker.
                Err(e) => {
                    if let Some((id, token)) = runs.remove(&e.id()) {
                        tracing::warn!(%queue, job = %id, "job still running at the shutdown deadline; releasing it");
                        let _ = ended
                            .send(Ended {
                                id,
                                lease_token: token,
                                end: RunEnd::Release,
                            })
                            .await;
                    }
                }
            }
        }
    }
}

/// A job task that died without queueing its end (it cannot, short of a bug in the runtime:
/// `run_one` catches the handler's panics) would keep its lease renewed forever. End it as a
/// failed attempt instead.
async fn end_lost_run(
    ended: &mpsc::Sender<Ended>,
    run: Option<(JobId, i64)>,
    e: &tokio::task::JoinError,
) {
    if let Some((id, lease_token)) = run {
        tracing::error!(job = %id, error = %e, "job task died without an outcome");
        let end = RunEnd::Retry {
            error: format!("job task died: {e}"),
            after: None,
        };
        let _ = ended
            .send(Ended {
                id,
                lease_token,
                end,
            })
            .await;
    }
}

/// How long a claim loop waits after its `locked`th claim in a row that met only locked rows:
/// 10 ms, doubling, at most 100 ms.
fn locked_backoff(locked: u32) -> Duration {
    Duration::from_millis((10u64 << locked.saturating_sub(1).min(4)).min(100))
}
