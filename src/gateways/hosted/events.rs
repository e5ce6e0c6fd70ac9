//! The internal gateway (and the mock, which speaks the same events): Standard Webhooks with
//! `{"type", "data": {"session_id", "payment_id", "amount", "currency", ...}}`.

use serde::Deserialize;

use crate::gateways::{
    DisputeStatus, EventError, Fact, Interpretation, PaymentStatus, SubscriptionChange, ref_of,
};
use crate::money::Money;

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
    data: Data,
}

#[derive(Deserialize)]
struct Data {
    session_id: Option<String>,
    payment_id: Option<String>,
    refund_id: Option<String>,
    dispute_id: Option<String>,
    /// The subscription a `subscription.canceled` ends: the fleet's own id, since the internal
    /// gateway bills the subscriptions kept here.
    subscription_id: Option<String>,
    amount: Option<String>,
    currency: Option<String>,
}

/// The renewal charges the gateway's own billing reports (with the subscription and period).
const RENEWALS: [&str; 2] = ["subscription.renewed", "subscription.renewal_failed"];

/// The status mapper: what a `payment.*` (or renewal) type means. Unknown ones are pending.
pub fn payment_status(kind: &str) -> PaymentStatus {
    match kind {
        "payment.succeeded" | "subscription.renewed" => PaymentStatus::Succeeded,
        "payment.failed" | "subscription.renewal_failed" => PaymentStatus::Failed,
        _ => PaymentStatus::Pending,
    }
}

/// What a `dispute.*` type means. An unknown one keeps the dispute's last known state.
pub fn dispute_status(kind: &str) -> Option<DisputeStatus> {
    match kind {
        "dispute.created" => Some(DisputeStatus::Open),
        "dispute.won" => Some(DisputeStatus::Won),
        "dispute.lost" => Some(DisputeStatus::Lost),
        "dispute.refunded" => Some(DisputeStatus::Refunded),
        other => {
            tracing::warn!(
                kind = other,
                "unknown internal dispute event; keeping the dispute's last known state"
            );
            None
        }
    }
}

pub fn interpret(body: &[u8]) -> Result<Interpretation, EventError> {
    let e: Event = serde_json::from_slice(body)?;
    let d = e.data;
    // Names a subscription, not a payment: ended there, so nothing is charged after it.
    if e.kind == "subscription.canceled" {
        return Ok(Interpretation::Subscription {
            subscription: d
                .subscription_id
                .ok_or(EventError::Missing("data.subscription_id"))?,
            first_session: None,
            change: SubscriptionChange::Canceled,
        });
    }
    let payment = ref_of(d.session_id.as_deref(), d.payment_id.as_deref())?;
    let money = || -> Result<Money, EventError> {
        let amount = d
            .amount
            .as_deref()
            .ok_or(EventError::Missing("data.amount"))?;
        let currency = d
            .currency
            .as_deref()
            .ok_or(EventError::Missing("data.currency"))?;
        Ok(Money::parse(amount, currency)?)
    };
    let fact = match e.kind.as_str() {
        // A renewal is a payment of its renewal order's session.
        k if k.starts_with("payment.") || RENEWALS.contains(&k) => {
            let status = payment_status(k);
            let amount = if d.amount.is_some() {
                Some(money()?)
            } else {
                None
            };
            Fact::Payment { status, amount }
        }
        "refund.succeeded" => Fact::Refund {
            refund_id: d
                .refund_id
                .clone()
                .ok_or(EventError::Missing("data.refund_id"))?,
            amount: money()?,
        },
        "refund.failed" | "refund.canceled" => match d.refund_id.clone() {
            Some(refund_id) => Fact::RefundEnded {
                refund_id,
                canceled: e.kind == "refund.canceled",
            },
            None => {
                return Ok(Interpretation::Ignore(format!(
                    "{} names no refund",
                    e.kind
                )));
            }
        },
        "refund.created" => {
            return Ok(Interpretation::Ignore(format!("{} moves no money", e.kind)));
        }
        k if k.starts_with("dispute.") => Fact::Dispute {
            dispute_id: d
                .dispute_id
                .clone()
                .ok_or(EventError::Missing("data.dispute_id"))?,
            amount: money()?,
            status: dispute_status(k),
        },
        other => {
            return Ok(Interpretation::Ignore(format!(
                "event type {other:?} is not acted on"
            )));
        }
    };
    Ok(Interpretation::Update {
        payment,
        facts: vec![fact],
    })
}
