//! The namespace pass: observe, validate and plan a namespace once for every reconcile waiting
//! on it, instead of once per policy.
//!
//! Planning reads the whole namespace (every policy on the same pods shares their documents and
//! their file descriptors), so with `n` policies one reconcile costs `O(n)` and a round of them
//! `O(n²)`: at 2,000 policies a reconcile that plans alone takes seconds. Here the reconciles of
//! a namespace share their plans:
//!
//! - **Reused**: the last pass serves a reconcile when nothing it was made from changed — the
//!   [`fingerprint`] of the namespace's pods, policy generations, EndpointSlices, Prometheus
//!   snapshot and generation floor is the same, the pass holds the policy as handed over (its
//!   generation and spec), and none of its autoscale decisions is due.
//! - **Planned**: otherwise the reconcile waits for the next pass, which plans for it and for
//!   every reconcile waiting with it (they are its `focus`: their decisions are made and their
//!   divisions judged again). One pass runs at a time per namespace; the first waiter to get
//!   the turn leads it, and a waiter whose turn comes after a pass that started after it
//!   registered takes that pass instead of planning again.
//!
//! What the fingerprint leaves out is what only the rollout moves, the pods' acknowledgements and
//! the published ConfigMaps, and what only a decision reads, the clients' reports. Every
//! reconcile sends the same pass's documents, so a pod one reconcile updated is current for the
//! next, and a pass planned later numbers its documents above whatever the pods run by then;
//! the busiest clients' division is judged again only with a decision, and a decision due
//! always plans anew, with the reports of that moment.

mod store;

use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use poolpilot_api::ConnectionPolicy;
use tracing::info;

use super::context::Context;
use super::observe;
use super::observed::Observed;
use super::{clients, cpu_bound};
use crate::gateway::Gateways;
use crate::metrics::OutcomeLabel;
use crate::plan::{self, BackendPlan, FleetPlan, Memory, PolicyKey, Timestamp};

use store::Namespace;
pub use store::{Pass, Passes, PolicyPass};

/// The plan of `policy`'s namespace for its reconcile: the last pass if it still holds
/// (the module's words say when), else the next one, planned with every reconcile waiting. A
/// policy the caches have not caught up with (the object handed over is newer) is planned on
/// its own, as handed over.
pub async fn plan_for<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    key: &PolicyKey,
) -> Result<Planned, observe::ObserveError> {
    let namespace = ctx.passes.namespace(&key.namespace);
    let pass = pass_for(ctx, &namespace, policy, key).await?;
    let news = namespace.state.lock().news.remove(key).unwrap_or_default();
    Ok(Planned { pass, news })
}

/// A reconcile's plan: its namespace's pass, and what passes decided for its policy that no
/// reconcile of it has told yet.
#[derive(Debug)]
pub struct Planned {
    /// The pass.
    pub pass: Arc<Pass>,
    /// The policy's backends as planned at each decision or re-division not told yet (oldest
    /// first).
    pub news: Vec<BackendPlan>,
}

async fn pass_for<G: Gateways>(
    ctx: &Context<G>,
    namespace: &Namespace,
    policy: &ConnectionPolicy,
    key: &PolicyKey,
) -> Result<Arc<Pass>, observe::ObserveError> {
    let world = fingerprint(ctx, &key.namespace);
    let registered = {
        let mut state = namespace.state.lock();
        if let Some(last) = &state.latest {
            let (same, held) = (last.world == world, last.holds(key, policy));
            let due = same && held && decision_due(ctx, policy, key, last);
            if same && held && !due {
                counted(ctx, "reused");
                return Ok(last.clone());
            }
            tracing::debug!(policy = %key, changed = !same, held, due, "the last pass does not hold; waiting for the next");
        }
        state.waiting.insert(key.clone());
        state.started
    };
    let pass = {
        let _turn = namespace.turn.lock().await;
        let served = {
            let state = namespace.state.lock();
            state.latest.clone().filter(|last| last.seq > registered)
        };
        match served {
            Some(pass) => pass,
            None => {
                let (focus, seq) = {
                    let mut state = namespace.state.lock();
                    state.waiting.insert(key.clone());
                    state.started += 1;
                    (std::mem::take(&mut state.waiting), state.started)
                };
                let pass = Arc::new(cpu_bound(|| run(ctx, &key.namespace, focus, seq)));
                let mut state = namespace.state.lock();
                state.record(&pass);
                state.latest = Some(pass.clone());
                pass
            }
        }
    };
    if pass.holds(key, policy) {
        counted(ctx, "planned");
        return Ok(pass);
    }
    // The cache is behind the object handed over: plan it as it is, for this reconcile only.
    counted(ctx, "private");
    let focus = BTreeSet::from([key.clone()]);
    let pass = Arc::new(cpu_bound(|| private(ctx, policy, &key.namespace, focus))?);
    namespace.state.lock().record(&pass);
    Ok(pass)
}

fn counted<G: Gateways>(ctx: &Context<G>, outcome: &'static str) {
    ctx.metrics
        .passes
        .get_or_create(&OutcomeLabel { outcome })
        .inc();
}

/// Whether one of `policy`'s autoscale decisions is due (a reconcile then plans, so that it
/// makes the decision).
fn decision_due<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    key: &PolicyKey,
    last: &Pass,
) -> bool {
    let accepted = last.policy(key).is_some_and(|p| p.verdict.is_accepted());
    accepted && decisions_due(ctx, policy, key)
}

/// Whether one of `policy`'s autoscale decisions is due, by the planner's memory (a backend it
/// has no memory of yet is due).
pub fn decisions_due<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    key: &PolicyKey,
) -> bool {
    if !policy.spec.autoscale.enabled {
        return false;
    }
    let now = (ctx.clock)();
    let interval = policy.spec.autoscale.interval.get();
    let memory = ctx.memory.lock();
    let namespace = memory.get(&key.namespace);
    policy.spec.backends.iter().any(|b| {
        namespace
            .and_then(|m| m.backends.get(&(key.clone(), b.name.clone())))
            .is_none_or(|m| m.due(interval, now))
    })
}

/// Plans `ns` for the reconciles in `focus`.
fn run<G: Gateways>(ctx: &Context<G>, ns: &str, focus: BTreeSet<PolicyKey>, seq: u64) -> Pass {
    // Taken first: a change while this pass observes makes the next reconcile plan again.
    let world = fingerprint(ctx, ns);
    let now = (ctx.clock)();
    let observed = observe::namespace(ctx, ns, now);
    super::rollout::forget_gone_pods(ctx, ns);
    planned(ctx, ns, observed, focus, world, seq, now)
}

/// Plans `policy` as handed over, with the cache's other policies of `ns`.
fn private<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    ns: &str,
    focus: BTreeSet<PolicyKey>,
) -> Result<Pass, observe::ObserveError> {
    let now = (ctx.clock)();
    let observed = observe::observe(ctx, policy, false, now)?;
    Ok(planned(ctx, ns, observed, focus, 0, 0, now))
}

fn planned<G: Gateways>(
    ctx: &Context<G>,
    ns: &str,
    mut observed: Observed,
    focus: BTreeSet<PolicyKey>,
    world: u64,
    seq: u64,
    now: Timestamp,
) -> Pass {
    clients::fill(ctx, ns, &mut observed.input, now);
    observed.input.focus = Some(focus);
    let verdicts = plan::validate::accept(&observed.input.policies, &observed.selected);
    let fleet = {
        let mut memory = ctx.memory.lock();
        let mem = memory.entry(ns.to_owned()).or_default();
        let fleet = plan::plan_with(&observed.input, &observed.selected, &verdicts, mem, now);
        count_and_log(ctx, &fleet, mem);
        fleet
    };
    let index = observed
        .input
        .policies
        .iter()
        .enumerate()
        .map(|(i, p)| (p.key.clone(), i))
        .collect();
    Pass {
        observed,
        verdicts,
        fleet,
        index,
        world,
        seq,
        at: now,
    }
}

/// Counts and logs the pass's decisions and re-divisions, once each.
fn count_and_log<G: Gateways>(ctx: &Context<G>, fleet: &FleetPlan, memory: &Memory) {
    for plan in &fleet.policies {
        for b in &plan.backends {
            if b.rebalanced.is_some() {
                ctx.metrics.rebalance();
            }
            let Some(decision) = &b.decision else {
                continue;
            };
            ctx.metrics.decision(decision);
            let reason = memory
                .backends
                .get(&(plan.key.clone(), b.name.clone()))
                .and_then(|m| m.last_decision.as_ref())
                .map_or("", |d| d.reason.as_str());
            let s = &b.sample;
            info!(
                policy = %plan.key.name,
                namespace = %plan.key.namespace,
                backend = %b.name,
                action = ?decision.action(),
                target = b.target,
                endpoints = b.endpoints,
                leased = s.leased,
                pending = s.pending,
                completed_per_s = s.completed,
                bytes_per_s = s.bytes,
                ttfb_s = s.ttfb,
                held_intervals = b.held,
                "autoscale decision: {reason}"
            );
        }
    }
}

/// A digest of what a pass of `ns` is made from, apart from the rollout's own traces and the
/// clients' reports (see the module's words): the pods (each one's resource version), the
/// policies (name, uid, generation, whether being deleted), the EndpointSlices it may read, when
/// the Prometheus snapshot was taken, and the generation floor. A policy's status write changes
/// none of it. Every reconcile computes it, so the watched parts come from the digests the
/// watches keep ([`world`](super::world)): a lookup each, instead of a walk of the pod and policy
/// caches (a copy of each cache's list and a hash of every object of the namespace).
pub fn fingerprint<G: Gateways>(ctx: &Context<G>, ns: &str) -> u64 {
    let world = &ctx.stores.world;
    let mut h = super::world::hasher();
    world.pods.namespace(ns).hash(&mut h);
    world.policies.namespace(ns).hash(&mut h);
    world
        .slices(ns, &ctx.config.backend_namespaces)
        .hash(&mut h);
    ctx.snapshot.read().at.hash(&mut h);
    ctx.rollouts.lock().seen_generation.get(ns).hash(&mut h);
    h.finish()
}
