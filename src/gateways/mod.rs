//! The gateways: their names, how each one's webhook events read, and how each one's statuses
//! map onto ours. Every mapper has a safe default: a status we do not know moves no money.

pub mod api;
pub mod hosted;
mod internal;
mod mercadopago;
mod razorpay;
mod stripe;
mod stripe_connect;

use serde::Serialize;

use crate::money::{Money, MoneyError};

pub use api::{GatewayError, GatewayRegistry, PaymentGateway};
pub use mercadopago::{MercadoPagoClient, MercadoPagoError};
pub use razorpay::{RazorpayGateway, event_identity as razorpay_event_identity};
pub use stripe_connect::StripeConnect;

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
        /// Closed because the buyer was refunded: the refund facts carry the money, so the
        /// dispute itself takes nothing back (that would move the money twice).
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

/// An HTTP client for a gateway's API: TLS by the process's provider, a bounded wait.
pub(crate) fn http_client(timeout: std::time::Duration) -> Result<reqwest::Client, reqwest::Error> {
    crate::tls::install_provider();
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout.min(std::time::Duration::from_secs(5)))
        .build()
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

/// Whom an event is for, as far as its signed body says: our seller id where the payment carries
/// the metadata our payment links give it (Stripe's `metadata`, Razorpay's `notes`, `seller_id`
/// in the data of our own gateways), else the gateway account it was sent for (a Stripe
/// connected account, Mercado Pago's `user_id`, Razorpay's `account_id`). Used only as the
/// processing job's fairness key, so one seller's flood of events cannot hold up another
/// seller's payment; nothing is decided by it.
pub fn seller_hint(gateway: GatewayName, v: &serde_json::Value) -> Option<String> {
    let text = |v: Option<&serde_json::Value>| match v? {
        serde_json::Value::String(s) if !s.is_empty() => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    let ours = match gateway {
        GatewayName::Stripe => text(v.pointer("/data/object/metadata/seller_id")),
        GatewayName::Razorpay => ["payment", "refund", "order", "dispute"]
            .iter()
            .find_map(|e| text(v.pointer(&format!("/payload/{e}/entity/notes/seller_id")))),
        GatewayName::Internal | GatewayName::Mock => text(v.pointer("/data/seller_id")),
        GatewayName::MercadoPago => None,
    };
    let hint = match ours {
        Some(seller) => format!("seller:{seller}"),
        None => {
            let account = match gateway {
                GatewayName::Stripe => text(v.get("account")),
                GatewayName::MercadoPago => text(v.get("user_id")),
                GatewayName::Razorpay => text(v.get("account_id")),
                GatewayName::Internal | GatewayName::Mock => None,
            }?;
            format!("{gateway}:{account}")
        }
    };
    // A key longer than the queue takes is cut (on a character boundary): it only groups.
    let mut end = hint.len().min(payfleet_queue::MAX_FAIRNESS_KEY);
    while !hint.is_char_boundary(end) {
        end -= 1;
    }
    Some(hint[..end].to_owned())
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

#[cfg(test)]
mod seller_hint_tests {
    use super::{GatewayName, seller_hint};
    use serde_json::json;

    #[test]
    fn our_seller_id_comes_first_then_the_gateway_account() {
        let stripe =
            json!({"account": "acct_1", "data": {"object": {"metadata": {"seller_id": "s-9"}}}});
        assert_eq!(
            seller_hint(GatewayName::Stripe, &stripe).as_deref(),
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
        let rzp = json!({"account_id": "acc_X", "payload": {"refund": {"entity": {"notes": {"seller_id": "s-2"}}}}});
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
