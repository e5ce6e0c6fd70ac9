//! The PostgreSQL connection: the pool (creating the database if absent), the migrations, which
//! errors mean an outage (retry later) rather than a refusal, and how Rust enums are stored as
//! text columns ([`text_enum!`]).

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::secret::SecretUrl;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Opens the pool, creating the database first if the server does not have it.
pub async fn connect(database_url: &SecretUrl, max_connections: u32) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(database_url.expose())
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

/// Runs the migrations where `config` says: on the direct connection behind a pooler, and
/// without the migrator's session lock when there is none (`PAYFLEET_LISTEN_URL=off`).
pub async fn migrate_as_configured(config: &crate::config::Config) -> anyhow::Result<()> {
    let (url, locking) = config.migrations_url();
    let pool = connect(url, 2).await?;
    let migrator = sqlx::migrate::Migrator {
        migrations: MIGRATOR.migrations.clone(),
        ignore_missing: MIGRATOR.ignore_missing,
        locking,
        no_tx: MIGRATOR.no_tx,
        table_name: MIGRATOR.table_name.clone(),
        create_schemas: MIGRATOR.create_schemas.clone(),
    };
    let done = migrator.run(&pool).await.context("migrations failed");
    pool.close().await;
    done
}

/// Connection trouble, pool exhaustion, a restarting server, a deadlock or serialization
/// failure, exhausted resources, a statement or lock timeout, a server that turned read-only
/// (a failover to a standby), a system or internal error: the same work may succeed later.
/// Anything else (a constraint, bad data, a bug in a statement) will fail the same way again.
pub fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            // 08 connection, 40 rollback (deadlock, serialization), 53 resources, 57 operator
            // intervention (timeouts, shutdown), 58 system, XX internal; 55P03 lock timeout;
            // 25006 read-only transaction.
            ["08", "40", "53", "57", "58", "XX", "55P03", "25006"]
                .iter()
                .any(|class| c.starts_with(class))
        }),
        _ => false,
    }
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

/// A stored value that is not one of the enum's spellings: the schema's CHECK constraints keep
/// this from happening, so it means a newer release wrote a state this one does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a known {what}")]
pub struct UnknownValue {
    pub what: &'static str,
    pub value: String,
}

/// A fieldless enum stored in a `text` column (kept valid by a CHECK constraint): its spelling
/// in one place, with `as_str`, `FromStr`, `Display`, serde and sqlx encode/decode.
///
/// ```ignore
/// text_enum! {
///     /// What a run's end asks of the job.
///     pub enum RunOutcome { Complete = "complete", Retry = "retry" }
/// }
/// ```
#[macro_export]
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(&self) -> &'static str {
                match self {
                    $( $name::$variant => $text ),+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::db::UnknownValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $( $text => Ok($name::$variant), )+
                    other => Err($crate::db::UnknownValue {
                        what: stringify!($name),
                        value: other.to_owned(),
                    }),
                }
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <::std::borrow::Cow<'de, str> as ::serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(::serde::de::Error::custom)
            }
        }

        impl ::sqlx::Type<::sqlx::Postgres> for $name {
            fn type_info() -> ::sqlx::postgres::PgTypeInfo {
                <&str as ::sqlx::Type<::sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &::sqlx::postgres::PgTypeInfo) -> bool {
                <&str as ::sqlx::Type<::sqlx::Postgres>>::compatible(ty)
            }
        }

        impl ::sqlx::postgres::PgHasArrayType for $name {
            fn array_type_info() -> ::sqlx::postgres::PgTypeInfo {
                <&str as ::sqlx::postgres::PgHasArrayType>::array_type_info()
            }
        }

        impl ::sqlx::Encode<'_, ::sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut ::sqlx::postgres::PgArgumentBuffer,
            ) -> Result<::sqlx::encode::IsNull, ::sqlx::error::BoxDynError> {
                <&str as ::sqlx::Encode<'_, ::sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl<'r> ::sqlx::Decode<'r, ::sqlx::Postgres> for $name {
            fn decode(
                value: ::sqlx::postgres::PgValueRef<'r>,
            ) -> Result<Self, ::sqlx::error::BoxDynError> {
                let text = <&str as ::sqlx::Decode<'r, ::sqlx::Postgres>>::decode(value)?;
                Ok(text.parse::<$name>()?)
            }
        }
    };
}
