//! The ledger: double entry underneath everything money. A movement is one [`Transfer`] of a
//! positive amount from one account to another in one currency, under a unique source key: the
//! same source can never post twice, and a transfer is never changed (a correction is another
//! transfer). Posting locks both accounts (in id order, so two postings cannot deadlock on
//! them), writes the transfer and one entry per account with the balance before and after, and
//! moves the balances: per account the entries sum to the balance, per currency all balances sum
//! to zero.
//!
//! Accounts are scoped to whom they concern (a seller, a buyer), so sales of different sellers
//! never wait on each other: a seller's sales, fees, refunds and payouts go through accounts
//! owned by that seller, and the platform's revenue is the sum of its per-seller revenue
//! accounts. A seller's balances are views of its `seller_pending` and `seller_available`
//! accounts.
//!
//! - `sales`: what a paid order, its refunds and disputes post, and the holding period's release
//! - `payouts`: paying sellers their available balance
//! - `invoices`: commission invoices per seller and period
//! - `coins`: the buyers' internal coins

pub mod coins;
pub mod invoices;
pub mod jobs;
pub mod payouts;
pub mod sales;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::PgConnection;

pub use crate::money::amount_text as decimal_text;
use crate::money::{Currency, Money};

crate::text_enum! {
    pub enum AccountKind {
        /// Money a gateway took for the platform (merchant of record), per gateway and seller.
        GatewayClearing = "gateway_clearing",
        /// Sales a gateway paid straight to the seller (Stripe Connect): reported, not held.
        ConnectedClearing = "connected_clearing",
        /// The platform's commission, per seller it was earned from.
        PlatformRevenue = "platform_revenue",
        /// What the platform owes a seller, within the holding period.
        SellerPending = "seller_pending",
        /// What the platform owes a seller, payable.
        SellerAvailable = "seller_available",
        /// A seller's sales paid straight to them (reporting).
        SellerConnected = "seller_connected",
        PayoutsInTransit = "payouts_in_transit",
        /// Money that left the platform (payouts paid).
        Bank = "bank",
        CoinsIssued = "coins_issued",
        BuyerWallet = "buyer_wallet",
        CoinsReserved = "coins_reserved",
        CoinsSpent = "coins_spent",
    }
}

crate::text_enum! {
    pub enum TransferKind {
        SaleCredit = "sale_credit",
        Fee = "fee",
        RefundDebit = "refund_debit",
        FeeRefund = "fee_refund",
        DisputeDebit = "dispute_debit",
        DisputeFeeDebit = "dispute_fee_debit",
        DisputeReversal = "dispute_reversal",
        DisputeFeeReversal = "dispute_fee_reversal",
        Release = "release",
        PayoutDebit = "payout_debit",
        PayoutPaid = "payout_paid",
        PayoutReversal = "payout_reversal",
        Adjustment = "adjustment",
        ConnectedSale = "connected_sale",
        CoinsGrant = "coins_grant",
        CoinsReserve = "coins_reserve",
        CoinsSpend = "coins_spend",
        CoinsRelease = "coins_release",
        /// Coins that paid an order, back in the buyer's wallet (the order refunded).
        CoinsRefund = "coins_refund",
    }
}

/// An account by what it is: its kind, whom it concerns, its currency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountRef {
    pub kind: AccountKind,
    pub owner: String,
    pub currency: Currency,
}

impl AccountRef {
    pub fn new(kind: AccountKind, owner: impl Into<String>, currency: Currency) -> Self {
        Self {
            kind,
            owner: owner.into(),
            currency,
        }
    }
}

/// A movement to post.
#[derive(Debug, Clone)]
pub struct Transfer {
    /// Unique: a second posting with the same key posts nothing.
    pub source_key: String,
    pub kind: TransferKind,
    pub from: AccountRef,
    pub to: AccountRef,
    pub amount: Money,
    pub available_at: Option<DateTime<Utc>>,
    pub order_number: Option<i64>,
    pub reference: Option<String>,
}

/// What posting did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posted {
    Posted(i64),
    /// The source was posted before: nothing moved.
    AlreadyPosted,
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("a transfer moves money between two accounts of its currency ({0})")]
    Mismatch(String),
    #[error("the balance of {kind} {owner} would go below zero")]
    Insufficient { kind: AccountKind, owner: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl LedgerError {
    fn from_db(e: sqlx::Error, to: &AccountRef, from: &AccountRef) -> Self {
        if crate::db::constraint(&e) == Some("ledger_accounts_wallet_not_negative") {
            // Only the account money leaves can go down.
            let _ = to;
            return Self::Insufficient {
                kind: from.kind,
                owner: from.owner.clone(),
            };
        }
        Self::Database(e)
    }
}

/// The id of an account, created at zero if new.
pub async fn account(tx: &mut PgConnection, a: &AccountRef) -> Result<i64, sqlx::Error> {
    // Nearly always it exists: one read, and the insert (with its speculative index entry and a
    // sequence value spent) only for a new one.
    if let Some(id) = account_id(tx, a).await? {
        return Ok(id);
    }
    let created: Option<i64> = sqlx::query_scalar(
        "INSERT INTO ledger_accounts (kind, owner, currency) VALUES ($1, $2, $3)
         ON CONFLICT (kind, owner, currency) DO NOTHING RETURNING id",
    )
    .bind(a.kind)
    .bind(&a.owner)
    .bind(a.currency.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(id) = created {
        return Ok(id);
    }
    // A separate statement: it sees the row another transaction committed meanwhile, which the
    // insert's own snapshot may not.
    account_id(tx, a).await?.ok_or(sqlx::Error::RowNotFound)
}

async fn account_id(tx: &mut PgConnection, a: &AccountRef) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM ledger_accounts WHERE kind = $1 AND owner = $2 AND currency = $3",
    )
    .bind(a.kind)
    .bind(&a.owner)
    .bind(a.currency.as_str())
    .fetch_optional(&mut *tx)
    .await
}

/// Locks accounts for the rest of the transaction, in id order. Returns their balances by id.
pub async fn lock(tx: &mut PgConnection, ids: &[i64]) -> Result<Vec<(i64, Decimal)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, balance FROM ledger_accounts WHERE id = ANY($1) ORDER BY id FOR UPDATE",
    )
    .bind(ids)
    .fetch_all(&mut *tx)
    .await
}

/// Posts a transfer in the caller's transaction: once per source key.
pub async fn post(tx: &mut PgConnection, t: &Transfer) -> Result<Posted, LedgerError> {
    if t.from.currency != t.amount.currency() || t.to.currency != t.amount.currency() {
        return Err(LedgerError::Mismatch(t.source_key.clone()));
    }
    if t.amount.is_zero() {
        return Ok(Posted::AlreadyPosted);
    }
    let from = account(tx, &t.from).await?;
    let to = account(tx, &t.to).await?;
    let balances = lock(tx, &[from, to]).await?;
    let balance = |id: i64| {
        balances
            .iter()
            .find(|(a, _)| *a == id)
            .map(|(_, b)| *b)
            .unwrap_or_default()
    };
    let inserted: Option<i64> = sqlx::query_scalar(
        "INSERT INTO ledger_transfers (source_key, kind, from_account, to_account, amount, currency,
                                       available_at, order_number, reference)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         ON CONFLICT (source_key) DO NOTHING RETURNING id",
    )
    .bind(&t.source_key)
    .bind(t.kind)
    .bind(from)
    .bind(to)
    .bind(t.amount.amount())
    .bind(t.amount.currency().as_str())
    .bind(t.available_at)
    .bind(t.order_number)
    .bind(&t.reference)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(transfer) = inserted else {
        return Ok(Posted::AlreadyPosted);
    };
    let amount = t.amount.amount();
    let (from_before, to_before) = (balance(from), balance(to));
    sqlx::query(
        "INSERT INTO ledger_entries (transfer_id, account_id, amount, balance_before, balance_after)
         VALUES ($1, $2, $3, $4, $5), ($1, $6, $7, $8, $9)",
    )
    .bind(transfer)
    .bind(from)
    .bind(-amount)
    .bind(from_before)
    .bind(from_before - amount)
    .bind(to)
    .bind(amount)
    .bind(to_before)
    .bind(to_before + amount)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE ledger_accounts SET balance = balance + d.delta, updated_at = now()
         FROM unnest($1::bigint[], $2::numeric[]) AS d(id, delta) WHERE ledger_accounts.id = d.id",
    )
    .bind([from, to])
    .bind([-amount, amount])
    .execute(&mut *tx)
    .await
    .map_err(|e| LedgerError::from_db(e, &t.to, &t.from))?;
    Ok(Posted::Posted(transfer))
}

/// A seller's balances in one currency.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Balance {
    pub currency: String,
    pub pending: String,
    pub available: String,
    /// Sales paid straight to the seller by the gateway (Stripe Connect), for reporting.
    pub connected_sales: String,
}

pub async fn balances(pool: &sqlx::PgPool, seller: &str) -> Result<Vec<Balance>, sqlx::Error> {
    let rows: Vec<(String, Decimal, Decimal, Decimal)> = sqlx::query_as(
        "SELECT currency::text,
                COALESCE(sum(balance) FILTER (WHERE kind = 'seller_pending'), 0),
                COALESCE(sum(balance) FILTER (WHERE kind = 'seller_available'), 0),
                COALESCE(sum(balance) FILTER (WHERE kind = 'seller_connected'), 0)
         FROM ledger_accounts
         WHERE owner = $1 AND kind IN ('seller_pending', 'seller_available', 'seller_connected')
         GROUP BY currency ORDER BY currency",
    )
    .bind(seller)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(c, p, a, s)| Balance {
            pending: decimal_text(p, &c),
            available: decimal_text(a, &c),
            connected_sales: decimal_text(s, &c),
            currency: c,
        })
        .collect())
}

/// One line of a seller's ledger.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Entry {
    pub id: i64,
    /// `pending`, `available` or `connected`.
    pub bucket: String,
    pub kind: TransferKind,
    pub currency: String,
    pub amount: Decimal,
    pub balance_before: Decimal,
    pub balance_after: Decimal,
    pub available_at: Option<DateTime<Utc>>,
    pub source_key: String,
    pub order_number: Option<i64>,
    pub reference: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// Amounts as the API writes them: decimal strings in the currency's minor unit.
impl Serialize for Entry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            id: i64,
            bucket: &'a str,
            kind: TransferKind,
            currency: &'a str,
            amount: String,
            balance_before: String,
            balance_after: String,
            available_at: Option<DateTime<Utc>>,
            source_key: &'a str,
            order_number: Option<i64>,
            reference: Option<&'a str>,
            created_at: DateTime<Utc>,
        }
        let c = self.currency.as_str();
        Wire {
            id: self.id,
            bucket: &self.bucket,
            kind: self.kind,
            currency: c,
            amount: decimal_text(self.amount, c),
            balance_before: decimal_text(self.balance_before, c),
            balance_after: decimal_text(self.balance_after, c),
            available_at: self.available_at,
            source_key: &self.source_key,
            order_number: self.order_number,
            reference: self.reference.as_deref(),
            created_at: self.created_at,
        }
        .serialize(s)
    }
}

/// A seller's entries, oldest first, `limit` after entry `after`.
pub async fn entries(
    pool: &sqlx::PgPool,
    seller: &str,
    after: i64,
    limit: i64,
) -> Result<Vec<Entry>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.id, replace(a.kind, 'seller_', '') AS bucket, t.kind, a.currency::text AS currency,
                e.amount, e.balance_before, e.balance_after, t.available_at, t.source_key, t.order_number,
                t.reference, e.created_at
         FROM ledger_entries e
         JOIN ledger_accounts a ON a.id = e.account_id
         JOIN ledger_transfers t ON t.id = e.transfer_id
         WHERE a.owner = $1 AND a.kind IN ('seller_pending', 'seller_available', 'seller_connected') AND e.id > $2
         ORDER BY e.id LIMIT $3",
    )
    .bind(seller)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// What the ledger's invariants look like now: accounts whose entries do not sum to their
/// balance, and currencies whose balances do not sum to zero. Both empty, always.
pub async fn check(pool: &sqlx::PgPool) -> Result<(Vec<i64>, Vec<String>), sqlx::Error> {
    let accounts: Vec<i64> = sqlx::query_scalar(
        "SELECT a.id FROM ledger_accounts a
         LEFT JOIN (SELECT account_id, sum(amount) AS total FROM ledger_entries GROUP BY account_id) e
                ON e.account_id = a.id
         WHERE a.balance <> COALESCE(e.total, 0)",
    )
    .fetch_all(pool)
    .await?;
    let currencies: Vec<String> = sqlx::query_scalar(
        "SELECT currency::text FROM ledger_accounts GROUP BY currency HAVING sum(balance) <> 0",
    )
    .fetch_all(pool)
    .await?;
    Ok((accounts, currencies))
}
