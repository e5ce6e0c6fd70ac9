//! Configuration from the environment (12-factor). A missing or invalid setting stops start-up
//! with a message that names it.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::queue::{QueuesConfig, QueuesConfigError};
use crate::webhooks::{SecretError, WebhookSecrets};

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/payfleet";
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const DEFAULT_BIND: &str = "127.0.0.1:8080";
pub const DEFAULT_WEBHOOK_BODY_LIMIT: usize = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{name} is not valid: {problem}")]
    Invalid { name: &'static str, problem: String },
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error(transparent)]
    Queues(#[from] QueuesConfigError),
}

#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: String,
    pub amqp_url: String,
    pub bind: SocketAddr,
    /// Most connections this process opens to PostgreSQL.
    pub db_pool_size: u32,
    pub webhooks: WebhookSecrets,
    pub webhook_body_limit: usize,
    /// How far a signed timestamp may be from now, either way.
    pub webhook_tolerance_secs: i64,
    pub queues: QueuesConfig,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parsed<T: std::str::FromStr>(name: &'static str, default: T) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    match var(name) {
        None => Ok(default),
        Some(v) => v.trim().parse().map_err(|e: T::Err| ConfigError::Invalid {
            name,
            problem: format!("{v:?}: {e}"),
        }),
    }
}

impl Config {
    /// Reads the environment. Webhook secrets are only those configured: see
    /// [`WebhookSecrets::with_development_defaults`] for `up`.
    pub fn from_env() -> Result<Self, ConfigError> {
        let database_url = var("DATABASE_URL").unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
        if !database_url.starts_with("postgres://") && !database_url.starts_with("postgresql://") {
            return Err(ConfigError::Invalid {
                name: "DATABASE_URL",
                problem: "must start with postgres://".into(),
            });
        }
        let amqp_url = var("AMQP_URL").unwrap_or_else(|| DEFAULT_AMQP_URL.to_owned());
        if !amqp_url.starts_with("amqp://") && !amqp_url.starts_with("amqps://") {
            return Err(ConfigError::Invalid {
                name: "AMQP_URL",
                problem: "must start with amqp:// or amqps://".into(),
            });
        }
        let bind = parsed(
            "PAYFLEET_BIND",
            DEFAULT_BIND.parse().map_err(|e| ConfigError::Invalid {
                name: "PAYFLEET_BIND",
                problem: format!("{e}"),
            })?,
        )?;
        let db_pool_size = parsed("PAYFLEET_DB_POOL_SIZE", 20u32)?;
        if db_pool_size < 4 {
            return Err(ConfigError::Invalid {
                name: "PAYFLEET_DB_POOL_SIZE",
                problem: "must be at least 4".into(),
            });
        }
        let webhook_body_limit = parsed("PAYFLEET_WEBHOOK_BODY_LIMIT", DEFAULT_WEBHOOK_BODY_LIMIT)?;
        if webhook_body_limit == 0 {
            return Err(ConfigError::Invalid {
                name: "PAYFLEET_WEBHOOK_BODY_LIMIT",
                problem: "must be positive".into(),
            });
        }
        let webhook_tolerance_secs = parsed("PAYFLEET_WEBHOOK_TOLERANCE_SECS", 300i64)?;
        if webhook_tolerance_secs <= 0 {
            return Err(ConfigError::Invalid {
                name: "PAYFLEET_WEBHOOK_TOLERANCE_SECS",
                problem: "must be positive".into(),
            });
        }
        let queues = match var("PAYFLEET_QUEUES") {
            Some(path) => QueuesConfig::from_file(&PathBuf::from(path))?,
            None => {
                let local = PathBuf::from("jobs/queues.toml");
                if local.is_file() {
                    QueuesConfig::from_file(&local)?
                } else {
                    QueuesConfig::built_in()?
                }
            }
        };
        Ok(Self {
            database_url,
            amqp_url,
            bind,
            db_pool_size,
            webhooks: WebhookSecrets::from_env()?,
            webhook_body_limit,
            webhook_tolerance_secs,
            queues,
        })
    }
}
