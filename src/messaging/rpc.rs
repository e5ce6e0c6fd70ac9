//! The payment-link RPC. The order side asks, the payment side answers:
//!
//! - requests go to the durable queue `{namespace}.payment_links`, consumed by every worker
//!   process (the payment side); each request names where to answer (`reply_to`) and carries a
//!   `correlation_id`;
//! - the order side receives answers on RabbitMQ's direct reply-to pseudo-queue
//!   (`amq.rabbitmq.reply-to`) of its own channel, matched to the waiting call by correlation id,
//!   and gives up after a timeout (the buyer gets a clear 503; the order is kept and payable
//!   later);
//! - the payment side is idempotent by order, so asking twice (after a timeout, say) gives the
//!   same session.
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
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::Broker;
use crate::gateways::GatewayName;
use crate::money::Money;

const QUEUE: &str = "payment_links";
const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

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
    #[error("the payment side is not reachable (no broker connection)")]
    NotConnected,
    #[error("the payment side did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the broker connection was lost while waiting for the answer")]
    Lost,
    #[error("could not send the request to the payment side")]
    Publish(#[source] lapin::Error),
    #[error("the payment side's answer does not read")]
    Decode(#[source] serde_json::Error),
    #[error("the request could not be written")]
    Encode(#[source] serde_json::Error),
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
                    tracing::warn!(error = %e, "cannot set up the payment-link RPC client; retrying");
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
                        tracing::warn!(error = %e, "the payment-link RPC channel failed; setting it up again");
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

    async fn call(&self, request: &PaymentLinkRequest) -> Result<PaymentLinkReply, RpcError> {
        let channel = self
            .channel
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|c| c.status().connected())
            .ok_or(RpcError::NotConnected)?;
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
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_correlation_id(correlation_id.as_str().into())
            .with_reply_to(DIRECT_REPLY_TO.into())
            // A request nobody took before its caller gave up is dropped by the broker.
            .with_expiration(self.timeout.as_millis().to_string().into());
        channel
            .basic_publish(
                "".into(),
                self.broker.name(QUEUE).as_str().into(),
                BasicPublishOptions::default(),
                &body,
                properties,
            )
            .await
            .map_err(RpcError::Publish)?;
        match tokio::time::timeout(self.timeout, rx).await {
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
        Box::pin(self.call(request))
    }
}

/// What the payment side does with a request.
pub trait LinkHandler: Send + Sync + 'static {
    fn handle(
        &self,
        request: PaymentLinkRequest,
    ) -> Pin<Box<dyn Future<Output = PaymentLinkReply> + Send + '_>>;
}

/// The payment side's consumer: runs until the process stops, setting itself up again after
/// every reconnection. Requests are handled concurrently (up to `prefetch`), each acknowledged
/// once answered; a request that cannot be read is dropped with a warning (it would never read).
pub async fn serve(broker: Broker, handler: Arc<dyn LinkHandler>, prefetch: u16) {
    tokio::select! {
        _ = broker.stopped() => tracing::info!("no longer answering payment-link requests"),
        _ = serve_until_stopped(broker.clone(), handler, prefetch) => {}
    }
}

async fn serve_until_stopped(broker: Broker, handler: Arc<dyn LinkHandler>, prefetch: u16) {
    loop {
        let connection = broker.connected().await;
        let queue = broker.name(QUEUE);
        let setup = async {
            let channel = connection.create_channel().await?;
            channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    broker.queue_arguments(),
                )
                .await?;
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
                tracing::warn!(error = %e, "cannot set up the payment-link consumer; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        tracing::info!(%queue, "answering payment-link requests");
        while let Some(delivery) = requests.next().await {
            let delivery = match delivery {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(error = %e, "the payment-link consumer failed; setting it up again");
                    break;
                }
            };
            let (handler, channel) = (handler.clone(), channel.clone());
            tokio::spawn(async move {
                let reply_to = delivery.properties.reply_to().clone();
                let correlation_id = delivery.properties.correlation_id().clone();
                let request: PaymentLinkRequest = match serde_json::from_slice(&delivery.data) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "dropping a payment-link request that does not read");
                        let _ = delivery
                            .nack(BasicNackOptions {
                                requeue: false,
                                ..Default::default()
                            })
                            .await;
                        return;
                    }
                };
                let order = request.order_number;
                let reply = handler.handle(request).await;
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
                        // The caller times out and asks again; the session is kept.
                        tracing::warn!(order, error = %e, "could not answer a payment-link request");
                    }
                }
                if let Err(e) = delivery.ack(BasicAckOptions::default()).await {
                    tracing::warn!(order, error = %e, "could not acknowledge a payment-link request");
                }
            });
        }
    }
}
