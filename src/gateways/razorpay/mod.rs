//! Razorpay: its scheme (`signature`: the raw body's HMAC), what its events mean (`events`,
//! including their identity, since the event id header is not signed), its Orders API client
//! (`client`: a Razorpay order is our session), and its settings.

mod client;
pub mod events;
pub mod signature;

use std::sync::Arc;

use serde_json::Value;

pub use client::RazorpayGateway;

use super::signature::SignatureError;
use super::{
    Delivery, EventError, EventFormat, GatewayName, Interpretation, PaymentGateway, SettingsError,
    SignatureCheck, api_url, text,
};
use crate::env::{Env, Invalid, invalid, var, webhook_secret};
use crate::secret::Secret;

/// Razorpay's API.
#[derive(Debug, Clone)]
pub struct Api {
    pub base_url: String,
    /// Public: buyers' browsers open Checkout with it.
    pub key_id: String,
    pub key_secret: Secret,
}

#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// `RAZORPAY_WEBHOOK_SECRET`.
    pub webhook_secret: Option<Secret>,
    /// `RAZORPAY_KEY_ID` and `RAZORPAY_KEY_SECRET` (both or neither), `RAZORPAY_API_URL`.
    pub api: Option<Api>,
}

impl Settings {
    pub fn from_env(env: &dyn Env) -> Result<Self, Invalid> {
        let api = match (var(env, "RAZORPAY_KEY_ID"), var(env, "RAZORPAY_KEY_SECRET")) {
            (None, None) => None,
            (Some(key_id), Some(secret)) => Some(Api {
                base_url: api_url(env, "RAZORPAY_API_URL", "https://api.razorpay.com")?,
                key_id,
                key_secret: Secret::new(secret),
            }),
            _ => {
                return Err(invalid(
                    "RAZORPAY_KEY_ID",
                    "set both RAZORPAY_KEY_ID and RAZORPAY_KEY_SECRET, or neither",
                ));
            }
        };
        Ok(Self {
            webhook_secret: webhook_secret(env, "RAZORPAY_WEBHOOK_SECRET")?,
            api,
        })
    }

    pub(super) fn signature_check(&self) -> Option<Arc<dyn SignatureCheck>> {
        let secret = self.webhook_secret.clone()?;
        Some(Arc::new(Signature { secret }))
    }

    /// The key id the payment page opens Checkout with.
    pub fn key_id(&self) -> Option<String> {
        self.api.as_ref().map(|a| a.key_id.clone())
    }

    pub(super) fn client(
        &self,
        public_url: &str,
    ) -> Result<Option<Arc<dyn PaymentGateway>>, SettingsError> {
        let (Some(api), true) = (&self.api, self.webhook_secret.is_some()) else {
            return Ok(None);
        };
        let g = RazorpayGateway::new(
            &api.base_url,
            &api.key_id,
            api.key_secret.clone(),
            public_url,
        )
        .map_err(|source| SettingsError::Client {
            gateway: GatewayName::Razorpay,
            source,
        })?;
        Ok(Some(Arc::new(g)))
    }
}

struct Signature {
    secret: Secret,
}

impl SignatureCheck for Signature {
    fn gateway(&self) -> GatewayName {
        GatewayName::Razorpay
    }

    fn verify(&self, d: &Delivery, _now: i64, _tolerance: i64) -> Result<(), SignatureError> {
        signature::razorpay(
            self.secret.expose(),
            d.header("x-razorpay-signature"),
            &d.body,
        )
    }
}

pub(super) struct Format;

pub(super) static FORMAT: Format = Format;

impl EventFormat for Format {
    fn attempts_per_session(&self) -> bool {
        true
    }

    fn name(&self) -> GatewayName {
        GatewayName::Razorpay
    }

    fn signature_headers(&self) -> &'static [&'static str] {
        &["x-razorpay-signature", "x-razorpay-event-id"]
    }

    /// Its event id header is not signed: the identity comes from the signed body.
    fn event_id(&self, _: &Delivery, json: &Value) -> Result<String, &'static str> {
        events::event_identity(json)
            .ok_or("the body has no event, created_at and entity id to identify it by")
    }

    fn type_field(&self) -> &'static str {
        "event"
    }

    /// Our payment links put the seller in the notes of whatever entity the event carries. The
    /// payment's last: only the platform writes an order's, a refund's or a dispute's notes,
    /// where a payment's may come from the buyer's checkout.
    fn seller_id(&self, json: &Value) -> Option<String> {
        ["order", "refund", "dispute", "payment"]
            .iter()
            .find_map(|e| text(json.pointer(&format!("/payload/{e}/entity/notes/seller_id"))))
    }

    fn account(&self, json: &Value) -> Option<String> {
        text(json.get("account_id"))
    }

    fn interpret(&self, body: &[u8]) -> Result<Interpretation, EventError> {
        events::interpret(body)
    }

    /// The platform's Razorpay account collects; the platform owes the seller.
    fn settles_through_platform(&self) -> bool {
        true
    }

    fn event_sources(&self) -> &'static [GatewayName] {
        &[GatewayName::Razorpay]
    }
}
