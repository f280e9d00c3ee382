//! Step 5, status (API): server-side apply of the computed status with the operator's one field
//! manager (at once when anything but observations changed, else at the policy's refresh:
//! `refresh.rs`), then Events for what changed: scale decisions, an fd budget breach, missing
//! metrics, a finished or halted rollout, a rejected policy.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use poolpilot_api::policy::Mode;
use poolpilot_api::{ConnectionPolicy, ConnectionPolicyStatus};
use serde_json::json;
use tracing::warn;

use super::context::{Context, FIELD_MANAGER};
use super::events::event_note;
use crate::gateway::Gateways;
use crate::metrics::OutcomeLabel;
use crate::plan::PolicyPlan;
use crate::plan::autoscale::{Decision, HELD_EVENT_AFTER};
use crate::plan::observations::observations_only;

/// Why the status step failed.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The status could not be applied.
    #[error("failed to apply the status of {name}")]
    Patch {
        /// The policy.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
}

/// Applies `status` and publishes the Events its changes call for.
pub async fn apply<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    plan: &PolicyPlan,
    status: ConnectionPolicyStatus,
) -> Result<(), StatusError> {
    let name = policy.name_any();
    let api: Api<ConnectionPolicy> =
        Api::namespaced(ctx.client.clone(), &policy.namespace().unwrap_or_default());
    let old = policy.status.clone().unwrap_or_default();
    let key = format!("{}/{name}", policy.namespace().unwrap_or_default());
    let now = (ctx.clock)();
    // A status that moved only in its observations waits for its turn (`refresh.rs`); the
    // stored one stays what the next reconcile compares with, so nothing done is lost.
    let deferred = policy.status.is_some()
        && observations_only(&old, &status)
        && !ctx.status_refresh.due(&key, &old, now);
    let mut events = events(&old, &status, plan, policy.spec.mode);
    if deferred {
        // Told when the status that names the new revision is written, not at every
        // reconcile until then.
        events.retain(|e| e.reason != "RolledOut");
        ctx.metrics
            .status_writes
            .get_or_create(&OutcomeLabel {
                outcome: "deferred",
            })
            .inc();
    } else if policy.status.as_ref() != Some(&status) {
        let patch = json!({
            "apiVersion": "poolpilot.io/v1alpha1",
            "kind": "ConnectionPolicy",
            "status": status,
        });
        api.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|source| StatusError::Patch {
            name: name.clone(),
            source,
        })?;
        ctx.status_refresh.written(&key, now);
        ctx.metrics
            .status_writes
            .get_or_create(&OutcomeLabel { outcome: "written" })
            .inc();
    }
    let reference = policy.object_ref(&());
    for e in events {
        if let Err(err) = ctx.recorder.publish(&e, &reference).await {
            warn!(reason = %e.reason, error = %crate::report(&err), "failed to publish an Event");
        }
    }
    Ok(())
}

fn condition<'a>(s: &'a ConnectionPolicyStatus, kind: &str) -> Option<&'a Condition> {
    s.conditions.iter().find(|c| c.type_ == kind)
}

/// The Events for the change from `old` to `new`: one per scale decision, and one per condition
/// that flipped into a state worth telling.
pub fn events(
    old: &ConnectionPolicyStatus,
    new: &ConnectionPolicyStatus,
    plan: &PolicyPlan,
    mode: Mode,
) -> Vec<Event> {
    let mut out = Vec::new();
    let event = |type_, reason: &str, note: String, action: &str| Event {
        type_,
        reason: reason.to_owned(),
        note: Some(event_note(&note)),
        action: action.to_owned(),
        secondary: None,
    };
    for b in &plan.backends {
        match &b.decision {
            Some(Decision::ScaleUp(s) | Decision::ScaleDown(s) | Decision::StepBack(s))
                if mode == Mode::Recommend =>
            {
                let reason = if s.to > s.from {
                    "WouldScaleUp"
                } else {
                    "WouldScaleDown"
                };
                out.push(event(
                    EventType::Normal,
                    reason,
                    format!("would scale {} {} → {}: {}", b.name, s.from, s.to, s.reason),
                    "Recommend",
                ));
            }
            Some(Decision::ScaleUp(s)) => out.push(event(
                EventType::Normal,
                "ScaledUp",
                format!("{}: target {} → {}: {}", b.name, s.from, s.to, s.reason),
                "Scale",
            )),
            Some(Decision::ScaleDown(s)) => out.push(event(
                EventType::Normal,
                "ScaledDown",
                format!("{}: target {} → {}: {}", b.name, s.from, s.to, s.reason),
                "Scale",
            )),
            // The knee guard lowered the target: growth made the backend worse (or it probes
            // below the best level).
            Some(Decision::StepBack(s)) => out.push(event(
                EventType::Warning,
                "SteppedBack",
                format!("{}: target {} → {}: {}", b.name, s.from, s.to, s.reason),
                "Scale",
            )),
            // Once per hold: when it has lasted HELD_EVENT_AFTER decisions (the recorder would
            // only count repeats of the same note, and the numbers change every interval).
            Some(d) if d.holds_growth() && b.held == HELD_EVENT_AFTER => {
                let why = new
                    .backends
                    .iter()
                    .find(|s| s.name == b.name)
                    .and_then(|s| s.last_decision.as_ref())
                    .map_or_else(String::new, |d| d.reason.clone());
                out.push(event(
                    EventType::Warning,
                    "GrowthHeld",
                    format!(
                        "{}: growth held for {HELD_EVENT_AFTER} intervals in a row: {why}",
                        b.name
                    ),
                    "Scale",
                ));
            }
            _ => {}
        }
        // The idle timeout lowered under the backend's keep-alive, or the spec's value tried
        // again after a quiet lowered one: once, in the run that did.
        let t = &b.idle_timeout;
        let tuned = [
            (
                t.lowered.is_some_and(|l| l.now),
                t.describe(),
                ("IdleTimeoutLowered", "WouldLowerIdleTimeout", "lower"),
            ),
            (
                t.tried.is_some_and(|t| t.now),
                t.describe_try(),
                ("IdleTimeoutRestored", "WouldRestoreIdleTimeout", "restore"),
            ),
        ];
        for (now, what, (reason, would, verb)) in tuned {
            let Some(what) = what.filter(|_| now) else {
                continue;
            };
            let (reason, note) = if mode == Mode::Recommend {
                (would, format!("would {verb} {}'s {what}", b.name))
            } else {
                (reason, format!("{}: {what}", b.name))
            };
            out.push(event(EventType::Normal, reason, note, "Tune"));
        }
        // The provider's refusals and failed certificate checks: told once, when they appear
        // (the status keeps the counts).
        let was = old.backends.iter().find(|s| s.name == b.name);
        let is = new.backends.iter().find(|s| s.name == b.name);
        let window = poolpilot_api::Duration::from(b.sample.findings_window);
        if let Some(c) = is.and_then(|s| s.cooldown.as_ref())
            && was.is_none_or(|s| s.cooldown.is_none())
        {
            out.push(event(
                EventType::Warning,
                "ProviderCoolingDown",
                format!(
                    "{}: the provider refused {} calls with Retry-After over the last {window}; none was sent into its refusal while it lasted: {} went to a fallback, {} were answered 429 backend_cooling_down",
                    b.name, c.refusals, c.fallback_calls, c.refused_calls
                ),
                "Observe",
            ));
        }
        if let Some(n) = is.and_then(|s| s.tls_verification_failures)
            && was.is_none_or(|s| s.tls_verification_failures.is_none())
        {
            out.push(event(
                EventType::Warning,
                "UpstreamTlsVerificationFailed",
                format!(
                    "{}: {n} calls failed verification of the backend's TLS certificate over the last {window} (502 upstream_tls_verification_failed): check tls.serverName and the CA (tls.caBundleSecret)",
                    b.name
                ),
                "Observe",
            ));
        }
        if let Some(why) = &b.rebalanced {
            let (reason, verb) = if mode == Mode::Recommend {
                ("WouldRebalanceShares", "would re-divide")
            } else {
                ("SharesRebalanced", "re-divided")
            };
            out.push(event(
                EventType::Normal,
                reason,
                format!("{}: shares {verb}: {why}", b.name),
                "Rebalance",
            ));
        }
    }
    let flipped = |kind: &str, status: &str| {
        let now = condition(new, kind).filter(|c| c.status == status)?;
        let before = condition(old, kind);
        let same = before.is_some_and(|b| b.status == now.status && b.reason == now.reason);
        (!same).then_some(now)
    };
    if let Some(c) = flipped("Accepted", "False") {
        out.push(event(
            EventType::Warning,
            &c.reason,
            c.message.clone(),
            "Validate",
        ));
    }
    if let Some(c) = flipped("MetricsAvailable", "False") {
        out.push(event(
            EventType::Warning,
            "MetricsMissing",
            c.message.clone(),
            "Observe",
        ));
    }
    if let Some(c) = flipped("FdBudget", "False") {
        out.push(event(
            EventType::Warning,
            "FdBudgetExceeded",
            c.message.clone(),
            "CheckFds",
        ));
    }
    if let Some(c) = flipped("RolledOut", "False").filter(|c| c.reason == "Halted") {
        out.push(event(
            EventType::Warning,
            "RolloutHalted",
            c.message.clone(),
            "RollOut",
        ));
    }
    let rolled = condition(new, "RolledOut").filter(|c| c.status == "True");
    if let Some(c) = rolled
        && (flipped("RolledOut", "True").is_some() || old.revision != new.revision)
    {
        out.push(event(
            EventType::Normal,
            "RolledOut",
            c.message.clone(),
            "RollOut",
        ));
    }
    out
}

#[cfg(test)]
pub(super) mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::plan::autoscale::{Bounds, Scale};
    use crate::plan::budget::FdReport;
    use crate::plan::idle_timeout::IdleTimeout;
    use crate::plan::validate::Acceptance;
    use crate::plan::{BackendPlan, BackendSample, PolicyKey, Timestamp};

    pub(crate) fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    pub(crate) fn cond(kind: &str, status: &str, reason: &str, message: &str) -> Condition {
        Condition {
            type_: kind.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation: Some(1),
            last_transition_time: Time(at(0)),
        }
    }

    pub(crate) fn plan(decision: Option<Decision>) -> PolicyPlan {
        plan_held(decision, 0)
    }

    /// A plan whose one backend has held growth `held` decisions in a row.
    pub(crate) fn plan_held(decision: Option<Decision>, held: u32) -> PolicyPlan {
        PolicyPlan {
            key: PolicyKey {
                namespace: "ns".into(),
                name: "p".into(),
            },
            acceptance: Acceptance::Accepted,
            selected: vec![],
            holders: vec![],
            live: vec![],
            ready: vec![],
            backends: vec![BackendPlan {
                name: "model-a".into(),
                endpoints: 1,
                target: 540,
                per_pod: 540,
                shares: vec![],
                demand: vec![],
                burst: 0,
                rebalanced: None,
                clamped: false,
                bounds: Bounds {
                    min: 1,
                    upper: 560,
                    margin: 0.2,
                    window: std::time::Duration::from_secs(300),
                    max_step_percent: 20,
                    capacity: 700,
                    interval: std::time::Duration::from_secs(15),
                    saturation_threshold: None,
                },
                decision,
                held,
                sample: BackendSample::default(),
                idle_timeout: IdleTimeout::configured(std::time::Duration::from_secs(30)),
                streams_per_socket: 1,
            }],
            fds: FdReport::default(),
            metrics_available: None,
            client_shares: Default::default(),
            token_shares: Default::default(),
            client_token_shares: Default::default(),
            token_use: None,
            document: None,
        }
    }

    pub(crate) fn status(conditions: Vec<Condition>) -> ConnectionPolicyStatus {
        ConnectionPolicyStatus {
            conditions,
            ..Default::default()
        }
    }

    #[test]
    fn scale_decisions_and_flips_become_events_once() {
        let scale = Scale {
            at: at(15),
            from: 300,
            to: 540,
            reason: "demand 450".into(),
        };
        let old = status(vec![cond("FdBudget", "True", "WithinBudget", "")]);
        let new = status(vec![cond(
            "FdBudget",
            "False",
            "OverBudget",
            "needs 1342 fds, pods allow 1024",
        )]);
        let events = events(
            &old,
            &new,
            &plan(Some(Decision::ScaleUp(scale))),
            Mode::Enforce,
        );
        let got: Vec<(&str, Option<&str>)> = events
            .iter()
            .map(|e| (e.reason.as_str(), e.note.as_deref()))
            .collect();
        assert_eq!(
            got,
            [
                ("ScaledUp", Some("model-a: target 300 → 540: demand 450")),
                ("FdBudgetExceeded", Some("needs 1342 fds, pods allow 1024")),
            ]
        );
        // The same state again: no repeated warning.
        assert!(events_again(&new).is_empty());
    }

    /// A status whose model-a saw the provider refuse and certificates fail.
    pub(crate) fn refused_and_unverified() -> ConnectionPolicyStatus {
        ConnectionPolicyStatus {
            backends: vec![poolpilot_api::policy::BackendStatus {
                name: "model-a".into(),
                cooldown: Some(poolpilot_api::policy::CooldownStatus {
                    refusals: 23,
                    refused_calls: 0,
                    fallback_calls: 2250,
                }),
                tls_verification_failures: Some(4),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn the_providers_refusals_and_failed_certificates_are_told_once_when_they_appear() {
        let mut p = plan(None);
        p.backends[0].sample.findings_window = std::time::Duration::from_secs(300);
        let none = status(vec![]);
        let seen = refused_and_unverified();
        let got: Vec<(String, String)> = events(&none, &seen, &p, Mode::Enforce)
            .into_iter()
            .map(|e| (e.reason, e.note.unwrap_or_default()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "ProviderCoolingDown".to_owned(),
                    "model-a: the provider refused 23 calls with Retry-After over the last 5m; none was sent into its refusal while it lasted: 2250 went to a fallback, 0 were answered 429 backend_cooling_down".to_owned()
                ),
                (
                    "UpstreamTlsVerificationFailed".to_owned(),
                    "model-a: 4 calls failed verification of the backend's TLS certificate over the last 5m (502 upstream_tls_verification_failed): check tls.serverName and the CA (tls.caBundleSecret)".to_owned()
                ),
            ]
        );
        // Still there on the next run, with other counts: nothing more to tell.
        let mut later = seen.clone();
        later.backends[0].cooldown.as_mut().unwrap().refusals = 40;
        assert!(events(&seen, &later, &p, Mode::Enforce).is_empty());
        // Gone for a window, then back: told again.
        assert_eq!(events(&none, &seen, &p, Mode::Recommend).len(), 2);
    }

    #[test]
    fn a_lowered_idle_timeout_is_told_once_by_the_run_that_lowered_it() {
        let spec = std::time::Duration::from_secs(30);
        let lowered = IdleTimeout::next(spec, None, Some(2.05), true, at(10));
        let mut p = plan(None);
        p.backends[0].idle_timeout = lowered;
        let s = status(vec![]);
        let told = |p: &PolicyPlan, mode| {
            events(&s, &s, p, mode)
                .into_iter()
                .map(|e| (e.reason, e.note.unwrap_or_default()))
                .collect::<Vec<_>>()
        };
        let got = told(&p, Mode::Enforce);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0, "IdleTimeoutLowered");
        assert!(
            got[0].1.starts_with("model-a: idleTimeout 30s → 1230ms: "),
            "{}",
            got[0].1
        );
        let got = told(&p, Mode::Recommend);
        assert_eq!(got[0].0, "WouldLowerIdleTimeout");
        assert!(got[0].1.starts_with("would lower model-a's idleTimeout"));
        // The next run keeps it and says nothing.
        let kept = IdleTimeout::next(spec, Some(lowered), None, true, at(20));
        p.backends[0].idle_timeout = kept;
        assert!(told(&p, Mode::Enforce).is_empty());
        // An hour without closes: the spec's value again, told once.
        let tried = IdleTimeout::next(spec, Some(kept), None, true, at(10 + 3600));
        p.backends[0].idle_timeout = tried;
        let got = told(&p, Mode::Enforce);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0, "IdleTimeoutRestored");
        assert!(
            got[0].1.starts_with("model-a: idleTimeout 1230ms → 30s: the gateways found no connection closed by the backend for 1h"),
            "{}",
            got[0].1
        );
        let got = told(&p, Mode::Recommend);
        assert_eq!(got[0].0, "WouldRestoreIdleTimeout");
        assert!(got[0].1.starts_with("would restore model-a's idleTimeout"));
        p.backends[0].idle_timeout = IdleTimeout::next(spec, Some(tried), None, true, at(3700));
        assert!(told(&p, Mode::Enforce).is_empty());
    }

    fn events_again(s: &ConnectionPolicyStatus) -> Vec<Event> {
        events(
            s,
            s,
            &plan(Some(Decision::Steady {
                recommendation: 540,
            })),
            Mode::Enforce,
        )
    }

    pub(crate) fn at_bound() -> Decision {
        Decision::AtUpperBound {
            recommendation: 560,
        }
    }

    #[test]
    fn a_hold_is_told_once_when_it_has_lasted_three_intervals() {
        let mut new = status(vec![]);
        new.backends.push(poolpilot_api::policy::BackendStatus {
            name: "model-a".into(),
            last_decision: Some(poolpilot_api::policy::DecisionRecord {
                time: Time(at(45)),
                action: poolpilot_api::policy::DecisionAction::Hold,
                reason: "held at 560: demand wants 600 per endpoint".into(),
            }),
            ..Default::default()
        });
        let told: Vec<Vec<String>> = (1..=5)
            .map(|held| {
                events(
                    &new,
                    &new,
                    &plan_held(Some(at_bound()), held),
                    Mode::Enforce,
                )
                .into_iter()
                .map(|e| format!("{} {}", e.reason, e.note.unwrap_or_default()))
                .collect()
            })
            .collect();
        assert_eq!(
            told,
            [
                vec![],
                vec![],
                vec![
                    "GrowthHeld model-a: growth held for 3 intervals in a row: held at 560: demand wants 600 per endpoint"
                        .to_owned()
                ],
                vec![],
                vec![]
            ]
        );
        assert!(
            events(&new, &new, &plan_held(None, 3), Mode::Enforce).is_empty(),
            "no decision this run, no Event"
        );
    }

    #[test]
    fn rollout_completion_and_halts_are_told() {
        let old = status(vec![cond("RolledOut", "False", "Progressing", "1/2")]);
        let done = status(vec![cond(
            "RolledOut",
            "True",
            "RolledOut",
            "2/2 pods run their documents; ConfigMap revision abc (generation 3)",
        )]);
        let e = events(&old, &done, &plan(None), Mode::Enforce);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].reason, "RolledOut");
        let halted = status(vec![cond(
            "RolledOut",
            "False",
            "Halted",
            "pod gw-0 refused revision abc: bad",
        )]);
        let e = events(&old, &halted, &plan(None), Mode::Enforce);
        assert_eq!(
            (e[0].reason.as_str(), e[0].type_),
            ("RolloutHalted", EventType::Warning)
        );
    }
}
