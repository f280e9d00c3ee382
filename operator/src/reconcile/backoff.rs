//! When a failed reconcile is tried again: 5 s after the first failure of a policy, doubling with
//! each failure in a row up to 5 min, back to 5 s once a reconcile of it succeeds. A policy that
//! keeps failing (an RBAC denial, an unreachable pod) costs the API server little, and one that
//! failed once is retried at once.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

/// The wait after the first failure.
pub const FIRST_RETRY: Duration = Duration::from_secs(5);
/// The longest wait.
pub const MAX_RETRY: Duration = Duration::from_secs(300);

/// The wait after `failures` failures in a row (1 for the first).
pub fn retry_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FIRST_RETRY.saturating_mul(1 << doublings).min(MAX_RETRY)
}

/// Failures in a row per policy (`namespace/name`).
#[derive(Debug, Default)]
pub struct RetryBackoff(Mutex<HashMap<String, u32>>);

impl RetryBackoff {
    /// Counts a failure of `policy`; the wait before trying it again.
    pub fn failed(&self, policy: &str) -> Duration {
        let mut failures = self.0.lock();
        let n = failures.entry(policy.to_owned()).or_default();
        *n = n.saturating_add(1);
        retry_delay(*n)
    }

    /// `policy` reconciled: its next failure waits [`FIRST_RETRY`] again.
    pub fn succeeded(&self, policy: &str) {
        self.0.lock().remove(policy);
    }

    /// Failures in a row of `policy`.
    pub fn failures(&self, policy: &str) -> u32 {
        self.0.lock().get(policy).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_doubles_from_five_seconds_up_to_five_minutes() {
        let waits: Vec<u64> = (1..=9).map(|n| retry_delay(n).as_secs()).collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(retry_delay(u32::MAX), MAX_RETRY);
        assert_eq!(retry_delay(0), FIRST_RETRY);
    }

    #[test]
    fn each_policy_backs_off_alone_and_a_success_starts_over() {
        let b = RetryBackoff::default();
        assert_eq!(b.failed("ns/a"), Duration::from_secs(5));
        assert_eq!(b.failed("ns/a"), Duration::from_secs(10));
        assert_eq!(b.failed("ns/a"), Duration::from_secs(20));
        assert_eq!(
            b.failed("ns/b"),
            Duration::from_secs(5),
            "b's first failure"
        );
        b.succeeded("ns/a");
        assert_eq!(b.failures("ns/a"), 0);
        assert_eq!(b.failed("ns/a"), Duration::from_secs(5));
        assert_eq!(b.failures("ns/b"), 1);
    }
}
