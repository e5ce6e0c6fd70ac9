use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::constraint_of;
use chrono::Utc;
use payfleet_queue::{
    self as queue, Cancelled, Fleet, Job, JobContext, JobError, JobId, NewJob, QueueSettings,
    QueuesConfig, Registry, Scheduled, Worker, admin, prune, rescue_expired, work_until_idle,
};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Echo {
    n: i64,
}

impl Job for Echo {
    const KIND: &'static str = "echo";
    const QUEUE: &'static str = "test";
    const MAX_ATTEMPTS: i32 = 3;
}

fn settings() -> QueueSettings {
    QueueSettings {
        concurrency: 10,
        timeout_ms: 2_000,
        claimers: 1,
        fetch_cooldown_ms: 0,
        claim_batch: None,
    }
}

fn fast_config(extra: &str) -> QueuesConfig {
    leased_config(600, extra)
}

fn leased_config(lease_ms: u64, extra: &str) -> QueuesConfig {
    QueuesConfig::parse(
        &format!(
            "[fleet]\npoll_interval_ms = 10000\nlease_ms = {lease_ms}\nrescue_interval_ms = 200\nshutdown_timeout_ms = 500\n{extra}\n[queues.test]\nconcurrency = 4\ntimeout_ms = 10000\n"
        ),
        "test",
    )
    .unwrap()
}

async fn job(pool: &PgPool, id: JobId) -> (String, i32, serde_json::Value, serde_json::Value) {
    sqlx::query_as("SELECT state, attempt, payload, errors FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Whether the job's row is gone: a run that completes a job deletes it (and nothing in these
/// tests prunes).
async fn completed(pool: &PgPool, id: JobId) -> bool {
    let left: Option<i64> = sqlx::query_scalar("SELECT id FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await
        .unwrap();
    left.is_none()
}

async fn state_counts(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT state, count(*) FROM jobs GROUP BY state ORDER BY state")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A fleet with short leases and a 10 s poll over `registry`.
fn start_fleet(pool: &PgPool, registry: Registry) -> payfleet_queue::FleetHandle {
    Fleet::new(pool.clone(), registry, fast_config(""), "test").start()
}

/// Records every payload it runs.
fn recording(seen: Arc<std::sync::Mutex<Vec<i64>>>) -> Registry {
    let mut r = Registry::new();
    r.register::<Echo, _, _>(move |_ctx: JobContext, job: Echo| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(job.n);
            Ok(())
        }
    })
    .unwrap();
    r
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_job_exists_if_and_only_if_the_callers_transaction_commits(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    queue::enqueue(&mut *tx, NewJob::of(&Echo { n: 1 }).unwrap())
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(state_counts(&pool).await.is_empty());
    let mut tx = pool.begin().await.unwrap();
    queue::enqueue(&mut *tx, NewJob::of(&Echo { n: 2 }).unwrap())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(state_counts(&pool).await, vec![("available".into(), 1)]);
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_key_is_unique_among_unfinished_jobs_and_enqueue_does_not_abort_the_transaction(
    pool: PgPool,
) {
    let mut tx = pool.begin().await.unwrap();
    let first = queue::enqueue(&mut *tx, NewJob::of(&Echo { n: 1 }).unwrap().key("k"))
        .await
        .unwrap();
    let second = queue::enqueue(&mut *tx, NewJob::of(&Echo { n: 2 }).unwrap().key("k"))
        .await
        .unwrap();
    assert!(first.is_some());
    assert_eq!(second, None);
    tx.commit().await.unwrap(); // still usable after the conflict
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    work_until_idle(&pool, &recording(seen.clone()), "test", &settings())
        .await
        .unwrap();
    // Finished: the key is free again.
    assert!(
        queue::enqueue(&pool, NewJob::of(&Echo { n: 3 }).unwrap().key("k"))
            .await
            .unwrap()
            .is_some()
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_step_runs_nothing_of_a_paused_queue_until_it_is_resumed(pool: PgPool) {
    queue::enqueue(&pool, NewJob::of(&Echo { n: 1 }).unwrap())
        .await
        .unwrap();
    admin::pause(&pool, "test").await.unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let ran = work_until_idle(&pool, &recording(seen.clone()), "test", &settings())
        .await
        .unwrap();
    assert_eq!(ran, 0);
    assert!(seen.lock().unwrap().is_empty());
    assert_eq!(state_counts(&pool).await, vec![("available".into(), 1)]);
    admin::resume(&pool, "test").await.unwrap();
    let ran = work_until_idle(&pool, &recording(seen.clone()), "test", &settings())
        .await
        .unwrap();
    assert_eq!(ran, 1);
    assert_eq!(*seen.lock().unwrap(), vec![1]);
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_steps_jobs_are_still_leased_when_their_turn_comes(pool: PgPool) {
    // Four jobs claimed together, each running most of its timeout, one after another: the
    // last starts well past twice one job's timeout after the claim.
    for n in 0..4 {
        queue::enqueue(&pool, NewJob::of(&Echo { n }).unwrap())
            .await
            .unwrap();
    }
    let leased_at_start = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    let seen = leased_at_start.clone();
    registry
        .register::<Echo, _, _>(move |ctx: JobContext, job: Echo| {
            let seen = seen.clone();
            async move {
                let leased: bool = sqlx::query_scalar(
                    "SELECT state = 'running' AND lease_expires_at > clock_timestamp() FROM jobs WHERE id = $1",
                )
                .bind(ctx.id)
                .fetch_one(&ctx.pool)
                .await
                .unwrap();
                seen.lock().unwrap().push((job.n, leased));
                tokio::time::sleep(Duration::from_millis(400)).await;
                Ok(())
            }
        })
        .unwrap();
    let settings = QueueSettings {
        concurrency: 4,
        timeout_ms: 500,
        ..settings()
    };
    let ran = work_until_idle(&pool, &registry, "test", &settings)
        .await
        .unwrap();
    assert_eq!(ran, 4);
    let mut seen = leased_at_start.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![(0, true), (1, true), (2, true), (3, true)]);
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn schedule_replaces_the_waiting_job_and_the_old_one_never_runs(pool: PgPool) {
    let later = Utc::now() + chrono::Duration::hours(1);
    let a = queue::schedule(
        &pool,
        NewJob::of(&Echo { n: 1 })
            .unwrap()
            .key("order:1:expire")
            .run_at(later),
    )
    .await
    .unwrap();
    let Scheduled::Inserted(id) = a else {
        panic!("{a:?}")
    };
    let b = queue::schedule(
        &pool,
        NewJob::of(&Echo { n: 2 }).unwrap().key("order:1:expire"),
    )
    .await
    .unwrap();
    assert_eq!(b, Scheduled::Replaced(id));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    work_until_idle(&pool, &recording(seen.clone()), "test", &settings())
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![2]);
    assert!(completed(&pool, id).await);
    assert!(state_counts(&pool).await.is_empty());
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn concurrent_schedules_of_one_key_leave_exactly_one_job(pool: PgPool) {
    let tasks: Vec<_> = (0..16)
        .map(|n| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut tx = pool.begin().await.unwrap();
                queue::schedule(&mut *tx, NewJob::of(&Echo { n }).unwrap().key("k"))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
                tx.commit().await.unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(state_counts(&pool).await, vec![("available".into(), 1)]);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    work_until_idle(&pool, &recording(seen.clone()), "test", &settings())
        .await
        .unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_rolled_back_reschedule_leaves_the_old_job(pool: PgPool) {
    let Scheduled::Inserted(id) =
        queue::schedule(&pool, NewJob::of(&Echo { n: 1 }).unwrap().key("k"))
            .await
            .unwrap()
    else {
        panic!()
    };
    let mut tx = pool.begin().await.unwrap();
    queue::schedule(&mut *tx, NewJob::of(&Echo { n: 2 }).unwrap().key("k"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(job(&pool, id).await.2["n"], 1);
}

/// Job `k` (echo 1) scheduled and running in a fleet whose echo handler records each run's
/// `n` and holds the very first run until `release` is notified: (fleet, the job, release, runs).
#[allow(clippy::type_complexity)]
async fn first_run_held(
    pool: &PgPool,
) -> (
    payfleet_queue::FleetHandle,
    JobId,
    Arc<tokio::sync::Notify>,
    Arc<std::sync::Mutex<Vec<i64>>>,
) {
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let runs = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    let (s, r, seen) = (started.clone(), release.clone(), runs.clone());
    registry
        .register::<Echo, _, _>(move |_ctx: JobContext, job: Echo| {
            let (s, r, seen) = (s.clone(), r.clone(), seen.clone());
            async move {
                let first = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(job.n);
                    seen.len() == 1
                };
                if first {
                    s.notify_one();
                    r.notified().await;
                }
                Ok(())
            }
        })
        .unwrap();
    let Scheduled::Inserted(id) =
        queue::schedule(pool, NewJob::of(&Echo { n: 1 }).unwrap().key("k"))
            .await
            .unwrap()
    else {
        panic!()
    };
    let fleet = start_fleet(pool, registry);
    started.notified().await;
    (fleet, id, release, runs)
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn rescheduling_or_cancelling_a_running_job_takes_effect_when_its_run_ends(pool: PgPool) {
    let (fleet, id, release, runs) = first_run_held(&pool).await;
    let later = Utc::now() + chrono::Duration::hours(1);
    let again = queue::schedule(
        &pool,
        NewJob::of(&Echo { n: 2 }).unwrap().key("k").run_at(later),
    )
    .await
    .unwrap();
    assert_eq!(again, Scheduled::ReplacedAfterRun(id));
    release.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    fleet.shutdown().await;
    let (state, attempt, payload, _) = job(&pool, id).await;
    assert_eq!(
        (state.as_str(), attempt, payload["n"].as_i64()),
        ("available", 0, Some(2))
    );
    assert_eq!(
        *runs.lock().unwrap(),
        vec![1],
        "the new schedule waits for its time"
    );

    // Cancel: a waiting job ends at once.
    assert_eq!(
        queue::cancel(&pool, "k").await.unwrap(),
        Cancelled::Cancelled(id)
    );
    assert_eq!(job(&pool, id).await.0, "cancelled");
    assert_eq!(
        queue::cancel(&pool, "k").await.unwrap(),
        Cancelled::NotFound
    );
}

/// Waits until `done` holds (asked every 20 ms, for at most 10 s).
async fn until<F, Fut>(mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done().await {
        assert!(std::time::Instant::now() < deadline, "timed out waiting");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A handler that writes its effect (row `n` of `effects`) and completes its run in one
/// transaction; for `n` = 2 an operator's cancel arrives first, for `n` = 3 the transaction
/// rolls back.
fn completing_in_transaction() -> Registry {
    let mut r = Registry::new();
    r.register::<Echo, _, _>(|ctx: JobContext, job: Echo| async move {
        if job.n == 2 {
            assert!(matches!(
                queue::cancel(&ctx.pool, "cancelled-meanwhile")
                    .await
                    .unwrap(),
                Cancelled::AfterRun(_)
            ));
        }
        let run = ctx.run();
        let mut tx = ctx.pool.begin().await.unwrap();
        sqlx::query("INSERT INTO effects (n, txid) VALUES ($1, txid_current())")
            .bind(job.n)
            .execute(&mut *tx)
            .await
            .unwrap();
        let completed: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(
            queue::complete_runs_from("unnest($1::bigint[], $2::bigint[])"),
        ))
        .bind(vec![run.id().0])
        .bind(vec![run.lease_token()])
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        if job.n == 3 {
            tx.rollback().await.unwrap();
            return Ok(());
        }
        tx.commit().await.unwrap();
        if completed == [run.id().0] {
            run.completed();
        }
        Ok(())
    })
    .unwrap();
    r
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_run_completed_in_its_handlers_transaction_ends_with_that_commit(pool: PgPool) {
    // Every DELETE statement on the jobs, with its transaction (a statement trigger fires even
    // when no row goes): the fleet's own end of a run is one.
    for ddl in [
        "CREATE TABLE effects (n bigint PRIMARY KEY, txid bigint NOT NULL)",
        "CREATE TABLE job_deletes (txid bigint NOT NULL)",
        "CREATE FUNCTION note_job_delete() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO job_deletes VALUES (txid_current()); RETURN NULL; END $$",
        "CREATE TRIGGER note_job_delete AFTER DELETE ON jobs FOR EACH STATEMENT EXECUTE FUNCTION note_job_delete()",
    ] {
        sqlx::query(ddl).execute(&pool).await.unwrap();
    }
    let fleet = start_fleet(&pool, completing_in_transaction());
    let one = queue::enqueue(&pool, NewJob::of(&Echo { n: 1 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    until(|| completed(&pool, one)).await;
    // Time for an end of the fleet's, were one coming.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deletes: Vec<(i64, Option<i64>)> = sqlx::query_as(
        "SELECT d.txid, e.n FROM job_deletes d LEFT JOIN effects e ON e.txid = d.txid",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        deletes.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        vec![Some(1)],
        "the job's row went in its effect's transaction, and the fleet wrote no end: {deletes:?}"
    );

    // A cancel asked during the run is honoured: the row stays for the run's end, which the
    // fleet writes. A rolled-back transaction completes nothing: the fleet ends the run.
    let two = queue::enqueue(
        &pool,
        NewJob::of(&Echo { n: 2 })
            .unwrap()
            .key("cancelled-meanwhile"),
    )
    .await
    .unwrap()
    .unwrap();
    let three = queue::enqueue(&pool, NewJob::of(&Echo { n: 3 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    until(|| async { !completed(&pool, two).await && job(&pool, two).await.0 == "cancelled" })
        .await;
    until(|| completed(&pool, three)).await;
    fleet.shutdown().await;
    let effects: Vec<i64> = sqlx::query_scalar("SELECT n FROM effects ORDER BY n")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(effects, vec![1, 2], "the third's effect rolled back");
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn concurrent_claims_never_share_a_job(pool: PgPool) {
    let jobs: Vec<NewJob> = (0..200).map(|n| NewJob::of(&Echo { n }).unwrap()).collect();
    assert_eq!(queue::enqueue_many(&pool, &jobs).await.unwrap(), 200);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let registry = recording(seen.clone());
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (pool, registry) = (pool.clone(), registry.clone());
            tokio::spawn(async move {
                work_until_idle(
                    &pool,
                    &registry,
                    "test",
                    &QueueSettings {
                        concurrency: 7,
                        timeout_ms: 1000,
                        claimers: 1,
                        fetch_cooldown_ms: 0,
                        claim_batch: None,
                    },
                )
                .await
                .unwrap()
            })
        })
        .collect();
    let mut total = 0;
    for w in workers {
        total += w.await.unwrap();
    }
    assert_eq!(total, 200);
    let mut ran = seen.lock().unwrap().clone();
    ran.sort();
    assert_eq!(ran, (0..200).collect::<Vec<_>>());
}

#[derive(Debug, Serialize, Deserialize)]
struct Outcome {
    what: String,
}

impl Job for Outcome {
    const KIND: &'static str = "outcome";
    const QUEUE: &'static str = "test";
    const MAX_ATTEMPTS: i32 = 2;
}

/// Each `what` ends its run a different way.
fn outcomes() -> Registry {
    let mut r = Registry::new();
    r.register::<Outcome, _, _>(|_ctx: JobContext, job: Outcome| {
        // A panic before the future exists must be caught like one inside it.
        assert!(job.what != "sync-panic", "panicked before its future");
        async move {
            match job.what.as_str() {
                "retry" => Err(JobError::retry(std::io::Error::other("gateway timed out"))),
                "fail" => Err(JobError::fail(std::io::Error::other(
                    "card number is invalid",
                ))),
                "snooze" => Err(JobError::Snooze(Duration::from_secs(60))),
                "cancel" => Err(JobError::Cancel("order already expired".into())),
                "panic" => panic!("boom"),
                "slow" => {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok(())
                }
                // Texts and delays PostgreSQL would refuse as given.
                "nul" => Err(JobError::fail(std::io::Error::other(
                    "gateway said \0 nonsense",
                ))),
                "forever" => Err(JobError::Snooze(Duration::MAX)),
                _ => Ok(()),
            }
        }
    })
    .unwrap();
    r
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn typed_outcomes_are_stored_with_backoff_errors_and_attempts(pool: PgPool) {
    let mut ids = std::collections::HashMap::new();
    for what in ["ok", "retry", "fail", "snooze", "cancel", "panic", "slow"] {
        let id = queue::enqueue(&pool, NewJob::of(&Outcome { what: what.into() }).unwrap())
            .await
            .unwrap()
            .unwrap();
        ids.insert(what, id);
    }
    let bad = queue::enqueue(
        &pool,
        NewJob::raw("test", "outcome", serde_json::json!({"nope": 1})),
    )
    .await
    .unwrap()
    .unwrap();
    let short = QueueSettings {
        concurrency: 10,
        timeout_ms: 300,
        claimers: 1,
        fetch_cooldown_ms: 0,
        claim_batch: None,
    };
    assert_eq!(
        work_until_idle(&pool, &outcomes(), "test", &short)
            .await
            .unwrap(),
        8
    );

    let row = |id: JobId| {
        let pool = pool.clone();
        async move {
            let r: (String, i32, f64, Option<String>) = sqlx::query_as(
                "SELECT state, attempt, extract(epoch FROM run_at - now())::float8, errors -> -1 ->> 'error' FROM jobs WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
            r
        }
    };
    assert!(completed(&pool, ids["ok"]).await);
    let (state, attempt, wait, error) = row(ids["retry"]).await;
    assert_eq!((state.as_str(), attempt), ("retryable", 1));
    assert!(
        wait > 1.0 && wait < 3.0,
        "backoff about 2 s with jitter, stored in run_at: {wait}"
    );
    assert!(error.unwrap().contains("gateway timed out"));
    let (state, _, _, error) = row(ids["fail"]).await;
    assert_eq!(state, "discarded");
    assert!(error.unwrap().contains("card number is invalid"));
    let (state, attempt, wait, _) = row(ids["snooze"]).await;
    assert_eq!(
        (state.as_str(), attempt),
        ("available", 0),
        "a snooze is not an attempt"
    );
    assert!(wait > 55.0, "{wait}");
    assert_eq!(row(ids["cancel"]).await.0, "cancelled");
    let (state, _, _, error) = row(ids["panic"]).await;
    assert_eq!(state, "retryable");
    assert!(error.unwrap().contains("panicked: boom"));
    let (state, _, _, error) = row(ids["slow"]).await;
    assert_eq!(state, "retryable");
    assert!(error.unwrap().contains("timed out"));
    let (state, _, _, error) = row(bad).await;
    assert_eq!(
        state, "discarded",
        "an undecodable payload is discarded, the worker goes on"
    );
    assert!(error.unwrap().contains("does not decode"));

    // The second failure uses the last attempt: the job is dead, kept with both errors.
    sqlx::query("UPDATE jobs SET run_at = now() WHERE state = 'retryable'")
        .execute(&pool)
        .await
        .unwrap();
    work_until_idle(&pool, &outcomes(), "test", &short)
        .await
        .unwrap();
    let (state, attempt, errors): (String, i32, serde_json::Value) =
        sqlx::query_as("SELECT state, attempt, errors FROM jobs WHERE id = $1")
            .bind(ids["retry"])
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), attempt, errors.as_array().unwrap().len()),
        ("discarded", 2, 2)
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_job_that_keeps_killing_workers_ends_discarded(pool: PgPool) {
    let id = queue::enqueue(&pool, NewJob::of(&Echo { n: 1 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    for attempt in 1..=Echo::MAX_ATTEMPTS {
        // A worker claims it and dies: the lease runs out.
        sqlx::query(
            "UPDATE jobs SET state = 'running', attempt = attempt + 1, lease_token = nextval('jobs_lease_token_seq'),
                 lease_expires_at = now() - interval '1 ms', locked_by = 'doomed'
             WHERE id = $1 AND state IN ('available', 'retryable')",
        )
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
        assert_eq!(rescue_expired(&pool).await.unwrap(), 1);
        let (state, n, _, _) = job(&pool, id).await;
        assert_eq!(n, attempt);
        let expected = if attempt < Echo::MAX_ATTEMPTS {
            "retryable"
        } else {
            "discarded"
        };
        assert_eq!(state, expected);
    }
    assert_eq!(rescue_expired(&pool).await.unwrap(), 0);
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn the_fleet_runs_jobs_on_notification_and_future_jobs_on_time(pool: PgPool) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    // The poll interval is 10 s: only LISTEN/NOTIFY and the next-run timer can explain prompt starts.
    let fleet = start_fleet(&pool, recording(seen.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    queue::enqueue(&pool, NewJob::of(&Echo { n: 1 }).unwrap())
        .await
        .unwrap();
    let at = Utc::now() + chrono::Duration::milliseconds(1500);
    queue::enqueue(&pool, NewJob::of(&Echo { n: 2 }).unwrap().run_at(at))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        *seen.lock().unwrap(),
        vec![1],
        "the due job ran at once, the future one waits"
    );
    // When the future job starts, seen within 10 ms (its row is deleted once it completes).
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while seen.lock().unwrap().len() < 2 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let late = (Utc::now() - at).as_seconds_f64();
    fleet.shutdown().await;
    assert_eq!(*seen.lock().unwrap(), vec![1, 2]);
    assert!(
        (0.0..1.0).contains(&late),
        "started {late} s after its time"
    );
}

/// Jobs that arrive one at a time (a paced flow) are claimed once each: after a claim that took
/// fewer jobs than it had room for, the claimer asks whether anything else is due before it
/// claims again. It used to claim again at once, and every such claim found nothing.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn jobs_arriving_one_at_a_time_are_claimed_once_each(pool: PgPool) {
    // Every claim statement counted, those that find nothing too (a statement-level trigger
    // fires for an update of no rows).
    sqlx::raw_sql(
        "CREATE TABLE claims_seen (at timestamptz NOT NULL DEFAULT clock_timestamp());
         CREATE FUNCTION count_claims() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF current_query() LIKE '%jobs_fair_walk%' THEN
                 INSERT INTO claims_seen DEFAULT VALUES;
             END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER count_claims AFTER UPDATE ON jobs
             FOR EACH STATEMENT EXECUTE FUNCTION count_claims();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let fleet = start_fleet(&pool, recording(seen.clone()));
    // Past the start-up claim.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM claims_seen")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(before >= 1, "the trigger counts claims");
    const JOBS: usize = 10;
    for n in 0..JOBS as i64 {
        queue::enqueue(&pool, NewJob::of(&Echo { n }).unwrap())
            .await
            .unwrap();
        until(|| {
            let seen = seen.clone();
            async move { seen.lock().unwrap().len() as i64 > n }
        })
        .await;
        // The claimer is back asleep before the next arrives.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM claims_seen")
        .fetch_one(&pool)
        .await
        .unwrap();
    fleet.shutdown().await;
    let claims = (claims - before) as usize;
    assert_eq!(seen.lock().unwrap().len(), JOBS);
    assert!(
        claims <= JOBS + 1,
        "{claims} claims for {JOBS} jobs that arrived one at a time"
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_running_job_keeps_its_lease_and_a_dead_workers_job_is_rescued(pool: PgPool) {
    let runs = Arc::new(AtomicUsize::new(0));
    let mut registry = Registry::new();
    let counter = runs.clone();
    registry
        .register::<Echo, _, _>(move |_ctx: JobContext, _job: Echo| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(3750)).await; // 2.5 leases
                Ok(())
            }
        })
        .unwrap();
    let id = queue::enqueue(&pool, NewJob::of(&Echo { n: 1 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    // Left behind by a worker that died a while ago.
    let dead = queue::enqueue(
        &pool,
        NewJob::of(&Echo { n: 2 })
            .unwrap()
            .max_attempts(1)
            .run_at(Utc::now() + chrono::Duration::days(1)),
    )
    .await
    .unwrap()
    .unwrap();
    sqlx::query(
        "UPDATE jobs SET state = 'running', attempt = 1, lease_token = 1, lease_expires_at = now() - interval '1 s',
             locked_by = 'gone', run_at = now() WHERE id = $1",
    )
    .bind(dead)
    .execute(&pool)
    .await
    .unwrap();
    // A lease of 1.5 s, renewed every 0.5 s: with the tests' 0.6 s, a renewal held up for 0.2 s
    // by a machine busy with every other test binary could give the job up to run again.
    let fleet = Fleet::new(pool.clone(), registry, leased_config(1500, ""), "test").start();
    // Until both are done, however slow the machine: the assertions below are about how.
    crate::wait_for(
        "the long job done and the dead one rescued",
        Duration::from_secs(30),
        async || completed(&pool, id).await && job(&pool, dead).await.0 == "discarded",
    )
    .await;
    fleet.shutdown().await;
    let (state, attempt, _, errors) = job(&pool, dead).await;
    assert_eq!(state, "discarded", "rescued; its only attempt is used up");
    assert_eq!(attempt, 1);
    assert!(
        errors[0]["error"]
            .as_str()
            .unwrap()
            .contains("worker gone stopped renewing")
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "renewed leases: the long job ran once"
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn shutdown_finishes_short_jobs_and_releases_long_ones(pool: PgPool) {
    let short = queue::enqueue(&pool, NewJob::of(&Outcome { what: "ok".into() }).unwrap())
        .await
        .unwrap()
        .unwrap();
    let long = queue::enqueue(
        &pool,
        NewJob::of(&Outcome {
            what: "slow".into(),
        })
        .unwrap(),
    )
    .await
    .unwrap()
    .unwrap();
    let fleet = start_fleet(&pool, outcomes());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let t = std::time::Instant::now();
    fleet.shutdown().await;
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "stopped within the deadline"
    );
    assert!(completed(&pool, short).await);
    let (state, attempt, _, _) = job(&pool, long).await;
    assert_eq!(
        (state.as_str(), attempt),
        ("available", 0),
        "released for another worker, not counted"
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn finished_jobs_are_pruned_after_their_retention(pool: PgPool) {
    // Completed rows as versions before migration 0030 left them (a completed job is deleted
    // now, and the schema refuses to write one).
    sqlx::query("ALTER TABLE jobs DROP CONSTRAINT jobs_completed_are_deleted")
        .execute(&pool)
        .await
        .unwrap();
    for (state, age_hours) in [
        ("completed", 48),
        ("completed", 1),
        ("cancelled", 48),
        ("discarded", 48),
        ("discarded", 24 * 8),
    ] {
        sqlx::query(
            "INSERT INTO jobs (queue, kind, state, finished_at) VALUES ('test', 'echo', $1, now() - $2 * interval '1 hour')",
        )
        .bind(state)
        .bind(age_hours as f64)
        .execute(&pool)
        .await
        .unwrap();
    }
    sqlx::query(
        "ALTER TABLE jobs ADD CONSTRAINT jobs_completed_are_deleted CHECK (state <> 'completed') NOT VALID",
    )
    .execute(&pool)
    .await
    .unwrap();
    queue::enqueue(&pool, NewJob::of(&Echo { n: 1 }).unwrap())
        .await
        .unwrap();
    assert_eq!(prune(&pool, 24 * 3600, 7 * 24 * 3600).await.unwrap(), 3);
    assert_eq!(
        state_counts(&pool).await,
        vec![
            ("available".into(), 1),
            ("completed".into(), 1),
            ("discarded".into(), 1)
        ]
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn operators_see_counts_and_dead_jobs_and_can_retry_or_discard(pool: PgPool) {
    let dead = queue::enqueue(
        &pool,
        NewJob::of(&Outcome {
            what: "fail".into(),
        })
        .unwrap(),
    )
    .await
    .unwrap()
    .unwrap();
    let waiting = queue::enqueue(
        &pool,
        NewJob::of(&Echo { n: 1 })
            .unwrap()
            .run_at(Utc::now() + chrono::Duration::hours(1)),
    )
    .await
    .unwrap()
    .unwrap();
    work_until_idle(&pool, &outcomes(), "test", &settings())
        .await
        .unwrap();
    let counts = admin::counts(&pool).await.unwrap();
    assert_eq!(
        counts
            .iter()
            .map(|c| (c.state.as_str(), c.count))
            .collect::<Vec<_>>(),
        vec![("available", 1), ("discarded", 1)]
    );
    let listed = admin::dead(&pool, Some("test"), 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("card number is invalid")
    );

    admin::retry(&pool, dead).await.unwrap();
    assert_eq!(job(&pool, dead).await.0, "available");
    assert!(matches!(
        admin::retry(&pool, dead).await,
        Err(admin::AdminError::WrongState { .. })
    ));
    admin::discard(&pool, waiting).await.unwrap();
    assert_eq!(job(&pool, waiting).await.0, "discarded");
    assert!(matches!(
        admin::discard(&pool, JobId(999_999)).await,
        Err(admin::AdminError::NotFound(_))
    ));
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn the_schema_refuses_inconsistent_states(pool: PgPool) {
    for (bad, constraint) in [
        (
            "INSERT INTO jobs (queue, kind, state) VALUES ('q', 'k', 'running')",
            "jobs_lease_iff_running",
        ),
        (
            "INSERT INTO jobs (queue, kind, state) VALUES ('q', 'k', 'discarded')",
            "jobs_finished_iff_final",
        ),
        (
            "INSERT INTO jobs (queue, kind, state, finished_at) VALUES ('q', 'k', 'completed', now())",
            "jobs_completed_are_deleted",
        ),
        (
            "INSERT INTO jobs (queue, kind, state) VALUES ('q', 'k', 'exploded')",
            "jobs_state_valid",
        ),
        (
            "INSERT INTO jobs (queue, kind, attempt, max_attempts) VALUES ('q', 'k', 3, 2)",
            "jobs_attempts_valid",
        ),
        (
            "INSERT INTO jobs (queue, kind, pending) VALUES ('q', 'k', 'cancel')",
            "jobs_pending_only_while_running",
        ),
    ] {
        let e = sqlx::query(bad).execute(&pool).await.unwrap_err();
        assert_eq!(constraint_of(&e), Some(constraint), "{bad}: {e}");
    }
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn an_unknown_run_outcome_raises_instead_of_discarding_the_job(pool: PgPool) {
    let e = sqlx::query_scalar::<_, String>("SELECT jobs_next_state(NULL, $1, 1, 3)")
        .bind("exploded")
        .fetch_one(&pool)
        .await
        .unwrap_err();
    let sqlx::Error::Database(db) = &e else {
        panic!("{e}")
    };
    assert_eq!(db.code().as_deref(), Some("22023"), "{e}");
    assert!(e.to_string().contains("unknown run end"), "{e}");
    // Every known outcome still maps, inlined or not.
    for (outcome, attempt, want) in [
        ("complete", 1, "completed"),
        ("retry", 1, "retryable"),
        ("retry", 3, "discarded"),
        ("fail", 1, "discarded"),
        ("snooze", 1, "available"),
        ("cancel", 1, "cancelled"),
        ("release", 1, "available"),
    ] {
        let got: String = sqlx::query_scalar("SELECT jobs_next_state(NULL, $1, $2, 3)")
            .bind(outcome)
            .bind(attempt)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(got, want, "{outcome}");
    }
}

#[test]
fn registering_a_kind_twice_is_an_error() {
    let mut r = Registry::new();
    r.register::<Echo, _, _>(|_c: JobContext, _j: Echo| async { Ok(()) })
        .unwrap();
    assert!(matches!(
        r.register::<Echo, _, _>(|_c: JobContext, _j: Echo| async { Ok(()) }),
        Err(payfleet_queue::RegistryError::Duplicate("echo"))
    ));
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_job_cancelled_while_running_ends_cancelled_whatever_its_outcome(pool: PgPool) {
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let mut registry = Registry::new();
    let (s, r) = (started.clone(), release.clone());
    registry
        .register::<Echo, _, _>(move |_ctx: JobContext, _job: Echo| {
            let (s, r) = (s.clone(), r.clone());
            async move {
                s.notify_one();
                r.notified().await;
                Err(JobError::retry(std::io::Error::other("would have retried")))
            }
        })
        .unwrap();
    let Scheduled::Inserted(id) =
        queue::schedule(&pool, NewJob::of(&Echo { n: 1 }).unwrap().key("k"))
            .await
            .unwrap()
    else {
        panic!()
    };
    let fleet = start_fleet(&pool, registry);
    started.notified().await;
    assert_eq!(
        queue::cancel(&pool, "k").await.unwrap(),
        Cancelled::AfterRun(id)
    );
    release.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    fleet.shutdown().await;
    assert_eq!(job(&pool, id).await.0, "cancelled");
}

/// Work that arrives after an operator cancelled the running job is new work: it must not be
/// dropped with the cancelled run.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn work_arriving_after_a_running_job_was_cancelled_runs_when_that_run_ends(pool: PgPool) {
    let (fleet, id, release, runs) = first_run_held(&pool).await;
    assert_eq!(
        queue::cancel(&pool, "k").await.unwrap(),
        Cancelled::AfterRun(id)
    );
    let marked = queue::enqueue_or_rerun(&pool, &[NewJob::of(&Echo { n: 1 }).unwrap().key("k")])
        .await
        .unwrap();
    assert_eq!(marked, 1, "the running job is marked to run again");
    release.notify_one();
    until(|| async { runs.lock().unwrap().len() == 2 }).await;
    until(|| completed(&pool, id)).await;
    fleet.shutdown().await;
    assert_eq!(*runs.lock().unwrap(), vec![1, 1]);
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_queue_never_runs_more_than_its_concurrency(pool: PgPool) {
    // With one claim loop, and with as many as the queue has slots (they share the slots).
    for claimers in [1, 3] {
        let now = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let mut registry = Registry::new();
        let (n, p) = (now.clone(), peak.clone());
        registry
            .register::<Echo, _, _>(move |_ctx: JobContext, _job: Echo| {
                let (n, p) = (n.clone(), p.clone());
                async move {
                    let running = n.fetch_add(1, Ordering::SeqCst) + 1;
                    p.fetch_max(running, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    n.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            })
            .unwrap();
        let jobs: Vec<NewJob> = (0..12).map(|n| NewJob::of(&Echo { n }).unwrap()).collect();
        queue::enqueue_many(&pool, &jobs).await.unwrap();
        let config = QueuesConfig::parse(
            &format!(
                "[fleet]\npoll_interval_ms = 50\n[queues.test]\nconcurrency = 3\ntimeout_ms = 5000\nclaimers = {claimers}\n"
            ),
            "t",
        )
        .unwrap();
        let fleet = Fleet::new(pool.clone(), registry, config, "test").start();
        tokio::time::sleep(Duration::from_millis(900)).await;
        fleet.shutdown().await;
        assert!(
            state_counts(&pool).await.is_empty(),
            "all 12 completed ({claimers} claimers)"
        );
        assert_eq!(peak.load(Ordering::SeqCst), 3, "{claimers} claimers");
    }
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_queue_claims_at_most_its_own_claim_batch_and_still_fills_its_slots(pool: PgPool) {
    // Every run waits until released, so the jobs stay claimed, each with its claim's time.
    let release = Arc::new(tokio::sync::Notify::new());
    let mut registry = Registry::new();
    let r = release.clone();
    registry
        .register::<Echo, _, _>(move |_ctx: JobContext, _job: Echo| {
            let r = r.clone();
            async move {
                r.notified().await;
                Ok(())
            }
        })
        .unwrap();
    let jobs: Vec<NewJob> = (0..10).map(|n| NewJob::of(&Echo { n }).unwrap()).collect();
    queue::enqueue_many(&pool, &jobs).await.unwrap();
    let config = QueuesConfig::parse(
        "[fleet]\npoll_interval_ms = 50\nclaim_batch = 500\n[queues.test]\nconcurrency = 10\ntimeout_ms = 5000\nclaim_batch = 3\n",
        "t",
    )
    .unwrap();
    let fleet = Fleet::new(pool.clone(), registry, config, "test").start();
    let mut claims: Vec<i64> = Vec::new();
    for _ in 0..100 {
        // One claim is one statement: its jobs share `attempted_at`, its transaction's time.
        claims = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE state = 'running' GROUP BY attempted_at ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        if claims.iter().sum::<i64>() == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    release.notify_waiters();
    fleet.shutdown().await;
    assert_eq!(
        claims.iter().sum::<i64>(),
        10,
        "every slot filled: {claims:?}"
    );
    assert!(
        claims.iter().all(|&n| n <= 3),
        "no claim took more than the queue's 3 (the fleet's cap is 500): {claims:?}"
    );
    assert_eq!(claims.len(), 4, "3 + 3 + 3 + 1: {claims:?}");
}

#[test]
fn a_queue_claim_batch_of_zero_is_refused() {
    let e = QueuesConfig::parse(
        "[queues.test]\nconcurrency = 10\ntimeout_ms = 5000\nclaim_batch = 0\n",
        "t",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("queue test: claim_batch must be at least 1"),
        "{e}"
    );
}

/// A job due far ahead wakes no worker (a notifying commit takes PostgreSQL's database-wide
/// notification lock); one due now does, whichever call wrote it.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn only_jobs_due_soon_notify_the_workers(pool: PgPool) {
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener.listen("payfleet_jobs").await.unwrap();
    let later = Utc::now() + chrono::Duration::hours(1);
    async fn heard(l: &mut sqlx::postgres::PgListener) -> Option<String> {
        tokio::time::timeout(Duration::from_millis(300), l.recv())
            .await
            .map(|n| n.unwrap().payload().to_owned())
            .ok()
    }
    queue::schedule(
        &pool,
        NewJob::of(&Echo { n: 1 }).unwrap().key("a").run_at(later),
    )
    .await
    .unwrap();
    queue::enqueue(&pool, NewJob::of(&Echo { n: 2 }).unwrap().run_at(later))
        .await
        .unwrap();
    assert_eq!(
        heard(&mut listener).await,
        None,
        "far ahead: no notification"
    );
    // Nor a waiting job moved further ahead (replaced), nor one retried for later.
    let later_still = later + chrono::Duration::hours(1);
    queue::schedule(
        &pool,
        NewJob::of(&Echo { n: 1 })
            .unwrap()
            .key("a")
            .run_at(later_still),
    )
    .await
    .unwrap();
    sqlx::query("UPDATE jobs SET run_at = $1 WHERE key IS NULL")
        .bind(later_still)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        heard(&mut listener).await,
        None,
        "moved ahead: no notification"
    );
    // Moved to now: the workers must hear of it.
    queue::schedule(&pool, NewJob::of(&Echo { n: 1 }).unwrap().key("a"))
        .await
        .unwrap();
    assert_eq!(heard(&mut listener).await.as_deref(), Some("test"));
    queue::enqueue(&pool, NewJob::of(&Echo { n: 3 }).unwrap())
        .await
        .unwrap();
    assert_eq!(heard(&mut listener).await.as_deref(), Some("test"));
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn without_a_notification_polling_still_finds_the_job(pool: PgPool) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let config = QueuesConfig::parse(
        "[fleet]\npoll_interval_ms = 300\n[queues.test]\nconcurrency = 2\ntimeout_ms = 5000\n",
        "t",
    )
    .unwrap();
    let fleet = Fleet::new(pool.clone(), recording(seen.clone()), config, "test").start();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Written behind the queue's back: no NOTIFY.
    sqlx::query("INSERT INTO jobs (queue, kind, payload) VALUES ('test', 'echo', '{\"n\": 7}')")
        .execute(&pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    fleet.shutdown().await;
    assert_eq!(*seen.lock().unwrap(), vec![7]);
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn the_listener_reconnects_by_itself(pool: PgPool) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    // A 10 s poll: a prompt start can only come from a notification.
    let fleet = start_fleet(&pool, recording(seen.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()) t",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "the listener's connection was found and cut");
    tokio::time::sleep(Duration::from_millis(1500)).await; // reconnect with backoff
    queue::enqueue(&pool, NewJob::of(&Echo { n: 9 }).unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(*seen.lock().unwrap(), vec![9]);
    fleet.shutdown().await;
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn ends_postgres_would_refuse_as_given_are_still_written(pool: PgPool) {
    let registry = outcomes();
    let mut ids = Vec::new();
    for what in ["nul", "forever", "sync-panic", "ok"] {
        ids.push(
            queue::enqueue(&pool, NewJob::of(&Outcome { what: what.into() }).unwrap())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    // A lease long enough that a loaded machine never has these runs rescued (a rescue would add
    // its own error before the ones this test reads).
    let config = QueuesConfig::parse(
        "[fleet]\npoll_interval_ms = 10000\nlease_ms = 10000\nrescue_interval_ms = 200\nshutdown_timeout_ms = 500\n[queues.test]\nconcurrency = 4\ntimeout_ms = 5000\n",
        "test",
    )
    .unwrap();
    let fleet = Fleet::new(pool.clone(), registry, config, "test").start();
    // Every run ended (a loaded machine may take more than a moment), then stop.
    let started = std::time::Instant::now();
    loop {
        // nul discarded, forever snoozed a year, sync-panic waiting for its retry, ok completed
        // (its row deleted).
        let states: Vec<(String, bool)> = sqlx::query_as(
            "SELECT state, run_at > now() + interval '300 days' FROM jobs WHERE id = ANY($1) ORDER BY id",
        )
        .bind(ids.iter().map(|id| id.0).collect::<Vec<i64>>())
        .fetch_all(&pool)
        .await
        .unwrap();
        let ended = states
            == [
                ("discarded".to_owned(), false),
                ("available".to_owned(), true),
                ("retryable".to_owned(), false),
            ];
        if ended || started.elapsed() > Duration::from_secs(15) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fleet.shutdown().await;

    let (state, _, _, errors) = job(&pool, ids[0]).await;
    assert_eq!(state, "discarded");
    assert_eq!(errors[0]["error"], "gateway said  nonsense");
    let days: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM run_at - now())::float8 / 86400 FROM jobs WHERE id = $1",
    )
    .bind(ids[1])
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        (364.0..366.0).contains(&days),
        "a snooze is capped at a year: {days}"
    );
    let (state, _, _, errors) = job(&pool, ids[2]).await;
    assert_eq!(state, "retryable");
    assert!(
        errors[0]["error"]
            .as_str()
            .unwrap()
            .contains("panicked before its future"),
        "{errors}"
    );
    assert!(
        completed(&pool, ids[3]).await,
        "the others in the batch were written"
    );
}

/// Counts runs per payload and notes runs that were stopped before they finished.
#[derive(Default)]
struct RunLog {
    runs: std::sync::Mutex<std::collections::HashMap<i64, usize>>,
    cut_short: std::sync::Mutex<Vec<i64>>,
}

struct CutShort(Arc<RunLog>, i64, bool);

impl Drop for CutShort {
    fn drop(&mut self) {
        if !self.2 {
            self.0.cut_short.lock().unwrap().push(self.1);
        }
    }
}

/// Echo jobs that take `ms` to run, logged in `log`.
fn slow(log: Arc<RunLog>, ms: u64) -> Registry {
    let mut r = Registry::new();
    r.register::<Echo, _, _>(move |_ctx: JobContext, job: Echo| {
        let log = log.clone();
        async move {
            *log.runs.lock().unwrap().entry(job.n).or_default() += 1;
            let mut guard = CutShort(log.clone(), job.n, false);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            guard.2 = true;
            Ok(())
        }
    })
    .unwrap();
    r
}

/// Enqueues an Echo job per payload and starts a fleet (leases of `lease_ms`) whose runs take
/// `ms`; returns once they all run.
async fn running_slowly(
    pool: &PgPool,
    log: &Arc<RunLog>,
    lease_ms: u64,
    ms: u64,
    payloads: &[i64],
) -> (Vec<JobId>, payfleet_queue::FleetHandle) {
    let mut ids = Vec::new();
    for n in payloads {
        ids.push(
            queue::enqueue(pool, NewJob::of(&Echo { n: *n }).unwrap())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let fleet = Fleet::new(
        pool.clone(),
        slow(log.clone(), ms),
        leased_config(lease_ms, ""),
        "test",
    )
    .start();
    wait_running(pool, payloads.len() as i64).await;
    (ids, fleet)
}

async fn wait_running(pool: &PgPool, n: i64) {
    for _ in 0..200 {
        let running: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'")
            .fetch_one(pool)
            .await
            .unwrap();
        if running == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the jobs did not start");
}

/// A transaction holding the job's row locked, as a business transaction that reschedules or
/// cancels its key does until it commits.
async fn hold_row(pool: &PgPool, id: JobId) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM jobs WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_row_locked_by_another_transaction_does_not_hold_up_other_runs_ends(pool: PgPool) {
    let log = Arc::new(RunLog::default());
    // Leases of 600 ms; each run takes 150 ms, so both end while A's row is held.
    let (ids, fleet) = running_slowly(&pool, &log, 600, 150, &[1, 2]).await;
    let (a, b) = (ids[0], ids[1]);

    // A business transaction holds A's row (a schedule or cancel of its key, say). Ends are
    // first written without locking their rows beforehand; that statement must not wait for
    // this one: B's end is written meanwhile, A's once the row is free.
    let tx = hold_row(&pool, a).await;
    crate::wait_for(
        "B's end, written while A's row is held",
        Duration::from_millis(400),
        async || completed(&pool, b).await,
    )
    .await;
    assert_eq!(
        job(&pool, a).await.0,
        "running",
        "A's end waits for its row"
    );
    tx.commit().await.unwrap();
    crate::wait_for(
        "A's end, once its row is free",
        Duration::from_secs(5),
        async || completed(&pool, a).await,
    )
    .await;
    fleet.shutdown().await;
    assert_eq!(
        *log.runs.lock().unwrap(),
        [(1, 1), (2, 1)].into_iter().collect(),
        "each ran once"
    );
    assert!(
        log.cut_short.lock().unwrap().is_empty(),
        "no run was cut short"
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_row_locked_by_another_transaction_does_not_hold_up_other_renewals(pool: PgPool) {
    let log = Arc::new(RunLog::default());
    // Leases of 2 s (renewed every 2/3 s, each renewal given 0.5 s: a loaded test machine
    // must not miss one for B); each run takes 7 s.
    let (ids, fleet) = running_slowly(&pool, &log, 2000, 7000, &[1, 2]).await;
    let (a, b) = (ids[0], ids[1]);

    // A long business transaction holds A's row (a schedule or cancel of its key, say) for
    // longer than a lease.
    let tx = hold_row(&pool, a).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let b_lease_left: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM lease_expires_at - now())::float8 FROM jobs WHERE id = $1",
    )
    .bind(b)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        b_lease_left > 0.0,
        "B's lease was renewed meanwhile ({b_lease_left} s left)"
    );
    tx.commit().await.unwrap();

    // B ran once, to its end. A could not be renewed for a whole lease: it was stopped (another
    // worker could have taken it), and runs again later.
    for _ in 0..200 {
        if completed(&pool, b).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fleet.shutdown().await;
    assert!(completed(&pool, b).await, "B completed");
    assert_eq!(
        log.runs.lock().unwrap().get(&2),
        Some(&1),
        "B never ran twice"
    );
    // A's next run (after its backoff) may still be running at the shutdown, which stops it too.
    let cut_short = log.cut_short.lock().unwrap().clone();
    assert!(
        cut_short.first() == Some(&1) && !cut_short.contains(&2),
        "only A was stopped: {cut_short:?}"
    );
    let (a_state, _, _, errors) = job(&pool, a).await;
    assert!(
        matches!(a_state.as_str(), "retryable" | "available"),
        "{a_state}"
    );
    // Its attempt ended as the worker wrote it, or as the rescuer did: whichever reached the row
    // first once the transaction let go of it (both wait for it).
    let error = errors[0]["error"].as_str().unwrap();
    assert!(
        error.contains("could not be renewed in time") || error.contains("stopped renewing it"),
        "{errors}"
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_run_whose_job_another_worker_took_is_cancelled_and_its_end_refused(pool: PgPool) {
    let log = Arc::new(RunLog::default());
    let (ids, fleet) = running_slowly(&pool, &log, 600, 5000, &[7]).await;
    let id = ids[0];

    // Another worker holds the job now (as after a rescue and a new claim).
    sqlx::query(
        "UPDATE jobs SET lease_token = nextval('jobs_lease_token_seq'), locked_by = 'other-worker',
             lease_expires_at = now() + interval '1 hour' WHERE id = $1",
    )
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    for _ in 0..100 {
        if !log.cut_short.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        *log.cut_short.lock().unwrap(),
        vec![7],
        "the run was told to stop"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    fleet.shutdown().await;
    // Its end was refused by the fencing token: the other worker's run is untouched.
    let (state, locked_by): (String, String) =
        sqlx::query_as("SELECT state, locked_by FROM jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), locked_by.as_str()),
        ("running", "other-worker")
    );
}

// ---- fairness between sellers -----------------------------------------------------------------

/// Waits (up to 90 s: a loaded test machine) until `done` says so about the runs seen.
async fn until_seen(seen: &Arc<std::sync::Mutex<Vec<i64>>>, done: impl Fn(&[i64]) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while !done(&seen.lock().unwrap()) {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out; {} runs seen",
            seen.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_sellers_job_starts_next_behind_another_sellers_flood_of_100_000(pool: PgPool) {
    for chunk in (0..100_000i64).collect::<Vec<_>>().chunks(20_000) {
        let flood: Vec<NewJob> = chunk
            .iter()
            .map(|&n| NewJob::of(&Echo { n }).unwrap().fairness_key("seller-a"))
            .collect();
        queue::enqueue_many(&pool, &flood).await.unwrap();
    }
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let fleet = start_fleet(&pool, recording(seen.clone()));
    until_seen(&seen, |s| s.len() >= 200).await;

    let b = queue::enqueue(
        &pool,
        NewJob::of(&Echo { n: -1 })
            .unwrap()
            .fairness_key("seller-b"),
    )
    .await
    .unwrap()
    .unwrap();
    // B has arrived once its enqueue committed (on a loaded machine the commit alone can take
    // long enough for several of A's claims).
    let before = seen.lock().unwrap().len();
    until_seen(&seen, |s| s.contains(&-1)).await;
    fleet.shutdown().await;

    // Oldest-first, B's job would have waited for the ~99,800 of A's still queued. Fair, it
    // waits for the runs already under way (4 slots) and at most one claim made before it
    // arrived; the claim after that is shared between A and B.
    let ran_before_b = seen
        .lock()
        .unwrap()
        .iter()
        .position(|&n| n == -1)
        .unwrap()
        .saturating_sub(before);
    assert!(
        ran_before_b <= 12,
        "{ran_before_b} of A's jobs started between B's arrival and B's start"
    );
    assert!(completed(&pool, b).await);
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE fairness_key = 'seller-a' AND state = 'available'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        waiting > 90_000,
        "the flood is still mostly waiting ({waiting})"
    );
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn claims_take_turns_between_sellers_and_the_jobs_without_one(pool: PgPool) {
    // Three sellers and the unkeyed jobs, 20 each, all enqueued group after group.
    let mut jobs = Vec::new();
    for group in 0..4i64 {
        for i in 0..20 {
            let job = NewJob::of(&Echo {
                n: group * 1000 + i,
            })
            .unwrap();
            jobs.push(match group {
                3 => job,
                _ => job.fairness_key(format!("seller-{group}")),
            });
        }
    }
    queue::enqueue_many(&pool, &jobs).await.unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let ran = work_until_idle(&pool, &recording(seen.clone()), "test", &settings())
        .await
        .unwrap();
    assert_eq!(ran, 80);
    let order = seen.lock().unwrap().clone();
    // Every claim of 10 is shared between the four groups: after each claim, no group is
    // more than one claim's share (2) ahead of another, though they were enqueued in turn.
    let mut per_group = [0usize; 4];
    for (i, n) in order.iter().enumerate() {
        per_group[(n / 1000) as usize] += 1;
        if (i + 1) % 8 == 0 {
            let (lo, hi) = (
                per_group.iter().min().unwrap(),
                per_group.iter().max().unwrap(),
            );
            assert!(
                hi - lo <= 2,
                "after {} runs: {per_group:?} ({order:?})",
                i + 1
            );
        }
    }
    // Within a group, the oldest first.
    for group in 0..4 {
        let runs: Vec<i64> = order
            .iter()
            .copied()
            .filter(|n| n / 1000 == group)
            .collect();
        let mut sorted = runs.clone();
        sorted.sort();
        assert_eq!(runs, sorted);
    }
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn sellers_whose_jobs_all_wait_for_later_do_not_hide_a_due_one(pool: PgPool) {
    // 300 sellers whose only job waits for a retry in an hour, then one seller with a due
    // job, sorted after them all: more than one claim's walk (256 groups) away.
    sellers_waiting_for_later(&pool, 300).await;
    let due = queue::enqueue(
        &pool,
        NewJob::of(&Echo { n: -1 }).unwrap().fairness_key("zzz"),
    )
    .await
    .unwrap()
    .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let one_slot = QueueSettings {
        concurrency: 1,
        timeout_ms: 2_000,
        claimers: 1,
        fetch_cooldown_ms: 0,
        claim_batch: None,
    };
    let ran = tokio::time::timeout(
        Duration::from_secs(20),
        work_until_idle(&pool, &recording(seen.clone()), "test", &one_slot),
    )
    .await
    .expect("the walk went on past the sellers with nothing due")
    .unwrap();
    assert_eq!(ran, 1);
    assert_eq!(*seen.lock().unwrap(), vec![-1]);
    assert!(completed(&pool, due).await);
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn an_empty_or_overlong_fairness_key_is_refused_and_nothing_is_written(pool: PgPool) {
    for key in [String::new(), "s".repeat(201)] {
        let len = key.len();
        let err = queue::enqueue(&pool, NewJob::of(&Echo { n: 1 }).unwrap().fairness_key(key))
            .await
            .unwrap_err();
        assert!(
            matches!(err, queue::QueueError::InvalidFairnessKey(n) if n == len),
            "{err}"
        );
    }
    assert!(state_counts(&pool).await.is_empty());
}

/// A completion deletes its job, unless a schedule or cancel of the job's key marked it while it
/// ran. The mark may commit while the completion waits for the row: the completion then reads
/// the row again and keeps the job (to run again, or cancelled), instead of deleting the work
/// the schedule asked for.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_schedule_committed_while_a_completion_waits_for_the_row_keeps_the_job(pool: PgPool) {
    for (mark, want) in [("schedule", "available"), ("cancel", "cancelled")] {
        let key = format!("order:{mark}:expire");
        let Scheduled::Inserted(id) =
            queue::schedule(&pool, NewJob::of(&Echo { n: 1 }).unwrap().key(&key))
                .await
                .unwrap()
        else {
            panic!()
        };
        // Claimed by a worker (as the claim writes it).
        let token: i64 = sqlx::query_scalar(
            "UPDATE jobs SET state = 'running', attempt = 1, lease_token = nextval('jobs_lease_token_seq'),
                 lease_expires_at = now() + interval '1 minute', locked_by = 'w'
             WHERE id = $1 RETURNING lease_token",
        )
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();

        // A business transaction marks the running job, and holds its row until it commits.
        let mut tx = pool.begin().await.unwrap();
        if mark == "schedule" {
            let again = queue::schedule(&mut *tx, NewJob::of(&Echo { n: 2 }).unwrap().key(&key))
                .await
                .unwrap();
            assert_eq!(again, Scheduled::ReplacedAfterRun(id));
        } else {
            let cancelled = queue::cancel(&mut *tx, &key).await.unwrap();
            assert_eq!(cancelled, Cancelled::AfterRun(id));
        }

        // The run completes meanwhile: its end waits for the row (no skipping).
        let end = {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut conn = pool.acquire().await.unwrap();
                sqlx::query("SET lock_timeout = '10s'")
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                let ended: Vec<(i64, String)> = sqlx::query_as(
                    "SELECT job_id, new_state FROM jobs_end_runs($1, $2, ARRAY['complete'], ARRAY[NULL::bigint], ARRAY[NULL::text], false)",
                )
                .bind(vec![id.0])
                .bind(vec![token])
                .fetch_all(&mut *conn)
                .await
                .unwrap();
                ended
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!end.is_finished(), "the end waits for the marked row");
        tx.commit().await.unwrap();

        let ended = end.await.unwrap();
        assert_eq!(ended, [(id.0, want.to_owned())], "{mark}");
        // A reschedule runs the new payload from attempt 0; a cancel keeps the run's attempt.
        let (want_attempt, want_n) = if mark == "schedule" { (0, 2) } else { (1, 1) };
        let (state, attempt, payload, _) = job(&pool, id).await;
        assert_eq!(
            (state.as_str(), attempt, payload["n"].as_i64()),
            (want, want_attempt, Some(want_n)),
            "{mark}: kept, not deleted"
        );
    }
}

/// A worker holding what its jobs need: the payloads it has seen, and a limit below which it
/// snoozes a job instead of running it.
struct Collector {
    seen: Arc<std::sync::Mutex<Vec<i64>>>,
    snooze_below: i64,
}

impl Worker<Echo> for Collector {
    async fn work(&self, _ctx: JobContext, job: Echo) -> Result<(), JobError> {
        if job.n < self.snooze_below {
            return Err(JobError::Snooze(Duration::from_secs(3600)));
        }
        self.seen.lock().unwrap().push(job.n);
        Ok(())
    }
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_worker_given_at_registration_runs_its_kind_with_what_it_holds(pool: PgPool) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    registry
        .add::<Echo, _>(Collector {
            seen: seen.clone(),
            snooze_below: 10,
        })
        .unwrap();
    assert!(matches!(
        registry.add::<Echo, _>(Collector {
            seen: seen.clone(),
            snooze_below: 0,
        }),
        Err(payfleet_queue::RegistryError::Duplicate("echo"))
    ));
    queue::enqueue_many(
        &pool,
        &[
            NewJob::of(&Echo { n: 5 }).unwrap(),
            NewJob::of(&Echo { n: 20 }).unwrap(),
        ],
    )
    .await
    .unwrap();
    work_until_idle(&pool, &registry, "test", &settings())
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![20]);
    // The snoozed job waits, its attempt not spent.
    let (state, attempt): (String, i32) =
        sqlx::query_as("SELECT state, attempt FROM jobs WHERE payload ->> 'n' = '5'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempt), ("available", 0));
}

/// A paused queue is not claimed from by a running fleet (it reads the pauses twice a second);
/// resumed, its waiting jobs run.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_paused_queue_waits_until_it_is_resumed(pool: PgPool) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handle = start_fleet(&pool, recording(seen.clone()));
    admin::pause(&pool, "test").await.unwrap();
    // Within a second every worker knows.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        admin::paused(&pool)
            .await
            .unwrap()
            .iter()
            .map(|(q, _)| q.as_str())
            .collect::<Vec<_>>(),
        ["test"]
    );
    let id = queue::enqueue(&pool, NewJob::of(&Echo { n: 7 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(seen.lock().unwrap().is_empty(), "a paused queue's job ran");
    assert_eq!(job(&pool, id).await.0, "available");

    admin::resume(&pool, "test").await.unwrap();
    crate::wait_for(
        "the job to run once the queue is resumed",
        Duration::from_secs(3),
        async || seen.lock().unwrap().contains(&7),
    )
    .await;
    assert!(admin::paused(&pool).await.unwrap().is_empty());
    handle.shutdown().await;
}

/// A worker started while its queue is paused (a deploy during an incident) claims nothing from
/// it: it reads the pauses before its first claim, not after.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_worker_started_while_its_queue_is_paused_claims_nothing(pool: PgPool) {
    admin::pause(&pool, "test").await.unwrap();
    let id = queue::enqueue(&pool, NewJob::of(&Echo { n: 7 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handle = start_fleet(&pool, recording(seen.clone()));
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(seen.lock().unwrap().is_empty(), "a paused queue's job ran");
    assert_eq!(job(&pool, id).await.0, "available");
    admin::resume(&pool, "test").await.unwrap();
    crate::wait_for(
        "the job to run once the queue is resumed",
        Duration::from_secs(3),
        async || seen.lock().unwrap().contains(&7),
    )
    .await;
    handle.shutdown().await;
}

/// A worker that cannot read the paused queues (here the table is out of its way; in life its
/// bookkeeping connections refused, or the table not granted) claims nothing and does not say
/// it is ready; once it can read them, it claims and is.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_worker_that_cannot_read_the_pauses_claims_nothing_and_is_not_ready(pool: PgPool) {
    sqlx::query("ALTER TABLE queue_pauses RENAME TO queue_pauses_away")
        .execute(&pool)
        .await
        .unwrap();
    let id = queue::enqueue(&pool, NewJob::of(&Echo { n: 8 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handle = start_fleet(&pool, recording(seen.clone()));
    let probe = handle.probe();
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(probe.is_running());
    assert!(!probe.is_claiming(), "ready without knowing the pauses");
    assert!(
        seen.lock().unwrap().is_empty(),
        "a job ran before the pauses were read"
    );
    assert_eq!(job(&pool, id).await.0, "available");
    sqlx::query("ALTER TABLE queue_pauses_away RENAME TO queue_pauses")
        .execute(&pool)
        .await
        .unwrap();
    crate::wait_for(
        "the job to run once the pauses can be read",
        Duration::from_secs(3),
        async || seen.lock().unwrap().contains(&8),
    )
    .await;
    assert!(probe.is_claiming());
    handle.shutdown().await;
    assert!(!probe.is_claiming(), "a stopped fleet is not ready");
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct HoldConnection {
    ms: u64,
}

impl Job for HoldConnection {
    const KIND: &'static str = "hold_connection";
    const QUEUE: &'static str = "slow";
    const MAX_ATTEMPTS: i32 = 1;
}

#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_queue_claims_while_another_queues_jobs_hold_every_connection_of_the_pool(pool: PgPool) {
    // The fleet's pool: two connections, both taken by the slow queue's jobs for 3 s.
    let jobs_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = recording(seen.clone());
    registry
        .register::<HoldConnection, _, _>(|ctx: JobContext, job: HoldConnection| async move {
            let mut conn = ctx.pool.acquire().await.map_err(JobError::retry)?;
            sqlx::query("SELECT 1")
                .execute(&mut *conn)
                .await
                .map_err(JobError::retry)?;
            tokio::time::sleep(Duration::from_millis(job.ms)).await;
            Ok(())
        })
        .unwrap();
    let config = QueuesConfig::parse(
        "[fleet]\npoll_interval_ms = 100\n[queues.slow]\nconcurrency = 2\ntimeout_ms = 10000\n[queues.test]\nconcurrency = 2\ntimeout_ms = 10000\n",
        "t",
    )
    .unwrap();
    for _ in 0..2 {
        queue::enqueue(&pool, NewJob::of(&HoldConnection { ms: 3_000 }).unwrap())
            .await
            .unwrap();
    }
    let fleet = Fleet::new(jobs_pool.clone(), registry, config, "test").start();
    wait_running(&pool, 2).await;
    // Both connections are held (a job has taken its own once it runs its statement).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(jobs_pool.num_idle(), 0, "the slow jobs hold the whole pool");
    queue::enqueue(&pool, NewJob::of(&Echo { n: 1 }).unwrap())
        .await
        .unwrap();
    // Claimed on the claims' own connections: it runs long before the slow jobs end.
    crate::wait_for(
        "the other queue's job",
        Duration::from_secs(1),
        async || seen.lock().unwrap().contains(&1),
    )
    .await;
    fleet.shutdown().await;
}

/// A worker's claims share two connections however many queues it works: at its start every
/// queue claims at once, and a backend of its own per queue (five with the built-in queues) each
/// parsed and planned the claim afresh while the first claim that found jobs waited for the
/// same cores. Every queue is still claimed: a job on the last of them runs.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_workers_queues_claim_on_two_connections_however_many_queues_it_works(pool: PgPool) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut queues = String::from("[fleet]\npoll_interval_ms = 50\n");
    for q in ["a", "b", "c", "d", "test"] {
        queues.push_str(&format!(
            "[queues.{q}]\nconcurrency = 2\ntimeout_ms = 10000\n"
        ));
    }
    let fleet = Fleet::new(
        pool.clone(),
        recording(seen.clone()),
        QueuesConfig::parse(&queues, "t").unwrap(),
        "test",
    )
    .start();
    // Every queue claims (nothing is due) and asks for its next due time, again and again.
    let mut claimers = std::collections::HashSet::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()
               AND (query LIKE 'WITH walk AS MATERIALIZED%' OR query LIKE 'SELECT (extract(epoch FROM least(%')",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        claimers.extend(pids);
    }
    assert!(
        !claimers.is_empty() && claimers.len() <= 2,
        "{} backends ran the claims of five queues",
        claimers.len()
    );
    // And an operator reading pg_stat_activity sees whose they are (the pool names no process:
    // the queue's own name stands in for it).
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT application_name FROM pg_stat_activity WHERE pid = ANY($1)",
    )
    .bind(claimers.iter().copied().collect::<Vec<i32>>())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(names, vec!["payfleet-queue: claims".to_owned()]);
    let listening: Vec<String> = sqlx::query_scalar(
        "SELECT application_name FROM pg_stat_activity
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(listening, vec!["payfleet-queue: bookkeeping".to_owned()]);
    queue::enqueue(&pool, NewJob::of(&Echo { n: 7 }).unwrap())
        .await
        .unwrap();
    crate::wait_for(
        "the job of the last queue",
        Duration::from_secs(2),
        async || seen.lock().unwrap().contains(&7),
    )
    .await;
    fleet.shutdown().await;
}

/// The census: fleets on one database count each other per queue as soon as one joins or leaves
/// (renewals are a second apart: within half a second only the notification can have told the
/// other), and the row of a worker that died without stopping is neither counted nor kept.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn fleets_count_each_other_per_queue_and_stop_counting_one_that_stopped_or_died(
    pool: PgPool,
) {
    use payfleet_queue::census::{self, Census};
    let two_queues = "[fleet]\npoll_interval_ms = 100\n[queues.test]\nconcurrency = 1\ntimeout_ms = 10000\n[queues.slow]\nconcurrency = 1\ntimeout_ms = 10000\n";
    let one_queue =
        "[fleet]\npoll_interval_ms = 100\n[queues.test]\nconcurrency = 1\ntimeout_ms = 10000\n";
    // A worker that died half a minute ago without stopping.
    sqlx::query(
        "INSERT INTO queue_workers (id, queues, started_at, seen_at)
         VALUES ('dead-1', '{test}', now() - interval '1 hour', now() - interval '30 seconds')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (census_a, census_b) = (Census::default(), Census::default());
    assert_eq!(census_a.workers_on("test"), None, "not counted yet");
    let a = Fleet::new(
        pool.clone(),
        Registry::new(),
        QueuesConfig::parse(two_queues, "t").unwrap(),
        "a",
    )
    .census(census_a.clone())
    .start();
    crate::wait_for(
        "the first fleet to count itself alone",
        Duration::from_secs(2),
        async || census_a.workers_on("test") == Some(1),
    )
    .await;
    let b = Fleet::new(
        pool.clone(),
        Registry::new(),
        QueuesConfig::parse(one_queue, "t").unwrap(),
        "b",
    )
    .census(census_b.clone())
    .start();
    crate::wait_for(
        "each fleet to count both",
        Duration::from_millis(500),
        async || census_a.workers_on("test") == Some(2) && census_b.workers_on("test") == Some(2),
    )
    .await;
    // Only the first works `slow`: one worker on it, as either counts.
    assert_eq!(census_a.workers_on("slow"), Some(1));
    assert_eq!(census_b.workers_on("slow"), Some(1));
    let rows = census::workers(&pool).await.unwrap();
    assert_eq!(rows.len(), 2, "the dead worker's row is deleted: {rows:?}");
    assert!(rows.iter().all(|w| w.live && w.id != "dead-1"), "{rows:?}");

    b.shutdown().await;
    crate::wait_for(
        "the first fleet to count itself alone again",
        Duration::from_millis(500),
        async || census_a.workers_on("test") == Some(1),
    )
    .await;
    a.shutdown().await;
    assert!(
        census::workers(&pool).await.unwrap().is_empty(),
        "a stopped fleet deletes its row"
    );
}

/// The end of a batch of runs takes arrays whose sizes PL/pgSQL's planner saw in every call's
/// values, so it planned the end's statements again at every call (twice the time of their
/// work): the function is planned once per connection for every call.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_runs_end_is_planned_once_not_at_every_call(pool: PgPool) {
    let config: Vec<String> =
        sqlx::query_scalar("SELECT unnest(proconfig) FROM pg_proc WHERE proname = 'jobs_end_runs'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        config,
        vec![
            "plan_cache_mode=force_generic_plan".to_owned(),
            // Through the primary key whatever the table's size when it was planned.
            "enable_seqscan=off".to_owned(),
            // And never compiled at every call (a forced scan's price would ask for it).
            "jit=off".to_owned()
        ]
    );
    // And the ends still end: one completed (its row gone), one retried (kept, retryable).
    let mut ids = Vec::new();
    for n in 0..2 {
        ids.push(
            queue::enqueue(&pool, NewJob::of(&Echo { n }).unwrap())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let claimed: Vec<(i64, i64)> = sqlx::query_as(
        "UPDATE jobs SET state = 'running', attempt = 1, lease_token = nextval('jobs_lease_token_seq'),
                lease_expires_at = now() + interval '1 minute', locked_by = 'test'
         WHERE id = ANY($1) RETURNING id, lease_token",
    )
    .bind(ids.iter().map(|id: &JobId| id.0).collect::<Vec<_>>())
    .fetch_all(&pool)
    .await
    .unwrap();
    let (by_id, tokens): (Vec<i64>, Vec<i64>) = claimed.into_iter().unzip();
    let mut ended: Vec<(i64, String)> = sqlx::query_as(
        "SELECT job_id, new_state FROM jobs_end_runs($1, $2, ARRAY['complete', 'retry'],
                                                     ARRAY[NULL::bigint, NULL], ARRAY[NULL::text, 'boom'])",
    )
    .bind(&by_id)
    .bind(&tokens)
    .fetch_all(&pool)
    .await
    .unwrap();
    ended.sort();
    let mut expected = vec![
        (by_id[0], "completed".to_owned()),
        (by_id[1], "retryable".to_owned()),
    ];
    expected.sort();
    assert_eq!(ended, expected);
    assert!(completed(&pool, JobId(by_id[0])).await);
}

/// Transactions committed in the test's database so far, as the statistics have them (each
/// backend reports its own about once a second while it works).
async fn commits(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A due job whose row another transaction holds locked (an operator's statement on `jobs`, a
/// business transaction replacing the job by its key) is stepped over by `SKIP LOCKED`, while
/// the question "is anything due?" still answers yes. The claim loop waits longer after each
/// claim that met only locked rows, instead of claiming and asking again at once for as long as
/// the lock is held; the job runs once the lock is gone.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_due_job_whose_row_is_locked_is_not_claimed_in_a_spin(pool: PgPool) {
    queue::enqueue(&pool, NewJob::of(&Echo { n: 5 }).unwrap())
        .await
        .unwrap();
    // Spinning, a claim and a question took a fraction of a millisecond: thousands a second.
    run_once_freed_without_spinning(&pool, "SELECT id FROM jobs FOR UPDATE", 5, 300).await;
}

/// A claim that takes nothing because its walk (256 groups at most) found nothing due on its
/// stretch of the ring is not a claim that met locked rows: the fleet's claim loop goes on round
/// the ring at once to the one seller with a job due, past 3,000 whose jobs wait for later.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn the_fleet_goes_round_sellers_with_nothing_due_without_waiting(pool: PgPool) {
    sellers_waiting_for_later(&pool, 3000).await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let fleet = start_fleet(&pool, recording(seen.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = std::time::Instant::now();
    // Written behind the queue's back (no notification): found by the claims going round.
    sqlx::query(
        "INSERT INTO jobs (queue, kind, payload, fairness_key) VALUES ('test', 'echo', '{\"n\": -1}', 'zzz')",
    )
    .execute(&pool)
    .await
    .unwrap();
    queue::enqueue(
        &pool,
        NewJob::of(&Echo { n: -2 }).unwrap().fairness_key("zzzz"),
    )
    .await
    .unwrap();
    crate::wait_for("the due jobs to run", Duration::from_secs(30), async || {
        seen.lock().unwrap().len() == 2
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?} to reach the sellers with a job due",
        started.elapsed()
    );
    fleet.shutdown().await;
}

/// The same with the locked job past a stretch of the ring where nothing is due (600 sellers
/// whose jobs wait for later, more than two claims' walks): the loop goes round the ring at
/// once, and waits longer each time it comes back to the same locked row.
#[sqlx::test(migrator = "payfleet_queue::pg::MIGRATOR")]
async fn a_locked_due_job_past_sellers_with_nothing_due_is_not_claimed_in_a_spin(pool: PgPool) {
    sellers_waiting_for_later(&pool, 600).await;
    queue::enqueue(
        &pool,
        NewJob::of(&Echo { n: -1 }).unwrap().fairness_key("zzz"),
    )
    .await
    .unwrap();
    run_once_freed_without_spinning(
        &pool,
        "SELECT id FROM jobs WHERE fairness_key = 'zzz' FOR UPDATE",
        -1,
        500,
    )
    .await;
}

/// `n` sellers (fairness keys `k0000`...) whose one job each waits for a retry in an hour.
async fn sellers_waiting_for_later(pool: &PgPool, n: i64) {
    let later = Utc::now() + chrono::Duration::hours(1);
    let waiting: Vec<NewJob> = (0..n)
        .map(|i| {
            NewJob::of(&Echo { n: i })
                .unwrap()
                .fairness_key(format!("k{i:04}"))
                .run_at(later)
        })
        .collect();
    queue::enqueue_many(pool, &waiting).await.unwrap();
}

/// Holds the rows `lock` selects in a transaction while a fleet works, and requires fewer than
/// `at_most` transactions in 3 s of it and the job `n` not run; then lets them go and requires
/// `n` to run, once.
async fn run_once_freed_without_spinning(pool: &PgPool, lock: &'static str, n: i64, at_most: i64) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(lock).fetch_all(&mut *holder).await.unwrap();
    let fleet = start_fleet(pool, recording(seen.clone()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = commits(pool).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = commits(pool).await - before;
    assert!(
        during < at_most,
        "{during} transactions in 3 s while the due job's row was locked"
    );
    assert!(seen.lock().unwrap().is_empty());
    holder.rollback().await.unwrap();
    crate::wait_for(
        "the job to run once its row is free",
        Duration::from_secs(15),
        async || *seen.lock().unwrap() == [n],
    )
    .await;
    fleet.shutdown().await;
}
