//! The webhook receiver: verify the signature over the raw body, store the event once per
//! (gateway, event id) together with its processing job, answer. Nothing else happens here.

pub mod signature;
mod writer;

pub use writer::{EventWriter, StoreError};

use std::collections::HashMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::HeaderMap;
use axum::routing::post;
use serde::Serialize;

use crate::gateways::{self, GatewayName};
use crate::http::ApiError;
use signature::{SignatureError, StandardSecret};

#[derive(Debug, thiserror::Error)]
#[error("{name} is not a valid secret: {problem}")]
pub struct SecretError {
    pub name: &'static str,
    pub problem: &'static str,
}

/// One secret per integration. A gateway without one is disabled (its endpoint answers 404).
#[derive(Debug, Clone, Default)]
pub struct WebhookSecrets {
    pub stripe: Option<String>,
    pub mercadopago: Option<String>,
    pub razorpay: Option<String>,
    pub internal: Option<StandardSecret>,
    pub mock: Option<StandardSecret>,
}

impl WebhookSecrets {
    pub fn from_env() -> Result<Self, SecretError> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.trim().is_empty());
        let standard = |name: &'static str| -> Result<Option<StandardSecret>, SecretError> {
            var(name)
                .map(|v| {
                    StandardSecret::parse(v.trim()).map_err(|problem| SecretError { name, problem })
                })
                .transpose()
        };
        Ok(Self {
            stripe: var("STRIPE_WEBHOOK_SECRET"),
            mercadopago: var("MERCADOPAGO_WEBHOOK_SECRET"),
            razorpay: var("RAZORPAY_WEBHOOK_SECRET"),
            internal: standard("INTERNAL_WEBHOOK_SECRET")?,
            mock: standard("MOCK_WEBHOOK_SECRET")?,
        })
    }

    /// For `up` with nothing configured: the internal and mock gateways get fresh secrets,
    /// returned so they can be printed. Configured secrets are kept.
    pub fn with_development_defaults(mut self) -> (Self, Vec<(&'static str, String)>) {
        let mut made = Vec::new();
        if self.internal.is_none() {
            let (s, text) = StandardSecret::generate();
            self.internal = Some(s);
            made.push(("INTERNAL_WEBHOOK_SECRET", text));
        }
        if self.mock.is_none() {
            let (s, text) = StandardSecret::generate();
            self.mock = Some(s);
            made.push(("MOCK_WEBHOOK_SECRET", text));
        }
        (self, made)
    }

    pub fn enabled(&self, gateway: GatewayName) -> bool {
        match gateway {
            GatewayName::Stripe => self.stripe.is_some(),
            GatewayName::MercadoPago => self.mercadopago.is_some(),
            GatewayName::Razorpay => self.razorpay.is_some(),
            GatewayName::Internal => self.internal.is_some(),
            GatewayName::Mock => self.mock.is_some(),
        }
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
}

/// A webhook whose signature checked out. The only way to build one is [`Webhook::verify`].
#[derive(Debug, Clone)]
pub struct Webhook {
    gateway: GatewayName,
    event_id: String,
    event_type: Option<String>,
    body: Bytes,
    headers: serde_json::Value,
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

impl Webhook {
    /// Checks the gateway's signature over the raw bytes, then reads the event's id from the
    /// signed headers or (Stripe) the body. Every gateway's body must be JSON.
    pub fn verify(
        gateway: GatewayName,
        secrets: &WebhookSecrets,
        headers: &HeaderMap,
        query: &HashMap<String, String>,
        body: Bytes,
        now: i64,
        tolerance: i64,
    ) -> Result<Self, RejectedWebhook> {
        let h = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let disabled = || RejectedWebhook::Disabled(gateway);
        // The id when a header carries it; Stripe's is in the body.
        let header_id = match gateway {
            GatewayName::Stripe => {
                let secret = secrets.stripe.as_deref().ok_or_else(disabled)?;
                signature::stripe(secret, h("stripe-signature"), &body, now, tolerance)?;
                None
            }
            GatewayName::MercadoPago => {
                let secret = secrets.mercadopago.as_deref().ok_or_else(disabled)?;
                let data_id = query.get("data.id").map(String::as_str);
                signature::mercadopago(
                    secret,
                    h("x-signature"),
                    h("x-request-id"),
                    data_id,
                    now,
                    tolerance,
                )?;
                // The body's id changes across resends; the signed request id names the delivery,
                // and processing deduplicates on the payment's state fetched from the API.
                let data_id = data_id.ok_or_else(|| {
                    RejectedWebhook::Malformed("missing data.id in the query string".into())
                })?;
                let request_id = h("x-request-id")
                    .ok_or_else(|| RejectedWebhook::Malformed("missing x-request-id".into()))?;
                Some(format!("{data_id}:{request_id}"))
            }
            GatewayName::Razorpay => {
                let secret = secrets.razorpay.as_deref().ok_or_else(disabled)?;
                signature::razorpay(secret, h("x-razorpay-signature"), &body)?;
                match h("x-razorpay-event-id") {
                    Some(id) if !id.is_empty() => Some(id.to_owned()),
                    _ => {
                        return Err(RejectedWebhook::Malformed(
                            "missing X-Razorpay-Event-Id".into(),
                        ));
                    }
                }
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
                    &body,
                    now,
                    tolerance,
                )?;
                h("webhook-id").map(str::to_owned)
            }
        };
        let json: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| RejectedWebhook::Malformed(format!("the body is not JSON: {e}")))?;
        if gateway == GatewayName::MercadoPago {
            // The body is not signed: it must name the resource the signed query names, since
            // processing reads the resource from it.
            let body_id = match json.get("data").and_then(|d| d.get("id")) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Number(n)) => n.to_string(),
                _ => String::new(),
            };
            let signed = query.get("data.id").map(String::as_str).unwrap_or_default();
            if !body_id.eq_ignore_ascii_case(signed) {
                return Err(RejectedWebhook::Malformed(
                    "the body's data.id differs from the signed data.id".into(),
                ));
            }
        }
        let event_id = match header_id {
            Some(id) => id,
            None => json
                .get("id")
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| {
                    RejectedWebhook::Malformed("the body has no string \"id\"".into())
                })?,
        };
        if event_id.is_empty() || event_id.len() > 255 {
            return Err(RejectedWebhook::Malformed(
                "the event id must be 1 to 255 characters".into(),
            ));
        }
        let mut kept: serde_json::Map<String, serde_json::Value> = KEPT_HEADERS
            .iter()
            .filter_map(|name| {
                h(name).map(|v| ((*name).to_owned(), serde_json::Value::String(v.to_owned())))
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
            event_id,
            body,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stored {
    Accepted,
    Duplicate,
}

/// What the webhook endpoints need.
#[derive(Clone)]
pub struct WebhookState {
    pub events: EventWriter,
    pub secrets: Arc<WebhookSecrets>,
    pub tolerance_secs: i64,
    pub body_limit: usize,
}

#[derive(Serialize)]
struct Receipt {
    status: Stored,
}

pub fn routes(state: WebhookState) -> axum::Router {
    axum::Router::new()
        .route("/webhooks/{gateway}", post(receive))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state)
}

async fn receive(
    State(state): State<WebhookState>,
    Path(gateway): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Receipt>, ApiError> {
    let gateway: GatewayName = gateway
        .parse()
        .map_err(|e: gateways::UnknownGateway| ApiError::NotFound(e.to_string()))?;
    if !state.secrets.enabled(gateway) {
        return Err(ApiError::NotFound(format!(
            "gateway {gateway} is not enabled"
        )));
    }
    let body = body.map_err(|r| ApiError::from_body(r, state.body_limit))?;
    let now = chrono::Utc::now().timestamp();
    let webhook = Webhook::verify(
        gateway,
        &state.secrets,
        &headers,
        &query,
        body,
        now,
        state.tolerance_secs,
    )?;
    let status = state.events.store(webhook).await?;
    crate::http::metrics::webhook_received(gateway, status);
    Ok(Json(Receipt { status }))
}
