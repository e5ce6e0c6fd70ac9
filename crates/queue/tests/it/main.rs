//! The queue's tests: each one gets its own database on the real PostgreSQL server
//! (`#[sqlx::test]`, `DATABASE_URL` names the server), migrated by the queue's migrations alone.

mod apalis;
mod queue;

#[path = "../support/wait.rs"]
mod wait;
pub use wait::wait_for;

/// The constraint a database error is about, if any.
pub fn constraint_of(e: &sqlx::Error) -> Option<&str> {
    match e {
        sqlx::Error::Database(db) => db.constraint(),
        _ => None,
    }
}
