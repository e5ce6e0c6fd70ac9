//! Orders: the business truth. Checkout creates them (`checkout`, priced by `pricing`); a paid
//! event confirms one exactly once ([`apply_payment`]); an unpaid one expires by itself
//! (`expiry`). The order's state and the provider's state of its payment are kept side by side.

pub mod checkout;
pub mod coin_payment;
pub mod expiry;
pub mod outbox;
pub mod pricing;
pub mod subscriptions;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::{PgConnection, PgExecutor};

use crate::catalogue::{Interval, ProductKind, SellerId};
use crate::gateways::GatewayName;
use crate::money::{Money, amount_text as amount};
use crate::payment_status::PaymentOrderStatus;
use payfleet_queue::{Registry, RegistryError};

/// How orders are priced and how long they wait.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The platform's commission, in percent of each order's total
    /// (`PAYFLEET_PLATFORM_FEE_PERCENT`, 10).
    pub platform_fee_percent: rust_decimal::Decimal,
    /// How long an order waits for its payment (`PAYFLEET_ORDER_EXPIRY_SECS`, 1800).
    pub expiry: std::time::Duration,
    /// Every internal-gateway subscription period this long instead of its interval
    /// (`PAYFLEET_SUBSCRIPTION_PERIOD_SECS`: tests and previews only).
    pub subscription_period: Option<std::time::Duration>,
}

impl Settings {
    pub fn from_env(env: &dyn crate::env::Env) -> Result<Self, crate::env::Invalid> {
        use crate::env::{invalid, parsed};
        let platform_fee_percent = parsed(
            env,
            "PAYFLEET_PLATFORM_FEE_PERCENT",
            rust_decimal::Decimal::TEN,
        )?;
        if platform_fee_percent.is_sign_negative()
            || platform_fee_percent > rust_decimal::Decimal::ONE_HUNDRED
        {
            return Err(invalid("PAYFLEET_PLATFORM_FEE_PERCENT", "must be 0 to 100"));
        }
        let expiry_secs = parsed(env, "PAYFLEET_ORDER_EXPIRY_SECS", 1800u64)?;
        if !(1..=30 * 86_400).contains(&expiry_secs) {
            return Err(invalid(
                "PAYFLEET_ORDER_EXPIRY_SECS",
                "must be 1 to 2592000 (30 days)",
            ));
        }
        let subscription_period = crate::env::var(env, "PAYFLEET_SUBSCRIPTION_PERIOD_SECS")
            .map(|v| {
                v.parse::<u64>()
                    .ok()
                    .filter(|s| (1..=366 * 86_400).contains(s))
                    .map(std::time::Duration::from_secs)
                    .ok_or_else(|| {
                        invalid(
                            "PAYFLEET_SUBSCRIPTION_PERIOD_SECS",
                            "must be 1 to 31622400 seconds",
                        )
                    })
            })
            .transpose()?;
        Ok(Self {
            platform_fee_percent,
            expiry: std::time::Duration::from_secs(expiry_secs),
            subscription_period,
        })
    }
}

payfleet_queue::text_enum! {
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

impl OrderStatus {
    /// Waiting for its money: it can be paid, and it expires.
    pub fn is_payable(&self) -> bool {
        matches!(self, Self::AwaitingPayment | Self::PaymentFailed)
    }
}

payfleet_queue::text_enum! {
    /// What happened to an order, recorded once each in its own transaction (`order_events`):
    /// what the order side tells other services.
    pub enum OrderEventKind {
        Created = "created",
        Paid = "paid",
        Expired = "expired",
        LatePayment = "late_payment",
        /// Paid again through another session after it was paid: refunded.
        ExtraPayment = "extra_payment",
        Reopened = "reopened",
        /// Its subscription's renewal failed (written by the database: migration 0049).
        PastDue = "past_due",
        /// Its subscription is active again: a retry of its renewal was paid.
        Reactivated = "reactivated",
        /// Its subscription ended.
        Canceled = "canceled",
        /// All its money went back to the buyer.
        Refunded = "refunded",
        /// A dispute of its payment was lost.
        ChargedBack = "charged_back",
    }
}

/// The order status a payment status leads to, from the current one. A pending payment changes
/// nothing; a failed attempt only marks an order still waiting for payment; an expired or
/// cancelled order stays so (a payment that comes after it is refunded: [`PaymentEffect`]).
pub fn next_status(current: OrderStatus, payment: PaymentOrderStatus) -> OrderStatus {
    if matches!(current, OrderStatus::Expired | OrderStatus::Cancelled) {
        return current;
    }
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

/// What a payment did to its order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PaymentEffect {
    Changed,
    Unchanged,
    /// A payment the order cannot take, to give back: paid after the order expired (the rule:
    /// the order stays expired and the payment is refunded automatically), or paid again
    /// through another session after the order was paid. `first` is true only the first time
    /// this is seen, so the refund is enqueued once.
    Refund {
        reason: OrderEventKind,
        first: bool,
    },
    /// The payment does not match what the order costs: nothing confirmed.
    AmountMismatch {
        order: Money,
        paid: Money,
    },
}

#[derive(sqlx::FromRow)]
struct Locked {
    id: i64,
    status: OrderStatus,
    payment_status: PaymentOrderStatus,
    total: Decimal,
    currency: String,
    amount_refunded: Decimal,
    paid_at: Option<DateTime<Utc>>,
    session_id: Option<String>,
    payment_attempt: i32,
    paid_with_coins: bool,
    /// Coins the buyer set aside to pay with (given back once the gateway's payment arrives).
    coin_reserved: bool,
}

/// The session a payment's facts come from, as the payment side recorded it.
#[derive(Debug, Clone, Copy)]
pub struct PaidThrough<'a> {
    pub session_id: &'a str,
    pub url: &'a str,
    /// The order's payment attempt the session was made for.
    pub attempt: i32,
    pub payment_id: Option<&'a str>,
}

/// Brings order `number` in line with its payment's derived state, inside the caller's
/// transaction (the order row is locked: concurrent events, the expiry and reconciliation
/// serialise on it). Confirmation happens once: the order turns paid once and one `paid` event
/// is recorded, whatever the duplicates, reorderings or crashes before.
#[allow(clippy::too_many_arguments)]
pub async fn apply_payment(
    tx: &mut PgConnection,
    number: i64,
    gateway: GatewayName,
    through: PaidThrough<'_>,
    payment: PaymentOrderStatus,
    paid: Option<Money>,
    refunded: Decimal,
) -> Result<Option<PaymentEffect>, payfleet_queue::QueueError> {
    let PaidThrough {
        session_id,
        url,
        attempt,
        payment_id,
    } = through;
    let order: Option<Locked> = sqlx::query_as(
        "SELECT id, status, payment_status, total, currency::text AS currency, amount_refunded, paid_at, session_id,
                payment_attempt, paid_with_coins, coin_reservation IS NOT NULL AS coin_reserved
         FROM orders WHERE number = $1 AND gateway = $2 FOR UPDATE",
    )
    .bind(number)
    .bind(gateway)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(o) = order else {
        return Ok(None);
    };
    if payment.implies_paid()
        && let Some(paid) = paid
    {
        let total = Money::new(o.total, paid.currency());
        if o.currency != paid.currency().as_str() || total.as_ref().ok() != Some(&paid) {
            let order =
                Money::new(o.total, o.currency.parse().unwrap_or(paid.currency())).unwrap_or(paid);
            return Ok(Some(PaymentEffect::AmountMismatch { order, paid }));
        }
    }
    // The order's own session: the one it stores, or, while it stores none, the one made for
    // its current attempt. Facts of any other session (an attempt given up, a coin payment's
    // gateway session) never move the order unless they are a payment: a failure or a refund
    // there says nothing about this order's payment.
    let current = match &o.session_id {
        Some(s) => s == session_id,
        None => attempt == o.payment_attempt,
    };
    if !payment.implies_paid() && (!current || o.paid_with_coins) {
        return Ok(Some(PaymentEffect::Unchanged));
    }
    // The payment side knew the session before the order side stored it (a lost answer):
    // the order learns it now.
    if o.session_id.is_none() && current {
        sqlx::query("UPDATE orders SET session_id = $2, payment_url = $3 WHERE id = $1 AND session_id IS NULL")
            .bind(o.id)
            .bind(session_id)
            .bind(url)
            .execute(&mut *tx)
            .await?;
    }
    if matches!(o.status, OrderStatus::Expired | OrderStatus::Cancelled) && payment.implies_paid() {
        sqlx::query("UPDATE orders SET payment_status = $2, updated_at = now() WHERE id = $1 AND payment_status <> $2")
            .bind(o.id)
            .bind(payment)
            .execute(&mut *tx)
            .await?;
        // Once per payment: each session's late payment (and each of a session's payments) is
        // given back.
        let first = record_payment_event(
            tx,
            o.id,
            OrderEventKind::LatePayment,
            serde_json::json!({"payment_status": payment, "session_id": session_id, "payment_id": payment_id}),
        )
        .await?;
        return Ok(Some(PaymentEffect::Refund {
            reason: OrderEventKind::LatePayment,
            first,
        }));
    }
    // Paid already, through another session (an earlier attempt that the gateway took late,
    // a second tab) or with coins: this second payment is given back.
    if payment.implies_paid()
        && o.paid_at.is_some()
        && (o.paid_with_coins || o.session_id.as_deref() != Some(session_id))
    {
        let first = record_payment_event(
            tx,
            o.id,
            OrderEventKind::ExtraPayment,
            serde_json::json!({"session_id": session_id, "payment_id": payment_id}),
        )
        .await?;
        return Ok(Some(PaymentEffect::Refund {
            reason: OrderEventKind::ExtraPayment,
            first,
        }));
    }
    let status = next_status(o.status, payment);
    let now_paid = payment.implies_paid() && o.paid_at.is_none();
    let changed = status != o.status
        || payment != o.payment_status
        || refunded != o.amount_refunded
        || now_paid;
    if !changed {
        return Ok(Some(PaymentEffect::Unchanged));
    }
    // The session that pays the order becomes its session (an earlier attempt that succeeded
    // late, after a new one was opened): any other session's payment is then an extra one.
    sqlx::query(
        "UPDATE orders SET status = $2, payment_status = $3, amount_refunded = $4,
             paid_at = CASE WHEN $5 THEN COALESCE(paid_at, now()) ELSE paid_at END,
             session_id = CASE WHEN $6 THEN $7 ELSE session_id END,
             payment_url = CASE WHEN $6 THEN $8 ELSE payment_url END,
             updated_at = now()
         WHERE id = $1",
    )
    .bind(o.id)
    .bind(status)
    .bind(payment)
    .bind(refunded)
    .bind(payment.implies_paid())
    .bind(now_paid)
    .bind(session_id)
    .bind(url)
    .execute(&mut *tx)
    .await?;
    // Its money went back: the services that acted on `paid` are told, once.
    let money_back = match status {
        OrderStatus::Refunded => Some(OrderEventKind::Refunded),
        OrderStatus::ChargedBack => Some(OrderEventKind::ChargedBack),
        _ => None,
    };
    if let Some(kind) = money_back.filter(|_| status != o.status) {
        record_event(
            tx,
            o.id,
            kind,
            serde_json::json!({"number": number, "amount_refunded": refunded}),
        )
        .await?;
    }
    if now_paid {
        record_event(
            tx,
            o.id,
            OrderEventKind::Paid,
            serde_json::json!({"number": number}),
        )
        .await?;
        // Coins the buyer tried to pay with first go back.
        if o.coin_reserved {
            coin_payment::give_back(tx, o.id).await?;
        }
    }
    Ok(Some(PaymentEffect::Changed))
}

/// A payment an order could not take, as its `late_payment` or `extra_payment` message recorded
/// it (given back by the payment side).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PaymentNotTaken {
    pub order_number: i64,
    /// `late_payment` or `extra_payment`.
    pub kind: String,
    pub session_id: String,
    /// The gateway's id of the payment, when the message named it.
    pub payment_id: Option<String>,
}

/// The extra payments (the order paid already) recorded more than `older_than` ago, through
/// their own index (migration 0079).
pub async fn extra_payments(
    pool: &sqlx::PgPool,
    older_than: std::time::Duration,
) -> Result<Vec<PaymentNotTaken>, sqlx::Error> {
    sqlx::query_as(
        "SELECT o.number AS order_number, e.kind, e.payload ->> 'session_id' AS session_id,
                NULLIF(e.payload ->> 'payment_id', '') AS payment_id
         FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE e.kind = 'extra_payment' AND e.created_at < now() - make_interval(secs => $1)
         ORDER BY e.id",
    )
    .bind(older_than.as_secs_f64())
    .fetch_all(pool)
    .await
}

/// Whether order `number` was paid through `session`: the payment its order took, not a late
/// or extra one on another of its sessions.
pub async fn paid_through(
    tx: &mut PgConnection,
    number: i64,
    session: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM orders WHERE number = $1 AND session_id = $2 AND paid_at IS NOT NULL)",
    )
    .bind(number)
    .bind(session)
    .fetch_one(&mut *tx)
    .await
}

/// Order `number`'s late or extra payment on `session` (and `payment`, when given: a message
/// that named no payment matches any), the first recorded.
pub async fn payment_not_taken(
    pool: &sqlx::PgPool,
    number: i64,
    session: &str,
    payment: Option<&str>,
) -> Result<Option<PaymentNotTaken>, sqlx::Error> {
    sqlx::query_as(
        "SELECT o.number AS order_number, e.kind, e.payload ->> 'session_id' AS session_id,
                NULLIF(e.payload ->> 'payment_id', '') AS payment_id
         FROM orders o
         JOIN order_events e ON e.order_id = o.id AND e.kind IN ('late_payment', 'extra_payment')
                            AND e.payload ->> 'session_id' = $2
         WHERE o.number = $1
           AND ($3::text IS NULL OR e.payload ->> 'payment_id' = $3
                OR COALESCE(e.payload ->> 'payment_id', '') = '')
         ORDER BY e.id LIMIT 1",
    )
    .bind(number)
    .bind(session)
    .bind(payment)
    .fetch_optional(pool)
    .await
}

/// Records a second payment on one of the order's sessions (given back by the caller): once.
/// An `extra_payment` of an order that was paid; of one never paid (expired or cancelled), a
/// `late_payment` like its session's first.
pub(crate) async fn record_extra_payment(
    tx: &mut PgConnection,
    number: i64,
    session_id: &str,
    payment_id: &str,
) -> Result<bool, sqlx::Error> {
    let order: Option<(i64, bool)> =
        sqlx::query_as("SELECT id, paid_at IS NOT NULL FROM orders WHERE number = $1 FOR UPDATE")
            .bind(number)
            .fetch_optional(&mut *tx)
            .await?;
    match order {
        Some((id, paid)) => {
            record_event(
                tx,
                id,
                if paid {
                    OrderEventKind::ExtraPayment
                } else {
                    OrderEventKind::LatePayment
                },
                serde_json::json!({"session_id": session_id, "payment_id": payment_id}),
            )
            .await
        }
        None => Ok(false),
    }
}

/// An order a first payment can confirm plainly, as [`lock_plainly_payable`] finds it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Payable {
    pub id: i64,
    pub number: i64,
    pub gateway: GatewayName,
    pub status: OrderStatus,
    pub total: Decimal,
    pub currency: String,
}

impl Payable {
    /// Whether `paid` is exactly what the order costs ([`apply_payment`]'s check).
    pub fn costs(&self, paid: &Money) -> bool {
        self.currency == paid.currency().as_str()
            && Money::new(self.total, paid.currency()).ok().as_ref() == Some(paid)
    }
}

/// Locks, in id order, those of the orders (`number`, `gateway`) whose payment would simply
/// confirm them: waiting for their money and never paid, with no coins paid or set aside. The
/// rest are left to [`apply_payment`], which knows every other case (a late payment, a second
/// one, coins to give back).
pub async fn lock_plainly_payable(
    tx: &mut PgConnection,
    orders: &[(i64, GatewayName)],
) -> Result<Vec<Payable>, sqlx::Error> {
    let (numbers, gateways): (Vec<i64>, Vec<GatewayName>) = orders.iter().copied().unzip();
    sqlx::query_as(
        // Each order found through its number's index, then all locked in id order. Asked as
        // `number = ANY($1)`, a planner without statistics (a new database, a server without
        // autovacuum) took that for most of the table and read every order through another
        // index, each batch of payments (README, "Statements that do not trust the planner").
        "SELECT o.id, o.number, o.gateway, o.status, o.total, o.currency::text AS currency
         FROM orders o
         WHERE o.id = ANY(ARRAY(
                   SELECT (SELECT x.id FROM orders x WHERE x.number = k.number AND x.gateway = k.gateway)
                   FROM unnest($1::bigint[], $2::text[]) AS k(number, gateway)))
           AND o.status IN ('awaiting_payment', 'payment_failed') AND o.paid_at IS NULL
           AND NOT o.paid_with_coins AND o.coin_reservation IS NULL
         ORDER BY o.id FOR UPDATE OF o",
    )
    .bind(&numbers)
    .bind(&gateways)
    .fetch_all(&mut *tx)
    .await
}

/// A payment that confirms a [`Payable`] order: the session it came through.
#[derive(Debug, Clone)]
pub struct Confirmation<'a> {
    pub order: &'a Payable,
    pub session_id: &'a str,
    pub url: &'a str,
    /// The trace its `paid` message continues (`traces`).
    pub traceparent: Option<&'a str>,
}

/// Confirms orders locked by [`lock_plainly_payable`] with their succeeded payments, as
/// [`apply_payment`] does for one (the paying session becomes the order's, one `paid` event
/// each), in one statement for all of them.
pub async fn confirm_paid(
    tx: &mut PgConnection,
    paid: &[Confirmation<'_>],
) -> Result<(), sqlx::Error> {
    let payment = PaymentOrderStatus::Succeeded;
    let mut ids = Vec::with_capacity(paid.len());
    let mut statuses = Vec::with_capacity(paid.len());
    let mut sessions = Vec::with_capacity(paid.len());
    let mut urls = Vec::with_capacity(paid.len());
    let mut traces = Vec::with_capacity(paid.len());
    for p in paid {
        ids.push(p.order.id);
        statuses.push(next_status(p.order.status, payment));
        sessions.push(p.session_id);
        urls.push(p.url);
        traces.push(p.traceparent);
    }
    sqlx::query(
        "WITH paid AS (
             UPDATE orders o SET status = p.status, payment_status = $5, amount_refunded = 0,
                 paid_at = COALESCE(o.paid_at, now()), session_id = p.session_id,
                 payment_url = p.url, updated_at = now()
             FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $7::text[])
                 AS p(id, status, session_id, url, traceparent)
             -- By the index, whatever the plan thinks of the array's length (an array the
             -- planner cannot see into: it sized the literal one as most of a table without
             -- statistics and read all of it).
             WHERE o.id = ANY(ARRAY(SELECT unnest($1::bigint[]))) AND o.id = p.id
             RETURNING o.id, o.number, p.traceparent)
         INSERT INTO order_events (order_id, kind, payload, traceparent)
         SELECT id, $6, jsonb_build_object('number', number), traceparent FROM paid
         ON CONFLICT DO NOTHING",
    )
    .bind(&ids)
    .bind(&statuses)
    .bind(&sessions)
    .bind(&urls)
    .bind(payment)
    .bind(OrderEventKind::Paid)
    .bind(&traces)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Records what happened to an order: once for every kind but `reopened`, and once per
/// payment (its session and payment id in the payload) for `late_payment` and `extra_payment`
/// (the unique indexes decide). Returns whether it was new.
pub(crate) async fn record_event(
    tx: &mut PgConnection,
    order_id: i64,
    kind: OrderEventKind,
    payload: serde_json::Value,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO order_events (order_id, kind, payload) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(order_id)
    .bind(kind)
    .bind(payload)
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Records a late or extra payment's event (`payload` names its session and payment id), once
/// per payment, under the order's lock: a payment reported first without its id (a Stripe
/// Checkout Session in subscription mode completes before its invoice names the PaymentIntent)
/// and then with it, in either order, is one payment of its session. Keyed by the id alone, it
/// was two events, two give-backs asked and its subscription stopped twice. (A session's payments
/// that each carry an id, as Mercado Pago's and Razorpay's attempts do, are each one.)
async fn record_payment_event(
    tx: &mut PgConnection,
    order_id: i64,
    kind: OrderEventKind,
    payload: serde_json::Value,
) -> Result<bool, sqlx::Error> {
    let session = payload["session_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let payment = payload["payment_id"].as_str().map(str::to_owned);
    let seen: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM order_events
                        WHERE order_id = $1 AND kind = $2 AND payload ->> 'session_id' = $3
                          AND ($4::text IS NULL OR COALESCE(payload ->> 'payment_id', '') = ''))",
    )
    .bind(order_id)
    .bind(kind)
    .bind(&session)
    .bind(payment.as_deref())
    .fetch_one(&mut *tx)
    .await?;
    if seen {
        return Ok(false);
    }
    record_event(tx, order_id, kind, payload).await
}

/// An order as a refund request needs it.
#[derive(Debug, sqlx::FromRow)]
pub struct RefundableOrder {
    pub seller_id: SellerId,
    pub status: OrderStatus,
    pub gateway: GatewayName,
    pub session_id: Option<String>,
    pub currency: String,
    pub total: Decimal,
    pub paid_with_coins: bool,
    pub coin_reservation: Option<String>,
}

/// Order `number`, locked (`FOR UPDATE`) for a refund request's transaction: requests of one
/// order take turns.
pub async fn lock_for_refund(
    tx: &mut PgConnection,
    number: i64,
) -> Result<Option<RefundableOrder>, sqlx::Error> {
    sqlx::query_as(
        "SELECT seller_id, status, gateway, session_id, currency::text AS currency, total, paid_with_coins, coin_reservation
         FROM orders WHERE number = $1 FOR UPDATE",
    )
    .bind(number)
    .fetch_optional(&mut *tx)
    .await
}

/// An order as clients see it: its own state and its payment's, side by side.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OrderView {
    pub number: i64,
    pub seller_id: SellerId,
    pub buyer_id: String,
    pub kind: ProductKind,
    pub interval: Option<Interval>,
    pub currency: String,
    pub subtotal: String,
    pub discount: String,
    pub total: String,
    pub platform_fee: String,
    pub seller_net: String,
    pub amount_refunded: String,
    pub status: OrderStatus,
    pub payment_status: PaymentOrderStatus,
    pub gateway: GatewayName,
    /// The current payment attempt (a failed one is followed by a new session).
    pub payment_attempt: i32,
    #[serde(skip)]
    pub payment_token: uuid::Uuid,
    pub payment: Option<PaymentLinkView>,
    pub expires_at: DateTime<Utc>,
    pub paid_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// The subscription its payment started (a paid subscription order).
    pub subscription_id: Option<subscriptions::SubscriptionId>,
    pub items: Vec<ItemView>,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PaymentLinkView {
    pub gateway: GatewayName,
    pub session_id: String,
    pub url: String,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct ItemView {
    pub product_id: crate::catalogue::ProductId,
    pub name: String,
    #[serde(with = "rust_decimal::serde::str")]
    #[schema(value_type = String)]
    pub unit_price: Decimal,
    pub quantity: i32,
    #[serde(with = "rust_decimal::serde::str")]
    #[schema(value_type = String)]
    pub subtotal: Decimal,
    #[serde(with = "rust_decimal::serde::str")]
    #[schema(value_type = String)]
    pub discount: Decimal,
}

#[derive(sqlx::FromRow)]
struct OrderRow {
    id: i64,
    number: i64,
    seller_id: SellerId,
    buyer_id: String,
    kind: ProductKind,
    interval: Option<Interval>,
    currency: String,
    subtotal: Decimal,
    discount: Decimal,
    total: Decimal,
    platform_fee: Decimal,
    seller_net: Decimal,
    amount_refunded: Decimal,
    status: OrderStatus,
    payment_status: PaymentOrderStatus,
    gateway: GatewayName,
    payment_attempt: i32,
    payment_token: uuid::Uuid,
    session_id: Option<String>,
    payment_url: Option<String>,
    expires_at: DateTime<Utc>,
    paid_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    subscription_id: Option<subscriptions::SubscriptionId>,
}

const ORDER_COLUMNS: &str = "id, number, seller_id, buyer_id, kind, \"interval\", currency::text AS currency,
     subtotal, discount, total, platform_fee, seller_net, amount_refunded, status, payment_status, gateway,
     payment_attempt, payment_token, session_id, payment_url, expires_at, paid_at, created_at,
     (SELECT s.id FROM subscriptions s WHERE s.order_number = orders.number) AS subscription_id";

async fn items<'c>(db: impl PgExecutor<'c>, order_id: i64) -> Result<Vec<ItemView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT product_id, name, unit_price, quantity, subtotal, discount FROM order_items
         WHERE order_id = $1 ORDER BY line",
    )
    .bind(order_id)
    .fetch_all(db)
    .await
}

fn view_of(o: OrderRow, items: Vec<ItemView>) -> OrderView {
    let c = o.currency.clone();
    let items = items
        .into_iter()
        .map(|mut i| {
            i.unit_price = amount(i.unit_price, &c).parse().unwrap_or(i.unit_price);
            i.subtotal = amount(i.subtotal, &c).parse().unwrap_or(i.subtotal);
            i.discount = amount(i.discount, &c).parse().unwrap_or(i.discount);
            i
        })
        .collect();
    OrderView {
        number: o.number,
        seller_id: o.seller_id,
        buyer_id: o.buyer_id,
        kind: o.kind,
        interval: o.interval,
        subtotal: amount(o.subtotal, &c),
        discount: amount(o.discount, &c),
        total: amount(o.total, &c),
        platform_fee: amount(o.platform_fee, &c),
        seller_net: amount(o.seller_net, &c),
        amount_refunded: amount(o.amount_refunded, &c),
        currency: o.currency,
        status: o.status,
        payment_status: o.payment_status,
        gateway: o.gateway,
        payment_attempt: o.payment_attempt,
        payment_token: o.payment_token,
        payment: match (o.session_id, o.payment_url) {
            (Some(session_id), Some(url)) => Some(PaymentLinkView {
                gateway: o.gateway,
                session_id,
                url,
            }),
            _ => None,
        },
        expires_at: o.expires_at,
        paid_at: o.paid_at,
        created_at: o.created_at,
        subscription_id: o.subscription_id,
        items,
    }
}

/// One step of an order's journey: one of its order events, and when its message left.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct JourneyStep {
    pub kind: String,
    pub payload: serde_json::Value,
    pub created_at: DateTime<Utc>,
    pub published_at: Option<DateTime<Utc>>,
}

/// Order `number`'s events, oldest first (empty for an unknown order).
pub async fn journey(pool: &sqlx::PgPool, number: i64) -> Result<Vec<JourneyStep>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.kind, e.payload, e.created_at, e.published_at
         FROM order_events e JOIN orders o ON o.id = e.order_id
         WHERE o.number = $1 ORDER BY e.id",
    )
    .bind(number)
    .fetch_all(pool)
    .await
}

/// Order `number`, as clients see it.
pub async fn view(pool: &sqlx::PgPool, number: i64) -> Result<Option<OrderView>, sqlx::Error> {
    view_of_seller(pool, number, None).await
}

/// Order `number` if it is `seller`'s (any seller's: None). Another seller's is not read at all:
/// its answer and its time are a missing order's.
pub async fn view_of_seller(
    pool: &sqlx::PgPool,
    number: i64,
    seller: Option<SellerId>,
) -> Result<Option<OrderView>, sqlx::Error> {
    let row: Option<OrderRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ORDER_COLUMNS} FROM orders WHERE number = $1 AND ($2::uuid IS NULL OR seller_id = $2)"
    )))
    .bind(number)
    .bind(seller)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let items = items(pool, row.id).await?;
    Ok(Some(view_of(row, items)))
}

/// The orders of a checkout, by number.
pub async fn of_checkout(
    pool: &sqlx::PgPool,
    checkout: i64,
) -> Result<Vec<OrderView>, sqlx::Error> {
    // One round trip for the orders and their lines (a checkout's answer is read with every
    // checkout): each order's lines come as arrays, in line order.
    let rows: Vec<OrderWithLines> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        // A subscription's renewals belong to its first order's checkout, not to its answer.
        "SELECT {ORDER_COLUMNS}, l.product_ids, l.names, l.unit_prices, l.quantities, l.subtotals, l.discounts
         FROM orders, LATERAL (
             SELECT COALESCE(array_agg(product_id ORDER BY line), '{{}}') AS product_ids,
                    COALESCE(array_agg(name ORDER BY line), '{{}}') AS names,
                    COALESCE(array_agg(unit_price ORDER BY line), '{{}}') AS unit_prices,
                    COALESCE(array_agg(quantity ORDER BY line), '{{}}') AS quantities,
                    COALESCE(array_agg(subtotal ORDER BY line), '{{}}') AS subtotals,
                    COALESCE(array_agg(discount ORDER BY line), '{{}}') AS discounts
             FROM order_items WHERE order_id = orders.id) l
         WHERE checkout_id = $1 AND renews IS NULL ORDER BY number"
    )))
    .bind(checkout)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let items = r
                .product_ids
                .into_iter()
                .zip(r.names)
                .zip(r.unit_prices)
                .zip(r.quantities)
                .zip(r.subtotals)
                .zip(r.discounts)
                .map(
                    |(((((product_id, name), unit_price), quantity), subtotal), discount)| {
                        ItemView {
                            product_id: crate::catalogue::ProductId(product_id),
                            name,
                            unit_price,
                            quantity,
                            subtotal,
                            discount,
                        }
                    },
                )
                .collect();
            view_of(r.order, items)
        })
        .collect())
}

/// An order with its lines, as columns of arrays in line order ([`of_checkout`]).
#[derive(sqlx::FromRow)]
struct OrderWithLines {
    #[sqlx(flatten)]
    order: OrderRow,
    product_ids: Vec<uuid::Uuid>,
    names: Vec<String>,
    unit_prices: Vec<Decimal>,
    quantities: Vec<i32>,
    subtotals: Vec<Decimal>,
    discounts: Vec<Decimal>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReopenError {
    #[error("no order {0}")]
    NotFound(i64),
    #[error("order {number} is {status}; only an order awaiting payment can be paid")]
    NotPayable { number: i64, status: OrderStatus },
    /// A renewal is charged by its subscription's billing (ours, or the gateway's dunning): a
    /// second way to pay it would pay it twice.
    #[error("order {0} is a subscription's renewal: its subscription's billing charges it")]
    Renewal(i64),
    #[error(transparent)]
    Queue(#[from] payfleet_queue::QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Locks order `number` for the transaction; it must be waiting for its payment.
async fn lock_payable(tx: &mut PgConnection, number: i64) -> Result<i64, ReopenError> {
    let row: Option<(i64, OrderStatus)> =
        sqlx::query_as("SELECT id, status FROM orders WHERE number = $1 FOR UPDATE")
            .bind(number)
            .fetch_optional(&mut *tx)
            .await?;
    let (id, status) = row.ok_or(ReopenError::NotFound(number))?;
    if !status.is_payable() {
        return Err(ReopenError::NotPayable { number, status });
    }
    Ok(id)
}

/// The buyer reopens payment of an order still waiting for it: its expiry moves to `expiry`
/// from now (the expiry job is replaced). Returns the order.
pub async fn reopen(
    pool: &sqlx::PgPool,
    number: i64,
    expiry: std::time::Duration,
) -> Result<OrderView, ReopenError> {
    let mut tx = pool.begin().await?;
    let id = lock_payable(&mut tx, number).await?;
    let renewal: bool = sqlx::query_scalar("SELECT renews IS NOT NULL FROM orders WHERE id = $1")
        .bind(id)
        .fetch_one(&mut *tx)
        .await?;
    if renewal {
        return Err(ReopenError::Renewal(number));
    }
    let expires_at =
        Utc::now() + chrono::Duration::from_std(expiry).unwrap_or(chrono::Duration::minutes(30));
    // After a failed payment, its session is spent: the next attempt gets a new one.
    sqlx::query(
        "UPDATE orders SET
             payment_attempt = payment_attempt + CASE WHEN status = 'payment_failed' THEN 1 ELSE 0 END,
             session_id = CASE WHEN status = 'payment_failed' THEN NULL ELSE session_id END,
             payment_url = CASE WHEN status = 'payment_failed' THEN NULL ELSE payment_url END,
             status = 'awaiting_payment', expires_at = $2, updated_at = now()
         WHERE id = $1",
    )
    .bind(id)
    .bind(expires_at)
    .execute(&mut *tx)
    .await?;
    expiry::schedule(&mut tx, number, expires_at).await?;
    record_event(
        &mut tx,
        id,
        OrderEventKind::Reopened,
        serde_json::json!({"expires_at": expires_at}),
    )
    .await?;
    tx.commit().await?;
    view(pool, number)
        .await?
        .ok_or(ReopenError::NotFound(number))
}

/// An operator ends the wait of an order now: its expiry job is moved to now (replacing it),
/// and the workers expire it as they would have later.
pub async fn expire_now(pool: &sqlx::PgPool, number: i64) -> Result<(), ReopenError> {
    let mut tx = pool.begin().await?;
    expire_in(&mut tx, number).await?;
    tx.commit().await?;
    Ok(())
}

/// [`expire_now`] in the caller's transaction.
pub(crate) async fn expire_in(tx: &mut PgConnection, number: i64) -> Result<(), ReopenError> {
    let id = lock_payable(tx, number).await?;
    let now = Utc::now();
    sqlx::query("UPDATE orders SET expires_at = $2, updated_at = now() WHERE id = $1")
        .bind(id)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    expiry::schedule(tx, number, now).await?;
    Ok(())
}

/// The order side's job kinds, each with its worker: expiries and coin settlements.
pub fn register(registry: &mut Registry) -> Result<(), RegistryError> {
    registry
        .add::<expiry::ExpireOrder, _>(expiry::Expirer)?
        .add::<coin_payment::SettleCoins, _>(coin_payment::CoinSettler)?;
    Ok(())
}
