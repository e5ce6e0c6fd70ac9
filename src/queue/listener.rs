//! The listener: wakes the fetcher of a queue when a job of it becomes claimable. Reconnects by
//! itself; after a reconnection every queue is woken, since notifications sent meanwhile are
//! lost. Polling covers the time it is down.

use std::collections::HashMap;
use std::sync::Arc;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, watch};

use super::fleet::{backoff, pause, stop_requested};
use super::store::CHANNEL;

pub(crate) async fn listen(
    on: PgPool,
    wakers: HashMap<String, Arc<Notify>>,
    mut stopped: watch::Receiver<bool>,
) {
    let wake_all = || wakers.values().for_each(|w| w.notify_one());
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
