//! Internal coins: a wallet per buyer and currency, as ledger accounts. Paying with coins is
//! reserve, then approve (the reservation is spent) or release (it goes back to the wallet).
//! Each step is idempotent by the reservation's id. Every change locks the buyer's accounts;
//! a CHECK constraint keeping the wallet and the reservations at or above zero is the last
//! barrier: a reservation beyond the balance fails cleanly, never leaves a negative balance.

use std::future::Future;
use std::pin::Pin;

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::{AccountKind, AccountRef, LedgerError, Transfer, TransferKind, account, lock, post};
use crate::messaging::rpc::{CoinReply, CoinRequest, Coins, Handler};
use crate::money::{Currency, Money};

payfleet_queue::text_enum! {
    pub enum ReservationState {
        Reserved = "reserved",
        Approved = "approved",
        Released = "released",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CoinError {
    #[error("buyer {buyer} has {balance} coins; {wanted} were asked")]
    Insufficient {
        buyer: String,
        balance: String,
        wanted: String,
    },
    #[error("no reservation {0}")]
    UnknownReservation(String),
    #[error("reservation {id} is {state}; it cannot be {action}")]
    Decided {
        id: String,
        state: ReservationState,
        action: &'static str,
    },
    #[error("{0} was used before with another buyer or amount")]
    Conflict(String),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl CoinError {
    /// An outage, in the coins' own statements or in their ledger postings: the same step may
    /// succeed later. Everything else is a property of the request.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Database(e) => crate::db::is_transient(e),
            Self::Ledger(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// A coin step in a job: an outage is retried; approving what was released (or the reverse),
/// or any other refusal, is a bug to look at, never retried.
impl From<CoinError> for payfleet_queue::JobError {
    fn from(e: CoinError) -> Self {
        Self::retry_if(e.is_transient(), e)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Wallet {
    pub buyer_id: String,
    pub currency: String,
    pub balance: String,
    pub reserved: String,
}

fn refs(buyer: &str, c: Currency) -> (AccountRef, AccountRef, AccountRef, AccountRef) {
    (
        AccountRef::new(AccountKind::CoinsIssued, buyer, c),
        AccountRef::new(AccountKind::BuyerWallet, buyer, c),
        AccountRef::new(AccountKind::CoinsReserved, buyer, c),
        AccountRef::new(AccountKind::CoinsSpent, buyer, c),
    )
}

async fn lock_buyer(
    tx: &mut sqlx::PgConnection,
    buyer: &str,
    c: Currency,
) -> Result<Decimal, sqlx::Error> {
    let (issued, wallet, reserved, spent) = refs(buyer, c);
    let wallet_id = account(tx, &wallet).await?;
    let mut ids = vec![
        account(tx, &issued).await?,
        wallet_id,
        account(tx, &reserved).await?,
        account(tx, &spent).await?,
    ];
    ids.sort_unstable();
    let balances = lock(tx, &ids).await?;
    Ok(balances
        .iter()
        .find(|(id, _)| *id == wallet_id)
        .map(|(_, b)| *b)
        .unwrap_or_default())
}

fn transfer(
    key: String,
    kind: TransferKind,
    from: AccountRef,
    to: AccountRef,
    amount: Money,
    reservation: &str,
) -> Transfer {
    Transfer {
        source_key: key,
        kind,
        from,
        to,
        amount,
        available_at: None,
        order_number: None,
        reference: Some(reservation.to_owned()),
    }
}

/// Gives a buyer coins (a promotion, a refund in coins). Once per `key`.
pub async fn grant(
    pool: &PgPool,
    buyer: &str,
    amount: Money,
    key: &str,
) -> Result<Wallet, CoinError> {
    let mut tx = pool.begin().await?;
    lock_buyer(&mut tx, buyer, amount.currency()).await?;
    let (issued, wallet, _, _) = refs(buyer, amount.currency());
    let wallet_id = account(&mut tx, &wallet).await?;
    let source = format!("coins_grant:{key}");
    let posted = post(
        &mut tx,
        &transfer(
            source.clone(),
            TransferKind::CoinsGrant,
            issued,
            wallet,
            amount,
            key,
        ),
    )
    .await?;
    if posted == super::Posted::AlreadyPosted {
        // The same key is the same grant: to this wallet, of this amount.
        let same: Option<bool> = sqlx::query_scalar(
            "SELECT to_account = $2 AND amount = $3 FROM ledger_transfers WHERE source_key = $1",
        )
        .bind(&source)
        .bind(wallet_id)
        .bind(amount.amount())
        .fetch_optional(&mut *tx)
        .await?;
        if same != Some(true) {
            return Err(CoinError::Conflict(key.to_owned()));
        }
    }
    tx.commit().await?;
    Ok(wallet_of(pool, buyer, amount.currency()).await?)
}

/// Reserves coins for a payment. Asking again with the same id gives the same reservation.
pub async fn reserve(
    pool: &PgPool,
    id: &str,
    buyer: &str,
    amount: Money,
    order: Option<i64>,
) -> Result<ReservationState, CoinError> {
    let mut tx = pool.begin().await?;
    let balance = lock_buyer(&mut tx, buyer, amount.currency()).await?;
    let existing: Option<Held> = sqlx::query_as(
        "SELECT buyer_id, amount, currency::text AS currency, state FROM coin_reservations WHERE id = $1 FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(h) = existing {
        // Released before it was made (its order is gone): it stays released.
        if h.amount.is_none() {
            return Ok(h.state);
        }
        if h.buyer_id.as_deref() != Some(buyer)
            || h.amount != Some(amount.amount())
            || h.currency.as_deref() != Some(amount.currency().as_str())
        {
            return Err(CoinError::Conflict(id.to_owned()));
        }
        return Ok(h.state);
    }
    if balance < amount.amount() {
        return Err(CoinError::Insufficient {
            buyer: buyer.to_owned(),
            balance: balance.normalize().to_string(),
            wanted: amount.to_string(),
        });
    }
    let (_, wallet, reserved, _) = refs(buyer, amount.currency());
    post(
        &mut tx,
        &transfer(
            format!("coins_reserve:{id}"),
            TransferKind::CoinsReserve,
            wallet.clone(),
            reserved,
            amount,
            id,
        ),
    )
    .await
    .map_err(|e| match e {
        // The CHECK refused it: the same answer as the check above.
        LedgerError::Insufficient { .. } => CoinError::Insufficient {
            buyer: buyer.to_owned(),
            balance: balance.normalize().to_string(),
            wanted: amount.to_string(),
        },
        other => CoinError::Ledger(other),
    })?;
    let made = sqlx::query(
        "INSERT INTO coin_reservations (id, buyer_id, amount, currency, order_number) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(id)
    .bind(buyer)
    .bind(amount.amount())
    .bind(amount.currency().as_str())
    .bind(order)
    .execute(&mut *tx)
    .await?;
    if made.rows_affected() == 0 {
        // Released meanwhile, before it was made: nothing is held (the transfer rolls back).
        drop(tx);
        return Ok(ReservationState::Released);
    }
    tx.commit().await?;
    Ok(ReservationState::Reserved)
}

/// A reservation as stored; a release that came before its reserve has no amount.
#[derive(sqlx::FromRow)]
struct Held {
    buyer_id: Option<String>,
    amount: Option<Decimal>,
    currency: Option<String>,
    state: ReservationState,
}

/// Approves (spends) or releases (gives back) a reservation. Doing the same again is a no-op;
/// the other step after one is refused. Releasing a reservation that was never made leaves it
/// released, so a reserve that arrives later holds nothing.
pub async fn decide(pool: &PgPool, id: &str, approve: bool) -> Result<ReservationState, CoinError> {
    let mut tx = pool.begin().await?;
    let state = decide_in(&mut tx, id, approve).await?;
    tx.commit().await?;
    Ok(state)
}

/// [`decide`], inside the caller's transaction.
async fn decide_in(
    tx: &mut sqlx::PgConnection,
    id: &str,
    approve: bool,
) -> Result<ReservationState, CoinError> {
    let (want, action) = if approve {
        (ReservationState::Approved, "approved")
    } else {
        (ReservationState::Released, "released")
    };
    let held = loop {
        let row: Option<Held> = sqlx::query_as(
            "SELECT buyer_id, amount, currency::text AS currency, state FROM coin_reservations WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        match row {
            Some(h) => break h,
            None if approve => return Err(CoinError::UnknownReservation(id.to_owned())),
            None => {
                let marked = sqlx::query(
                    "INSERT INTO coin_reservations (id, state, decided_at) VALUES ($1, 'released', now())
                     ON CONFLICT (id) DO NOTHING",
                )
                .bind(id)
                .execute(&mut *tx)
                .await?;
                if marked.rows_affected() == 1 {
                    return Ok(ReservationState::Released);
                }
                // A reserve committed meanwhile: decide on it.
            }
        }
    };
    let (Some(buyer), Some(amount), Some(currency)) = (held.buyer_id, held.amount, held.currency)
    else {
        // Released before it was made.
        return if held.state == want {
            Ok(want)
        } else {
            Err(CoinError::Decided {
                id: id.to_owned(),
                state: held.state,
                action,
            })
        };
    };
    let c: Currency = currency
        .parse()
        .map_err(|_| CoinError::UnknownReservation(id.to_owned()))?;
    lock_buyer(tx, &buyer, c).await?;
    // Read again under the lock: a concurrent decision has committed or not.
    let state: ReservationState =
        sqlx::query_scalar("SELECT state FROM coin_reservations WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_one(&mut *tx)
            .await?;
    match state {
        s if s == want => return Ok(s),
        ReservationState::Reserved => {}
        s => {
            return Err(CoinError::Decided {
                id: id.to_owned(),
                state: s,
                action,
            });
        }
    }
    let amount = Money::new(amount, c).map_err(|_| CoinError::UnknownReservation(id.to_owned()))?;
    let (_, wallet, reserved, spent) = refs(&buyer, c);
    let t = if approve {
        transfer(
            format!("coins_spend:{id}"),
            TransferKind::CoinsSpend,
            reserved,
            spent,
            amount,
            id,
        )
    } else {
        transfer(
            format!("coins_release:{id}"),
            TransferKind::CoinsRelease,
            reserved,
            wallet,
            amount,
            id,
        )
    };
    post(tx, &t).await?;
    sqlx::query("UPDATE coin_reservations SET state = $2, decided_at = now() WHERE id = $1")
        .bind(id)
        .bind(want)
        .execute(&mut *tx)
        .await?;
    Ok(want)
}

/// Gives `amount` of what reservation `id` paid back to its buyer's wallet (order `order`, paid
/// with it, refunded), once per `key`, in the caller's transaction. A reservation whose approval
/// has not run yet is approved first: its order was paid with it.
pub async fn refund(
    tx: &mut sqlx::PgConnection,
    id: &str,
    amount: Money,
    key: &str,
    order: i64,
) -> Result<(), CoinError> {
    decide_in(tx, id, true).await?;
    let held: Held = sqlx::query_as(
        "SELECT buyer_id, amount, currency::text AS currency, state FROM coin_reservations WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    let (Some(buyer), Some(paid)) = (held.buyer_id, held.amount) else {
        return Err(CoinError::UnknownReservation(id.to_owned()));
    };
    if held.currency.as_deref() != Some(amount.currency().as_str()) || amount.amount() > paid {
        return Err(CoinError::Conflict(id.to_owned()));
    }
    let (_, wallet, _, spent) = refs(&buyer, amount.currency());
    let mut t = transfer(
        format!("coins_refund:{key}"),
        TransferKind::CoinsRefund,
        spent,
        wallet,
        amount,
        id,
    );
    t.order_number = Some(order);
    post(tx, &t).await?;
    Ok(())
}

/// The coins' side of the [`Coins`] RPC, answered by the worker processes.
pub struct CoinService {
    pub pool: PgPool,
}

impl CoinService {
    async fn answer(&self, request: CoinRequest) -> CoinReply {
        let (id, result) = match request {
            CoinRequest::Reserve {
                reservation_id,
                buyer_id,
                amount,
                order_number,
            } => {
                let r = reserve(&self.pool, &reservation_id, &buyer_id, amount, order_number).await;
                (reservation_id, r)
            }
            CoinRequest::Approve { reservation_id } => {
                let r = decide(&self.pool, &reservation_id, true).await;
                (reservation_id, r)
            }
            CoinRequest::Release { reservation_id } => {
                let r = decide(&self.pool, &reservation_id, false).await;
                (reservation_id, r)
            }
        };
        let refused = |code: &str, e: &CoinError| CoinReply::Refused {
            code: code.to_owned(),
            message: e.to_string(),
        };
        match result {
            Ok(state) => CoinReply::Done {
                reservation_id: id,
                state: state.as_str().to_owned(),
            },
            Err(e @ CoinError::Insufficient { .. }) => refused("coins_insufficient", &e),
            Err(e @ CoinError::Decided { .. }) => refused("reservation_decided", &e),
            Err(e @ CoinError::UnknownReservation(_)) => refused("unknown_reservation", &e),
            Err(e @ CoinError::Conflict(_)) => refused("reservation_conflict", &e),
            Err(e) => {
                tracing::warn!(reservation = %id, error = %e, "a coin request failed");
                CoinReply::Failed {
                    message: e.to_string(),
                }
            }
        }
    }
}

impl Handler<Coins> for CoinService {
    fn handle(&self, request: CoinRequest) -> Pin<Box<dyn Future<Output = CoinReply> + Send + '_>> {
        Box::pin(self.answer(request))
    }
}

/// A buyer's wallet in one currency.
pub async fn wallet_of(pool: &PgPool, buyer: &str, c: Currency) -> Result<Wallet, sqlx::Error> {
    let (balance, reserved): (Decimal, Decimal) = sqlx::query_as(
        "SELECT COALESCE(sum(balance) FILTER (WHERE kind = 'buyer_wallet'), 0),
                COALESCE(sum(balance) FILTER (WHERE kind = 'coins_reserved'), 0)
         FROM ledger_accounts WHERE owner = $1 AND currency = $2 AND kind IN ('buyer_wallet', 'coins_reserved')",
    )
    .bind(buyer)
    .bind(c.as_str())
    .fetch_one(pool)
    .await?;
    Ok(Wallet {
        buyer_id: buyer.to_owned(),
        currency: c.to_string(),
        balance: super::decimal_text(balance, c.as_str()),
        reserved: super::decimal_text(reserved, c.as_str()),
    })
}

/// A buyer's wallets, one per currency they hold coins in.
pub async fn wallets(pool: &PgPool, buyer: &str) -> Result<Vec<Wallet>, sqlx::Error> {
    let currencies: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT currency::text FROM ledger_accounts WHERE owner = $1 AND kind = 'buyer_wallet' ORDER BY 1",
    )
    .bind(buyer)
    .fetch_all(pool)
    .await?;
    let mut out = Vec::new();
    for c in currencies {
        if let Ok(c) = c.parse() {
            out.push(wallet_of(pool, buyer, c).await?);
        }
    }
    Ok(out)
}
