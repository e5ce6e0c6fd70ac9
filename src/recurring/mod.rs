//! Recurring jobs: schedules from `jobs/recurring.toml`, each period run once by the fleet.
//!
//! Every worker process ticks (every second): for each enabled schedule it computes the latest
//! period at or before now and, when that period is new to it, inserts the period's row in
//! `recurring_runs` (`ON CONFLICT DO NOTHING`) and, if the insert was its own, enqueues the run
//! in the same transaction. The primary key (name, period) is the database deciding: one run per
//! period however many processes tick, on however many machines, with no timer of their own
//! mattering. The run's job has a fixed key (`recurring:<name>`), unique among unfinished jobs,
//! so a run that outlasts its period is never started twice: the next period is recorded as
//! `skipped`, with the reason. At start-up the latest period is looked at once, so a period
//! missed while the fleet was down is caught up, once, if it is at most `catch_up_secs` old.
//!
//! What each name does is given by the process that assembles the fleet ([`Tasks`]).

pub mod schedules;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

pub use schedules::{Schedule, ScheduleError, Schedules};

use payfleet_queue::{
    self as queue, Job, JobContext, JobError, NewJob, QueueError, Registry, RegistryError, Worker,
};

/// Runs one period of a recurring job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecurringRun {
    pub name: String,
    pub period: DateTime<Utc>,
}

impl Job for RecurringRun {
    const KIND: &'static str = "recurring_run";
    const QUEUE: &'static str = "recurring";
    // A run that fails is retried with backoff, as any job: an outage's burst of failures (a
    // database restart, workers killed under it) must not leave a day's payouts dead after a few
    // minutes (the hour-long soak found five attempts too few). Each task is idempotent for its
    // period, so a late run of an earlier period is harmless.
    const MAX_ATTEMPTS: i32 = 25;
}

type TaskFuture = Pin<Box<dyn Future<Output = Result<(), JobError>> + Send>>;
type Task = Arc<dyn Fn(PgPool, DateTime<Tz>) -> TaskFuture + Send + Sync>;

/// What each recurring job does, by name: given the pool and the period it stands for, in the
/// schedule's time zone (a payout run at 00:30 in Tokyo pays for Tokyo's day).
#[derive(Clone, Default)]
pub struct Tasks {
    tasks: HashMap<&'static str, Task>,
}

impl Tasks {
    pub fn add<F, Fut>(&mut self, name: &'static str, task: F) -> &mut Self
    where
        F: Fn(PgPool, DateTime<Tz>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), JobError>> + Send + 'static,
    {
        self.tasks.insert(
            name,
            Arc::new(move |pool, period| Box::pin(task(pool, period))),
        );
        self
    }

    fn get(&self, name: &str) -> Option<Task> {
        self.tasks.get(name).cloned()
    }
}

/// What a tick did with one schedule's latest period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ticked {
    /// This process recorded the period and enqueued its run.
    Enqueued(DateTime<Utc>),
    /// The previous run was still going: the period is recorded as skipped.
    Skipped(DateTime<Utc>),
    /// Another process had recorded it.
    Taken(DateTime<Utc>),
    /// Missed by more than the catch-up limit: not run.
    TooOld(DateTime<Utc>),
}

/// Looks at `schedule`'s latest period at `now`; records and enqueues it if nobody has.
pub async fn tick(
    pool: &PgPool,
    schedule: &Schedule,
    now: DateTime<Utc>,
) -> Result<Option<Ticked>, QueueError> {
    let Some(period) = schedule.latest(now) else {
        return Ok(None);
    };
    let age = (now - period).to_std().unwrap_or(Duration::ZERO);
    if age > schedule.catch_up {
        return Ok(Some(Ticked::TooOld(period)));
    }
    let mut tx = pool.begin().await?;
    let recorded = sqlx::query(
        "INSERT INTO recurring_runs (name, period) VALUES ($1, $2) ON CONFLICT (name, period) DO NOTHING",
    )
    .bind(&schedule.name)
    .bind(period)
    .execute(&mut *tx)
    .await?;
    if recorded.rows_affected() == 0 {
        return Ok(Some(Ticked::Taken(period)));
    }
    let job = NewJob::of(&RecurringRun {
        name: schedule.name.clone(),
        period,
    })?
    .key(format!("recurring:{}", schedule.name));
    let ticked = match queue::enqueue(&mut *tx, job).await? {
        Some(id) => {
            sqlx::query("UPDATE recurring_runs SET job_id = $3 WHERE name = $1 AND period = $2")
                .bind(&schedule.name)
                .bind(period)
                .bind(id.0)
                .execute(&mut *tx)
                .await?;
            Ticked::Enqueued(period)
        }
        None => {
            sqlx::query(
                "UPDATE recurring_runs SET state = 'skipped', finished_at = now(),
                        error = 'the previous run was still going when this period came'
                 WHERE name = $1 AND period = $2",
            )
            .bind(&schedule.name)
            .bind(period)
            .execute(&mut *tx)
            .await?;
            tracing::warn!(recurring = %schedule.name, %period, "the previous run is still going: period skipped");
            Ticked::Skipped(period)
        }
    };
    tx.commit().await?;
    Ok(Some(ticked))
}

/// The scheduler of one worker process: ticks every enabled schedule each second until
/// `stopped` resolves. A period already handled by this process is not looked at again.
pub async fn schedule(pool: PgPool, schedules: Schedules, stopped: impl Future<Output = ()>) {
    let enabled: Vec<Schedule> = schedules.list.into_iter().filter(|s| s.enabled).collect();
    if enabled.is_empty() {
        return;
    }
    let mut seen: HashMap<String, DateTime<Utc>> = HashMap::new();
    // The first tick a second after the start, as every later one: a worker started on a
    // backlog gives its first moments to the backlog (a new backend and statements planned
    // afresh for each schedule otherwise), and a period is ticked by whichever worker comes
    // first.
    let mut every = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            _ = every.tick() => {}
        }
        let now = Utc::now();
        for s in &enabled {
            let Some(latest) = s.latest(now) else {
                continue;
            };
            if seen.get(&s.name) == Some(&latest) {
                continue;
            }
            match tick(&pool, s, now).await {
                Ok(result) => {
                    if let Some(Ticked::TooOld(period)) = result {
                        tracing::warn!(recurring = %s.name, %period, "a period missed beyond catch_up_secs is not run");
                    }
                    seen.insert(s.name.clone(), latest);
                }
                // The database is out: look again next second.
                Err(e) => {
                    tracing::warn!(recurring = %s.name, error = %e, "cannot schedule a recurring run")
                }
            }
        }
    }
}

/// Runs the periods' jobs: each with its task (by name) and its schedule.
pub struct Runner {
    pub tasks: Tasks,
    pub schedules: Schedules,
}

impl Worker<RecurringRun> for Runner {
    async fn work(&self, ctx: JobContext, job: RecurringRun) -> Result<(), JobError> {
        run(&self.tasks, &self.schedules, &ctx, &job).await
    }
}

/// The recurring jobs' kind, with its worker.
pub fn register(registry: &mut Registry, runner: Runner) -> Result<(), RegistryError> {
    registry.add::<RecurringRun, _>(runner)?;
    Ok(())
}

/// Runs a period's job: marks it running, runs its task, records how it ended. A failure on
/// the last attempt (or one that can never succeed) marks the period failed, with its error.
async fn run(
    tasks: &Tasks,
    schedules: &Schedules,
    ctx: &JobContext,
    job: &RecurringRun,
) -> Result<(), JobError> {
    let task = tasks.get(&job.name).ok_or_else(|| {
        JobError::fail(format!(
            "no recurring job {:?} in this worker: is jobs/recurring.toml newer than the binary?",
            job.name
        ))
    })?;
    // A period that has finished is not run again: a worker killed after its run completed but
    // before the job's end was written leaves the job to be rescued and claimed once more, and
    // that rerun is a no-op. A failed run starts again (an operator's retry, or a retry of the
    // job itself), its old end cleared.
    let finished: Option<String> = sqlx::query_scalar(
        "SELECT state FROM recurring_runs WHERE name = $1 AND period = $2 AND state IN ('completed', 'skipped')",
    )
    .bind(&job.name)
    .bind(job.period)
    .fetch_optional(&ctx.pool)
    .await?;
    if let Some(state) = finished {
        tracing::info!(recurring = %job.name, period = %job.period, %state, "the period has already finished: nothing to run again");
        return Ok(());
    }
    sqlx::query(
        "UPDATE recurring_runs SET state = 'running', started_at = COALESCE(started_at, now()),
                                   finished_at = NULL, error = NULL
         WHERE name = $1 AND period = $2 AND state NOT IN ('completed', 'skipped')",
    )
    .bind(&job.name)
    .bind(job.period)
    .execute(&ctx.pool)
    .await?;
    let zone = schedules
        .get(&job.name)
        .map_or(chrono_tz::UTC, |s| s.timezone);
    let result = task(ctx.pool.clone(), job.period.with_timezone(&zone)).await;
    let last = ctx.attempt >= ctx.max_attempts;
    let (state, error) = match &result {
        Ok(()) => ("completed", None),
        Err(JobError::Fail(e)) => ("failed", Some(e.to_string())),
        Err(e @ JobError::Retry { .. }) if last => ("failed", Some(e.to_string())),
        Err(e @ JobError::Retry { .. }) => {
            // Retried with backoff (up to an hour between attempts): the period stays running,
            // and says why, for the admin API and the `payfleet_recurring_runs_troubled` gauge.
            sqlx::query("UPDATE recurring_runs SET error = $3 WHERE name = $1 AND period = $2")
                .bind(&job.name)
                .bind(job.period)
                .bind(format!(
                    "attempt {} of {} failed, to be tried again: {e}",
                    ctx.attempt, ctx.max_attempts
                ))
                .execute(&ctx.pool)
                .await?;
            return result;
        }
        Err(_) => return result,
    };
    sqlx::query(
        "UPDATE recurring_runs SET state = $3, error = $4, finished_at = now() WHERE name = $1 AND period = $2",
    )
    .bind(&job.name)
    .bind(job.period)
    .bind(state)
    .bind(error)
    .execute(&ctx.pool)
    .await?;
    if state == "failed" {
        tracing::error!(recurring = %job.name, period = %job.period, "a recurring run failed");
    }
    result
}

/// A recurring job as the admin API shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Overview {
    pub name: String,
    pub cron: String,
    pub timezone: String,
    pub enabled: bool,
    pub last_period: Option<DateTime<Utc>>,
    pub last_state: Option<String>,
    pub next_period: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct RunView {
    pub period: DateTime<Utc>,
    pub state: String,
    pub job_id: Option<i64>,
    pub error: Option<String>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
}

pub async fn overview(
    pool: &PgPool,
    schedules: &Schedules,
    now: DateTime<Utc>,
) -> Result<Vec<Overview>, sqlx::Error> {
    let mut out = Vec::with_capacity(schedules.list.len());
    for s in &schedules.list {
        let last: Option<(DateTime<Utc>, String)> = sqlx::query_as(
            "SELECT period, state FROM recurring_runs WHERE name = $1 ORDER BY period DESC LIMIT 1",
        )
        .bind(&s.name)
        .fetch_optional(pool)
        .await?;
        out.push(Overview {
            name: s.name.clone(),
            cron: s.cron.source().to_owned(),
            timezone: s.timezone.name().to_owned(),
            enabled: s.enabled,
            last_period: last.as_ref().map(|(p, _)| *p),
            last_state: last.map(|(_, st)| st),
            next_period: s.enabled.then(|| s.next(now)).flatten(),
        });
    }
    Ok(out)
}

/// The periods of the last week an operator should look at, by recurring job name: failed,
/// retrying after an error, or unfinished an hour after they were scheduled (a run lasts
/// minutes: its job died by its timeout, a lost lease or a kill on its last attempt, leaving the
/// period running); unless a later period of the same job has completed since (its job has a
/// fixed key, so a later one runs only once the earlier's job is gone).
pub async fn troubled(pool: &PgPool) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.name, count(*) FROM recurring_runs r
         WHERE r.period > now() - interval '7 days'
           AND (r.state IN ('scheduled', 'running')
                    AND (r.error IS NOT NULL OR r.created_at < now() - interval '1 hour')
                OR r.state = 'failed')
           AND NOT EXISTS (SELECT 1 FROM recurring_runs l
                           WHERE l.name = r.name AND l.period > r.period AND l.state = 'completed')
         GROUP BY r.name ORDER BY r.name",
    )
    .fetch_all(pool)
    .await
}

/// A recurring job's runs, newest first.
pub async fn runs(pool: &PgPool, name: &str, limit: i64) -> Result<Vec<RunView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT period, state, job_id, error, started_at, finished_at FROM recurring_runs
         WHERE name = $1 ORDER BY period DESC LIMIT $2",
    )
    .bind(name)
    .bind(limit)
    .fetch_all(pool)
    .await
}
