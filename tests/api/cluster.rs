//! The broker losing a node: on a real three-node RabbitMQ cluster (`.ci/rabbitmq-cluster`,
//! which `.ci/run` starts), the fleet's quorum queues keep every order message through the loss
//! of the node that leads them and that every connection was on, and with quorum RPC queues
//! (`PAYFLEET_AMQP_RPC_QUORUM=on`) checkouts get their payment links again once the fleet has
//! reconnected; and a broker under a resource alarm, which takes no message, gets the callers
//! that need it an answer in time rather than their requests held for the alarm. The tests take
//! turns: two nodes stopped at once would leave no majority, and an alarm blocks the whole
//! cluster.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use payfleet::messaging::Broker;
use payfleet::messaging::orders::{self, Handled, OrderMessage};
use payfleet::secret::SecretUrl;
use payfleet::startup::Roles;
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use tokio::net::{TcpListener, TcpStream};

use crate::checkout::Shop;
use crate::gateways::{
    Log, config_with_stripe, connected_product, stand_in, stripe_api, stripe_cart,
};
use crate::helpers::*;

/// One test at a time stops a node.
static ONE_NODE_DOWN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const NODES: [(&str, u16); 3] = [
    ("pf1@localhost", 5681),
    ("pf2@localhost", 5682),
    ("pf3@localhost", 5683),
];

fn rabbitmqctl(node: &str, args: &[&str]) -> String {
    crate::helpers::rabbitmqctl(&[&["-n", node], args].concat())
}

/// What a load balancer in front of the cluster does: each connection goes to the first node
/// that takes it.
async fn balancer() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                for (_, port) in NODES {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", port)).await {
                        let (mut cr, mut cw) = client.into_split();
                        let (mut sr, mut sw) = server.into_split();
                        tokio::select! {
                            _ = tokio::io::copy(&mut cr, &mut sw) => {}
                            _ = tokio::io::copy(&mut sr, &mut cw) => {}
                        }
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Restarts a stopped node's broker when the test ends, whatever its outcome.
struct Restart(&'static str);

impl Drop for Restart {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["-n", self.0, "start_app"])
            .output();
    }
}

async fn order_events(pool: &PgPool, from: usize, n: usize) {
    let sessions: Vec<String> = (from..from + n).map(|i| format!("s{i}")).collect();
    let sessions: Vec<&str> = sessions.iter().map(String::as_str).collect();
    orders_for(pool, "internal", &sessions, "10.00", "BRL").await;
    sqlx::query(
        "INSERT INTO order_events (order_id, kind, payload)
         SELECT id, 'created', '{}' FROM orders o
         WHERE NOT EXISTS (SELECT 1 FROM order_events e WHERE e.order_id = o.id)",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn every_node_answers() {
    for (node, port) in NODES {
        assert!(
            TcpStream::connect(("127.0.0.1", port)).await.is_ok(),
            "the RabbitMQ cluster's node {node} does not answer on {port}: start it with .ci/rabbitmq-cluster (.ci/run does)"
        );
    }
}

/// The node leading quorum queue `queue`.
fn leader_of(queue: &str) -> &'static str {
    let queues = rabbitmqctl("pf1@localhost", &["list_queues", "name", "type", "leader"]);
    let line = queues
        .lines()
        .find(|l| l.starts_with(&format!("{queue}\t")))
        .unwrap_or_default()
        .to_owned();
    assert!(line.contains("quorum"), "{line}");
    NODES
        .iter()
        .map(|(n, _)| *n)
        .find(|n| line.contains(n))
        .unwrap_or_else(|| panic!("no leader in {line:?}"))
}

#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn order_messages_survive_the_loss_of_the_node_leading_their_queue(pool: PgPool) {
    let _turn = ONE_NODE_DOWN.lock().await;
    every_node_answers().await;
    let lb = balancer().await;
    let mut config = test_config();
    config.amqp_url = SecretUrl::new(format!("amqp://guest:guest@{lb}/%2f"));
    assert!(config.messaging.queues.quorum);
    // The fleet declares its queues (on pf1, where every connection goes: they are led there)
    // and publishes ten messages, nobody consuming yet.
    let _worker = spawn_roles(pool.clone(), config.clone(), Roles::WORK).await;
    order_events(&pool, 0, 10).await;
    let queue = format!("{}.fulfilment", config.messaging.namespace);
    // Each rabbitmqctl starts an Erlang VM (about a CPU-second): asked every 10 ms, it would
    // take a core of the two from the fleet and the broker it waits for.
    wait_for(
        "ten messages queued",
        Duration::from_secs(120),
        async || {
            tokio::time::sleep(Duration::from_secs(1)).await;
            rabbitmqctl("pf1@localhost", &["list_queues", "name", "messages"])
                .lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == [queue.as_str(), "10"])
        },
    )
    .await;
    let leader = leader_of(&queue);

    // The leading node goes; the fleet reconnects through the balancer and goes on.
    let _restart = Restart(leader);
    rabbitmqctl(leader, &["stop_app"]);
    order_events(&pool, 10, 10).await;

    // A consuming service, connected to what is left of the cluster, gets all twenty, once.
    sqlx::query("CREATE TABLE handled (message_id text)")
        .execute(&pool)
        .await
        .unwrap();
    let service = Broker::start_with(
        config.amqp_url.clone(),
        &config.messaging.namespace,
        config.messaging.queue_ttl_ms,
        config.messaging.queues,
    );
    tokio::spawn(orders::consume(
        service.clone(),
        pool.clone(),
        "fulfilment".into(),
        "test-fulfilment".into(),
        |m: OrderMessage, tx: &mut PgConnection| -> Handled<'_> {
            Box::pin(async move {
                sqlx::query("INSERT INTO handled VALUES ($1)")
                    .bind(&m.message_id)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            })
        },
    ));
    let handled = async || -> (i64, i64) {
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM handled")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    // The new leader's election and the reconnections take seconds; on a loaded machine (the
    // whole suite at once on two cores), tens of seconds.
    wait_for("all twenty handled", Duration::from_secs(120), async || {
        handled().await.0 >= 20
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(handled().await, (20, 20));
    service.stop();
}

/// With quorum RPC queues, the loss of the node leading the payment links' queue (and holding
/// every connection) stops links only until the fleet has reconnected to the rest: a checkout
/// meanwhile may be answered 503 (its orders kept), and one after it gets its link. (With the
/// default classic RPC queues, a queue whose node is gone cannot be declared again anywhere
/// until that node returns: README, "RPC requests through classic queues".)
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn payment_links_go_on_through_the_loss_of_their_queues_node_with_quorum_rpc_queues(
    pool: PgPool,
) {
    let _turn = ONE_NODE_DOWN.lock().await;
    every_node_answers().await;
    let lb = balancer().await;
    let mut config = test_config();
    config.amqp_url = SecretUrl::new(format!("amqp://guest:guest@{lb}/%2f"));
    config.messaging.queues.rpc_quorum = true;
    // A checkout waiting on a lost connection gives up sooner than the suite's patient default.
    config.messaging.rpc_timeout = Duration::from_secs(3);
    let (running, receiver) = worker_then_receiver(&pool, &config, Duration::from_secs(60)).await;
    let shop = Shop {
        app: Arc::new(receiver),
    };
    let seller = shop.seller("S").await;
    let product = shop.product(&seller, "10.00", "BRL").await;
    let cart = json!({"buyer_id": "b", "gateway": "internal", "items": [{"product_id": product, "quantity": 1}]});
    let (status, answer) = shop.checkout(Some("before"), cart.clone()).await;
    assert_eq!(status, 201, "{answer}");
    let leader = leader_of(&format!(
        "{}.payment_link_batches",
        config.messaging.namespace
    ));

    let _restart = Restart(leader);
    rabbitmqctl(leader, &["stop_app"]);
    let mut tries = 0;
    let mut refused = Vec::new();
    wait_for(
        "a checkout answered with its link after the node's loss",
        Duration::from_secs(120),
        async || {
            tries += 1;
            let (status, answer) = shop
                .checkout(Some(&format!("after-{tries}")), cart.clone())
                .await;
            if status != 201 {
                refused.push((status, answer["error"]["code"].clone()));
                tokio::time::sleep(Duration::from_millis(500)).await;
                return false;
            }
            answer["orders"][0]["payment"]["url"].is_string()
        },
    )
    .await;
    // Meanwhile only the honest refusal: the link could not be made now, the orders are kept.
    assert!(
        refused
            .iter()
            .all(|(s, code)| *s == 503 && code == "payment_link_unavailable"),
        "{refused:?}"
    );
    running.stop().await;
}

/// Ends a node's memory alarm when the test ends, whatever its outcome.
struct EndAlarm(&'static str);

impl Drop for EndAlarm {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["-n", self.0, "set_vm_memory_high_watermark", "0.4"])
            .output();
    }
}

/// A broker under a memory alarm takes no message from a connection that publishes: a payment
/// link asked of an outside gateway (one request of its own) is answered 503 within the RPC's
/// timeout, its order kept, instead of the checkout waiting, unanswered, for as long as the
/// alarm lasts; and once the alarm ends, the same checkout gets its link.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_broker_alarm_gets_a_checkout_a_503_in_time_not_a_request_held(pool: PgPool) {
    let _turn = ONE_NODE_DOWN.lock().await;
    every_node_answers().await;
    let base = stand_in(stripe_api(), Log::default()).await;
    let mut config = config_with_stripe(base);
    config.amqp_url = SecretUrl::new("amqp://guest:guest@127.0.0.1:5681/%2f".to_owned());
    config.messaging.rpc_timeout = Duration::from_secs(3);
    let (running, receiver) = worker_then_receiver(&pool, &config, Duration::from_secs(60)).await;
    let shop = Shop {
        app: Arc::new(receiver),
    };
    let product = connected_product(&shop).await;
    // Asked again while 503, as a client does: a quorum queue consumed right after it was
    // declared can crash the broker's channel (`rabbit_quorum_queue:consume` meeting no process
    // yet), which closes the connection, and its consumers set themselves up again.
    let mut before = (0, serde_json::Value::Null);
    for _ in 0..10 {
        before = shop.checkout(Some("before"), stripe_cart(&product)).await;
        if before.0 != 503 {
            break;
        }
    }
    assert_eq!(before.0, 201, "{}", before.1);

    let _end = EndAlarm("pf1@localhost");
    rabbitmqctl("pf1@localhost", &["set_vm_memory_high_watermark", "0"]);
    // The broker tells its connections once the alarm is raised; a request sent before that
    // is taken into the socket and never read: either way, the answer comes in time.
    for i in 0..3 {
        let started = std::time::Instant::now();
        let (status, answer) = tokio::time::timeout(
            Duration::from_secs(20),
            shop.checkout(Some(&format!("during-{i}")), stripe_cart(&product)),
        )
        .await
        .expect("the checkout is answered while the alarm lasts");
        assert_eq!(
            (status, answer["error"]["code"].as_str()),
            (503, Some("payment_link_unavailable")),
            "{answer}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }
    rabbitmqctl("pf1@localhost", &["set_vm_memory_high_watermark", "0.4"]);
    wait_for(
        "the checkout gets its link after the alarm",
        Duration::from_secs(60),
        async || {
            let (status, answer) = shop.checkout(Some("during-0"), stripe_cart(&product)).await;
            if status != 201 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                return false;
            }
            answer["orders"][0]["payment"]["url"].is_string()
        },
    )
    .await;
    running.stop().await;
}
