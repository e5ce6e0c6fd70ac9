//! Stripe events (API objects in `data.object`, amounts in minor units, lower-case currency).
//! The session is the Checkout Session; refunds and disputes name the PaymentIntent.

use serde::Deserialize;
use serde_json::Value;

use crate::gateways::{DisputeStatus, EventError, Fact, Interpretation, PaymentStatus, ref_of};
use crate::money::Money;

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
    data: EventData,
}

#[derive(Deserialize)]
struct EventData {
    object: Value,
}

/// Checkout Session `payment_status`.
pub fn session_status(s: &str) -> PaymentStatus {
    match s {
        "paid" | "no_payment_required" => PaymentStatus::Succeeded,
        _ => PaymentStatus::Pending,
    }
}

/// PaymentIntent `status`.
pub fn intent_status(s: &str) -> PaymentStatus {
    match s {
        "succeeded" => PaymentStatus::Succeeded,
        "canceled" => PaymentStatus::Failed,
        _ => PaymentStatus::Pending,
    }
}

/// Dispute `status`. `warning_closed` (an inquiry that never became a chargeback) and
/// `prevented` (stopped before it was filed) end in the seller's favour; `charge_refunded`
/// closes it because the charge was refunded, which the refund events account for. A status
/// we do not know is `None`: the dispute keeps its last known state.
pub fn dispute_status(s: &str) -> Option<DisputeStatus> {
    match s {
        "warning_needs_response" | "warning_under_review" | "needs_response" | "under_review" => {
            Some(DisputeStatus::Open)
        }
        "won" | "warning_closed" | "prevented" => Some(DisputeStatus::Won),
        "lost" => Some(DisputeStatus::Lost),
        "charge_refunded" => Some(DisputeStatus::Refunded),
        other => {
            tracing::warn!(
                status = other,
                "unknown Stripe dispute status; keeping the dispute's last known state"
            );
            None
        }
    }
}

fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn money_at(v: &Value, amount_key: &'static str) -> Result<Money, EventError> {
    let units = v
        .get(amount_key)
        .and_then(Value::as_i64)
        .ok_or(EventError::Missing(amount_key))?;
    let currency = str_at(v, "currency").ok_or(EventError::Missing("currency"))?;
    Ok(Money::from_minor(units, currency)?)
}

pub fn interpret(body: &[u8]) -> Result<Interpretation, EventError> {
    let e: Event = serde_json::from_slice(body)?;
    let o = &e.data.object;
    let update = |session: Option<&str>,
                  payment: Option<&str>,
                  fact: Fact|
     -> Result<Interpretation, EventError> {
        Ok(Interpretation::Update {
            payment: ref_of(session, payment)?,
            facts: vec![fact],
        })
    };
    match e.kind.as_str() {
        "checkout.session.completed"
        | "checkout.session.async_payment_succeeded"
        | "checkout.session.async_payment_failed"
        | "checkout.session.expired" => {
            let status = match e.kind.as_str() {
                "checkout.session.async_payment_failed" | "checkout.session.expired" => {
                    PaymentStatus::Failed
                }
                _ => session_status(str_at(o, "payment_status").unwrap_or("")),
            };
            let id = str_at(o, "id").ok_or(EventError::Missing("data.object.id"))?;
            let amount = if o.get("amount_total").is_some_and(Value::is_i64) {
                Some(money_at(o, "amount_total")?)
            } else {
                None
            };
            update(
                Some(id),
                str_at(o, "payment_intent"),
                Fact::Payment { status, amount },
            )
        }
        "payment_intent.succeeded"
        | "payment_intent.payment_failed"
        | "payment_intent.canceled" => {
            let status = match e.kind.as_str() {
                "payment_intent.payment_failed" => PaymentStatus::Failed,
                _ => intent_status(str_at(o, "status").unwrap_or("")),
            };
            let session = o.get("metadata").and_then(|m| str_at(m, "session_id"));
            let amount = if status == PaymentStatus::Succeeded {
                Some(money_at(o, "amount_received")?)
            } else {
                None
            };
            update(session, str_at(o, "id"), Fact::Payment { status, amount })
        }
        "refund.created" | "refund.updated" | "refund.failed" | "charge.refund.updated" => {
            if let Some(end @ ("failed" | "canceled")) = str_at(o, "status") {
                let refund_id = str_at(o, "id")
                    .ok_or(EventError::Missing("data.object.id"))?
                    .to_owned();
                return update(
                    None,
                    str_at(o, "payment_intent"),
                    Fact::RefundEnded {
                        refund_id,
                        canceled: end == "canceled",
                    },
                );
            }
            if str_at(o, "status") != Some("succeeded") {
                return Ok(Interpretation::Ignore(format!(
                    "refund status {:?} moves no money yet",
                    str_at(o, "status")
                )));
            }
            let refund_id = str_at(o, "id")
                .ok_or(EventError::Missing("data.object.id"))?
                .to_owned();
            update(
                None,
                str_at(o, "payment_intent"),
                Fact::Refund {
                    refund_id,
                    amount: money_at(o, "amount")?,
                },
            )
        }
        "charge.refunded" => {
            let refunds = o
                .get("refunds")
                .and_then(|r| r.get("data"))
                .and_then(Value::as_array);
            let Some(refunds) = refunds else {
                return Ok(Interpretation::Ignore(
                    "charge.refunded without refund details; refund.* events carry them".into(),
                ));
            };
            let mut facts = Vec::new();
            for r in refunds
                .iter()
                .filter(|r| str_at(r, "status") == Some("succeeded"))
            {
                let refund_id = str_at(r, "id")
                    .ok_or(EventError::Missing("refund id"))?
                    .to_owned();
                facts.push(Fact::Refund {
                    refund_id,
                    amount: money_at(r, "amount")?,
                });
            }
            if facts.is_empty() {
                return Ok(Interpretation::Ignore(
                    "no succeeded refund in charge.refunded".into(),
                ));
            }
            Ok(Interpretation::Update {
                payment: ref_of(None, str_at(o, "payment_intent"))?,
                facts,
            })
        }
        k if k.starts_with("charge.dispute.") => {
            let dispute_id = str_at(o, "id")
                .ok_or(EventError::Missing("data.object.id"))?
                .to_owned();
            let status = dispute_status(str_at(o, "status").unwrap_or(""));
            update(
                None,
                str_at(o, "payment_intent"),
                Fact::Dispute {
                    dispute_id,
                    amount: money_at(o, "amount")?,
                    status,
                },
            )
        }
        other => Ok(Interpretation::Ignore(format!(
            "event type {other:?} is not acted on"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateways::PaymentRef;

    #[test]
    fn a_completed_checkout_session_is_a_succeeded_payment() {
        let body = br#"{"id":"evt_1","type":"checkout.session.completed","data":{"object":{"id":"cs_1","payment_intent":"pi_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#;
        let Interpretation::Update { payment, facts } = interpret(body).unwrap() else {
            panic!("not an update")
        };
        assert_eq!(
            payment,
            PaymentRef {
                session_id: Some("cs_1".into()),
                payment_id: Some("pi_1".into())
            }
        );
        assert_eq!(
            facts,
            vec![Fact::Payment {
                status: PaymentStatus::Succeeded,
                amount: Some(Money::parse("19.90", "BRL").unwrap())
            }]
        );
    }

    #[test]
    fn a_refund_that_fails_or_is_canceled_ends_its_request() {
        for (status, canceled) in [("failed", false), ("canceled", true)] {
            let body = format!(
                r#"{{"id":"evt_9","type":"refund.updated","data":{{"object":{{"id":"re_9","payment_intent":"pi_1","amount":500,"currency":"brl","status":"{status}"}}}}}}"#
            );
            let Interpretation::Update { facts, .. } = interpret(body.as_bytes()).unwrap() else {
                panic!("not an update")
            };
            assert_eq!(
                facts,
                vec![Fact::RefundEnded {
                    refund_id: "re_9".into(),
                    canceled
                }]
            );
        }
    }

    #[test]
    fn unknown_statuses_move_no_money() {
        assert_eq!(session_status("something_new"), PaymentStatus::Pending);
        assert_eq!(intent_status("requires_capture"), PaymentStatus::Pending);
        assert_eq!(dispute_status("brand_new_state"), None);
    }

    #[test]
    fn every_documented_dispute_status_ends_in_its_state() {
        for (status, want) in [
            ("warning_needs_response", DisputeStatus::Open),
            ("warning_under_review", DisputeStatus::Open),
            ("needs_response", DisputeStatus::Open),
            ("under_review", DisputeStatus::Open),
            ("won", DisputeStatus::Won),
            ("warning_closed", DisputeStatus::Won),
            ("prevented", DisputeStatus::Won),
            ("lost", DisputeStatus::Lost),
            ("charge_refunded", DisputeStatus::Refunded),
        ] {
            assert_eq!(dispute_status(status), Some(want), "{status}");
        }
    }
}
