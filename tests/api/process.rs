//! The real binary as operators run it: worker processes killed and stopped, the jobs command.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::helpers::*;

async fn wait_for(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_killed_mid_stream_leaves_every_event_to_exactly_one_effect(pool: PgPool) {
    const N: i64 = 600;
    let app = Arc::new(spawn_app(pool.clone()).await);
    deliver_payments(&app, N as usize).await;
    let queues = queues_file("kill", 16);

    let mut first = payfleet(&pool, &["work"])
        .env("PAYFLEET_QUEUES", &queues)
        .spawn()
        .unwrap();
    wait_for(
        "the first worker to get going",
        Duration::from_secs(30),
        async || processed_events(&pool).await >= 50,
    )
    .await;
    first.kill().await.unwrap(); // SIGKILL: no shutdown, no completions written, leases left behind
    let at_kill = processed_events(&pool).await;
    let running: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'")
        .fetch_one(&pool)
        .await
        .unwrap();

    let mut second = payfleet(&pool, &["work"])
        .env("PAYFLEET_QUEUES", &queues)
        .spawn()
        .unwrap();
    wait_for(
        "every event to be processed",
        Duration::from_secs(60),
        async || processed_events(&pool).await == N,
    )
    .await;
    second.kill().await.unwrap();
    assert_eq!(
        processed_events(&pool).await,
        N,
        "no event processed twice or lost"
    );

    assert!(
        at_kill < N,
        "the kill came mid-stream ({at_kill} of {N} done)"
    );
    let (orders, paid, payments): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status = 'paid'), (SELECT count(*) FROM payment_orders) FROM orders",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((orders, paid, payments), (N, N, N));
    // The runs cut off by the kill are rescued once their leases expire and rerun; they find
    // their events done. Every job ends completed.
    let mut third = payfleet(&pool, &["work"])
        .env("PAYFLEET_QUEUES", &queues)
        .spawn()
        .unwrap();
    wait_for(
        "every job to complete",
        Duration::from_secs(30),
        async || {
            let left: i64 =
                sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state <> 'completed'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            left == 0
        },
    )
    .await;
    third.kill().await.unwrap();
    let rescued: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE errors::text LIKE '%lease expired%'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        rescued >= running,
        "{running} runs were cut off, {rescued} rescued"
    );
    assert!(running > 0, "the kill cut runs off");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn sigterm_stops_a_worker_cleanly_and_leaves_no_job_running(pool: PgPool) {
    let app = Arc::new(spawn_app(pool.clone()).await);
    deliver_payments(&app, 300).await;
    let queues = queues_file("term", 4);
    let mut worker = payfleet(&pool, &["work"])
        .env("PAYFLEET_QUEUES", &queues)
        .spawn()
        .unwrap();
    wait_for(
        "the worker to get going",
        Duration::from_secs(30),
        async || processed_events(&pool).await >= 20,
    )
    .await;
    let pid = worker.id().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = tokio::time::timeout(Duration::from_secs(10), worker.wait())
        .await
        .expect("stopped in time")
        .unwrap();
    assert!(status.success(), "{status}");
    let running: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(running, 0, "every run finished or was released");
    let lost: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs j JOIN payment_events e ON j.key = 'payment_event:' || e.gateway || ':' || e.event_id
         WHERE j.state = 'completed' AND e.processed_at IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(lost, 0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_jobs_command_shows_counts_and_refuses_bad_ids_plainly(pool: PgPool) {
    let app = Arc::new(spawn_app(pool.clone()).await);
    deliver_payments(&app, 3).await;
    let out = payfleet(&pool, &["jobs"]).output().await.unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["events", "available", "3"]),
        "{text}"
    );

    let out = payfleet(&pool, &["jobs", "retry", "424242"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim(),
        "payfleet: no job 424242"
    );

    let out = payfleet(&pool, &["jobs", "dead"]).output().await.unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        "no dead jobs"
    );
}
