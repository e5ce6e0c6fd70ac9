//! Mercado Pago. A notification only names a resource (`data.id`) and its body is not signed,
//! so the payment's state is fetched from the API (`client`) before anything is recorded. Its
//! scheme (`signature`) signs a manifest of the resource's id and the delivery's request id.

mod client;
pub mod events;
pub mod signature;

use std::sync::Arc;

use serde_json::Value;

pub use client::{MercadoPagoClient, MercadoPagoError, is_renewal_session};

use super::signature::SignatureError;
use super::{
    Delivery, EventError, EventFormat, GatewayName, Interpretation, PaymentGateway, SettingsError,
    SignatureCheck, api_url, text,
};
use crate::env::{Env, Invalid, var, webhook_secret};
use crate::secret::Secret;

pub const DEFAULT_API_URL: &str = "https://api.mercadopago.com";

/// Mercado Pago's API: event processing reads payments (its webhook bodies are not signed), the
/// payment side creates preferences and refunds.
#[derive(Debug, Clone)]
pub struct Api {
    pub base_url: String,
    pub access_token: Secret,
}

#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// `MERCADOPAGO_WEBHOOK_SECRET`.
    pub webhook_secret: Option<Secret>,
    /// `MERCADOPAGO_ACCESS_TOKEN`, `MERCADOPAGO_API_URL`.
    pub api: Option<Api>,
}

impl Settings {
    pub fn from_env(env: &dyn Env) -> Result<Self, Invalid> {
        Ok(Self {
            webhook_secret: webhook_secret(env, "MERCADOPAGO_WEBHOOK_SECRET")?,
            api: match var(env, "MERCADOPAGO_ACCESS_TOKEN") {
                None => None,
                Some(token) => Some(Api {
                    base_url: api_url(env, "MERCADOPAGO_API_URL", DEFAULT_API_URL)?,
                    access_token: Secret::new(token),
                }),
            },
        })
    }

    pub(super) fn signature_check(&self) -> Option<Arc<dyn SignatureCheck>> {
        let secret = self.webhook_secret.clone()?;
        Some(Arc::new(Signature { secret }))
    }

    /// The API client event processing reads payments with, wherever the access token is
    /// configured.
    pub fn reader(&self) -> Result<Option<MercadoPagoClient>, MercadoPagoError> {
        self.api
            .as_ref()
            .map(|api| MercadoPagoClient::new(&api.base_url, api.access_token.clone()))
            .transpose()
    }

    /// The gateway buyers pay through, where both the access token and the webhook secret are
    /// configured.
    pub(super) fn client(&self) -> Result<Option<Arc<dyn PaymentGateway>>, SettingsError> {
        if self.webhook_secret.is_none() {
            return Ok(None);
        }
        let client = self.reader().map_err(|e| match e {
            MercadoPagoError::Http(source) => SettingsError::Client {
                gateway: GatewayName::MercadoPago,
                source,
            },
            other => SettingsError::Conflict(other.to_string()),
        })?;
        Ok(client.map(|c| Arc::new(c) as Arc<dyn PaymentGateway>))
    }
}

struct Signature {
    secret: Secret,
}

impl SignatureCheck for Signature {
    fn gateway(&self) -> GatewayName {
        GatewayName::MercadoPago
    }

    fn verify(&self, d: &Delivery, now: i64, tolerance: i64) -> Result<(), SignatureError> {
        signature::mercadopago(
            self.secret.expose(),
            d.header("x-signature"),
            d.header("x-request-id"),
            d.query("data.id"),
            now,
            tolerance,
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
        GatewayName::MercadoPago
    }

    fn signature_headers(&self) -> &'static [&'static str] {
        &["x-signature", "x-request-id"]
    }

    fn signed_query(&self) -> &'static [&'static str] {
        &["data.id"]
    }

    /// The body is not signed: it must name the resource the signed query names, since
    /// processing reads the resource from it. Its own id changes across resends; the signed
    /// request id names the delivery, and processing deduplicates on the payment's state
    /// fetched from the API. The resource is named as signed (an alphanumeric id lowercased),
    /// so a resend that only changes the id's case is the same event.
    fn event_id(&self, d: &Delivery, json: &Value) -> Result<String, &'static str> {
        let signed = d
            .query("data.id")
            .filter(|s| !s.is_empty())
            .ok_or("missing data.id in the query string")?;
        let body_id = text(json.get("data").and_then(|d| d.get("id"))).unwrap_or_default();
        if !body_id.eq_ignore_ascii_case(signed) {
            return Err("the body's data.id differs from the signed data.id");
        }
        let request_id = d.header("x-request-id").ok_or("missing x-request-id")?;
        Ok(format!(
            "{}:{request_id}",
            signature::signed_data_id(signed)
        ))
    }

    fn type_field(&self) -> &'static str {
        "action"
    }

    /// Its notifications carry none of our metadata.
    fn seller_id(&self, _: &Value) -> Option<String> {
        None
    }

    fn account(&self, json: &Value) -> Option<String> {
        text(json.get("user_id"))
    }

    fn interpret(&self, body: &[u8]) -> Result<Interpretation, EventError> {
        events::interpret(body)
    }

    /// The preference is the seller's: the money lands with the seller.
    fn settles_through_platform(&self) -> bool {
        false
    }

    /// A mediation is its payment's state: the payment is read again whole, so the refunds
    /// that ended it are recorded with its decision.
    fn disputes_are_payment_state(&self) -> bool {
        true
    }

    fn event_sources(&self) -> &'static [GatewayName] {
        &[GatewayName::MercadoPago]
    }
}
