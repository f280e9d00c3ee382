//! Rollout waves, decided purely: which pods get their new document now. `AllAtOnce` updates every
//! stale pod; `Progressive` updates `canaryPods` pods first, waits until they ran the revision for
//! the verify period, then updates the rest. A refusal (NACK) or a regression halts the rollout;
//! pods that appear later simply count as stale and get the current document. The canaries are
//! the stale pods that answered last time, by name: one that did not answer is tried again
//! after them (the least recently failed first), so that one unreachable pod never holds the
//! rollout.

use std::collections::BTreeMap;
use std::time::Duration;

use poolpilot_api::policy::RolloutStrategy;

use super::time::{Timestamp, elapsed};

/// One ready selected pod, as the rollout sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodState {
    /// The pod's name.
    pub name: String,
    /// The revision it should run.
    pub desired: String,
    /// The revision it acknowledged last.
    pub acked: Option<String>,
    /// The generation of that document, when known.
    pub generation: Option<u64>,
    /// Its refusal of `desired`, if it refused it.
    pub refused: Option<String>,
    /// When the last document sent to it went unanswered (no IP, a failed connection, no
    /// answer in time), if it did and it has acknowledged none since.
    pub unanswered_at: Option<Timestamp>,
}

impl PodState {
    /// Whether it runs the revision it should.
    pub fn current(&self) -> bool {
        self.acked.as_deref() == Some(self.desired.as_str())
    }
}

/// What to do now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Wave {
    /// Pods to send their document to now.
    pub push: Vec<String>,
    /// Why the rest waits (canary verification), if it does.
    pub waiting: Option<String>,
    /// How long the canaries' verification still runs, while it does: the rest follow once it
    /// has (judged then, not an interval later).
    pub verified_in: Option<Duration>,
    /// Why the rollout stopped (a refusal or a regression), if it did.
    pub halted: Option<String>,
}

/// The rollout's knobs.
#[derive(Clone, Copy, Debug)]
pub struct Strategy {
    /// Progressive or all at once.
    pub kind: RolloutStrategy,
    /// Canary pods for Progressive.
    pub canary_pods: u32,
    /// How long canaries must run the revision before the rest follow.
    pub verify: Duration,
}

/// How the canaries are doing compared with the pods still on the old revision.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// No worse than the rest.
    Healthy,
    /// Worse than the rest: the rollout stops.
    Regressed(String),
    /// Their metrics are missing: the rollout pauses (it never promotes on missing data).
    Unknown(String),
}

/// One pod's call and lease-timeout rates (per second); `None` when the pod is not scraped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PodRates {
    /// Upstream calls per second.
    pub requests: f64,
    /// Lease timeouts per second.
    pub lease_timeouts: f64,
    /// Upstream calls answered 5xx per second.
    pub upstream_5xx: f64,
    /// 90th percentile of upstream call duration, seconds (`None`: no calls in the window).
    pub p90: Option<f64>,
}

/// A canary's lease-timeout share may exceed the rest's by this much (half a percentage point).
pub const REGRESSION_MARGIN: f64 = 0.005;
/// A canary's upstream 5xx share may exceed the rest's by this much (one percentage point).
pub const UPSTREAM_5XX_MARGIN: f64 = 0.01;
/// A canary's p90 latency may be this many times the rest's ...
pub const P90_RATIO: f64 = 1.5;
/// ... plus this many seconds (so that short calls' jitter is no regression).
pub const P90_SLACK_SECONDS: f64 = 0.1;

/// A failure rate the canaries are compared on: its name, how to read it from a pod's rates,
/// and how far above the other pods' it may be.
type FailureRate = (&'static str, fn(&PodRates) -> f64, f64);

/// Judges the canaries against the other pods on the signals users watch, each with its
/// margin: lease timeouts per call, upstream 5xx per call, and p90 latency (the slowest
/// canary's against the slowest other pod's; judged only when both served calls). The verdict
/// names the first signal that regressed and both numbers.
pub fn judge(canaries: &[Option<PodRates>], others: &[Option<PodRates>]) -> Verdict {
    if canaries.is_empty() || canaries.iter().any(Option::is_none) {
        return Verdict::Unknown("no metrics for the canary pods yet".into());
    }
    let share = |pods: &[Option<PodRates>], of: fn(&PodRates) -> f64| {
        let (calls, bad) = pods
            .iter()
            .flatten()
            .fold((0.0, 0.0), |(c, b), r| (c + r.requests, b + of(r)));
        if calls > 0.0 { bad / calls } else { 0.0 }
    };
    let failures: [FailureRate; 2] = [
        ("lease timeouts", |r| r.lease_timeouts, REGRESSION_MARGIN),
        ("upstream 5xx", |r| r.upstream_5xx, UPSTREAM_5XX_MARGIN),
    ];
    for (what, of, margin) in failures {
        let (canary, rest) = (share(canaries, of), share(others, of));
        if canary > rest + margin {
            return Verdict::Regressed(format!(
                "{what} on {:.1}% of the canaries' calls vs {:.1}% on the other pods",
                canary * 100.0,
                rest * 100.0
            ));
        }
    }
    let slowest = |pods: &[Option<PodRates>]| {
        pods.iter()
            .flatten()
            .filter_map(|r| r.p90.filter(|p| p.is_finite()))
            .reduce(f64::max)
    };
    if let (Some(canary), Some(rest)) = (slowest(canaries), slowest(others))
        && canary > rest * P90_RATIO + P90_SLACK_SECONDS
    {
        return Verdict::Regressed(format!(
            "p90 latency {canary:.2} s on the canaries vs {rest:.2} s on the other pods (more than ×{P90_RATIO} + {P90_SLACK_SECONDS} s)"
        ));
    }
    Verdict::Healthy
}

/// The next wave. `canary_since` is when the first pod acknowledged the revision (the runtime
/// remembers it); `canary` is how the pods already on it are doing.
pub fn next_wave(
    strategy: Strategy,
    pods: &[PodState],
    canary_since: Option<Timestamp>,
    canary: &Verdict,
    now: Timestamp,
) -> Wave {
    let mut sorted: Vec<&PodState> = pods.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(p) = sorted.iter().find(|p| p.refused.is_some()) {
        let why = p.refused.as_deref().unwrap_or_default();
        return Wave {
            halted: Some(format!(
                "pod {} refused revision {}: {why}",
                p.name, p.desired
            )),
            ..Wave::default()
        };
    }
    let stale_pods: Vec<&PodState> = sorted.iter().copied().filter(|p| !p.current()).collect();
    let stale: Vec<String> = stale_pods.iter().map(|p| p.name.clone()).collect();
    if stale.is_empty() {
        return Wave::default();
    }
    match strategy.kind {
        RolloutStrategy::AllAtOnce => Wave {
            push: stale,
            ..Wave::default()
        },
        RolloutStrategy::Progressive => {
            let updated = sorted.len() - stale.len();
            let canaries = (strategy.canary_pods.max(1) as usize).min(sorted.len());
            if updated < canaries {
                let push = canary_order(stale_pods)
                    .into_iter()
                    .take(canaries - updated)
                    .collect();
                return Wave {
                    push,
                    ..Wave::default()
                };
            }
            // The canaries are judged at the end of their verification, on rates of calls they
            // served under the new revision; judged earlier, the rates are mostly the old
            // revision's (a flash crowd's lease timeouts look like a regression). Without
            // verification intervals the rest follow as soon as the canaries acknowledged.
            let verified_for = canary_since.map_or(Duration::ZERO, |t| elapsed(t, now));
            if strategy.verify.is_zero() {
                return Wave {
                    push: stale,
                    ..Wave::default()
                };
            }
            if verified_for >= strategy.verify {
                return match canary {
                    Verdict::Regressed(why) => Wave {
                        halted: Some(format!("canary regression: {why}")),
                        ..Wave::default()
                    },
                    Verdict::Unknown(why) => Wave {
                        waiting: Some(format!("canary verification paused: {why}")),
                        ..Wave::default()
                    },
                    Verdict::Healthy => Wave {
                        push: stale,
                        ..Wave::default()
                    },
                };
            }
            let left = strategy.verify - verified_for;
            let shown = poolpilot_api::Duration::from(left);
            Wave {
                waiting: Some(format!(
                    "verifying {updated} canary pod(s) for {shown} more"
                )),
                verified_in: Some(left),
                ..Wave::default()
            }
        }
    }
}

/// The stale pods (given by name) in the order canaries are chosen from: those whose last
/// document was answered (or that never got one), by name, then those that did not answer, the
/// least recently failed first.
fn canary_order(mut stale: Vec<&PodState>) -> Vec<String> {
    // A stable sort keeps the names' order among pods that answered.
    stale.sort_by_key(|p| (p.unanswered_at.is_some(), p.unanswered_at));
    stale.into_iter().map(|p| p.name.clone()).collect()
}

/// Counts per outcome, for status.
pub fn updated_count(pods: &[PodState]) -> usize {
    pods.iter().filter(|p| p.current()).count()
}

/// The pods that run a later document than the one planned for them (`planned` gives its
/// generation by pod): a later pass of the namespace reached them after this one. Not updated
/// for this rollout, and its next pass numbers theirs above it.
pub fn ahead(pods: &[PodState], planned: impl Fn(&str) -> Option<u64>) -> Vec<String> {
    pods.iter()
        .filter(|p| !p.current())
        .filter(|p| {
            p.generation
                .zip(planned(&p.name))
                .is_some_and(|(runs, ours)| runs > ours)
        })
        .map(|p| p.name.clone())
        .collect()
}

/// Refusals by pod, for status.
pub fn refusals(pods: &[PodState]) -> BTreeMap<String, String> {
    pods.iter()
        .filter_map(|p| Some((p.name.clone(), p.refused.clone()?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn pod(name: &str, acked: Option<&str>) -> PodState {
        PodState {
            generation: None,
            name: name.into(),
            desired: "new".into(),
            acked: acked.map(Into::into),
            refused: None,
            unanswered_at: None,
        }
    }

    const PROGRESSIVE: Strategy = Strategy {
        kind: RolloutStrategy::Progressive,
        canary_pods: 1,
        verify: Duration::from_secs(30),
    };

    #[test]
    fn progressive_sends_the_canary_first() {
        let pods = [
            pod("gw-b", Some("old")),
            pod("gw-a", Some("old")),
            pod("gw-c", None),
        ];
        let w = next_wave(PROGRESSIVE, &pods, None, &Verdict::Healthy, at(0));
        assert_eq!(w.push, ["gw-a"], "the first pod by name is the canary");
    }

    #[test]
    fn a_canary_that_did_not_answer_gives_way_to_the_next_stale_pod_and_is_tried_after_them() {
        let failed = |name: &str, secs: i64| PodState {
            unanswered_at: Some(at(secs)),
            ..pod(name, Some("old"))
        };
        // gw-a, first by name, timed out on its document: gw-b is the canary now.
        let pods = [
            failed("gw-a", 5),
            pod("gw-b", Some("old")),
            pod("gw-c", None),
        ];
        let w = next_wave(PROGRESSIVE, &pods, None, &Verdict::Healthy, at(10));
        assert_eq!(w.push, ["gw-b"]);
        let two = Strategy {
            canary_pods: 2,
            ..PROGRESSIVE
        };
        let w = next_wave(two, &pods, None, &Verdict::Healthy, at(10));
        assert_eq!(w.push, ["gw-b", "gw-c"]);
        // Every stale pod failed: they are tried in turn, the least recently failed first, not
        // the first by name forever.
        let pods = [failed("gw-a", 20), failed("gw-b", 5), failed("gw-c", 12)];
        let w = next_wave(PROGRESSIVE, &pods, None, &Verdict::Healthy, at(30));
        assert_eq!(w.push, ["gw-b"]);
        // Past the canaries the rest, reachable or not, follow together.
        let pods = [
            pod("gw-a", Some("new")),
            failed("gw-b", 5),
            pod("gw-c", None),
        ];
        let w = next_wave(PROGRESSIVE, &pods, Some(at(0)), &Verdict::Healthy, at(30));
        assert_eq!(w.push, ["gw-b", "gw-c"]);
    }

    #[test]
    fn pods_on_a_later_generation_than_planned_are_ahead_and_no_other() {
        let on = |name: &str, acked: &str, generation: u64| PodState {
            generation: Some(generation),
            ..pod(name, Some(acked))
        };
        let pods = [
            on("gw-a", "new", 5),
            on("gw-b", "later", 7),
            on("gw-c", "old", 3),
            pod("gw-d", None),
        ];
        assert_eq!(ahead(&pods, |_| Some(5)), ["gw-b"]);
        assert!(
            ahead(&pods, |_| None).is_empty(),
            "nothing planned: nothing to compare"
        );
    }

    #[test]
    fn progressive_waits_for_the_verify_period_then_sends_the_rest() {
        let pods = [
            pod("gw-a", Some("new")),
            pod("gw-b", Some("old")),
            pod("gw-c", Some("old")),
        ];
        let w = next_wave(PROGRESSIVE, &pods, Some(at(0)), &Verdict::Healthy, at(10));
        assert!(w.push.is_empty());
        assert_eq!(
            w.waiting.as_deref(),
            Some("verifying 1 canary pod(s) for 20s more")
        );
        assert_eq!(
            w.verified_in,
            Some(Duration::from_secs(20)),
            "the next look is due when the verification ends"
        );
        let w = next_wave(PROGRESSIVE, &pods, Some(at(0)), &Verdict::Healthy, at(30));
        assert_eq!(w.push, ["gw-b", "gw-c"]);
        assert_eq!(w.verified_in, None);
    }

    #[test]
    fn a_refusal_halts_the_rollout() {
        let mut pods = [pod("gw-a", Some("old")), pod("gw-b", Some("old"))];
        pods[0].refused = Some("backends[0].pool.leaseTimeout: must be longer than 0s".into());
        let w = next_wave(PROGRESSIVE, &pods, None, &Verdict::Healthy, at(0));
        assert!(w.push.is_empty());
        assert!(
            w.halted
                .unwrap()
                .starts_with("pod gw-a refused revision new")
        );
    }

    #[test]
    fn a_regression_halts_the_rollout() {
        let pods = [pod("gw-a", Some("new")), pod("gw-b", Some("old"))];
        let w = next_wave(
            PROGRESSIVE,
            &pods,
            Some(at(0)),
            &judge(&[Some(rates(100.0, 4.0))], &[Some(rates(100.0, 0.5))]),
            at(60),
        );
        assert!(w.push.is_empty());
        assert_eq!(
            w.halted.as_deref(),
            Some(
                "canary regression: lease timeouts on 4.0% of the canaries' calls vs 0.5% on the other pods"
            )
        );
    }

    fn rates(requests: f64, lease_timeouts: f64) -> PodRates {
        PodRates {
            requests,
            lease_timeouts,
            upstream_5xx: 0.0,
            p90: Some(1.0),
        }
    }

    #[test]
    fn judging_compares_5xx_per_call_and_p90_latency_naming_the_signal_and_both_numbers() {
        let with = |upstream_5xx: f64, p90: Option<f64>| PodRates {
            upstream_5xx,
            p90,
            ..rates(100.0, 0.0)
        };
        assert_eq!(
            judge(
                &[Some(with(12.0, Some(1.0)))],
                &[Some(with(0.5, Some(1.0)))]
            ),
            Verdict::Regressed(
                "upstream 5xx on 12.0% of the canaries' calls vs 0.5% on the other pods".into()
            )
        );
        assert_eq!(
            judge(&[Some(with(1.4, Some(1.0)))], &[Some(with(0.5, Some(1.0)))]),
            Verdict::Healthy,
            "within one percentage point"
        );
        assert_eq!(
            judge(&[Some(with(0.0, Some(2.4)))], &[Some(with(0.0, Some(1.1)))]),
            Verdict::Regressed(
                "p90 latency 2.40 s on the canaries vs 1.10 s on the other pods (more than ×1.5 + 0.1 s)"
                    .into()
            )
        );
        assert_eq!(
            judge(&[Some(with(0.0, Some(1.7)))], &[Some(with(0.0, Some(1.1)))]),
            Verdict::Healthy,
            "1.7 s is within 1.1 × 1.5 + 0.1"
        );
        assert_eq!(
            judge(&[Some(with(0.0, Some(9.0)))], &[Some(with(0.0, None))]),
            Verdict::Healthy,
            "no calls on the other pods: latency is not compared"
        );
        // Lease timeouts are judged first.
        let both = PodRates {
            lease_timeouts: 4.0,
            ..with(12.0, Some(1.0))
        };
        assert!(matches!(
            judge(&[Some(both)], &[Some(with(0.0, Some(1.0)))]),
            Verdict::Regressed(why) if why.starts_with("lease timeouts")
        ));
    }

    #[test]
    fn judging_compares_lease_timeouts_per_call() {
        let healthy = judge(&[Some(rates(100.0, 0.9))], &[Some(rates(100.0, 0.5))]);
        assert_eq!(healthy, Verdict::Healthy, "within half a percentage point");
        assert_eq!(
            judge(&[Some(rates(0.0, 0.0))], &[]),
            Verdict::Healthy,
            "no calls, no regression"
        );
        assert!(matches!(
            judge(&[None], &[Some(rates(1.0, 0.0))]),
            Verdict::Unknown(_)
        ));
        assert!(matches!(judge(&[], &[]), Verdict::Unknown(_)));
    }

    #[test]
    fn missing_canary_metrics_pause_the_promotion() {
        let pods = [pod("gw-a", Some("new")), pod("gw-b", Some("old"))];
        let unknown = Verdict::Unknown("no metrics for the canary pods yet".into());
        let w = next_wave(PROGRESSIVE, &pods, Some(at(0)), &unknown, at(60));
        assert!(w.push.is_empty() && w.halted.is_none());
        assert_eq!(
            w.waiting.as_deref(),
            Some("canary verification paused: no metrics for the canary pods yet")
        );
    }

    #[test]
    fn all_at_once_sends_every_stale_pod() {
        let s = Strategy {
            kind: RolloutStrategy::AllAtOnce,
            ..PROGRESSIVE
        };
        let pods = [
            pod("gw-a", Some("new")),
            pod("gw-b", Some("old")),
            pod("gw-c", None),
        ];
        assert_eq!(
            next_wave(s, &pods, None, &Verdict::Healthy, at(0)).push,
            ["gw-b", "gw-c"]
        );
    }

    #[test]
    fn a_pod_that_appears_later_gets_the_current_document() {
        let pods = [
            pod("gw-a", Some("new")),
            pod("gw-b", Some("new")),
            pod("gw-d", None),
        ];
        let w = next_wave(PROGRESSIVE, &pods, Some(at(0)), &Verdict::Healthy, at(600));
        assert_eq!(w.push, ["gw-d"]);
        assert_eq!(updated_count(&pods), 2);
    }

    #[test]
    fn nothing_to_do_when_every_pod_is_current() {
        let pods = [pod("gw-a", Some("new"))];
        assert_eq!(
            next_wave(PROGRESSIVE, &pods, Some(at(0)), &Verdict::Healthy, at(1)),
            Wave::default()
        );
    }
}
