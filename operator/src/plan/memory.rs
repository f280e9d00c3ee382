//! What the planner remembers between runs of a namespace: the autoscale memory, the last known
//! fd limits and the last rendering.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::autoscale::BackendMemory;
use super::clients::ClientDivision;
use super::idle_timeout::IdleTimeout;
use super::input::PolicyKey;
use super::memo;
use super::shares::Divided;
use super::tokens::TokenDivision;

/// What the planner remembers between runs (the runtime keeps it in memory; after a restart it
/// is rebuilt from status).
#[derive(Clone, Debug, Default)]
pub struct Memory {
    /// Autoscale memory per policy and backend.
    pub backends: BTreeMap<(PolicyKey, String), BackendMemory>,
    /// The last known `process_max_fds` per pod (used while a sample is missing).
    pub fd_limits: BTreeMap<String, u64>,
    /// The division of each backend's target over its holders, per policy and backend.
    pub divisions: BTreeMap<(PolicyKey, String), Divided>,
    /// The burst allowance per endpoint in force, per policy and backend.
    pub bursts: BTreeMap<(PolicyKey, String), u32>,
    /// The idle timeout the pods run, per policy and backend.
    pub idle_timeouts: BTreeMap<(PolicyKey, String), IdleTimeout>,
    /// The busiest clients' limits divided over the holders, per policy and client key.
    pub client_divisions: BTreeMap<PolicyKey, BTreeMap<String, ClientDivision>>,
    /// The named clients' token budgets divided over the holders, per policy and override name.
    pub token_divisions: BTreeMap<PolicyKey, BTreeMap<String, TokenDivision>>,
    /// The policy's token budget divided for its busiest clients without an override, per
    /// policy and client key.
    pub client_token_divisions: BTreeMap<PolicyKey, BTreeMap<String, TokenDivision>>,
    /// The last rendering, reused while its inputs are unchanged.
    pub rendered: Option<Arc<memo::Rendered>>,
}

impl Memory {
    /// Forgets what was remembered of `policy` (deleted, or not in force): its backends'
    /// autoscale memory, divisions, bursts, idle timeouts, client and token divisions.
    pub fn forget(&mut self, policy: &PolicyKey) {
        self.backends.retain(|(k, _), _| k != policy);
        self.divisions.retain(|(k, _), _| k != policy);
        self.bursts.retain(|(k, _), _| k != policy);
        self.idle_timeouts.retain(|(k, _), _| k != policy);
        self.client_divisions.remove(policy);
        self.token_divisions.remove(policy);
        self.client_token_divisions.remove(policy);
    }
}
