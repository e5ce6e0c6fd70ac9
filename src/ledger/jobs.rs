//! The ledger's recurring work, as the recurring jobs run it (`jobs/recurring.toml`:
//! `holding_release`, `payouts`, `invoices`). Every run is idempotent by itself (a release once
//! per sale, a payout once per seller and period, an invoice once per seller and month), so a
//! run repeated after a crash, or by an operator (`payfleet money ...`), changes nothing twice.

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use sqlx::PgPool;

use super::{invoices, payouts, sales};
use payfleet_queue::JobError;

/// Moves matured sales from pending to available.
pub async fn release(pool: PgPool, _period: DateTime<Tz>) -> Result<(), JobError> {
    let released = sales::release_matured(&pool, Utc::now()).await?;
    if released > 0 {
        tracing::info!(released, "matured sales released to available");
    }
    Ok(())
}

/// Pays every seller due on the period's day (in the schedule's time zone).
pub async fn payouts(pool: PgPool, period: DateTime<Tz>) -> Result<(), JobError> {
    let made = payouts::run(&pool, period.date_naive())
        .await
        .map_err(|e| match e {
            payouts::PayoutError::Database(e) => e.into(),
            payouts::PayoutError::Ledger(e) => e.into(),
            other => JobError::fail(other),
        })?;
    tracing::info!(payouts = made.len(), "payout run done");
    Ok(())
}

/// Invoices every month of `zone` ended by the run's period and not invoiced yet (the period's
/// instant, not its date in the schedule's own time zone: a run at 01:00 in Tokyo is still the
/// day before in UTC).
pub async fn invoices(pool: PgPool, period: DateTime<Tz>, zone: Tz) -> Result<(), JobError> {
    invoices::record_zone(&pool, zone).await?;
    let numbers = invoices::run_due(&pool, period.with_timezone(&Utc), zone).await?;
    tracing::info!(invoices = numbers.len(), "invoice run done");
    Ok(())
}
