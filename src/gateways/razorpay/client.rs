//! Razorpay's API: orders (the session), their payments (status), refunds, disputes.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::events::{dispute_status, payment_status};
use crate::gateways::api::{
    DisputeQuery, GatewayError, PaymentState, RefundOutcome, RefundQuery, RefundReceipt,
    RefundRequest, Session, SessionRequest, SubscriptionEnd, end_checked, read_json,
    unknown_status,
};
use crate::gateways::{DisputeStatus, GatewayName, PaymentStatus};
use crate::money::Money;
use crate::secret::Secret;

const NAME: GatewayName = GatewayName::Razorpay;

/// Razorpay's Orders API. A Razorpay order is our session: its payments carry its id back in
/// their events (`order_id`). The buyer pays on a page of ours that opens Razorpay Checkout for
/// the order.
#[derive(Debug, Clone)]
pub struct RazorpayGateway {
    api: String,
    key_id: String,
    key_secret: Secret,
    public_url: String,
    http: reqwest::Client,
}

/// Razorpay's error body: `{"error": {"code", "description"}}`.
fn rzp_error(body: &Value) -> (Option<String>, Option<String>) {
    let e = &body["error"];
    (
        e["code"].as_str().map(str::to_owned),
        e["description"].as_str().map(str::to_owned),
    )
}

#[derive(Deserialize)]
struct RzpOrder {
    id: String,
}

/// A subscription's invoice (`GET /v1/invoices/{id}`), as far as it is read.
#[derive(Deserialize)]
struct RzpInvoice {
    /// `issued`, `paid`, `partially_paid`, `expired`, `cancelled`.
    status: Option<String>,
    payment_id: Option<String>,
    amount_paid: Option<i64>,
    currency: Option<String>,
}

#[derive(Deserialize)]
struct RzpPayments {
    #[serde(default)]
    items: Vec<RzpPayment>,
}

#[derive(Deserialize)]
struct RzpPayment {
    id: String,
    status: String,
    amount: i64,
    currency: String,
}

#[derive(Deserialize)]
struct RzpRefund {
    id: String,
    status: Option<String>,
}

fn minor(m: &Money) -> Result<i64, GatewayError> {
    m.minor_units()
        .ok_or_else(|| GatewayError::Refused(format!("{m} does not fit Razorpay's minor units")))
}

/// Our refund key as Razorpay takes it: at least ten characters, only letters, digits, hyphens
/// and underscores (its documented alphabet; anything else is refused 400, so a refund keyed
/// with it could never be made). A second payment's give-back is keyed `<session>:<payment>`:
/// the colon becomes `--`, which neither Razorpay's ids (`order_…`, `pay_…`) nor our keys hold,
/// so two keys stay two. Any other character is written as `-x` and its code in hex.
fn refund_key(key: &str) -> String {
    let mut safe = String::with_capacity(key.len() + 8);
    for c in key.chars() {
        match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | '-' => safe.push(c),
            ':' => safe.push_str("--"),
            c => safe.push_str(&format!("-x{:x}-", u32::from(c))),
        }
    }
    while safe.len() < 10 {
        safe.push('_');
    }
    safe
}

impl RazorpayGateway {
    /// The same client waiting at most `timeout` for an answer (a test's impatient client).
    pub fn with_timeout(mut self, timeout: Duration) -> Result<Self, reqwest::Error> {
        self.http = crate::gateways::http_client(timeout)?;
        Ok(self)
    }

    pub fn new(
        api: &str,
        key_id: &str,
        key_secret: Secret,
        public_url: &str,
    ) -> Result<Self, reqwest::Error> {
        Ok(Self {
            api: api.trim_end_matches('/').to_owned(),
            key_id: key_id.to_owned(),
            key_secret,
            public_url: public_url.trim_end_matches('/').to_owned(),
            http: crate::gateways::http_client(Duration::from_secs(15))?,
        })
    }

    /// The key id buyers' browsers use to open Checkout (public, unlike the secret).
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    async fn create(&self, r: &SessionRequest) -> Result<Session, GatewayError> {
        let order: RzpOrder = read_json(
            NAME,
            self.http
                .post(format!("{}/v1/orders", self.api))
                .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                .json(&serde_json::json!({
                    "amount": minor(&r.amount)?,
                    "currency": r.amount.currency(),
                    "receipt": format!("order-{}", r.order_number),
                    "notes": r.metadata,
                }))
                .send()
                .await,
            rzp_error,
        )
        .await?;
        let url = format!("{}/pay/razorpay/{}", self.public_url, order.id);
        Ok(Session {
            session_id: order.id,
            url,
        })
    }

    async fn read(
        &self,
        session_id: &str,
        _seller_account: Option<&str>,
    ) -> Result<PaymentState, GatewayError> {
        // A renewal charged without an order is named by its invoice.
        if session_id.starts_with("inv_") {
            return self.read_invoice(session_id).await;
        }
        let payments: RzpPayments = read_json(
            NAME,
            self.http
                .get(format!("{}/v1/orders/{session_id}/payments", self.api))
                .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                .send()
                .await,
            rzp_error,
        )
        .await?;
        // The payment that took the money and kept it, if any; else the latest attempt. A
        // `refunded` one (refunded whole, or authorized and never captured: Razorpay gives those
        // back after five days) is not the order's payment: read as paid, it confirmed an order
        // and posted a sale on money the buyer had back, with no refund ever recorded. It counts
        // as pending here; its own events, if they come, say the rest.
        let chosen = payments
            .items
            .iter()
            .find(|p| p.status == "captured")
            .or_else(|| payments.items.first());
        Ok(match chosen {
            Some(p) if p.status == "refunded" => PaymentState {
                status: PaymentStatus::Pending,
                payment_id: None,
                amount: None,
                subscription: None,
            },
            Some(p) => PaymentState {
                status: self.map(&p.status),
                payment_id: Some(p.id.clone()),
                amount: Money::from_minor(p.amount, &p.currency).ok(),
                subscription: None,
            },
            None => PaymentState {
                status: PaymentStatus::Pending,
                payment_id: None,
                amount: None,
                subscription: None,
            },
        })
    }

    /// A subscription's invoice (`GET /v1/invoices/{id}`), the session of a renewal charged
    /// without an order of its own: `paid`, with the payment that paid it and what it paid;
    /// `expired` or `cancelled`, failed; else (issued: Razorpay may still charge it) pending.
    async fn read_invoice(&self, invoice: &str) -> Result<PaymentState, GatewayError> {
        let i: RzpInvoice = read_json(
            NAME,
            self.http
                .get(format!("{}/v1/invoices/{invoice}", self.api))
                .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                .send()
                .await,
            rzp_error,
        )
        .await?;
        let pending = PaymentState {
            status: PaymentStatus::Pending,
            payment_id: None,
            amount: None,
            subscription: None,
        };
        Ok(match i.status.as_deref() {
            Some("paid") => PaymentState {
                status: PaymentStatus::Succeeded,
                payment_id: i.payment_id,
                amount: match (i.amount_paid, i.currency.as_deref()) {
                    (Some(units), Some(c)) => Money::from_minor(units, c).ok(),
                    _ => None,
                },
                subscription: None,
            },
            Some("expired" | "cancelled") => PaymentState {
                status: PaymentStatus::Failed,
                ..pending
            },
            _ => pending,
        })
    }

    async fn refund_payment(&self, r: &RefundRequest) -> Result<RefundReceipt, GatewayError> {
        let key = refund_key(&r.idempotency_key);
        let refund: RzpRefund = read_json(
            NAME,
            self.http
                .post(format!("{}/v1/payments/{}/refund", self.api, r.payment_id))
                .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                // Razorpay deduplicates refunds on this header (`receipt` is a reference
                // only): a retry after a timeout is the same refund, not a second one.
                .header("X-Refund-Idempotency", &key)
                .json(&serde_json::json!({
                    "amount": minor(&r.amount)?,
                    "receipt": key,
                }))
                .send()
                .await,
            rzp_error,
        )
        .await?;
        Ok(RefundReceipt {
            refund_id: refund.id,
            succeeded: refund.status.as_deref() == Some("processed"),
        })
    }
}

impl RazorpayGateway {
    async fn refund_state(&self, q: &RefundQuery) -> Result<RefundOutcome, GatewayError> {
        let refund: RzpRefund = read_json(
            NAME,
            self.http
                .get(format!(
                    "{}/v1/payments/{}/refunds/{}",
                    self.api, q.payment_id, q.refund_id
                ))
                .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                .send()
                .await,
            rzp_error,
        )
        .await?;
        Ok(match refund.status.as_deref() {
            Some("processed") => RefundOutcome::Succeeded,
            Some("failed") => RefundOutcome::Failed,
            _ => RefundOutcome::Pending,
        })
    }
}

impl RazorpayGateway {
    /// The dispute entity (`GET /v1/disputes/{id}`).
    async fn dispute_state(&self, q: &DisputeQuery) -> Result<Option<DisputeStatus>, GatewayError> {
        let dispute: Value = read_json(
            NAME,
            self.http
                .get(format!("{}/v1/disputes/{}", self.api, q.dispute_id))
                .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                .send()
                .await,
            rzp_error,
        )
        .await?;
        let status = dispute.get("status").and_then(Value::as_str).unwrap_or("");
        // A closed dispute ended by a refund or on the transaction's details: its payment says
        // which (`events::closed`).
        let payment = if status == "closed" {
            let id = dispute
                .get("payment_id")
                .and_then(Value::as_str)
                .unwrap_or(&q.payment_id);
            Some(
                read_json::<Value>(
                    NAME,
                    self.http
                        .get(format!("{}/v1/payments/{id}", self.api))
                        .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                        .send()
                        .await,
                    rzp_error,
                )
                .await?,
            )
        } else {
            None
        };
        Ok(dispute_status(status, &dispute, payment.as_ref()))
    }
}

impl RazorpayGateway {
    /// `POST /v1/subscriptions/{id}/cancel`, now or at the end of the cycle paid
    /// (`cancel_at_cycle_end`). Razorpay refuses to cancel a subscription that has ended
    /// already (400): asking again must change nothing, so such a refusal is checked against
    /// the subscription itself, and one that has ended is what was asked.
    async fn end_subscription(
        &self,
        subscription: &str,
        _seller_account: Option<&str>,
        at_period_end: bool,
    ) -> Result<SubscriptionEnd, GatewayError> {
        end_checked(self.ask_to_end(subscription, at_period_end), || {
            self.subscription_ended(subscription)
        })
        .await
    }

    /// Whether Razorpay has the subscription and it has ended (`GET /v1/subscriptions/{id}`).
    async fn subscription_ended(&self, subscription: &str) -> Result<bool, GatewayError> {
        #[derive(Deserialize)]
        struct Subscription {
            status: Option<String>,
        }
        let s: Subscription = read_json(
            NAME,
            self.http
                .get(format!("{}/v1/subscriptions/{subscription}", self.api))
                .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                .send()
                .await,
            rzp_error,
        )
        .await?;
        Ok(matches!(
            s.status.as_deref(),
            Some("cancelled" | "completed" | "expired")
        ))
    }

    async fn ask_to_end(
        &self,
        subscription: &str,
        at_period_end: bool,
    ) -> Result<(), GatewayError> {
        let _: serde_json::Value = read_json(
            NAME,
            self.http
                .post(format!(
                    "{}/v1/subscriptions/{subscription}/cancel",
                    self.api
                ))
                .basic_auth(&self.key_id, Some(self.key_secret.expose()))
                .json(&serde_json::json!({"cancel_at_cycle_end": u8::from(at_period_end)}))
                .send()
                .await,
            rzp_error,
        )
        .await?;
        Ok(())
    }
}

crate::gateways::api::payment_gateway!(RazorpayGateway, subscriptions);

impl RazorpayGateway {
    fn gateway(&self) -> GatewayName {
        NAME
    }

    /// The gateway's payment status in our words (unknown: pending, logged).
    fn map(&self, raw: &str) -> PaymentStatus {
        match raw {
            "created" | "authorized" | "captured" | "refunded" | "failed" => payment_status(raw),
            other => unknown_status(NAME, other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::refund_key;

    fn razorpay_takes(key: &str) -> bool {
        key.len() >= 10
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    }

    #[test]
    fn refund_keys_are_written_in_razorpays_alphabet_and_stay_distinct() {
        let first = "payfleet-refund-razorpay-order_Rz1";
        let second = "payfleet-refund-razorpay-order_Rz1:pay_Rz2";
        assert_eq!(
            refund_key(first),
            first,
            "a key already valid is sent as it is"
        );
        assert_eq!(
            refund_key(second),
            "payfleet-refund-razorpay-order_Rz1--pay_Rz2"
        );
        let odd = ["r-1", "a:b", "a b/c", "ünï:x"];
        for k in [first, second].into_iter().chain(odd) {
            assert!(razorpay_takes(&refund_key(k)), "{k} -> {}", refund_key(k));
        }
        assert_ne!(refund_key(first), refund_key(second));
    }
}
