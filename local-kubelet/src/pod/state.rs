//! What the pod worker knows of each container: its current process, the termination of the
//! previous one, back-off, readiness and the bookkeeping of its probes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, ContainerStateTerminated, Pod};
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

/// A container's current process.
#[derive(Debug)]
pub(super) struct Run {
    pub(super) id: u64,
    pub(super) pid: u32,
    pub(super) started_at: Timestamp,
    pub(super) started: Instant,
    pub(super) killed_for: Option<String>,
    /// What this run's probes need, fixed at start: the container's named ports and its
    /// environment (exec probes run with it, as they would inside the container).
    pub(super) probe_context: Arc<ProbeContext>,
}

/// The per-run inputs of a container's probes.
#[derive(Debug)]
pub(super) struct ProbeContext {
    pub(super) ip: String,
    pub(super) ports: BTreeMap<String, u16>,
    pub(super) env: BTreeMap<String, String>,
}

/// Probe bookkeeping for one probe of one container.
#[derive(Debug, Default)]
pub(super) struct ProbeState {
    pub(super) next: Option<Instant>,
    pub(super) in_flight: bool,
    pub(super) successes: u32,
    pub(super) failures: u32,
}

#[derive(Debug)]
pub(super) struct ContainerState {
    pub(super) spec: Container,
    pub(super) init: bool,
    pub(super) run: Option<Run>,
    pub(super) restart_count: i32,
    /// The termination of the previous run (`lastState`).
    pub(super) last_terminated: Option<ContainerStateTerminated>,
    /// Set when the container finished for good (no restart coming).
    pub(super) finished: Option<ContainerStateTerminated>,
    pub(super) waiting: Option<(String, String)>,
    pub(super) next_start: Instant,
    pub(super) backoff: Duration,
    pub(super) ready: bool,
    pub(super) readiness: ProbeState,
    pub(super) liveness: ProbeState,
}

/// The pod's `restartPolicy` (`Always` when not set).
pub(super) fn restart_policy(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.restart_policy.as_deref())
        .unwrap_or("Always")
}
