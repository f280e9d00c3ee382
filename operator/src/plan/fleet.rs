//! One planning run over a namespace: validation and conflicts, autoscaling, the budget
//! division, the fd check and the rendering, in that order (see the [`super`] diagram).

use std::collections::BTreeMap;
use std::sync::Arc;

use poolpilot_api::policy::StartFrom;

use super::autoscale::{self, BackendMemory, Bounds};
use super::budget::{self, FdReport};
use super::input::{BackendSample, FleetInput, GatewayPod, PolicyInput, Samples};
use super::memory::Memory;
use super::output::{BackendPlan, FleetPlan, MetricsState, PolicyPlan};
use super::time::Timestamp;
use super::{fds, memo, render, selector, validate};

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
                    per_pod: budget::share(mem.target, holders.len() as u32),
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
