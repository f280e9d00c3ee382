//! What one planning run is given: the namespace's policies and gateway pods, the latest
//! Prometheus samples, the documents already published. Plain data, no decisions: every other
//! planning module reads these types, and this one reads none of them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use poolpilot_api::limits::Endpoint;
use poolpilot_api::{ConnectionPolicySpec, ConnectionPolicyStatus};

use super::time::Timestamp;

/// `namespace/name` of a policy.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyKey {
    /// The policy's namespace.
    pub namespace: String,
    /// The policy's name.
    pub name: String,
}

impl std::fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One policy as the planner needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyInput {
    /// Which policy.
    pub key: PolicyKey,
    /// `metadata.generation`.
    pub generation: i64,
    /// `metadata.creationTimestamp`; the older policy wins a conflict.
    pub created: Timestamp,
    /// The spec as stored.
    pub spec: ConnectionPolicySpec,
    /// The status as stored (conditions keep their transition times; targets survive restarts).
    pub status: Option<ConnectionPolicyStatus>,
    /// Resolved endpoints per backend name (from EndpointSlices or the static addresses).
    pub endpoints: BTreeMap<String, Vec<Endpoint>>,
}

impl PolicyInput {
    /// The gateway selector.
    pub fn selector(&self) -> &LabelSelector {
        &self.spec.gateway_selector
    }
}

/// One gateway pod in the policies' namespace.
#[derive(Clone, Debug, Default)]
pub struct GatewayPod {
    /// The pod's name.
    pub name: String,
    /// Its labels (matched against the policies' gateway selectors).
    pub labels: BTreeMap<String, String>,
    /// Its IP, once it has one.
    pub ip: Option<IpAddr>,
    /// Whether it is ready (Ready condition True, not terminating): it counts in `RolledOut`.
    pub ready: bool,
    /// Whether it is terminating (deletion requested): it drains and gets no new document, but
    /// holds its share until it is gone.
    pub terminating: bool,
    /// Whether its containers stopped for good (phase Succeeded or Failed): it holds nothing.
    pub stopped: bool,
    /// The limits the pod acknowledged last (from a PUT answer), if known.
    pub acked: Option<Acked>,
}

/// What a gateway pod said it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acked {
    /// Content revision.
    pub revision: String,
    /// Document generation.
    pub generation: u64,
}

/// The latest Prometheus samples for one backend (fleet sums over the pods a policy selects).
/// `None` is missing data: a query error, an empty result, NaN or a stale sample. Never zero.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BackendSample {
    /// Leased connections (calls in flight to the backend), averaged over the window.
    pub leased: Option<f64>,
    /// Pending lease requests, averaged over the window.
    pub pending: Option<f64>,
    /// Leased connections at the latest scrape (a crowd that began within the window shows
    /// here in full).
    pub leased_now: Option<f64>,
    /// Pending lease requests at the latest scrape.
    pub pending_now: Option<f64>,
    /// Upstream calls completed per second without a 5xx, over the window.
    pub completed: Option<f64>,
    /// Response body bytes received from the backend per second, over the window.
    pub bytes: Option<f64>,
    /// Seconds of the calls completed without a 5xx, per second over the window (the sum of
    /// their durations): their mean duration is `busy ÷ completed`.
    pub busy: Option<f64>,
    /// Median time from sending a request to the first byte of its response body, seconds.
    pub ttfb: Option<f64>,
    /// The smallest `SETTINGS_MAX_CONCURRENT_STREAMS` the backend's HTTP/2 servers sent, over
    /// the pods' connections at the latest scrape (`poolpilot_upstream_h2_max_concurrent_streams`);
    /// `None` without one.
    pub h2_max_streams: Option<f64>,
    /// `protocol: Auto`: the addresses the pods call over HTTP/1.1 for the fallback cooldown,
    /// summed over the pods at the latest scrape (`poolpilot_upstream_h2_fallback`); `None`:
    /// none.
    pub h2_fallback: Option<f64>,
    /// The 5th percentile of the idle times, in seconds, at which the pods found connections
    /// closed by the backend over the window (`poolpilot_pool_peer_closed_idle_seconds`);
    /// `None`: none found.
    pub peer_idle_close: Option<f64>,
    /// The provider's refusals with a time to come back (`Retry-After`) that cooled the backend
    /// down, summed over the pods over the findings window (`poolpilot_upstream_cooldowns_total`).
    pub provider_refusals: Option<f64>,
    /// Calls the gateways refused meanwhile (`poolpilot_upstream_cooldown_refused_total`).
    pub cooldown_refused: Option<f64>,
    /// Calls sent meanwhile to a fallback backend (`poolpilot_upstream_fallbacks_total`).
    pub fallbacks: Option<f64>,
    /// Calls whose TLS handshake failed verification of the backend's certificate
    /// (`poolpilot_upstream_tls_failures_total{reason="certificate"}`).
    pub tls_verification_failures: Option<f64>,
    /// The window those four are counted over (ten windows: findings are rare).
    pub findings_window: std::time::Duration,
    /// The window the averages and rates are taken over.
    pub window: std::time::Duration,
    /// The backend's own saturation signal, when it has a saturation query.
    pub saturation: SaturationSignal,
    /// Ready selected pods without fresh samples (no `process_max_fds` within two scrape
    /// intervals). While any is, the demand and throughput sums are missing: the fleet's demand
    /// is not the sum over the pods that happen to be scraped.
    pub unscraped: u32,
    /// What the selected pods run now: the sum of their pools' caps for the backend
    /// (`poolpilot_pool_max_connections`), for `autoscale.startFrom: Current`.
    pub current: Option<f64>,
    /// The demand per priority class, interactive first (reported, not planned on).
    pub classes: [ClassSample; 2],
    /// Model tokens a second the pods counted for the backend (`poolpilot_tokens_total`),
    /// reported, not planned on. `None`: no selected pod exported the series, or a ready one
    /// is unscraped.
    pub tokens: Option<TokenRates>,
}

/// A backend's model tokens a second over the window, summed over the pods a policy selects.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenRates {
    /// Input (prompt) tokens a second, cached ones included.
    pub input: f64,
    /// Output (completion) tokens a second.
    pub output: f64,
}

/// Demand of one priority class on one backend: leased connections plus pending lease
/// requests, fleet sums averaged over the window. `None` is missing data, never zero.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ClassSample {
    /// Connections held by the class's calls.
    pub leased: Option<f64>,
    /// The class's lease requests waiting.
    pub pending: Option<f64>,
}

impl ClassSample {
    /// leased + pending, when both are known.
    pub fn demand(&self) -> Option<f64> {
        self.leased.zip(self.pending).map(|(l, p)| l + p)
    }
}

/// A backend's own saturation signal (`spec.backends[].saturation.query`) in a sample.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum SaturationSignal {
    /// No value: no query is configured, or the poller has not picked it up yet.
    #[default]
    NotConfigured,
    /// The query is configured but has not run since (a new or edited query).
    Pending,
    /// The query failed, returned nothing, or NaN.
    Missing,
    /// Its value (the largest, when it returned several series).
    Value(f64),
}

/// The latest file-descriptor samples of one pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodSample {
    /// `process_max_fds`.
    pub max_fds: Option<u64>,
    /// `process_open_fds`.
    pub open_fds: Option<u64>,
}

/// One pod's pool for one backend, summed over the backend's endpoints: what the division of
/// the target reads. Present only for a pod with fresh samples.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PodPool {
    /// Leased connections, averaged over the window.
    pub leased: f64,
    /// Pending lease requests, averaged over the window.
    pub pending: f64,
    /// Leased connections at the latest scrape.
    pub leased_now: f64,
}

impl PodPool {
    /// Demand per endpoint: leased + pending over the window, divided by `endpoints`.
    pub fn demand(&self, endpoints: u32) -> f64 {
        (self.leased + self.pending) / f64::from(endpoints.max(1))
    }

    /// Connections per endpoint leased now, rounded up.
    pub fn in_flight(&self, endpoints: u32) -> u32 {
        let per = self.leased_now / f64::from(endpoints.max(1));
        if per.is_finite() && per > 0.0 {
            per.ceil().min(f64::from(u32::MAX)) as u32
        } else {
            0
        }
    }
}

/// One client as a gateway pod reports it (`GET /v1/clients`): among its busiest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClientUse {
    /// Hex SHA-256 of its key.
    pub key_sha256: String,
    /// Its calls in flight now.
    pub in_flight: u32,
    /// Its calls waiting now.
    pub queued: u32,
    /// In flight + queued, averaged over the last 10 s.
    pub demand: f64,
    /// Input (prompt) tokens a second of its calls that ended in the last 10 s.
    pub input_tokens: f64,
    /// Output (completion) tokens a second of the same.
    pub output_tokens: f64,
}

/// Everything Prometheus told us at one instant.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    /// Per policy and backend name.
    pub backends: BTreeMap<(PolicyKey, String), BackendSample>,
    /// Per policy, backend name and pod: each selected pod's own pool, for the division.
    pub pools: BTreeMap<(PolicyKey, String, String), PodPool>,
    /// Per pod name.
    pub pods: BTreeMap<String, PodSample>,
    /// Per policy and scraped pod: the tokens a minute charged to each of its clients' budgets
    /// there, by client label (an override's name, or `other`), for the division of fleet-wide
    /// token budgets. A pod absent: no fresh sample.
    pub token_use: BTreeMap<(PolicyKey, String), BTreeMap<String, f64>>,
}

/// The whole input of one planning run for one namespace.
#[derive(Clone, Debug, Default)]
pub struct FleetInput {
    /// Every policy in the namespace.
    pub policies: Vec<PolicyInput>,
    /// Every gateway pod in the namespace (selected by at least one policy or not).
    pub pods: Vec<GatewayPod>,
    /// The latest samples (shared by the runs of one metrics round).
    pub samples: std::sync::Arc<Samples>,
    /// Documents already published (the policies' ConfigMaps): generations never go back.
    pub published: Vec<Acked>,
    /// Every rendered document's generation must be above this (a pod said it runs it).
    pub generation_floor: u64,
    /// How long a backend's first samples may take to reach the planner once it is planned (its
    /// pods take its document, are scraped, and the scrape is queried): the age past which a
    /// sample counts as missing. A new backend's misses within it do not make its metrics
    /// unavailable.
    pub samples_horizon: std::time::Duration,
    /// The busiest clients each pod reported for each policy (`None` for a pod: no fresh report).
    pub clients: BTreeMap<(PolicyKey, String), Vec<ClientUse>>,
    /// The policies being reconciled: only their backends' divisions are judged again when no
    /// decision ran (the others keep theirs while they fit). `None`: every policy. Decisions
    /// do not depend on it: every backend whose interval is due decides, whichever reconcile
    /// plans, so that one run serves every reconcile until the next decision is due.
    pub focus: Option<BTreeSet<PolicyKey>>,
}
