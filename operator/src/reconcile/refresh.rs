//! How often a policy's status is written when only its observations moved
//! ([`crate::plan::observations`]): all policies' refreshes together stay under a rate
//! (`--status-refresh-rate`, writes per second), so that each policy's numbers are written at
//! least once per `policies ÷ rate` seconds. A fleet of a few dozen policies sees every interval's
//! numbers; one of thousands does not spend the API server's writes on them, and whatever the
//! operator did or found (a target, a share, a condition's state, a rollout's progress) is
//! written at once whatever the size.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use poolpilot_api::ConnectionPolicyStatus;

use crate::plan::Timestamp;

/// The default rate of observation refreshes, over all policies.
pub const DEFAULT_REFRESH_RATE: f64 = 20.0;

/// When each policy's status was last written (by `namespace/name`), and the rate.
#[derive(Debug)]
pub struct StatusRefresh {
    /// Refreshes per second over all policies; 0: every change is written at once.
    rate: f64,
    written: Mutex<HashMap<String, Timestamp>>,
}

impl Default for StatusRefresh {
    fn default() -> Self {
        Self::new(DEFAULT_REFRESH_RATE)
    }
}

impl StatusRefresh {
    /// Refreshes at most `rate` statuses per second over all policies (0: no limit).
    pub fn new(rate: f64) -> Self {
        Self {
            rate: if rate.is_finite() { rate.max(0.0) } else { 0.0 },
            written: Mutex::default(),
        }
    }

    /// How long a policy's observations may wait for their refresh when `policies` policies
    /// share the rate.
    pub fn period(&self, policies: usize) -> Duration {
        if self.rate == 0.0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(policies as f64 / self.rate)
    }

    /// Whether `policy`'s observations are due to be written at `now`: the period has passed
    /// since its last write, or since the last decision its stored status shows when this
    /// operator has not written it (it just started, or took over).
    pub fn due(&self, policy: &str, stored: &ConnectionPolicyStatus, now: Timestamp) -> bool {
        let written = self.written.lock();
        let period = self.period(written.len().max(1));
        let last = written.get(policy).copied().or_else(|| {
            stored
                .backends
                .iter()
                .filter_map(|b| b.last_decision.as_ref().map(|d| d.time.0))
                .max()
        });
        last.is_none_or(|last| {
            now.duration_since(last)
                .try_into()
                .is_ok_and(|since: Duration| since >= period)
                || last > now
        })
    }

    /// `policy`'s status was written at `now`.
    pub fn written(&self, policy: &str, now: Timestamp) {
        self.written.lock().insert(policy.to_owned(), now);
    }

    /// `policy` is gone.
    pub fn forget(&self, policy: &str) {
        self.written.lock().remove(policy);
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use poolpilot_api::policy::{BackendStatus, DecisionAction, DecisionRecord};

    use super::*;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + second).unwrap()
    }

    fn decided_at(second: i64) -> ConnectionPolicyStatus {
        ConnectionPolicyStatus {
            backends: vec![BackendStatus {
                last_decision: Some(DecisionRecord {
                    time: Time(at(second)),
                    action: DecisionAction::NoChange,
                    reason: String::new(),
                }),
                ..BackendStatus::default()
            }],
            ..ConnectionPolicyStatus::default()
        }
    }

    #[test]
    fn the_period_grows_with_the_policies_sharing_the_rate() {
        let r = StatusRefresh::new(20.0);
        assert_eq!(r.period(10), Duration::from_millis(500));
        assert_eq!(r.period(2_000), Duration::from_secs(100));
        assert_eq!(StatusRefresh::new(0.0).period(2_000), Duration::ZERO);
        assert_eq!(StatusRefresh::new(f64::NAN).period(2_000), Duration::ZERO);
    }

    #[test]
    fn a_policy_is_refreshed_once_per_period_after_its_last_write() {
        let r = StatusRefresh::new(1.0);
        for i in 0..30 {
            r.written(&format!("ns/p{i}"), at(0));
        }
        let stored = ConnectionPolicyStatus::default();
        assert!(!r.due("ns/p0", &stored, at(29)), "30 policies at 1/s: 30 s");
        assert!(r.due("ns/p0", &stored, at(30)));
        r.written("ns/p0", at(30));
        assert!(!r.due("ns/p0", &stored, at(45)));
        assert!(
            r.due("ns/new", &stored, at(30)),
            "never written, nothing stored"
        );
        // A clock that went back does not hold a refresh forever.
        assert!(r.due("ns/p1", &stored, at(-5)));
        r.forget("ns/p0");
        assert!(r.due("ns/p0", &stored, at(31)));
    }

    #[test]
    fn an_operator_that_just_started_counts_from_the_stored_decision() {
        let r = StatusRefresh::new(0.1);
        r.written("ns/other", at(0));
        // 1 policy known at 0.1/s: 10 s.
        assert!(!r.due("ns/p", &decided_at(0), at(9)));
        assert!(r.due("ns/p", &decided_at(0), at(10)));
        assert!(StatusRefresh::new(0.0).due("ns/p", &decided_at(0), at(0)));
    }
}
