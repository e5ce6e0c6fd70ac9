//! Which worker runs which kind of job. A kind's behaviour is one [`Worker`] implementation,
//! holding what its jobs need (given once, at registration), as River's `Worker.Work` and
//! underway's `Task::execute`; [`Registry::register`] also takes a plain closure.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

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
        Ok(self)
    }

    pub(crate) fn get(&self, kind: &str) -> Option<Arc<Erased>> {
        self.handlers.get(kind).cloned()
    }

    pub fn kinds(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.handlers.keys().copied()
    }
}
