//! Webhook ingestion: verify the signature over the raw body ([`Webhook::verify`], the only way
//! to build a [`Webhook`]), then store the event once per (gateway, event id) together with its
//! processing job ([`EventWriter`]). Nothing else happens on the way in. The HTTP endpoint is
//! `http::webhooks`.

pub mod signature;
mod writer;

pub use writer::{EventWriter, StoreError};

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use tokio::sync::Semaphore;

use crate::gateways::{self, GatewayName};
use crate::secret::Secret;
use signature::SignatureError;

use crate::secret::StandardSecret;

/// One secret per integration. A gateway without one is disabled (its endpoint answers 404).
/// Built by `config`; every field prints redacted.
#[derive(Debug, Clone, Default)]
pub struct WebhookSecrets {
    pub stripe: Option<Secret>,
    /// The signing secret of a second Stripe endpoint on the same URL: Stripe signs a Connect
    /// endpoint's events (connected accounts) and an account endpoint's (the platform's own, the
    /// internal gateway's acquirer) with secrets of their own.
    pub stripe_platform: Option<Secret>,
    pub mercadopago: Option<Secret>,
    pub razorpay: Option<Secret>,
    pub internal: Option<StandardSecret>,
    pub mock: Option<StandardSecret>,
}

impl WebhookSecrets {
    pub fn enabled(&self, gateway: GatewayName) -> bool {
        match gateway {
            GatewayName::Stripe => self.stripe.is_some() || self.stripe_platform.is_some(),
            GatewayName::MercadoPago => self.mercadopago.is_some(),
            GatewayName::Razorpay => self.razorpay.is_some(),
            GatewayName::Internal => self.internal.is_some(),
            GatewayName::Mock => self.mock.is_some(),
        }
    }

    pub fn enabled_gateways(&self) -> Vec<GatewayName> {
        GatewayName::ALL
            .iter()
            .copied()
            .filter(|g| self.enabled(*g))
            .collect()
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
    /// The seller the event is for, if its body says (`gateways::seller_hint`).
    seller: Option<String>,
}

/// The request headers that carry a delivery's signature and identity, kept with the event.
const KEPT_HEADERS: &[&str] = &[
    "stripe-signature",
    "x-signature",
    "x-request-id",
    "x-razorpay-signature",
    "x-razorpay-event-id",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "content-type",
    "user-agent",
];

/// Longest kept header value: the signature headers are bounded before this, the others are
/// informational and truncated.
const MAX_KEPT_HEADER: usize = 512;

/// What a delivery carries, owned, so it can be verified on another thread.
pub struct Delivery {
    pub gateway: GatewayName,
    pub headers: HeaderMap,
    pub query: HashMap<String, String>,
    pub body: Bytes,
}

impl Webhook {
    /// Checks the gateway's signature over the raw bytes, then reads the event's id from what
    /// the signature covers. Every gateway's body must be JSON.
    pub fn verify(
        d: &Delivery,
        secrets: &WebhookSecrets,
        now: i64,
        tolerance: i64,
    ) -> Result<Self, RejectedWebhook> {
        let gateway = d.gateway;
        let (headers, query, body) = (&d.headers, &d.query, &d.body);
        let h = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let disabled = || RejectedWebhook::Disabled(gateway);
        match gateway {
            GatewayName::Stripe => {
                // Either endpoint's secret (Connect's, the platform account's): the first that
                // matches. Only a mismatch tries the next; anything else is refused at once.
                let header = h("stripe-signature");
                let mut outcome = Err(disabled());
                for secret in [&secrets.stripe, &secrets.stripe_platform]
                    .into_iter()
                    .flatten()
                {
                    outcome = signature::stripe(secret.expose(), header, body, now, tolerance)
                        .map_err(RejectedWebhook::from);
                    if !matches!(
                        outcome,
                        Err(RejectedWebhook::Signature(SignatureError::Mismatch(_)))
                    ) {
                        break;
                    }
                }
                outcome?;
            }
            GatewayName::MercadoPago => {
                let secret = secrets.mercadopago.as_ref().ok_or_else(disabled)?;
                signature::mercadopago(
                    secret.expose(),
                    h("x-signature"),
                    h("x-request-id"),
                    query.get("data.id").map(String::as_str),
                    now,
                    tolerance,
                )?;
            }
            GatewayName::Razorpay => {
                let secret = secrets.razorpay.as_ref().ok_or_else(disabled)?;
                signature::razorpay(secret.expose(), h("x-razorpay-signature"), body)?;
            }
            GatewayName::Internal | GatewayName::Mock => {
                let secret = if gateway == GatewayName::Internal {
                    &secrets.internal
                } else {
                    &secrets.mock
                };
                let secret = secret.as_ref().ok_or_else(disabled)?;
                signature::standard(
                    secret,
                    h("webhook-id"),
                    h("webhook-timestamp"),
                    h("webhook-signature"),
                    body,
                    now,
                    tolerance,
                )?;
            }
        }
        let json: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| RejectedWebhook::Malformed(format!("the body is not JSON: {e}")))?;
        let malformed = |m: &str| RejectedWebhook::Malformed(m.to_owned());
        let event_id = match gateway {
            // The id is in the signed body.
            GatewayName::Stripe => json
                .get("id")
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| malformed("the body has no string \"id\""))?,
            GatewayName::MercadoPago => {
                // The body is not signed: it must name the resource the signed query names,
                // since processing reads the resource from it. Its own id changes across
                // resends; the signed request id names the delivery, and processing
                // deduplicates on the payment's state fetched from the API.
                let signed = query
                    .get("data.id")
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| malformed("missing data.id in the query string"))?;
                let body_id = match json.get("data").and_then(|d| d.get("id")) {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    Some(serde_json::Value::Number(n)) => n.to_string(),
                    _ => String::new(),
                };
                if !body_id.eq_ignore_ascii_case(signed) {
                    return Err(malformed(
                        "the body's data.id differs from the signed data.id",
                    ));
                }
                let request_id =
                    h("x-request-id").ok_or_else(|| malformed("missing x-request-id"))?;
                format!("{signed}:{request_id}")
            }
            // Its event id header is not signed: the identity comes from the signed body.
            GatewayName::Razorpay => gateways::razorpay_event_identity(&json).ok_or_else(|| {
                malformed("the body has no event, created_at and entity id to identify it by")
            })?,
            // Standard Webhooks sign the id.
            GatewayName::Internal | GatewayName::Mock => h("webhook-id")
                .map(str::to_owned)
                .ok_or_else(|| malformed("missing webhook-id"))?,
        };
        if event_id.is_empty() || event_id.len() > 255 {
            return Err(malformed("the event id must be 1 to 255 characters"));
        }
        let mut kept: serde_json::Map<String, serde_json::Value> = KEPT_HEADERS
            .iter()
            .filter_map(|name| {
                h(name).map(|v| {
                    let v: String = v.chars().take(MAX_KEPT_HEADER).collect();
                    ((*name).to_owned(), serde_json::Value::String(v))
                })
            })
            .collect();
        if let Some(data_id) = query.get("data.id") {
            kept.insert(
                "query:data.id".into(),
                serde_json::Value::String(data_id.clone()),
            );
        }
        Ok(Self {
            gateway,
            event_type: gateways::event_type(gateway, &json),
            seller: gateways::seller_hint(gateway, &json),
            event_id,
            body: body.clone(),
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
    secrets: Arc<WebhookSecrets>,
    tolerance_secs: i64,
    permits: Arc<Semaphore>,
}

impl Verifier {
    pub fn new(secrets: Arc<WebhookSecrets>, tolerance_secs: i64) -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            secrets,
            tolerance_secs,
            permits: Arc::new(Semaphore::new(cores)),
        }
    }

    pub fn secrets(&self) -> &WebhookSecrets {
        &self.secrets
    }

    pub async fn verify(&self, delivery: Delivery) -> Result<Webhook, RejectedWebhook> {
        let now = chrono::Utc::now().timestamp();
        if delivery.body.len() <= INLINE_VERIFY_MAX {
            return Webhook::verify(&delivery, &self.secrets, now, self.tolerance_secs);
        }
        // The semaphore is never closed.
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| RejectedWebhook::Aborted("the verifier has stopped".into()))?;
        let secrets = self.secrets.clone();
        let tolerance = self.tolerance_secs;
        tokio::task::spawn_blocking(move || Webhook::verify(&delivery, &secrets, now, tolerance))
            .await
            .map_err(|e| RejectedWebhook::Aborted(e.to_string()))?
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stored {
    Accepted,
    Duplicate,
}
