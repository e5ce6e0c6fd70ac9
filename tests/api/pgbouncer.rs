//! payfleet behind a real PgBouncer in transaction pooling mode (`.ci/pgbouncer` starts it on
//! port 6432; `PAYFLEET_TEST_PGBOUNCER_URL` names another). Between two transactions PgBouncer
//! may hand a client's server connection to another client: nothing may rely on session state,
//! prepared statements must be the kind it tracks (`max_prepared_statements`), and LISTEN goes
//! over a direct connection (`PAYFLEET_LISTEN_URL`) or not at all.

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use payfleet::config::ListenTo;
use payfleet::secret::SecretUrl;
use payfleet_queue::{
    self as queue, Fleet, Job, JobContext, Listen, NewJob, QueuesConfig, Registry,
};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool, Row};

use crate::helpers::*;

fn bouncer() -> String {
    std::env::var("PAYFLEET_TEST_PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432".to_owned())
}

async fn database_name(pool: &PgPool) -> String {
    sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The test's database, through PgBouncer.
async fn through_bouncer(pool: &PgPool, size: u32) -> PgPool {
    let url = format!("{}/{}", bouncer(), database_name(pool).await);
    PgPoolOptions::new()
        .max_connections(size)
        .connect_with(PgConnectOptions::from_str(&url).unwrap())
        .await
        .unwrap_or_else(|e| {
            panic!("PgBouncer does not answer at {url} ({e}): start it with .ci/pgbouncer (.ci/run does)")
        })
}

/// PgBouncer's admin console: which pool the test's database is in, and in what mode.
async fn pool_mode(pool: &PgPool) -> String {
    let db = database_name(pool).await;
    let mut admin = sqlx::PgConnection::connect(&format!("{}/pgbouncer", bouncer()))
        .await
        .unwrap();
    let rows = sqlx::raw_sql("SHOW POOLS")
        .fetch_all(&mut admin)
        .await
        .unwrap();
    rows.iter()
        .find(|r| r.try_get::<String, _>("database").ok().as_deref() == Some(db.as_str()))
        .map(|r| r.try_get::<String, _>("pool_mode").unwrap())
        .unwrap_or_else(|| panic!("PgBouncer has no pool for {db}"))
}

/// Closes PgBouncer's server connections to the test's database, so that it can be dropped
/// (and made again by the next run: test databases are named after their test), then lets
/// PgBouncer take connections to that name again.
async fn release(pool: &PgPool) {
    let db = database_name(pool).await;
    assert!(db.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    let mut admin = sqlx::PgConnection::connect(&format!("{}/pgbouncer", bouncer()))
        .await
        .unwrap();
    // The admin console takes one command per query.
    for command in ["KILL", "RESUME"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("{command} {db}")))
            .execute(&mut admin)
            .await
            .unwrap();
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Bounce {
    n: i64,
}

impl Job for Bounce {
    const KIND: &'static str = "bounce";
    const QUEUE: &'static str = "bounce";
}

fn recording(seen: Arc<Mutex<Vec<i64>>>) -> Registry {
    let mut r = Registry::new();
    r.register::<Bounce, _, _>(move |_ctx: JobContext, job: Bounce| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(job.n);
            Ok(())
        }
    })
    .unwrap();
    r
}

/// A 10 s poll: a job that starts sooner was announced by NOTIFY.
fn queues(poll_ms: u64) -> QueuesConfig {
    QueuesConfig::parse(
        &format!(
            "[fleet]\npoll_interval_ms = {poll_ms}\nlease_ms = 2000\nrescue_interval_ms = 500\n\
             [queues.bounce]\nconcurrency = 8\ntimeout_ms = 5000\n"
        ),
        "test",
    )
    .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn two_fleets_behind_pgbouncer_run_every_job_once_and_listen_on_a_direct_connection(
    pool: PgPool,
) {
    let direct = PgConnectOptions::from_str(&database_url(&pool)).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut fleets = Vec::new();
    for _ in 0..2 {
        let bounced = through_bouncer(&pool, 4).await;
        fleets.push(
            Fleet::new(bounced, recording(seen.clone()), queues(10_000), "bouncer")
                .listen(Listen::Direct(Box::new(direct.clone())))
                .start(),
        );
    }
    let client = through_bouncer(&pool, 4).await;
    assert_eq!(pool_mode(&client).await, "transaction");
    // Some jobs keyed by seller, some not; enqueued in batches and one by one, all through
    // the pooler.
    let jobs: Vec<NewJob> = (0..600)
        .map(|n| {
            let job = NewJob::of(&Bounce { n }).unwrap();
            if n % 3 == 0 {
                job.fairness_key(format!("seller-{}", n % 7))
            } else {
                job
            }
        })
        .collect();
    for chunk in jobs.chunks(100) {
        queue::enqueue_many(&client, chunk).await.unwrap();
    }
    for n in 600..650 {
        queue::enqueue(&client, NewJob::of(&Bounce { n }).unwrap())
            .await
            .unwrap();
    }
    wait_for("every job to run", Duration::from_secs(60), async || {
        seen.lock().unwrap().len() >= 650
    })
    .await;
    // Once more, with both fleets idle: only a notification can start it within the poll.
    let started = Instant::now();
    queue::enqueue(&client, NewJob::of(&Bounce { n: 650 }).unwrap())
        .await
        .unwrap();
    wait_for("the notified job", Duration::from_secs(5), async || {
        seen.lock().unwrap().contains(&650)
    })
    .await;
    let waited = started.elapsed();
    for f in fleets {
        f.shutdown().await;
    }
    let ran = seen.lock().unwrap().clone();
    let distinct: HashSet<i64> = ran.iter().copied().collect();
    assert_eq!((ran.len(), distinct.len()), (651, 651), "each job once");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "every job completed (and was deleted)");
    assert!(
        waited < Duration::from_secs(5),
        "the idle fleets were woken ({waited:?}; the poll is 10 s)"
    );
    release(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn with_no_direct_connection_the_fleet_polls(pool: PgPool) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let bounced = through_bouncer(&pool, 4).await;
    let fleet = Fleet::new(
        bounced.clone(),
        recording(seen.clone()),
        queues(100),
        "poll",
    )
    .listen(Listen::Off)
    .start();
    let jobs: Vec<NewJob> = (0..100)
        .map(|n| NewJob::of(&Bounce { n }).unwrap())
        .collect();
    queue::enqueue_many(&bounced, &jobs).await.unwrap();
    wait_for("every job to run", Duration::from_secs(30), async || {
        seen.lock().unwrap().len() >= 100
    })
    .await;
    fleet.shutdown().await;
    assert_eq!(seen.lock().unwrap().len(), 100);
    release(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn webhooks_become_paid_orders_through_pgbouncer(pool: PgPool) {
    const N: usize = 120;
    let bounced = through_bouncer(&pool, 10).await;
    let mut config = test_config();
    config.listen = ListenTo::Direct(SecretUrl::new(database_url(&pool)));
    // Everything the receiver and the workers do goes through the pooler.
    let app = Arc::new(spawn_fleet(bounced, config).await);
    deliver_payments(&app, N).await;
    wait_for(
        "every payment to confirm its order",
        Duration::from_secs(60),
        async || {
            let paid: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE status = 'paid'")
                .fetch_one(&pool)
                .await
                .unwrap();
            paid == N as i64
        },
    )
    .await;
    assert_eq!(processed_events(&pool).await, N as i64);
    drop(app);
    release(&pool).await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn payfleet_work_runs_behind_pgbouncer_with_its_listen_url(pool: PgPool) {
    let app = Arc::new(spawn_app(pool.clone()).await);
    deliver_payments(&app, 40).await;
    // Polling every 10 s: an event handled sooner once the worker is idle was notified, which
    // only its LISTEN on the direct URL can hear (a transaction-pooling bouncer keeps none).
    let queues =
        std::env::temp_dir().join(format!("payfleet-test-listen-{}.toml", std::process::id()));
    std::fs::write(
        &queues,
        "[fleet]\npoll_interval_ms = 10000\nlease_ms = 1000\nrescue_interval_ms = 200\nshutdown_timeout_ms = 2000\n\
         [queues.default]\nconcurrency = 4\ntimeout_ms = 5000\n\
         [queues.events]\nconcurrency = 4\ntimeout_ms = 5000\n\
         [queues.orders]\nconcurrency = 4\ntimeout_ms = 5000\n\
         [queues.payments]\nconcurrency = 4\ntimeout_ms = 5000\n\
         [queues.recurring]\nconcurrency = 2\ntimeout_ms = 30000\n",
    )
    .unwrap();
    let bounced = format!("{}/{}", bouncer(), database_name(&pool).await);
    let mut worker = payfleet(&pool, &["work"])
        .env("DATABASE_URL", &bounced)
        .env("PAYFLEET_LISTEN_URL", database_url(&pool))
        .env("PAYFLEET_QUEUES", &queues)
        .spawn()
        .unwrap();
    wait_for(
        "the worker to process",
        Duration::from_secs(60),
        async || processed_events(&pool).await == 40,
    )
    .await;
    // Idle now: one more payment is handled within the poll only if the worker heard of it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    orders_for(&pool, "internal", &["sess_late"], "10.00", "BRL").await;
    let started = std::time::Instant::now();
    let (status, body) = app
        .deliver(&internal(
            "msg_late",
            &payment_body("payment.succeeded", "sess_late", "10.00"),
        ))
        .await;
    assert_eq!(status, 200, "{body}");
    wait_for("the notified event", Duration::from_secs(5), async || {
        processed_events(&pool).await == 41
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the idle worker was woken (the poll is 10 s)"
    );
    worker.kill().await.unwrap();
    release(&pool).await;
}
