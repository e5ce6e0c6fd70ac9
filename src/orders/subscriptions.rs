//! Subscriptions: what a paid subscription order starts (docs/state_machine.md). The database
//! starts one in the transaction that confirms the order, whichever path confirms it (migration
//! 0047's trigger), so no confirmation can forget it; this module reads them.
//!
//! Renewals are orders of their own, one per (subscription, period) (`orders.renews`, a unique
//! index): opened here for the subscriptions the fleet bills itself ([`open_due`]), charged by
//! the payment side (`payments::renewals`), confirmed by the same event path as any order. The
//! database moves a subscription between `active` and `past_due` as its current renewal is
//! paid or fails (migration 0048's trigger).
//!
//! A gateway that bills a subscription itself (Stripe) reports each period's charge: its
//! renewal order is opened here when the first event about that period arrives
//! ([`open_reported`]), and the gateway's changes (an end, a cancellation at the period's end)
//! are recorded by [`apply_change`].

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
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
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
    /// Its renewals, oldest period first: each one order of its own.
    pub renewals: Vec<RenewalView>,
}

/// One period's renewal.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RenewalView {
    pub order_number: i64,
    pub period_start: DateTime<Utc>,
    pub period_end: DateTime<Utc>,
    pub amount: String,
    pub currency: String,
    /// `paid`, `failed` (its charge failed, or it expired unpaid), `refunded`, or `pending`
    /// (charged and not answered yet).
    pub state: String,
    pub paid_at: Option<DateTime<Utc>>,
}

#[derive(sqlx::FromRow)]
struct RenewalRow {
    number: i64,
    period_start: DateTime<Utc>,
    period_end: DateTime<Utc>,
    total: Decimal,
    currency: String,
    state: String,
    paid_at: Option<DateTime<Utc>>,
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
            renewals: Vec::new(),
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
    let Some(row) = row else { return Ok(None) };
    let renewals: Vec<RenewalRow> = sqlx::query_as(
        "SELECT number, period_start, period_end, total, currency::text AS currency, paid_at,
                CASE WHEN status = 'refunded' THEN 'refunded'
                     WHEN paid_at IS NOT NULL THEN 'paid'
                     WHEN status IN ('payment_failed', 'expired', 'cancelled') THEN 'failed'
                     ELSE 'pending' END AS state
         FROM orders WHERE renews = $1 ORDER BY period_start",
    )
    .bind(id)
    .fetch_all(pool)
    .await?;
    let mut view = SubscriptionView::from(row);
    view.renewals = renewals
        .into_iter()
        .map(|r| RenewalView {
            amount: amount_text(r.total, &r.currency),
            order_number: r.number,
            period_start: r.period_start,
            period_end: r.period_end,
            currency: r.currency,
            state: r.state,
            paid_at: r.paid_at,
        })
        .collect();
    Ok(Some(view))
}

/// How the fleet bills the subscriptions it bills itself (the internal gateway's).
#[derive(Debug, Clone)]
pub struct Billing {
    /// The platform's commission on each renewal, in percent (as at checkout).
    pub fee_percent: Decimal,
    /// Every period this long instead of its interval (`PAYFLEET_SUBSCRIPTION_PERIOD_SECS`:
    /// tests and previews only).
    pub period: Option<std::time::Duration>,
    /// How long a renewal may wait for its payment at least (the order expiry): a renewal of a
    /// period missed while nothing ran is still charged.
    pub expiry: std::time::Duration,
}

/// Most attempts at one renewal's charge: the billing run retries a failed one once per run,
/// and cancels the subscription when the last one fails (or the renewal expires unpaid).
pub const MAX_RENEWAL_ATTEMPTS: i32 = 4;

/// A renewal order waiting for its charge.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Renewal {
    pub number: i64,
    pub subscription_id: SubscriptionId,
    pub period_start: DateTime<Utc>,
    pub period_end: DateTime<Utc>,
    /// Whether the simulator answers its charge with a success.
    pub simulated_success: bool,
}

/// What one billing pass did on the order side.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Opened {
    /// Renewal orders opened (one per subscription and period).
    pub renewals: usize,
    /// Subscriptions canceled because their renewal could not be charged.
    pub canceled: usize,
}

#[derive(sqlx::FromRow)]
struct Due {
    id: SubscriptionId,
    order_number: i64,
    cancel_at_period_end: bool,
    amount: Decimal,
    currency: String,
    current_period_end: DateTime<Utc>,
    /// The next period's end: one interval on (calendar months and years, as the first
    /// period's), or the configured period.
    next_end: DateTime<Utc>,
}

/// Cancels the past-due subscriptions that cannot recover (below), then opens the renewal
/// orders of `gateway`'s active subscriptions whose period ended: one order per
/// (subscription, period), each in the transaction that moves its subscription to the new
/// period, with its sale's amounts, its items at their list price and its `created` message.
/// Concurrent runs skip what another holds; a unique index is the last word. A subscription
/// whose periods ended while nothing ran (downtime) is renewed once for each of them, in order
/// (at most `limit` renewals a pass; the next pass goes on).
pub async fn open_due(
    pool: &PgPool,
    gateway: GatewayName,
    billing: &Billing,
    limit: i64,
) -> Result<Opened, payfleet_queue::QueueError> {
    let mut opened = Opened {
        canceled: cancel_unpaid(pool, gateway).await?,
        ..Opened::default()
    };
    if let Some(period) = billing.period {
        // The short period of tests and previews applies to every live subscription here.
        sqlx::query(
            "UPDATE subscriptions SET current_period_end = current_period_start + make_interval(secs => $2)
             WHERE gateway = $1 AND status <> 'canceled'
               AND current_period_end <> current_period_start + make_interval(secs => $2)",
        )
        .bind(gateway)
        .bind(period.as_secs_f64())
        .execute(pool)
        .await?;
    }
    // One short transaction per renewal: the order-number counter row, which every checkout
    // needs too, is held only for one renewal's commit.
    for _ in 0..limit {
        let mut tx = pool.begin().await?;
        let due: Option<Due> = sqlx::query_as(
            "SELECT id, order_number, cancel_at_period_end, amount, currency::text AS currency, current_period_end,
                    CASE WHEN $2::float8 IS NULL THEN COALESCE((
                             -- The first period's start plus whole intervals: a month after the
                             -- 31st ends on the 28th, and the next on the 31st again (one interval
                             -- on from each end would stay on the 28th for ever). Counted from a
                             -- low guess: at most about 2 % low (31-day months), never high.
                             -- Only for a period already on that calendar: one that is not
                             -- (moved by hand, or by the old arithmetic) goes on one interval
                             -- from its end, never a short period at the full price. In UTC,
                             -- as the first period's end (migration 0099).
                             SELECT CASE WHEN bool_or(p.at = s.current_period_end)
                                         THEN min(p.at) FILTER (WHERE p.at > s.current_period_end) END
                             FROM (SELECT paid_at AS start FROM orders WHERE number = s.order_number) a,
                                  LATERAL (SELECT greatest(1, floor(extract(epoch FROM s.current_period_end - a.start)
                                      / CASE s.\"interval\" WHEN 'day' THEN 90000 WHEN 'week' THEN 608400
                                                             WHEN 'month' THEN 2682000 ELSE 31626000 END)::int - 1) AS low) g,
                                  generate_series(g.low, g.low + 61) AS n,
                                  LATERAL (SELECT ((a.start AT TIME ZONE 'UTC') + n * ('1 ' || s.\"interval\")::interval)
                                                  AT TIME ZONE 'UTC' AS at) p),
                           ((current_period_end AT TIME ZONE 'UTC') + ('1 ' || \"interval\")::interval) AT TIME ZONE 'UTC')
                         ELSE current_period_end + make_interval(secs => $2) END AS next_end
             FROM subscriptions s
             WHERE gateway = $1 AND status = 'active' AND current_period_end <= now()
             ORDER BY current_period_end LIMIT 1
             FOR UPDATE SKIP LOCKED",
        )
        .bind(gateway)
        .bind(billing.period.map(|p| p.as_secs_f64()))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(s) = due else { break };
        match open_one(&mut tx, s, billing).await? {
            Step::Opened => opened.renewals += 1,
            Step::Canceled => opened.canceled += 1,
            Step::Nothing => {}
        }
        tx.commit().await?;
    }
    Ok(opened)
}

enum Step {
    Opened,
    Canceled,
    Nothing,
}

/// Renews (or, as asked, ends) one subscription whose period ended, in the caller's transaction.
async fn open_one(
    tx: &mut sqlx::PgConnection,
    s: Due,
    billing: &Billing,
) -> Result<Step, payfleet_queue::QueueError> {
    if s.cancel_at_period_end {
        // Canceled at its period's end, as asked: nothing is charged after it.
        sqlx::query(
            "UPDATE subscriptions SET status = 'canceled', canceled_at = current_period_end, updated_at = now()
             WHERE id = $1",
        )
        .bind(s.id)
        .execute(&mut *tx)
        .await?;
        return Ok(Step::Canceled);
    }
    let (start, end) = (s.current_period_end, s.next_end);
    let total = crate::money::Money::new(s.amount, s.currency.parse().map_err(bad_row)?)
        .map_err(bad_row)?;
    let fee = total
        .percent(billing.fee_percent)
        .ok_or_else(|| bad_row(format!("the fee of {total} does not fit")))?;
    let expires_at = end.max(
        Utc::now() + chrono::Duration::from_std(billing.expiry).unwrap_or(chrono::Duration::zero()),
    );
    let created = insert_renewal(
        tx,
        NewRenewal {
            subscription: s.id,
            first_order: s.order_number,
            period: (start, end),
            total,
            fee,
            expires_at,
            cancelled: false,
        },
    )
    .await?;
    sqlx::query(
        "UPDATE subscriptions SET current_period_start = $2, current_period_end = $3, updated_at = now()
         WHERE id = $1",
    )
    .bind(s.id)
    .bind(start)
    .bind(end)
    .execute(&mut *tx)
    .await?;
    let Some(number) = created else {
        return Ok(Step::Nothing);
    };
    // Unpaid when its period ends (or, for a period missed while nothing ran, an order
    // expiry from now), it expires: a payment after that is given back.
    super::expiry::schedule(&mut *tx, number, expires_at).await?;
    Ok(Step::Opened)
}

/// A renewal order to open.
struct NewRenewal {
    subscription: SubscriptionId,
    first_order: i64,
    period: (DateTime<Utc>, DateTime<Utc>),
    total: crate::money::Money,
    fee: crate::money::Money,
    expires_at: DateTime<Utc>,
    /// Opened cancelled: a charge for a period after the subscription ended, whose payment is
    /// then given back as any payment of a cancelled order is.
    cancelled: bool,
}

/// Opens the renewal order of one (subscription, period), as the first order's seller, buyer,
/// gateway and items (at their list price), with its `created` message: its number, or `None`
/// when that period's renewal exists already (the unique index decides).
async fn insert_renewal(
    tx: &mut sqlx::PgConnection,
    r: NewRenewal,
) -> Result<Option<i64>, payfleet_queue::QueueError> {
    let (start, end) = r.period;
    let created: Option<(i64, i64)> = sqlx::query_as(
        "WITH n AS (UPDATE order_numbers SET last = last + 1 WHERE singleton RETURNING last),
              first AS (SELECT * FROM orders WHERE number = $2)
         INSERT INTO orders (number, checkout_id, seller_id, buyer_id, kind, \"interval\", currency,
                             subtotal, discount, total, platform_fee, seller_net, gateway,
                             expires_at, renews, period_start, period_end, status)
         SELECT n.last, first.checkout_id, first.seller_id, first.buyer_id, 'subscription',
                first.\"interval\", first.currency, $3, 0, $3, $4, $3 - $4, first.gateway,
                $7, $1, $5, $6, CASE WHEN $8 THEN 'cancelled' ELSE 'awaiting_payment' END
         FROM n, first
         WHERE first.currency = $9
         ON CONFLICT (renews, period_start) WHERE renews IS NOT NULL DO NOTHING
         RETURNING id, number",
    )
    .bind(r.subscription)
    .bind(r.first_order)
    .bind(r.total.amount())
    .bind(r.fee.amount())
    .bind(start)
    .bind(end)
    .bind(r.expires_at)
    .bind(r.cancelled)
    .bind(r.total.currency().as_str())
    .fetch_optional(&mut *tx)
    .await?;
    let Some((order_id, number)) = created else {
        return Ok(None);
    };
    sqlx::query(
        "INSERT INTO order_items (order_id, line, product_id, name, unit_price, quantity, subtotal, discount)
         SELECT $1, i.line, i.product_id, i.name, i.unit_price, i.quantity, i.subtotal, 0
         FROM order_items i JOIN orders o ON o.id = i.order_id WHERE o.number = $2",
    )
    .bind(order_id)
    .bind(r.first_order)
    .execute(&mut *tx)
    .await?;
    super::record_event(
        &mut *tx,
        order_id,
        super::OrderEventKind::Created,
        serde_json::json!({"number": number, "renews": r.subscription, "period_start": start, "period_end": end}),
    )
    .await?;
    Ok(Some(number))
}

/// A renewal a gateway reports for one period of a subscription it bills.
#[derive(Debug, Clone)]
pub struct Reported {
    pub period_start: DateTime<Utc>,
    /// `None`: one interval of the subscription from its start.
    pub period_end: Option<DateTime<Utc>>,
    /// What the gateway charges for it.
    pub amount: crate::money::Money,
    /// The platform's commission the gateway took on it; `None`: `fee_percent` of the amount.
    pub fee: Option<crate::money::Money>,
    pub fee_percent: Decimal,
}

/// Where a reported renewal goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportedRenewal {
    /// The renewal order of its period (opened now or before): its number, payment attempt,
    /// total and the platform's fee in it.
    Order {
        number: i64,
        attempt: i32,
        total: crate::money::Money,
        fee: Decimal,
    },
    /// The order started no subscription (its payment was given back).
    NoSubscription,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("the renewal's period ends ({end}) before it starts ({start})")]
    Period {
        start: DateTime<Utc>,
        end: DateTime<Utc>,
    },
    #[error("a renewal of {amount} for a subscription in {currency}")]
    Currency {
        amount: crate::money::Money,
        currency: String,
    },
    #[error("the platform's fee on {0} does not fit")]
    Fee(crate::money::Money),
    #[error(transparent)]
    Queue(#[from] payfleet_queue::QueueError),
}

impl From<sqlx::Error> for ReportError {
    fn from(e: sqlx::Error) -> Self {
        Self::Queue(e.into())
    }
}

/// The renewal order of a period a gateway billed for the subscription `first_order` started,
/// opened once per (subscription, period) in the caller's transaction (the subscription row is
/// locked: its events serialise on it), whatever the duplicates and their order. A period
/// later than the subscription's current one becomes current. Its order never expires by
/// itself: the gateway's own retries decide, and report it paid, or end the subscription. A
/// period that starts after the subscription was canceled opens its order cancelled: what was
/// charged for it is given back.
pub async fn open_reported(
    tx: &mut sqlx::PgConnection,
    first_order: i64,
    r: &Reported,
) -> Result<ReportedRenewal, ReportError> {
    #[derive(sqlx::FromRow)]
    struct Billed {
        id: SubscriptionId,
        canceled_at: Option<DateTime<Utc>>,
        /// One interval from the reported start.
        one_interval: DateTime<Utc>,
        currency: String,
    }
    let found: Option<Billed> = sqlx::query_as(
        "SELECT id, canceled_at, $2 + ('1 ' || \"interval\")::interval AS one_interval,
                currency::text AS currency
         FROM subscriptions WHERE order_number = $1 FOR UPDATE",
    )
    .bind(first_order)
    .bind(r.period_start)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(Billed {
        id,
        canceled_at,
        one_interval,
        currency,
    }) = found
    else {
        return Ok(ReportedRenewal::NoSubscription);
    };
    let (start, end) = (r.period_start, r.period_end.unwrap_or(one_interval));
    if end <= start {
        return Err(ReportError::Period { start, end });
    }
    if r.amount.currency().as_str() != currency {
        return Err(ReportError::Currency {
            amount: r.amount,
            currency,
        });
    }
    let existing: Option<(i64, i32, Decimal, Decimal)> = sqlx::query_as(
        "SELECT number, payment_attempt, total, platform_fee FROM orders
         WHERE renews = $1 AND period_start = $2",
    )
    .bind(id)
    .bind(start)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some((number, attempt, total, fee)) = existing {
        let total = crate::money::Money::new(total, r.amount.currency()).map_err(|_| {
            ReportError::Currency {
                amount: r.amount,
                currency: currency.clone(),
            }
        })?;
        return Ok(ReportedRenewal::Order {
            number,
            attempt,
            total,
            fee,
        });
    }
    let fee = match r.fee {
        Some(fee) => fee,
        None => r
            .amount
            .percent(r.fee_percent)
            .ok_or(ReportError::Fee(r.amount))?,
    };
    if fee.currency() != r.amount.currency() || fee.amount() > r.amount.amount() {
        return Err(ReportError::Fee(r.amount));
    }
    let number = insert_renewal(
        tx,
        NewRenewal {
            subscription: id,
            first_order,
            period: (start, end),
            total: r.amount,
            fee,
            // Not scheduled: the gateway's dunning decides, not our clock.
            expires_at: end,
            cancelled: canceled_at.is_some_and(|at| at <= start),
        },
    )
    .await?
    .ok_or_else(|| ReportError::Queue(sqlx::Error::RowNotFound.into()))?;
    sqlx::query(
        "UPDATE subscriptions SET current_period_start = $2, current_period_end = $3, updated_at = now()
         WHERE id = $1 AND current_period_start < $2 AND status <> 'canceled'",
    )
    .bind(id)
    .bind(start)
    .bind(end)
    .execute(&mut *tx)
    .await?;
    Ok(ReportedRenewal::Order {
        number,
        attempt: 1,
        total: r.amount,
        fee: fee.amount(),
    })
}

/// Whether the renewal order `number` belongs to a subscription that has ended here and takes
/// no payment (cancelled: a period after the end; expired: one the end left unpaid): a charge
/// for it is given back, and its gateway, still billing, is to be told to stop.
pub async fn billed_after_end(
    tx: &mut sqlx::PgConnection,
    number: i64,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM orders o JOIN subscriptions s ON s.id = o.renews
                        WHERE o.number = $1 AND s.status = 'canceled'
                          AND o.status IN ('cancelled', 'expired'))",
    )
    .bind(number)
    .fetch_one(&mut *tx)
    .await
}

/// What each renewal of the subscription `first_order` started charges, if it started one.
pub async fn charge_of(
    tx: &mut sqlx::PgConnection,
    first_order: i64,
) -> Result<Option<crate::money::Money>, sqlx::Error> {
    let found: Option<(Decimal, String)> =
        sqlx::query_as("SELECT amount, currency::text FROM subscriptions WHERE order_number = $1")
            .bind(first_order)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(found.and_then(|(amount, currency)| {
        crate::money::Money::new(amount, currency.parse().ok()?).ok()
    }))
}

/// The order that started subscription `id`, if `gateway` bills it.
pub async fn first_order_of(
    tx: &mut sqlx::PgConnection,
    id: SubscriptionId,
    gateway: GatewayName,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT order_number FROM subscriptions WHERE id = $1 AND gateway = $2")
        .bind(id)
        .bind(gateway)
        .fetch_optional(&mut *tx)
        .await
}

/// A change a gateway made to a subscription it bills, recorded for the subscription
/// `first_order` started, in the caller's transaction. Ended there, it is canceled here (once)
/// and its current renewal, if unpaid, expires. `None`: no such subscription; else whether
/// anything changed.
pub async fn apply_change(
    tx: &mut sqlx::PgConnection,
    first_order: i64,
    change: crate::gateways::SubscriptionChange,
) -> Result<Option<bool>, ReportError> {
    use crate::gateways::SubscriptionChange;
    let found: Option<(SubscriptionId, SubscriptionStatus, DateTime<Utc>, bool)> = sqlx::query_as(
        "SELECT id, status, current_period_start, cancel_at_period_end FROM subscriptions
         WHERE order_number = $1 FOR UPDATE",
    )
    .bind(first_order)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((id, status, period_start, at_end)) = found else {
        return Ok(None);
    };
    if status == SubscriptionStatus::Canceled {
        return Ok(Some(false));
    }
    match change {
        SubscriptionChange::CancelAtPeriodEnd(wanted) => {
            if wanted == at_end {
                return Ok(Some(false));
            }
            sqlx::query(
                "UPDATE subscriptions SET cancel_at_period_end = $2, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(wanted)
            .execute(&mut *tx)
            .await?;
        }
        SubscriptionChange::Canceled => {
            sqlx::query(
                "UPDATE subscriptions SET status = 'canceled', canceled_at = now(), updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .execute(&mut *tx)
            .await?;
            expire_unpaid(tx, id, period_start).await?;
        }
    }
    Ok(Some(true))
}

/// Expires the unpaid renewal of a canceled subscription's current period, if any, in the
/// cancellation's own transaction: a charge in flight (a billing pass that listed it before the
/// cancellation, a gateway's invoice paid meanwhile) then finds it expired and is given back as
/// a late payment. Moving its expiry job to now instead left a race between that job and the
/// payment's, and a payment that won kept the money of a canceled subscription.
async fn expire_unpaid(
    tx: &mut sqlx::PgConnection,
    id: SubscriptionId,
    period_start: DateTime<Utc>,
) -> Result<(), payfleet_queue::QueueError> {
    let unpaid: Option<(i64, i64)> = sqlx::query_as(
        "SELECT id, number FROM orders WHERE renews = $1 AND period_start = $2 AND paid_at IS NULL
           AND status IN ('awaiting_payment', 'payment_failed')
         FOR UPDATE",
    )
    .bind(id)
    .bind(period_start)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((order, number)) = unpaid else {
        return Ok(());
    };
    super::expiry::expire_locked(tx, order, number).await
}

/// Cancels the past-due subscriptions whose current renewal failed its last attempt, or expired
/// unpaid, and expires that renewal (a payment after it is given back).
async fn cancel_unpaid(
    pool: &PgPool,
    gateway: GatewayName,
) -> Result<usize, payfleet_queue::QueueError> {
    // The renewal ends in the cancellation's own transaction, as a cancellation's does
    // (`expire_unpaid`): a charge in flight then lands as a late payment, given back.
    let mut tx = pool.begin().await?;
    // The renewals first (each locked as the join reads it), then their subscriptions as they
    // are updated: the order a payment of one locks them (the order, then through migration
    // 0048's trigger its subscription); the other order could deadlock with a charge landing
    // meanwhile.
    let given_up: Vec<(SubscriptionId, i64, DateTime<Utc>)> = sqlx::query_as(
        "WITH renewals AS (
             SELECT o.renews, o.number FROM orders o JOIN subscriptions s ON o.renews = s.id
             WHERE s.gateway = $1 AND s.status = 'past_due'
               AND o.period_start = s.current_period_start AND o.paid_at IS NULL
               AND ((o.status = 'payment_failed' AND o.payment_attempt >= $2) OR o.status = 'expired')
             ORDER BY o.id FOR UPDATE OF o)
         UPDATE subscriptions s SET status = 'canceled', canceled_at = now(), updated_at = now()
         FROM renewals r
         WHERE s.id = r.renews AND s.status = 'past_due'
         RETURNING s.id, r.number, s.current_period_start",
    )
    .bind(gateway)
    .bind(MAX_RENEWAL_ATTEMPTS)
    .fetch_all(&mut *tx)
    .await?;
    for (id, number, period_start) in &given_up {
        tracing::info!(subscription = %id, renewal = number, "subscription canceled: its renewal could not be charged");
        expire_unpaid(&mut tx, *id, *period_start).await?;
    }
    tx.commit().await?;
    Ok(given_up.len())
}

/// The renewals of `gateway` waiting for a charge: the new ones, and the failed ones whose
/// subscription is past due and that have attempts left (each moved to its next attempt here:
/// a failed attempt's session is spent).
pub async fn to_charge(
    pool: &PgPool,
    gateway: GatewayName,
    limit: i64,
) -> Result<Vec<Renewal>, sqlx::Error> {
    sqlx::query(
        "WITH retried AS (
             UPDATE orders o SET payment_attempt = payment_attempt + 1, session_id = NULL, payment_url = NULL,
                 status = 'awaiting_payment', updated_at = now()
             FROM subscriptions s
             WHERE o.renews = s.id AND s.gateway = $1 AND s.status = 'past_due'
               AND o.period_start = s.current_period_start
               AND o.status = 'payment_failed' AND o.payment_attempt < $2
             RETURNING o.id, o.payment_attempt)
         INSERT INTO order_events (order_id, kind, payload)
         SELECT id, 'reopened', jsonb_build_object('attempt', payment_attempt, 'by', 'subscription_billing')
         FROM retried",
    )
    .bind(gateway)
    .bind(MAX_RENEWAL_ATTEMPTS)
    .execute(pool)
    .await?;
    sqlx::query_as(
        "SELECT o.number, s.id AS subscription_id, o.period_start, o.period_end,
                s.simulated_renewals = 'succeed' AS simulated_success
         FROM orders o JOIN subscriptions s ON s.id = o.renews
         WHERE s.gateway = $1 AND s.status <> 'canceled' AND o.status = 'awaiting_payment'
         ORDER BY o.number LIMIT $2",
    )
    .bind(gateway)
    .bind(limit)
    .fetch_all(pool)
    .await
}

#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    #[error("no subscription {0}")]
    NotFound(SubscriptionId),
    #[error(transparent)]
    Queue(#[from] payfleet_queue::QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Records a subscription's cancellation here: now, or at its current period's end (then the
/// fleet's billing, or the gateway, ends it instead of renewing it). Once: a canceled
/// subscription is answered as it is. Cancelled now, its current renewal, if unpaid, expires
/// (a payment after it is given back); a paid period is not refunded here (that is a refund of
/// its order). The gateway that bills it was told first (`payments::subscriptions`).
pub async fn cancel(
    pool: &PgPool,
    id: SubscriptionId,
    at_period_end: bool,
) -> Result<SubscriptionView, CancelError> {
    let mut tx = pool.begin().await?;
    let found: Option<(SubscriptionStatus, DateTime<Utc>)> = sqlx::query_as(
        "SELECT status, current_period_start FROM subscriptions WHERE id = $1 FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let (status, period_start) = found.ok_or(CancelError::NotFound(id))?;
    if status != SubscriptionStatus::Canceled {
        if at_period_end {
            sqlx::query(
                "UPDATE subscriptions SET cancel_at_period_end = true, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .execute(&mut *tx)
            .await?;
        } else {
            sqlx::query(
                "UPDATE subscriptions SET status = 'canceled', canceled_at = now(), updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .execute(&mut *tx)
            .await?;
            expire_unpaid(&mut tx, id, period_start).await?;
        }
    }
    tx.commit().await?;
    view(pool, id).await?.ok_or(CancelError::NotFound(id))
}

/// Sets how the simulator answers the subscription's next renewals. `false`: no such
/// subscription.
pub async fn simulate(
    pool: &PgPool,
    id: SubscriptionId,
    succeed: bool,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE subscriptions SET simulated_renewals = $2, updated_at = now() WHERE id = $1",
    )
    .bind(id)
    .bind(if succeed { "succeed" } else { "fail" })
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

fn bad_row(e: impl std::fmt::Display) -> payfleet_queue::QueueError {
    payfleet_queue::QueueError::Database(sqlx::Error::Decode(e.to_string().into()))
}

/// The past-due subscriptions, the longest past due first, for the operator (at most `limit`).
pub async fn past_due(pool: &PgPool, limit: i64) -> Result<Vec<SubscriptionView>, sqlx::Error> {
    let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM subscriptions WHERE status = 'past_due'
         ORDER BY current_period_start LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(SubscriptionView::from).collect())
}

/// A live subscription whose period ended with nothing reported since (the consistency check
/// `subscription_period_overdue`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Overdue {
    pub id: SubscriptionId,
    pub order_number: i64,
    pub gateway: String,
    pub current_period_end: DateTime<Utc>,
    /// The session its first order was paid through: the payment that started it.
    pub first_session: Option<String>,
}

/// The live subscriptions whose current period ended within `ended` (on `gateways` only, when
/// given), oldest first: every renewal reported (paid or failed) and the fleet's own billing
/// move the current period on, and an end cancels, so these had their renewal's or their
/// end's report lost.
pub async fn overdue(
    pool: &PgPool,
    ended: std::ops::Range<DateTime<Utc>>,
    gateways: Option<&[&str]>,
    limit: i64,
) -> Result<Vec<Overdue>, sqlx::Error> {
    sqlx::query_as(
        "SELECT s.id, s.order_number, s.gateway, s.current_period_end, o.session_id AS first_session
         FROM subscriptions s LEFT JOIN orders o ON o.number = s.order_number
         WHERE s.status <> 'canceled' AND s.current_period_end >= $1 AND s.current_period_end < $2
           AND ($3::text[] IS NULL OR s.gateway = ANY($3))
         ORDER BY s.current_period_end LIMIT $4",
    )
    .bind(ended.start)
    .bind(ended.end)
    .bind(gateways)
    .bind(limit)
    .fetch_all(pool)
    .await
}
