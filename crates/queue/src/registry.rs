//! Which worker runs which kind of job. A kind's behaviour is one [`Worker`] implementation,
//! holding what its jobs need (given once, at registration), as River's `Worker.Work` and
//! underway's `Task::execute`; [`Registry::register`] also takes a plain closure.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::PgPool;

use super::{Job, JobError, JobId};

/// What a handler knows about the run it is in.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub id: JobId,
    pub kind: String,
    pub queue: String,
    /// 1 on the first run.
    pub attempt: i32,
    pub max_attempts: i32,
    pub pool: PgPool,
    /// The run's hold on its job's row, for completing the job in a transaction of the
    /// handler's ([`JobContext::run`]).
    pub(crate) run: RunClaim,
}

impl JobContext {
    /// This run's hold on its job's row: handed to whatever writes the job's effect, the job
    /// can be completed in the same transaction ([`crate::complete_runs_from`]) instead of in
    /// a statement and commit of the fleet's own after the run.
    pub fn run(&self) -> RunClaim {
        self.run.clone()
    }
}

/// A run's hold on its job's row: the job's id and the lease token of this run. A transaction
/// that writes the job's effect may complete the job too, by deleting its row with
/// [`crate::complete_runs_from`] (only while this run still holds it, and only if no cancel or
/// reschedule was asked meanwhile), and once that transaction has committed says so with
/// [`RunClaim::completed`]: the run then ends with no statement of the fleet's. A run whose
/// row was not deleted (its lease lost, an operator's request pending, the transaction rolled
/// back) ends as any other, by its outcome.
#[derive(Debug, Clone)]
pub struct RunClaim {
    id: JobId,
    lease_token: i64,
    completed: Arc<AtomicBool>,
}

impl RunClaim {
    pub(crate) fn new(id: JobId, lease_token: i64) -> Self {
        Self {
            id,
            lease_token,
            completed: Arc::default(),
        }
    }

    pub fn id(&self) -> JobId {
        self.id
    }

    /// The token the job's row holds while this run does (bound beside the id).
    pub fn lease_token(&self) -> i64 {
        self.lease_token
    }

    /// The transaction that deleted this run's job row has committed: the job is completed.
    /// Say it only after the commit (before it, a rollback would leave the row running with
    /// no end to come).
    pub fn completed(&self) {
        self.completed.store(true, Ordering::Release);
    }

    pub(crate) fn is_completed(&self) -> bool {
        self.completed.load(Ordering::Acquire)
    }
}

pub(crate) type RunFuture = Pin<Box<dyn Future<Output = Result<(), JobError>> + Send>>;

type Erased =
    dyn Fn(JobContext, serde_json::Value) -> Result<RunFuture, serde_json::Error> + Send + Sync;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("job kind {0:?} is registered twice")]
    Duplicate(&'static str),
}

/// What a kind of job does: runs one job of kind `J`. Its outcome is typed: `Ok` completes the
/// job; [`JobError`] retries it (after the stored backoff or a given delay), fails it for good,
/// snoozes it (no attempt spent) or cancels it. One type may work several kinds.
pub trait Worker<J: Job>: Send + Sync + 'static {
    fn work(&self, ctx: JobContext, job: J) -> impl Future<Output = Result<(), JobError>> + Send;
}

/// The handlers of one worker process, by job kind.
#[derive(Default, Clone)]
pub struct Registry {
    handlers: HashMap<&'static str, Arc<Erased>>,
    /// Each kind's queue.
    queues: HashMap<&'static str, &'static str>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("kinds", &self.handlers.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `worker` as the one that runs `J`'s kind; a kind can only have one.
    pub fn add<J: Job, W: Worker<J>>(&mut self, worker: W) -> Result<&mut Self, RegistryError> {
        let worker = Arc::new(worker);
        self.register::<J, _, _>(move |ctx, job| {
            let worker = worker.clone();
            async move { worker.work(ctx, job).await }
        })
    }

    /// Registers the handler of `J`; a kind can only have one.
    pub fn register<J, F, Fut>(&mut self, handler: F) -> Result<&mut Self, RegistryError>
    where
        J: Job,
        F: Fn(JobContext, J) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), JobError>> + Send + 'static,
    {
        if self.handlers.contains_key(J::KIND) {
            return Err(RegistryError::Duplicate(J::KIND));
        }
        let erased = move |ctx: JobContext,
                           payload: serde_json::Value|
              -> Result<RunFuture, serde_json::Error> {
            let job: J = serde_json::from_value(payload)?;
            Ok(Box::pin(handler(ctx, job)))
        };
        self.handlers.insert(J::KIND, Arc::new(erased));
        self.queues.insert(J::KIND, J::QUEUE);
        Ok(self)
    }

    /// Each registered kind (with its queue) whose queue `config`'s catalogue does not define
    /// (whether or not this process works it), by kind: no worker would ever claim its jobs,
    /// which would wait for ever.
    pub fn undefined_queues(
        &self,
        config: &crate::QueuesConfig,
    ) -> Vec<(&'static str, &'static str)> {
        let mut missing: Vec<_> = self
            .queues
            .iter()
            .filter(|(_, queue)| {
                !config.queues.contains_key(**queue) && !config.defined.contains(**queue)
            })
            .map(|(kind, queue)| (*kind, *queue))
            .collect();
        missing.sort_unstable();
        missing
    }

    pub(crate) fn get(&self, kind: &str) -> Option<Arc<Erased>> {
        self.handlers.get(kind).cloned()
    }

    pub fn kinds(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.handlers.keys().copied()
    }
}
