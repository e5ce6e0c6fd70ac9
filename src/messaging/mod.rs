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
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

/// A message's headers carrying a trace context (`traces`).
pub(crate) fn trace_headers(traceparent: &str) -> FieldTable {
    let mut headers = FieldTable::default();
    headers.insert(
        "traceparent".into(),
        AMQPValue::LongString(traceparent.into()),
    );
    headers
}

/// The trace context a message carries, if it is one (the sender chose it: only a well-formed
/// W3C `traceparent` is taken).
pub(crate) fn traceparent_of(properties: &lapin::BasicProperties) -> Option<String> {
    let headers = properties.headers().as_ref()?;
    let value = match headers.inner().get("traceparent")? {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        _ => return None,
    };
    crate::traces::is_traceparent(&value).then_some(value)
}
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
    /// How the queues are kept (`PAYFLEET_AMQP_QUORUM`, `PAYFLEET_AMQP_RPC_QUORUM`,
    /// `PAYFLEET_AMQP_DELIVERY_LIMIT`).
    pub queues: QueueKind,
}

/// How this fleet's queues are kept by the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueKind {
    /// Quorum queues, replicated over the cluster's nodes (`PAYFLEET_AMQP_QUORUM`, on): a
    /// node's loss loses no message. Off: classic queues, on one node.
    pub quorum: bool,
    /// The RPC request queues are quorum queues too (`PAYFLEET_AMQP_RPC_QUORUM`, off): on a
    /// cluster, payment links and coins then go on through the loss of the node holding their
    /// queue. Off: classic queues. An RPC request is worth nothing once its caller has given up
    /// (it expires with the caller's patience, and its answer goes to the caller's channel,
    /// which a broker restart closes), so a quorum queue's replication and flush buy it
    /// availability on a cluster, never a message kept; on one node they only cost: a link's
    /// round trip through the broker took 4.5 ms through a quorum queue against 3.0 ms through
    /// a classic one (README, "RPC requests through classic queues").
    pub rpc_quorum: bool,
    /// A service's message delivered this many times without an acknowledgement (its consumer
    /// keeps refusing it, or keeps dying on it) goes to the dead-letter queue `{ns}.dead`
    /// instead (`PAYFLEET_AMQP_DELIVERY_LIMIT`, 1000; quorum queues only).
    pub delivery_limit: u32,
}

impl Default for QueueKind {
    fn default() -> Self {
        Self {
            quorum: true,
            rpc_quorum: false,
            delivery_limit: 1000,
        }
    }
}

impl QueueKind {
    /// Whether a queue for `usage` is a quorum queue.
    pub(crate) fn is_quorum(&self, usage: QueueUse) -> bool {
        match usage {
            QueueUse::Rpc => self.rpc_quorum,
            QueueUse::Service | QueueUse::Dead => self.quorum,
        }
    }
}

/// The dead-letter queue's delivery limit: a returned message is delivered again, never dropped.
const DEAD_LETTERS_DELIVERY_LIMIT: u32 = 1_000_000_000;

/// What a queue is for, which decides its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueUse {
    /// A service's order messages: refused ones are dead-lettered.
    Service,
    /// RPC requests: each expires with its caller's patience, and an expired one just goes.
    Rpc,
    /// The dead-letter queue itself.
    Dead,
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
        let delivery_limit = parsed(env, "PAYFLEET_AMQP_DELIVERY_LIMIT", 1000u32)?;
        if delivery_limit == 0 {
            return Err(invalid(
                "PAYFLEET_AMQP_DELIVERY_LIMIT",
                "must be a positive number of deliveries",
            ));
        }
        Ok(Self {
            rpc_timeout: Duration::from_millis(rpc_timeout_ms),
            namespace,
            queue_ttl_ms,
            order_routes,
            queues: QueueKind {
                quorum: crate::env::switch_or(env, "PAYFLEET_AMQP_QUORUM", true)?,
                rpc_quorum: crate::env::switch(env, "PAYFLEET_AMQP_RPC_QUORUM")?,
                delivery_limit,
            },
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
    queues: QueueKind,
    /// Where its messages and calls are counted.
    telemetry: crate::telemetry::Telemetry,
    /// This process's RPC consumers set up and taking requests ([`rpc::serve`]): a request
    /// sent before its queue has a consumer or even exists is lost, and its caller times out.
    answering: Arc<std::sync::atomic::AtomicUsize>,
}

/// An RPC consumer counted by [`Broker::answering`] while it lives.
pub(crate) struct Answering(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
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
        Self::start_with(url, namespace, queue_ttl_ms, QueueKind::default())
    }

    /// [`Broker::start`], its queues kept as `queues` says.
    pub fn start_with(
        url: SecretUrl,
        namespace: &str,
        queue_ttl_ms: Option<u32>,
        queues: QueueKind,
    ) -> Self {
        crate::tls::install_provider();
        let (tx, rx) = watch::channel(None);
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(supervise(url, tx, stopped));
        Self {
            connection: rx,
            stop: Arc::new(stop),
            namespace: namespace.into(),
            queue_ttl_ms,
            queues,
            telemetry: Default::default(),
            answering: Default::default(),
        }
    }

    /// How many of this process's RPC consumers take requests now.
    pub fn answering(&self) -> usize {
        self.answering.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts an RPC consumer as taking requests until the guard is dropped.
    pub(crate) fn answering_while(&self) -> Answering {
        self.answering
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Answering(self.answering.clone())
    }

    /// The broker, its messages and RPC calls counted in `telemetry` (the process's).
    pub fn observed(mut self, telemetry: crate::telemetry::Telemetry) -> Self {
        self.telemetry = telemetry;
        self
    }

    pub fn telemetry(&self) -> &crate::telemetry::Telemetry {
        &self.telemetry
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

    /// Whether the broker has told this connection it takes no messages now (a memory or disk
    /// alarm): a publish would wait, unsent, until the alarm ends.
    pub fn is_blocked(&self) -> bool {
        self.connection
            .borrow()
            .as_ref()
            .is_some_and(|c| c.status().blocked())
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

    fn queue_arguments(&self, usage: QueueUse) -> FieldTable {
        let mut args = FieldTable::default();
        if let Some(ms) = self.queue_ttl_ms {
            args.insert("x-expires".into(), AMQPValue::LongUInt(ms));
        }
        if self.queues.is_quorum(usage) {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        // The dead-letter queue has nothing behind it: a limit on its deliveries (RabbitMQ 4
        // gives every quorum queue 20) would drop what its keeper returns while the database
        // refuses to keep it. So it gets one too high to reach.
        if usage == QueueUse::Dead && self.queues.is_quorum(usage) {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongUInt(DEAD_LETTERS_DELIVERY_LIMIT),
            );
        }
        if usage == QueueUse::Service {
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(self.name("dead").as_str().into()),
            );
            if self.queues.quorum {
                args.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongUInt(self.queues.delivery_limit),
                );
            }
        }
        args
    }

    /// Declares (durable) queue `name` for `usage`, with the dead-letter exchange and queue its
    /// refused messages go to. A queue that exists with other arguments (a classic queue
    /// declared before quorum queues were) is used as it is, with a warning: the broker never
    /// changes a queue's type, so it must be drained and deleted to be declared anew.
    pub(crate) async fn declare_queue(&self, name: &str, usage: QueueUse) -> lapin::Result<()> {
        let connection = self.connected().await;
        if usage == QueueUse::Service {
            // Where its refused messages go, declared with it.
            Box::pin(self.declare_queue(&self.name("dead"), QueueUse::Dead)).await?;
        }
        if usage == QueueUse::Dead {
            // The dead-letter exchange and its binding, with the queue, whoever declares it: a
            // dead-letter queue deleted (to be declared with a new limit: README, "Upgrading")
            // and declared again by its keeper alone was bound to nothing, and a message the
            // broker dead-letters to an exchange without a queue is dropped.
            let channel = connection.create_channel().await?;
            channel
                .exchange_declare(
                    name.into(),
                    lapin::ExchangeKind::Fanout,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            let _ = channel.close(200, "declared".into()).await;
            self.declare_queue_alone(&connection, name, usage).await?;
            let channel = connection.create_channel().await?;
            channel
                .queue_bind(
                    name.into(),
                    name.into(),
                    "".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let _ = channel.close(200, "bound".into()).await;
            return Ok(());
        }
        self.declare_queue_alone(&connection, name, usage).await
    }

    /// Declares queue `name` for `usage`, and nothing with it.
    async fn declare_queue_alone(
        &self,
        connection: &Connection,
        name: &str,
        usage: QueueUse,
    ) -> lapin::Result<()> {
        // On a channel of its own: a refusal closes the channel it came on.
        let channel = connection.create_channel().await?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        match channel
            .queue_declare(name.into(), durable, self.queue_arguments(usage))
            .await
        {
            Ok(_) => {
                let _ = channel.close(200, "declared".into()).await;
                Ok(())
            }
            Err(e) if precondition_failed(&e) => {
                tracing::warn!(
                    queue = name,
                    quorum = self.queues.is_quorum(usage),
                    "the queue exists with other arguments (declared by an earlier release or setting): it is used as it is; drain and delete it to have it declared as configured"
                );
                let channel = connection.create_channel().await?;
                channel
                    .queue_declare(
                        name.into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                let _ = channel.close(200, "found".into()).await;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

/// The broker refused a declaration as inequivalent to what exists.
fn precondition_failed(e: &lapin::Error) -> bool {
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(a)
            if matches!(
                a.kind(),
                lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::PRECONDITIONFAILED)
            )
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_carries_a_well_formed_trace_context_only() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let carried = lapin::BasicProperties::default().with_headers(trace_headers(tp));
        assert_eq!(traceparent_of(&carried).as_deref(), Some(tp));
        let forged = lapin::BasicProperties::default().with_headers(trace_headers("00-x-y-01"));
        assert_eq!(traceparent_of(&forged), None);
        assert_eq!(traceparent_of(&lapin::BasicProperties::default()), None);
    }

    fn read(pair: Option<(&str, &str)>) -> Result<Settings, Invalid> {
        match pair {
            Some(p) => Settings::from_env(&[p]),
            None => Settings::from_env(&[("PAYFLEET_UNRELATED", "")]),
        }
    }

    #[test]
    fn service_queues_are_quorum_queues_rpc_queues_classic_unless_switched_and_a_bad_setting_is_named()
     {
        assert_eq!(read(None).unwrap().queues, QueueKind::default());
        assert!(read(None).unwrap().queues.quorum);
        let classic = read(Some(("PAYFLEET_AMQP_QUORUM", "off"))).unwrap();
        assert!(!classic.queues.quorum);
        let limited = read(Some(("PAYFLEET_AMQP_DELIVERY_LIMIT", "5"))).unwrap();
        assert_eq!(limited.queues.delivery_limit, 5);
        // The RPC requests' queues are classic unless asked, whatever the services' queues.
        let default = read(None).unwrap().queues;
        assert!(!default.is_quorum(QueueUse::Rpc));
        assert!(default.is_quorum(QueueUse::Service) && default.is_quorum(QueueUse::Dead));
        assert!(!classic.queues.is_quorum(QueueUse::Service));
        let rpc = read(Some(("PAYFLEET_AMQP_RPC_QUORUM", "on")))
            .unwrap()
            .queues;
        assert!(rpc.is_quorum(QueueUse::Rpc) && rpc.is_quorum(QueueUse::Service));
        for (name, value) in [
            ("PAYFLEET_AMQP_QUORUM", "yes"),
            ("PAYFLEET_AMQP_RPC_QUORUM", "1"),
            ("PAYFLEET_AMQP_DELIVERY_LIMIT", "0"),
            ("PAYFLEET_AMQP_DELIVERY_LIMIT", "-1"),
        ] {
            let e = read(Some((name, value))).unwrap_err();
            assert!(e.to_string().contains(name), "{e}");
        }
    }
}
