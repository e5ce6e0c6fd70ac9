//! RabbitMQ. One shared connection per process, kept up by a supervisor that reconnects with
//! backoff and tells the parts that use it ([`Broker::connected`]); each part opens its own
//! channel on it and handles that channel's errors where it uses it (a consumer's stream, a
//! publish's confirmation), then waits for the next connection. The connection's own error
//! events are drained and logged by the supervisor: an error nobody listens to must never take
//! the process down.
//!
//! - [`rpc`]: the payment-link RPC between the order side (client) and the payment side (the
//!   consumer inside the worker processes).
//! - [`orders`]: order events from the outbox to each consuming service's queue.

pub mod orders;
pub mod rpc;

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::{Connection, ConnectionProperties};
use tokio::sync::watch;

use crate::env::{Env, Invalid, invalid, parsed, var};
use crate::secret::SecretUrl;

/// How this fleet uses RabbitMQ.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long the order side waits for the payment side's answer
    /// (`PAYFLEET_RPC_TIMEOUT_MS`, 5000).
    pub rpc_timeout: Duration,
    /// Prefix of this fleet's queues and exchanges (`PAYFLEET_AMQP_NAMESPACE`, `payfleet`).
    pub namespace: String,
    /// Queues unused this long are dropped by RabbitMQ (`PAYFLEET_AMQP_QUEUE_TTL_MS`: tests,
    /// preview set-ups).
    pub queue_ttl_ms: Option<u32>,
    /// Which service's queue takes which order messages (`PAYFLEET_ORDER_ROUTES`).
    pub order_routes: orders::Routes,
}

impl Settings {
    pub fn from_env(env: &dyn Env) -> Result<Self, Invalid> {
        let rpc_timeout_ms = parsed(env, "PAYFLEET_RPC_TIMEOUT_MS", 5000u64)?;
        if !(1..=120_000).contains(&rpc_timeout_ms) {
            return Err(invalid("PAYFLEET_RPC_TIMEOUT_MS", "must be 1 to 120000"));
        }
        let namespace =
            var(env, "PAYFLEET_AMQP_NAMESPACE").unwrap_or_else(|| "payfleet".to_owned());
        if !namespace
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            || namespace.len() > 100
        {
            return Err(invalid(
                "PAYFLEET_AMQP_NAMESPACE",
                "letters, digits, - _ . only, at most 100",
            ));
        }
        let queue_ttl_ms = var(env, "PAYFLEET_AMQP_QUEUE_TTL_MS")
            .map(|v| {
                v.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                    invalid(
                        "PAYFLEET_AMQP_QUEUE_TTL_MS",
                        "must be a positive number of milliseconds",
                    )
                })
            })
            .transpose()?;
        let order_routes = match var(env, "PAYFLEET_ORDER_ROUTES") {
            Some(v) => v
                .parse()
                .map_err(|problem| invalid("PAYFLEET_ORDER_ROUTES", problem))?,
            None => orders::Routes::default(),
        };
        Ok(Self {
            rpc_timeout: Duration::from_millis(rpc_timeout_ms),
            namespace,
            queue_ttl_ms,
            order_routes,
        })
    }
}

/// The shared connection of a process. Cheap to clone.
#[derive(Clone)]
pub struct Broker {
    connection: watch::Receiver<Option<Arc<Connection>>>,
    /// Tells the supervisor and every part on the connection to stop (the process stops).
    stop: Arc<watch::Sender<bool>>,
    /// Prefix of every queue and exchange this fleet declares, so that fleets (and tests) can
    /// share a broker.
    namespace: Arc<str>,
    /// Queues unused this long are dropped by the broker (test and preview set-ups).
    queue_ttl_ms: Option<u32>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("connected", &self.is_connected())
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl Broker {
    /// Starts the supervisor on the current runtime; the broker may be down now and come up
    /// later.
    pub fn start(url: SecretUrl, namespace: &str, queue_ttl_ms: Option<u32>) -> Self {
        crate::tls::install_provider();
        let (tx, rx) = watch::channel(None);
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(supervise(url, tx, stopped));
        Self {
            connection: rx,
            stop: Arc::new(stop),
            namespace: namespace.into(),
            queue_ttl_ms,
        }
    }

    /// Stops the supervisor (closing the connection) and every part waiting on
    /// [`Broker::stopped`].
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// Resolves once [`Broker::stop`] was called.
    pub async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        while !*rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    pub fn is_connected(&self) -> bool {
        self.connection
            .borrow()
            .as_ref()
            .is_some_and(|c| c.status().connected())
    }

    /// The shared connection, once it is up.
    pub async fn connected(&self) -> Arc<Connection> {
        let mut rx = self.connection.clone();
        loop {
            if let Some(c) = rx
                .borrow_and_update()
                .as_ref()
                .filter(|c| c.status().connected())
            {
                return c.clone();
            }
            if rx.changed().await.is_err() {
                // The supervisor is gone (the process is stopping): never connected again.
                std::future::pending::<()>().await;
            }
        }
    }

    /// `{namespace}.{name}`.
    pub fn name(&self, name: &str) -> String {
        format!("{}.{name}", self.namespace)
    }

    fn queue_arguments(&self) -> lapin::types::FieldTable {
        let mut args = lapin::types::FieldTable::default();
        if let Some(ms) = self.queue_ttl_ms {
            args.insert("x-expires".into(), lapin::types::AMQPValue::LongUInt(ms));
        }
        args
    }
}

async fn supervise(
    url: SecretUrl,
    slot: watch::Sender<Option<Arc<Connection>>>,
    mut stop: watch::Receiver<bool>,
) {
    let url = with_heartbeat(url.expose());
    let mut failures: u32 = 0;
    loop {
        if *stop.borrow() {
            return;
        }
        let props = ConnectionProperties::default().with_connection_name("payfleet".into());
        match Connection::connect(&url, props).await {
            Ok(c) => {
                if failures > 0 {
                    tracing::info!("connected to RabbitMQ");
                }
                failures = 0;
                let c = Arc::new(c);
                let mut events = c.events_listener();
                slot.send_replace(Some(c.clone()));
                // Watch the connection: its error events, and its status in case an error
                // goes unreported.
                loop {
                    tokio::select! {
                        _ = stop.changed() => {
                            slot.send_replace(None);
                            let _ = c.close(200, "payfleet is stopping".into()).await;
                            return;
                        }
                        event = events.next() => match event {
                            Some(lapin::Event::Error(e)) => tracing::warn!(error = %e, "RabbitMQ connection error"),
                            Some(lapin::Event::ConnectionBlocked(why)) => tracing::warn!(reason = %why, "RabbitMQ blocked the connection"),
                            Some(_) => {}
                            None => break,
                        },
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                    if !(c.status().connected() || c.status().connecting()) {
                        break;
                    }
                }
                tracing::warn!("RabbitMQ connection lost; reconnecting");
                slot.send_replace(None);
            }
            Err(e) => {
                failures += 1;
                if failures == 1 || failures.is_multiple_of(30) {
                    tracing::warn!(error = %e, "cannot connect to RabbitMQ; retrying");
                }
                tokio::time::sleep(Duration::from_millis(
                    (250u64 << failures.min(4)).min(5_000),
                ))
                .await;
            }
        }
    }
}

/// Adds a 30 s heartbeat unless the URL sets one, so a dead peer is noticed.
fn with_heartbeat(url: &str) -> String {
    if url.contains("heartbeat=") {
        url.to_owned()
    } else if url.contains('?') {
        format!("{url}&heartbeat=30")
    } else {
        format!("{url}?heartbeat=30")
    }
}
