//! Failed sign-ins and wrong credentials, counted per client address: after [`MAX_FAILURES`] in
//! a [`WINDOW`] the address is refused (429 with `Retry-After`) until its window passes, even
//! with a right credential, or guessing would go on and only the right guess would show. A
//! success does not reset the count: a caller holding one weak credential cannot use it to wipe
//! the trail of guessing another.
//!
//! A credential that must be looked up (an API key not cached) is an attempt in flight until
//! its answer: an address's failures and its attempts in flight together stay under the limit,
//! so a burst of guesses sent at once is refused past the tenth instead of all passing the
//! check before the first failure is counted. Attempts are counted by distinct credential: an
//! honest backend's many requests with its one key are one attempt.
//!
//! Per process, in memory: an attacker who reaches N receivers gets N times the guesses, still
//! few against a 256-bit key. IPv6 addresses count by their /64 (one host's share of a network),
//! and the table is bounded: when full, the oldest tenth of the windows goes at once.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const MAX_FAILURES: u32 = 10;
pub const WINDOW: Duration = Duration::from_secs(15 * 60);
/// Most addresses tracked at once.
const ADDRESSES: usize = 100_000;

/// An address past its limit, and how long it has left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Locked {
    pub retry_after: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    started: Instant,
    failures: u32,
}

#[derive(Default)]
struct Table {
    windows: HashMap<IpAddr, Window>,
    /// Credentials being looked up, per address, with how many requests carry each.
    pending: HashMap<IpAddr, HashMap<[u8; 32], u32>>,
}

pub struct FailureLimiter {
    max: u32,
    window: Duration,
    table: Mutex<Table>,
}

impl Default for FailureLimiter {
    fn default() -> Self {
        Self::new(MAX_FAILURES, WINDOW)
    }
}

/// The unit an address is counted in: itself for IPv4, its /64 for IPv6 (an IPv4-mapped IPv6
/// address is its IPv4 address).
pub(crate) fn unit(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(_) => addr,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

impl FailureLimiter {
    pub fn new(max: u32, window: Duration) -> Self {
        Self {
            max,
            window,
            table: Mutex::default(),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The failures of `key` in its current window, and how long that window has left.
    fn failures(&self, table: &Table, key: IpAddr, now: Instant) -> (u32, Duration) {
        match table.windows.get(&key) {
            Some(w) => {
                let left = self.window.saturating_sub(now.duration_since(w.started));
                if left.is_zero() {
                    (0, self.window)
                } else {
                    (w.failures, left)
                }
            }
            None => (0, self.window),
        }
    }

    /// Whether `addr` may try a credential now.
    pub fn check(&self, addr: IpAddr, now: Instant) -> Result<(), Locked> {
        let table = self.table();
        match self.failures(&table, unit(addr), now) {
            (failures, left) if failures >= self.max => Err(Locked { retry_after: left }),
            _ => Ok(()),
        }
    }

    /// Starts the lookup of a credential (by its digest) for `addr`: refused when its failures
    /// and the other credentials it has in flight reach the limit. Every `begin` is followed by
    /// an [`end`](Self::end) (see `callers::Attempt`).
    pub fn begin(&self, addr: IpAddr, credential: [u8; 32], now: Instant) -> Result<(), Locked> {
        let key = unit(addr);
        let mut table = self.table();
        let (failures, left) = self.failures(&table, key, now);
        let pending = table.pending.entry(key).or_default();
        let others = pending.len() as u32 - u32::from(pending.contains_key(&credential));
        if failures + others >= self.max {
            if pending.is_empty() {
                table.pending.remove(&key);
            }
            return Err(Locked { retry_after: left });
        }
        *pending.entry(credential).or_insert(0) += 1;
        Ok(())
    }

    /// Ends a lookup [`begin`](Self::begin) started (count its failure first, if it failed).
    pub fn end(&self, addr: IpAddr, credential: [u8; 32]) {
        let key = unit(addr);
        let mut table = self.table();
        if let Some(pending) = table.pending.get_mut(&key) {
            if let Some(n) = pending.get_mut(&credential) {
                *n -= 1;
                if *n == 0 {
                    pending.remove(&credential);
                }
            }
            if pending.is_empty() {
                table.pending.remove(&key);
            }
        }
    }

    /// Counts a failure of `addr`; returns how many it has in its window.
    pub fn failed(&self, addr: IpAddr, now: Instant) -> u32 {
        let mut guard = self.table();
        let table = &mut guard.windows;
        let key = unit(addr);
        if !table.contains_key(&key) && table.len() >= ADDRESSES {
            table.retain(|_, w| now.duration_since(w.started) < self.window);
            if table.len() >= ADDRESSES {
                // Full of live windows: the oldest tenth goes in one pass, not one per address.
                let mut starts: Vec<Instant> = table.values().map(|w| w.started).collect();
                let cut = ADDRESSES / 10;
                starts.select_nth_unstable(cut);
                let before = starts[cut];
                table.retain(|_, w| w.started > before);
            }
        }
        let w = table.entry(key).or_insert(Window {
            started: now,
            failures: 0,
        });
        if now.duration_since(w.started) >= self.window {
            *w = Window {
                started: now,
                failures: 0,
            };
        }
        w.failures = w.failures.saturating_add(1);
        w.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_failures_lock_an_address_until_its_window_passes() {
        let l = FailureLimiter::default();
        let a: IpAddr = "203.0.113.7".parse().unwrap();
        let b: IpAddr = "203.0.113.8".parse().unwrap();
        let t0 = Instant::now();
        for i in 1..=10 {
            assert_eq!(l.check(a, t0), Ok(()));
            assert_eq!(l.failed(a, t0), i);
        }
        let locked = l.check(a, t0 + Duration::from_secs(60)).unwrap_err();
        assert_eq!(locked.retry_after, WINDOW - Duration::from_secs(60));
        assert_eq!(l.check(b, t0), Ok(()), "another address is not held up");
        assert_eq!(l.check(a, t0 + WINDOW), Ok(()));
        assert_eq!(l.failed(a, t0 + WINDOW), 1, "a new window starts");
    }

    #[test]
    fn lookups_in_flight_count_by_distinct_credential() {
        let l = FailureLimiter::new(3, WINDOW);
        let a: IpAddr = "203.0.113.9".parse().unwrap();
        let t0 = Instant::now();
        // A burst of guesses at once: past the limit before any has failed.
        for guess in 0..3u8 {
            assert_eq!(l.begin(a, [guess; 32], t0), Ok(()));
        }
        assert!(l.begin(a, [9; 32], t0).is_err());
        // The same credential again is the same attempt (an honest backend's burst).
        assert_eq!(l.begin(a, [0; 32], t0), Ok(()));
        for guess in 0..3u8 {
            l.end(a, [guess; 32]);
        }
        l.end(a, [0; 32]);
        assert_eq!(
            l.begin(a, [9; 32], t0),
            Ok(()),
            "nothing in flight, nothing failed"
        );
        l.end(a, [9; 32]);
        // Failures and attempts in flight share the limit.
        l.failed(a, t0);
        l.failed(a, t0);
        assert_eq!(l.begin(a, [1; 32], t0), Ok(()));
        assert!(l.begin(a, [2; 32], t0).is_err());
    }

    #[test]
    fn an_ipv6_network_counts_as_one_address() {
        let l = FailureLimiter::new(2, WINDOW);
        let t0 = Instant::now();
        l.failed("2001:db8:1:2::1".parse().unwrap(), t0);
        l.failed("2001:db8:1:2:ffff::9".parse().unwrap(), t0);
        assert!(l.check("2001:db8:1:2::77".parse().unwrap(), t0).is_err());
        assert!(l.check("2001:db8:1:3::1".parse().unwrap(), t0).is_ok());
        l.failed("::ffff:198.51.100.1".parse().unwrap(), t0);
        l.failed("198.51.100.1".parse().unwrap(), t0);
        assert!(l.check("198.51.100.1".parse().unwrap(), t0).is_err());
    }
}
