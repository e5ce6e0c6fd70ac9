//! Paying an order with the buyer's coins (`POST /orders/{number}/coins`).
//!
//! 1. The order notes its reservation id (one per order, unguessable) before anything is
//!    asked, so that however this ends, the order knows to give a reservation back.
//! 2. The order side reserves the order's total over the coins RPC. Refused (not enough coins):
//!    nothing changed. No answer: 503, and asking again reserves once (idempotent by id).
//! 3. One transaction, under the order's lock: the order turns paid (once), its `paid` event and
//!    the seller's sale are written, and a job to approve the reservation (spend the coins) is
//!    enqueued. If the order stopped being payable meanwhile (expired, paid through a gateway),
//!    the job releases the reservation instead.
//!
//! The expiry of an order with a reservation id enqueues its release, and a gateway payment for
//! an order paid with coins is an extra payment, refunded like any.
//!
//! A subscription's order is not paid with coins: its gateway charges each later period on what
//! paid the first, and coins leave it nothing to charge (nor, at Stripe, any subscription to
//! renew), so the subscription would start and never be paid again.

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use super::{OrderEventKind, OrderStatus, OrderView, record_event, view};
use crate::catalogue::ProductKind;
use crate::ledger::LedgerError;
use crate::ledger::coins::{self, ReservationState};
use crate::ledger::sales::{self, Channel, Sale};
use crate::messaging::rpc::{CoinReply, CoinRequest, Coins, RpcClient, RpcError};
use crate::money::Money;
use payfleet_queue::{self as queue, Job, JobContext, JobError, NewJob, QueueError, Worker};

#[derive(Debug, thiserror::Error)]
pub enum CoinPaymentError {
    #[error("no order {0}")]
    NotFound(i64),
    #[error("order {number} is {status}; only an order awaiting payment can be paid")]
    NotPayable { number: i64, status: OrderStatus },
    #[error(
        "order {0} is a subscription: its gateway charges every period, coins cannot; pay it through its payment link"
    )]
    Subscription(i64),
    #[error("the coins refused: {message}")]
    Refused { code: String, message: String },
    #[error("the coins did not answer ({0}); nothing was spent, try again")]
    Unavailable(String),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl From<RpcError> for CoinPaymentError {
    fn from(e: RpcError) -> Self {
        Self::Unavailable(e.to_string())
    }
}

/// Approves or releases a coin reservation for the order side. The workers host the coins, so
/// the job asks them in-process; the step is idempotent by the reservation's id.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SettleCoins {
    pub reservation_id: String,
    pub approve: bool,
}

impl Job for SettleCoins {
    const KIND: &'static str = "settle_coins";
    const QUEUE: &'static str = "orders";
}

impl SettleCoins {
    pub fn job(&self) -> Result<NewJob, QueueError> {
        Ok(NewJob::of(self)?.key(Self::key(&self.reservation_id, self.approve)))
    }

    /// The key of the step (spending, or giving back) of `reservation_id`.
    pub fn key(reservation_id: &str, approve: bool) -> String {
        let step = if approve { "approve" } else { "release" };
        format!("settle_coins:{reservation_id}:{step}")
    }

    /// Enqueues the settling of `reservation_id` in the caller's transaction.
    async fn enqueue(
        tx: &mut PgConnection,
        reservation_id: String,
        approve: bool,
    ) -> Result<(), QueueError> {
        let job = Self {
            reservation_id,
            approve,
        }
        .job()?;
        queue::enqueue(&mut *tx, job).await?;
        Ok(())
    }
}

/// Why a coin reservation was not settled again.
#[derive(Debug, thiserror::Error)]
pub enum SettleAgainError {
    #[error("no coin reservation {0} is still reserved")]
    NotReserved(String),
    #[error(
        "order {number} still waits for payment with coin reservation {reservation}: it is settled when the order is paid or expires"
    )]
    StillWaiting { reservation: String, number: i64 },
    #[error(
        "a settling of coin reservation {0} is waiting or running already (payfleet jobs counts)"
    )]
    UnderWay(String),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Settles again a coin reservation whose order no longer waits for it (`payfleet money
/// settle-coins`, for the `coin_reservation_unsettled` finding: its job ended dead): spent when
/// its order was paid with it, else given back. The step is decided here, from the order, never
/// by the operator, and is idempotent by the reservation's id. Returns whether it is spent.
pub async fn settle_again(pool: &PgPool, reservation_id: &str) -> Result<bool, SettleAgainError> {
    let found: Option<(Option<i64>, Option<bool>, Option<bool>)> = sqlx::query_as(
        "SELECT o.number, o.paid_with_coins AND o.coin_reservation = r.id,
                o.coin_reservation = r.id AND o.status IN ('awaiting_payment', 'payment_failed')
         FROM coin_reservations r LEFT JOIN orders o ON o.number = r.order_number
         WHERE r.id = $1 AND r.state = 'reserved'",
    )
    .bind(reservation_id)
    .fetch_optional(pool)
    .await?;
    let Some((number, spent, waiting)) = found else {
        return Err(SettleAgainError::NotReserved(reservation_id.to_owned()));
    };
    if let (Some(number), Some(true)) = (number, waiting) {
        return Err(SettleAgainError::StillWaiting {
            reservation: reservation_id.to_owned(),
            number,
        });
    }
    let approve = spent == Some(true);
    let job = SettleCoins {
        reservation_id: reservation_id.to_owned(),
        approve,
    }
    .job()?;
    match queue::enqueue(pool, job).await? {
        Some(_) => Ok(approve),
        None => Err(SettleAgainError::UnderWay(reservation_id.to_owned())),
    }
}

/// Records a refund of `amount` on order `number`, paid with coins: refunded once the refunds
/// reach its total, partly refunded before.
pub async fn record_refund(
    tx: &mut PgConnection,
    number: i64,
    amount: rust_decimal::Decimal,
) -> Result<(), sqlx::Error> {
    let moved: Option<(i64, OrderStatus)> = sqlx::query_as(
        "UPDATE orders SET amount_refunded = amount_refunded + $2,
                status = CASE WHEN amount_refunded + $2 >= total THEN 'refunded' ELSE 'partially_refunded' END,
                payment_status = CASE WHEN amount_refunded + $2 >= total THEN 'refunded' ELSE 'partially_refunded' END,
                updated_at = now()
         WHERE number = $1
         RETURNING id, status",
    )
    .bind(number)
    .bind(amount)
    .fetch_optional(&mut *tx)
    .await?;
    // All of it back: the services that acted on `paid` are told, once.
    if let Some((id, OrderStatus::Refunded)) = moved {
        record_event(
            tx,
            id,
            OrderEventKind::Refunded,
            serde_json::json!({"number": number, "paid_with": "coins"}),
        )
        .await?;
    }
    Ok(())
}

/// Runs the coin settlements: approving what was released (or the reverse) is a bug to look
/// at, failed for good; an outage is retried.
pub struct CoinSettler;

impl Worker<SettleCoins> for CoinSettler {
    async fn work(&self, ctx: JobContext, job: SettleCoins) -> Result<(), JobError> {
        match coins::decide(&ctx.pool, &job.reservation_id, job.approve).await {
            Ok(state) => {
                tracing::info!(reservation = %job.reservation_id, %state, "coin reservation settled");
                Ok(())
            }
            // An outage, even inside the ledger's posting, is retried (a connection ended
            // under the job once discarded it: the soak, seed 16305071602730530984).
            Err(e) => Err(e.into()),
        }
    }
}

#[derive(sqlx::FromRow)]
struct Payable {
    id: i64,
    status: OrderStatus,
    buyer_id: String,
    total: rust_decimal::Decimal,
    currency: String,
    coin_reservation: Option<String>,
    paid_with_coins: bool,
    kind: ProductKind,
}

async fn lock(tx: &mut PgConnection, number: i64) -> Result<Payable, CoinPaymentError> {
    sqlx::query_as(
        "SELECT id, status, buyer_id, total, currency::text AS currency, coin_reservation, paid_with_coins, kind
         FROM orders WHERE number = $1 FOR UPDATE",
    )
    .bind(number)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(CoinPaymentError::NotFound(number))
}

/// Pays order `number` with its buyer's coins. Asking again after it worked returns the order.
pub async fn pay(
    pool: &PgPool,
    rpc: &RpcClient,
    number: i64,
) -> Result<OrderView, CoinPaymentError> {
    // 1. The reservation's id, noted on the order first.
    let mut tx = pool.begin().await?;
    let o = lock(&mut tx, number).await?;
    if o.paid_with_coins {
        drop(tx);
        return order_view(pool, number).await;
    }
    // Refused before anything is reserved or noted: nothing to give back.
    if o.kind == ProductKind::Subscription {
        return Err(CoinPaymentError::Subscription(number));
    }
    if !o.status.is_payable() {
        return Err(CoinPaymentError::NotPayable {
            number,
            status: o.status,
        });
    }
    let reservation_id = match o.coin_reservation {
        Some(id) => id,
        None => {
            let id = format!("order-{:032x}", rand::random::<u128>());
            sqlx::query(
                "UPDATE orders SET coin_reservation = $2, updated_at = now() WHERE id = $1",
            )
            .bind(o.id)
            .bind(&id)
            .execute(&mut *tx)
            .await?;
            id
        }
    };
    tx.commit().await?;
    let amount = Money::parse(&o.total.to_string(), &o.currency)
        .map_err(|e| LedgerError::Mismatch(format!("order {number}: {e}")))?;

    // 2. Reserve over the RPC.
    let reply = rpc
        .call::<Coins>(&CoinRequest::Reserve {
            reservation_id: reservation_id.clone(),
            buyer_id: o.buyer_id.clone(),
            amount,
            order_number: Some(number),
        })
        .await?;
    match reply {
        CoinReply::Done { state, .. } if state == ReservationState::Reserved.as_str() => {}
        CoinReply::Done { state, .. } if state == ReservationState::Approved.as_str() => {}
        CoinReply::Done { state, .. } => {
            // Released: the order stopped waiting (its expiry gave the reservation back).
            let status = current_status(pool, number).await?;
            tracing::info!(order = number, %state, "coin reservation not held");
            return Err(CoinPaymentError::NotPayable { number, status });
        }
        CoinReply::Refused { code, message } => {
            return Err(CoinPaymentError::Refused { code, message });
        }
        CoinReply::Failed { message } => return Err(CoinPaymentError::Unavailable(message)),
    }

    // 3. Confirm, or give the coins back.
    let mut tx = pool.begin().await?;
    let o = lock(&mut tx, number).await?;
    if !o.status.is_payable() {
        if !o.paid_with_coins {
            SettleCoins::enqueue(&mut tx, reservation_id, false).await?;
            tx.commit().await?;
            return Err(CoinPaymentError::NotPayable {
                number,
                status: o.status,
            });
        }
        drop(tx);
        return order_view(pool, number).await;
    }
    sqlx::query(
        "UPDATE orders SET status = 'paid', payment_status = 'succeeded', paid_at = now(),
                paid_with_coins = true, updated_at = now()
         WHERE id = $1",
    )
    .bind(o.id)
    .execute(&mut *tx)
    .await?;
    record_event(
        &mut tx,
        o.id,
        OrderEventKind::Paid,
        serde_json::json!({"number": number, "paid_with": "coins"}),
    )
    .await?;
    if let Some(sale) = Sale::of_order(&mut tx, number, Channel::Coins).await? {
        sales::record_sale(&mut tx, &sale).await?;
    }
    SettleCoins::enqueue(&mut tx, reservation_id, true).await?;
    tx.commit().await?;
    tracing::info!(order = number, "order paid with coins");
    order_view(pool, number).await
}

async fn order_view(pool: &PgPool, number: i64) -> Result<OrderView, CoinPaymentError> {
    view(pool, number)
        .await?
        .ok_or(CoinPaymentError::NotFound(number))
}

async fn current_status(pool: &PgPool, number: i64) -> Result<OrderStatus, CoinPaymentError> {
    sqlx::query_scalar("SELECT status FROM orders WHERE number = $1")
        .bind(number)
        .fetch_optional(pool)
        .await?
        .ok_or(CoinPaymentError::NotFound(number))
}

/// In the caller's transaction (an expiry, a gateway payment): gives back the order's coin
/// reservation, if it asked for one and did not pay with it.
pub async fn give_back(tx: &mut PgConnection, order_id: i64) -> Result<(), QueueError> {
    let reservation: Option<String> = sqlx::query_scalar(
        "SELECT coin_reservation FROM orders WHERE id = $1 AND coin_reservation IS NOT NULL AND NOT paid_with_coins",
    )
    .bind(order_id)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(reservation_id) = reservation {
        SettleCoins::enqueue(tx, reservation_id, false).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::AccountKind;

    #[test]
    fn a_settlement_is_retried_after_an_outage_even_inside_its_ledger_posting() {
        let outage = || sqlx::Error::PoolTimedOut;
        for e in [
            coins::CoinError::Database(outage()),
            coins::CoinError::Ledger(LedgerError::Database(outage())),
        ] {
            assert!(
                matches!(JobError::from(e), JobError::Retry { .. }),
                "an outage must be retried"
            );
        }
        for e in [
            coins::CoinError::UnknownReservation("r-1".into()),
            coins::CoinError::Ledger(LedgerError::Insufficient {
                kind: AccountKind::CoinsReserved,
                owner: "buyer-1".into(),
            }),
            coins::CoinError::Ledger(LedgerError::Database(sqlx::Error::RowNotFound)),
        ] {
            assert!(
                matches!(JobError::from(e), JobError::Fail(_)),
                "a refusal is failed for good"
            );
        }
    }
}
