//! Payouts: each seller is paid its available balance once per payout period (a day, an ISO
//! week or a month, as the seller chose) when it is at least the seller's minimum. A payout
//! moves the amount from `seller_available` to `payouts_in_transit` and is `pending` until the
//! bank confirms it (`paid`: to `bank`) or refuses it (`failed`: back to `seller_available`, once).
//! Two runs for the same period, from two workers at once, make one payout: the period is part
//! of the payout's key and the seller's accounts are locked while it is taken.

use chrono::{DateTime, Datelike, NaiveDate, Utc};
use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::PgPool;

use super::{AccountKind, AccountRef, LedgerError, Transfer, TransferKind, account, lock, post};
use crate::catalogue::PayoutFrequency;
use crate::money::{Currency, Money};

payfleet_queue::text_enum! {
    pub enum PayoutState {
        Pending = "pending",
        Paid = "paid",
        Failed = "failed",
    }
}

/// The first day of the payout period `date` falls in.
pub fn period_start(frequency: PayoutFrequency, date: NaiveDate) -> NaiveDate {
    match frequency {
        PayoutFrequency::Daily => date,
        PayoutFrequency::Weekly => {
            date - chrono::Duration::days(i64::from(date.weekday().num_days_from_monday()))
        }
        PayoutFrequency::Monthly => date.with_day(1).unwrap_or(date),
    }
}

#[derive(Debug, Clone, sqlx::FromRow, utoipa::ToSchema)]
pub struct Payout {
    pub id: i64,
    pub seller_id: crate::catalogue::SellerId,
    pub currency: String,
    pub period_start: NaiveDate,
    #[schema(value_type = String)]
    pub amount: Decimal,
    pub state: PayoutState,
    pub failure: Option<String>,
    pub created_at: DateTime<Utc>,
    pub decided_at: Option<DateTime<Utc>>,
}

impl Serialize for Payout {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            id: i64,
            seller_id: &'a crate::catalogue::SellerId,
            currency: &'a str,
            period_start: NaiveDate,
            amount: String,
            state: PayoutState,
            failure: Option<&'a str>,
            created_at: DateTime<Utc>,
            decided_at: Option<DateTime<Utc>>,
        }
        Wire {
            id: self.id,
            seller_id: &self.seller_id,
            currency: &self.currency,
            period_start: self.period_start,
            amount: super::decimal_text(self.amount, &self.currency),
            state: self.state,
            failure: self.failure.as_deref(),
            created_at: self.created_at,
            decided_at: self.decided_at,
        }
        .serialize(s)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PayoutError {
    #[error("no payout {0}")]
    NotFound(i64),
    #[error("payout {id} is {state}; only a pending payout can be marked paid or failed")]
    Decided { id: i64, state: PayoutState },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A run that paid the sellers it could (`made`) and failed for these.
    #[error("{} of the run's payouts failed (the others were made): {}", .failed.len(), .failed.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Sellers {
        made: Vec<i64>,
        failed: Vec<SellerFailure>,
    },
}

impl PayoutError {
    /// An outage of the database (met directly or in a posting): asking again later may work.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Database(e) => crate::db::is_transient(e),
            Self::Ledger(e) => e.is_transient(),
            _ => false,
        }
    }
}

fn accounts(seller: &str, currency: Currency) -> (AccountRef, AccountRef, AccountRef) {
    (
        AccountRef::new(AccountKind::SellerAvailable, seller, currency),
        AccountRef::new(AccountKind::PayoutsInTransit, seller, currency),
        AccountRef::new(AccountKind::Bank, seller, currency),
    )
}

/// Pays every seller that is due on `today`. Returns the payouts made.
///
/// Each seller's payout is its own transaction: one that fails (an amount beyond what a payout
/// carries, a barrier of the ledger refusing it) is logged and the run goes on to the sellers
/// after it, then ends in [`PayoutError::Sellers`] naming each that failed, for an operator to
/// see (the run's job ends dead; run again, it pays no seller twice: one payout per period). An
/// outage of the database, met directly or in a posting, ends the run at once, to be retried:
/// every seller after would fail the same way.
pub async fn run(pool: &PgPool, today: NaiveDate) -> Result<Vec<i64>, PayoutError> {
    let candidates: Vec<(String, PayoutFrequency, Decimal, String)> = sqlx::query_as(
        "SELECT s.id::text, s.payout_frequency, COALESCE(m.minimum, s.payout_minimum), a.currency::text
         FROM sellers s JOIN ledger_accounts a ON a.owner = s.id::text AND a.kind = 'seller_available'
         LEFT JOIN seller_payout_minimums m ON m.seller_id = s.id AND m.currency = a.currency
         WHERE a.balance > 0 AND a.balance >= COALESCE(m.minimum, s.payout_minimum)
         ORDER BY s.id, a.currency",
    )
    .fetch_all(pool)
    .await?;
    let mut made = Vec::new();
    let mut failed = Vec::new();
    for (seller, frequency, minimum, currency) in candidates {
        let Ok(c) = currency.parse::<Currency>() else {
            continue;
        };
        match pay_one(pool, &seller, (frequency, minimum, c), today).await {
            Ok(Some(id)) => made.push(id),
            Ok(None) => {}
            Err(e) if e.is_transient() => return Err(e),
            Err(e) => {
                tracing::error!(%seller, currency = %c, error = %e, "a seller's payout failed; the run goes on to the others");
                failed.push(SellerFailure {
                    seller,
                    currency: c,
                    error: Box::new(e),
                });
            }
        }
    }
    if !failed.is_empty() {
        return Err(PayoutError::Sellers { made, failed });
    }
    Ok(made)
}

/// A seller's payout that failed in a run.
#[derive(Debug, thiserror::Error)]
#[error("seller {seller}'s payout in {currency}: {error}")]
pub struct SellerFailure {
    pub seller: String,
    pub currency: Currency,
    #[source]
    pub error: Box<PayoutError>,
}

/// Pays `seller` its available balance in currency `c` if it is due on `today`: the payout made,
/// or none (below the minimum, held back, paid already this period).
async fn pay_one(
    pool: &PgPool,
    seller: &str,
    (frequency, minimum, c): (PayoutFrequency, Decimal, Currency),
    today: NaiveDate,
) -> Result<Option<i64>, PayoutError> {
    let (available, transit, _) = accounts(seller, c);
    let mut tx = pool.begin().await?;
    let mut ids = vec![
        account(&mut tx, &available).await?,
        account(&mut tx, &transit).await?,
    ];
    ids.sort_unstable();
    let balances = lock(&mut tx, &ids).await?;
    let available_id = account(&mut tx, &available).await?;
    let balance = balances
        .iter()
        .find(|(id, _)| *id == available_id)
        .map(|(_, b)| *b)
        .unwrap_or_default();
    // Refunds under way (asked of the gateway, not recorded yet) will take the seller's
    // share of them back from this balance: paying it out now would leave the seller owing
    // what a refund already known has taken. Their whole amount is held back (the seller's
    // share is at most that); what they do not take is paid by a later run.
    let held = refunds_under_way(&mut tx, seller, c).await?;
    let balance = balance - held;
    if balance <= Decimal::ZERO || balance < minimum {
        if held > Decimal::ZERO {
            tracing::info!(%seller, currency = %c, %held, "no payout: refunds and disputes under way hold back the seller's available balance");
        }
        return Ok(None);
    }
    let period = period_start(frequency, today);
    let id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO payouts (seller_id, currency, period_start, amount) VALUES ($1::uuid, $2, $3, $4)
         ON CONFLICT (seller_id, currency, period_start) DO NOTHING RETURNING id",
    )
    .bind(seller)
    .bind(c.as_str())
    .bind(period)
    .bind(balance)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(id) = id else {
        return Ok(None); // paid already this period
    };
    let amount =
        Money::new(balance, c).map_err(|_| LedgerError::Mismatch(format!("payout {id}")))?;
    let key = format!("payout:{id}");
    post(
        &mut tx,
        &Transfer {
            source_key: key.clone(),
            kind: TransferKind::PayoutDebit,
            from: available,
            to: transit,
            amount,
            available_at: None,
            order_number: None,
            reference: Some(id.to_string()),
        },
    )
    .await?;
    // The payout names its debit (the schema checks, at commit, that it has one).
    sqlx::query(
        "UPDATE payouts SET debit_transfer_id = (SELECT id FROM ledger_transfers WHERE source_key = $2)
         WHERE id = $1",
    )
    .bind(id)
    .bind(&key)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::info!(payout = id, %seller, %amount, %period, "payout made");
    Ok(Some(id))
}

/// In the transaction of a refund request of `seller`'s, before it is written: waits for a
/// payout of the seller's being made to commit, and keeps the next from reading the seller's
/// refunds under way until the request has committed (a payout holds the seller's available
/// account `FOR UPDATE` before it reads them; this holds it `FOR SHARE`). Without it, a request
/// committed between a payout's read and its commit was not held back, and the refund then took
/// from a balance the payout had paid out.
pub async fn hold_against_payouts(
    tx: &mut sqlx::PgConnection,
    seller: &str,
    currency: Currency,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT 1 FROM ledger_accounts
         WHERE kind = 'seller_available' AND owner = $1 AND currency = $2 FOR SHARE",
    )
    .bind(seller)
    .bind(currency.as_str())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What the seller's refunds under way in `currency` may still take: the requests the gateway
/// has not answered or has accepted, not yet recorded as refunds (the same requests an order's
/// refunds count as taken, `payments::order_refunds`), found through the index of requests
/// under way. A request held by its payment's open dispute (`refund_request_held`, migration
/// 0072) counts too: the dispute took its own amount, not the request's, and whichever way it
/// ends the refund may still be made (lost, on what the dispute left of the payment; won, with
/// the dispute's share given back), so its share may still be taken from the seller. So does a
/// request ended unanswered (`refund_request_unconfirmed`, migration 0087): the gateway may
/// have made it, and its event would then take the seller's share, for as long as the
/// consistency check `refund_unconfirmed` reports it.
///
/// And a payment's disputes ended as a refund, for 30 days after one ended, hold back the part
/// of them that only refunds recorded before them cover: the ledger counts every recorded
/// refund as covering them (`sales::settle_take_backs`: our order of recording is not the
/// gateway's), but a partial refund made before a dispute opened gave the buyer other money,
/// and until the dispute's own refund is recorded that part may be money the buyer has
/// (`payment_dispute_refund_unrecorded`, migrations 0086 and 0088: per payment, as the ledger
/// counts it, never beyond what the sale can still give back). Requests and disputes alike,
/// only for the gateways whose money reaches the platform: the others' take-backs (a Stripe
/// Connect refund) come out of the seller's connected money, never what is paid out.
async fn refunds_under_way(
    tx: &mut sqlx::PgConnection,
    seller: &str,
    currency: Currency,
) -> Result<Decimal, sqlx::Error> {
    let requests: Decimal = sqlx::query_scalar(
        "SELECT COALESCE(sum(q.amount), 0) FROM refund_requests q
         JOIN order_money o ON o.number = q.order_number
         WHERE o.seller_id = $1::uuid AND q.currency = $2 AND q.gateway = ANY($3)
           AND (q.state IN ('requested', 'accepted')
                AND NOT EXISTS (SELECT 1 FROM payment_refunds r
                                 WHERE r.gateway = q.gateway AND r.refund_id = q.refund_id)
                OR q.state = 'failed' AND q.updated_at > now() - interval '30 days'
                   AND refund_request_unconfirmed(q))",
    )
    .bind(seller)
    .bind(currency.as_str())
    .bind(crate::gateways::through_platform())
    .fetch_one(&mut *tx)
    .await?;
    // Per payment, as the ledger counts its take-backs (migration 0088).
    let disputed: Decimal = sqlx::query_scalar(
        "SELECT COALESCE(sum(payment_dispute_refund_unrecorded(po.id)), 0)
         FROM payment_orders po
         JOIN payment_sessions s ON s.gateway = po.gateway AND s.session_id = po.session_id
         JOIN order_money o ON o.number = s.order_number
         WHERE o.seller_id = $1::uuid AND o.currency = $2 AND po.gateway = ANY($3)
           AND po.id IN (SELECT d.payment_order_id FROM payment_disputes d
                         WHERE d.status = 'refunded' AND d.refunded_before > 0
                           AND d.updated_at > now() - interval '30 days')",
    )
    .bind(seller)
    .bind(currency.as_str())
    .bind(crate::gateways::through_platform())
    .fetch_one(&mut *tx)
    .await?;
    Ok(requests + disputed)
}

/// The bank confirmed (`failure` None) or refused the payout. Once: a decided payout stays, the
/// same decision again returns it, the other one is refused.
pub async fn decide(pool: &PgPool, id: i64, failure: Option<&str>) -> Result<Payout, PayoutError> {
    let mut tx = pool.begin().await?;
    let row: Option<(String, String, PayoutState, Decimal)> = sqlx::query_as(
        "SELECT seller_id::text, currency::text, state, amount FROM payouts WHERE id = $1 FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let (seller, currency, state, amount) = row.ok_or(PayoutError::NotFound(id))?;
    let wanted = if failure.is_some() {
        PayoutState::Failed
    } else {
        PayoutState::Paid
    };
    if state == wanted {
        // The same decision again (a retried call): nothing more moves.
        drop(tx);
        return list_where(pool, "id", &id.to_string())
            .await?
            .pop()
            .ok_or(PayoutError::NotFound(id));
    }
    if state != PayoutState::Pending {
        return Err(PayoutError::Decided { id, state });
    }
    let c: Currency = currency
        .parse()
        .map_err(|_| LedgerError::Mismatch(format!("payout {id}")))?;
    let amount =
        Money::new(amount, c).map_err(|_| LedgerError::Mismatch(format!("payout {id}")))?;
    let (available, transit, bank) = accounts(&seller, c);
    let (key, kind, to, next) = match failure {
        None => (
            format!("payout_paid:{id}"),
            TransferKind::PayoutPaid,
            bank,
            PayoutState::Paid,
        ),
        // A failed payout gives the seller the money back, once.
        Some(_) => (
            format!("payout_failed:{id}"),
            TransferKind::PayoutReversal,
            available,
            PayoutState::Failed,
        ),
    };
    post(
        &mut tx,
        &Transfer {
            source_key: key.clone(),
            kind,
            from: transit,
            to,
            amount,
            available_at: None,
            order_number: None,
            reference: Some(id.to_string()),
        },
    )
    .await?;
    sqlx::query(
        "UPDATE payouts SET state = $2, failure = $3, decided_at = now(),
                decided_transfer_id = (SELECT id FROM ledger_transfers WHERE source_key = $4)
         WHERE id = $1",
    )
    .bind(id)
    .bind(next)
    .bind(failure)
    .bind(&key)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    list_where(pool, "id", &id.to_string())
        .await?
        .pop()
        .ok_or(PayoutError::NotFound(id))
}

/// Payouts whose `column` (a fixed name, never input) reads as `value`.
async fn list_where(
    pool: &PgPool,
    column: &'static str,
    value: &str,
) -> Result<Vec<Payout>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, seller_id, currency::text AS currency, period_start, amount, state, failure, created_at, decided_at
         FROM payouts WHERE {column}::text = $1 ORDER BY id DESC"
    )))
    .bind(value)
    .fetch_all(pool)
    .await
}

/// A seller's payouts, newest first.
pub async fn list(pool: &PgPool, seller: &str) -> Result<Vec<Payout>, sqlx::Error> {
    list_where(pool, "seller_id", seller).await
}

/// Payouts in `state`, oldest first: what an operator still has to confirm with the bank.
pub async fn in_state(pool: &PgPool, state: PayoutState) -> Result<Vec<Payout>, sqlx::Error> {
    let mut list = list_where(pool, "state", state.as_str()).await?;
    list.reverse();
    Ok(list)
}
