//! Order messages: every order event ("order paid", "expired", ...) goes to the queue of the
//! service that consumes that order type, never round-robin across unrelated consumers.
//!
//! - Outbox: `order_events` is the outbox (the order side's: `orders::outbox` reads it for the
//!   relay through [`Outbox`]). An event row is written in the transaction of the
//!   business change that causes it (confirmation, expiry, ...), so no change goes without its
//!   message and no message without its change. A relay in every worker process publishes the
//!   unpublished rows (`FOR UPDATE SKIP LOCKED`: relays share the work), waits for the broker's
//!   publisher confirms, then marks them published in the same transaction. A broker outage
//!   leaves rows unpublished (the `payfleet_outbox_unpublished` gauge shows them) until it
//!   returns: messages are delayed, never lost. A crash between the broker's confirm and the
//!   commit publishes a row again: consumers are idempotent by message id.
//! - Routing: a durable topic exchange `{ns}.orders`, routing key `order.<kind>.<event>`
//!   (`order.subscription.paid`). Each consuming service has its durable queue
//!   `{ns}.<service>`, bound by the patterns of `PAYFLEET_ORDER_ROUTES`. A key no queue binds
//!   (a new order type) goes, through the exchange's alternate exchange `{ns}.orders.unrouted`,
//!   to the durable `{ns}.orders.legacy` queue, whose consumer logs a warning with the type and
//!   keeps the message (`unrouted_messages`).
//! - Consuming: [`consume`] hands each message to a handler once per consumer and message id,
//!   in one transaction with the record that it was handled.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, ExchangeKind};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use super::{Broker, QueueUse};
use crate::db::Kept;
use crate::telemetry::MessageEvent;

/// Which service's queue takes which routing keys: `service=pattern,pattern;service=...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routes {
    pub services: Vec<(String, Vec<String>)>,
}

impl Default for Routes {
    fn default() -> Self {
        Self {
            services: vec![
                ("fulfilment".into(), vec!["order.one_off.*".into()]),
                ("subscriptions".into(), vec!["order.subscription.*".into()]),
            ],
        }
    }
}

/// The names under the namespace the fleet itself declares.
const RESERVED: [&str; 5] = [
    "orders",
    "dead",
    <super::rpc::PaymentLink as super::rpc::Rpc>::QUEUE,
    <super::rpc::PaymentLinkBatch as super::rpc::Rpc>::QUEUE,
    <super::rpc::Coins as super::rpc::Rpc>::QUEUE,
];

impl Routes {
    /// The first service whose patterns take routing key `key`.
    pub fn service_of(&self, key: &str) -> Option<&str> {
        self.services
            .iter()
            .find(|(_, patterns)| patterns.iter().any(|p| topic_matches(p, key)))
            .map(|(service, _)| service.as_str())
    }
}

impl std::str::FromStr for Routes {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut services = Vec::new();
        for part in s.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (service, patterns) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?} is not service=pattern[,pattern]"))?;
            let service = service.trim();
            let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
            if service.is_empty() || !service.chars().all(valid) {
                return Err(format!(
                    "{service:?} is not a service name (letters, digits, _ and -)"
                ));
            }
            // The fleet's own names under the namespace: a service queue of one of them would
            // be the RPC's request queue or the dead letters' (its consumers taking order
            // messages they refuse, and the service's taking RPC requests), or the exchange.
            if RESERVED.contains(&service) {
                return Err(format!(
                    "{service:?} is a name of the fleet's own (not {})",
                    RESERVED.join(", ")
                ));
            }
            let patterns: Vec<String> = patterns
                .split(',')
                .map(|p| p.trim().to_owned())
                .filter(|p| !p.is_empty())
                .collect();
            if patterns.is_empty() {
                return Err(format!("service {service:?} binds no pattern"));
            }
            services.push((service.to_owned(), patterns));
        }
        Ok(Self { services })
    }
}

/// An order event as published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrderMessage {
    pub message_id: String,
    /// The order event's kind: `paid`, `expired`, ...
    pub event: String,
    pub order_number: i64,
    /// The order's type: `one_off`, `subscription`.
    pub order_kind: String,
    pub seller_id: String,
    pub buyer_id: String,
    pub total: String,
    pub currency: String,
    pub payload: serde_json::Value,
    pub occurred_at: DateTime<Utc>,
}

impl OrderMessage {
    pub fn routing_key(&self) -> String {
        routing_key(&self.order_kind, &self.event)
    }
}

/// The routing key of an order message: `order.<order type>.<event>`.
pub fn routing_key(order_kind: &str, event: &str) -> String {
    format!("order.{order_kind}.{event}")
}

/// The id of the message an outbox row is published as.
pub fn message_id(outbox_id: i64) -> String {
    format!("order-event-{outbox_id}")
}

/// The outbox row a message id names, if it is an order message's.
pub fn outbox_id(message_id: &str) -> Option<i64> {
    message_id
        .strip_prefix("order-event-")
        .and_then(|n| n.parse().ok())
}

#[derive(sqlx::FromRow)]
pub struct Unpublished {
    /// The outbox row's id: the message's id is built from it (`order-event-<id>`).
    pub id: i64,
    pub kind: String,
    pub payload: serde_json::Value,
    pub created_at: DateTime<Utc>,
    pub number: i64,
    pub order_kind: String,
    pub seller_id: String,
    pub buyer_id: String,
    pub total: rust_decimal::Decimal,
    pub currency: String,
    /// The trace the message continues (`traces`): sent as its `traceparent` header.
    pub traceparent: Option<String>,
}

/// Where the relay takes the order messages from: the order side's outbox, whose rows only
/// the order side reads and writes (`orders::outbox`). The relay holds the transaction: the
/// rows it takes stay locked until the broker has confirmed them.
pub trait Outbox: Send + Sync + 'static {
    /// Up to `max` unpublished rows, oldest first, locked (skipping those another relay holds).
    fn take(
        &self,
        tx: &mut PgConnection,
        max: i64,
    ) -> impl Future<Output = Result<Vec<Unpublished>, sqlx::Error>> + Send;
    /// Marks rows as published.
    fn mark_published(
        &self,
        tx: &mut PgConnection,
        ids: &[i64],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Puts off rows the broker refused, each with the broker's answer: each is tried again on
    /// a clock of its own, backing off, so it holds up no other row.
    fn put_off(
        &self,
        tx: &mut PgConnection,
        refused: &[(i64, String)],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Marks a row to be published again (a dead message replayed); false if there is none.
    fn publish_again(
        &self,
        tx: &mut PgConnection,
        id: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// When a row was written (None: there is none).
    fn written_at(
        &self,
        tx: &mut PgConnection,
        id: i64,
    ) -> impl Future<Output = Result<Option<chrono::DateTime<chrono::Utc>>, sqlx::Error>> + Send;
}

/// How long a consumer's record of a message it handled is kept (`consumed_messages`, pruned by
/// the housekeeping): a message sent again within it is dropped by every consumer that handled
/// it; one older is sent again only when the operator says so (`--force`), as it may be handled
/// a second time.
pub const CONSUMED_RETENTION: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

/// Whether a message written at `at` is older than the consumers' records of it may be.
pub fn older_than_records(at: chrono::DateTime<chrono::Utc>) -> bool {
    chrono::Duration::from_std(CONSUMED_RETENTION).is_ok_and(|kept| at < chrono::Utc::now() - kept)
}

impl Unpublished {
    fn message(self) -> OrderMessage {
        OrderMessage {
            message_id: message_id(self.id),
            event: self.kind,
            order_number: self.number,
            total: crate::money::amount_text(self.total, &self.currency),
            order_kind: self.order_kind,
            seller_id: self.seller_id,
            buyer_id: self.buyer_id,
            currency: self.currency,
            payload: self.payload,
            occurred_at: self.created_at,
        }
    }
}

const BATCH: i64 = 200;
/// How long the relay lets messages gather after a short batch.
const LINGER: Duration = Duration::from_millis(25);

/// Declares the exchanges and queues (idempotent; every relay does it after connecting).
async fn declare(channel: &Channel, broker: &Broker, routes: &Routes) -> lapin::Result<()> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let exchange = broker.name("orders");
    let unrouted = broker.name("orders.unrouted");
    channel
        .exchange_declare(
            unrouted.as_str().into(),
            ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        )
        .await?;
    let mut args = FieldTable::default();
    args.insert(
        "alternate-exchange".into(),
        AMQPValue::LongString(unrouted.as_str().into()),
    );
    channel
        .exchange_declare(exchange.as_str().into(), ExchangeKind::Topic, durable, args)
        .await?;
    let queue = |name: String| async move {
        broker
            .declare_queue(&name, QueueUse::Service)
            .await
            .map(|_| name)
    };
    let legacy = queue(broker.name("orders.legacy")).await?;
    channel
        .queue_bind(
            legacy.as_str().into(),
            unrouted.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    for (service, patterns) in &routes.services {
        let q = queue(broker.name(service)).await?;
        for p in patterns {
            channel
                .queue_bind(
                    q.as_str().into(),
                    exchange.as_str().into(),
                    p.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
enum RelayError {
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    #[error("the broker did not confirm within {0:?}")]
    Unconfirmed(Duration),
    #[error("the broker is refusing messages (a resource alarm)")]
    Blocked,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Encode(#[from] serde_json::Error),
}

/// What one batch did with the rows it took.
#[derive(Debug, Clone, Copy, Default)]
struct Relayed {
    taken: usize,
    published: usize,
    /// Refused by the broker (nacked, or returned as routed nowhere): put off, each on its own.
    refused: usize,
    /// One came back routed to no queue at all: the topology is declared again.
    unroutable: bool,
}

/// What the broker said of a message it refused, as kept with its row.
const NACKED: &str = "refused by the broker (a queue it is routed to refuses messages: full with reject-publish, or without its majority)";
const RETURNED: &str = "routed to no queue, not even the unrouted messages' (the relay declares the queues and bindings again)";

/// Publishes one batch. A message the broker refuses is put off on its own clock, and the
/// others of the batch are marked as published; only a batch that could not be published at
/// all (the channel lost, no confirm in time) is an error, its rows left for a later batch.
async fn relay_batch(
    channel: &Channel,
    broker: &Broker,
    conn: &mut PgConnection,
    outbox: &impl Outbox,
) -> Result<Relayed, RelayError> {
    // A broker under an alarm would take the publishes below into its socket's buffer and
    // never read them: the rows are not even taken until it takes messages again.
    if broker.is_blocked() {
        return Err(RelayError::Blocked);
    }
    let mut tx = sqlx::Connection::begin_with(conn, crate::db::BEGIN_BY_KEYS).await?;
    let rows = outbox.take(&mut tx, BATCH).await?;
    let mut relayed = Relayed {
        taken: rows.len(),
        ..Relayed::default()
    };
    if rows.is_empty() {
        return Ok(relayed);
    }
    // One deadline for the publishes and their confirms: an alarm raised mid-batch holds the
    // publishes themselves, and never the rows' transaction for longer than this.
    let deadline = tokio::time::Instant::now() + CONFIRM_TIMEOUT;
    let exchange = broker.name("orders");
    let mut confirms = Vec::with_capacity(rows.len());
    let mut failure = None;
    for row in rows {
        let id = row.id;
        let traceparent = row.traceparent.clone();
        let message = row.message();
        let body = serde_json::to_vec(&message)?;
        let mut properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_message_id(message.message_id.as_str().into())
            .with_type(message.event.as_str().into())
            .with_timestamp(message.occurred_at.timestamp().max(0) as u64);
        if let Some(tp) = &traceparent {
            properties = properties.with_headers(super::trace_headers(tp));
        }
        // Mandatory: a message that reaches no queue comes back instead of being confirmed.
        let published = channel.basic_publish(
            exchange.as_str().into(),
            message.routing_key().as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            &body,
            properties,
        );
        let Ok(confirm) = tokio::time::timeout_at(deadline, published).await else {
            // The rest stay in the outbox, for a later batch.
            failure = Some(RelayError::Unconfirmed(CONFIRM_TIMEOUT));
            break;
        };
        confirms.push((id, confirm?));
    }
    broker
        .telemetry()
        .message(MessageEvent::Published, confirms.len() as u64);
    // What the broker confirmed is marked, and what it refused put off, whatever happens to
    // the rest: an unconfirmed message stays in the outbox, without sending the others again.
    // The wait is bounded, so a stalled broker (a memory alarm) never holds the rows'
    // transaction open for long.
    let mut acked = Vec::with_capacity(confirms.len());
    let mut refused = Vec::new();
    let waited = tokio::time::timeout_at(deadline, async {
        for (id, confirm) in confirms {
            match confirm.await {
                Ok(Confirmation::Ack(None)) => {
                    broker.telemetry().message(MessageEvent::Confirmed, 1);
                    acked.push(id);
                }
                Ok(Confirmation::Ack(Some(_))) => {
                    tracing::warn!(message = %message_id(id), "{RETURNED}");
                    broker.telemetry().message(MessageEvent::Returned, 1);
                    relayed.unroutable = true;
                    refused.push((id, RETURNED.to_owned()));
                }
                Ok(_) => {
                    tracing::warn!(message = %message_id(id), "{NACKED}; it goes again on its own, backing off (payfleet messages unpublished)");
                    broker.telemetry().message(MessageEvent::Nacked, 1);
                    refused.push((id, NACKED.to_owned()));
                }
                Err(e) => {
                    failure = Some(RelayError::Broker(e));
                    return;
                }
            }
        }
    })
    .await;
    if waited.is_err() {
        failure = Some(RelayError::Unconfirmed(CONFIRM_TIMEOUT));
    }
    if !acked.is_empty() {
        outbox.mark_published(&mut tx, &acked).await?;
    }
    if !refused.is_empty() {
        outbox.put_off(&mut tx, &refused).await?;
    }
    tx.commit().await?;
    relayed.published = acked.len();
    relayed.refused = refused.len();
    match failure {
        Some(e) => Err(e),
        None => Ok(relayed),
    }
}

/// How long a batch may take to be published and confirmed.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest pause of the relay after failed batches.
const RELAY_PAUSE_MAX: Duration = Duration::from_secs(5);

/// The relay's pause after `failures` failed batches in a row: growing, so a broker that keeps
/// failing is not asked five times a second, and never more than a few seconds, as the
/// connection's, so messages held back by a broker's blip go out soon after it ends.
fn relay_pause(failures: u32) -> Duration {
    Duration::from_millis(500)
        .saturating_mul(1 << failures.min(6))
        .min(RELAY_PAUSE_MAX)
}

/// The outbox relay of one process: runs until the broker is stopped.
pub async fn relay(
    broker: Broker,
    pool: PgPool,
    routes: Routes,
    idle: Duration,
    outbox: impl Outbox,
) {
    tokio::select! {
        _ = broker.stopped() => {}
        _ = relay_until_stopped(broker.clone(), pool, routes, idle, &outbox) => {}
    }
}

async fn relay_until_stopped(
    broker: Broker,
    pool: PgPool,
    routes: Routes,
    idle: Duration,
    outbox: &impl Outbox,
) {
    // Consecutive failed batches, for the pause before the next (`relay_pause`).
    let mut failures = 0u32;
    loop {
        let connection = broker.connected().await;
        let setup = async {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            declare(&channel, &broker, &routes).await?;
            Ok::<_, lapin::Error>(channel)
        };
        let channel = match setup.await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot set up the outbox relay; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        // While messages pour in (batches back to back), each on the connection the last used.
        let kept = Kept::default();
        loop {
            let batch = async {
                let mut conn = kept.take(&pool).await?;
                let relayed = relay_batch(&channel, &broker, &mut conn, outbox).await?;
                if relayed.taken > 0 {
                    kept.put(conn);
                }
                Ok::<_, RelayError>(relayed)
            };
            match batch.await {
                Ok(relayed) if relayed.taken == 0 => {
                    failures = 0;
                    kept.release();
                    tokio::time::sleep(idle).await;
                }
                Ok(relayed) => {
                    tracing::debug!(
                        published = relayed.published,
                        refused = relayed.refused,
                        "order messages published"
                    );
                    if relayed.unroutable {
                        // Routed to no queue at all, not even the unrouted messages' (a queue
                        // deleted, and declared again by its consumer without its binding):
                        // the topology is declared again before it goes again.
                        failures = failures.saturating_add(1);
                        tokio::time::sleep(relay_pause(failures)).await;
                        break;
                    }
                    failures = 0;
                    // A short batch: messages are coming in a few at a time. Let them gather
                    // for a moment, so that a flood is relayed in batches (a statement, a
                    // confirm wait and an update each) rather than message by message.
                    // Its connection is not kept meanwhile: messages trickling in would hold
                    // one of the pool's nearly all the time (the checkout tests' apps, on pools
                    // of ten under the whole suite's load, saw payment links time out).
                    if relayed.taken < (BATCH / 4) as usize {
                        kept.release();
                        tokio::time::sleep(LINGER).await;
                    }
                }
                Err(RelayError::Database(e)) => {
                    tracing::warn!(error = %e, "the outbox relay cannot read the outbox; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let pause = relay_pause(failures);
                    tracing::warn!(error = %e, retry_in = ?pause, "order messages not published; they stay in the outbox and go again");
                    tokio::time::sleep(pause).await;
                    break;
                }
            }
            if !channel.status().connected() {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Failed attempts of a handler at one message before the message is dead.
pub const MAX_HANDLER_ATTEMPTS: i32 = 5;

/// Counts a failed attempt of `consumer` at a message; returns whether it is now dead.
async fn failed_attempt(
    pool: &PgPool,
    consumer: &str,
    message: &OrderMessage,
    routing_key: &str,
    error: &str,
) -> Result<bool, sqlx::Error> {
    let body = serde_json::to_value(message).unwrap_or_default();
    sqlx::query_scalar(
        "INSERT INTO message_failures (consumer, message_id, routing_key, body, attempts, last_error)
         VALUES ($1, $2, $3, $4, 1, $5)
         ON CONFLICT (consumer, message_id) DO UPDATE SET
             attempts = message_failures.attempts + 1, last_error = EXCLUDED.last_error, last_failed_at = now(),
             dead_at = CASE WHEN message_failures.attempts + 1 >= $6 THEN COALESCE(message_failures.dead_at, now())
                            ELSE message_failures.dead_at END
         RETURNING dead_at IS NOT NULL OR attempts >= $6",
    )
    .bind(consumer)
    .bind(&message.message_id)
    .bind(routing_key)
    .bind(body)
    .bind(error)
    .bind(MAX_HANDLER_ATTEMPTS)
    .fetch_one(pool)
    .await
}

/// A message a consumer gave up on.
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct DeadMessage {
    pub consumer: String,
    pub message_id: String,
    pub routing_key: String,
    pub attempts: i32,
    pub last_error: String,
    pub dead_at: chrono::DateTime<chrono::Utc>,
}

/// The messages consumers gave up on, oldest first.
pub async fn dead_messages(pool: &PgPool, limit: i64) -> Result<Vec<DeadMessage>, sqlx::Error> {
    sqlx::query_as(
        "SELECT consumer, message_id, routing_key, attempts, last_error, dead_at FROM message_failures
         WHERE dead_at IS NOT NULL ORDER BY dead_at, consumer, message_id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayMessageError {
    #[error("no dead message {message_id} of consumer {consumer}")]
    NotDead {
        consumer: String,
        message_id: String,
    },
    #[error("message {0} is not an order event's: it cannot be sent again from the outbox")]
    NotFromOutbox(String),
    #[error(
        "message {message_id} was written at {written_at}, longer ago than the consumers keep their records of the messages they handled: one that handled it would handle it again; send it with --force only once every consumer's side is checked"
    )]
    OlderThanRecords {
        message_id: String,
        written_at: chrono::DateTime<chrono::Utc>,
    },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Sends a dead message again (after a fix to its consumer): its failures are forgotten and its
/// order event goes through the outbox once more. A consumer that handled it meanwhile drops it,
/// within [`CONSUMED_RETENTION`]; an older message is sent only with `force`.
pub async fn replay_dead(
    pool: &PgPool,
    outbox: &impl Outbox,
    consumer: &str,
    message_id: &str,
    force: bool,
) -> Result<(), ReplayMessageError> {
    let event = outbox_id(message_id)
        .ok_or_else(|| ReplayMessageError::NotFromOutbox(message_id.to_owned()))?;
    let mut tx = pool.begin().await?;
    if let Some(written_at) = outbox.written_at(&mut tx, event).await?
        && older_than_records(written_at)
        && !force
    {
        return Err(ReplayMessageError::OlderThanRecords {
            message_id: message_id.to_owned(),
            written_at,
        });
    }
    let removed = sqlx::query(
        "DELETE FROM message_failures WHERE consumer = $1 AND message_id = $2 AND dead_at IS NOT NULL",
    )
    .bind(consumer)
    .bind(message_id)
    .execute(&mut *tx)
    .await?;
    if removed.rows_affected() == 0 {
        return Err(ReplayMessageError::NotDead {
            consumer: consumer.to_owned(),
            message_id: message_id.to_owned(),
        });
    }
    // The dead-letter queue's keeper recorded it taken when it kept it: forgotten, so that
    // dead-lettered again it is kept again, not dropped as a repeat. (A service's own record
    // stays: one that handled the message since keeps it handled once.)
    if consumer == DEAD_LETTERED {
        sqlx::query("DELETE FROM consumed_messages WHERE consumer = $1 AND message_id = $2")
            .bind(consumer)
            .bind(message_id)
            .execute(&mut *tx)
            .await?;
    }
    if !outbox.publish_again(&mut tx, event).await? {
        return Err(ReplayMessageError::NotFromOutbox(message_id.to_owned()));
    }
    tx.commit().await?;
    Ok(())
}

/// What a consumer's handler returns: its work in the consumer's transaction.
pub type Handled<'c> = Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'c>>;

/// Hands each message of `{ns}.<queue>` to `handler` once for `consumer`, however often it is
/// delivered: the handler runs in a transaction with the record of the message id, and the
/// delivery is acknowledged after the commit. A handler error rolls back and the message is
/// delivered again later, up to [`MAX_HANDLER_ATTEMPTS`] times (an outage of the database is not
/// counted); then it is dead: kept in `message_failures` with its body and last error, for an
/// operator to list and replay (`payfleet messages`), and acknowledged. A message that does not
/// read is kept in `unrouted_messages`.
pub async fn consume<H>(broker: Broker, pool: PgPool, queue: String, consumer: String, handler: H)
where
    H: for<'c> Fn(OrderMessage, &'c mut PgConnection) -> Handled<'c> + Send + Sync + 'static,
{
    consume_as(broker, pool, (queue, QueueUse::Service), consumer, handler).await;
}

/// [`consume`] from a queue declared for `usage`.
async fn consume_as<H>(
    broker: Broker,
    pool: PgPool,
    (queue, usage): (String, QueueUse),
    consumer: String,
    handler: H,
) where
    H: for<'c> Fn(OrderMessage, &'c mut PgConnection) -> Handled<'c> + Send + Sync + 'static,
{
    tokio::select! {
        _ = broker.stopped() => {}
        _ = consume_until_stopped(&broker, &pool, (&queue, usage), &consumer, &handler) => {}
    }
}

async fn consume_until_stopped<H>(
    broker: &Broker,
    pool: &PgPool,
    (queue, usage): (&str, QueueUse),
    consumer: &str,
    handler: &H,
) where
    H: for<'c> Fn(OrderMessage, &'c mut PgConnection) -> Handled<'c> + Send + Sync + 'static,
{
    let name = broker.name(queue);
    loop {
        let connection = broker.connected().await;
        let setup = async {
            let channel = connection.create_channel().await?;
            channel.basic_qos(32, BasicQosOptions::default()).await?;
            broker.declare_queue(&name, usage).await?;
            let deliveries = channel
                .basic_consume(
                    name.as_str().into(),
                    consumer.into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok::<_, lapin::Error>((channel, deliveries))
        };
        let (channel, mut deliveries) = match setup.await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(queue = %name, error = %e, "cannot set up the consumer; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        while let Some(delivery) = deliveries.next().await {
            let Ok(delivery) = delivery else { break };
            let message: OrderMessage = match serde_json::from_slice(&delivery.data) {
                Ok(m) => m,
                Err(e) => {
                    // Not lost: kept beside the unrouted ones for an operator, then acknowledged.
                    tracing::warn!(queue = %name, error = %e, "an order message that does not read: kept in unrouted_messages");
                    match keep_unreadable(pool, &name, &delivery).await {
                        Ok(()) => {
                            let _ = delivery.ack(BasicAckOptions::default()).await;
                        }
                        Err(e) => {
                            tracing::warn!(queue = %name, error = %e, "cannot keep an unreadable order message; it is delivered again");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                            let _ = delivery
                                .nack(BasicNackOptions {
                                    requeue: true,
                                    ..Default::default()
                                })
                                .await;
                        }
                    }
                    continue;
                }
            };
            let id = message.message_id.clone();
            // In the trace of the change the message reports (its `traceparent` header).
            let span = crate::traces::hop_span(
                || tracing::info_span!("order_message", queue = %name, message = %id, consumer),
            );
            crate::traces::continue_trace(
                &span,
                super::traceparent_of(&delivery.properties).as_deref(),
            );
            let handled = || {
                tracing::Instrument::instrument(
                    handle(pool, consumer, handler, message.clone()),
                    span.clone(),
                )
            };
            let mut result = handled().await;
            // The database gone (not the handler refusing while it answers): the message waits
            // for it here, unacknowledged, and is handled once it is back. Requeued instead, it
            // came back every half second, and a quorum queue counts every delivery toward its
            // delivery limit: an outage of minutes sent the messages to the dead-letter queue,
            // out of every operator's view. (A broker that takes it back meanwhile, its
            // consumer timeout passed or the channel lost, delivers it again: counted once.)
            let mut pause = Duration::from_millis(500);
            let held_since = tokio::time::Instant::now();
            let mut given_up = false;
            // The dead-letter queue's keeper holds its message for as long as the database will
            // not take it, answering or not (refusing writes, say): no other consumer could
            // keep it, and a broker that counts deliveries (a quorum queue's delivery limit,
            // 20 by default since RabbitMQ 4) would drop a message requeued or returned too
            // often, with no dead-letter queue behind this one.
            let keeper = usage == QueueUse::Dead;
            while let Err(e) = &result
                && crate::db::is_transient(e)
                && channel.status().connected()
                && (keeper || !database_answers(pool).await)
            {
                // Held long enough: this process's database may be the only one gone (a
                // partition, its own PgBouncer). Its channel closes, so the broker gives this
                // message and the others it holds for it to consumers that can take them; it
                // consumes again once its database answers.
                if !keeper && held_since.elapsed() >= HOLD_AT_MOST {
                    given_up = true;
                    break;
                }
                if keeper {
                    tracing::error!(queue = %name, message = %id, held_for = ?held_since.elapsed(), error = %payfleet_queue::error_chain(e),
                        "the database will not keep a dead-lettered order message: it is held, unacknowledged, until it does");
                } else {
                    tracing::warn!(queue = %name, message = %id, error = %payfleet_queue::error_chain(e),
                        "the database is not answering: the order message waits for it, unacknowledged");
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
                result = handled().await;
            }
            if given_up {
                tracing::warn!(queue = %name, "the database has not answered for a while: the broker takes this consumer's messages back until it does");
                let _ = channel
                    .close(200, "the database is not answering".into())
                    .await;
                while !database_answers(pool).await {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                break;
            }
            match result {
                Ok(first) => {
                    if !first {
                        tracing::debug!(queue = %name, message = %id, "a message handled before: dropped");
                    }
                    let _ = delivery.ack(BasicAckOptions::default()).await;
                    broker.telemetry().message(MessageEvent::Consumed, 1);
                }
                Err(e) => {
                    let text = payfleet_queue::error_chain(&e);
                    // An outage is not the message's fault: it is delivered again, uncounted.
                    let dead = if crate::db::is_transient(&e) {
                        false
                    } else {
                        failed_attempt(
                            pool,
                            consumer,
                            &message,
                            delivery.routing_key.as_str(),
                            &text,
                        )
                        .await
                        .unwrap_or(false)
                    };
                    if dead {
                        tracing::error!(queue = %name, message = %id, error = %text, attempts = MAX_HANDLER_ATTEMPTS,
                            "an order message failed every attempt: kept as dead (payfleet messages dead), not delivered again");
                        let _ = delivery.ack(BasicAckOptions::default()).await;
                        broker.telemetry().message(MessageEvent::Dead, 1);
                        continue;
                    }
                    broker.telemetry().message(MessageEvent::Redelivered, 1);
                    tracing::warn!(queue = %name, message = %id, error = %text, "an order message could not be handled; it is delivered again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let _ = delivery
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..Default::default()
                        })
                        .await;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Hands `message` to `handler` for `consumer` in one transaction with the record that it was
/// handled; returns whether it was the first time.
async fn handle<H>(
    pool: &PgPool,
    consumer: &str,
    handler: &H,
    message: OrderMessage,
) -> Result<bool, sqlx::Error>
where
    H: for<'c> Fn(OrderMessage, &'c mut PgConnection) -> Handled<'c> + Send + Sync + 'static,
{
    let mut tx = pool.begin().await?;
    // Handled now: a failure kept of an earlier delivery (dead, or on its way to it) is no
    // longer one, and would be listed and reported as a message no one handled. Only if the
    // handler commits. The dead-lettered consumer's "handling" is the keeping of that record.
    let first = sqlx::query(
        "WITH handled AS (DELETE FROM message_failures WHERE consumer = $1 AND message_id = $2 AND $1 <> $3)
         INSERT INTO consumed_messages (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
    )
    .bind(consumer)
    .bind(&message.message_id)
    .bind(DEAD_LETTERED)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if first {
        handler(message, &mut tx).await?;
    }
    tx.commit().await?;
    Ok(first)
}

/// How long a consumer holds a message for a database that does not answer before it lets the
/// broker give its messages to others.
const HOLD_AT_MOST: Duration = Duration::from_secs(30);

/// Whether the database answers as the primary (after a failover, a connection that reaches
/// the old primary, now a replica, answers but refuses every write).
async fn database_answers(pool: &PgPool) -> bool {
    matches!(
        sqlx::query_scalar::<_, bool>("SELECT NOT pg_is_in_recovery()")
            .fetch_one(pool)
            .await,
        Ok(true)
    )
}

/// Keeps a message that is not an order message (its body as JSON when it is JSON, else as
/// text) under its AMQP message id, or one derived from its queue and delivery.
async fn keep_unreadable(
    pool: &PgPool,
    queue: &str,
    delivery: &lapin::message::Delivery,
) -> Result<(), sqlx::Error> {
    let body = serde_json::from_slice::<serde_json::Value>(&delivery.data).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(&delivery.data).into_owned())
    });
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|m| m.to_string())
        .unwrap_or_else(|| format!("unreadable:{queue}:{:032x}", rand::random::<u128>()));
    sqlx::query(
        "INSERT INTO unrouted_messages (message_id, routing_key, order_kind, body) VALUES ($1, $2, 'unreadable', $3)
         ON CONFLICT (message_id) DO NOTHING",
    )
    .bind(id)
    .bind(delivery.routing_key.as_str())
    .bind(body)
    .execute(pool)
    .await?;
    Ok(())
}

/// Deletes the record of messages consumed more than `older_than` ago, in bounded batches: a
/// message is only delivered again within seconds of its first delivery (a relay that crashed
/// between the broker's confirm and its commit), so a month of records is plenty.
pub async fn prune_consumed(pool: &PgPool, older_than: Duration) -> Result<u64, sqlx::Error> {
    let mut pruned = 0;
    loop {
        let n = sqlx::query(
            "DELETE FROM consumed_messages WHERE ctid IN (
                 SELECT ctid FROM consumed_messages
                 WHERE consumed_at < now() - make_interval(secs => $1) LIMIT 5000)",
        )
        .bind(older_than.as_secs_f64())
        .execute(pool)
        .await?
        .rows_affected();
        pruned += n;
        if n < 5000 {
            return Ok(pruned);
        }
    }
}

/// Who the order messages the broker dead-lettered are kept for in `message_failures`.
pub const DEAD_LETTERED: &str = "dead-lettered";

/// The dead-letter queue's consumer. The broker dead-letters a service's message it delivered
/// its delivery limit's times without an answer (`PAYFLEET_AMQP_DELIVERY_LIMIT`: a database that
/// answers but refuses every write, a consumer that dies on the message) or that a consumer
/// refused: left in `{ns}.dead`, no operator's command, metric or check saw it, and the service
/// never acted on it. Each is kept dead in `message_failures` under [`DEAD_LETTERED`], as a
/// message a consumer gave up on: listed (`payfleet messages dead`), reported
/// (`order_message_dead`) and replayed (`payfleet messages replay`,
/// which sends it to every service again; each takes it once).
pub async fn keep_dead_lettered(broker: Broker, pool: PgPool) {
    consume_as(
        broker,
        pool,
        ("dead".into(), QueueUse::Dead),
        DEAD_LETTERED.into(),
        |m: OrderMessage, tx: &mut PgConnection| {
            let key = m.routing_key();
            tracing::error!(routing_key = %key, message = %m.message_id, order = m.order_number,
                "the broker dead-lettered an order message a service never handled: kept as dead (payfleet messages dead, replay)");
            let body = serde_json::to_value(&m).unwrap_or_default();
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO message_failures (consumer, message_id, routing_key, body, attempts, last_error, dead_at)
                     VALUES ($1, $2, $3, $4, 1, $5, now())
                     ON CONFLICT (consumer, message_id) DO UPDATE SET
                         attempts = message_failures.attempts + 1, last_error = EXCLUDED.last_error,
                         last_failed_at = now(), dead_at = COALESCE(message_failures.dead_at, now())",
                )
                .bind(DEAD_LETTERED)
                .bind(&m.message_id)
                .bind(&key)
                .bind(body)
                .bind("the broker dead-lettered it: a service's queue delivered it its delivery limit's times (PAYFLEET_AMQP_DELIVERY_LIMIT) without its consumer answering, or a consumer refused it")
                .execute(&mut *tx)
                .await?;
                Ok(())
            })
        },
    )
    .await
}

/// The legacy queue's consumer: a message no service's queue binds is logged with its type and
/// kept in `unrouted_messages`, for an operator to read and, once a service binds the type,
/// send on (by hand, or by marking its order event unpublished: the relay sends it again).
///
/// A message that `routes` does bind came here because its service's queue lost its bindings:
/// deleted (to be declared anew, as quorum: README, "Upgrading") and declared again by the
/// service's own consumer, which knows no routes, so every message of the service's went here
/// until a relay set up again, which may be days. Such a message is kept too, and goes again
/// from the outbox once the topology is declared again (binding the queue): its service takes
/// it. Should it come back here (the queue deleted again meanwhile), it is dropped as handled,
/// and its record stays. The topology is declared at most every [`BIND_AGAIN_EVERY`] (a backlog
/// of such messages declares it once), and waited for at most [`BIND_AGAIN_WITHIN`], in the
/// message's transaction.
pub async fn keep_unrouted(broker: Broker, pool: PgPool, routes: Routes, outbox: impl Outbox) {
    let routes = std::sync::Arc::new(routes);
    let outbox = std::sync::Arc::new(outbox);
    let bound_at = std::sync::Arc::new(std::sync::Mutex::new(None::<tokio::time::Instant>));
    let declaring = broker.clone();
    consume(
        broker,
        pool,
        "orders.legacy".into(),
        "legacy".into(),
        move |m: OrderMessage, tx: &mut PgConnection| {
            let key = m.routing_key();
            let body = serde_json::to_value(&m).unwrap_or_default();
            let (broker, routes, outbox, bound_at) = (
                declaring.clone(),
                routes.clone(),
                outbox.clone(),
                bound_at.clone(),
            );
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO unrouted_messages (message_id, routing_key, order_kind, body) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (message_id) DO NOTHING",
                )
                .bind(&m.message_id)
                .bind(&key)
                .bind(&m.order_kind)
                .bind(body)
                .execute(&mut *tx)
                .await?;
                let (Some(service), Some(id)) = (routes.service_of(&key), outbox_id(&m.message_id))
                else {
                    tracing::warn!(routing_key = %key, order = m.order_number, order_kind = %m.order_kind, event = %m.event,
                        "an order message no service's queue binds: kept in unrouted_messages");
                    return Ok(());
                };
                let recently = bound_at
                    .lock()
                    .ok()
                    .and_then(|at| *at)
                    .is_some_and(|at| at.elapsed() < BIND_AGAIN_EVERY);
                if !recently {
                    match tokio::time::timeout(BIND_AGAIN_WITHIN, bind_again(&broker, &routes)).await {
                        Ok(Ok(())) => {
                            if let Ok(mut at) = bound_at.lock() {
                                *at = Some(tokio::time::Instant::now());
                            }
                        }
                        Ok(Err(e)) => {
                            tracing::error!(routing_key = %key, %service, error = %e,
                                "an order message its service binds came to the legacy queue, and the bindings could not be declared again: kept in unrouted_messages");
                            return Ok(());
                        }
                        Err(_) => {
                            tracing::error!(routing_key = %key, %service,
                                "an order message its service binds came to the legacy queue, and the broker did not declare the bindings in time: kept in unrouted_messages");
                            return Ok(());
                        }
                    }
                }
                if outbox.publish_again(&mut *tx, id).await? {
                    tracing::warn!(routing_key = %key, %service, order = m.order_number,
                        "an order message its service binds came to the legacy queue (the service's queue lost its bindings): bound again, and the message goes again (kept in unrouted_messages too)");
                }
                Ok(())
            })
        },
    )
    .await
}

/// How often the legacy queue's consumer declares the topology again, at most.
const BIND_AGAIN_EVERY: Duration = Duration::from_secs(10);
/// How long it waits for the broker to declare it, in a message's transaction.
const BIND_AGAIN_WITHIN: Duration = Duration::from_secs(5);

/// Declares the exchanges, queues and bindings again, on a channel of its own.
async fn bind_again(broker: &Broker, routes: &Routes) -> lapin::Result<()> {
    let connection = broker.connected().await;
    let channel = connection.create_channel().await?;
    declare(&channel, broker, routes).await?;
    let _ = channel.close(200, "declared".into()).await;
    Ok(())
}

/// Whether topic pattern `pattern` (`*`: one word, `#`: none or more) takes routing key `key`,
/// as RabbitMQ's topic exchange matches them.
fn topic_matches(pattern: &str, key: &str) -> bool {
    fn words(p: &[&str], k: &[&str]) -> bool {
        match (p.split_first(), k.split_first()) {
            (None, None) => true,
            (Some((&"#", rest)), _) => words(rest, k) || (!k.is_empty() && words(p, &k[1..])),
            (Some((w, rest)), Some((kw, krest))) => (*w == "*" || w == kw) && words(rest, krest),
            _ => false,
        }
    }
    let p: Vec<&str> = pattern.split('.').collect();
    let k: Vec<&str> = key.split('.').collect();
    words(&p, &k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_may_not_take_a_name_of_the_fleets_own_queues() {
        for name in [
            "orders",
            "dead",
            "coins",
            "payment_links",
            "payment_link_batches",
        ] {
            let refused = format!("{name}=order.*.paid")
                .parse::<Routes>()
                .unwrap_err();
            assert!(refused.contains("of the fleet's own"), "{refused}");
        }
        let routes: Routes = "loyalty=order.*.paid; coin-rewards=order.one_off.*"
            .parse()
            .unwrap();
        assert_eq!(routes.services.len(), 2);
        assert!("bad name=order.#".parse::<Routes>().is_err());
    }

    #[test]
    fn topic_patterns_match_as_rabbitmqs_do() {
        for (pattern, key, matches) in [
            ("order.one_off.*", "order.one_off.paid", true),
            ("order.one_off.*", "order.one_off", false),
            ("order.one_off.*", "order.one_off.paid.late", false),
            ("order.*.paid", "order.subscription.paid", true),
            ("order.#", "order", true),
            ("order.#", "order.one_off.paid", true),
            ("#", "order.one_off.paid", true),
            ("#.paid", "order.one_off.paid", true),
            ("#.paid", "order.one_off.expired", false),
            ("order.#.paid", "order.paid", true),
            ("order.subscription.*", "order.one_off.paid", false),
        ] {
            assert_eq!(topic_matches(pattern, key), matches, "{pattern} {key}");
        }
        let routes = Routes::default();
        assert_eq!(routes.service_of("order.one_off.paid"), Some("fulfilment"));
        assert_eq!(routes.service_of("order.gift.paid"), None);
    }
}
