//! Request and reply over RabbitMQ, and the two RPCs the fleet speaks: the payment link
//! ([`PaymentLink`]: the order side asks the payment side for an order's link) and the coins
//! ([`Coins`]: the order side reserves, approves and releases a buyer's coins). For each:
//!
//! - requests go to a durable queue, `{namespace}.payment_links` or `{namespace}.coins`,
//!   consumed by every worker process; each request names where to answer (`reply_to`) and
//!   carries a `correlation_id`;
//! - the order side receives answers on RabbitMQ's direct reply-to pseudo-queue
//!   (`amq.rabbitmq.reply-to`) of its own channel, matched to the waiting call by correlation id,
//!   and gives up after a timeout (the buyer gets a clear 503; the order is kept and payable
//!   later);
//! - the answering side is idempotent (by order and attempt for a link, by reservation id for
//!   coins), so asking twice (after a timeout, say) does the work once.
//!
//! Both sides survive a broker restart: on a lost connection or channel they wait for the
//! supervisor's next connection and set up again; calls made meanwhile fail at once.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};

use super::Broker;
use crate::batches::in_batches;
use crate::gateways::GatewayName;
use crate::money::Money;
use crate::telemetry::RpcResult;

const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// One remote procedure: its queue (under the fleet's namespace), request and reply.
pub trait Rpc: Send + Sync + 'static {
    const QUEUE: &'static str;
    type Request: Serialize + DeserializeOwned + Send + Sync;
    type Reply: Serialize + DeserializeOwned + Send;
}

/// The payment link for an order.
pub struct PaymentLink;

impl Rpc for PaymentLink {
    const QUEUE: &'static str = "payment_links";
    type Request = PaymentLinkRequest;
    type Reply = PaymentLinkReply;
}

/// Payment links for many orders in one request message, answered in one reply (each link as
/// [`PaymentLink`] would answer it, in the order asked): what the order side asks while other
/// links are on their way travels together ([`BatchedLinks`]).
pub struct PaymentLinkBatch;

impl Rpc for PaymentLinkBatch {
    const QUEUE: &'static str = "payment_link_batches";
    type Request = Vec<PaymentLinkRequest>;
    type Reply = Vec<PaymentLinkReply>;
}

/// A buyer's coins.
pub struct Coins;

impl Rpc for Coins {
    const QUEUE: &'static str = "coins";
    type Request = CoinRequest;
    type Reply = CoinReply;
}

/// What the order side asks of the coins: each step idempotent by the reservation's id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum CoinRequest {
    Reserve {
        reservation_id: String,
        buyer_id: String,
        amount: Money,
        order_number: Option<i64>,
    },
    /// The reservation is spent.
    Approve { reservation_id: String },
    /// The reservation goes back to the wallet.
    Release { reservation_id: String },
}

/// The coins' answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum CoinReply {
    /// The reservation's state after the step (`reserved`, `approved`, `released`).
    Done {
        reservation_id: String,
        state: String,
    },
    /// Refused for good (`coins_insufficient`, `reservation_decided`, `unknown_reservation`,
    /// `reservation_conflict`).
    Refused { code: String, message: String },
    /// Not done now; asking again later may work.
    Failed { message: String },
}

/// What the order side asks for: a payment link for one order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentLinkRequest {
    pub order_number: i64,
    pub gateway: GatewayName,
    pub amount: Money,
    pub platform_fee: Money,
    pub seller_id: String,
    /// The seller's Stripe Connect account, for direct charges.
    pub seller_account: Option<String>,
    pub buyer_id: String,
    pub description: String,
    /// For a subscription: its billing interval.
    pub recurring_interval: Option<String>,
    /// The order's payment attempt: a failed attempt's session is spent, the next gets its own.
    pub attempt: i32,
    /// Unique across installations and attempts, unguessable: the gateways' idempotency keys
    /// and references are made of it.
    pub link_key: String,
    /// When the order stops waiting for its payment: the session should not outlive it.
    pub expires_at: chrono::DateTime<chrono::Utc>,
    /// A subscription whose first period costs less than the later ones (a coupon discounts
    /// the first period only): what each later period charges. `amount` is the first's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renews_at: Option<Money>,
    /// With `renews_at`: the platform's commission on each later period, priced as the order's
    /// own fee is. A gateway that bills the periods takes its commission as a share of each, and
    /// that share comes from here, not from the discounted first period's fee (which a coupon
    /// and the fee's rounding would carry into every period after it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renews_fee: Option<Money>,
    /// How long the caller waits for the answer (its RPC timeout): the payment side stops
    /// waiting for an outside gateway then, counted from the request's receipt (a clock of its
    /// own, never compared with the caller's), instead of holding a consumer's slot for the
    /// gateway's own longer timeout for a caller gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_within_ms: Option<u64>,
}

/// The payment side's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum PaymentLinkReply {
    Created {
        session_id: String,
        url: String,
    },
    /// The payment side could not make the link; `retryable`: asking again later may work.
    Failed {
        code: String,
        message: String,
        retryable: bool,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("the answering side is not reachable (no broker connection)")]
    NotConnected,
    /// The broker takes no message from this connection now (a memory or disk alarm): a
    /// request would wait, unsent, for as long as the alarm lasts.
    #[error("the broker is refusing messages (a resource alarm)")]
    Blocked,
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the broker connection was lost while waiting for the answer")]
    Lost,
    #[error("could not send the request")]
    Publish(#[source] lapin::Error),
    #[error("the answer does not read")]
    Decode(#[source] serde_json::Error),
    #[error("the request could not be written")]
    Encode(#[source] serde_json::Error),
    #[error("asked for {asked} links, answered {answered}")]
    Mismatch { asked: usize, answered: usize },
    /// The error of a batch of calls, which each of them shares.
    #[error(transparent)]
    Shared(Arc<RpcError>),
}

impl RpcError {
    /// Asking again later may work: the broker or the answering side was not there in time.
    /// (An answer that does not read, or a request that cannot be written, never will.)
    pub fn is_transient(&self) -> bool {
        match self {
            // A reply of another length is a payment side of another release: asking again
            // (once it is replaced) works.
            Self::NotConnected
            | Self::Blocked
            | Self::Timeout(_)
            | Self::Lost
            | Self::Publish(_)
            | Self::Mismatch { .. } => true,
            Self::Decode(_) | Self::Encode(_) => false,
            Self::Shared(e) => e.is_transient(),
        }
    }

    fn result(&self) -> RpcResult {
        match self {
            Self::Timeout(_) => RpcResult::Timeout,
            Self::Shared(e) => e.result(),
            _ => RpcResult::Failed,
        }
    }
}

/// The order side's way to ask for a payment link. A trait so the order side does not care how
/// the answer travels.
pub trait PaymentLinks: Send + Sync {
    fn create<'a>(
        &'a self,
        request: &'a PaymentLinkRequest,
    ) -> Pin<Box<dyn Future<Output = Result<PaymentLinkReply, RpcError>> + Send + 'a>>;
}

type Pending = Arc<Mutex<HashMap<String, oneshot::Sender<Vec<u8>>>>>;

/// The RPC client: one channel with its direct reply-to consumer, re-created after every
/// reconnection. Cheap to clone.
#[derive(Clone)]
pub struct RpcClient {
    broker: Broker,
    timeout: Duration,
    channel: Arc<Mutex<Option<Channel>>>,
    pending: Pending,
}

impl RpcClient {
    /// Starts the client's channel keeper on the current runtime.
    pub fn start(broker: Broker, timeout: Duration) -> Self {
        let client = Self {
            broker,
            timeout,
            channel: Arc::default(),
            pending: Arc::default(),
        };
        tokio::spawn(client.clone().keep_channel());
        client
    }

    /// Whether a call could be sent right now.
    pub fn is_ready(&self) -> bool {
        self.channel
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|c| c.status().connected())
    }

    async fn keep_channel(self) {
        tokio::select! {
            _ = self.broker.stopped() => {}
            _ = self.clone().keep_channel_until_stopped() => {}
        }
    }

    async fn keep_channel_until_stopped(self) {
        loop {
            let connection = self.broker.connected().await;
            let setup = async {
                let channel = connection.create_channel().await?;
                let replies = channel
                    .basic_consume(
                        DIRECT_REPLY_TO.into(),
                        "".into(),
                        BasicConsumeOptions {
                            no_ack: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                Ok::<_, lapin::Error>((channel, replies))
            };
            let (channel, mut replies) = match setup.await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot set up the RPC client; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            *self.channel.lock().unwrap_or_else(PoisonError::into_inner) = Some(channel);
            while let Some(delivery) = replies.next().await {
                match delivery {
                    Ok(d) => {
                        let id = d
                            .properties
                            .correlation_id()
                            .as_ref()
                            .map(|c| c.to_string());
                        let waiting = id.and_then(|id| {
                            self.pending
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .remove(&id)
                        });
                        match waiting {
                            Some(tx) => {
                                let _ = tx.send(d.data);
                            }
                            // Its caller gave up (timeout) before the answer came.
                            None => tracing::debug!("an answer nobody waits for any more"),
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the RPC client's channel failed; setting it up again");
                        break;
                    }
                }
            }
            *self.channel.lock().unwrap_or_else(PoisonError::into_inner) = None;
            // Calls waiting on the lost channel will never get their answer.
            self.pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Asks `R`'s answering side and waits for its reply (at most the client's timeout).
    pub async fn call<R: Rpc>(&self, request: &R::Request) -> Result<R::Reply, RpcError> {
        let answer = self.ask::<R>(request).await;
        self.count(R::QUEUE, answer.as_ref().err());
        answer
    }

    fn count(&self, rpc: &'static str, error: Option<&RpcError>) {
        let result = error.map_or(RpcResult::Answered, RpcError::result);
        self.broker.telemetry().rpc_call(rpc, result);
    }

    async fn ask<R: Rpc>(&self, request: &R::Request) -> Result<R::Reply, RpcError> {
        let channel = self
            .channel
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|c| c.status().connected())
            .ok_or(RpcError::NotConnected)?;
        if self.broker.is_blocked() {
            return Err(RpcError::Blocked);
        }
        // One deadline for the whole call: a broker that stops taking messages mid-way (an
        // alarm raised after the check above) holds the publish itself, not only the answer.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let correlation_id = format!("{:032x}", rand::random::<u128>());
        let body = serde_json::to_vec(request).map_err(RpcError::Encode)?;
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(correlation_id.clone(), tx);
        // However this call ends (an answer, a timeout, its caller gone), its entry goes.
        let _forget = Forget {
            pending: self.pending.clone(),
            id: correlation_id.clone(),
        };
        let mut properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_correlation_id(correlation_id.as_str().into())
            .with_reply_to(DIRECT_REPLY_TO.into())
            // A request nobody took before its caller gave up is dropped by the broker.
            .with_expiration(self.timeout.as_millis().to_string().into());
        // The answering side's span continues the caller's trace (`traces`).
        if let Some(tp) = crate::traces::traceparent() {
            properties = properties.with_headers(super::trace_headers(&tp));
        }
        let published = channel.basic_publish(
            "".into(),
            self.broker.name(R::QUEUE).as_str().into(),
            BasicPublishOptions::default(),
            &body,
            properties,
        );
        tokio::time::timeout_at(deadline, published)
            .await
            .map_err(|_| RpcError::Timeout(self.timeout))?
            .map_err(RpcError::Publish)?;
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(data)) => serde_json::from_slice(&data).map_err(RpcError::Decode),
            Ok(Err(_)) => Err(RpcError::Lost),
            Err(_) => Err(RpcError::Timeout(self.timeout)),
        }
    }
}

/// Removes a call's entry from the waiting calls when the call ends, whichever way.
struct Forget {
    pending: Pending,
    id: String,
}

impl Drop for Forget {
    fn drop(&mut self) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

impl PaymentLinks for RpcClient {
    fn create<'a>(
        &'a self,
        request: &'a PaymentLinkRequest,
    ) -> Pin<Box<dyn Future<Output = Result<PaymentLinkReply, RpcError>> + Send + 'a>> {
        Box::pin(self.call::<PaymentLink>(request))
    }
}

/// Most links in one request message.
const LINK_BATCH: usize = 64;

/// Request messages on their way at once: one; the links asked while it is answered gather
/// for the next (as the checkouts' writer's batches do, for the same reason).
const LINK_BATCHES_IN_FLIGHT: usize = 1;

/// A link asked: the request, the caller's trace, where its answer goes.
struct LinkCall {
    request: PaymentLinkRequest,
    traceparent: Option<String>,
    reply: oneshot::Sender<Result<PaymentLinkReply, RpcError>>,
}

/// The order side's payment links over [`PaymentLinkBatch`]: the links asked while others are
/// on their way go together in one request message, answered in one reply. At sixteen
/// concurrent checkouts each link was a request and a reply through the broker, and three
/// statements on the payment side; together they are one message each way and three
/// statements per batch. Each link still gets its own answer (or its own refusal), and each
/// is counted as a `payment_links` call. Only the links whose sessions are rows in our
/// database travel together (`together`: the hosted gateways', but not the internal gateway's
/// where it collects through an acquirer, whose sessions are Stripe's); an outside gateway's
/// link is still one request of its own ([`PaymentLink`]), so a slow gateway holds up no
/// other link, and no batch waits for its slowest call. Cheap to clone.
#[derive(Clone)]
pub struct BatchedLinks {
    client: RpcClient,
    queue: mpsc::Sender<LinkCall>,
    together: Arc<[GatewayName]>,
}

impl BatchedLinks {
    /// The gateways whose links may travel together: the hosted ones, but the internal gateway
    /// only while it collects no real money through `acquirer`.
    pub fn together(acquirer: Option<GatewayName>) -> Vec<GatewayName> {
        [GatewayName::Internal, GatewayName::Mock]
            .into_iter()
            .filter(|g| !(*g == GatewayName::Internal && acquirer.is_some()))
            .collect()
    }

    /// Starts the batches' task on the current runtime; it ends when every handle is dropped.
    /// `together`: the gateways whose links are batched ([`Self::together`]).
    pub fn start(client: RpcClient, together: Vec<GatewayName>) -> Self {
        // Declared by the asking side too, before its first request: a request sent before any
        // payment side has declared the queue (a fleet starting, an upgrade whose workers are
        // not replaced yet) waits in it, until it expires with its caller's patience, instead
        // of being dropped by the broker as unroutable. Declaring a quorum queue on a loaded
        // broker can take longer than a first checkout takes to come: the batches wait for it
        // (within their callers' timeout), and a failed declaration is tried again.
        let broker = client.broker.clone();
        let (declared_tx, declared) = watch::channel(false);
        tokio::spawn(async move {
            let queue = broker.name(PaymentLinkBatch::QUEUE);
            loop {
                match broker.declare_queue(&queue, super::QueueUse::Rpc).await {
                    Ok(()) => {
                        let _ = declared_tx.send(true);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(%queue, error = %e, "cannot declare the payment links' queue; trying again");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        });
        let (queue, pending) = mpsc::channel(4 * LINK_BATCH);
        let asking = client.clone();
        tokio::spawn(in_batches(
            pending,
            LINK_BATCH,
            LINK_BATCHES_IN_FLIGHT,
            move |batch| ask_links(asking.clone(), declared.clone(), batch),
        ));
        Self {
            client,
            queue,
            together: together.into(),
        }
    }

    async fn ask(&self, request: &PaymentLinkRequest) -> Result<PaymentLinkReply, RpcError> {
        let request = PaymentLinkRequest {
            answer_within_ms: u64::try_from(self.client.timeout.as_millis()).ok(),
            ..request.clone()
        };
        if !self.together.contains(&request.gateway) {
            return self.client.call::<PaymentLink>(&request).await;
        }
        let (reply, answer) = oneshot::channel();
        let call = LinkCall {
            request,
            traceparent: crate::traces::traceparent(),
            reply,
        };
        // One timeout for the whole wait, as for a link asked alone: the batch on its way
        // before this one's does not lengthen it.
        let asked = async {
            self.queue
                .send(call)
                .await
                .map_err(|_| RpcError::NotConnected)?;
            // The batch's task gone (the process stopping, or a panic): no answer will come.
            answer.await.unwrap_or(Err(RpcError::Lost))
        };
        let answer = tokio::time::timeout(self.client.timeout, asked)
            .await
            .unwrap_or(Err(RpcError::Timeout(self.client.timeout)));
        if let Err(
            e
            @ (RpcError::NotConnected | RpcError::Blocked | RpcError::Lost | RpcError::Timeout(_)),
        ) = &answer
        {
            // Not counted by a batch.
            self.client.count(PaymentLink::QUEUE, Some(e));
        }
        answer
    }
}

/// Asks one batch of links in one message and hands each caller its own answer. The message
/// continues the first link's trace (a message carries one): the payment side's span for the
/// batch sits in that checkout's trace.
async fn ask_links(client: RpcClient, mut declared: watch::Receiver<bool>, batch: Vec<LinkCall>) {
    // Sent only to a queue that exists (see [`BatchedLinks::start`]); the callers' timeout
    // bounds the wait. A declaring task gone (the process stopping) leaves the callers to it.
    if declared.wait_for(|d| *d).await.is_err() {
        return;
    }
    let span = crate::traces::hop_span(|| {
        tracing::info_span!(
            "payment_link_batch",
            links = batch.len(),
            otel.kind = "client"
        )
    });
    crate::traces::continue_trace(&span, batch.first().and_then(|c| c.traceparent.as_deref()));
    let (requests, callers): (Vec<PaymentLinkRequest>, Vec<_>) =
        batch.into_iter().map(|c| (c.request, c.reply)).unzip();
    let asked = tracing::Instrument::instrument(client.ask::<PaymentLinkBatch>(&requests), span);
    let answer = match asked.await {
        Ok(links) if links.len() == requests.len() => Ok(links),
        Ok(links) => Err(RpcError::Mismatch {
            asked: requests.len(),
            answered: links.len(),
        }),
        Err(e) => Err(e),
    };
    match answer {
        Ok(links) => {
            for (caller, link) in callers.into_iter().zip(links) {
                if caller.send(Ok(link)).is_ok() {
                    client.count(PaymentLink::QUEUE, None);
                }
            }
        }
        Err(e) => {
            let e = Arc::new(e);
            for caller in callers {
                let e = RpcError::Shared(e.clone());
                if caller.is_closed() {
                    continue;
                }
                client.count(PaymentLink::QUEUE, Some(&e));
                let _ = caller.send(Err(e));
            }
        }
    }
}

impl PaymentLinks for BatchedLinks {
    fn create<'a>(
        &'a self,
        request: &'a PaymentLinkRequest,
    ) -> Pin<Box<dyn Future<Output = Result<PaymentLinkReply, RpcError>> + Send + 'a>> {
        Box::pin(self.ask(request))
    }
}

/// What the answering side of `R` does with a request.
pub trait Handler<R: Rpc>: Send + Sync + 'static {
    fn handle(&self, request: R::Request) -> Pin<Box<dyn Future<Output = R::Reply> + Send + '_>>;
}

/// The answering side's consumer of `R`: runs until the process stops, setting itself up again
/// after every reconnection. Requests are handled concurrently (up to `prefetch`), each
/// acknowledged once answered; a request that cannot be read is dropped with a warning (it
/// would never read).
pub async fn serve<R: Rpc>(broker: Broker, handler: Arc<dyn Handler<R>>, prefetch: u16) {
    tokio::select! {
        _ = broker.stopped() => tracing::info!(rpc = R::QUEUE, "no longer answering requests"),
        _ = serve_until_stopped(broker.clone(), handler, prefetch) => {}
    }
}

async fn serve_until_stopped<R: Rpc>(broker: Broker, handler: Arc<dyn Handler<R>>, prefetch: u16) {
    loop {
        let connection = broker.connected().await;
        let queue = broker.name(R::QUEUE);
        let setup = async {
            let channel = connection.create_channel().await?;
            broker.declare_queue(&queue, super::QueueUse::Rpc).await?;
            channel
                .basic_qos(prefetch, BasicQosOptions::default())
                .await?;
            let requests = channel
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok::<_, lapin::Error>((channel, requests))
        };
        let (channel, mut requests) = match setup.await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(rpc = R::QUEUE, error = %e, "cannot set up the consumer; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        tracing::info!(%queue, "answering requests");
        let _answering = broker.answering_while();
        while let Some(delivery) = requests.next().await {
            let delivery = match delivery {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(rpc = R::QUEUE, error = %e, "the consumer failed; setting it up again");
                    break;
                }
            };
            let (handler, channel) = (handler.clone(), channel.clone());
            tokio::spawn(async move {
                let reply_to = delivery.properties.reply_to().clone();
                let correlation_id = delivery.properties.correlation_id().clone();
                let request: R::Request = match serde_json::from_slice(&delivery.data) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(rpc = R::QUEUE, error = %e, "dropping a request that does not read");
                        let _ = delivery
                            .nack(BasicNackOptions {
                                requeue: false,
                                ..Default::default()
                            })
                            .await;
                        return;
                    }
                };
                let span = crate::traces::hop_span(|| {
                    tracing::info_span!("rpc", rpc = R::QUEUE, otel.kind = "server")
                });
                crate::traces::continue_trace(
                    &span,
                    super::traceparent_of(&delivery.properties).as_deref(),
                );
                let reply = tracing::Instrument::instrument(handler.handle(request), span).await;
                if let (Some(reply_to), Ok(body)) = (reply_to, serde_json::to_vec(&reply)) {
                    let mut properties =
                        BasicProperties::default().with_content_type("application/json".into());
                    if let Some(id) = correlation_id {
                        properties = properties.with_correlation_id(id);
                    }
                    if let Err(e) = channel
                        .basic_publish(
                            "".into(),
                            reply_to,
                            BasicPublishOptions::default(),
                            &body,
                            properties,
                        )
                        .await
                    {
                        // The caller times out and asks again; the work done is kept.
                        tracing::warn!(rpc = R::QUEUE, error = %e, "could not answer a request");
                    }
                }
                if let Err(e) = delivery.ack(BasicAckOptions::default()).await {
                    tracing::warn!(rpc = R::QUEUE, error = %e, "could not acknowledge a request");
                }
            });
        }
    }
}
