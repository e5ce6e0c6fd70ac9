//! Commission invoices: per seller and period (a calendar month by default), the platform's
//! commission as the ledger recorded it: a line per order (its fee, less what refunds and
//! disputes gave back in the period), totals per currency, a sequential number without gaps
//! (taken from a counter row inside the invoice's transaction). Made once per seller and period:
//! a rerun returns the same invoice.
//!
//! Periods are calendar days of one time zone (`PAYFLEET_INVOICE_TIMEZONE`, default UTC): a
//! month runs from its first midnight there to the next month's, and a run never invoices a
//! month that has not ended there, [`SETTLED_AFTER`] before. (The run's own schedule may be in another zone: an invoice
//! made once must hold all of its month, so the month cannot depend on when the run happens.)
//! The zone is recorded with the first invoice (`invoice_calendar`), and a run in another one is
//! refused ([`InvoiceError::OtherZone`]): its months would overlap the months invoiced, the fees
//! in between invoiced twice, or leave hours out, their fees never invoiced.

use chrono::{DateTime, Datelike, NaiveDate, TimeZone, Utc};
use chrono_tz::Tz;
use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use super::decimal_text;
use crate::catalogue::SellerId;

#[derive(Debug, thiserror::Error)]
pub enum InvoiceError {
    #[error(
        "commission invoices are made in months of {recorded} (recorded with the first invoice), not of {configured}: set PAYFLEET_INVOICE_TIMEZONE={recorded}; months of two zones overlap (their fees invoiced twice) or leave hours out (never invoiced)"
    )]
    OtherZone {
        recorded: String,
        configured: String,
    },
    #[error(
        "invoices were made before their time zone was recorded: the fleet's workers record theirs (PAYFLEET_INVOICE_TIMEZONE) as they start, and this run's ({configured}) is not taken in its place, as it may not be the one those invoices were made in; start a worker (payfleet work) first"
    )]
    ZoneUnrecorded { configured: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl From<InvoiceError> for payfleet_queue::JobError {
    fn from(e: InvoiceError) -> Self {
        match e {
            InvoiceError::Database(e) => e.into(),
            // A configuration the run cannot mend: dead, on the dashboard's failed jobs, until
            // the fleet runs with the recorded zone (the next run then invoices the month).
            other => Self::fail(other),
        }
    }
}

/// Records `zone` as the invoices' time zone unless one is: the fleet's (its workers as they
/// start, its `invoices` job), whose zone is the one every invoice so far was made in (a
/// deployment upgraded with invoices made). Returns the zone recorded, `zone` or the one there
/// before it (by name).
pub async fn record_zone(pool: &PgPool, zone: Tz) -> Result<String, sqlx::Error> {
    let recorded: Option<String> = sqlx::query_scalar(
        "WITH recorded AS (
             INSERT INTO invoice_calendar (timezone) VALUES ($1)
             ON CONFLICT (singleton) DO NOTHING RETURNING timezone)
         SELECT timezone FROM recorded
         UNION ALL SELECT timezone FROM invoice_calendar
         LIMIT 1",
    )
    .bind(zone.name())
    .fetch_optional(pool)
    .await?;
    match recorded {
        Some(z) => Ok(z),
        // Another worker's row, committed after this statement's snapshot was taken (the insert
        // waited for it, then skipped): read in a statement of its own, it is there.
        None => {
            sqlx::query_scalar("SELECT timezone FROM invoice_calendar")
                .fetch_one(pool)
                .await
        }
    }
}

/// The calendar month before the one `today` falls in: the period a monthly run invoices.
pub fn previous_month(today: NaiveDate) -> (NaiveDate, NaiveDate) {
    let this_month = today.with_day(1).unwrap_or(today);
    let start = (this_month - chrono::Duration::days(1))
        .with_day(1)
        .unwrap_or(this_month);
    (start, this_month)
}

/// The instant a day of `zone` begins (its first instant, should a clock change skip midnight).
pub fn day_start(day: NaiveDate, zone: Tz) -> DateTime<Utc> {
    (0..24)
        .find_map(|h| {
            zone.from_local_datetime(&day.and_hms_opt(h, 0, 0)?)
                .earliest()
        })
        .map_or_else(
            || day.and_time(chrono::NaiveTime::MIN).and_utc(),
            |t| t.with_timezone(&Utc),
        )
}

/// Amounts are decimal strings in the currency's minor unit.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct InvoiceLine {
    pub line: i32,
    pub order_number: i64,
    pub currency: String,
    pub commission: String,
    pub description: String,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct InvoiceTotal {
    pub currency: String,
    pub commission: String,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Invoice {
    pub number: i64,
    pub seller_id: SellerId,
    pub seller_name: String,
    pub period_start: NaiveDate,
    pub period_end: NaiveDate,
    pub created_at: DateTime<Utc>,
    pub lines: Vec<InvoiceLine>,
    pub totals: Vec<InvoiceTotal>,
}

/// Invoices every seller that earned the platform commission in `[start, end)` (days of
/// `zone`). Returns their numbers (made now or before).
pub async fn run(
    pool: &PgPool,
    start: NaiveDate,
    end: NaiveDate,
    zone: Tz,
) -> Result<Vec<i64>, InvoiceError> {
    let sellers: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT a.owner FROM ledger_transfers t
         JOIN ledger_accounts a ON a.kind = 'platform_revenue' AND a.id IN (t.from_account, t.to_account)
         WHERE t.created_at >= $1 AND t.created_at < $2 ORDER BY a.owner",
    )
    .bind(day_start(start, zone))
    .bind(day_start(end, zone))
    .fetch_all(pool)
    .await?;
    let mut numbers = Vec::new();
    for seller in sellers {
        if let Some(n) = create(pool, &seller, start, end, zone).await? {
            numbers.push(n);
        }
    }
    Ok(numbers)
}

/// How long after a month has ended it may be invoiced. A transfer's posting time is taken
/// when its posting starts, before it waits for its accounts and commits: a fee posted in the
/// month's last moments may commit after the month has ended, and an invoice made in between
/// (made once, never amended) would leave it out. A posting holds its accounts for
/// milliseconds; an hour leaves every one stamped in the month committed long before.
pub const SETTLED_AFTER: chrono::Duration = chrono::Duration::hours(1);

/// Whether the month (or any period) ending on `end` (a day of `zone`) may be invoiced at `at`.
pub fn has_settled(end: NaiveDate, zone: Tz, at: DateTime<Utc>) -> bool {
    at >= day_start(end, zone) + SETTLED_AFTER
}

/// How far back a run looks for months left uninvoiced (the fleet down, the job dead).
pub const CATCH_UP_MONTHS: u32 = 12;

/// Invoices every month of `zone` that had ended [`SETTLED_AFTER`] before `at`, since
/// [`CATCH_UP_MONTHS`] ago, in which a seller earned commission and has no invoice yet: last
/// month, and any month a run missed. Returns the numbers made.
pub async fn run_due(pool: &PgPool, at: DateTime<Utc>, zone: Tz) -> Result<Vec<i64>, InvoiceError> {
    let today = (at - SETTLED_AFTER).with_timezone(&zone).date_naive();
    let this_month = today.with_day(1).unwrap_or(today);
    let since = this_month
        .checked_sub_months(chrono::Months::new(CATCH_UP_MONTHS))
        .unwrap_or(this_month);
    let due: Vec<(String, NaiveDate)> = sqlx::query_as(
        "SELECT DISTINCT a.owner, date_trunc('month', t.created_at AT TIME ZONE $3)::date AS month
         FROM ledger_transfers t
         JOIN ledger_accounts a ON a.kind = 'platform_revenue' AND a.id IN (t.from_account, t.to_account)
         WHERE t.created_at >= $1 AND t.created_at < $2
           AND NOT EXISTS (SELECT 1 FROM invoices i
                           WHERE i.seller_id::text = a.owner
                             AND i.period_start = date_trunc('month', t.created_at AT TIME ZONE $3)::date)
         ORDER BY month, a.owner",
    )
    .bind(day_start(since, zone))
    .bind(day_start(this_month, zone))
    .bind(zone.name())
    .fetch_all(pool)
    .await?;
    let mut numbers = Vec::new();
    for (seller, month) in due {
        let end = month
            .checked_add_months(chrono::Months::new(1))
            .unwrap_or(this_month);
        if let Some(n) = create(pool, &seller, month, end, zone).await? {
            numbers.push(n);
        }
    }
    Ok(numbers)
}

/// The invoice of `seller` for `[start, end)` (days of `zone`): made if there was commission
/// and it is not made yet. Returns its number.
pub async fn create(
    pool: &PgPool,
    seller: &str,
    start: NaiveDate,
    end: NaiveDate,
    zone: Tz,
) -> Result<Option<i64>, InvoiceError> {
    let mut tx = pool.begin().await?;
    // One invoice of a seller is made at a time: a concurrent run waits, then finds it.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('invoice:' || $1, 0))")
        .bind(seller)
        .execute(&mut *tx)
        .await?;
    // The zone of every invoice: the fleet's workers record theirs as they start, and the
    // `invoices` job before each run ([`record_zone`]); else the very first invoice records its
    // own (a racing first insert is waited for; the row is never changed, so no invoice waits
    // for another's). Where invoices were made before the zone was recorded (an upgraded
    // deployment), only the fleet records it: an operator's shell may have another zone.
    sqlx::query(
        "INSERT INTO invoice_calendar (timezone) SELECT $1 WHERE NOT EXISTS (SELECT 1 FROM invoices)
         ON CONFLICT (singleton) DO NOTHING",
    )
    .bind(zone.name())
    .execute(&mut *tx)
    .await?;
    let recorded: Option<String> = sqlx::query_scalar("SELECT timezone FROM invoice_calendar")
        .fetch_optional(&mut *tx)
        .await?;
    match recorded {
        Some(recorded) if recorded == zone.name() => {}
        Some(recorded) => {
            return Err(InvoiceError::OtherZone {
                recorded,
                configured: zone.name().to_owned(),
            });
        }
        None => {
            return Err(InvoiceError::ZoneUnrecorded {
                configured: zone.name().to_owned(),
            });
        }
    }
    let existing: Option<i64> = sqlx::query_scalar(
        "SELECT number FROM invoices WHERE seller_id = $1::uuid AND period_start = $2",
    )
    .bind(seller)
    .bind(start)
    .fetch_optional(&mut *tx)
    .await?;
    if existing.is_some() {
        return Ok(existing);
    }
    let lines: Vec<(i64, String, Decimal)> = sqlx::query_as(
        "SELECT t.order_number, t.currency::text,
                sum(CASE WHEN t.to_account = a.id THEN t.amount ELSE -t.amount END)
         FROM ledger_transfers t
         JOIN ledger_accounts a ON a.kind = 'platform_revenue' AND a.owner = $1
                               AND a.id IN (t.from_account, t.to_account)
         WHERE t.created_at >= $2 AND t.created_at < $3 AND t.order_number IS NOT NULL
         GROUP BY t.order_number, t.currency ORDER BY t.order_number, t.currency",
    )
    .bind(seller)
    .bind(day_start(start, zone))
    .bind(day_start(end, zone))
    .fetch_all(&mut *tx)
    .await?;
    if lines.is_empty() {
        return Ok(None);
    }
    let number = next_number(&mut tx).await?;
    let invoice: i64 = sqlx::query_scalar(
        "INSERT INTO invoices (number, seller_id, period_start, period_end) VALUES ($1, $2::uuid, $3, $4) RETURNING id",
    )
    .bind(number)
    .bind(seller)
    .bind(start)
    .bind(end)
    .fetch_one(&mut *tx)
    .await?;
    for (i, (order, currency, commission)) in lines.iter().enumerate() {
        let description = if *commission < Decimal::ZERO {
            format!("Commission returned on order {order} (refund or dispute)")
        } else {
            format!("Commission on order {order}")
        };
        sqlx::query(
            "INSERT INTO invoice_lines (invoice_id, line, order_number, currency, commission, description)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(invoice)
        .bind(i as i32 + 1)
        .bind(order)
        .bind(currency)
        .bind(commission)
        .bind(description)
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query(
        "INSERT INTO invoice_totals (invoice_id, currency, commission)
         SELECT $1, currency, sum(commission) FROM invoice_lines WHERE invoice_id = $1 GROUP BY currency",
    )
    .bind(invoice)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::info!(invoice = number, %seller, %start, "commission invoice made");
    Ok(Some(number))
}

async fn next_number(tx: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("UPDATE invoice_numbers SET last = last + 1 WHERE singleton RETURNING last")
        .fetch_one(&mut *tx)
        .await
}

#[derive(sqlx::FromRow)]
struct Head {
    id: i64,
    number: i64,
    seller_id: SellerId,
    seller_name: String,
    period_start: NaiveDate,
    period_end: NaiveDate,
    created_at: DateTime<Utc>,
}

const HEAD: &str = "SELECT i.id, i.number, i.seller_id, s.name AS seller_name, i.period_start, i.period_end, i.created_at
     FROM invoices i JOIN sellers s ON s.id = i.seller_id";

async fn complete(pool: &PgPool, h: Head) -> Result<Invoice, sqlx::Error> {
    let lines: Vec<(i32, i64, String, Decimal, String)> = sqlx::query_as(
        "SELECT line, order_number, currency::text, commission, description
         FROM invoice_lines WHERE invoice_id = $1 ORDER BY line",
    )
    .bind(h.id)
    .fetch_all(pool)
    .await?;
    let totals: Vec<(String, Decimal)> = sqlx::query_as(
        "SELECT currency::text, commission FROM invoice_totals WHERE invoice_id = $1 ORDER BY currency",
    )
    .bind(h.id)
    .fetch_all(pool)
    .await?;
    let lines = lines
        .into_iter()
        .map(
            |(line, order_number, currency, commission, description)| InvoiceLine {
                line,
                order_number,
                commission: decimal_text(commission, &currency),
                currency,
                description,
            },
        )
        .collect();
    let totals = totals
        .into_iter()
        .map(|(currency, commission)| InvoiceTotal {
            commission: decimal_text(commission, &currency),
            currency,
        })
        .collect();
    Ok(Invoice {
        number: h.number,
        seller_id: h.seller_id,
        seller_name: h.seller_name,
        period_start: h.period_start,
        period_end: h.period_end,
        created_at: h.created_at,
        lines,
        totals,
    })
}

/// A seller's invoices, newest first.
pub async fn list(pool: &PgPool, seller: SellerId) -> Result<Vec<Invoice>, sqlx::Error> {
    let heads: Vec<Head> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "{HEAD} WHERE i.seller_id = $1 ORDER BY i.number DESC"
    )))
    .bind(seller)
    .fetch_all(pool)
    .await?;
    let mut out = Vec::with_capacity(heads.len());
    for h in heads {
        out.push(complete(pool, h).await?);
    }
    Ok(out)
}

/// Invoice `number` of `seller`.
pub async fn get(
    pool: &PgPool,
    seller: SellerId,
    number: i64,
) -> Result<Option<Invoice>, sqlx::Error> {
    let head: Option<Head> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "{HEAD} WHERE i.seller_id = $1 AND i.number = $2"
    )))
    .bind(seller)
    .bind(number)
    .fetch_optional(pool)
    .await?;
    match head {
        Some(h) => Ok(Some(complete(pool, h).await?)),
        None => Ok(None),
    }
}
