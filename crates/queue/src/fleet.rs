//! The worker runtime of one process: starts a fetcher per queue (`executor`), the completer,
//! the lease keeper, the listener and the maintenance loop, and stops them gracefully.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::{Mutex, Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use super::census::{self, Census};
use super::executor::{QueueShare, fetch, run_one};
use super::lease::Leases;
use super::listener::QueueWaker;
use super::loops::{Pauses, Shared};
use super::registry::Registry;
use super::store::FairCursor;
use super::{
    BookkeepingCommit, Ended, QueueSettings, QueuesConfig, RunEnd, completer, end_runs, lease,
    listener, maintenance, store,
};

/// Connections of a worker's claims pool: its queues' claims and their next-due-time asks.
const CLAIM_CONNECTIONS: u32 = 2;

/// Runs in one process all the queues of a catalogue.
pub struct Fleet {
    pool: PgPool,
    registry: Registry,
    config: QueuesConfig,
    worker_id: String,
    listen: Listen,
    observer: Option<Arc<dyn crate::RunObserver>>,
    census: Census,
}

/// Where the fleet LISTENs for new jobs. LISTEN holds state on a server session, which a pooler
/// in transaction mode (PgBouncer) hands to other clients between transactions: behind one,
/// listen on a direct connection, or not at all (every queue is then polled at the fleet's
/// `poll_interval_ms`). Everything else the fleet does is one transaction at a time.
#[derive(Debug, Clone, Default)]
pub enum Listen {
    /// On the fleet's own database connection (no pooler in between).
    #[default]
    Database,
    /// On a direct connection to PostgreSQL.
    Direct(Box<PgConnectOptions>),
    /// Poll only.
    Off,
}

/// A started fleet. [`FleetHandle::shutdown`] stops it gracefully.
pub struct FleetHandle {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    leases: Arc<Leases>,
    running: Arc<AtomicBool>,
    pauses: watch::Receiver<Pauses>,
}

/// Tells whether a fleet is running and claiming, for a worker's readiness.
#[derive(Clone)]
pub struct FleetProbe {
    running: Arc<AtomicBool>,
    pauses: watch::Receiver<Pauses>,
}

impl FleetProbe {
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Relaxed)
    }

    /// Running, and it has read the paused queues: until then it claims nothing
    /// ([`Pauses`]), and a worker that cannot read them (its bookkeeping connections refused,
    /// the table missing or not granted) must not look ready while it does no work.
    pub fn is_claiming(&self) -> bool {
        self.is_running() && self.pauses.borrow().is_some()
    }
}

/// Clears the running flag however the fleet's task ends (a panic included).
struct RunningFlag(Arc<AtomicBool>);

impl Drop for RunningFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
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

    /// False once the fleet has stopped, for whatever reason: a worker's readiness.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Relaxed)
    }

    pub fn probe(&self) -> FleetProbe {
        FleetProbe {
            running: self.running.clone(),
            pauses: self.pauses.clone(),
        }
    }

    /// Runs of this process that hold a lease right now.
    pub fn running_jobs(&self) -> usize {
        self.leases.len()
    }
}

impl Fleet {
    /// `host` names the machine in the worker's id (`<host>-<pid>-<random>`), which is stored
    /// with every claim and every error.
    pub fn new(pool: PgPool, registry: Registry, config: QueuesConfig, host: &str) -> Self {
        Self {
            pool,
            registry,
            config,
            worker_id: format!(
                "{host}-{}-{:04x}",
                std::process::id(),
                rand::random::<u16>()
            ),
            listen: Listen::Database,
            observer: None,
            census: Census::default(),
        }
    }

    /// Keeps `census` (the fleet's worker processes per queue) while the fleet runs, for
    /// whatever else in the process sizes its work by it. Without this, the fleet keeps a census
    /// of its own: it is counted all the same.
    pub fn census(mut self, census: Census) -> Self {
        self.census = census;
        self
    }

    /// Tells `observer` of every run's end (its queue, kind, outcome and times).
    pub fn observe(mut self, observer: Arc<dyn crate::RunObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Where to LISTEN for new jobs (by default, the fleet's own database connection).
    pub fn listen(mut self, listen: Listen) -> Self {
        self.listen = listen;
        self
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Starts every loop on the current runtime.
    pub fn start(self) -> FleetHandle {
        let (stop, stopped) = watch::channel(false);
        let leases = Arc::new(Leases::default());
        let running = Arc::new(AtomicBool::new(true));
        let flag = RunningFlag(running.clone());
        let for_run = leases.clone();
        let (paused_tx, pauses) = watch::channel(None);
        let task = tokio::spawn(async move {
            let _flag = flag;
            self.run(stopped, for_run, paused_tx).await
        });
        FleetHandle {
            stop,
            task,
            leases,
            running,
            pauses,
        }
    }

    async fn run(
        self,
        stopped: watch::Receiver<bool>,
        leases: Arc<Leases>,
        paused_tx: watch::Sender<Pauses>,
    ) {
        let Fleet {
            pool,
            registry,
            config,
            worker_id,
            listen,
            observer,
            census,
        } = self;
        let control = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(crate::pg::part_of(&pool.connect_options(), "bookkeeping"));
        // A queue's claimers take turns (one claim of a queue at a time), and a claim of a
        // queue with nothing due is a fraction of a millisecond: two connections carry every
        // queue's claims. One per queue, a worker started on a backlog opened five backends at
        // once, each parsing and planning the claim and compiling its walk afresh (15 to 30 ms
        // of PostgreSQL each) while the first claim that had jobs waited for the same cores.
        let claims = PgPoolOptions::new()
            .max_connections(
                CLAIM_CONNECTIONS
                    .min(u32::try_from(config.queues.len().max(1)).unwrap_or(CLAIM_CONNECTIONS)),
            )
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(crate::pg::part_of(&pool.connect_options(), "claims"));
        let paused = paused_tx.subscribe();
        let paused_tx = Arc::new(paused_tx);
        let shared = Arc::new(Shared {
            pool,
            claims,
            control,
            registry,
            config,
            worker_id,
            leases,
            observer,
            paused,
        });
        tracing::info!(worker = %shared.worker_id, queues = ?shared.config.queues.keys().collect::<Vec<_>>(), "worker started");

        let wakers: HashMap<String, Arc<QueueWaker>> = shared
            .config
            .queues
            .keys()
            .map(|q| (q.clone(), Arc::default()))
            .collect();
        let (ended_tx, ended_rx) = mpsc::channel::<Ended>(10_000);

        let completer = tokio::spawn(completer::complete(shared.clone(), ended_rx));
        let mut background = JoinSet::new();
        let listen_on = match listen {
            Listen::Database => Some(shared.control.clone()),
            Listen::Direct(options) => Some(
                PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(Duration::from_secs(5))
                    .connect_lazy_with(crate::pg::part_of(&options, "listener")),
            ),
            Listen::Off => {
                tracing::info!(
                    poll_interval_ms = shared.config.fleet.poll_interval_ms,
                    "not listening for new jobs: every queue is polled"
                );
                None
            }
        };
        let recount = Arc::new(tokio::sync::Notify::new());
        let census_task;
        if let Some(on) = listen_on {
            let (w, r, st) = (wakers.clone(), recount.clone(), stopped.clone());
            background.spawn(supervise("listener", move || {
                listener::listen(on.clone(), w.clone(), r.clone(), st.clone())
            }));
        }
        {
            let (pool, worker, st) = (
                shared.control.clone(),
                shared.worker_id.clone(),
                stopped.clone(),
            );
            let queues: Vec<String> = shared.config.queues.keys().cloned().collect();
            // Not in `background`: it ends by itself when stopped, once its row is deleted,
            // which the fleet waits for (bounded) before it returns.
            census_task = tokio::spawn(supervise("census", move || {
                census::keep(
                    pool.clone(),
                    worker.clone(),
                    queues.clone(),
                    census.clone(),
                    recount.clone(),
                    st.clone(),
                )
            }));
        }
        {
            // The keeper's own connections: nothing else can use them up.
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(5))
                .connect_lazy_with(crate::pg::part_of(&shared.pool.connect_options(), "leases"));
            let leases = shared.leases.clone();
            let lease = shared.config.fleet.lease();
            background.spawn(supervise("lease keeper", move || {
                lease::keep(pool.clone(), leases.clone(), lease)
            }));
        }
        {
            let (s, st) = (shared.clone(), stopped.clone());
            background.spawn(supervise("maintenance", move || {
                maintenance::maintain(s.clone(), st.clone())
            }));
        }
        {
            let (pool, tx, st) = (shared.control.clone(), paused_tx, stopped.clone());
            background.spawn(supervise("pause watcher", move || {
                crate::loops::watch_pauses(pool.clone(), tx.clone(), st.clone())
            }));
        }

        let mut fetchers = JoinSet::new();
        for (name, settings) in &shared.config.queues {
            let waker = wakers.get(name).cloned().unwrap_or_default();
            let share = Arc::new(QueueShare {
                name: name.clone(),
                settings: settings.clone(),
                slots: Arc::new(Semaphore::new(settings.concurrency as usize)),
                turn: Mutex::new(FairCursor::following(
                    waker.arrivals(),
                    store::PROBE_FROM_START_EVERY,
                )),
                waker,
            });
            for _ in 0..settings.claimers {
                fetchers.spawn(fetch(
                    shared.clone(),
                    share.clone(),
                    ended_tx.clone(),
                    stopped.clone(),
                ));
            }
        }
        drop(ended_tx);
        while let Some(done) = fetchers.join_next().await {
            if let Err(e) = done {
                tracing::error!(error = %e, "a queue's fetcher ended abnormally");
            }
        }
        // Every sender is gone once the fetchers and their jobs are: the completer drains and ends.
        if let Err(e) = completer.await {
            tracing::error!(error = %e, "completer ended abnormally");
        }
        // Its row deleted, the others take this worker's share now, not ten seconds later.
        if tokio::time::timeout(CENSUS_LEAVE, census_task)
            .await
            .is_err()
        {
            tracing::debug!(
                "the census row was not deleted in time; it stops being counted in ten seconds"
            );
        }
        background.abort_all();
        while background.join_next().await.is_some() {}
        tracing::info!(worker = %shared.worker_id, "worker stopped");
    }
}

/// How long a stopping fleet waits for its census row to be deleted.
const CENSUS_LEAVE: Duration = Duration::from_secs(2);

/// Runs a background loop, starting it again if it panics: a bug in one loop must not leave a
/// worker claiming jobs whose leases nobody renews.
async fn supervise<F, Fut>(name: &'static str, start: F)
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        match tokio::spawn(start()).await {
            Ok(()) => return,
            Err(e) if e.is_cancelled() => return,
            Err(e) => {
                tracing::error!(task = name, error = %e, "fleet task panicked; restarting it");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// Claims and runs due jobs of `queue` one batch at a time, in this task, until none is due
/// or an operator has paused the queue: a deterministic way for tests and tools to step the
/// workers. Returns how many runs ended.
pub async fn work_until_idle(
    pool: &PgPool,
    registry: &Registry,
    queue: &str,
    settings: &QueueSettings,
) -> Result<usize, sqlx::Error> {
    let worker = format!("step-{}-{:04x}", std::process::id(), rand::random::<u16>());
    let mut total = 0;
    let mut cursor = store::FairCursor::default();
    // A step takes what one worker's slots could run, and no more than the queue's own cap.
    let batch = settings
        .claim_batch(settings.concurrency)
        .min(settings.concurrency);
    // Nothing renews a step's leases, and its jobs run one after another, each for at most its
    // timeout: the lease covers the last of them too, so no rescuer hands a job of the step to
    // another worker while it waits its turn here.
    let lease = step_lease(settings.timeout_ms, batch);
    loop {
        // As the fleet's claimers hold back for a pause (`payfleet jobs pause`).
        let paused: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM queue_pauses WHERE queue = $1)")
                .bind(queue)
                .fetch_one(pool)
                .await?;
        if paused {
            return Ok(total);
        }
        let claimed = store::claim(
            pool,
            queue,
            i64::from(batch),
            lease,
            &worker,
            &mut cursor,
            BookkeepingCommit::On,
        )
        .await?;
        if claimed.is_empty() {
            // A claim that met only groups with nothing due moved past them: ask again while
            // something is due.
            if store::next_due_in(pool, queue).await? == Some(Duration::ZERO) {
                continue;
            }
            return Ok(total);
        }
        let mut ended = Vec::with_capacity(claimed.len());
        for job in claimed {
            let (id, token) = (job.id, job.lease_token);
            let end = run_one(pool, registry, queue, settings.timeout(), job, None).await;
            total += 1;
            // Completed in the handler's own transaction: nothing to write.
            if matches!(end, RunEnd::Completed) {
                continue;
            }
            ended.push(Ended {
                id,
                lease_token: token,
                end,
            });
        }
        if !ended.is_empty() {
            end_runs(pool, &ended).await?;
        }
    }
}

/// The lease of a step of `batch` jobs, each run for at most `timeout_ms` one after another:
/// the whole step's length and as much again (a job's own lease in the fleet is twice its
/// timeout), at least a second.
fn step_lease(timeout_ms: u64, batch: u32) -> Duration {
    Duration::from_millis(
        timeout_ms
            .saturating_mul(2)
            .saturating_mul(u64::from(batch.max(1)))
            .max(1_000),
    )
}

#[cfg(test)]
mod step_tests {
    use super::*;

    #[test]
    fn a_steps_lease_outlasts_its_last_job() {
        // Ten jobs of at most 2 s each, one after another: the tenth may end 20 s in.
        assert_eq!(step_lease(2_000, 10), Duration::from_secs(40));
        assert_eq!(step_lease(2_000, 1), Duration::from_secs(4));
        assert_eq!(step_lease(100, 1), Duration::from_secs(1));
        assert_eq!(step_lease(2_000, 0), Duration::from_secs(4));
        assert_eq!(step_lease(u64::MAX, 10), Duration::from_millis(u64::MAX));
    }
}
