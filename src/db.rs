//! The PostgreSQL connection: the pool (creating the database if absent), the migrations, and
//! which errors mean an outage (retry later) rather than a refusal.

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Opens the pool, creating the database first if the server does not have it.
pub async fn connect(database_url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(database_url)
        .context("DATABASE_URL is not a valid PostgreSQL URL")?;
    create_database_if_absent(&options).await?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        // Fail fast when the database is down: requests get a 503, workers back off.
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .context("cannot connect to PostgreSQL (DATABASE_URL)")
}

async fn create_database_if_absent(options: &PgConnectOptions) -> anyhow::Result<()> {
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    match options.connect().await {
        Ok(c) => {
            c.close().await.ok();
            return Ok(());
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {}
        Err(e) => return Err(e).context("cannot connect to PostgreSQL (DATABASE_URL)"),
    }
    let sql = format!("CREATE DATABASE {}", quote_ident(&name));
    match on_maintenance_database(options, sql).await {
        Ok(()) => tracing::info!(database = %name, "created the database"),
        // Another process created it meanwhile.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
        Err(e) => return Err(e).context("cannot create the database"),
    }
    Ok(())
}

/// Runs one statement on the server's `postgres` database: creating or dropping ours cannot be
/// done from inside it.
pub(crate) async fn on_maintenance_database(
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
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR.run(pool).await.context("migrations failed")
}

/// Connection trouble, pool exhaustion, a restarting server, a deadlock or serialization
/// failure, exhausted resources: the same work may succeed later. Anything else (a constraint,
/// bad data) will fail the same way again.
pub fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            ["08", "40", "53", "57P"]
                .iter()
                .any(|class| c.starts_with(class))
        }),
        _ => false,
    }
}
