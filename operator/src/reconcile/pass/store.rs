//! What the namespace passes keep between reconciles: each namespace's last [`Pass`], the
//! reconciles waiting for its next one, the turn to plan, and the decisions not told yet.
//!
//! The [`Context`] holds these and the planning in the parent module reads the context, so this
//! module imports neither the context nor any of the reconciler's steps: the imports would go
//! round in a circle.
//!
//! [`Context`]: crate::reconcile::Context

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use poolpilot_api::ConnectionPolicy;

use crate::plan::validate::Acceptance;
use crate::plan::{BackendPlan, FleetPlan, PolicyInput, PolicyKey, PolicyPlan, Timestamp};
use crate::reconcile::observed::Observed;

/// One plan of a namespace, and what it was made from.
#[derive(Debug)]
pub struct Pass {
    /// What was observed: every policy in force, the pods they select, the samples, the
    /// clients' reports.
    pub observed: Observed,
    /// The verdict on each policy of `observed.input`, in its order.
    pub verdicts: Vec<Acceptance>,
    /// The plan.
    pub fleet: FleetPlan,
    /// Where each policy is in `observed.input.policies`, `verdicts` and `fleet.policies`.
    pub(super) index: HashMap<PolicyKey, usize>,
    /// The namespace's [`fingerprint`](super::fingerprint) when it started.
    pub(super) world: u64,
    /// Its place among the namespace's passes (1 for the first; 0 for a private one).
    pub(super) seq: u64,
    /// When it was planned.
    pub at: Timestamp,
}

/// One policy's part of a pass.
#[derive(Clone, Copy, Debug)]
pub struct PolicyPass<'a> {
    /// The policy as planned.
    pub input: &'a PolicyInput,
    /// Its verdict.
    pub verdict: &'a Acceptance,
    /// Its plan.
    pub plan: &'a PolicyPlan,
}

impl Pass {
    /// `key`'s part of the pass, if the policy was in force when it was made.
    pub fn policy(&self, key: &PolicyKey) -> Option<PolicyPass<'_>> {
        let &i = self.index.get(key)?;
        Some(PolicyPass {
            input: &self.observed.input.policies[i],
            verdict: &self.verdicts[i],
            plan: &self.fleet.policies[i],
        })
    }

    /// Whether it planned `policy` (`key`) as it is: at its generation, with its spec.
    pub(super) fn holds(&self, key: &PolicyKey, policy: &ConnectionPolicy) -> bool {
        self.policy(key).is_some_and(|p| {
            p.input.generation == policy.metadata.generation.unwrap_or_default()
                && p.input.spec == policy.spec
        })
    }
}

/// The passes of every namespace.
#[derive(Debug, Default)]
pub struct Passes {
    namespaces: parking_lot::Mutex<BTreeMap<String, Arc<Namespace>>>,
}

/// One namespace's passes: the last one, the reconciles waiting for the next, and the turn to
/// plan.
#[derive(Debug, Default)]
pub(super) struct Namespace {
    pub(super) state: parking_lot::Mutex<State>,
    /// Held by the reconcile planning a pass (tokio's mutex is fair: waiters get it in turn).
    pub(super) turn: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) latest: Option<Arc<Pass>>,
    /// The reconciles waiting for the next pass.
    pub(super) waiting: BTreeSet<PolicyKey>,
    /// Passes started so far.
    pub(super) started: u64,
    /// The decisions and re-divisions passes made that the policy's own reconcile has not told
    /// yet (in its Events), per policy: a pass decides for every policy due, whichever
    /// reconcile it plans for, and each is told once, by the next reconcile of its policy.
    pub(super) news: BTreeMap<PolicyKey, Vec<BackendPlan>>,
}

/// The most untold news kept per policy (a policy whose reconciles stopped, being deleted,
/// keeps no more than this).
const NEWS_KEPT: usize = 16;

impl State {
    pub(super) fn record(&mut self, pass: &Pass) {
        for plan in &pass.fleet.policies {
            let news: Vec<BackendPlan> = plan
                .backends
                .iter()
                .filter(|b| b.decision.is_some() || b.rebalanced.is_some())
                .cloned()
                .collect();
            if news.is_empty() {
                continue;
            }
            let kept = self.news.entry(plan.key.clone()).or_default();
            kept.extend(news);
            let over = kept.len().saturating_sub(NEWS_KEPT);
            kept.drain(..over);
        }
    }
}

impl Passes {
    pub(super) fn namespace(&self, ns: &str) -> Arc<Namespace> {
        self.namespaces
            .lock()
            .entry(ns.to_owned())
            .or_default()
            .clone()
    }

    /// Forgets a namespace with no policy left (its last pass holds every pod's document).
    pub fn forget(&self, ns: &str) {
        self.namespaces.lock().remove(ns);
    }
}

#[cfg(test)]
impl Passes {
    /// Takes `ns`'s turn, so that its reconciles wait for the next pass together.
    pub(crate) async fn hold_turn(&self, ns: &str) -> tokio::sync::OwnedMutexGuard<()> {
        self.namespace(ns).turn.clone().lock_owned().await
    }

    /// How many reconciles of `ns` wait for the next pass.
    pub(crate) fn waiting(&self, ns: &str) -> usize {
        self.namespace(ns).state.lock().waiting.len()
    }

    /// How many passes of `ns` were planned (private ones aside).
    pub(crate) fn started(&self, ns: &str) -> u64 {
        self.namespace(ns).state.lock().started
    }
}
