//! What a paid order, its refunds and its disputes post, and the holding period's release.
//!
//! Where the platform is merchant of record (the internal gateway, the mock, Razorpay), the whole
//! amount reaches the platform's clearing account for the gateway: the seller's net is credited
//! to the seller's pending balance, available after the seller's holding period, and the fee to
//! the platform's revenue. Where the gateway pays the seller directly (Stripe Connect, Mercado
//! Pago's marketplace split), the sale is recorded for reporting (`seller_connected`) and the fee
//! for invoicing.
//!
//! Refunds and disputes are split like the sale: the seller bears `amount × net / total`
//! rounded half-even to the minor unit on the running total of everything taken back, the
//! platform's fee the rest, and together they never take back more than was paid
//! ([`settle_take_backs`]). A refund or dispute takes from the seller's pending balance while the
//! sale is in its holding period, from the available balance after (which may go below zero: the
//! seller then owes it from later sales). A dispute takes when it opens and gives back once if it
//! ends in the seller's favour, or if it ends as a refund (the refund then takes). Everything is
//! keyed by its source (order, refund id, dispute id), so a fact seen twice, or processed again,
//! posts nothing more.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use sqlx::{PgConnection, PgPool};

use super::{
    AccountKind, AccountRef, LedgerError, Transfer, TransferKind, accounts, lock, post_many,
};
use crate::gateways::{DisputeStatus, GatewayName};
use crate::money::{Currency, Money};

/// How an order was paid: through a gateway, or with the platform's coins (the platform took
/// the buyer's coins and owes the seller, as a merchant of record would).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    Gateway(GatewayName),
    Coins,
}

impl Channel {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Self::Gateway(g) => g.as_str(),
            Self::Coins => "coins",
        }
    }

    fn through_platform(&self) -> bool {
        match self {
            Self::Gateway(g) => crate::gateways::format(*g).settles_through_platform(),
            Self::Coins => true,
        }
    }
}

impl std::fmt::Display for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A paid order, as the ledger sees it.
#[derive(Debug, Clone)]
pub struct Sale {
    pub order_number: i64,
    pub seller_id: String,
    pub channel: Channel,
    pub total: Money,
    pub fee: Money,
    pub net: Money,
    pub paid_at: DateTime<Utc>,
    pub holding_days: i32,
}

struct Accounts {
    clearing: AccountRef,
    revenue: AccountRef,
    pending: AccountRef,
    available: AccountRef,
    connected: AccountRef,
}

impl Sale {
    fn currency(&self) -> Currency {
        self.total.currency()
    }

    fn accounts(&self) -> Accounts {
        let (seller, c) = (self.seller_id.as_str(), self.currency());
        let clearing_kind = if self.channel.through_platform() {
            AccountKind::GatewayClearing
        } else {
            AccountKind::ConnectedClearing
        };
        Accounts {
            clearing: AccountRef::new(clearing_kind, format!("{}:{seller}", self.channel), c),
            revenue: AccountRef::new(AccountKind::PlatformRevenue, seller, c),
            pending: AccountRef::new(AccountKind::SellerPending, seller, c),
            available: AccountRef::new(AccountKind::SellerAvailable, seller, c),
            connected: AccountRef::new(AccountKind::SellerConnected, seller, c),
        }
    }

    /// The seller's part of an amount taken back (refund, dispute); the rest is the fee's.
    pub fn split(&self, amount: &Money) -> Result<(Money, Money), LedgerError> {
        let seller = amount
            .share(&self.net, &self.total)
            .ok_or_else(|| LedgerError::Mismatch(format!("order {}", self.order_number)))?;
        let platform = amount
            .checked_sub(&seller)
            .ok_or_else(|| LedgerError::Mismatch(format!("order {}", self.order_number)))?;
        Ok((seller, platform))
    }

    fn transfer(
        &self,
        key: String,
        kind: TransferKind,
        from: &AccountRef,
        to: &AccountRef,
        amount: Money,
    ) -> Transfer {
        Transfer {
            source_key: key,
            kind,
            from: from.clone(),
            to: to.clone(),
            amount,
            available_at: None,
            order_number: Some(self.order_number),
            reference: None,
        }
    }
}

/// A confirmed order as the ledger needs it.
#[derive(sqlx::FromRow)]
pub(super) struct SaleRow {
    pub(super) seller_id: String,
    total: Decimal,
    platform_fee: Decimal,
    seller_net: Decimal,
    currency: String,
    paid_at: Option<DateTime<Utc>>,
    holding_days: i32,
}

impl SaleRow {
    pub(super) fn into_sale(
        self,
        number: i64,
        channel: Channel,
    ) -> Result<Option<Sale>, LedgerError> {
        let SaleRow {
            seller_id,
            total,
            platform_fee,
            seller_net,
            currency,
            paid_at: Some(paid_at),
            holding_days,
        } = self
        else {
            return Ok(None);
        };
        let mismatch = || LedgerError::Mismatch(format!("order {number}"));
        let c: Currency = currency.parse().map_err(|_| mismatch())?;
        let money = |d: Decimal| Money::new(d, c).map_err(|_| mismatch());
        Ok(Some(Sale {
            order_number: number,
            seller_id,
            channel,
            total: money(total)?,
            fee: money(platform_fee)?,
            net: money(seller_net)?,
            paid_at,
            holding_days,
        }))
    }
}

/// An order as a sale, read through the orders context's published view (`order_money`,
/// migration 0046), which also says what makes a confirmed order a sale.
pub(super) const SALE_COLUMNS: &str = "o.seller_id::text AS seller_id, o.total, o.platform_fee, o.seller_net, o.currency::text AS currency,
    o.paid_at, s.holding_days";
pub(super) const SALE_JOIN: &str = "order_money o JOIN sellers s ON s.id = o.seller_id";
pub(super) const IS_SALE: &str = "o.is_sale";

impl Sale {
    /// Order `number` as a sale through `channel`, if it was paid and kept.
    pub async fn of_order(
        tx: &mut PgConnection,
        number: i64,
        channel: Channel,
    ) -> Result<Option<Sale>, LedgerError> {
        let row: Option<SaleRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {SALE_COLUMNS} FROM {SALE_JOIN} WHERE o.number = $1 AND {IS_SALE}"
        )))
        .bind(number)
        .fetch_optional(&mut *tx)
        .await?;
        match row {
            Some(row) => row.into_sale(number, channel),
            None => Ok(None),
        }
    }
}

/// Locks every account of the seller a sale touches, in id order, before any posting: all the
/// postings of one seller and currency serialise here, and never deadlock on each other.
async fn lock_seller(tx: &mut PgConnection, a: &Accounts) -> Result<(), sqlx::Error> {
    let refs = [
        a.clearing.clone(),
        a.revenue.clone(),
        a.pending.clone(),
        a.available.clone(),
        a.connected.clone(),
    ];
    let mut ids = accounts(tx, &refs).await?;
    ids.sort_unstable();
    lock(tx, &ids).await?;
    Ok(())
}

/// Whether the sale's holding period has been dealt with (read under the seller's lock).
async fn released(tx: &mut PgConnection, order: i64) -> Result<bool, sqlx::Error> {
    let r: Option<i64> =
        sqlx::query_scalar("SELECT order_number FROM ledger_releases WHERE order_number = $1")
            .bind(order)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(r.is_some())
}

/// Where the seller's part of a refund or dispute comes from now.
async fn seller_bucket(
    tx: &mut PgConnection,
    sale: &Sale,
    a: &Accounts,
) -> Result<AccountRef, sqlx::Error> {
    Ok(if !sale.channel.through_platform() {
        a.connected.clone()
    } else if released(tx, sale.order_number).await? {
        a.available.clone()
    } else {
        a.pending.clone()
    })
}

/// The paid order's credit and fee. Once per order. Every account of the seller is locked
/// first (in id order, one statement), so that what the transaction posts after it (a refund,
/// a dispute) locks nothing more and cannot deadlock with another posting of the seller.
pub async fn record_sale(tx: &mut PgConnection, sale: &Sale) -> Result<(), LedgerError> {
    lock_seller(tx, &sale.accounts()).await?;
    post_many(tx, &sale.postings()).await?;
    // A due row a replay leaves (its sale refused by a poster once) goes with its posting.
    super::poster::clear(tx, sale.order_number).await?;
    Ok(())
}

impl Sale {
    /// The sale's credit to the seller and its fee to the platform, both from the clearing
    /// account of its channel.
    pub(super) fn postings(&self) -> [Transfer; 2] {
        let a = self.accounts();
        let n = self.order_number;
        let credit = if self.channel.through_platform() {
            let mut credit = self.transfer(
                format!("sale:{n}"),
                TransferKind::SaleCredit,
                &a.clearing,
                &a.pending,
                self.net,
            );
            credit.available_at =
                Some(self.paid_at + chrono::Duration::days(i64::from(self.holding_days)));
            credit
        } else {
            self.transfer(
                format!("sale:{n}"),
                TransferKind::ConnectedSale,
                &a.clearing,
                &a.connected,
                self.net,
            )
        };
        let fee = self.transfer(
            format!("fee:{n}"),
            TransferKind::Fee,
            &a.clearing,
            &a.revenue,
            self.fee,
        );
        [credit, fee]
    }
}

/// What is taken back from a sale, as one of its facts names it.
#[derive(Debug, Clone)]
pub enum TakeBack {
    /// A refund: taken for good.
    Refund { refund_id: String, amount: Money },
    /// A dispute: taken while open or lost, given back if it ends in the seller's favour, and
    /// handed over to its refund if it ends as one (kept taken until that refund is recorded).
    Dispute {
        dispute_id: String,
        amount: Money,
        status: DisputeStatus,
    },
}

/// A posting key of a take-back, and the kinds of its seller and fee parts.
struct Step {
    key: String,
    reference: String,
    /// Taken from the seller (refund, dispute) or given back (a dispute's reversal).
    taken: bool,
    kinds: (TransferKind, TransferKind),
}

/// Brings the ledger in line with everything taken back from a sale (refunds and disputes, in
/// any order, seen any number of times). What the sale owes back is
/// `T = min(total, refunds + disputes open or lost + what of disputes ended as a refund the
/// recorded refunds do not cover, each refund covering one)`: never more than was paid, however a
/// gateway's refunds and chargebacks add up (an overage is the consistency check
/// `taken_back_beyond_payment`'s, for an operator, not a second debit of the seller). The seller
/// bears `share(T)` (rounded half-even on that running total, so partial amounts never drift and
/// taking back the whole payment returns exactly the net) and the platform's fee the rest.
///
/// Each fact has its posting key (`refund:<channel>:<id>`, `dispute:...`, `dispute_reversal:...`);
/// the first key not posted yet carries the difference between that target and what the sale's
/// postings took so far. A key is posted once; a key whose difference is nothing posts nothing
/// and finds nothing to do when looked at again. So the same facts, arriving in any order and
/// repeated, end in the same balances.
pub async fn settle_take_backs(
    tx: &mut PgConnection,
    sale: &Sale,
    facts: &[TakeBack],
) -> Result<(), LedgerError> {
    // Nothing taken back: nothing to bring in line (facts are never forgotten, so none was
    // posted before either), and the seller's accounts are not held for it.
    if facts.is_empty() {
        return Ok(());
    }
    let a = sale.accounts();
    lock_seller(tx, &a).await?;
    let mismatch = || LedgerError::Mismatch(format!("order {}", sale.order_number));
    let zero = Money::new(Decimal::ZERO, sale.currency()).map_err(|_| mismatch())?;
    let mut claimed = zero;
    let mut steps = Vec::new();
    let channel = sale.channel;
    // A dispute that ended as a refund gave the buyer the money through that refund: until the
    // refund is recorded (its event may come later, or be lost), the dispute keeps what the
    // recorded refunds do not cover, so the seller is never given back, and paid out, money
    // the buyer already has. A refund covers one dispute: the disputes, in the order recorded,
    // take what is left of the refunds in turn. Which refunds came before a dispute opened (and
    // gave the buyer other money) is not decided here: our order of recording is not the
    // gateway's, and a refund wrongly taken for an earlier one would leave its dispute taken
    // from the seller for ever. The payouts hold that part back instead, for a while
    // (`ledger::payouts`, `payment_disputes.refunded_before`).
    let mut refunded = Decimal::ZERO;
    let mut covering_taken = Decimal::ZERO;
    for fact in facts {
        if let TakeBack::Refund { amount, .. } = fact {
            refunded += amount.amount();
        }
    }
    for fact in facts {
        match fact {
            TakeBack::Refund { refund_id, amount } => {
                claimed = claimed.checked_add(amount).ok_or_else(mismatch)?;
                steps.push(Step {
                    key: format!("refund:{channel}:{refund_id}"),
                    reference: refund_id.clone(),
                    taken: true,
                    kinds: (TransferKind::RefundDebit, TransferKind::FeeRefund),
                });
            }
            TakeBack::Dispute {
                dispute_id,
                amount,
                status,
            } => {
                steps.push(Step {
                    key: format!("dispute:{channel}:{dispute_id}"),
                    reference: dispute_id.clone(),
                    taken: true,
                    kinds: (TransferKind::DisputeDebit, TransferKind::DisputeFeeDebit),
                });
                if *status == DisputeStatus::Refunded {
                    let after = (refunded - covering_taken).max(Decimal::ZERO);
                    let covered = after.min(amount.amount());
                    covering_taken += covered;
                    let uncovered = amount.amount() - covered;
                    let uncovered =
                        Money::new(uncovered, amount.currency()).map_err(|_| mismatch())?;
                    claimed = claimed.checked_add(&uncovered).ok_or_else(mismatch)?;
                }
                if matches!(status, DisputeStatus::Won | DisputeStatus::Refunded) {
                    steps.push(Step {
                        key: format!("dispute_reversal:{channel}:{dispute_id}"),
                        reference: dispute_id.clone(),
                        taken: false,
                        kinds: (
                            TransferKind::DisputeReversal,
                            TransferKind::DisputeFeeReversal,
                        ),
                    });
                } else {
                    claimed = claimed.checked_add(amount).ok_or_else(mismatch)?;
                }
            }
        }
    }
    let target = if claimed.amount() > sale.total.amount() {
        sale.total
    } else {
        claimed
    };
    let (seller_target, fee_target) = sale.split(&target)?;
    let (mut seller_taken, mut fee_taken) = taken_so_far(tx, sale).await?;
    let from = seller_bucket(tx, sale, &a).await?;
    let done = posted(tx, &steps).await?;
    let mut postings = Vec::new();
    for step in steps {
        if done.contains(&step.key) {
            continue;
        }
        let seller = seller_target.amount() - seller_taken;
        let fee = fee_target.amount() - fee_taken;
        if seller.is_zero() && fee.is_zero() {
            continue;
        }
        // Both parts move the same way: the seller's share and the fee's rest each grow (or
        // shrink) with the target, a cent at a time at most as fast.
        if (seller + fee > Decimal::ZERO) != step.taken {
            // Against this step's direction (a refund seen in the same event as a dispute's
            // win that gives back more): left to the step that moves that way.
            continue;
        }
        let parts = [
            (format!("{}:seller", step.key), step.kinds.0, seller, &from),
            (format!("{}:fee", step.key), step.kinds.1, fee, &a.revenue),
        ];
        for (key, kind, delta, account) in parts {
            if delta.is_zero() {
                continue;
            }
            let amount = Money::new(delta.abs(), sale.currency()).map_err(|_| mismatch())?;
            // A take moves money to the clearing account; a give-back out of it.
            let (debit, credit) = if step.taken {
                (account, &a.clearing)
            } else {
                (&a.clearing, account)
            };
            let mut t = sale.transfer(key, kind, debit, credit, amount);
            t.reference = Some(step.reference.clone());
            postings.push(t);
        }
        seller_taken += seller;
        fee_taken += fee;
    }
    post_many(tx, &postings).await?;
    Ok(())
}

/// The take-back keys that have posted either of their parts.
async fn posted(
    tx: &mut PgConnection,
    steps: &[Step],
) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    let keys: Vec<&str> = steps.iter().map(|s| s.key.as_str()).collect();
    let done: Vec<String> = sqlx::query_scalar(
        "SELECT k FROM unnest($1::text[]) AS k
         WHERE EXISTS (SELECT 1 FROM ledger_transfers WHERE source_key IN (k || ':seller', k || ':fee'))",
    )
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await?;
    Ok(done.into_iter().collect())
}

/// What the sale's take-back postings hold now: the seller's part and the fee's.
async fn taken_so_far(
    tx: &mut PgConnection,
    sale: &Sale,
) -> Result<(Decimal, Decimal), sqlx::Error> {
    sqlx::query_as(
        "SELECT COALESCE(sum(CASE kind WHEN 'refund_debit' THEN amount WHEN 'dispute_debit' THEN amount
                                       WHEN 'dispute_reversal' THEN -amount ELSE 0 END), 0),
                COALESCE(sum(CASE kind WHEN 'fee_refund' THEN amount WHEN 'dispute_fee_debit' THEN amount
                                       WHEN 'dispute_fee_reversal' THEN -amount ELSE 0 END), 0)
         FROM ledger_transfers WHERE order_number = $1",
    )
    .bind(sale.order_number)
    .fetch_one(&mut *tx)
    .await
}

/// Sales one release transaction takes at most: a flash sale's thousands mature together, and
/// one transaction per sale held the seller's accounts once per sale, beside the payments still
/// posting to them.
const RELEASE_BATCH: i64 = 500;

/// Moves the sales whose holding period has passed from pending to available: what is left of
/// each sale in pending (its credit less the refunds and disputes taken from pending meanwhile),
/// once per sale, however many workers run it at once. Returns how many sales it dealt with.
///
/// One transaction per seller and currency, for up to [`RELEASE_BATCH`] of its sales: a run
/// holds one seller's accounts at a time (postings of other sellers do not wait for it, and two
/// runs cannot deadlock on each other's sellers), and a seller's matured sales are released
/// together, in a fixed number of statements.
pub async fn release_matured(pool: &PgPool, now: DateTime<Utc>) -> Result<u64, LedgerError> {
    let mut done = 0;
    loop {
        let mut tx = pool.begin().await?;
        // Several runs may go at once: each takes a different seller's sales, or the sales
        // another run left (SKIP LOCKED).
        let next: Option<(i64, String, String)> = sqlx::query_as(
            "SELECT t.to_account, a.owner, t.currency::text
             FROM ledger_transfers t JOIN ledger_accounts a ON a.id = t.to_account
             WHERE t.kind = 'sale_credit' AND t.available_at <= $1
               AND NOT EXISTS (SELECT 1 FROM ledger_releases r WHERE r.order_number = t.order_number)
             ORDER BY t.available_at LIMIT 1
             FOR UPDATE OF t SKIP LOCKED",
        )
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((pending, seller, currency)) = next else {
            return Ok(done);
        };
        let due: Vec<(i64, Decimal)> = sqlx::query_as(
            "SELECT t.order_number, t.amount FROM ledger_transfers t
             WHERE t.kind = 'sale_credit' AND t.to_account = $1 AND t.available_at <= $2
               AND NOT EXISTS (SELECT 1 FROM ledger_releases r WHERE r.order_number = t.order_number)
             ORDER BY t.available_at LIMIT $3
             FOR UPDATE OF t SKIP LOCKED",
        )
        .bind(pending)
        .bind(now)
        .bind(RELEASE_BATCH)
        .fetch_all(&mut *tx)
        .await?;
        // A run whose snapshot predates another's commit can take sales that one has just
        // released: the releases' own keys find them done, and they are not counted twice.
        let released = release_seller(&mut tx, &seller, &currency, &due).await?;
        tx.commit().await?;
        done += released;
    }
}

/// Releases a seller's matured sales (`due`: order and sale credit); returns how many this
/// call released (the others another run had).
async fn release_seller(
    tx: &mut PgConnection,
    seller: &str,
    currency: &str,
    due: &[(i64, Decimal)],
) -> Result<u64, LedgerError> {
    if due.is_empty() {
        return Ok(0);
    }
    let c: Currency = currency
        .parse()
        .map_err(|_| LedgerError::Mismatch(format!("seller {seller}")))?;
    let pending = AccountRef::new(AccountKind::SellerPending, seller, c);
    let available = AccountRef::new(AccountKind::SellerAvailable, seller, c);
    let mut ids = accounts(tx, &[pending.clone(), available.clone()]).await?;
    ids.sort_unstable();
    lock(tx, &ids).await?;
    let orders: Vec<i64> = due.iter().map(|(n, _)| *n).collect();
    let claimed: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO ledger_releases (order_number, amount) SELECT n, 0 FROM unnest($1::bigint[]) AS n
         ON CONFLICT DO NOTHING RETURNING order_number",
    )
    .bind(&orders)
    .fetch_all(&mut *tx)
    .await?;
    if claimed.is_empty() {
        return Ok(0);
    }
    // What left pending for each order since its credit, and what came back to it.
    let moved: std::collections::HashMap<i64, Decimal> = sqlx::query_as(
        "SELECT t.order_number, sum(CASE WHEN t.to_account = a.id THEN t.amount ELSE -t.amount END)
         FROM ledger_transfers t JOIN ledger_accounts a
           ON a.kind = 'seller_pending' AND a.owner = $2 AND a.currency = $3
         WHERE t.order_number = ANY(ARRAY(SELECT unnest($1::bigint[]))) AND t.kind <> 'sale_credit'
           AND (t.from_account = a.id OR t.to_account = a.id)
         GROUP BY t.order_number",
    )
    .bind(&claimed)
    .bind(seller)
    .bind(currency)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();
    let credits: std::collections::HashMap<i64, Decimal> = due.iter().copied().collect();
    let mut left = Vec::with_capacity(claimed.len());
    let mut transfers = Vec::with_capacity(claimed.len());
    for &order in &claimed {
        let credit = credits.get(&order).copied().unwrap_or_default();
        let rest = credit + moved.get(&order).copied().unwrap_or_default();
        left.push(rest);
        if rest.is_zero() {
            continue;
        }
        // More taken back than the sale left (a dispute on a partly refunded sale): the
        // shortfall moves to pending from available, so that pending holds nothing of a
        // released sale and available shows what the seller really has.
        let (from, to) = if rest > Decimal::ZERO {
            (pending.clone(), available.clone())
        } else {
            (available.clone(), pending.clone())
        };
        let amount = Money::new(rest.abs(), c)
            .map_err(|_| LedgerError::Mismatch(format!("order {order}")))?;
        transfers.push(Transfer {
            source_key: format!("release:{order}"),
            kind: TransferKind::Release,
            from,
            to,
            amount,
            available_at: None,
            order_number: Some(order),
            reference: None,
        });
    }
    // What moves to available first, then any shortfall taken from it.
    transfers.sort_by_key(|t| t.from.kind != AccountKind::SellerPending);
    post_many(tx, &transfers).await?;
    sqlx::query(
        "UPDATE ledger_releases r SET amount = x.amount
         FROM unnest($1::bigint[], $2::numeric[]) AS x(order_number, amount)
         WHERE r.order_number = x.order_number",
    )
    .bind(&claimed)
    .bind(&left)
    .execute(&mut *tx)
    .await?;
    Ok(claimed.len() as u64)
}
