//! Webhook ingestion: verify the signature over the raw body ([`Webhook::verify`], the only way
//! to build a [`Webhook`]), then store the event once per (gateway, event id) together with its
//! processing job ([`EventWriter`]). Nothing else happens on the way in. How each gateway signs
//! and names its deliveries is its own (`gateways::<name>`); this module asks it through
//! `gateways::SignatureCheck` and `gateways::EventFormat`. The HTTP endpoint is
//! `http::webhooks`.

mod writer;

pub use writer::{EventWriter, StoreError};

use std::sync::Arc;

use axum::body::Bytes;
use tokio::sync::Semaphore;

use crate::env::{Env, Invalid, invalid, parsed};
pub use crate::gateways::Delivery;
use crate::gateways::signature::SignatureError;
use crate::gateways::{self, GatewayName, SignatureChecks};

/// The receiver's limits on webhooks.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Largest body taken (`PAYFLEET_WEBHOOK_BODY_LIMIT`, 1 MiB).
    pub body_limit: usize,
    /// Webhooks that may wait for the event writer; beyond it a request is refused at once
    /// with a 503 (`PAYFLEET_WEBHOOK_QUEUE_CAPACITY`, 1024).
    pub queue_capacity: usize,
    /// How far a signed timestamp may be from now, either way
    /// (`PAYFLEET_WEBHOOK_TOLERANCE_SECS`, 300).
    pub tolerance_secs: i64,
}

pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;

/// The longest a signed webhook's timestamp may be from now: a replay is refused after this.
pub const MAX_TOLERANCE_SECS: i64 = 600;

impl Settings {
    pub fn from_env(env: &dyn Env) -> Result<Self, Invalid> {
        let body_limit = parsed(env, "PAYFLEET_WEBHOOK_BODY_LIMIT", DEFAULT_BODY_LIMIT)?;
        if body_limit == 0 {
            return Err(invalid("PAYFLEET_WEBHOOK_BODY_LIMIT", "must be positive"));
        }
        let queue_capacity = parsed(env, "PAYFLEET_WEBHOOK_QUEUE_CAPACITY", 1024usize)?;
        if queue_capacity == 0 {
            return Err(invalid(
                "PAYFLEET_WEBHOOK_QUEUE_CAPACITY",
                "must be positive",
            ));
        }
        let tolerance_secs = parsed(env, "PAYFLEET_WEBHOOK_TOLERANCE_SECS", 300i64)?;
        if !(1..=MAX_TOLERANCE_SECS).contains(&tolerance_secs) {
            return Err(invalid(
                "PAYFLEET_WEBHOOK_TOLERANCE_SECS",
                format!("must be 1 to {MAX_TOLERANCE_SECS} (ten minutes)"),
            ));
        }
        Ok(Self {
            body_limit,
            queue_capacity,
            tolerance_secs,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RejectedWebhook {
    #[error("gateway {0} is not enabled")]
    Disabled(GatewayName),
    #[error(transparent)]
    Signature(#[from] SignatureError),
    #[error("{0}")]
    Malformed(String),
    /// A bug, not the sender's fault: the verification task did not finish.
    #[error("verification did not finish: {0}")]
    Aborted(String),
}

impl RejectedWebhook {
    /// Why, for metrics: `disabled`, `malformed`, or the signature problem.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Disabled(_) => "disabled",
            Self::Signature(e) => e.reason(),
            Self::Malformed(_) => "malformed_body",
            Self::Aborted(_) => "aborted",
        }
    }
}

/// A webhook whose signature checked out. The only way to build one is [`Webhook::verify`].
#[derive(Debug, Clone)]
pub struct Webhook {
    gateway: GatewayName,
    event_id: String,
    event_type: Option<String>,
    body: Bytes,
    headers: serde_json::Value,
    /// The seller the event is for, if its body says (`gateways::EventFormat::seller_hint`).
    seller: Option<String>,
}

/// Headers kept with every event, whatever its gateway, besides its signature's.
const KEPT_HEADERS: &[&str] = &["content-type", "user-agent"];

/// Longest kept header value: the signature headers are bounded before this, the others are
/// informational and truncated.
const MAX_KEPT_HEADER: usize = 512;

impl Webhook {
    /// Checks the gateway's signature over the raw bytes, then reads the event's id from what
    /// the signature covers. Every gateway's body must be JSON.
    pub fn verify(
        d: &Delivery,
        checks: &SignatureChecks,
        now: i64,
        tolerance: i64,
    ) -> Result<Self, RejectedWebhook> {
        let gateway = d.gateway;
        let check = checks
            .get(gateway)
            .ok_or(RejectedWebhook::Disabled(gateway))?;
        check.verify(d, now, tolerance)?;
        let format = gateways::format(gateway);
        let json: serde_json::Value = serde_json::from_slice(&d.body)
            .map_err(|e| RejectedWebhook::Malformed(format!("the body is not JSON: {e}")))?;
        let malformed = |m: &str| RejectedWebhook::Malformed(m.to_owned());
        let event_id = format.event_id(d, &json).map_err(malformed)?;
        if event_id.is_empty() || event_id.len() > 255 {
            return Err(malformed("the event id must be 1 to 255 characters"));
        }
        let mut kept: serde_json::Map<String, serde_json::Value> = format
            .signature_headers()
            .iter()
            .chain(KEPT_HEADERS)
            .filter_map(|name| {
                d.header(name).map(|v| {
                    let v: String = v.chars().take(MAX_KEPT_HEADER).collect();
                    ((*name).to_owned(), serde_json::Value::String(v))
                })
            })
            .collect();
        for name in format.signed_query() {
            if let Some(value) = d.query(name) {
                kept.insert(
                    format!("query:{name}"),
                    serde_json::Value::String(value.to_owned()),
                );
            }
        }
        Ok(Self {
            gateway,
            event_type: format.event_type(&json),
            seller: format.seller_hint(&json),
            event_id,
            body: d.body.clone(),
            headers: serde_json::Value::Object(kept),
        })
    }

    pub fn gateway(&self) -> GatewayName {
        self.gateway
    }

    pub fn event_id(&self) -> &str {
        &self.event_id
    }
}

/// Bodies up to this size are verified where the request is handled: one HMAC over 64 KiB is
/// tens of microseconds. Larger ones go to the blocking pool.
const INLINE_VERIFY_MAX: usize = 64 * 1024;

/// Verifies webhooks without holding up the threads that serve other requests and drive the
/// event writer: a large body's HMAC and JSON parse run on the blocking pool, at most as many
/// at once as the machine has cores (the rest wait their turn, asynchronously).
#[derive(Clone)]
pub struct Verifier {
    checks: Arc<SignatureChecks>,
    tolerance_secs: i64,
    permits: Arc<Semaphore>,
}

impl Verifier {
    pub fn new(checks: SignatureChecks, tolerance_secs: i64) -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            checks: Arc::new(checks),
            tolerance_secs,
            permits: Arc::new(Semaphore::new(cores)),
        }
    }

    /// Whether `gateway`'s webhooks are taken (its secret is configured).
    pub fn enabled(&self, gateway: GatewayName) -> bool {
        self.checks.get(gateway).is_some()
    }

    pub async fn verify(&self, delivery: Delivery) -> Result<Webhook, RejectedWebhook> {
        let now = chrono::Utc::now().timestamp();
        if delivery.body.len() <= INLINE_VERIFY_MAX {
            return Webhook::verify(&delivery, &self.checks, now, self.tolerance_secs);
        }
        // The semaphore is never closed.
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| RejectedWebhook::Aborted("the verifier has stopped".into()))?;
        let checks = self.checks.clone();
        let tolerance = self.tolerance_secs;
        tokio::task::spawn_blocking(move || Webhook::verify(&delivery, &checks, now, tolerance))
            .await
            .map_err(|e| RejectedWebhook::Aborted(e.to_string()))?
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Stored {
    Accepted,
    Duplicate,
}
