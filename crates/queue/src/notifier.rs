//! Wakes workers after commit, outside the caller's transaction. A NOTIFY inside a transaction
//! holds PostgreSQL's notify-queue lock through the commit, which serialises concurrent commits
//! (no group commit); hot paths such as webhook ingestion enqueue without it and call
//! [`Notifier::notify`] once committed. Notifications that pile up while one is being sent go
//! out together. If one is lost (database down), the workers' polling still finds the job.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};

use sqlx::PgPool;
use tokio::sync::Notify;

use super::store;

#[derive(Clone)]
pub struct Notifier {
    pending: Arc<Mutex<BTreeSet<String>>>,
    wake: Arc<Notify>,
}

impl Notifier {
    /// Starts the sending task on the current runtime.
    pub fn start(pool: PgPool) -> Self {
        let n = Self {
            pending: Arc::default(),
            wake: Arc::default(),
        };
        tokio::spawn(n.clone().run(pool));
        n
    }

    /// Asks for the workers of `queue` to be woken soon.
    pub fn notify(&self, queue: &str) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if !pending.contains(queue) {
            pending.insert(queue.to_owned());
        }
        drop(pending);
        self.wake.notify_one();
    }

    async fn run(self, pool: PgPool) {
        loop {
            self.wake.notified().await;
            let queues: Vec<String> =
                std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
                    .into_iter()
                    .collect();
            if queues.is_empty() {
                continue;
            }
            if let Err(e) = store::notify_queues(&pool, &queues).await {
                tracing::debug!(error = %e, "could not notify workers; they will poll");
            }
        }
    }
}
