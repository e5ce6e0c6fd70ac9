//! payfleet's own gateways, `internal` and `mock` (the same behaviour under two names): the
//! session, payment page state and refunds in our database (`client`: [`HostedGateway`]), the
//! Standard Webhooks scheme they sign with (`signature`), what their events mean (`events`),
//! and their settings: their secrets, where they deliver, whether their payments are simulated
//! and who collects the internal gateway's payments where they are not.

mod client;
pub mod events;
pub mod signature;

use std::sync::Arc;

use serde_json::Value;
use sqlx::PgPool;

pub use client::{
    EventSink, HostedGateway, HostedPayment, Outcome, RenewalCharge, event, is_session_id,
    mark_delivered, payment,
};

use super::signature::SignatureError;
use super::{
    Delivery, EventError, EventFormat, GatewayName, Interpretation, SettingsError, SignatureCheck,
    text,
};
use crate::env::{Env, Invalid, http_url, invalid, switch, var};
use crate::secret::StandardSecret;

payfleet_queue::text_enum! {
    /// Who collects the internal gateway's payments (the platform is merchant of record).
    pub enum InternalAcquirer {
        /// The pay/fail page: no money moves (development, tests, previews).
        Simulator = "simulator",
        /// Stripe Checkout Sessions on the platform's own Stripe account.
        Stripe = "stripe",
    }
}

/// One hosted gateway's delivery target: where its events go and what they are signed with.
#[derive(Debug, Clone)]
pub struct Target {
    pub gateway: GatewayName,
    pub url: String,
    pub secret: StandardSecret,
}

#[derive(Debug, Clone)]
pub struct Settings {
    /// `INTERNAL_WEBHOOK_SECRET`: enables the internal gateway.
    pub internal: Option<StandardSecret>,
    /// `MOCK_WEBHOOK_SECRET`: enables the mock.
    pub mock: Option<StandardSecret>,
    /// The internal and mock gateways' pay/fail page may run (`PAYFLEET_PAYMENT_SIMULATOR=on`):
    /// it moves no real money, so production never turns it on.
    pub simulator: bool,
    /// Who collects the internal gateway's payments: the simulator, or Stripe on the platform's
    /// own account (`PAYFLEET_INTERNAL_ACQUIRER`).
    pub internal_acquirer: InternalAcquirer,
    /// Where each delivers its events (`PAYFLEET_INTERNAL_WEBHOOK_URL`,
    /// `PAYFLEET_MOCK_WEBHOOK_URL`; by default this receiver's own endpoints).
    pub internal_webhook_url: String,
    pub mock_webhook_url: String,
}

fn standard_secret(env: &dyn Env, name: &'static str) -> Result<Option<StandardSecret>, Invalid> {
    var(env, name)
        .map(|v| StandardSecret::parse(&v).map_err(|problem| invalid(name, problem)))
        .transpose()
}

impl Settings {
    /// `public_url`: where buyers reach this receiver; the default delivery targets are its
    /// webhook endpoints.
    pub fn from_env(env: &dyn Env, public_url: &str) -> Result<Self, Invalid> {
        Ok(Self {
            internal: standard_secret(env, "INTERNAL_WEBHOOK_SECRET")?,
            mock: standard_secret(env, "MOCK_WEBHOOK_SECRET")?,
            simulator: switch(env, "PAYFLEET_PAYMENT_SIMULATOR")?,
            internal_acquirer: match var(env, "PAYFLEET_INTERNAL_ACQUIRER") {
                None => InternalAcquirer::Simulator,
                Some(v) => v.parse().map_err(|_| {
                    invalid(
                        "PAYFLEET_INTERNAL_ACQUIRER",
                        format!("{v:?}: simulator or stripe"),
                    )
                })?,
            },
            internal_webhook_url: http_url(
                env,
                "PAYFLEET_INTERNAL_WEBHOOK_URL",
                &format!("{public_url}/webhooks/internal"),
            )?,
            mock_webhook_url: http_url(
                env,
                "PAYFLEET_MOCK_WEBHOOK_URL",
                &format!("{public_url}/webhooks/mock"),
            )?,
        })
    }

    fn secrets(&self) -> [(GatewayName, Option<&StandardSecret>); 2] {
        [
            (GatewayName::Internal, self.internal.as_ref()),
            (GatewayName::Mock, self.mock.as_ref()),
        ]
    }

    pub(super) fn signature_checks(&self) -> Vec<Arc<dyn SignatureCheck>> {
        self.secrets()
            .into_iter()
            .filter_map(|(gateway, secret)| {
                let secret = secret?.clone();
                Some(Arc::new(Standard { gateway, secret }) as Arc<dyn SignatureCheck>)
            })
            .collect()
    }

    /// The gateway that collects the internal gateway's payments, where it is not simulated.
    pub fn acquirer(&self) -> Option<GatewayName> {
        match self.internal_acquirer {
            InternalAcquirer::Simulator => None,
            InternalAcquirer::Stripe => Some(GatewayName::Stripe),
        }
    }

    /// The enabled gateways whose payments are simulated (the pay/fail page: no money moves):
    /// the mock, and the internal gateway unless it collects through a real acquirer.
    pub fn simulated(&self) -> Vec<GatewayName> {
        self.secrets()
            .into_iter()
            .filter(|(gateway, secret)| {
                secret.is_some() && (*gateway == GatewayName::Mock || self.acquirer().is_none())
            })
            .map(|(gateway, _)| gateway)
            .collect()
    }

    /// A simulated gateway runs only where the payment simulator is on: a pay button that moves
    /// no money must never be reachable where money is real. And a real acquirer's payments are
    /// confirmed by its own signed events only.
    pub(super) fn check(&self) -> Result<(), SettingsError> {
        if let Some(acquirer) = self.acquirer()
            && self.internal.is_some()
        {
            // Its facts come from the acquirer alone: an internal-gateway webhook secret would
            // let events signed with it speak for real-money sessions no simulator ever made.
            return Err(SettingsError::Conflict(format!(
                "PAYFLEET_INTERNAL_ACQUIRER={acquirer} and INTERNAL_WEBHOOK_SECRET are both set: the internal gateway's payments are {acquirer}'s, confirmed by {acquirer}'s signed events only; unset INTERNAL_WEBHOOK_SECRET"
            )));
        }
        let simulated = self.simulated();
        if simulated.is_empty() {
            return Ok(());
        }
        let names = super::joined(&simulated, " and ");
        if !self.simulator {
            return Err(SettingsError::Conflict(format!(
                "the {names} gateway's payments are simulated (a pay/fail page, no money moves) and PAYFLEET_PAYMENT_SIMULATOR is off: \
                 set PAYFLEET_PAYMENT_SIMULATOR=on only where no money is real (development, tests, previews); \
                 in production unset MOCK_WEBHOOK_SECRET and have the internal gateway collect through Stripe (PAYFLEET_INTERNAL_ACQUIRER=stripe)"
            )));
        }
        Ok(())
    }

    /// The simulated gateways, for their payment pages and the registry.
    pub(super) fn gateways(
        &self,
        pool: &PgPool,
        public_url: &str,
        sink: Arc<dyn EventSink>,
    ) -> Vec<HostedGateway> {
        let simulated = self.simulated();
        self.secrets()
            .into_iter()
            .filter(|(gateway, _)| simulated.contains(gateway))
            .filter_map(|(gateway, secret)| {
                Some(HostedGateway::new(
                    gateway,
                    pool.clone(),
                    public_url,
                    sink.clone(),
                    secret?.derive_key("payment page form"),
                ))
            })
            .collect()
    }

    /// Where the hosted gateways deliver their events, and what they sign with.
    pub fn targets(&self) -> Vec<Target> {
        self.secrets()
            .into_iter()
            .filter_map(|(gateway, secret)| {
                let url = match gateway {
                    GatewayName::Mock => &self.mock_webhook_url,
                    _ => &self.internal_webhook_url,
                };
                Some(Target {
                    gateway,
                    url: url.clone(),
                    secret: secret?.clone(),
                })
            })
            .collect()
    }
}

/// Standard Webhooks, with one gateway's secret.
struct Standard {
    gateway: GatewayName,
    secret: StandardSecret,
}

impl SignatureCheck for Standard {
    fn gateway(&self) -> GatewayName {
        self.gateway
    }

    fn verify(&self, d: &Delivery, now: i64, tolerance: i64) -> Result<(), SignatureError> {
        signature::standard(
            &self.secret,
            d.header("webhook-id"),
            d.header("webhook-timestamp"),
            d.header("webhook-signature"),
            &d.body,
            now,
            tolerance,
        )
    }
}

/// The event format of one hosted gateway: the same events under its name.
pub(super) struct Format {
    name: GatewayName,
    sources: &'static [GatewayName],
}

/// The internal gateway's events. Its payments may also be Stripe's to report, when Stripe is
/// its acquirer (its events arrive through Stripe's webhook).
pub(super) static INTERNAL: Format = Format {
    name: GatewayName::Internal,
    sources: &[GatewayName::Internal, GatewayName::Stripe],
};

pub(super) static MOCK: Format = Format {
    name: GatewayName::Mock,
    sources: &[GatewayName::Mock],
};

impl EventFormat for Format {
    fn name(&self) -> GatewayName {
        self.name
    }

    fn signature_headers(&self) -> &'static [&'static str] {
        &["webhook-id", "webhook-timestamp", "webhook-signature"]
    }

    /// Standard Webhooks sign the id.
    fn event_id(&self, d: &Delivery, _: &Value) -> Result<String, &'static str> {
        d.header("webhook-id")
            .map(str::to_owned)
            .ok_or("missing webhook-id")
    }

    fn seller_id(&self, json: &Value) -> Option<String> {
        text(json.pointer("/data/seller_id"))
    }

    fn interpret(&self, body: &[u8]) -> Result<Interpretation, EventError> {
        events::interpret(body)
    }

    /// The platform is merchant of record: the whole amount lands in its account.
    fn settles_through_platform(&self) -> bool {
        true
    }

    fn event_sources(&self) -> &'static [GatewayName] {
        self.sources
    }
}
