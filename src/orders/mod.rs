//! Orders: the business truth. A payment is an input; the order's state is the result. For now
//! an order record is created by its first payment event; checkout will create it up front.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::PgConnection;

use crate::gateways::GatewayName;
use crate::payment_status::PaymentOrderStatus;

crate::text_enum! {
    /// `orders.status` (docs/state_machine.md).
    pub enum OrderStatus {
        AwaitingPayment = "awaiting_payment",
        PaymentFailed = "payment_failed",
        Paid = "paid",
        PartiallyRefunded = "partially_refunded",
        Refunded = "refunded",
        Disputed = "disputed",
        ChargedBack = "charged_back",
        Expired = "expired",
        Cancelled = "cancelled",
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Order {
    pub id: i64,
    pub gateway: String,
    pub session_id: String,
    pub status: OrderStatus,
    pub currency: Option<String>,
    pub total: Option<Decimal>,
    pub amount_refunded: Decimal,
    pub paid_at: Option<DateTime<Utc>>,
}

/// The order status a payment status leads to, from the current one. A pending payment
/// changes nothing; a failed attempt only marks an order still waiting for payment.
pub fn next_status(current: OrderStatus, payment: PaymentOrderStatus) -> OrderStatus {
    match payment {
        PaymentOrderStatus::Pending => current,
        PaymentOrderStatus::Failed => match current {
            OrderStatus::AwaitingPayment => OrderStatus::PaymentFailed,
            other => other,
        },
        PaymentOrderStatus::Succeeded => OrderStatus::Paid,
        PaymentOrderStatus::PartiallyRefunded => OrderStatus::PartiallyRefunded,
        PaymentOrderStatus::Refunded => OrderStatus::Refunded,
        PaymentOrderStatus::Disputed => OrderStatus::Disputed,
        PaymentOrderStatus::ChargedBack => OrderStatus::ChargedBack,
    }
}

/// Brings the order of a payment session in line with the payment's derived state, inside the
/// caller's transaction. Returns whether the order changed. Applying the same state twice
/// changes nothing: `paid_at` is set once.
pub async fn apply_payment(
    tx: &mut PgConnection,
    gateway: GatewayName,
    session_id: &str,
    payment: PaymentOrderStatus,
    amount: Option<(Decimal, &str)>,
    refunded: Decimal,
) -> Result<(i64, bool), sqlx::Error> {
    let order: Order = sqlx::query_as(
        "INSERT INTO orders (gateway, session_id, total, currency) VALUES ($1, $2, $3, $4)
         ON CONFLICT (gateway, session_id) DO UPDATE SET
             total = COALESCE(orders.total, EXCLUDED.total),
             currency = COALESCE(orders.currency, EXCLUDED.currency)
         RETURNING id, gateway, session_id, status, currency::text, total, amount_refunded, paid_at",
    )
    .bind(gateway.as_str())
    .bind(session_id)
    .bind(amount.map(|a| a.0))
    .bind(amount.map(|a| a.1))
    .fetch_one(&mut *tx)
    .await?;
    let status = next_status(order.status, payment);
    let paid = payment.implies_paid();
    let changed = status != order.status
        || refunded != order.amount_refunded
        || (paid && order.paid_at.is_none());
    if changed {
        sqlx::query(
            "UPDATE orders SET status = $2, amount_refunded = $3,
                 paid_at = CASE WHEN $4 THEN COALESCE(paid_at, now()) ELSE paid_at END,
                 updated_at = now()
             WHERE id = $1",
        )
        .bind(order.id)
        .bind(status)
        .bind(refunded)
        .bind(paid)
        .execute(&mut *tx)
        .await?;
    }
    Ok((order.id, changed))
}

pub async fn by_session(
    db: &sqlx::PgPool,
    gateway: GatewayName,
    session_id: &str,
) -> Result<Option<Order>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, gateway, session_id, status, currency::text, total, amount_refunded, paid_at
         FROM orders WHERE gateway = $1 AND session_id = $2",
    )
    .bind(gateway.as_str())
    .bind(session_id)
    .fetch_optional(db)
    .await
}
