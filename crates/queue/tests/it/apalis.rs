//! payfleet's queue as an apalis backend: an apalis worker (with tower layers) claims payfleet
//! jobs under leases, retries with the stored backoff, sees replace-by-key, and is cancelled
//! when its lease is lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use apalis::layers::WorkerBuilderExt;
use apalis_core::backend::TaskSink;
use apalis_core::error::BoxDynError;
use apalis_core::task::attempt::Attempt;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::task::data::Data;
use apalis_core::task::task_id::TaskId;
use apalis_core::worker::builder::WorkerBuilder;
use payfleet_queue::JobError;
use payfleet_queue::apalis::{PayfleetBackend, Settings};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::wait_for;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charge {
    n: i64,
    /// Fail the first attempt (with a plain error), or for good (with JobError::Fail).
    fail: Option<String>,
}

/// What a handler saw of its job's row while it ran.
async fn record(pool: &PgPool, id: &TaskId, n: i64, attempt: usize) -> Result<(), BoxDynError> {
    sqlx::query(
        "INSERT INTO seen (job_id, n, attempt, state, locked_by, leased)
         SELECT id, $2, $3, state, locked_by, lease_expires_at > now() AND lease_token IS NOT NULL
         FROM jobs WHERE id = $1",
    )
    .bind(id.as_int().unwrap_or_default() as i64)
    .bind(n)
    .bind(attempt as i32)
    .execute(pool)
    .await?;
    Ok(())
}

async fn charge(
    job: Charge,
    id: TaskId,
    attempt: Attempt,
    pool: Data<PgPool>,
) -> Result<(), BoxDynError> {
    record(&pool, &id, job.n, attempt.current()).await?;
    match job.fail.as_deref() {
        Some("once") if attempt.current() == 1 => Err("card network timeout".into()),
        Some("for good") => Err(Box::new(JobError::fail("card reported stolen"))),
        _ => Ok(()),
    }
}

async fn setup(pool: &PgPool) -> PayfleetBackend<Charge> {
    sqlx::query(
        "CREATE TABLE seen (job_id bigint, n bigint, attempt int, state text, locked_by text, leased bool)",
    )
    .execute(pool)
    .await
    .unwrap();
    PayfleetBackend::new(pool.clone(), Settings::new("charges", "charge"))
}

/// Runs an apalis worker with the usual tower layers until the test ends.
fn run_worker(pool: &PgPool, backend: PayfleetBackend<Charge>) -> tokio::task::JoinHandle<()> {
    let worker = WorkerBuilder::new("charges-1")
        .backend(backend)
        .enable_tracing()
        .timeout(Duration::from_secs(10))
        .concurrency(4)
        .data(pool.clone())
        .build(charge);
    tokio::spawn(async move {
        let _ = worker.run().await;
    })
}

async fn states(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT state, count(*) FROM jobs WHERE queue = 'charges' GROUP BY state ORDER BY state",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn an_apalis_handler_runs_payfleet_jobs_under_leases_each_once(pool: PgPool) {
    let backend = setup(&pool).await;
    let mut sink = backend.clone();
    for n in 0..30 {
        sink.push(Charge { n, fail: None }).await.unwrap();
    }
    // Two workers on the same queue share it; neither runs a job the other ran.
    let a = run_worker(&pool, backend.clone());
    let b = run_worker(&pool, backend);
    wait_for("30 completed", Duration::from_secs(20), async || {
        states(&pool).await.is_empty()
    })
    .await;
    a.abort();
    b.abort();
    let (runs, distinct, leased): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT n), count(*) FILTER (WHERE state = 'running' AND leased AND locked_by LIKE 'apalis:%')
         FROM seen",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((runs, distinct, leased), (30, 30, 30));
}

/// An operator's pause holds an apalis worker's queue as it holds the fleet's: nothing runs
/// until the queue is resumed.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn an_apalis_worker_claims_nothing_from_a_paused_queue(pool: PgPool) {
    let backend = setup(&pool).await;
    let mut sink = backend.clone();
    payfleet_queue::admin::pause(&pool, "charges")
        .await
        .unwrap();
    sink.push(Charge { n: 1, fail: None }).await.unwrap();
    let worker = run_worker(&pool, backend);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(states(&pool).await, vec![("available".to_owned(), 1)]);
    payfleet_queue::admin::resume(&pool, "charges")
        .await
        .unwrap();
    wait_for(
        "the job to run once resumed",
        Duration::from_secs(10),
        async || states(&pool).await.is_empty(),
    )
    .await;
    worker.abort();
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_failed_run_waits_for_the_stored_backoff_and_a_failure_for_good_is_kept(pool: PgPool) {
    let backend = setup(&pool).await;
    let mut sink = backend.clone();
    sink.push(Charge {
        n: 1,
        fail: Some("once".into()),
    })
    .await
    .unwrap();
    sink.push(Charge {
        n: 2,
        fail: Some("for good".into()),
    })
    .await
    .unwrap();
    let worker = run_worker(&pool, backend);
    // The first attempt failed: the job waits in the table for payfleet's backoff (about 2 s
    // after attempt 1), with the error kept, not in the worker's memory.
    wait_for("retryable", Duration::from_secs(10), async || {
        states(&pool).await.iter().any(|(s, _)| s == "retryable")
    })
    .await;
    let (wait, error): (f64, String) = sqlx::query_as(
        "SELECT extract(epoch FROM run_at - now())::float8, errors -> -1 ->> 'error'
         FROM jobs WHERE queue = 'charges' AND state = 'retryable'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!((0.5..=2.6).contains(&wait), "{wait}");
    assert!(error.contains("card network timeout"), "{error}");
    wait_for("retried and done", Duration::from_secs(10), async || {
        states(&pool).await == [("discarded".to_owned(), 1)]
    })
    .await;
    worker.abort();
    let attempts: Vec<(i64, i32)> =
        sqlx::query_as("SELECT n, attempt FROM seen ORDER BY n, attempt")
            .fetch_all(&pool)
            .await
            .unwrap();
    // n=1 ran twice (the second after the backoff); n=2 once, failed for good at once.
    assert_eq!(attempts, [(1, 1), (1, 2), (2, 1)]);
    let kept: String =
        sqlx::query_scalar("SELECT errors -> -1 ->> 'error' FROM jobs WHERE state = 'discarded'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(kept.contains("card reported stolen"), "{kept}");
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn pushing_a_key_again_replaces_the_waiting_job_and_the_worker_sees_only_the_last(
    pool: PgPool,
) {
    let backend = setup(&pool).await;
    let mut sink = backend.clone();
    // The fleet's own job under the same key, on its own queue: apalis keys never touch it.
    payfleet_queue::schedule(
        &pool,
        payfleet_queue::NewJob::raw("orders", "expire_order", serde_json::json!({"number": 7}))
            .key("order:7")
            .run_at(chrono::Utc::now() + chrono::Duration::hours(1)),
    )
    .await
    .unwrap();
    // An expiry-like job an hour out, then rescheduled for now with new arguments.
    sink.push_task(
        TaskBuilder::new(Charge { n: 1, fail: None })
            .idempotency_key("order:7")
            .run_in_hours(1)
            .build(),
    )
    .await
    .unwrap();
    sink.push_task(
        TaskBuilder::new(Charge { n: 2, fail: None })
            .idempotency_key("order:7")
            .build(),
    )
    .await
    .unwrap();
    let keyed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE key = 'apalis:charges:order:7'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(keyed, 1);
    let fleets: (String, serde_json::Value) =
        sqlx::query_as("SELECT kind, payload FROM jobs WHERE key = 'order:7'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        fleets,
        ("expire_order".to_owned(), serde_json::json!({"number": 7}))
    );
    let worker = run_worker(&pool, backend);
    wait_for("done", Duration::from_secs(10), async || {
        states(&pool).await.is_empty()
    })
    .await;
    worker.abort();
    let seen: Vec<i64> = sqlx::query_scalar("SELECT n FROM seen")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(seen, [2]);
}

static CANCELLED: AtomicBool = AtomicBool::new(false);

struct Dropped;

impl Drop for Dropped {
    fn drop(&mut self) {
        CANCELLED.store(true, Ordering::SeqCst);
    }
}

async fn slow(_job: Charge) -> Result<(), BoxDynError> {
    let _guard = Dropped;
    tokio::time::sleep(Duration::from_secs(60)).await;
    std::mem::forget(_guard);
    Ok(())
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_handler_whose_lease_is_lost_is_cancelled(pool: PgPool) {
    let mut settings = Settings::new("charges", "charge");
    settings.lease = Duration::from_millis(600);
    let backend = PayfleetBackend::<Charge>::new(pool.clone(), settings);
    let mut sink = backend.clone();
    sink.push(Charge { n: 1, fail: None }).await.unwrap();
    let worker = WorkerBuilder::new("slow").backend(backend).build(slow);
    let running = tokio::spawn(async move {
        let _ = worker.run().await;
    });
    wait_for("running", Duration::from_secs(10), async || {
        states(&pool).await == [("running".to_owned(), 1)]
    })
    .await;
    // Another claim took the job (as a rescue after a long pause would): new fencing token.
    sqlx::query(
        "UPDATE jobs SET lease_token = nextval('jobs_lease_token_seq') WHERE queue = 'charges'",
    )
    .execute(&pool)
    .await
    .unwrap();
    wait_for("cancelled", Duration::from_secs(5), async || {
        CANCELLED.load(Ordering::SeqCst)
    })
    .await;
    running.abort();
    // The lost run wrote nothing: the job is the new holder's to end.
    assert_eq!(states(&pool).await, [("running".to_owned(), 1)]);
}
