//! Requests that arrive while others are served, served together: the checkouts' writer, their
//! answers' store and the payment links asked over RabbitMQ each take what is waiting in one
//! statement or one message, so a statement's (or a message's) fixed cost is paid once per
//! batch instead of once per request. A lone request waits for nothing.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc};

/// Runs `run` on what arrives on `pending`, at most `in_flight` batches at once: each batch
/// takes what arrived while the others ran (at most `most`). Ends when every sender is dropped.
/// A batch that panics drops its requests' replies: each caller sees its reply channel closed
/// and does its work alone (or fails), as its own code says.
pub async fn in_batches<T, F, Fut>(
    mut pending: mpsc::Receiver<T>,
    most: usize,
    in_flight: usize,
    run: F,
) where
    T: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(in_flight.max(1)));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut batch = Vec::with_capacity(most);
        if pending.recv_many(&mut batch, most.max(1)).await == 0 {
            return;
        }
        let batch = run(batch);
        tokio::spawn(async move {
            batch.await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    #[tokio::test]
    async fn what_waits_is_served_together_and_a_lone_request_waits_for_nothing() {
        let (tx, rx) = mpsc::channel(16);
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let (gate_tx, gate_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(in_batches(rx, 4, 1, move |batch: Vec<u32>| {
            let (seen, mut gate) = (seen.clone(), gate_rx.clone());
            async move {
                seen.lock().unwrap().push(batch.len());
                // The first batch holds the only slot until the gate opens.
                let _ = gate.wait_for(|open| *open).await;
            }
        }));
        tx.send(1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            *sizes.lock().unwrap(),
            vec![1],
            "a lone request goes at once"
        );
        for i in 0..6 {
            tx.send(i).await.unwrap();
        }
        gate_tx.send(true).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            *sizes.lock().unwrap(),
            vec![1, 4, 2],
            "what waited went together, at most four at a time"
        );
    }
}
