//! The worker runtime of one process: a fetcher per queue, a completer, a lease keeper, a
//! listener and the maintenance loop (rescue and prune).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::registry::{JobContext, Registry};
use super::{Ended, JobId, QueueSettings, QueuesConfig, RunEnd, end_runs};

/// The channel every LISTENing worker waits on; the payload is the queue's name.
pub(crate) const CHANNEL: &str = "payfleet_jobs";

/// A claimed job, as the claim statement returns it.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct Claimed {
    pub id: JobId,
    pub kind: String,
    pub payload: serde_json::Value,
    pub attempt: i32,
    pub max_attempts: i32,
    pub lease_token: i64,
}

/// Claims up to `limit` due jobs of `queue` in one statement.
pub(crate) async fn claim(
    pool: &PgPool,
    queue: &str,
    limit: i64,
    lease: Duration,
    worker: &str,
) -> Result<Vec<Claimed>, sqlx::Error> {
    sqlx::query_as(
        "WITH next AS (
             SELECT id FROM jobs
             WHERE queue = $1 AND state IN ('available', 'retryable') AND run_at <= now()
             ORDER BY run_at, id
             LIMIT $2
             FOR UPDATE SKIP LOCKED
         )
         UPDATE jobs j SET
             state = 'running',
             attempt = j.attempt + 1,
             attempted_at = now(),
             lease_token = nextval('jobs_lease_token_seq'),
             lease_expires_at = now() + $3 * interval '1 millisecond',
             locked_by = $4
         FROM next WHERE j.id = next.id
         RETURNING j.id, j.kind, j.payload, j.attempt, j.max_attempts, j.lease_token",
    )
    .bind(queue)
    .bind(limit)
    .bind(millis(lease))
    .bind(worker)
    .fetch_all(pool)
    .await
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Runs one claimed job to its end: decode, run under the queue's timeout, catch panics.
pub(crate) async fn run_one(
    pool: &PgPool,
    registry: &Registry,
    queue: &str,
    timeout: Duration,
    job: Claimed,
) -> RunEnd {
    let Some(handler) = registry.get(&job.kind) else {
        // Maybe a newer release of the fleet knows this kind: retry rather than discard.
        return RunEnd::Retry {
            error: format!("no handler for job kind {:?} in this worker", job.kind),
            after: None,
        };
    };
    let ctx = JobContext {
        id: job.id,
        kind: job.kind.clone(),
        queue: queue.to_owned(),
        attempt: job.attempt,
        max_attempts: job.max_attempts,
        pool: pool.clone(),
    };
    // Decoding and the handler's synchronous part run in the job's own task too, so a panic
    // anywhere in the handler is caught and a timeout can stop it.
    let kind = job.kind;
    let payload = job.payload;
    let mut task = AbortOnDrop(tokio::spawn(async move {
        match handler(ctx, payload) {
            Ok(future) => Ok(future.await),
            Err(e) => Err(e),
        }
    }));
    match tokio::time::timeout(timeout, &mut task.0).await {
        Err(_) => RunEnd::Retry {
            error: format!("timed out after {timeout:?}"),
            after: None,
        },
        Ok(Err(e)) if e.is_panic() => RunEnd::Retry {
            error: format!("handler panicked: {}", panic_text(e)),
            after: None,
        },
        Ok(Err(e)) => RunEnd::Retry {
            error: format!("handler task ended: {e}"),
            after: None,
        },
        Ok(Ok(Err(e))) => RunEnd::Fail {
            error: format!("payload does not decode as a {kind} job: {e}"),
        },
        Ok(Ok(Ok(result))) => RunEnd::from(result),
    }
}

fn panic_text(e: tokio::task::JoinError) -> String {
    let payload = e.into_panic();
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs in one process all the queues of a catalogue.
pub struct Fleet {
    pool: PgPool,
    registry: Registry,
    config: QueuesConfig,
    worker_id: String,
}

/// A started fleet. [`FleetHandle::shutdown`] stops it gracefully.
pub struct FleetHandle {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl FleetHandle {
    /// Stops claiming, waits for running jobs up to the shutdown timeout, releases the rest,
    /// writes every outcome and returns.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "fleet task ended abnormally");
        }
    }
}

struct Shared {
    /// Claims and the jobs themselves.
    pool: PgPool,
    /// The fleet's own bookkeeping (listener, completions, lease renewals, rescue, pruning), on
    /// connections of its own: busy handlers must never starve the renewals, or leases would
    /// expire under running jobs and another worker would run them a second time.
    control: PgPool,
    registry: Registry,
    config: QueuesConfig,
    worker_id: String,
    /// Runs of this process that hold a lease: id -> lease token. Renewed by the lease keeper,
    /// removed once their end is written.
    leases: Mutex<HashMap<JobId, i64>>,
}

impl Shared {
    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, i64>> {
        // The map stays consistent even if a holder panicked: every operation is one call.
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Fleet {
    pub fn new(pool: PgPool, registry: Registry, config: QueuesConfig) -> Self {
        Self {
            pool,
            registry,
            config,
            worker_id: worker_id(),
        }
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Starts every loop on the current runtime.
    pub fn start(self) -> FleetHandle {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(self.run(stopped));
        FleetHandle { stop, task }
    }

    async fn run(self, stopped: watch::Receiver<bool>) {
        let Fleet {
            pool,
            registry,
            config,
            worker_id,
        } = self;
        let control = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with((*pool.connect_options()).clone());
        let shared = Arc::new(Shared {
            pool,
            control,
            registry,
            config,
            worker_id,
            leases: Mutex::new(HashMap::new()),
        });
        tracing::info!(worker = %shared.worker_id, queues = ?shared.config.queues.keys().collect::<Vec<_>>(), "worker started");

        let wakers: HashMap<String, Arc<Notify>> = shared
            .config
            .queues
            .keys()
            .map(|q| (q.clone(), Arc::new(Notify::new())))
            .collect();
        let (ended_tx, ended_rx) = mpsc::channel::<Ended>(10_000);

        let completer = tokio::spawn(complete(shared.clone(), ended_rx));
        let mut background = JoinSet::new();
        background.spawn(listen(shared.clone(), wakers.clone(), stopped.clone()));
        background.spawn(keep_leases(shared.clone()));
        background.spawn(maintain(shared.clone(), stopped.clone()));

        let mut fetchers = JoinSet::new();
        for (name, settings) in &shared.config.queues {
            let waker = wakers.get(name).cloned().unwrap_or_default();
            fetchers.spawn(fetch(
                shared.clone(),
                name.clone(),
                settings.clone(),
                waker,
                ended_tx.clone(),
                stopped.clone(),
            ));
        }
        drop(ended_tx);
        while fetchers.join_next().await.is_some() {}
        // Every sender is gone once the fetchers and their jobs are: the completer drains and ends.
        if let Err(e) = completer.await {
            tracing::error!(error = %e, "completer ended abnormally");
        }
        background.abort_all();
        while background.join_next().await.is_some() {}
        tracing::info!(worker = %shared.worker_id, "worker stopped");
    }
}

fn worker_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}

/// Resolves once the fleet is told to stop (or its handle is gone).
async fn stop_requested(stopped: &mut watch::Receiver<bool>) {
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
async fn pause(stopped: &mut watch::Receiver<bool>, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = stop_requested(stopped) => false,
    }
}

/// The loop of one queue: claim what the free slots can take, run each job in its own task,
/// sleep until a notification, the next run time or the poll interval.
async fn fetch(
    shared: Arc<Shared>,
    queue: String,
    settings: QueueSettings,
    waker: Arc<Notify>,
    ended: mpsc::Sender<Ended>,
    mut stopped: watch::Receiver<bool>,
) {
    let fleet = &shared.config.fleet;
    let slots = Arc::new(Semaphore::new(settings.concurrency as usize));
    let mut running: JoinSet<()> = JoinSet::new();
    let mut runs: HashMap<tokio::task::Id, (JobId, i64)> = HashMap::new();
    let mut failures = 0u32;

    'work: loop {
        if *stopped.borrow() {
            break;
        }
        // Wait for a free slot; this fetcher is the only one taking permits.
        tokio::select! {
            permit = slots.clone().acquire_owned() => drop(permit),
            _ = stop_requested(&mut stopped) => break 'work,
        }
        while let Some(done) = running.try_join_next_with_id() {
            match done {
                Ok((id, ())) => {
                    runs.remove(&id);
                }
                Err(e) => end_lost_run(&ended, runs.remove(&e.id()), &e).await,
            }
        }
        let want = slots.available_permits().min(fleet.claim_batch as usize);
        let claimed = match claim(
            &shared.pool,
            &queue,
            want as i64,
            fleet.lease(),
            &shared.worker_id,
        )
        .await
        {
            Ok(c) => {
                failures = 0;
                c
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
        {
            let mut leases = shared.leases();
            for job in &claimed {
                leases.insert(job.id, job.lease_token);
            }
        }
        for job in claimed {
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                // Cannot happen (we counted the permits); never drop a claimed job on the floor.
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
            let pool = shared.pool.clone();
            let registry = shared.registry.clone();
            let ended = ended.clone();
            let queue_name = queue.clone();
            let timeout = settings.timeout();
            let handle = running.spawn(async move {
                let end = run_one(&pool, &registry, &queue_name, timeout, job).await;
                if let RunEnd::Retry { error, .. } | RunEnd::Fail { error } = &end {
                    tracing::warn!(queue = %queue_name, job = %id, %error, "job run failed");
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
        if got == want {
            continue; // there may be more due right now
        }
        let nap = match next_due_in(&shared.pool, &queue).await {
            Ok(Some(due)) => due.min(fleet.poll_interval()),
            Ok(None) => fleet.poll_interval(),
            Err(e) => {
                tracing::warn!(%queue, error = %e, "could not read the next run time");
                fleet.poll_interval()
            }
        };
        if nap.is_zero() {
            continue;
        }
        tokio::select! {
            _ = waker.notified() => {},
            _ = tokio::time::sleep(nap) => {},
            _ = stop_requested(&mut stopped) => break 'work,
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

/// How long until the earliest waiting job of `queue` is due (zero if one is due now).
async fn next_due_in(pool: &PgPool, queue: &str) -> Result<Option<Duration>, sqlx::Error> {
    let ms: Option<f64> = sqlx::query_scalar(
        "SELECT (extract(epoch FROM min(run_at) - now()) * 1000)::float8
         FROM jobs WHERE queue = $1 AND state IN ('available', 'retryable')",
    )
    .bind(queue)
    .fetch_one(pool)
    .await?;
    Ok(ms.map(|ms| Duration::from_millis(ms.max(0.0).ceil() as u64)))
}

fn backoff(failures: u32) -> Duration {
    Duration::from_millis((100u64 << failures.min(6)).min(5_000))
}

/// Writes run ends in batches: whatever has queued up while the previous batch was written.
/// An outage is waited out, never dropped. An end the database refuses (bad data in an error
/// text, say) is written alone, so it cannot block the others; if it still fails, its lease is
/// let go and the rescue records the run as a failed attempt.
async fn complete(shared: Arc<Shared>, mut ended: mpsc::Receiver<Ended>) {
    let max = shared.config.fleet.complete_batch as usize;
    let mut batch: Vec<Ended> = Vec::with_capacity(max);
    while ended.recv_many(&mut batch, max).await > 0 {
        batch.sort_by_key(|e| e.id); // a stable lock order
        if let Err(e) = write_ends(&shared.control, &batch).await {
            tracing::warn!(error = %e, jobs = batch.len(), "a run end was refused; writing them one by one");
            for end in &batch {
                if let Err(e) = write_ends(&shared.control, std::slice::from_ref(end)).await {
                    tracing::error!(job = %end.id, error = %e, "run end refused; the rescue will end this run");
                }
            }
        }
        {
            let mut leases = shared.leases();
            for e in &batch {
                if leases.get(&e.id) == Some(&e.lease_token) {
                    leases.remove(&e.id);
                }
            }
        }
        batch.clear();
    }
}

/// Writes ends, waiting out outages; returns only a refusal.
async fn write_ends(pool: &PgPool, batch: &[Ended]) -> Result<(), sqlx::Error> {
    let mut failures = 0;
    loop {
        match end_runs(pool, batch).await {
            Ok(rows) => {
                for (id, state) in &rows {
                    tracing::debug!(job = %id, %state, "run ended");
                }
                return Ok(());
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

/// Renews the lease of every job this process runs, every third of the lease.
/// Runs until the fleet aborts it, after the last end is written.
async fn keep_leases(shared: Arc<Shared>) {
    let lease = shared.config.fleet.lease();
    loop {
        tokio::time::sleep(lease / 3).await;
        let (ids, tokens): (Vec<i64>, Vec<i64>) =
            shared.leases().iter().map(|(id, t)| (id.0, *t)).unzip();
        if ids.is_empty() {
            continue;
        }
        // Rows are locked in id order, as the completer's are, so the two cannot deadlock.
        let renewed = sqlx::query(
            "WITH held AS (
                 SELECT j.id FROM jobs j
                 JOIN unnest($1::bigint[], $2::bigint[]) AS l(id, token) ON j.id = l.id AND j.lease_token = l.token
                 WHERE j.state = 'running'
                 ORDER BY j.id
                 FOR UPDATE OF j)
             UPDATE jobs j SET lease_expires_at = now() + $3 * interval '1 millisecond'
             FROM held WHERE j.id = held.id",
        )
        .bind(&ids)
        .bind(&tokens)
        .bind(millis(lease))
        .execute(&shared.control)
        .await;
        match renewed {
            Ok(done) if done.rows_affected() < ids.len() as u64 => {
                tracing::debug!(
                    held = ids.len(),
                    renewed = done.rows_affected(),
                    "some leases were already ended or lost"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not renew leases"),
        }
    }
}

/// Wakes the fetcher of a queue when a job of it becomes claimable. Reconnects by itself; after
/// a reconnection every queue is woken, since notifications sent meanwhile are lost.
async fn listen(
    shared: Arc<Shared>,
    wakers: HashMap<String, Arc<Notify>>,
    mut stopped: watch::Receiver<bool>,
) {
    let wake_all = || wakers.values().for_each(|w| w.notify_one());
    let mut failures = 0;
    loop {
        let mut listener = match PgListener::connect_with(&shared.control).await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "cannot connect the job listener; polling meanwhile");
                if !pause(&mut stopped, backoff(failures)).await {
                    return;
                }
                continue;
            }
        };
        if let Err(e) = listener.listen(CHANNEL).await {
            failures += 1;
            tracing::warn!(error = %e, "cannot LISTEN for jobs; polling meanwhile");
            if !pause(&mut stopped, backoff(failures)).await {
                return;
            }
            continue;
        }
        failures = 0;
        wake_all();
        loop {
            let got = tokio::select! {
                got = listener.try_recv() => got,
                _ = stop_requested(&mut stopped) => return,
            };
            match got {
                Ok(Some(n)) => {
                    if let Some(w) = wakers.get(n.payload()) {
                        w.notify_one();
                    }
                }
                // The connection was lost; the next try_recv reconnects and re-LISTENs.
                Ok(None) => {
                    tracing::info!("job listener reconnecting");
                    wake_all();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "job listener lost its connection");
                    failures += 1;
                    if !pause(&mut stopped, backoff(failures)).await {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

/// Rescues jobs whose lease expired and prunes finished jobs past their retention. Every
/// worker runs it; SKIP LOCKED keeps them from doing the same rows twice.
async fn maintain(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let fleet = &shared.config.fleet;
    let mut rescue_every = tokio::time::interval(fleet.rescue_interval());
    let mut prune_every = tokio::time::interval(fleet.prune_interval());
    rescue_every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    prune_every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = rescue_every.tick() => {
                match rescue_expired(&shared.control).await {
                    Ok(0) => {}
                    Ok(n) => tracing::warn!(jobs = n, "rescued jobs whose worker stopped renewing the lease"),
                    Err(e) => tracing::warn!(error = %e, "rescue failed"),
                }
            }
            _ = prune_every.tick() => {
                match prune(&shared.control, fleet.completed_retention_secs, fleet.discarded_retention_secs).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(jobs = n, "pruned finished jobs"),
                    Err(e) => tracing::warn!(error = %e, "prune failed"),
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
        let expired: Vec<(JobId, i64, String, DateTime<Utc>)> = sqlx::query_as(
            "SELECT id, lease_token, locked_by, lease_expires_at FROM jobs
             WHERE state = 'running' AND lease_expires_at < now()
             ORDER BY lease_expires_at
             LIMIT 1000
             FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await?;
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
        if batch.len() < 1000 {
            return Ok(rescued);
        }
    }
}

/// Deletes finished jobs older than their retention, in bounded batches.
pub async fn prune(
    pool: &PgPool,
    completed_retention_secs: u64,
    discarded_retention_secs: u64,
) -> Result<u64, sqlx::Error> {
    let mut pruned = 0;
    loop {
        let done = sqlx::query(
            "DELETE FROM jobs WHERE id IN (
                 SELECT id FROM jobs
                 WHERE (state IN ('completed', 'cancelled') AND finished_at < now() - $1 * interval '1 second')
                    OR (state = 'discarded' AND finished_at < now() - $2 * interval '1 second')
                 LIMIT 5000
                 FOR UPDATE SKIP LOCKED)",
        )
        .bind(completed_retention_secs as f64)
        .bind(discarded_retention_secs as f64)
        .execute(pool)
        .await?;
        pruned += done.rows_affected();
        if done.rows_affected() < 5000 {
            return Ok(pruned);
        }
    }
}

/// Claims and runs due jobs of `queue` one batch at a time, in this task, until none is due:
/// a deterministic way for tests and tools to step the workers. Returns how many runs ended.
pub async fn work_until_idle(
    pool: &PgPool,
    registry: &Registry,
    queue: &str,
    settings: &QueueSettings,
) -> Result<usize, sqlx::Error> {
    let worker = format!("step-{}", worker_id());
    let lease = Duration::from_millis(settings.timeout_ms.saturating_mul(2).max(1_000));
    let mut total = 0;
    loop {
        let claimed = claim(pool, queue, settings.concurrency as i64, lease, &worker).await?;
        if claimed.is_empty() {
            return Ok(total);
        }
        let mut ended = Vec::with_capacity(claimed.len());
        for job in claimed {
            let (id, token) = (job.id, job.lease_token);
            let end = run_one(pool, registry, queue, settings.timeout(), job).await;
            ended.push(Ended {
                id,
                lease_token: token,
                end,
            });
        }
        total += ended.len();
        end_runs(pool, &ended).await?;
    }
}
