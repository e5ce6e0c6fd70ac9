//! Event processing: turns a stored gateway event into the provider's truth (`payment_orders`
//! and its refund and dispute facts) and the order's state, exactly once, in one transaction
//! with the event's processed mark.

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use crate::gateways::{
    self, DisputeStatus, EventError, Fact, GatewayName, Interpretation, MercadoPagoClient,
    MercadoPagoError, PaymentRef, PaymentStatus,
};
use crate::orders;
use crate::queue::{Job, JobError};

/// Processes one row of `payment_events`, named by its (gateway, event id).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessPaymentEvent {
    pub gateway: GatewayName,
    pub event_id: String,
}

impl Job for ProcessPaymentEvent {
    const KIND: &'static str = "process_payment_event";
    const QUEUE: &'static str = "events";
    // With the stored backoff (2^attempt s) 25 attempts span weeks: long enough for a refund
    // that arrived before its payment to wait for it.
    const MAX_ATTEMPTS: i32 = 25;
}

impl ProcessPaymentEvent {
    pub fn key(gateway: GatewayName, event_id: &str) -> String {
        format!("payment_event:{gateway}:{event_id}")
    }
}

/// The provider's truth about a payment, derived from every fact known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PaymentOrderStatus {
    Pending,
    Succeeded,
    Failed,
    PartiallyRefunded,
    Refunded,
    Disputed,
    ChargedBack,
}

impl PaymentOrderStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::PartiallyRefunded => "partially_refunded",
            Self::Refunded => "refunded",
            Self::Disputed => "disputed",
            Self::ChargedBack => "charged_back",
        }
    }

    /// Every state past a success means the money was taken once.
    pub fn implies_paid(&self) -> bool {
        !matches!(self, Self::Pending | Self::Failed)
    }
}

/// Facts known about a payment, whatever order they arrived in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    pub succeeded: bool,
    pub failed: bool,
    pub amount: Option<Decimal>,
    pub refunded: Decimal,
    pub disputes: Vec<DisputeStatus>,
}

/// The derivation: a lost dispute, then an open one, then refunds, then success or failure.
/// A refund or dispute proves the payment succeeded even before its own event arrives; with
/// the amount still unknown a refund counts as partial.
pub fn derive_status(f: &Facts) -> PaymentOrderStatus {
    if f.disputes.contains(&DisputeStatus::Lost) {
        PaymentOrderStatus::ChargedBack
    } else if f.disputes.contains(&DisputeStatus::Open) {
        PaymentOrderStatus::Disputed
    } else if f.refunded > Decimal::ZERO {
        match f.amount {
            Some(a) if f.refunded >= a => PaymentOrderStatus::Refunded,
            _ => PaymentOrderStatus::PartiallyRefunded,
        }
    } else if f.succeeded || !f.disputes.is_empty() {
        PaymentOrderStatus::Succeeded
    } else if f.failed {
        PaymentOrderStatus::Failed
    } else {
        PaymentOrderStatus::Pending
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("payment event {0}:{1} does not exist")]
    NoSuchEvent(GatewayName, String),
    #[error("payment event {id} ({gateway}) cannot be read")]
    Unreadable {
        id: i64,
        gateway: String,
        #[source]
        source: EventError,
    },
    #[error("payment {0} is not known yet; waiting for its payment event")]
    UnknownPayment(String),
    #[error("Mercado Pago events need MERCADOPAGO_ACCESS_TOKEN to fetch the payment")]
    NoMercadoPagoClient,
    #[error("could not fetch the payment from Mercado Pago")]
    MercadoPago(#[from] MercadoPagoError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl From<ProcessError> for JobError {
    fn from(e: ProcessError) -> Self {
        match e {
            // A signed event we cannot read will not read better later: keep it for operators.
            ProcessError::NoSuchEvent(..) | ProcessError::Unreadable { .. } => JobError::fail(e),
            ProcessError::MercadoPago(MercadoPagoError::Event(_)) => JobError::fail(e),
            _ => JobError::retry(e),
        }
    }
}

/// What processing concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed {
    Applied,
    Ignored(String),
    AlreadyProcessed,
}

/// What processing needs beyond the database.
#[derive(Debug, Clone, Default)]
pub struct Processor {
    pub mercadopago: Option<MercadoPagoClient>,
}

#[derive(sqlx::FromRow)]
struct EventRow {
    id: i64,
    raw_body: Vec<u8>,
    processed_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl Processor {
    /// Processes a stored event. Safe to run any number of times, concurrently too: the event row
    /// is locked, and the effects commit with its processed mark or not at all.
    pub async fn process(
        &self,
        pool: &PgPool,
        gateway: GatewayName,
        event: &str,
    ) -> Result<Processed, ProcessError> {
        let row: EventRow = sqlx::query_as(
            "SELECT id, raw_body, processed_at FROM payment_events WHERE gateway = $1 AND event_id = $2",
        )
        .bind(gateway.as_str())
        .bind(event)
        .fetch_optional(pool)
        .await?
        .ok_or_else(|| ProcessError::NoSuchEvent(gateway, event.to_owned()))?;
        if row.processed_at.is_some() {
            return Ok(Processed::AlreadyProcessed);
        }
        let event_id = row.id;
        let unreadable = |source: EventError| ProcessError::Unreadable {
            id: event_id,
            gateway: gateway.to_string(),
            source,
        };
        // Network calls happen before the transaction, never while it holds locks.
        let interpretation =
            match gateways::interpret(gateway, &row.raw_body).map_err(unreadable)? {
                Interpretation::Lookup { resource_id } => {
                    let client = self
                        .mercadopago
                        .as_ref()
                        .ok_or(ProcessError::NoMercadoPagoClient)?;
                    let (payment, facts) = client.payment_facts(&resource_id).await?;
                    if payment.session_id.is_none() {
                        Interpretation::Ignore(format!(
                            "payment {resource_id} has no external_reference"
                        ))
                    } else {
                        Interpretation::Update { payment, facts }
                    }
                }
                other => other,
            };

        let mut tx = pool.begin().await?;
        let processed: Option<Option<chrono::DateTime<chrono::Utc>>> =
            sqlx::query_scalar("SELECT processed_at FROM payment_events WHERE id = $1 FOR UPDATE")
                .bind(event_id)
                .fetch_optional(&mut *tx)
                .await?;
        if processed.flatten().is_some() {
            return Ok(Processed::AlreadyProcessed);
        }
        let result = match interpretation {
            Interpretation::Ignore(reason) => Processed::Ignored(reason),
            Interpretation::Update { payment, facts } => {
                if apply(&mut tx, gateway, &payment, &facts, event_id).await? {
                    Processed::Applied
                } else {
                    Processed::Ignored("every fact was already known".into())
                }
            }
            Interpretation::Lookup { .. } => Processed::Ignored("nothing to look up".into()),
        };
        let (outcome, detail) = match &result {
            Processed::Applied => ("applied", None),
            Processed::Ignored(reason) => ("ignored", Some(reason.as_str())),
            Processed::AlreadyProcessed => ("ignored", None),
        };
        sqlx::query("UPDATE payment_events SET processed_at = now(), outcome = $2, outcome_detail = $3 WHERE id = $1")
            .bind(event_id)
            .bind(outcome)
            .bind(detail)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(result)
    }
}

/// Records the facts, derives the payment's status and brings the order in line. Returns
/// whether anything changed.
async fn apply(
    tx: &mut PgConnection,
    gateway: GatewayName,
    payment: &PaymentRef,
    facts: &[Fact],
    event_id: i64,
) -> Result<bool, ProcessError> {
    let g = gateway.as_str();
    // Find the payment, locking its row so concurrent events of one payment serialise.
    let po_id: i64 = match &payment.session_id {
        Some(session) => {
            sqlx::query_scalar(
                "INSERT INTO payment_orders (gateway, session_id, payment_id) VALUES ($1, $2, $3)
                 ON CONFLICT (gateway, session_id) DO UPDATE
                     SET payment_id = COALESCE(payment_orders.payment_id, EXCLUDED.payment_id)
                 RETURNING id",
            )
            .bind(g)
            .bind(session)
            .bind(&payment.payment_id)
            .fetch_one(&mut *tx)
            .await?
        }
        None => {
            let pid = payment.payment_id.as_deref().unwrap_or_default();
            sqlx::query_scalar(
                "SELECT id FROM payment_orders WHERE gateway = $1 AND payment_id = $2 ORDER BY id LIMIT 1 FOR UPDATE",
            )
            .bind(g)
            .bind(pid)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| ProcessError::UnknownPayment(pid.to_owned()))?
        }
    };

    let mut changed = false;
    for fact in facts {
        let rows = match fact {
            Fact::Payment { status: PaymentStatus::Succeeded, amount } => {
                sqlx::query(
                    "UPDATE payment_orders SET
                         succeeded_at = COALESCE(succeeded_at, now()),
                         amount = COALESCE(amount, $2), currency = COALESCE(currency, $3),
                         payment_id = COALESCE($4, payment_id), updated_at = now()
                     WHERE id = $1 AND (succeeded_at IS NULL OR (amount IS NULL AND $2::numeric IS NOT NULL))",
                )
                .bind(po_id)
                .bind(amount.map(|m| m.amount()))
                .bind(amount.map(|m| m.currency().to_string()))
                .bind(&payment.payment_id)
                .execute(&mut *tx)
                .await?
            }
            Fact::Payment { status: PaymentStatus::Failed, .. } => {
                sqlx::query("UPDATE payment_orders SET failed_at = now(), updated_at = now() WHERE id = $1 AND failed_at IS NULL")
                    .bind(po_id)
                    .execute(&mut *tx)
                    .await?
            }
            Fact::Payment { status: PaymentStatus::Pending, .. } => continue,
            Fact::Refund { refund_id, amount } => {
                sqlx::query(
                    "INSERT INTO payment_refunds (payment_order_id, gateway, refund_id, amount, currency, event_id)
                     VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (gateway, refund_id) DO NOTHING",
                )
                .bind(po_id)
                .bind(g)
                .bind(refund_id)
                .bind(amount.amount())
                .bind(amount.currency().to_string())
                .bind(event_id)
                .execute(&mut *tx)
                .await?
            }
            Fact::Dispute { dispute_id, amount, status } => {
                // A decided dispute stays decided: a late "created" cannot reopen it.
                sqlx::query(
                    "INSERT INTO payment_disputes (payment_order_id, gateway, dispute_id, status, amount, currency)
                     VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (gateway, dispute_id) DO UPDATE SET status = EXCLUDED.status, updated_at = now()
                     WHERE payment_disputes.status = 'open' AND EXCLUDED.status <> 'open'",
                )
                .bind(po_id)
                .bind(g)
                .bind(dispute_id)
                .bind(status.as_str())
                .bind(amount.amount())
                .bind(amount.currency().to_string())
                .execute(&mut *tx)
                .await?
            }
        };
        changed |= rows.rows_affected() > 0;
    }

    let (session_id, succeeded, failed, amount, currency, refunded, disputes): (
        String,
        bool,
        bool,
        Option<Decimal>,
        Option<String>,
        Decimal,
        Vec<String>,
    ) = sqlx::query_as(
        "SELECT po.session_id, po.succeeded_at IS NOT NULL, po.failed_at IS NOT NULL, po.amount, po.currency::text,
                COALESCE((SELECT sum(amount) FROM payment_refunds r WHERE r.payment_order_id = po.id), 0),
                ARRAY(SELECT status FROM payment_disputes d WHERE d.payment_order_id = po.id)
         FROM payment_orders po WHERE po.id = $1",
    )
    .bind(po_id)
    .fetch_one(&mut *tx)
    .await?;
    let facts = Facts {
        succeeded,
        failed,
        amount,
        refunded,
        disputes: disputes
            .iter()
            .map(|s| match s.as_str() {
                "won" => DisputeStatus::Won,
                "lost" => DisputeStatus::Lost,
                _ => DisputeStatus::Open,
            })
            .collect(),
    };
    let status = derive_status(&facts);
    sqlx::query("UPDATE payment_orders SET status = $2, amount_refunded = $3, updated_at = now() WHERE id = $1 AND (status <> $2 OR amount_refunded <> $3)")
        .bind(po_id)
        .bind(status.as_str())
        .bind(refunded)
        .execute(&mut *tx)
        .await?;
    let amount = amount.zip(currency.as_deref());
    let (order_id, order_changed) =
        orders::apply_payment(tx, gateway, &session_id, status, amount, refunded).await?;
    sqlx::query(
        "UPDATE payment_orders SET order_id = $2 WHERE id = $1 AND order_id IS DISTINCT FROM $2",
    )
    .bind(po_id)
    .bind(order_id)
    .execute(&mut *tx)
    .await?;
    Ok(changed || order_changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Decimal {
        s.parse().unwrap()
    }

    #[test]
    fn the_status_does_not_depend_on_arrival_order() {
        let refund_first = Facts {
            refunded: d("10"),
            ..Facts::default()
        };
        assert_eq!(
            derive_status(&refund_first),
            PaymentOrderStatus::PartiallyRefunded
        );
        let both = Facts {
            succeeded: true,
            amount: Some(d("10")),
            refunded: d("10"),
            ..Facts::default()
        };
        assert_eq!(derive_status(&both), PaymentOrderStatus::Refunded);
        let partial = Facts {
            succeeded: true,
            amount: Some(d("10")),
            refunded: d("4"),
            ..Facts::default()
        };
        assert_eq!(
            derive_status(&partial),
            PaymentOrderStatus::PartiallyRefunded
        );
        let failed_then_paid = Facts {
            succeeded: true,
            failed: true,
            amount: Some(d("10")),
            ..Facts::default()
        };
        assert_eq!(
            derive_status(&failed_then_paid),
            PaymentOrderStatus::Succeeded
        );
        let won = Facts {
            succeeded: true,
            disputes: vec![DisputeStatus::Won],
            ..Facts::default()
        };
        assert_eq!(derive_status(&won), PaymentOrderStatus::Succeeded);
        let lost = Facts {
            succeeded: true,
            disputes: vec![DisputeStatus::Won, DisputeStatus::Lost],
            ..Facts::default()
        };
        assert_eq!(derive_status(&lost), PaymentOrderStatus::ChargedBack);
    }
}
