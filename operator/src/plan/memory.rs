//! What the planner remembers between runs of a namespace: the autoscale memory, the last known
//! fd limits and the last rendering.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::autoscale::BackendMemory;
use super::input::PolicyKey;
use super::memo;

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
