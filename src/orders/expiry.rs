//! An unpaid order expires by itself: one job per order (`order_expiry:<number>`), scheduled at
//! checkout; scheduling it again (the buyer reopens payment) replaces the previous one. Expiry
//! gives back the order's coupon redemption. A payment that arrives after expiry is refunded
//! (see `apply_payment`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use super::{OrderEventKind, OrderStatus, record_event};
use crate::catalogue::{self, CouponId};
use payfleet_queue::{
    self as queue, Job, JobContext, JobError, NewJob, QueueError, Scheduled, Worker,
};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExpireOrder {
    pub number: i64,
}

impl Job for ExpireOrder {
    const KIND: &'static str = "expire_order";
    const QUEUE: &'static str = "orders";
}

impl ExpireOrder {
    /// An order's expiry job's key is this and its number.
    pub const KEY_PREFIX: &'static str = "order_expiry:";

    pub fn key(number: i64) -> String {
        format!("{}{number}", Self::KEY_PREFIX)
    }
}

/// Orders still waiting for their payment longer than `grace` past their expiry, for the caller
/// to keep those whose expiry job is unfinished ([`ExpireOrder::key`]): the others' did not run
/// (discarded by an operator, or dead and deleted with the dead jobs a week later). Such an
/// order would take a payment days later as its own, and keeps its coupon redemption.
/// `POST /admin/orders/{n}/expire` expires it now. A renewal a gateway bills is not one: it has
/// no expiry job of ours (the gateway's dunning decides it, for weeks past its period's end).
/// (Number, expiry), oldest first.
pub async fn overdue(
    pool: &PgPool,
    grace: Duration,
    limit: i64,
) -> Result<Vec<(i64, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT number, expires_at FROM orders
         WHERE status IN ('awaiting_payment', 'payment_failed') AND renews IS NULL
           AND expires_at < now() - make_interval(secs => $1)
         ORDER BY expires_at LIMIT $2",
    )
    .bind(grace.as_secs_f64())
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Schedules (or moves) the expiry of order `number`, in the caller's transaction.
pub async fn schedule(
    tx: &mut PgConnection,
    number: i64,
    at: DateTime<Utc>,
) -> Result<Scheduled, QueueError> {
    queue::schedule(&mut *tx, job(number, at)?).await
}

/// Order `number`'s expiry job, to run `at`: one per order (its key), which a reschedule
/// replaces. (A new order's is written by checkout's numbering statement.)
fn job(number: i64, at: DateTime<Utc>) -> Result<NewJob, QueueError> {
    Ok(NewJob::of(&ExpireOrder { number })?
        .key(ExpireOrder::key(number))
        .run_at(at))
}

/// What an expiry run found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    Expired,
    /// Paid (or otherwise decided) first: nothing to do.
    NotPayable(OrderStatus),
    /// Its time moved (payment reopened): run again then.
    NotYet(Duration),
    NoSuchOrder,
}

#[derive(sqlx::FromRow)]
struct Row {
    id: i64,
    status: OrderStatus,
    expires_at: DateTime<Utc>,
    created_at: DateTime<Utc>,
}

/// How long past its time an order's expiry waits for the processing of events received
/// before that time (one of them may be its payment). Beyond it, a stuck event does not hold
/// expiries back: the order expires, and its payment, when processed, is given back.
const BACKLOG_GRACE: chrono::TimeDelta = chrono::TimeDelta::minutes(10);

/// How soon an expiry held back by the event backlog looks again.
const BACKLOG_RECHECK: Duration = Duration::from_secs(2);

/// Expires order `number` if it is still waiting for payment and its time has come.
pub async fn expire(pool: &PgPool, number: i64) -> Result<Expiry, payfleet_queue::QueueError> {
    let mut tx = pool.begin().await?;
    let row: Option<Row> = sqlx::query_as(
        "SELECT id, status, expires_at, created_at FROM orders WHERE number = $1 FOR UPDATE",
    )
    .bind(number)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(o) = row else {
        return Ok(Expiry::NoSuchOrder);
    };
    if !o.status.is_payable() {
        return Ok(Expiry::NotPayable(o.status));
    }
    let now = Utc::now();
    if o.expires_at > now {
        return Ok(Expiry::NotYet(
            (o.expires_at - now).to_std().unwrap_or_default(),
        ));
    }
    // A payment that arrived in time is the order's, however late the workers get to it (an
    // outage, a restart): while events received before its time still wait for processing, it
    // waits too (the hour-long soak found orders paid in time expired this way). Events of any
    // gateway: an internal order collected through Stripe is paid by Stripe's events, stored
    // under Stripe's name until processing tells whose they are. Only events received while
    // the order could be paid: one stuck since before the order existed cannot be its payment,
    // and must not hold back every order's expiry for the grace. Read through the unprocessed
    // events' index; rejected or waiting events do not hold it.
    if now - o.expires_at < BACKLOG_GRACE {
        let backlog: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM payment_events
                            WHERE processed_at IS NULL AND received_at <= $1 AND received_at >= $2
                              AND outcome IS NULL)",
        )
        .bind(o.expires_at)
        .bind(o.created_at)
        .fetch_one(&mut *tx)
        .await?;
        if backlog {
            return Ok(Expiry::NotYet(BACKLOG_RECHECK));
        }
    }
    expire_locked(&mut tx, o.id, number).await?;
    tx.commit().await?;
    Ok(Expiry::Expired)
}

/// Expires order `number` (row `id`, locked by the caller and still payable), in the caller's
/// transaction: its coupon redemption and coin reservation given back, its `expired` message
/// written. A payment after it is given back (`apply_payment`).
pub(super) async fn expire_locked(
    tx: &mut PgConnection,
    id: i64,
    number: i64,
) -> Result<(), QueueError> {
    sqlx::query(
        "UPDATE orders SET status = 'expired', expired_at = now(), updated_at = now() WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    let released: Option<CouponId> = sqlx::query_scalar(
        "UPDATE coupon_redemptions SET released_at = now()
         WHERE order_id = $1 AND released_at IS NULL RETURNING coupon_id",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(coupon) = released {
        catalogue::release_redemption(&mut *tx, coupon).await?;
    }
    super::coin_payment::give_back(&mut *tx, id).await?;
    record_event(
        &mut *tx,
        id,
        OrderEventKind::Expired,
        serde_json::json!({"number": number}),
    )
    .await?;
    Ok(())
}

/// Runs the expiry jobs. An order whose time moved (its payment reopened) is looked at again
/// then: a snooze, no attempt spent.
pub struct Expirer;

impl Worker<ExpireOrder> for Expirer {
    async fn work(&self, ctx: JobContext, job: ExpireOrder) -> Result<(), JobError> {
        match expire(&ctx.pool, job.number).await? {
            Expiry::NotYet(wait) => Err(JobError::Snooze(wait)),
            done => {
                tracing::debug!(order = job.number, ?done, "order expiry ran");
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checkout writes new orders' expiry jobs in its numbering statement, building this
    /// payload and key in SQL from each order's number: they must stay this shape.
    #[test]
    fn an_expiry_job_is_its_orders_number_under_its_key() {
        let payload = serde_json::to_value(ExpireOrder { number: 7 }).unwrap();
        assert_eq!(payload, serde_json::json!({"number": 7}));
        assert_eq!(ExpireOrder::key(7), format!("{}7", ExpireOrder::KEY_PREFIX));
    }
}
