//! Which parts of a policy's status are observations, refreshed with every interval's samples
//! (demand, utilization, tokens used, tokens a second, when the last decision was made and its
//! numbers, the conditions' messages, the shared document's revision), and which say what the
//! operator did or found (targets, shares, bursts, scale changes, decisions' actions,
//! conditions' states, pods taking or refusing documents, the generation observed). A status
//! that moved only in its observations may wait for its turn to be written
//! ([`crate::reconcile`]'s refresh); any other change is written at once.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use poolpilot_api::ConnectionPolicyStatus;

use super::time::Timestamp;

/// Whether `new` differs from `old` only in observations (`false` when they are equal).
pub fn observations_only(old: &ConnectionPolicyStatus, new: &ConnectionPolicyStatus) -> bool {
    old != new && without_observations(old) == without_observations(new)
}

/// `status` with every observation cleared.
fn without_observations(status: &ConnectionPolicyStatus) -> ConnectionPolicyStatus {
    let mut s = status.clone();
    // The document is shared by every policy on the same pods: another policy's change moves
    // its revision. A change of this policy's own numbers moves its targets or shares too.
    s.revision = None;
    s.limits_generation = None;
    for c in &mut s.conditions {
        c.message.clear();
    }
    for b in &mut s.backends {
        b.leased = None;
        b.pending = None;
        b.utilization = None;
        b.demand_by_class = None;
        b.tokens_per_second = None;
        b.http1_fallback = None;
        // Whether the provider refused, or certificates failed, is a finding (its Event is told
        // once, when it appears); how many in the window is an observation.
        if let Some(c) = &mut b.cooldown {
            *c = Default::default();
        }
        if let Some(n) = &mut b.tls_verification_failures {
            *n = 0;
        }
        for share in &mut b.shares {
            share.demand = None;
        }
        if let Some(d) = &mut b.last_decision {
            d.time = Time(Timestamp::UNIX_EPOCH);
            d.reason.clear();
        }
    }
    for c in &mut s.clients {
        for share in &mut c.shares {
            share.demand = None;
        }
    }
    for t in &mut s.tokens {
        t.used_per_minute = None;
        for share in &mut t.shares {
            share.used_per_minute = None;
        }
    }
    if let Some(pods) = &mut s.pods {
        for p in &mut pods.items {
            p.revision = None;
            p.generation = None;
            p.since = None;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use poolpilot_api::policy::{
        BackendStatus, DecisionAction, DecisionRecord, PodRun, PodShare, PodsStatus,
        TokenThroughput,
    };

    use super::*;

    fn at(second: i64) -> Time {
        Time(Timestamp::from_second(1_800_000_000 + second).unwrap())
    }

    /// A settled policy's status, as the status step writes it.
    fn status() -> ConnectionPolicyStatus {
        ConnectionPolicyStatus {
            observed_generation: Some(3),
            revision: Some("9f2c1e".into()),
            limits_generation: Some(7),
            targets: Some("model-a=12".into()),
            updated: Some("2/2".into()),
            conditions: vec![Condition {
                type_: "RolledOut".into(),
                status: "True".into(),
                reason: "RolledOut".into(),
                message: "2/2 pods run their documents; ConfigMap revision 9f2c1e (generation 7)"
                    .into(),
                observed_generation: Some(3),
                last_transition_time: at(0),
            }],
            backends: vec![BackendStatus {
                name: "model-a".into(),
                endpoints: 2,
                target: 12,
                per_pod: 6,
                shares: vec![
                    PodShare {
                        pod: "gw-0".into(),
                        share: 6,
                        demand: Some(4.5),
                    },
                    PodShare {
                        pod: "gw-1".into(),
                        share: 6,
                        demand: Some(4.0),
                    },
                ],
                leased: Some(8.0),
                pending: Some(0.5),
                utilization: Some(0.35),
                tokens_per_second: Some(TokenThroughput {
                    input: 1520.0,
                    output: 312.0,
                }),
                last_decision: Some(DecisionRecord {
                    time: at(15),
                    action: DecisionAction::NoChange,
                    reason: "demand 8.5 recommends 12, the target".into(),
                }),
                ..BackendStatus::default()
            }],
            pods: Some(PodsStatus {
                selected: 2,
                ready: 2,
                updated: 2,
                items: vec![PodRun {
                    name: "gw-0".into(),
                    revision: Some("9f2c1e".into()),
                    generation: Some(7),
                    current: true,
                    since: Some(at(0)),
                    last_error: None,
                }],
                ..PodsStatus::default()
            }),
            ..ConnectionPolicyStatus::default()
        }
    }

    #[test]
    fn the_next_intervals_samples_and_another_policys_revision_are_observations() {
        let old = status();
        let mut new = status();
        new.revision = Some("77aa01".into());
        new.limits_generation = Some(8);
        new.conditions[0].message =
            "2/2 pods run their documents; ConfigMap revision 77aa01 (generation 8)".into();
        let b = &mut new.backends[0];
        b.leased = Some(9.0);
        b.shares[0].demand = Some(5.0);
        b.tokens_per_second = Some(TokenThroughput {
            input: 1490.0,
            output: 318.0,
        });
        b.last_decision = Some(DecisionRecord {
            time: at(30),
            action: DecisionAction::NoChange,
            reason: "demand 9 recommends 12, the target".into(),
        });
        let pods = new.pods.as_mut().unwrap();
        pods.items[0].revision = Some("77aa01".into());
        pods.items[0].since = Some(at(30));
        assert!(observations_only(&old, &new));
        assert!(!observations_only(&old, &old), "no change is no refresh");
        let mut quiet = status();
        quiet.backends[0].tokens_per_second = None;
        assert!(
            observations_only(&old, &quiet),
            "token rates going (no model calls in the window) are an observation too"
        );
    }

    #[test]
    fn what_the_operator_did_or_found_is_never_an_observation() {
        type Change = fn(&mut ConnectionPolicyStatus);
        let changes: [(&str, Change); 10] = [
            ("observed generation", |s| s.observed_generation = Some(4)),
            ("targets", |s| s.targets = Some("model-a=14".into())),
            ("target", |s| s.backends[0].target = 14),
            ("a pod's share", |s| s.backends[0].shares[0].share = 7),
            ("burst", |s| s.backends[0].burst = 2),
            ("decision action", |s| {
                s.backends[0].last_decision.as_mut().unwrap().action = DecisionAction::Rebalance
            }),
            ("condition state", |s| {
                s.conditions[0].status = "False".into()
            }),
            ("condition reason", |s| {
                s.conditions[0].reason = "Halted".into()
            }),
            ("a pod behind", |s| {
                s.pods.as_mut().unwrap().items[0].current = false;
            }),
            ("a pod's error", |s| {
                s.pods.as_mut().unwrap().items[0].last_error = Some("422".into());
            }),
        ];
        for (what, change) in changes {
            let mut new = status();
            change(&mut new);
            assert!(!observations_only(&status(), &new), "{what}");
            // Nor beside a refreshed observation.
            new.backends[0].leased = Some(1.0);
            assert!(
                !observations_only(&status(), &new),
                "{what} with new samples"
            );
        }
    }
}
