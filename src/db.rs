//! The PostgreSQL connection: the pool (creating the database if absent), the migrations (the
//! queue's, then the application's), and which errors mean a refusal of the row or a lost
//! connection. Which errors mean an outage, and the text-column enums, are the queue crate's
//! (`payfleet_queue::pg`), re-exported here.

use std::borrow::Cow;
use std::collections::HashSet;
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sqlx::migrate::Migrator;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool, Postgres};

pub use payfleet_queue::pg::{UnknownValue, is_transient};

use crate::secret::SecretUrl;

/// The application's own migrations, recorded in `_sqlx_migrations`. The queue's schema is the
/// queue crate's (`payfleet_queue::pg::MIGRATOR`, its own table), applied first.
pub static APP_MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let mut migrator = sqlx::migrate!("./migrations");
    // The versions the queue took over are missing here by design; [`check_history`] refuses
    // any other missing one, as sqlx would.
    migrator.set_ignore_missing(true);
    migrator
});

/// Every migration a fresh database takes, the queue's then the application's (the order they
/// must run in, which is not the versions' order: `run_to` does not apply), as one migrator
/// for `#[sqlx::test]`, which takes one. Their versions cannot collide (the queue's are
/// timestamps); on a fresh test database both land in `_sqlx_migrations`, where
/// [`migrate`] keeps the queue's in their own table.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| Migrator {
    migrations: Cow::Owned(
        payfleet_queue::pg::MIGRATOR
            .migrations
            .iter()
            .chain(APP_MIGRATOR.migrations.iter())
            .cloned()
            .collect(),
    ),
    ..Migrator::DEFAULT
});

/// The application's migrations that built the queue's schema before the queue kept its own
/// (`crates/queue/migrations` holds the result in one step). A database migrated before records
/// them in `_sqlx_migrations`; they are not missing.
const MOVED_TO_QUEUE: [i64; 15] = [1, 5, 9, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31];

/// Migration 0006 held a part of the queue's schema, which moved with it: a database migrated
/// before records the file's checksum from before the move, which is its current one's equal.
const MIGRATION_6_BEFORE_THE_MOVE: &str = "a85bc02d0250c7206245d96a2a12c742c4a0a6d281e1e3fb2e3e6440cfd5ca3e216c6b0c3a90cf02a3e0cedba9d84bd5";

/// Connections a busy loop keeps from one of its transactions to the next, the last one given
/// back being the next one taken. The pool hands out its oldest idle connection, so a loop that
/// takes one per transaction goes round every connection its process opened, and each new
/// backend pays once for what a backend that ran those statements before does not: the
/// catalogue read for their tables, the statements and PL/pgSQL parsed and planned, the shared
/// buffers mapped page by page (a worker started on a backlog ran its first 25 batches of
/// payment events on 16 backends). A loop keeps at most what it would hold at once anyway
/// (one per transaction in flight), and gives them back ([`Kept::release`]) once idle; a
/// connection whose transaction failed is not put back, and the pool checks it before handing
/// it out again.
#[derive(Clone, Default)]
pub struct Kept(std::sync::Arc<std::sync::Mutex<Vec<PoolConnection<Postgres>>>>);

impl Kept {
    /// The connection put back last, else one of the pool's.
    pub async fn take(&self, pool: &PgPool) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        let kept = self.lock().pop();
        match kept {
            Some(conn) => Ok(conn),
            None => pool.acquire().await,
        }
    }

    /// Keeps `conn` for the next [`Kept::take`].
    pub fn put(&self, conn: PoolConnection<Postgres>) {
        self.lock().push(conn);
    }

    /// Gives every kept connection back to the pool.
    pub fn release(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<PoolConnection<Postgres>>> {
        // A panic while holding the lock leaves a plain Vec behind: still usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Begins a transaction whose statements reach every row through a key, with sequential scans
/// off for it alone. A statement prepared on a connection keeps its plan for the connection's
/// life, and one planned while its table was small (a new database) scans the table whole, which
/// costs more with every row the table gains; with sequential scans off the planner takes an
/// index wherever one serves, whatever the sizes it sees (README, "Plans made on small tables").
///
/// Compiling is off with them: a scan that no index can serve is then priced at PostgreSQL's
/// `disable_cost` (ten billion), far past `jit_above_cost`, and a statement so planned would be
/// compiled by LLVM at every run (a posting of 31 sales, in a transaction that also read a
/// 51-row table without an index, took 447 ms instead of 7: README, "The ledger's barriers look
/// once per account"). Statements of a few milliseconds never gain from compiling. `SET LOCAL`
/// ends with the transaction: nothing stays on a pooled connection.
pub const BEGIN_BY_KEYS: &str = "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL jit = off";

/// Opens the pool of a `payfleet <role>` process, creating the database first if the server does
/// not have it. Its connections carry the application name `payfleet <role>` (what
/// `pg_stat_activity` shows an operator), unless `DATABASE_URL` names one; the parts of a
/// process with connections of their own add theirs (`payfleet work: claims`,
/// [`payfleet_queue::pg::part_of`]).
pub async fn connect(
    database_url: &SecretUrl,
    max_connections: u32,
    role: &str,
) -> anyhow::Result<PgPool> {
    let mut options = PgConnectOptions::from_str(database_url.expose())
        .context("DATABASE_URL is not a valid PostgreSQL URL")?;
    if options.get_application_name().is_none() {
        options = options.application_name(&format!("payfleet {role}"));
    }
    // A process started while PostgreSQL is away (restarting, out of connection slots, not up
    // yet after the machine's start) waits for it a while, as its requests and jobs would,
    // rather than exiting into its supervisor's restart loop; a wrong password or a database
    // that cannot be made fails at once.
    let started = Instant::now();
    let mut wait = Duration::from_millis(250);
    loop {
        match open(&options, max_connections).await {
            Ok(pool) => return Ok(pool),
            // No server (yet), one starting or shutting down, one out of connection slots.
            Err(e) if is_transient(&e) && started.elapsed() < STARTUP_PATIENCE => {
                tracing::warn!(error = %e, "PostgreSQL cannot be reached yet; trying again");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e).context("cannot connect to PostgreSQL (DATABASE_URL)"),
        }
    }
}

/// How long a process starting waits for PostgreSQL to be reachable.
const STARTUP_PATIENCE: Duration = Duration::from_secs(60);

/// The pool, the database made first if the server does not have it.
///
/// The pool's first connection asks: on a database that exists (every start but the first)
/// that is the only connection opened, where a check before it cost every starting process a
/// backend of its own (PostgreSQL forks and initialises one per connection, about 4.5 ms here)
/// before its work could begin.
async fn open(options: &PgConnectOptions, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    let pool = || {
        PgPoolOptions::new()
            .max_connections(max_connections)
            // Fail fast when the database is down: requests get a 503, workers back off.
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
    };
    let missing = |e: &sqlx::Error| matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some(NO_SUCH_DATABASE));
    match pool().await {
        Err(e) if missing(&e) => match create_database(options).await {
            Ok(()) => pool().await,
            // Processes started together on an empty server each make it, and all but one
            // fail: with 42P04, or with 23505 on `pg_database`'s name index when the first had
            // not committed yet (PostgreSQL checks the name before it inserts). Whatever the
            // error, the database may be there now: the creation's error stands only if not.
            Err(creating) => match pool().await {
                Err(e) if missing(&e) => Err(creating),
                opened => opened,
            },
        },
        opened => opened,
    }
}

/// PostgreSQL's `invalid_catalog_name`: the database named does not exist.
const NO_SUCH_DATABASE: &str = "3D000";

async fn create_database(options: &PgConnectOptions) -> Result<(), sqlx::Error> {
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    let sql = format!("CREATE DATABASE {}", quote_ident(&name));
    match on_maintenance_database(options, sql).await {
        Ok(()) => tracing::info!(database = %name, "created the database"),
        // Another process created it meanwhile.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
        Err(e) => return Err(e),
    }
    Ok(())
}

/// Runs one statement on the server's `postgres` database: creating or dropping ours cannot be
/// done from inside it.
pub async fn on_maintenance_database(
    options: &PgConnectOptions,
    sql: String,
) -> Result<(), sqlx::Error> {
    let mut admin = options.clone().database("postgres").connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&mut admin)
        .await?;
    admin.close().await.ok();
    Ok(())
}

/// A database name as a quoted SQL identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Applies the queue's migrations, then the application's, each set in its own table.
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    run_migrations(pool, true).await
}

/// [`migrate`] on its own pool to `url` (the direct connection behind a pooler), without the
/// migrators' session lock when `locking` is off (a pooler in transaction mode has no session
/// to hold it: `PAYFLEET_LISTEN_URL=off`).
pub async fn migrate_at(url: &SecretUrl, locking: bool) -> anyhow::Result<()> {
    let pool = connect(url, 2, "migrate").await?;
    let done = run_migrations(&pool, locking).await;
    pool.close().await;
    done
}

async fn run_migrations(pool: &PgPool, locking: bool) -> anyhow::Result<()> {
    check_history(pool).await?;
    let mut conn = pool.acquire().await?;
    let lock = if locking {
        Some(migrating_alone(&mut conn).await?)
    } else {
        None
    };
    let done = async {
        unlocked(&payfleet_queue::pg::MIGRATOR)
            .run(&mut *conn)
            .await
            .context("the queue's migrations failed")?;
        unlocked(&APP_MIGRATOR)
            .run(&mut *conn)
            .await
            .context("migrations failed")
    }
    .await;
    if let Some(id) = lock {
        let unlocked: Result<bool, sqlx::Error> =
            sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                .bind(id)
                .fetch_one(&mut *conn)
                .await;
        if !matches!(unlocked, Ok(true)) {
            // Never back in the pool holding the lock: closing the session lets it go.
            conn.close_on_drop();
        }
    }
    done
}

/// Takes the migrators' session lock (sqlx's own key for this database, so a migrator of an
/// earlier release waits for this one and the other way round) by asking without waiting, again
/// every 200 ms until it is free. sqlx's migrator waits inside `SELECT pg_advisory_lock(...)`:
/// that statement holds a snapshot while it waits, and a `CREATE INDEX CONCURRENTLY` of the
/// migrator holding the lock waits for every older snapshot to end, so two migrators started
/// together deadlocked, and the one PostgreSQL cut off left an invalid index behind
/// (`migrations::two_migrators_at_once_both_finish_and_leave_every_index_valid`). Between tries
/// this session runs no statement and holds no snapshot.
async fn migrating_alone(conn: &mut sqlx::PgConnection) -> anyhow::Result<i64> {
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut *conn)
        .await?;
    let id = migration_lock_id(&database);
    let started = Instant::now();
    let mut said = Duration::ZERO;
    loop {
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(id)
            .fetch_one(&mut *conn)
            .await?;
        if taken {
            return Ok(id);
        }
        if started.elapsed() >= said + Duration::from_secs(10) {
            said = started.elapsed();
            tracing::info!(
                waited_secs = said.as_secs(),
                "another process is migrating this database; waiting for it"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// sqlx's migration lock key for a database (`sqlx-postgres`'s `generate_lock_id`).
fn migration_lock_id(database: &str) -> i64 {
    const CRC: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISO_HDLC);
    0x3d32_ad9e * i64::from(CRC.checksum(database.as_bytes()))
}

/// `migrator` without sqlx's own lock: [`migrating_alone`] holds it, without waiting inside a
/// statement.
fn unlocked(migrator: &Migrator) -> Migrator {
    Migrator {
        migrations: migrator.migrations.clone(),
        ignore_missing: migrator.ignore_missing,
        locking: false,
        no_tx: migrator.no_tx,
        table_name: migrator.table_name.clone(),
        create_schemas: migrator.create_schemas.clone(),
    }
}

/// What sqlx checks of the applied migrations, with the queue's move allowed for: a version
/// recorded but absent from this release is refused unless the queue took it over, and a
/// database that recorded some of those but not all (one migrated by a release older than the
/// last before the move) is refused too: the queue's single step expects all of them. It also
/// records 0006's current checksum where the one from before the move is recorded.
async fn check_history(pool: &PgPool) -> anyhow::Result<()> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(pool)
        .await
        .context("cannot read the migrations' history")?;
    if !exists {
        return Ok(());
    }
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations")
        .fetch_all(pool)
        .await
        .context("cannot read the migrations' history")?;
    let known: HashSet<i64> = MIGRATOR.migrations.iter().map(|m| m.version).collect();
    if let Some(v) = applied
        .iter()
        .find(|v| !known.contains(v) && !MOVED_TO_QUEUE.contains(v))
    {
        bail!(
            "the database has migration {v}, which this release does not know (was it migrated by a newer release?)"
        );
    }
    let moved = MOVED_TO_QUEUE
        .iter()
        .filter(|v| applied.contains(v))
        .count();
    if moved > 0 && moved < MOVED_TO_QUEUE.len() {
        bail!(
            "the database stops before migration 31: apply the migrations of the release before the queue's own (or any older one that reaches 31) first"
        );
    }
    if moved > 0 {
        let current = APP_MIGRATOR
            .migrations
            .iter()
            .find(|m| m.version == 6)
            .context("migration 6 is missing from this build")?;
        let before = hex::decode(MIGRATION_6_BEFORE_THE_MOVE).context("the recorded checksum")?;
        sqlx::query(
            "UPDATE _sqlx_migrations SET checksum = $1 WHERE version = 6 AND checksum = $2",
        )
        .bind(current.checksum.as_ref())
        .bind(before)
        .execute(pool)
        .await
        .context("cannot record migration 6's checksum after the move")?;
    }
    Ok(())
}

/// The database refused this row for what it holds (bad data, a constraint, a trigger's
/// refusal): the same statement without it would succeed.
pub fn is_about_the_row(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("22") || c.starts_with("23") || c.starts_with("P0")),
        sqlx::Error::Encode(_) => true,
        _ => false,
    }
}

/// The connection itself is gone (or never came): drop it and connect again, rather than
/// retrying the statement on it.
pub fn is_connection_lost(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
        _ => false,
    }
}

/// The name of the constraint a database error is about, if any.
pub fn constraint(e: &sqlx::Error) -> Option<&str> {
    match e {
        sqlx::Error::Database(db) => db.constraint(),
        _ => None,
    }
}

/// For tests: a pool of one connection to `pool`'s database, so that every statement it runs is
/// prepared on that connection and [`plan_counts`] sees it.
#[cfg(test)]
pub(crate) async fn one_connection(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .expect("a pool of one connection")
}

/// For tests: how often the statements prepared on `pool`'s one connection whose text contains
/// `fragment` were planned on their generic plan, and how often again for their parameters'
/// values (PostgreSQL plans the first five executions for their values, then keeps the generic
/// plan unless it looks dearer than those did: README, "Plans made once").
#[cfg(test)]
pub(crate) async fn plan_counts(pool: &PgPool, fragment: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(sum(generic_plans), 0)::int8, coalesce(sum(custom_plans), 0)::int8
         FROM pg_prepared_statements WHERE strpos(statement, $1) > 0 AND from_sql = false",
    )
    .bind(fragment)
    .fetch_one(pool)
    .await
    .expect("pg_prepared_statements")
}

/// For tests: the generic plan of a statement, made in a transaction begun with `begin` (which
/// ends rolled back). `prepare` is what follows `PREPARE planned` (the parameters' types, `AS`,
/// the statement), `arguments` what follows `EXECUTE planned`.
#[cfg(test)]
pub(crate) async fn generic_plan(
    pool: &PgPool,
    begin: &str,
    prepare: &str,
    arguments: &str,
) -> String {
    let mut conn = pool.acquire().await.expect("a connection");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{begin}; SET LOCAL plan_cache_mode = force_generic_plan; PREPARE planned{prepare}"
    )))
    .execute(&mut *conn)
    .await
    .expect("prepared");
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN EXECUTE planned{arguments}"
    )))
    .fetch_all(&mut *conn)
    .await
    .expect("explained");
    sqlx::raw_sql("ROLLBACK; DEALLOCATE planned")
        .execute(&mut *conn)
        .await
        .expect("deallocated");
    plan.join("\n")
}

/// Whether PostgreSQL would compile, in a transaction begun with `begin`, a statement that only
/// a sequential scan can serve.
#[cfg(test)]
pub(crate) async fn compiles_a_forced_scan(pool: &PgPool, begin: &'static str) -> bool {
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS unindexed (x int)")
        .execute(pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin_with(&mut *conn, begin)
        .await
        .unwrap();
    let plan: serde_json::Value =
        sqlx::query_scalar("EXPLAIN (FORMAT JSON) SELECT * FROM unindexed WHERE x = 1")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    tx.rollback().await.unwrap();
    plan[0].get("JIT").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::PgConnection;

    async fn backend(conn: &mut PgConnection) -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .unwrap()
    }

    async fn application_name(pool: &PgPool) -> String {
        sqlx::query_scalar(
            "SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_process_makes_its_database_when_the_server_lacks_it() {
        let url = std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server");
        let name = format!("payfleet_made_{:08x}", rand::random::<u32>());
        let options = PgConnectOptions::from_str(&url).unwrap().database(&name);
        let absent = |e: sqlx::Error| matches!(&e, sqlx::Error::Database(d) if d.code().as_deref() == Some(NO_SUCH_DATABASE));
        assert!(absent(options.connect().await.map(|_| ()).unwrap_err()));
        let made = open(&options, 1).await.unwrap();
        let on: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(&made)
            .await
            .unwrap();
        assert_eq!(on, name);
        // Opened again, it is found, not made twice.
        let again = open(&options, 1).await.unwrap();
        made.close().await;
        again.close().await;
        on_maintenance_database(&options, format!("DROP DATABASE {}", quote_ident(&name)))
            .await
            .unwrap();
    }

    /// Processes started together on a server without their database (a fleet's first start)
    /// each try to make it; every one of them opens it, whichever made it.
    #[tokio::test]
    async fn processes_started_together_all_open_the_database_one_of_them_made() {
        let url = std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server");
        for _ in 0..3 {
            let name = format!("payfleet_made_{:08x}", rand::random::<u32>());
            let options = PgConnectOptions::from_str(&url).unwrap().database(&name);
            let opening: Vec<_> = (0..6)
                .map(|_| {
                    let options = options.clone();
                    tokio::spawn(async move { open(&options, 1).await })
                })
                .collect();
            let mut errors = Vec::new();
            for o in opening {
                match o.await.unwrap() {
                    Ok(pool) => pool.close().await,
                    Err(e) => errors.push(e.to_string()),
                }
            }
            on_maintenance_database(&options, format!("DROP DATABASE {}", quote_ident(&name)))
                .await
                .unwrap();
            assert!(errors.is_empty(), "{errors:?}");
        }
    }

    #[tokio::test]
    async fn a_process_names_its_connections_unless_the_url_does() {
        let url = std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server");
        let pool = connect(&SecretUrl::new(url.clone()), 1, "work")
            .await
            .unwrap();
        assert_eq!(application_name(&pool).await, "payfleet work");
        let named = if url.contains('?') {
            format!("{url}&application_name=mine")
        } else {
            format!("{url}?application_name=mine")
        };
        let pool = connect(&SecretUrl::new(named), 1, "work").await.unwrap();
        assert_eq!(application_name(&pool).await, "mine");
    }

    #[sqlx::test]
    async fn a_transaction_by_keys_never_compiles_a_scan_it_could_not_avoid(pool: PgPool) {
        assert!(!compiles_a_forced_scan(&pool, BEGIN_BY_KEYS).await);
        // The hazard, where the server can compile: sequential scans off alone.
        let jit: bool = sqlx::query_scalar("SELECT pg_jit_available()")
            .fetch_one(&pool)
            .await
            .unwrap();
        let scans_off = "BEGIN; SET LOCAL enable_seqscan = off";
        assert_eq!(compiles_a_forced_scan(&pool, scans_off).await, jit);
    }

    #[sqlx::test]
    async fn the_next_take_gets_the_connection_given_back_last(pool: PgPool) {
        let kept = Kept::default();
        let (mut first, mut second) = (
            kept.take(&pool).await.unwrap(),
            kept.take(&pool).await.unwrap(),
        );
        let (a, b) = (backend(&mut first).await, backend(&mut second).await);
        assert_ne!(a, b, "two transactions at once, two connections");
        kept.put(first);
        kept.put(second);
        // The pool would hand out its oldest idle connection; `Kept`, the last given back.
        let mut next = kept.take(&pool).await.unwrap();
        assert_eq!(backend(&mut next).await, b);
        let mut after = kept.take(&pool).await.unwrap();
        assert_eq!(backend(&mut after).await, a);
        assert_eq!(pool.size(), 2, "no connection opened for them");
    }

    #[sqlx::test]
    async fn released_connections_go_back_to_the_pool(pool: PgPool) {
        let kept = Kept::default();
        let conn = kept.take(&pool).await.unwrap();
        kept.put(conn);
        assert_eq!(pool.num_idle(), 0, "kept out of the pool while kept");
        kept.release();
        // The pool takes it back on its own task.
        for _ in 0..100 {
            if pool.num_idle() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.num_idle(), 1);
        assert!(kept.lock().is_empty());
    }
}
