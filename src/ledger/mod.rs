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
//! - `poster`: the sales of payments posted in batches per seller, right after their effect
//! - `payouts`: paying sellers their available balance
//! - `invoices`: commission invoices per seller and period
//! - `coins`: the buyers' internal coins

pub mod coins;
pub mod invoices;
pub mod jobs;
pub mod payouts;
pub mod poster;
pub mod sales;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::PgConnection;

pub use crate::money::amount_text as decimal_text;

/// The ledger's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The time zone of invoice periods (`PAYFLEET_INVOICE_TIMEZONE`, UTC): a month is invoiced
    /// once it has ended there.
    pub invoice_timezone: chrono_tz::Tz,
}

impl Settings {
    pub fn from_env(env: &dyn crate::env::Env) -> Result<Self, crate::env::Invalid> {
        Ok(Self {
            invoice_timezone: match crate::env::var(env, "PAYFLEET_INVOICE_TIMEZONE") {
                None => chrono_tz::UTC,
                Some(v) => v.parse().map_err(|_| {
                    crate::env::invalid(
                        "PAYFLEET_INVOICE_TIMEZONE",
                        format!("{v:?} is not an IANA time zone name"),
                    )
                })?,
            },
        })
    }
}
use crate::money::{Currency, Money};

payfleet_queue::text_enum! {
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

payfleet_queue::text_enum! {
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

impl AccountKind {
    /// Whether its balance may never go below zero (`ledger_accounts_wallet_not_negative`).
    pub fn has_floor(&self) -> bool {
        matches!(self, Self::BuyerWallet | Self::CoinsReserved)
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
    /// An outage (a lost connection, a deadlock, a restart): the same posting may succeed
    /// later. A refusal of the ledger's rules is not one.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Database(e) if crate::db::is_transient(e))
    }
}

impl From<LedgerError> for payfleet_queue::JobError {
    fn from(e: LedgerError) -> Self {
        Self::retry_if(e.is_transient(), e)
    }
}

/// The id of an account, created at zero if new.
pub async fn account(tx: &mut PgConnection, a: &AccountRef) -> Result<i64, sqlx::Error> {
    let ids = accounts(tx, std::slice::from_ref(a)).await?;
    ids.first().copied().ok_or(sqlx::Error::RowNotFound)
}

/// The ids of accounts, in the order asked, each created at zero if new: one call of the
/// database's `ledger_accounts_of` (migration 0057), which reads them and, only for new ones,
/// creates them in one order whoever does (so two transactions creating the same accounts
/// cannot deadlock) and reads them again in a statement of its own (which sees the accounts
/// another transaction committed meanwhile).
pub async fn accounts(tx: &mut PgConnection, refs: &[AccountRef]) -> Result<Vec<i64>, sqlx::Error> {
    let (kinds, owners, currencies) = columns(refs.iter());
    let ids: Vec<i64> = sqlx::query_scalar("SELECT ledger_accounts_of($1, $2, $3::bpchar[])")
        .bind(&kinds)
        .bind(&owners)
        .bind(&currencies)
        .fetch_one(&mut *tx)
        .await?;
    if ids.len() != refs.len() {
        return Err(sqlx::Error::RowNotFound);
    }
    Ok(ids)
}

fn columns<'a>(
    refs: impl Iterator<Item = &'a AccountRef>,
) -> (Vec<&'a str>, Vec<&'a str>, Vec<&'a str>) {
    let mut columns = (Vec::new(), Vec::new(), Vec::new());
    for r in refs {
        columns.0.push(r.kind.as_str());
        columns.1.push(r.owner.as_str());
        columns.2.push(r.currency.as_str());
    }
    columns
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
    let posted = post_many(tx, std::slice::from_ref(t)).await?;
    Ok(posted.first().copied().unwrap_or(Posted::AlreadyPosted))
}

/// Posts transfers in the caller's transaction, each once per source key, in the order given
/// (a key given twice posts once), in one round trip however many there are: one call of the
/// database's `ledger_post` (migrations 0045, 0057 and 0061) finds the accounts (created if
/// new) before any lock, writes the new transfers, locks their accounts in id order (so two
/// postings cannot deadlock on them), writes the entries with each account's running balance
/// from the balances as locked, and moves the balances. What each transfer did comes back in
/// the same order.
pub async fn post_many(
    tx: &mut PgConnection,
    transfers: &[Transfer],
) -> Result<Vec<Posted>, LedgerError> {
    let mut refs: Vec<AccountRef> = Vec::new();
    let mut live = Vec::new();
    for (i, t) in transfers.iter().enumerate() {
        if t.from.currency != t.amount.currency() || t.to.currency != t.amount.currency() {
            return Err(LedgerError::Mismatch(t.source_key.clone()));
        }
        if t.amount.is_zero() {
            continue;
        }
        for a in [&t.from, &t.to] {
            if !refs.contains(a) {
                refs.push(a.clone());
            }
        }
        live.push(i);
    }
    let mut posted = vec![Posted::AlreadyPosted; transfers.len()];
    if live.is_empty() {
        return Ok(posted);
    }
    // Accounts by their 1-based place in `refs`, as the database's function takes them.
    let place = |a: &AccountRef| {
        refs.iter()
            .position(|r| r == a)
            .and_then(|i| i32::try_from(i + 1).ok())
            .unwrap_or_default()
    };
    let floored: Vec<i32> = refs
        .iter()
        .filter(|r| r.kind.has_floor())
        .map(place)
        .collect();
    let (account_kinds, account_owners, account_currencies) = columns(refs.iter());

    let mut keys = Vec::with_capacity(live.len());
    let mut kinds = Vec::with_capacity(live.len());
    let mut froms = Vec::with_capacity(live.len());
    let mut tos = Vec::with_capacity(live.len());
    let mut amounts = Vec::with_capacity(live.len());
    let mut currencies = Vec::with_capacity(live.len());
    let mut available = Vec::with_capacity(live.len());
    let mut orders = Vec::with_capacity(live.len());
    let mut references = Vec::with_capacity(live.len());
    for &i in &live {
        let t = &transfers[i];
        keys.push(t.source_key.as_str());
        kinds.push(t.kind.as_str());
        froms.push(place(&t.from));
        tos.push(place(&t.to));
        amounts.push(t.amount.amount());
        currencies.push(t.from.currency.as_str());
        available.push(t.available_at);
        orders.push(t.order_number);
        references.push(t.reference.as_deref());
    }
    let written: Vec<(i64, String)> = sqlx::query_as(
        "SELECT posted_id, posted_key
         FROM ledger_post($1, $2, $3::bpchar[], $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
    )
    .bind(&account_kinds)
    .bind(&account_owners)
    .bind(&account_currencies)
    .bind(&floored)
    .bind(&keys)
    .bind(&kinds)
    .bind(&froms)
    .bind(&tos)
    .bind(&amounts)
    .bind(&currencies)
    .bind(&available)
    .bind(&orders)
    .bind(&references)
    .fetch_all(&mut *tx)
    .await
    .map_err(|e| {
        if crate::db::constraint(&e) == Some("ledger_accounts_wallet_not_negative") {
            // The account named by the error's detail (its place in `refs`): one money leaves.
            let account = match &e {
                sqlx::Error::Database(d) => d
                    .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                    .and_then(|d| d.detail())
                    .and_then(|at| at.parse::<usize>().ok())
                    .and_then(|at| at.checked_sub(1))
                    .and_then(|i| refs.get(i)),
                _ => None,
            };
            if let Some(a) = account {
                return LedgerError::Insufficient {
                    kind: a.kind,
                    owner: a.owner.clone(),
                };
            }
        }
        LedgerError::Database(e)
    })?;
    let mut new: std::collections::HashMap<String, i64> =
        written.into_iter().map(|(id, key)| (key, id)).collect();
    for &i in &live {
        if let Some(id) = new.remove(&transfers[i].source_key) {
            posted[i] = Posted::Posted(id);
        }
    }
    Ok(posted)
}

/// A seller's balances in one currency.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Balance {
    pub currency: String,
    pub pending: String,
    pub available: String,
    /// Sales paid straight to the seller by the gateway (Stripe Connect), for reporting.
    pub connected_sales: String,
}

/// A seller's balances, with every sale confirmed so far posted.
pub async fn balances(pool: &sqlx::PgPool, seller: &str) -> Result<Vec<Balance>, sqlx::Error> {
    poster::settle(pool, seller).await?;
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
#[derive(Debug, Clone, sqlx::FromRow, utoipa::ToSchema)]
pub struct Entry {
    pub id: i64,
    /// `pending`, `available` or `connected`.
    pub bucket: String,
    pub kind: TransferKind,
    pub currency: String,
    #[schema(value_type = String)]
    pub amount: Decimal,
    #[schema(value_type = String)]
    pub balance_before: Decimal,
    #[schema(value_type = String)]
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

/// A seller's entries, oldest first, `limit` after entry `after`, with every sale confirmed so
/// far posted.
pub async fn entries(
    pool: &sqlx::PgPool,
    seller: &str,
    after: i64,
    limit: i64,
) -> Result<Vec<Entry>, sqlx::Error> {
    poster::settle(pool, seller).await?;
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

/// One transfer about an order, with the accounts it moved money between.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct OrderTransfer {
    pub id: i64,
    pub kind: String,
    pub source_key: String,
    #[serde(with = "rust_decimal::serde::str")]
    pub amount: Decimal,
    pub currency: String,
    /// `<kind>:<owner>` of each account.
    pub from_account: String,
    pub to_account: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// Every transfer about order `number`, in posting order.
pub async fn of_order(pool: &sqlx::PgPool, number: i64) -> Result<Vec<OrderTransfer>, sqlx::Error> {
    sqlx::query_as(
        "SELECT t.id, t.kind, t.source_key, t.amount, t.currency::text AS currency,
                f.kind || ':' || f.owner AS from_account, d.kind || ':' || d.owner AS to_account,
                t.created_at
         FROM ledger_transfers t
         JOIN ledger_accounts f ON f.id = t.from_account
         JOIN ledger_accounts d ON d.id = t.to_account
         WHERE t.order_number = $1 ORDER BY t.id",
    )
    .bind(number)
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
