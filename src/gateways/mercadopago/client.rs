//! Mercado Pago's API: the payment a notification names (its facts), preferences (the
//! session), refunds, mediations.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::events::payment_status;
use crate::gateways::api::{
    DisputeQuery, GatewayError, PaymentState, RefundOutcome, RefundQuery, RefundReceipt,
    RefundRequest, Session, SessionRequest, SubscriptionEnd, UndeliveredEvent, end_checked,
    read_json, unknown_status,
};
use crate::gateways::{
    DisputeStatus, EventError, Fact, GatewayName, Interpretation, LookupResource, PaymentRef,
    PaymentStatus, Period, Renewal, SubscriptionChange,
};
use crate::money::{Money, MoneyError};
use crate::secret::Secret;

#[derive(Debug, thiserror::Error)]
pub enum MercadoPagoError {
    #[error("request to Mercado Pago failed")]
    Http(#[from] reqwest::Error),
    #[error("Mercado Pago answered {0} for {1}")]
    Status(u16, String),
    #[error("Mercado Pago's payment does not read as documented")]
    Event(#[from] EventError),
}

impl MercadoPagoError {
    /// Worth asking again later: the network, a timeout, Mercado Pago's own trouble, a rate
    /// limit, or a payment not visible yet (its notification can arrive before the API has it).
    /// A refused token or a payment that does not read as documented will not improve.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Http(e) => !e.is_decode(),
            Self::Status(code, _) => *code == 404 || *code == 429 || *code >= 500,
            Self::Event(_) => false,
        }
    }
}

impl From<MoneyError> for MercadoPagoError {
    fn from(e: MoneyError) -> Self {
        Self::Event(EventError::Money(e))
    }
}

/// The part of the Payments API the event processor needs.
#[derive(Debug, Clone)]
pub struct MercadoPagoClient {
    base_url: String,
    access_token: Secret,
    http: reqwest::Client,
}

#[derive(Deserialize)]
struct Payment {
    id: Value,
    status: String,
    /// What stage a `charged_back` payment's chargeback is at (see [`mediation_status`]).
    status_detail: Option<String>,
    transaction_amount: Option<Value>,
    currency_id: Option<String>,
    external_reference: Option<String>,
    #[serde(default)]
    refunds: Vec<Refund>,
    /// `{"type": "SUBSCRIPTIONS", ...}` on a preapproval's charge.
    point_of_interaction: Option<Value>,
}

/// An amount as Mercado Pago writes it (a number and a currency id), where both are there and
/// read.
fn amount_of(amount: Option<&Value>, currency: Option<&str>) -> Option<Money> {
    let d = decimal(amount?).ok()?;
    Money::new(d, currency?.parse().ok()?).ok()
}

/// How a renewal's session names its preapproval charge: `authorized_payment:{id}`.
const AUTHORIZED_PAYMENT: &str = "authorized_payment:";

/// Whether `session_id` names a preapproval's charge (a renewal's session), not a preference.
pub fn is_renewal_session(session_id: &str) -> bool {
    session_id.starts_with(AUTHORIZED_PAYMENT)
}

/// A preapproval's charge for one period (`GET /authorized_payments/{id}`).
#[derive(Deserialize)]
struct AuthorizedPayment {
    id: Value,
    preapproval_id: String,
    external_reference: Option<String>,
    transaction_amount: Option<Value>,
    currency_id: Option<String>,
    debit_date: Option<String>,
    payment: Option<ChargedPayment>,
}

#[derive(Deserialize)]
struct ChargedPayment {
    id: Value,
    status: String,
}

/// A page of a preapproval's charges (`GET /authorized_payments/search`).
#[derive(Deserialize)]
struct AuthorizedPage {
    paging: Option<Paging>,
    results: Vec<AuthorizedPayment>,
}

#[derive(Deserialize)]
struct Paging {
    total: Option<i64>,
}

/// Most pages of a preapproval's charges read when one of its periods is asked about.
const AUTHORIZED_PAGES: i64 = 10;
/// Charges a page.
const AUTHORIZED_PAGE: i64 = 50;

/// A preapproval (`GET /preapproval/{id}`).
#[derive(Deserialize)]
struct Preapproval {
    id: String,
    status: String,
    external_reference: Option<String>,
}

#[derive(Deserialize)]
struct Refund {
    id: Value,
    amount: Value,
    status: Option<String>,
}

/// The API sends amounts as JSON numbers; serde_json prints back the shortest text that
/// round-trips, which is the text sent for any amount with a few decimals.
fn decimal(v: &Value) -> Result<rust_decimal::Decimal, EventError> {
    let text = match v {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        _ => return Err(EventError::Missing("a numeric amount")),
    };
    text.parse()
        .map_err(|_| EventError::Missing("a numeric amount"))
}

fn id_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl MercadoPagoClient {
    /// The same client waiting at most `timeout` for an answer (a test's impatient client).
    pub fn with_timeout(mut self, timeout: Duration) -> Result<Self, reqwest::Error> {
        self.http = crate::gateways::http_client(timeout)?;
        Ok(self)
    }

    pub fn new(base_url: &str, access_token: Secret) -> Result<Self, MercadoPagoError> {
        Ok(Self {
            base_url: base_url.trim_end_matches('/').to_owned(),
            access_token,
            http: crate::gateways::http_client(Duration::from_secs(10))?,
        })
    }

    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        what: String,
    ) -> Result<T, MercadoPagoError> {
        let resp = self
            .http
            .get(format!("{}{path}", self.base_url))
            .bearer_auth(self.access_token.expose())
            .send()
            .await?;
        if !resp.status().is_success() {
            return Err(MercadoPagoError::Status(resp.status().as_u16(), what));
        }
        Ok(resp.json().await?)
    }

    /// Fetches what a notification names and states what it establishes: a payment's facts; a
    /// preapproval's charge as the renewal of its period (the preapproval's `external_reference`
    /// names the session of the subscription's first payment, as the platform set it); a
    /// preapproval's end.
    pub async fn look_up(
        &self,
        resource: LookupResource,
        id: &str,
    ) -> Result<Interpretation, MercadoPagoError> {
        match resource {
            LookupResource::Payment | LookupResource::DisputedPayment => {
                let disputed = resource == LookupResource::DisputedPayment;
                let p: Payment = self
                    .get(&format!("/v1/payments/{id}"), format!("payment {id}"))
                    .await?;
                let of_subscription = p
                    .point_of_interaction
                    .as_ref()
                    .and_then(|v| v.get("type"))
                    .and_then(Value::as_str)
                    == Some("SUBSCRIPTIONS");
                let approved = p.status == "approved";
                let (mut payment, facts) = payment_facts(p)?;
                if of_subscription {
                    // Its authorized payment's notification reports the charge as its period's
                    // renewal; read here, its external_reference (the first payment's session)
                    // would make it a second payment of that session. What only this payment
                    // tells, its refunds and its mediation, is the renewal's: applied to it by
                    // the payment's id alone (waiting for the renewal to be known if need be).
                    // An approved charge's notification says nothing of that kind: its "won"
                    // only decides a mediation there was, and every charge's notification
                    // would wait on a renewal that may never be known here (a preapproval of
                    // someone else's). A mediation still open here is asked about by
                    // reconciliation (`DisputedPayment`), where that "won" is its decision.
                    let says_more = |f: &Fact| match f {
                        Fact::Payment { .. } => false,
                        Fact::DisputeDecided {
                            status: DisputeStatus::Won,
                            ..
                        } => !approved || disputed,
                        _ => true,
                    };
                    let facts: Vec<Fact> = facts.into_iter().filter(says_more).collect();
                    if facts.is_empty() {
                        return Ok(Interpretation::Ignore(format!(
                            "payment {id} is a preapproval's charge: its authorized payment reports it"
                        )));
                    }
                    payment.session_id = None;
                    return Ok(Interpretation::Update { payment, facts });
                }
                Ok(if payment.session_id.is_none() {
                    Interpretation::Ignore(format!("payment {id} has no external_reference"))
                } else {
                    Interpretation::Update { payment, facts }
                })
            }
            LookupResource::AuthorizedPayment => {
                let a: AuthorizedPayment = self
                    .get(
                        &format!("/authorized_payments/{id}"),
                        format!("authorized payment {id}"),
                    )
                    .await?;
                Ok(authorized_payment(a)?)
            }
            LookupResource::Preapproval => {
                let p: Preapproval = self
                    .get(&format!("/preapproval/{id}"), format!("preapproval {id}"))
                    .await?;
                Ok(if p.status == "cancelled" {
                    Interpretation::Subscription {
                        subscription: p.id,
                        first_session: p.external_reference.filter(|s| !s.is_empty()),
                        change: SubscriptionChange::Canceled,
                    }
                } else {
                    Interpretation::Ignore(format!("preapproval {} is {}", p.id, p.status))
                })
            }
        }
    }
}

/// A preapproval's charge, as the renewal of the period starting on its debit date.
fn authorized_payment(a: AuthorizedPayment) -> Result<Interpretation, EventError> {
    let Some(first_session) = a.external_reference.filter(|s| !s.is_empty()) else {
        return Ok(Interpretation::Ignore(format!(
            "preapproval {} names no first payment (external_reference)",
            a.preapproval_id
        )));
    };
    let Some(charged) = a.payment else {
        return Ok(Interpretation::Ignore(format!(
            "authorized payment {} is not charged yet",
            id_text(&a.id)
        )));
    };
    let status = payment_status(&charged.status);
    let amount = match status {
        PaymentStatus::Pending => {
            return Ok(Interpretation::Ignore(format!(
                "authorized payment {}'s charge is {}",
                id_text(&a.id),
                charged.status
            )));
        }
        PaymentStatus::Failed => None,
        PaymentStatus::Succeeded => {
            let currency = a
                .currency_id
                .as_deref()
                .ok_or(EventError::Missing("currency_id"))?;
            let amount = a
                .transaction_amount
                .as_ref()
                .ok_or(EventError::Missing("transaction_amount"))?;
            Some(Money::new(decimal(amount)?, currency.parse()?)?)
        }
    };
    let start = a
        .debit_date
        .as_deref()
        .and_then(|d| chrono::DateTime::parse_from_rfc3339(d).ok())
        .ok_or(EventError::Missing("debit_date"))?
        .with_timezone(&chrono::Utc);
    Ok(Interpretation::Renewal {
        renewal: Renewal {
            subscription: a.preapproval_id,
            first_session: Some(first_session),
            period: Some(Period { start, end: None }),
            fee: None,
            url: None,
            due: None,
        },
        payment: PaymentRef {
            session_id: Some(format!("{AUTHORIZED_PAYMENT}{}", id_text(&a.id))),
            payment_id: Some(id_text(&charged.id)),
        },
        facts: vec![Fact::Payment { status, amount }],
    })
}

/// What a payment establishes: its status, and each refund and dispute it carries, with stable
/// ids so a second look records nothing new.
fn payment_facts(p: Payment) -> Result<(PaymentRef, Vec<Fact>), EventError> {
    let currency = p
        .currency_id
        .as_deref()
        .ok_or(EventError::Missing("currency_id"))?;
    let amount = match &p.transaction_amount {
        Some(a) => Some(Money::new(decimal(a)?, currency.parse()?)?),
        None => None,
    };
    let status = payment_status(&p.status);
    let mut facts = vec![Fact::Payment {
        status,
        amount: if status == PaymentStatus::Succeeded {
            amount
        } else {
            None
        },
    }];
    for r in p
        .refunds
        .iter()
        .filter(|r| r.status.as_deref().is_none_or(|s| s == "approved"))
    {
        facts.push(Fact::Refund {
            refund_id: id_text(&r.id),
            amount: Money::new(decimal(&r.amount)?, currency.parse()?)?,
        });
    }
    // A mediation is a dispute: `in_mediation` opens it; it ends won when the payment is
    // `approved` again, lost as a chargeback (`charged_back`), or lost as a refund
    // (`refunded`: the refunds above carry the money; the dispute keeps taken only what they do
    // not cover).
    let dispute_id = format!("mp-{}", id_text(&p.id));
    match (
        mediation_status(&p.status, p.status_detail.as_deref()),
        amount,
    ) {
        // Opened or lost: the mediation takes its amount.
        (Some(status @ (DisputeStatus::Open | DisputeStatus::Lost)), Some(amount)) => {
            facts.push(Fact::Dispute {
                dispute_id,
                amount,
                status: Some(status),
            })
        }
        // Won or ended as a refund: it decides a mediation there was, if any.
        (Some(status @ (DisputeStatus::Won | DisputeStatus::Refunded)), _) => {
            facts.push(Fact::DisputeDecided { dispute_id, status })
        }
        _ => {}
    }
    let payment = PaymentRef {
        session_id: p.external_reference.filter(|s| !s.is_empty()),
        payment_id: Some(id_text(&p.id)),
    };
    Ok((payment, facts))
}

/// A payment's status as its mediation's: `in_mediation` open, approved (again) won,
/// `refunded` ended as a refund (the refunds carry the money). A chargeback stays
/// `charged_back` from its start to its end; its `status_detail` says where it stands:
/// `in_process` still open (the amount is held, not taken), `reimbursed` decided for the seller
/// (Mercado Pago covered it), `settled` (or no detail, as older answers give) lost. A detail we
/// do not know holds the amount as an open dispute does, rather than taking it for good: a
/// decided dispute never changes again.
fn mediation_status(payment_status: &str, detail: Option<&str>) -> Option<DisputeStatus> {
    match (payment_status, detail) {
        ("in_mediation", _) => Some(DisputeStatus::Open),
        ("approved", _) => Some(DisputeStatus::Won),
        ("charged_back", None | Some("settled")) => Some(DisputeStatus::Lost),
        ("charged_back", Some("reimbursed")) => Some(DisputeStatus::Won),
        ("charged_back", Some(other)) => {
            if other != "in_process" {
                tracing::warn!(gateway = %NAME, detail = other, "a chargeback at a stage we do not know: held as open");
            }
            Some(DisputeStatus::Open)
        }
        ("refunded", _) => Some(DisputeStatus::Refunded),
        _ => None,
    }
}

// ---- the gateway: preferences (the link), payment search (status), refunds ------------------

const NAME: GatewayName = GatewayName::MercadoPago;

/// Mercado Pago's error body: `{"message", "error", "status", "cause": [...]}`.
fn mp_error(body: &Value) -> (Option<String>, Option<String>) {
    (
        body["error"].as_str().map(str::to_owned),
        body["message"].as_str().map(str::to_owned),
    )
}

/// A JSON number with the amount's decimal text (Mercado Pago takes amounts as numbers).
fn number(m: &Money) -> Value {
    m.amount()
        .to_string()
        .parse::<serde_json::Number>()
        .map(Value::Number)
        .unwrap_or(Value::Null)
}

#[derive(Deserialize)]
struct Preference {
    init_point: String,
}

#[derive(Deserialize)]
struct Search {
    #[serde(default)]
    results: Vec<Payment>,
}

#[derive(Deserialize)]
struct RefundAnswer {
    id: Value,
    status: Option<String>,
}

impl MercadoPagoClient {
    /// Our session is the preference's `external_reference`, which every payment made through
    /// it carries back (that is how events find their order).
    async fn create(&self, r: &SessionRequest) -> Result<Session, GatewayError> {
        let session_id = r.reference.clone();
        let body = serde_json::json!({
            "items": [{
                "title": r.description,
                "quantity": 1,
                "unit_price": number(&r.amount),
                "currency_id": r.amount.currency(),
            }],
            "external_reference": session_id,
            "marketplace_fee": number(&r.platform_fee),
            "expires": true,
            "expiration_date_to": r.expires_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            "metadata": r.metadata,
        });
        let pref: Preference = read_json(
            NAME,
            self.http
                .post(format!("{}/checkout/preferences", self.base_url))
                .bearer_auth(self.access_token.expose())
                .header("X-Idempotency-Key", &r.idempotency_key)
                .json(&body)
                .send()
                .await,
            mp_error,
        )
        .await?;
        Ok(Session {
            session_id,
            url: pref.init_point,
        })
    }

    async fn read(
        &self,
        session_id: &str,
        _seller_account: Option<&str>,
    ) -> Result<PaymentState, GatewayError> {
        // A preapproval's charge for one period (a renewal's session): its charges carry the
        // subscription's `external_reference`, not this session's, so a search by it finds
        // none; the authorized payment names its own charge.
        if let Some(id) = session_id.strip_prefix(AUTHORIZED_PAYMENT) {
            return self.read_authorized(id).await;
        }
        let found: Search = read_json(
            NAME,
            self.http
                .get(format!("{}/v1/payments/search", self.base_url))
                .bearer_auth(self.access_token.expose())
                .query(&[
                    ("external_reference", session_id),
                    ("sort", "date_created"),
                    ("criteria", "desc"),
                ])
                .send()
                .await,
            mp_error,
        )
        .await?;
        // The payment that took the money, if any; else the latest attempt.
        let chosen = found
            .results
            .iter()
            .find(|p| payment_status(&p.status) == PaymentStatus::Succeeded)
            .or_else(|| found.results.first());
        let Some(p) = chosen else {
            return Ok(PaymentState {
                status: PaymentStatus::Pending,
                payment_id: None,
                amount: None,
                subscription: None,
            });
        };
        let amount = amount_of(p.transaction_amount.as_ref(), p.currency_id.as_deref());
        Ok(PaymentState {
            status: self.map(&p.status),
            payment_id: Some(id_text(&p.id)),
            amount,
            subscription: None,
        })
    }

    /// A preapproval's charges debited since `since` (`GET
    /// /authorized_payments/search?preapproval_id=…`, page by page), each charged one, approved
    /// or rejected, as the `subscription_authorized_payment` notification that reports it
    /// (processed as that notification is: the authorized payment looked up and read as its
    /// period's renewal), under an id of its own
    /// (`reconciled_authorized_payment:<id>:<paid|failed>`). One not charged yet, or whose
    /// charge is under way, reports nothing. Mercado Pago's collector is the seller's token,
    /// not an account header: `_seller_account` is not read.
    async fn subscription_charges(
        &self,
        preapproval: &str,
        _seller_account: Option<&str>,
        since: chrono::DateTime<chrono::Utc>,
    ) -> Result<Option<(GatewayName, Vec<UndeliveredEvent>)>, GatewayError> {
        let mut events = Vec::new();
        for page in 0..AUTHORIZED_PAGES {
            let offset = page * AUTHORIZED_PAGE;
            let found: AuthorizedPage = read_json(
                NAME,
                self.http
                    .get(format!("{}/authorized_payments/search", self.base_url))
                    .query(&[
                        ("preapproval_id", preapproval.to_owned()),
                        ("offset", offset.to_string()),
                        ("limit", AUTHORIZED_PAGE.to_string()),
                    ])
                    .bearer_auth(self.access_token.expose())
                    .send()
                    .await,
                mp_error,
            )
            .await?;
            let listed = found.results.len() as i64;
            for a in found.results {
                let debited = a
                    .debit_date
                    .as_deref()
                    .and_then(|d| chrono::DateTime::parse_from_rfc3339(d).ok());
                if debited.is_none_or(|d| d < since) {
                    continue;
                }
                let outcome = match a.payment.as_ref().map(|p| payment_status(&p.status)) {
                    Some(PaymentStatus::Succeeded) => "paid",
                    Some(PaymentStatus::Failed) => "failed",
                    _ => continue,
                };
                let id = id_text(&a.id);
                let event_id = format!("reconciled_authorized_payment:{id}:{outcome}");
                let body = serde_json::json!({
                    "id": event_id, "type": "subscription_authorized_payment",
                    "action": "updated", "data": {"id": id},
                });
                events.push(UndeliveredEvent {
                    event_id,
                    event_type: "subscription_authorized_payment".to_owned(),
                    body: serde_json::to_vec(&body).map_err(|source| GatewayError::Decode {
                        gateway: NAME,
                        source,
                    })?,
                });
            }
            let total = found.paging.and_then(|p| p.total).unwrap_or(0);
            if listed < AUTHORIZED_PAGE || offset + listed >= total {
                break;
            }
        }
        Ok(Some((NAME, events)))
    }

    /// Where a preapproval's charge stands (`GET /authorized_payments/{id}`): its payment's
    /// status, id and amount; not charged yet, pending.
    async fn read_authorized(&self, id: &str) -> Result<PaymentState, GatewayError> {
        let a: AuthorizedPayment = read_json(
            NAME,
            self.http
                .get(format!("{}/authorized_payments/{id}", self.base_url))
                .bearer_auth(self.access_token.expose())
                .send()
                .await,
            mp_error,
        )
        .await?;
        let Some(charged) = a.payment else {
            return Ok(PaymentState {
                status: PaymentStatus::Pending,
                payment_id: None,
                amount: None,
                subscription: None,
            });
        };
        let amount = amount_of(a.transaction_amount.as_ref(), a.currency_id.as_deref());
        Ok(PaymentState {
            status: self.map(&charged.status),
            payment_id: Some(id_text(&charged.id)),
            amount,
            subscription: None,
        })
    }

    async fn refund_payment(&self, r: &RefundRequest) -> Result<RefundReceipt, GatewayError> {
        let answer: RefundAnswer = read_json(
            NAME,
            self.http
                .post(format!(
                    "{}/v1/payments/{}/refunds",
                    self.base_url, r.payment_id
                ))
                .bearer_auth(self.access_token.expose())
                .header("X-Idempotency-Key", &r.idempotency_key)
                .json(&serde_json::json!({"amount": number(&r.amount)}))
                .send()
                .await,
            mp_error,
        )
        .await?;
        Ok(RefundReceipt {
            refund_id: id_text(&answer.id),
            succeeded: answer.status.as_deref() == Some("approved"),
        })
    }
}

impl MercadoPagoClient {
    async fn refund_state(&self, q: &RefundQuery) -> Result<RefundOutcome, GatewayError> {
        let refund: RefundAnswer = read_json(
            NAME,
            self.http
                .get(format!(
                    "{}/v1/payments/{}/refunds/{}",
                    self.base_url, q.payment_id, q.refund_id
                ))
                .bearer_auth(self.access_token.expose())
                .send()
                .await,
            mp_error,
        )
        .await?;
        Ok(match refund.status.as_deref() {
            Some("approved") => RefundOutcome::Succeeded,
            Some("rejected") => RefundOutcome::Failed,
            Some("cancelled") => RefundOutcome::Canceled,
            _ => RefundOutcome::Pending,
        })
    }
}

impl MercadoPagoClient {
    /// A mediation is its payment's status (`GET /v1/payments/{id}`): still `in_mediation`, or
    /// decided as the payment's events read it (approved again: won; `charged_back`: lost;
    /// `refunded`: ended as a refund).
    async fn dispute_state(&self, q: &DisputeQuery) -> Result<Option<DisputeStatus>, GatewayError> {
        let p: PaymentStatusOnly = read_json(
            NAME,
            self.http
                .get(format!("{}/v1/payments/{}", self.base_url, q.payment_id))
                .bearer_auth(self.access_token.expose())
                .send()
                .await,
            mp_error,
        )
        .await?;
        Ok(mediation_status(&p.status, p.status_detail.as_deref()))
    }
}

#[derive(Deserialize)]
struct PaymentStatusOnly {
    status: String,
    status_detail: Option<String>,
}

impl MercadoPagoClient {
    /// `PUT /preapproval/{id}` `{"status": "cancelled"}`. A preapproval ends at once: Mercado
    /// Pago keeps no "at the period's end", so that is refused (cancel now instead). A refusal
    /// is checked against the preapproval: one cancelled already is stopped.
    async fn end_subscription(
        &self,
        subscription: &str,
        _seller_account: Option<&str>,
        at_period_end: bool,
    ) -> Result<SubscriptionEnd, GatewayError> {
        if at_period_end {
            // Ended there already (its event lost): it ends here now, as asked or not.
            if self.preapproval_cancelled(subscription).await? {
                return Ok(SubscriptionEnd::AlreadyEnded);
            }
            return Err(GatewayError::Refused(
                "Mercado Pago cannot end a preapproval at its period's end; cancel it now".into(),
            ));
        }
        end_checked(self.ask_to_cancel(subscription), || {
            self.preapproval_cancelled(subscription)
        })
        .await
    }

    /// Whether Mercado Pago has the preapproval, cancelled (`GET /preapproval/{id}`).
    async fn preapproval_cancelled(&self, subscription: &str) -> Result<bool, GatewayError> {
        let p: Preapproval = read_json(
            NAME,
            self.http
                .get(format!("{}/preapproval/{subscription}", self.base_url))
                .bearer_auth(self.access_token.expose())
                .send()
                .await,
            mp_error,
        )
        .await?;
        Ok(p.status == "cancelled")
    }

    async fn ask_to_cancel(&self, subscription: &str) -> Result<(), GatewayError> {
        let _: Value = read_json(
            NAME,
            self.http
                .put(format!("{}/preapproval/{subscription}", self.base_url))
                .bearer_auth(self.access_token.expose())
                .json(&serde_json::json!({"status": "cancelled"}))
                .send()
                .await,
            mp_error,
        )
        .await?;
        Ok(())
    }
}

crate::gateways::api::payment_gateway!(MercadoPagoClient, subscriptions, period_charges);

impl MercadoPagoClient {
    fn gateway(&self) -> GatewayName {
        NAME
    }

    /// The gateway's payment status in our words (unknown: pending, logged).
    fn map(&self, raw: &str) -> PaymentStatus {
        match raw {
            "approved" | "refunded" | "charged_back" | "in_mediation" | "rejected"
            | "cancelled" | "pending" | "in_process" | "authorized" => payment_status(raw),
            other => unknown_status(NAME, other),
        }
    }
}
