//! Readiness by role, metrics a dashboard can alert on, and what a scrape costs.

use std::sync::Arc;

use payfleet::http::{self, Readiness};
use payfleet::secret::Secret;
use payfleet::webhooks::EventWriter;
use sqlx::PgPool;

use crate::helpers::*;

pub fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in\n{text}"))
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_receiver_is_ready_with_its_database_and_writer_whatever_rabbitmq_does(pool: PgPool) {
    // No broker runs for a receiver in this test: webhooks must land even when RabbitMQ is down.
    let app = spawn_app(pool).await;
    let (status, body) = app.get("/readyz").await;
    assert_eq!(status, 200, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"database": "ok", "event_writer": "ok"})
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn readiness_fails_when_the_database_is_gone(pool: PgPool) {
    let proxy = DbProxy::for_database(&pool).await;
    let app = spawn_app(proxy.pool(&pool)).await;
    proxy.set(Link::Refused);
    let started = std::time::Instant::now();
    let (status, body) = app.get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(r#""database":"unavailable""#), "{body}");
    assert!(started.elapsed() < std::time::Duration::from_secs(3));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn readiness_fails_when_the_event_writer_has_ended(pool: PgPool) {
    // A writer whose task has ended (here: its runtime is gone).
    let options = (*pool.connect_options()).clone();
    let dead = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let writer = rt.block_on(async { EventWriter::start(options, None, 8) });
        drop(rt);
        writer
    })
    .join()
    .unwrap();
    assert!(!dead.is_alive());
    let addr = probes_of(Readiness {
        pool,
        events: Some(dead),
        fleet: None,
        broker: None,
        database: Default::default(),
    })
    .await;
    let resp = reqwest::get(format!("http://{addr}/readyz")).await.unwrap();
    assert_eq!(resp.status(), 503);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["event_writer"], "unavailable");
    assert_eq!(body["database"], "ok");
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn refused_webhooks_are_counted_by_gateway_and_reason(pool: PgPool) {
    let mut config = test_config();
    // The gateway signs with a secret we do not have: every delivery is a mismatch.
    config.gateways.stripe.webhook_secret = Some(Secret::new("whsec_rotated_without_telling_us"));
    let app = spawn_app_with(pool, config).await;
    for i in 0..3 {
        let (status, _) = app
            .deliver(&stripe(&format!(r#"{{"id":"evt_{i}"}}"#), now()))
            .await;
        assert_eq!(status, 401);
    }
    let (status, _) = app
        .deliver(&standard(
            payfleet::gateways::GatewayName::Internal,
            "m_old",
            now() - 3600,
            "{}",
        ))
        .await;
    assert_eq!(status, 401);
    let (status, _) = app
        .deliver(&internal(
            "m_ok",
            &payment_body("payment.succeeded", "s", "1.00"),
        ))
        .await;
    assert_eq!(status, 200);

    let text = app.metrics().await;
    assert_eq!(
        metric(
            &text,
            r#"payfleet_webhooks_refused_total{gateway="stripe",reason="mismatch"}"#
        ),
        3.0
    );
    assert_eq!(
        metric(
            &text,
            r#"payfleet_webhooks_refused_total{gateway="internal",reason="timestamp"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            r#"payfleet_webhooks_total{gateway="internal",status="accepted"}"#
        ),
        1.0
    );
    // The stored event waits for its job: counted, with its age.
    assert_eq!(
        metric(
            &text,
            r#"payfleet_payment_events_unprocessed{state="pending"}"#
        ),
        1.0
    );
    assert!(
        metric(
            &text,
            r#"payfleet_payment_events_oldest_unprocessed_seconds{state="pending"}"#
        ) >= 0.0
    );
    assert_eq!(
        metric(&text, r#"payfleet_jobs{queue="events",state="available"}"#),
        1.0
    );
    assert_eq!(
        metric(&text, r#"payfleet_queue_due_jobs{queue="events"}"#),
        1.0
    );
    assert_eq!(metric(&text, "payfleet_outbox_unpublished "), 0.0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn queue_age_and_event_lag_are_measured_not_guessed(pool: PgPool) {
    let app = spawn_app(pool.clone()).await;
    // A job due 90 s ago and one scheduled for tomorrow: only the first is backlog.
    sqlx::query(
        "INSERT INTO jobs (queue, kind, run_at) VALUES ('payments', 'k', now() - interval '90 seconds'),
                                                       ('payments', 'k', now() + interval '1 day')",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Three events processed 1, 2 and 30 s after they arrived.
    sqlx::query(
        "INSERT INTO payment_events (gateway, event_id, event_type, raw_body, received_at, processed_at, outcome)
         SELECT 'internal', 'e' || s, 'payment.succeeded', '\\x', now() - interval '1 minute',
                now() - interval '1 minute' + s * interval '1 second', 'applied'
         FROM unnest(ARRAY[1, 2, 30]) AS s",
    )
    .execute(&pool)
    .await
    .unwrap();
    let text = app.metrics().await;
    assert_eq!(
        metric(&text, r#"payfleet_queue_due_jobs{queue="payments"}"#),
        1.0
    );
    let oldest = metric(
        &text,
        r#"payfleet_queue_oldest_due_seconds{queue="payments"}"#,
    );
    assert!((90.0..120.0).contains(&oldest), "{oldest}");
    let lag = |q: &str| {
        metric(
            &text,
            &format!(r#"payfleet_payment_events_processing_lag_seconds{{percentile="{q}"}}"#),
        )
    };
    assert_eq!((lag("50"), lag("100")), (2.0, 30.0));
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_scrape_reads_the_backlog_not_the_whole_jobs_table(pool: PgPool) {
    // A day of cancelled jobs, a few live ones.
    sqlx::query(
        "INSERT INTO jobs (queue, kind, state, finished_at, attempt)
         SELECT 'default', 'k', 'cancelled', now(), 1 FROM generate_series(1, 20000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO jobs (queue, kind) SELECT 'default', 'k' FROM generate_series(1, 3)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE jobs").execute(&pool).await.unwrap();
    for sql in payfleet_queue::admin::LIVE_COUNT_QUERIES {
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}")))
            .fetch_all(&pool)
            .await
            .unwrap();
        let plan = plan.join("\n");
        assert!(!plan.contains("Seq Scan"), "{sql}\n{plan}");
    }
    let counts = payfleet_queue::admin::live_counts(&pool).await.unwrap();
    assert_eq!(counts.len(), 1);
    assert_eq!(
        (counts[0].state.as_str(), counts[0].count),
        ("available", 3)
    );
    let _ = Arc::new(());
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn every_answer_carries_its_request_id(pool: PgPool) {
    let app = spawn_app(pool).await;
    let given = app
        .http
        .get(format!("http://{}/healthz", app.addr))
        .header("x-request-id", "req-42")
        .send()
        .await
        .unwrap();
    assert_eq!(given.headers()["x-request-id"], "req-42");
    // None (or one that is not sane): a new one, also on errors.
    for header in [None, Some("bad id with spaces")] {
        let mut req = app.http.get(format!("http://{}/nowhere", app.addr));
        if let Some(h) = header {
            req = req.header("x-request-id", h);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 404);
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        assert_eq!(id.len(), 16, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_backlog_gauge_never_reads_the_jobs_scheduled_for_later(pool: PgPool) {
    // Many expiry-like jobs for tomorrow, two due now.
    sqlx::query(
        "INSERT INTO jobs (queue, kind, run_at)
         SELECT 'orders', 'k', now() + interval '1 day' FROM generate_series(1, 50000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO jobs (queue, kind) SELECT 'events', 'k' FROM generate_series(1, 2)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE jobs").execute(&pool).await.unwrap();
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {}",
        payfleet_queue::admin::LIVE_COUNT_QUERIES[2]
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let plan = plan.join("\n");
    assert!(!plan.contains("Seq Scan"), "{plan}");
    // The whole statement's pages (the root node's count): a handful, where reading the
    // scheduled jobs' index entries would take well over a hundred.
    let pages: u64 = plan
        .lines()
        .find_map(|l| l.trim().strip_prefix("Buffers: shared hit="))
        .and_then(|n| n.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(pages < 40, "{pages} pages read:\n{plan}");
    let due = payfleet_queue::admin::due_by_queue(&pool).await.unwrap();
    assert_eq!(
        due.iter()
            .map(|d| (d.queue.as_str(), d.due))
            .collect::<Vec<_>>(),
        [("events", 2)]
    );
}

/// What `promtool check metrics` (Prometheus' own linter) says of a text: nothing when clean.
fn promtool(text: &str) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool runs: install it with `apt-get install prometheus` (.ci/run does)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
    .trim()
    .to_owned()
}

/// `/metrics` passes Prometheus' own linter, after some work (a gauge with a `quantile` label
/// did not: that label is a summary's).
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn metrics_pass_promtool(pool: PgPool) {
    let app = spawn_fleet(pool.clone(), test_config()).await;
    let (status, _) = app
        .deliver(&internal(
            "m_1",
            &payment_body("payment.succeeded", "s", "1.00"),
        ))
        .await;
    assert_eq!(status, 200);
    // Processed by the fleet's workers, so its histograms have their series.
    wait_for(
        "the event to be processed",
        std::time::Duration::from_secs(20),
        async || processed_events(&pool).await == 1,
    )
    .await;
    let text = app.metrics().await;
    assert!(text.contains("payfleet_"), "{text}");
    assert_eq!(promtool(&text), "", "promtool on:\n{text}");
    // The fleet's one worker process, from the census: the rules alert when the events queue
    // has none.
    assert_eq!(
        sample(&text, "payfleet_queue_workers{queue=\"events\"}"),
        1.0,
        "{text}"
    );

    // The alert rules in docs/ops pass promtool too, and alert on metrics that exist.
    let out = std::process::Command::new("promtool")
        .args(["check", "rules", "docs/ops/alerts.yml"])
        .output()
        .expect("promtool runs");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let rules = std::fs::read_to_string("docs/ops/alerts.yml").unwrap();
    let mut named = 0;
    for word in rules.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("payfleet_") && word.len() > "payfleet_".len() {
            named += 1;
            // A histogram's series are its family's.
            let family = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| word.strip_suffix(s))
                .unwrap_or(word);
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "the alert rules name {word}, which /metrics does not export"
            );
        }
    }
    assert!(named >= 9, "{named} metrics named by the rules");
}

/// The value of the sample `name{labels}` in a `/metrics` text (0 when absent).
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// After a known workload the histograms count exactly it: each webhook answer by its route
/// template and status class, each event's processing run by its queue, kind and outcome, each
/// run's wait for its start, each event's receipt to effect; and the text still passes promtool.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_histograms_count_the_work_done(pool: PgPool) {
    let app = spawn_fleet(pool.clone(), test_config()).await;
    for i in 0..5 {
        let (status, _) = app
            .deliver(&internal(
                &format!("h_{i}"),
                &payment_body("payment.succeeded", &format!("s_{i}"), "1.00"),
            ))
            .await;
        assert_eq!(status, 200);
    }
    let mut forged = internal("h_forged", &payment_body("payment.succeeded", "s", "1.00"));
    forged.headers.retain(|(k, _)| k != "webhook-signature");
    forged
        .headers
        .push(("webhook-signature".into(), "v1,AAAA".into()));
    assert_eq!(app.deliver(&forged).await.0, 401);
    wait_for(
        "the five events to be processed",
        std::time::Duration::from_secs(20),
        async || processed_events(&pool).await == 5,
    )
    .await;
    let text = app.metrics().await;
    let webhooks = "payfleet_http_request_duration_seconds_count{route=\"/webhooks/{gateway}\"";
    assert_eq!(
        sample(&text, &format!("{webhooks},status=\"2xx\"}}")),
        5.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, &format!("{webhooks},status=\"4xx\"}}")),
        1.0,
        "{text}"
    );
    let runs = "payfleet_job_run_seconds_count{queue=\"events\",kind=\"process_payment_event\",outcome=\"complete\"}";
    assert_eq!(sample(&text, runs), 5.0, "{text}");
    assert!(
        sample(
            &text,
            "payfleet_job_start_delay_seconds_count{queue=\"events\"}"
        ) >= 5.0,
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "payfleet_webhook_to_effect_seconds_count{gateway=\"internal\"}"
        ),
        5.0,
        "{text}"
    );
    assert!(
        text.contains("# TYPE payfleet_job_run_seconds histogram"),
        "{text}"
    );
    assert_eq!(promtool(&text), "", "promtool on:\n{text}");

    // The Grafana dashboard in docs/ops reads only metrics that exist.
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("docs/ops/grafana.json").unwrap()).unwrap();
    let mut named = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if !word.starts_with("payfleet_") {
                    continue;
                }
                named += 1;
                let family = ["_bucket", "_count", "_sum"]
                    .iter()
                    .find_map(|s| word.strip_suffix(s))
                    .unwrap_or(word);
                let bare = family.strip_suffix("_total").unwrap_or(family);
                assert!(
                    text.contains(&format!("# TYPE {family} "))
                        || text.contains(&format!("# TYPE {bare} ")),
                    "the dashboard's panel {:?} reads {word}, which /metrics does not export",
                    panel["title"]
                );
            }
        }
    }
    assert!(named >= 20, "{named} series read by the dashboard");
}

/// A worker answers the payment-link and coins RPC and relays the order messages: without its
/// broker it cannot do its work, and says so; with it back, it is ready again.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_is_not_ready_while_its_broker_is_unreachable(pool: PgPool) {
    let proxy = TcpProxy::start("127.0.0.1:5672").await;
    let broker = payfleet::messaging::Broker::start(
        payfleet::secret::SecretUrl::new(format!("amqp://guest:guest@{}", proxy.addr)),
        "health",
        None,
    );
    let addr = probes_of(Readiness {
        pool,
        events: None,
        fleet: None,
        broker: Some(broker.clone()),
        database: Default::default(),
    })
    .await;
    let readyz = async || {
        let resp = reqwest::get(format!("http://{addr}/readyz")).await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json::<serde_json::Value>().await.unwrap())
    };
    wait_for(
        "connected",
        std::time::Duration::from_secs(30),
        async || readyz().await.0 == 200,
    )
    .await;
    assert_eq!(readyz().await.1["broker"], "ok");
    proxy.set(Link::Refused);
    wait_for(
        "not ready",
        std::time::Duration::from_secs(30),
        async || {
            readyz().await
                == (
                    503,
                    serde_json::json!({"database": "ok", "broker": "unavailable"}),
                )
        },
    )
    .await;
    proxy.set(Link::Up);
    wait_for(
        "ready again",
        std::time::Duration::from_secs(60),
        async || readyz().await.0 == 200,
    )
    .await;
    broker.stop();
}

/// A worker's probes (`/healthz`, `/readyz`) answering for `readiness`, on a port of their own.
async fn probes_of(readiness: Readiness) -> std::net::SocketAddr {
    let router = http::worker_router(
        readiness.pool.clone(),
        readiness,
        http::Callers::new(None, None, None, None),
        std::time::Duration::ZERO,
        Default::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

/// A label matcher: its label, operator and value.
type Matcher = (String, String, String);

/// The label matchers (`name="value"`, `name=~"a|b"`, `name!="value"`) of every selector of a
/// `payfleet_` metric in a PromQL text: the metric, then each matcher's label, operator and
/// value.
fn selectors(promql: &str) -> Vec<(String, Vec<Matcher>)> {
    let mut found = Vec::new();
    let mut rest = promql;
    while let Some(start) = rest.find("payfleet_") {
        rest = &rest[start..];
        let name_end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let name = rest[..name_end].to_owned();
        rest = &rest[name_end..];
        let Some(body) = rest.strip_prefix('{') else {
            continue;
        };
        let close = body.find('}').expect("a selector's braces close");
        let matchers = body[..close]
            .split(',')
            .filter(|m| !m.trim().is_empty())
            .map(|m| {
                let op_at = m.find(['=', '!']).expect("a matcher has an operator");
                let (label, tail) = m.split_at(op_at);
                let op_len = if tail.starts_with("=~") || tail.starts_with("!=") {
                    2
                } else {
                    1
                };
                let (op, value) = tail.split_at(op_len);
                (
                    label.trim().to_owned(),
                    op.to_owned(),
                    value.trim().trim_matches('"').to_owned(),
                )
            })
            .collect();
        found.push((name, matchers));
        rest = &body[close..];
    }
    found
}

/// Whether a `/metrics` text has a series of `metric` that every matcher accepts (a regex
/// matcher here is an alternation of plain values, as the rules write them).
fn has_series(text: &str, metric: &str, matchers: &[Matcher]) -> bool {
    text.lines()
        .filter_map(|l| l.strip_prefix(metric)?.strip_prefix('{'))
        .map(|l| l.split('}').next().unwrap_or_default())
        .any(|labels| {
            let value_of = |name: &str| {
                labels.split(',').find_map(|pair| {
                    let (k, v) = pair.split_once('=')?;
                    (k == name).then(|| v.trim_matches('"').to_owned())
                })
            };
            matchers.iter().all(|(label, op, want)| {
                let got = value_of(label).unwrap_or_default();
                match op.as_str() {
                    "=" => got == *want,
                    "!=" => got != *want,
                    "=~" => want.split('|').any(|w| w == got),
                    other => panic!("matcher {other}"),
                }
            })
        })
}

/// The alert rules and the dashboard ask for the label values the fleet exports: with a job
/// dead and an event rejected, the rules' selectors of the jobs and the events match a series of
/// the scrape. (The dead-jobs rule and panel once asked for `state="dead"`, which no series
/// has, so they could never fire nor show one.)
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_rules_and_the_dashboard_select_series_that_exist(pool: PgPool) {
    let app = spawn_fleet(pool.clone(), test_config()).await;
    sqlx::query(
        "INSERT INTO jobs (queue, kind, key, state, attempt, max_attempts, finished_at, errors)
         VALUES ('payments', 'deliver_hosted_event', 'hosted:s1', 'discarded', 25, 25, now(),
                 '[{\"error\": \"gateway answered 502\"}]')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let text = app.metrics().await;
    let rules = std::fs::read_to_string("docs/ops/alerts.yml").unwrap();
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("docs/ops/grafana.json").unwrap()).unwrap();
    let mut promql = vec![rules];
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            promql.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    // The gauges read from the database: every label value a selector asks of them is one a
    // series of this scrape has (the workload above gives each the state it asks for).
    let gauges = [
        "payfleet_jobs",
        "payfleet_payment_events_unprocessed",
        "payfleet_payment_events_oldest_unprocessed_seconds",
        "payfleet_queue_workers",
        "payfleet_ledger_sales_due",
    ];
    let mut checked = 0;
    for text_of in &promql {
        for (metric, matchers) in selectors(text_of) {
            if matchers.is_empty() || !gauges.contains(&metric.as_str()) {
                continue;
            }
            checked += 1;
            assert!(
                has_series(&text, &metric, &matchers),
                "{metric}{matchers:?} matches no series of /metrics:\n{text}"
            );
        }
    }
    assert!(checked >= 6, "{checked} selectors checked");
}

/// A database that takes the gauges' statements and never answers them (a table held by a
/// migration's lock) still gets a scrape its answer within Prometheus' timeout: the process's
/// own counters, with `payfleet_database_gauges_read 0`. The scrape used to wait for the lock.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_scrape_answers_in_time_when_the_database_holds_the_gauges_statements(pool: PgPool) {
    let app = spawn_fleet(pool.clone(), test_config()).await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let text = tokio::time::timeout(std::time::Duration::from_secs(9), app.metrics())
        .await
        .expect("the scrape is answered within Prometheus' ten seconds");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        sample(&text, "payfleet_database_gauges_read"),
        0.0,
        "{text}"
    );
    assert!(
        text.contains("# TYPE payfleet_webhooks_refused_total "),
        "{text}"
    );
    holder.rollback().await.unwrap();
    // Once the lock is gone the gauges are read again.
    let text = app.metrics().await;
    assert_eq!(
        sample(&text, "payfleet_database_gauges_read"),
        1.0,
        "{text}"
    );
}

/// A request the server stops at its answer timeout (a lock held it) is counted as the 503 it
/// was answered, under its route: the server's answer is made outside the router, and the
/// requests most worth seeing on the 5xx panel used to be missing from it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_request_stopped_at_its_answer_timeout_is_counted_as_its_503(pool: PgPool) {
    let mut config = test_config();
    config.http.answer_timeout = std::time::Duration::from_secs(1);
    let app = spawn_app_with(pool.clone(), config).await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let (status, body) = app.get("/orders/1").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("answer_timeout"), "{body}");
    holder.rollback().await.unwrap();
    let text = app.metrics().await;
    assert_eq!(
        sample(
            &text,
            "payfleet_http_request_duration_seconds_count{route=\"/orders/{number}\",status=\"5xx\"}"
        ),
        1.0,
        "{text}"
    );
}
