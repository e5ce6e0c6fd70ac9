//! Writes verified webhooks in batches. Requests that arrive while a batch is being written
//! queue up and go out together in the next statement: one commit (one WAL flush) for many
//! events, where one statement per request would wait for a flush each. Every request is still
//! answered only after its own event and processing job have committed.
//!
//! One writer per process, so one statement in flight: that makes the largest batches. Measured
//! with `payfleet bench ingest` at 32 senders: one writer ~11,600 webhooks/s, two ~9,800, four
//! ~8,000. More throughput comes from more `web` processes.
//!
//! An outage is answered fast, never waited out by the sender:
//! - the writer owns one connection, opened with a short timeout, and bounds each statement;
//! - when the database is unreachable, the whole batch gets 503 at once (a batch is split one
//!   event at a time only when the database refused one of its events), and for a short,
//!   growing interval every batch gets 503 without trying (a circuit breaker);
//! - when the writer's queue is full, a request is refused at once with 503, not queued;
//! - a panic while writing loses no event (its senders get 503 and resend) and the writer goes
//!   on; if the task ever ended, [`EventWriter::is_alive`] says so and `/readyz` fails.

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::{Stored, Webhook};
use crate::gateways::GatewayName;
use crate::payments::ProcessPaymentEvent;
use payfleet_queue::{Job, JobColumns, NewJob, Notifier, QueueError};

/// Most events in one statement.
const MAX_BATCH: usize = 256;
/// Opening the writer's connection: a database that does not answer is an outage.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// One batch statement (milliseconds normally).
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(4);
/// After a failed attempt, batches are refused without trying for this long, doubling up to
/// [`MAX_PAUSE`] while the outage lasts.
const FIRST_PAUSE: Duration = Duration::from_millis(200);
const MAX_PAUSE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused this event itself (not an outage).
    #[error("the database refused the event")]
    Refused(#[source] Arc<sqlx::Error>),
    #[error("the database is unavailable")]
    Unavailable(#[source] Arc<sqlx::Error>),
    #[error("the database was unreachable moments ago; not trying again yet")]
    CircuitOpen,
    #[error("too many webhooks are waiting to be stored")]
    Overloaded,
    #[error("could not build the processing job")]
    Job(#[source] Arc<QueueError>),
    #[error("the event writer has stopped")]
    Stopped,
}

impl StoreError {
    /// Worth resending later (503); the others are a problem with this event (500).
    pub fn is_unavailable(&self) -> bool {
        !matches!(self, Self::Refused(_) | Self::Job(_))
    }
}

struct Pending {
    webhook: Webhook,
    job: NewJob,
    reply: oneshot::Sender<Result<Stored, StoreError>>,
}

/// The handle the receiver stores through. Cheap to clone.
#[derive(Clone)]
pub struct EventWriter {
    queue: mpsc::Sender<Pending>,
    reachable: Arc<AtomicBool>,
}

impl EventWriter {
    /// Starts the writer on the current runtime, with a connection of its own to `options`.
    /// Beyond `capacity` requests waiting for it, a request is refused at once.
    pub fn start(options: PgConnectOptions, notifier: Option<Notifier>, capacity: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Pending>(capacity.max(1));
        let reachable = Arc::new(AtomicBool::new(true));
        let writer = Writer {
            options,
            notifier,
            connection: None,
            failures: 0,
            paused_until: None,
            reachable: reachable.clone(),
        };
        tokio::spawn(writer.run(rx));
        Self {
            queue: tx,
            reachable,
        }
    }

    /// False once the writer task has ended: the process cannot store webhooks.
    pub fn is_alive(&self) -> bool {
        !self.queue.is_closed()
    }

    /// Whether the writer's last attempt reached the database.
    pub fn database_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Stores the event and enqueues its processing job in one statement: both commit or
    /// neither does. A repeat of a stored (gateway, event id), also one arriving at the same
    /// moment, writes nothing and is a duplicate; a repeat of an event not processed yet
    /// enqueues its processing again if no job is left for it (its job died).
    pub async fn store(&self, webhook: Webhook) -> Result<Stored, StoreError> {
        let job = ProcessPaymentEvent::job(
            webhook.gateway,
            &webhook.event_id,
            webhook.seller.as_deref(),
        )
        .map_err(|e| StoreError::Job(Arc::new(e)))?;
        let (reply, answer) = oneshot::channel();
        self.queue
            .try_send(Pending {
                webhook,
                job,
                reply,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => StoreError::Overloaded,
                mpsc::error::TrySendError::Closed(_) => StoreError::Stopped,
            })?;
        answer.await.map_err(|_| StoreError::Stopped)?
    }
}

struct Writer {
    options: PgConnectOptions,
    notifier: Option<Notifier>,
    connection: Option<PgConnection>,
    failures: u32,
    paused_until: Option<Instant>,
    reachable: Arc<AtomicBool>,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Pending>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            // Take whatever is waiting (at least one).
            if rx.recv_many(&mut batch, MAX_BATCH).await == 0 {
                return; // every EventWriter handle is gone
            }
            let written = AssertUnwindSafe(self.write_batch(&mut batch))
                .catch_unwind()
                .await;
            if written.is_err() {
                // The batch's senders see their reply dropped (503) and resend; nothing was
                // half-written (one statement). Start again on a fresh connection.
                tracing::error!(
                    events = batch.len(),
                    "the event writer panicked; its batch was refused and it goes on"
                );
                self.connection = None;
            }
            batch.clear();
        }
    }

    async fn write_batch(&mut self, batch: &mut Vec<Pending>) {
        if self.paused_until.is_some_and(|t| Instant::now() < t) {
            answer_all(batch, || StoreError::CircuitOpen);
            return;
        }
        let conn = match self.connection().await {
            Ok(c) => c,
            Err(e) => {
                self.outage(&e);
                let e = Arc::new(e);
                answer_all(batch, || StoreError::Unavailable(e.clone()));
                return;
            }
        };
        let written = match tokio::time::timeout(STATEMENT_TIMEOUT, write(conn, batch)).await {
            Ok(r) => r,
            Err(_) => Err(timed_out("the batch statement")),
        };
        match written {
            Ok(rows) => {
                self.healthy();
                self.answer(batch, rows);
            }
            Err(e) if crate::db::is_transient(&e) => {
                self.outage(&e);
                let e = Arc::new(e);
                answer_all(batch, || StoreError::Unavailable(e.clone()));
            }
            // The database refused an event of the batch for what it holds: write them one by
            // one, so only that one is refused.
            Err(e) if batch.len() > 1 && crate::db::is_about_the_row(&e) => {
                tracing::warn!(error = %e, events = batch.len(), "an event of the batch was refused; writing them one by one");
                self.one_by_one(batch).await;
            }
            Err(e) => {
                let e = Arc::new(e);
                answer_all(batch, || StoreError::Refused(e.clone()));
            }
        }
    }

    async fn one_by_one(&mut self, batch: &mut Vec<Pending>) {
        let mut outage: Option<Arc<sqlx::Error>> = None;
        for p in batch.drain(..) {
            if let Some(e) = &outage {
                let _ = p.reply.send(Err(StoreError::Unavailable(e.clone())));
                continue;
            }
            let one = std::slice::from_ref(&p);
            let written = match self.connection().await {
                Ok(conn) => match tokio::time::timeout(STATEMENT_TIMEOUT, write(conn, one)).await {
                    Ok(r) => r,
                    Err(_) => Err(timed_out("a single-event statement")),
                },
                Err(e) => Err(e),
            };
            match written {
                Ok(rows) => {
                    self.healthy();
                    self.answer(&mut vec![p], rows);
                }
                Err(e) if crate::db::is_transient(&e) => {
                    self.outage(&e);
                    let e = Arc::new(e);
                    let _ = p.reply.send(Err(StoreError::Unavailable(e.clone())));
                    outage = Some(e);
                }
                Err(e) => {
                    let _ = p.reply.send(Err(StoreError::Refused(Arc::new(e))));
                }
            }
        }
    }

    /// The writer's connection, opened if needed.
    async fn connection(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        if self.connection.is_none() {
            let c = tokio::time::timeout(CONNECT_TIMEOUT, self.options.connect())
                .await
                .map_err(|_| timed_out("connecting"))??;
            self.connection = Some(c);
        }
        self.connection
            .as_mut()
            .ok_or_else(|| timed_out("connecting"))
    }

    fn outage(&mut self, e: &sqlx::Error) {
        // Closing politely would wait on a dead peer; dropping the connection is enough.
        if crate::db::is_connection_lost(e) {
            self.connection = None;
        }
        self.failures += 1;
        let pause = FIRST_PAUSE
            .saturating_mul(1 << self.failures.min(8).saturating_sub(1))
            .min(MAX_PAUSE);
        self.paused_until = Some(Instant::now() + pause);
        if self.reachable.swap(false, Ordering::Relaxed) {
            tracing::warn!(error = %e, "webhooks cannot be stored: answering 503 until the database is back");
        }
    }

    fn healthy(&mut self) {
        self.failures = 0;
        self.paused_until = None;
        if !self.reachable.swap(true, Ordering::Relaxed) {
            tracing::info!("the database is back: storing webhooks again");
        }
    }

    /// Answers each request of a written batch and wakes the workers if jobs were written.
    fn answer(&self, batch: &mut Vec<Pending>, rows: Written) {
        let mut inserted = rows.inserted;
        for p in batch.drain(..) {
            // The first request for a new event is the one that stored it.
            let first = inserted.remove(&(p.webhook.gateway, p.webhook.event_id.clone()));
            let answer = match (first, &rows.redrive_failed) {
                (true, _) => Ok(Stored::Accepted),
                (false, None) => Ok(Stored::Duplicate),
                (false, Some(e)) => Err(StoreError::Unavailable(e.clone())),
            };
            let _ = p.reply.send(answer);
        }
        if rows.jobs
            && let Some(n) = &self.notifier
        {
            n.notify(<ProcessPaymentEvent as Job>::QUEUE);
        }
    }
}

fn answer_all(batch: &mut Vec<Pending>, error: impl Fn() -> StoreError) {
    for p in batch.drain(..) {
        let _ = p.reply.send(Err(error()));
    }
}

fn timed_out(what: &str) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} timed out"),
    ))
}

struct Written {
    /// The (gateway, event id) of the events inserted.
    inserted: HashSet<(GatewayName, String)>,
    /// Whether any processing job may have been written.
    jobs: bool,
    /// Re-driving the repeats failed (an outage): they are answered 503 so the gateway resends.
    redrive_failed: Option<Arc<sqlx::Error>>,
}

/// The events, and for each one inserted its processing job, in one statement.
static RECORD_EVENTS: LazyLock<String> = LazyLock::new(|| {
    [
        "WITH t AS (
                     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::timestamptz[],
                                          $6::int[], $7::text[], $8::text[], $9::text[], $10::text[],
                                          $11::bytea[], $12::jsonb[])
                         AS t(job_queue, job_kind, job_key, job_payload, job_run_at, job_max_attempts,
                              job_fairness_key, gateway, event_id, event_type, raw_body, headers)),
                 ev AS (
                     INSERT INTO payment_events (gateway, event_id, event_type, raw_body, headers)
                     SELECT gateway, event_id, event_type, raw_body, headers FROM t
                     ON CONFLICT (gateway, event_id) DO NOTHING
                     RETURNING gateway, event_id),
                 enqueued AS (",
        &payfleet_queue::insert_jobs_from("ev JOIN t USING (gateway, event_id)"),
        ")
                 SELECT gateway, event_id FROM ev",
    ]
    .concat()
});

/// Processing jobs for the repeated events not processed yet, in one statement.
static REDRIVE: LazyLock<String> = LazyLock::new(|| {
    [
        "WITH t AS (
                 SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::timestamptz[],
                                      $6::int[], $7::text[], $8::text[], $9::text[])
                     AS t(job_queue, job_kind, job_key, job_payload, job_run_at, job_max_attempts,
                          job_fairness_key, gateway, event_id)),
             enqueued AS (",
        &payfleet_queue::insert_jobs_from("(SELECT t.* FROM t WHERE EXISTS (
                     SELECT 1 FROM payment_events p
                     WHERE p.gateway = t.gateway AND p.event_id = t.event_id AND p.processed_at IS NULL)) AS src"),
        " RETURNING id)
             SELECT count(*) FROM enqueued",
    ]
    .concat()
});

/// Writes the events of `batch` that are new, each with its job, in one statement. Repeats are
/// rare (a gateway resending after a timeout): for those only, a second statement enqueues the
/// processing again of the ones not processed yet, unless a job is still unfinished for them.
async fn write(conn: &mut PgConnection, batch: &[Pending]) -> Result<Written, sqlx::Error> {
    let mut jobs = JobColumns::default();
    let mut gateways = Vec::with_capacity(batch.len());
    let mut ids = Vec::with_capacity(batch.len());
    let mut types = Vec::with_capacity(batch.len());
    let mut bodies = Vec::with_capacity(batch.len());
    let mut headers = Vec::with_capacity(batch.len());
    for p in batch {
        jobs.push(&p.job)
            .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        gateways.push(p.webhook.gateway);
        ids.push(p.webhook.event_id.as_str());
        types.push(p.webhook.event_type.as_deref());
        bodies.push(p.webhook.body.as_ref());
        headers.push(&p.webhook.headers);
    }
    let rows: Vec<(GatewayName, String)> = jobs
        .bind(sqlx::query_as(RECORD_EVENTS.as_str()))
        .bind(&gateways)
        .bind(&ids)
        .bind(&types)
        .bind(&bodies)
        .bind(&headers)
        .fetch_all(&mut *conn)
        .await?;
    let inserted: HashSet<(GatewayName, String)> = rows.into_iter().collect();
    let repeats: Vec<&Pending> = batch
        .iter()
        .filter(|p| !inserted.contains(&(p.webhook.gateway, p.webhook.event_id.clone())))
        .collect();
    let mut written = Written {
        jobs: !inserted.is_empty(),
        inserted,
        redrive_failed: None,
    };
    if !repeats.is_empty() {
        match redrive(conn, &repeats).await {
            Ok(n) => written.jobs |= n > 0,
            Err(e) => {
                tracing::warn!(error = %e, repeats = repeats.len(), "could not re-drive repeated events");
                written.redrive_failed = Some(Arc::new(e));
            }
        }
    }
    Ok(written)
}

/// Enqueues the processing of the repeated events that are not processed, unless a job is
/// still unfinished for them (its key is taken). Returns how many jobs were written.
async fn redrive(conn: &mut PgConnection, repeats: &[&Pending]) -> Result<u64, sqlx::Error> {
    let mut jobs = JobColumns::default();
    let mut gateways = Vec::with_capacity(repeats.len());
    let mut ids = Vec::with_capacity(repeats.len());
    for p in repeats {
        jobs.push(&p.job)
            .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        gateways.push(p.webhook.gateway);
        ids.push(p.webhook.event_id.as_str());
    }
    let (written,): (i64,) = jobs
        .bind(sqlx::query_as(REDRIVE.as_str()))
        .bind(&gateways)
        .bind(&ids)
        .fetch_one(conn)
        .await?;
    if written > 0 {
        tracing::info!(
            jobs = written,
            "repeated deliveries of unprocessed events enqueued them again"
        );
    }
    Ok(written as u64)
}
