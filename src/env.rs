//! Where settings come from (the process environment, or a list of pairs in tests) and how one
//! variable is read and checked. Each context reads its own settings with these
//! (`gateways::Settings::from_env`, `payments::reconcile::Settings::from_env`, ...); `config`
//! composes them. A setting that does not read names itself in the error.

use crate::secret::Secret;

/// The source of settings: the process environment, or a list of pairs (tests).
pub trait Env {
    fn get(&self, name: &str) -> Option<String>;
}

/// The process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn get(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl<const N: usize> Env for [(&str, &str); N] {
    fn get(&self, name: &str) -> Option<String> {
        self.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    }
}

/// A setting that does not read, by its variable's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name} is not valid: {problem}")]
pub struct Invalid {
    pub name: &'static str,
    pub problem: String,
}

pub fn invalid(name: &'static str, problem: impl Into<String>) -> Invalid {
    Invalid {
        name,
        problem: problem.into(),
    }
}

/// A variable's value, trimmed; empty is unset.
pub fn var(env: &dyn Env, name: &str) -> Option<String> {
    env.get(name)
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// A secret's value (never printed), if set.
pub fn secret(env: &dyn Env, name: &str) -> Option<Secret> {
    var(env, name).map(Secret::new)
}

/// Fewest characters a webhook secret may have: a forged event signed with a guessed secret is
/// a payment that never happened, and Razorpay's signatures carry no time, so one guess
/// holds for ever. Stripe's and Mercado Pago's secrets are given (32 characters and more);
/// Razorpay's is typed by the operator.
pub const WEBHOOK_SECRET_MIN_CHARS: usize = 16;

/// A gateway's webhook secret, if set: refused when shorter than
/// [`WEBHOOK_SECRET_MIN_CHARS`].
pub fn webhook_secret(env: &dyn Env, name: &'static str) -> Result<Option<Secret>, Invalid> {
    match var(env, name) {
        Some(v) if v.chars().count() < WEBHOOK_SECRET_MIN_CHARS => Err(invalid(
            name,
            format!(
                "must be at least {WEBHOOK_SECRET_MIN_CHARS} characters (a short secret can be guessed, and every event signed with it is believed): use the gateway's, or a long random one"
            ),
        )),
        v => Ok(v.map(Secret::new)),
    }
}

/// A variable parsed as `T`, or `default` when unset.
pub fn parsed<T: std::str::FromStr>(
    env: &dyn Env,
    name: &'static str,
    default: T,
) -> Result<T, Invalid>
where
    T::Err: std::fmt::Display,
{
    match var(env, name) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|e: T::Err| invalid(name, format!("{v:?}: {e}"))),
    }
}

/// [`parsed`], refused outside `range` (whose bounds the message names).
pub fn parsed_within<T>(
    env: &dyn Env,
    name: &'static str,
    default: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<T, Invalid>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
    T::Err: std::fmt::Display,
{
    let v = parsed(env, name, default)?;
    if range.contains(&v) {
        Ok(v)
    } else {
        Err(invalid(
            name,
            format!("{v} is not between {} and {}", range.start(), range.end()),
        ))
    }
}

/// An `on`/`off` switch, off when unset.
pub fn switch(env: &dyn Env, name: &'static str) -> Result<bool, Invalid> {
    switch_or(env, name, false)
}

/// An `on`/`off` switch, `default` when unset.
pub fn switch_or(env: &dyn Env, name: &'static str, default: bool) -> Result<bool, Invalid> {
    match var(env, name).as_deref() {
        None => Ok(default),
        Some("off") => Ok(false),
        Some("on") => Ok(true),
        Some(other) => Err(invalid(name, format!("{other:?}: on or off"))),
    }
}

/// A switch as [`switch`] reads it: for the settings a process hands its child processes.
pub fn on_off(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}

/// An http(s) URL without its trailing slash, or `default` when unset.
pub fn http_url(env: &dyn Env, name: &'static str, default: &str) -> Result<String, Invalid> {
    let v = var(env, name).unwrap_or_else(|| default.to_owned());
    if !v.starts_with("http://") && !v.starts_with("https://") {
        return Err(invalid(name, "must start with http:// or https://"));
    }
    Ok(v.trim_end_matches('/').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_handed_on_reads_back_the_same() {
        for on in [false, true] {
            let env = [("PAYFLEET_SOME_SWITCH", on_off(on))];
            assert_eq!(switch(&env, "PAYFLEET_SOME_SWITCH").unwrap(), on);
            assert_eq!(switch_or(&env, "PAYFLEET_SOME_SWITCH", !on).unwrap(), on);
        }
    }
}
