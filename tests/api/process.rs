//! The real binary as operators run it: worker processes killed and stopped, the jobs command.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::helpers::*;

const METRICS_TOKEN: &str = "test-metrics-token-0123456789-abcdef";

/// Runs `payfleet <args>` to its end.
async fn run(pool: &PgPool, args: &[&str]) -> std::process::Output {
    payfleet(pool, args).output().await.unwrap()
}

/// A `payfleet work` process, once it has processed `at_least` events.
async fn worker_that_processed(
    pool: &PgPool,
    queues: &std::path::Path,
    at_least: i64,
) -> tokio::process::Child {
    let worker = payfleet(pool, &["work"])
        .env("PAYFLEET_QUEUES", queues)
        .spawn()
        .unwrap();
    wait_for(
        "the worker to get going",
        Duration::from_secs(30),
        async || processed_events(pool).await >= at_least,
    )
    .await;
    worker
}

/// Waits until every job has completed: a completed job's row is deleted.
async fn every_job_completes(pool: &PgPool, within: Duration) {
    wait_for("every job to complete", within, async || {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
            .fetch_one(pool)
            .await
            .unwrap();
        left == 0
    })
    .await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_killed_mid_stream_leaves_every_event_to_exactly_one_effect(pool: PgPool) {
    const N: i64 = 600;
    let app = Arc::new(spawn_app(pool.clone()).await);
    deliver_payments(&app, N as usize).await;
    let queues = queues_file("kill", 16);

    let mut first = worker_that_processed(&pool, &queues, 50).await;
    // Killed while it holds runs (on a loaded machine a poll may fall between two of its
    // claims, when it holds none).
    wait_for(
        "the worker to hold runs",
        Duration::from_secs(30),
        async || {
            let running: i64 =
                sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            running > 0
        },
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
    every_job_completes(&pool, Duration::from_secs(30)).await;
    third.kill().await.unwrap();
    let claims = claims_made(&pool).await;
    assert!(
        claims >= N + running,
        "{running} runs were cut off and claimed again: {claims} claims of {N} jobs"
    );
    assert!(running > 0, "the kill cut runs off");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn sigterm_stops_a_worker_cleanly_and_leaves_no_job_running(pool: PgPool) {
    let app = Arc::new(spawn_app(pool.clone()).await);
    deliver_payments(&app, 300).await;
    let queues = queues_file("term", 4);
    let mut worker = worker_that_processed(&pool, &queues, 20).await;
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
        "SELECT count(*) FROM payment_events e
         WHERE e.processed_at IS NULL AND NOT EXISTS (
             SELECT 1 FROM jobs j WHERE j.key = 'payment_event:' || e.gateway || ':' || e.event_id)",
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
    let out = run(&pool, &["jobs"]).await;
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["events", "available", "3"]),
        "{text}"
    );

    let out = run(&pool, &["jobs", "retry", "424242"]).await;
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim(),
        "payfleet: no job 424242"
    );

    let out = run(&pool, &["jobs", "dead"]).await;
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        "no dead jobs"
    );

    // A mistyped queue is not paused (nothing would stop while the operator believes it did):
    // refused, naming the fleet's queues; a real one is.
    let out = run(&pool, &["jobs", "pause", "paymnts"]).await;
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("no queue \"paymnts\"") && err.contains("payments"),
        "{err}"
    );
    let paused = async || -> Vec<String> {
        sqlx::query_scalar("SELECT queue FROM queue_pauses")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    assert!(paused().await.is_empty());
    let out = run(&pool, &["jobs", "pause", "payments"]).await;
    assert!(out.status.success());
    assert_eq!(paused().await, vec!["payments".to_owned()]);
    let out = run(&pool, &["jobs", "resume", "payments"]).await;
    assert!(out.status.success());
    assert!(paused().await.is_empty());
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn operators_list_unprocessed_events_and_replay_them(pool: PgPool) {
    let app = Arc::new(spawn_app(pool.clone()).await);
    deliver_payments(&app, 3).await;
    // sess_0's job died during an outage; sess_1's refund waits for a payment; sess_2 is fine.
    sqlx::query(
        "UPDATE jobs SET state = 'discarded', finished_at = now() WHERE key = 'payment_event:internal:msg_0'",
    )
    .execute(&pool)
    .await
    .unwrap();
    app.deliver(&internal("msg_r", &refund_body("sess_9", "r9", "1.00")))
        .await;
    process_events(&pool).await;

    let out = run(&pool, &["events", "unprocessed"]).await;
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert_eq!(
        (rows[0][2], rows[0][4], rows[0][5]),
        ("msg_0", "pending", "discarded"),
        "{text}"
    );
    assert_eq!(
        (rows[1][2], rows[1][4], rows[1][5]),
        ("msg_r", "waiting", "none"),
        "{text}"
    );
    assert!(text.contains("waiting for payment:pay_sess_9"), "{text}");

    let id = rows[0][0];
    let out = run(&pool, &["events", "replay", id]).await;
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        format!("event {id} will be processed again")
    );
    process_events(&pool).await;
    assert_eq!(
        order_status(&pool, "internal", "sess_0").await.unwrap().0,
        "paid"
    );

    // A processed event and an unknown id are plain refusals.
    let out = run(&pool, &["events", "replay", id]).await;
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim(),
        format!(
            "payfleet: payment event {id} is already processed (applied); there is nothing to replay"
        )
    );
    let out = run(&pool, &["events", "replay", "999999"]).await;
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim(),
        "payfleet: no payment event 999999"
    );
    let out = run(&pool, &["events", "replay", "--all"]).await;
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        "1 unprocessed events will be processed again"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_reports_its_own_readiness_and_never_logs_a_password(pool: PgPool) {
    payfleet::tls::install_provider();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // Trust authentication ignores the password, so it can be a marker to look for.
    let url = database_url(&pool).replacen("postgres@", "postgres:hunter2-marker@", 1);
    let queues = queues_file("ready", 2);
    let mut worker = payfleet(&pool, &["work"])
        .env("DATABASE_URL", &url)
        .env("PAYFLEET_QUEUES", &queues)
        .env("PAYFLEET_WORKER_BIND", format!("127.0.0.1:{port}"))
        .env("PAYFLEET_METRICS_TOKEN", METRICS_TOKEN)
        .env("RUST_LOG", "debug,sqlx=debug")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read as it is written: debug logs fill a pipe's buffer within seconds, and a worker
    // blocked on writing its log answers nothing.
    let stderr = worker.stderr.take().unwrap();
    let logs = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut all = Vec::new();
        let mut stderr = stderr;
        stderr.read_to_end(&mut all).await.map(|_| all)
    });
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    // Ready once it serves and its fleet has read the paused queues (a moment after its start).
    let mut ready = None;
    for _ in 0..100 {
        if let Ok(resp) = http
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
        {
            ready = Some((resp.status().as_u16(), resp.text().await.unwrap()));
            if ready.as_ref().is_some_and(|(status, _)| *status == 200) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = ready.expect("the worker serves /readyz");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap(),
        serde_json::json!({"database": "ok", "workers": "ok", "broker": "ok"})
    );
    let anonymous = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        anonymous.status(),
        401,
        "a worker's metrics take a token too"
    );
    let metrics = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .bearer_auth(METRICS_TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("payfleet_payment_events_unprocessed"),
        "{metrics}"
    );
    let pid = worker.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), worker.wait())
        .await
        .expect("the worker stops on SIGTERM")
        .unwrap();
    let logs = logs.await.unwrap().unwrap();
    let logs = String::from_utf8_lossy(&logs);
    assert!(logs.contains("payfleet started"), "{logs}");
    assert!(
        logs.contains("postgres:***@"),
        "the database is named, redacted: {logs}"
    );
    assert!(
        !logs.contains("hunter2-marker"),
        "a password reached the logs: {logs}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn logs_are_json_lines_on_request_and_a_bad_format_is_refused(pool: PgPool) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut worker = payfleet(&pool, &["work"])
        .env("PAYFLEET_LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(worker.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("a log line")
        .unwrap()
        .expect("a log line");
    let entry: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert!(
        entry["level"].is_string() && entry["fields"]["message"].is_string(),
        "{entry}"
    );
    worker.kill().await.unwrap();

    let out = run_with(&pool, &["jobs"], ("PAYFLEET_LOG_FORMAT", "xml")).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("PAYFLEET_LOG_FORMAT"));
}

async fn run_with(pool: &PgPool, args: &[&str], env: (&str, &str)) -> std::process::Output {
    payfleet(pool, args)
        .env(env.0, env.1)
        .output()
        .await
        .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn three_worker_processes_drain_a_backlog_with_every_job_run_once(pool: PgPool) {
    const N: i64 = 900;
    let app = Arc::new(spawn_app(pool.clone()).await);
    deliver_payments(&app, N as usize).await;
    // Leases long enough that no live worker's run is ever taken over: every second claim would
    // be a fault of the queue.
    let queues = queues_file_leased("three", 8, 10_000);
    let mut workers: Vec<_> = (0..3)
        .map(|_| {
            payfleet(&pool, &["work"])
                .env("PAYFLEET_QUEUES", &queues)
                .spawn()
                .unwrap()
        })
        .collect();
    every_job_completes(&pool, Duration::from_secs(60)).await;
    for w in &mut workers {
        w.kill().await.unwrap();
    }
    // Each job was claimed once (a second claim would be a second attempt) and its event
    // processed once: one payment, one paid order each.
    assert_eq!(claims_made(&pool).await, N, "one claim per job");
    let (orders, paid, payments): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status = 'paid'), (SELECT count(*) FROM payment_orders) FROM orders",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((orders, paid, payments), (N, N, N));
    assert_eq!(processed_events(&pool).await, N);
}

/// `payfleet migrate` and `events replay --all` show their progress only on a terminal: piped
/// (a log, CI), their output is their result lines, nothing drawn.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn long_commands_draw_no_progress_when_not_on_a_terminal(pool: PgPool) {
    for args in [&["migrate"][..], &["events", "replay", "--all"][..]] {
        let out = run(&pool, args).await;
        assert!(out.status.success(), "{args:?}: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("applying migrations") && !stderr.contains("queueing every"),
            "{args:?} drew its progress into a pipe: {stderr}"
        );
        assert!(
            !stdout.contains('\u{1b}') && !stderr.contains('\u{1b}'),
            "{args:?}: {stderr}"
        );
        assert!(
            stdout.contains("migrations applied") || stdout.contains("will be processed again"),
            "{args:?}: {stdout}"
        );
    }
}

/// A queue catalogue without one of the fleet's queues (an older release's file, one written by
/// hand) stops a worker at start, naming what is missing: it used to start, and the jobs of
/// the missing queue (every payment event's) waited for ever, no worker claiming them.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_refuses_a_queue_catalogue_without_the_fleets_queues(pool: PgPool) {
    let dir = std::env::temp_dir().join(format!("payfleet-queues-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!(
        "{}.toml",
        database_url(&pool).rsplit('/').next().unwrap()
    ));
    std::fs::write(
        &file,
        "[queues.default]\nconcurrency = 8\ntimeout_ms = 30000\n\n[queues.orders]\nconcurrency = 8\ntimeout_ms = 30000\n",
    )
    .unwrap();
    let stderr = refused_at_start(
        payfleet(&pool, &["work"])
            .env("PAYFLEET_QUEUES", &file)
            .env("PAYFLEET_WORKER_BIND", "127.0.0.1:0"),
    )
    .await;
    std::fs::remove_file(&file).ok();
    for missing in [
        "[queues.events] (for process_payment_event)",
        "[queues.payments]",
        "[queues.recurring]",
    ] {
        assert!(stderr.contains(missing), "{missing}: {stderr}");
    }
    assert!(!stderr.contains("[queues.orders]"), "{stderr}");
}

/// A worker given some of the catalogue's queues (`work --queues events`, the dedicated workers
/// of docs/scaling.md) starts: the queues it leaves to other processes are still defined.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_of_some_queues_starts_beside_the_catalogues_others(pool: PgPool) {
    let mut worker = payfleet(&pool, &["work", "--queues", "events"])
        .env("PAYFLEET_WORKER_BIND", "127.0.0.1:0")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ended = worker.try_wait().unwrap();
    if ended.is_some() {
        let out = worker.wait_with_output().await.unwrap();
        panic!(
            "the worker stopped: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    worker.kill().await.unwrap();
}
