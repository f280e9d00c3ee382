//! What one planning run decides: per policy its acceptance, the pods it selects, per backend
//! the target and each pod's share, the fd check, and the documents each pod should run.

use std::collections::BTreeMap;
use std::sync::Arc;

use poolpilot_api::GatewayLimits;

use super::autoscale::{Bounds, Decision};
use super::budget::FdReport;
use super::clients::ClientDivision;
use super::idle_timeout::IdleTimeout;
use super::input::{BackendSample, PolicyKey};
use super::tokens::TokenDivision;
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
    /// The smallest holder's share after the fd check: the share of the durable ConfigMap's
    /// document, for pods that start later (the next run divides the target over them too).
    pub per_pod: u32,
    /// Each holder's share per endpoint, in the order of [`PolicyPlan::holders`], after the fd
    /// check: the target divided by demand ([`super::division`]).
    pub shares: Vec<u32>,
    /// Each holder's demand per endpoint the shares were divided by (`None`: no sample).
    pub demand: Vec<Option<f64>>,
    /// Connections per endpoint each holder may open beyond its share while calls wait in its
    /// pool queue (0: none; see [`super::division::burst`]).
    pub burst: u32,
    /// Why this run re-divided the same target over the same pods, when it did.
    pub rebalanced: Option<String>,
    /// Whether the fd check lowered the shares.
    pub clamped: bool,
    /// The bounds the target lives in.
    pub bounds: Bounds,
    /// What the autoscaler decided this run (`None`: not due this run).
    pub decision: Option<Decision>,
    /// Decisions in a row that held this backend's growth (0: the last one did not).
    pub held: u32,
    /// The sample the decision was made from.
    pub sample: BackendSample,
    /// The idle timeout the pods run: the spec's, or lower, under the backend's keep-alive
    /// ([`super::idle_timeout`]).
    pub idle_timeout: IdleTimeout,
    /// Slots one socket carries, for the fd check: 1 for HTTP/1.1 (and `Auto`, whose servers
    /// may answer HTTP/1.1), for HTTP/2 the servers' stream limit ([`super::fds::streams_per_socket`]).
    pub streams_per_socket: u32,
}

impl BackendPlan {
    /// The share of the holder at `rank` (its place among the holders in name order); `None`
    /// (the durable ConfigMap's document, for pods that start later) gets `per_pod`, the
    /// smallest.
    pub fn share_of(&self, rank: Option<usize>) -> u32 {
        rank.and_then(|r| self.shares.get(r).copied())
            .unwrap_or(self.per_pod)
    }

    /// Connections per endpoint the holders open together when each takes its share: more than
    /// the target only when there are more holders than the target allows (every share is at
    /// least 1).
    pub fn fleet_total(&self) -> u64 {
        self.shares.iter().map(|&s| u64::from(s)).sum()
    }

    /// The overcommit, when the shares' floor of 1 takes the fleet over the backend's budget:
    /// `(fleet total, target)`.
    pub fn overcommit(&self) -> Option<(u64, u32)> {
        let total = self.fleet_total();
        (total > u64::from(self.target)).then_some((total, self.target))
    }

    /// Sets `per_pod` to the smallest share (the target itself with no holder: the first pod to
    /// appear may take it).
    pub fn settle_per_pod(&mut self) {
        self.per_pod = self
            .shares
            .iter()
            .copied()
            .min()
            .unwrap_or(self.target.max(1));
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
    /// Its busiest clients' fleet-wide limits divided over the holders by where their calls
    /// arrive, by client key (empty: every client gets the even split).
    pub client_shares: BTreeMap<String, ClientDivision>,
    /// Its named clients' fleet-wide token budgets divided over the holders by where their
    /// tokens are used, by override name (empty: every budget is split evenly, or per pod).
    pub token_shares: BTreeMap<String, TokenDivision>,
    /// The policy's token budget divided over the holders by where the clients without an
    /// override that spend the most of it spend it, by client key (empty: the even split).
    pub client_token_shares: BTreeMap<String, TokenDivision>,
    /// The tokens a minute charged to each client label's budgets over the selected pods (an
    /// override's name, or `other`; a label absent used none), `None` while a ready pod has
    /// no sample. A fact of this run, for status.
    pub token_use: Option<BTreeMap<String, f64>>,
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

    /// `pod`'s share of backend `b` (a holder's own share; the smallest for anyone else).
    pub fn share(&self, b: &BackendPlan, pod: &str) -> u32 {
        b.share_of(self.rank(pod))
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
    /// How many backends' divisions over their holders this run computed. The others, of
    /// policies not in focus that made no decision and whose division in memory still fits,
    /// were kept as they were.
    pub divided: usize,
}

impl FleetPlan {
    /// The plan of one policy.
    pub fn policy(&self, key: &PolicyKey) -> Option<&PolicyPlan> {
        self.policies.iter().find(|p| &p.key == key)
    }
}
