//! The ledger's recurring work as queue jobs: the holding period's release, the payout run and
//! the commission invoice run. Each is one job row under a fixed key (a key is unique among
//! unfinished jobs), so however many workers run there is one of each, claimed by one worker at
//! a time; after a run it snoozes until its next one. Every run is idempotent by itself (a
//! release once per sale, a payout once per seller and period, an invoice once per seller and
//! month), so a run repeated after a crash, or by an operator (`payfleet money ...`), changes
//! nothing twice. A run that fails for good ends dead and listed (`payfleet jobs dead`); the next
//! worker start, or `payfleet jobs retry`, brings it back.

use std::time::Duration;

use chrono::{DateTime, NaiveTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::{LedgerError, invoices, payouts, sales};
use crate::queue::{self, Job, JobError, NewJob, QueueError};

/// Moves matured sales from pending to available.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReleaseMatured {}

impl Job for ReleaseMatured {
    const KIND: &'static str = "ledger_release";
    const QUEUE: &'static str = "ledger";
}

/// Pays every seller that is due.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunPayouts {}

impl Job for RunPayouts {
    const KIND: &'static str = "payout_run";
    const QUEUE: &'static str = "ledger";
}

/// Invoices last month's commission (and any ended month a run missed).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunInvoices {}

impl Job for RunInvoices {
    const KIND: &'static str = "invoice_run";
    const QUEUE: &'static str = "ledger";
}

/// How often matured sales are released.
pub const RELEASE_EVERY: Duration = Duration::from_secs(600);
/// The payout run's time of day (UTC).
pub const PAYOUTS_AT: NaiveTime = NaiveTime::from_hms_opt(0, 30, 0).expect("a valid time");
/// The invoice run's time of day (UTC); it runs daily and invoices the previous month once.
pub const INVOICES_AT: NaiveTime = NaiveTime::from_hms_opt(1, 0, 0).expect("a valid time");

/// The next time of day `at` after `now`.
pub fn next_daily(now: DateTime<Utc>, at: NaiveTime) -> DateTime<Utc> {
    let today = now.date_naive().and_time(at).and_utc();
    if today > now {
        today
    } else {
        today + chrono::Duration::days(1)
    }
}

fn until(next: DateTime<Utc>, now: DateTime<Utc>) -> Duration {
    (next - now).to_std().unwrap_or(Duration::ZERO)
}

/// Makes sure each recurring job exists (a worker start calls this; existing ones are kept).
pub async fn ensure(pool: &PgPool) -> Result<(), QueueError> {
    let now = Utc::now();
    queue::enqueue(
        pool,
        NewJob::of(&ReleaseMatured {})?.key(ReleaseMatured::KIND),
    )
    .await?;
    queue::enqueue(
        pool,
        NewJob::of(&RunPayouts {})?
            .key(RunPayouts::KIND)
            .run_at(next_daily(now, PAYOUTS_AT)),
    )
    .await?;
    queue::enqueue(
        pool,
        NewJob::of(&RunInvoices {})?
            .key(RunInvoices::KIND)
            .run_at(next_daily(now, INVOICES_AT)),
    )
    .await?;
    Ok(())
}

fn job_error(e: LedgerError) -> JobError {
    match e {
        LedgerError::Database(e) => e.into(),
        other => JobError::fail(other),
    }
}

impl ReleaseMatured {
    pub async fn run(&self, pool: &PgPool) -> Result<(), JobError> {
        let released = sales::release_matured(pool, Utc::now())
            .await
            .map_err(job_error)?;
        if released > 0 {
            tracing::info!(released, "matured sales released to available");
        }
        Err(JobError::Snooze(RELEASE_EVERY))
    }
}

impl RunPayouts {
    pub async fn run(&self, pool: &PgPool) -> Result<(), JobError> {
        let now = Utc::now();
        let made = payouts::run(pool, now.date_naive())
            .await
            .map_err(|e| match e {
                payouts::PayoutError::Database(e) => e.into(),
                payouts::PayoutError::Ledger(e) => job_error(e),
                other => JobError::fail(other),
            })?;
        tracing::info!(payouts = made.len(), "payout run done");
        Err(JobError::Snooze(until(next_daily(now, PAYOUTS_AT), now)))
    }
}

impl RunInvoices {
    pub async fn run(&self, pool: &PgPool) -> Result<(), JobError> {
        let now = Utc::now();
        let numbers = invoices::run_due(pool, now.date_naive()).await?;
        tracing::info!(invoices = numbers.len(), "invoice run done");
        Err(JobError::Snooze(until(next_daily(now, INVOICES_AT), now)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_daily_run_is_later_today_or_tomorrow() {
        let at = NaiveTime::from_hms_opt(0, 30, 0).unwrap();
        let before: DateTime<Utc> = "2026-03-01T00:10:00Z".parse().unwrap();
        let after: DateTime<Utc> = "2026-03-01T00:30:00Z".parse().unwrap();
        assert_eq!(
            next_daily(before, at),
            "2026-03-01T00:30:00Z".parse::<DateTime<Utc>>().unwrap()
        );
        assert_eq!(
            next_daily(after, at),
            "2026-03-02T00:30:00Z".parse::<DateTime<Utc>>().unwrap()
        );
    }
}
