//! Failed sign-ins and wrong credentials, counted per client address: after [`MAX_FAILURES`] in
//! a [`WINDOW`] the address is refused (429 with `Retry-After`) until its window passes, even
//! with a right credential, or guessing would go on and only the right guess would show. A
//! success does not reset the count: a caller holding one weak credential cannot use it to wipe
//! the trail of guessing another.
//!
//! Per process, in memory: an attacker who reaches N receivers gets N times the guesses, still
//! few against a 256-bit key. IPv6 addresses count by their /64 (one host's share of a network),
//! and the table is bounded: when full, the oldest windows go first.

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

pub struct FailureLimiter {
    max: u32,
    window: Duration,
    table: Mutex<HashMap<IpAddr, Window>>,
}

impl Default for FailureLimiter {
    fn default() -> Self {
        Self::new(MAX_FAILURES, WINDOW)
    }
}

/// The unit an address is counted in: itself for IPv4, its /64 for IPv6 (an IPv4-mapped IPv6
/// address is its IPv4 address).
fn unit(addr: IpAddr) -> IpAddr {
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

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Window>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `addr` may try a credential now.
    pub fn check(&self, addr: IpAddr, now: Instant) -> Result<(), Locked> {
        match self.table().get(&unit(addr)) {
            Some(w) if w.failures >= self.max => {
                let left = self.window.saturating_sub(now.duration_since(w.started));
                if left.is_zero() {
                    Ok(())
                } else {
                    Err(Locked { retry_after: left })
                }
            }
            _ => Ok(()),
        }
    }

    /// Counts a failure of `addr`; returns how many it has in its window.
    pub fn failed(&self, addr: IpAddr, now: Instant) -> u32 {
        let mut table = self.table();
        let key = unit(addr);
        if !table.contains_key(&key) && table.len() >= ADDRESSES {
            table.retain(|_, w| now.duration_since(w.started) < self.window);
            if table.len() >= ADDRESSES
                && let Some(oldest) = table.iter().min_by_key(|(_, w)| w.started).map(|(k, _)| *k)
            {
                table.remove(&oldest);
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
