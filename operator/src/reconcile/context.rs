//! What every reconcile shares: the client, the settings, the caches, the latest Prometheus
//! snapshot, the planner's and the rollout's memory, the gateway client, Events and metrics.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::core::DeserializeGuard;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;
use parking_lot::{Mutex, RwLock};
use poolpilot_api::ConnectionPolicy;

use super::backoff;
use crate::gateway::Gateways;
use crate::metrics::Metrics;
use crate::plan::input::ClientUse;
use crate::plan::selector::SelectionMemo;
use crate::plan::{Acked, Memory, PolicyKey, Timestamp};
use crate::prom::{SaturationQueries, Snapshot};

/// The one field manager of every server-side apply.
pub const FIELD_MANAGER: &str = "poolpilot-operator";

/// Runtime settings of the reconciler.
#[derive(Clone, Debug)]
pub struct Config {
    /// The gateways' admin port (a pod annotation may override it).
    pub admin_port: u16,
    /// Name of the Secret (in the policy's namespace) holding the admin token.
    pub token_secret: String,
    /// Key of the token in that Secret.
    pub token_key: String,
    /// A Prometheus snapshot older than this is missing data.
    pub snapshot_max_age: Duration,
    /// Longest wait between two reconciles of a policy.
    pub max_requeue: Duration,
    /// Namespaces besides its own whose Services a policy may name as backends
    /// (`--backend-namespaces`).
    pub backend_namespaces: Vec<String>,
    /// How documents go out to the pods of a wave (`--rollout-concurrency`, `--put-timeout`).
    pub pushes: PushBound,
}

/// How a wave's documents go out: at most `concurrency` pods at once, each given `timeout` for
/// its answer, so that a slow or hung pod holds one slot for at most the timeout and never the
/// wave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PushBound {
    /// The most PUTs in flight per reconcile (at least 1).
    pub concurrency: usize,
    /// How long one pod has to answer (its retry with the previous token included).
    pub timeout: Duration,
}

impl Default for PushBound {
    fn default() -> Self {
        Self {
            concurrency: DEFAULT_ROLLOUT_CONCURRENCY,
            timeout: Duration::from_secs(5),
        }
    }
}

/// The default of `--rollout-concurrency`.
pub const DEFAULT_ROLLOUT_CONCURRENCY: usize = 32;

/// What the rollout remembers between reconciles.
#[derive(Clone, Debug, Default)]
pub struct RolloutMemory {
    /// The last acknowledgement per (namespace, pod, run of the pod: [`observe::instance`]).
    pub acked: BTreeMap<(String, String, String), Acked>,
    /// When the last document sent to a pod (or the read of the one it runs) went unanswered
    /// (no IP, a failed connection, no answer in time), per (namespace, pod, run of the pod),
    /// until it acknowledges one: the rollout picks its canaries among the pods that answer.
    pub unanswered: BTreeMap<(String, String, String), Timestamp>,
    /// Refusals per (namespace, pod, revision).
    pub refused: BTreeMap<(String, String, String), String>,
    /// When a revision was first acknowledged by a canary, per (namespace, revision).
    pub canary_since: BTreeMap<(String, String), Timestamp>,
    /// The revision each policy rolls out, per (namespace, policy): when it changes, the
    /// verification of the one before is forgotten, so that a revision seen again (an edit
    /// undone, a target back where it was) is verified anew.
    pub rolling: BTreeMap<(String, String), String>,
    /// The policy generation (`metadata.generation`) every selected pod last ran a document
    /// of, per (namespace, policy). A change of tuned numbers only (shares, bursts, client
    /// limits) under the generation every pod ran is the operator's own (a decision, a
    /// re-division) and reaches every pod at once; under a newer one it is the user's edit, and
    /// the rollout's waves verify it on the canaries first.
    pub rolled_out_generation: BTreeMap<(String, String), i64>,
    /// The floor of the namespace's next document generations: the highest a pod was found
    /// running (a 409 answer, a document read back, one found from a later pass) or sent (a
    /// rollback), per namespace ([`RolloutMemory::saw_generation`]).
    pub seen_generation: BTreeMap<String, u64>,
    /// When a policy was last reconciled again at once because its pods ran a later pass, per
    /// (namespace, policy): at most once a second, so that two writers raising the generation
    /// over each other (two operators on the same pods) cannot spin the passes.
    pub ahead_requeued: BTreeMap<(String, String), Timestamp>,
    /// The documents each pod acknowledged last and the one before, per (namespace, pod): a
    /// regressed canary goes back to the one before.
    pub sent: BTreeMap<(String, String), SentDocuments>,
    /// Revisions whose canaries regressed and were rolled back, with why, per (namespace,
    /// revision): the rollout stays halted until the policy changes (a new revision).
    pub regressed: BTreeMap<(String, String), String>,
    /// The admin token Secret's value as last read, and the one before it, per namespace: after
    /// a rotation, pods whose mounted copy still holds the previous token get it (on a 401 to
    /// the new one) until the kubelet refreshes their copy.
    pub tokens: BTreeMap<String, (String, Option<String>)>,
}

impl RolloutMemory {
    /// Raises `ns`'s generation floor to `generation`: the namespace's next pass numbers its
    /// documents above it.
    pub fn saw_generation(&mut self, ns: &str, generation: u64) {
        let seen = self.seen_generation.entry(ns.to_owned()).or_default();
        *seen = (*seen).max(generation);
    }

    /// When the canaries' verification of `desired`, the revision `policy` in `ns` rolls out,
    /// started: when a canary was first seen on it (`on_it`: one is now). A policy that moved to
    /// another revision forgets the verification of the one before and of `desired`, so that a
    /// revision seen again (an edit undone, a target back where it was) is verified anew.
    pub fn verification_start(
        &mut self,
        ns: &str,
        policy: &str,
        desired: &str,
        on_it: bool,
        now: Timestamp,
    ) -> Option<Timestamp> {
        let rolling = (ns.to_owned(), policy.to_owned());
        if self.rolling.get(&rolling).map(String::as_str) != Some(desired) {
            if let Some(before) = self.rolling.insert(rolling, desired.to_owned()) {
                self.canary_since.remove(&(ns.to_owned(), before));
            }
            self.canary_since
                .remove(&(ns.to_owned(), desired.to_owned()));
        }
        let key = (ns.to_owned(), desired.to_owned());
        if on_it {
            Some(*self.canary_since.entry(key).or_insert(now))
        } else {
            self.canary_since.get(&key).copied()
        }
    }
}

/// The documents one pod acknowledged: the last and the one before it.
#[derive(Clone, Debug, Default)]
pub struct SentDocuments {
    /// The last one.
    pub current: Option<Arc<poolpilot_api::GatewayLimits>>,
    /// The one before it (another revision).
    pub previous: Option<Arc<poolpilot_api::GatewayLimits>>,
}
/// One pod's report of its busiest clients: when it came, and its clients per policy.
pub type ClientReport = (Timestamp, BTreeMap<PolicyKey, Vec<ClientUse>>);

/// The latest report of each pod, per (namespace, pod).
#[derive(Clone, Debug, Default)]
pub struct ClientReports {
    by_pod: BTreeMap<(String, String), ClientReport>,
}

impl ClientReports {
    /// Records a pod's report.
    pub fn insert(&mut self, pod: (String, String), report: ClientReport) {
        self.by_pod.insert(pod, report);
    }

    /// Every report, by (namespace, pod).
    pub fn iter(&self) -> impl Iterator<Item = (&(String, String), &ClientReport)> {
        self.by_pod.iter()
    }

    /// Forgets the pods of `ns` that are not in `pods` (gone).
    pub fn retain(&mut self, ns: &str, pods: &[String]) {
        self.by_pod
            .retain(|(n, p), _| n != ns || pods.iter().any(|x| x == p));
    }
}

/// The caches observe reads.
#[derive(Clone, Debug)]
pub struct Stores {
    /// Every ConnectionPolicy, those this operator cannot read included (left out of planning).
    pub policies: Store<DeserializeGuard<ConnectionPolicy>>,
    /// Pods (possibly narrowed by a label selector).
    pub pods: Store<Pod>,
    /// EndpointSlices: of the watched scope, then of each backend namespace outside it
    /// (`--backend-namespaces` with `--namespace`).
    pub slices: Vec<Store<EndpointSlice>>,
    /// The ConfigMaps the operator wrote.
    pub configmaps: Store<ConfigMap>,
    /// The digests of the policies, pods and EndpointSlices, kept by the same watches
    /// ([`super::world`]).
    pub world: super::world::World,
}

/// Everything the reconciler needs, shared by every reconcile.
pub struct Context<G: Gateways> {
    /// Kubernetes client.
    pub client: Client,
    /// Settings.
    pub config: Config,
    /// Caches of the watched objects.
    pub stores: Stores,
    /// The latest Prometheus snapshot (written by the poller).
    pub snapshot: Arc<RwLock<Snapshot>>,
    /// The backends' saturation queries the poller runs (each reconcile sets its policy's).
    pub saturation: SaturationQueries,
    /// Autoscale memory per namespace.
    pub memory: Mutex<BTreeMap<String, Memory>>,
    /// Rollout memory.
    pub rollouts: Mutex<RolloutMemory>,
    /// Which pods each distinct selector selects, per namespace, while its pods stay the same
    /// ([`SelectionMemo`]).
    pub selections: Mutex<BTreeMap<String, SelectionMemo>>,
    /// The namespaces' plans, shared by their reconciles ([`super::pass`]).
    pub passes: super::pass::Passes,
    /// Each policy's samples as read from the latest Prometheus snapshot, per namespace
    /// ([`super::samples`]).
    pub samples: Mutex<BTreeMap<String, super::samples::SamplesMemo>>,
    /// The gateways' latest reports of their busiest clients (step 1b, `clients.rs`).
    pub client_reports: Mutex<ClientReports>,
    /// When each policy's status was last written, for the refresh of its observations.
    pub status_refresh: super::refresh::StatusRefresh,
    /// What waits to be reconciled (changes, then each policy's next periodic reconcile),
    /// handed to the Controller as slots free up ([`super::queue`]).
    pub queue: Arc<super::queue::ReconcileQueue>,
    /// Failures in a row per policy, for the retry back-off of [`error_policy`].
    pub retries: backoff::RetryBackoff,
    /// The gateway admin client.
    pub gateways: G,
    /// Publishes Events.
    pub recorder: Recorder,
    /// The operator's metrics.
    pub metrics: Metrics,
    /// The wall clock (a fixed one in tests).
    pub clock: fn() -> Timestamp,
}

impl<G: Gateways> std::fmt::Debug for Context<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
