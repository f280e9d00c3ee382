//! One planning run over a namespace: validation and conflicts, autoscaling, the budget
//! division, the fd check and the rendering, in that order (see the [`super`] diagram).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use poolpilot_api::policy::{BackendSpec, ClientScope, ClientsSpec, DecisionAction, StartFrom};

use super::autoscale::{self, BackendMemory, Bounds};
use super::budget::FdReport;
use super::idle_timeout::{IdleTimeout, Lowered};
use super::input::{
    BackendSample, ClientUse, FleetInput, GatewayPod, PodPool, PolicyInput, Samples,
};
use super::memory::Memory;
use super::output::{BackendPlan, FleetPlan, MetricsState, PolicyPlan};
use super::time::Timestamp;
use super::{
    clients, division, fds, generations, memo, render, selector, shares, tokens, validate,
};

/// Plans the namespace: validation and conflicts, autoscaling (only for backends whose interval is
/// due at `now`), budgets, the fd check and the rendered documents (the last rendering when its
/// inputs are unchanged). `memory` is updated in place.
pub fn plan(input: &FleetInput, memory: &mut Memory, now: Timestamp) -> FleetPlan {
    let selection = selector::select(&input.policies, &input.pods);
    let acceptance = validate::accept(&input.policies, &selection);
    plan_with(input, &selection, &acceptance, memory, now)
}

/// [`plan`] given which pods each policy selects ([`selector::select`]) and the verdicts on them
/// ([`validate::accept`]), one per policy of `input` in its order: the runtime makes both once
/// per namespace pass, for validation and planning alike.
pub fn plan_with(
    input: &FleetInput,
    selection: &[Vec<String>],
    acceptance: &[validate::Acceptance],
    memory: &mut Memory,
    now: Timestamp,
) -> FleetPlan {
    debug_assert_eq!(selection.len(), input.policies.len());
    debug_assert_eq!(acceptance.len(), input.policies.len());

    // Remember the latest fd limits, so a missing sample holds the last known one.
    for (pod, s) in &input.samples.pods {
        if let Some(max) = s.max_fds {
            memory.fd_limits.insert(pod.clone(), max);
        }
    }

    let by_name: BTreeMap<&str, &GatewayPod> =
        input.pods.iter().map(|p| (p.name.as_str(), p)).collect();
    let mut plans = Vec::with_capacity(input.policies.len());
    let mut divided = 0;
    for (i, policy) in input.policies.iter().enumerate() {
        let selected = selection[i].clone();
        let pods_where = |keep: fn(&GatewayPod) -> bool| -> Vec<String> {
            selected
                .iter()
                .filter(|p| by_name.get(p.as_str()).is_some_and(|pod| keep(pod)))
                .cloned()
                .collect()
        };
        let holders = pods_where(|p| !p.stopped);
        let live = pods_where(|p| !p.stopped && !p.terminating);
        let ready = pods_where(|p| p.ready && !p.stopped && !p.terminating);
        let ready_set: BTreeSet<&str> = ready.iter().map(String::as_str).collect();
        let is_ready: Vec<bool> = holders
            .iter()
            .map(|h| ready_set.contains(h.as_str()))
            .collect();
        // Not one of the reconciles this run plans for: its divisions were made by its own.
        let unfocused = input
            .focus
            .as_ref()
            .is_some_and(|f| !f.contains(&policy.key));
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
                let mem = memory.backends.entry(key).or_insert_with(|| {
                    BackendMemory::start(previous, &bounds, now)
                        .first_samples_by(now, input.samples_horizon)
                });
                let decision = if !policy.spec.autoscale.enabled {
                    mem.target = bounds.upper;
                    None
                } else if mem.due(policy.spec.autoscale.interval.get(), now) {
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
                // The division of the target over the holders, by demand (re-judged when a
                // decision ran), and the burst beside it. A policy not in focus keeps the
                // division in memory while it still fits its target and holders: its own
                // reconcile divides it, once per round, not every other policy's again.
                let key = (policy.key.clone(), b.name.clone());
                let kept = memory
                    .divisions
                    .get(&key)
                    .filter(|d| unfocused && decision.is_none() && d.fits(mem.target, &holders));
                let (division_shares, division_demand, rebalanced, held, redivided, made) =
                    match kept {
                        Some(d) => (
                            d.shares.clone(),
                            d.demand.clone(),
                            None,
                            d.shares.iter().map(|&s| u64::from(s)).sum::<u64>(),
                            false,
                            None,
                        ),
                        None => {
                            divided += 1;
                            let pools: Vec<Option<PodPool>> = holders
                                .iter()
                                .map(|h| {
                                    let at = (policy.key.clone(), b.name.clone(), h.clone());
                                    input.samples.pools.get(&at).copied()
                                })
                                .collect();
                            let last = memory
                                .divisions
                                .get(&key)
                                .cloned()
                                .or_else(|| restored(policy, &b.name, &holders, now));
                            let step = divide(
                                policy,
                                mem,
                                endpoints,
                                (&holders, &is_ready, &pools),
                                last.as_ref(),
                                decision.is_some(),
                                now,
                            );
                            // What the pods may hold: their shares, and, right after a
                            // re-division, the connections they still have in flight above a
                            // lowered share (those close only as their calls end; bursts in use
                            // count too, which errs on the safe side). Between re-divisions it
                            // is the shares alone, which the pods' bursts go on top of.
                            let redivided = last.as_ref().is_none_or(|l| {
                                l.holders != step.divided.holders || l.shares != step.divided.shares
                            });
                            let held: u64 = step
                                .divided
                                .shares
                                .iter()
                                .zip(&pools)
                                .map(|(&share, pool)| {
                                    let in_flight = pool.map_or(0, |p| p.in_flight(endpoints));
                                    u64::from(if redivided {
                                        share.max(in_flight)
                                    } else {
                                        share
                                    })
                                })
                                .sum();
                            (
                                step.divided.shares.clone(),
                                step.divided.demand.clone(),
                                step.rebalanced,
                                held,
                                redivided,
                                Some(step.divided),
                            )
                        }
                    };
                // Sized again on a decision made on fresh data or a new division; otherwise the
                // last one stays (a decision that saw no data knows nothing new, and the
                // documents should not change while Prometheus is away).
                let fresh = decision.as_ref().is_some_and(on_fresh_data);
                let sized = || {
                    burst_budget(policy, b, mem)
                        .map_or(0, |budget| division::burst(budget, held, holders.len()))
                };
                let burst = match memory.bursts.get(&key) {
                    Some(&last) if !fresh && !redivided => last,
                    _ => sized(),
                };
                memory.bursts.insert(key.clone(), burst);
                let last_idle = memory
                    .idle_timeouts
                    .get(&key)
                    .copied()
                    .or_else(|| restored_idle_timeout(policy, &b.name));
                // Lowered or tried again by the policy's own reconcile, which tells it in an
                // Event; another's run plans with the value in force.
                let idle_timeout = IdleTimeout::next(
                    b.pool.idle_timeout.get(),
                    last_idle,
                    sample.peer_idle_close,
                    !unfocused,
                    now,
                );
                memory.idle_timeouts.insert(key.clone(), idle_timeout);
                let mut plan = BackendPlan {
                    name: b.name.clone(),
                    endpoints,
                    target: mem.target,
                    per_pod: 0,
                    shares: division_shares,
                    demand: division_demand,
                    burst,
                    rebalanced,
                    clamped: false,
                    bounds,
                    decision,
                    held: mem.held,
                    idle_timeout,
                    streams_per_socket: super::fds::streams_per_socket(b.protocol, &sample),
                    sample,
                };
                plan.settle_per_pod();
                if let Some(made) = made {
                    memory.divisions.insert(key, made);
                }
                backends.push(plan);
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
        // The busiest clients' fleet-wide limits, divided by where their calls arrive; judged
        // again when a decision ran (once per interval).
        let client_shares = match fleet_clients(policy, accepted) {
            Some(c) => {
                let reports = client_reports(policy, input, &holders);
                let overridden = override_keys(c);
                // Re-judged with a decision made on fresh data (not while Prometheus is away:
                // the documents stay as they are then).
                let due = backends
                    .iter()
                    .any(|b| b.decision.as_ref().is_some_and(on_fresh_data));
                let limits = (c.max_concurrency, c.max_queue);
                let last = memory
                    .client_divisions
                    .get(&policy.key)
                    .cloned()
                    .unwrap_or_else(|| {
                        let status = policy.status.as_ref().map_or(&[][..], |s| &s.clients);
                        clients::restored(status, &holders, limits, &overridden, now)
                    });
                let divided = clients::divide(
                    &holders,
                    &is_ready,
                    &reports,
                    limits,
                    &overridden,
                    &last,
                    due,
                    now,
                );
                memory
                    .client_divisions
                    .insert(policy.key.clone(), divided.clone());
                divided
            }
            _ => {
                memory.client_divisions.remove(&policy.key);
                BTreeMap::new()
            }
        };
        let due = backends
            .iter()
            .any(|b| b.decision.as_ref().is_some_and(on_fresh_data));
        let (token_shares, token_use) = token_budgets(
            policy,
            input,
            memory,
            (&holders, &is_ready),
            accepted,
            due,
            now,
        );
        let client_token_shares = client_token_budgets(
            policy,
            input,
            memory,
            (&holders, &is_ready),
            accepted,
            due,
            now,
        );
        plans.push(PolicyPlan {
            key: policy.key.clone(),
            client_shares,
            token_shares,
            client_token_shares,
            token_use,
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
    let generations = generations::Generations::new(
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
            divided,
        };
    }
    fds::check(&input.policies, &mut plans, &fd_limits);
    let rendering = render::render_all(
        &input.policies,
        &input.pods,
        &mut plans,
        generations,
        memory.rendered.as_deref().map(|last| (last, &render_input)),
    );
    memory.rendered = Some(Arc::new(memo::Rendered::new(
        render_input,
        rendering.plans,
        rendering.documents.clone(),
        rendering.on_pods,
    )));
    FleetPlan {
        policies: plans,
        documents: rendering.documents,
        divided,
    }
}

/// One backend's division this run ([`shares::step`] by demand with autoscale on, else the
/// even split), and the words of a re-division in its decision record: a pod short of
/// connections while others sat on theirs is never a `NoChange`.
fn divide(
    policy: &PolicyInput,
    mem: &mut BackendMemory,
    endpoints: u32,
    (holders, ready, pools): (&[String], &[bool], &[Option<PodPool>]),
    last: Option<&shares::Divided>,
    due: bool,
    now: Timestamp,
) -> shares::Step {
    let step = if policy.spec.autoscale.enabled {
        shares::step(
            mem.target,
            endpoints,
            shares::Holders {
                names: holders,
                ready,
                pools,
            },
            last,
            due,
            now,
        )
    } else {
        shares::Step {
            divided: shares::Divided {
                holders: holders.to_vec(),
                target: mem.target,
                shares: division::even(mem.target, holders.len()),
                demand: pools
                    .iter()
                    .map(|p| p.map(|p| p.demand(endpoints)))
                    .collect(),
                at: now,
            },
            rebalanced: None,
        }
    };
    if let (Some(why), Some(d)) = (&step.rebalanced, mem.last_decision.as_mut())
        && d.at == now
    {
        if d.action == DecisionAction::NoChange {
            d.action = DecisionAction::Rebalance;
            d.reason = format!("{why}; {}", d.reason);
        } else {
            d.reason = format!("{}; shares re-divided: {why}", d.reason);
        }
    }
    step
}

/// Whether a decision was made on fresh data (not while samples are missing or just back): only
/// such a decision re-sizes the bursts and re-judges the client divisions.
fn on_fresh_data(d: &autoscale::Decision) -> bool {
    !matches!(
        d,
        autoscale::Decision::MissingData { .. } | autoscale::Decision::Recovering { .. }
    )
}

/// The most connections per endpoint the fleet may open with its bursts: the capacity less half
/// the headroom (the target's upper bound keeps the whole headroom), never above `autoscale.max`
/// (the bound the user set) nor a knee the guard found. `None`, no burst, where growth would be wrong: autoscale off (the targets are
/// static), growth held (at the knee, the upper bound or for missing data), or the backend
/// saturated.
fn burst_budget(policy: &PolicyInput, b: &BackendSpec, mem: &BackendMemory) -> Option<u32> {
    if !policy.spec.autoscale.enabled || mem.held > 0 || mem.saturation.is_some() {
        return None;
    }
    let capacity = f64::from(b.capacity.max_connections_per_endpoint);
    let mut budget = (capacity * (1.0 - b.capacity.headroom / 2.0)).floor() as u32;
    if let Some(max) = policy.spec.autoscale.max {
        budget = budget.min(max);
    }
    Some(mem.knee.cap().map_or(budget, |c| budget.min(c)))
}

/// The division a policy's status recorded for a backend, when it still divides its target
/// over the same holders (continuity across operator restarts).
fn restored(
    policy: &PolicyInput,
    backend: &str,
    holders: &[String],
    now: Timestamp,
) -> Option<shares::Divided> {
    let b = policy
        .status
        .as_ref()?
        .backends
        .iter()
        .find(|b| b.name == backend)?;
    let pods: Vec<String> = b.shares.iter().map(|s| s.pod.clone()).collect();
    let shares: Vec<u32> = b.shares.iter().map(|s| s.share).collect();
    (pods == holders && shares.iter().sum::<u32>() == b.target).then(|| shares::Divided {
        holders: pods,
        target: b.target,
        shares,
        demand: b.shares.iter().map(|s| s.demand).collect(),
        at: now,
    })
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

/// The lowered idle timeout a backend's status records (after a restart, or on a newly elected
/// operator), so that the pods keep running it instead of meeting the backend's closes again.
fn restored_idle_timeout(policy: &PolicyInput, backend: &str) -> Option<IdleTimeout> {
    let s = policy
        .status
        .as_ref()?
        .backends
        .iter()
        .find(|b| b.name == backend)?
        .idle_timeout
        .as_ref()?;
    Some(IdleTimeout {
        configured: s.configured.get(),
        in_force: s.in_force.get(),
        lowered: Some(Lowered {
            closed_after: s.backend_closed_after_seconds,
            at: s.since.0,
            // Not recorded: the wait before a try counts from the lowering.
            last_finding: s.since.0,
            now: false,
        }),
        tries: s.tries,
        tried: None,
    })
}

/// The client rules of `policy` when they hold for the whole fleet and the operator divides
/// them (the policy accepted, `clients.scope: Fleet`, autoscale on).
fn fleet_clients(policy: &PolicyInput, accepted: bool) -> Option<&ClientsSpec> {
    policy
        .spec
        .clients
        .as_ref()
        .filter(|c| accepted && c.scope == ClientScope::Fleet && policy.spec.autoscale.enabled)
}

/// What each of `holders` reported of `policy`'s busiest clients (`None`: no fresh report).
fn client_reports<'a>(
    policy: &PolicyInput,
    input: &'a FleetInput,
    holders: &[String],
) -> Vec<Option<&'a [ClientUse]>> {
    holders
        .iter()
        .map(|h| {
            input
                .clients
                .get(&(policy.key.clone(), h.clone()))
                .map(Vec::as_slice)
        })
        .collect()
}

/// The keys of the clients `c` names in its overrides (their limits and budgets are theirs).
fn override_keys(c: &ClientsSpec) -> Vec<&str> {
    c.overrides
        .iter()
        .map(|o| o.client.key_sha256.as_str())
        .collect()
}

/// The policy's token budget divided for its busiest clients without an override by where they
/// spend it (fleet-wide budgets only), re-judged when `due` (a decision ran on fresh data), from
/// the pods' reports of the clients that spend the most tokens.
fn client_token_budgets(
    policy: &PolicyInput,
    input: &FleetInput,
    memory: &mut Memory,
    (holders, ready): (&[String], &[bool]),
    accepted: bool,
    due: bool,
    now: Timestamp,
) -> BTreeMap<String, tokens::TokenDivision> {
    let Some((c, budget)) =
        fleet_clients(policy, accepted).and_then(|c| Some((c, c.tokens.as_ref()?)))
    else {
        memory.client_token_divisions.remove(&policy.key);
        return BTreeMap::new();
    };
    let reports = client_reports(policy, input, holders);
    let overridden = override_keys(c);
    let last = memory
        .client_token_divisions
        .get(&policy.key)
        .cloned()
        .unwrap_or_default();
    let divided = tokens::divide_clients(
        holders,
        ready,
        &reports,
        budget,
        &overridden,
        &last,
        due,
        now,
    );
    memory
        .client_token_divisions
        .insert(policy.key.clone(), divided.clone());
    divided
}

/// The fleet-wide token budgets of a policy's named clients divided by where their tokens are
/// used ([`tokens`]; with `clients.scope: Fleet` and autoscale on, re-judged when `due`: a
/// decision ran on fresh data), and the tokens a minute each client label was charged over the
/// holders (when every ready one has a sample).
fn token_budgets(
    policy: &PolicyInput,
    input: &FleetInput,
    memory: &mut Memory,
    (holders, ready): (&[String], &[bool]),
    accepted: bool,
    due: bool,
    now: Timestamp,
) -> (
    BTreeMap<String, tokens::TokenDivision>,
    Option<BTreeMap<String, f64>>,
) {
    let uses: Vec<Option<&BTreeMap<String, f64>>> = holders
        .iter()
        .map(|h| {
            input
                .samples
                .token_use
                .get(&(policy.key.clone(), h.clone()))
        })
        .collect();
    let complete = (0..holders.len()).all(|i| !ready[i] || uses[i].is_some());
    let total = (complete && uses.iter().any(Option::is_some)).then(|| {
        let mut total: BTreeMap<String, f64> = BTreeMap::new();
        for used in uses.iter().flatten() {
            for (client, v) in used.iter() {
                *total.entry(client.clone()).or_default() += v;
            }
        }
        total
    });
    let Some(c) = fleet_clients(policy, accepted) else {
        memory.token_divisions.remove(&policy.key);
        return (BTreeMap::new(), total);
    };
    // Each override with a budget (its own, else the policy's), by name.
    let budgets: BTreeMap<String, u64> = c
        .overrides
        .iter()
        .filter_map(|o| {
            let t = o.tokens.as_ref().or(c.tokens.as_ref())?;
            Some((o.name.clone(), t.per_minute))
        })
        .collect();
    let last = memory
        .token_divisions
        .get(&policy.key)
        .cloned()
        .unwrap_or_else(|| {
            let status = policy.status.as_ref().map_or(&[][..], |s| &s.tokens);
            tokens::restored(status, holders, &budgets, now)
        });
    let divided: BTreeMap<String, tokens::TokenDivision> = budgets
        .iter()
        .map(|(name, &budget)| {
            let used: Vec<Option<f64>> = uses
                .iter()
                .map(|u| u.map(|u| u.get(name).copied().unwrap_or(0.0)))
                .collect();
            let d = tokens::divide(holders, ready, &used, budget, last.get(name), due, now);
            (name.clone(), d)
        })
        .collect();
    memory
        .token_divisions
        .insert(policy.key.clone(), divided.clone());
    (divided, total)
}
