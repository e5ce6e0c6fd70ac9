//! The gateways. One folder per gateway holds all payfleet knows of it: how its webhooks are
//! signed (`signature`), what its events mean (`events`), its API client (`client`), its
//! settings, and its [`EventFormat`] (what the receiver and event processing ask of it). The
//! rest of the fleet reaches a gateway only through the three traits here and in `api`:
//! - [`EventFormat`]: a delivery's event id, type and seller, its events' facts, and how its
//!   money flows; one per gateway, found by name with [`format`] (the one place that names
//!   them all);
//! - [`SignatureCheck`]: a delivery's signature, with the secrets its settings hold;
//! - [`api::PaymentGateway`]: sessions, statuses, refunds, disputes, missed events, held by
//!   name in [`GatewayRegistry`].
//!
//! Every mapper has a safe default: a status we do not know moves no money.
//! - `stripe`       Stripe Connect direct charges, and the internal gateway's acquirer
//! - `mercadopago`  Mercado Pago (unsigned bodies: the payment is read from its API)
//! - `razorpay`     Razorpay (orders are the sessions)
//! - `hosted`       payfleet's own gateways, `internal` and `mock` (Standard Webhooks)

pub mod api;
pub mod hosted;
pub mod mercadopago;
pub mod razorpay;
pub mod signature;
pub mod stripe;

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use serde::Serialize;
use sqlx::PgPool;

use crate::env::{Env, Invalid};
use crate::money::{Money, MoneyError};
use signature::SignatureError;

pub use api::{GatewayError, GatewayRegistry, PaymentGateway};
pub use mercadopago::{MercadoPagoClient, MercadoPagoError};
pub use razorpay::RazorpayGateway;
pub use stripe::StripeConnect;

payfleet_queue::text_enum! {
    /// The gateways payfleet speaks to, by the name used in URLs, configuration and storage.
    pub enum GatewayName {
        Stripe = "stripe",
        MercadoPago = "mercadopago",
        Razorpay = "razorpay",
        Internal = "internal",
        Mock = "mock",
    }
}

/// Gateways' names for a message: `joined(&[Stripe, Razorpay], " and ")` is "stripe and razorpay".
pub fn joined(gateways: &[GatewayName], separator: &str) -> String {
    gateways
        .iter()
        .map(|g| g.as_str())
        .collect::<Vec<_>>()
        .join(separator)
}

/// What a gateway says about a payment attempt, in our words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PaymentStatus {
    /// Not settled either way (also every status we do not know).
    Pending,
    Succeeded,
    Failed,
}

payfleet_queue::text_enum! {
    /// Where a dispute stands. It moves once, from `open` to one of the decided states, and
    /// never back: a late "created" or an unknown status cannot reopen it.
    pub enum DisputeStatus {
        /// Not decided: the disputed amount is held.
        Open = "open",
        /// Closed in the seller's favour (won, an inquiry closed, a chargeback prevented).
        Won = "won",
        /// Lost: a chargeback takes the amount back.
        Lost = "lost",
        /// Closed because the buyer was refunded: the refund facts carry the money. The dispute
        /// keeps taken only what the recorded refunds do not cover yet (its refund's event may
        /// come later, or never), so the money neither moves twice nor goes back to the seller
        /// before the refund is known (`ledger::sales::settle_take_backs`).
        Refunded = "refunded",
    }
}

impl DisputeStatus {
    pub fn is_decided(&self) -> bool {
        !matches!(self, Self::Open)
    }
}

/// One fact an event establishes. Facts are recorded once each (by their ids) and the payment's
/// status is derived from all of them, so arrival order does not matter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fact {
    Payment {
        status: PaymentStatus,
        amount: Option<Money>,
    },
    Refund {
        refund_id: String,
        amount: Money,
    },
    /// A dispute and its status as the gateway reports it. `None`: a status we do not know,
    /// which keeps the dispute's last known state (a new dispute starts open).
    Dispute {
        dispute_id: String,
        amount: Money,
        status: Option<DisputeStatus>,
    },
    /// A refund the gateway had taken, ended without moving money: failed, or canceled. Its
    /// request ends so, and its amount may be refunded again.
    RefundEnded {
        refund_id: String,
        canceled: bool,
    },
    /// The decision of a dispute that may or may not have been opened: it decides an open one
    /// and does nothing otherwise (Mercado Pago reports `approved` after a mediation was won,
    /// and also for payments that were never disputed).
    DisputeDecided {
        dispute_id: String,
        status: DisputeStatus,
    },
    /// The payment started a subscription the gateway bills from now on (Stripe's Checkout
    /// Session in subscription mode): the gateway's id of it, which its renewals name.
    Subscribed {
        subscription: String,
    },
}

/// What a notification that only names a resource names (Mercado Pago's topics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupResource {
    Payment,
    /// A payment read again for a dispute of it still open here (reconciliation): a decision
    /// it shows counts, even the "won" every approved preapproval charge shows.
    DisputedPayment,
    /// A preapproval's (subscription's) charge for one period.
    AuthorizedPayment,
    /// A preapproval (subscription).
    Preapproval,
}

/// A gateway-billed subscription's charge, as the gateway reports it. Its payment's facts go
/// with it (`Interpretation::Renewal`); the renewal order of its period is what they apply to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Renewal {
    /// The gateway's id of the subscription.
    pub subscription: String,
    /// The session of the subscription's first payment, where the event names it (a reference
    /// only the platform sets); otherwise the subscription is found by its id, recorded from
    /// its first payment's event ([`Fact::Subscribed`]).
    pub first_session: Option<String>,
    /// The period it pays. `None`: the first period, which the checkout's own payment pays (a
    /// Stripe invoice billed when the subscription was created): the facts are that payment's.
    pub period: Option<Period>,
    /// The platform's commission on it, where the gateway took one (Stripe's application fee).
    pub fee: Option<Money>,
    /// Where the buyer can see or pay it, if the gateway has such a page.
    pub url: Option<String>,
    /// What the period's charge asks for, where the gateway says it with a failure (Stripe's
    /// `amount_due`): the renewal order a failure opens costs that, so the gateway's retry
    /// that succeeds pays exactly its order (a coupon, a proration or a price change makes it
    /// differ from the subscription's own charge).
    pub due: Option<Money>,
}

/// A subscription period, as a gateway bills it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub start: chrono::DateTime<chrono::Utc>,
    /// `None`: one interval of the subscription from `start` (a gateway that reports only the
    /// charge's date).
    pub end: Option<chrono::DateTime<chrono::Utc>>,
}

/// A change the gateway made to a subscription it bills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscriptionChange {
    /// Ended there (canceled, or its dunning gave up): nothing is charged after it.
    Canceled,
    /// It ends at its current period's end (`true`), or no longer does.
    CancelAtPeriodEnd(bool),
}

/// Which payment an event is about: the gateway session (our key for it) and/or the gateway's
/// payment id. At least one is present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentRef {
    pub session_id: Option<String>,
    pub payment_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interpretation {
    Update {
        payment: PaymentRef,
        facts: Vec<Fact>,
    },
    /// The event is signed but says nothing we act on; the reason is recorded.
    Ignore(String),
    /// The event only names a resource; its state must be fetched from the gateway
    /// (Mercado Pago does not sign the body).
    Lookup {
        resource: LookupResource,
        resource_id: String,
    },
    /// A subscription's charge: the renewal order of its period, opened once, takes the facts
    /// of `payment` (the renewal's own session: Stripe's invoice, ...).
    Renewal {
        renewal: Renewal,
        payment: PaymentRef,
        facts: Vec<Fact>,
    },
    /// The gateway changed a subscription it bills (`subscription`: its id there).
    Subscription {
        subscription: String,
        first_session: Option<String>,
        change: SubscriptionChange,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error("the event body is not the JSON the gateway documents")]
    Json(#[from] serde_json::Error),
    #[error("the event has no {0}")]
    Missing(&'static str),
    #[error("the event carries a bad amount")]
    Money(#[from] MoneyError),
}

/// An HTTP client for a gateway's API: TLS by the process's provider, a bounded wait.
pub(crate) fn http_client(timeout: std::time::Duration) -> Result<reqwest::Client, reqwest::Error> {
    crate::tls::install_provider();
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout.min(std::time::Duration::from_secs(5)))
        .build()
}

/// What a webhook delivery carries, owned, so it can be verified on another thread.
pub struct Delivery {
    pub gateway: GatewayName,
    pub headers: HeaderMap,
    pub query: HashMap<String, String>,
    pub body: Bytes,
}

impl Delivery {
    /// A header's value, if it is text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// A query parameter's value.
    pub fn query(&self, name: &str) -> Option<&str> {
        self.query.get(name).map(String::as_str)
    }
}

/// How one gateway's deliveries and events read. Nothing here needs a secret: a delivery is
/// read only after its [`SignatureCheck`] passed, and stored events are read again by event
/// processing whatever the receiver's settings are now.
pub trait EventFormat: Send + Sync {
    fn name(&self) -> GatewayName;

    /// The headers that carry a delivery's signature and identity, kept with the event.
    fn signature_headers(&self) -> &'static [&'static str];

    /// The query parameters a delivery's signature covers, kept with the event.
    fn signed_query(&self) -> &'static [&'static str] {
        &[]
    }

    /// The event's id, from what the signature covers (the body, or a signed header or query
    /// parameter). `Err`: why the delivery cannot be named.
    fn event_id(
        &self,
        delivery: &Delivery,
        json: &serde_json::Value,
    ) -> Result<String, &'static str>;

    /// The body's field that names the event's type.
    fn type_field(&self) -> &'static str {
        "type"
    }

    /// The event's type, as the gateway names it, for the event log.
    fn event_type(&self, json: &serde_json::Value) -> Option<String> {
        json.get(self.type_field())?.as_str().map(str::to_owned)
    }

    /// Our seller's id, where the payment carries the metadata our payment links give it.
    fn seller_id(&self, json: &serde_json::Value) -> Option<String>;

    /// The gateway account the event was sent for (a Stripe connected account, ...).
    fn account(&self, json: &serde_json::Value) -> Option<String> {
        let _ = json;
        None
    }

    /// What a verified event body establishes.
    fn interpret(&self, body: &[u8]) -> Result<Interpretation, EventError>;

    /// Whether its payments' money reaches the platform (which then owes the seller), or goes
    /// straight to the seller.
    fn settles_through_platform(&self) -> bool;

    /// Whether it charges on the seller's own account, which a checkout must then know.
    fn charges_on_seller_account(&self) -> bool {
        false
    }

    /// Whether a dispute's state is its payment's state, read whole from the gateway (a
    /// reconciled dispute is then a lookup of the payment).
    fn disputes_are_payment_state(&self) -> bool {
        false
    }

    /// Whether one session takes several payment attempts, so a failed one may be followed by
    /// one that succeeds (a Mercado Pago preference, a Razorpay order); elsewhere a session's
    /// failure is its end (the internal gateway decides a session once, a Stripe Checkout
    /// Session's failure event is its expiry or its asynchronous payment's failure).
    fn attempts_per_session(&self) -> bool {
        false
    }

    /// The gateways whose events may carry facts about this gateway's payments: its own, and
    /// those that may acquire for it.
    fn event_sources(&self) -> &'static [GatewayName];

    /// Whom an event is for, as far as its signed body says: the seller's own account where the
    /// gateway charges on it and names it (`<gateway>:<account>`: a Stripe connected account),
    /// else our seller id (`seller:<id>`), else the gateway account (`<gateway>:<account>`).
    /// Used only as the processing job's fairness key, so one seller's flood of events cannot
    /// hold up another seller's payment; nothing is decided by it. A seller's own account comes
    /// first because a connected seller writes the metadata on its own objects: a seller id read
    /// there would let one seller queue its flood in another's group, or spread it over as many
    /// groups as it likes. A key longer than the queue takes is cut (on a character boundary):
    /// it only groups.
    fn seller_hint(&self, json: &serde_json::Value) -> Option<String> {
        let account = self.account(json);
        let hint = match (
            self.charges_on_seller_account(),
            account,
            self.seller_id(json),
        ) {
            (true, Some(account), _) | (false, Some(account), None) => {
                format!("{}:{account}", self.name())
            }
            (_, _, Some(seller)) => format!("seller:{seller}"),
            (_, None, None) => return None,
        };
        let mut end = hint.len().min(payfleet_queue::MAX_FAIRNESS_KEY);
        while !hint.is_char_boundary(end) {
            end -= 1;
        }
        Some(hint[..end].to_owned())
    }
}

/// The gateways whose sales the ledger credits to the seller (the money reached the platform):
/// their names, as the tables keep them.
pub fn through_platform() -> Vec<&'static str> {
    GatewayName::ALL
        .iter()
        .filter(|g| format(**g).settles_through_platform())
        .map(|g| g.as_str())
        .collect()
}

/// The event format of a gateway. The one place that names every gateway.
pub fn format(gateway: GatewayName) -> &'static dyn EventFormat {
    match gateway {
        GatewayName::Stripe => &stripe::FORMAT,
        GatewayName::MercadoPago => &mercadopago::FORMAT,
        GatewayName::Razorpay => &razorpay::FORMAT,
        GatewayName::Internal => &hosted::INTERNAL,
        GatewayName::Mock => &hosted::MOCK,
    }
}

/// Reads a verified event body of `gateway`'s.
pub fn interpret(gateway: GatewayName, body: &[u8]) -> Result<Interpretation, EventError> {
    format(gateway).interpret(body)
}

/// Checks a delivery's signature with the secrets one gateway's settings hold.
pub trait SignatureCheck: Send + Sync {
    fn gateway(&self) -> GatewayName;
    /// `now` and `tolerance` in seconds: a signed timestamp further from now is refused.
    fn verify(&self, delivery: &Delivery, now: i64, tolerance: i64) -> Result<(), SignatureError>;
}

/// The signature checks of the gateways whose webhook secret is configured, by name. A gateway
/// without one is disabled.
#[derive(Clone, Default)]
pub struct SignatureChecks(HashMap<GatewayName, Arc<dyn SignatureCheck>>);

impl std::fmt::Debug for SignatureChecks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.enabled()).finish()
    }
}

impl SignatureChecks {
    fn add(&mut self, check: Option<Arc<dyn SignatureCheck>>) {
        if let Some(c) = check {
            self.0.insert(c.gateway(), c);
        }
    }

    pub fn get(&self, gateway: GatewayName) -> Option<&dyn SignatureCheck> {
        self.0.get(&gateway).map(|c| c.as_ref())
    }

    /// The enabled gateways, in a stable order.
    pub fn enabled(&self) -> Vec<GatewayName> {
        GatewayName::ALL
            .iter()
            .copied()
            .filter(|g| self.0.contains_key(g))
            .collect()
    }
}

/// Every gateway's settings, each read by its own folder.
#[derive(Debug, Clone)]
pub struct Settings {
    pub stripe: stripe::Settings,
    pub mercadopago: mercadopago::Settings,
    pub razorpay: razorpay::Settings,
    pub hosted: hosted::Settings,
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// Settings that are each valid but unsafe or useless together.
    #[error("{0}")]
    Conflict(String),
    #[error("cannot build the {gateway} client")]
    Client {
        gateway: GatewayName,
        #[source]
        source: reqwest::Error,
    },
    #[error(transparent)]
    Duplicate(#[from] api::DuplicateGateway),
}

impl Settings {
    /// `public_url`: where buyers reach this receiver (payment pages, the pages gateways send
    /// them back to, the hosted gateways' webhook endpoints by default).
    pub fn from_env(env: &dyn Env, public_url: &str) -> Result<Self, Invalid> {
        Ok(Self {
            stripe: stripe::Settings::from_env(env)?,
            mercadopago: mercadopago::Settings::from_env(env)?,
            razorpay: razorpay::Settings::from_env(env)?,
            hosted: hosted::Settings::from_env(env, public_url)?,
        })
    }

    /// The signature checks of the gateways whose webhook secret is configured.
    pub fn signature_checks(&self) -> SignatureChecks {
        let mut checks = SignatureChecks::default();
        checks.add(self.stripe.signature_check());
        checks.add(self.mercadopago.signature_check());
        checks.add(self.razorpay.signature_check());
        for check in self.hosted.signature_checks() {
            checks.add(Some(check));
        }
        checks
    }

    /// The gateway that collects the internal gateway's payments, where it is not simulated.
    pub fn internal_acquirer(&self) -> Option<GatewayName> {
        self.hosted.acquirer()
    }

    /// The gateways configured here through which money is real: every outside gateway whose
    /// events are received, and the internal gateway's acquirer.
    pub fn real_money(&self) -> Vec<GatewayName> {
        let mut real: Vec<GatewayName> = self
            .signature_checks()
            .enabled()
            .into_iter()
            .filter(|g| !matches!(g, GatewayName::Internal | GatewayName::Mock))
            .collect();
        if let Some(acquirer) = self.internal_acquirer()
            && !real.contains(&acquirer)
        {
            real.push(acquirer);
        }
        real
    }

    /// The outside gateways whose links, made here, carry the public URL: Stripe's return pages
    /// (Connect, or as the internal gateway's acquirer) and Razorpay's callback, each where its
    /// API credentials are set. Mercado Pago's links carry none.
    pub fn links_with_public_url(&self) -> Vec<GatewayName> {
        let mut linking = Vec::new();
        if self.stripe.api.is_some() {
            linking.push(GatewayName::Stripe);
        }
        if self.razorpay.api.is_some() {
            linking.push(GatewayName::Razorpay);
        }
        linking
    }

    /// The gateways whose API credentials here are live ones, by the gateway's own prefixes:
    /// Stripe's `sk_live_` and `rk_live_`, Razorpay's `rzp_live_`, Mercado Pago's production
    /// `APP_USR-` (its sandbox's are `TEST-`). Their money is real.
    pub fn live(&self) -> Vec<GatewayName> {
        let mut live = Vec::new();
        if let Some(api) = &self.stripe.api {
            let key = api.secret_key.expose();
            if key.starts_with("sk_live_") || key.starts_with("rk_live_") {
                live.push(GatewayName::Stripe);
            }
        }
        if let Some(api) = &self.mercadopago.api
            && api.access_token.expose().starts_with("APP_USR-")
        {
            live.push(GatewayName::MercadoPago);
        }
        if let Some(api) = &self.razorpay.api
            && api.key_id.starts_with("rzp_live_")
        {
            live.push(GatewayName::Razorpay);
        }
        live
    }

    /// Refuses settings that are each valid but unsafe together: a simulated gateway where the
    /// payment simulator is off, or beside a gateway's live credentials; an internal-gateway
    /// secret beside a real acquirer.
    pub fn check(&self) -> Result<(), SettingsError> {
        self.hosted.check()?;
        // The simulator's pay button confirms orders no money paid: never where money is real.
        // Sandbox credentials beside it are a preview's, and allowed.
        let simulated = self.hosted.simulated();
        let live = self.live();
        if !simulated.is_empty() && !live.is_empty() {
            let names = |g: &[GatewayName]| joined(g, " and ");
            return Err(SettingsError::Conflict(format!(
                "the {} gateway's payments are simulated (a pay button that moves no money) and {} has live credentials here, so money is real: \
                 turn PAYFLEET_PAYMENT_SIMULATOR off and unset MOCK_WEBHOOK_SECRET and INTERNAL_WEBHOOK_SECRET (the internal gateway collects through Stripe with PAYFLEET_INTERNAL_ACQUIRER=stripe), \
                 or use the gateway's sandbox credentials",
                names(&simulated),
                names(&live)
            )));
        }
        if self.hosted.acquirer().is_some() && !self.stripe.receives_platform_events() {
            return Err(SettingsError::Conflict(
                "PAYFLEET_INTERNAL_ACQUIRER=stripe needs STRIPE_SECRET_KEY and the platform endpoint's signing secret (STRIPE_PLATFORM_WEBHOOK_SECRET, or STRIPE_WEBHOOK_SECRET): the platform account's events confirm its payments".into(),
            ));
        }
        Ok(())
    }

    /// The gateways buyers can pay through: a gateway is enabled when its webhook secret is
    /// configured (its events can be received) and, for an outside gateway, its API
    /// credentials. Also the hosted ones by themselves, for their payment pages; their events
    /// go to `sink`.
    pub fn clients(
        &self,
        pool: &PgPool,
        public_url: &str,
        sink: Arc<dyn hosted::EventSink>,
    ) -> Result<(GatewayRegistry, Vec<hosted::HostedGateway>), SettingsError> {
        self.check()?;
        let mut registry = GatewayRegistry::default();
        let hosted = self.hosted.gateways(pool, public_url, sink);
        for g in &hosted {
            registry.register(Arc::new(g.clone()))?;
        }
        let outside: [Option<Arc<dyn PaymentGateway>>; 4] = [
            self.stripe
                .acquirer_client(public_url, self.hosted.acquirer())?,
            self.stripe.client(public_url)?,
            self.mercadopago.client()?,
            self.razorpay.client(public_url)?,
        ];
        for g in outside.into_iter().flatten() {
            registry.register(g)?;
        }
        Ok((registry, hosted))
    }
}

/// A gateway's API base URL: https, except on this machine (a local stand-in), so that no
/// credential or payment travels in the clear.
fn api_url(env: &dyn Env, name: &'static str, default: &str) -> Result<String, Invalid> {
    let v = crate::env::var(env, name).unwrap_or_else(|| default.to_owned());
    let url =
        reqwest::Url::parse(&v).map_err(|e| crate::env::invalid(name, format!("{v:?}: {e}")))?;
    let loopback = url.host_str().is_some_and(|h| {
        h.eq_ignore_ascii_case("localhost")
            || h.trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    });
    match url.scheme() {
        "https" => {}
        "http" if loopback => {}
        "http" => {
            return Err(crate::env::invalid(
                name,
                "must be https (http only on loopback)",
            ));
        }
        _ => return Err(crate::env::invalid(name, "must start with https://")),
    }
    Ok(v.trim_end_matches('/').to_owned())
}

/// A JSON value as text: a non-empty string, or a number (ids some gateways send as numbers).
fn text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) if !s.is_empty() => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn ref_of(session_id: Option<&str>, payment_id: Option<&str>) -> Result<PaymentRef, EventError> {
    let clean = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_owned);
    let r = PaymentRef {
        session_id: clean(session_id),
        payment_id: clean(payment_id),
    };
    if r.session_id.is_none() && r.payment_id.is_none() {
        return Err(EventError::Missing("session or payment id"));
    }
    Ok(r)
}

#[cfg(test)]
mod format_tests {
    use super::*;

    #[test]
    fn every_gateway_reads_its_own_events_and_names_its_signature_headers() {
        for g in GatewayName::ALL {
            let f = format(*g);
            assert_eq!(f.name(), *g);
            assert!(f.event_sources().contains(g), "{g}");
            assert!(!f.signature_headers().is_empty(), "{g}");
        }
        // Where the money lands decides who owes the seller: only the platform's own
        // collections are the platform's debt.
        let through_platform: Vec<GatewayName> = GatewayName::ALL
            .iter()
            .copied()
            .filter(|g| format(*g).settles_through_platform())
            .collect();
        assert_eq!(
            through_platform,
            vec![
                GatewayName::Razorpay,
                GatewayName::Internal,
                GatewayName::Mock
            ]
        );
    }

    #[test]
    fn a_gateway_is_enabled_by_its_webhook_secret_alone() {
        let env = [
            ("RAZORPAY_WEBHOOK_SECRET", "rzp-webhook-secret-1"),
            (
                "MOCK_WEBHOOK_SECRET",
                "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
            ),
            ("STRIPE_SECRET_KEY", "sk_test_only_the_api"),
        ];
        let settings = Settings::from_env(&env, "http://127.0.0.1:8080").unwrap();
        assert_eq!(
            settings.signature_checks().enabled(),
            vec![GatewayName::Razorpay, GatewayName::Mock]
        );
        assert_eq!(
            settings.hosted.targets()[0].url,
            "http://127.0.0.1:8080/webhooks/mock"
        );
    }
}

#[cfg(test)]
mod seller_hint_tests {
    use super::{GatewayName, format};

    fn seller_hint(g: GatewayName, v: &serde_json::Value) -> Option<String> {
        format(g).seller_hint(v)
    }
    use serde_json::json;

    #[test]
    fn a_sellers_own_account_comes_first_then_our_seller_id_then_the_gateway_account() {
        // A connected account's events: the seller wrote the metadata, Stripe named the account.
        let stripe =
            json!({"account": "acct_1", "data": {"object": {"metadata": {"seller_id": "s-9"}}}});
        assert_eq!(
            seller_hint(GatewayName::Stripe, &stripe).as_deref(),
            Some("stripe:acct_1")
        );
        // The platform's own (no account): our metadata.
        let platform = json!({"data": {"object": {"metadata": {"seller_id": "s-9"}}}});
        assert_eq!(
            seller_hint(GatewayName::Stripe, &platform).as_deref(),
            Some("seller:s-9")
        );
        let connect = json!({"account": "acct_1", "data": {"object": {"metadata": {}}}});
        assert_eq!(
            seller_hint(GatewayName::Stripe, &connect).as_deref(),
            Some("stripe:acct_1")
        );
        let mp = json!({"action": "payment.updated", "user_id": 4711, "data": {"id": "1"}});
        assert_eq!(
            seller_hint(GatewayName::MercadoPago, &mp).as_deref(),
            Some("mercadopago:4711")
        );
        // The platform's Razorpay account collects for every seller: our notes say whose.
        let rzp = json!({"account_id": "acc_X", "payload": {"refund": {"entity": {"notes": {"seller_id": "s-2"}}}}});
        assert_eq!(
            seller_hint(GatewayName::Razorpay, &rzp).as_deref(),
            Some("seller:s-2")
        );
        // The order's notes (the platform's) over the payment's (the buyer's checkout may set
        // them).
        let rzp = json!({"account_id": "acc_X", "payload": {
            "payment": {"entity": {"notes": {"seller_id": "s-forged"}}},
            "order": {"entity": {"notes": {"seller_id": "s-2"}}}}});
        assert_eq!(
            seller_hint(GatewayName::Razorpay, &rzp).as_deref(),
            Some("seller:s-2")
        );
        let internal = json!({"type": "payment.succeeded", "data": {"seller_id": "s-3"}});
        assert_eq!(
            seller_hint(GatewayName::Internal, &internal).as_deref(),
            Some("seller:s-3")
        );
    }

    #[test]
    fn no_seller_and_no_account_is_no_key_and_a_long_one_is_cut() {
        assert_eq!(seller_hint(GatewayName::Mock, &json!({"data": {}})), None);
        assert_eq!(
            seller_hint(GatewayName::Stripe, &json!({"account": ""})),
            None
        );
        let long = json!({"data": {"seller_id": "é".repeat(300)}});
        let hint = seller_hint(GatewayName::Internal, &long).unwrap();
        assert!(hint.len() <= payfleet_queue::MAX_FAIRNESS_KEY && hint.starts_with("seller:é"));
    }
}
