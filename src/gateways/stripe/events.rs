//! Stripe events (API objects in `data.object`, amounts in minor units, lower-case currency).
//! The session is the Checkout Session; refunds and disputes name the PaymentIntent.

use serde::Deserialize;
use serde_json::Value;

use crate::gateways::{
    DisputeStatus, EventError, Fact, Interpretation, PaymentRef, PaymentStatus, Period, Renewal,
    SubscriptionChange, ref_of,
};
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

/// Dispute `status`. `warning_closed` (an inquiry that never became a chargeback) ends in the
/// seller's favour. `charge_refunded` closes it because the charge was refunded, and so does
/// `prevented`: a chargeback stopped before it was filed by a prevention programme (Visa's Rapid
/// Dispute Resolution), which settles it by refunding the buyer at once. The refund events
/// account for that money, so the dispute's take-back is kept until they are recorded; read as
/// won, it was credited back to the seller, paid out, and then taken again by the refund. A
/// status we do not know is `None`: the dispute keeps its last known state.
pub fn dispute_status(s: &str) -> Option<DisputeStatus> {
    match s {
        "warning_needs_response" | "warning_under_review" | "needs_response" | "under_review" => {
            Some(DisputeStatus::Open)
        }
        "won" | "warning_closed" => Some(DisputeStatus::Won),
        "lost" => Some(DisputeStatus::Lost),
        "charge_refunded" | "prevented" => Some(DisputeStatus::Refunded),
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
            let mut facts = vec![Fact::Payment { status, amount }];
            // In subscription mode the session starts a subscription Stripe bills from now on.
            if str_at(o, "mode") == Some("subscription")
                && let Some(subscription) = str_at(o, "subscription")
            {
                facts.push(Fact::Subscribed {
                    subscription: subscription.to_owned(),
                });
            }
            Ok(Interpretation::Update {
                payment: ref_of(Some(id), str_at(o, "payment_intent"))?,
                facts,
            })
        }
        "invoice.paid" | "invoice.payment_succeeded" | "invoice.payment_failed" => {
            invoice(o, e.kind == "invoice.payment_failed")
        }
        "customer.subscription.updated" | "customer.subscription.deleted" => {
            let subscription = str_at(o, "id")
                .ok_or(EventError::Missing("data.object.id"))?
                .to_owned();
            let ended = e.kind == "customer.subscription.deleted"
                || matches!(str_at(o, "status"), Some("canceled" | "incomplete_expired"));
            let change = if ended {
                SubscriptionChange::Canceled
            } else {
                SubscriptionChange::CancelAtPeriodEnd(
                    o.get("cancel_at_period_end")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                )
            };
            Ok(Interpretation::Subscription {
                subscription,
                first_session: None,
                change,
            })
        }
        "payment_intent.succeeded"
        | "payment_intent.payment_failed"
        | "payment_intent.canceled" => {
            let status = match e.kind.as_str() {
                "payment_intent.payment_failed" => PaymentStatus::Failed,
                _ => intent_status(str_at(o, "status").unwrap_or("")),
            };
            let amount = if status == PaymentStatus::Succeeded {
                Some(money_at(o, "amount_received")?)
            } else {
                None
            };
            // Known by its PaymentIntent only, never by a session named in its metadata:
            // whoever makes a PaymentIntent writes its metadata, and every connected account
            // sends its events to the Connect endpoint, so any seller could name another's
            // session there (or its own, paid without the platform's fee). Our sessions' own
            // PaymentIntents carry no session id; their session's events name them.
            update(None, str_at(o, "id"), Fact::Payment { status, amount })
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

fn timestamp(
    v: Option<&Value>,
    what: &'static str,
) -> Result<chrono::DateTime<chrono::Utc>, EventError> {
    v.and_then(Value::as_i64)
        .and_then(|t| chrono::DateTime::from_timestamp(t, 0))
        .ok_or(EventError::Missing(what))
}

/// An Invoice of a subscription: a renewal (its line's period), or the first period's own
/// charge (`billing_reason` `subscription_create`), whose facts are the checkout's payment's.
/// Read as both the API versions before 2025-03-31 and after it write it (the subscription
/// under `parent.subscription_details`, the PaymentIntent under `payments`).
fn invoice(o: &Value, failed: bool) -> Result<Interpretation, EventError> {
    let subscription = str_at(o, "subscription")
        .or_else(|| {
            o.pointer("/parent/subscription_details/subscription")
                .and_then(Value::as_str)
        })
        .map(str::to_owned);
    let Some(subscription) = subscription else {
        return Ok(Interpretation::Ignore(
            "an invoice of no subscription".into(),
        ));
    };
    let id = str_at(o, "id").ok_or(EventError::Missing("data.object.id"))?;
    let payment_id = str_at(o, "payment_intent").or_else(|| {
        o.pointer("/payments/data/0/payment/payment_intent")
            .and_then(Value::as_str)
    });
    let first = str_at(o, "billing_reason") == Some("subscription_create");
    let status = if failed {
        if first {
            return Ok(Interpretation::Ignore(
                "the first invoice's failure is its checkout's".into(),
            ));
        }
        PaymentStatus::Failed
    } else {
        PaymentStatus::Succeeded
    };
    let amount = match status {
        PaymentStatus::Succeeded => {
            let paid = money_at(o, "amount_paid")?;
            if paid.amount().is_zero() {
                return Ok(Interpretation::Ignore("the invoice charged nothing".into()));
            }
            Some(paid)
        }
        _ => None,
    };
    // A period's invoice, or the first one. An invoice for a change within a period (a plan
    // changed and invoiced at once, a usage threshold, one made by hand) is no period's: read
    // as a renewal, it opened a second renewal inside the current period, with a sale, and
    // moved the period on. Its payment is one no order asked for: recorded as unmatched (not
    // given back), so that a success is the finding `captured_payment_unconfirmed`, for an
    // operator to decide.
    if str_at(o, "billing_reason").is_some_and(|r| {
        !matches!(
            r,
            "subscription_cycle" | "subscription_create" | "subscription"
        )
    }) {
        return Ok(Interpretation::Update {
            payment: PaymentRef {
                session_id: Some(id.to_owned()),
                payment_id: payment_id.map(str::to_owned),
            },
            facts: vec![Fact::Payment { status, amount }],
        });
    }
    let period = if first {
        None
    } else {
        // The period's own line: a period's invoice lists the prorations of a change made
        // within the period before it (their periods are the change's remainder, not the
        // period billed).
        let lines = o
            .pointer("/lines/data")
            .and_then(Value::as_array)
            .ok_or(EventError::Missing("lines.data"))?;
        let proration = |l: &&Value| {
            l.get("proration").and_then(Value::as_bool) == Some(true)
                || l.pointer("/parent/subscription_item_details/proration")
                    .and_then(Value::as_bool)
                    == Some(true)
        };
        let line = lines
            .iter()
            .find(|l| !proration(l))
            .or(lines.first())
            .and_then(|l| l.get("period"))
            .ok_or(EventError::Missing("lines.data[].period"))?;
        Some(Period {
            start: timestamp(line.get("start"), "lines.data[].period.start")?,
            end: Some(timestamp(line.get("end"), "lines.data[].period.end")?),
        })
    };
    let fee = match o.get("application_fee_amount") {
        Some(v) if v.is_i64() => Some(money_at(o, "application_fee_amount")?),
        _ => None,
    };
    let due = match o.get("amount_due") {
        Some(v) if v.as_i64().is_some_and(|d| d > 0) => Some(money_at(o, "amount_due")?),
        _ => None,
    };
    Ok(Interpretation::Renewal {
        renewal: Renewal {
            subscription,
            first_session: None,
            period,
            fee,
            url: str_at(o, "hosted_invoice_url").map(str::to_owned),
            due,
        },
        payment: PaymentRef {
            session_id: Some(id.to_owned()),
            payment_id: payment_id.map(str::to_owned),
        },
        facts: vec![Fact::Payment { status, amount }],
    })
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
    fn a_payment_intent_is_known_by_its_own_id_never_by_a_session_in_its_metadata() {
        let body = br#"{"id":"evt_1","type":"payment_intent.succeeded","account":"acct_other","data":{"object":{"id":"pi_9","status":"succeeded","amount_received":1990,"currency":"brl","metadata":{"session_id":"cs_1"}}}}"#;
        let Interpretation::Update { payment, .. } = interpret(body).unwrap() else {
            panic!("not an update")
        };
        assert_eq!(
            payment,
            PaymentRef {
                session_id: None,
                payment_id: Some("pi_9".into())
            }
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

    fn renewal_of(body: &str) -> (Renewal, PaymentRef, Vec<Fact>) {
        match interpret(body.as_bytes()).unwrap() {
            Interpretation::Renewal {
                renewal,
                payment,
                facts,
            } => (renewal, payment, facts),
            other => panic!("not a renewal: {other:?}"),
        }
    }

    /// An invoice for a change within a period (an upgrade invoiced at once) is no period's
    /// renewal: it opens no second renewal inside the current period. Its payment is one no
    /// order asked for (recorded as such, for an operator).
    #[test]
    fn an_invoice_for_a_change_within_a_period_is_no_renewal() {
        let body = r#"{"id":"evt_4","type":"invoice.paid","account":"acct_1","data":{"object":{"id":"in_4","subscription":"sub_1","billing_reason":"subscription_update","payment_intent":"pi_4","amount_paid":500,"currency":"brl","lines":{"data":[{"proration":true,"period":{"start":1768000000,"end":1769904000}}]}}}}"#;
        match interpret(body.as_bytes()).unwrap() {
            Interpretation::Update { payment, facts } => {
                assert_eq!(
                    payment,
                    PaymentRef {
                        session_id: Some("in_4".into()),
                        payment_id: Some("pi_4".into())
                    }
                );
                assert_eq!(
                    facts,
                    vec![Fact::Payment {
                        status: PaymentStatus::Succeeded,
                        amount: Some(Money::parse("5.00", "BRL").unwrap())
                    }]
                );
            }
            other => panic!("{other:?}"),
        }
    }

    /// A period's invoice after a change within the period (a plan upgraded) lists the
    /// change's prorations first: the renewal is the period billed, not the remainder the
    /// prorations cover (that would open a second renewal inside the current period).
    #[test]
    fn a_periods_invoice_is_the_period_billed_not_its_prorations() {
        let at = |t| chrono::DateTime::from_timestamp(t, 0).unwrap();
        let proration = |marked: &str| {
            format!(
                r#"{{"id":"evt_3","type":"invoice.paid","account":"acct_1","data":{{"object":{{"id":"in_3","subscription":"sub_1","billing_reason":"subscription_cycle","payment_intent":"pi_3","amount_paid":2990,"currency":"brl","lines":{{"data":[{{{marked},"period":{{"start":1768000000,"end":1769904000}}}},{{"period":{{"start":1769904000,"end":1772323200}}}}]}}}}}}}}"#
            )
        };
        // Before API version 2025-03-31 (`proration` on the line), and after it (under `parent`).
        for marked in [
            r#""proration":true"#,
            r#""parent":{"type":"subscription_item_details","subscription_item_details":{"proration":true}}"#,
        ] {
            let (renewal, _, _) = renewal_of(&proration(marked));
            assert_eq!(
                renewal.period,
                Some(Period {
                    start: at(1769904000),
                    end: Some(at(1772323200))
                })
            );
        }
    }

    #[test]
    fn a_paid_subscription_invoice_is_its_periods_renewal_with_its_application_fee() {
        let at = |t| chrono::DateTime::from_timestamp(t, 0).unwrap();
        // Before API version 2025-03-31, and after it (the subscription under `parent`, the
        // PaymentIntent under `payments`).
        for body in [
            r#"{"id":"evt_2","type":"invoice.paid","account":"acct_1","data":{"object":{"id":"in_2","subscription":"sub_1","billing_reason":"subscription_cycle","payment_intent":"pi_2","amount_paid":1990,"currency":"brl","application_fee_amount":199,"hosted_invoice_url":"https://invoice.stripe.test/in_2","lines":{"data":[{"period":{"start":1767225600,"end":1769904000}}]}}}}"#,
            r#"{"id":"evt_2","type":"invoice.paid","account":"acct_1","data":{"object":{"id":"in_2","parent":{"type":"subscription_details","subscription_details":{"subscription":"sub_1"}},"billing_reason":"subscription_cycle","payments":{"data":[{"payment":{"type":"payment_intent","payment_intent":"pi_2"}}]},"amount_paid":1990,"currency":"brl","application_fee_amount":199,"hosted_invoice_url":"https://invoice.stripe.test/in_2","lines":{"data":[{"period":{"start":1767225600,"end":1769904000}}]}}}}"#,
        ] {
            let (renewal, payment, facts) = renewal_of(body);
            assert_eq!(
                renewal,
                Renewal {
                    subscription: "sub_1".into(),
                    first_session: None,
                    period: Some(Period {
                        start: at(1767225600),
                        end: Some(at(1769904000))
                    }),
                    fee: Some(Money::parse("1.99", "BRL").unwrap()),
                    url: Some("https://invoice.stripe.test/in_2".into()),
                    due: None,
                }
            );
            assert_eq!(
                payment,
                PaymentRef {
                    session_id: Some("in_2".into()),
                    payment_id: Some("pi_2".into())
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
    }

    #[test]
    fn the_first_invoice_is_the_checkouts_payment_and_a_failed_one_moves_no_money() {
        let (renewal, payment, _) = renewal_of(
            r#"{"id":"evt_1","type":"invoice.paid","data":{"object":{"id":"in_1","subscription":"sub_1","billing_reason":"subscription_create","payment_intent":"pi_1","amount_paid":1990,"currency":"brl"}}}"#,
        );
        assert_eq!(renewal.period, None);
        assert_eq!(payment.payment_id.as_deref(), Some("pi_1"));
        let (renewal, _, facts) = renewal_of(
            r#"{"id":"evt_3","type":"invoice.payment_failed","data":{"object":{"id":"in_3","subscription":"sub_1","billing_reason":"subscription_cycle","payment_intent":"pi_3","amount_paid":0,"amount_due":1990,"currency":"brl","lines":{"data":[{"period":{"start":1769904000,"end":1772323200}}]}}}}"#,
        );
        assert!(renewal.period.is_some());
        assert_eq!(
            facts,
            vec![Fact::Payment {
                status: PaymentStatus::Failed,
                amount: None
            }]
        );
        for ignored in [
            r#"{"id":"e","type":"invoice.payment_failed","data":{"object":{"id":"in_1","subscription":"sub_1","billing_reason":"subscription_create","currency":"brl"}}}"#,
            r#"{"id":"e","type":"invoice.paid","data":{"object":{"id":"in_9","subscription":"sub_1","billing_reason":"subscription_cycle","amount_paid":0,"currency":"brl","lines":{"data":[{"period":{"start":1,"end":2}}]}}}}"#,
            r#"{"id":"e","type":"invoice.paid","data":{"object":{"id":"in_8","billing_reason":"manual","amount_paid":500,"currency":"brl"}}}"#,
        ] {
            assert!(
                matches!(
                    interpret(ignored.as_bytes()).unwrap(),
                    Interpretation::Ignore(_)
                ),
                "{ignored}"
            );
        }
        // A renewal without its period cannot be placed.
        assert!(interpret(br#"{"id":"e","type":"invoice.paid","data":{"object":{"id":"in_7","subscription":"sub_1","billing_reason":"subscription_cycle","amount_paid":500,"currency":"brl"}}}"#).is_err());
    }

    #[test]
    fn a_subscription_mode_session_names_its_subscription_and_its_changes_end_it() {
        let Interpretation::Update { facts, .. } = interpret(br#"{"id":"evt_1","type":"checkout.session.completed","data":{"object":{"id":"cs_1","mode":"subscription","subscription":"sub_1","payment_intent":null,"invoice":"in_1","amount_total":1990,"currency":"brl","payment_status":"paid"}}}"#).unwrap() else {
            panic!("not an update")
        };
        assert_eq!(
            facts[1],
            Fact::Subscribed {
                subscription: "sub_1".into()
            }
        );
        for (body, want) in [
            (
                r#"{"id":"e","type":"customer.subscription.updated","data":{"object":{"id":"sub_1","status":"active","cancel_at_period_end":true}}}"#,
                SubscriptionChange::CancelAtPeriodEnd(true),
            ),
            (
                r#"{"id":"e","type":"customer.subscription.updated","data":{"object":{"id":"sub_1","status":"past_due","cancel_at_period_end":false}}}"#,
                SubscriptionChange::CancelAtPeriodEnd(false),
            ),
            (
                r#"{"id":"e","type":"customer.subscription.deleted","data":{"object":{"id":"sub_1","status":"canceled"}}}"#,
                SubscriptionChange::Canceled,
            ),
        ] {
            let Interpretation::Subscription {
                subscription,
                change,
                ..
            } = interpret(body.as_bytes()).unwrap()
            else {
                panic!("{body}")
            };
            assert_eq!((subscription.as_str(), change), ("sub_1", want), "{body}");
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
            ("prevented", DisputeStatus::Refunded),
            ("lost", DisputeStatus::Lost),
            ("charge_refunded", DisputeStatus::Refunded),
        ] {
            assert_eq!(dispute_status(status), Some(want), "{status}");
        }
    }
}
