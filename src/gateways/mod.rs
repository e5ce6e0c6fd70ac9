//! The gateways: their names, how each one's webhook events read, and how each one's statuses
//! map onto ours. Every mapper has a safe default: a status we do not know moves no money.

mod internal;
mod mercadopago;
mod razorpay;
mod stripe;

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::money::{Money, MoneyError};

pub use mercadopago::{MercadoPagoClient, MercadoPagoError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GatewayName {
    Stripe,
    MercadoPago,
    Razorpay,
    Internal,
    Mock,
}

impl GatewayName {
    pub const ALL: [GatewayName; 5] = [
        Self::Stripe,
        Self::MercadoPago,
        Self::Razorpay,
        Self::Internal,
        Self::Mock,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Stripe => "stripe",
            Self::MercadoPago => "mercadopago",
            Self::Razorpay => "razorpay",
            Self::Internal => "internal",
            Self::Mock => "mock",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown gateway {0:?}")]
pub struct UnknownGateway(pub String);

impl FromStr for GatewayName {
    type Err = UnknownGateway;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|g| g.as_str() == s)
            .ok_or_else(|| UnknownGateway(s.to_owned()))
    }
}

impl fmt::Display for GatewayName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DisputeStatus {
    /// Also every dispute status we do not know: the money is held until it is decided.
    Open,
    Won,
    Lost,
}

impl DisputeStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Won => "won",
            Self::Lost => "lost",
        }
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
    Dispute {
        dispute_id: String,
        amount: Money,
        status: DisputeStatus,
    },
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
    Lookup { resource_id: String },
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

/// Reads a verified event body.
pub fn interpret(gateway: GatewayName, body: &[u8]) -> Result<Interpretation, EventError> {
    match gateway {
        GatewayName::Stripe => stripe::interpret(body),
        GatewayName::Razorpay => razorpay::interpret(body),
        GatewayName::Internal | GatewayName::Mock => internal::interpret(body),
        GatewayName::MercadoPago => mercadopago::interpret(body),
    }
}

/// The event's type, as the gateway names it, for the event log.
pub fn event_type(gateway: GatewayName, v: &serde_json::Value) -> Option<String> {
    let field = match gateway {
        GatewayName::Razorpay => "event",
        GatewayName::MercadoPago => "action",
        _ => "type",
    };
    v.get(field)?.as_str().map(str::to_owned)
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
