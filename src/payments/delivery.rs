//! Delivering the hosted (internal and mock) gateway's events to the receiver, as an outside
//! gateway would: signed with Standard Webhooks, POSTed to the configured URL, retried with the
//! queue's backoff until the receiver takes it (a 2xx).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use crate::gateways::GatewayName;
use crate::gateways::hosted::{self, EventSink};
use payfleet_queue::{self as queue, Job, JobContext, JobError, NewJob, Worker};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeliverHostedEvent {
    pub id: String,
}

impl Job for DeliverHostedEvent {
    const KIND: &'static str = "deliver_hosted_event";
    const QUEUE: &'static str = "payments";
}

/// Enqueues the delivery of every event the hosted gateway emits, in its transaction.
pub struct QueueSink;

impl EventSink for QueueSink {
    fn emitted<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        _gateway: GatewayName,
        event_id: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'a>> {
        Box::pin(async move {
            let job = NewJob::of(&DeliverHostedEvent {
                id: event_id.to_owned(),
            })
            .map_err(|e| sqlx::Error::Encode(Box::new(e)))?
            .key(format!("hosted_event:{event_id}"));
            queue::enqueue(&mut *tx, job).await.map_err(|e| match e {
                queue::QueueError::Database(e) => e,
                other => sqlx::Error::Encode(Box::new(other)),
            })?;
            Ok(())
        })
    }
}

/// Where and how each hosted gateway delivers.
#[derive(Clone)]
pub struct Deliverer {
    pub pool: PgPool,
    pub http: reqwest::Client,
    /// Each hosted gateway's webhook URL and signing secret.
    pub targets: Vec<hosted::Target>,
}

#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("no event {0}")]
    NoSuchEvent(String),
    #[error("gateway {0} has no delivery target (its secret or URL is not configured)")]
    NoTarget(GatewayName),
    #[error("the receiver is not reachable")]
    Unreachable(#[source] reqwest::Error),
    #[error("the receiver answered {0}")]
    Refused(u16),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl From<DeliveryError> for JobError {
    fn from(e: DeliveryError) -> Self {
        match &e {
            // An event is stored in the same transaction as its job: a missing one will not
            // appear later.
            DeliveryError::NoSuchEvent(_) => JobError::fail(e),
            DeliveryError::Database(db) if !crate::db::is_transient(db) => JobError::fail(e),
            _ => JobError::retry(e),
        }
    }
}

/// The deliverer runs the delivery jobs.
impl Worker<DeliverHostedEvent> for Deliverer {
    async fn work(&self, _ctx: JobContext, job: DeliverHostedEvent) -> Result<(), JobError> {
        Ok(self.deliver(&job.id).await?)
    }
}

impl Deliverer {
    pub fn new(pool: PgPool, targets: Vec<hosted::Target>) -> Result<Self, reqwest::Error> {
        crate::tls::install_provider();
        Ok(Self {
            pool,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            targets,
        })
    }

    pub async fn deliver(&self, id: &str) -> Result<(), DeliveryError> {
        let (gateway, body) = hosted::event(&self.pool, id)
            .await?
            .ok_or_else(|| DeliveryError::NoSuchEvent(id.to_owned()))?;
        let hosted::Target { url, secret, .. } = self
            .targets
            .iter()
            .find(|t| t.gateway == gateway)
            .ok_or(DeliveryError::NoTarget(gateway))?;
        let body = body.to_string();
        let ts = chrono::Utc::now().timestamp();
        let resp = self
            .http
            .post(url)
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", secret.sign(id, ts, body.as_bytes()))
            .body(body)
            .send()
            .await
            .map_err(DeliveryError::Unreachable)?;
        if !resp.status().is_success() {
            return Err(DeliveryError::Refused(resp.status().as_u16()));
        }
        hosted::mark_delivered(&self.pool, id).await?;
        Ok(())
    }
}
