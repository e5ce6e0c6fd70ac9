//! What the queue needs of PostgreSQL besides its statements: its schema's migrations (kept in
//! their own table, so an application's own migrations never collide with them), which errors
//! mean an outage rather than a refusal, and how a Rust enum is stored in a `text` column
//! ([`text_enum!`](crate::text_enum)). The application reuses the last two for its own tables.

use std::sync::LazyLock;

use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnectOptions;

/// The table that records which of the queue's migrations a database has.
pub const MIGRATIONS_TABLE: &str = "_payfleet_queue_migrations";

/// The queue's schema: `jobs`, its indexes and the functions its statements call. Its versions
/// are timestamps, so an application may also list them beside its own numbered ones in a
/// single migrator (payfleet's tests do) without a collision.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
});

/// Applies the queue's migrations that `pool`'s database does not have yet.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// `options` for the connections of one part of a process: their application name, which
/// `pg_stat_activity` shows an operator beside each backend's query, its waits and its locks,
/// is the process's followed by `: part` (`payfleet work: claims`), or `payfleet-queue: part`
/// where the process named none.
pub fn part_of(options: &PgConnectOptions, part: &str) -> PgConnectOptions {
    let process = options.get_application_name().unwrap_or("payfleet-queue");
    options
        .clone()
        .application_name(&format!("{process}: {part}"))
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
            type Err = $crate::pg::UnknownValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $( $text => Ok($name::$variant), )+
                    other => Err($crate::pg::UnknownValue {
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
