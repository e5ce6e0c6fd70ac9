//! Stripe, two ways:
//! - **Connect with direct charges** (the `stripe` gateway): Checkout Sessions are created on the
//!   seller's connected account (`Stripe-Account`), with the platform's fee taken on the charge
//!   itself (`payment_intent_data[application_fee_amount]`, in minor units; for a subscription,
//!   `subscription_data[application_fee_percent]`).
//! - **The internal gateway's acquirer** (`PAYFLEET_INTERNAL_ACQUIRER=stripe`): the platform is
//!   merchant of record and collects on its own Stripe account (no `Stripe-Account`, no
//!   application fee); the seller, fee and net travel in the session's metadata, and the split
//!   is settled in the seller's ledger as for any internal-gateway payment. Stripe's events on
//!   the platform account (no `account` field) are the internal gateway's facts (`payments`).
//!
//! Requests are form-encoded, as Stripe's API takes them, and every POST carries an
//! `Idempotency-Key`.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::gateways::api::{
    DisputeQuery, GatewayError, InvoicePayment, PaymentState, RefundOutcome, RefundQuery,
    RefundReceipt, RefundRequest, Session, SessionRequest, SubscriptionEnd, UndeliveredEvent,
    end_checked, read_json, unknown_status,
};
use crate::gateways::{DisputeStatus, GatewayName, PaymentStatus};
use crate::money::Money;
use crate::secret::Secret;

const NAME: GatewayName = GatewayName::Stripe;

/// On whose Stripe account the money is collected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Collects {
    /// The seller's connected account, the platform's fee on the charge.
    OnSellersAccount,
    /// The platform's own account: the internal gateway's acquirer.
    OnPlatformAccount,
}

#[derive(Debug, Clone)]
pub struct StripeConnect {
    collects: Collects,
    api: String,
    secret_key: Secret,
    success_url: String,
    cancel_url: String,
    http: reqwest::Client,
}

#[derive(Deserialize)]
struct CheckoutSession {
    id: String,
    url: Option<String>,
    payment_status: Option<String>,
    payment_intent: Option<Value>,
    amount_total: Option<i64>,
    currency: Option<String>,
    /// In subscription mode: the subscription it started (its id, or the object if expanded).
    mode: Option<String>,
    subscription: Option<Value>,
}

/// A page of Stripe's events list.
#[derive(Deserialize)]
struct EventPage {
    data: Vec<Value>,
    has_more: bool,
}

/// Most pages of the events list read per account and run (100 events each).
const EVENT_PAGES: usize = 5;

#[derive(Deserialize)]
struct StripeRefund {
    id: String,
    status: Option<String>,
}

/// A Dispute object, as far as we read it.
#[derive(Deserialize)]
struct StripeDispute {
    status: Option<String>,
}

/// Stripe's error body: `{"error": {"type", "code", "message"}}`.
fn stripe_error(body: &Value) -> (Option<String>, Option<String>) {
    let e = &body["error"];
    let code = e["code"]
        .as_str()
        .or_else(|| e["type"].as_str())
        .map(str::to_owned);
    (code, e["message"].as_str().map(str::to_owned))
}

fn minor(m: &Money) -> Result<i64, GatewayError> {
    m.minor_units()
        .ok_or_else(|| GatewayError::Refused(format!("{m} does not fit Stripe's minor units")))
}

impl StripeConnect {
    /// The same client waiting at most `timeout` for an answer (a test's impatient client).
    pub fn with_timeout(mut self, timeout: Duration) -> Result<Self, reqwest::Error> {
        self.http = crate::gateways::http_client(timeout)?;
        Ok(self)
    }

    /// Connect with direct charges. `api`: Stripe's base URL (`https://api.stripe.com`);
    /// `public_url`: where buyers come back.
    pub fn new(api: &str, secret_key: Secret, public_url: &str) -> Result<Self, reqwest::Error> {
        Self::collecting(Collects::OnSellersAccount, api, secret_key, public_url)
    }

    /// The internal gateway's acquirer: Checkout Sessions on the platform's own account.
    pub fn internal_acquirer(
        api: &str,
        secret_key: Secret,
        public_url: &str,
    ) -> Result<Self, reqwest::Error> {
        Self::collecting(Collects::OnPlatformAccount, api, secret_key, public_url)
    }

    fn collecting(
        collects: Collects,
        api: &str,
        secret_key: Secret,
        public_url: &str,
    ) -> Result<Self, reqwest::Error> {
        let public = public_url.trim_end_matches('/');
        Ok(Self {
            collects,
            api: api.trim_end_matches('/').to_owned(),
            secret_key,
            success_url: format!("{public}/orders/paid?session_id={{CHECKOUT_SESSION_ID}}"),
            cancel_url: format!("{public}/orders/cancelled"),
            http: crate::gateways::http_client(Duration::from_secs(15))?,
        })
    }

    fn post(
        &self,
        path: &str,
        account: Option<&str>,
        idempotency_key: &str,
        form: &[(String, String)],
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .post(format!("{}{path}", self.api))
            .bearer_auth(self.secret_key.expose())
            .header("Idempotency-Key", idempotency_key)
            .form(form);
        if let Some(a) = account {
            req = req.header("Stripe-Account", a);
        }
        req
    }

    /// The connected account a request about a seller's payment goes to (none: the platform's).
    fn account<'a>(&self, seller_account: Option<&'a str>) -> Option<&'a str> {
        match self.collects {
            Collects::OnSellersAccount => seller_account,
            Collects::OnPlatformAccount => None,
        }
    }

    /// A coupon of `off` for the first invoice of `r`'s subscription only (`duration=once`,
    /// redeemable once), on the account the session is made on. Its own idempotency key, made
    /// of the session's: asked again, it is the same coupon.
    async fn first_period_coupon(
        &self,
        account: Option<&str>,
        r: &SessionRequest,
        off: &Money,
    ) -> Result<String, GatewayError> {
        #[derive(Deserialize)]
        struct Coupon {
            id: String,
        }
        let form: Vec<(String, String)> = vec![
            ("amount_off".into(), minor(off)?.to_string()),
            (
                "currency".into(),
                off.currency().as_str().to_ascii_lowercase(),
            ),
            ("duration".into(), "once".into()),
            ("max_redemptions".into(), "1".into()),
            (
                "name".into(),
                format!("Order {}: first period", r.order_number),
            ),
        ];
        let key = format!("{}-first-period", r.idempotency_key);
        let coupon: Coupon = read_json(
            NAME,
            self.post("/v1/coupons", account, &key, &form).send().await,
            stripe_error,
        )
        .await?;
        Ok(coupon.id)
    }

    async fn create(&self, r: &SessionRequest) -> Result<Session, GatewayError> {
        let account = match self.collects {
            Collects::OnSellersAccount => Some(r.seller_account.as_deref().ok_or_else(|| {
                GatewayError::Refused(
                    "the seller has no Stripe account (stripe_account) for direct charges".into(),
                )
            })?),
            Collects::OnPlatformAccount => None,
        };
        let fee_on_charge = self.collects == Collects::OnSellersAccount;
        let currency = r.amount.currency().as_str().to_ascii_lowercase();
        // A subscription whose first period is discounted: the price is what every period
        // charges, and the first period's discount a coupon Stripe applies once.
        let first_off = match (&r.recurring_interval, &r.recurring_amount) {
            (Some(_), Some(later)) if later.amount() > r.amount.amount() => Some((
                *later,
                later.checked_sub(&r.amount).ok_or_else(|| {
                    GatewayError::Refused(format!(
                        "a subscription of {later} whose first period costs {}",
                        r.amount
                    ))
                })?,
            )),
            _ => None,
        };
        let price = first_off.map_or(r.amount, |(later, _)| later);
        let mut form: Vec<(String, String)> = vec![
            ("line_items[0][quantity]".into(), "1".into()),
            ("line_items[0][price_data][currency]".into(), currency),
            (
                "line_items[0][price_data][unit_amount]".into(),
                minor(&price)?.to_string(),
            ),
            (
                "line_items[0][price_data][product_data][name]".into(),
                r.description.clone(),
            ),
            ("client_reference_id".into(), r.order_number.to_string()),
            // Stripe takes 30 minutes to 24 hours after the session's creation: the session ends
            // with the order, within those. Counted from the link's first asking, not from now:
            // a retry under the same idempotency key must ask exactly the same, or Stripe
            // refuses it (`idempotency_error`) for a day.
            (
                "expires_at".into(),
                r.expires_at
                    .clamp(
                        r.first_asked_at + chrono::Duration::minutes(31),
                        r.first_asked_at + chrono::Duration::hours(23),
                    )
                    .timestamp()
                    .to_string(),
            ),
            ("success_url".into(), self.success_url.clone()),
            ("cancel_url".into(), self.cancel_url.clone()),
        ];
        match &r.recurring_interval {
            Some(interval) => {
                form.push(("mode".into(), "subscription".into()));
                form.push((
                    "line_items[0][price_data][recurring][interval]".into(),
                    interval.clone(),
                ));
                if let Some((_, off)) = first_off {
                    let coupon = self.first_period_coupon(account, r, &off).await?;
                    form.push(("discounts[0][coupon]".into(), coupon));
                }
                // Subscriptions take the fee as a percentage of each invoice: the later
                // periods' where the first is discounted (their commission, not the first's).
                let (each, fee) = match (&r.recurring_amount, &r.recurring_fee) {
                    (Some(each), Some(fee)) => (each, fee),
                    _ => (&r.amount, &r.platform_fee),
                };
                let percent = if each.is_zero() {
                    rust_decimal::Decimal::ZERO
                } else {
                    (fee.amount() * rust_decimal::Decimal::ONE_HUNDRED / each.amount()).round_dp(2)
                };
                if fee_on_charge {
                    form.push((
                        "subscription_data[application_fee_percent]".into(),
                        percent.to_string(),
                    ));
                }
                for (k, v) in &r.metadata {
                    form.push((format!("subscription_data[metadata][{k}]"), v.clone()));
                }
            }
            None => {
                form.push(("mode".into(), "payment".into()));
                if fee_on_charge {
                    form.push((
                        "payment_intent_data[application_fee_amount]".into(),
                        minor(&r.platform_fee)?.to_string(),
                    ));
                }
                for (k, v) in &r.metadata {
                    form.push((format!("payment_intent_data[metadata][{k}]"), v.clone()));
                }
            }
        }
        for (k, v) in &r.metadata {
            form.push((format!("metadata[{k}]"), v.clone()));
        }
        let session: CheckoutSession = read_json(
            NAME,
            self.post("/v1/checkout/sessions", account, &r.idempotency_key, &form)
                .send()
                .await,
            stripe_error,
        )
        .await?;
        let url = session.url.ok_or_else(|| {
            GatewayError::Refused("Stripe returned a session without a url".into())
        })?;
        Ok(Session {
            session_id: session.id,
            url,
        })
    }

    async fn read(
        &self,
        session_id: &str,
        seller_account: Option<&str>,
    ) -> Result<PaymentState, GatewayError> {
        // A renewal's session is the invoice Stripe's billing made for the period.
        if session_id.starts_with(INVOICE_PREFIX) {
            return self.read_invoice(session_id, seller_account).await;
        }
        let req = self.get(
            &format!("/v1/checkout/sessions/{session_id}"),
            seller_account,
        );
        let s: CheckoutSession = read_json(NAME, req.send().await, stripe_error).await?;
        let amount = match (s.amount_total, s.currency.as_deref()) {
            (Some(units), Some(c)) => Some(
                Money::from_minor(units, c)
                    .map_err(|e| GatewayError::Refused(format!("Stripe's amount: {e}")))?,
            ),
            _ => None,
        };
        let subscription = if s.mode.as_deref() == Some("subscription") {
            id_of(s.subscription)
        } else {
            None
        };
        Ok(PaymentState {
            status: self.map(s.payment_status.as_deref().unwrap_or("")),
            payment_id: id_of(s.payment_intent),
            amount,
            subscription,
        })
    }

    /// Stripe's events list, `delivery_success=false`: events still being retried or given up
    /// on, newest first, on the connected account when given.
    /// The internal gateway's acquirer keeps no such list here: its undelivered events are
    /// Stripe's, which reconciliation would store as the internal gateway's; each of its
    /// sessions is asked about instead.
    async fn undelivered(
        &self,
        since: chrono::DateTime<chrono::Utc>,
        account: Option<&str>,
        pace: Duration,
    ) -> Result<Option<Vec<UndeliveredEvent>>, GatewayError> {
        if self.collects == Collects::OnPlatformAccount {
            return Ok(None);
        }
        let mut events = Vec::new();
        let mut after: Option<String> = None;
        for page in 0..EVENT_PAGES {
            if page > 0 {
                tokio::time::sleep(pace).await;
            }
            let mut query = vec![
                ("delivery_success".to_owned(), "false".to_owned()),
                ("created[gte]".to_owned(), since.timestamp().to_string()),
                ("limit".to_owned(), "100".to_owned()),
            ];
            if let Some(a) = &after {
                query.push(("starting_after".to_owned(), a.clone()));
            }
            let req = self.get("/v1/events", account).query(&query);
            let page: EventPage = read_json(NAME, req.send().await, stripe_error).await?;
            for event in &page.data {
                let (Some(id), Some(kind)) = (event["id"].as_str(), event["type"].as_str()) else {
                    return Err(GatewayError::Refused(
                        "Stripe listed an event without an id or type".into(),
                    ));
                };
                // Stored as its webhook would have come: a connected account's event names it
                // (its routing reads `account`), whether or not the list wrote it.
                let mut event = event.clone();
                if let (Some(a), Some(fields)) = (account, event.as_object_mut()) {
                    fields
                        .entry("account")
                        .or_insert_with(|| Value::String(a.to_owned()));
                }
                events.push(UndeliveredEvent {
                    event_id: id.to_owned(),
                    event_type: kind.to_owned(),
                    body: serde_json::to_vec(&event).map_err(|e| {
                        GatewayError::Refused(format!("Stripe's event does not encode: {e}"))
                    })?,
                });
            }
            match (page.has_more, events.last()) {
                (true, Some(last)) => after = Some(last.event_id.clone()),
                _ => break,
            }
        }
        Ok(Some(events))
    }

    async fn refund_payment(&self, r: &RefundRequest) -> Result<RefundReceipt, GatewayError> {
        let mut form = vec![
            ("payment_intent".to_owned(), r.payment_id.clone()),
            ("amount".to_owned(), minor(&r.amount)?.to_string()),
        ];
        if self.collects == Collects::OnSellersAccount {
            // The platform's fee goes back in proportion, as the ledger books it.
            form.push(("refund_application_fee".to_owned(), "true".to_owned()));
        }
        let refund: StripeRefund = read_json(
            NAME,
            self.post(
                "/v1/refunds",
                self.account(r.seller_account.as_deref()),
                &r.idempotency_key,
                &form,
            )
            .send()
            .await,
            stripe_error,
        )
        .await?;
        Ok(RefundReceipt {
            refund_id: refund.id,
            succeeded: refund.status.as_deref() == Some("succeeded"),
        })
    }
}

impl StripeConnect {
    async fn refund_state(&self, q: &RefundQuery) -> Result<RefundOutcome, GatewayError> {
        let req = self.get(
            &format!("/v1/refunds/{}", q.refund_id),
            q.seller_account.as_deref(),
        );
        let refund: StripeRefund = read_json(NAME, req.send().await, stripe_error).await?;
        Ok(match refund.status.as_deref() {
            Some("succeeded") => RefundOutcome::Succeeded,
            Some("failed") => RefundOutcome::Failed,
            Some("canceled") => RefundOutcome::Canceled,
            _ => RefundOutcome::Pending,
        })
    }
}

impl StripeConnect {
    /// The Dispute object (`GET /v1/disputes/{id}`), on the seller's account for direct charges.
    async fn dispute_state(&self, q: &DisputeQuery) -> Result<Option<DisputeStatus>, GatewayError> {
        let req = self.get(
            &format!("/v1/disputes/{}", q.dispute_id),
            q.seller_account.as_deref(),
        );
        let dispute: StripeDispute = read_json(NAME, req.send().await, stripe_error).await?;
        Ok(dispute
            .status
            .as_deref()
            .and_then(super::events::dispute_status))
    }
}

crate::gateways::api::payment_gateway!(StripeConnect, undelivered, subscriptions);

/// A page of an invoice's payments (`GET /v1/invoice_payments`), as far as we read it.
#[derive(Deserialize)]
struct InvoicePayments {
    data: Vec<InvoicePaymentRow>,
}

#[derive(Deserialize)]
struct InvoicePaymentRow {
    status: Option<String>,
    payment: Option<InvoicePaymentRef>,
}

#[derive(Deserialize)]
struct InvoicePaymentRef {
    /// The PaymentIntent: its id, or the object itself when expanded.
    payment_intent: Option<Value>,
}

/// How Stripe's invoice ids begin: a renewal's session is its period's invoice.
const INVOICE_PREFIX: &str = "in_";

/// An invoice (`GET /v1/invoices/{id}`), as far as reconciliation reads it.
#[derive(Deserialize)]
struct Invoice {
    /// `draft`, `open` (unpaid so far: Stripe's billing may retry it), `paid`, `void`,
    /// `uncollectible`.
    status: Option<String>,
    amount_paid: Option<i64>,
    currency: Option<String>,
    /// Before API version 2025-03-31: the PaymentIntent that pays it (its id, or the object if
    /// expanded). Since, the invoice's payments are a list of their own.
    payment_intent: Option<Value>,
}

/// An expandable field's id: the id itself, or the expanded object's.
fn id_of(v: Option<Value>) -> Option<String> {
    match v {
        Some(Value::String(id)) => Some(id),
        Some(Value::Object(o)) => o.get("id").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

impl StripeConnect {
    /// A `GET` of the API's `path`, on the seller's account for direct charges.
    fn get(&self, path: &str, seller_account: Option<&str>) -> reqwest::RequestBuilder {
        let req = self
            .http
            .get(format!("{}{path}", self.api))
            .bearer_auth(self.secret_key.expose());
        match self.account(seller_account) {
            Some(a) => req.header("Stripe-Account", a),
            None => req,
        }
    }

    /// A renewal's state, from the invoice Stripe's billing made for its period: what
    /// reconciliation asks when the invoice's `invoice.paid` never came, the first one or a
    /// retry's after a failure Stripe reported (Smart Retries charge the same invoice again,
    /// days later). Paid: with the PaymentIntent that paid it, which the period's refunds and
    /// disputes name (on API versions since 2025-03-31, from the invoice's payments). Open (a
    /// retry may still come) or a draft: pending; voided or uncollectible: failed. An invoice
    /// paid with nothing charged (a credit, a 100 % coupon) has no payment to record: pending,
    /// as its webhook is ignored.
    async fn read_invoice(
        &self,
        invoice: &str,
        seller_account: Option<&str>,
    ) -> Result<PaymentState, GatewayError> {
        let req = self.get(&format!("/v1/invoices/{invoice}"), seller_account);
        let i: Invoice = read_json(NAME, req.send().await, stripe_error).await?;
        let pending = PaymentState {
            status: PaymentStatus::Pending,
            payment_id: None,
            amount: None,
            subscription: None,
        };
        match i.status.as_deref().unwrap_or("") {
            "paid" => {}
            "void" | "uncollectible" => {
                return Ok(PaymentState {
                    status: PaymentStatus::Failed,
                    ..pending
                });
            }
            "open" | "draft" => return Ok(pending),
            other => {
                return Ok(PaymentState {
                    status: unknown_status(NAME, other),
                    ..pending
                });
            }
        }
        let amount = match (i.amount_paid, i.currency.as_deref()) {
            (Some(units), Some(c)) if units > 0 => Money::from_minor(units, c)
                .map_err(|e| GatewayError::Refused(format!("Stripe's amount: {e}")))?,
            _ => return Ok(pending),
        };
        let payment_id = match id_of(i.payment_intent) {
            Some(id) => id,
            None => self
                .invoice_paid_by(invoice, seller_account)
                .await?
                .map(|p| p.payment_id)
                // Recorded without it, the period's refunds and disputes would wait for ever:
                // refused (a finding), and asked again at a later run.
                .ok_or_else(|| {
                    GatewayError::Refused(format!(
                        "Stripe says invoice {invoice} is paid but names no payment that paid it"
                    ))
                })?,
        };
        // Not the subscription: a renewal's payment does not start one.
        Ok(PaymentState {
            status: PaymentStatus::Succeeded,
            payment_id: Some(payment_id),
            amount: Some(amount),
            subscription: None,
        })
    }

    /// The invoices Stripe's billing made for `subscription`'s periods since `since` (`GET
    /// /v1/invoices?subscription=…&created[gte]=…`, on the seller's account for direct
    /// charges), each paid or failed for good as the event that reports it: `invoice.paid`, or
    /// `invoice.payment_failed` for one voided or uncollectible after an attempt, under an id
    /// of its own (`reconciled_invoice:<invoice>:<paid|failed>`), with `account` as Stripe
    /// writes it on a connected account's events. The Invoice object is what the event carries.
    /// Only a period's own invoice (`subscription_cycle`): the first is its checkout's, reported
    /// by it, and one for a change within a period (prorations, a threshold) is no period's. An
    /// invoice still open reports nothing, even after an attempt: a bank debit is open while its
    /// payment is processing, and a failure the fleet invented would make the subscription past
    /// due while the money is on its way (its payment, or its end, is found later). For the
    /// platform's endpoint ([`NAME`]) either way: the internal gateway's subscriptions are
    /// billed on its account.
    async fn subscription_charges(
        &self,
        subscription: &str,
        seller_account: Option<&str>,
        since: chrono::DateTime<chrono::Utc>,
    ) -> Result<Option<(GatewayName, Vec<UndeliveredEvent>)>, GatewayError> {
        let created = since.timestamp().to_string();
        let req = self.get("/v1/invoices", seller_account).query(&[
            ("subscription", subscription),
            ("created[gte]", created.as_str()),
            ("limit", "100"),
        ]);
        let page: EventPage = read_json(NAME, req.send().await, stripe_error).await?;
        let account = self.account(seller_account);
        let mut events = Vec::new();
        for invoice in page.data {
            let Some(id) = invoice["id"].as_str().map(str::to_owned) else {
                return Err(GatewayError::Refused(
                    "Stripe listed an invoice without an id".into(),
                ));
            };
            if invoice["billing_reason"].as_str() != Some("subscription_cycle") {
                continue;
            }
            let attempted = invoice["attempt_count"].as_i64().is_some_and(|n| n > 0);
            let (kind, outcome) = match invoice["status"].as_str() {
                Some("paid") => ("invoice.paid", "paid"),
                Some("void" | "uncollectible") if attempted => ("invoice.payment_failed", "failed"),
                _ => continue,
            };
            let event_id = format!("reconciled_invoice:{id}:{outcome}");
            let mut event = serde_json::json!({
                "id": event_id, "object": "event", "type": kind, "data": {"object": invoice},
            });
            if let (Some(a), Some(fields)) = (account, event.as_object_mut()) {
                fields.insert("account".into(), Value::String(a.to_owned()));
            }
            events.push(UndeliveredEvent {
                event_id,
                event_type: kind.to_owned(),
                body: serde_json::to_vec(&event).map_err(|source| GatewayError::Decode {
                    gateway: NAME,
                    source,
                })?,
            });
        }
        Ok(Some((NAME, events)))
    }

    /// The PaymentIntent that paid a subscription's invoice, with the application fee Stripe
    /// took on it: `GET /v1/invoice_payments?invoice=…` with the PaymentIntent expanded, on
    /// the seller's account for direct charges. Since API version 2025-03-31 an Invoice names
    /// neither (its payments are a list of their own, not written into its events), and a
    /// refund or dispute of the period names only the PaymentIntent. The paid one of the
    /// invoice's payments (an invoice keeps its failed attempts too).
    async fn invoice_paid_by(
        &self,
        invoice: &str,
        seller_account: Option<&str>,
    ) -> Result<Option<InvoicePayment>, GatewayError> {
        let req = self.get("/v1/invoice_payments", seller_account).query(&[
            ("invoice", invoice),
            ("expand[]", "data.payment.payment_intent"),
        ]);
        let page: InvoicePayments = read_json(NAME, req.send().await, stripe_error).await?;
        let Some(intent) = page
            .data
            .into_iter()
            .filter(|p| p.status.as_deref() == Some("paid"))
            .find_map(|p| p.payment.and_then(|p| p.payment_intent))
        else {
            return Ok(None);
        };
        let (payment_id, fee) = match &intent {
            Value::String(id) => (id.clone(), None),
            Value::Object(o) => {
                let Some(id) = o.get("id").and_then(Value::as_str) else {
                    return Ok(None);
                };
                let fee = match (
                    o.get("application_fee_amount").and_then(Value::as_i64),
                    o.get("currency").and_then(Value::as_str),
                ) {
                    (Some(units), Some(currency)) => {
                        Some(Money::from_minor(units, currency).map_err(|e| {
                            GatewayError::Refused(format!(
                                "{NAME} answered a fee we cannot read: {e}"
                            ))
                        })?)
                    }
                    _ => None,
                };
                (id.to_owned(), fee)
            }
            _ => return Ok(None),
        };
        Ok(Some(InvoicePayment { payment_id, fee }))
    }
}

impl StripeConnect {
    /// Cancels a subscription on the seller's account: `DELETE /v1/subscriptions/{id}` now, or
    /// `cancel_at_period_end=true` (Stripe then ends it when the period paid ends and sends
    /// `customer.subscription.deleted`). Stripe answers a subscription that has ended already
    /// as missing (`DELETE`, 404 `resource_missing`) or refuses to change it (400): asking
    /// again must change nothing, so such a refusal is checked against the subscription itself,
    /// and one that has ended is what was asked.
    async fn end_subscription(
        &self,
        subscription: &str,
        seller_account: Option<&str>,
        at_period_end: bool,
    ) -> Result<SubscriptionEnd, GatewayError> {
        end_checked(
            self.ask_to_end(subscription, seller_account, at_period_end),
            || self.subscription_ended(subscription, seller_account),
        )
        .await
    }

    /// Whether Stripe has the subscription and it has ended (`GET /v1/subscriptions/{id}`).
    async fn subscription_ended(
        &self,
        subscription: &str,
        seller_account: Option<&str>,
    ) -> Result<bool, GatewayError> {
        #[derive(serde::Deserialize)]
        struct Subscription {
            status: Option<String>,
        }
        let req = self.get(&format!("/v1/subscriptions/{subscription}"), seller_account);
        let s: Subscription = read_json(NAME, req.send().await, stripe_error).await?;
        Ok(matches!(
            s.status.as_deref(),
            Some("canceled" | "incomplete_expired")
        ))
    }

    async fn ask_to_end(
        &self,
        subscription: &str,
        seller_account: Option<&str>,
        at_period_end: bool,
    ) -> Result<(), GatewayError> {
        let account = self.account(seller_account);
        let path = format!("/v1/subscriptions/{subscription}");
        let req = if at_period_end {
            // Without an idempotency key: setting the flag again sets it once. A key of the
            // subscription's own made a second cancellation within Stripe's day (the buyer
            // having resumed the subscription at Stripe since) a replay of the first one's
            // answer that set nothing: recorded cancelled here, billed on there.
            let mut req = self
                .http
                .post(format!("{}{path}", self.api))
                .bearer_auth(self.secret_key.expose())
                .form(&[("cancel_at_period_end", "true")]);
            if let Some(a) = account {
                req = req.header("Stripe-Account", a);
            }
            req
        } else {
            let mut req = self
                .http
                .delete(format!("{}{path}", self.api))
                .bearer_auth(self.secret_key.expose());
            if let Some(a) = account {
                req = req.header("Stripe-Account", a);
            }
            req
        };
        let _: Value = read_json(NAME, req.send().await, stripe_error).await?;
        Ok(())
    }

    fn gateway(&self) -> GatewayName {
        match self.collects {
            Collects::OnSellersAccount => NAME,
            Collects::OnPlatformAccount => GatewayName::Internal,
        }
    }

    /// The gateway's payment status in our words (unknown: pending, logged).
    fn map(&self, raw: &str) -> PaymentStatus {
        match raw {
            "paid" | "no_payment_required" => PaymentStatus::Succeeded,
            "unpaid" => PaymentStatus::Pending,
            other => unknown_status(NAME, other),
        }
    }
}
