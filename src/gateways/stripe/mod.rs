//! Stripe: its webhooks' scheme (`signature`), what its events mean (`events`), its API client
//! (`client`: Connect direct charges, or the internal gateway's acquirer on the platform's own
//! account), and its settings.

mod client;
pub mod events;
pub mod signature;

use std::sync::Arc;

use serde_json::Value;

pub use client::StripeConnect;

use super::signature::SignatureError;
use super::{
    Delivery, EventError, EventFormat, GatewayName, Interpretation, PaymentGateway, SettingsError,
    SignatureCheck, api_url, text,
};
use crate::env::{Env, Invalid, var, webhook_secret};
use crate::secret::Secret;

/// Stripe's API, for Connect direct charges (and the internal gateway's acquirer).
#[derive(Debug, Clone)]
pub struct Api {
    pub base_url: String,
    pub secret_key: Secret,
}

#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// The Connect endpoint's signing secret (`STRIPE_WEBHOOK_SECRET`): connected accounts'
    /// events.
    pub webhook_secret: Option<Secret>,
    /// The signing secret of a second endpoint on the same URL
    /// (`STRIPE_PLATFORM_WEBHOOK_SECRET`): Stripe signs an account endpoint's events (the
    /// platform's own, the internal gateway's acquirer) with a secret of its own.
    pub platform_webhook_secret: Option<Secret>,
    /// `STRIPE_SECRET_KEY`, `STRIPE_API_URL`.
    pub api: Option<Api>,
}

impl Settings {
    pub fn from_env(env: &dyn Env) -> Result<Self, Invalid> {
        Ok(Self {
            webhook_secret: webhook_secret(env, "STRIPE_WEBHOOK_SECRET")?,
            platform_webhook_secret: webhook_secret(env, "STRIPE_PLATFORM_WEBHOOK_SECRET")?,
            api: match var(env, "STRIPE_SECRET_KEY") {
                None => None,
                Some(key) => Some(Api {
                    base_url: api_url(env, "STRIPE_API_URL", "https://api.stripe.com")?,
                    secret_key: Secret::new(key),
                }),
            },
        })
    }

    pub(super) fn signature_check(&self) -> Option<Arc<dyn SignatureCheck>> {
        let secrets: Vec<Secret> = [&self.webhook_secret, &self.platform_webhook_secret]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        (!secrets.is_empty()).then(|| Arc::new(Signatures { secrets }) as Arc<dyn SignatureCheck>)
    }

    /// The platform account's events can be received and its API asked.
    pub(super) fn receives_platform_events(&self) -> bool {
        self.api.is_some()
            && (self.webhook_secret.is_some() || self.platform_webhook_secret.is_some())
    }

    /// The Connect client, where both its API key and its endpoint's secret are configured.
    pub(super) fn client(
        &self,
        public_url: &str,
    ) -> Result<Option<Arc<dyn PaymentGateway>>, SettingsError> {
        let (Some(api), true) = (&self.api, self.webhook_secret.is_some()) else {
            return Ok(None);
        };
        let g = StripeConnect::new(&api.base_url, api.secret_key.clone(), public_url)
            .map_err(client_error)?;
        Ok(Some(Arc::new(g)))
    }

    /// The client that collects `acquires_for`'s payments on the platform's own account.
    pub(super) fn acquirer_client(
        &self,
        public_url: &str,
        acquires_for: Option<GatewayName>,
    ) -> Result<Option<Arc<dyn PaymentGateway>>, SettingsError> {
        let (Some(api), Some(_)) = (&self.api, acquires_for) else {
            return Ok(None);
        };
        let g = StripeConnect::internal_acquirer(&api.base_url, api.secret_key.clone(), public_url)
            .map_err(client_error)?;
        Ok(Some(Arc::new(g)))
    }
}

fn client_error(source: reqwest::Error) -> SettingsError {
    SettingsError::Client {
        gateway: GatewayName::Stripe,
        source,
    }
}

/// Either endpoint's secret (Connect's, the platform account's): the first that matches. Only
/// a mismatch tries the next; anything else is refused at once.
struct Signatures {
    secrets: Vec<Secret>,
}

impl SignatureCheck for Signatures {
    fn gateway(&self) -> GatewayName {
        GatewayName::Stripe
    }

    fn verify(&self, d: &Delivery, now: i64, tolerance: i64) -> Result<(), SignatureError> {
        let header = d.header("stripe-signature");
        let mut outcome = Ok(());
        for secret in &self.secrets {
            outcome = signature::stripe(secret.expose(), header, &d.body, now, tolerance);
            if !matches!(outcome, Err(SignatureError::Mismatch(_))) {
                break;
            }
        }
        outcome
    }
}

pub(super) struct Format;

pub(super) static FORMAT: Format = Format;

impl EventFormat for Format {
    fn name(&self) -> GatewayName {
        GatewayName::Stripe
    }

    fn signature_headers(&self) -> &'static [&'static str] {
        &["stripe-signature"]
    }

    /// The id is in the signed body.
    fn event_id(&self, _: &Delivery, json: &Value) -> Result<String, &'static str> {
        json.get("id")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or("the body has no string \"id\"")
    }

    fn seller_id(&self, json: &Value) -> Option<String> {
        text(json.pointer("/data/object/metadata/seller_id"))
    }

    fn account(&self, json: &Value) -> Option<String> {
        text(json.get("account"))
    }

    fn interpret(&self, body: &[u8]) -> Result<Interpretation, EventError> {
        events::interpret(body)
    }

    /// Direct charges: the money lands on the seller's connected account.
    fn settles_through_platform(&self) -> bool {
        false
    }

    fn charges_on_seller_account(&self) -> bool {
        true
    }

    fn event_sources(&self) -> &'static [GatewayName] {
        &[GatewayName::Stripe]
    }
}
