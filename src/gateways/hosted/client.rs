//! The internal gateway (and the mock, which behaves the same under another name): payfleet's
//! own, with the platform as merchant of record. The whole amount lands in the platform's
//! account; the split (seller, fee, net) travels in the session's metadata and is settled in the
//! seller's ledger when paid. Its state lives in our database (`internal_payments`,
//! `internal_refunds`) as an outside gateway's would live in theirs, and it reports what happens
//! the way they do: a Standard Webhooks-signed event (`internal_events`), delivered to the
//! receiver by whoever implements [`EventSink`] (a job with retries).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use rust_decimal::Decimal;
use serde_json::json;
use sqlx::{PgConnection, PgPool};

use crate::gateways::api::{
    GatewayError, PaymentState, RefundOutcome, RefundQuery, RefundReceipt, RefundRequest, Session,
    SessionRequest, unknown_status,
};
use crate::gateways::{GatewayName, PaymentStatus};
use crate::money::Money;

/// Receives the events the gateway emits, inside the transaction that produced them, to deliver
/// them once it commits.
pub trait EventSink: Send + Sync {
    fn emitted<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        gateway: GatewayName,
        event_id: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'a>>;
}

/// The buyer's choice on the hosted payment page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
}

/// The subscription and period a renewal's charge is for, carried in its event.
#[derive(Debug, Clone)]
pub struct RenewalCharge {
    pub subscription_id: String,
    pub period_start: chrono::DateTime<chrono::Utc>,
    pub period_end: chrono::DateTime<chrono::Utc>,
}

/// A session of the hosted gateway, as its payment page shows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct HostedPayment {
    pub session_id: String,
    pub gateway: GatewayName,
    pub order_number: i64,
    pub amount: Decimal,
    pub currency: String,
    pub status: String,
    pub payment_id: Option<String>,
}

impl HostedPayment {
    pub fn money(&self) -> Result<Money, crate::money::MoneyError> {
        Money::new(self.amount, self.currency.parse()?)
    }
}

#[derive(Clone)]
pub struct HostedGateway {
    name: GatewayName,
    pool: PgPool,
    public_url: String,
    sink: Arc<dyn EventSink>,
    page_key: [u8; 32],
}

fn random_id(prefix: &str) -> String {
    format!("{prefix}_{:024x}", rand::random::<u128>() >> 32)
}

/// Whether `s` has the shape of a session id this gateway makes (`ips_` or `mps_` and 24 hex
/// digits): anything else is no session, without asking the database.
pub fn is_session_id(s: &str) -> bool {
    s.split_once('_').is_some_and(|(prefix, hex)| {
        matches!(prefix, "ips" | "mps")
            && hex.len() == 24
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

impl HostedGateway {
    /// `name`: internal or mock. Payment pages are served under `public_url`; their forms are
    /// signed with `page_key` (the same in every receiver: derived from the gateway's secret).
    pub fn new(
        name: GatewayName,
        pool: PgPool,
        public_url: &str,
        sink: Arc<dyn EventSink>,
        page_key: [u8; 32],
    ) -> Self {
        Self {
            name,
            pool,
            public_url: public_url.trim_end_matches('/').to_owned(),
            sink,
            page_key,
        }
    }

    /// Which hosted gateway this is (internal or mock).
    pub fn name(&self) -> GatewayName {
        self.name
    }

    /// The key the payment page's form tokens are signed with.
    pub fn page_key(&self) -> [u8; 32] {
        self.page_key
    }

    async fn create(&self, r: &SessionRequest) -> Result<Session, GatewayError> {
        let mut made = self.create_many(std::slice::from_ref(r)).await;
        made.pop()
            .unwrap_or(Err(GatewayError::Database(sqlx::Error::RowNotFound)))
    }

    /// The sessions of many orders: those not made yet in one statement, those made before (by
    /// an earlier request, or a concurrent one) read in one more. A batch that fails as a whole
    /// is made again one by one, where each request's own error shows.
    async fn create_many(&self, requests: &[SessionRequest]) -> Vec<Result<Session, GatewayError>> {
        let session = |id: Option<String>| {
            id.map(|id| self.session(id))
                .ok_or(GatewayError::Database(sqlx::Error::RowNotFound))
        };
        match self.write_sessions(requests).await {
            Ok(made) => made.into_iter().map(session).collect(),
            // Only a refusal of some row is worth making the rest alone; an outage fails all.
            Err(e) if requests.len() == 1 || !crate::db::is_about_the_row(&e) => {
                let e = Arc::new(e);
                requests
                    .iter()
                    .map(|_| Err(GatewayError::SharedDatabase(e.clone())))
                    .collect()
            }
            Err(e) => {
                tracing::warn!(sessions = requests.len(), error = %e, "a batch of sessions failed; each is made alone");
                let mut made = Vec::with_capacity(requests.len());
                for r in requests {
                    made.push(match self.write_sessions(std::slice::from_ref(r)).await {
                        Ok(one) => session(one.into_iter().next().flatten()),
                        Err(e) => Err(e.into()),
                    });
                }
                made
            }
        }
    }

    /// Each request's session id, in the order asked (none: neither made nor found).
    async fn write_sessions(
        &self,
        requests: &[SessionRequest],
    ) -> Result<Vec<Option<String>>, sqlx::Error> {
        let prefix = if self.name == GatewayName::Mock {
            "mps"
        } else {
            "ips"
        };
        let ids: Vec<String> = requests.iter().map(|_| random_id(prefix)).collect();
        let numbers: Vec<i64> = requests.iter().map(|r| r.order_number).collect();
        let attempts: Vec<i32> = requests.iter().map(|r| r.attempt).collect();
        let amounts: Vec<Decimal> = requests.iter().map(|r| r.amount.amount()).collect();
        let currencies: Vec<String> = requests
            .iter()
            .map(|r| r.amount.currency().as_str().to_owned())
            .collect();
        let metadata: Vec<serde_json::Value> = requests
            .iter()
            .map(|r| serde_json::to_value(&r.metadata).unwrap_or_default())
            .collect();
        // Idempotent by order and attempt: a request made before keeps its first session.
        // Committed without waiting for its flush: a link reaches a buyer only once the order
        // side has stored it with a synchronous commit, which flushes this one too (the log is
        // one sequence); lost in a crash before that, the session is made again when the link
        // is asked again.
        let inserted: Vec<String> = sqlx::query_scalar(
            "INSERT INTO internal_payments (session_id, gateway, order_number, attempt, amount, currency, metadata)
             SELECT x.session_id, $2, x.order_number, x.attempt, x.amount, x.currency, x.metadata
             FROM (SELECT set_config('synchronous_commit', 'off', true)) c,
                  unnest($1::text[], $3::bigint[], $4::int[], $5::numeric[], $6::text[], $7::jsonb[])
                    AS x(session_id, order_number, attempt, amount, currency, metadata)
             ON CONFLICT (gateway, order_number, attempt) DO NOTHING
             RETURNING session_id",
        )
        .bind(&ids)
        .bind(self.name)
        .bind(&numbers)
        .bind(&attempts)
        .bind(&amounts)
        .bind(&currencies)
        .bind(&metadata)
        .fetch_all(&self.pool)
        .await?;
        let mut made: Vec<Option<String>> = ids
            .into_iter()
            .map(|id| inserted.contains(&id).then_some(id))
            .collect();
        let missing: Vec<usize> = (0..made.len()).filter(|i| made[*i].is_none()).collect();
        if missing.is_empty() {
            return Ok(made);
        }
        // Made before: a statement of its own sees a concurrent request's committed row.
        let found: Vec<(i64, String)> = sqlx::query_as(
            "SELECT k.i, p.session_id
             FROM unnest($2::bigint[], $3::int[]) WITH ORDINALITY AS k(order_number, attempt, i)
             CROSS JOIN LATERAL (
                 SELECT session_id FROM internal_payments p
                 WHERE p.gateway = $1 AND p.order_number = k.order_number AND p.attempt = k.attempt
             ) p",
        )
        .bind(self.name)
        .bind(missing.iter().map(|i| numbers[*i]).collect::<Vec<_>>())
        .bind(missing.iter().map(|i| attempts[*i]).collect::<Vec<_>>())
        .fetch_all(&self.pool)
        .await?;
        for (k, session_id) in found {
            if let Some(i) = usize::try_from(k - 1).ok().and_then(|k| missing.get(k)) {
                made[*i] = Some(session_id);
            }
        }
        Ok(made)
    }

    fn session(&self, session_id: String) -> Session {
        let url = format!("{}/pay/{session_id}", self.public_url);
        Session { session_id, url }
    }

    async fn read(
        &self,
        session_id: &str,
        _seller_account: Option<&str>,
    ) -> Result<PaymentState, GatewayError> {
        let p = payment(&self.pool, session_id)
            .await?
            .filter(|p| p.gateway == self.name)
            .ok_or_else(|| {
                GatewayError::Refused(format!("no {} session {session_id}", self.name))
            })?;
        Ok(PaymentState {
            status: self.map(&p.status),
            payment_id: p.payment_id.clone(),
            amount: p.money().ok(),
            subscription: None,
        })
    }

    /// Records the buyer's choice on the payment page, once: a session is decided once. Returns
    /// the session as it stands (already decided: unchanged).
    pub async fn decide(
        &self,
        session_id: &str,
        outcome: Outcome,
    ) -> Result<HostedPayment, GatewayError> {
        self.settle(session_id, outcome, None).await
    }

    /// Charges a subscription's renewal on its session, as the gateway's own billing does (the
    /// simulator: `outcome` is its answer), and reports it as `subscription.renewed` or
    /// `subscription.renewal_failed`. Charged once: a session already decided is answered as
    /// it was, and emits nothing more.
    pub async fn charge_renewal(
        &self,
        session_id: &str,
        outcome: Outcome,
        renewal: &RenewalCharge,
    ) -> Result<HostedPayment, GatewayError> {
        self.settle(session_id, outcome, Some(renewal)).await
    }

    async fn settle(
        &self,
        session_id: &str,
        outcome: Outcome,
        renewal: Option<&RenewalCharge>,
    ) -> Result<HostedPayment, GatewayError> {
        let mut tx = self.pool.begin().await?;
        let (status, payment_id) = match outcome {
            Outcome::Succeeded => ("succeeded", Some(random_id("ipay"))),
            Outcome::Failed => ("failed", None),
        };
        let decided: Option<HostedPayment> = sqlx::query_as(
            "UPDATE internal_payments SET status = $3, payment_id = $4, decided_at = now()
             WHERE session_id = $1 AND gateway = $2 AND status = 'pending'
             RETURNING session_id, gateway, order_number, amount, currency::text AS currency, status, payment_id",
        )
        .bind(session_id)
        .bind(self.name)
        .bind(status)
        .bind(&payment_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(p) = decided else {
            return payment(&self.pool, session_id)
                .await?
                .filter(|p| p.gateway == self.name)
                .ok_or_else(|| {
                    GatewayError::Refused(format!("no {} session {session_id}", self.name))
                });
        };
        let kind = match (outcome, renewal) {
            (Outcome::Succeeded, None) => "payment.succeeded",
            (Outcome::Failed, None) => "payment.failed",
            (Outcome::Succeeded, Some(_)) => "subscription.renewed",
            (Outcome::Failed, Some(_)) => "subscription.renewal_failed",
        };
        let mut data = json!({
            "session_id": p.session_id,
            "payment_id": p.payment_id,
            "amount": p.money().map(|m| m.amount().to_string()).unwrap_or_default(),
            "currency": p.currency,
        });
        if let (Some(r), Some(fields)) = (renewal, data.as_object_mut()) {
            fields.insert("subscription_id".into(), json!(r.subscription_id));
            fields.insert("period_start".into(), json!(r.period_start));
            fields.insert("period_end".into(), json!(r.period_end));
        }
        self.emit(&mut tx, kind, data).await?;
        tx.commit().await?;
        Ok(p)
    }

    async fn refund_payment(&self, r: &RefundRequest) -> Result<RefundReceipt, GatewayError> {
        let mut tx = self.pool.begin().await?;
        // The payment's row first: refunds of one payment take turns, so the same refund asked
        // twice at once finds the first one's record instead of racing it.
        let p: Option<HostedPayment> = sqlx::query_as(
            "SELECT session_id, gateway, order_number, amount, currency::text AS currency, status, payment_id
             FROM internal_payments WHERE session_id = $1 AND gateway = $2 FOR UPDATE",
        )
        .bind(&r.session_id)
        .bind(self.name)
        .fetch_optional(&mut *tx)
        .await?;
        // The same refund asked twice is one refund.
        let known: Option<String> =
            sqlx::query_scalar("SELECT refund_id FROM internal_refunds WHERE idempotency_key = $1")
                .bind(&r.idempotency_key)
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(refund_id) = known {
            return Ok(RefundReceipt {
                refund_id,
                succeeded: true,
            });
        }
        let p = p.ok_or_else(|| {
            GatewayError::Refused(format!("no session {} to refund", r.session_id))
        })?;
        let own = p.status == "succeeded" && p.payment_id.as_deref() == Some(r.payment_id.as_str());
        if own {
            if r.amount.currency().as_str() != p.currency {
                return Err(GatewayError::Refused(format!(
                    "a refund in {} of a payment in {}",
                    r.amount.currency(),
                    p.currency
                )));
            }
            let refunded: Decimal = sqlx::query_scalar(
                "SELECT COALESCE(sum(amount), 0) FROM internal_refunds
                 WHERE session_id = $1 AND (payment_id IS NULL OR payment_id = $2)",
            )
            .bind(&r.session_id)
            .bind(&r.payment_id)
            .fetch_one(&mut *tx)
            .await?;
            if refunded + r.amount.amount() > p.amount {
                return Err(GatewayError::Refused(format!(
                    "a refund of {} would exceed the {} {} paid",
                    r.amount, p.amount, p.currency
                )));
            }
        } else {
            // Not the payment this session's page took: one the gateway's signed events reported
            // (a second payment of the session, or one its page never saw). The simulator's
            // events are whatever its secret signs, so it gives back what they reported, as the
            // platform asks (the platform never asks more than the payment it recorded).
            tracing::info!(session = %r.session_id, payment = %r.payment_id, "the simulator gives back a payment its page did not take");
        }
        let refund_id = random_id("irf");
        sqlx::query(
            "INSERT INTO internal_refunds (refund_id, session_id, amount, idempotency_key, payment_id)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&refund_id)
        .bind(&r.session_id)
        .bind(r.amount.amount())
        .bind(&r.idempotency_key)
        .bind(&r.payment_id)
        .execute(&mut *tx)
        .await?;
        let data = json!({
            "session_id": r.session_id,
            "payment_id": r.payment_id,
            "refund_id": refund_id,
            "amount": r.amount.amount().to_string(),
            "currency": r.amount.currency(),
        });
        self.emit(&mut tx, "refund.succeeded", data).await?;
        tx.commit().await?;
        Ok(RefundReceipt {
            refund_id,
            succeeded: true,
        })
    }

    async fn emit(
        &self,
        tx: &mut PgConnection,
        kind: &str,
        data: serde_json::Value,
    ) -> Result<(), GatewayError> {
        let id = random_id("msg");
        sqlx::query("INSERT INTO internal_events (id, gateway, body) VALUES ($1, $2, $3)")
            .bind(&id)
            .bind(self.name)
            .bind(json!({"type": kind, "data": data}))
            .execute(&mut *tx)
            .await?;
        self.sink.emitted(tx, self.name, &id).await?;
        Ok(())
    }
}

/// A hosted session by id, whichever hosted gateway made it.
pub async fn payment(
    pool: &PgPool,
    session_id: &str,
) -> Result<Option<HostedPayment>, sqlx::Error> {
    sqlx::query_as(
        "SELECT session_id, gateway, order_number, amount, currency::text AS currency, status, payment_id
         FROM internal_payments WHERE session_id = $1",
    )
    .bind(session_id)
    .fetch_optional(pool)
    .await
}

/// An event the hosted gateway emitted, to deliver: its gateway and signed body.
pub async fn event(
    pool: &PgPool,
    id: &str,
) -> Result<Option<(GatewayName, serde_json::Value)>, sqlx::Error> {
    sqlx::query_as("SELECT gateway, body FROM internal_events WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await
}

pub async fn mark_delivered(pool: &PgPool, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE internal_events SET delivered_at = COALESCE(delivered_at, now()) WHERE id = $1",
    )
    .bind(id)
    .execute(pool)
    .await
    .map(|_| ())
}

impl HostedGateway {
    /// A refund this gateway made is done at once: it has its record, or it made none.
    async fn refund_state(&self, q: &RefundQuery) -> Result<RefundOutcome, GatewayError> {
        let known: Option<String> = sqlx::query_scalar(
            "SELECT r.refund_id FROM internal_refunds r JOIN internal_payments p ON p.session_id = r.session_id
             WHERE r.refund_id = $1 AND p.gateway = $2",
        )
        .bind(&q.refund_id)
        .bind(self.name)
        .fetch_optional(&self.pool)
        .await?;
        match known {
            Some(_) => Ok(RefundOutcome::Succeeded),
            None => Err(GatewayError::Refused(format!(
                "no {} refund {}",
                self.name, q.refund_id
            ))),
        }
    }
}

impl HostedGateway {
    /// The simulator decides no disputes, so there is nothing to ask. (Where the internal
    /// gateway collects through Stripe, `PAYFLEET_INTERNAL_ACQUIRER=stripe`, it is Stripe's
    /// client, which is asked.)
    async fn dispute_state(
        &self,
        _: &crate::gateways::api::DisputeQuery,
    ) -> Result<Option<crate::gateways::DisputeStatus>, GatewayError> {
        Ok(None)
    }
}

crate::gateways::api::payment_gateway!(HostedGateway, many_sessions);

impl HostedGateway {
    fn gateway(&self) -> GatewayName {
        self.name
    }

    /// The gateway's payment status in our words (unknown: pending, logged).
    fn map(&self, raw: &str) -> PaymentStatus {
        match raw {
            "succeeded" => PaymentStatus::Succeeded,
            "failed" => PaymentStatus::Failed,
            "pending" => PaymentStatus::Pending,
            other => unknown_status(self.name, other),
        }
    }
}
