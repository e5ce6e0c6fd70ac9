//! Order messages over the real RabbitMQ: routed to the consuming service's queue by order
//! type, unbound types kept by the legacy queue's consumer, published from the outbox through
//! a broker outage without loss, and handled once per message id however often delivered.

use std::sync::Arc;
use std::time::Duration;

use lapin::types::AMQPValue;
use payfleet::messaging::Broker;
use payfleet::messaging::orders::{self, Handled, OrderMessage};
use payfleet::startup::Roles;
use serde_json::json;
use sqlx::{PgConnection, PgPool};

use crate::checkout::Shop;
use crate::health::metric;
use crate::helpers::*;

/// A consuming service: every message its handler runs for lands in `handled` (no unique key,
/// so a message handled twice would show twice).
async fn service(pool: &PgPool, config: &payfleet::config::Config, queue: &str) -> Broker {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS handled (queue text, message_id text, routing_key text)",
    )
    .execute(pool)
    .await
    .unwrap();
    let broker = Broker::start(
        config.amqp_url.clone(),
        &config.messaging.namespace,
        config.messaging.queue_ttl_ms,
    );
    let name = queue.to_owned();
    tokio::spawn(orders::consume(
        broker.clone(),
        pool.clone(),
        queue.to_owned(),
        format!("test-{queue}"),
        move |m: OrderMessage, tx: &mut PgConnection| -> Handled<'_> {
            let name = name.clone();
            Box::pin(async move {
                sqlx::query("INSERT INTO handled VALUES ($1, $2, $3)")
                    .bind(name)
                    .bind(&m.message_id)
                    .bind(m.routing_key())
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            })
        },
    ));
    broker
}

async fn handled(pool: &PgPool, queue: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT routing_key FROM handled WHERE queue = $1 ORDER BY routing_key")
        .bind(queue)
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn order_messages_go_to_their_services_queue_and_unbound_types_to_legacy(pool: PgPool) {
    // Only the subscriptions service is bound: one-off orders are a type no queue takes.
    let mut config = test_config();
    config.messaging.order_routes = "subscriptions=order.subscription.*".parse().unwrap();
    let shop = Shop {
        app: Arc::new(spawn_fleet(pool.clone(), config.clone()).await),
    };
    let _subscriptions = service(&pool, &config, "subscriptions").await;
    let seller = shop.seller("A").await;
    let one_off = shop.product(&seller, "10.00", "BRL").await;
    let club = shop
        .admin(
            "/admin/products",
            json!({"seller_id": seller, "name": "club", "kind": "subscription", "price": "19.90", "currency": "BRL", "interval": "month"}),
        )
        .await;
    let (status, answer) = shop
        .checkout(
            Some("k"),
            json!({"buyer_id": "b", "gateway": "internal", "items": [
                {"product_id": one_off, "quantity": 1},
                {"product_id": club["id"], "quantity": 1}]}),
        )
        .await;
    assert_eq!(status, 201, "{answer}");
    let subscription = answer["orders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["kind"] == "subscription")
        .unwrap()
        .clone();
    // The buyer pays the subscription on the internal gateway's page; the fleet does the rest.
    let (paid, _) = shop
        .app
        .pay(
            subscription["payment"]["url"].as_str().unwrap(),
            "succeeded",
        )
        .await;
    assert_eq!(paid, 200);
    wait_for(
        "order paid reaches subscriptions",
        Duration::from_secs(30),
        async || {
            handled(&pool, "subscriptions").await
                == ["order.subscription.created", "order.subscription.paid"]
        },
    )
    .await;
    // The one-off order's message went to no service: the legacy consumer kept it.
    wait_for(
        "unrouted message kept",
        Duration::from_secs(30),
        async || {
            let kept: Vec<(String, String)> =
                sqlx::query_as("SELECT routing_key, order_kind FROM unrouted_messages")
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            kept == [("order.one_off.created".to_owned(), "one_off".to_owned())]
        },
    )
    .await;
    assert!(
        !handled(&pool, "subscriptions")
            .await
            .iter()
            .any(|k| k.contains("one_off"))
    );
    // The relay marks a message published once the broker confirmed it, which may be just
    // after a consumer already handled it.
    wait_for(
        "every message marked published",
        Duration::from_secs(30),
        async || {
            let unpublished: i64 =
                sqlx::query_scalar("SELECT count(*) FROM order_events WHERE published_at IS NULL")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            unpublished == 0
        },
    )
    .await;
}

async fn kept_unrouted(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM unrouted_messages")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The unrouted messages' queue deleted (by an operator, or its TTL) and declared again by its
/// consumer has lost its binding: a message of a type no service binds would then reach no
/// queue at all. Published as mandatory, it comes back instead of being confirmed into nowhere,
/// stays in the outbox, and goes again once the relay has declared the bindings again.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_message_that_would_reach_no_queue_stays_until_its_queue_is_bound_again(pool: PgPool) {
    let mut config = test_config();
    config.messaging.order_routes = "subscriptions=order.subscription.*".parse().unwrap();
    let fleet = spawn_fleet(pool.clone(), config.clone()).await;
    order_events(&pool, 1).await;
    wait_for("the first kept", Duration::from_secs(30), async || {
        kept_unrouted(&pool).await == 1
    })
    .await;
    let returned = async || {
        let text = fleet.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix("payfleet_amqp_messages_total{event=\"returned\"} "))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    assert_eq!(returned().await, 0.0, "counted from zero");
    // Its consumer declares it again, bound to nothing.
    deleted_and_declared_again(&format!("{}.orders.legacy", config.messaging.namespace)).await;
    expired_events(&pool).await;
    wait_for("the second kept", Duration::from_secs(60), async || {
        kept_unrouted(&pool).await == 2
    })
    .await;
    // The broker's return is counted, apart from the refusals (nacks).
    assert!(returned().await >= 1.0);
}

/// A service's queue deleted (to be declared anew as quorum: README, "Upgrading") and declared
/// again by the service's consumer, which knows no routes: bound to nothing, its messages went to
/// the legacy queue and stayed there, unhandled, until a relay set up again. The legacy consumer
/// now sees a message the routes bind, declares the bindings again and sends the message again:
/// the service handles it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_service_queue_declared_again_by_its_consumer_is_bound_again(pool: PgPool) {
    let config = test_config();
    let _fleet = spawn_fleet(pool.clone(), config.clone()).await;
    let _fulfilment = service(&pool, &config, "fulfilment").await;
    order_events(&pool, 1).await;
    wait_for("the first handled", Duration::from_secs(30), async || {
        handled(&pool, "fulfilment").await.len() == 1
    })
    .await;
    // Its consumer declares it again, bound to nothing.
    deleted_and_declared_again(&format!("{}.fulfilment", config.messaging.namespace)).await;
    expired_events(&pool).await;
    wait_for(
        "the second handled by its service",
        Duration::from_secs(30),
        async || {
            handled(&pool, "fulfilment").await == ["order.one_off.created", "order.one_off.expired"]
        },
    )
    .await;
    // Kept as well, so that no message that reached the legacy queue goes unrecorded.
    assert_eq!(kept_unrouted(&pool).await, 1);
}

/// Waits until `queue` exists with one consumer. (Each rabbitmqctl is an Erlang VM starting:
/// asked once a second.)
async fn consumed_once(queue: &str) {
    wait_for(
        &format!("{queue} consumed"),
        Duration::from_secs(60),
        async || {
            tokio::time::sleep(Duration::from_secs(1)).await;
            rabbitmqctl(&["list_queues", "name", "consumers"])
                .lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == [queue, "1"])
        },
    )
    .await;
}

/// Deletes `queue` and waits until its consumer has declared it again (as an operator's
/// deletion does: README, "Upgrading").
async fn deleted_and_declared_again(queue: &str) {
    rabbitmqctl(&["delete_queue", queue]);
    consumed_once(queue).await;
}

/// An `expired` event for every fixture order.
async fn expired_events(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO order_events (order_id, kind, payload) SELECT id, 'expired', '{}' FROM orders",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// `n` order events written as the business code writes them, for fixture orders.
async fn order_events(pool: &PgPool, n: usize) {
    let sessions: Vec<String> = (0..n).map(|i| format!("s{i}")).collect();
    let sessions: Vec<&str> = sessions.iter().map(String::as_str).collect();
    orders_for(pool, "internal", &sessions, "10.00", "BRL").await;
    sqlx::query(
        "INSERT INTO order_events (order_id, kind, payload) SELECT id, 'created', '{}' FROM orders",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// The relay joins to their orders only the messages it takes (and takes new ones and refused
/// ones due again, each by its own limit), whatever plan finds the waiting ones: with index scans off, the unpublished rows come through a bitmap and a sort, the plan
/// the planner picks while its statistics count few of them (a drained backlog, a broker
/// outage); a read that joined before it limited joined every waiting message.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_relay_joins_only_the_messages_it_takes(pool: PgPool) {
    order_events(&pool, 300).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET LOCAL enable_indexscan = off; PREPARE take(bigint) AS {}",
        payfleet::orders::outbox::TAKE
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    let plan: serde_json::Value =
        sqlx::query_scalar("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE take(200)")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    // Every join of the plan, with the rows it made.
    fn joined(node: &serde_json::Value, out: &mut Vec<(String, u64)>) {
        let kind = node["Node Type"].as_str().unwrap_or_default();
        if kind.contains("Join") || kind == "Nested Loop" {
            out.push((
                kind.to_owned(),
                node["Actual Rows"].as_u64().unwrap_or(u64::MAX),
            ));
        }
        for child in node["Plans"].as_array().into_iter().flatten() {
            joined(child, out);
        }
    }
    let mut joins = Vec::new();
    joined(&plan[0]["Plan"], &mut joins);
    assert!(!joins.is_empty(), "no join in {plan}");
    assert!(
        joins.iter().all(|(_, rows)| *rows <= 200),
        "joined more than it takes: {joins:?}"
    );
    tx.rollback().await.unwrap();
    // And it takes them, oldest first.
    let mut tx = pool.begin().await.unwrap();
    let taken: Vec<i64> = sqlx::query_scalar(payfleet::orders::outbox::TAKE)
        .bind(200_i64)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let oldest: Vec<i64> = sqlx::query_scalar("SELECT id FROM order_events ORDER BY id LIMIT 200")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(taken, oldest);
    tx.rollback().await.unwrap();
    // Refused ones put off among them (the oldest 60 due again, the next 10 not yet): a read
    // takes the 200 oldest new ones and 50 of those due, never one not due.
    sqlx::query(
        "UPDATE order_events SET publish_attempts = 1,
             publish_after = CASE WHEN id < (SELECT min(id) + 60 FROM order_events)
                                  THEN now() - interval '1 second' ELSE now() + interval '1 hour' END
         WHERE id < (SELECT min(id) + 70 FROM order_events)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    let taken: Vec<i64> = sqlx::query_scalar(payfleet::orders::outbox::TAKE)
        .bind(200_i64)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let (new, due): (Vec<i64>, Vec<i64>) = sqlx::query_as(
        "SELECT COALESCE(array_agg(id) FILTER (WHERE publish_after IS NULL), '{}'),
                COALESCE(array_agg(id) FILTER (WHERE publish_after <= now()), '{}')
         FROM order_events WHERE id = ANY($1)",
    )
    .bind(&taken)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!((new.len(), due.len()), (200, 50), "{taken:?}");
    let oldest_new: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM order_events WHERE publish_after IS NULL ORDER BY id LIMIT 200",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut new = new;
    new.sort();
    assert_eq!(new, oldest_new);
    let mut sorted = taken.clone();
    sorted.dedup();
    assert_eq!(sorted.len(), 250, "no row taken twice");
    tx.rollback().await.unwrap();
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_broker_outage_delays_order_messages_and_loses_none(pool: PgPool) {
    let amqp = TcpProxy::start("127.0.0.1:5672").await;
    let direct = test_config();
    let mut config = direct.clone();
    config.amqp_url =
        payfleet::secret::SecretUrl::new(format!("amqp://guest:guest@{}/%2f", amqp.addr));
    let _fulfilment = service(&pool, &direct, "fulfilment").await;
    // The broker is gone before the worker starts: nothing can be published.
    amqp.set(Link::Refused);
    let worker = spawn_roles(pool.clone(), config, Roles::WORK).await;
    order_events(&pool, 40).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let text = worker.metrics().await;
    assert_eq!(metric(&text, "payfleet_outbox_unpublished "), 40.0);
    assert!(metric(&text, "payfleet_outbox_oldest_unpublished_seconds ") >= 1.0);
    assert!(handled(&pool, "fulfilment").await.is_empty());
    // Back: the relay reconnects by itself and every message arrives, once.
    amqp.set(Link::Up);
    wait_for("all 40 handled", Duration::from_secs(30), async || {
        handled(&pool, "fulfilment").await.len() >= 40
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ids: Vec<(String, i64)> = sqlx::query_as(
        "SELECT message_id, count(*) FROM handled GROUP BY message_id HAVING count(*) > 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(ids.is_empty(), "handled twice: {ids:?}");
    assert_eq!(handled(&pool, "fulfilment").await.len(), 40);
    let text = worker.metrics().await;
    assert_eq!(metric(&text, "payfleet_outbox_unpublished "), 0.0);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_message_published_twice_is_handled_once(pool: PgPool) {
    let config = test_config();
    let _fulfilment = service(&pool, &config, "fulfilment").await;
    let _worker = spawn_roles(pool.clone(), config, Roles::WORK).await;
    order_events(&pool, 5).await;
    wait_for("5 handled", Duration::from_secs(20), async || {
        handled(&pool, "fulfilment").await.len() == 5
    })
    .await;
    // As if the relay crashed after the broker's confirms and before its commit: the rows go
    // again, the consumer recognises their ids.
    sqlx::query("UPDATE order_events SET published_at = NULL")
        .execute(&pool)
        .await
        .unwrap();
    wait_for("republished", Duration::from_secs(20), async || {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM order_events WHERE published_at IS NULL")
                .fetch_one(&pool)
                .await
                .unwrap();
        n == 0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(handled(&pool, "fulfilment").await.len(), 5);
    let consumed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM consumed_messages WHERE consumer = 'test-fulfilment'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(consumed, 5);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_message_that_is_no_order_message_is_kept_not_dropped(pool: PgPool) {
    let config = test_config();
    let broker = service(&pool, &config, "fulfilment").await;
    wait_for(
        "the consumer's queue",
        Duration::from_secs(30),
        async || {
            // A passive declare of a queue not there yet closes its channel: a new one each time.
            let channel = broker.connected().await.create_channel().await.unwrap();
            channel
                .queue_declare(
                    broker.name("fulfilment").as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .is_ok()
        },
    )
    .await;
    // Published until the broker confirms it: on two cores shared with a whole suite and a
    // broker cluster, a connection may be reset under a publish nothing confirms (a CI run
    // once waited 30 s here for a message never kept). Kept under its id, it is kept once.
    wait_for(
        "the message published",
        Duration::from_secs(30),
        async || {
            let Ok(channel) = broker.connected().await.create_channel().await else {
                return false;
            };
            if channel
                .confirm_select(lapin::options::ConfirmSelectOptions::default())
                .await
                .is_err()
            {
                return false;
            }
            let Ok(confirm) = channel
                .basic_publish(
                    "".into(),
                    broker.name("fulfilment").as_str().into(),
                    lapin::options::BasicPublishOptions::default(),
                    b"not json at all",
                    lapin::BasicProperties::default().with_message_id("odd-1".into()),
                )
                .await
            else {
                return false;
            };
            matches!(confirm.await, Ok(lapin::Confirmation::Ack(_)))
        },
    )
    .await;
    // Half a second alone; the budget is for a suite sharing two cores with a broker cluster's
    // failover (a CI run once took over ten seconds here), as the other waits of this file.
    wait_for("kept", Duration::from_secs(30), async || {
        let kept: Vec<(String, serde_json::Value)> = sqlx::query_as(
            "SELECT order_kind, body FROM unrouted_messages WHERE message_id = 'odd-1'",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        kept == [(
            "unreadable".to_owned(),
            serde_json::json!("not json at all"),
        )]
    })
    .await;
    assert!(handled(&pool, "fulfilment").await.is_empty());
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn consumers_forget_messages_after_a_month_not_before(pool: PgPool) {
    sqlx::query(
        "INSERT INTO consumed_messages (consumer, message_id, consumed_at)
         VALUES ('c', 'old', now() - interval '31 days'), ('c', 'recent', now() - interval '29 days')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let n = orders::prune_consumed(&pool, Duration::from_secs(30 * 24 * 3600))
        .await
        .unwrap();
    assert_eq!(n, 1);
    let left: Vec<String> = sqlx::query_scalar("SELECT message_id FROM consumed_messages")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ["recent"]);
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_message_its_consumer_always_fails_is_kept_dead_and_replayed_after_a_fix(pool: PgPool) {
    let config = test_config();
    let attempts = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let fixed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let broker = Broker::start(
        config.amqp_url.clone(),
        &config.messaging.namespace,
        config.messaging.queue_ttl_ms,
    );
    let (counter, switch) = (attempts.clone(), fixed.clone());
    tokio::spawn(orders::consume(
        broker.clone(),
        pool.clone(),
        "fulfilment".into(),
        "test-broken".into(),
        move |_m: OrderMessage, tx: &mut PgConnection| -> Handled<'_> {
            let (counter, switch) = (counter.clone(), switch.clone());
            Box::pin(async move {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if switch.load(std::sync::atomic::Ordering::SeqCst) {
                    return Ok(());
                }
                // A bug in the handler: it fails whatever the message.
                sqlx::query("SELECT 1 / 0").execute(&mut *tx).await?;
                Ok(())
            })
        },
    ));
    let _worker = spawn_roles(pool.clone(), config.clone(), Roles::WORK).await;
    order_events(&pool, 1).await;
    wait_for(
        "the message to be dead",
        Duration::from_secs(30),
        async || !orders::dead_messages(&pool, 10).await.unwrap().is_empty(),
    )
    .await;
    let dead = orders::dead_messages(&pool, 10).await.unwrap();
    assert_eq!(dead[0].attempts, orders::MAX_HANDLER_ATTEMPTS);
    assert!(dead[0].last_error.contains("division by zero"), "{dead:?}");
    // Not delivered again and again: the count stops.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        attempts.load(std::sync::atomic::Ordering::SeqCst),
        orders::MAX_HANDLER_ATTEMPTS as u32
    );
    let findings = payfleet::consistency::check(&pool, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        findings.iter().any(|f| f.check == "order_message_dead"),
        "{findings:?}"
    );
    // Fixed, then replayed: handled once.
    fixed.store(true, std::sync::atomic::Ordering::SeqCst);
    let out = payfleet(
        &pool,
        &["messages", "replay", "test-broken", &dead[0].message_id],
    )
    .output()
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for(
        "the replayed message to be handled",
        Duration::from_secs(30),
        async || {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM consumed_messages WHERE consumer = 'test-broken'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            n == 1
        },
    )
    .await;
    assert!(orders::dead_messages(&pool, 10).await.unwrap().is_empty());
}

/// A message whose handler failed and then handled it leaves no failure behind: it is neither
/// listed among the dead nor reported as one no service handled.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_message_handled_after_failing_leaves_no_failure_behind(pool: PgPool) {
    let config = test_config();
    let attempts = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let broker = Broker::start(
        config.amqp_url.clone(),
        &config.messaging.namespace,
        config.messaging.queue_ttl_ms,
    );
    let counter = attempts.clone();
    tokio::spawn(orders::consume(
        broker.clone(),
        pool.clone(),
        "fulfilment".into(),
        "test-flaky".into(),
        move |_m: OrderMessage, tx: &mut PgConnection| -> Handled<'_> {
            let counter = counter.clone();
            Box::pin(async move {
                // Its first two deliveries fail (a bug met and mended, a constraint's race).
                if counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 2 {
                    sqlx::query("SELECT 1 / 0").execute(&mut *tx).await?;
                }
                Ok(())
            })
        },
    ));
    let _worker = spawn_roles(pool.clone(), config.clone(), Roles::WORK).await;
    order_events(&pool, 1).await;
    wait_for(
        "the message to be handled",
        Duration::from_secs(30),
        async || {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM consumed_messages WHERE consumer = 'test-flaky'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            n == 1
        },
    )
    .await;
    assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), 3);
    let failures: i64 =
        sqlx::query_scalar("SELECT count(*) FROM message_failures WHERE consumer = 'test-flaky'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(failures, 0);
}

/// A broker client for `config`'s namespace and queues.
fn broker_of(config: &payfleet::config::Config) -> Broker {
    Broker::start_with(
        config.amqp_url.clone(),
        &config.messaging.namespace,
        config.messaging.queue_ttl_ms,
        config.messaging.queues,
    )
}

/// A fulfilment consumer that refuses every message as an outage would (so it is requeued,
/// uncounted by the consumer): how many times it was handed one.
fn refusing_fulfilment(broker: &Broker, pool: &PgPool) -> Arc<std::sync::atomic::AtomicU32> {
    let attempts = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counter = attempts.clone();
    tokio::spawn(orders::consume(
        broker.clone(),
        pool.clone(),
        "fulfilment".into(),
        "test-refusing".into(),
        move |_m: OrderMessage, _tx: &mut PgConnection| -> Handled<'_> {
            let counter = counter.clone();
            Box::pin(async move {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Err(sqlx::Error::PoolTimedOut)
            })
        },
    ));
    attempts
}

/// Quorum queues (the default) count each delivery of a message; one its consumer keeps
/// refusing (here: an outage that never ends, so it is requeued every time) goes to the
/// dead-letter queue after `PAYFLEET_AMQP_DELIVERY_LIMIT` deliveries instead of looping forever.
/// There the workers keep it dead for an operator, as a message a consumer gave up on (left in
/// the queue, no command, metric or check saw it); replayed, it is sent to the services again.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_message_its_consumer_keeps_refusing_is_dead_lettered_kept_and_replayed(pool: PgPool) {
    let mut config = test_config();
    assert!(config.messaging.queues.quorum, "quorum queues by default");
    config.messaging.queues.delivery_limit = 2;
    let broker = broker_of(&config);
    let attempts = refusing_fulfilment(&broker, &pool);
    let _worker = spawn_roles(pool.clone(), config.clone(), Roles::WORK).await;
    order_events(&pool, 1).await;
    let dead_lettered = async || {
        orders::dead_messages(&pool, 10)
            .await
            .unwrap()
            .into_iter()
            .filter(|m| m.consumer == orders::DEAD_LETTERED)
            .collect::<Vec<_>>()
    };
    let mut kept = Vec::new();
    wait_for(
        "the message dead-lettered and kept",
        Duration::from_secs(30),
        async || {
            kept = dead_lettered().await;
            !kept.is_empty()
        },
    )
    .await;
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].routing_key, "order.one_off.created");
    assert!(kept[0].last_error.contains("dead-lettered"), "{kept:?}");
    // Delivered the limit's times (and once more, which the broker dead-letters), no more.
    let tried = attempts.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), tried);
    assert!((2..=3).contains(&tried), "{tried} deliveries");
    // An operator sees it...
    let findings = findings_of(&pool, "order_message_dead").await;
    assert!(
        findings
            .iter()
            .any(|(subject, _)| subject.contains(orders::DEAD_LETTERED)),
        "{findings:?}"
    );
    // ... and replays it: sent to the service again, which tries it again; dead-lettered once
    // more, it is kept again.
    let replay = async |force: bool| {
        orders::replay_dead(
            &pool,
            &payfleet::orders::outbox::OrderOutbox,
            orders::DEAD_LETTERED,
            &kept[0].message_id,
            force,
        )
        .await
    };
    replay(false).await.unwrap();
    assert!(dead_lettered().await.is_empty());
    wait_for(
        "delivered again and kept again",
        Duration::from_secs(30),
        async || {
            attempts.load(std::sync::atomic::Ordering::SeqCst) > tried
                && dead_lettered().await.len() == 1
        },
    )
    .await;
    // A message written longer ago than the consumers keep their records of what they handled:
    // replayed, a service that handled it would handle it again. Refused without --force, the
    // dead message kept; with it, sent.
    sqlx::query("UPDATE order_events SET created_at = now() - interval '31 days'")
        .execute(&pool)
        .await
        .unwrap();
    let old = replay(false).await.unwrap_err();
    assert!(
        matches!(old, orders::ReplayMessageError::OlderThanRecords { .. }),
        "{old}"
    );
    assert_eq!(dead_lettered().await.len(), 1);
    replay(true).await.unwrap();
}

/// The dead-letter queue deleted (as README's "Upgrading" says to, to declare it with a new
/// limit) is declared again by its keeper, bound to its exchange again: before, only a service
/// queue's declaration bound it, and until one came, every message the broker dead-lettered
/// went to an exchange without a queue and was dropped, with no trace.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_dead_letter_queue_declared_again_by_its_keeper_takes_dead_letters_again(pool: PgPool) {
    let mut config = test_config();
    config.messaging.queues.delivery_limit = 2;
    let broker = broker_of(&config);
    let attempts = refusing_fulfilment(&broker, &pool);
    let _worker = spawn_roles(pool.clone(), config.clone(), Roles::WORK).await;
    let dead = format!("{}.dead", config.messaging.namespace);
    consumed_once(&dead).await;
    deleted_and_declared_again(&dead).await;
    order_events(&pool, 1).await;
    wait_for(
        "the message dead-lettered and kept",
        Duration::from_secs(30),
        async || {
            orders::dead_messages(&pool, 10)
                .await
                .unwrap()
                .iter()
                .any(|m| m.consumer == orders::DEAD_LETTERED)
        },
    )
    .await;
    assert!(attempts.load(std::sync::atomic::Ordering::SeqCst) >= 2);
}

/// A database that answers but refuses writes (a storage-full instance turned read-only) refuses
/// the dead-letter keeper's record too: the keeper holds the message, unacknowledged, until it
/// can keep it. Requeued instead, a dead-letter queue that counts deliveries (here a limit of 2,
/// as RabbitMQ 4 gives every quorum queue 20) dropped it, with nothing behind it.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn the_dead_letter_keeper_holds_a_message_the_database_will_not_take_yet(pool: PgPool) {
    let mut config = test_config();
    config.messaging.queues.delivery_limit = 2;
    // The dead-letter queue as a broker that counts its deliveries has it.
    declare_queue(
        &config,
        &format!("{}.dead", config.messaging.namespace),
        &[
            ("x-queue-type", AMQPValue::LongString("quorum".into())),
            ("x-delivery-limit", AMQPValue::LongUInt(2)),
        ],
    )
    .await
    .unwrap();
    // Writes to the kept messages refused, as a read-only database refuses them.
    sqlx::raw_sql(
        "CREATE TABLE refusing (on_ boolean NOT NULL);
         INSERT INTO refusing VALUES (true);
         CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF (SELECT on_ FROM refusing) THEN
                 RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction' USING ERRCODE = '25006';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse BEFORE INSERT ON message_failures FOR EACH ROW EXECUTE FUNCTION refuse();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let broker = broker_of(&config);
    refusing_fulfilment(&broker, &pool);
    let _worker = spawn_roles(pool.clone(), config.clone(), Roles::WORK).await;
    order_events(&pool, 1).await;
    wait_for("published", Duration::from_secs(30), async || {
        unpublished_count(&pool).await == 0
    })
    .await;
    // Requeued every half second, it would have passed the dead-letter queue's limit of 2.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(orders::dead_messages(&pool, 10).await.unwrap().is_empty());
    sqlx::query("UPDATE refusing SET on_ = false")
        .execute(&pool)
        .await
        .unwrap();
    wait_for(
        "kept once the database takes it",
        Duration::from_secs(30),
        async || {
            orders::dead_messages(&pool, 10)
                .await
                .unwrap()
                .iter()
                .any(|m| m.consumer == orders::DEAD_LETTERED)
        },
    )
    .await;
}

/// The database gone (its port closed) while a service consumes: the message waits for it,
/// unacknowledged, and is handled once it is back. Requeued every half second instead, each
/// delivery counted toward the quorum queue's limit, and an outage of a few minutes (here a few
/// seconds, the limit being 2) sent the service's messages to the dead-letter queue, which no
/// operator's command lists.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_database_outage_holds_a_services_messages_without_spending_their_deliveries(
    pool: PgPool,
) {
    let mut config = test_config();
    config.messaging.queues.delivery_limit = 2;
    sqlx::query("CREATE TABLE handled (queue text, message_id text, routing_key text)")
        .execute(&pool)
        .await
        .unwrap();
    let proxy = DbProxy::for_database(&pool).await;
    let broker = broker_of(&config);
    // The consumer's pool gives up on a connection after a second (the default pool's five
    // would space the attempts too far apart for a short test).
    let options = (*pool.connect_options())
        .clone()
        .host(&proxy.addr.ip().to_string())
        .port(proxy.addr.port());
    let through = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(options);
    tokio::spawn(orders::consume(
        broker.clone(),
        through,
        "fulfilment".into(),
        "test-held".into(),
        move |m: OrderMessage, tx: &mut PgConnection| -> Handled<'_> {
            Box::pin(async move {
                sqlx::query("INSERT INTO handled VALUES ('fulfilment', $1, $2)")
                    .bind(&m.message_id)
                    .bind(m.routing_key())
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            })
        },
    ));
    let _worker = spawn_roles(pool.clone(), config.clone(), Roles::WORK).await;
    proxy.set(Link::Refused);
    order_events(&pool, 1).await;
    wait_for("published", Duration::from_secs(30), async || {
        unpublished_count(&pool).await == 0
    })
    .await;
    // Requeued, it would have been delivered every second and a half: past its limit of 2.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(handled(&pool, "fulfilment").await.is_empty());
    proxy.set(Link::Up);
    wait_for(
        "handled once the database is back",
        Duration::from_secs(30),
        async || handled(&pool, "fulfilment").await.len() == 1,
    )
    .await;
    assert!(
        orders::dead_messages(&pool, 10).await.unwrap().is_empty(),
        "nothing dead-lettered"
    );
}

/// A queue an earlier release declared classic (the broker never changes a queue's type) is
/// used as it is, with a warning, rather than stopping the fleet: its messages still flow.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_classic_queue_from_before_quorum_queues_is_used_as_it_is(pool: PgPool) {
    let config = test_config();
    let ns = config.messaging.namespace.clone();
    declare_queue(&config, &format!("{ns}.fulfilment"), &[])
        .await
        .unwrap();
    let _fulfilment = service(&pool, &config, "fulfilment").await;
    let _worker = spawn_roles(pool.clone(), config.clone(), Roles::WORK).await;
    order_events(&pool, 3).await;
    wait_for("handled", Duration::from_secs(30), async || {
        handled(&pool, "fulfilment").await.len() == 3
    })
    .await;
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_worker_is_ready_for_calls_once_its_rpc_consumers_take_requests(pool: PgPool) {
    // A request sent before its consumer is set up (its queue maybe not even declared) is lost
    // and its caller answered 503 at the timeout: readiness counts the consumers, not the
    // connection.
    let config = test_config();
    let running = payfleet::startup::start(&config, pool.clone(), Roles::WORK, None).unwrap();
    let broker = running.broker().clone();
    wait_for(
        "the worker's RPC consumers (payment links, their batches, coins)",
        Duration::from_secs(20),
        async || running.rpc_ready(),
    )
    .await;
    assert_eq!(broker.answering(), 3);
    // A receiver's first checkout then finds the payment side answering: 201 at once.
    let shop = Shop {
        app: Arc::new(spawn_roles(pool.clone(), config, Roles::SERVE).await),
    };
    let order = shop.one_order("10.00").await;
    assert!(order["payment"]["url"].is_string(), "{order}");
    running.stop().await;
    wait_for(
        "no consumer counted once the worker stopped",
        Duration::from_secs(10),
        async || broker.answering() == 0,
    )
    .await;
}

/// A connection and channel of the test's own to the broker, and the arguments every queue of
/// the test's fleet is declared with (its time to live), to declare a queue as the fleet would.
async fn own_channel(
    config: &payfleet::config::Config,
) -> (lapin::Connection, lapin::Channel, lapin::types::FieldTable) {
    let connection = lapin::Connection::connect(
        config.amqp_url.expose(),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut args = lapin::types::FieldTable::default();
    args.insert(
        "x-expires".into(),
        lapin::types::AMQPValue::LongUInt(config.messaging.queue_ttl_ms.unwrap()),
    );
    (connection, channel, args)
}

/// Declares the durable `queue` on a connection of its own, as a broker would have it (another
/// release, another setting), with the test's expiry and `extra` arguments.
async fn declare_queue(
    config: &payfleet::config::Config,
    queue: &str,
    extra: &[(&str, AMQPValue)],
) -> Result<(), lapin::Error> {
    let (connection, channel, mut args) = own_channel(config).await;
    for (name, value) in extra {
        args.insert((*name).into(), value.clone());
    }
    let declared = channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await;
    let _ = connection.close(200, "done".into()).await;
    declared.map(|_| ())
}

/// Whether `queue` is a classic queue: the broker accepts a declaration of it as one only if it
/// is (the type is among the arguments a queue's declarations must agree on).
async fn declared_classic(config: &payfleet::config::Config, queue: &str) -> bool {
    let classic = AMQPValue::LongString("classic".into());
    match declare_queue(config, queue, &[("x-queue-type", classic)]).await {
        Ok(_) => true,
        Err(e) => {
            assert!(e.to_string().contains("x-queue-type"), "{e}");
            false
        }
    }
}

/// An RPC request is worth nothing once its caller gave up, so its queues are classic by
/// default (a quorum queue's replication and flush only lengthened a link's round trip on one
/// node); on a cluster `PAYFLEET_AMQP_RPC_QUORUM=on` makes them quorum queues, which go on
/// through the loss of a node. Links travel through either kind. (The services' queues stay
/// quorum queues: the dead-letter test above counts their deliveries, which only they do.)
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn rpc_request_queues_are_classic_unless_asked(pool: PgPool) {
    for rpc_quorum in [false, true] {
        let mut config = test_config();
        assert!(!config.messaging.queues.rpc_quorum, "classic by default");
        config.messaging.queues.rpc_quorum = rpc_quorum;
        let (running, receiver) =
            worker_then_receiver(&pool, &config, Duration::from_secs(20)).await;
        let shop = Shop {
            app: Arc::new(receiver),
        };
        let order = shop.one_order("10.00").await;
        assert!(order["payment"]["url"].is_string(), "{order}");
        let ns = &config.messaging.namespace;
        for rpc in ["payment_links", "payment_link_batches", "coins"] {
            assert_eq!(
                declared_classic(&config, &format!("{ns}.{rpc}")).await,
                !rpc_quorum,
                "{rpc} with PAYFLEET_AMQP_RPC_QUORUM {rpc_quorum}"
            );
        }
        running.stop().await;
    }
}

/// A queue of the test's own, bound to the order messages by `pattern`, that refuses every
/// message (full, `reject-publish`): the broker nacks what it routes there, as it does for a
/// service queue an operator capped, or a quorum queue without its majority. Exclusive: it goes
/// with `connection`.
async fn refusing_queue(config: &payfleet::config::Config, pattern: &str) -> lapin::Connection {
    use lapin::types::AMQPValue;
    let (connection, channel, _) = own_channel(config).await;
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let name = format!("{}.refusing", config.messaging.namespace);
    channel
        .queue_declare(
            name.as_str().into(),
            lapin::options::QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            name.as_str().into(),
            format!("{}.orders", config.messaging.namespace)
                .as_str()
                .into(),
            pattern.into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    connection
}

async fn unpublished_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM order_events WHERE published_at IS NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A message the broker keeps refusing (here: every `expired`, routed to a full queue) is tried
/// again on its own clock, backing off: it holds up no other message, an operator sees it with
/// the broker's answer (`payfleet messages unpublished`, the `order_message_refused` check)
/// and sends it at once once the cause is gone (`payfleet messages send`). Before, every batch
/// took it again, failed, and paused the relay for up to five seconds: a thousand messages
/// behind it took half a minute. (Its finding needs three refusals in a row: a blip's one
/// refusal is none.)
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_message_the_broker_keeps_refusing_holds_up_no_other_and_is_sent_again_by_hand(
    pool: PgPool,
) {
    use payfleet::orders::outbox;
    let config = test_config();
    let _fleet = spawn_fleet(pool.clone(), config.clone()).await;
    // One message through first: the relay has declared the exchange.
    order_events(&pool, 1).await;
    wait_for("the first published", Duration::from_secs(30), async || {
        unpublished_count(&pool).await == 0
    })
    .await;
    let refusing = refusing_queue(&config, "order.*.expired").await;
    let poison: i64 = sqlx::query_scalar(
        "INSERT INTO order_events (order_id, kind, payload) SELECT id, 'expired', '{}' FROM orders RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let attempts = async || -> i32 {
        sqlx::query_scalar("SELECT publish_attempts FROM order_events WHERE id = $1")
            .bind(poison)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    wait_for("three refusals", Duration::from_secs(60), async || {
        attempts().await >= 3
    })
    .await;
    // A thousand messages behind it go at once.
    let sessions: Vec<String> = (0..1000).map(|i| format!("more{i}")).collect();
    let sessions: Vec<&str> = sessions.iter().map(String::as_str).collect();
    orders_for(&pool, "internal", &sessions, "10.00", "BRL").await;
    sqlx::query(
        "INSERT INTO order_events (order_id, kind, payload)
         SELECT o.id, 'created', '{}' FROM orders o
         WHERE NOT EXISTS (SELECT 1 FROM order_events e WHERE e.order_id = o.id AND e.kind = 'created')",
    )
    .execute(&pool)
    .await
    .unwrap();
    wait_for(
        "the thousand behind it published",
        Duration::from_secs(8),
        async || unpublished_count(&pool).await == 1,
    )
    .await;
    // The operator sees it, with the broker's answer and when it goes next.
    let message_id = format!("order-event-{poison}");
    let waiting = outbox::unpublished(&pool, 10).await.unwrap();
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    let w = &waiting[0];
    assert_eq!(w.message_id, message_id);
    assert_eq!(w.routing_key, "order.one_off.expired");
    assert!(w.attempts >= 3, "{w:?}");
    assert!(
        w.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("refused"),
        "{w:?}"
    );
    let next = w
        .next_attempt
        .expect("a refused message has its next attempt");
    assert!(next > w.created_at, "backing off: {w:?}");
    let findings = payfleet::consistency::check(&pool, Duration::ZERO)
        .await
        .unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f.check == "order_message_refused" && f.subject.contains(&message_id)),
        "{findings:?}"
    );
    // The cause gone, the operator sends it now rather than at its next attempt (here an
    // hour away, so only the operator's word can send it within the test).
    refusing.close(200, "done".into()).await.unwrap();
    sqlx::query("UPDATE order_events SET publish_after = now() + interval '1 hour' WHERE id = $1")
        .bind(poison)
        .execute(&pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(unpublished_count(&pool).await, 1, "put off, not sent");
    outbox::send_now(&pool, &message_id, false).await.unwrap();
    wait_for("sent by hand", Duration::from_secs(5), async || {
        unpublished_count(&pool).await == 0
    })
    .await;
    let refusals: (i32, Option<String>) =
        sqlx::query_as("SELECT publish_attempts, publish_error FROM order_events WHERE id = $1")
            .bind(poison)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(refusals, (0, None), "sent by hand, its refusals forgotten");
    assert!(
        payfleet::consistency::check(&pool, Duration::ZERO)
            .await
            .unwrap()
            .iter()
            .all(|f| f.check != "order_message_refused")
    );
    // Bad input changes nothing, and says why.
    let e = outbox::send_now(&pool, "order-event-999999999", false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no order message"), "{e}");
    let e = outbox::send_now(&pool, "payment-7", false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not an order message"), "{e}");
    // Written and published longer ago than the consumers keep their records (however
    // recently it was sent again: a consumer's record is of its first handling): sent again
    // only with --force (a consumer that handled it would handle it again), else left as it is.
    sqlx::query("UPDATE order_events SET created_at = now() - interval '31 days' WHERE id = $1")
        .bind(poison)
        .execute(&pool)
        .await
        .unwrap();
    let e = outbox::send_now(&pool, &message_id, false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    assert_eq!(unpublished_count(&pool).await, 0, "nothing sent");
    outbox::send_now(&pool, &message_id, true).await.unwrap();
    wait_for("sent by hand, forced", Duration::from_secs(5), async || {
        sqlx::query_scalar::<_, bool>(
            "SELECT published_at > now() - interval '1 minute' FROM order_events WHERE id = $1",
        )
        .bind(poison)
        .fetch_one(&pool)
        .await
        .unwrap_or(false)
    })
    .await;
}
