//! The status step's pure half: a policy's plan, its autoscale memory and the rollout's outcome
//! become the `ConnectionPolicyStatus` to apply (conditions, per-backend targets and decisions,
//! pods selected / updated, fd numbers).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use poolpilot_api::policy::{
    BackendStatus, ClientStatus, CooldownStatus, DecisionRecord, IdleTimeoutStatus, Mode,
    PodFailure, PodRun, PodShare, PodsStatus, ScaleRecord, TokenBudgetStatus, TokenThroughput,
};
use poolpilot_api::{ConnectionPolicySpec, ConnectionPolicyStatus};

use super::conditions::{Computed, Kind, Status, merge};
use super::input::{PolicyInput, TokenRates};
use super::memory::Memory;
use super::output::PolicyPlan;
use super::time::Timestamp;
use super::validate::Acceptance;

/// The most pods `backends[].shares` lists (status stays small on a large fleet).
pub const MAX_SHARES_LISTED: usize = 50;
use super::waves::{PodState, refusals, updated_count};

/// How the rollout went for one policy's ready selected pods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RolloutReport {
    /// Every ready selected pod with what it runs and should run.
    pub pods: Vec<PodState>,
    /// Pods that could not be reached, with the error.
    pub unreachable: BTreeMap<String, String>,
    /// Of those, the pods that did not answer within the per-pod timeout (tried again at the
    /// next reconcile, not sooner: a hung pod would only hold its slot again).
    pub slow: BTreeSet<String>,
    /// The pods that run a newer generation: answered so (409), or found on a later pass's
    /// document. The next pass numbers their document above it.
    pub older: BTreeSet<String>,
    /// Why the rollout waits, if it does.
    pub waiting: Option<String>,
    /// When the canaries' verification ends, from now, while it runs: the policy's next
    /// reconcile comes then, so that the rest follow without waiting for its interval.
    pub verified_in: Option<Duration>,
    /// Why the rollout stopped, if it did.
    pub halted: Option<String>,
}

/// What every message of a backend refused for its Service's namespace says (`Accepted=False`,
/// reason `NamespaceNotAllowed`).
pub const NAMESPACE_REFUSAL: &str = "is not a namespace this operator reads backends from";

/// The status of `policy` after this run.
pub fn compute(
    policy: &PolicyInput,
    plan: &PolicyPlan,
    memory: &Memory,
    rollout: &RolloutReport,
    now: Timestamp,
) -> ConnectionPolicyStatus {
    let old = policy.status.clone().unwrap_or_default();
    let ready = plan.ready.len();
    let live = plan.live.len();
    let updated = updated_count(&rollout.pods);
    let doc = plan.document.as_ref();

    let backends: Vec<BackendStatus> = plan
        .backends
        .iter()
        .map(|b| {
            let mem = memory.backends.get(&(plan.key.clone(), b.name.clone()));
            let demand = b.sample.leased.zip(b.sample.pending).map(|(l, p)| l + p);
            let pooled = plan.pooled(b) as f64 * f64::from(b.endpoints);
            BackendStatus {
                name: b.name.clone(),
                endpoints: b.endpoints,
                target: b.target,
                per_pod: b.per_pod,
                burst: b.burst,
                shares: shares_listed(&plan.holders, &b.shares, &b.demand),
                leased: b.sample.leased.filter(|v| v.is_finite()),
                pending: b.sample.pending.filter(|v| v.is_finite()),
                utilization: demand
                    .filter(|d| d.is_finite() && pooled > 0.0)
                    .map(|d| (d / pooled * 1000.0).round() / 1000.0),
                demand_by_class: super::priority::status(&b.sample.classes),
                tokens_per_second: b.sample.tokens.and_then(token_throughput),
                http1_fallback: b
                    .sample
                    .h2_fallback
                    .filter(|v| v.is_finite() && *v >= 0.5)
                    .map(|v| v.round() as u32),
                cooldown: b
                    .sample
                    .provider_refusals
                    .map(count)
                    .filter(|n| *n > 0)
                    .map(|refusals| CooldownStatus {
                        refusals,
                        refused_calls: b.sample.cooldown_refused.map_or(0, count),
                        fallback_calls: b.sample.fallbacks.map_or(0, count),
                    }),
                tls_verification_failures: b
                    .sample
                    .tls_verification_failures
                    .map(count)
                    .filter(|n| *n > 0),
                idle_timeout: b.idle_timeout.lowered.map(|l| IdleTimeoutStatus {
                    in_force: b.idle_timeout.in_force.into(),
                    configured: b.idle_timeout.configured.into(),
                    backend_closed_after_seconds: (l.closed_after * 1000.0).round() / 1000.0,
                    since: Time(l.at),
                    tries: b.idle_timeout.tries,
                }),
                last_scale: mem
                    .and_then(|m| m.last_scale.as_ref())
                    .map(|s| ScaleRecord {
                        time: Time(s.at),
                        from: s.from,
                        to: s.to,
                        reason: s.reason.clone(),
                    }),
                last_decision: mem
                    .and_then(|m| m.last_decision.as_ref())
                    .map(|d| DecisionRecord {
                        time: Time(d.at),
                        action: d.action,
                        reason: d.reason.clone(),
                    }),
            }
            .with_history_from(&old, &b.name)
        })
        .collect();

    // The client divisions, so that a restarted (or newly elected) operator keeps them instead
    // of falling back to the even split and changing every pod's document.
    let clients: Vec<ClientStatus> = if plan.holders.len() <= MAX_SHARES_LISTED {
        plan.client_shares
            .values()
            .map(|d| ClientStatus {
                key_sha256: d.key_sha256.clone(),
                max_concurrency: d.concurrency.target,
                shares: shares_listed(&plan.holders, &d.concurrency.shares, &d.concurrency.demand),
            })
            .collect()
    } else {
        Vec::new()
    };

    // Each token budget's use, and its division where it has one.
    let tokens: Vec<TokenBudgetStatus> = match policy.spec.clients.as_ref() {
        Some(c) if plan.acceptance.is_accepted() => {
            let used = |client: &str| {
                plan.token_use
                    .as_ref()
                    .map(|u| u.get(client).copied().unwrap_or(0.0))
            };
            let listed = if plan.holders.len() <= MAX_SHARES_LISTED {
                MAX_SHARES_LISTED
            } else {
                0
            };
            let named = c.overrides.iter().filter_map(|o| {
                let t = o.tokens.as_ref().or(c.tokens.as_ref())?;
                Some(super::tokens::status(
                    &o.name,
                    t.per_minute,
                    used(&o.name),
                    plan.token_shares.get(&o.name),
                    listed,
                ))
            });
            let other = c.tokens.as_ref().map(|t| {
                super::tokens::status(
                    super::tokens::OTHER,
                    t.per_minute,
                    used(super::tokens::OTHER),
                    None,
                    0,
                )
            });
            named.chain(other).collect()
        }
        _ => Vec::new(),
    };

    let mut failures: Vec<PodFailure> = refusals(&rollout.pods)
        .into_iter()
        .chain(rollout.unreachable.clone())
        .map(|(pod, message)| PodFailure { pod, message })
        .collect();
    failures.sort_by(|a, b| a.pod.cmp(&b.pod));

    let (items, omitted) = pod_runs(&old, plan, rollout, &failures, now);

    let conditions = merge(
        &old.conditions,
        conditions(&policy.spec, plan, rollout, &backends, memory, updated),
        policy.generation,
        now,
    );
    let accepted = plan.acceptance.is_accepted();
    ConnectionPolicyStatus {
        observed_generation: Some(policy.generation),
        revision: doc.map(|d| d.revision.clone()),
        limits_generation: doc.map(|d| d.generation),
        targets: accepted.then(|| {
            backends
                .iter()
                .map(|b| format!("{}={}", b.name, b.target))
                .collect::<Vec<_>>()
                .join(",")
        }),
        updated: Some(format!("{updated}/{live}")),
        conditions,
        backends,
        pods: Some(PodsStatus {
            selected: plan.selected.len() as u32,
            ready: ready as u32,
            updated: updated as u32,
            fd_limit: plan.fds.limit,
            fd_needed: plan.fds.needed,
            failures,
            items,
            omitted,
        }),
        clients,
        tokens,
    }
}

/// Each holder's share and the demand it was divided by, for status (the first
/// [`MAX_SHARES_LISTED`] holders; demand rounded to hundredths).
fn shares_listed(holders: &[String], shares: &[u32], demand: &[Option<f64>]) -> Vec<PodShare> {
    holders
        .iter()
        .zip(shares)
        .zip(demand.iter().chain(std::iter::repeat(&None)))
        .take(MAX_SHARES_LISTED)
        .map(|((pod, &share), demand)| PodShare {
            pod: pod.clone(),
            share,
            demand: demand
                .filter(|d| d.is_finite())
                .map(|d| (d * 100.0).round() / 100.0),
        })
        .collect()
}

/// The most pods `status.pods.items` lists.
pub const MAX_POD_ITEMS: usize = 50;

/// What each selected pod runs (the first [`MAX_POD_ITEMS`] by name, and how many more): its
/// revision and generation, since when (kept from the stored status while the revision holds),
/// and its last error (kept until it takes another revision).
fn pod_runs(
    old: &ConnectionPolicyStatus,
    plan: &PolicyPlan,
    rollout: &RolloutReport,
    failures: &[PodFailure],
    now: Timestamp,
) -> (Vec<PodRun>, u32) {
    let before: BTreeMap<&str, &PodRun> = old
        .pods
        .iter()
        .flat_map(|p| &p.items)
        .map(|r| (r.name.as_str(), r))
        .collect();
    let mut names: Vec<&String> = plan.selected.iter().collect();
    names.sort();
    let omitted = names.len().saturating_sub(MAX_POD_ITEMS) as u32;
    let items = names
        .into_iter()
        .take(MAX_POD_ITEMS)
        .map(|name| {
            let state = rollout.pods.iter().find(|p| &p.name == name);
            let revision = state.and_then(|s| s.acked.clone());
            let generation = state.and_then(|s| s.generation);
            let stored = before
                .get(name.as_str())
                .filter(|r| r.revision == revision && r.generation == generation);
            let error = failures
                .iter()
                .find(|f| &f.pod == name)
                .map(|f| f.message.clone())
                .or_else(|| stored.and_then(|r| r.last_error.clone()));
            PodRun {
                name: name.clone(),
                current: state.is_some_and(|s| {
                    !s.desired.is_empty() && s.acked.as_deref() == Some(s.desired.as_str())
                }),
                since: revision
                    .as_ref()
                    .map(|_| stored.and_then(|r| r.since.clone()).unwrap_or(Time(now))),
                revision,
                generation,
                last_error: error,
            }
        })
        .collect();
    (items, omitted)
}

trait WithHistory {
    fn with_history_from(self, old: &ConnectionPolicyStatus, name: &str) -> Self;
}

impl WithHistory for BackendStatus {
    /// Keeps the stored last scale and last decision when memory has none (after an operator
    /// restart).
    fn with_history_from(mut self, old: &ConnectionPolicyStatus, name: &str) -> Self {
        let stored = old.backends.iter().find(|b| b.name == name);
        if self.last_scale.is_none() {
            self.last_scale = stored.and_then(|b| b.last_scale.clone());
        }
        if self.last_decision.is_none() {
            self.last_decision = stored.and_then(|b| b.last_decision.clone());
        }
        self
    }
}

fn conditions(
    spec: &ConnectionPolicySpec,
    plan: &PolicyPlan,
    rollout: &RolloutReport,
    backends: &[BackendStatus],
    memory: &Memory,
    updated: usize,
) -> Vec<Computed> {
    let accepted = match &plan.acceptance {
        Acceptance::Accepted => Computed::new(
            Kind::Accepted,
            Status::True,
            "Accepted",
            "valid, no conflicts",
        ),
        // A backend Service in a namespace the operator may not read (reconcile/observe.rs).
        Acceptance::Invalid(errors) if errors.iter().all(|e| e.contains(NAMESPACE_REFUSAL)) => {
            Computed::new(
                Kind::Accepted,
                Status::False,
                "NamespaceNotAllowed",
                errors.join("; "),
            )
        }
        Acceptance::Invalid(errors) => {
            Computed::new(Kind::Accepted, Status::False, "Invalid", errors.join("; "))
        }
        Acceptance::Conflicted(why) => {
            Computed::new(Kind::Accepted, Status::False, "Conflicted", why.clone())
        }
    };
    if !plan.acceptance.is_accepted() {
        let why = "the policy is not accepted";
        return vec![
            accepted,
            Computed::new(Kind::MetricsAvailable, Status::Unknown, "NotAccepted", why),
            Computed::new(Kind::FdBudget, Status::Unknown, "NotAccepted", why),
            Computed::new(Kind::RolledOut, Status::False, "NotAccepted", why),
            Computed::new(Kind::Saturated, Status::Unknown, "NotAccepted", why),
            Computed::new(Kind::Ready, Status::False, "NotAccepted", why),
        ];
    }

    let metrics = match &plan.metrics_available {
        None => Computed::new(
            Kind::MetricsAvailable,
            Status::Unknown,
            "AutoscaleDisabled",
            "autoscale is off",
        ),
        Some(m) if m.available => Computed::new(
            Kind::MetricsAvailable,
            Status::True,
            "SamplesFresh",
            m.message.clone(),
        ),
        Some(m) => Computed::new(
            Kind::MetricsAvailable,
            Status::False,
            "SamplesMissing",
            m.message.clone(),
        ),
    };

    let fd = match plan.fds.within() {
        Some(true) => Computed::new(
            Kind::FdBudget,
            Status::True,
            "WithinBudget",
            plan.fds.message(),
        ),
        Some(false) => Computed::new(
            Kind::FdBudget,
            Status::False,
            "OverBudget",
            plan.fds.message(),
        ),
        None => Computed::new(
            Kind::FdBudget,
            Status::Unknown,
            "FdLimitUnknown",
            plan.fds.message(),
        ),
    };

    let ready = plan.ready.len();
    let live = plan.live.len();
    let revision = plan.document.as_ref().map(|d| {
        format!(
            "ConfigMap revision {} (generation {})",
            d.revision, d.generation
        )
    });
    let revision = revision.unwrap_or_default();
    let recommending = spec.mode == Mode::Recommend;
    let rolled = if recommending {
        Computed::new(
            Kind::RolledOut,
            Status::False,
            "Recommending",
            format!(
                "mode Recommend: nothing is sent to the pods; {updated}/{live} run the recommended documents; recommended {revision}, in ConfigMap {}-recommended",
                plan.key.name
            ),
        )
    } else if ready == 0 {
        Computed::new(
            Kind::RolledOut,
            Status::False,
            "NoReadyPods",
            "no ready gateway pod matches gatewaySelector",
        )
    } else if let Some(halted) = &rollout.halted {
        Computed::new(Kind::RolledOut, Status::False, "Halted", halted.clone())
    } else if updated == live {
        Computed::new(
            Kind::RolledOut,
            Status::True,
            "RolledOut",
            format!("{updated}/{live} pods run their documents; {revision}"),
        )
    } else {
        let mut msg = format!("{updated}/{live} pods run their documents; {revision}");
        if let Some(w) = &rollout.waiting {
            msg.push_str(&format!("; {w}"));
        }
        for (pod, e) in &rollout.unreachable {
            msg.push_str(&format!("; pod {pod} not updated: {e}"));
        }
        Computed::new(Kind::RolledOut, Status::False, "Progressing", msg)
    };

    // A backend without endpoints has no capacity at all: every request for it fails. Say so,
    // naming the Service, instead of leaving only `endpoints: 0` in its status.
    let unresolved = plan
        .backends
        .iter()
        .filter(|b| b.endpoints == 0)
        .map(|b| no_endpoints(spec, &b.name));
    let saturated: Vec<String> = unresolved
        .chain(plan.backends.iter().filter_map(|b| {
            let m = memory.backends.get(&(plan.key.clone(), b.name.clone()))?;
            m.saturation
                .as_ref()
                .map(|why| format!("{}: {why}", b.name))
        }))
        .collect();
    // Every holder keeps at least one connection per endpoint: with more holders than the
    // budget allows, the fleet opens more than it. Never silently.
    let overcommitted: Vec<String> = plan
        .backends
        .iter()
        .filter_map(|b| {
            let holders = plan.holders.len();
            let (total, target) = b.overcommit()?;
            Some(format!(
                "{}: {holders} gateway pods keep at least 1 connection per endpoint each, \
                 {total} in all, over the backend's budget of {target} per endpoint; \
                 run fewer gateway pods or raise the budget",
                b.name
            ))
        })
        .collect();
    let saturated = if saturated.is_empty() && !overcommitted.is_empty() {
        Computed::new(
            Kind::Saturated,
            Status::True,
            "Overcommitted",
            overcommitted.join("; "),
        )
    } else if saturated.is_empty() {
        let util = backends
            .iter()
            .filter_map(|b| {
                b.utilization
                    .map(|u| format!("{} {:.0}%", b.name, u * 100.0))
            })
            .collect::<Vec<_>>()
            .join(", ");
        let msg = if util.is_empty() {
            "no backend is saturated".to_owned()
        } else {
            format!("utilization {util}")
        };
        Computed::new(Kind::Saturated, Status::False, "WithinCapacity", msg)
    } else {
        let all: Vec<String> = saturated.into_iter().chain(overcommitted).collect();
        Computed::new(Kind::Saturated, Status::True, "Saturated", all.join("; "))
    };

    let ready_cond = if recommending {
        Computed::new(
            Kind::Ready,
            Status::True,
            "Recommending",
            rolled.message.clone(),
        )
    } else if rolled.status == Status::True {
        Computed::new(Kind::Ready, Status::True, "Ready", rolled.message.clone())
    } else {
        Computed::new(
            Kind::Ready,
            Status::False,
            rolled.reason,
            rolled.message.clone(),
        )
    };
    vec![accepted, metrics, fd, rolled, saturated, ready_cond]
}

/// Why backend `name` has no endpoints, for the `Saturated` message.
fn no_endpoints(spec: &ConnectionPolicySpec, name: &str) -> String {
    let service = spec
        .backends
        .iter()
        .find(|b| b.name == name)
        .and_then(|b| b.endpoints.service.as_ref());
    match service {
        Some(s) => format!(
            "{name}: no endpoints: Service {} has no ready endpoint on port {}; requests for {name} fail with 503",
            s.name, s.port
        ),
        None => format!(
            "{name}: no endpoints: endpoints.addresses is empty; requests for {name} fail with 503"
        ),
    }
}

/// A count over a window from Prometheus' `increase()` (extrapolated, fractional) as a whole
/// number of events.
fn count(v: f64) -> u32 {
    if v.is_finite() && v > 0.0 {
        v.round().min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

/// A backend's token rates as its status reports them (`None` when either is not finite).
fn token_throughput(rates: TokenRates) -> Option<TokenThroughput> {
    let TokenRates { input, output } = rates;
    (input.is_finite() && output.is_finite()).then(|| TokenThroughput {
        input: three_figures(input.max(0.0)),
        output: three_figures(output.max(0.0)),
    })
}

/// `v` rounded to three significant figures: within half a percent of it, whatever its size.
/// Token rates span from a few a second to hundreds of thousands, so the fixed decimals of the
/// other rates in status (hundredths, thousandths) would keep the noise in a busy backend's
/// last digits and round a quiet one's away. Rounding alone does not spare a busy backend's
/// status its writes (its rate moves by more than that from one interval to the next): like
/// the other observations, the rates never make a write on their own
/// ([`super::observations`]), a change of them waits for the policy's refresh.
pub fn three_figures(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    // Scaled by an exact power of ten either way, so that 123456 comes out as 123000.
    let e = 2 - v.abs().log10().floor() as i32;
    if e >= 0 {
        let f = 10f64.powi(e);
        (v * f).round() / f
    } else {
        let f = 10f64.powi(-e);
        (v / f).round() * f
    }
}
