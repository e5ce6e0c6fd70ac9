//! Recurring jobs: each period runs once however many processes tick, a run that outlasts its
//! period is not started twice, a missed period is caught up once within its limit, the runs
//! are visible to operators, and a bad schedule stops start-up naming its line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use payfleet::recurring::{self, Schedules, Ticked};
use serde_json::Value;
use sqlx::PgPool;

use crate::helpers::*;

fn schedules(text: &str) -> Schedules {
    Schedules::parse(text, "test recurring.toml").unwrap()
}

fn at(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

async fn rows(pool: &PgPool) -> Vec<(String, DateTime<Utc>, String)> {
    sqlx::query_as("SELECT name, period, state FROM recurring_runs ORDER BY name, period")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn each_period_runs_once_however_many_processes_tick(pool: PgPool) {
    let s = schedules("[holding_release]\ncron = \"0 */10 * * * *\"\ncatch_up_secs = 3600\n");
    let schedule = Arc::new(s.list[0].clone());
    // Eight processes see the same period at once.
    let now = Utc::now();
    let ticks: Vec<_> = (0..8)
        .map(|_| {
            let (pool, schedule) = (pool.clone(), schedule.clone());
            tokio::spawn(async move { recurring::tick(&pool, &schedule, now).await.unwrap() })
        })
        .collect();
    let mut enqueued = 0;
    for t in ticks {
        match t.await.unwrap() {
            Some(Ticked::Enqueued(_)) => enqueued += 1,
            Some(Ticked::Taken(_)) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(enqueued, 1);
    let period = schedule.latest(now).unwrap();
    assert_eq!(
        rows(&pool).await,
        vec![("holding_release".into(), period, "scheduled".into())]
    );
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'recurring_run'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, 1);
    // A worker runs it: the period is completed.
    let mut config = test_config();
    config.recurring = s.clone();
    assert_eq!(step(&pool, &config, "recurring").await, 1);
    assert_eq!(
        rows(&pool).await,
        vec![("holding_release".into(), period, "completed".into())]
    );
    // Ticking again in the same period does nothing.
    assert_eq!(
        recurring::tick(&pool, &schedule, now).await.unwrap(),
        Some(Ticked::Taken(period))
    );
    // Its worker died after the run finished but before the job's end was written: the job is
    // rescued and claimed again. That rerun is a no-op, and the period stays completed.
    let job = payfleet_queue::NewJob::of(&recurring::RecurringRun {
        name: "holding_release".into(),
        period,
    })
    .unwrap();
    payfleet_queue::enqueue(&pool, job).await.unwrap();
    assert_eq!(step(&pool, &config, "recurring").await, 1);
    assert_eq!(
        rows(&pool).await,
        vec![("holding_release".into(), period, "completed".into())]
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'discarded'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(dead, 0, "the rerun did not end dead");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_run_that_outlasts_its_period_is_not_started_twice(pool: PgPool) {
    let s = schedules("[payouts]\ncron = \"0 0 * * * *\"\n");
    let schedule = &s.list[0];
    let first = recurring::tick(&pool, schedule, at("2026-12-01T10:05:00Z"))
        .await
        .unwrap();
    assert_eq!(first, Some(Ticked::Enqueued(at("2026-12-01T10:00:00Z"))));
    // Its run has not ended when the next period comes.
    let second = recurring::tick(&pool, schedule, at("2026-12-01T11:00:30Z"))
        .await
        .unwrap();
    assert_eq!(second, Some(Ticked::Skipped(at("2026-12-01T11:00:00Z"))));
    let skipped: (String, Option<String>) = sqlx::query_as(
        "SELECT state, error FROM recurring_runs WHERE period = '2026-12-01T11:00:00Z'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(skipped.0, "skipped");
    assert!(skipped.1.unwrap().contains("still going"));
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'recurring_run'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, 1);
}

/// A run that fails is retried with backoff for hours before its job is dead: meanwhile its
/// period says why, and it is counted as troubled (the alert's gauge) until a run completes.
/// A period left running an hour after it came (its job died by a timeout or a kill) is too.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_failing_run_says_why_and_is_counted_until_one_completes(pool: PgPool) {
    let s = schedules("[payouts]\ncron = \"0 0 * * * *\"\ncatch_up_secs = 7200\n");
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut tasks = recurring::Tasks::default();
    let f = failing.clone();
    tasks.add("payouts", move |_pool, _period| {
        let fail = f.load(std::sync::atomic::Ordering::SeqCst);
        async move {
            if fail {
                Err(payfleet_queue::JobError::retry("the bank's API is down"))
            } else {
                Ok(())
            }
        }
    });
    let mut registry = payfleet_queue::Registry::default();
    recurring::register(
        &mut registry,
        recurring::Runner {
            tasks,
            schedules: s.clone(),
        },
    )
    .unwrap();
    let settings = payfleet_queue::QueueSettings {
        concurrency: 1,
        timeout_ms: 30_000,
        claimers: 1,
        fetch_cooldown_ms: 0,
        claim_batch: None,
    };
    let now = Utc::now();
    recurring::tick(&pool, &s.list[0], now).await.unwrap();
    assert!(recurring::troubled(&pool).await.unwrap().is_empty());
    payfleet_queue::work_until_idle(&pool, &registry, "recurring", &settings)
        .await
        .unwrap();
    let (state, error): (String, Option<String>) =
        sqlx::query_as("SELECT state, error FROM recurring_runs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state, "running");
    let error = error.unwrap_or_default();
    assert!(
        error.contains("attempt 1 of 25 failed, to be tried again: the bank's API is down"),
        "{error}"
    );
    assert_eq!(
        recurring::troubled(&pool).await.unwrap(),
        vec![("payouts".to_owned(), 1)]
    );
    // Its next attempt, due now, completes: nothing troubled.
    failing.store(false, std::sync::atomic::Ordering::SeqCst);
    sqlx::query("UPDATE jobs SET run_at = now() WHERE kind = 'recurring_run'")
        .execute(&pool)
        .await
        .unwrap();
    payfleet_queue::work_until_idle(&pool, &registry, "recurring", &settings)
        .await
        .unwrap();
    assert_eq!(
        rows(&pool)
            .await
            .into_iter()
            .map(|r| r.2)
            .collect::<Vec<_>>(),
        vec!["completed"]
    );
    assert!(recurring::troubled(&pool).await.unwrap().is_empty());
    // A period whose job died on its last attempt without ending it (a timeout, a kill) stays
    // running: an hour on, it is counted, until a later period of its job completes.
    sqlx::query(
        "INSERT INTO recurring_runs (name, period, state, started_at, created_at)
         VALUES ('invoices', now() - interval '2 hours', 'running', now() - interval '2 hours', now() - interval '2 hours')",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        recurring::troubled(&pool).await.unwrap(),
        vec![("invoices".to_owned(), 1)]
    );
    sqlx::query(
        "INSERT INTO recurring_runs (name, period, state, started_at, finished_at)
         VALUES ('invoices', now() - interval '1 hour', 'completed', now(), now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert!(recurring::troubled(&pool).await.unwrap().is_empty());
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_missed_period_is_caught_up_once_within_its_limit(pool: PgPool) {
    // Hourly, caught up within two hours: the fleet comes back at 13:40 after being down since
    // 09:00. Only the latest period (13:00) runs, once.
    let s = schedules("[prune]\ncron = \"0 0 * * * *\"\ncatch_up_secs = 7200\n");
    let back = at("2026-12-01T13:40:00Z");
    assert_eq!(
        recurring::tick(&pool, &s.list[0], back).await.unwrap(),
        Some(Ticked::Enqueued(at("2026-12-01T13:00:00Z")))
    );
    assert_eq!(rows(&pool).await.len(), 1);
    // Daily at midnight, caught up within ten minutes: at 13:40 the missed midnight is too old.
    let s = schedules("[invoices]\ncron = \"0 0 0 * * *\"\ncatch_up_secs = 600\n");
    assert_eq!(
        recurring::tick(&pool, &s.list[0], back).await.unwrap(),
        Some(Ticked::TooOld(at("2026-12-01T00:00:00Z")))
    );
    assert_eq!(rows(&pool).await.len(), 1);
}

async fn admin_get(app: &TestApp, path: &str, token: Option<&str>) -> (u16, Value) {
    let mut req = app.anon.get(format!("http://{}{path}", app.addr));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_fleet_runs_its_schedules_and_shows_their_last_and_next_runs(pool: PgPool) {
    let mut config = test_config();
    config.recurring = schedules(
        "[holding_release]\ncron = \"* * * * * *\"\n\n[prune]\ncron = \"*/2 * * * * *\"\n\n[payouts]\ncron = \"0 30 0 * * *\"\nenabled = false\n",
    );
    // Two worker processes' worth of schedulers on one database.
    let app = spawn_fleet(pool.clone(), config.clone()).await;
    let _second = spawn_roles(pool.clone(), config, payfleet::startup::Roles::WORK).await;
    let start = Instant::now();
    loop {
        let completed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM recurring_runs WHERE name = 'holding_release' AND state = 'completed'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if completed >= 3 {
            break;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let jobs: Vec<(String, String, Option<String>)> = sqlx::query_as(
                "SELECT kind, state, errors::text FROM jobs ORDER BY id DESC LIMIT 5",
            )
            .fetch_all(&pool)
            .await
            .unwrap();
            panic!("no runs: {:?}; jobs {jobs:?}", rows(&pool).await);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // None of the runs the two schedulers started failed (one row per period: the primary key;
    // a period may be skipped while the previous run still goes, or missed by a tick that came
    // late, and neither is asserted away here).
    let runs: Vec<(DateTime<Utc>, String)> = sqlx::query_as(
        "SELECT period, state FROM recurring_runs WHERE name = 'holding_release' ORDER BY period",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(runs.iter().all(|(_, state)| state != "failed"), "{runs:?}");

    let (status, _) = admin_get(&app, "/admin/recurring", None).await;
    assert_eq!(status, 401);
    let (status, list) = admin_get(&app, "/admin/recurring", Some(ADMIN_TOKEN)).await;
    assert_eq!(status, 200, "{list}");
    let by_name = |n: &str| {
        list["recurring"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == n)
            .cloned()
            .unwrap()
    };
    let release = by_name("holding_release");
    assert_eq!(release["cron"], "* * * * * *");
    assert_eq!(release["timezone"], "UTC");
    assert!(release["last_period"].is_string());
    assert!(release["next_period"].is_string());
    let payouts = by_name("payouts");
    assert_eq!(payouts["enabled"], false);
    assert!(payouts["last_period"].is_null() && payouts["next_period"].is_null());

    let (status, runs) = admin_get(
        &app,
        "/admin/recurring/holding_release/runs?limit=2",
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 200);
    let runs = runs["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert!(
        runs[0]["period"].as_str() > runs[1]["period"].as_str(),
        "newest first"
    );
    for (path, status) in [
        ("/admin/recurring/reconcile/runs", 404),
        ("/admin/recurring/holding_release/runs?limit=0", 400),
        ("/admin/recurring/holding_release/runs?limit=x", 400),
    ] {
        let (got, body) = admin_get(&app, path, Some(ADMIN_TOKEN)).await;
        assert_eq!(got, status, "{path}: {body}");
        assert!(body["error"]["code"].is_string());
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_bad_schedule_stops_start_up_naming_its_line(pool: PgPool) {
    let path = std::env::temp_dir().join(format!("recurring-{}.toml", rand::random::<u64>()));
    std::fs::write(
        &path,
        "[payouts]\ncron = \"0 30 0 * * *\"\n\n[invoices]\ncron = \"0 0 25 * * *\"\n",
    )
    .unwrap();
    let out = payfleet(&pool, &["work"])
        .env("PAYFLEET_RECURRING", &path)
        .output()
        .await
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("line 5") && stderr.contains("[invoices]"),
        "{stderr}"
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_flag_naming_no_queue_stops_start_up_saying_so(pool: PgPool) {
    let out = payfleet(&pool, &["work", "--queues", "events,nope"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--queues names \"nope\""), "{stderr}");
}

/// An operator sees the fleet's worker processes over the admin API as `payfleet jobs workers`
/// shows them: each with the queues it works, and whether it is live. Anonymous callers get 401.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_admin_api_lists_the_fleets_worker_processes(pool: PgPool) {
    let app = spawn_fleet(pool.clone(), test_config()).await;
    let (status, body) = admin_get(&app, "/admin/workers", None).await;
    assert_eq!(status, 401, "{body}");
    let mut listed = Value::Null;
    for _ in 0..100 {
        let (status, body) = admin_get(&app, "/admin/workers", Some(ADMIN_TOKEN)).await;
        assert_eq!(status, 200, "{body}");
        if body["workers"].as_array().is_some_and(|w| !w.is_empty()) {
            listed = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let workers = listed["workers"]
        .as_array()
        .expect("the fleet's worker is listed");
    assert_eq!(workers.len(), 1, "{listed}");
    let me = &workers[0];
    assert_eq!(me["live"], true);
    let queues: Vec<&str> = me["queues"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        queues.contains(&"events") && queues.contains(&"orders"),
        "{me}"
    );
    assert!(me["id"].as_str().is_some_and(|id| !id.is_empty()));
}
