//! Razorpay events: `{"event", "payload": {"payment": {"entity"}, "refund": {"entity"}, ...}}`,
//! amounts in minor units. The session is the Razorpay order (`order_...`).

use serde_json::Value;

use crate::gateways::{
    DisputeStatus, EventError, Fact, Interpretation, PaymentRef, PaymentStatus, Period, Renewal,
    SubscriptionChange, ref_of,
};
use crate::money::Money;

/// Payment entity `status`. `authorized` is not money yet: only `captured` is.
pub fn payment_status(s: &str) -> PaymentStatus {
    match s {
        "captured" | "refunded" => PaymentStatus::Succeeded,
        "failed" => PaymentStatus::Failed,
        _ => PaymentStatus::Pending,
    }
}

/// Dispute entity `status`, with the dispute itself and the payment it disputes where the status
/// needs them: a `closed` dispute was closed either on the transaction's details the merchant
/// gave, or by a refund to the buyer (Razorpay's dispute entity), and only the payment tells
/// which ([`closed`]). A status we do not know keeps the dispute's last known state.
pub fn dispute_status(s: &str, dispute: &Value, payment: Option<&Value>) -> Option<DisputeStatus> {
    match s {
        "open" | "under_review" => Some(DisputeStatus::Open),
        "won" => Some(DisputeStatus::Won),
        "closed" => closed(dispute, payment),
        "lost" => Some(DisputeStatus::Lost),
        other => {
            tracing::warn!(
                status = other,
                "unknown Razorpay dispute status; keeping the dispute's last known state"
            );
            None
        }
    }
}

/// How a `closed` dispute ended, from the payment it disputes. Closed by a refund, the
/// payment's refunds (`amount_refunded`) cover the disputed amount: the refund's own event gives
/// the buyer's money back and debits the seller, so the dispute's take-back is kept until the
/// recorded refunds cover it ([`DisputeStatus::Refunded`]); read as won, the seller was
/// credited back the money the refund then took again, and paid out meanwhile. Refunds short of
/// the disputed amount (a partial refund made before the dispute) did not close it: closed on
/// the transaction's details, it is won (read as refunded, the part no refund covers would stay
/// taken from the seller for good). Without the payment, or its refunds, nothing is decided:
/// the dispute keeps its last known state, and reconciliation asks the payment itself
/// (`GET /v1/payments/{id}`), since a decided dispute never changes again.
pub(crate) fn closed(dispute: &Value, payment: Option<&Value>) -> Option<DisputeStatus> {
    let refunded = payment?.get("amount_refunded").and_then(Value::as_i64)?;
    let disputed = dispute.get("amount").and_then(Value::as_i64)?;
    Some(if refunded >= disputed {
        DisputeStatus::Refunded
    } else {
        DisputeStatus::Won
    })
}

/// The stored identity of a Razorpay event. Its `X-Razorpay-Event-Id` header is not signed, so
/// a captured delivery could be replayed forever under fresh ids; the identity is built from
/// what the signature covers instead: the event name, the id of the entity it is about and the
/// event's `created_at`. A gateway retry resends the same body, so it is a duplicate; so is a
/// replay.
pub fn event_identity(v: &Value) -> Option<String> {
    let event = str_at(v, "event").filter(|e| !e.is_empty())?;
    let created_at = v.get("created_at").and_then(Value::as_i64)?;
    let payload = v.get("payload")?.as_object()?;
    // The entity the event is about: the first one `contains` names, else the payload's first.
    let named = v.get("contains").and_then(Value::as_array).and_then(|c| {
        c.iter()
            .filter_map(Value::as_str)
            .find(|n| payload.contains_key(*n))
    });
    let entity_name = named.or_else(|| payload.keys().next().map(String::as_str))?;
    let entity_id = payload
        .get(entity_name)
        .and_then(|e| e.get("entity"))
        .and_then(|e| str_at(e, "id"))
        .filter(|id| !id.is_empty())?;
    Some(format!("{event}:{entity_id}:{created_at}"))
}

fn entity<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get("payload")?.get(name)?.get("entity")
}

fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn money_at(v: &Value) -> Result<Money, EventError> {
    let units = v
        .get("amount")
        .and_then(Value::as_i64)
        .ok_or(EventError::Missing("amount"))?;
    let currency = str_at(v, "currency").ok_or(EventError::Missing("currency"))?;
    Ok(Money::from_minor(units, currency)?)
}

pub fn interpret(body: &[u8]) -> Result<Interpretation, EventError> {
    let v: Value = serde_json::from_slice(body)?;
    let event = str_at(&v, "event").ok_or(EventError::Missing("event"))?;
    let payment = entity(&v, "payment");
    let order_id = payment.and_then(|p| str_at(p, "order_id"));
    let payment_id = payment.and_then(|p| str_at(p, "id"));
    let fact = match event {
        "subscription.charged" | "subscription.pending" => {
            return subscription_charge(&v, event == "subscription.charged");
        }
        "subscription.halted" | "subscription.cancelled" | "subscription.completed" => {
            let sub = entity(&v, "subscription")
                .ok_or(EventError::Missing("payload.subscription.entity"))?;
            return Ok(Interpretation::Subscription {
                subscription: str_at(sub, "id")
                    .ok_or(EventError::Missing("subscription id"))?
                    .to_owned(),
                first_session: first_session(sub),
                change: SubscriptionChange::Canceled,
            });
        }
        "payment.captured" | "payment.failed" | "payment.authorized" | "order.paid"
            if payment.and_then(|p| str_at(p, "invoice_id")).is_some() =>
        {
            return Ok(Interpretation::Ignore(
                "a subscription invoice's payment: its subscription.charged reports it".into(),
            ));
        }
        "payment.captured" | "payment.failed" | "payment.authorized" | "order.paid" => {
            let p = payment.ok_or(EventError::Missing("payload.payment.entity"))?;
            let status = payment_status(str_at(p, "status").unwrap_or(""));
            let amount = if status == PaymentStatus::Succeeded {
                Some(money_at(p)?)
            } else {
                None
            };
            Fact::Payment { status, amount }
        }
        "refund.processed" | "refund.failed" => {
            let r = entity(&v, "refund").ok_or(EventError::Missing("payload.refund.entity"))?;
            let refund_id = str_at(r, "id")
                .ok_or(EventError::Missing("refund id"))?
                .to_owned();
            let payment_id = payment_id.or_else(|| str_at(r, "payment_id"));
            let fact = if event == "refund.processed" {
                Fact::Refund {
                    refund_id,
                    amount: money_at(r)?,
                }
            } else {
                Fact::RefundEnded {
                    refund_id,
                    canceled: false,
                }
            };
            return Ok(Interpretation::Update {
                payment: ref_of(order_id, payment_id)?,
                facts: vec![fact],
            });
        }
        k if k.starts_with("payment.dispute.") => {
            let d = entity(&v, "dispute").ok_or(EventError::Missing("payload.dispute.entity"))?;
            let dispute_id = str_at(d, "id")
                .ok_or(EventError::Missing("dispute id"))?
                .to_owned();
            let status = match k {
                "payment.dispute.won" => Some(DisputeStatus::Won),
                "payment.dispute.lost" => Some(DisputeStatus::Lost),
                "payment.dispute.closed" => closed(d, payment),
                _ => dispute_status(str_at(d, "status").unwrap_or(""), d, payment),
            };
            let payment_id = payment_id.or_else(|| str_at(d, "payment_id"));
            return Ok(Interpretation::Update {
                payment: ref_of(order_id, payment_id)?,
                facts: vec![Fact::Dispute {
                    dispute_id,
                    amount: money_at(d)?,
                    status,
                }],
            });
        }
        other => {
            return Ok(Interpretation::Ignore(format!(
                "event {other:?} is not acted on"
            )));
        }
    };
    Ok(Interpretation::Update {
        payment: ref_of(order_id, payment_id)?,
        facts: vec![fact],
    })
}

/// The session of a subscription's first payment, as the platform noted it on the
/// subscription (`notes.session_id`: notes only the platform's key can set).
fn first_session(sub: &Value) -> Option<String> {
    sub.get("notes")
        .and_then(|n| str_at(n, "session_id"))
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// A subscription's charge (`subscription.charged`) or failed charge (`subscription.pending`),
/// as the renewal of its current cycle. The charge's session is the Razorpay order of the
/// cycle's invoice, which its retries and refunds name too; the charge of the checkout's own
/// order is the first period's.
fn subscription_charge(v: &Value, charged: bool) -> Result<Interpretation, EventError> {
    let sub =
        entity(v, "subscription").ok_or(EventError::Missing("payload.subscription.entity"))?;
    let subscription = str_at(sub, "id")
        .ok_or(EventError::Missing("subscription id"))?
        .to_owned();
    let Some(p) = entity(v, "payment") else {
        return Ok(Interpretation::Ignore(
            "the subscription event names no charge".into(),
        ));
    };
    let session = str_at(p, "order_id")
        .or_else(|| str_at(p, "invoice_id"))
        .ok_or(EventError::Missing("payment order_id"))?
        .to_owned();
    let first = first_session(sub);
    let at = |key: &'static str| {
        sub.get(key)
            .and_then(Value::as_i64)
            .and_then(|t| chrono::DateTime::from_timestamp(t, 0))
            .ok_or(EventError::Missing(key))
    };
    let period = if first.as_deref() == Some(session.as_str()) {
        None
    } else {
        Some(Period {
            start: at("current_start")?,
            end: Some(at("current_end")?),
        })
    };
    let (status, amount) = if charged {
        (PaymentStatus::Succeeded, Some(money_at(p)?))
    } else {
        (PaymentStatus::Failed, None)
    };
    Ok(Interpretation::Renewal {
        renewal: Renewal {
            subscription,
            first_session: first,
            period,
            fee: None,
            url: str_at(sub, "short_url").map(str::to_owned),
            due: None,
        },
        payment: PaymentRef {
            session_id: Some(session),
            payment_id: str_at(p, "id").map(str::to_owned),
        },
        facts: vec![Fact::Payment { status, amount }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `closed` is Razorpay's word both for a dispute closed on the transaction's details (won)
    /// and for one closed by a refund to the buyer: the payment the event carries says which,
    /// by whether its refunds cover the disputed amount.
    #[test]
    fn a_closed_dispute_is_won_unless_its_payment_was_refunded() {
        let with = |event: &str, status: &str, refunded: i64, disputed: i64| {
            format!(
                r#"{{"event":"{event}","created_at":1,"contains":["payment","dispute"],"payload":{{"payment":{{"entity":{{"id":"pay_1","amount":1990,"currency":"INR","status":"captured","order_id":"order_1","amount_refunded":{refunded},"refund_status":null}}}},"dispute":{{"entity":{{"id":"disp_1","payment_id":"pay_1","amount":{disputed},"currency":"INR","status":"{status}"}}}}}}}}"#
            )
        };
        let closed =
            |event: &str, status: &str, refunded: i64, _: &str| with(event, status, refunded, 1990);
        let status_of = |body: String| match interpret(body.as_bytes()).unwrap() {
            Interpretation::Update { facts, .. } => match facts.as_slice() {
                [Fact::Dispute { status, .. }] => *status,
                other => panic!("{other:?}"),
            },
            _ => panic!("not an update"),
        };
        for event in ["payment.dispute.closed", "payment.dispute.action_required"] {
            assert_eq!(
                status_of(closed(event, "closed", 0, "null")),
                Some(DisputeStatus::Won),
                "{event}"
            );
            assert_eq!(
                status_of(closed(event, "closed", 1990, r#""full""#)),
                Some(DisputeStatus::Refunded),
                "{event}"
            );
            // A partial refund made before a dispute of the rest did not close it.
            assert_eq!(
                status_of(with(event, "closed", 500, 1490)),
                Some(DisputeStatus::Won),
                "{event}"
            );
            assert_eq!(
                status_of(with(event, "closed", 1990, 1490)),
                Some(DisputeStatus::Refunded),
                "{event}"
            );
        }
        // No payment in the event: nothing decided; reconciliation asks the payment.
        let bare = r#"{"event":"payment.dispute.closed","created_at":1,"contains":["dispute"],"payload":{"dispute":{"entity":{"id":"disp_1","payment_id":"pay_1","amount":1990,"currency":"INR","status":"closed"}}}}"#;
        assert_eq!(status_of(bare.to_owned()), None);
        assert_eq!(
            status_of(closed("payment.dispute.won", "won", 1990, r#""full""#)),
            Some(DisputeStatus::Won)
        );
    }

    #[test]
    fn a_subscription_charge_is_its_cycles_renewal_and_its_invoice_payment_is_not_a_new_order() {
        let charged = |order_id: &str| {
            format!(
                r#"{{"event":"subscription.charged","created_at":1,"contains":["subscription","payment"],"payload":{{"subscription":{{"entity":{{"id":"sub_R1","current_start":1767225600,"current_end":1769904000,"notes":{{"session_id":"order_first"}}}}}},"payment":{{"entity":{{"id":"pay_2","amount":1990,"currency":"INR","status":"captured","order_id":"{order_id}","invoice_id":"inv_2"}}}}}}}}"#
            )
        };
        let Interpretation::Renewal {
            renewal,
            payment,
            facts,
        } = interpret(charged("order_2").as_bytes()).unwrap()
        else {
            panic!("not a renewal")
        };
        assert_eq!(renewal.subscription, "sub_R1");
        assert_eq!(renewal.first_session.as_deref(), Some("order_first"));
        assert_eq!(
            renewal.period.map(|p| p.start.timestamp()),
            Some(1767225600)
        );
        assert_eq!(
            (payment.session_id.as_deref(), payment.payment_id.as_deref()),
            (Some("order_2"), Some("pay_2"))
        );
        assert_eq!(
            facts,
            vec![Fact::Payment {
                status: PaymentStatus::Succeeded,
                amount: Some(Money::parse("19.90", "INR").unwrap())
            }]
        );
        // The charge of the checkout's own order is the first period's.
        let Interpretation::Renewal { renewal, .. } =
            interpret(charged("order_first").as_bytes()).unwrap()
        else {
            panic!("not a renewal")
        };
        assert_eq!(renewal.period, None);
        let captured = r#"{"event":"payment.captured","created_at":1,"contains":["payment"],"payload":{"payment":{"entity":{"id":"pay_2","amount":1990,"currency":"INR","status":"captured","order_id":"order_2","invoice_id":"inv_2"}}}}"#;
        assert!(matches!(
            interpret(captured.as_bytes()).unwrap(),
            Interpretation::Ignore(_)
        ));
        let halted = r#"{"event":"subscription.halted","created_at":1,"contains":["subscription"],"payload":{"subscription":{"entity":{"id":"sub_R1","notes":{"session_id":"order_first"}}}}}"#;
        assert!(matches!(
            interpret(halted.as_bytes()).unwrap(),
            Interpretation::Subscription {
                change: SubscriptionChange::Canceled,
                ..
            }
        ));
    }

    #[test]
    fn a_captured_payment_succeeds_and_an_authorized_one_waits() {
        let body = br#"{"entity":"event","event":"payment.captured","payload":{"payment":{"entity":{"id":"pay_1","amount":50000,"currency":"INR","status":"captured","order_id":"order_1"}}}}"#;
        let Interpretation::Update { facts, payment } = interpret(body).unwrap() else {
            panic!()
        };
        assert_eq!(payment.session_id.as_deref(), Some("order_1"));
        assert_eq!(
            facts,
            vec![Fact::Payment {
                status: PaymentStatus::Succeeded,
                amount: Some(Money::parse("500", "INR").unwrap())
            }]
        );
        assert_eq!(payment_status("authorized"), PaymentStatus::Pending);
        assert_eq!(payment_status("never_heard_of_it"), PaymentStatus::Pending);
    }

    #[test]
    fn a_refund_is_done_when_processed_and_ended_when_failed() {
        let body = |event: &str| {
            format!(
                r#"{{"entity":"event","event":"{event}","payload":{{"refund":{{"entity":{{"id":"rfnd_1","payment_id":"pay_1","amount":500,"currency":"INR"}}}}}}}}"#
            )
        };
        let facts = |event: &str| match interpret(body(event).as_bytes()).unwrap() {
            Interpretation::Update { facts, .. } => facts,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            facts("refund.processed"),
            vec![Fact::Refund {
                refund_id: "rfnd_1".into(),
                amount: Money::parse("5.00", "INR").unwrap()
            }]
        );
        assert_eq!(
            facts("refund.failed"),
            vec![Fact::RefundEnded {
                refund_id: "rfnd_1".into(),
                canceled: false
            }]
        );
    }

    #[test]
    fn the_identity_comes_from_the_signed_body() {
        let body: Value = serde_json::from_str(r#"{"entity":"event","event":"payment.captured","contains":["payment"],"payload":{"payment":{"entity":{"id":"pay_1","status":"captured"}}},"created_at":1700000000}"#).unwrap();
        assert_eq!(
            event_identity(&body).as_deref(),
            Some("payment.captured:pay_1:1700000000")
        );
        let refund: Value = serde_json::from_str(r#"{"event":"refund.processed","contains":["refund","payment"],"payload":{"payment":{"entity":{"id":"pay_1"}},"refund":{"entity":{"id":"rfnd_9"}}},"created_at":1700000100}"#).unwrap();
        assert_eq!(
            event_identity(&refund).as_deref(),
            Some("refund.processed:rfnd_9:1700000100")
        );
        let no_time: Value = serde_json::from_str(
            r#"{"event":"payment.captured","payload":{"payment":{"entity":{"id":"pay_1"}}}}"#,
        )
        .unwrap();
        assert_eq!(event_identity(&no_time), None);
    }
}
