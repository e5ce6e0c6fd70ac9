//! Configuration from the environment (12-factor). The process's own settings are read here;
//! a context with settings of its own reads them itself (`gateways::Settings::from_env`,
//! `payments::reconcile::Settings::from_env`) and this module composes them. A missing or
//! invalid setting stops start-up with a message that names it. Secrets and URLs with passwords
//! are wrapped so they never print.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::auth::Token;
pub use crate::env::{Env, ProcessEnv};
use crate::env::{Invalid, http_url, parsed, var};
use crate::http::server::HttpSettings;
use crate::secret::SecretUrl;
use payfleet_queue::{QueuesConfig, QueuesConfigError};

/// The queues' settings shipped with the binary; used when no file is configured or found.
const BUILT_IN_QUEUES: &str = include_str!("../jobs/queues.toml");

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/payfleet";
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const DEFAULT_BIND: &str = "127.0.0.1:8080";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Invalid(#[from] Invalid),
    #[error(transparent)]
    Queues(#[from] QueuesConfigError),
    #[error(transparent)]
    Recurring(#[from] crate::recurring::ScheduleError),
}

fn invalid(name: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(crate::env::invalid(name, problem))
}

#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: SecretUrl,
    pub amqp_url: SecretUrl,
    /// Where `serve` and `up` listen.
    pub bind: SocketAddr,
    /// Where a `work` process serves its health and metrics, if anywhere.
    pub worker_bind: Option<SocketAddr>,
    /// Most connections this process opens to PostgreSQL.
    pub db_pool_size: u32,
    /// Where the session-level work goes (LISTEN, the migrations' lock) when DATABASE_URL is a
    /// pooler in transaction mode: `PAYFLEET_LISTEN_URL`.
    pub listen: ListenTo,
    /// Each gateway's secrets, API credentials and switches.
    pub gateways: crate::gateways::Settings,
    /// The receiver's limits on webhooks.
    pub webhooks: crate::webhooks::Settings,
    pub queues: QueuesConfig,
    /// Names this machine in worker ids.
    pub host_name: String,
    /// Turns the admin API and the dashboard on (only its digest is kept).
    pub admin_token: Option<Token>,
    /// Set by `payfleet up` alone (`demo::development_config`): its development API key, kept in
    /// plain text for its restarts and `payfleet demo`, is in force. Never read from the
    /// environment.
    pub development: bool,
    /// A token that may read `/metrics` and nothing else (Prometheus' bearer).
    pub metrics_token: Option<Token>,
    /// How long a reading of the metrics' database gauges is served before it is read again,
    /// whatever the scrape rate (`PAYFLEET_METRICS_REFRESH_MS`).
    pub metrics_refresh: std::time::Duration,
    /// The limits of the HTTP server and who its clients are.
    pub http: HttpSettings,
    /// The platform's commission, how long an order waits.
    pub orders: crate::orders::Settings,
    /// Where buyers reach this receiver (payment pages, the pages gateways send them back to).
    pub public_url: String,
    /// Whether `PAYFLEET_PUBLIC_URL` was given (else `public_url` is `http://` +
    /// `PAYFLEET_BIND`, right only where buyers reach this very address).
    pub public_url_given: bool,
    /// The RPC's timeout, the queues' namespace, the order messages' routes.
    pub messaging: crate::messaging::Settings,
    /// The invoices' time zone.
    pub ledger: crate::ledger::Settings,
    /// The recurring jobs worker processes schedule (`jobs/recurring.toml`).
    pub recurring: crate::recurring::Schedules,
    /// How long work in flight may take before the consistency checks report it.
    pub consistency: crate::consistency::Settings,
    /// Missed-webhook reconciliation: grace, sessions per gateway per run, pace.
    pub reconcile: crate::payments::reconcile::Settings,
    /// Batch transactions of payment events a worker process runs at once, when set
    /// (`PAYFLEET_EVENT_BATCHES`; `payments::batch::BatchSettings::for_process`).
    pub event_batches: Option<usize>,
}

/// An operator's token: at least 32 visible characters.
fn token(env: &dyn Env, name: &'static str) -> Result<Option<Token>, ConfigError> {
    var(env, name)
        .map(|v| Token::parse(&v).map_err(|problem| invalid(name, problem)))
        .transpose()
}

fn url(
    env: &dyn Env,
    name: &'static str,
    default: &str,
    schemes: &[&str],
) -> Result<SecretUrl, ConfigError> {
    let value = var(env, name).unwrap_or_else(|| default.to_owned());
    if !schemes
        .iter()
        .any(|s| value.starts_with(&format!("{s}://")))
    {
        return Err(invalid(
            name,
            format!("must start with {}", schemes.join(":// or ") + "://"),
        ));
    }
    Ok(SecretUrl::new(value))
}

/// Refuses an `AMQP_URL` the broker client could not use as written, at start rather than in
/// a reconnect loop that never ends (a port that is not a number, say). The client
/// reads an IPv6 address as the host `localhost`: refused too, rather than connecting to
/// another broker or none. The message never repeats the URL (it holds the password).
fn amqp_url_usable(value: &str) -> Result<(), ConfigError> {
    if let Err(e) = value.parse::<lapin::uri::AMQPUri>() {
        let problem = if e.contains(value) {
            "is not a URL with a host".to_owned()
        } else {
            e
        };
        return Err(invalid("AMQP_URL", format!("cannot be used: {problem}")));
    }
    let after_scheme = value.split_once("://").map_or(value, |(_, rest)| rest);
    let authority = after_scheme.split('/').next().unwrap_or_default();
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host.starts_with('[') {
        return Err(invalid(
            "AMQP_URL",
            "an IPv6 address as its host is read as localhost by the broker client: use a host name",
        ));
    }
    Ok(())
}

/// `PAYFLEET_LISTEN_URL`: unset, the session-level work uses DATABASE_URL (no pooler in
/// between); a URL, a direct connection to PostgreSQL for it; `off`, none (workers poll, and
/// migrations run without their lock: run `payfleet migrate` from one place).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenTo {
    Database,
    Direct(SecretUrl),
    Off,
}

impl Config {
    /// Where migrations run: the direct connection when there is one (sqlx's migrator holds a
    /// session-level advisory lock, which a pooler in transaction mode would hand to someone
    /// else's transaction), and whether they may take that lock.
    pub fn migrations_url(&self) -> (&SecretUrl, bool) {
        match &self.listen {
            ListenTo::Database => (&self.database_url, true),
            ListenTo::Direct(url) => (url, true),
            ListenTo::Off => (&self.database_url, false),
        }
    }
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from(&ProcessEnv)
    }

    /// Reads `env`. Webhook secrets are only those configured (`up` adds the hosted gateways'
    /// own: `demo::development_config`).
    pub fn from(env: &dyn Env) -> Result<Self, ConfigError> {
        let database_url = url(
            env,
            "DATABASE_URL",
            DEFAULT_DATABASE_URL,
            &["postgres", "postgresql"],
        )?;
        let amqp_url = url(env, "AMQP_URL", DEFAULT_AMQP_URL, &["amqp", "amqps"])?;
        amqp_url_usable(amqp_url.expose())?;
        let default_bind: SocketAddr = DEFAULT_BIND
            .parse()
            .map_err(|e| invalid("PAYFLEET_BIND", format!("{e}")))?;
        let bind = parsed(env, "PAYFLEET_BIND", default_bind)?;
        let worker_bind = var(env, "PAYFLEET_WORKER_BIND")
            .map(|v| {
                v.parse::<SocketAddr>()
                    .map_err(|e| invalid("PAYFLEET_WORKER_BIND", format!("{v:?}: {e}")))
            })
            .transpose()?;
        let db_pool_size = parsed(env, "PAYFLEET_DB_POOL_SIZE", 20u32)?;
        let listen = match var(env, "PAYFLEET_LISTEN_URL") {
            None => ListenTo::Database,
            Some(v) if v == "off" => ListenTo::Off,
            Some(_) => ListenTo::Direct(url(
                env,
                "PAYFLEET_LISTEN_URL",
                "",
                &["postgres", "postgresql"],
            )?),
        };
        if db_pool_size < 4 {
            return Err(invalid("PAYFLEET_DB_POOL_SIZE", "must be at least 4"));
        }
        let queues = match var(env, "PAYFLEET_QUEUES") {
            Some(path) => QueuesConfig::from_file(&PathBuf::from(path))?,
            None => {
                let local = PathBuf::from("jobs/queues.toml");
                if local.is_file() {
                    QueuesConfig::from_file(&local)?
                } else {
                    QueuesConfig::parse(BUILT_IN_QUEUES, "the built-in jobs/queues.toml")?
                }
            }
        };
        let recurring = match var(env, "PAYFLEET_RECURRING").as_deref() {
            Some("off") => crate::recurring::Schedules::none(),
            Some(path) => crate::recurring::Schedules::from_file(&PathBuf::from(path))?,
            None => {
                let local = PathBuf::from("jobs/recurring.toml");
                if local.is_file() {
                    crate::recurring::Schedules::from_file(&local)?
                } else {
                    crate::recurring::Schedules::built_in()?
                }
            }
        };
        let admin_token = token(env, "PAYFLEET_ADMIN_TOKEN")?;
        let metrics_token = token(env, "PAYFLEET_METRICS_TOKEN")?;
        let metrics_refresh_ms = parsed(env, "PAYFLEET_METRICS_REFRESH_MS", 5000u64)?;
        if !(1000..=600_000).contains(&metrics_refresh_ms) {
            return Err(invalid(
                "PAYFLEET_METRICS_REFRESH_MS",
                "must be 1000 to 600000: scrapes must not set the database's pace",
            ));
        }
        let metrics_refresh = std::time::Duration::from_millis(metrics_refresh_ms);
        let public_url = http_url(env, "PAYFLEET_PUBLIC_URL", &format!("http://{bind}"))?;
        let public_url_given = var(env, "PAYFLEET_PUBLIC_URL").is_some();
        let gateways = crate::gateways::Settings::from_env(env, &public_url)?;
        let messaging = crate::messaging::Settings::from_env(env)?;
        let host_name = var(env, "HOSTNAME")
            .or_else(|| {
                std::fs::read_to_string("/etc/hostname")
                    .ok()
                    .map(|h| h.trim().to_owned())
            })
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "host".to_owned());
        Ok(Self {
            database_url,
            amqp_url,
            bind,
            worker_bind,
            db_pool_size,
            listen,
            gateways,
            webhooks: crate::webhooks::Settings::from_env(env)?,
            queues,
            host_name,
            admin_token,
            development: false,
            metrics_token,
            metrics_refresh,
            http: HttpSettings::from_env(env)?.covering(messaging.rpc_timeout),
            orders: crate::orders::Settings::from_env(env)?,
            public_url,
            public_url_given,
            messaging,
            recurring,
            ledger: crate::ledger::Settings::from_env(env)?,
            consistency: crate::consistency::Settings::from_env(env)?,
            reconcile: crate::payments::reconcile::Settings::from_env(env)?,
            event_batches: crate::payments::batch::in_flight_from_env(env)?,
        })
    }
}

/// The log filter (`RUST_LOG`), read before the rest so start-up errors are logged too.
pub fn log_filter() -> String {
    var(&ProcessEnv, "RUST_LOG").unwrap_or_else(|| "info,sqlx=warn".to_owned())
}

/// How log lines are written (`PAYFLEET_LOG_FORMAT`): text for people, JSON (one object per
/// line, with the spans' fields) for log pipelines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

pub fn log_format() -> Result<LogFormat, ConfigError> {
    match var(&ProcessEnv, "PAYFLEET_LOG_FORMAT").as_deref() {
        None | Some("text") => Ok(LogFormat::Text),
        Some("json") => Ok(LogFormat::Json),
        Some(other) => Err(invalid(
            "PAYFLEET_LOG_FORMAT",
            format!("{other:?}: text or json"),
        )),
    }
}

/// Threads of a process's async runtime (`PAYFLEET_RUNTIME_THREADS`, 1 to 256), for its role
/// as [`crate::traces`] names it (`serve`, `work`, `up`, or the command). `None`: the runtime's
/// default, one per core.
///
/// A worker process (`work`) runs on one thread unless told otherwise. Its jobs wait on
/// PostgreSQL, the broker and the gateways, not on its own CPU (a fleet's workers used 14 to 16 %
/// of the machine while PostgreSQL used about 60 % in `bench e2e`'s drains), and with a second
/// thread each of the many small hand-offs of a batch (a claim's jobs to the batcher, the
/// batch's replies back, the completer's batch) could wake a thread parked on the other core:
/// a futex and a context switch, which on the machine measured cost more than the hand-off
/// itself. A fleet grows by worker processes (docs/scaling.md), each with its own pools.
pub fn runtime_threads(env: &dyn Env, role: &str) -> Result<Option<usize>, ConfigError> {
    const NAME: &str = "PAYFLEET_RUNTIME_THREADS";
    match var(env, NAME) {
        None => Ok((role == "work").then_some(1)),
        Some(_) => {
            let n: usize = parsed(env, NAME, 0)?;
            if !(1..=256).contains(&n) {
                return Err(invalid(NAME, format!("{n}: must be 1 to 256")));
            }
            Ok(Some(n))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_runs_on_one_thread_unless_told_and_others_on_the_default() {
        let unset: [(&str, &str); 0] = [];
        assert_eq!(runtime_threads(&unset, "work").ok(), Some(Some(1)));
        assert_eq!(runtime_threads(&unset, "serve").ok(), Some(None));
        assert_eq!(runtime_threads(&unset, "up").ok(), Some(None));
        let four = [("PAYFLEET_RUNTIME_THREADS", "4")];
        assert_eq!(runtime_threads(&four, "work").ok(), Some(Some(4)));
        assert_eq!(runtime_threads(&four, "serve").ok(), Some(Some(4)));
        for bad in ["0", "257", "two", "-1"] {
            let env = [("PAYFLEET_RUNTIME_THREADS", bad)];
            let err = runtime_threads(&env, "work").expect_err(bad).to_string();
            assert!(err.contains("PAYFLEET_RUNTIME_THREADS"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_built_in_queues_parse() {
        let c = QueuesConfig::parse(BUILT_IN_QUEUES, "t").expect("built-in queues");
        for queue in ["default", "events", "orders", "payments", "recurring"] {
            assert!(c.queue(queue).is_some(), "{queue}");
        }
    }

    #[test]
    fn secrets_and_passwords_never_reach_debug_output() {
        let env = [
            (
                "DATABASE_URL",
                "postgres://app:db-password-123@db:5432/payfleet",
            ),
            ("AMQP_URL", "amqp://app:amqp-password-456@mq:5672/%2f"),
            ("STRIPE_WEBHOOK_SECRET", "whsec_stripe_secret_789"),
            ("MERCADOPAGO_WEBHOOK_SECRET", "mp-webhook-secret-abc"),
            ("RAZORPAY_WEBHOOK_SECRET", "rzp-webhook-secret-def"),
            (
                "INTERNAL_WEBHOOK_SECRET",
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            ),
            ("MERCADOPAGO_ACCESS_TOKEN", "APP_USR-token-ghi"),
            ("STRIPE_SECRET_KEY", "sk_test_stripe_key_jkl"),
            ("RAZORPAY_KEY_ID", "rzp_test_id"),
            ("RAZORPAY_KEY_SECRET", "rzp-key-secret-mno"),
            (
                "PAYFLEET_ADMIN_TOKEN",
                "admin-token-pqr-0123456789-0123456789",
            ),
            ("PAYFLEET_QUEUES", "jobs/queues.toml"),
        ];
        let config = Config::from(&env).unwrap();
        let printed = format!("{config:?} {} {}", config.database_url, config.amqp_url);
        for secret in [
            "db-password-123",
            "amqp-password-456",
            "whsec_stripe_secret_789",
            "mp-webhook-secret-abc",
            "rzp-webhook-secret-def",
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "APP_USR-token-ghi",
            "sk_test_stripe_key_jkl",
            "rzp-key-secret-mno",
            "admin-token-pqr-0123456789-0123456789",
        ] {
            assert!(!printed.contains(secret), "{secret} printed in {printed}");
        }
        assert!(
            printed.contains("postgres://app:***@db:5432/payfleet"),
            "{printed}"
        );
        assert_eq!(
            config.database_url.expose(),
            "postgres://app:db-password-123@db:5432/payfleet"
        );
    }

    #[test]
    fn the_event_batches_in_flight_are_one_to_eight_or_two() {
        let with = |v: &'static str| {
            Config::from(&[
                ("PAYFLEET_EVENT_BATCHES", v),
                ("PAYFLEET_QUEUES", "jobs/queues.toml"),
            ])
        };
        assert_eq!(with("").unwrap().event_batches, None);
        assert_eq!(with("1").unwrap().event_batches, Some(1));
        assert_eq!(with("8").unwrap().event_batches, Some(8));
        for bad in ["0", "9", "two", "-1"] {
            let e = with(bad).unwrap_err().to_string();
            assert!(
                e.starts_with("PAYFLEET_EVENT_BATCHES is not valid"),
                "{bad}: {e}"
            );
        }
        use crate::payments::batch::BatchSettings;
        let unset = BatchSettings::for_process(None);
        assert_eq!((unset.in_flight, unset.in_flight_in_fleet), (2, 1));
        for n in [1, 3] {
            let set = BatchSettings::for_process(Some(n));
            assert_eq!((set.in_flight, set.in_flight_in_fleet), (n, n));
        }
    }

    #[test]
    fn an_invalid_setting_names_itself() {
        let e = Config::from(&[
            ("PAYFLEET_DB_POOL_SIZE", "2"),
            ("PAYFLEET_QUEUES", "jobs/queues.toml"),
        ])
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "PAYFLEET_DB_POOL_SIZE is not valid: must be at least 4"
        );
        let e = Config::from(&[
            ("DATABASE_URL", "mysql://x"),
            ("PAYFLEET_QUEUES", "jobs/queues.toml"),
        ])
        .unwrap_err();
        assert!(
            e.to_string().starts_with("DATABASE_URL is not valid"),
            "{e}"
        );
        let e = Config::from(&[
            ("INTERNAL_WEBHOOK_SECRET", "whsec_short"),
            ("PAYFLEET_QUEUES", "jobs/queues.toml"),
        ])
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("INTERNAL_WEBHOOK_SECRET is not valid"),
            "{e}"
        );
    }

    #[test]
    fn settings_that_would_switch_reconciliation_or_the_checks_off_are_refused() {
        let q = ("PAYFLEET_QUEUES", "jobs/queues.toml");
        for (name, value) in [
            ("PAYFLEET_RECONCILE_PER_RUN", "0"),
            ("PAYFLEET_RECONCILE_GRACE_SECS", "99999999999999999"),
            ("PAYFLEET_CONSISTENCY_GRACE_SECS", "99999999999999999"),
            ("PAYFLEET_RECONCILE_PACE_MS", "3600000"),
        ] {
            let e = Config::from(&[(name, value), q]).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{name} is not valid")) && e.contains("is not between"),
                "{name}={value}: {e}"
            );
        }
        let c = Config::from(&[("PAYFLEET_RECONCILE_PER_RUN", "1"), q]).unwrap();
        assert_eq!(c.reconcile.per_run, 1);
    }

    #[test]
    fn an_amqp_url_the_client_cannot_use_is_refused_without_its_password() {
        let q = ("PAYFLEET_QUEUES", "jobs/queues.toml");
        for (url, said) in [
            ("amqp://guest:s3cret@host:notaport/%2f", "cannot be used"),
            ("amqp://guest:s3cret@[2001:db8::1]:5672/%2f", "IPv6"),
        ] {
            let e = Config::from(&[("AMQP_URL", url), q])
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("AMQP_URL is not valid"), "{url}: {e}");
            assert!(e.contains(said), "{url}: {e}");
            assert!(!e.contains("s3cret"), "{url}: {e}");
        }
        for url in [
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqps://u:p@mq.example.com/vhost",
            "amqp://mq:5672",
        ] {
            Config::from(&[("AMQP_URL", url), q]).unwrap();
        }
    }

    #[test]
    fn the_trust_settings_refuse_weak_or_unsafe_values() {
        let q = ("PAYFLEET_QUEUES", "jobs/queues.toml");
        let problem = |env: &[(&str, &str); 2]| Config::from(env).unwrap_err().to_string();
        // A webhook secret short enough to guess: anyone could sign a payment with it.
        for name in [
            "STRIPE_WEBHOOK_SECRET",
            "STRIPE_PLATFORM_WEBHOOK_SECRET",
            "MERCADOPAGO_WEBHOOK_SECRET",
            "RAZORPAY_WEBHOOK_SECRET",
        ] {
            let said = problem(&[(name, "rzp-fifteen-chr"), q]);
            assert!(
                said.starts_with(&format!("{name} is not valid")) && said.contains("16 characters"),
                "{said}"
            );
            Config::from(&[(name, "rzp-sixteen-chrs"), q]).unwrap();
        }
        assert!(
            problem(&[("PAYFLEET_ADMIN_TOKEN", "sixteen-chars-ok"), q])
                .contains("at least 32 characters")
        );
        assert!(
            problem(&[("PAYFLEET_METRICS_TOKEN", "short"), q]).contains("PAYFLEET_METRICS_TOKEN")
        );
        assert!(
            problem(&[("PAYFLEET_WEBHOOK_TOLERANCE_SECS", "601"), q]).contains("ten minutes"),
            "a replay window of more than ten minutes is refused"
        );
        let clear = Config::from(&[
            ("STRIPE_SECRET_KEY", "sk_test_x"),
            ("STRIPE_API_URL", "http://api.stripe.example"),
            q,
        ])
        .unwrap_err()
        .to_string();
        assert!(
            clear.contains("https"),
            "a gateway's API in the clear: {clear}"
        );
        assert!(problem(&[("PAYFLEET_PAYMENT_SIMULATOR", "yes"), q]).contains("on or off"));
        assert!(problem(&[("PAYFLEET_INTERNAL_ACQUIRER", "paypal"), q]).contains("stripe"));
        // A local stand-in may be plain http; the defaults are safe.
        let c = Config::from(&[
            ("RAZORPAY_KEY_ID", "k"),
            ("RAZORPAY_KEY_SECRET", "s"),
            ("RAZORPAY_API_URL", "http://127.0.0.1:9999"),
            q,
        ])
        .unwrap();
        assert_eq!(
            c.gateways.razorpay.api.unwrap().base_url,
            "http://127.0.0.1:9999"
        );
        let c = Config::from(&[q]).unwrap();
        assert!(!c.gateways.hosted.simulator);
        assert_eq!(c.gateways.internal_acquirer(), None);
        assert_eq!(c.http.header_timeout, std::time::Duration::from_secs(10));
        assert_eq!(c.http.body_timeout, std::time::Duration::from_secs(30));
        assert!(c.http.client_address_header.is_none());
    }
}
