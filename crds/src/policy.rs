//! The `ConnectionPolicy` custom resource (`poolpilot.io/v1alpha1`): what a user declares about a
//! group of model backends (capacity, pool, timeouts, client limits, autoscale bounds, rollout) and
//! the status the operator reports back. Every field's doc comment becomes `kubectl explain` text;
//! cross-field rules are CEL `x-kubernetes-validations`, so `kubectl apply` refuses a bad policy.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Duration;

pub mod conditions;
pub mod reference;
pub mod upstream;

pub use reference::reference_markdown;

/// The largest number of backends one policy may declare (keeps CEL cost estimates bounded).
pub const MAX_BACKENDS: usize = 32;

/// Connection-pool, throttling and autoscaling policy for a group of model backends, enforced by
/// the gateway pods that `gatewaySelector` selects. The operator divides each backend's declared
/// capacity across those pods, tunes the pool targets from Prometheus, and rolls the resulting
/// limits out to every pod.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "poolpilot.io",
    version = "v1alpha1",
    kind = "ConnectionPolicy",
    plural = "connectionpolicies",
    singular = "connectionpolicy",
    shortname = "cpol",
    category = "poolpilot",
    namespaced,
    status = "ConnectionPolicyStatus",
    derive = "PartialEq",
    doc = "Connection-pool, throttling and autoscaling policy for a group of model backends, \
           enforced by the gateway pods it selects.",
    printcolumn = r#"{"name":"Targets","type":"string","jsonPath":".status.targets","description":"Fleet-wide connection target per endpoint of each backend"}"#,
    printcolumn = r#"{"name":"Updated","type":"string","jsonPath":".status.updated","description":"Pods running their current limits / selected pods not terminating"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status","description":"Status of the Ready condition: accepted and rolled out to every selected pod"}"#,
    printcolumn = r#"{"name":"Saturated","type":"string","jsonPath":".status.conditions[?(@.type==\"Saturated\")].status","description":"Status of the Saturated condition: some backend wants more connections than it can safely get"}"#,
    printcolumn = r#"{"name":"Accepted","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Accepted\")].reason","description":"Reason of the Accepted condition (Accepted, Invalid, Conflicted)"}"#,
    printcolumn = r#"{"name":"Metrics","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"MetricsAvailable\")].reason","description":"Reason of the MetricsAvailable condition (SamplesFresh, SamplesMissing, ...)"}"#,
    printcolumn = r#"{"name":"FdBudget","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"FdBudget\")].reason","description":"Reason of the FdBudget condition (WithinBudget, OverBudget, FdLimitUnknown)"}"#,
    printcolumn = r#"{"name":"Rollout","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"RolledOut\")].reason","description":"Reason of the RolledOut condition (RolledOut, Progressing, Halted, NoReadyPods)"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp","description":"Time since the policy was created"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.backends.all(b, double(self.autoscale.min) <= double(b.capacity.maxConnectionsPerEndpoint) * (1.0 - b.capacity.headroom))",
        "message": "autoscale.min must not exceed capacity.maxConnectionsPerEndpoint × (1 − capacity.headroom) of any backend",
        "fieldPath": ".autoscale.min"
    },
    {
        "rule": "!has(self.autoscale.max) || self.backends.all(b, double(self.autoscale.max) <= double(b.capacity.maxConnectionsPerEndpoint) * (1.0 - b.capacity.headroom))",
        "message": "autoscale.max must not exceed capacity.maxConnectionsPerEndpoint × (1 − capacity.headroom) of any backend",
        "fieldPath": ".autoscale.max"
    },
    {
        "rule": "self.backends.all(b, !has(b.fallback) || b.fallback.all(f, f != b.name && self.backends.exists(o, o.name == f)))",
        "message": "backends[].fallback names other backends of this policy",
        "fieldPath": ".backends"
    },
    {
        "rule": "!has(self.clients) || !has(self.clients.priority) || !has(self.clients.priority.agingAfter) || self.backends.all(b, !has(b.pool) || !has(b.pool.leaseTimeout) || duration(self.clients.priority.agingAfter) < duration(b.pool.leaseTimeout))",
        "message": "clients.priority.agingAfter must be shorter than every backend's pool.leaseTimeout, or batch calls time out in the pool queue before they age",
        "fieldPath": ".clients.priority.agingAfter"
    }
]))]
pub struct ConnectionPolicySpec {
    /// Which gateway pods (in this namespace) enforce this policy. An empty selector selects every
    /// pod in the namespace, which is rarely what you want.
    pub gateway_selector: LabelSelector,
    /// The model backends, matched against requests in this order: the first backend whose
    /// `match` fits a request gets it. Names must be unique across every policy that selects the
    /// same pods; on a clash the older policy wins. A list map keyed by `name`: the API server
    /// refuses a duplicate name, and server-side apply merges backends by name.
    #[schemars(
        length(min = 1, max = 32),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub backends: Vec<BackendSpec>,
    /// Per-client concurrency limits for calls to these backends, enforced by each gateway pod:
    /// a call over its client's limit waits in that client's queue, or is refused with 429 and
    /// Retry-After. Omitted: clients are not limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clients: Option<ClientsSpec>,
    /// Limits on the client (downstream) connections of each selected gateway pod.
    #[serde(default)]
    pub listener: ListenerSpec,
    /// Bounds and pace of the operator's tuning of the per-endpoint connection targets.
    #[serde(default)]
    pub autoscale: AutoscaleSpec,
    /// File-descriptor budget of each selected gateway pod: the operator keeps the pools, client
    /// connections and this reserve within half the pod's fd limit, scaling the pool shares down
    /// when they do not fit (condition `FdBudget`).
    #[serde(default)]
    pub file_descriptors: FileDescriptorsSpec,
    /// How new limits reach the selected pods: canary pods first, or every pod at once.
    #[serde(default)]
    pub rollout: RolloutSpec,
    /// `Enforce` (the default): the operator rolls its limits out. `Recommend` (shadow mode):
    /// it observes, validates, plans, checks the fd budget and computes each pod's share exactly
    /// as it would enforce them, and publishes them (status, `WouldScaleUp`/`WouldScaleDown`
    /// Events, metrics, and the rendered document in the ConfigMap `<name>-recommended`), but
    /// sends nothing to the pods and leaves the limits ConfigMap alone. Switching to `Enforce`
    /// rolls the current recommendation out.
    #[serde(default, skip_serializing_if = "Mode::is_enforce")]
    pub mode: Mode,
}

/// Whether the operator acts on its decisions or only publishes them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Mode {
    /// Roll the limits out.
    #[default]
    Enforce,
    /// Publish the limits it would roll out; change nothing on the pods.
    Recommend,
}

impl Mode {
    /// Whether this is `Enforce`.
    pub fn is_enforce(&self) -> bool {
        *self == Self::Enforce
    }
}

/// Where a backend's target starts when the policy has no status yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum StartFrom {
    /// The upper bound (`max`, or capacity × (1 − headroom)): what a static configuration
    /// runs, no slow cold start.
    #[default]
    Max,
    /// The lower bound, `min`.
    Min,
    /// What the selected pods run now: the sum of their pools' caps for the backend
    /// (`poolpilot_pool_max_connections`), within the bounds; the upper bound while that is not
    /// known (no pod runs the backend yet, or no fresh sample).
    Current,
}

/// One group of interchangeable model-server instances.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.credentials) || !has(self.endpoints.external) || self.endpoints.external.all(e, has(e.tls))",
        "message": "credentials go to external endpoints over TLS only: set tls on every endpoints.external",
        "fieldPath": ".credentials"
    },
    {
        "rule": "!has(self.protocol) || self.protocol != 'Auto' || (has(self.endpoints.external) && self.endpoints.external.all(e, has(e.tls)))",
        "message": "protocol Auto negotiates by ALPN, over TLS only: set tls on every endpoints.external, or say Http1 or Http2 (h2c) for plain endpoints",
        "fieldPath": ".protocol"
    }
]))]
pub struct BackendSpec {
    /// The backend's name: unique within the policy and among the backends of every policy that
    /// selects the same gateway pods; the `backend` label of every gateway metric about it.
    #[schemars(
        length(min = 1, max = 63),
        pattern(r"^[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")
    )]
    pub name: String,
    /// Which requests go to this backend. Every condition given must hold; an empty match takes
    /// every request that reaches it.
    #[serde(default, rename = "match")]
    pub route: RouteMatchSpec,
    /// The instances: a Service whose EndpointSlices the operator resolves, static addresses, or
    /// external DNS names the gateways resolve.
    /// Set exactly one of `service`, `addresses` and `external`.
    pub endpoints: EndpointsSpec,
    /// What one backend instance can take, declared once for the whole gateway fleet: the
    /// operator divides it across the selected gateway pods that exist (Pending, not Ready and
    /// terminating ones included, so that a fleet being resized never holds more).
    pub capacity: CapacitySpec,
    /// The connection pool each gateway pod keeps to each endpoint. Its size is not set here: it
    /// is the operator's per-pod share of the fleet target (`status.backends[].perPod`);
    /// everything else is taken as written.
    #[serde(default)]
    pub pool: PoolSpec,
    /// Hard limits on one proxied call; when one fires the gateway closes the upstream connection.
    #[serde(default)]
    pub timeouts: TimeoutsSpec,
    /// Active health checking of each endpoint: an unhealthy endpoint gets no new calls until
    /// it passes again. Omitted: endpoints are presumed healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheckSpec>,
    /// Passive ejection of endpoints that fail calls in a row: an ejected endpoint gets no calls
    /// for a while. Omitted: endpoints are never ejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlier_detection: Option<OutlierDetectionSpec>,
    /// The backend's own saturation signal, for model servers that export one (vLLM's
    /// `vllm:num_requests_waiting`, say): while it is at or above its threshold, the operator
    /// holds growth of this backend's target. Omitted: saturation is judged from the gateways'
    /// metrics alone (docs/autoscaling.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saturation: Option<SaturationSpec>,
    /// The provider's key, from a Secret the gateway pods mount, set on every call in place of
    /// the client's `Authorization` (hosted providers: OpenAI, Azure OpenAI). Omitted: the
    /// client's headers go through as they came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<upstream::CredentialsSpec>,
    /// The HTTP version of the calls: `Http1` (the default), `Http2` (many calls share one
    /// connection: the pool's share and `capacity` count concurrent streams, the file
    /// descriptors count connections) or `Auto` (what the server picks by ALPN, TLS endpoints
    /// only).
    #[serde(default, skip_serializing_if = "upstream::ProtocolSpec::is_default")]
    pub protocol: upstream::ProtocolSpec,
    /// Backends of this policy that take this backend's calls, in this order, while it cools
    /// down (its provider refused with `429` or `503` and `Retry-After`; only a backend with
    /// `credentials` cools down): the first of them not cooling down gets the call, with its own
    /// credentials, pool and timeouts. Have them serve the same model. When every one cools
    /// down too, the client gets `429` with the shortest wait left. Omitted: calls to a cooling
    /// backend are refused with what is left of its wait.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 4),
        inner(length(min = 1, max = 63)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub fallback: Vec<String>,
    /// The most output tokens the backend's model server produces for a call that sets neither
    /// `max_completion_tokens` nor `max_tokens` (its own default: vLLM's is what is left of the
    /// model's context, or its `--generation-config` `max_new_tokens`). A call without them to
    /// this backend is estimated with it, in place of the client's `tokens.defaultMaxTokens`.
    /// Omitted: `tokens.defaultMaxTokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10_000_000))]
    pub default_max_tokens: Option<u64>,
}

/// A backend's own saturation signal, read from Prometheus.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SaturationSpec {
    /// PromQL evaluating to one number for the whole backend, run with the operator's other
    /// queries every round (for example `sum(avg_over_time(vllm:num_requests_waiting{namespace="models"}[30s]))`).
    /// When it returns several series the largest counts; an empty or failed answer is missing
    /// data, and missing data holds growth.
    #[schemars(length(min = 1, max = 2048))]
    pub query: String,
    /// At or above this value the backend counts as saturated and growth is held.
    #[schemars(range(min = 0.0, max = 1e12))]
    pub threshold: f64,
}

/// Request matching. A request matches when every condition given here holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteMatchSpec {
    /// The request path starts with this (for example `/v1/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256), pattern(r"^/"))]
    pub path_prefix: Option<String>,
    /// Each of these headers is present with exactly this value (names are case-insensitive).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16))]
    pub headers: BTreeMap<String, String>,
    /// The JSON request body's top-level `model` field equals this (OpenAI-style APIs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub model: Option<String>,
}

/// Where a backend's instances are: exactly one of `service`, `addresses` and `external`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "(has(self.service) ? 1 : 0) + (has(self.addresses) ? 1 : 0) + (has(self.external) ? 1 : 0) == 1", "message": "set exactly one of endpoints.service, endpoints.addresses and endpoints.external"},
    {
        "rule": EXTERNAL_NAMES_LEAVE_THE_CLUSTER,
        "message": "endpoints.external must name hosts outside the cluster and the pod: localhost, *.localhost, *.svc, *.cluster.local and *.internal need endpoints.allowPrivateAddresses",
        "fieldPath": ".external"
    },
    {
        "rule": "!has(self.external) || self.external.all(e, e.port != 443 || has(e.tls))",
        "message": "endpoints.external on port 443 must set tls (plain HTTP to an HTTPS port would carry keys in clear text)",
        "fieldPath": ".external"
    },
    {
        "rule": ADDRESSES_ARE_IP_PORT,
        "message": "endpoints.addresses must be ip:port (IPv6 as [addr]:port)",
        "fieldPath": ".addresses"
    },
    {
        "rule": ADDRESSES_LEAVE_THE_POD,
        "message": "endpoints.addresses must be unicast addresses outside the pod and the node: loopback, link-local, metadata, multicast and broadcast addresses need endpoints.allowPrivateAddresses",
        "fieldPath": ".addresses"
    }
]))]
pub struct EndpointsSpec {
    /// A Service in the policy's namespace; its ready endpoints (from EndpointSlices) are pooled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceRef>,
    /// Fixed instance addresses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub addresses: Option<Vec<StaticEndpoint>>,
    /// DNS names (a hosted provider's API, a model server behind a name): each gateway resolves
    /// them in the background, respecting TTLs, and pools every address of the answer, all of a
    /// name's addresses together under its share of `capacity.maxConnectionsPerEndpoint` (a
    /// provider limits an account, not an IP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub external: Option<Vec<ExternalEndpoint>>,
    /// Let `addresses` name loopback, unspecified, link-local, cloud-metadata, multicast and
    /// broadcast addresses (the list: docs/deploying.md). Refused by default: from a gateway
    /// pod they reach the pod itself (its admin port, through the proxy port) or the node's
    /// metadata service, not a model backend. Private ranges (10/8, 172.16/12, 192.168/16,
    /// fc00::/7) need no permission.
    #[serde(default)]
    pub allow_private_addresses: bool,
}

/// The host of a static address in CEL: between the brackets of `[v6]:port`, before the last
/// `:` of `v4:port`; empty when there is none.
macro_rules! cel_host {
    () => {
        "(a.address.startsWith('[') ? (a.address.indexOf(']') > 0 ? a.address.substring(1, a.address.indexOf(']')) : '') : (a.address.lastIndexOf(':') > 0 ? a.address.substring(0, a.address.lastIndexOf(':')) : ''))"
    };
}

/// CEL: every static address is an IP (Kubernetes' `isIP`: no IPv4-mapped IPv6, no zone) and a
/// port.
const ADDRESSES_ARE_IP_PORT: &str = concat!(
    "!has(self.addresses) || self.addresses.all(a, isIP(",
    cel_host!(),
    ") && a.address.substring(a.address.lastIndexOf(':') + 1).matches('^[0-9]{1,5}$'))"
);

/// CEL: unless `allowPrivateAddresses`, every static address is global unicast (not loopback,
/// unspecified, link-local, multicast or broadcast) and no cloud metadata service.
const ADDRESSES_LEAVE_THE_POD: &str = concat!(
    "!has(self.addresses) || (has(self.allowPrivateAddresses) && self.allowPrivateAddresses) || self.addresses.all(a, isIP(",
    cel_host!(),
    ") && ip(",
    cel_host!(),
    ").isGlobalUnicast() && !(string(ip(",
    cel_host!(),
    ")) in ['100.100.100.200', 'fd00:ec2::254']))"
);

/// CEL: unless `allowPrivateAddresses`, no external name is one that resolves inside the pod or
/// the cluster by convention.
const EXTERNAL_NAMES_LEAVE_THE_CLUSTER: &str = "!has(self.external) || (has(self.allowPrivateAddresses) && self.allowPrivateAddresses) || self.external.all(e, !(e.host == 'localhost' || e.host.endsWith('.localhost') || e.host.endsWith('.svc') || e.host.endsWith('.cluster.local') || e.host.endsWith('.internal')))";

/// A backend named by DNS.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalEndpoint {
    /// Stable name (the `endpoint` metric label, with `/<ip>` of each address); defaults to
    /// `host:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub name: Option<String>,
    /// The DNS name, lowercase (letters, digits, `-` and `.`).
    #[schemars(
        length(min = 1, max = 253),
        pattern(r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\.)*[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
    )]
    pub host: String,
    /// The port.
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// TLS to it (verified against the system's roots or `caBundleSecret`, for `serverName` or
    /// the host; there is no way to skip verification); omitted: plain HTTP/1.1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<upstream::ExternalTls>,
}

/// A Service whose endpoints are the backend's instances.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceRef {
    /// Name of the Service.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Namespace of the Service; omitted: the policy's. Another namespace must be one the
    /// operator may read backends from (its `--backend-namespaces`, the chart's
    /// `operator.backendNamespaces`), else the policy is not accepted (reason
    /// `NamespaceNotAllowed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), pattern(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub namespace: Option<String>,
    /// The port the backend instances listen on, as listed in the Service's EndpointSlices (the
    /// Service's `targetPort` as a number).
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
}

/// One fixed backend instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StaticEndpoint {
    /// Stable name (the `endpoint` metric label); defaults to the address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub name: Option<String>,
    /// `ip:port` of the instance (IPv6 as `[addr]:port`).
    #[schemars(length(min = 3, max = 64))]
    pub address: String,
}

/// A backend instance's capacity, declared once for the whole gateway fleet.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "double(self.maxConnectionsPerEndpoint) * (1.0 - self.headroom) >= 1.0",
        "message": "capacity leaves less than one connection per endpoint after headroom"
    }
]))]
pub struct CapacitySpec {
    /// Concurrent connections ONE backend instance can take, summed over ALL gateway pods. The
    /// operator divides it across the selected pods; it never multiplies with replicas.
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_connections_per_endpoint: u32,
    /// Share of that capacity kept in reserve, never pooled (0.2 keeps 20% free).
    #[serde(default = "CapacitySpec::default_headroom")]
    #[schemars(range(min = 0.0, max = 0.9))]
    pub headroom: f64,
}

/// One gateway pod's connection pool to one endpoint. The pool size itself is the operator's
/// per-pod share of the fleet target; everything else is taken as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "duration(self.validateAfterIdle) <= duration(self.idleTimeout)",
        "message": "pool.validateAfterIdle must not exceed pool.idleTimeout",
        "messageExpression": "'pool.validateAfterIdle must not exceed pool.idleTimeout: ' + self.validateAfterIdle + ' > ' + self.idleTimeout"
    }
]))]
pub struct PoolSpec {
    /// Lease requests that may wait for a connection, per pod and backend; beyond them the gateway
    /// answers 503 with a Retry-After.
    #[schemars(range(max = 1_000_000))]
    pub max_pending: u32,
    /// Longest wait for a pooled connection before failing fast with 503 and Retry-After (what
    /// HTTP client libraries call the connection request or lease timeout). Keep it well under
    /// the callers' own deadline.
    #[schemars(schema_with = "positive_duration")]
    pub lease_timeout: Duration,
    /// Close a pooled connection that sat idle this long.
    #[schemars(schema_with = "positive_duration")]
    pub idle_timeout: Duration,
    /// Close a connection this old when it is next returned to the pool.
    #[schemars(schema_with = "positive_duration")]
    pub max_lifetime: Duration,
    /// Give up connecting to an endpoint after this long.
    #[schemars(schema_with = "positive_duration")]
    pub connect_timeout: Duration,
    /// Check that a connection idle longer than this is still open before reusing it (a closed
    /// one is dropped and another taken). At most `idleTimeout`.
    #[schemars(schema_with = "positive_duration")]
    pub validate_after_idle: Duration,
    /// Delay lease requests a little while others wait: `min(max, pending × perPending)` before
    /// each one joins the queue. Omitted: no delay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft_throttle: Option<SoftThrottleSpec>,
}

/// The soft throttle of a pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "duration(self.perPending) <= duration(self.max)", "message": "pool.softThrottle.perPending must not exceed pool.softThrottle.max"},
    {"rule": "duration(self.max) <= duration('1s')", "message": "pool.softThrottle.max must be at most 1s: it delays every call while requests wait"}
]))]
pub struct SoftThrottleSpec {
    /// Delay per lease request already waiting (2ms in the report it comes from).
    #[schemars(schema_with = "positive_duration")]
    pub per_pending: Duration,
    /// Longest delay (10ms in that report).
    #[schemars(schema_with = "positive_duration")]
    pub max: Duration,
}

/// Hard limits on one proxied call; the gateway closes the upstream connection when one fires.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "duration(self.firstByte) <= duration(self.total)",
        "message": "timeouts.firstByte must not exceed timeouts.total",
        "messageExpression": "'timeouts.firstByte must not exceed timeouts.total: ' + self.firstByte + ' > ' + self.total"
    },
    {
        "rule": "duration(self.streamIdle) <= duration(self.total)",
        "message": "timeouts.streamIdle must not exceed timeouts.total",
        "messageExpression": "'timeouts.streamIdle must not exceed timeouts.total: ' + self.streamIdle + ' > ' + self.total"
    }
]))]
pub struct TimeoutsSpec {
    /// Longest time from sending the request to receiving the response head; the client gets
    /// 504 when it fires.
    #[schemars(schema_with = "positive_duration")]
    pub first_byte: Duration,
    /// Longest time for the whole call, streamed response body included. At least `firstByte`
    /// and `streamIdle`.
    #[schemars(schema_with = "positive_duration")]
    pub total: Duration,
    /// Longest silence between two chunks of a streamed (SSE) response body.
    #[schemars(schema_with = "positive_duration")]
    pub stream_idle: Duration,
}

/// Active HTTP health checking. A probe's connection takes a slot of the endpoint's pool cap,
/// so probes never take an endpoint over its share; when every slot is in use the endpoint is
/// not probed that round (its calls report to outlier detection).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "duration(self.timeout) <= duration(self.interval)",
        "message": "healthCheck.timeout must not exceed healthCheck.interval",
        "messageExpression": "'healthCheck.timeout must not exceed healthCheck.interval: ' + self.timeout + ' > ' + self.interval"
    }
]))]
pub struct HealthCheckSpec {
    /// Path probed with GET; any 2xx answer is healthy.
    #[schemars(length(min = 1, max = 256), pattern(r"^/"))]
    pub path: String,
    /// Time between two probes of one endpoint.
    #[schemars(schema_with = "positive_duration")]
    pub interval: Duration,
    /// Timeout of one probe; a probe that times out fails. At most `interval`.
    #[serde(default = "HealthCheckSpec::default_timeout")]
    #[schemars(schema_with = "positive_duration")]
    pub timeout: Duration,
    /// Consecutive failed probes that mark an endpoint unhealthy.
    #[serde(default = "HealthCheckSpec::default_unhealthy")]
    #[schemars(range(min = 1, max = 100))]
    pub unhealthy_threshold: u32,
    /// Consecutive passed probes that mark it healthy again.
    #[serde(default = "HealthCheckSpec::default_healthy")]
    #[schemars(range(min = 1, max = 100))]
    pub healthy_threshold: u32,
}

/// Passive outlier ejection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutlierDetectionSpec {
    /// Consecutive failed calls (connect error, 5xx, timeout) that eject an endpoint.
    #[schemars(range(min = 1, max = 1000))]
    pub consecutive_failures: u32,
    /// First ejection length; each further ejection of the same endpoint lasts longer.
    #[schemars(schema_with = "positive_duration")]
    pub base_ejection: Duration,
    /// Never eject more than this percentage of a backend's endpoints.
    #[serde(default = "OutlierDetectionSpec::default_max_ejected")]
    #[schemars(range(max = 100))]
    pub max_ejected_percent: u32,
}

/// Per-client concurrency limits: one client must not hold the whole pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.slowCalls) || self.slowCalls.demotedConcurrency <= self.maxConcurrency",
        "message": "clients.slowCalls.demotedConcurrency must not exceed clients.maxConcurrency"
    },
    {
        "rule": "!has(self.priority) || !has(self.priority.agingAfter) || duration(self.priority.agingAfter) < duration(has(self.queueTimeout) ? self.queueTimeout : '2s')",
        "message": "clients.priority.agingAfter must be shorter than clients.queueTimeout, or batch calls time out in their queue before they age",
        "fieldPath": ".priority.agingAfter"
    }
]))]
pub struct ClientsSpec {
    /// How a request's client is identified: by a header or by source IP, exactly one of them.
    pub identity: ClientIdentitySpec,
    /// What `maxConcurrency`, `maxQueue`, the overrides' `maxConcurrency` and
    /// `slowCalls.demotedConcurrency` count. `Fleet` (the default): calls across every selected
    /// gateway pod; the operator divides each over the pods as it divides a backend's target
    /// (every selected pod not stopped; rounded down, the remainder one each to the first pods
    /// by name, at least 1 call in flight per pod; 0 queued is allowed) and divides again as
    /// pods come and go. `PerPod`:
    /// on each gateway pod, so a client may run the limit times the number of pods.
    #[serde(default, skip_serializing_if = "ClientScope::is_fleet")]
    pub scope: ClientScope,
    /// Calls one client may have in flight (across the fleet, or per pod: `scope`).
    #[schemars(range(min = 1, max = 100_000))]
    pub max_concurrency: u32,
    /// Calls one client may have waiting beyond `maxConcurrency` (across the fleet, or per pod:
    /// `scope`); more are refused with 429 and Retry-After. 0: no queue, refuse at once.
    #[serde(default)]
    #[schemars(range(max = 100_000))]
    pub max_queue: u32,
    /// Longest wait in that queue before 429 and Retry-After.
    #[serde(default = "ClientsSpec::default_queue_timeout")]
    #[schemars(schema_with = "positive_duration")]
    pub queue_timeout: Duration,
    /// Named clients with their own concurrency limit (an allowlist for batch callers).
    /// A list map keyed by `name`: the API server refuses a duplicate name.
    #[serde(default)]
    #[schemars(
        length(max = 64),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub overrides: Vec<ClientOverrideSpec>,
    /// Demotion of clients whose calls are often slow: such a client gets a lower concurrency
    /// limit for a while. Omitted: no demotion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_calls: Option<SlowCallsSpec>,
    /// Downstream connections one client source (an IPv4 address, an IPv6 /64) may hold open on
    /// one gateway pod; stops a client that never closes its connections from draining the pod
    /// of sockets. A connection over it is answered 429 with Retry-After and closed. When
    /// several policies select a pod, the largest value applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_connections_per_client: Option<u32>,
    /// Clients each gateway pod keeps state for at once (calls in flight or queued, a
    /// demotion, slow calls). When the table is full the longest-idle client is forgotten;
    /// when every entry has calls in flight, a new client gets 503 with Retry-After. Bounds the
    /// memory a client rotating its keys can take.
    #[serde(default = "ClientsSpec::default_max_clients")]
    #[schemars(range(min = 1, max = 10_000_000))]
    pub max_clients: u32,
    /// Priority classes: which calls are `Interactive` and which `Batch`, how long batch may
    /// be passed over before it ages, and how much of a backend batch may hold. Each gateway
    /// pod serves interactive calls before batch ones in every client's queue and in the
    /// connection pool queue of every backend of this policy. Omitted: every call is
    /// `Interactive` unless its override names a class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<PrioritySpec>,
    /// Each client's token budget: what its calls may cost in model tokens a minute (and a
    /// day), counted across the fleet or per pod as `scope` says. `Fleet`: an override's budget
    /// (its own `tokens`, else this one) is divided over the selected pods by where its tokens
    /// were used over the last interval (each pod's `poolpilot_client_tokens_total`), and
    /// re-divided every autoscale interval, so that a client pinned to one pod gets over 99% of
    /// its budget there (a pod without its calls keeps a hundredth of the even part); a client
    /// without an override that spends most of its even part on one pod (the pods report the
    /// clients that spend the most tokens) has this budget divided the same way, and every
    /// other client gets the even part on each pod. Each gateway pod admits a call only if its
    /// estimate fits (its
    /// `max_completion_tokens` or `max_tokens`, else `defaultMaxTokens`, plus its prompt's
    /// bytes ÷ 4), refuses it otherwise with 429 (OpenAI's `rate_limit_exceeded`, with
    /// `Retry-After`, `retry-after-ms` and the `x-ratelimit-*` headers) before it reaches a
    /// backend, and settles
    /// the reservation with the backend's `usage` once the response ends. An override's
    /// `tokens` replaces it for its client. Omitted: calls are not limited by tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenBudgetSpec>,
}

/// A token budget.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.perDay) || self.perDay >= self.perMinute",
        "message": "tokens.perDay must be at least tokens.perMinute",
        "fieldPath": ".perDay"
    },
    {
        "rule": "!has(self.count) || self.count != 'Weighted' || has(self.weights)",
        "message": "tokens.count Weighted needs tokens.weights",
        "fieldPath": ".weights"
    },
    {
        "rule": "!has(self.weights) || self.weights.input + self.weights.output > 0.0",
        "message": "tokens.weights must not both be 0",
        "fieldPath": ".weights"
    }
]))]
pub struct TokenBudgetSpec {
    /// Tokens a client may use a minute: a bucket of this size, refilled continuously over a
    /// minute. A call costing more than the whole bucket is admitted when the bucket is full.
    #[schemars(range(min = 1, max = 1_000_000_000_000_u64))]
    pub per_minute: u64,
    /// Tokens a client may use a day: a second bucket, refilled over a day. Omitted: no
    /// daily budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_440_000_000_000_000_u64))]
    pub per_day: Option<u64>,
    /// What a call costs: `Total` (prompt and completion tokens, the default), `Output`
    /// (completion tokens), or `Weighted` (`weights`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub count: TokenCountSpec,
    /// The weights of `count: Weighted`: what a prompt token and a completion token cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<TokenWeightsSpec>,
    /// The output tokens a call that sets neither `max_completion_tokens` nor `max_tokens` is
    /// assumed to reserve (a backend's own default is often the whole context), unless its
    /// backend declares its own (`backends[].defaultMaxTokens`).
    #[serde(default = "TokenBudgetSpec::default_max_tokens")]
    #[schemars(range(min = 1, max = 10_000_000))]
    pub default_max_tokens: u64,
    /// Calls a client may make a minute, a bucket of its own; the responses then carry
    /// OpenAI's `x-ratelimit-*-requests` headers too. Omitted: no request budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100_000_000))]
    pub requests_per_minute: Option<u32>,
}

impl TokenBudgetSpec {
    fn default_max_tokens() -> u64 {
        crate::limits::TokenBudget::DEFAULT_MAX_TOKENS
    }
}

/// What a token budget counts of a call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum TokenCountSpec {
    /// Prompt and completion tokens.
    #[default]
    Total,
    /// Completion tokens only.
    Output,
    /// `weights.input` per prompt token and `weights.output` per completion token.
    Weighted,
}

/// The weights of a weighted token count.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenWeightsSpec {
    /// What one prompt token costs.
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub input: f64,
    /// What one completion token costs.
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub output: f64,
}

/// A call's priority class. There are two; a third is not supported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PriorityClassSpec {
    /// Served before batch calls that wait with it.
    #[default]
    Interactive,
    /// Served after the interactive calls waiting with it, until it has waited `agingAfter`;
    /// held to `batchMaxPercent` of a backend's connections.
    Batch,
}

/// How calls get their priority class, and how batch calls are treated. A full pool queue
/// (`pool.maxPending`) takes an interactive call in place of its newest batch waiter, which is
/// answered 503 as on a full queue.
///
/// Who picks the class: an override's `class` pins its client's calls (the header is not
/// read); otherwise a call sending `header` with `batch` is batch (a call may always lower
/// itself); with `interactive` it is interactive only when `trustHeader` is set; any other
/// call gets `defaultClass`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.trustHeader) || !self.trustHeader || has(self.header)",
        "message": "clients.priority.trustHeader needs clients.priority.header",
        "fieldPath": ".trustHeader"
    }
]))]
pub struct PrioritySpec {
    /// The class of calls that neither an override nor the header classes.
    #[serde(default, skip_serializing_if = "is_default")]
    pub default_class: PriorityClassSpec,
    /// A request header whose value (`interactive` or `batch`, in any case; other values are
    /// ignored) names a call's class, for clients without an override class (for example
    /// `x-poolpilot-priority`). Omitted: no header is read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128), pattern(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"))]
    pub header: Option<String>,
    /// Take `interactive` from the header too, not only `batch`. Set it only when the header
    /// comes from something you trust (a proxy in front that sets or strips it): otherwise any
    /// client could raise itself to interactive. Needs `header`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub trust_header: bool,
    /// The starvation bound: a batch call that has waited this long in a queue is served as
    /// if it were an interactive call arriving then (it is passed over only by the interactive
    /// calls that arrived before that moment). Omitted: half of each queue's timeout
    /// (`pool.leaseTimeout` in a backend's pool queue, `clients.queueTimeout` in a client's
    /// queue). Keep it below those timeouts, or batch calls time out before they age.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "positive_duration")]
    pub aging_after: Option<Duration>,
    /// The most of a backend's connections in each gateway pod that batch calls may hold, in
    /// percent of the pod's pool cap over the backend's endpoints (rounded down, at least one
    /// connection). A batch call over it waits even when a connection is free; interactive
    /// calls may use every connection. Omitted: no cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub batch_max_percent: Option<u32>,
}

/// How a client is identified: exactly one of `header` and `sourceIP`. With `header:
/// authorization` the client is the bearer token of `Authorization: Bearer <token>` (what
/// OpenAI SDKs send), without its scheme.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.header) != has(self.sourceIP)", "message": "set exactly one of identity.header and identity.sourceIP"}
]))]
pub struct ClientIdentitySpec {
    /// A request header whose value identifies the client (an API key, say). Values are never
    /// logged or exported raw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128), pattern(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"))]
    pub header: Option<String>,
    /// Identify clients by their connection's source IP address. Write `sourceIP: {}`.
    #[serde(default, rename = "sourceIP", skip_serializing_if = "Option::is_none")]
    pub source_ip: Option<SourceIp>,
}

/// Marker: clients are identified by source IP. Takes no fields.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SourceIp {}

/// A named client with its own concurrency limit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClientOverrideSpec {
    /// Name used in metrics and logs instead of the key (`other` is reserved).
    #[schemars(
        length(min = 1, max = 63),
        pattern(r"^[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")
    )]
    pub name: String,
    /// Which client this is, by the hash of its identity value.
    #[serde(rename = "match")]
    pub client: ClientMatchSpec,
    /// This client's concurrency limit (across the fleet, or per pod: `clients.scope`).
    #[schemars(range(min = 1, max = 100_000))]
    pub max_concurrency: u32,
    /// This client's priority class: every call of it gets this class, whatever header it
    /// sends. Omitted: `clients.priority` classes its calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        description = "This client's priority class (`Interactive` or `Batch`): every call of it gets this class, whatever header it sends. Omitted: `clients.priority` classes its calls."
    )]
    pub class: Option<PriorityClassSpec>,
    /// This client's own token budget, in place of `clients.tokens` (across the fleet, or per
    /// pod: `clients.scope`). Omitted: `clients.tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenBudgetSpec>,
    /// This client's weight in the connection pool queue's token-fair order: among the
    /// clients waiting in one priority class, each is served tokens in proportion to its
    /// weight (a client of weight 2 gets twice the tokens of one of weight 1 while both wait).
    /// Omitted: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub weight: Option<u32>,
}

/// What the client limits count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ClientScope {
    /// Calls across every selected gateway pod, divided over the pods by the operator.
    #[default]
    Fleet,
    /// Calls on each gateway pod.
    PerPod,
}

impl ClientScope {
    /// Whether this is `Fleet`.
    pub fn is_fleet(&self) -> bool {
        *self == Self::Fleet
    }
}

/// Identifies one client without storing its key in the cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClientMatchSpec {
    /// Lower-case hex SHA-256 of the client's identity value (the API key, or the IP as text).
    #[schemars(pattern(r"^[0-9a-f]{64}$"))]
    pub key_sha256: String,
}

/// Slow-call demotion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.maxRatio > 0.0", "message": "slowCalls.maxRatio must be above 0"}
]))]
pub struct SlowCallsSpec {
    /// A call counts as slow when it waited longer than this for the backend: for its first
    /// response byte, or between two chunks of its response (a stall). A long stream that keeps
    /// flowing is not slow, whatever its total duration.
    #[schemars(schema_with = "positive_duration")]
    pub threshold: Duration,
    /// Demote a client when more than this share of its recent calls were slow (0 < ratio ≤ 1).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_ratio: f64,
    /// Concurrency of a demoted client.
    #[schemars(range(min = 1, max = 100_000))]
    pub demoted_concurrency: u32,
    /// How long a demotion lasts.
    #[schemars(schema_with = "positive_duration")]
    pub cooldown: Duration,
    /// Calls of a client needed before its slow-call ratio is judged.
    #[serde(default = "SlowCallsSpec::default_min_calls")]
    #[schemars(range(min = 1, max = 100_000))]
    pub min_calls: u32,
}

/// Downstream limits of each gateway pod. When several policies select a pod, the most
/// permissive value of each field applies (the largest limit or timeout, the lowest rate), but
/// the smallest `maxUpstreamConnections`, and the oldest policy's `trustedProxies`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ListenerSpec {
    /// Client connections one gateway pod accepts in total. Counted in the pod's file-descriptor
    /// budget.
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_connections: u32,
    /// Upstream connections one gateway pod may hold across all its backends, shared fairly
    /// between them (an equal part each; a backend whose pool is smaller leaves the rest to the
    /// others). Counted in the pod's file-descriptor budget instead of the sum of the pools when
    /// smaller. When policies on the same pods set different values, the smallest applies.
    /// Omitted: the pools' own caps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_upstream_connections: Option<u32>,
    /// Longest wait for a client to accept more of a response (nginx's `send_timeout`): a
    /// response its client stops reading is cut after this, its backend connection and client
    /// slot freed, the HTTP/1 connection closed or the HTTP/2 stream reset.
    #[schemars(schema_with = "positive_duration")]
    pub send_timeout: Duration,
    /// Longest wait for the next bytes of a request body; then 408 (nginx's
    /// `client_body_timeout`).
    #[schemars(schema_with = "positive_duration")]
    pub body_read_timeout: Duration,
    /// Slowest average rate, in bytes per second, at which a request body may arrive once it
    /// has taken longer than 5 s; slower: 408. 0: no minimum.
    #[schemars(range(max = 1_000_000_000))]
    pub min_body_rate: u32,
    /// HTTP/2 streams one client connection may have open at once.
    #[schemars(range(min = 1, max = 10_000))]
    pub max_concurrent_streams: u32,
    /// The proxies or load balancers in front of the gateway pods whose word on a client's
    /// address is taken (for per-client connection caps and source-IP client identities).
    /// Omitted: a connection's peer is the client.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trusted_proxies: Option<TrustedProxiesSpec>,
}

/// Proxies trusted to name the client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrustedProxiesSpec {
    /// Their addresses, as CIDRs (an IPv4 or IPv6 network and its prefix length: the load
    /// balancers' subnet, say).
    #[schemars(schema_with = "cidr_list")]
    pub cidrs: Vec<String>,
    /// How they pass the client's address: `ProxyV2`, a PROXY protocol version 2 header opening
    /// each of their connections (required from them: a connection without one is closed), or
    /// `XForwardedFor`, the header's rightmost address that is not a trusted proxy (the
    /// per-client connection cap then does not apply to the proxies' own connections).
    pub protocol: TrustedProxyProtocol,
}

/// How a trusted proxy passes the client's address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum TrustedProxyProtocol {
    /// A PROXY protocol v2 header on every connection.
    ProxyV2,
    /// The `X-Forwarded-For` header.
    XForwardedFor,
}

/// Bounds and pace of the operator's tuning.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.max) || self.min <= self.max",
        "message": "autoscale.min must not exceed autoscale.max"
    }
]))]
pub struct AutoscaleSpec {
    /// Tune the targets from observed demand. When false every backend runs at its upper bound
    /// (`max`, or capacity × (1 − headroom)), still clamped to the file-descriptor budget.
    pub enabled: bool,
    /// Lower bound of the target: fleet-wide connections per backend endpoint, summed over all
    /// selected gateway pods.
    #[schemars(range(min = 1, max = 1_000_000))]
    pub min: u32,
    /// Upper bound of the target; never above capacity × (1 − headroom), which is the default.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max: Option<u32>,
    /// Spare share kept above the observed demand: target = demand × (1 + margin).
    #[schemars(range(min = 0.0, max = 4.0))]
    pub margin: f64,
    /// How often the targets are reconsidered. Keep it at least the Prometheus scrape interval.
    #[schemars(schema_with = "positive_duration")]
    pub interval: Duration,
    /// How fast targets may shrink: slowly, and stabilized over a window. (Growth is one step to
    /// the demand estimate.)
    pub scale_down: ScaleDownSpec,
    /// Where a new policy's targets start (before its first decision): `Max` (the default),
    /// `Min`, or `Current`, the limits the pods run now.
    #[serde(skip_serializing_if = "is_default")]
    pub start_from: StartFrom,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// Slow, stabilized shrinking.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ScaleDownSpec {
    /// Shrink to the highest recommendation seen over this window, and at most once per window.
    #[schemars(schema_with = "positive_duration")]
    pub stabilization_window: Duration,
    /// Largest decrease of one step, in percent of the current target.
    #[schemars(range(min = 1, max = 100))]
    pub max_step_percent: u32,
}

/// Per-pod file-descriptor budget.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct FileDescriptorsSpec {
    /// Descriptors kept free in each gateway pod for listeners, logs and the admin API. Pool
    /// shares are clamped so that pools + client connections + reserve fit in half the pod's
    /// `process_max_fds`.
    #[schemars(range(max = 1_000_000))]
    pub reserve: u32,
}

/// How new limits reach the pods.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct RolloutSpec {
    /// `Progressive`: canary pods first, verified before the rest; `AllAtOnce`: every pod at once.
    pub strategy: RolloutStrategy,
    /// Pods that get new limits first under the Progressive strategy; the others follow once
    /// they acknowledged and stayed healthy for `verifyIntervals`.
    #[schemars(range(min = 1, max = 1000))]
    pub canary_pods: u32,
    /// Autoscale intervals the canary pods must stay healthy before the rest are updated (0:
    /// update the rest as soon as the canaries acknowledged).
    #[schemars(range(max = 100))]
    pub verify_intervals: u32,
}

/// Rollout strategy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum RolloutStrategy {
    /// Canary pods first, then the rest once the canaries acknowledged and stayed healthy.
    #[default]
    Progressive,
    /// Every selected pod at once.
    AllAtOnce,
}

/// What the operator observed, decided and applied. What it decided and applied is written at
/// once; what it only observed (demand, utilization, tokens used, the last decision's time and
/// numbers while its action holds, messages, the shared document's revision) is refreshed at
/// least every `policies ÷ --status-refresh-rate` seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionPolicyStatus {
    /// The `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Content hash of the policy's durable limits document (its ConfigMap, every backend at the
    /// smallest share; a pod that starts from it reports this `revision` until the operator
    /// sends it its own document).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Generation of that limits document (increases with every new revision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits_generation: Option<u64>,
    /// One-line summary of the targets, `backend=target` (for `kubectl get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<String>,
    /// Pods running their current documents / selected pods not terminating, as `updated/pods`
    /// (for `kubectl get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated: Option<String>,
    /// One condition of each type, in this order: `Accepted`, `MetricsAvailable`, `FdBudget`,
    /// `RolledOut`, `Saturated` and `Ready`. Their reasons are listed in poolpilot's
    /// ConnectionPolicy reference (docs/connectionpolicy-reference.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Per backend: target, per-pod share, observed saturation and the last scale decision.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backends: Vec<BackendStatus>,
    /// The selected gateway pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<PodsStatus>,
    /// The busiest clients whose fleet-wide limits (`clients.scope: Fleet`) are divided over the
    /// pods by where their calls arrive (at most 32; every other client has the even split).
    /// Listed only while the policy has at most 50 pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<ClientStatus>,
    /// Each token budget's use (`clients.tokens` and the overrides' budgets): one entry per
    /// override with a budget (its own, or the policy's), and one for `other`, the clients
    /// without an override (each of which has the whole budget on its own; its use is theirs
    /// together). With `clients.scope: Fleet` an override's budget is divided over the pods by
    /// where its tokens are used, and `shares` lists each pod's part (while the policy has at
    /// most 50 pods).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<TokenBudgetStatus>,
}

/// One token budget and its use.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenBudgetStatus {
    /// The override's name, or `other` for the clients without one.
    pub client: String,
    /// The budget's `perMinute` (across the fleet, or per pod: `clients.scope`).
    pub per_minute: u64,
    /// Tokens a minute charged to it over the selected pods, averaged over the metrics window
    /// (settled, in the budget's units). Absent: a ready pod had no sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_per_minute: Option<f64>,
    /// Each pod's part of a fleet-wide budget and the use it was divided by, in pod name order.
    /// Empty: the budget is split evenly (or per pod).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<PodTokens>,
}

/// One pod's part of a token budget.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodTokens {
    /// The gateway pod.
    pub pod: String,
    /// Its part of `perMinute`.
    pub per_minute: u64,
    /// Tokens a minute the client was charged there when the budget was last divided. Absent:
    /// no sample of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_per_minute: Option<f64>,
}

/// One client's fleet-wide limits divided over the pods.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClientStatus {
    /// Hex SHA-256 of the client's identity value (as in `clients.overrides[].client`).
    pub key_sha256: String,
    /// The fleet-wide `maxConcurrency` divided.
    pub max_concurrency: u32,
    /// Each pod's part of it and the client's demand there, in pod name order.
    pub shares: Vec<PodShare>,
}

/// One backend as the operator sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackendStatus {
    /// The backend's name.
    pub name: String,
    /// Endpoints resolved (ready addresses of the Service, or the static addresses).
    pub endpoints: u32,
    /// Fleet-wide connection target per endpoint: connections all selected gateway pods together
    /// may hold to one endpoint.
    pub target: u32,
    /// The smallest pod's share of the target (the pool size per endpoint in a pod). The target
    /// is divided by demand: each pod's share is in `shares`, and they add up to at most the
    /// target (more only when every pod is at its floor of 1).
    pub per_pod: u32,
    /// Connections per endpoint each pod may open beyond its share while calls wait in its
    /// pool queue, before the next decision re-divides the target (absent: no burst; none is
    /// handed out while the backend is held at its knee or the fleet is saturated).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub burst: u32,
    /// Each pod's share of the target and the demand it was divided by, in pod name order (at
    /// most 50 pods are listed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<PodShare>,
    /// Leased connections, fleet sum, averaged over the last interval (absent: no data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leased: Option<f64>,
    /// Pending lease requests, fleet sum, averaged over the last interval (absent: no data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<f64>,
    /// Demand over the pooled capacity in force (leased + pending) / (target × endpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization: Option<f64>,
    /// The demand (leased + pending) split by priority class, fleet sums averaged over the
    /// last interval. The target is sized from the total; this says whose demand it is.
    /// Absent: no data for a class (gateways too old to report classes, or missing samples).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand_by_class: Option<ClassDemand>,
    /// Model tokens a second the selected gateway pods counted for the backend, summed over the
    /// pods, over the last interval (`poolpilot_tokens_total`, whatever the count's source:
    /// the backend's `usage`, a stream's chunks or the gateway's estimate), each rounded to
    /// three significant figures. Reported, not planned on: the target is sized from
    /// connections. Absent: no selected pod counted tokens for the backend (not a model
    /// backend, or no call yet), or a ready pod had no sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<TokenThroughput>,
    /// The last change of the target, with its reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale: Option<ScaleRecord>,
    /// The autoscaler's last decision about this backend, whatever it was (a change, a hold or
    /// no change), with its reason and numbers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_decision: Option<DecisionRecord>,
    /// `protocol: Auto`: endpoint addresses the gateway pods call over HTTP/1.1 for the
    /// fallback cooldown at their latest scrape (the server picked `http/1.1` or refused `h2`;
    /// summed over the pods, each counting the addresses it fell back on). Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http1_fallback: Option<u32>,
    /// The provider's back-pressure (a backend with `credentials`): its refusals with
    /// `Retry-After` that cooled the backend down over the last ten metric windows (five
    /// minutes with the defaults), summed over the pods, and what became of the calls
    /// meanwhile. Absent: no such refusal in that time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown: Option<CooldownStatus>,
    /// Calls whose TLS handshake failed verification of the backend's certificate over the
    /// last ten metric windows, summed over the pods (check `tls.serverName` and the CA).
    /// Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_verification_failures: Option<u32>,
    /// `pool.idleTimeout` as the pods run it when the backend closes idle connections sooner
    /// than the spec's: the operator keeps it under the idle time at which the gateways found
    /// connections closed by the backend. Absent: the spec's value is in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<IdleTimeoutStatus>,
}

/// A provider's refusals with a time to come back, and the calls meanwhile.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CooldownStatus {
    /// The provider's `429`/`503` answers with `Retry-After` (each reached its caller as it
    /// came and started or extended the cooldown).
    pub refusals: u32,
    /// Calls the gateways answered `429` `backend_cooling_down` while it lasted.
    pub refused_calls: u32,
    /// Calls they sent to a fallback backend while it lasted.
    pub fallback_calls: u32,
}

/// The idle timeout in force for a backend that closes idle connections sooner than
/// `pool.idleTimeout` says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IdleTimeoutStatus {
    /// The idle timeout the pods run (`1230ms`), under the backend's keep-alive.
    pub in_force: Duration,
    /// The spec's `pool.idleTimeout` it replaces; editing the spec starts over from the new
    /// value.
    pub configured: Duration,
    /// The idle time, in seconds, after which the backend was seen closing connections: the
    /// 5th percentile of the gateways' findings when it was last lowered.
    pub backend_closed_after_seconds: f64,
    /// When it was last lowered.
    pub since: Time,
    /// Tries of the spec's value in a row that the backend's closes ended: the lowered value is
    /// kept for an hour × 2^tries (at most a day) after the last close found before the spec's
    /// value is tried again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tries: u32,
}

/// One pod's share of a divided limit: a backend's target, or a client's `maxConcurrency`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodShare {
    /// The gateway pod.
    pub pod: String,
    /// Its part: for a backend its pool size per endpoint, for a client the calls it may have
    /// in flight in this pod.
    pub share: u32,
    /// Its demand when the limit was last divided: for a backend per endpoint (leased + pending,
    /// averaged over the interval), for a client its calls in flight and waiting (averaged over
    /// 10 s). Absent: no sample of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand: Option<f64>,
}

/// A backend's demand per priority class.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClassDemand {
    /// Connections held and lease requests waiting for interactive calls.
    pub interactive: f64,
    /// Connections held and lease requests waiting for batch calls.
    pub batch: f64,
}

/// A backend's model tokens a second, each rounded to three significant figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenThroughput {
    /// Prompt tokens sent to the backend a second (the part it served from its prompt cache
    /// included).
    pub input: f64,
    /// Completion tokens received from it a second.
    pub output: f64,
}

/// One decision of the autoscaler about a backend.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DecisionRecord {
    /// When it was made.
    pub time: Time,
    /// What it did.
    pub action: DecisionAction,
    /// Why, with the numbers it was made from (`held at 8: growth to 15 held: …`).
    pub reason: String,
}

/// What one autoscaler decision did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DecisionAction {
    /// The target grew.
    ScaleUp,
    /// The target shrank.
    ScaleDown,
    /// A change was wanted and withheld: growth past the backend's knee or its upper bound, a
    /// shrink the stabilization window defers, or any change while data is missing.
    Hold,
    /// No change was wanted: the recommendation equals the target or lies within the 10%
    /// deadband.
    NoChange,
    /// The target stayed and its division over the pods changed: a pod queued while shares
    /// elsewhere sat unused, or demand moved between pods past the deadband.
    Rebalance,
}

/// One change of a target, with its reason.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScaleRecord {
    /// When it was decided.
    pub time: Time,
    /// Target before.
    pub from: u32,
    /// Target after.
    pub to: u32,
    /// Why, with the numbers (`demand 143 (leased 120 + pending 23) × 1.05`).
    pub reason: String,
}

/// The selected gateway pods.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodsStatus {
    /// Pods the gateway selector selects.
    pub selected: u32,
    /// Of those, pods that are ready.
    pub ready: u32,
    /// Selected pods not terminating that acknowledged their current document.
    pub updated: u32,
    /// The smallest `process_max_fds` of the selected pods (absent: not known yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fd_limit: Option<u64>,
    /// File descriptors the rendered limits need in the busiest pod.
    pub fd_needed: u64,
    /// Pods that refused or did not answer the current revision, with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<PodFailure>,
    /// What each selected pod runs, in name order: the first 50 (`omitted` counts the rest).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub items: Vec<PodRun>,
    /// Selected pods left out of `items` (beyond the first 50).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What one selected gateway pod runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRun {
    /// The pod's name.
    pub name: String,
    /// The revision of the limits document it runs (absent: none known yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The generation of that document.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Whether that is the document the policy wants it to run now.
    pub current: bool,
    /// When the operator first saw it run that revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
    /// Its last refusal or failure to answer, kept until it takes a new revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A pod that did not take the current revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodFailure {
    /// The pod's name.
    pub pod: String,
    /// What it answered, or why it could not be reached.
    pub message: String,
}

// === defaults ===

impl CapacitySpec {
    fn default_headroom() -> f64 {
        0.2
    }
}

impl Default for PoolSpec {
    fn default() -> Self {
        Self {
            max_pending: 128,
            lease_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_secs(30),
            max_lifetime: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(1),
            validate_after_idle: Duration::from_secs(2),
            soft_throttle: None,
        }
    }
}

impl Default for TimeoutsSpec {
    fn default() -> Self {
        Self {
            first_byte: Duration::from_secs(15),
            total: Duration::from_secs(120),
            stream_idle: Duration::from_secs(15),
        }
    }
}

impl HealthCheckSpec {
    fn default_timeout() -> Duration {
        Duration::from_secs(1)
    }
    fn default_unhealthy() -> u32 {
        3
    }
    fn default_healthy() -> u32 {
        2
    }
}

impl OutlierDetectionSpec {
    fn default_max_ejected() -> u32 {
        50
    }
}

impl ClientsSpec {
    fn default_queue_timeout() -> Duration {
        Duration::from_secs(2)
    }

    fn default_max_clients() -> u32 {
        crate::limits::ClientPolicy::DEFAULT_MAX_CLIENTS
    }
}

impl SlowCallsSpec {
    fn default_min_calls() -> u32 {
        10
    }
}

impl Default for ListenerSpec {
    fn default() -> Self {
        // The gateway's own defaults, but for the connection count (a pod's fd budget).
        let gateway = crate::limits::ListenerLimits::default();
        Self {
            max_connections: 1024,
            max_upstream_connections: None,
            send_timeout: gateway.send_timeout,
            body_read_timeout: gateway.body_read_timeout,
            min_body_rate: gateway.min_body_rate,
            max_concurrent_streams: gateway.http2.max_concurrent_streams,
            trusted_proxies: None,
        }
    }
}

impl Default for AutoscaleSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            min: 1,
            max: None,
            margin: 0.2,
            interval: Duration::from_secs(15),
            scale_down: ScaleDownSpec::default(),
            start_from: StartFrom::default(),
        }
    }
}

impl Default for ScaleDownSpec {
    fn default() -> Self {
        Self {
            stabilization_window: Duration::from_secs(300),
            max_step_percent: 20,
        }
    }
}

impl Default for FileDescriptorsSpec {
    fn default() -> Self {
        Self { reserve: 256 }
    }
}

impl Default for RolloutSpec {
    fn default() -> Self {
        Self {
            strategy: RolloutStrategy::Progressive,
            canary_pods: 1,
            verify_intervals: 2,
        }
    }
}

// === impl CapacitySpec ===

impl CapacitySpec {
    /// The most connections the fleet may hold to one endpoint: capacity × (1 − headroom),
    /// rounded down (the CEL rules guarantee at least 1).
    pub fn budget(&self) -> u32 {
        let b = (f64::from(self.max_connections_per_endpoint) * (1.0 - self.headroom)).floor();
        // `as` saturates; the schema keeps headroom within [0, 0.9].
        (b as u32).max(1)
    }
}

/// The `ConnectionPolicy` CustomResourceDefinition as committed: the derived one, with the
/// schema's integer formats narrowed to the ones Kubernetes knows (`int32`, `int64`; the ranges
/// already bound them) and doc-comment line breaks inside paragraphs joined, so that `kubectl
/// explain` wraps the text itself.
pub fn crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt;
    let mut value = serde_json::to_value(ConnectionPolicy::crd()).expect("a CRD serialises");
    tidy_schema(&mut value);
    serde_json::from_value(value).expect("a tidied CRD deserialises")
}

fn tidy_schema(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            if let Some(Value::String(f)) = map.get_mut("format") {
                match f.as_str() {
                    "uint8" | "uint16" | "uint32" => *f = "int32".into(),
                    "uint64" => *f = "int64".into(),
                    _ => {}
                }
            }
            if let Some(Value::String(d)) = map.get_mut("description") {
                *d = d
                    .split("\n\n")
                    .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
                    .collect::<Vec<_>>()
                    .join("\n\n");
            }
            map.values_mut().for_each(tidy_schema);
        }
        Value::Array(items) => items.iter_mut().for_each(tidy_schema),
        _ => {}
    }
}

/// The generated CustomResourceDefinition YAML of [`ConnectionPolicy`], exactly as committed in
/// `crds/connectionpolicy.yaml` (the `crdgen` bin prints it; a test checks the file for drift).
pub fn crd_yaml() -> String {
    let yaml = serde_norway::to_string(&crd()).expect("a CRD serialises to YAML");
    format!("# Generated by `cargo run -p poolpilot-api --bin crdgen`; do not edit.\n---\n{yaml}")
}

/// The schema of every duration field: a Go-style duration string that must be longer than zero.
fn positive_duration(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "pattern": crate::duration::DURATION_PATTERN,
        "maxLength": 32,
        "x-kubernetes-validations": [
            {"rule": "duration(self) > duration('0s')", "message": "must be longer than 0s"}
        ]
    })
}

fn cidr_list(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "minItems": 1,
        "maxItems": 64,
        "items": {
            "type": "string",
            // The longest IPv6 CIDR: 39 characters of address, `/128`.
            "maxLength": 43,
            "x-kubernetes-validations": [
                {"rule": "isCIDR(self)", "message": "every entry must be a CIDR: an address and a prefix length"}
            ]
        }
    })
}

#[cfg(test)]
mod doc_fields;
#[cfg(test)]
mod tests;
