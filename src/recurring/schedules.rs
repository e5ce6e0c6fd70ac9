//! `jobs/recurring.toml`: one table per recurring job, with its `cron` expression (the `cron`
//! crate's syntax, seconds first), an optional IANA `timezone` (default UTC), `enabled`
//! (default true) and `catch_up_secs` (how old a missed period may be and still run once at
//! start-up; default a day). Read and checked at start-up: an unknown name, an expression that
//! does not parse or a time zone that does not exist stops start-up with the line that holds it.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use toml::Spanned;

/// The schedules shipped with the binary; used when no file is configured or found.
const BUILT_IN: &str = include_str!("../../jobs/recurring.toml");

/// The recurring jobs this fleet knows how to run.
pub const KNOWN: &[&str] = &[
    "payouts",
    "invoices",
    "holding_release",
    "reconcile",
    "consistency",
    "prune",
    "subscription_billing",
];

const DEFAULT_CATCH_UP: Duration = Duration::from_secs(24 * 3600);
/// The shortest `catch_up_secs` allowed: a period is looked at a moment after its time, so a
/// limit near zero skips every run.
const MIN_CATCH_UP_SECS: u64 = 60;

#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid recurring jobs in {origin}")]
    Parse {
        origin: String,
        #[source]
        source: toml::de::Error,
    },
    #[error("{origin}, line {line}: {problem}")]
    Invalid {
        origin: String,
        line: usize,
        problem: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    cron: Spanned<String>,
    timezone: Option<Spanned<String>>,
    #[serde(default = "yes")]
    enabled: bool,
    catch_up_secs: Option<u64>,
}

fn yes() -> bool {
    true
}

/// One recurring job: when it runs, in which time zone.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub name: String,
    pub cron: cron::Schedule,
    pub timezone: chrono_tz::Tz,
    pub enabled: bool,
    /// A missed period older than this is not run at start-up.
    pub catch_up: Duration,
}

impl Schedule {
    /// The latest period at or before `now`: the run that should have started by now.
    pub fn latest(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let local = now.with_timezone(&self.timezone);
        // `after` starts strictly after its argument: one second on, so that a period falling
        // exactly on `now` counts as due.
        let probe = local + chrono::Duration::seconds(1);
        self.cron
            .after(&probe)
            .rev()
            .map(|t| t.with_timezone(&Utc))
            // The probe's own second may be a period still ahead of `now`.
            .find(|t| *t <= now)
    }

    /// The first period after `now`.
    pub fn next(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron
            .after(&now.with_timezone(&self.timezone))
            .next()
            .map(|t| t.with_timezone(&Utc))
    }
}

/// Every recurring job of the fleet, by name.
#[derive(Debug, Clone, Default)]
pub struct Schedules {
    pub list: Vec<Schedule>,
    /// Where they were read from, for messages.
    pub origin: String,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

impl Schedules {
    /// No recurring jobs at all (`PAYFLEET_RECURRING=off`: tests, maintenance windows).
    pub fn none() -> Self {
        Self {
            list: Vec::new(),
            origin: "PAYFLEET_RECURRING=off".into(),
        }
    }

    pub fn built_in() -> Result<Self, ScheduleError> {
        Self::parse(BUILT_IN, "the built-in jobs/recurring.toml")
    }

    pub fn from_file(path: &Path) -> Result<Self, ScheduleError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScheduleError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, origin: &str) -> Result<Self, ScheduleError> {
        let entries: BTreeMap<String, Entry> =
            toml::from_str(text).map_err(|source| ScheduleError::Parse {
                origin: origin.to_owned(),
                source,
            })?;
        let invalid = |offset: usize, problem: String| ScheduleError::Invalid {
            origin: origin.to_owned(),
            line: line_of(text, offset),
            problem,
        };
        let mut list = Vec::new();
        for (name, e) in entries {
            let at = e.cron.span().start;
            if !KNOWN.contains(&name.as_str()) {
                return Err(invalid(
                    at,
                    format!(
                        "[{name}] is not a recurring job this fleet knows (it knows {})",
                        KNOWN.join(", ")
                    ),
                ));
            }
            let cron = cron::Schedule::from_str(e.cron.get_ref()).map_err(|err| {
                invalid(
                    at,
                    format!(
                        "[{name}] cron {:?} is not a cron expression (seconds first: \"0 30 0 * * *\"): {err}",
                        e.cron.get_ref()
                    ),
                )
            })?;
            let timezone = match &e.timezone {
                None => chrono_tz::UTC,
                Some(tz) => tz.get_ref().parse().map_err(|_| {
                    invalid(
                        tz.span().start,
                        format!(
                            "[{name}] timezone {:?} is not an IANA time zone (\"America/Sao_Paulo\")",
                            tz.get_ref()
                        ),
                    )
                })?,
            };
            if cron.upcoming(timezone).next().is_none() {
                return Err(invalid(
                    at,
                    format!("[{name}] cron {:?} never fires again", e.cron.get_ref()),
                ));
            }
            if let Some(secs) = e.catch_up_secs
                && secs < MIN_CATCH_UP_SECS
            {
                return Err(invalid(
                    at,
                    format!(
                        "[{name}] catch_up_secs = {secs} is below {MIN_CATCH_UP_SECS}: a period is looked at a moment after its time (a second or more on a busy fleet), so a smaller limit would skip every run, not only the ones missed while the fleet was down"
                    ),
                ));
            }
            list.push(Schedule {
                name,
                cron,
                timezone,
                enabled: e.enabled,
                catch_up: e
                    .catch_up_secs
                    .map(Duration::from_secs)
                    .unwrap_or(DEFAULT_CATCH_UP),
            });
        }
        Ok(Self {
            list,
            origin: origin.to_owned(),
        })
    }

    pub fn get(&self, name: &str) -> Option<&Schedule> {
        self.list.iter().find(|s| s.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_catch_up_too_short_for_any_run_is_refused() {
        let text = "[payouts]\ncron = \"0 30 0 * * *\"\ncatch_up_secs = 0\n";
        let e = Schedules::parse(text, "r.toml").unwrap_err().to_string();
        assert!(
            e.starts_with("r.toml, line 2: [payouts] catch_up_secs = 0 is below 60"),
            "{e}"
        );
        let text = "[payouts]\ncron = \"0 30 0 * * *\"\ncatch_up_secs = 60\n";
        let s = Schedules::parse(text, "r.toml").unwrap();
        assert_eq!(s.list[0].catch_up, Duration::from_secs(60));
    }

    #[test]
    fn the_shipped_schedules_read() {
        let s = Schedules::built_in().unwrap();
        assert_eq!(s.list.len(), KNOWN.len());
    }

    #[test]
    fn a_bad_line_is_named() {
        let text = "[payouts]\ncron = \"0 30 0 * * *\"\n\n[invoices]\ncron = \"every day\"\n";
        let e = Schedules::parse(text, "r.toml").unwrap_err().to_string();
        assert!(
            e.starts_with("r.toml, line 5: [invoices] cron \"every day\""),
            "{e}"
        );
        let text = "[payouts]\ncron = \"0 30 0 * * *\"\ntimezone = \"Mars/Olympus\"\n";
        let e = Schedules::parse(text, "r.toml").unwrap_err().to_string();
        assert!(e.starts_with("r.toml, line 3: [payouts] timezone"), "{e}");
        let text = "[payout]\ncron = \"0 30 0 * * *\"\n";
        let e = Schedules::parse(text, "r.toml").unwrap_err().to_string();
        assert!(e.contains("line 2: [payout] is not a recurring job"), "{e}");
        let text = "[payouts]\ncron = \"0 30 0 * * *\"\nevery = 3\n";
        assert!(Schedules::parse(text, "r.toml").is_err());
    }

    #[test]
    fn the_latest_period_is_in_the_schedules_time_zone() {
        let text = "[payouts]\ncron = \"0 30 0 * * *\"\ntimezone = \"America/Sao_Paulo\"\n";
        let s = Schedules::parse(text, "r.toml").unwrap();
        let p = &s.list[0];
        // 00:30 in São Paulo (UTC−3) is 03:30 UTC.
        let now: DateTime<Utc> = "2026-03-10T04:00:00Z".parse().unwrap();
        assert_eq!(
            p.latest(now).unwrap(),
            "2026-03-10T03:30:00Z".parse::<DateTime<Utc>>().unwrap()
        );
        let before: DateTime<Utc> = "2026-03-10T03:29:59Z".parse().unwrap();
        assert_eq!(
            p.latest(before).unwrap(),
            "2026-03-09T03:30:00Z".parse::<DateTime<Utc>>().unwrap()
        );
        let exactly: DateTime<Utc> = "2026-03-10T03:30:00Z".parse().unwrap();
        assert_eq!(p.latest(exactly).unwrap(), exactly);
        // Every second: the latest period is now's second, never the next one.
        let s = Schedules::parse("[prune]\ncron = \"* * * * * *\"\n", "r.toml").unwrap();
        let now: DateTime<Utc> = "2026-03-10T03:30:00.600Z".parse().unwrap();
        assert_eq!(
            s.list[0].latest(now).unwrap(),
            "2026-03-10T03:30:00Z".parse::<DateTime<Utc>>().unwrap()
        );
        assert_eq!(
            p.next(exactly).unwrap(),
            "2026-03-11T03:30:00Z".parse::<DateTime<Utc>>().unwrap()
        );
    }
}
