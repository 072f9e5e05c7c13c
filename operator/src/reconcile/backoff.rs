//! Error backoff per object: how long a failing reconcile waits before its retry.

use std::time::{Duration, Instant};

/// Error backoff: 5 s doubling per back-off level, at most 5 minutes.
pub fn backoff(level: u32) -> Duration {
    Duration::from_secs((5u64 << (level.clamp(1, 7) - 1)).min(300))
}

/// One object's consecutive failures and its back-off level.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Consecutive failed reconciles.
    pub failures: u32,
    /// The back-off level (`backoff(level)` is the wait).
    pub level: u32,
    /// When the last failure was recorded.
    pub at: Instant,
}

impl Backoff {
    /// The state after one more failure at `now`. The level rises only for a failure that
    /// comes once most of the previous wait has passed (the retry it asked for): the watch
    /// events an object's own status writes cause re-run a failing reconcile many times
    /// within one wait, and counting each of those would push the next retry to the 5-minute
    /// cap within a second, long after the cause (a webhook, a quota) may be gone.
    pub fn fail(prev: Option<Backoff>, now: Instant) -> Backoff {
        match prev {
            None => Backoff {
                failures: 1,
                level: 1,
                at: now,
            },
            Some(b) => {
                let retried = now.saturating_duration_since(b.at) >= backoff(b.level) / 2;
                Backoff {
                    failures: b.failures.saturating_add(1),
                    level: if retried { b.level + 1 } else { b.level },
                    at: now,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff(1), Duration::from_secs(5));
        assert_eq!(backoff(2), Duration::from_secs(10));
        assert_eq!(backoff(4), Duration::from_secs(40));
        assert_eq!(backoff(6), Duration::from_secs(160));
        assert_eq!(backoff(30), Duration::from_secs(300));
        assert!(backoff(u32::MAX) <= Duration::from_secs(300));
    }

    /// Failures re-run by watch events within one wait keep the level; a failure of the
    /// retry the wait asked for raises it; every failure counts as consecutive.
    #[test]
    fn only_retries_after_the_wait_raise_the_backoff() {
        let t0 = Instant::now();
        let mut b = Backoff::fail(None, t0);
        assert_eq!((b.failures, b.level), (1, 1));
        for i in 1..=8 {
            b = Backoff::fail(Some(b), t0 + Duration::from_millis(30 * i));
        }
        assert_eq!((b.failures, b.level), (9, 1));
        assert_eq!(backoff(b.level), Duration::from_secs(5));
        let after_wait = b.at + backoff(b.level);
        b = Backoff::fail(Some(b), after_wait);
        assert_eq!((b.failures, b.level), (10, 2));
        b = Backoff::fail(Some(b), after_wait + Duration::from_secs(1));
        assert_eq!(b.level, 2);
        b = Backoff::fail(Some(b), after_wait + Duration::from_secs(12));
        assert_eq!(b.level, 3);
    }
}
