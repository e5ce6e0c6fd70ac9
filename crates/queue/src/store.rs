//! Every statement the queue runs, in one place. The rules of a run's end live in SQL
//! (`jobs_end_runs`, `jobs_next_state`: the crate's migration), so the worker, the rescue
//! and the shutdown release cannot disagree about them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, PgPool};

use super::{BookkeepingCommit, JobId, JobState, RunOutcome};

/// The channel every LISTENing worker waits on; the payload is the queue's name.
pub(crate) const CHANNEL: &str = "payfleet_jobs";

// The one INSERT of jobs, as text the const statements below are built from at compile time;
// `crate::insert_jobs_from` gives it to callers, with its contract.
macro_rules! insert_jobs_from {
    ($($source:tt)+) => {
        concat!(insert_jobs_on_key_conflict!($($source)+), " DO NOTHING")
    };
}

// `insert_jobs_from!` up to its conflict target, the key of an unfinished job: the caller says
// what a conflict does.
macro_rules! insert_jobs_on_key_conflict {
    ($($source:tt)+) => {
        concat!(
            "INSERT INTO jobs (queue, kind, key, payload, run_at, max_attempts, fairness_key) ",
            "SELECT job_queue, job_kind, job_key, job_payload, COALESCE(job_run_at, now()), job_max_attempts, ",
            "job_fairness_key FROM ",
            $($source)+,
            " ON CONFLICT (key) WHERE key IS NOT NULL AND state IN ('available', 'running', 'retryable')"
        )
    };
}

// The seven parameters `JobColumns::bind` fills, as a relation for `insert_jobs_from!`.
macro_rules! job_columns_from_params {
    () => {
        "unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::timestamptz[], $6::int[], $7::text[]) \
         AS t(job_queue, job_kind, job_key, job_payload, job_run_at, job_max_attempts, job_fairness_key)"
    };
}

/// See [`crate::insert_jobs_from`].
pub(crate) fn insert_jobs_from(source: &str) -> String {
    // The marker is not SQL a source could contain by accident: it is replaced, once.
    insert_jobs_from!("\u{0}source\u{0}").replacen("\u{0}source\u{0}", source, 1)
}

/// See [`crate::complete_runs_from`]. The rule is `jobs_end_runs`' for a completed run with
/// nothing pending (`jobs_next_state(NULL, 'complete', ..)` is always `completed`): its row
/// goes. Matched by lease token, so a run whose lease was lost (and its job perhaps claimed
/// again) completes nothing.
pub(crate) fn complete_runs_from(source: &str) -> String {
    format!(
        "DELETE FROM jobs j USING {source} AS r(id, token)
         WHERE j.id = r.id AND j.lease_token = r.token AND j.pending IS NULL
         RETURNING j.id"
    )
}

pub(crate) const JOB_COLUMNS_FROM_PARAMS: &str = job_columns_from_params!();

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

// ---- enqueue, schedule, cancel -------------------------------------------------------------

// A job due more than a minute from now wakes no worker: every worker looks again within its
// poll interval (`[fleet] poll_interval_ms`, a second by default; keep it under a minute), long
// before the job is due, and a transaction that notifies takes a database-wide lock at commit
// (PostgreSQL's notification queue), which a checkout scheduling its orders' expiries half an
// hour ahead should not queue behind.
pub(crate) const ENQUEUE_ONE: &str = concat!(
    "WITH j AS (",
    insert_jobs_from!(job_columns_from_params!()),
    " RETURNING id, run_at) SELECT id FROM j
      LEFT JOIN LATERAL (SELECT pg_notify('payfleet_jobs', $1[1]) WHERE j.run_at <= now() + interval '1 minute') n ON true"
);

pub(crate) const ENQUEUE_MANY: &str = concat!(
    "WITH j AS (",
    insert_jobs_from!(job_columns_from_params!()),
    " RETURNING id), queues AS (SELECT DISTINCT q FROM unnest($1::text[], $5::timestamptz[]) AS x(q, at)
                                WHERE at IS NULL OR at <= now() + interval '1 minute')
         SELECT (SELECT count(*) FROM j)
         FROM (SELECT count(pg_notify('payfleet_jobs', q)) FROM queues) n"
);

/// Adds jobs; for a key held by a job that is running right now, marks that job to run again
/// when its run ends (a reschedule keeping its payload), so work that arrived during the run is
/// not missed. That holds for a run an operator cancelled too: the cancel ended the work known
/// then, not what arrived after it. A key held by a waiting job is left as it is: that job will
/// run.
pub(crate) const ENQUEUE_OR_RERUN: &str = concat!(
    "WITH j AS (",
    insert_jobs_on_key_conflict!(job_columns_from_params!()),
    " DO UPDATE SET pending = 'reschedule', run_at = now()
      WHERE jobs.state = 'running'
      RETURNING id), queues AS (SELECT DISTINCT q FROM unnest($1::text[]) AS q)
     SELECT (SELECT count(*) FROM j)
     FROM (SELECT count(pg_notify('payfleet_jobs', q)) FROM queues) n"
);

/// Inserts a keyed job or replaces the unfinished one holding the key, in one statement:
/// concurrent calls serialise on the key's row. A running job keeps running and is marked to
/// become available with the new payload and time when its run ends.
pub(crate) const SCHEDULE: &str = "WITH j AS (
     INSERT INTO jobs (queue, kind, key, payload, run_at, max_attempts, fairness_key)
     VALUES ($1, $2, $3, $4, COALESCE($5, now()), $6, $7)
     ON CONFLICT (key) WHERE key IS NOT NULL AND state IN ('available', 'running', 'retryable')
     DO UPDATE SET
         queue = EXCLUDED.queue,
         kind = EXCLUDED.kind,
         payload = EXCLUDED.payload,
         fairness_key = EXCLUDED.fairness_key,
         run_at = EXCLUDED.run_at,
         max_attempts = CASE WHEN jobs.state = 'running'
                             THEN greatest(EXCLUDED.max_attempts, jobs.attempt)
                             ELSE EXCLUDED.max_attempts END,
         attempt = CASE WHEN jobs.state = 'running' THEN jobs.attempt ELSE 0 END,
         state = CASE WHEN jobs.state = 'running' THEN 'running' ELSE 'available' END,
         pending = CASE WHEN jobs.state = 'running' THEN 'reschedule' END
     RETURNING id, queue, run_at, (xmax = 0) AS inserted, state = 'running' AS running)
     SELECT id, inserted, running FROM j
     LEFT JOIN LATERAL (SELECT pg_notify('payfleet_jobs', j.queue) WHERE j.run_at <= now() + interval '1 minute') n ON true";

pub(crate) const CANCEL: &str = "UPDATE jobs SET
         state = CASE WHEN state = 'running' THEN 'running' ELSE 'cancelled' END,
         pending = CASE WHEN state = 'running' THEN 'cancel' END,
         finished_at = CASE WHEN state = 'running' THEN NULL ELSE now() END
     WHERE key = $1 AND state IN ('available', 'running', 'retryable')
     RETURNING id, state = 'running'";

// ---- claiming and running ------------------------------------------------------------------

/// A claimed job, as the claim statement returns it.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub id: JobId,
    pub kind: String,
    pub payload: serde_json::Value,
    pub attempt: i32,
    pub max_attempts: i32,
    pub lease_token: i64,
    /// When it was due.
    pub run_at: DateTime<Utc>,
}

/// Where a worker's claims of one queue are: in the ring of fairness groups (each claim starts
/// after the group the previous one ended on, so no group is always served last), and within
/// the groups (`Hints`).
#[derive(Debug, Default, Clone)]
pub(crate) struct FairCursor {
    after_group: Option<String>,
    hints: Option<Hints>,
}

/// Where the previous claims stopped in each group they took jobs from, so the next claim's
/// probe of the group starts there rather than at the group's start, where the index entries of
/// every job of it claimed since the last vacuum wait for it. A job committed behind such a
/// point (its transaction took its run time before the claim and committed after it) is found
/// by a probe from the start: the claims of a queue probe from the start, with
/// every hint dropped, whenever a job was notified since their last such probe (every way a
/// job becomes waiting notifies: `arrivals` counts what the listener heard), after a claim that
/// found nothing, and at least every `every` (`PROBE_FROM_START_EVERY`: notifications may be
/// lost, or there may be no listener). A group's hint is only ever set by a claim after the
/// last probe from the start, and the first claim after it that visits the group probes the
/// group from its start.
#[derive(Debug, Clone)]
struct Hints {
    arrivals: Arc<AtomicU64>,
    every: Duration,
    /// The last job claimed from the unkeyed group.
    unkeyed: Option<(DateTime<Utc>, i64)>,
    /// The last job claimed from each keyed group, in key order.
    keyed: BTreeMap<String, (DateTime<Utc>, i64)>,
    /// When the last probe from the start was sent, and how many arrivals had been counted.
    from_start_at: Option<Instant>,
    arrivals_then: u64,
}

/// How often, at least, the claims of a queue probe its groups from the start.
pub(crate) const PROBE_FROM_START_EVERY: Duration = Duration::from_millis(250);

/// At most this many keyed groups have a hint (a claim passes them all to the walk); a claim
/// from a group beyond them probes it from its start.
const MAX_KEY_HINTS: usize = 4096;

/// The starting points a claim passes to the walk: the unkeyed group's, and the keyed groups'
/// as three arrays in key order.
#[derive(Debug, Default)]
struct Starts {
    unkeyed: Option<(DateTime<Utc>, i64)>,
    keys: Vec<String>,
    run_ats: Vec<DateTime<Utc>>,
    ids: Vec<i64>,
}

impl FairCursor {
    /// A cursor whose claims may start a group's probe where the previous claims stopped;
    /// `arrivals` counts the notifications of the queue's jobs, and a probe from the start is
    /// sent at least `every`.
    pub(crate) fn following(arrivals: Arc<AtomicU64>, every: Duration) -> Self {
        Self {
            after_group: None,
            hints: Some(Hints {
                arrivals,
                every,
                unkeyed: None,
                keyed: BTreeMap::new(),
                from_start_at: None,
                arrivals_then: 0,
            }),
        }
    }

    /// Where this claim's probes start (none given: at the start of each group).
    fn starts(&mut self) -> Starts {
        let Some(hints) = self.hints.as_mut() else {
            return Starts::default();
        };
        let arrivals = hints.arrivals.load(Ordering::Acquire);
        let stale = hints
            .from_start_at
            .is_none_or(|at| at.elapsed() >= hints.every);
        if stale || arrivals != hints.arrivals_then {
            hints.from_start_at = Some(Instant::now());
            hints.arrivals_then = arrivals;
            hints.unkeyed = None;
            hints.keyed.clear();
            return Starts::default();
        }
        let mut starts = Starts {
            unkeyed: hints.unkeyed,
            keys: Vec::with_capacity(hints.keyed.len()),
            run_ats: Vec::with_capacity(hints.keyed.len()),
            ids: Vec::with_capacity(hints.keyed.len()),
        };
        for (key, (run_at, id)) in &hints.keyed {
            starts.keys.push(key.clone());
            starts.run_ats.push(*run_at);
            starts.ids.push(*id);
        }
        starts
    }

    /// The group the last claim's walk ended on (`None` before any, or at the ring's end).
    pub(crate) fn position(&self) -> Option<&str> {
        self.after_group.as_deref()
    }

    /// Moves the cursor past a claim: the ring past its last group, each group it took jobs
    /// from past the last of them (a claim that took nothing sends the next one from the start).
    fn moved(&mut self, last_group: Option<String>, claimed: &[ClaimRow]) {
        self.after_group = last_group;
        let Some(hints) = self.hints.as_mut() else {
            return;
        };
        if claimed.iter().all(|r| r.id.is_none()) {
            hints.from_start_at = None;
            return;
        }
        for row in claimed {
            let (Some(run_at), Some(id)) = (row.run_at, row.id) else {
                continue;
            };
            let at = (run_at, id.0);
            match &row.fairness_key {
                None => hints.unkeyed = hints.unkeyed.max(Some(at)),
                Some(key) => {
                    if let Some(last) = hints.keyed.get_mut(key) {
                        *last = (*last).max(at);
                    } else if hints.keyed.len() < MAX_KEY_HINTS {
                        hints.keyed.insert(key.clone(), at);
                    }
                }
            }
        }
    }
}

/// How many groups one claim looks at, at most: keys whose jobs all wait for a retry cost a
/// probe each, and a claim must stay cheap however many there are (the next claim goes on
/// from where this one stopped).
const CLAIM_MAX_GROUPS: i32 = 256;

/// The claim: up to $2 due jobs of queue $1, leased for $3 ms to worker $4, in one statement
/// whose transaction commits with `synchronous_commit` $7 (`BookkeepingCommit`).
///
/// Fair between groups (`jobs_fair_walk`): the walk starts after group $5 and visits groups
/// until $2 of them have a job due (or $6 were visited, or the ring closes), probing the unkeyed
/// group after ($8, $9) and the keyed groups $10 after ($11, $12), where given (`Hints`). The
/// batch is shared equally between the due groups, each taking its oldest due jobs from the
/// head the walk found, entry for entry (so no scan steps again over the entries of jobs
/// claimed since the last vacuum). With one group (no job carries a key) this is the plain
/// oldest-first claim. The walk's last group always comes back, on a row with no job when none
/// was claimed, so the cursor moves on past groups that had nothing due; so does how many groups
/// the walk found with a job due (read without locks: a claim that takes nothing from them met
/// only rows another transaction holds).
pub(crate) const CLAIM: &str = "WITH walk AS MATERIALIZED (
             SELECT grp, due, pos, head, head_id FROM jobs_fair_walk($1, $5, $2, $6, $8, $9, $10, $11, $12)
         ),
         share AS (SELECT greatest(1, $2 / greatest(count(*), 1))::int AS per FROM walk WHERE due),
         next AS (
             SELECT c.id FROM walk CROSS JOIN share CROSS JOIN LATERAL (
                 SELECT id FROM jobs
                 WHERE queue = $1 AND state IN ('available', 'retryable')
                   AND fairness_key = walk.grp AND (run_at, id) >= (walk.head, walk.head_id)
                   AND run_at <= now()
                 ORDER BY run_at, id
                 LIMIT share.per
                 FOR UPDATE SKIP LOCKED) c
             WHERE walk.due AND walk.grp <> ''
           UNION ALL
             SELECT u.id FROM (
                 SELECT id FROM jobs
                 WHERE queue = $1 AND state IN ('available', 'retryable')
                   AND fairness_key IS NULL AND run_at <= now()
                   AND (run_at, id) >= ((SELECT head FROM walk WHERE grp = ''),
                                        (SELECT head_id FROM walk WHERE grp = ''))
                 ORDER BY run_at, id
                 LIMIT (SELECT per FROM share)
                 FOR UPDATE SKIP LOCKED) u
             WHERE EXISTS (SELECT 1 FROM walk WHERE due AND grp = '')
         ),
         claimed AS (
             UPDATE jobs j SET
                 state = 'running',
                 attempt = j.attempt + 1,
                 attempted_at = now(),
                 -- The sequence keeps tokens apart while the database runs; the random high
                 -- bits keep a value it hands out again after a crash (its last values lost
                 -- with the commits not waited for) from matching a run that still holds it.
                 lease_token = nextval('jobs_lease_token_seq')
                               | (floor(random() * 1073741824)::bigint << 32),
                 lease_expires_at = now() + $3 * interval '1 millisecond',
                 locked_by = $4
             -- At most $2 rows (the shares add up to no more); saying so keeps the plan a
             -- primary-key probe per job.
             FROM (SELECT id FROM next LIMIT $2) picked WHERE j.id = picked.id
             RETURNING j.id, j.kind, j.payload, j.attempt, j.max_attempts, j.lease_token, j.run_at,
                       j.fairness_key
         )
         SELECT c.id, c.kind, c.payload, c.attempt, c.max_attempts, c.lease_token, c.run_at,
                c.fairness_key, w.last_group, w.due_groups
         FROM (SELECT (SELECT grp FROM walk ORDER BY pos DESC LIMIT 1) AS last_group,
                      (SELECT count(*) FROM walk WHERE due) AS due_groups,
                      set_config('synchronous_commit', $7, true) AS commit_mode) w
         LEFT JOIN claimed c ON true";

#[derive(sqlx::FromRow)]
struct ClaimRow {
    id: Option<JobId>,
    kind: Option<String>,
    payload: Option<serde_json::Value>,
    attempt: Option<i32>,
    max_attempts: Option<i32>,
    lease_token: Option<i64>,
    run_at: Option<DateTime<Utc>>,
    fairness_key: Option<String>,
    last_group: Option<String>,
    due_groups: Option<i64>,
}

/// What a claim came to.
pub(crate) struct Claim {
    /// The jobs it took.
    pub jobs: Vec<Claimed>,
    /// It took nothing, yet its walk found a job due: every due job it reached was locked by
    /// another transaction (an operator's statement on `jobs`, a business transaction replacing
    /// a job by its key, another worker's claim in flight), which `SKIP LOCKED` steps over.
    pub only_locked: bool,
    /// Its walk found no group with a job due on its stretch of the ring (at most
    /// `CLAIM_MAX_GROUPS` groups): the next claim goes on from where it stopped.
    pub nothing_due_seen: bool,
}

/// Claims up to `limit` due jobs of `queue` in one statement, taking turns between fairness
/// groups from `cursor` on, and moves the cursor.
pub(crate) async fn claim<'c>(
    db: impl PgExecutor<'c>,
    queue: &str,
    limit: i64,
    lease: Duration,
    worker: &str,
    cursor: &mut FairCursor,
    commit: BookkeepingCommit,
) -> Result<Vec<Claimed>, sqlx::Error> {
    Ok(
        claim_seeing(db, queue, limit, lease, worker, cursor, commit)
            .await?
            .jobs,
    )
}

/// [`claim`], saying whether it met only locked rows.
pub(crate) async fn claim_seeing<'c>(
    db: impl PgExecutor<'c>,
    queue: &str,
    limit: i64,
    lease: Duration,
    worker: &str,
    cursor: &mut FairCursor,
    commit: BookkeepingCommit,
) -> Result<Claim, sqlx::Error> {
    let starts = cursor.starts();
    let rows: Vec<ClaimRow> = sqlx::query_as(CLAIM)
        .bind(queue)
        .bind(i32::try_from(limit).unwrap_or(i32::MAX))
        .bind(millis(lease))
        .bind(worker)
        .bind(cursor.after_group.as_deref())
        .bind(CLAIM_MAX_GROUPS)
        .bind(commit.setting())
        .bind(starts.unkeyed.map(|(run_at, _)| run_at))
        .bind(starts.unkeyed.map(|(_, id)| id))
        .bind(&starts.keys)
        .bind(&starts.run_ats)
        .bind(&starts.ids)
        .fetch_all(db)
        .await?;
    if let Some(first) = rows.first() {
        cursor.moved(first.last_group.clone(), &rows);
    }
    let due_groups = rows.first().and_then(|r| r.due_groups).unwrap_or(0);
    let jobs: Vec<Claimed> = rows
        .into_iter()
        .filter_map(|r| {
            Some(Claimed {
                id: r.id?,
                kind: r.kind?,
                payload: r.payload?,
                attempt: r.attempt?,
                max_attempts: r.max_attempts?,
                lease_token: r.lease_token?,
                run_at: r.run_at?,
            })
        })
        .collect();
    Ok(Claim {
        only_locked: jobs.is_empty() && due_groups > 0,
        nothing_due_seen: due_groups == 0,
        jobs,
    })
}

/// How long until the earliest waiting job of `queue` is due (zero if one is due now).
pub(crate) async fn next_due_in(
    pool: &PgPool,
    queue: &str,
) -> Result<Option<Duration>, sqlx::Error> {
    // Each part through its own claim index: the first unkeyed entry, and the keyed entries
    // (one group's jobs are in run_at order, so this reads the queue's keyed jobs). The first
    // unkeyed entry is asked for as such: written as min(), the planner, whose statistics often
    // saw an empty queue, may read every due entry instead (100 ms in a 150,000-job drain).
    let ms: Option<f64> = sqlx::query_scalar(
        "SELECT (extract(epoch FROM least(
             (SELECT run_at FROM jobs
              WHERE queue = $1 AND state IN ('available', 'retryable') AND fairness_key IS NULL
              ORDER BY run_at LIMIT 1),
             (SELECT min(run_at) FROM jobs
              WHERE queue = $1 AND state IN ('available', 'retryable') AND fairness_key IS NOT NULL)
         ) - now()) * 1000)::float8",
    )
    .bind(queue)
    .fetch_one(pool)
    .await?;
    Ok(ms.map(|ms| Duration::from_millis(ms.max(0.0).ceil() as u64)))
}

/// One run's end, named by its lease.
#[derive(Debug, Clone)]
pub(crate) struct EndRow {
    pub id: JobId,
    pub lease_token: i64,
    pub outcome: RunOutcome,
    pub delay_ms: Option<i64>,
    pub error: Option<String>,
}

/// What ending runs does about a run whose row another transaction holds locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockedRows {
    /// Skips it: the run stays running, for its end to be written later. Never waits; each row
    /// is locked before it is updated.
    Skip,
    /// Waits for it at most `END_LOCK_WAIT`, then fails with lock_not_available (55P03). Takes
    /// no lock of its own before updating, which is cheaper: for a batch whose rows no one else
    /// holds, the usual case.
    WaitBriefly,
}

/// How long `LockedRows::WaitBriefly` waits for a row another transaction holds.
const END_LOCK_WAIT: &str = "50ms";

/// Ends runs in one statement. Returns the new state of each run that still held its lease;
/// a run missing from the answer had lost it (rescued, or claimed by another worker), or was
/// skipped (`LockedRows::Skip`). `commit` applies to the statement's transaction (the
/// caller's, if it runs in one), as does `WaitBriefly`'s lock timeout.
pub(crate) async fn end_runs<'c>(
    db: impl PgExecutor<'c>,
    ends: &[EndRow],
    commit: BookkeepingCommit,
    locked: LockedRows,
) -> Result<Vec<(JobId, JobState)>, sqlx::Error> {
    let ids: Vec<i64> = ends.iter().map(|e| e.id.0).collect();
    let tokens: Vec<i64> = ends.iter().map(|e| e.lease_token).collect();
    let outcomes: Vec<RunOutcome> = ends.iter().map(|e| e.outcome).collect();
    let delays: Vec<Option<i64>> = ends.iter().map(|e| e.delay_ms).collect();
    let errors: Vec<Option<&str>> = ends.iter().map(|e| e.error.as_deref()).collect();
    // The settings first: the function takes its skip flag from `s` (no lock timeout set:
    // skip), so no plan can run it before them. A skipping end keeps the session's timeout.
    sqlx::query_as(
        "SELECT e.job_id, e.new_state
         FROM (SELECT set_config('synchronous_commit', $6, true),
                      CASE WHEN NOT $7 THEN set_config('lock_timeout', $8, true) END)
              AS s(commit_mode, lock_wait),
              LATERAL jobs_end_runs($1, $2, $3, $4, $5, s.lock_wait IS NULL) AS e",
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(&outcomes)
    .bind(&delays)
    .bind(&errors)
    .bind(commit.setting())
    .bind(locked == LockedRows::Skip)
    .bind(END_LOCK_WAIT)
    .fetch_all(db)
    .await
}

// ---- leases --------------------------------------------------------------------------------

/// Extends the leases this worker holds. A row locked by someone else (a long transaction that
/// reschedules or cancels the job) is skipped, not waited for: one locked row must not hold up
/// the renewal of every other run. Returns the ids renewed.
///
/// A matching lease token is what says the job still runs (a token is set exactly while a job
/// runs); a `state = 'running'` predicate would let the planner, whose statistics often saw no
/// running job, drive the join from the partial index of running jobs and read the arrays once
/// per job.
pub(crate) async fn renew_leases(
    pool: &PgPool,
    ids: &[i64],
    tokens: &[i64],
    lease: Duration,
) -> Result<Vec<JobId>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH held AS (
             SELECT j.id FROM jobs j
             JOIN unnest($1::bigint[], $2::bigint[]) AS l(id, token) ON j.id = l.id AND j.lease_token = l.token
             ORDER BY j.id
             FOR UPDATE OF j SKIP LOCKED)
         UPDATE jobs j SET lease_expires_at = now() + $3 * interval '1 millisecond'
         FROM held WHERE j.id = held.id
         RETURNING j.id",
    )
    .bind(ids)
    .bind(tokens)
    .bind(millis(lease))
    .fetch_all(pool)
    .await
}

/// Which of these runs still hold their lease, read without waiting for any lock.
pub(crate) async fn still_held(
    pool: &PgPool,
    ids: &[i64],
    tokens: &[i64],
) -> Result<Vec<JobId>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT j.id FROM jobs j
         JOIN unnest($1::bigint[], $2::bigint[]) AS l(id, token) ON j.id = l.id AND j.lease_token = l.token",
    )
    .bind(ids)
    .bind(tokens)
    .fetch_all(pool)
    .await
}

// ---- maintenance ---------------------------------------------------------------------------

/// Runs whose lease has expired, locked for this transaction (skipping any another rescuer
/// holds), oldest first.
pub(crate) async fn lock_expired<'c>(
    db: impl PgExecutor<'c>,
    limit: i64,
) -> Result<Vec<(JobId, i64, String, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, lease_token, locked_by, lease_expires_at FROM jobs
         WHERE state = 'running' AND lease_expires_at < now()
         ORDER BY lease_expires_at
         LIMIT $1
         FOR UPDATE SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Deletes up to `limit` finished jobs past their retention. (A run that completes deletes its
/// job; this still takes the completed rows that releases before that left.)
pub(crate) async fn prune_batch(
    pool: &PgPool,
    completed_retention_secs: u64,
    discarded_retention_secs: u64,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM jobs WHERE id IN (
             SELECT id FROM jobs
             WHERE (state IN ('completed', 'cancelled') AND finished_at < now() - $1 * interval '1 second')
                OR (state = 'discarded' AND finished_at < now() - $2 * interval '1 second')
             LIMIT $3
             FOR UPDATE SKIP LOCKED)",
    )
    .bind(completed_retention_secs as f64)
    .bind(discarded_retention_secs as f64)
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// Wakes the workers of these queues (outside any transaction: see `Notifier`).
pub(crate) async fn notify_queues(pool: &PgPool, queues: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, q) FROM unnest($2::text[]) AS q")
        .bind(CHANNEL)
        .bind(queues)
        .execute(pool)
        .await
        .map(|_| ())
}

// ---- the operator's view -------------------------------------------------------------------

/// Jobs that are not finished, by queue and state. Reads only the partial indexes of waiting
/// (keyed and unkeyed) and running jobs, so its cost follows the backlog, not the table
/// (finished jobs are kept for days: dead and cancelled ones, and completed ones written
/// by releases before a completed run deleted its job).
pub(crate) const UNFINISHED_COUNTS: &str = "SELECT queue, state, sum(count)::bigint AS count FROM (
         SELECT queue, state, count(*) AS count FROM jobs
         WHERE state IN ('available', 'retryable') AND fairness_key IS NULL GROUP BY queue, state
         UNION ALL
         SELECT queue, state, count(*) AS count FROM jobs
         WHERE state IN ('available', 'retryable') AND fairness_key IS NOT NULL GROUP BY queue, state
         UNION ALL
         SELECT queue, state, count(*) AS count FROM jobs
         WHERE state = 'running' GROUP BY queue, state
     ) parts
     GROUP BY queue, state
     ORDER BY queue, state";

/// Per queue: jobs due now and not running, and how long the oldest of them has been due.
/// The queues are found by skipping through the two claim indexes (one probe each), and each
/// queue's count reads only its due unkeyed entries and its keyed entries: jobs scheduled for
/// later without a key (a million expiry jobs) are never read, so a scrape costs the backlog,
/// not the table.
pub(crate) const DUE_BY_QUEUE: &str = "WITH RECURSIVE q AS (
         SELECT least(
             (SELECT min(queue) FROM jobs
              WHERE state IN ('available', 'retryable') AND fairness_key IS NULL),
             (SELECT min(queue) FROM jobs
              WHERE state IN ('available', 'retryable') AND fairness_key IS NOT NULL)) AS queue
         UNION ALL
         SELECT least(
             (SELECT min(j.queue) FROM jobs j
              WHERE j.state IN ('available', 'retryable') AND j.fairness_key IS NULL
                AND j.queue > q.queue),
             (SELECT min(j.queue) FROM jobs j
              WHERE j.state IN ('available', 'retryable') AND j.fairness_key IS NOT NULL
                AND j.queue > q.queue))
         FROM q WHERE q.queue IS NOT NULL
     )
     SELECT q.queue, d.due, d.oldest_due_secs
     FROM q CROSS JOIN LATERAL (
         SELECT sum(part.due)::bigint AS due,
                COALESCE(extract(epoch FROM now() - min(part.oldest)), 0)::float8 AS oldest_due_secs
         FROM (
             SELECT count(*) AS due, min(run_at) AS oldest FROM jobs
             WHERE queue = q.queue AND state IN ('available', 'retryable')
               AND fairness_key IS NULL AND run_at <= now()
             UNION ALL
             SELECT count(*) AS due, min(run_at) AS oldest FROM jobs
             WHERE queue = q.queue AND state IN ('available', 'retryable')
               AND fairness_key IS NOT NULL AND run_at <= now()
         ) part
     ) d
     WHERE q.queue IS NOT NULL AND d.due > 0
     ORDER BY q.queue";

/// Discarded jobs by queue, through the index of finished jobs.
pub(crate) const DEAD_COUNTS: &str = "SELECT queue, state, count(*) AS count FROM jobs
     WHERE state = 'discarded' AND finished_at IS NOT NULL
     GROUP BY queue, state ORDER BY queue, state";

/// Every job by queue and state (a full count, for the command line).
pub(crate) const ALL_COUNTS: &str =
    "SELECT queue, state, count(*) AS count FROM jobs GROUP BY queue, state ORDER BY queue, state";

/// Jobs waiting to retry after a failure (soonest first), then dead ones (newest first), each
/// part through its partial indexes.
pub(crate) const FAILED: &str = "(SELECT * FROM (
          (SELECT id, queue, kind, key, state, attempt, max_attempts, run_at AS at,
                  errors -> -1 ->> 'error' AS last_error
           FROM jobs WHERE state = 'retryable' AND fairness_key IS NULL
           ORDER BY run_at, id LIMIT $1)
          UNION ALL
          (SELECT id, queue, kind, key, state, attempt, max_attempts, run_at AS at,
                  errors -> -1 ->> 'error' AS last_error
           FROM jobs WHERE state = 'retryable' AND fairness_key IS NOT NULL
           ORDER BY run_at, id LIMIT $1)
      ) waiting ORDER BY at, id LIMIT $1)
     UNION ALL
     (SELECT id, queue, kind, key, state, attempt, max_attempts, finished_at AS at,
             errors -> -1 ->> 'error' AS last_error
      FROM jobs WHERE state = 'discarded' AND finished_at IS NOT NULL
      ORDER BY finished_at DESC, id DESC LIMIT $1)";

pub(crate) const DEAD: &str = "SELECT id, queue, kind, key, attempt, max_attempts, finished_at,
         errors -> -1 ->> 'error' AS last_error
     FROM jobs
     WHERE state = 'discarded' AND ($1::text IS NULL OR queue = $1)
     ORDER BY finished_at DESC, id DESC
     LIMIT $2";

pub(crate) const LOCK_STATE_AND_KEY: &str = "SELECT state, key FROM jobs WHERE id = $1 FOR UPDATE";

pub(crate) const RETRY: &str =
    "UPDATE jobs SET state = 'available', run_at = now(), finished_at = NULL,
         max_attempts = greatest(max_attempts, attempt + 1)
     WHERE id = $1";

pub(crate) const DISCARD: &str = "UPDATE jobs SET state = 'discarded', finished_at = now(),
         errors = errors || jsonb_build_array(jsonb_build_object(
             'attempt', attempt, 'at', now(), 'error', 'discarded by an operator'))
     WHERE id = $1";

/// The latest job of a key: the unfinished one if any (through the unique key index), else the
/// newest discarded one (through the index of finished jobs).
pub(crate) const LATEST_BY_KEY: &str = "SELECT coalesce(
         (SELECT state FROM jobs WHERE key = $1 AND state IN ('available', 'running', 'retryable')),
         (SELECT state FROM jobs WHERE key = $1 AND state = 'discarded' AND finished_at IS NOT NULL
          ORDER BY finished_at DESC LIMIT 1))";

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::{Connection, PgConnection};

    async fn setting(conn: &mut PgConnection, name: &str) -> String {
        sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(conn)
            .await
            .unwrap()
    }

    async fn commit_mode(conn: &mut PgConnection) -> String {
        setting(conn, "synchronous_commit").await
    }

    /// Sequential scans of `jobs` by one call of `jobs_end_runs` (a run of a job that is not
    /// there) on a connection of its own, whose plans are made afresh while the queue is small:
    /// read from the transaction's own counters.
    async fn job_scans_ending_runs(pool: &PgPool) -> i64 {
        let mut conn = PgConnection::connect_with(&pool.connect_options())
            .await
            .unwrap();
        let mut tx = conn.begin().await.unwrap();
        sqlx::query("SELECT * FROM jobs_end_runs('{1}', '{1}', '{completed}', '{0}', '{NULL}')")
            .execute(&mut *tx)
            .await
            .unwrap();
        let scans: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(seq_scan), 0)::int8 FROM pg_stat_xact_user_tables WHERE relname = 'jobs'",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();
        scans
    }

    /// A run's end is planned once per connection and the plan kept while `jobs` grows: made
    /// while the queue was small, it read every job to end a batch of runs. With sequential
    /// scans off in the function, it probes each by its key.
    #[sqlx::test(migrator = "crate::pg::MIGRATOR")]
    async fn ending_runs_planned_on_a_small_queue_probes_jobs_by_key(pool: PgPool) {
        sqlx::query("INSERT INTO jobs (queue, kind) SELECT 'q', 'k' FROM generate_series(1, 50)")
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(job_scans_ending_runs(&pool).await, 0);
        // The hazard, with the function's setting taken away.
        sqlx::query(
            "ALTER FUNCTION jobs_end_runs(bigint[], bigint[], text[], bigint[], text[], boolean)
                 RESET enable_seqscan",
        )
        .execute(&pool)
        .await
        .unwrap();
        assert!(job_scans_ending_runs(&pool).await > 0);
    }

    /// The fleet's bookkeeping commit mode holds for the claim's and the end's own transaction
    /// and never stays on the connection: a pooled connection (PgBouncer's included) goes back
    /// as it came, and a handler's transaction on it commits synchronously.
    #[sqlx::test(migrator = "crate::pg::MIGRATOR")]
    async fn the_bookkeeping_commit_mode_holds_for_its_own_transaction_only(pool: PgPool) {
        sqlx::query("INSERT INTO jobs (queue, kind) SELECT 'q', 'k' FROM generate_series(1, 3)")
            .execute(&pool)
            .await
            .unwrap();
        let mut conn = pool.acquire().await.unwrap();
        assert_eq!(commit_mode(&mut conn).await, "on");
        let lease = Duration::from_secs(30);
        let mut cursor = FairCursor::default();

        // Inside a transaction: the mode is set for it, and gone after its commit.
        let mut tx = conn.begin().await.unwrap();
        let claimed = claim(
            &mut *tx,
            "q",
            1,
            lease,
            "w",
            &mut cursor,
            BookkeepingCommit::Off,
        )
        .await
        .unwrap();
        assert_eq!(claimed.len(), 1);
        assert_eq!(commit_mode(&mut tx).await, "off");
        tx.commit().await.unwrap();
        assert_eq!(commit_mode(&mut conn).await, "on");

        // As a statement of its own (how the fleet runs them): nothing stays either.
        let claimed = claim(
            &mut *conn,
            "q",
            2,
            lease,
            "w",
            &mut cursor,
            BookkeepingCommit::RemoteWrite,
        )
        .await
        .unwrap();
        assert_eq!(claimed.len(), 2);
        assert_eq!(commit_mode(&mut conn).await, "on");
        let ends: Vec<EndRow> = claimed
            .iter()
            .map(|c| EndRow {
                id: c.id,
                lease_token: c.lease_token,
                outcome: RunOutcome::Complete,
                delay_ms: None,
                error: None,
            })
            .collect();
        let mut tx = conn.begin().await.unwrap();
        let ended = end_runs(
            &mut *tx,
            &ends,
            BookkeepingCommit::Local,
            LockedRows::WaitBriefly,
        )
        .await
        .unwrap();
        assert_eq!(ended.len(), 2, "both runs still held their lease");
        assert_eq!(commit_mode(&mut tx).await, "local");
        assert_eq!(setting(&mut tx, "lock_timeout").await, "50ms");
        tx.commit().await.unwrap();
        assert_eq!(commit_mode(&mut conn).await, "on");
        assert_eq!(setting(&mut conn, "lock_timeout").await, "0");
        // Completed jobs are deleted: only the first claim's run is left, still running.
        let left: Vec<String> = sqlx::query_scalar("SELECT state FROM jobs")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        assert_eq!(left, ["running"]);
    }

    /// A claim lost in a database crash (commits not waited for) can see the token sequence
    /// hand out the same value again: the run that still holds the lost claim's token must not
    /// match the new claim's, or its renewals would succeed and both runs go on at once.
    #[sqlx::test(migrator = "crate::pg::MIGRATOR")]
    async fn a_token_handed_out_again_after_a_crash_fences_off_the_run_that_held_it(pool: PgPool) {
        insert_job(&pool, 1, 1).await;
        let mut cursor = FairCursor::default();
        let lease = Duration::from_secs(30);
        let first = claim(
            &pool,
            "q",
            1,
            lease,
            "w1",
            &mut cursor,
            BookkeepingCommit::On,
        )
        .await
        .unwrap();
        let (id, token) = (first[0].id, first[0].lease_token);
        // The crash: the claim is gone, and so are the sequence's values since before it.
        sqlx::query(
            "UPDATE jobs SET state = 'available', attempt = 0, lease_token = NULL, lease_expires_at = NULL,
                 locked_by = NULL WHERE id = $1",
        )
        .bind(id.0)
        .execute(&pool)
        .await
        .unwrap();
        let last: i64 = sqlx::query_scalar("SELECT last_value FROM jobs_lease_token_seq")
            .fetch_one(&pool)
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER SEQUENCE jobs_lease_token_seq RESTART WITH {last}"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let mut cursor = FairCursor::default();
        let again = claim(
            &pool,
            "q",
            1,
            lease,
            "w2",
            &mut cursor,
            BookkeepingCommit::On,
        )
        .await
        .unwrap();
        assert_eq!(again[0].id, id);
        assert_ne!(again[0].lease_token, token);
        // The first run's renewal is refused: its lease keeper cancels it.
        let renewed = renew_leases(&pool, &[id.0], &[token], lease).await.unwrap();
        assert!(renewed.is_empty());
    }

    /// Claims the next `n` jobs of queue q for the tests below; returns their payloads' n, in
    /// order.
    async fn claim_ns(pool: &PgPool, cursor: &mut FairCursor, n: i64) -> Vec<i64> {
        let claimed = claim(
            pool,
            "q",
            n,
            Duration::from_secs(30),
            "w",
            cursor,
            BookkeepingCommit::On,
        )
        .await
        .unwrap();
        let mut ns: Vec<i64> = claimed
            .iter()
            .map(|c| c.payload["n"].as_i64().unwrap())
            .collect();
        ns.sort_unstable();
        ns
    }

    async fn insert_job(pool: &PgPool, n: i64, ago_secs: i64) {
        insert_keyed(pool, n, None, ago_secs).await;
    }

    async fn insert_keyed(pool: &PgPool, n: i64, key: Option<&str>, ago_secs: i64) {
        sqlx::query(
            "INSERT INTO jobs (queue, kind, payload, run_at, fairness_key)
             VALUES ('q', 'k', jsonb_build_object('n', $1::bigint), now() - $2 * interval '1 second', $3)",
        )
        .bind(n)
        .bind(ago_secs as f64)
        .bind(key)
        .execute(pool)
        .await
        .unwrap();
    }

    /// The same for a seller's group: its probe starts where the previous claims stopped in
    /// it, a job committed behind that point is claimed once notified, and a seller that
    /// appears before a hinted one is not passed over.
    #[sqlx::test(migrator = "crate::pg::MIGRATOR")]
    async fn a_sellers_job_committed_behind_the_claims_is_found(pool: PgPool) {
        for n in 1..=6 {
            insert_keyed(&pool, n, Some("seller-b"), 100 - n).await;
        }
        let arrivals = Arc::new(AtomicU64::new(0));
        let mut cursor = FairCursor::following(arrivals.clone(), Duration::from_secs(3600));
        assert_eq!(claim_ns(&pool, &mut cursor, 2).await, [1, 2]);
        insert_keyed(&pool, 100, Some("seller-b"), 3600).await;
        assert_eq!(claim_ns(&pool, &mut cursor, 2).await, [3, 4]);
        arrivals.fetch_add(1, Ordering::Release);
        assert_eq!(claim_ns(&pool, &mut cursor, 2).await, [5, 100]);

        // A new seller, unnotified, before the hinted one in key order.
        insert_keyed(&pool, 200, Some("seller-a"), 10).await;
        assert_eq!(claim_ns(&pool, &mut cursor, 1).await, [200]);
        assert_eq!(claim_ns(&pool, &mut cursor, 1).await, [6]);
        assert_eq!(claim_ns(&pool, &mut cursor, 1).await, Vec::<i64>::new());
    }

    /// A cursor that follows the queue's notifications starts the probe of the unkeyed group
    /// where its previous claim stopped; a job committed behind that point (its run time taken
    /// before the previous claim) is still claimed: at once after a notification, within the
    /// period of probes from the start without one, and by the claim after one that found
    /// nothing.
    #[sqlx::test(migrator = "crate::pg::MIGRATOR")]
    async fn a_job_committed_behind_the_claims_is_found(pool: PgPool) {
        for n in 1..=10 {
            insert_job(&pool, n, 100 - n).await;
        }
        let arrivals = Arc::new(AtomicU64::new(0));
        let hour = Duration::from_secs(3600);
        let mut cursor = FairCursor::following(arrivals.clone(), hour);
        assert_eq!(claim_ns(&pool, &mut cursor, 3).await, [1, 2, 3]);

        // Behind the claims, unnotified: the next claim goes on from where the last one stopped.
        insert_job(&pool, 100, 3600).await;
        assert_eq!(claim_ns(&pool, &mut cursor, 2).await, [4, 5]);
        // Notified: the next claim probes from the start, and takes it first (then 6).
        arrivals.fetch_add(1, Ordering::Release);
        assert_eq!(claim_ns(&pool, &mut cursor, 2).await, [6, 100]);

        // Unnotified again: found once the period of probes from the start is over.
        insert_job(&pool, 200, 3600).await;
        assert_eq!(claim_ns(&pool, &mut cursor, 1).await, [7]);
        let every = Duration::from_millis(100);
        if let Some(hint) = cursor.hints.as_mut() {
            hint.every = every;
        }
        tokio::time::sleep(every).await;
        assert_eq!(claim_ns(&pool, &mut cursor, 1).await, [200]);
        if let Some(hint) = cursor.hints.as_mut() {
            hint.every = hour;
        }

        // A claim that finds nothing after its point sends the next one from the start.
        assert_eq!(claim_ns(&pool, &mut cursor, 3).await, [8, 9, 10]);
        insert_job(&pool, 300, 3600).await;
        assert_eq!(claim_ns(&pool, &mut cursor, 1).await, Vec::<i64>::new());
        assert_eq!(claim_ns(&pool, &mut cursor, 1).await, [300]);

        // A cursor without notifications to follow (the apalis backend's, the stepping
        // helper's) always probes from the start.
        let mut plain = FairCursor::default();
        insert_job(&pool, 400, 10).await;
        insert_job(&pool, 401, 3600).await;
        assert_eq!(claim_ns(&pool, &mut plain, 1).await, [401]);
        insert_job(&pool, 402, 7200).await;
        assert_eq!(claim_ns(&pool, &mut plain, 1).await, [402]);
        assert_eq!(claim_ns(&pool, &mut plain, 1).await, [400]);
    }
}
