//! payfleet's queue as an apalis backend (apalis-core 1.0), for teams whose jobs are apalis
//! handlers: an apalis `WorkerBuilder`, with its tower layers (retry, timeout, tracing,
//! concurrency), runs jobs from payfleet's `jobs` table with payfleet's guarantees.
//!
//! - Claiming: one statement (`FOR UPDATE SKIP LOCKED` + `UPDATE ... RETURNING`) takes a due
//!   job of the backend's queue and gives it a lease with a fencing token, as the fleet's own
//!   workers do; any number of apalis and payfleet workers share a queue safely.
//! - While the handler runs, the backend's layer renews the lease (without waiting on locks
//!   others hold); a handler whose lease is lost is dropped (cancelled) with a warning, since
//!   another worker may now run the job.
//! - The end of a run is written through the fencing token: success completes the job; a
//!   handler's error retries it with payfleet's stored backoff (`run_at` in the table, so it
//!   survives a crash), discarding it when its attempts are used; a handler may return a
//!   [`JobError`] to choose (`Fail`, `Snooze`, `Cancel`, `Retry` after a delay).
//! - Pushing ([`apalis_core::backend::TaskSink`]): a task with an idempotency key is scheduled
//!   by key, so pushing the same key again replaces the waiting job (one expiry job per order),
//!   and `run_at` and `max_attempts` are kept. Keys are scoped to the queue (stored as
//!   `apalis:<queue>:<key>`), so they never touch the fleet's own keyed jobs.
//!
//! A queue served by an apalis worker holds that worker's jobs only: a payload that does not
//! read as the worker's arguments is failed at once, kept with its error.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use apalis_core::backend::finalize::Ephemeral;
use apalis_core::backend::{Backend, BackendConfig};
use apalis_core::error::BoxDynError;
use apalis_core::task::Task;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::task::task_id::TaskId;
use apalis_core::worker::context::WorkerContext;
use chrono::{DateTime, Utc};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::PgPool;

use super::store::FairCursor;
use super::{
    BookkeepingCommit, Ended, JobError, JobId, NewJob, QueueError, RunEnd, error_chain, store,
};

/// Where and how an apalis worker takes its jobs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The payfleet queue this worker serves.
    pub queue: String,
    /// The `kind` written on pushed jobs (listings and dashboards show it).
    pub kind: String,
    /// How long a claim holds a job before another worker may take it; renewed every third.
    pub lease: Duration,
    /// How long to wait before looking again when the queue had nothing due.
    pub poll_interval: Duration,
    /// How often this worker also rescues jobs whose lease expired (a crashed worker's).
    pub rescue_interval: Duration,
    /// Attempts of a pushed job that does not set its own.
    pub max_attempts: i32,
}

impl Settings {
    pub fn new(queue: &str, kind: &str) -> Self {
        Self {
            queue: queue.to_owned(),
            kind: kind.to_owned(),
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(100),
            rescue_interval: Duration::from_secs(30),
            max_attempts: 25,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApalisError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("the task's arguments do not serialise: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("job {0} lost its lease; another worker may run it")]
    LeaseLost(JobId),
}

/// The claim a task runs under, carried in its extensions for the backend's layer.
#[derive(Debug, Clone, Copy)]
struct Claim {
    id: JobId,
    lease_token: i64,
}

enum Fetch<Args> {
    Idle,
    Sleeping(Pin<Box<tokio::time::Sleep>>),
    Claiming(BoxFuture<'static, Result<Vec<Task<Args>>, ApalisError>>),
}

/// payfleet's queue as an apalis backend and task sink. Clone it to keep a sink while a worker
/// owns the backend.
pub struct PayfleetBackend<Args> {
    pool: PgPool,
    settings: Settings,
    fetch: Fetch<Args>,
    ready: VecDeque<Task<Args>>,
    last_rescue: Option<tokio::time::Instant>,
    /// Where this backend's claims are in the ring of fairness groups.
    cursor: Arc<Mutex<FairCursor>>,
    pushes: Vec<Task<Args>>,
    flushing: Option<BoxFuture<'static, Result<(), ApalisError>>>,
    _args: PhantomData<fn() -> Args>,
}

// Nothing in the backend is pinned structurally (its futures are boxed), whatever `Args` is.
impl<Args> Unpin for PayfleetBackend<Args> {}

impl<Args> Clone for PayfleetBackend<Args> {
    fn clone(&self) -> Self {
        Self::new(self.pool.clone(), self.settings.clone())
    }
}

impl<Args> PayfleetBackend<Args> {
    pub fn new(pool: PgPool, settings: Settings) -> Self {
        Self {
            pool,
            settings,
            fetch: Fetch::Idle,
            ready: VecDeque::new(),
            last_rescue: None,
            cursor: Arc::default(),
            pushes: Vec::new(),
            flushing: None,
            _args: PhantomData,
        }
    }
}

impl<Args: DeserializeOwned + Send + 'static> PayfleetBackend<Args> {
    /// Claims one due job, reading its arguments; a job whose payload does not read is failed
    /// at once (kept, with the error) and the next one is tried.
    fn claim(
        &mut self,
        worker: &WorkerContext,
    ) -> BoxFuture<'static, Result<Vec<Task<Args>>, ApalisError>> {
        let pool = self.pool.clone();
        let settings = self.settings.clone();
        let worker = format!("apalis:{}", worker.name());
        let rescue = self
            .last_rescue
            .is_none_or(|at| at.elapsed() >= settings.rescue_interval);
        if rescue {
            self.last_rescue = Some(tokio::time::Instant::now());
        }
        let shared_cursor = self.cursor.clone();
        async move {
            if rescue {
                let rescued = super::rescue_expired(&pool).await?;
                if rescued > 0 {
                    tracing::warn!(rescued, "jobs whose lease expired were made claimable again");
                }
            }
            // An operator's pause (`payfleet jobs pause`) holds this queue here as it holds the
            // fleet's workers: nothing is claimed while it lasts, and the next poll asks again.
            let paused: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM queue_pauses WHERE queue = $1)")
                    .bind(&settings.queue)
                    .fetch_one(&pool)
                    .await?;
            if paused {
                return Ok(Vec::new());
            }
            loop {
                // One claim at a time per backend (apalis polls the stream), so the cursor is
                // copied out and back rather than locked across the await.
                let mut cursor = shared_cursor.lock().map(|c| c.clone()).unwrap_or_default();
                let claimed = store::claim(
                    &pool,
                    &settings.queue,
                    1,
                    settings.lease,
                    &worker,
                    &mut cursor,
                    BookkeepingCommit::On,
                )
                .await?;
                if let Ok(mut shared) = shared_cursor.lock() {
                    *shared = cursor;
                }
                let Some(job) = claimed.into_iter().next() else {
                    return Ok(Vec::new());
                };
                match serde_json::from_value::<Args>(job.payload) {
                    Ok(args) => {
                        let task = TaskBuilder::new(args)
                            .task_id(TaskId::from_int(job.id.0 as u64))
                            // apalis counts the attempt when the task starts.
                            .attempt(job.attempt.saturating_sub(1) as usize)
                            .max_attempts(job.max_attempts as usize)
                            .queue(settings.queue.as_str().into())
                            .data(Claim {
                                id: job.id,
                                lease_token: job.lease_token,
                            })
                            .build();
                        return Ok(vec![task]);
                    }
                    Err(e) => {
                        tracing::warn!(job = %job.id, kind = %job.kind, error = %e,
                            "a job whose payload is not this worker's arguments: failed");
                        let end = Ended {
                            id: job.id,
                            lease_token: job.lease_token,
                            end: RunEnd::Fail {
                                error: format!("the payload does not read as the apalis worker's arguments: {e}"),
                            },
                        };
                        super::end_runs(&pool, &[end]).await?;
                    }
                }
            }
        }
        .boxed()
    }
}

impl<Args: DeserializeOwned + Send + 'static> Backend for PayfleetBackend<Args> {
    type Task = Task<Args>;
    type Error = ApalisError;

    fn poll_ready(
        &mut self,
        _cx: &mut Context<'_>,
        _worker: &WorkerContext,
    ) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Option<Result<Self::Task, Self::Error>>> {
        loop {
            if let Some(task) = self.ready.pop_front() {
                return Poll::Ready(Some(Ok(task)));
            }
            match &mut self.fetch {
                Fetch::Idle => {
                    let claim = self.claim(worker);
                    self.fetch = Fetch::Claiming(claim);
                }
                Fetch::Sleeping(sleep) => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.fetch = Fetch::Idle;
                }
                Fetch::Claiming(claim) => {
                    let result = match claim.as_mut().poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(r) => r,
                    };
                    let wait = Box::pin(tokio::time::sleep(self.settings.poll_interval));
                    match result {
                        Ok(tasks) if tasks.is_empty() => self.fetch = Fetch::Sleeping(wait),
                        Ok(tasks) => {
                            self.ready.extend(tasks);
                            self.fetch = Fetch::Idle;
                        }
                        Err(e) => {
                            // An outage: apalis ends a worker on a backend error, so it is
                            // logged here and the claim tried again after a pause instead.
                            tracing::warn!(queue = %self.settings.queue, error = %e,
                                "cannot claim from payfleet's queue; trying again");
                            self.fetch = Fetch::Sleeping(Box::pin(tokio::time::sleep(
                                self.settings.poll_interval.max(Duration::from_secs(1)),
                            )));
                        }
                    }
                }
            }
        }
    }

    fn poll_close(
        &mut self,
        cx: &mut Context<'_>,
        _worker: &WorkerContext,
    ) -> Poll<Result<(), Self::Error>> {
        // A claim in flight is finished, and what it took (never started) is handed back.
        if let Fetch::Claiming(claim) = &mut self.fetch {
            match claim.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(tasks)) => self.ready.extend(tasks),
                Poll::Ready(Err(e)) => tracing::warn!(error = %e, "a claim failed while closing"),
            }
            self.fetch = Fetch::Idle;
        }
        if self.flushing.is_none() && !self.ready.is_empty() {
            let ends: Vec<Ended> = self
                .ready
                .drain(..)
                .filter_map(|t| t.ctx().data().get::<Claim>().copied())
                .map(|c| Ended {
                    id: c.id,
                    lease_token: c.lease_token,
                    end: RunEnd::Release,
                })
                .collect();
            let pool = self.pool.clone();
            self.flushing = Some(
                async move {
                    super::end_runs(&pool, &ends).await?;
                    Ok(())
                }
                .boxed(),
            );
        }
        if let Some(f) = &mut self.flushing {
            let done = std::task::ready!(f.as_mut().poll(cx));
            self.flushing = None;
            return Poll::Ready(done);
        }
        Poll::Ready(Ok(()))
    }
}

impl<Args: DeserializeOwned + Send + 'static> BackendConfig for PayfleetBackend<Args> {
    type Args = Args;
    type Id = u64;
    type Kind = Ephemeral;
    type Config = Settings;
    type Layer = PayfleetLayer;

    fn config(&self) -> &Settings {
        &self.settings
    }

    fn middleware(&mut self, _worker: &mut WorkerContext) -> PayfleetLayer {
        PayfleetLayer {
            pool: self.pool.clone(),
            lease: self.settings.lease,
        }
    }
}

/// A pushed task as a payfleet job: its key, run time and attempts kept.
fn new_job<Args: Serialize>(settings: &Settings, task: &Task<Args>) -> Result<NewJob, ApalisError> {
    let mut job = NewJob::raw(
        &settings.queue,
        &settings.kind,
        serde_json::to_value(&task.args)?,
    )
    .max_attempts(
        task.max_attempts()
            .and_then(|n| i32::try_from(n).ok())
            .filter(|n| *n > 0)
            .unwrap_or(settings.max_attempts),
    );
    if let Some(at) = task
        .run_at()
        .and_then(|s| DateTime::<Utc>::from_timestamp(i64::try_from(s).ok()?, 0))
    {
        job = job.run_at(at);
    }
    if let Some(key) = task.idempotency_key() {
        // Scoped to the worker's queue: an apalis key can never replace one of the fleet's own
        // keyed jobs (an order's expiry) or another queue's.
        job = job.key(format!("apalis:{}:{key}", settings.queue));
    }
    Ok(job)
}

impl<Args: Serialize + Send + 'static> futures_util::Sink<Task<Args>> for PayfleetBackend<Args> {
    type Error = ApalisError;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), ApalisError>> {
        // One flush at a time: wait for the one under way.
        let this = self.get_mut();
        if let Some(f) = &mut this.flushing {
            let done = std::task::ready!(f.as_mut().poll(cx));
            this.flushing = None;
            done?;
        }
        Poll::Ready(Ok(()))
    }

    fn start_send(self: Pin<&mut Self>, task: Task<Args>) -> Result<(), ApalisError> {
        self.get_mut().pushes.push(task);
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), ApalisError>> {
        let this = self.get_mut();
        if this.flushing.is_none() {
            if this.pushes.is_empty() {
                return Poll::Ready(Ok(()));
            }
            let jobs = this
                .pushes
                .drain(..)
                .map(|t| new_job(&this.settings, &t))
                .collect::<Result<Vec<_>, _>>()?;
            let pool = this.pool.clone();
            // One transaction: the batch is written whole or not at all. A keyed job is
            // scheduled (replacing the waiting job of its key), the others inserted.
            this.flushing = Some(
                async move {
                    let mut tx = pool.begin().await?;
                    for job in jobs {
                        if job.has_key() {
                            super::schedule(&mut *tx, job).await?;
                        } else {
                            super::enqueue(&mut *tx, job).await?;
                        }
                    }
                    tx.commit().await?;
                    Ok(())
                }
                .boxed(),
            );
        }
        let Some(f) = &mut this.flushing else {
            return Poll::Ready(Ok(()));
        };
        let done = std::task::ready!(f.as_mut().poll(cx));
        this.flushing = None;
        Poll::Ready(done)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), ApalisError>> {
        self.poll_flush(cx)
    }
}

/// The backend's layer: keeps the lease while the handler runs and writes how the run ended.
#[derive(Clone)]
pub struct PayfleetLayer {
    pool: PgPool,
    lease: Duration,
}

impl<S> tower_layer::Layer<S> for PayfleetLayer {
    type Service = PayfleetService<S>;

    fn layer(&self, inner: S) -> PayfleetService<S> {
        PayfleetService {
            inner,
            pool: self.pool.clone(),
            lease: self.lease,
        }
    }
}

#[derive(Clone)]
pub struct PayfleetService<S> {
    inner: S,
    pool: PgPool,
    lease: Duration,
}

/// How a handler's answer ends its run.
fn run_end<R>(result: &Result<R, BoxDynError>) -> RunEnd {
    let Err(e) = result else {
        return RunEnd::Complete;
    };
    let error = error_chain(e.as_ref());
    match e.downcast_ref::<JobError>() {
        Some(JobError::Retry { after, .. }) => RunEnd::Retry {
            error,
            after: *after,
        },
        Some(JobError::Fail(_)) => RunEnd::Fail { error },
        Some(JobError::Snooze(d)) => RunEnd::Snooze(*d),
        Some(JobError::Cancel(reason)) => RunEnd::Cancel {
            reason: reason.clone(),
        },
        // Any other error (a timeout layer's, the handler's own): retried with the stored
        // backoff until the job's attempts are used.
        None => RunEnd::Retry { error, after: None },
    }
}

/// Renews the lease every third of its length; returns when it is lost, or when it may have
/// run out without a renewal this worker could confirm (the database unreachable: a rescuer
/// may already have handed the job to someone else).
async fn keep_lease(pool: PgPool, claim: Claim, lease: Duration) {
    let mut every = tokio::time::interval(lease / 3);
    every.tick().await;
    // Renewals move the expiry to `lease` after the statement ran; counting from before it
    // was sent keeps the local deadline on the safe side.
    let mut held_until = tokio::time::Instant::now() + lease;
    loop {
        every.tick().await;
        let asked = tokio::time::Instant::now();
        let bound = held_until.saturating_duration_since(asked).min(lease / 3);
        let renewal = tokio::time::timeout(
            bound,
            store::renew_leases(&pool, &[claim.id.0], &[claim.lease_token], lease),
        )
        .await;
        match renewal {
            Ok(Ok(renewed)) if !renewed.is_empty() => held_until = asked + lease,
            Ok(Ok(_)) => {
                // Locked by someone else right now (renewal skips locks), or really lost.
                match store::still_held(&pool, &[claim.id.0], &[claim.lease_token]).await {
                    Ok(held) if held.is_empty() => return,
                    Ok(_) => {}
                    Err(e) => tracing::warn!(job = %claim.id, error = %e, "cannot check the lease"),
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(job = %claim.id, error = %e, "cannot renew the lease; trying again")
            }
            Err(_) => tracing::warn!(job = %claim.id, "the lease renewal did not answer in time"),
        }
        if tokio::time::Instant::now() + lease / 3 >= held_until {
            // The next renewal could only come after the lease ran out.
            return;
        }
    }
}

/// Writes a run's end; a row another transaction holds right now (ends skip locked rows) is
/// tried again while the lease lasts. Returns whether the end was recorded.
async fn record_end(pool: &PgPool, end: &Ended, lease: Duration) -> Result<bool, sqlx::Error> {
    let deadline = tokio::time::Instant::now() + lease;
    let mut pause = Duration::from_millis(20);
    loop {
        if !super::end_runs(pool, std::slice::from_ref(end))
            .await?
            .is_empty()
        {
            return Ok(true);
        }
        let held = store::still_held(pool, &[end.id.0], &[end.lease_token]).await?;
        if held.is_empty() || tokio::time::Instant::now() + pause >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

impl<S, Args> tower_service::Service<Task<Args>> for PayfleetService<S>
where
    S: tower_service::Service<Task<Args>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxDynError>,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxDynError;
    type Future = BoxFuture<'static, Result<S::Response, BoxDynError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxDynError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, task: Task<Args>) -> Self::Future {
        let claim = task.ctx().data().get::<Claim>().copied();
        let run = self.inner.call(task);
        let (pool, lease) = (self.pool.clone(), self.lease);
        async move {
            let Some(claim) = claim else {
                // Not one of ours (another backend piped in): nothing to keep or write.
                return run.await.map_err(Into::into);
            };
            let result = tokio::select! {
                r = run => r.map_err(Into::into),
                () = keep_lease(pool.clone(), claim, lease) => {
                    tracing::warn!(job = %claim.id, "lease lost: the handler is cancelled, another worker may run the job");
                    return Err(ApalisError::LeaseLost(claim.id).into());
                }
            };
            let end = Ended {
                id: claim.id,
                lease_token: claim.lease_token,
                end: run_end(&result),
            };
            match record_end(&pool, &end, lease).await {
                Ok(false) => {
                    tracing::warn!(job = %claim.id, "the run ended after its lease was lost: its end is not recorded");
                }
                Ok(true) => {}
                Err(e) => {
                    // The lease runs out and the job is rescued: it runs again (at least once).
                    tracing::warn!(job = %claim.id, error = %e, "cannot record the end of a run; the job will run again");
                }
            }
            result
        }
        .boxed()
    }
}
