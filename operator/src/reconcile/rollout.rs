//! Step 4, roll out (API and gateways): server-side apply of the policy's durable ConfigMap
//! (owned by the policy, so it goes when the policy goes), then `PUT /v1/limits` to the pods of
//! the current wave (canaries first under Progressive), recording acknowledgements and refusals
//! (an operator that just started or took over first asks the pods what they run).
//! Also the cleanup of a deleted policy: its pods get documents without its backends.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use poolpilot_api::limits::TokenBudget;
use poolpilot_api::{ConnectionPolicy, GatewayLimits};
use serde_json::json;
use tracing::{debug, info, warn};

use super::context::{Context, FIELD_MANAGER, PushBound};
use super::observe::{self, DOCUMENT_KEY, GENERATION_ANNOTATION, MANAGED_BY, REVISION_ANNOTATION};
use super::observed::Observed;
use crate::gateway::{Gateways, PutError, ReportError};
use crate::metrics::OutcomeLabel;
use crate::plan::status::RolloutReport;
use crate::plan::waves::{self, PodState, Strategy};
use crate::plan::{Acked, FleetPlan, PolicyKey, Timestamp, plausible_generation};

/// Why the rollout step failed.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    /// The ConfigMap could not be applied.
    #[error("failed to apply ConfigMap {name}")]
    ConfigMap {
        /// Its name.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The admin-token Secret could not be read.
    #[error("failed to read the admin token from Secret {name}")]
    Token {
        /// Its name.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The Secret has no such key.
    #[error("Secret {name} has no key {key:?}")]
    TokenKey {
        /// The Secret.
        name: String,
        /// The key looked for.
        key: String,
    },
    /// The document could not be serialised (never expected).
    #[error("failed to serialise the limits document")]
    Serialize(#[source] serde_json::Error),
}

/// The name of a policy's ConfigMap when its pods name none
/// ([`LIMITS_CONFIGMAP_ANNOTATION`]).
pub fn configmap_name(policy: &str) -> String {
    format!("{policy}-limits")
}

/// The gateway pod annotation that names the durable limits ConfigMap its fleet mounts (the
/// chart sets `<release>-gateway-limits`, manifests/gateway `poolpilot-gateway-limits`): the
/// operator writes the document of every policy on those pods there, so that the mount does not
/// depend on any policy's name. The name must end in `-limits` (the admission policy of
/// manifests/operator/admission.yaml lets the operator write no other).
pub const LIMITS_CONFIGMAP_ANNOTATION: &str = "poolpilot.io/limits-configmap";

/// The label that marks a fleet's ConfigMap (named by [`LIMITS_CONFIGMAP_ANNOTATION`]).
const FLEET_LABEL: &str = "poolpilot.io/fleet-limits";

/// Where a policy's durable document goes: the ConfigMap named by the
/// [`LIMITS_CONFIGMAP_ANNOTATION`] of its first selected pod (whose policies the document
/// holds, the same for every policy on those pods), or without the annotation `<policy>-limits`.
/// A fleet's ConfigMap keeps the owner it was created with: the first policy to write it
/// controls it, and every policy on the fleet writes it as that policy's. Its ownerReferences
/// never change after the create, which clusters enforcing owner-reference permissions
/// (OpenShift) would refuse without `delete` on ConfigMaps; when that policy goes, the garbage
/// collector deletes the ConfigMap and the next reconcile of another policy on the fleet writes
/// it anew.
struct Durable {
    name: String,
    fleet: bool,
    /// The policy the ConfigMap is written as (`name`, `uid`), when not the reconciled one.
    owner: Option<(String, String)>,
}

fn durable_configmap<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    fleet: &FleetPlan,
    plan: &crate::plan::PolicyPlan,
) -> Durable {
    let ns = policy.namespace().unwrap_or_default();
    let own = || Durable {
        name: configmap_name(&policy.name_any()),
        fleet: false,
        owner: None,
    };
    let Some(first) = plan.selected.first() else {
        return own();
    };
    let pods = ctx.stores.pods.state();
    let Some(named) = pods
        .iter()
        .find(|p| p.namespace().as_deref() == Some(ns.as_str()) && &p.name_any() == first)
        .and_then(|p| p.annotations().get(LIMITS_CONFIGMAP_ANNOTATION).cloned())
    else {
        return own();
    };
    if !named.ends_with("-limits") || named.len() > 253 {
        warn!(namespace = %ns, pod = %first, configmap = %named,
            "the {LIMITS_CONFIGMAP_ANNOTATION} annotation must name a ConfigMap ending in -limits: using {}",
            configmap_name(&policy.name_any()));
        return own();
    }
    // The policy controlling the existing ConfigMap, if it is another policy on this fleet.
    let owner = ctx
        .stores
        .configmaps
        .get(&ObjectRef::new(&named).within(&ns))
        .and_then(|cm| {
            cm.owner_references()
                .iter()
                .find(|o| o.controller == Some(true) && o.kind == "ConnectionPolicy")
                .map(|o| (o.name.clone(), o.uid.clone()))
        })
        .filter(|(name, _)| {
            name != &policy.name_any()
                && fleet.policies.iter().any(|p| {
                    p.key.namespace == ns && &p.key.name == name && p.selected.contains(first)
                })
        });
    Durable {
        name: named,
        fleet: true,
        owner,
    }
}

/// Applies the ConfigMap and sends the current wave. Returns how the rollout stands.
pub async fn roll_out<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    key: &PolicyKey,
    observed: &Observed,
    fleet: &FleetPlan,
    now: Timestamp,
) -> Result<RolloutReport, RolloutError> {
    let ns = &observed.namespace;
    let Some(plan) = fleet.policy(key) else {
        return Ok(RolloutReport::default());
    };
    // Pods that never got a PUT follow the ConfigMap: a new document reaches it only once every
    // pod runs its own (the first one at once, so that starting pods have limits). Before, a
    // canary's document reached those pods through the ConfigMap before its verification.
    // A document that only lowers shares and client limits (more pods to divide over) goes to
    // the ConfigMap first, so that a pod starting meanwhile never takes more than its share.
    let durable = durable_configmap(ctx, policy, fleet, plan);
    let name = durable.name.clone();
    let published: Option<Option<GatewayLimits>> = ctx
        .stores
        .configmaps
        .get(&ObjectRef::new(&name).within(ns))
        .map(|cm| {
            cm.data
                .as_ref()
                .and_then(|d| d.get(DOCUMENT_KEY))
                .and_then(|d| serde_json::from_str(d).ok())
        });
    let first = match (&published, &plan.document) {
        (None, _) => true,
        (Some(Some(old)), Some(new)) => only_lowers(old, new),
        _ => false,
    };
    let published = published.is_some();
    if first && let Some(doc) = &plan.document {
        apply_configmap(ctx, policy, &durable, doc).await?;
    }

    // Read from the Secret once, by the first read or send that needs them.
    let tokens = Tokens::new(ctx, ns);
    let states = pod_states(ctx, observed, fleet, &plan.live);
    let spec = &policy.spec.rollout;
    let strategy = Strategy {
        kind: spec.strategy,
        canary_pods: spec.canary_pods,
        verify: policy.spec.autoscale.interval.get() * spec.verify_intervals,
    };
    let desired = plan
        .document
        .as_ref()
        .map(|d| d.revision.clone())
        .unwrap_or_default();
    // Verification starts when a canary is first seen on the revision: acknowledged by PUT,
    // or (a pod whose own document is the ConfigMap's) loaded from the ConfigMap, which no PUT
    // ever acknowledges. (A pod's acknowledgement names its own document's revision, which
    // differs from pod to pod with their shares: the policy's revision keys the rollout.)
    let verification_since = |states: &[PodState]| {
        ctx.rollouts.lock().verification_start(
            ns,
            &policy.name_any(),
            &desired,
            states.iter().any(PodState::current),
            now,
        )
    };
    let since = verification_since(&states);
    let verdict = {
        let snapshot = ctx.snapshot.read();
        let max_age = ctx.config.snapshot_max_age;
        let rates = |current: bool| -> Vec<_> {
            states
                .iter()
                .filter(|p| p.current() == current)
                .map(|p| snapshot.rates(ns, &p.name, now, max_age))
                .collect()
        };
        waves::judge(&rates(true), &rates(false))
    };
    // A revision whose canaries regressed stays halted (they were rolled back) until the policy
    // changes: pushing it again would only repeat the regression.
    let regressed = ctx
        .rollouts
        .lock()
        .regressed
        .get(&(ns.clone(), desired.clone()))
        .cloned();
    if let Some(why) = regressed {
        return Ok(RolloutReport {
            pods: states,
            halted: Some(why),
            ..RolloutReport::default()
        });
    }
    // The operator's own tuning (only shares, bursts and client limits moved, under the policy
    // generation every pod ran: an autoscale decision, a re-division) goes to every pod in this
    // reconcile, the pods it lowers first, so that the fleet stays inside the budget while it
    // moves: no canary, since the loop must act within its interval and nothing changes but
    // how much each pod holds. The same numbers edited by the user (a newer generation) go
    // through the waves: the canaries run the edit for the verification period first.
    let policy_key = (ns.clone(), policy.name_any());
    let generation = policy.metadata.generation.unwrap_or_default();
    let own_tuning = rolled_out_generation(ctx, &policy_key, policy) == Some(generation);
    let mut states = states;
    if own_tuning && learn_running(ctx, observed, &states, &tokens, now).await? {
        states = pod_states(ctx, observed, fleet, &plan.live);
    }
    if own_tuning && let Some(lowering) = retune_wave(ctx, observed, fleet, &states, true) {
        let mut pushed = push(ctx, observed, fleet, &lowering, &tokens, now).await?;
        let after = pod_states(ctx, observed, fleet, &plan.live);
        let lowered = lowering
            .iter()
            .all(|p| after.iter().any(|s| &s.name == p && s.current()));
        if lowered && let Some(rest) = retune_wave(ctx, observed, fleet, &after, false) {
            pushed.extend(push(ctx, observed, fleet, &rest, &tokens, now).await?);
        }
        let states = pod_states(ctx, observed, fleet, &plan.live);
        let older = later_pass(ctx, ns, pushed.older, &states, fleet);
        let complete = states.iter().all(PodState::current);
        if published
            && !first
            && complete
            && let Some(doc) = &plan.document
        {
            apply_configmap(ctx, policy, &durable, doc).await?;
        }
        return Ok(RolloutReport {
            pods: states,
            unreachable: pushed.failed,
            slow: pushed.slow,
            older,
            ..RolloutReport::default()
        });
    }
    let mut wave = waves::next_wave(strategy, &states, since, &verdict, now);
    let mut pushed = push(ctx, observed, fleet, &wave.push, &tokens, now).await?;
    if strategy.verify.is_zero() && !wave.push.is_empty() && wave.halted.is_none() {
        // Without verification the rest follow the canaries as soon as they acknowledged: in
        // this reconcile, not the next. A canary that did not take it is not tried twice.
        let after = pod_states(ctx, observed, fleet, &plan.live);
        if after
            .iter()
            .any(|p| wave.push.contains(&p.name) && p.current())
        {
            let rest = waves::next_wave(strategy, &after, since, &verdict, now);
            pushed.extend(push(ctx, observed, fleet, &rest.push, &tokens, now).await?);
            wave = rest;
        }
    }
    if let (waves::Verdict::Regressed(why), Some(_)) = (&verdict, &wave.halted) {
        let canaries: Vec<String> = states
            .iter()
            .filter(|p| p.current())
            .map(|p| p.name.clone())
            .collect();
        let (back, failed) = roll_back(ctx, observed, &canaries, &tokens, now).await?;
        pushed.extend(failed);
        let why = format!(
            "canary regression: {why}; {back} of {} canary pod(s) rolled back to their previous document, the other pods never got revision {desired}",
            canaries.len()
        );
        ctx.rollouts
            .lock()
            .regressed
            .insert((ns.clone(), desired.clone()), why.clone());
        wave.halted = Some(why);
    }

    let states = pod_states(ctx, observed, fleet, &plan.live);
    // Canaries that took the revision in this reconcile start their verification now, and the
    // policy's next reconcile comes when it ends.
    let since = verification_since(&states);
    let next = waves::next_wave(strategy, &states, since, &verdict, now);
    let older = later_pass(ctx, ns, pushed.older, &states, fleet);
    let halted = wave.halted.or_else(|| {
        waves::refusals(&states)
            .into_iter()
            .next()
            .map(|(pod, why)| format!("pod {pod} refused revision {desired}: {why}"))
    });
    let complete = states.iter().all(PodState::current);
    if halted.is_none() && complete {
        ctx.rollouts
            .lock()
            .rolled_out_generation
            .insert(policy_key, generation);
    }
    if published
        && !first
        && halted.is_none()
        && complete
        && let Some(doc) = &plan.document
    {
        apply_configmap(ctx, policy, &durable, doc).await?;
    }
    Ok(RolloutReport {
        pods: states,
        unreachable: pushed.failed,
        slow: pushed.slow,
        older,
        waiting: next.waiting.filter(|_| halted.is_none()),
        verified_in: next.verified_in.filter(|_| halted.is_none()),
        halted,
    })
}

/// How a document differs from another when it differs only in the numbers the operator tunes
/// (pool shares, bursts, client limits, the parts of token budgets): what a new division of
/// the targets makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tuning {
    /// Every tuned number is the same or lower.
    Lowers,
    /// Some tuned number is higher (others may be lower).
    Raises,
}

/// How `new` differs from `old` when only tuned numbers differ (`None`: anything else differs,
/// an endpoint, a route, a timeout: a change of content that goes through the rollout's waves).
/// A lowering may reach pods through the ConfigMap before the waves; a re-division (shares
/// moved between pods) skips the canaries, since it changes no behaviour to verify, only how
/// much of the same budget each pod holds.
pub fn tuning(old: &GatewayLimits, new: &GatewayLimits) -> Option<Tuning> {
    if old.backends.len() != new.backends.len()
        || old.client_policies.len() != new.client_policies.len()
    {
        return None;
    }
    let mut raised = false;
    // Sets a tuned number back to the old document's value, noting whether it was raised.
    fn tuned(raised: &mut bool, a: &mut u32, b: u32) {
        *raised |= *a > b;
        *a = b;
    }
    // A token budget's parts are tuned numbers too (its division over the pods); a budget
    // that appears or goes is content.
    fn tuned_tokens(raised: &mut bool, a: &mut Option<TokenBudget>, b: &Option<TokenBudget>) {
        let (Some(a), Some(b)) = (a, b) else {
            return;
        };
        *raised |= a.per_minute > b.per_minute;
        a.per_minute = b.per_minute;
        if let (Some(x), Some(y)) = (&mut a.per_day, b.per_day) {
            *raised |= *x > y;
            *x = y;
        }
        if let (Some(x), Some(y)) = (&mut a.requests_per_minute, b.requests_per_minute) {
            *raised |= *x > y;
            *x = y;
        }
    }
    let mut same = new.clone();
    same.revision.clone_from(&old.revision);
    same.generation = old.generation;
    for (b, o) in same.backends.iter_mut().zip(&old.backends) {
        if b.name != o.name {
            return None;
        }
        tuned(
            &mut raised,
            &mut b.pool.max_connections_per_endpoint,
            o.pool.max_connections_per_endpoint,
        );
        tuned(
            &mut raised,
            &mut b.pool.burst_per_endpoint,
            o.pool.burst_per_endpoint,
        );
    }
    for (c, o) in same.client_policies.iter_mut().zip(&old.client_policies) {
        if c.overrides.len() != o.overrides.len()
            || c.slow_calls.is_some() != o.slow_calls.is_some()
        {
            return None;
        }
        tuned(&mut raised, &mut c.max_concurrency, o.max_concurrency);
        tuned(&mut raised, &mut c.max_queue, o.max_queue);
        tuned_tokens(&mut raised, &mut c.tokens, &o.tokens);
        for (a, b) in c.overrides.iter_mut().zip(&o.overrides) {
            tuned(&mut raised, &mut a.max_concurrency, b.max_concurrency);
            tuned_tokens(&mut raised, &mut a.tokens, &b.tokens);
        }
        if let (Some(a), Some(b)) = (&mut c.slow_calls, &o.slow_calls) {
            tuned(
                &mut raised,
                &mut a.demoted_concurrency,
                b.demoted_concurrency,
            );
        }
        // Client shares are tuned numbers too: a share for a new client, or a larger one, raises.
        for share in &c.client_shares {
            let before = o
                .client_shares
                .iter()
                .find(|x| x.key_sha256 == share.key_sha256);
            raised |= before.is_none_or(|b| {
                share.max_concurrency > b.max_concurrency || share.max_queue > b.max_queue
            });
        }
        for before in &o.client_shares {
            if !c
                .client_shares
                .iter()
                .any(|x| x.key_sha256 == before.key_sha256)
            {
                // Back to the policy's own limits.
                raised |=
                    c.max_concurrency > before.max_concurrency || c.max_queue > before.max_queue;
            }
        }
        c.client_shares.clone_from(&o.client_shares);
    }
    (&same == old).then_some(if raised {
        Tuning::Raises
    } else {
        Tuning::Lowers
    })
}

/// Whether `new` differs from `old` only by lower (or equal) tuned numbers: what more pods to
/// divide over make. Such a document may reach pods through the ConfigMap before the waves.
pub fn only_lowers(old: &GatewayLimits, new: &GatewayLimits) -> bool {
    tuning(old, new) == Some(Tuning::Lowers)
}

/// The pods of a re-division to send now, when every stale pod's change is a [`Tuning`] of
/// what it runs: with `lowering_first`, the pods it lowers (or, when none, all of them); else
/// the rest. `None`: some stale pod's change is not a tuning (or what it runs is not known),
/// and the rollout's waves decide.
fn retune_wave<G: Gateways>(
    ctx: &Context<G>,
    observed: &Observed,
    fleet: &FleetPlan,
    states: &[PodState],
    lowering_first: bool,
) -> Option<Vec<String>> {
    let ns = &observed.namespace;
    let memory = ctx.rollouts.lock();
    let mut lowering = Vec::new();
    let mut raising = Vec::new();
    for p in states.iter().filter(|p| !p.current()) {
        if p.refused.is_some() {
            return None;
        }
        let running = memory
            .sent
            .get(&(ns.clone(), p.name.clone()))?
            .current
            .as_ref()?;
        if p.acked.as_deref() != Some(running.revision.as_str()) {
            return None;
        }
        let desired = fleet.documents.get(&p.name)?;
        match tuning(running, desired)? {
            Tuning::Lowers => lowering.push(p.name.clone()),
            Tuning::Raises => raising.push(p.name.clone()),
        }
    }
    if lowering.is_empty() && raising.is_empty() {
        return None;
    }
    Some(if lowering_first && !lowering.is_empty() {
        lowering
    } else {
        lowering.extend(raising);
        lowering
    })
}

/// The policy generation every selected pod last ran a document of (see
/// [`RolloutMemory::rolled_out_generation`]): as this operator rolled it out or, when it has
/// rolled out nothing of the policy yet (it just started, or took over from a leader that
/// did), as the status says, a `RolledOut` condition true at the generation it observed.
///
/// [`RolloutMemory::rolled_out_generation`]: super::context::RolloutMemory::rolled_out_generation
fn rolled_out_generation<G: Gateways>(
    ctx: &Context<G>,
    key: &(String, String),
    policy: &ConnectionPolicy,
) -> Option<i64> {
    let mut memory = ctx.rollouts.lock();
    if let Some(g) = memory.rolled_out_generation.get(key) {
        return Some(*g);
    }
    let told = policy
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "RolledOut" && c.status == "True")?
        .observed_generation?;
    memory.rolled_out_generation.insert(key.clone(), told);
    Some(told)
}

/// Reads the documents the stale pods run when this operator sent them none (it just started,
/// or took over from another leader), from their admin API (`GET /v1/limits`, bounded as the
/// PUTs are). Knowing them, a re-division goes to the pods it lowers first, as the previous
/// leader's would have; not knowing them, it would go through the canaries, which may raise one
/// pod before another is lowered: more than the backend's budget held for a while. A pod that
/// cannot tell is left to the rollout's waves; one that gives no answer is remembered as
/// unanswered, as after a PUT, and not asked again. Whether any was learned.
async fn learn_running<G: Gateways>(
    ctx: &Context<G>,
    observed: &Observed,
    states: &[PodState],
    tokens: &Tokens<'_, G>,
    now: Timestamp,
) -> Result<bool, RolloutError> {
    let ns = &observed.namespace;
    let unknown: Vec<(String, SocketAddr)> = {
        let memory = ctx.rollouts.lock();
        states
            .iter()
            .filter(|p| !p.current() && p.refused.is_none() && p.unanswered_at.is_none())
            .filter(|p| {
                memory
                    .sent
                    .get(&(ns.clone(), p.name.clone()))
                    .is_none_or(|s| s.current.is_none())
            })
            .filter_map(|p| Some((p.name.clone(), *observed.admin.get(&p.name)?)))
            .collect()
    };
    if unknown.is_empty() {
        return Ok(false);
    }
    let (token, previous) = tokens.get().await?;
    let bound = ctx.config.pushes;
    let reads = unknown.into_iter().map(|(name, addr)| {
        let (token, previous) = (token.as_str(), previous.as_deref());
        async move {
            let attempt = async {
                let mut result = ctx.gateways.limits(ns, addr, token).await;
                if let (Err(ReportError::Unauthorized), Some(previous)) = (&result, previous) {
                    result = ctx.gateways.limits(ns, addr, previous).await;
                }
                result
            };
            let result = tokio::time::timeout(bound.timeout, attempt)
                .await
                .unwrap_or_else(|_| Err(ReportError::TimedOut(bound.timeout)));
            (name, result)
        }
    });
    let results: Vec<_> = futures::stream::iter(reads)
        .buffer_unordered(bound.concurrency.max(1))
        .collect()
        .await;
    let instances = pod_instances(ctx, ns, results.iter().map(|(name, _)| name));
    let mut memory = ctx.rollouts.lock();
    let mut learned = false;
    for (name, result) in results {
        let doc = match result {
            Ok(doc) if plausible_generation(doc.generation) => doc,
            Ok(doc) => {
                debug!(namespace = %ns, pod = %name, generation = doc.generation, "a pod runs an implausible generation; the rollout's waves decide");
                continue;
            }
            Err(e) => {
                debug!(namespace = %ns, pod = %name, error = %crate::report(&e), "could not read the document a pod runs; the rollout's waves decide");
                if matches!(e, ReportError::TimedOut(_) | ReportError::Transport(_)) {
                    let instance = instances.get(&name).cloned().unwrap_or_default();
                    memory.unanswered.insert((ns.clone(), name, instance), now);
                }
                continue;
            }
        };
        let instance = instances.get(&name).cloned().unwrap_or_default();
        memory.saw_generation(ns, doc.generation);
        memory.acked.insert(
            (ns.clone(), name.clone(), instance),
            Acked {
                revision: doc.revision.clone(),
                generation: doc.generation,
            },
        );
        memory.sent.entry((ns.clone(), name)).or_default().current = Some(Arc::new(doc));
        learned = true;
    }
    Ok(learned)
}

/// Sends each of `canaries` the document it acknowledged before the current one, at a
/// generation above everything issued (the planner's next documents go above it in turn).
/// Returns how many took it, and the pods that could not be rolled back with why.
async fn roll_back<G: Gateways>(
    ctx: &Context<G>,
    observed: &Observed,
    canaries: &[String],
    tokens: &Tokens<'_, G>,
    now: Timestamp,
) -> Result<(usize, Pushed), RolloutError> {
    let ns = &observed.namespace;
    let mut failed = BTreeMap::new();
    let mut documents = BTreeMap::new();
    {
        let mut memory = ctx.rollouts.lock();
        let floor = memory.seen_generation.get(ns).copied().unwrap_or_default();
        for pod in canaries {
            let sent = memory.sent.get(&(ns.clone(), pod.clone()));
            let (Some(current), Some(previous)) = (
                sent.and_then(|s| s.current.clone()),
                sent.and_then(|s| s.previous.clone()),
            ) else {
                failed.insert(
                    pod.clone(),
                    "no previous document known (the operator restarted, or the pod started from the ConfigMap's): it keeps the new one".to_owned(),
                );
                continue;
            };
            let mut doc = (*previous).clone();
            doc.generation = current.generation.max(previous.generation).max(floor) + 1;
            documents.insert(pod.clone(), Arc::new(doc));
        }
        // The planner's next documents go above the rolled-back ones.
        if let Some(top) = documents.values().map(|d| d.generation).max() {
            memory.saw_generation(ns, top);
        }
    }
    let pods: Vec<String> = documents.keys().cloned().collect();
    let back = FleetPlan {
        documents,
        ..FleetPlan::default()
    };
    let mut pushed = push(ctx, observed, &back, &pods, tokens, now).await?;
    let rolled = pods.len() - pushed.failed.len();
    pushed.failed.extend(failed);
    if rolled > 0 {
        warn!(namespace = %ns, pods = ?pods, "canary regression: rolled back");
    }
    Ok((rolled, pushed))
}

/// The name of a policy's recommendation ConfigMap (`mode: Recommend`).
pub fn recommended_configmap_name(policy: &str) -> String {
    format!("{policy}-recommended")
}

/// Shadow mode (`mode: Recommend`): applies the document the policy would roll out to its
/// `-recommended` ConfigMap (which no pod mounts), sends nothing to the pods and leaves the
/// limits ConfigMap alone. The report says which pods already run the recommendation.
pub async fn recommend<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    key: &PolicyKey,
    observed: &Observed,
    fleet: &FleetPlan,
) -> Result<RolloutReport, RolloutError> {
    let Some(plan) = fleet.policy(key) else {
        return Ok(RolloutReport::default());
    };
    if let Some(doc) = &plan.document {
        let name = recommended_configmap_name(&policy.name_any());
        apply_document(ctx, policy, &name, doc).await?;
    }
    Ok(RolloutReport {
        pods: pod_states(ctx, observed, fleet, &plan.live),
        ..RolloutReport::default()
    })
}

/// The report of a policy that is not rolled out (not accepted).
pub fn not_rolled_out(key: &PolicyKey, observed: &Observed, fleet: &FleetPlan) -> RolloutReport {
    let live = fleet
        .policy(key)
        .map(|p| p.live.clone())
        .unwrap_or_default();
    let pods = live
        .iter()
        .map(|name| {
            let acked = observed
                .input
                .pods
                .iter()
                .find(|p| &p.name == name)
                .and_then(|p| p.acked.as_ref());
            PodState {
                name: name.clone(),
                desired: String::new(),
                acked: acked.map(|a| a.revision.clone()),
                generation: acked.map(|a| a.generation),
                refused: None,
                unanswered_at: None,
            }
        })
        .collect();
    RolloutReport {
        pods,
        ..RolloutReport::default()
    }
}

/// Sends a deleted policy's pods their documents without its backends (best effort: a pod that
/// cannot be reached loads the durable ConfigMaps of the remaining policies when it restarts).
pub async fn remove<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    observed: &Observed,
    fleet: &FleetPlan,
) -> Result<(), RolloutError> {
    let mine: Vec<String> = observed
        .input
        .pods
        .iter()
        .filter(|p| {
            !p.stopped
                && !p.terminating
                && crate::plan::selector::matches(&policy.spec.gateway_selector, &p.labels)
        })
        .map(|p| p.name.clone())
        .collect();
    let tokens = Tokens::new(ctx, &observed.namespace);
    let failed = push(ctx, observed, fleet, &mine, &tokens, (ctx.clock)())
        .await?
        .failed;
    for (pod, why) in &failed {
        warn!(%pod, %why, "could not remove the deleted policy's backends from a pod");
    }
    info!(
        pods = mine.len() - failed.len(),
        "removed the deleted policy's backends"
    );
    Ok(())
}

async fn apply_configmap<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    durable: &Durable,
    doc: &GatewayLimits,
) -> Result<(), RolloutError> {
    apply_owned(ctx, policy, durable, doc).await
}

/// Server-side apply of ConfigMap `name` holding `doc`, owned by the policy (unless it already
/// holds it).
async fn apply_document<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    name: &str,
    doc: &GatewayLimits,
) -> Result<(), RolloutError> {
    let alone = Durable {
        name: name.to_owned(),
        fleet: false,
        owner: None,
    };
    apply_owned(ctx, policy, &alone, doc).await
}

/// [`apply_document`] of ConfigMap `durable.name`, with the fleet label, as its owner's.
async fn apply_owned<G: Gateways>(
    ctx: &Context<G>,
    policy: &ConnectionPolicy,
    durable: &Durable,
    doc: &GatewayLimits,
) -> Result<(), RolloutError> {
    let name = durable.name.clone();
    let ns = policy.namespace().unwrap_or_default();
    let body = serde_json::to_string_pretty(doc).map_err(RolloutError::Serialize)?;
    let generation = doc.generation.to_string();
    let unchanged = ctx
        .stores
        .configmaps
        .get(&ObjectRef::new(&name).within(&ns))
        .is_some_and(|cm| {
            cm.annotations().get(REVISION_ANNOTATION) == Some(&doc.revision)
                && cm.annotations().get(GENERATION_ANNOTATION) == Some(&generation)
                && cm.data.as_ref().and_then(|d| d.get(DOCUMENT_KEY)) == Some(&body)
        });
    if unchanged {
        return Ok(());
    }
    let mut owner = policy
        .controller_owner_ref(&())
        .into_iter()
        .collect::<Vec<_>>();
    let mut writer = policy.name_any();
    if let (Some((name, uid)), Some(reference)) = (&durable.owner, owner.first_mut()) {
        name.clone_into(&mut reference.name);
        uid.clone_into(&mut reference.uid);
        name.clone_into(&mut writer);
    }
    let mut labels = serde_json::Map::new();
    labels.insert(MANAGED_BY.0.to_owned(), MANAGED_BY.1.into());
    labels.insert("poolpilot.io/policy".to_owned(), writer.into());
    if durable.fleet {
        labels.insert(FLEET_LABEL.to_owned(), "true".into());
    }
    let cm = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": labels,
            "annotations": {REVISION_ANNOTATION: doc.revision, GENERATION_ANNOTATION: generation},
            "ownerReferences": owner,
        },
        "data": {DOCUMENT_KEY: body},
    });
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&cm),
    )
    .await
    .map(drop)
    .map_err(|source| RolloutError::ConfigMap { name, source })
}

/// The pods that answered they run a newer generation, and those found on a later pass's
/// document after this one's went out (another reconcile of the namespace pushed it meanwhile,
/// without a refusal to say so): either way not updated for this rollout, and the policy comes
/// back as a change. The next pass numbers its documents above the latter too, as above a
/// refusal's generation, so that they stop counting as ahead once it is planned.
fn later_pass<G: Gateways>(
    ctx: &Context<G>,
    ns: &str,
    refused: BTreeSet<String>,
    states: &[PodState],
    fleet: &FleetPlan,
) -> BTreeSet<String> {
    let planned = |pod: &str| fleet.documents.get(pod).map(|d| d.generation);
    let ahead = waves::ahead(states, planned);
    let top = states
        .iter()
        .filter(|p| ahead.contains(&p.name))
        .filter_map(|p| p.generation)
        .filter(|g| plausible_generation(*g))
        .max();
    if let Some(top) = top {
        ctx.rollouts.lock().saw_generation(ns, top);
    }
    let mut older = refused;
    older.extend(ahead);
    older
}

/// The run ([`observe::instance`]) of pod `name` of `ns` as the store has it now, if it has it.
fn pod_instance<G: Gateways>(ctx: &Context<G>, ns: &str, name: &str) -> Option<String> {
    let pod = ctx.stores.pods.get(&ObjectRef::new(name).within(ns))?;
    Some(observe::instance(&pod))
}

/// The same for each of `names`, by name. Looked up one by one: a policy's pods are a few of
/// the namespace's (at 1,000 pods, listing them all for every wave of every reconcile was a
/// fifth of the operator's CPU at a cold start).
fn pod_instances<'a, G: Gateways>(
    ctx: &Context<G>,
    ns: &str,
    names: impl IntoIterator<Item = &'a String>,
) -> BTreeMap<String, String> {
    names
        .into_iter()
        .filter_map(|name| Some((name.clone(), pod_instance(ctx, ns, name)?)))
        .collect()
}

/// Drops what the rollout memory knows of the pods of `ns` that are gone or run anew (their
/// acknowledgements, their unanswered documents): a Deployment's pods come and go under new
/// names, and the memory must not grow with every pod that ever ran. Called by each namespace
/// pass (a pod that comes, goes or restarts changes the pass's fingerprint), over the
/// namespace's own entries only.
pub(super) fn forget_gone_pods<G: Gateways>(ctx: &Context<G>, ns: &str) {
    let mut memory = ctx.rollouts.lock();
    let memory = &mut *memory;
    let gone = |pod: &str, instance: &str| pod_instance(ctx, ns, pod).as_deref() != Some(instance);
    forget_in(&mut memory.acked, ns, gone);
    forget_in(&mut memory.unanswered, ns, gone);
}

/// Removes the entries of `ns` whose (pod, run of the pod) is `gone`.
fn forget_in<V>(
    map: &mut BTreeMap<(String, String, String), V>,
    ns: &str,
    gone: impl Fn(&str, &str) -> bool,
) {
    let from = (ns.to_owned(), String::new(), String::new());
    let stale: Vec<_> = map
        .range(from..)
        .map(|(k, _)| k)
        .take_while(|(n, _, _)| n == ns)
        .filter(|(_, pod, instance)| gone(pod, instance))
        .cloned()
        .collect();
    for key in stale {
        map.remove(&key);
    }
}

/// The rollout state of the pods `live` (selected, neither terminating nor stopped).
fn pod_states<G: Gateways>(
    ctx: &Context<G>,
    observed: &Observed,
    fleet: &FleetPlan,
    live: &[String],
) -> Vec<PodState> {
    let ns = &observed.namespace;
    let instances = pod_instances(ctx, ns, live);
    let pods: BTreeMap<&str, &crate::plan::GatewayPod> = observed
        .input
        .pods
        .iter()
        .map(|p| (p.name.as_str(), p))
        .collect();
    let memory = ctx.rollouts.lock();
    live.iter()
        .filter_map(|name| {
            let desired = fleet.documents.get(name)?.revision.clone();
            let pod = pods.get(name.as_str())?;
            let instance = instances.get(name).cloned().unwrap_or_default();
            let unanswered_at = memory
                .unanswered
                .get(&(ns.clone(), name.clone(), instance.clone()))
                .copied();
            let known = memory
                .acked
                .get(&(ns.clone(), name.clone(), instance))
                .or(pod.acked.as_ref());
            let acked = known.map(|a| a.revision.clone());
            let generation = known.map(|a| a.generation);
            let refused = memory
                .refused
                .get(&(ns.clone(), name.clone(), desired.clone()))
                .cloned();
            Some(PodState {
                name: name.clone(),
                desired,
                acked,
                generation,
                refused,
                unanswered_at,
            })
        })
        .collect()
}

/// What one [`push`] left undone: the pods that could not be reached (or did not answer
/// sensibly), with why, and of those the ones that did not answer within the per-pod timeout.
#[derive(Debug, Default)]
struct Pushed {
    failed: BTreeMap<String, String>,
    slow: BTreeSet<String>,
    older: BTreeSet<String>,
}

impl Pushed {
    fn extend(&mut self, other: Pushed) {
        self.failed.extend(other.failed);
        self.slow.extend(other.slow);
        self.older.extend(other.older);
    }
}

/// What became of one pod's PUT (and its retry with the previous token after a 401).
#[derive(Debug)]
pub enum Delivery {
    /// The pod answered (or the connection failed) in time.
    Answered(Result<Acked, PutError>),
    /// No answer within the per-pod timeout: the PUT was abandoned, the pod is tried again at
    /// the next reconcile.
    TimedOut(Duration),
}

/// Sends each pod (name, admin address, document) its document with `token` (and again with
/// `previous` after a 401), at most `bound.concurrency` pods at once, each given
/// `bound.timeout` for its answer: a slow or hung pod holds one slot for at most the timeout,
/// and the others go on meanwhile. The outcomes come in the order they ended.
pub async fn send_all<G: Gateways>(
    gateways: &G,
    namespace: &str,
    (token, previous): (&str, Option<&str>),
    pods: Vec<(String, SocketAddr, Arc<GatewayLimits>)>,
    bound: PushBound,
) -> Vec<(String, Arc<GatewayLimits>, Delivery)> {
    let sends = pods.into_iter().map(|(name, addr, doc)| async move {
        let attempt = async {
            let mut result = gateways.put(namespace, addr, token, &doc).await;
            if let (Err(PutError::Unauthorized), Some(previous)) = (&result, previous) {
                result = gateways.put(namespace, addr, previous, &doc).await;
            }
            result
        };
        let delivery = match tokio::time::timeout(bound.timeout, attempt).await {
            Ok(result) => Delivery::Answered(result),
            Err(_) => Delivery::TimedOut(bound.timeout),
        };
        (name, doc, delivery)
    });
    futures::stream::iter(sends)
        .buffer_unordered(bound.concurrency.max(1))
        .collect()
        .await
}

/// PUTs each pod in `pods` its document ([`send_all`], bounded by `--rollout-concurrency` and
/// `--put-timeout`). Returns the pods that could not be reached (or did not answer sensibly),
/// with why; acknowledgements and refusals go to the rollout memory.
async fn push<G: Gateways>(
    ctx: &Context<G>,
    observed: &Observed,
    fleet: &FleetPlan,
    pods: &[String],
    tokens: &Tokens<'_, G>,
    now: Timestamp,
) -> Result<Pushed, RolloutError> {
    let mut failed = BTreeMap::new();
    let mut slow = BTreeSet::new();
    let mut older = BTreeSet::new();
    // The pods that gave no answer (no IP, a failed connection, none in time, not a sensible
    // one): remembered, so that the next canary is one that answers.
    let mut unanswered = Vec::new();
    if pods.is_empty() {
        return Ok(Pushed {
            failed,
            slow,
            older,
        });
    }
    let ns = &observed.namespace;
    let (token, previous) = tokens.get().await?;
    let sends: Vec<(String, SocketAddr, Arc<GatewayLimits>)> = pods
        .iter()
        .filter_map(|name| {
            let doc = fleet.documents.get(name)?;
            let Some(addr) = observed.admin.get(name) else {
                failed.insert(name.clone(), "the pod has no IP yet".to_owned());
                unanswered.push(name.clone());
                return None;
            };
            Some((name.clone(), *addr, doc.clone()))
        })
        .collect();
    let results = send_all(
        &ctx.gateways,
        ns,
        (token, previous.as_deref()),
        sends,
        ctx.config.pushes,
    )
    .await;

    let instances = pod_instances(
        ctx,
        ns,
        results.iter().map(|(name, _, _)| name).chain(&unanswered),
    );
    let mut memory = ctx.rollouts.lock();
    for (name, doc, delivery) in results {
        let revision = doc.revision.clone();
        let result = match delivery {
            Delivery::Answered(result) => result,
            Delivery::TimedOut(after) => {
                warn!(namespace = %ns, pod = %name, timeout = ?after, "no answer to the PUT in time; tried again at the next reconcile");
                failed.insert(
                    name.clone(),
                    format!("no answer within {after:?} (--put-timeout); tried again at the next reconcile"),
                );
                slow.insert(name.clone());
                unanswered.push(name);
                ctx.metrics
                    .puts
                    .get_or_create(&OutcomeLabel { outcome: "timeout" })
                    .inc();
                continue;
            }
        };
        let outcome = match result {
            Ok(ack) => {
                let sent = memory.sent.entry((ns.clone(), name.clone())).or_default();
                if sent
                    .current
                    .as_ref()
                    .is_none_or(|c| c.revision != doc.revision)
                {
                    sent.previous = sent.current.take();
                }
                sent.current = Some(doc);
                let instance = instances.get(&name).cloned().unwrap_or_default();
                // A pod that took a document has nothing outstanding to refuse, and answers.
                memory
                    .refused
                    .retain(|(n, p, _), _| !(n == ns && p == &name));
                memory
                    .unanswered
                    .remove(&(ns.clone(), name.clone(), instance.clone()));
                memory.acked.insert((ns.clone(), name, instance), ack);
                "acked"
            }
            Err(PutError::Older {
                generation: Some(g),
                ..
            }) if !plausible_generation(g) => {
                // No document can go above it: the pod must start over from the ConfigMap.
                memory.refused.insert(
                    (ns.clone(), name, revision),
                    format!(
                        "runs generation {g}, above the largest the operator issues: restart the pod to reload its limits from the ConfigMap"
                    ),
                );
                "refused"
            }
            Err(PutError::Older {
                generation: Some(g),
                ..
            }) => {
                memory.saw_generation(ns, g);
                older.insert(name.clone());
                failed.insert(
                    name,
                    format!("runs generation {g}; the next document goes above it"),
                );
                "older"
            }
            Err(e) if e.is_nack() => {
                memory
                    .refused
                    .insert((ns.clone(), name, revision), e.to_string());
                "refused"
            }
            Err(e) => {
                let why = if matches!(e, PutError::Unauthorized) {
                    // Say which token: the pod's differs from the one the operator sends.
                    format!(
                        "HTTP 401: {e} (the pod's admin token differs from Secret {}, key {:?})",
                        ctx.config.token_secret, ctx.config.token_key
                    )
                } else {
                    crate::report(&e)
                };
                failed.insert(name.clone(), why);
                unanswered.push(name);
                if matches!(e, PutError::Unauthorized) {
                    "unauthorized"
                } else {
                    "failed"
                }
            }
        };
        ctx.metrics
            .puts
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }
    for name in unanswered {
        let instance = instances.get(&name).cloned().unwrap_or_default();
        memory.unanswered.insert((ns.clone(), name, instance), now);
    }
    Ok(Pushed {
        failed,
        slow,
        older,
    })
}

/// The admin tokens of one namespace ([`tokens`]), read from its Secret at most once for all
/// the reads and sends of one reconcile.
struct Tokens<'a, G: Gateways> {
    ctx: &'a Context<G>,
    ns: &'a str,
    read: tokio::sync::OnceCell<(String, Option<String>)>,
}

impl<'a, G: Gateways> Tokens<'a, G> {
    fn new(ctx: &'a Context<G>, ns: &'a str) -> Self {
        Self {
            ctx,
            ns,
            read: tokio::sync::OnceCell::new(),
        }
    }

    /// The tokens, read by the first call (a failed read is tried again by the next).
    async fn get(&self) -> Result<&(String, Option<String>), RolloutError> {
        self.read
            .get_or_try_init(|| tokens(self.ctx, self.ns))
            .await
    }
}

/// The admin token of `ns` ([`token`]) and, after a rotation, the one before it (which pods
/// whose mounted copy the kubelet has not refreshed yet still hold).
async fn tokens<G: Gateways>(
    ctx: &Context<G>,
    ns: &str,
) -> Result<(String, Option<String>), RolloutError> {
    let token = token(ctx, ns).await?;
    let mut memory = ctx.rollouts.lock();
    let seen = memory.tokens.entry(ns.to_owned()).or_default();
    if seen.0 != token {
        let before = std::mem::replace(&mut seen.0, token.clone());
        seen.1 = Some(before).filter(|t| !t.is_empty());
    }
    Ok((token, seen.1.clone()))
}

/// Reads the admin token from the Secret in `ns`.
async fn token<G: Gateways>(ctx: &Context<G>, ns: &str) -> Result<String, RolloutError> {
    let name = ctx.config.token_secret.clone();
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let secret = api.get(&name).await.map_err(|source| RolloutError::Token {
        name: name.clone(),
        source,
    })?;
    let key = &ctx.config.token_key;
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|s| s.clone().into_bytes())
        })
        .ok_or_else(|| RolloutError::TokenKey {
            name,
            key: key.clone(),
        })?;
    Ok(String::from_utf8_lossy(&bytes).trim().to_owned())
}

#[cfg(test)]
pub(crate) mod tests;
