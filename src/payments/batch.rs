//! Payment events processed many to a transaction.
//!
//! Nearly every event is the first success of a checkout's session, with its amount: it records
//! the payment, confirms its order, writes the order's `paid` message and posts the sale. Done
//! one event per transaction, that is some twenty statements and a commit each, and a flash
//! sale's payments then wait on each other for the seller's accounts. Here the events that the
//! jobs of one worker hand in meanwhile are taken together: one transaction and a fixed number of
//! statements for the lot, each statement doing the same step for every event (the rows of
//! `unnest`ed arrays), the sellers' accounts taken last and held only for the posting and the
//! commit.
//!
//! Only that plain case is done here, and only when every condition for it holds under the same
//! locks the one-event path takes (the event unprocessed, the payment's keys, the order's row):
//! a webhook whose one fact is a success with its amount, of a session no payment is known for,
//! whose order waits for its money, was never paid, has no coins paid or set aside, and costs
//! exactly that amount. Anything else (a duplicate, a refund, a late or second payment, a wrong
//! amount, an event the batch could not process) goes back to its job, which processes it alone
//! through [`Processor::process`]: the one path that knows every case. Both end in the same rows;
//! `tests/api/processing.rs` compares them.
//!
//! The jobs keep their own leases, timeouts and retries: a job hands its event to the batcher and
//! waits for the answer; if the batch fails (an outage, a deadlock, a refusal), every job of it
//! processes its event alone, which retries an outage as any job does.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::apply::{
    Waiting, enqueue_woken, key_name, keys_of, lock_key_names, waiting_for_keys_sql, waiting_keys,
};
use super::{EventOutcome, ProcessError, Processed, Processor};
use crate::db::Kept;
use crate::gateways::{self, Fact, GatewayName, Interpretation, PaymentStatus};
use crate::ledger::sales::Channel;
use crate::money::Money;
use crate::orders::{self, Confirmation};
use crate::payment_status::{Facts, derive_status};
use payfleet_queue::{Census, Job, JobContext, JobError, JobId, RunClaim, Worker};

use super::ProcessPaymentEvent;

/// How the batcher of one worker process works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// Most events in the batches in flight together: each of `n` batches in flight takes at
    /// most an `n`th ([`BatchSettings::per_batch`]).
    pub events_in_batches: usize,
    /// Batch transactions in flight at once (each holds one database connection) while this
    /// worker process is the only one working the events queue, or before it has counted the
    /// others.
    pub in_flight: usize,
    /// Batch transactions in flight at once while other worker processes work the events queue
    /// too (their batches post to the same accounts), as the fleet's census counts them.
    pub in_flight_in_fleet: usize,
    /// Events processed alone at once (each holds one database connection while it runs).
    pub alone: usize,
    /// How long an event waits for a turn to be processed alone before its job gives its slot
    /// back ([`Handled::Busy`]): a worker holds many more events than it processes alone at
    /// once, and the wait must not eat the job's timeout or its attempts.
    pub alone_wait: Duration,
    /// The longest a batch may take (a drained one of 256 events takes a few tens of
    /// milliseconds): one that never returns (a lock waited on, a connection half-open after a
    /// failover) would hold its turn, and every event behind it, for ever. Past it, the batch's
    /// connection is closed and each of its events is processed alone, as after any failed
    /// batch.
    pub deadline: Duration,
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self {
            events_in_batches: 256,
            in_flight: 2,
            in_flight_in_fleet: 1,
            alone: 16,
            alone_wait: Duration::from_secs(10),
            deadline: Duration::from_secs(30),
        }
    }
}

impl BatchSettings {
    /// The settings of a worker process: `in_flight` as set (`PAYFLEET_EVENT_BATCHES`) whatever
    /// the fleet, else two in a lone worker and one in each of a fleet's. The batches of every
    /// worker post to the same sellers' accounts one after the other: two in a lone process let
    /// one read and write while the other posts and commits; in a fleet the other processes'
    /// batches do that, and a second batch per process only waits on the others' postings with
    /// its events held (docs/benchmarks.md, "Batches in flight across the fleet").
    pub fn for_process(set: Option<usize>) -> Self {
        let default = Self::default();
        match set {
            Some(n) => Self {
                in_flight: n,
                in_flight_in_fleet: n,
                ..default
            },
            None => default,
        }
    }

    /// Most events in one batch while `in_flight` batches may be in flight: their share of
    /// [`BatchSettings::events_in_batches`]. A worker's events queue takes in 512 events at once
    /// (`jobs/queues.toml`), twice what its batches take together, so whatever the number of
    /// batches in flight a batch's worth of events waits for each as it commits: a lone worker
    /// runs two batches of up to 128, a fleet's worker one of up to 256 (README, "A batch as
    /// large as the worker's share").
    fn per_batch(&self, in_flight: usize) -> usize {
        (self.events_in_batches / in_flight.max(1)).max(1)
    }

    /// Batches in flight for a count of the events queue's worker processes (`None`: not
    /// counted yet, or no census kept).
    fn in_flight_for(&self, workers: Option<usize>) -> usize {
        match workers {
            Some(n) if n >= 2 => self.in_flight_in_fleet,
            _ => self.in_flight,
        }
        .max(1)
    }
}

/// `PAYFLEET_EVENT_BATCHES`: batch transactions of payment events one worker process runs at
/// once (1 to 8; unset: two, [`BatchSettings::for_process`]).
pub fn in_flight_from_env(env: &dyn crate::env::Env) -> Result<Option<usize>, crate::env::Invalid> {
    const NAME: &str = "PAYFLEET_EVENT_BATCHES";
    if crate::env::var(env, NAME).is_none() {
        return Ok(None);
    }
    let n = crate::env::parsed(env, NAME, 0usize)?;
    if !(1..=8).contains(&n) {
        return Err(crate::env::invalid(NAME, "must be 1 to 8"));
    }
    Ok(Some(n))
}

/// What became of an event handed to the batcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    Processed(Processed),
    /// Not a batch's, and every turn to process it alone stayed taken for
    /// [`BatchSettings::alone_wait`]: its job comes back later, without spending an attempt,
    /// when this worker or another has a turn free.
    Busy,
}

/// Hands events to the batch transactions; cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    queue: mpsc::Sender<Request>,
    alone: Arc<Semaphore>,
    alone_wait: Duration,
    processor: Arc<Processor>,
}

struct Request {
    gateway: GatewayName,
    event_id: String,
    /// The trace the event's processing continues, for the order message it writes.
    traceparent: Option<String>,
    /// The job's run, when a job hands the event in: its row is completed in the batch's
    /// transaction, with the event's effect.
    run: Option<RunClaim>,
    reply: oneshot::Sender<Option<Processed>>,
}

impl Batcher {
    /// Starts the batcher's task on the current runtime; it ends when every handle is dropped.
    /// With a `census` (the fleet's, kept by this process's [`payfleet_queue::Fleet`]), the
    /// batches in flight follow the number of worker processes on the events queue
    /// ([`BatchSettings::in_flight_in_fleet`]); without one, they stay at `in_flight`.
    pub fn start(
        pool: PgPool,
        processor: Arc<Processor>,
        settings: BatchSettings,
        census: Option<&Census>,
    ) -> Self {
        let (queue, requests) = mpsc::channel(settings.events_in_batches.max(1) * 4);
        let workers = census.and_then(|c| c.workers_on(ProcessPaymentEvent::QUEUE));
        let now = settings.in_flight_for(workers);
        let gate = Arc::new(Semaphore::new(now));
        let in_flight = Arc::new(AtomicUsize::new(now));
        if let Some(census) = census
            && settings.in_flight != settings.in_flight_in_fleet
        {
            tokio::spawn(follow_census(
                gate.clone(),
                in_flight.clone(),
                census.subscribe(),
                settings,
            ));
        }
        tokio::spawn(batch_loop(
            pool,
            processor.clone(),
            requests,
            queue.downgrade(),
            settings,
            Turns { gate, in_flight },
        ));
        Self {
            queue,
            alone: Arc::new(Semaphore::new(settings.alone.max(1))),
            alone_wait: settings.alone_wait,
            processor,
        }
    }

    /// Processes one stored event: in a batch when it is the plain case, else alone. Safe to run
    /// any number of times, as [`Processor::process`] is.
    pub async fn process(
        &self,
        pool: &PgPool,
        gateway: GatewayName,
        event_id: &str,
    ) -> Result<Handled, ProcessError> {
        self.process_run(pool, gateway, event_id, None).await
    }

    /// [`Batcher::process`] for a job's `run`: a batch that applies the event completes the
    /// job in the same transaction (no statement nor commit of the fleet's for its end).
    async fn process_run(
        &self,
        pool: &PgPool,
        gateway: GatewayName,
        event_id: &str,
        run: Option<RunClaim>,
    ) -> Result<Handled, ProcessError> {
        let (reply, answer) = oneshot::channel();
        let request = Request {
            gateway,
            event_id: event_id.to_owned(),
            traceparent: crate::traces::traceparent(),
            run,
            reply,
        };
        if self.queue.send(request).await.is_ok()
            && let Ok(Some(done)) = answer.await
        {
            return Ok(Handled::Processed(done));
        }
        let Ok(Ok(_turn)) = tokio::time::timeout(self.alone_wait, self.alone.acquire()).await
        else {
            return Ok(Handled::Busy);
        };
        Ok(Handled::Processed(
            self.processor.process(pool, gateway, event_id).await?,
        ))
    }
}

/// The batcher runs the event-processing jobs.
impl Worker<ProcessPaymentEvent> for Batcher {
    async fn work(&self, ctx: JobContext, job: ProcessPaymentEvent) -> Result<(), JobError> {
        // In the trace of the request that stored the event, whichever process runs the job.
        let span = crate::traces::hop_span(
            || tracing::info_span!("payment_event", gateway = %job.gateway, event = %job.event_id),
        );
        crate::traces::continue_trace(&span, job.traceparent.as_deref());
        let handled = tracing::Instrument::instrument(
            self.process_run(&ctx.pool, job.gateway, &job.event_id, Some(ctx.run())),
            span,
        )
        .await?;
        match handled {
            Handled::Processed(result) => {
                tracing::debug!(gateway = %job.gateway, event = %job.event_id, ?result, "payment event processed");
                Ok(())
            }
            // Back in the queue for a worker with a turn free, no attempt spent.
            Handled::Busy => Err(JobError::Snooze(Duration::from_secs(1))),
        }
    }
}

/// Takes what the jobs handed in since the last batch started (at most `max`) as soon as a
/// batch transaction may start: under load the batches grow by themselves, and a lone event
/// waits for nothing.
///
/// While events keep coming, each batch runs on a connection a batch used before ([`Kept`]:
/// at most one per batch in flight, kept only while more events wait), not on the pool's next
/// one: the pool hands its idle connections out in turn, and a worker started on a backlog ran
/// its first 25 batches on 16 backends, each paying for its first statements (the catalogue
/// read, the statements parsed and planned, PostgreSQL's shared memory mapped page by page)
/// what a backend that ran them before does not.
async fn batch_loop(
    pool: PgPool,
    processor: Arc<Processor>,
    mut requests: mpsc::Receiver<Request>,
    waiting: mpsc::WeakSender<Request>,
    settings: BatchSettings,
    turns: Turns,
) {
    // Closed on the way out: the census follower ends with the loop.
    struct Closing(Arc<Semaphore>);
    impl Drop for Closing {
        fn drop(&mut self) {
            self.0.close();
        }
    }
    let _closing = Closing(turns.gate.clone());
    let kept = Kept::default();
    loop {
        let Ok(permit) = turns.gate.clone().acquire_owned().await else {
            return;
        };
        let max = settings.per_batch(turns.in_flight.load(Ordering::Relaxed));
        let mut batch = Vec::with_capacity(max);
        // `recv_many` is cancel safe: nothing is lost when the wait times out.
        let received =
            match tokio::time::timeout(KEPT_IDLE, requests.recv_many(&mut batch, max)).await {
                Ok(n) => n,
                Err(_) => {
                    // No events: what a batch kept as the last ones came in goes back too.
                    kept.release();
                    requests.recv_many(&mut batch, max).await
                }
            };
        if received == 0 {
            return;
        }
        // The jobs of one claim hand their events in one after the other: let those already
        // started hand theirs in before the batch closes (a worker's first batch was one event).
        tokio::task::yield_now().await;
        let room = max - batch.len();
        if room > 0 && !requests.is_empty() {
            requests.recv_many(&mut batch, room).await;
        }
        let (pool, processor, kept, waiting) = (
            pool.clone(),
            processor.clone(),
            kept.clone(),
            waiting.clone(),
        );
        // A panic in the batch drops its replies: each job then processes its event alone.
        tokio::spawn(async move {
            let events: Vec<(GatewayName, &str)> = batch
                .iter()
                .map(|r| (r.gateway, r.event_id.as_str()))
                .collect();
            let traces: Vec<Option<String>> = batch.iter().map(|r| r.traceparent.clone()).collect();
            let runs: Vec<Option<RunClaim>> = batch.iter().map(|r| r.run.clone()).collect();
            let outcome = match kept.take(&pool).await {
                Ok(mut conn) => {
                    let outcome = match tokio::time::timeout(
                        settings.deadline,
                        process_batch(
                            &mut conn,
                            processor.internal_acquirer,
                            &events,
                            &traces,
                            &runs,
                            Some(&processor.telemetry),
                        ),
                    )
                    .await
                    {
                        Ok(outcome) => outcome,
                        Err(_) => {
                            // Whatever it waits on, the connection is closed, not pooled:
                            // the server ends the transaction when it notices.
                            conn.close_on_drop();
                            Err(sqlx::Error::Io(std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                format!("the batch did not finish within {:?}", settings.deadline),
                            ))
                            .into())
                        }
                    };
                    // Kept for the next batch only while events wait for one: an idle
                    // batcher holds no connection another part of the process may need. A
                    // connection that failed its batch goes back to the pool, which checks
                    // it before handing it out again.
                    if outcome.is_ok() && events_waiting(&waiting) {
                        kept.put(conn);
                    }
                    outcome
                }
                Err(e) => Err(e.into()),
            };
            let done = match outcome {
                Ok(done) => done,
                Err(e) => {
                    tracing::warn!(events = events.len(), error = %payfleet_queue::error_chain(&e), "a batch of payment events failed; each is processed alone");
                    vec![false; events.len()]
                }
            };
            for (request, applied) in batch.into_iter().zip(done) {
                let _ = request.reply.send(applied.then_some(Processed::Applied));
            }
            drop(permit);
        });
    }
}

/// The batch loop's turns: a permit of `gate` per batch in flight, and how many batches may be
/// in flight now (what a batch's size is a share of).
struct Turns {
    gate: Arc<Semaphore>,
    in_flight: Arc<AtomicUsize>,
}

/// Keeps the permits of `gate` (the batches in flight, `in_flight` of them at the start, kept
/// up to date there) at what the census asks for the number of worker processes on the events
/// queue. A permit taken away waits for a batch in flight to end (the gate is fair: before the
/// batch loop's next one). Ends when the census or the batch loop (which closes the gate) is
/// gone.
async fn follow_census(
    gate: Arc<Semaphore>,
    in_flight: Arc<AtomicUsize>,
    mut counts: tokio::sync::watch::Receiver<Option<Arc<payfleet_queue::census::Counts>>>,
    settings: BatchSettings,
) {
    let mut now = in_flight.load(Ordering::Relaxed);
    loop {
        let workers = counts.borrow_and_update().as_ref().map(|c| {
            c.get(ProcessPaymentEvent::QUEUE)
                .copied()
                .unwrap_or_default()
        });
        let want = settings.in_flight_for(workers);
        if want > now {
            gate.add_permits(want - now);
        } else if want < now {
            let Ok(taken) = gate
                .acquire_many(u32::try_from(now - want).unwrap_or(u32::MAX))
                .await
            else {
                return;
            };
            taken.forget();
        }
        if want != now {
            tracing::info!(batches_in_flight = want, workers = ?workers, events_a_batch = settings.per_batch(want), "payment-event batches in flight follow the fleet's census");
            now = want;
            in_flight.store(now, Ordering::Relaxed);
        }
        if gate.is_closed() || counts.changed().await.is_err() {
            return;
        }
    }
}

/// How soon a batcher without events gives back a connection a batch kept as the last events
/// came in (the batch saw events waiting; they went in another batch).
const KEPT_IDLE: Duration = Duration::from_millis(500);

/// Whether events wait in the batcher's queue.
fn events_waiting(queue: &mpsc::WeakSender<Request>) -> bool {
    queue
        .upgrade()
        .is_some_and(|q| q.capacity() < q.max_capacity())
}

/// A webhook the batch can apply: the first success of a session, with its amount.
struct Candidate {
    /// Its place in the batch.
    at: usize,
    event: i64,
    gateway: GatewayName,
    session_id: String,
    payment_id: Option<String>,
    paid: Money,
    /// Its order's number and its session's link, found under the locks.
    order: Option<(i64, String)>,
}

/// A batch's transaction, its statements planned once per connection rather than for each
/// batch's values. PostgreSQL plans a prepared statement for its parameters' values five times
/// on each connection before it considers the generic plan, and a worker started on a backlog
/// runs its first batches on new connections: in a deployed `payfleet bench e2e` paced phase
/// nearly every statement of every batch was planned again, about 2.6 ms of planning a batch
/// beside the posting's own. Each statement reaches its rows through a key whatever the sizes
/// of its arrays (they are written so: see each), and the only constant a partial index needs
/// (`outcome = 'waiting'`) is written into its statement, so the generic plan is the plan every
/// batch would get. Sequential scans are off for the same reason: a plan made once is kept for
/// the connection's life, and one made while a table was small (a fleet started on a new
/// database) scanned it whole, which costs less than an index probe per row there and more with
/// every row the table gains: the jobs' completion read every job of the table in each batch
/// (`payments::batch::tests::a_batch_planned_on_small_tables_reads_its_rows_by_key`). `SET LOCAL`
/// ends with the transaction: the connection goes back to the pool as it was, and a pooler in
/// transaction mode sees nothing left on the session. Compiling is off with sequential scans, as
/// in `db::BEGIN_BY_KEYS` (which says why).
const BEGIN_PLANNED_ONCE: &str = "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan; \
     SET LOCAL enable_seqscan = off; SET LOCAL jit = off";

/// Processes the plain cases among `events` in one transaction. Returns, for each event, whether
/// it was applied here; the others are left exactly as they were, for [`Processor::process`].
/// `internal_acquirer`: as [`Processor::internal_acquirer`].
/// `traces`: the trace each event's processing continues, by its place (none when shorter).
/// `runs`: the job run that handed each event in, by its place (none when shorter): an applied
/// event's job is completed in the batch's transaction, and its run told so once it commits.
/// `telemetry`, if given, observes each applied event's time from its receipt.
pub async fn process_batch(
    conn: &mut PgConnection,
    internal_acquirer: Option<GatewayName>,
    events: &[(GatewayName, &str)],
    traces: &[Option<String>],
    runs: &[Option<RunClaim>],
    telemetry: Option<&crate::telemetry::Telemetry>,
) -> Result<Vec<bool>, ProcessError> {
    let mut done = vec![false; events.len()];
    // Every statement of the batch on its plan made once per connection (README, "A batch's
    // plans made once"), set in the same round trip as the BEGIN and for this transaction only.
    let mut tx = sqlx::Connection::begin_with(conn, BEGIN_PLANNED_ONCE).await?;
    let mut candidates = read_candidates(&mut tx, internal_acquirer, events).await?;
    if candidates.is_empty() {
        return Ok(done);
    }
    // The one-event path's locks, in its order: the events' rows (above), the payments' keys,
    // then the orders' rows.
    let names = candidates
        .iter()
        .flat_map(|c| {
            let payment = gateways::PaymentRef {
                session_id: Some(c.session_id.clone()),
                payment_id: c.payment_id.clone(),
            };
            keys_of(&payment)
                .into_iter()
                .map(|k| key_name(c.gateway, &k))
                .collect::<Vec<_>>()
        })
        .collect();
    lock_key_names(&mut tx, names).await?;
    find_sessions(&mut tx, &mut candidates).await?;
    let wanted: Vec<(i64, GatewayName)> = candidates
        .iter()
        .filter_map(|c| c.order.as_ref().map(|(n, _)| (*n, c.gateway)))
        .collect();
    let payable: HashMap<(i64, GatewayName), orders::Payable> =
        orders::lock_plainly_payable(&mut tx, &wanted)
            .await?
            .into_iter()
            .map(|o| ((o.number, o.gateway), o))
            .collect();
    // Two sessions of one order (an earlier attempt paid late beside the current one): the
    // first confirms it, the other is a second payment, for the one-event path.
    let mut confirming = HashSet::new();
    candidates.retain(|c| {
        c.order.as_ref().is_some_and(|(n, _)| {
            payable
                .get(&(*n, c.gateway))
                .is_some_and(|o| o.costs(&c.paid))
                && confirming.insert(*n)
        })
    });
    if candidates.is_empty() {
        return Ok(done);
    }

    let confirmations: Vec<Confirmation<'_>> = candidates
        .iter()
        .filter_map(|c| {
            let (number, url) = c.order.as_ref()?;
            Some(Confirmation {
                order: payable.get(&(*number, c.gateway))?,
                session_id: &c.session_id,
                url,
                traceparent: traces.get(c.at).and_then(Option::as_deref),
            })
        })
        .collect();
    orders::confirm_paid(&mut tx, &confirmations).await?;
    // Whatever waited for these payments (a refund that overtook its payment) looks again.
    let mut keys = Vec::with_capacity(2 * candidates.len());
    for c in &candidates {
        keys.push((c.gateway, format!("session:{}", c.session_id)));
        if let Some(p) = &c.payment_id {
            keys.push((c.gateway, format!("payment:{p}")));
        }
    }
    let keys: Vec<(GatewayName, &str)> = keys.iter().map(|(g, k)| (*g, k.as_str())).collect();
    let runs_applied: Vec<&RunClaim> = candidates
        .iter()
        .filter_map(|c| runs.get(c.at)?.as_ref())
        .collect();
    let Applied {
        received,
        jobs,
        waiting,
    } = record_applied(&mut tx, &candidates, &runs_applied, &keys).await?;
    enqueue_woken(&mut tx, &waiting).await?;
    // Last: the sellers' turns and accounts, held only for the posting and the commit.
    let sales: Vec<(i64, Channel)> = candidates
        .iter()
        .filter_map(|c| Some((c.order.as_ref()?.0, Channel::Gateway(c.gateway))))
        .collect();
    crate::ledger::poster::post_confirmed(&mut tx, &sales).await?;
    tx.commit().await?;
    for c in &candidates {
        done[c.at] = true;
    }
    for run in runs_applied {
        if jobs.contains(&run.id()) {
            run.completed();
        }
    }
    if let Some(t) = telemetry {
        let now = chrono::Utc::now();
        for (id, at) in &received {
            if let Some(c) = candidates.iter().find(|c| c.event == *id) {
                t.event_processed(c.gateway, (now - *at).to_std().unwrap_or_default());
            }
        }
    }
    tracing::debug!(
        events = events.len(),
        applied = candidates.len(),
        "payment events applied in a batch"
    );
    Ok(done)
}

/// The batch's events, by gateway and event id: each with whether it is still unprocessed.
const READ_EVENTS: &str = "SELECT e.id, e.gateway, e.event_id, e.raw_body, e.source, e.processed_at IS NULL
     FROM payment_events e
     WHERE e.id = ANY(ARRAY(
               SELECT (SELECT x.id FROM payment_events x WHERE x.gateway = k.gateway AND x.event_id = k.event_id)
               FROM unnest($1::text[], $2::text[]) AS k(gateway, event_id)))
     ORDER BY e.id FOR UPDATE";

/// Locks the events among `events` (in id order, as the one-event path locks its one) and
/// keeps the unprocessed plain cases: webhooks (not reconciliation's answers) whose one fact is
/// a success with its amount, each session and payment once in the batch.
async fn read_candidates(
    tx: &mut PgConnection,
    internal_acquirer: Option<GatewayName>,
    events: &[(GatewayName, &str)],
) -> Result<Vec<Candidate>, sqlx::Error> {
    let (gateways, ids): (Vec<GatewayName>, Vec<&str>) = events.iter().copied().unzip();
    let rows: Vec<(i64, GatewayName, String, Vec<u8>, String, bool)> = sqlx::query_as(
        // Each event found by its key, then all locked in id order, through the primary key
        // alone. Whether it is still unprocessed is read from the row as locked (its latest
        // version) and kept out here, not asked in the WHERE: there, the planner may read the
        // whole partial index of unprocessed events instead (as `record_applied` found), which
        // during a backlog holds every event of it, and the plan is made once per connection.
        READ_EVENTS,
    )
    .bind(&gateways)
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await?;
    let at: HashMap<(GatewayName, &str), usize> = events
        .iter()
        .enumerate()
        .map(|(i, (g, id))| ((*g, *id), i))
        .collect();
    let mut seen = HashSet::new();
    let mut candidates = Vec::with_capacity(rows.len());
    for (event, gateway, event_id, body, source, unprocessed) in rows {
        if !unprocessed {
            continue;
        }
        // An acquirer's event may be about the internal gateway's payment: whose it is, the
        // one-event path decides.
        if source != "webhook" || Some(gateway) == internal_acquirer {
            continue;
        }
        let Some(&place) = at.get(&(gateway, event_id.as_str())) else {
            continue;
        };
        let Ok(Interpretation::Update { payment, facts }) = gateways::interpret(gateway, &body)
        else {
            continue;
        };
        let (
            Some(session_id),
            [
                Fact::Payment {
                    status: PaymentStatus::Succeeded,
                    amount: Some(paid),
                },
            ],
        ) = (payment.session_id, facts.as_slice())
        else {
            continue;
        };
        let fresh = seen.insert((gateway, format!("session:{session_id}")))
            & payment
                .payment_id
                .as_ref()
                .is_none_or(|p| seen.insert((gateway, format!("payment:{p}"))));
        if !fresh {
            continue;
        }
        candidates.push(Candidate {
            at: place,
            event,
            gateway,
            session_id,
            payment_id: payment.payment_id,
            paid: *paid,
            order: None,
        });
    }
    Ok(candidates)
}

/// Each candidate's order and payment link, from its session; a candidate whose session or
/// payment id is known to a payment already (a duplicate, a second payment) keeps none.
async fn find_sessions(
    tx: &mut PgConnection,
    candidates: &mut [Candidate],
) -> Result<(), sqlx::Error> {
    let gateways: Vec<GatewayName> = candidates.iter().map(|c| c.gateway).collect();
    let sessions: Vec<&str> = candidates.iter().map(|c| c.session_id.as_str()).collect();
    let payments: Vec<Option<&str>> = candidates.iter().map(|c| c.payment_id.as_deref()).collect();
    let found: Vec<(i64, i64, String)> = sqlx::query_as(
        // Each looked up through its keys' indexes: scalar subqueries and a LIMIT keep the
        // planner from turning the lookups into joins that read every session or payment.
        "SELECT i, order_number, url FROM (
             SELECT k.i::int8 AS i, ps.order_number, ps.url,
                    (SELECT po.id FROM payment_orders po
                     WHERE po.gateway = k.gateway AND po.session_id = k.session_id LIMIT 1) AS by_session,
                    (SELECT po.id FROM payment_orders po
                     WHERE po.gateway = k.gateway AND po.payment_id = k.payment_id LIMIT 1) AS by_payment
             FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS k(gateway, session_id, payment_id, i)
             CROSS JOIN LATERAL (SELECT order_number, url FROM payment_sessions ps
                                 WHERE ps.gateway = k.gateway AND ps.session_id = k.session_id LIMIT 1) ps
         ) t
         WHERE by_session IS NULL AND by_payment IS NULL",
    )
    .bind(&gateways)
    .bind(&sessions)
    .bind(&payments)
    .fetch_all(&mut *tx)
    .await?;
    for (i, number, url) in found {
        if let Some(c) = usize::try_from(i - 1)
            .ok()
            .and_then(|i| candidates.get_mut(i))
        {
            c.order = Some((number, url));
        }
    }
    Ok(())
}

/// What [`record_applied`] wrote and found: each event's id and time of receipt, the jobs
/// completed, and the events that waited for these payments.
struct Applied {
    received: Vec<(i64, chrono::DateTime<chrono::Utc>)>,
    jobs: HashSet<JobId>,
    waiting: Vec<Waiting>,
}

/// The payments, known from now on as succeeded with their amounts (as the one-event path
/// leaves a first success: its status derived from that one fact), their events applied, and
/// the jobs that handed them in completed (`runs`), in one statement (a round trip fewer in the
/// window the batch's locks are held), which also reads the events that waited for one of the
/// payments' `keys` (a refund that overtook its payment), for the caller to wake.
///
/// A job completed here has its end written by this commit: in a paced phase of `payfleet bench
/// e2e` the fleet's own ends of these jobs, a statement and a commit on its bookkeeping
/// connection for every batch, took about a tenth of the machine's CPU.
async fn record_applied(
    tx: &mut PgConnection,
    candidates: &[Candidate],
    runs: &[&RunClaim],
    keys: &[(GatewayName, &str)],
) -> Result<Applied, sqlx::Error> {
    let status = derive_status(&Facts {
        succeeded: true,
        ..Facts::default()
    });
    let mut events = Vec::with_capacity(candidates.len());
    let mut gateways = Vec::with_capacity(candidates.len());
    let mut sessions = Vec::with_capacity(candidates.len());
    let mut payments = Vec::with_capacity(candidates.len());
    let mut amounts = Vec::with_capacity(candidates.len());
    let mut currencies = Vec::with_capacity(candidates.len());
    for c in candidates {
        events.push(c.event);
        gateways.push(c.gateway);
        sessions.push(c.session_id.as_str());
        payments.push(c.payment_id.as_deref());
        amounts.push(c.paid.amount());
        currencies.push(c.paid.currency().to_string());
    }
    let (job_ids, tokens): (Vec<i64>, Vec<i64>) =
        runs.iter().map(|r| (r.id().0, r.lease_token())).unzip();
    let (sources, names) = waiting_keys(keys);
    let rows: Vec<AppliedRow> = sqlx::query_as(RECORD_APPLIED.as_str())
        .bind(&gateways)
        .bind(&sessions)
        .bind(&payments)
        .bind(&amounts)
        .bind(&currencies)
        .bind(status)
        .bind(&events)
        .bind(EventOutcome::Applied)
        .bind(&job_ids)
        .bind(&tokens)
        .bind(&sources)
        .bind(&names)
        .fetch_all(&mut *tx)
        .await?;
    let mut applied = Applied {
        received: Vec::with_capacity(rows.len()),
        jobs: HashSet::with_capacity(runs.len()),
        waiting: Vec::new(),
    };
    for row in rows {
        match row {
            AppliedRow {
                id: Some(id),
                received_at: Some(at),
                ..
            } => applied.received.push((id, at)),
            AppliedRow {
                id: Some(id),
                received_at: None,
                ..
            } => {
                applied.jobs.insert(JobId(id));
            }
            AppliedRow {
                gateway: Some(gateway),
                event_id: Some(event_id),
                raw_body: Some(body),
                ..
            } => applied.waiting.push((gateway, event_id, body)),
            _ => {}
        }
    }
    Ok(applied)
}

/// A row of [`RECORD_APPLIED`]: an event applied (its id and time of receipt), a job completed
/// (its id alone), or an event waiting for one of the payments (its gateway, id and body).
#[derive(sqlx::FromRow)]
struct AppliedRow {
    id: Option<i64>,
    received_at: Option<chrono::DateTime<chrono::Utc>>,
    gateway: Option<GatewayName>,
    event_id: Option<String>,
    raw_body: Option<Vec<u8>>,
}

/// [`record_applied`]'s statement: the events (with their time of receipt), the jobs completed
/// (without one), then the events waiting for these payments (read from the statement's
/// snapshot, where the events applied here are not processed yet, and left out by id anyway).
static RECORD_APPLIED: LazyLock<String> = LazyLock::new(|| {
    // The events, locked unprocessed since `read_candidates`, by their ids alone: asked also
    // for `processed_at IS NULL`, the plan read the whole partial index of unprocessed events,
    // which keeps every processed one until a vacuum. The payments' insert and the jobs'
    // completion run whether or not the query reads them (PostgreSQL runs every
    // data-modifying WITH).
    format!(
        "WITH paid AS (
             INSERT INTO payment_orders (gateway, session_id, payment_id, status, amount, currency, succeeded_at)
             SELECT g, s, p, $6, a, c, now()
             FROM unnest($1::text[], $2::text[], $3::text[], $4::numeric[], $5::text[]) AS x(g, s, p, a, c)),
         completed AS ({}),
         applied AS (
             UPDATE payment_events SET outcome = $8, outcome_detail = NULL, waiting_for = NULL, processed_at = now()
             WHERE id = ANY(ARRAY(SELECT unnest($7::bigint[]))) RETURNING id, received_at)
         SELECT id, received_at, NULL::text AS gateway, NULL::text AS event_id, NULL::bytea AS raw_body
           FROM applied
         UNION ALL SELECT id, NULL, NULL, NULL, NULL FROM completed
         UNION ALL SELECT NULL, NULL, w.gateway, w.event_id, w.raw_body FROM ({}) w",
        payfleet_queue::complete_runs_from("unnest($9::bigint[], $10::bigint[])"),
        waiting_for_keys_sql("$11", "$12", "$7")
    )
});

#[cfg(test)]
mod tests {
    use super::*;

    fn on_events(workers: usize) -> payfleet_queue::census::Counts {
        [(ProcessPaymentEvent::QUEUE.to_owned(), workers)].into()
    }

    /// The batch's read of its events goes through the primary key even where the statistics
    /// say there are no unprocessed events (as after a quiet spell, before a backlog arrives):
    /// the plan is made once per connection, and a plan through the partial index of
    /// unprocessed events would read every event of a backlog at every batch.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn reading_a_batchs_events_goes_by_their_keys_whatever_the_statistics(pool: PgPool) {
        sqlx::query(
            "INSERT INTO payment_events (gateway, event_id, raw_body, processed_at, outcome)
             SELECT 'internal', 'quiet-' || g, '\\x7b7d', now(), 'ignored' FROM generate_series(1, 3000) g",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("ANALYZE payment_events")
            .execute(&pool)
            .await
            .unwrap();
        let plan = crate::db::generic_plan(
            &pool,
            "BEGIN",
            &format!("(text[], text[]) AS {READ_EVENTS}"),
            "('{internal}', '{quiet-1}')",
        )
        .await;
        assert!(
            plan.contains("payment_events_pkey") && !plan.contains("payment_events_unprocessed"),
            "{plan}"
        );
    }

    /// The plan of [`RECORD_APPLIED`] made in a transaction begun with `begin`, on a database
    /// whose tables are still empty (a fleet's first batch on a new database).
    async fn record_applied_plan(pool: &PgPool, begin: &str) -> String {
        crate::db::generic_plan(
            pool,
            begin,
            &format!(" AS {}", *RECORD_APPLIED),
            "('{}', '{}', '{}', '{}', '{}', 'succeeded', '{}', 'applied', '{}', '{}', '{}', '{}')",
        )
        .await
    }

    /// With sequential scans off, a scan no index serves is priced far past `jit_above_cost`:
    /// the batch's transaction turns compiling off too (the hazard: `db::tests`).
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_batch_never_compiles_a_scan_it_could_not_avoid(pool: PgPool) {
        assert!(!crate::db::compiles_a_forced_scan(&pool, BEGIN_PLANNED_ONCE).await);
    }

    /// A batch's statements are planned once per connection, and the plan kept while the tables
    /// grow: one made while `jobs` was small read every job to complete a batch's runs (a hash
    /// join over a scan of the table), which costs more with every job the table gains. In the
    /// batch's transaction the plan is the primary key's whatever the sizes.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_batch_planned_on_small_tables_reads_its_rows_by_key(pool: PgPool) {
        let scanning = record_applied_plan(&pool, "BEGIN").await;
        assert!(
            scanning.contains("Seq Scan on jobs"),
            "the hazard: on an empty table the generic plan scans it\n{scanning}"
        );
        let batch = record_applied_plan(&pool, BEGIN_PLANNED_ONCE).await;
        assert!(!batch.contains("Seq Scan"), "{batch}");
        assert!(batch.contains("jobs_pkey"), "{batch}");
    }

    #[test]
    fn a_lone_worker_runs_two_batches_a_fleets_workers_one_each_unless_set() {
        let unset = BatchSettings::for_process(None);
        assert_eq!(unset.in_flight_for(None), 2, "not counted yet");
        assert_eq!(unset.in_flight_for(Some(1)), 2);
        assert_eq!(unset.in_flight_for(Some(2)), 1);
        assert_eq!(unset.in_flight_for(Some(5)), 1);
        let set = BatchSettings::for_process(Some(3));
        assert_eq!(set.in_flight_for(Some(1)), 3);
        assert_eq!(set.in_flight_for(Some(4)), 3);
    }

    #[test]
    fn a_batch_takes_its_share_of_the_events_in_batches() {
        let settings = BatchSettings::for_process(None);
        assert_eq!(settings.per_batch(2), 128, "a lone worker's two batches");
        assert_eq!(settings.per_batch(1), 256, "a fleet's worker's one");
        assert_eq!(BatchSettings::for_process(Some(3)).per_batch(3), 85);
        let tiny = BatchSettings {
            events_in_batches: 1,
            ..settings
        };
        assert_eq!(tiny.per_batch(4), 1, "never an empty batch");
        assert_eq!(tiny.per_batch(0), 1);
    }

    #[tokio::test]
    async fn batches_in_flight_follow_the_census_and_a_batch_under_way_keeps_its_turn() {
        let census = Census::default();
        let gate = Arc::new(Semaphore::new(2));
        let in_flight = Arc::new(AtomicUsize::new(2));
        tokio::spawn(follow_census(
            gate.clone(),
            in_flight.clone(),
            census.subscribe(),
            BatchSettings::default(),
        ));
        let under_way = gate.clone().acquire_owned().await.unwrap();
        let settle = || tokio::time::sleep(Duration::from_millis(50));

        // A second worker joins: the free turn is taken away at once, the busy one when its
        // batch ends.
        census.record(on_events(2));
        settle().await;
        assert_eq!(gate.available_permits(), 0);
        drop(under_way);
        settle().await;
        assert_eq!(
            gate.available_permits(),
            1,
            "one batch in flight beside another worker"
        );
        assert_eq!(in_flight.load(Ordering::Relaxed), 1, "a batch's share: all");

        // A worker on other queues only is not a worker of the events queue.
        census.record(
            [
                ("orders".to_owned(), 3),
                (ProcessPaymentEvent::QUEUE.to_owned(), 1),
            ]
            .into(),
        );
        settle().await;
        assert_eq!(gate.available_permits(), 2, "alone again: two");
        assert_eq!(
            in_flight.load(Ordering::Relaxed),
            2,
            "a batch's share: half"
        );

        // The batch loop ended (it closes the gate): the follower ends too.
        gate.close();
        census.record(on_events(2));
        settle().await;
        assert_eq!(gate.available_permits(), 2);
    }
}
