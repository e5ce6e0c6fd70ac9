//! A database outage as it happens: many senders at once while PostgreSQL is really
//! unreachable (a closed port, then a partition), through a proxy the test controls.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::helpers::*;

/// Sends `n` distinct webhooks at once; returns each answer with how long it took.
async fn burst(
    app: &Arc<TestApp>,
    prefix: &str,
    n: usize,
) -> Vec<(u16, serde_json::Value, Duration, bool)> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let app = app.clone();
            let id = format!("{prefix}_{i}");
            tokio::spawn(async move {
                let d = internal(&id, &payment_body("payment.succeeded", &id, "1.00"));
                let mut req = app
                    .http
                    .post(format!("http://{}/webhooks/internal", app.addr))
                    .body(d.body.clone());
                for (k, v) in &d.headers {
                    req = req.header(k, v);
                }
                let started = Instant::now();
                let resp = req.send().await.unwrap();
                let took = started.elapsed();
                let retry_after = resp.headers().contains_key("retry-after");
                let status = resp.status().as_u16();
                let body = resp.json().await.unwrap_or(serde_json::Value::Null);
                (status, body, took, retry_after)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn assert_all_unavailable_within(
    answers: &[(u16, serde_json::Value, Duration, bool)],
    limit: Duration,
) {
    for (status, body, took, retry_after) in answers {
        assert_eq!(*status, 503, "{body}");
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
        assert!(retry_after, "a 503 says when to come back");
        assert!(*took < limit, "answered after {took:?}: {body}");
    }
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn with_the_database_gone_every_sender_gets_a_fast_503_and_nothing_is_lost(pool: PgPool) {
    let proxy = DbProxy::for_database(&pool).await;
    let app = Arc::new(spawn_app(proxy.pool(&pool)).await);
    let (status, _) = app
        .deliver(&internal(
            "before",
            &payment_body("payment.succeeded", "before", "1.00"),
        ))
        .await;
    assert_eq!(status, 200);

    // The port closes: 200 senders at once, every one answered within a couple of seconds.
    proxy.set(Link::Refused);
    let answers = burst(&app, "refused", 200).await;
    assert_all_unavailable_within(&answers, Duration::from_secs(3));
    // What the outage counts can still be scraped, the database's gauges left out.
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("payfleet_database_gauges_read 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "payfleet_webhooks_refused_total{gateway=\"internal\",reason=\"unavailable\"} 200"
        ),
        "{metrics}"
    );
    assert!(!metrics.contains("payfleet_jobs{"), "{metrics}");

    // A partition: connections hang. The writer's connect timeout bounds every answer.
    proxy.set(Link::Blackhole);
    let answers = burst(&app, "blackhole", 100).await;
    assert_all_unavailable_within(&answers, Duration::from_secs(5));

    // Back: the gateways' resends are stored (after the writer's short pause).
    proxy.set(Link::Up);
    let started = Instant::now();
    loop {
        let (status, body) = app
            .deliver(&internal(
                "after",
                &payment_body("payment.succeeded", "after", "1.00"),
            ))
            .await;
        if status == 200 {
            assert_eq!(body["status"], "accepted");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still {status}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stored: Vec<String> = sqlx::query_scalar("SELECT event_id FROM payment_events ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        stored,
        vec!["before", "after"],
        "no half-written event from the outage"
    );
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, 2);
    assert!(
        app.metrics()
            .await
            .contains("payfleet_database_gauges_read 1")
    );
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_full_writer_queue_refuses_at_once_instead_of_blocking(pool: PgPool) {
    let proxy = DbProxy::for_database(&pool).await;
    let mut config = test_config();
    config.webhooks.queue_capacity = 8;
    let app = Arc::new(spawn_app_with(proxy.pool(&pool), config).await);
    // The writer hangs connecting for its timeout; meanwhile the queue fills.
    proxy.set(Link::Blackhole);
    let answers = burst(&app, "flood", 120).await;
    assert_all_unavailable_within(&answers, Duration::from_secs(5));
    let refused_at_once = answers
        .iter()
        .filter(|(_, body, took, _)| {
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("too many webhooks are waiting"))
                && *took < Duration::from_millis(1500)
        })
        .count();
    assert!(
        refused_at_once > 0,
        "some senders were refused without waiting for the writer"
    );
}

/// Found by `payfleet soak`: a process started while PostgreSQL was away (restarting, out of
/// connection slots) exited at once. It now waits for the server, as its requests and jobs
/// would; an error waiting cannot cure (an unknown role) still fails at once.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_process_starting_while_the_database_is_away_waits_for_it(pool: PgPool) {
    let proxy = DbProxy::for_database(&pool).await;
    proxy.set(Link::Refused);
    let o = pool.connect_options();
    let url = payfleet::secret::SecretUrl::new(format!(
        "postgres://{}@{}/{}",
        o.get_username(),
        proxy.addr,
        o.get_database().unwrap()
    ));
    let started = std::time::Instant::now();
    let connecting = tokio::spawn(async move { payfleet::db::connect(&url, 2, "work").await });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(
        !connecting.is_finished(),
        "it waits while the server is away"
    );
    proxy.set(Link::Up);
    let pool = connecting
        .await
        .unwrap()
        .expect("connected once the server is back");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(one, 1);
    assert!(started.elapsed() < std::time::Duration::from_secs(30));

    let stranger = payfleet::secret::SecretUrl::new(format!(
        "postgres://no_such_role@{}/{}",
        proxy.addr,
        o.get_database().unwrap()
    ));
    let started = std::time::Instant::now();
    let refused = payfleet::db::connect(&stranger, 2, "work").await;
    assert!(refused.is_err());
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "no waiting for what cannot change"
    );
}
