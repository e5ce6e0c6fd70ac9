//! Refunds an operator asks for (`POST /admin/orders/{n}/refunds`).
//!
//! A request is written first, with the job that carries it out, in one transaction that holds
//! the order's lock and checks the amount against what is left to refund (the payment less its
//! recorded refunds and the requests still under way): two requests can never refund more than
//! was paid. The gateway is then asked, with the request's own idempotency key, by the request
//! itself and, if that did not finish (an outage, a crash), by the job later; asking twice
//! refunds once. The refund the gateway answers with is recorded through the same path as a
//! refund event (`apply`), so the seller is debited once whether our record or the gateway's
//! event comes first, or both.
//!
//! An order paid with coins asks no gateway: its request gives the coins back to the buyer's
//! wallet, debits the seller and marks the order refunded, all in the request's own transaction
//! (it is `succeeded` when written, or not written at all).

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::ProcessError;
use crate::gateways::api::{RefundOutcome, RefundRequest};
use crate::gateways::{GatewayError, GatewayName, GatewayRegistry};
use crate::ledger::coins::{self, CoinError};
use crate::ledger::sales::{self, Channel, Sale, TakeBack};
use crate::money::{Currency, Money};
use crate::orders::{self, OrderStatus};
use payfleet_queue::{self as queue, Job, JobError, NewJob, QueueError};

payfleet_queue::text_enum! {
    pub enum RefundState {
        Requested = "requested",
        Accepted = "accepted",
        Succeeded = "succeeded",
        Failed = "failed",
        /// The gateway took it, then canceled it: nothing moved.
        Canceled = "canceled",
    }
}

/// Carries out refund request `id` (when the request itself could not).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CarryOutRefund {
    pub id: i64,
}

impl Job for CarryOutRefund {
    const KIND: &'static str = "carry_out_refund";
    const QUEUE: &'static str = "payments";
}

/// How long the request itself has before the job takes over.
pub const JOB_DELAY: chrono::Duration = chrono::Duration::seconds(30);

#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct RefundView {
    pub id: i64,
    pub order_number: i64,
    /// What paid the order: `gateway` (then `gateway` names it) or `coins`.
    pub paid_with: String,
    /// None for a coin-paid order's refund.
    pub gateway: Option<GatewayName>,
    #[serde(with = "rust_decimal::serde::str")]
    #[schema(value_type = String)]
    pub amount: Decimal,
    pub currency: String,
    pub reason: String,
    pub state: RefundState,
    pub refund_id: Option<String>,
    pub failure: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Amounts with the currency's minor-unit digits ("14.90", not the stored "14.9000").
fn shaped(mut v: RefundView) -> RefundView {
    if let Ok(c) = v.currency.parse::<Currency>() {
        v.amount = v.amount.normalize();
        v.amount.rescale(c.exponent().max(v.amount.scale()));
    }
    v
}

const COLUMNS: &str =
    "id, order_number, paid_with, gateway, amount, currency::text AS currency, reason, state, refund_id,
                       failure, created_at, updated_at";

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct NewRefund {
    /// A decimal string; the whole amount left to refund when absent.
    pub amount: Option<String>,
    #[serde(default)]
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RefundError {
    #[error("no order {0}")]
    NoOrder(i64),
    #[error("order {number} is {status}: only a paid order can be refunded")]
    NotRefundable { number: i64, status: OrderStatus },
    #[error("{0}")]
    InvalidAmount(String),
    #[error("a refund of {amount} exceeds the {left} left to refund on order {number}")]
    Exceeds {
        number: i64,
        amount: Money,
        left: Money,
    },
    #[error("the reason is at most 500 characters")]
    InvalidReason,
    #[error("this Idempotency-Key was used for another refund")]
    KeyReused,
    #[error("no refund request {0}")]
    NoRequest(i64),
    #[error("gateway {0} is not enabled here")]
    GatewayDisabled(GatewayName),
    #[error(transparent)]
    Record(#[from] ProcessError),
    #[error(transparent)]
    Coins(#[from] CoinError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl From<crate::ledger::LedgerError> for RefundError {
    fn from(e: crate::ledger::LedgerError) -> Self {
        Self::Record(e.into())
    }
}

/// Writes refund request `key` for order `number` (or returns the one written before with this
/// key). Returns the request and whether it was written now.
pub async fn request(
    pool: &PgPool,
    number: i64,
    key: &str,
    new: &NewRefund,
) -> Result<(RefundView, bool), RefundError> {
    if new.reason.chars().count() > 500 {
        return Err(RefundError::InvalidReason);
    }
    let mut tx = pool.begin().await?;
    let paid = orders::lock_for_refund(&mut tx, number)
        .await?
        .ok_or(RefundError::NoOrder(number))?;
    let payment: Option<(Option<String>, Option<Decimal>)> = match &paid.session_id {
        Some(session_id) => sqlx::query_as(
            "SELECT payment_id, amount FROM payment_orders WHERE gateway = $1 AND session_id = $2",
        )
        .bind(paid.gateway)
        .bind(session_id)
        .fetch_optional(&mut *tx)
        .await?,
        None => None,
    };
    let (payment_id, captured) = payment.unwrap_or_default();
    // Under the order's lock: a concurrent request with the same key has committed or not.
    if let Some(existing) = by_key(&mut tx, key).await? {
        let same_amount = match &new.amount {
            Some(a) => Decimal::from_str_exact(a.trim()).ok() == Some(existing.amount),
            None => true,
        };
        if existing.order_number != number || !same_amount {
            return Err(RefundError::KeyReused);
        }
        return Ok((existing, false));
    }
    let c: Currency = paid
        .currency
        .parse()
        .map_err(|_| RefundError::InvalidAmount(format!("order {number} has no currency")))?;
    if !matches!(
        paid.status,
        OrderStatus::Paid | OrderStatus::PartiallyRefunded
    ) {
        return Err(RefundError::NotRefundable {
            number,
            status: paid.status,
        });
    }
    let paid_through = match (&paid.session_id, &payment_id, captured) {
        _ if paid.paid_with_coins => None,
        (Some(session), Some(payment), Some(captured)) => {
            Some((session.clone(), payment.clone(), captured))
        }
        _ => {
            return Err(RefundError::NotRefundable {
                number,
                status: paid.status,
            });
        }
    };
    let (captured, taken) = match &paid_through {
        Some((session, _, captured)) => (
            *captured,
            gateway_taken(&mut tx, paid.gateway, session).await?,
        ),
        None => (paid.total, coins_taken(&mut tx, number).await?),
    };
    let left =
        Money::new(captured - taken, c).map_err(|e| RefundError::InvalidAmount(e.to_string()))?;
    let amount = match &new.amount {
        Some(a) => Money::parse(a, c.as_str()).map_err(|e| {
            RefundError::InvalidAmount(format!("amount {a:?} is not an amount of {c}: {e}"))
        })?,
        None => left,
    };
    if amount.amount() <= Decimal::ZERO {
        return Err(RefundError::InvalidAmount(
            "a refund is of a positive amount (nothing is left to refund)".into(),
        ));
    }
    if amount.amount() > left.amount() {
        return Err(RefundError::Exceeds {
            number,
            amount,
            left,
        });
    }
    let Some((session, payment, _)) = paid_through else {
        let reservation = paid.coin_reservation.ok_or(RefundError::NotRefundable {
            number,
            status: paid.status,
        })?;
        let view = refund_coins(&mut tx, number, key, new, &reservation, amount).await?;
        tx.commit().await?;
        tracing::info!(order = number, refund_request = view.id, %amount, "coins given back");
        return Ok((view, true));
    };
    crate::ledger::payouts::hold_against_payouts(&mut tx, &paid.seller_id.to_string(), c).await?;
    let view: RefundView = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO refund_requests (idempotency_key, order_number, gateway, session_id, payment_id, amount, currency, reason)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING {COLUMNS}"
    )))
    .bind(key)
    .bind(number)
    .bind(paid.gateway)
    .bind(&session)
    .bind(&payment)
    .bind(amount.amount())
    .bind(c.as_str())
    .bind(new.reason.trim())
    .fetch_one(&mut *tx)
    .await
    .map_err(key_taken)?;
    let view = shaped(view);
    let job = NewJob::of(&CarryOutRefund { id: view.id })?
        .key(format!("carry_out_refund:{}", view.id))
        .run_at(Utc::now() + JOB_DELAY);
    queue::enqueue(&mut *tx, job).await?;
    tx.commit().await?;
    tracing::info!(order = number, refund_request = view.id, %amount, "refund requested");
    Ok((view, true))
}

/// The same key taken at this moment for another order's refund.
fn key_taken(e: sqlx::Error) -> RefundError {
    if crate::db::constraint(&e) == Some("refund_requests_idempotency_key_key") {
        RefundError::KeyReused
    } else {
        RefundError::Database(e)
    }
}

/// What a gateway payment has given back or is giving back: its recorded refunds, and the
/// requests under way that are not recorded as refunds yet.
async fn gateway_taken(
    tx: &mut sqlx::PgConnection,
    gateway: GatewayName,
    session: &str,
) -> Result<Decimal, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT COALESCE((SELECT sum(r.amount) FROM payment_refunds r
                            JOIN payment_orders po ON po.id = r.payment_order_id
                           WHERE po.gateway = $1 AND po.session_id = $2), 0)
              + COALESCE((SELECT sum(q.amount) FROM refund_requests q
                           WHERE q.gateway = $1 AND q.session_id = $2
                             AND q.state IN ('requested', 'accepted')
                             AND NOT EXISTS (SELECT 1 FROM payment_refunds r
                                              WHERE r.gateway = q.gateway AND r.refund_id = q.refund_id)), 0)",
    )
    .bind(gateway)
    .bind(session)
    .fetch_one(&mut *tx)
    .await
}

/// The coin refunds of a coin-paid order (each done when written).
async fn coin_refunds(
    tx: &mut sqlx::PgConnection,
    number: i64,
) -> Result<Vec<(String, Decimal)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT refund_id, amount FROM refund_requests
         WHERE order_number = $1 AND paid_with = 'coins' AND state = 'succeeded' ORDER BY id",
    )
    .bind(number)
    .fetch_all(&mut *tx)
    .await
}

async fn coins_taken(tx: &mut sqlx::PgConnection, number: i64) -> Result<Decimal, sqlx::Error> {
    Ok(coin_refunds(tx, number)
        .await?
        .iter()
        .map(|(_, a)| *a)
        .sum())
}

/// A coin-paid order's refund, under the order's lock: the request (done), the coins back in
/// the buyer's wallet, the seller's part and the fee's taken back as for any refund, and the
/// order's refunded amount, in the caller's transaction.
async fn refund_coins(
    tx: &mut sqlx::PgConnection,
    number: i64,
    key: &str,
    new: &NewRefund,
    reservation: &str,
    amount: Money,
) -> Result<RefundView, RefundError> {
    let refund_id = format!("coins-{:032x}", rand::random::<u128>());
    let view: RefundView = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO refund_requests (idempotency_key, order_number, paid_with, amount, currency, reason, state, refund_id)
         VALUES ($1, $2, 'coins', $3, $4, $5, 'succeeded', $6) RETURNING {COLUMNS}"
    )))
    .bind(key)
    .bind(number)
    .bind(amount.amount())
    .bind(amount.currency().as_str())
    .bind(new.reason.trim())
    .bind(&refund_id)
    .fetch_one(&mut *tx)
    .await
    .map_err(key_taken)?;
    coins::refund(tx, reservation, amount, &refund_id, number).await?;
    if let Some(sale) = Sale::of_order(tx, number, Channel::Coins).await? {
        let facts = coin_refunds(tx, number)
            .await?
            .into_iter()
            .map(|(refund_id, a)| {
                Money::new(a, amount.currency())
                    .map(|amount| TakeBack::Refund { refund_id, amount })
                    .map_err(|e| RefundError::InvalidAmount(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        sales::settle_take_backs(tx, &sale, &facts).await?;
    }
    orders::coin_payment::record_refund(tx, number, amount.amount()).await?;
    Ok(shaped(view))
}

async fn by_key(tx: &mut sqlx::PgConnection, key: &str) -> Result<Option<RefundView>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM refund_requests WHERE idempotency_key = $1"
    )))
    .bind(key)
    .fetch_optional(&mut *tx)
    .await
    .map(|v| v.map(shaped))
}

/// An operator paid back another way the buyer of a refund recorded as done that the gateway
/// then reported failed or canceled (the consistency check `refund_failed_after_done`): the
/// finding closes. Whether there was such a refund, not repaid before.
pub async fn repaid_elsewhere(
    pool: &PgPool,
    gateway: GatewayName,
    refund_id: &str,
) -> Result<bool, sqlx::Error> {
    let marked = sqlx::query(
        "UPDATE refunds_ended SET repaid_at = now()
         WHERE gateway = $1 AND refund_id = $2 AND repaid_at IS NULL
           AND (EXISTS (SELECT 1 FROM payment_refunds r WHERE r.gateway = $1 AND r.refund_id = $2)
                OR EXISTS (SELECT 1 FROM second_payment_refunds r
                           JOIN second_payments p ON p.id = r.second_payment_id
                           WHERE p.gateway = $1 AND r.refund_id = $2))",
    )
    .bind(gateway)
    .bind(refund_id)
    .execute(pool)
    .await?;
    if marked.rows_affected() > 0 {
        tracing::info!(%gateway, refund = refund_id, "an operator paid back the buyer of a refund the gateway failed after it was done");
    }
    Ok(marked.rows_affected() > 0)
}

pub async fn get(pool: &PgPool, id: i64) -> Result<Option<RefundView>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM refund_requests WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await
    .map(|v| v.map(shaped))
}

/// An order's refund requests, oldest first.
pub async fn of_order(pool: &PgPool, number: i64) -> Result<Vec<RefundView>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM refund_requests WHERE order_number = $1 ORDER BY id"
    )))
    .bind(number)
    .fetch_all(pool)
    .await
    .map(|list| list.into_iter().map(shaped).collect())
}

/// What asking the gateway came to.
#[derive(Debug)]
pub enum CarriedOut {
    /// Answered (succeeded, accepted, failed) now or before.
    Answered(RefundView),
    /// The gateway (or our database) did not answer: the request stays `requested`, and its job
    /// asks again later.
    NotYet(RefundView, GatewayError),
    /// The payment was disputed after the refund was asked for, and the dispute is open: the
    /// gateway is not asked while it is (the buyer would get the refund and the chargeback),
    /// and the request stays `requested` until the dispute ends.
    Held(RefundView),
}

/// How long after its first ask a refund request whose answer never came (a timeout, a 5xx, an
/// answer we could not read) is asked of the gateway again, under the same idempotency key.
/// Stripe keeps a key at least 24 hours and may forget it after; Razorpay and Mercado Pago
/// promise no longer. Asked again once the gateway has forgotten the key, a refund it made the
/// first time would be made a second time, and neither the ledger (the refunds are two refunds
/// of one payment) nor any check could tell. The request's own retries (25 attempts, their
/// backoff about 15 hours in all, 19 at the most) mostly end within it; what comes later (the
/// last of them behind a backlog, an operator's job retry, a dispute's hold ending, the request
/// asked for again) ends the request instead, for an operator to look at the gateway: it may
/// leave a refund to ask for again, never one made twice.
pub const ASK_AGAIN_WITHIN: std::time::Duration = std::time::Duration::from_secs(20 * 3600);

/// How a request ended by [`ASK_AGAIN_WITHIN`] starts its failure: the database's
/// `refund_request_unconfirmed` (migration 0087: the consistency check `refund_unconfirmed`,
/// the payouts' hold) finds them by these words, written out there too.
pub const UNANSWERED: &str = "the gateway never answered this refund";

impl RefundView {
    /// Ended because the gateway never answered within [`ASK_AGAIN_WITHIN`]: the gateway may or
    /// may not have made it, which is not a refusal.
    pub fn unanswered(&self) -> bool {
        self.state == RefundState::Failed
            && self
                .failure
                .as_deref()
                .is_some_and(|f| f.starts_with(UNANSWERED))
    }
}

/// How long a refund held by an open dispute waits before it looks again: disputes take weeks.
pub const DISPUTE_HOLD: std::time::Duration = std::time::Duration::from_secs(3600);

/// What the payment's disputes say of a refund asked for before them.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Disputed {
    /// None, every one won, or what the lost ones took leaves room for the refund: it goes
    /// ahead.
    No,
    /// One is open: the refund waits.
    Open,
    /// One lost (the chargeback gave the buyer the money) or ended in a refund since the
    /// refund was asked for, and what is left of the payment does not cover it: made, it would
    /// pay the buyer twice.
    Ended(String),
}

/// What the disputes of `gateway`'s payment on `session` say of a refund of `amount` asked for
/// at `asked_at`. What is left counts every lost or refund-ended dispute whole beside the
/// recorded refunds (a dispute ended by a refund may count that refund twice): when in doubt,
/// the buyer is not paid twice, and the operator sees the failed request.
pub(super) async fn disputed(
    pool: &PgPool,
    gateway: GatewayName,
    session: &str,
    amount: Decimal,
    asked_at: DateTime<Utc>,
) -> Result<Disputed, sqlx::Error> {
    let disputes: Vec<(String, Decimal, bool)> = sqlx::query_as(
        "SELECT d.status, d.amount, d.updated_at >= $3 FROM payment_disputes d
         JOIN payment_orders po ON po.id = d.payment_order_id
         WHERE po.gateway = $1 AND po.session_id = $2",
    )
    .bind(gateway)
    .bind(session)
    .bind(asked_at)
    .fetch_all(pool)
    .await?;
    if disputes.iter().any(|(s, _, _)| s == "open") {
        return Ok(Disputed::Open);
    }
    let ended = |s: &str| matches!(s, "lost" | "refunded");
    let Some((since, _, _)) = disputes.iter().find(|(s, _, since)| ended(s) && *since) else {
        return Ok(Disputed::No);
    };
    let (captured, refunded): (Option<Decimal>, Decimal) = sqlx::query_as(
        "SELECT po.amount, COALESCE((SELECT sum(r.amount) FROM payment_refunds r WHERE r.payment_order_id = po.id), 0)
         FROM payment_orders po WHERE po.gateway = $1 AND po.session_id = $2",
    )
    .bind(gateway)
    .bind(session)
    .fetch_one(pool)
    .await?;
    let taken: Decimal = disputes
        .iter()
        .filter(|(s, _, _)| ended(s))
        .map(|(_, a, _)| *a)
        .sum();
    let left = captured.unwrap_or_default() - refunded - taken;
    Ok(if amount <= left {
        Disputed::No
    } else {
        Disputed::Ended(since.clone())
    })
}

#[derive(sqlx::FromRow)]
struct Pending {
    gateway: GatewayName,
    session_id: String,
    payment_id: String,
    amount: Decimal,
    currency: String,
    gateway_key: uuid::Uuid,
    seller_account: Option<String>,
    /// The gateway's refund, once it took one.
    refund_id: Option<String>,
}

impl Pending {
    async fn of(pool: &PgPool, id: i64) -> Result<Self, sqlx::Error> {
        sqlx::query_as(
            "SELECT q.gateway, q.session_id, q.payment_id, q.amount, q.currency::text AS currency, q.gateway_key,
                    s.metadata ->> 'seller_account' AS seller_account, q.refund_id
             FROM refund_requests q
             LEFT JOIN payment_sessions s ON s.gateway = q.gateway AND s.session_id = q.session_id
             WHERE q.id = $1",
        )
        .bind(id)
        .fetch_one(pool)
        .await
    }

    fn amount(&self) -> Result<Money, RefundError> {
        let c: Currency = self
            .currency
            .parse()
            .map_err(|_| RefundError::InvalidAmount(format!("currency {}", self.currency)))?;
        Money::new(self.amount, c).map_err(|e| RefundError::InvalidAmount(e.to_string()))
    }

    /// The refund the gateway took, to record or to ask about later.
    fn settle(&self, refund_id: &str, amount: Money) -> super::SettleRefund {
        super::SettleRefund {
            gateway: self.gateway,
            session_id: self.session_id.clone(),
            payment_id: self.payment_id.clone(),
            refund_id: refund_id.to_owned(),
            amount,
            seller_account: self.seller_account.clone(),
        }
    }
}

/// Asks the gateway about accepted request `id`'s refund again, unless a job is asking already:
/// the job that asked may have ended (the gateway kept the refund pending past its attempts)
/// with the refund's event lost, and the request would then stay `accepted`, its amount held
/// from the seller's payouts, for ever. Asking for the refund again (its Idempotency-Key, or its
/// `CarryOutRefund` job) re-drives it.
async fn settle_again(pool: &PgPool, id: i64) -> Result<(), RefundError> {
    let p = Pending::of(pool, id).await?;
    let Some(refund_id) = p.refund_id.as_deref() else {
        return Ok(());
    };
    let job = p.settle(refund_id, p.amount()?).job()?;
    if queue::enqueue(pool, job).await?.is_some() {
        tracing::info!(refund_request = id, refund = %refund_id, "an accepted refund is asked about again");
    }
    Ok(())
}

/// Asks the gateway for request `id`'s refund and records its answer. Safe to run any number of
/// times, concurrently too: the gateway gets the same idempotency key, and the answer is
/// recorded once.
pub async fn carry_out(
    pool: &PgPool,
    gateways: &GatewayRegistry,
    id: i64,
) -> Result<CarriedOut, RefundError> {
    let view = get(pool, id).await?.ok_or(RefundError::NoRequest(id))?;
    if view.state == RefundState::Accepted {
        settle_again(pool, id).await?;
    }
    if view.state != RefundState::Requested {
        return Ok(CarriedOut::Answered(view));
    }
    let p = Pending::of(pool, id).await?;
    // A request is refused while its payment is disputed, but the dispute may open between the
    // request and the gateway's answer (an outage that kept the job retrying): the gateway is
    // asked only while no dispute is open or lost.
    match disputed(pool, p.gateway, &p.session_id, p.amount, view.created_at).await? {
        Disputed::No => {}
        Disputed::Open => return Ok(CarriedOut::Held(view)),
        Disputed::Ended(status) => {
            // Asked of the gateway already, its answer lost: the refund may have been made
            // before the dispute took the money too. Ended unanswered, so that it is reported
            // and held back from payouts as any unanswered refund is (`refund_unconfirmed`),
            // not ended as a refund that was never made.
            let ended = sqlx::query(
                "UPDATE refund_requests SET state = 'failed', updated_at = now(),
                        failure = CASE WHEN first_asked_at IS NULL
                            THEN 'the payment was disputed after the refund was asked for, and the dispute ended ' || $2 || ': the buyer has that money back through it, and what is left of the payment does not cover this refund'
                            ELSE $3 || ', first asked for at ' || first_asked_at || ', before its payment''s dispute ended ' || $2 || ': it may have been made, and asking again could give the buyer the disputed money a second time, so it is not asked again. If the gateway made it, its refund event records it (see the order''s refunds)'
                        END
                 WHERE id = $1 AND state = 'requested'",
            )
            .bind(id)
            .bind(&status)
            .bind(UNANSWERED)
            .execute(pool)
            .await?;
            if ended.rows_affected() == 1 {
                tracing::warn!(refund_request = id, dispute = %status, "a refund asked for before its payment's dispute was not made: the dispute ended it");
            }
            let view = get(pool, id).await?.ok_or(RefundError::NoRequest(id))?;
            return Ok(CarriedOut::Answered(view));
        }
    }
    let gateway = gateways
        .get(p.gateway)
        .ok_or(RefundError::GatewayDisabled(p.gateway))?;
    let amount = p.amount()?;
    // Stamped, and committed, before the gateway is first asked; read back on every later ask.
    let first_ask: Option<(DateTime<Utc>, bool)> = sqlx::query_as(
        "UPDATE refund_requests SET first_asked_at = COALESCE(first_asked_at, now())
         WHERE id = $1 AND state = 'requested'
         RETURNING first_asked_at, first_asked_at < now() - $2 * interval '1 second'",
    )
    .bind(id)
    .bind(ASK_AGAIN_WITHIN.as_secs_f64())
    .fetch_optional(pool)
    .await?;
    let Some((first_asked_at, forgotten)) = first_ask else {
        // Answered meanwhile (its event, or another run of its job).
        let view = get(pool, id).await?.ok_or(RefundError::NoRequest(id))?;
        return Ok(CarriedOut::Answered(view));
    };
    if forgotten {
        let failure = format!(
            "{UNANSWERED}, first asked for at {first_asked_at}, and may \
             have forgotten its idempotency key since: asking again could refund twice, so it is \
             not asked again. If the gateway made a refund of this payment for it, its refund event \
             records it (see the order's refunds); if not, ask for a new refund with a new \
             Idempotency-Key"
        );
        let ended = sqlx::query(
            "UPDATE refund_requests SET state = 'failed', failure = $2, updated_at = now()
             WHERE id = $1 AND state = 'requested'",
        )
        .bind(id)
        .bind(&failure)
        .execute(pool)
        .await?;
        if ended.rows_affected() == 1 {
            tracing::warn!(refund_request = id, %first_asked_at, "a refund whose answer never came was not asked again past the gateway's idempotency window: ended for an operator");
        }
        let view = get(pool, id).await?.ok_or(RefundError::NoRequest(id))?;
        return Ok(CarriedOut::Answered(view));
    }
    let asked = gateway
        .refund(&RefundRequest {
            session_id: p.session_id.clone(),
            payment_id: p.payment_id.clone(),
            amount,
            seller_account: p.seller_account.clone(),
            idempotency_key: format!("payfleet-refund-{}", p.gateway_key.simple()),
        })
        .await;
    let mut tx = pool.begin().await?;
    // Whoever records first wins; the other finds the request answered.
    let state: RefundState =
        sqlx::query_scalar("SELECT state FROM refund_requests WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_one(&mut *tx)
            .await?;
    if state != RefundState::Requested {
        drop(tx);
        let view = get(pool, id).await?.ok_or(RefundError::NoRequest(id))?;
        return Ok(CarriedOut::Answered(view));
    }
    let taken = |refund_id: &str| p.settle(refund_id, amount);
    let ended = match &asked {
        Ok(receipt) if receipt.succeeded => {
            super::apply::ended_as(&mut tx, p.gateway, &receipt.refund_id).await?
        }
        _ => None,
    };
    match asked {
        // The gateway reported this refund failed (or canceled) before its answer reached us
        // (an answer replayed under the same key after a timeout): the buyer has nothing back.
        Ok(receipt) if ended.is_some() => {
            let state = ended.unwrap_or_default();
            sqlx::query(
                "UPDATE refund_requests SET state = $3, refund_id = $2, updated_at = now(),
                        failure = 'the gateway reported the refund ' || $3 || ' before its answer came'
                 WHERE id = $1",
            )
            .bind(id)
            .bind(&receipt.refund_id)
            .bind(&state)
            .execute(&mut *tx)
            .await?;
            tracing::warn!(refund_request = id, refund = %receipt.refund_id, state, "the gateway answered a refund done that it had reported ended: ended");
        }
        Ok(receipt) if receipt.succeeded => {
            sqlx::query(
                "UPDATE refund_requests SET state = 'succeeded', refund_id = $2, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(&receipt.refund_id)
            .execute(&mut *tx)
            .await?;
            // Recorded as the gateway's refund event would record it; the event, when it comes,
            // finds it known.
            taken(&receipt.refund_id)
                .record(&mut tx, RefundOutcome::Succeeded)
                .await?;
            tracing::info!(refund_request = id, refund = %receipt.refund_id, "refund done");
        }
        Ok(receipt) => {
            // Its refund event may have been processed already (it overtook this answer): then
            // the refund is recorded, and the request is done.
            sqlx::query(
                "UPDATE refund_requests SET refund_id = $2, updated_at = now(),
                        state = CASE WHEN EXISTS (SELECT 1 FROM payment_refunds r
                                                  WHERE r.gateway = $3 AND r.refund_id = $2)
                                     THEN 'succeeded' ELSE 'accepted' END
                 WHERE id = $1",
            )
            .bind(id)
            .bind(&receipt.refund_id)
            .bind(p.gateway)
            .execute(&mut *tx)
            .await?;
            // Its event records it; if that never comes, the gateway is asked.
            queue::enqueue(&mut *tx, taken(&receipt.refund_id).job()?).await?;
            tracing::info!(refund_request = id, refund = %receipt.refund_id, "refund accepted by the gateway; its event (or, failing it, the gateway asked later) will record it");
        }
        // An answer we could not read, or an error of the gateway's own store, may hide a
        // refund that was made: asking again with the same key finds out, so neither is taken
        // as a refusal.
        Err(e)
            if e.is_transient()
                || matches!(e, GatewayError::Decode { .. } | GatewayError::Database(_)) =>
        {
            drop(tx);
            let view = get(pool, id).await?.ok_or(RefundError::NoRequest(id))?;
            return Ok(CarriedOut::NotYet(view, e));
        }
        Err(e) => {
            sqlx::query(
                "UPDATE refund_requests SET state = 'failed', failure = $2, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(e.to_string())
            .execute(&mut *tx)
            .await?;
            tracing::warn!(refund_request = id, error = %e, "the gateway refused the refund");
        }
    }
    tx.commit().await?;
    let view = get(pool, id).await?.ok_or(RefundError::NoRequest(id))?;
    Ok(CarriedOut::Answered(view))
}

impl CarryOutRefund {
    pub async fn run(&self, pool: &PgPool, gateways: &GatewayRegistry) -> Result<(), JobError> {
        match carry_out(pool, gateways, self.id).await {
            Ok(CarriedOut::Answered(_)) => Ok(()),
            Ok(CarriedOut::NotYet(_, e)) => Err(JobError::retry(e)),
            Ok(CarriedOut::Held(_)) => Err(JobError::Snooze(DISPUTE_HOLD)),
            Err(RefundError::GatewayDisabled(g)) => Err(JobError::retry(format!(
                "gateway {g} is not enabled in this worker; the refund waits for one that has it"
            ))),
            Err(e) => Err(carry_out_error(e)),
        }
    }
}

/// An outage (the database's, in the refund's own statements, its coins, its ledger posting or
/// its queue's) is retried; anything else is a property of the refund and fails it for good.
fn carry_out_error(e: RefundError) -> JobError {
    let transient = match &e {
        RefundError::Database(e) | RefundError::Queue(QueueError::Database(e)) => {
            crate::db::is_transient(e)
        }
        RefundError::Record(e) => e.is_transient(),
        RefundError::Coins(e) => e.is_transient(),
        _ => false,
    };
    JobError::retry_if(transient, e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::LedgerError;

    #[test]
    fn a_refund_is_retried_after_an_outage_wherever_it_met_it() {
        let outage = || sqlx::Error::PoolTimedOut;
        for e in [
            RefundError::Database(outage()),
            RefundError::Queue(QueueError::Database(outage())),
            RefundError::Record(ProcessError::Database(outage())),
            RefundError::Coins(CoinError::Database(outage())),
            RefundError::Coins(CoinError::Ledger(LedgerError::Database(outage()))),
        ] {
            let shown = e.to_string();
            assert!(
                matches!(carry_out_error(e), JobError::Retry { .. }),
                "{shown}: an outage must be retried"
            );
        }
        for e in [
            RefundError::KeyReused,
            RefundError::Coins(CoinError::UnknownReservation("r-1".into())),
            RefundError::Database(sqlx::Error::RowNotFound),
        ] {
            let shown = e.to_string();
            assert!(
                matches!(carry_out_error(e), JobError::Fail(_)),
                "{shown}: a refusal is failed for good"
            );
        }
    }
}
