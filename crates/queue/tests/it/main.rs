//! The queue's tests: each one gets its own database on the real PostgreSQL server
//! (`#[sqlx::test]`, `DATABASE_URL` names the server), migrated by the queue's migrations alone.

mod apalis;
mod queue;

/// Waits until `done` holds, failing the test after `limit`.
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

/// The constraint a database error is about, if any.
pub fn constraint_of(e: &sqlx::Error) -> Option<&str> {
    match e {
        sqlx::Error::Database(db) => db.constraint(),
        _ => None,
    }
}
