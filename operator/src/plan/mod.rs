//! The pure planning core: given every policy and gateway pod of one namespace, the latest
//! Prometheus samples, the autoscale memory and `now`, decide the targets, check them against the
//! file-descriptor budget, render one limits document per pod and compute each policy's status.
//! No kube client, no IO, no clock: every decision here is a unit test.
//!
//! ```text
//!  policies + pods + endpoints + samples + memory + now
//!        │
//!   validate ──► conflicts (oldest wins) ──► accepted policies
//!        │
//!   autoscale (per backend, when its interval is due) ──► fleet targets
//!        │
//!   budget: target ÷ holders ──► per-pod shares ──► fd check (clamp) ──► render per pod
//!        │
//!   status (conditions with stable transition times)
//! ```

pub mod autoscale;
pub mod conditions;
pub mod fds;
pub mod memo;
pub mod priority;
pub mod render;
pub mod selector;
pub mod status;
pub mod validate;
pub mod waves;

#[cfg(test)]
pub(crate) mod tests;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
pub use k8s_openapi::jiff::Timestamp;
use poolpilot_api::limits::Endpoint;
use poolpilot_api::policy::StartFrom;
use poolpilot_api::{ConnectionPolicySpec, ConnectionPolicyStatus, GatewayLimits};
pub use render::{implausible_generations, plausible_generation};

use self::autoscale::{BackendMemory, Bounds, Decision};
use self::fds::FdReport;
use self::validate::Acceptance;

/// `namespace/name` of a policy.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyKey {
    /// The policy's namespace.
    pub namespace: String,
    /// The policy's name.
    pub name: String,
}

impl std::fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One policy as the planner needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyInput {
    /// Which policy.
    pub key: PolicyKey,
    /// `metadata.generation`.
    pub generation: i64,
    /// `metadata.creationTimestamp`; the older policy wins a conflict.
    pub created: Timestamp,
    /// The spec as stored.
    pub spec: ConnectionPolicySpec,
    /// The status as stored (conditions keep their transition times; targets survive restarts).
    pub status: Option<ConnectionPolicyStatus>,
    /// Resolved endpoints per backend name (from EndpointSlices or the static addresses).
    pub endpoints: BTreeMap<String, Vec<Endpoint>>,
}

impl PolicyInput {
    /// The gateway selector.
    pub fn selector(&self) -> &LabelSelector {
        &self.spec.gateway_selector
    }
}

/// One gateway pod in the policies' namespace.
#[derive(Clone, Debug, Default)]
pub struct GatewayPod {
    /// The pod's name.
    pub name: String,
    /// Its labels (matched against the policies' gateway selectors).
    pub labels: BTreeMap<String, String>,
    /// Its IP, once it has one.
    pub ip: Option<IpAddr>,
    /// Whether it is ready (Ready condition True, not terminating): it counts in `RolledOut`.
    pub ready: bool,
    /// Whether it is terminating (deletion requested): it drains and gets no new document, but
    /// holds its share until it is gone.
    pub terminating: bool,
    /// Whether its containers stopped for good (phase Succeeded or Failed): it holds nothing.
    pub stopped: bool,
    /// The limits the pod acknowledged last (from a PUT answer), if known.
    pub acked: Option<Acked>,
}

/// What a gateway pod said it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acked {
    /// Content revision.
    pub revision: String,
    /// Document generation.
    pub generation: u64,
}

/// The latest Prometheus samples for one backend (fleet sums over the pods a policy selects).
/// `None` is missing data: a query error, an empty result, NaN or a stale sample. Never zero.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BackendSample {
    /// Leased connections (calls in flight to the backend), averaged over the window.
    pub leased: Option<f64>,
    /// Pending lease requests, averaged over the window.
    pub pending: Option<f64>,
    /// Leased connections at the latest scrape (a crowd that began within the window shows
    /// here in full).
    pub leased_now: Option<f64>,
    /// Pending lease requests at the latest scrape.
    pub pending_now: Option<f64>,
    /// Upstream calls completed per second without a 5xx, over the window.
    pub completed: Option<f64>,
    /// Response body bytes received from the backend per second, over the window.
    pub bytes: Option<f64>,
    /// Median time from sending a request to the first byte of its response body, seconds.
    pub ttfb: Option<f64>,
    /// The window the averages and rates are taken over.
    pub window: std::time::Duration,
    /// The backend's own saturation signal, when it has a saturation query.
    pub saturation: SaturationSignal,
    /// Ready selected pods without fresh samples (no `process_max_fds` within two scrape
    /// intervals). While any is, the demand and throughput sums are missing: the fleet's demand
    /// is not the sum over the pods that happen to be scraped.
    pub unscraped: u32,
    /// What the selected pods run now: the sum of their pools' caps for the backend
    /// (`poolpilot_pool_max_connections`), for `autoscale.startFrom: Current`.
    pub current: Option<f64>,
    /// The demand per priority class, interactive first (reported, not planned on).
    pub classes: [priority::ClassSample; 2],
}

/// A backend's own saturation signal (`spec.backends[].saturation.query`) in a sample.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum SaturationSignal {
    /// No value: no query is configured, or the poller has not picked it up yet.
    #[default]
    NotConfigured,
    /// The query is configured but has not run since (a new or edited query).
    Pending,
    /// The query failed, returned nothing, or NaN.
    Missing,
    /// Its value (the largest, when it returned several series).
    Value(f64),
}

/// The latest file-descriptor samples of one pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodSample {
    /// `process_max_fds`.
    pub max_fds: Option<u64>,
    /// `process_open_fds`.
    pub open_fds: Option<u64>,
}

/// Everything Prometheus told us at one instant.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    /// Per policy and backend name.
    pub backends: BTreeMap<(PolicyKey, String), BackendSample>,
    /// Per pod name.
    pub pods: BTreeMap<String, PodSample>,
}

/// What the planner remembers between runs (the runtime keeps it in memory; after a restart it
/// is rebuilt from status).
#[derive(Clone, Debug, Default)]
pub struct Memory {
    /// Autoscale memory per policy and backend.
    pub backends: BTreeMap<(PolicyKey, String), BackendMemory>,
    /// The last known `process_max_fds` per pod (used while a sample is missing).
    pub fd_limits: BTreeMap<String, u64>,
    /// The last rendering, reused while its inputs are unchanged.
    pub rendered: Option<Arc<memo::Rendered>>,
}

/// The whole input of one planning run for one namespace.
#[derive(Clone, Debug, Default)]
pub struct FleetInput {
    /// Every policy in the namespace.
    pub policies: Vec<PolicyInput>,
    /// Every gateway pod in the namespace (selected by at least one policy or not).
    pub pods: Vec<GatewayPod>,
    /// The latest samples.
    pub samples: Samples,
    /// Documents already published (the policies' ConfigMaps): generations never go back.
    pub published: Vec<Acked>,
    /// Every rendered document's generation must be above this (a pod said it runs it).
    pub generation_floor: u64,
    /// The policy being reconciled: only its backends get autoscale decisions this run (the
    /// others keep their targets until their own reconcile). `None`: every policy decides.
    pub focus: Option<PolicyKey>,
}

/// The plan for one backend of an accepted policy.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendPlan {
    /// The backend's name.
    pub name: String,
    /// Endpoints resolved.
    pub endpoints: u32,
    /// The fleet-wide target per endpoint chosen by the autoscaler (or the upper bound).
    pub target: u32,
    /// Each holder's share after the fd check, rounded down; [`BackendPlan::share_of`] hands
    /// the remainder of the division out, one connection per pod.
    pub per_pod: u32,
    /// Whether the fd check lowered the shares (then no pod gets more than `per_pod`).
    pub clamped: bool,
    /// The bounds the target lives in.
    pub bounds: Bounds,
    /// What the autoscaler decided this run (`None`: not due this run).
    pub decision: Option<Decision>,
    /// Decisions in a row that held this backend's growth (0: the last one did not).
    pub held: u32,
    /// The sample the decision was made from.
    pub sample: BackendSample,
}

impl BackendPlan {
    /// The share of a holder: `per_pod`, plus one for the first `target mod holders` holders
    /// (by `rank`, their place among the holders in name order), so that the shares add up to
    /// the fleet target exactly. `rank` `None` (the durable ConfigMap's document, for pods that
    /// start later) and shares the fd check clamped get `per_pod`.
    ///
    /// Ranking in name order keeps resizes within the budget: a pod joining never raises another
    /// pod's share, and a pod leaving never lowers one, so the shares only shrink when pods are
    /// created and only grow once pods are gone.
    pub fn share_of(&self, rank: Option<usize>, holders: usize) -> u32 {
        let Some(rank) = rank else {
            return self.per_pod;
        };
        let holders = u32::try_from(holders).unwrap_or(u32::MAX);
        if holders == 0 || self.clamped || self.per_pod != fds::share(self.target, holders) {
            return self.per_pod;
        }
        let remainder = self
            .target
            .saturating_sub(self.per_pod.saturating_mul(holders));
        self.per_pod + u32::from(u32::try_from(rank).unwrap_or(u32::MAX) < remainder)
    }
}

impl BackendPlan {
    /// Connections per endpoint the `holders` would open together when each takes its share:
    /// more than the target when there are more holders than the target allows (every share is
    /// at least 1).
    pub fn fleet_total(&self, holders: usize) -> u64 {
        (0..holders)
            .map(|rank| u64::from(self.share_of(Some(rank), holders)))
            .sum()
    }

    /// The overcommit, when the shares' floor of 1 takes the fleet over the backend's budget:
    /// `(fleet total, target)`.
    pub fn overcommit(&self, holders: usize) -> Option<(u64, u32)> {
        let total = self.fleet_total(holders);
        (total > u64::from(self.target)).then_some((total, self.target))
    }
}

/// The plan for one policy.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyPlan {
    /// Which policy.
    pub key: PolicyKey,
    /// Whether it is accepted, and if not why.
    pub acceptance: Acceptance,
    /// Names of the pods it selects, sorted.
    pub selected: Vec<String>,
    /// Of those, the pods that may hold backend connections and divide the targets among them:
    /// every one not stopped, including pods still Pending or not Ready (they may start serving
    /// any moment) and terminating ones (they hold connections until they are gone).
    pub holders: Vec<String>,
    /// Of the holders, those to send documents to: every one not terminating.
    pub live: Vec<String>,
    /// Of those, the ready ones.
    pub ready: Vec<String>,
    /// Per backend, in spec order (empty when not accepted).
    pub backends: Vec<BackendPlan>,
    /// The fd check over the pods it selects.
    pub fds: FdReport,
    /// Whether its metrics are available (`None` when autoscale is off).
    pub metrics_available: Option<MetricsState>,
    /// The document its ConfigMap holds, for pods that start later: the policies on its first
    /// selected pod, each backend at the base share (the smallest). Shared by every policy on
    /// the same pods.
    pub document: Option<Arc<GatewayLimits>>,
}

impl PolicyPlan {
    /// `pod`'s place among the holders, which decides who gets the division's remainder.
    pub fn rank(&self, pod: &str) -> Option<usize> {
        self.holders.iter().position(|h| h == pod)
    }

    /// `pod`'s share of backend `b` (a holder's rank share; the base share for anyone else).
    pub fn share(&self, b: &BackendPlan, pod: &str) -> u32 {
        b.share_of(self.rank(pod), self.holders.len())
    }

    /// Connections per endpoint of backend `b` pooled by the ready pods: the sum of their shares.
    pub fn pooled(&self, b: &BackendPlan) -> u64 {
        self.ready.iter().map(|p| u64::from(self.share(b, p))).sum()
    }
}

/// Availability of a policy's metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsState {
    /// False after three missed samples in a row, until two fresh ones.
    pub available: bool,
    /// Why, for the condition message.
    pub message: String,
}

/// The output of one planning run.
#[derive(Clone, Debug, Default)]
pub struct FleetPlan {
    /// Per policy, in input order.
    pub policies: Vec<PolicyPlan>,
    /// The document each selected pod should run, by pod name.
    pub documents: BTreeMap<String, Arc<GatewayLimits>>,
}

impl FleetPlan {
    /// The plan of one policy.
    pub fn policy(&self, key: &PolicyKey) -> Option<&PolicyPlan> {
        self.policies.iter().find(|p| &p.key == key)
    }
}

/// Plans the namespace: validation and conflicts, autoscaling (only for backends whose interval is
/// due at `now`), budgets, the fd check and the rendered documents (the last rendering when its
/// inputs are unchanged). `memory` is updated in place.
pub fn plan(input: &FleetInput, memory: &mut Memory, now: Timestamp) -> FleetPlan {
    let selection = selector::select(&input.policies, &input.pods);
    let acceptance = validate::accept(&input.policies, &selection);

    // Remember the latest fd limits, so a missing sample holds the last known one.
    for (pod, s) in &input.samples.pods {
        if let Some(max) = s.max_fds {
            memory.fd_limits.insert(pod.clone(), max);
        }
    }

    let mut plans = Vec::with_capacity(input.policies.len());
    for (i, policy) in input.policies.iter().enumerate() {
        let selected = selection[i].clone();
        let pods_where = |keep: fn(&GatewayPod) -> bool| -> Vec<String> {
            selected
                .iter()
                .filter(|p| input.pods.iter().any(|pod| &pod.name == *p && keep(pod)))
                .cloned()
                .collect()
        };
        let holders = pods_where(|p| !p.stopped);
        let live = pods_where(|p| !p.stopped && !p.terminating);
        let ready = pods_where(|p| p.ready && !p.stopped && !p.terminating);
        let accepted = acceptance[i].is_accepted();
        let mut backends = Vec::new();
        let mut metrics = None;
        if accepted {
            let mut unavailable = Vec::new();
            let mut missing = Vec::new();
            for b in &policy.spec.backends {
                let endpoints = policy.endpoints.get(&b.name).map_or(0, Vec::len) as u32;
                let bounds = Bounds::of(&policy.spec, b);
                let key = (policy.key.clone(), b.name.clone());
                let sample = input
                    .samples
                    .backends
                    .get(&key)
                    .copied()
                    .unwrap_or_default();
                let previous = previous_target(policy, &b.name)
                    .or_else(|| start_from(policy.spec.autoscale.start_from, &bounds, &sample));
                let mem = memory
                    .backends
                    .entry(key)
                    .or_insert_with(|| BackendMemory::start(previous, &bounds, now));
                let decision = if !policy.spec.autoscale.enabled {
                    mem.target = bounds.upper;
                    None
                } else if input.focus.as_ref().is_none_or(|f| f == &policy.key)
                    && mem.due(policy.spec.autoscale.interval.get(), now)
                {
                    Some(autoscale::decide(&bounds, mem, &sample, endpoints, now))
                } else {
                    mem.target = bounds.clamp(mem.target);
                    None
                };
                // Each backend is named for its own state only: a backend without traffic has
                // nothing missing, and one that misses data is not blamed on another.
                let name = &b.name;
                let pods = if sample.unscraped > 0 {
                    unscraped_pods(&ready, &input.samples)
                } else {
                    String::new()
                };
                match (mem.metrics_available, mem.missing) {
                    (false, Some(what)) => unavailable.push(format!(
                        "{name}: no usable {what} sample{pods} for {} decisions or more in a row",
                        autoscale::MISSES_BEFORE_UNAVAILABLE
                    )),
                    (false, None) => unavailable.push(format!(
                        "{name}: samples fresh again, {} of the {} needed to resume",
                        mem.fresh,
                        autoscale::FRESH_TO_RESUME
                    )),
                    (true, Some(what)) => missing.push(format!(
                        "{name}: no usable {what} sample{pods} at the last decision"
                    )),
                    (true, None) => {}
                }
                backends.push(BackendPlan {
                    name: b.name.clone(),
                    endpoints,
                    target: mem.target,
                    per_pod: fds::share(mem.target, holders.len() as u32),
                    clamped: false,
                    bounds,
                    decision,
                    held: mem.held,
                    sample,
                });
            }
            if policy.spec.autoscale.enabled {
                let available = unavailable.is_empty();
                unavailable.extend(missing);
                let message = if unavailable.is_empty() {
                    "fresh samples for every backend".to_owned()
                } else {
                    format!("{}; their targets are held", unavailable.join("; "))
                };
                metrics = Some(MetricsState { available, message });
            }
        }
        plans.push(PolicyPlan {
            key: policy.key.clone(),
            acceptance: acceptance[i].clone(),
            selected,
            holders,
            live,
            ready,
            backends,
            fds: FdReport::default(),
            metrics_available: metrics,
            document: None,
        });
    }

    let fd_limits: BTreeMap<String, u64> = input
        .pods
        .iter()
        .filter_map(|p| memory.fd_limits.get(&p.name).map(|l| (p.name.clone(), *l)))
        .collect();
    let generations = render::Generations::new(
        &input.policies,
        &input.pods,
        &input.published,
        input.generation_floor,
    );
    let render_input = memo::RenderInput::of(input, &plans, &fd_limits, &generations);
    if let Some(last) = memory.rendered.as_deref()
        && last.input == render_input
    {
        return FleetPlan {
            policies: last.reuse(plans),
            documents: last.documents.clone(),
        };
    }
    fds::check(&input.policies, &mut plans, &fd_limits);
    let documents = render::render_all(&input.policies, &input.pods, &mut plans, generations);
    memory.rendered = Some(Arc::new(memo::Rendered::new(
        render_input,
        &plans,
        documents.clone(),
    )));
    FleetPlan {
        policies: plans,
        documents,
    }
}

/// Where a backend without a recorded target starts (`None`: the upper bound).
fn start_from(from: StartFrom, bounds: &Bounds, sample: &BackendSample) -> Option<u32> {
    match from {
        StartFrom::Max => None,
        StartFrom::Min => Some(bounds.min),
        StartFrom::Current => sample
            .current
            .filter(|c| c.is_finite() && *c >= 1.0)
            .map(|c| c.round().min(f64::from(u32::MAX)) as u32),
    }
}

/// How many pods to name in a message before counting the rest.
const NAMED_PODS: usize = 3;

/// The ready pods without fresh samples, for a condition message: ` (ready pods without fresh
/// samples: gw-1, gw-2)`.
fn unscraped_pods(ready: &[String], samples: &Samples) -> String {
    let unscraped: Vec<&str> = ready
        .iter()
        .filter(|p| samples.pods.get(*p).is_none_or(|s| s.max_fds.is_none()))
        .map(String::as_str)
        .collect();
    if unscraped.is_empty() {
        return String::new();
    }
    let mut names = unscraped[..unscraped.len().min(NAMED_PODS)].join(", ");
    if unscraped.len() > NAMED_PODS {
        names.push_str(&format!(" and {} more", unscraped.len() - NAMED_PODS));
    }
    format!(" (ready pods without fresh samples: {names})")
}

/// The target a policy's status recorded for a backend (continuity across operator restarts).
fn previous_target(policy: &PolicyInput, backend: &str) -> Option<u32> {
    policy
        .status
        .as_ref()?
        .backends
        .iter()
        .find(|b| b.name == backend)
        .map(|b| b.target)
}

/// Time from `then` to `now`; zero if `then` is in the future.
pub(crate) fn elapsed(then: Timestamp, now: Timestamp) -> std::time::Duration {
    let d = now.duration_since(then);
    if d.is_negative() {
        std::time::Duration::ZERO
    } else {
        d.unsigned_abs()
    }
}
