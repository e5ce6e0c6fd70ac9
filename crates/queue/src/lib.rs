//! payfleet-queue: a PostgreSQL job queue and its worker fleet, on sqlx and a plain tokio
//! runtime. It knows nothing of what its jobs do (payfleet's payments are one user of it).
//!
//! - [`enqueue`], [`schedule`], [`cancel`] take any executor, so a job is written inside the
//!   caller's transaction and exists if and only if the business write commits;
//!   [`insert_jobs_from`] places the same insert inside a statement of the caller's own, and
//!   [`complete_runs_from`] a run's completion ([`JobContext::run`]), so a job's effect and its
//!   end can commit together.
//! - [`Fleet`] runs the workers of one process. Its parts, as River's `internal/` splits them:
//!   `executor` (a fetcher per queue: batched `FOR UPDATE SKIP LOCKED` claims, each run in its own
//!   task under a timeout), `completer` (batched run ends), `lease` (renewals, and cancelling a
//!   run whose lease is lost), `listener` (LISTEN/NOTIFY wake-ups; polling is the fallback) and
//!   `maintenance` (rescue of expired leases, pruning); what those loops share (stopping,
//!   pausing, backing off) is `loops`, below them all. [`census`] counts the fleet's worker
//!   processes per queue (`queue_workers`), for what a process sizes by it and for operators.
//! - `store` holds every statement; the rules of a run's end are SQL (`jobs_end_runs`).
//! - [`pg`]: the schema's migrations (their own table, `pg::migrate`), which database errors
//!   are outages, and enums stored as text. [`admin`]: the operator's view and repairs.
//! - `apalis` (feature `apalis`): the queue as an apalis-core backend.

pub mod admin;
#[cfg(feature = "apalis")]
pub mod apalis;
pub mod census;
mod completer;
mod config;
mod executor;
mod fleet;
mod lease;
mod listener;
mod loops;
mod maintenance;
mod notifier;
pub mod pg;
mod registry;
mod store;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Serialize, de::DeserializeOwned};
use sqlx::PgExecutor;

pub use census::Census;
pub use config::{
    BookkeepingCommit, FleetSettings, QueueSettings, QueuesConfig, QueuesConfigError,
};
pub use fleet::{Fleet, FleetHandle, FleetProbe, Listen, work_until_idle};
pub use maintenance::{prune, rescue_expired, vacuum_if_dead};
pub use notifier::Notifier;
pub use registry::{JobContext, Registry, RegistryError, RunClaim, Worker};

crate::text_enum! {
    /// `jobs.state` (docs/state_machine.md).
    pub enum JobState {
        /// Waiting for its `run_at`; claimable once due.
        Available = "available",
        /// Claimed by a worker that holds a lease.
        Running = "running",
        /// Failed an attempt; claimable again at `run_at` (the stored backoff).
        Retryable = "retryable",
        Completed = "completed",
        Discarded = "discarded",
        Cancelled = "cancelled",
    }
}

impl JobState {
    pub fn is_finished(&self) -> bool {
        matches!(self, Self::Completed | Self::Discarded | Self::Cancelled)
    }
}

crate::text_enum! {
    /// How a run ended, as `jobs_end_runs` reads it.
    pub enum RunOutcome {
        Complete = "complete",
        Retry = "retry",
        Fail = "fail",
        Snooze = "snooze",
        Cancel = "cancel",
        /// Handed back without counting an attempt (shutdown).
        Release = "release",
    }
}

/// One run's end, as a fleet reports it to its [`RunObserver`].
#[derive(Debug, Clone, Copy)]
pub struct RunReport<'a> {
    pub queue: &'a str,
    pub kind: &'a str,
    pub outcome: RunOutcome,
    /// The handler's run time (decoding included).
    pub took: std::time::Duration,
    /// From the time the job was due (`run_at`) to its start: the queue's backlog as this job
    /// felt it.
    pub waited: std::time::Duration,
}

/// Told of every run's end (metrics): called on the run's task, so it must be quick and must
/// not block.
pub trait RunObserver: Send + Sync + 'static {
    fn run_ended(&self, run: &RunReport<'_>);
}

/// A kind of job: its payload type, the queue it runs on and how often it may be tried.
pub trait Job: Serialize + DeserializeOwned + Send + 'static {
    const KIND: &'static str;
    const QUEUE: &'static str;
    const MAX_ATTEMPTS: i32 = 25;
}

/// The id of a row in `jobs`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, sqlx::Type, serde::Serialize,
)]
#[sqlx(transparent)]
pub struct JobId(pub i64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A job about to be written.
#[derive(Debug, Clone)]
pub struct NewJob {
    queue: String,
    kind: String,
    key: Option<String>,
    payload: serde_json::Value,
    run_at: Option<DateTime<Utc>>,
    max_attempts: i32,
    fairness_key: Option<String>,
}

/// Longest fairness key (the schema's `jobs_fairness_key_valid`).
pub const MAX_FAIRNESS_KEY: usize = 200;

impl NewJob {
    pub fn of<J: Job>(job: &J) -> Result<Self, QueueError> {
        Ok(Self {
            queue: J::QUEUE.to_owned(),
            kind: J::KIND.to_owned(),
            key: None,
            payload: serde_json::to_value(job).map_err(QueueError::Encode)?,
            run_at: None,
            max_attempts: J::MAX_ATTEMPTS,
            fairness_key: None,
        })
    }

    /// A job whose payload is already JSON, for operators and benchmarks.
    pub fn raw(queue: &str, kind: &str, payload: serde_json::Value) -> Self {
        Self {
            queue: queue.to_owned(),
            kind: kind.to_owned(),
            key: None,
            payload,
            run_at: None,
            max_attempts: 25,
            fairness_key: None,
        }
    }

    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self
    }

    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Who the job is for (a seller, say): within its queue, claims take turns between keys,
    /// so a flood of one key's jobs does not hold up another key's. Jobs without one share a
    /// single turn.
    pub fn fairness_key(mut self, key: impl Into<String>) -> Self {
        self.fairness_key = Some(key.into());
        self
    }

    pub fn has_key(&self) -> bool {
        self.key.is_some()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("could not encode the job payload")]
    Encode(#[source] serde_json::Error),
    #[error("schedule needs a job key")]
    MissingKey,
    #[error("max_attempts must be at least 1 (got {0})")]
    InvalidMaxAttempts(i32),
    #[error("a fairness key must be 1 to {MAX_FAIRNESS_KEY} bytes (got {0})")]
    InvalidFairnessKey(usize),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

fn check(job: &NewJob) -> Result<(), QueueError> {
    if job.max_attempts < 1 {
        return Err(QueueError::InvalidMaxAttempts(job.max_attempts));
    }
    if let Some(key) = &job.fairness_key
        && (key.is_empty() || key.len() > MAX_FAIRNESS_KEY)
    {
        return Err(QueueError::InvalidFairnessKey(key.len()));
    }
    Ok(())
}

/// Adds a job. With a key that an unfinished job already holds, nothing is written and `None`
/// comes back; the caller's transaction is not aborted by the conflict. Workers LISTENing are
/// woken when the transaction commits.
pub async fn enqueue<'c>(
    db: impl PgExecutor<'c>,
    job: NewJob,
) -> Result<Option<JobId>, QueueError> {
    let mut columns = JobColumns::default();
    columns.push(&job)?;
    let id: Option<(JobId,)> = columns
        .bind(sqlx::query_as(store::ENQUEUE_ONE))
        .fetch_optional(db)
        .await?;
    Ok(id.map(|(id,)| id))
}

/// The INSERT of jobs as SQL text, for a statement of the caller's that writes its own rows and
/// their jobs in one round trip (a CTE of it, say), under the rules of [`enqueue_many`]: a key
/// an unfinished job holds means nothing is written for that job, and the statement goes on.
///
/// `source` is SQL naming a relation (a CTE's name, or a parenthesised subquery with an alias)
/// with the columns `job_queue text, job_kind text, job_key text, job_payload jsonb,
/// job_run_at timestamptz` (NULL: now), `job_max_attempts int, job_fairness_key text`; any
/// other columns are ignored. [`JOB_COLUMNS_FROM_PARAMS`] is such a relation over the seven
/// parameters [`JobColumns::bind`] fills. Append `RETURNING ...` to see what was written.
///
/// The statement does not wake the workers (a NOTIFY inside a transaction would serialise its
/// commits): call [`Notifier::notify`] once it has committed, or let the workers' polling find
/// the jobs. Build the text once (a `LazyLock<String>`), so the statement is prepared once.
pub fn insert_jobs_from(source: &str) -> String {
    store::insert_jobs_from(source)
}

/// SQL that completes runs inside the caller's transaction, with their effect: deletes the job
/// row of each run `source` names, as [`RunClaim`]s' `(id, lease_token)`, while that run still
/// holds it and nothing is pending on it (a cancel or a reschedule asked during the run is left
/// for the run's own end, which honours it), and returns the ids of the jobs completed
/// (`RETURNING id`). After the commit, call [`RunClaim::completed`] on those runs; the others
/// end as usual.
///
/// `source` is SQL naming a relation of two columns, the job id (bigint) and the lease token
/// (bigint), aliased here as `r(id, token)`: `unnest($1::bigint[], $2::bigint[])`, say. The
/// statement is a `DELETE`, for a `WITH` of a statement of the caller's. Build the text once
/// (a `LazyLock<String>`), so the statement is prepared once.
pub fn complete_runs_from(source: &str) -> String {
    store::complete_runs_from(source)
}

/// The relation [`insert_jobs_from`] reads, over the seven parameters `$1` to `$7` that
/// [`JobColumns::bind`] fills.
pub const JOB_COLUMNS_FROM_PARAMS: &str = store::JOB_COLUMNS_FROM_PARAMS;

/// Jobs as parallel arrays, bound as the first seven parameters of a statement that inserts them
/// with [`insert_jobs_from`] over [`JOB_COLUMNS_FROM_PARAMS`].
#[derive(Debug, Default)]
pub struct JobColumns<'a> {
    queues: Vec<&'a str>,
    kinds: Vec<&'a str>,
    keys: Vec<Option<&'a str>>,
    payloads: Vec<&'a serde_json::Value>,
    run_ats: Vec<Option<DateTime<Utc>>>,
    max_attempts: Vec<i32>,
    fairness_keys: Vec<Option<&'a str>>,
}

impl<'a> JobColumns<'a> {
    pub fn push(&mut self, job: &'a NewJob) -> Result<(), QueueError> {
        check(job)?;
        self.queues.push(&job.queue);
        self.kinds.push(&job.kind);
        self.keys.push(job.key.as_deref());
        self.payloads.push(&job.payload);
        self.run_ats.push(job.run_at);
        self.max_attempts.push(job.max_attempts);
        self.fairness_keys.push(job.fairness_key.as_deref());
        Ok(())
    }

    /// Binds the columns as the next seven parameters, typed `text[], text[], text[], jsonb[],
    /// timestamptz[], int[], text[]`: queue, kind, key, payload, run_at, max_attempts,
    /// fairness key.
    pub fn bind<'q, O>(
        &'q self,
        q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        q.bind(&self.queues)
            .bind(&self.kinds)
            .bind(&self.keys)
            .bind(&self.payloads)
            .bind(&self.run_ats)
            .bind(&self.max_attempts)
            .bind(&self.fairness_keys)
    }
}

/// Adds many jobs in one statement. Keyed jobs whose key is taken are skipped; returns how
/// many were written.
pub async fn enqueue_many<'c>(db: impl PgExecutor<'c>, jobs: &[NewJob]) -> Result<u64, QueueError> {
    let mut columns = JobColumns::default();
    for job in jobs {
        columns.push(job)?;
    }
    let (written,): (i64,) = columns
        .bind(sqlx::query_as(store::ENQUEUE_MANY))
        .fetch_one(db)
        .await?;
    Ok(written as u64)
}

/// Adds jobs like [`enqueue_many`], except that a key held by a job running right now makes
/// that job run again once its run ends: for work that must not be missed when it arrives while
/// the job that would do it is already running (a payment waking an event whose own run has
/// just decided to wait). Returns how many jobs were added or marked.
pub async fn enqueue_or_rerun<'c>(
    db: impl PgExecutor<'c>,
    jobs: &[NewJob],
) -> Result<u64, QueueError> {
    let mut columns = JobColumns::default();
    for job in jobs {
        columns.push(job)?;
    }
    let (written,): (i64,) = columns
        .bind(sqlx::query_as(store::ENQUEUE_OR_RERUN))
        .fetch_one(db)
        .await?;
    Ok(written as u64)
}

/// What [`schedule`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheduled {
    /// No unfinished job had the key; this one was added.
    Inserted(JobId),
    /// A waiting job with the key now carries the new payload and run time; it cannot run with
    /// the old ones any more.
    Replaced(JobId),
    /// The job with the key is running right now. When that run ends, whatever its outcome, the
    /// job becomes available again with the new payload and run time.
    ReplacedAfterRun(JobId),
}

/// Adds a keyed job or atomically replaces the unfinished job holding the key. Concurrent calls
/// serialise on the key's row, so there is never more than one unfinished job per key.
pub async fn schedule<'c>(db: impl PgExecutor<'c>, job: NewJob) -> Result<Scheduled, QueueError> {
    check(&job)?;
    let key = job.key.as_deref().ok_or(QueueError::MissingKey)?;
    let (id, inserted, running): (JobId, bool, bool) = sqlx::query_as(store::SCHEDULE)
        .bind(&job.queue)
        .bind(&job.kind)
        .bind(key)
        .bind(&job.payload)
        .bind(job.run_at)
        .bind(job.max_attempts)
        .bind(job.fairness_key.as_deref())
        .fetch_one(db)
        .await?;
    Ok(match (inserted, running) {
        (true, _) => Scheduled::Inserted(id),
        (false, false) => Scheduled::Replaced(id),
        (false, true) => Scheduled::ReplacedAfterRun(id),
    })
}

/// What [`cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// No unfinished job had the key.
    NotFound,
    /// The waiting job was cancelled.
    Cancelled(JobId),
    /// The job is running; it ends cancelled, whatever the outcome of this run (unless work
    /// for its key arrives meanwhile through [`enqueue_or_rerun`]: then it runs again).
    AfterRun(JobId),
}

/// Cancels the unfinished job holding `key`.
pub async fn cancel<'c>(db: impl PgExecutor<'c>, key: &str) -> Result<Cancelled, QueueError> {
    let row: Option<(JobId, bool)> = sqlx::query_as(store::CANCEL)
        .bind(key)
        .fetch_optional(db)
        .await?;
    Ok(match row {
        None => Cancelled::NotFound,
        Some((id, false)) => Cancelled::Cancelled(id),
        Some((id, true)) => Cancelled::AfterRun(id),
    })
}

/// The state of the latest job holding `key`: the unfinished one if any, else the newest
/// discarded one. `None` when neither exists (it completed, was cancelled, or was pruned).
pub async fn latest_state_of_key<'c>(
    db: impl PgExecutor<'c>,
    key: &str,
) -> Result<Option<JobState>, sqlx::Error> {
    sqlx::query_scalar(store::LATEST_BY_KEY)
        .bind(key)
        .fetch_one(db)
        .await
}

pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A job that could not enqueue another: retried if the database is out, failed otherwise.
impl From<QueueError> for JobError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Database(e) => e.into(),
            other => Self::fail(other),
        }
    }
}

/// How a run that did not simply succeed ends. Returning `Ok(())` completes the job.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Try again later: after `after`, or after the stored exponential backoff. Counts as an
    /// attempt; when attempts run out the job is discarded.
    #[error("{source}")]
    Retry {
        #[source]
        source: BoxError,
        after: Option<Duration>,
    },
    /// This job can never succeed: discard it now, keeping the error.
    #[error("{0}")]
    Fail(#[source] BoxError),
    /// Not an error: run again after the delay, without counting an attempt.
    #[error("snoozed for {0:?}")]
    Snooze(Duration),
    /// Nothing left to do: end the job as cancelled.
    #[error("cancelled: {0}")]
    Cancel(String),
}

impl JobError {
    pub fn retry(source: impl Into<BoxError>) -> Self {
        Self::Retry {
            source: source.into(),
            after: None,
        }
    }

    pub fn retry_after(source: impl Into<BoxError>, after: Duration) -> Self {
        Self::Retry {
            source: source.into(),
            after: Some(after),
        }
    }

    pub fn fail(source: impl Into<BoxError>) -> Self {
        Self::Fail(source.into())
    }

    /// Retried when `transient` (an outage: the same run may succeed later), failed for good
    /// otherwise: the one rule for an error type that knows which of its cases are outages.
    pub fn retry_if(transient: bool, source: impl Into<BoxError>) -> Self {
        if transient {
            Self::retry(source)
        } else {
            Self::fail(source)
        }
    }
}

/// A database error inside a job is retried with backoff when it is an outage
/// ([`crate::pg::is_transient`]); anything else (a constraint, bad data) would fail the same way
/// again, so the job fails at once, keeping the error for an operator.
impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        Self::retry_if(crate::pg::is_transient(&e), e)
    }
}

/// How a run ended, as `jobs_end_runs` spells it.
#[derive(Debug, Clone)]
pub(crate) enum RunEnd {
    Complete,
    /// Completed by the handler's own transaction ([`RunClaim::completed`]): no end to write.
    Completed,
    Retry {
        error: String,
        after: Option<Duration>,
    },
    Fail {
        error: String,
    },
    Snooze(Duration),
    Cancel {
        reason: String,
    },
    Release,
}

impl RunEnd {
    pub(crate) fn outcome(&self) -> RunOutcome {
        match self {
            Self::Complete | Self::Completed => RunOutcome::Complete,
            Self::Retry { .. } => RunOutcome::Retry,
            Self::Fail { .. } => RunOutcome::Fail,
            Self::Snooze(_) => RunOutcome::Snooze,
            Self::Cancel { .. } => RunOutcome::Cancel,
            Self::Release => RunOutcome::Release,
        }
    }

    fn delay_ms(&self) -> Option<i64> {
        let d = match self {
            Self::Retry { after, .. } => (*after)?,
            Self::Snooze(d) => *d,
            _ => return None,
        };
        // A run time beyond a year is surely a mistake; a year still counts as "much later".
        Some(d.min(MAX_DELAY).as_millis() as i64)
    }

    fn error(&self) -> Option<String> {
        let text = match self {
            Self::Retry { error, .. } | Self::Fail { error } => error.clone(),
            Self::Cancel { reason } => format!("cancelled: {reason}"),
            _ => return None,
        };
        Some(storable(&text))
    }
}

impl From<Result<(), JobError>> for RunEnd {
    fn from(result: Result<(), JobError>) -> Self {
        match result {
            Ok(()) => Self::Complete,
            Err(e) => {
                let error = error_chain(&e);
                match e {
                    JobError::Retry { after, .. } => Self::Retry { error, after },
                    JobError::Fail(_) => Self::Fail { error },
                    JobError::Snooze(d) => Self::Snooze(d),
                    JobError::Cancel(reason) => Self::Cancel { reason },
                }
            }
        }
    }
}

const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);
const MAX_ERROR_CHARS: usize = 2000;

/// An error text PostgreSQL will store: no NUL (text cannot hold one; error texts may quote
/// outside input) and of bounded length.
fn storable(text: &str) -> String {
    let mut out: String = text
        .chars()
        .filter(|c| *c != '\0')
        .take(MAX_ERROR_CHARS)
        .collect();
    if text.chars().count() > MAX_ERROR_CHARS {
        out.push('…');
    }
    out
}

/// "outer: inner: root", so the stored error keeps its causes.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// One run's end, named by its lease.
#[derive(Debug, Clone)]
pub(crate) struct Ended {
    pub id: JobId,
    pub lease_token: i64,
    pub end: RunEnd,
}

impl Ended {
    fn row(&self) -> store::EndRow {
        store::EndRow {
            id: self.id,
            lease_token: self.lease_token,
            outcome: self.end.outcome(),
            delay_ms: self.end.delay_ms(),
            error: self.end.error(),
        }
    }
}

/// Ends runs in one statement, committing durably and skipping rows another transaction holds.
/// Returns the new state of each run that still held its lease.
pub(crate) async fn end_runs<'c>(
    db: impl PgExecutor<'c>,
    ended: &[Ended],
) -> Result<Vec<(JobId, JobState)>, sqlx::Error> {
    end_runs_as(db, ended, BookkeepingCommit::On, store::LockedRows::Skip).await
}

/// [`end_runs`] with the commit mode and the handling of locked rows the fleet's completer
/// chooses.
pub(crate) async fn end_runs_as<'c>(
    db: impl PgExecutor<'c>,
    ended: &[Ended],
    commit: BookkeepingCommit,
    locked: store::LockedRows,
) -> Result<Vec<(JobId, JobState)>, sqlx::Error> {
    let rows: Vec<store::EndRow> = ended.iter().map(Ended::row).collect();
    store::end_runs(db, &rows, commit, locked).await
}
