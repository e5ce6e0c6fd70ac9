//! Subscriptions: what a paid subscription order starts (docs/state_machine.md). The database
//! starts one in the transaction that confirms the order, whichever path confirms it (migration
//! 0047's trigger), so no confirmation can forget it; this module reads them.
//!
//! Not built yet (issue 21 goes on): renewals (the internal gateway's `subscription_billing`,
//! Stripe's `invoice.paid`, Mercado Pago's and Razorpay's), past due and dunning, cancellation.
//! Until then a subscription stays in its first period, and nothing charges it again.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::PgPool;

use crate::catalogue::{Interval, ProductId, SellerId};
use crate::gateways::GatewayName;
use crate::money::amount_text;

/// A subscription's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, sqlx::Type)]
#[serde(transparent)]
#[sqlx(transparent)]
pub struct SubscriptionId(pub uuid::Uuid);

impl std::fmt::Display for SubscriptionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for SubscriptionId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        uuid::Uuid::parse_str(s.trim()).map(Self)
    }
}

payfleet_queue::text_enum! {
    /// `subscriptions.status` (docs/state_machine.md).
    pub enum SubscriptionStatus {
        /// Paid for its current period.
        Active = "active",
        /// Its last renewal failed; the gateway (or our billing) tries again.
        PastDue = "past_due",
        /// Ended: nothing is charged after it.
        Canceled = "canceled",
    }
}

/// A subscription as clients see it.
#[derive(Debug, Clone, Serialize)]
pub struct SubscriptionView {
    pub id: SubscriptionId,
    pub order_number: i64,
    pub seller_id: SellerId,
    pub buyer_id: String,
    pub product_id: ProductId,
    pub gateway: GatewayName,
    pub interval: Interval,
    /// What each renewal charges.
    pub amount: String,
    pub currency: String,
    pub status: SubscriptionStatus,
    pub current_period_start: DateTime<Utc>,
    pub current_period_end: DateTime<Utc>,
    pub cancel_at_period_end: bool,
    pub canceled_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct Row {
    id: SubscriptionId,
    order_number: i64,
    seller_id: SellerId,
    buyer_id: String,
    product_id: ProductId,
    gateway: GatewayName,
    interval: Interval,
    amount: Decimal,
    currency: String,
    status: SubscriptionStatus,
    current_period_start: DateTime<Utc>,
    current_period_end: DateTime<Utc>,
    cancel_at_period_end: bool,
    canceled_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
}

impl From<Row> for SubscriptionView {
    fn from(r: Row) -> Self {
        Self {
            amount: amount_text(r.amount, &r.currency),
            id: r.id,
            order_number: r.order_number,
            seller_id: r.seller_id,
            buyer_id: r.buyer_id,
            product_id: r.product_id,
            gateway: r.gateway,
            interval: r.interval,
            currency: r.currency,
            status: r.status,
            current_period_start: r.current_period_start,
            current_period_end: r.current_period_end,
            cancel_at_period_end: r.cancel_at_period_end,
            canceled_at: r.canceled_at,
            created_at: r.created_at,
        }
    }
}

const COLUMNS: &str = "id, order_number, seller_id, buyer_id, product_id, gateway, \"interval\",
    amount, currency::text AS currency, status, current_period_start, current_period_end,
    cancel_at_period_end, canceled_at, created_at";

/// Subscription `id`, as clients see it.
pub async fn view(
    pool: &PgPool,
    id: SubscriptionId,
) -> Result<Option<SubscriptionView>, sqlx::Error> {
    let row: Option<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM subscriptions WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(SubscriptionView::from))
}
