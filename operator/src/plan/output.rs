//! What one planning run decides: per policy its acceptance, the pods it selects, per backend
//! the target and each pod's share, the fd check, and the documents each pod should run.

use std::collections::BTreeMap;
use std::sync::Arc;

use poolpilot_api::GatewayLimits;

use super::autoscale::{Bounds, Decision};
use super::budget::{FdReport, share};
use super::input::{BackendSample, PolicyKey};
use super::validate::Acceptance;

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
        if holders == 0 || self.clamped || self.per_pod != share(self.target, holders) {
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
