//! The migrations: the queue's schema in its own table, the application's after it, and a
//! database migrated before the queue kept its own migrations taking the new layout as it is.

use sqlx::PgPool;

/// The application's migrations that built the queue's schema before it kept its own.
const MOVED_TO_QUEUE: [i64; 15] = [1, 5, 9, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31];

async fn versions(pool: &PgPool, table: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM {table} WHERE success ORDER BY version"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn checksum_of_6(pool: &PgPool) -> Vec<u8> {
    sqlx::query_scalar("SELECT checksum FROM _sqlx_migrations WHERE version = 6")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Rewrites a freshly migrated database's history into what a release before the move left:
/// no queue migrations table, the moved versions recorded among the application's, and 0006
/// under the checksum it had then.
async fn as_migrated_before_the_move(pool: &PgPool) {
    sqlx::query("DROP TABLE _payfleet_queue_migrations")
        .execute(pool)
        .await
        .unwrap();
    for v in MOVED_TO_QUEUE {
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES ($1, 'before the move', true, '\\x00', 0)",
        )
        .bind(v)
        .execute(pool)
        .await
        .unwrap();
    }
    sqlx::query(
        "UPDATE _sqlx_migrations SET checksum = decode('a85bc02d0250c7206245d96a2a12c742c4a0a6d281e1e3fb2e3e6440cfd5ca3e216c6b0c3a90cf02a3e0cedba9d84bd5', 'hex')
         WHERE version = 6",
    )
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrations = false)]
async fn a_fresh_database_keeps_the_queues_migrations_in_their_own_table(pool: PgPool) {
    payfleet::db::migrate(&pool).await.unwrap();
    let queue = versions(&pool, payfleet_queue::pg::MIGRATIONS_TABLE).await;
    assert_eq!(queue.len(), payfleet_queue::pg::MIGRATOR.migrations.len());
    let app = versions(&pool, "_sqlx_migrations").await;
    assert_eq!(app.len(), payfleet::db::APP_MIGRATOR.migrations.len());
    assert!(
        app.iter().all(|v| !queue.contains(v)),
        "no version in both: {app:?} {queue:?}"
    );
    // Again: nothing to do, nothing refused.
    payfleet::db::migrate(&pool).await.unwrap();
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, 0);
}

#[sqlx::test(migrations = false)]
async fn a_database_migrated_before_the_move_takes_the_queues_own_migrations(pool: PgPool) {
    payfleet::db::migrate(&pool).await.unwrap();
    let fresh_6 = checksum_of_6(&pool).await;
    // A job waiting in the old layout must still be there, untouched, after the move.
    payfleet_queue::enqueue(
        &pool,
        payfleet_queue::NewJob::raw("default", "k", serde_json::json!({"n": 1})),
    )
    .await
    .unwrap();
    as_migrated_before_the_move(&pool).await;
    assert_ne!(checksum_of_6(&pool).await, fresh_6);

    payfleet::db::migrate(&pool).await.unwrap();
    assert_eq!(
        versions(&pool, payfleet_queue::pg::MIGRATIONS_TABLE)
            .await
            .len(),
        payfleet_queue::pg::MIGRATOR.migrations.len()
    );
    assert_eq!(
        checksum_of_6(&pool).await,
        fresh_6,
        "0006 recorded as it is now"
    );
    let jobs: Vec<String> = sqlx::query_scalar("SELECT kind FROM jobs")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, ["k"]);
    payfleet::db::migrate(&pool).await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn a_history_that_stops_part_way_or_knows_a_newer_migration_is_refused(pool: PgPool) {
    payfleet::db::migrate(&pool).await.unwrap();
    as_migrated_before_the_move(&pool).await;
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 31")
        .execute(&pool)
        .await
        .unwrap();
    let e = payfleet::db::migrate(&pool).await.unwrap_err().to_string();
    assert!(e.contains("stops before migration 31"), "{e}");
    let queue_table: bool =
        sqlx::query_scalar("SELECT to_regclass('_payfleet_queue_migrations') IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!queue_table, "a refused history changes nothing");

    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (31, 'before the move', true, '\\x00', 0), (9999, 'newer', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let e = payfleet::db::migrate(&pool).await.unwrap_err().to_string();
    assert!(e.contains("migration 9999"), "{e}");
}

/// A transaction a vanished client left open (a partitioned worker) ends after five idle
/// minutes, not after the server's TCP keepalive (two hours), so its locks do not stall the
/// sellers it holds: every new session of the fleet's database has the setting.
#[sqlx::test(migrator = "payfleet::db::MIGRATOR")]
async fn a_transaction_left_idle_by_a_vanished_client_ends_after_five_minutes(pool: PgPool) {
    use sqlx::Connection;
    let mut fresh = sqlx::PgConnection::connect_with(&pool.connect_options())
        .await
        .unwrap();
    let timeout: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(&mut fresh)
        .await
        .unwrap();
    assert_eq!(timeout, "5min");
    fresh.close().await.unwrap();
}

/// Two processes migrating one fresh database at once (`payfleet up` twice, two release hosts)
/// both finish, and every index is valid. sqlx's migrator waited for its lock inside a
/// statement, whose snapshot the holder's `CREATE INDEX CONCURRENTLY` then waited for: a
/// deadlock, which PostgreSQL ended by cutting one off, leaving an invalid index behind.
#[sqlx::test(migrations = false)]
async fn two_migrators_at_once_both_finish_and_leave_every_index_valid(pool: PgPool) {
    let options = pool.connect_options();
    let other = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with((*options).clone())
        .await
        .unwrap();
    let (a, b) = tokio::join!(payfleet::db::migrate(&pool), payfleet::db::migrate(&other));
    a.unwrap();
    b.unwrap();
    let invalid: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE NOT i.indisvalid",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(invalid, Vec::<String>::new());
    assert_eq!(
        versions(&pool, "_sqlx_migrations").await.len(),
        payfleet::db::APP_MIGRATOR.migrations.len()
    );
    other.close().await;
}

/// An index a `CONCURRENTLY` build left invalid is not recorded as built: the check after it
/// stops the migrations and names it.
#[sqlx::test(migrations = false)]
async fn an_index_left_invalid_by_a_cut_off_build_stops_the_migrations(pool: PgPool) {
    payfleet::db::migrate(&pool).await.unwrap();
    // What a build cut off leaves: the index there, not valid.
    sqlx::query(
        "UPDATE pg_index SET indisvalid = false
         WHERE indexrelid = 'payouts_pending'::regclass",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version >= 102")
        .execute(&pool)
        .await
        .unwrap();
    let refused = payfleet::db::migrate(&pool).await.unwrap_err();
    assert!(
        format!("{refused:#}").contains("payouts_pending missing or invalid"),
        "{refused:#}"
    );
}
