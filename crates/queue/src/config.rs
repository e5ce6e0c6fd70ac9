//! The operator-editable settings of the fleet and of each queue, as TOML (payfleet ships its
//! own as `jobs/queues.toml`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum QueuesConfigError {
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid queue configuration in {origin}")]
    Parse {
        origin: String,
        #[source]
        source: toml::de::Error,
    },
    #[error("invalid queue configuration in {origin}: {problem}")]
    Invalid { origin: String, problem: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueuesConfig {
    #[serde(default)]
    pub fleet: FleetSettings,
    pub queues: BTreeMap<String, QueueSettings>,
    /// Every queue the catalogue defines, including those [`QueuesConfig::only`] leaves out of
    /// this process's `queues` (another process works them).
    #[serde(skip)]
    pub defined: std::collections::BTreeSet<String>,
}

/// Settings shared by every queue of one worker process.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetSettings {
    /// Longest sleep between claims when no notification arrives.
    pub poll_interval_ms: u64,
    /// How long a claim is held without renewal; renewed every third of it while the job runs.
    pub lease_ms: u64,
    /// How often expired leases are looked for.
    pub rescue_interval_ms: u64,
    pub completed_retention_secs: u64,
    /// Dead jobs stay longer, for operators to inspect and retry.
    pub discarded_retention_secs: u64,
    /// How long a stopping worker waits for running jobs before releasing them.
    pub shutdown_timeout_ms: u64,
    /// Most jobs claimed in one statement, in every queue that does not set its own
    /// (`QueueSettings::claim_batch`, which may be larger or smaller).
    pub claim_batch: u32,
    /// Most run endings written in one statement.
    pub complete_batch: u32,
    /// The fleet vacuums the jobs table itself once this many of its rows are dead (0: leave it
    /// to autovacuum). Every claimed job leaves dead entries at the head of the claim indexes
    /// that each claim steps over until a vacuum removes them; autovacuum's defaults wait for a
    /// fifth of the table, and a server may run without it.
    pub vacuum_dead_rows: u64,
    /// How the fleet's claims and run ends commit: PostgreSQL's `synchronous_commit` for those
    /// statements' own transactions (see `BookkeepingCommit`).
    pub bookkeeping_synchronous_commit: BookkeepingCommit,
}

/// PostgreSQL's `synchronous_commit`, for the transactions of the fleet's claims and run ends
/// only: set with `set_config(..., true)` inside each statement, so nothing stays on the session
/// (a pooled connection, PgBouncer's included, goes back as it came).
///
/// `off` (the default) lets a claim or an end return before its WAL record is flushed. A crash
/// of PostgreSQL itself can then forget the last fraction of a second of them: a forgotten
/// claim makes the job claimable again, a forgotten end leaves the run to be rescued, so the
/// job runs again, as it does after any worker crash. No effect is lost or doubled by it:
/// handlers commit their own writes synchronously (the WAL is one sequence, so that flush also
/// makes every earlier claim durable), and are idempotent. `on` waits for the flush, as every
/// business transaction does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BookkeepingCommit {
    On,
    Off,
    Local,
    RemoteWrite,
    RemoteApply,
}

impl BookkeepingCommit {
    /// The value as PostgreSQL spells it.
    pub(crate) fn setting(self) -> &'static str {
        match self {
            Self::On => "on",
            Self::Off => "off",
            Self::Local => "local",
            Self::RemoteWrite => "remote_write",
            Self::RemoteApply => "remote_apply",
        }
    }
}

impl Default for FleetSettings {
    fn default() -> Self {
        Self {
            poll_interval_ms: 1000,
            lease_ms: 30_000,
            rescue_interval_ms: 5_000,
            completed_retention_secs: 24 * 3600,
            discarded_retention_secs: 7 * 24 * 3600,
            shutdown_timeout_ms: 10_000,
            claim_batch: 500,
            complete_batch: 2000,
            vacuum_dead_rows: 100_000,
            bookkeeping_synchronous_commit: BookkeepingCommit::Off,
        }
    }
}

impl FleetSettings {
    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_interval_ms)
    }
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }
    pub fn rescue_interval(&self) -> Duration {
        Duration::from_millis(self.rescue_interval_ms)
    }
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSettings {
    /// Jobs of this queue run at once in one worker process.
    pub concurrency: u32,
    /// A run longer than this is stopped and retried.
    pub timeout_ms: u64,
    /// Claim statements of this queue in flight at once in one worker process, sharing its
    /// slots. One is enough for most queues; a queue of many short jobs drains faster with two,
    /// since PostgreSQL works on one claim while the worker starts the jobs of the other.
    #[serde(default = "one_claimer")]
    pub claimers: u32,
    /// The least time between two claims of one claim loop (River's fetch cooldown). Under a
    /// flood of short jobs, slots free up one by one; without a pause each claim takes the few
    /// freed since the last, and the claims' own cost grows to rival the jobs'. 0: none.
    #[serde(default)]
    pub fetch_cooldown_ms: u64,
    /// Most jobs one claim of this queue takes (unset: the fleet's `claim_batch`). None of a
    /// claim's jobs starts before its statement returns, and a bigger claim takes longer, so a
    /// worker started on a backlog waits for its whole first claim. A queue whose jobs are
    /// worked in batches (payfleet's `events` queue) needs only about two batches'
    /// worth a claim; its slots still fill, since the next claim follows at once.
    #[serde(default)]
    pub claim_batch: Option<u32>,
}

fn one_claimer() -> u32 {
    1
}

impl QueueSettings {
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    pub fn fetch_cooldown(&self) -> Duration {
        Duration::from_millis(self.fetch_cooldown_ms)
    }

    /// Most jobs one claim of this queue takes in a fleet claiming at most `fleet` at once.
    pub fn claim_batch(&self, fleet: u32) -> u32 {
        self.claim_batch.unwrap_or(fleet)
    }
}

impl QueuesConfig {
    /// Reads `path`; a missing file is an error, since the operator named it.
    pub fn from_file(path: &Path) -> Result<Self, QueuesConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| QueuesConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, origin: &str) -> Result<Self, QueuesConfigError> {
        let mut config: Self = toml::from_str(text).map_err(|source| QueuesConfigError::Parse {
            origin: origin.to_owned(),
            source,
        })?;
        config.defined = config.queues.keys().cloned().collect();
        let invalid = |problem: String| QueuesConfigError::Invalid {
            origin: origin.to_owned(),
            problem,
        };
        if config.queues.is_empty() {
            return Err(invalid("no [queues.NAME] section".into()));
        }
        for (name, q) in &config.queues {
            if q.concurrency == 0 {
                return Err(invalid(format!(
                    "queue {name}: concurrency must be at least 1"
                )));
            }
            if q.claimers == 0 {
                return Err(invalid(format!(
                    "queue {name}: claimers must be at least 1"
                )));
            }
            if q.claim_batch == Some(0) {
                return Err(invalid(format!(
                    "queue {name}: claim_batch must be at least 1"
                )));
            }
            if q.timeout_ms == 0 {
                return Err(invalid(format!(
                    "queue {name}: timeout_ms must be at least 1"
                )));
            }
        }
        let f = &config.fleet;
        if f.lease_ms < 300 {
            return Err(invalid("fleet.lease_ms must be at least 300".into()));
        }
        if f.claim_batch == 0 || f.complete_batch == 0 || f.poll_interval_ms == 0 {
            return Err(invalid(
                "fleet.claim_batch, complete_batch and poll_interval_ms must be positive".into(),
            ));
        }
        if f.rescue_interval_ms == 0 {
            return Err(invalid("fleet.rescue_interval_ms must be positive".into()));
        }
        // A job due more than a minute ahead wakes no worker (store::ENQUEUE_MANY): every worker
        // must look again sooner than that.
        if f.poll_interval_ms > 60_000 {
            return Err(invalid(
                "fleet.poll_interval_ms must be at most 60000 (a job scheduled a minute ahead or more wakes no worker; each looks again within its poll interval)".into(),
            ));
        }
        Ok(config)
    }

    pub fn queue(&self, name: &str) -> Option<&QueueSettings> {
        self.queues.get(name)
    }

    /// Keeps only the named queues (a process dedicated to some queues: `work --queues`).
    pub fn only(&mut self, names: &[String]) -> Result<(), QueuesConfigError> {
        if let Some(unknown) = names.iter().find(|n| !self.queues.contains_key(*n)) {
            return Err(self.flag_error(format!(
                "--queues names {unknown:?}, which is not a queue (known: {})",
                self.queues.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        self.queues.retain(|name, _| names.contains(name));
        Ok(())
    }

    /// Sets a queue's concurrency from `QUEUE=N` (`work --concurrency events=16`).
    pub fn set_concurrency(&mut self, assignment: &str) -> Result<(), QueuesConfigError> {
        let parsed = assignment
            .split_once('=')
            .and_then(|(q, n)| Some((q.trim(), n.trim().parse::<u32>().ok()?)));
        let Some((queue, n)) = parsed.filter(|(_, n)| *n > 0) else {
            return Err(self.flag_error(format!(
                "--concurrency {assignment:?} is not QUEUE=N with N at least 1"
            )));
        };
        match self.queues.get_mut(queue) {
            Some(q) => {
                q.concurrency = n;
                Ok(())
            }
            None => Err(self.flag_error(format!(
                "--concurrency names {queue:?}, which is not a queue"
            ))),
        }
    }

    fn flag_error(&self, problem: String) -> QueuesConfigError {
        QueuesConfigError::Invalid {
            origin: "the command line".into(),
            problem,
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn flags_narrow_the_queues_and_set_concurrency_or_say_what_is_wrong() {
        let mut c = QueuesConfig::parse(
            "[queues.default]\nconcurrency = 10\ntimeout_ms = 100\n\
             [queues.events]\nconcurrency = 10\ntimeout_ms = 100\n\
             [queues.payments]\nconcurrency = 10\ntimeout_ms = 100\n",
            "t",
        )
        .unwrap();
        c.only(&["events".to_owned(), "payments".to_owned()])
            .unwrap();
        assert_eq!(c.queues.keys().collect::<Vec<_>>(), ["events", "payments"]);
        c.set_concurrency("events=16").unwrap();
        assert_eq!(c.queue("events").unwrap().concurrency, 16);
        for bad in ["events", "events=0", "events=x", "ledger=4"] {
            let e = c.set_concurrency(bad).unwrap_err().to_string();
            assert!(e.contains("--concurrency"), "{e}");
        }
        let e = c.only(&["nope".to_owned()]).unwrap_err().to_string();
        assert!(e.contains("\"nope\"") && e.contains("events"), "{e}");
        assert_eq!(c.queues.len(), 2, "a refused flag changes nothing");
    }

    use super::*;

    #[test]
    fn unknown_fields_and_zero_concurrency_or_claimers_are_rejected() {
        let e = QueuesConfig::parse(
            "[queues.a]\nconcurrency = 1\ntimeout_ms = 5\nspeed = 3\n",
            "t",
        )
        .unwrap_err();
        assert!(e.to_string().contains("invalid queue configuration"), "{e}");
        let e =
            QueuesConfig::parse("[queues.a]\nconcurrency = 0\ntimeout_ms = 5\n", "t").unwrap_err();
        assert!(
            e.to_string().contains("concurrency must be at least 1"),
            "{e}"
        );
        let e = QueuesConfig::parse(
            "[queues.a]\nconcurrency = 4\ntimeout_ms = 5\nclaimers = 0\n",
            "t",
        )
        .unwrap_err();
        assert!(e.to_string().contains("claimers must be at least 1"), "{e}");
        let c = QueuesConfig::parse("[queues.a]\nconcurrency = 4\ntimeout_ms = 5\n", "t").unwrap();
        assert_eq!(c.queue("a").map(|q| q.claimers), Some(1), "one by default");
    }

    #[test]
    fn a_poll_interval_beyond_a_minute_is_refused() {
        let queue = "[queues.a]\nconcurrency = 4\ntimeout_ms = 5\n";
        let e = QueuesConfig::parse(&format!("[fleet]\npoll_interval_ms = 60001\n{queue}"), "t")
            .unwrap_err();
        assert!(e.to_string().contains("at most 60000"), "{e}");
        QueuesConfig::parse(&format!("[fleet]\npoll_interval_ms = 60000\n{queue}"), "t").unwrap();
    }
}
