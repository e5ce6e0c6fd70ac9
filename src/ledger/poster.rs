//! The seller's poster: sales are posted in batches per seller when a seller's payments arrive
//! faster than its accounts can be held for each.
//!
//! Whoever posts a seller's sales holds the seller's turn (an advisory lock). A payment's
//! transaction (the order confirmed, its order message in the outbox) tries the turn
//! ([`post_or_defer`]): free, it posts its sale itself, a few statements before the commit it
//! makes anyway; taken (another payment of the same seller is posting), it records its sale as
//! due (one statement, no account touched) and, right after it commits, the job that processed
//! it posts whatever its seller has due ([`Due::post`]): one transaction holds the seller's
//! turn and accounts once, writes every due sale's credit and fee with their entries
//! (`ledger::post_many`, a fixed number of statements for the whole batch) and deletes the rows
//! it posted. While one poster holds the turn, the payments of that seller keep committing
//! beside it, and the next poster takes all of them at once: under a flash sale the batches
//! grow, and the seller's accounts are held once per batch instead of once per payment for the
//! whole of its transaction.
//!
//! What keeps the ledger's promises: the posters of one seller take turns on an advisory lock
//! taken before they read what is due, so the one whose turn it is takes every sale committed
//! until then, and the others, finding their sales posted, leave at once; the postings are keyed
//! by their source (`sale:<n>`, `fee:<n>`), so a sale posted another way (a refund's
//! transaction posts its sale first) is not posted again; and entries are written under the
//! accounts' row locks, each starting where the account's last one ended. Anything that reads a
//! seller's balances posts that seller's sales due first ([`settle`]), so no answer is behind a
//! confirmed order.
//!
//! A sale whose job stopped between the two transactions is posted by the next payment of its
//! seller, or by every worker's [`sweep`] within a second. A sale a poster finds the ledger
//! refuses (which no valid order does) keeps its row with the reason, is counted by the metrics
//! and the consistency check `sale_without_credit`, and is posted again by [`repost`] (`payfleet
//! money repost`) after a fix (its event is applied, so a replay would not); one refused in the
//! payment's own transaction rejects that event instead, as any posting there does (kept with
//! its reason, replayed after a fix).

use std::time::Duration;

use sqlx::{PgConnection, PgPool};

use super::LedgerError;
use super::sales::{Channel, IS_SALE, SALE_COLUMNS, SALE_JOIN, SaleRow};
use crate::gateways::GatewayName;

/// Sales one poster transaction takes at most: enough that a flash sale's batches stay few,
/// few enough that a batch holds the seller's accounts for milliseconds.
const BATCH: i64 = 500;

impl Channel {
    fn parse(text: &str) -> Option<Self> {
        match text {
            "coins" => Some(Self::Coins),
            g => g.parse::<GatewayName>().ok().map(Self::Gateway),
        }
    }
}

/// A sale recorded as due: to post once its transaction has committed ([`Due::post`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    pub seller: String,
    pub order_number: i64,
}

impl Due {
    /// Posts it with its seller's others, unless a poster has taken it already. In a task of
    /// its own: a caller that stops waiting (a job timed out) cannot cut a poster off between
    /// lining up and letting go of its place in line.
    pub async fn post(self, pool: &PgPool) -> Result<u64, LedgerError> {
        let pool = pool.clone();
        let seller = self.seller.clone();
        tokio::spawn(async move { post_due(&pool, &self.seller, Some(self.order_number)).await })
            .await
            .unwrap_or_else(|e| {
                tracing::error!(seller, error = %e, "the poster's task failed; the sweep will post its sales");
                Ok(0)
            })
    }
}

/// Order `number`'s sale through `channel`, in the payment's own transaction: posted there when
/// no poster has the seller's turn (the seller's accounts are then free, and the sale is
/// written by a few statements before the commit the payment makes anyway), else recorded as
/// due for the poster whose turn it is. Returns the sale left due, to post after commit.
pub async fn post_or_defer(
    tx: &mut PgConnection,
    number: i64,
    channel: Channel,
) -> Result<Option<Due>, LedgerError> {
    #[derive(sqlx::FromRow)]
    struct Unposted {
        turn: bool,
        due: bool,
        #[sqlx(flatten)]
        sale: SaleRow,
    }
    // The turn is tried only for a sale not posted yet.
    let row: Option<Unposted> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT pg_try_advisory_xact_lock({TURN_OF_ORDER}) AS turn,
                EXISTS (SELECT 1 FROM ledger_sales_due d WHERE d.order_number = o.number) AS due,
                {SALE_COLUMNS}
         FROM {SALE_JOIN}
         WHERE o.number = $1 AND {IS_SALE}
           AND NOT EXISTS (SELECT 1 FROM ledger_transfers t WHERE t.source_key = 'sale:' || o.number)"
    )))
    .bind(number)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    if !row.turn {
        // Due for the poster whose turn it is (a replayed event re-drives a sale whose posting
        // was refused).
        sqlx::query(
            "INSERT INTO ledger_sales_due (order_number, seller_id, channel) VALUES ($1, $2::uuid, $3)
             ON CONFLICT (order_number) DO UPDATE SET failure = NULL WHERE ledger_sales_due.failure IS NOT NULL",
        )
        .bind(number)
        .bind(&row.sale.seller_id)
        .bind(channel.name())
        .execute(&mut *tx)
        .await?;
        return Ok(Some(Due {
            seller: row.sale.seller_id,
            order_number: number,
        }));
    }
    // A refusal here is the payment's, as any posting's in its transaction: the event is
    // rejected with its reason and replayed after a fix.
    if let Some(sale) = row.sale.into_sale(number, channel)? {
        super::post_many(tx, &sale.postings()).await?;
    }
    // Left by an earlier run (refused by a poster, and replayed since): posted now.
    if row.due {
        clear(tx, number).await?;
    }
    Ok(None)
}

/// Posts the sales of orders just confirmed in the caller's transaction, many at once (the
/// batch path of event processing), with one [`super::post_many`]: the sellers' accounts are
/// the transaction's last locks, held for one round trip and the commit. It takes no turn: a
/// payment's own transaction finding the turn free then waits for the accounts (for that one
/// round trip), and a poster holding a turn locks accounts as this does, in id order. Orders
/// that are not sales (none, once confirmed) post nothing.
pub async fn post_confirmed(
    tx: &mut PgConnection,
    orders: &[(i64, Channel)],
) -> Result<(), LedgerError> {
    if orders.is_empty() {
        return Ok(());
    }
    let numbers: Vec<i64> = orders.iter().map(|(n, _)| *n).collect();
    #[derive(sqlx::FromRow)]
    struct Confirmed {
        number: i64,
        #[sqlx(flatten)]
        sale: SaleRow,
    }
    // The numbers as an array the planner cannot see into: by the numbers' index, where the
    // literal array was sized as most of a table without statistics and read all of it.
    let rows: Vec<Confirmed> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT o.number, {SALE_COLUMNS} FROM {SALE_JOIN}
         WHERE o.number = ANY(ARRAY(SELECT unnest($1::bigint[]))) AND {IS_SALE} ORDER BY o.number"
    )))
    .bind(&numbers)
    .fetch_all(&mut *tx)
    .await?;
    let channels: std::collections::HashMap<i64, Channel> = orders.iter().copied().collect();
    let mut postings = Vec::with_capacity(2 * rows.len());
    for row in rows {
        let Some(channel) = channels.get(&row.number) else {
            continue;
        };
        if let Some(sale) = row.sale.into_sale(row.number, *channel)? {
            postings.extend(sale.postings());
        }
    }
    super::post_many(tx, &postings).await?;
    Ok(())
}

/// Deletes order `number`'s due row, in the transaction that posts its sale some other way.
pub(super) async fn clear(tx: &mut PgConnection, number: i64) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM ledger_sales_due WHERE order_number = $1")
        .bind(number)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// The seller's turn, as [`TURN`] names it, for the seller of order `o`.
const TURN_OF_ORDER: &str = "hashtextextended('ledger_poster:' || o.seller_id::text, 0)";

#[derive(sqlx::FromRow)]
struct DueRow {
    order_number: i64,
    channel: String,
    is_sale: bool,
    #[sqlx(flatten)]
    sale: SaleRow,
}

/// Posts the sales due of `seller`, in batches, until none is left, or leaves them to the
/// poster whose turn is next. Returns how many this call posted. `mine`: the sale the caller
/// has just recorded; when a poster has taken it already, there is nothing to do.
pub async fn post_due(pool: &PgPool, seller: &str, mine: Option<i64>) -> Result<u64, LedgerError> {
    if let Some(number) = mine {
        let due: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM ledger_sales_due WHERE order_number = $1 AND failure IS NULL)",
        )
        .bind(number)
        .fetch_one(pool)
        .await?;
        if !due {
            return Ok(0);
        }
    }
    post(pool, seller, Turn::Queue).await
}

/// What posting a refused sale again came to ([`repost`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Reposted {
    /// Posted.
    Posted,
    /// Refused again: kept with its (new) reason.
    RefusedAgain(String),
    /// No sale of that order was kept refused.
    NotRefused,
}

/// Posts again a sale the ledger refused (`payfleet money repost`, after the fix its reason
/// asked for): its reason is cleared and its seller's poster posts it with whatever else is
/// due, in its turn, as if it were new; refused again, it keeps its new reason. A replayed event
/// cannot do it: its event is applied already.
pub async fn repost(pool: &PgPool, number: i64) -> Result<Reposted, LedgerError> {
    let seller: Option<String> = sqlx::query_scalar(
        "UPDATE ledger_sales_due SET failure = NULL
         WHERE order_number = $1 AND failure IS NOT NULL RETURNING seller_id::text",
    )
    .bind(number)
    .fetch_optional(pool)
    .await?;
    let Some(seller) = seller else {
        return Ok(Reposted::NotRefused);
    };
    // Every sale due of the seller, one by one if their batch is refused: this one included.
    post(pool, &seller, Turn::Wait).await?;
    let failure: Option<Option<String>> =
        sqlx::query_scalar("SELECT failure FROM ledger_sales_due WHERE order_number = $1")
            .bind(number)
            .fetch_optional(pool)
            .await?;
    Ok(match failure {
        None => Reposted::Posted,
        Some(reason) => Reposted::RefusedAgain(reason.unwrap_or_default()),
    })
}

/// Posts the sales due of `seller`: once it returns, every sale of the seller committed before
/// is in the ledger. For readers of balances and entries; without anything due it is one read.
pub async fn settle(pool: &PgPool, seller: &str) -> Result<u64, sqlx::Error> {
    if seller.parse::<uuid::Uuid>().is_err() {
        return Ok(0);
    }
    let due: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM ledger_sales_due WHERE seller_id = $1::uuid AND failure IS NULL)",
    )
    .bind(seller)
    .fetch_one(pool)
    .await?;
    if !due {
        return Ok(0);
    }
    // A refused sale is kept with its reason by `post` itself: what comes back is an outage.
    post(pool, seller, Turn::Wait).await.map_err(|e| match e {
        LedgerError::Database(e) => e,
        other => sqlx::Error::Decode(Box::new(other)),
    })
}

/// The seller's turn: one advisory lock per seller, held by whoever posts its sales.
const TURN: &str = "hashtextextended('ledger_poster:' || $1, 0)";
/// The one poster next in line for the seller's turn ([`Turn::Queue`]).
const NEXT: &str = "hashtextextended('ledger_poster_next:' || $1, 0)";

/// How a poster waits for the seller's turn (an advisory lock, taken before it reads what is
/// due, so the poster whose turn it is takes every sale committed until then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// Wait for it: a reader, who must see every sale committed before it posted.
    Wait,
    /// Take it if free, or wait as the one poster next in line (a second advisory lock, held
    /// only while waiting), or else leave: the poster next in line reads what is due only once
    /// it has its turn, so it takes this caller's sale too. A job never waits behind more than
    /// one other poster, and its slot goes back to new payments.
    Queue,
}

async fn post(pool: &PgPool, seller: &str, turn: Turn) -> Result<u64, LedgerError> {
    let mut done = 0;
    loop {
        match post_batch(pool, seller, turn, None).await {
            Ok(n) => {
                done += n;
                if n < BATCH as u64 {
                    return Ok(done);
                }
            }
            Err(e) if is_outage(&e) => return Err(e),
            // One refused sale must not hold up the seller's others: each is posted alone, and
            // the one refused keeps its reason.
            Err(e) => {
                tracing::warn!(seller, error = %e, "a batch of sales was refused; posting them one at a time");
                return Ok(done + post_one_by_one(pool, seller).await?);
            }
        }
    }
}

fn is_outage(e: &LedgerError) -> bool {
    matches!(e, LedgerError::Database(e) if crate::db::is_transient(e))
}

/// Takes the seller's turn in `tx` as `turn` says; false: left to the poster next in line.
async fn take_turn(tx: &mut PgConnection, seller: &str, turn: Turn) -> Result<bool, sqlx::Error> {
    if turn == Turn::Wait {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT pg_advisory_xact_lock({TURN})"
        )))
        .bind(seller)
        .execute(&mut *tx)
        .await?;
        return Ok(true);
    }
    let free: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT pg_try_advisory_xact_lock({TURN})"
    )))
    .bind(seller)
    .fetch_one(&mut *tx)
    .await?;
    if free {
        return Ok(true);
    }
    // Next in line: a session lock, so that it can be let go as soon as the turn is ours (the
    // next caller may then line up behind us). Taken and let go within this transaction, on
    // its one connection (also behind a transaction-pooling PgBouncer).
    let next: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT pg_try_advisory_lock({NEXT})"
    )))
    .bind(seller)
    .fetch_one(&mut *tx)
    .await?;
    if !next {
        return Ok(false);
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_xact_lock({TURN}), pg_advisory_unlock({NEXT})"
    )))
    .bind(seller)
    .execute(&mut *tx)
    .await?;
    Ok(true)
}

/// One transaction: claims the seller's sales due (up to [`BATCH`], or only order `only`),
/// posts them, deletes their rows. Returns how many; none when left to the next poster.
async fn post_batch(
    pool: &PgPool,
    seller: &str,
    turn: Turn,
    only: Option<i64>,
) -> Result<u64, LedgerError> {
    let mut conn = pool.acquire().await?;
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    match take_turn(&mut tx, seller, turn).await {
        Ok(true) => {}
        Ok(false) => return Ok(0),
        Err(e) => {
            // It may hold the session lock of the next in line, which a rollback keeps: let go
            // of it on the same connection, or close the connection (the lock goes with the
            // session) rather than return it to the pool with it.
            drop(tx);
            let released = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT pg_advisory_unlock({NEXT})"
            )))
            .bind(seller)
            .execute(&mut *conn)
            .await;
            if released.is_err() {
                conn.close_on_drop();
            }
            return Err(e.into());
        }
    }
    let rows: Vec<DueRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT d.order_number, d.channel, ({IS_SALE}) AS is_sale, {SALE_COLUMNS}
         FROM ledger_sales_due d JOIN {SALE_JOIN} ON o.number = d.order_number
         WHERE d.seller_id = $1::uuid AND d.failure IS NULL AND ($3::bigint IS NULL OR d.order_number = $3)
         ORDER BY d.order_number LIMIT $2"
    )))
    .bind(seller)
    .bind(BATCH)
    .bind(only)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Ok(0);
    }
    let numbers: Vec<i64> = rows.iter().map(|r| r.order_number).collect();
    let mut postings = Vec::with_capacity(2 * rows.len());
    for row in rows {
        let number = row.order_number;
        let channel = Channel::parse(&row.channel).ok_or_else(|| {
            LedgerError::Mismatch(format!("order {number}: channel {}", row.channel))
        })?;
        // An order that stopped being a sale since (none does once paid) posts nothing.
        if !row.is_sale {
            continue;
        }
        if let Some(sale) = row.sale.into_sale(number, channel)? {
            postings.extend(sale.postings());
        }
    }
    super::post_many(&mut tx, &postings).await?;
    sqlx::query("DELETE FROM ledger_sales_due WHERE order_number = ANY($1)")
        .bind(&numbers)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(numbers.len() as u64)
}

/// Each sale due of the seller in its own transaction; one refused keeps its reason.
async fn post_one_by_one(pool: &PgPool, seller: &str) -> Result<u64, LedgerError> {
    let numbers: Vec<i64> = sqlx::query_scalar(
        "SELECT order_number FROM ledger_sales_due WHERE seller_id = $1::uuid AND failure IS NULL ORDER BY order_number",
    )
    .bind(seller)
    .fetch_all(pool)
    .await?;
    let mut done = 0;
    for number in numbers {
        match post_batch(pool, seller, Turn::Wait, Some(number)).await {
            Ok(n) => done += n,
            Err(e) if is_outage(&e) => return Err(e),
            Err(e) => {
                let reason = payfleet_queue::error_chain(&e);
                tracing::error!(seller, order = number, %reason, "the ledger refused a sale; it is kept for an operator (payfleet money repost, after a fix)");
                sqlx::query("UPDATE ledger_sales_due SET failure = $2 WHERE order_number = $1")
                    .bind(number)
                    .bind(&reason)
                    .execute(pool)
                    .await?;
            }
        }
    }
    Ok(done)
}

/// Posts every seller's sales left due for longer than `after` (a job that stopped between its
/// payment's transaction and its posting), every `every`, for as long as the process runs. Each
/// worker runs one; they share the rows.
pub async fn sweep(pool: PgPool, every: Duration, after: Duration) {
    // The first look one period after the start: a sale is left due for `after` before it is
    // this sweep's, and a worker started on a backlog gives its first moments to the backlog.
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let sellers: Result<Vec<String>, sqlx::Error> = sqlx::query_scalar(
            "SELECT DISTINCT seller_id::text FROM ledger_sales_due
             WHERE failure IS NULL AND created_at < now() - make_interval(secs => $1) LIMIT 100",
        )
        .bind(after.as_secs_f64())
        .fetch_all(&pool)
        .await;
        match sellers {
            Ok(sellers) => {
                for seller in sellers {
                    match post_due(&pool, &seller, None).await {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(seller, sales = n, "posted sales left due"),
                        Err(e) => {
                            tracing::warn!(seller, error = %e, "cannot post sales left due; trying again")
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot look for sales left due; trying again"),
        }
    }
}

/// Sales due now, and those the ledger refused: for the metrics.
pub async fn due(pool: &PgPool) -> Result<(i64, i64, f64), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE failure IS NULL), count(*) FILTER (WHERE failure IS NOT NULL),
                COALESCE(EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE failure IS NULL)), 0)::float8
         FROM ledger_sales_due",
    )
    .fetch_one(pool)
    .await
}
