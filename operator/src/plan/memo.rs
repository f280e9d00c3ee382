//! The namespace's last rendering, reused while everything it was made from is unchanged. Every
//! reconcile plans the whole namespace, so with many policies on the same pods it would render
//! (and hash) every pod's document of every backend again each time: quadratic in the number of
//! policies. Most reconciles change nothing the documents depend on; comparing those inputs is
//! far cheaper than rendering them.
//!
//! When something did change, most pods' documents usually did not: a decision of one policy
//! changes the documents of the pods it selects, not the other pods'. [`Reuse`] tells the
//! rendering which pods' last documents it may take as they are: those whose policies (the
//! same ones, in the same order) are each unchanged since the last rendering, policy and
//! rendered plan alike. A document depends on nothing else but the pod's name and the
//! generation handed out for its revision, which the rendering still asks for. The same holds
//! for the ConfigMaps' documents (the policies on a pod at the base shares, one per first
//! selected pod) and for each policy's own document, which the rendering validates: with 2,000
//! policies on 100 groups of pods, a change of one policy rendered, hashed and validated about
//! 2,100 documents before, and renders its own group's now.

use std::collections::BTreeMap;
use std::sync::Arc;

use poolpilot_api::GatewayLimits;

use super::generations::Generations;
use super::input::{FleetInput, PolicyInput};
use super::output::PolicyPlan;

/// Everything the fd check and the rendering read. Per-run facts that they do not read (the
/// decisions, the samples, a re-division's reason, metrics availability, the policies' statuses
/// beyond the documents they record) are left out, so that a reconcile that only looked at fresh samples finds the
/// rendering still valid.
#[derive(Clone, Debug, PartialEq)]
pub struct RenderInput {
    policies: Vec<PolicyInput>,
    plans: Vec<PolicyPlan>,
    pods: Vec<String>,
    fd_limits: BTreeMap<String, u64>,
    generations: Generations,
}

impl RenderInput {
    /// The inputs of rendering `plans` (targets decided, not yet checked against the fd budget).
    pub fn of(
        input: &FleetInput,
        plans: &[PolicyPlan],
        fd_limits: &BTreeMap<String, u64>,
        generations: &Generations,
    ) -> Self {
        Self {
            policies: input
                .policies
                .iter()
                .map(|p| PolicyInput {
                    status: None,
                    ..p.clone()
                })
                .collect(),
            plans: plans.iter().map(without_run_facts).collect(),
            pods: input.pods.iter().map(|p| p.name.clone()).collect(),
            fd_limits: fd_limits.clone(),
            generations: generations.clone(),
        }
    }
}

/// A rendering and what it was made from.
#[derive(Clone, PartialEq)]
pub struct Rendered {
    /// What it was made from.
    pub input: RenderInput,
    /// The plans after the fd check and rendering, without this run's facts.
    pub plans: Vec<PolicyPlan>,
    /// The documents per pod.
    pub documents: BTreeMap<String, Arc<GatewayLimits>>,
    /// The policies each pod's document was rendered from, by index into `plans`, in the
    /// order the rendering took them.
    pub on_pods: BTreeMap<String, Vec<usize>>,
}

impl std::fmt::Debug for Rendered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendered")
            .field("policies", &self.plans.len())
            .field("documents", &self.documents.len())
            .finish_non_exhaustive()
    }
}

impl Rendered {
    /// Records a rendering: `plans` are the rendered plans without this run's facts
    /// ([`rendered_plans`]).
    pub fn new(
        input: RenderInput,
        plans: Vec<PolicyPlan>,
        documents: BTreeMap<String, Arc<GatewayLimits>>,
        on_pods: BTreeMap<String, Vec<usize>>,
    ) -> Self {
        Self {
            input,
            plans,
            documents,
            on_pods,
        }
    }

    /// The rendered plans with this run's facts (decisions, samples, metrics availability) taken
    /// from `fresh`, the plans of this run before rendering; they match the recorded ones one to
    /// one since the inputs are equal.
    pub fn reuse(&self, fresh: Vec<PolicyPlan>) -> Vec<PolicyPlan> {
        self.plans
            .iter()
            .zip(fresh)
            .map(|(rendered, fresh)| {
                let mut plan = rendered.clone();
                plan.metrics_available = fresh.metrics_available;
                plan.token_use = fresh.token_use;
                for (b, f) in plan.backends.iter_mut().zip(fresh.backends) {
                    b.decision = f.decision;
                    b.sample = f.sample;
                    b.rebalanced = f.rebalanced;
                    b.idle_timeout = f.idle_timeout;
                }
                plan
            })
            .collect()
    }
}

/// The rendered `plans` without what only this run decided or saw, as a [`Rendered`] keeps them
/// and as [`Reuse::new`] compares them.
pub fn rendered_plans(plans: &[PolicyPlan]) -> Vec<PolicyPlan> {
    plans.iter().map(without_run_facts).collect()
}

/// Which documents of the last rendering this one may take as they are: a pod's, and a
/// ConfigMap's (the policies on one pod at the base shares); and which policies' own documents
/// passed their validation there.
#[derive(Debug)]
pub struct Reuse<'a> {
    last: &'a Rendered,
    /// Per policy of this rendering (by index): its index in `last` when it is the same policy
    /// (its status aside) with the same rendered plan (this run's facts and its ConfigMap's
    /// document aside).
    same: Vec<Option<usize>>,
}

impl<'a> Reuse<'a> {
    /// Compares this rendering's policies (`input`) and plans (`plans`: after the fd check,
    /// without this run's facts, before the documents' own validation) with `last`'s, each
    /// policy once. The ConfigMaps' documents are left out of the comparison: they are what
    /// the rendering makes from the rest.
    pub fn new(last: &'a Rendered, input: &RenderInput, plans: &[PolicyPlan]) -> Self {
        let index: std::collections::HashMap<&super::input::PolicyKey, usize> = last
            .input
            .policies
            .iter()
            .enumerate()
            .map(|(j, p)| (&p.key, j))
            .collect();
        let same = input
            .policies
            .iter()
            .zip(plans)
            .map(|(policy, plan)| {
                index.get(&policy.key).copied().filter(|&j| {
                    last.input.policies[j] == *policy
                        && last
                            .plans
                            .get(j)
                            .is_some_and(|l| same_but_document(l, plan))
                })
            })
            .collect();
        Self { last, same }
    }

    /// Whether policy `i`'s own document passed its validation in the last rendering: the same
    /// policy with the same plan was accepted there (validation only ever rejects), so its
    /// document, made from nothing else, is the same one.
    pub fn validated(&self, i: usize) -> bool {
        self.same
            .get(i)
            .copied()
            .flatten()
            .and_then(|j| self.last.plans.get(j))
            .is_some_and(|p| p.acceptance.is_accepted())
    }

    /// A policy that `pod`'s document or ConfigMap is now made from (`on_pod`, by index into
    /// this rendering's plans, in order) is not the same one as last time, or the pod's
    /// policies are not the same list.
    fn changed(&self, pod: &str, on_pod: &[usize]) -> bool {
        let Some(was) = self.last.on_pods.get(pod) else {
            return true;
        };
        was.len() != on_pod.len()
            || !on_pod
                .iter()
                .zip(was)
                .all(|(&i, &j)| self.same.get(i).copied().flatten() == Some(j))
    }

    /// The last document of `pod` when it was rendered from the same policies as `on_pod` (by
    /// index into this rendering's plans, in order), each unchanged: what rendering it again
    /// would give, but for its generation.
    pub fn document(&self, pod: &str, on_pod: &[usize]) -> Option<&'a Arc<GatewayLimits>> {
        if self.changed(pod, on_pod) {
            return None;
        }
        self.last.documents.get(pod)
    }

    /// The last ConfigMap document of policy `first`, the first policy whose first selected pod
    /// is `pod`, when the policies on `pod` (`on_pod`, as for [`Self::document`]) are each
    /// unchanged: the same policies at the base shares, so the same document but for its
    /// generation. (The same plan selects the same pods, so the policy it was last time had its
    /// ConfigMap's document made from the policies on the same first pod.)
    pub fn configmap_document(
        &self,
        first: usize,
        pod: &str,
        on_pod: &[usize],
    ) -> Option<&'a Arc<GatewayLimits>> {
        let j = self.same.get(first).copied().flatten()?;
        if self.changed(pod, on_pod) {
            return None;
        }
        self.last.plans.get(j)?.document.as_ref()
    }
}

/// Whether two rendered plans are equal but for their ConfigMaps' documents (every other
/// field is named, so that a field added to the plan is compared too).
fn same_but_document(a: &PolicyPlan, b: &PolicyPlan) -> bool {
    let PolicyPlan {
        key,
        acceptance,
        selected,
        holders,
        live,
        ready,
        backends,
        fds,
        metrics_available,
        client_shares,
        token_shares,
        client_token_shares,
        token_use,
        document: _,
    } = a;
    *key == b.key
        && *acceptance == b.acceptance
        && *selected == b.selected
        && *holders == b.holders
        && *live == b.live
        && *ready == b.ready
        && *backends == b.backends
        && *fds == b.fds
        && *metrics_available == b.metrics_available
        && *client_shares == b.client_shares
        && *token_shares == b.token_shares
        && *client_token_shares == b.client_token_shares
        && *token_use == b.token_use
}

/// `plan` without what only this run decided or saw.
fn without_run_facts(plan: &PolicyPlan) -> PolicyPlan {
    let mut plan = plan.clone();
    plan.metrics_available = None;
    plan.token_use = Default::default();
    for b in &mut plan.backends {
        b.decision = None;
        b.sample = Default::default();
        b.rebalanced = None;
        // Whether this run lowered it is a fact of the run; the value is the documents'.
        if let Some(l) = &mut b.idle_timeout.lowered {
            l.now = false;
        }
        if let Some(t) = &mut b.idle_timeout.tried {
            t.now = false;
        }
    }
    plan
}
