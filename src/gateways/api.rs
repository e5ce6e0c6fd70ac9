//! One interface for every gateway: create a payment session (the payment link), read a
//! payment's state, refund, and map the gateway's statuses to ours (an unknown status maps to a
//! safe default, pending, and is logged). A registry picks implementations by name; registering
//! a name twice is an error.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::{DisputeStatus, GatewayName, PaymentStatus};
use crate::money::Money;

pub type GatewayFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, GatewayError>> + Send + 'a>>;

/// Many sessions' creation: each its own outcome, in the order asked.
pub type SessionsFuture<'a> =
    Pin<Box<dyn Future<Output = Vec<Result<Session, GatewayError>>> + Send + 'a>>;

/// A payment session to create for one order.
#[derive(Debug, Clone)]
pub struct SessionRequest {
    pub order_number: i64,
    pub attempt: i32,
    pub amount: Money,
    /// The platform's commission (Stripe Connect takes it on the charge).
    pub platform_fee: Money,
    /// The seller's Stripe Connect account, for direct charges.
    pub seller_account: Option<String>,
    pub description: String,
    /// A subscription's billing interval (`day`, `week`, `month`, `year`).
    pub recurring_interval: Option<String>,
    /// What each period after the first charges, where it differs from `amount` (a coupon
    /// discounts a subscription's first period only).
    pub recurring_amount: Option<Money>,
    /// With `recurring_amount`: the platform's commission on each later period.
    pub recurring_fee: Option<Money>,
    /// Carried with the session (the seller, the split) and back in the gateway's events.
    pub metadata: BTreeMap<String, String>,
    /// The same key for the same order and attempt: a repeated request creates nothing new.
    /// Unique across installations.
    pub idempotency_key: String,
    /// Names the session where a gateway wants our own reference (Mercado Pago).
    pub reference: String,
    /// When the order stops waiting: a gateway that can, stops taking payment then. The
    /// order's expiry at the first asking, at every retry too (a reopened order's has moved on,
    /// and a retry under the same idempotency key must ask the same).
    pub expires_at: chrono::DateTime<chrono::Utc>,
    /// When the payment side first asked for this order attempt's session: the same at every
    /// retry, so a gateway that bounds an expiry by the session's creation (Stripe) asks the
    /// same thing again under the same idempotency key.
    pub first_asked_at: chrono::DateTime<chrono::Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub session_id: String,
    pub url: String,
}

/// What the gateway says about a session's payment now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentState {
    pub status: PaymentStatus,
    pub payment_id: Option<String>,
    pub amount: Option<Money>,
    /// The gateway's subscription the payment started, where the gateway bills it from then on
    /// (a Stripe Checkout Session in subscription mode): what its renewals and cancellation
    /// will name, recorded as its webhook's `Fact::Subscribed` would be.
    pub subscription: Option<String>,
}

/// The payment that paid an invoice a gateway billed for a subscription, as its API tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvoicePayment {
    /// The gateway's id of the payment (Stripe's PaymentIntent): what its refunds and disputes
    /// name.
    pub payment_id: String,
    /// The platform's commission the gateway took on it, when it says.
    pub fee: Option<Money>,
}

/// An event the gateway could not deliver to our webhook endpoint, as its API lists it: the
/// same object a webhook carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UndeliveredEvent {
    pub event_id: String,
    pub event_type: String,
    /// The event object, as JSON (what a webhook's body would hold).
    pub body: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct RefundRequest {
    pub session_id: String,
    pub payment_id: String,
    pub amount: Money,
    pub seller_account: Option<String>,
    /// The same key for the same refund: asking twice refunds once.
    pub idempotency_key: String,
}

/// A refund the gateway took, to ask about.
#[derive(Debug, Clone)]
pub struct RefundQuery {
    pub session_id: String,
    pub payment_id: String,
    pub refund_id: String,
    pub seller_account: Option<String>,
}

/// A dispute whose decision never reached us, to ask about.
#[derive(Debug, Clone)]
pub struct DisputeQuery {
    pub session_id: String,
    pub payment_id: String,
    pub dispute_id: String,
    pub seller_account: Option<String>,
}

/// Where a refund the gateway took stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundOutcome {
    /// Still under way (also every status we do not know).
    Pending,
    Succeeded,
    Failed,
    Canceled,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundReceipt {
    pub refund_id: String,
    /// Done (`true`) or accepted and still processing.
    pub succeeded: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("{gateway} is not reachable")]
    Unreachable {
        gateway: GatewayName,
        #[source]
        source: reqwest::Error,
    },
    #[error("{gateway} answered {status}: {message}")]
    Api {
        gateway: GatewayName,
        status: u16,
        code: Option<String>,
        message: String,
    },
    #[error("{gateway}'s answer does not read as documented")]
    Decode {
        gateway: GatewayName,
        #[source]
        source: serde_json::Error,
    },
    /// A request this gateway cannot take (a seller without a Stripe account, an amount too
    /// large for minor units, a refund beyond the payment, an unknown session).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The database error of a statement that wrote many sessions, which each shares.
    #[error(transparent)]
    SharedDatabase(Arc<sqlx::Error>),
}

impl GatewayError {
    /// Asking again later may work: the network, a rate limit, the gateway's own trouble, a
    /// concurrent request with the same idempotency key, an outage of our database.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unreachable { .. } => true,
            Self::Api { status, .. } => *status == 409 || *status == 429 || *status >= 500,
            Self::Decode { .. } | Self::Refused(_) => false,
            Self::Database(e) => crate::db::is_transient(e),
            Self::SharedDatabase(e) => crate::db::is_transient(e),
        }
    }

    /// Our own database's error, met while talking to the gateway: never the gateway's refusal,
    /// and its text (constraint names, the server's words) is for the log, not for the caller.
    pub fn is_ours(&self) -> bool {
        matches!(self, Self::Database(_) | Self::SharedDatabase(_))
    }

    /// The gateway did not take the platform's own part of the request: it refused our
    /// credentials (401, 403: a key revoked or rotated, or without access to the account asked
    /// about), or answered what we cannot read. Neither is the caller's to mend, and the
    /// gateway's words (a key's last characters, an account id) are for the log, not for the
    /// caller.
    pub fn is_the_platforms(&self) -> bool {
        matches!(
            self,
            Self::Api {
                status: 401 | 403,
                ..
            } | Self::Decode { .. }
        )
    }

    /// The gateway refused the request outright (a 4xx of its own, not a conflict over the
    /// idempotency key nor a rate limit): nothing was done, whatever was asked. Not an answer
    /// we could not read, nor our own refusal after the request: either may hide what the
    /// gateway did.
    pub fn refused_outright(&self) -> bool {
        match self {
            Self::Api { status, code, .. } => {
                (400..500).contains(status)
                    && !matches!(status, 409 | 429)
                    && code.as_deref() != Some("idempotency_error")
            }
            _ => false,
        }
    }

    /// A short machine-readable code.
    pub fn code(&self) -> &str {
        match self {
            Self::Unreachable { .. } => "gateway_unreachable",
            Self::Api { code: Some(c), .. } => c,
            Self::Api { .. } => "gateway_error",
            Self::Decode { .. } => "gateway_answer_unreadable",
            Self::Refused(_) => "gateway_refused",
            Self::Database(_) | Self::SharedDatabase(_) => "unavailable",
        }
    }
}

/// A payment gateway.
pub trait PaymentGateway: Send + Sync {
    fn name(&self) -> GatewayName;
    /// Creates (or, for the same idempotency key, finds) the session an order is paid through.
    fn create_session<'a>(&'a self, request: &'a SessionRequest) -> GatewayFuture<'a, Session>;
    /// Creates the sessions of many orders: each as [`Self::create_session`] would, answered in
    /// the order asked. An outside gateway is asked about each at once; one that keeps its
    /// sessions in our database (the internal gateway) writes them in one statement.
    fn create_sessions<'a>(&'a self, requests: &'a [SessionRequest]) -> SessionsFuture<'a> {
        Box::pin(futures_util::future::join_all(
            requests.iter().map(|r| self.create_session(r)),
        ))
    }
    /// Whether its sessions are rows in our database, made by an insert that gives the session
    /// made before for the same order and attempt: asking it again costs what looking for the
    /// session first would, so the payment side does not look first.
    fn sessions_are_ours(&self) -> bool {
        false
    }
    /// The state of a session's payment, asked of the gateway now.
    fn status<'a>(
        &'a self,
        session_id: &'a str,
        seller_account: Option<&'a str>,
    ) -> GatewayFuture<'a, PaymentState>;
    fn refund<'a>(&'a self, request: &'a RefundRequest) -> GatewayFuture<'a, RefundReceipt>;
    /// Where a refund it took stands now (a refund answered as accepted, whose outcome never
    /// arrived).
    fn refund_status<'a>(&'a self, query: &'a RefundQuery) -> GatewayFuture<'a, RefundOutcome>;
    /// Where a dispute stands now (one open long, whose decision's event may have been lost).
    /// `None`: the gateway keeps no such dispute to ask about, or names a status we do not know.
    fn dispute_status<'a>(
        &'a self,
        query: &'a DisputeQuery,
    ) -> GatewayFuture<'a, Option<DisputeStatus>>;
    /// Events created since `since` whose delivery to our endpoint has not succeeded (Stripe's
    /// events list with `delivery_success=false`), on the seller's account when given. `None`:
    /// the gateway keeps no such list (nothing was asked); reconciliation asks it about each
    /// session instead. Pages of a long list are asked `pace` apart (the gateway's rate limit).
    fn undelivered_events<'a>(
        &'a self,
        _since: chrono::DateTime<chrono::Utc>,
        _seller_account: Option<&'a str>,
        _pace: std::time::Duration,
    ) -> GatewayFuture<'a, Option<Vec<UndeliveredEvent>>> {
        Box::pin(async { Ok(None) })
    }
    /// The payment that paid `invoice`, an invoice it billed for a subscription, on the
    /// seller's account when given: asked when the invoice's event does not name it (Stripe's
    /// API versions since 2025-03-31 write no `payment_intent` or `application_fee_amount` on
    /// an Invoice). `None`: the gateway bills no invoices, or names no paid payment of it.
    fn invoice_payment<'a>(
        &'a self,
        _invoice: &'a str,
        _seller_account: Option<&'a str>,
    ) -> GatewayFuture<'a, Option<InvoicePayment>> {
        Box::pin(async { Ok(None) })
    }
    /// Whether [`Self::period_charges`] asks the gateway (it keeps such a list).
    fn lists_period_charges(&self) -> bool {
        false
    }
    /// The charges its billing made for a subscription it bills (`subscription`: its id there)
    /// since `since`, on the seller's account when given: each paid or failed one as the
    /// webhook event that reports it, its id of its own, for the gateway named beside them
    /// (whose endpoint receives such events). Asked by reconciliation for a period that ended
    /// with nothing reported since: its renewal's event was lost. `None`: the gateway keeps no
    /// such list to ask.
    fn period_charges<'a>(
        &'a self,
        _subscription: &'a str,
        _seller_account: Option<&'a str>,
        _since: chrono::DateTime<chrono::Utc>,
    ) -> GatewayFuture<'a, Option<(GatewayName, Vec<UndeliveredEvent>)>> {
        Box::pin(async { Ok(None) })
    }
    /// Cancels a subscription it bills (`subscription`: its id there), now or at the end of
    /// the period paid, on the seller's account when given. Asking again changes nothing more:
    /// one that has ended there already answers [`SubscriptionEnd::AlreadyEnded`].
    fn cancel_subscription<'a>(
        &'a self,
        _subscription: &'a str,
        _seller_account: Option<&'a str>,
        _at_period_end: bool,
    ) -> GatewayFuture<'a, SubscriptionEnd> {
        let name = self.name();
        Box::pin(async move {
            Err(GatewayError::Refused(format!(
                "{name} bills no subscription payfleet can cancel"
            )))
        })
    }
    /// The gateway's payment status in our words; anything unknown is pending (moves no money)
    /// and is logged.
    fn map_status(&self, raw: &str) -> PaymentStatus;
}

/// What a gateway's cancellation of a subscription came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscriptionEnd {
    /// Cancelled as asked: now, or at the end of the period paid.
    AsAsked,
    /// It had ended there already (its end's event may never have come): it ends here now,
    /// whatever was asked.
    AlreadyEnded,
}

/// A cancellation's answer, a refusal (400, 404) checked against the subscription itself
/// (`ended`: whether the gateway has it, ended): gateways refuse to cancel what has ended
/// already (Stripe answers a deleted subscription as missing), and asking again must change
/// nothing rather than leave a job dead or an operator's cancel refused.
pub async fn end_checked<E, F>(
    asked: impl Future<Output = Result<(), GatewayError>>,
    ended: E,
) -> Result<SubscriptionEnd, GatewayError>
where
    E: FnOnce() -> F,
    F: Future<Output = Result<bool, GatewayError>>,
{
    match asked.await {
        Ok(()) => Ok(SubscriptionEnd::AsAsked),
        Err(
            refused @ GatewayError::Api {
                status: 400 | 404, ..
            },
        ) => match ended().await {
            Ok(true) => Ok(SubscriptionEnd::AlreadyEnded),
            Err(e) if e.is_transient() => Err(e),
            Ok(false) | Err(_) => Err(refused),
        },
        Err(e) => Err(e),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("gateway {0} is registered twice")]
pub struct DuplicateGateway(pub GatewayName);

/// The enabled gateways, by name.
#[derive(Clone, Default)]
pub struct GatewayRegistry {
    gateways: HashMap<GatewayName, Arc<dyn PaymentGateway>>,
}

impl std::fmt::Debug for GatewayRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl GatewayRegistry {
    pub fn register(&mut self, gateway: Arc<dyn PaymentGateway>) -> Result<(), DuplicateGateway> {
        let name = gateway.name();
        if self.gateways.contains_key(&name) {
            return Err(DuplicateGateway(name));
        }
        self.gateways.insert(name, gateway);
        Ok(())
    }

    pub fn get(&self, name: GatewayName) -> Option<Arc<dyn PaymentGateway>> {
        self.gateways.get(&name).cloned()
    }

    pub fn names(&self) -> Vec<GatewayName> {
        let mut names: Vec<GatewayName> = self.gateways.keys().copied().collect();
        names.sort_by_key(|g| g.as_str());
        names
    }
}

/// Implements [`PaymentGateway`] for a type with the inherent methods `gateway`, `create`,
/// `read`, `refund_payment`, `refund_state`, `dispute_state` and `map`: the trait's boxing in one
/// place.
macro_rules! payment_gateway {
    // With Stripe's list of undelivered events (`undelivered`), and subscriptions it bills and
    // cancels (`subscriptions`, an inherent `end_subscription`), their invoices' payments asked
    // of it (an inherent `invoice_paid_by`).
    ($ty:ty, undelivered, subscriptions) => {
        $crate::gateways::api::payment_gateway!(@impl $ty,
            fn undelivered_events<'a>(
                &'a self,
                since: chrono::DateTime<chrono::Utc>,
                seller_account: Option<&'a str>,
                pace: std::time::Duration,
            ) -> $crate::gateways::api::GatewayFuture<'a, Option<Vec<$crate::gateways::api::UndeliveredEvent>>> {
                Box::pin(self.undelivered(since, seller_account, pace))
            }

            fn invoice_payment<'a>(
                &'a self,
                invoice: &'a str,
                seller_account: Option<&'a str>,
            ) -> $crate::gateways::api::GatewayFuture<'a, Option<$crate::gateways::api::InvoicePayment>> {
                Box::pin(self.invoice_paid_by(invoice, seller_account))
            }

            $crate::gateways::api::payment_gateway!(@period_charges);

            $crate::gateways::api::payment_gateway!(@cancel);
        );
    };
    ($ty:ty, subscriptions) => {
        $crate::gateways::api::payment_gateway!(@impl $ty,
            $crate::gateways::api::payment_gateway!(@cancel);
        );
    };
    // Subscriptions it bills and cancels, and the charges of their periods listed (an inherent
    // `subscription_charges`).
    ($ty:ty, subscriptions, period_charges) => {
        $crate::gateways::api::payment_gateway!(@impl $ty,
            $crate::gateways::api::payment_gateway!(@cancel);
            $crate::gateways::api::payment_gateway!(@period_charges);
        );
    };
    ($ty:ty) => {
        $crate::gateways::api::payment_gateway!(@impl $ty,);
    };
    // Sessions kept in our database, many written at once (an inherent `create_many`).
    ($ty:ty, many_sessions) => {
        $crate::gateways::api::payment_gateway!(@impl $ty,
            fn create_sessions<'a>(
                &'a self,
                requests: &'a [$crate::gateways::api::SessionRequest],
            ) -> $crate::gateways::api::SessionsFuture<'a> {
                Box::pin(self.create_many(requests))
            }

            fn sessions_are_ours(&self) -> bool {
                true
            }
        );
    };
    (@period_charges) => {
        fn period_charges<'a>(
            &'a self,
            subscription: &'a str,
            seller_account: Option<&'a str>,
            since: chrono::DateTime<chrono::Utc>,
        ) -> $crate::gateways::api::GatewayFuture<
            'a,
            Option<($crate::gateways::GatewayName, Vec<$crate::gateways::api::UndeliveredEvent>)>,
        > {
            Box::pin(self.subscription_charges(subscription, seller_account, since))
        }

        fn lists_period_charges(&self) -> bool {
            true
        }
    };
    (@cancel) => {
        fn cancel_subscription<'a>(
            &'a self,
            subscription: &'a str,
            seller_account: Option<&'a str>,
            at_period_end: bool,
        ) -> $crate::gateways::api::GatewayFuture<'a, $crate::gateways::api::SubscriptionEnd> {
            Box::pin(self.end_subscription(subscription, seller_account, at_period_end))
        }
    };
    (@impl $ty:ty, $($extra:item)*) => {
        impl $crate::gateways::api::PaymentGateway for $ty {
            fn name(&self) -> $crate::gateways::GatewayName {
                self.gateway()
            }

            fn create_session<'a>(
                &'a self,
                request: &'a $crate::gateways::api::SessionRequest,
            ) -> $crate::gateways::api::GatewayFuture<'a, $crate::gateways::api::Session> {
                Box::pin(self.create(request))
            }

            fn status<'a>(
                &'a self,
                session_id: &'a str,
                seller_account: Option<&'a str>,
            ) -> $crate::gateways::api::GatewayFuture<'a, $crate::gateways::api::PaymentState> {
                Box::pin(self.read(session_id, seller_account))
            }

            fn refund<'a>(
                &'a self,
                request: &'a $crate::gateways::api::RefundRequest,
            ) -> $crate::gateways::api::GatewayFuture<'a, $crate::gateways::api::RefundReceipt>
            {
                Box::pin(self.refund_payment(request))
            }

            fn refund_status<'a>(
                &'a self,
                query: &'a $crate::gateways::api::RefundQuery,
            ) -> $crate::gateways::api::GatewayFuture<'a, $crate::gateways::api::RefundOutcome>
            {
                Box::pin(self.refund_state(query))
            }

            fn dispute_status<'a>(
                &'a self,
                query: &'a $crate::gateways::api::DisputeQuery,
            ) -> $crate::gateways::api::GatewayFuture<'a, Option<$crate::gateways::DisputeStatus>>
            {
                Box::pin(self.dispute_state(query))
            }

            fn map_status(&self, raw: &str) -> $crate::gateways::PaymentStatus {
                self.map(raw)
            }

            $($extra)*
        }
    };
}
pub(crate) use payment_gateway;

/// Logs a status a mapper did not know (the mapper then answers pending).
pub(crate) fn unknown_status(gateway: GatewayName, raw: &str) -> PaymentStatus {
    tracing::warn!(%gateway, status = raw, "unknown payment status; treated as pending");
    PaymentStatus::Pending
}

/// Reads a gateway's JSON answer, or its error.
pub(crate) async fn read_json<T: serde::de::DeserializeOwned>(
    gateway: GatewayName,
    response: Result<reqwest::Response, reqwest::Error>,
    error_message: impl Fn(&serde_json::Value) -> (Option<String>, Option<String>),
) -> Result<T, GatewayError> {
    let response = response.map_err(|source| GatewayError::Unreachable { gateway, source })?;
    let status = response.status();
    let bytes = response
        .bytes()
        .await
        .map_err(|source| GatewayError::Unreachable { gateway, source })?;
    if !status.is_success() {
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        let (code, message) = error_message(&body);
        return Err(GatewayError::Api {
            gateway,
            status: status.as_u16(),
            code,
            message: message
                .unwrap_or_else(|| status.canonical_reason().unwrap_or("an error").to_owned()),
        });
    }
    serde_json::from_slice(&bytes).map_err(|source| GatewayError::Decode { gateway, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(GatewayName);

    impl PaymentGateway for Fake {
        fn name(&self) -> GatewayName {
            self.0
        }
        fn create_session<'a>(&'a self, _: &'a SessionRequest) -> GatewayFuture<'a, Session> {
            Box::pin(async { Err(GatewayError::Refused("fake".into())) })
        }
        fn status<'a>(&'a self, _: &'a str, _: Option<&'a str>) -> GatewayFuture<'a, PaymentState> {
            Box::pin(async { Err(GatewayError::Refused("fake".into())) })
        }
        fn refund<'a>(&'a self, _: &'a RefundRequest) -> GatewayFuture<'a, RefundReceipt> {
            Box::pin(async { Err(GatewayError::Refused("fake".into())) })
        }
        fn refund_status<'a>(&'a self, _: &'a RefundQuery) -> GatewayFuture<'a, RefundOutcome> {
            Box::pin(async { Ok(RefundOutcome::Pending) })
        }
        fn dispute_status<'a>(
            &'a self,
            _: &'a DisputeQuery,
        ) -> GatewayFuture<'a, Option<DisputeStatus>> {
            Box::pin(async { Ok(None) })
        }
        fn map_status(&self, raw: &str) -> PaymentStatus {
            unknown_status(self.0, raw)
        }
    }

    #[test]
    fn a_name_is_registered_once() {
        let mut registry = GatewayRegistry::default();
        registry
            .register(Arc::new(Fake(GatewayName::Mock)))
            .unwrap();
        registry
            .register(Arc::new(Fake(GatewayName::Stripe)))
            .unwrap();
        assert_eq!(
            registry
                .register(Arc::new(Fake(GatewayName::Mock)))
                .unwrap_err(),
            DuplicateGateway(GatewayName::Mock)
        );
        assert_eq!(
            registry.names(),
            vec![GatewayName::Mock, GatewayName::Stripe]
        );
        assert!(registry.get(GatewayName::Razorpay).is_none());
    }
}
