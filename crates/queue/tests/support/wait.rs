//! Waiting in tests for what workers do on their own time: shared by the queue's tests and the
//! application's (each includes this file), so both fail the same way, naming what they waited
//! for.

/// Polls `done` every 10 ms until it holds; fails the test after `limit`.
pub async fn wait_for(what: &str, limit: std::time::Duration, mut done: impl AsyncFnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done().await {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
