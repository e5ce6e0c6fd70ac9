//! The listener: wakes the fetcher of a queue when a job of it becomes claimable, and the census
//! when a worker joins or leaves. Reconnects by itself; after a reconnection every queue and the
//! census are woken, since notifications sent meanwhile are lost. Polling covers the time it is
//! down.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, watch};

use super::census;
use super::loops::{backoff, pause, stop_requested};
use super::store::CHANNEL;

/// A queue's wake-up call: its claimers sleep on it when nothing is due, and its claims read
/// how many jobs were notified (`store::FairCursor`).
#[derive(Debug, Default)]
pub(crate) struct QueueWaker {
    notify: Notify,
    /// Notifications heard for the queue, and reconnections of the listener (after which some
    /// may have been lost).
    arrivals: Arc<AtomicU64>,
}

impl QueueWaker {
    /// A job of the queue became claimable (or may have: the listener reconnected).
    pub(crate) fn job_arrived(&self) {
        self.arrivals.fetch_add(1, Ordering::Release);
        self.notify.notify_one();
    }

    /// Wakes a sleeping claimer to claim beside a busy one.
    pub(crate) fn nudge(&self) {
        self.notify.notify_one();
    }

    pub(crate) async fn wait(&self) {
        self.notify.notified().await;
    }

    pub(crate) fn arrivals(&self) -> Arc<AtomicU64> {
        self.arrivals.clone()
    }
}

/// Wakes each queue's claimers as its jobs arrive, and `recount` (the census) as workers join or
/// leave; after a reconnection, all of them.
pub(crate) async fn listen(
    on: PgPool,
    wakers: HashMap<String, Arc<QueueWaker>>,
    recount: Arc<Notify>,
    mut stopped: watch::Receiver<bool>,
) {
    let wake_all = || {
        wakers.values().for_each(|w| w.job_arrived());
        recount.notify_one();
    };
    let mut failures = 0;
    loop {
        let mut listener = match PgListener::connect_with(&on).await {
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
        if let Err(e) = listener.listen_all([CHANNEL, census::CHANNEL]).await {
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
                Ok(Some(n)) if n.channel() == census::CHANNEL => recount.notify_one(),
                Ok(Some(n)) => {
                    if let Some(w) = wakers.get(n.payload()) {
                        w.job_arrived();
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
