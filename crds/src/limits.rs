//! The limits document ([`GatewayLimits`]): everything one gateway pod needs to pool, route and
//! throttle, rendered by the operator and applied by the gateway (via `PUT /v1/limits` or the
//! durable ConfigMap file). The gateway never reads the CRD; this is its whole contract.
//!
//! The same YAML/JSON shape is what a user writes to run a gateway standalone.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::Duration;

mod upstream;
pub use upstream::{
    ClientCertificate, CredentialScheme, Credentials, EndpointTls, UpstreamProtocol,
};

/// The largest generation a document may carry: 2^53 − 1, the largest integer every JSON reader
/// keeps exactly (JavaScript, Go's `interface{}`, kubectl's JSONPath). Far beyond any count of
/// changes, so that a larger one read back from a pod or an annotation is a corrupted or forged
/// value, never a real history, and adding one to it can never wrap.
pub const MAX_GENERATION: u64 = (1 << 53) - 1;

/// The largest limits document a gateway takes (`PUT /v1/limits`), and so the largest one it
/// can answer `GET /v1/limits` with: far beyond a pod selected by every policy of a namespace.
pub const MAX_DOCUMENT_BYTES: usize = 4 * 1024 * 1024;

/// Everything a gateway pod enforces, in one versioned document.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewayLimits {
    /// Hash of the document's content (see [`GatewayLimits::content_revision`]). Empty in a
    /// hand-written file: the gateway computes it. When set it must match the content.
    #[serde(default)]
    pub revision: String,
    /// Monotonically increasing version, at most [`MAX_GENERATION`]. A gateway refuses a document
    /// older than the one it runs.
    #[serde(default)]
    pub generation: u64,
    /// Limits on the downstream (client-facing) side of every listener.
    #[serde(default)]
    pub listener: ListenerLimits,
    /// Per-client concurrency rules; backends refer to one by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_policies: Vec<ClientPolicy>,
    /// Model backends, matched in this order: the first whose route matches a request gets it.
    #[serde(default)]
    pub backends: Vec<BackendLimits>,
}

/// Downstream limits: what protects the gateway itself from its clients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ListenerLimits {
    /// Open client connections the pod accepts in total; beyond it, new connections wait in the
    /// kernel backlog.
    pub max_connections: u32,
    /// Open connections one client source may hold (an IPv4 address, or an IPv6 /64); beyond
    /// it a new connection is answered `429` with `Retry-After` and `Connection: close` (at a
    /// bounded rate; beyond that rate it is closed at once). Stops a client that opens
    /// connections and never closes them from draining the pod.
    pub max_connections_per_client: Option<u32>,
    /// Upstream connections the pod may hold across all its backends (HttpAsyncClient's
    /// `maxTotal` above its `maxPerRoute`). The backends share it fairly: each gets an equal
    /// part, a backend whose pool is smaller than its part leaves the rest to the others (max-min
    /// fairness), and each endpoint keeps at least one connection. None: the pools' own caps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_upstream_connections: Option<u32>,
    /// Close a client keep-alive connection idle this long.
    pub idle_timeout: Duration,
    /// A client must send its complete request head within this time (slowloris protection).
    pub header_read_timeout: Duration,
    /// Longest wait for a client to accept more of a response (nginx's `send_timeout`): a
    /// response the client stops reading is cut after this, its upstream connection and client
    /// permit released, the HTTP/1 connection closed or the HTTP/2 stream reset.
    pub send_timeout: Duration,
    /// Longest wait for the next bytes of a request body, while it is buffered for routing and
    /// while it streams to the backend; then `408` (nginx's `client_body_timeout`).
    pub body_read_timeout: Duration,
    /// Slowest average rate a request body may arrive at, in bytes per second, once it has
    /// taken longer than [`BODY_RATE_GRACE`]; slower: `408` (Kestrel's minimum request body
    /// data rate). 0: no minimum.
    pub min_body_rate: u32,
    /// Largest request head accepted, in bytes; larger ones get 431.
    pub max_header_bytes: u32,
    /// Most request headers accepted; more get 431.
    pub max_headers: u32,
    /// Largest request body accepted, in bytes; larger ones get 413.
    pub max_body_bytes: u64,
    /// How much of a request body the router may buffer to read its JSON `model` field.
    pub route_body_bytes: u32,
    /// Bytes of request bodies the whole pod may hold buffered for routing at once; a request
    /// that would go over it gets `503` with `Retry-After`.
    pub route_buffer_budget: u64,
    /// HTTP/2 client connections.
    pub http2: Http2Limits,
    /// Where a client's address comes from when it connects through a proxy or load balancer;
    /// none: the TCP peer is the client.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trusted_proxies: Option<TrustedProxies>,
}

/// How long a request body may take, at least, before [`ListenerLimits::min_body_rate`] is
/// checked (Kestrel's grace period).
pub const BODY_RATE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            max_connections: 16_384,
            max_connections_per_client: None,
            max_upstream_connections: None,
            idle_timeout: Duration::from_secs(60),
            header_read_timeout: Duration::from_secs(10),
            send_timeout: Duration::from_secs(60),
            body_read_timeout: Duration::from_secs(60),
            min_body_rate: 240,
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            max_body_bytes: 16 * 1024 * 1024,
            route_body_bytes: 64 * 1024,
            route_buffer_budget: 32 * 1024 * 1024,
            http2: Http2Limits::default(),
            trusted_proxies: None,
        }
    }
}

/// Limits of HTTP/2 client connections.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Http2Limits {
    /// Streams one connection may have open at once (`SETTINGS_MAX_CONCURRENT_STREAMS`).
    pub max_concurrent_streams: u32,
    /// How often the gateway pings a client connection.
    pub keep_alive_interval: Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub keep_alive_timeout: Duration,
}

impl Default for Http2Limits {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 100,
            keep_alive_interval: Duration::from_secs(30),
            keep_alive_timeout: Duration::from_secs(20),
        }
    }
}

/// The proxies or load balancers in front of the gateway whose word on the client's address
/// is taken.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TrustedProxies {
    /// Addresses of the trusted proxies (CIDRs such as `10.0.0.0/8` or `fd00::/8`).
    pub cidrs: Vec<ipnet::IpNet>,
    /// How they say who the client is.
    pub protocol: ProxyProtocol,
}

/// How a trusted proxy passes the client's address on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProxyProtocol {
    /// A PROXY protocol version 2 header opens every connection from a trusted proxy. The
    /// ConnectionPolicy's spelling, `ProxyV2`, is read too.
    #[serde(alias = "ProxyV2")]
    ProxyV2,
    /// The `X-Forwarded-For` header: the client is its rightmost address that is not a trusted
    /// proxy (nginx's `real_ip_recursive`). `XForwardedFor` is read too.
    #[serde(alias = "XForwardedFor")]
    XForwardedFor,
}

impl TrustedProxies {
    /// Whether `ip` is a trusted proxy.
    pub fn trusts(&self, ip: std::net::IpAddr) -> bool {
        let ip = canonical_ip(ip);
        self.cidrs.iter().any(|net| net.contains(&ip))
    }
}

/// `ip` with an IPv4-mapped IPv6 address (`::ffff:10.0.0.1`) turned into IPv4.
pub fn canonical_ip(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// One group of interchangeable model-server instances, with this pod's share of their capacity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackendLimits {
    /// Unique name; used as the `backend` metric label.
    pub name: String,
    /// `namespace/name` of the ConnectionPolicy this backend comes from (empty when standalone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// Which requests go to this backend.
    #[serde(default, rename = "match")]
    pub route: RouteMatch,
    /// The instances to pool connections to.
    pub endpoints: Vec<Endpoint>,
    /// This pod's connection pool per endpoint.
    pub pool: PoolLimits,
    /// Hard limits on one proxied call.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Active health checking; none means every endpoint is presumed healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// Passive ejection of failing endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlier_detection: Option<OutlierDetection>,
    /// Name of the entry in `clientPolicies` that limits callers of this backend (none: unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_policy: Option<String>,
    /// The provider's key, set on every call in place of the client's `Authorization` (none:
    /// the client's headers go through as they came).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<Credentials>,
    /// The HTTP version of calls to its endpoints (default `http1`).
    #[serde(default, skip_serializing_if = "UpstreamProtocol::is_default")]
    pub protocol: UpstreamProtocol,
    /// Other backends of this document that take its calls, in this order, while it cools
    /// down (a provider's refusal with a time to come back): the first not cooling down.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallback: Vec<String>,
    /// The most output tokens its model server produces for a call that sets neither
    /// `max_completion_tokens` nor `max_tokens`: such a call's estimate, in place of its client
    /// budget's `defaultMaxTokens` (none: the budget's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_max_tokens: Option<u64>,
}

/// A request matches when every condition given here holds; an empty match takes everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteMatch {
    /// The request path starts with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Each of these headers is present with exactly this value (names are case-insensitive).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The JSON request body's top-level `model` field equals this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// One backend instance, or one DNS name standing for a set of them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Endpoint {
    /// Stable name (a pod name, or `ip:port`); used as the `endpoint` metric label (for a DNS
    /// name, with `/<ip>` of each address it resolves to).
    pub name: String,
    /// Where to connect: `ip:port`, or `host:port`, which the gateway resolves in the
    /// background and pools per address, all of them under this endpoint's cap.
    pub address: EndpointAddress,
    /// TLS to this endpoint; none: plain HTTP/1.1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<EndpointTls>,
}

/// Where an endpoint is: an IP address and port, or a DNS name and port (`host:port`; IPv6 as
/// `[addr]:port`). Written and read as that text.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EndpointAddress {
    /// `ip:port`.
    Ip(SocketAddr),
    /// `host:port`: a DNS name (letters, digits, `-` and `.`; labels of 1 to 63 characters, at
    /// most 253 in all), resolved by the gateway.
    Host {
        /// The name, lowercase, without a trailing dot.
        host: String,
        /// The port.
        port: u16,
    },
}

impl EndpointAddress {
    /// The socket address of an `ip:port` endpoint; `None` for a DNS name.
    pub fn ip(&self) -> Option<SocketAddr> {
        match self {
            Self::Ip(addr) => Some(*addr),
            Self::Host { .. } => None,
        }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        match self {
            Self::Ip(addr) => addr.port(),
            Self::Host { port, .. } => *port,
        }
    }

    /// Changes the port.
    pub fn set_port(&mut self, new: u16) {
        match self {
            Self::Ip(addr) => addr.set_port(new),
            Self::Host { port, .. } => *port = new,
        }
    }
}

impl From<SocketAddr> for EndpointAddress {
    fn from(addr: SocketAddr) -> Self {
        Self::Ip(addr)
    }
}

impl fmt::Display for EndpointAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(addr) => addr.fmt(f),
            Self::Host { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

/// An endpoint address that is neither `ip:port` nor `host:port`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not ip:port or host:port (a DNS name: letters, digits, '-' and '.')")]
pub struct BadEndpointAddress(pub String);

impl std::str::FromStr for EndpointAddress {
    type Err = BadEndpointAddress;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Ok(Self::Ip(addr));
        }
        let bad = || BadEndpointAddress(text.to_owned());
        let (host, port) = text.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        let label_ok = |l: &str| {
            (1..=63).contains(&l.len())
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        // A name, not an IP address in another spelling (`10.1`, `0x7f.1`): its last label has
        // a letter, as every top-level domain does.
        let tld_ok = host
            .rsplit('.')
            .next()
            .is_some_and(|l| l.bytes().any(|c| c.is_ascii_alphabetic()));
        if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) || !tld_ok {
            return Err(bad());
        }
        Ok(Self::Host { host, port })
    }
}

impl Serialize for EndpointAddress {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for EndpointAddress {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The connection pool of one backend, per endpoint, in this pod.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolLimits {
    /// Hard cap on open connections from this pod to one endpoint (this pod's share of the fleet
    /// target).
    pub max_connections_per_endpoint: u32,
    /// Lease requests that may wait for a connection, per backend in this pod; beyond it: 503.
    pub max_pending: u32,
    /// Longest wait for a connection before giving up with 503 (an HTTP client pool's connection-request timeout).
    pub lease_timeout: Duration,
    /// Close a pooled connection idle this long.
    pub idle_timeout: Duration,
    /// Close a connection this old when it is next returned.
    pub max_lifetime: Duration,
    /// Give up connecting after this long.
    pub connect_timeout: Duration,
    /// Check a connection that sat idle longer than this before reusing it.
    pub validate_after_idle: Duration,
    /// Slow lease entry down while requests wait: omitted, none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft_throttle: Option<SoftThrottle>,
    /// Connections per endpoint this pod may open beyond `maxConnectionsPerEndpoint` at once,
    /// without waiting for the operator, while lease requests wait in its pool queue; each is
    /// closed when it is returned with no request waiting. The operator sizes it so that the
    /// whole fleet stays inside the backend's budget even when every pod bursts at once, and
    /// gives none to a backend held at its knee. 0 or omitted: no burst. At most
    /// [`MAX_BURST_PER_ENDPOINT`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub burst_per_endpoint: u32,
}

/// The largest `pool.burstPerEndpoint` a document may carry.
pub const MAX_BURST_PER_ENDPOINT: u32 = 1_000_000;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A short, bounded delay before a lease request, growing with the requests already waiting:
/// `min(max, pending × perPending)`. It smooths a burst into the queue instead of letting it
/// pile up at once (the HttpAsyncClient report slept `min(10, pending × 2)` ms).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SoftThrottle {
    /// Delay per lease request already waiting.
    pub per_pending: Duration,
    /// Longest delay.
    pub max: Duration,
}

impl SoftThrottle {
    /// The delay of a lease request that finds `pending` requests waiting.
    pub fn delay(&self, pending: u32) -> std::time::Duration {
        self.per_pending
            .get()
            .saturating_mul(pending)
            .min(self.max.get())
    }
}

/// Hard limits on one proxied call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Timeouts {
    /// From sending the request to the response head.
    pub first_byte: Duration,
    /// The whole call, response body included.
    pub total: Duration,
    /// Longest silence between two body chunks of a streaming (SSE) response.
    pub stream_idle: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            first_byte: Duration::from_secs(15),
            total: Duration::from_secs(120),
            stream_idle: Duration::from_secs(15),
        }
    }
}

/// Active HTTP health checking of each endpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HealthCheck {
    /// Path probed with GET; a 2xx answer is healthy.
    pub path: String,
    /// Time between probes.
    pub interval: Duration,
    /// Timeout of one probe.
    #[serde(default = "HealthCheck::default_timeout")]
    pub timeout: Duration,
    /// Consecutive failed probes that mark an endpoint unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive passed probes that mark it healthy again.
    pub healthy_threshold: u32,
}

impl HealthCheck {
    fn default_timeout() -> Duration {
        Duration::from_secs(1)
    }
}

/// Passive outlier ejection: endpoints that fail calls in a row are taken out for a while.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutlierDetection {
    /// Consecutive failed calls (connect error, 5xx, timeout) that eject an endpoint.
    pub consecutive_failures: u32,
    /// First ejection length; each further ejection of the same endpoint lasts longer.
    pub base_ejection: Duration,
    /// Never eject more than this share of a backend's endpoints.
    pub max_ejected_percent: u32,
}

/// Per-client concurrency rules.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientPolicy {
    /// Unique name; backends refer to it.
    pub name: String,
    /// How a request's client is identified.
    pub identity: ClientIdentity,
    /// Calls one client may have in flight.
    pub max_concurrency: u32,
    /// Calls one client may have waiting beyond that; more get 429.
    pub max_queue: u32,
    /// Longest wait in that queue before 429.
    pub queue_timeout: Duration,
    /// Named clients with their own limits (an allowlist for batch callers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<ClientOverride>,
    /// Demotion of clients whose calls are often slow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_calls: Option<SlowCalls>,
    /// Clients this policy keeps state for at once in one pod. A client has state only while it
    /// has calls in flight or queued, or something to remember (a demotion, slow calls); when
    /// the table is full the longest-idle client with nothing in flight is forgotten, and when
    /// every entry is busy a new client gets `503` with `Retry-After`.
    #[serde(default = "ClientPolicy::default_max_clients")]
    pub max_clients: u32,
    /// Priority classes of this policy's calls, applied in its per-client queues and in the
    /// pool queue of every backend that refers to it. Omitted: the defaults of [`Priority`]
    /// (a call is `interactive` unless its override names a class; no header is read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// This pod's part of the fleet-wide limits of the clients whose calls arrive here, keyed
    /// by the SHA-256 of their key: the operator divides a client's `maxConcurrency` and
    /// `maxQueue` over the pods by where its calls arrive (from each pod's `GET /v1/clients`),
    /// so that a client pinned to one pod by its load balancer gets its whole limit there. A
    /// client not listed gets `maxConcurrency` and `maxQueue` (the even split). An override
    /// still wins over a share.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_shares: Vec<ClientShare>,
    /// Each client's token budget in this pod (an override's own budget wins). None: calls
    /// are not limited by tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenBudget>,
    /// This pod's part of the fleet-wide token budget (`tokens`) of the clients whose tokens
    /// are spent here, keyed by the SHA-256 of their key: the operator divides a client's
    /// budget over the pods by where it spends it (from each pod's `GET /v1/clients?by=tokens`),
    /// so that a client pinned to one pod gets its whole budget there. A client not listed
    /// gets `tokens` (the even split). An override's budget still wins over a share.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_token_shares: Vec<ClientTokenShare>,
}

/// One client's part of its fleet-wide token budget in this pod: the policy's `tokens` with
/// these buckets (a bucket not given stays the policy's).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientTokenShare {
    /// Hex SHA-256 of the client's identity value (its API key, or its address as text).
    pub key_sha256: String,
    /// Its part of `tokens.perMinute`.
    pub per_minute: u64,
    /// Its part of `tokens.perDay` (present when the budget has one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_day: Option<u64>,
    /// Its part of `tokens.requestsPerMinute` (present when the budget has one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u32>,
}

impl ClientTokenShare {
    /// The budget this share gives its client: `policy`'s, with its buckets.
    pub fn budget(&self, policy: &TokenBudget) -> TokenBudget {
        TokenBudget {
            per_minute: self.per_minute,
            per_day: self.per_day.or(policy.per_day),
            requests_per_minute: self.requests_per_minute.or(policy.requests_per_minute),
            ..policy.clone()
        }
    }
}

/// One client's part of its fleet-wide limits in this pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientShare {
    /// Hex SHA-256 of the client's identity value (its API key, or its address as text).
    pub key_sha256: String,
    /// Calls it may have in flight in this pod.
    pub max_concurrency: u32,
    /// Calls it may have waiting in this pod beyond that.
    pub max_queue: u32,
}

/// The largest `tokens.perMinute` (a trillion: far beyond any fleet, small enough that a day
/// of it is exact in an `f64`).
pub const MAX_TOKENS_PER_MINUTE: u64 = 1_000_000_000_000;

/// The most client shares one client policy may carry in a document.
pub const MAX_CLIENT_SHARES: usize = 256;

/// The priority class of a call. Two classes; there is no third.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "camelCase")]
pub enum PriorityClass {
    /// Served first.
    #[default]
    Interactive,
    /// Served after the interactive calls waiting with it, until it has waited `agingAfter`.
    Batch,
}

impl PriorityClass {
    /// Both classes, interactive first.
    pub const ALL: [Self; 2] = [Self::Interactive, Self::Batch];

    /// The metric label and header value (`interactive`, `batch`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Interactive => "interactive",
            Self::Batch => "batch",
        }
    }

    /// The class a header value names (`interactive` or `batch`, any case), if any.
    pub fn parse(value: &[u8]) -> Option<Self> {
        if value.eq_ignore_ascii_case(b"interactive") {
            Some(Self::Interactive)
        } else if value.eq_ignore_ascii_case(b"batch") {
            Some(Self::Batch)
        } else {
            None
        }
    }

    /// An index into per-class arrays (interactive 0, batch 1).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// How the calls of a client policy get their priority class, and how the queues treat batch.
///
/// A call's class: its client's override `class` when the override sets one (the header is
/// not read); else the `header`'s value when the policy takes it (`batch` always, since a call
/// may always lower itself; `interactive` only with `trustHeader`, so that a client cannot
/// raise itself); else `defaultClass`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Priority {
    /// Class of a call that neither an override nor the header classes.
    #[serde(default)]
    pub default_class: PriorityClass,
    /// Request header naming a call's class (`interactive` or `batch`, any case; another value
    /// is ignored). None: the header is not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Take `interactive` from the header too (only when a proxy in front sets or strips it).
    #[serde(default)]
    pub trust_header: bool,
    /// A batch call that waited this long in a queue is served as if it were an interactive
    /// call that arrived then. None: half of each queue's timeout (`leaseTimeout` in the pool
    /// queue, `queueTimeout` in a client's queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aging_after: Option<Duration>,
    /// Most of a backend's connections in this pod (percent of its pool cap over its
    /// endpoints, rounded down, at least 1) that batch calls may hold; a batch call beyond it
    /// waits even when a connection is free. Interactive calls may use every connection. None:
    /// no cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_max_percent: Option<u32>,
}

impl Priority {
    /// The aging bound of a queue whose timeout is `timeout`.
    pub fn aging_in(&self, timeout: std::time::Duration) -> std::time::Duration {
        self.aging_after.map_or(timeout / 2, Duration::get)
    }

    /// The class of a call: its override's class if it has one, else the header's values as
    /// the policy takes them, else the default. `header_values` are the header's lines; each
    /// may be a comma-separated list, and whitespace around an element is ignored. The lowest
    /// class named wins: `batch` anywhere makes the call batch (a call may lower itself, and a
    /// proxy that appends `batch` is not overruled by a value its client sent first);
    /// `interactive` counts only when trusted.
    pub fn class_of<V: AsRef<[u8]>>(
        &self,
        override_class: Option<PriorityClass>,
        header_values: impl IntoIterator<Item = V>,
    ) -> PriorityClass {
        if let Some(class) = override_class {
            return class;
        }
        let mut named = None;
        for value in header_values {
            for element in value.as_ref().split(|b| *b == b',') {
                named = named.max(PriorityClass::parse(element.trim_ascii()));
            }
        }
        match named {
            Some(PriorityClass::Batch) => PriorityClass::Batch,
            Some(PriorityClass::Interactive) if self.trust_header => PriorityClass::Interactive,
            _ => self.default_class,
        }
    }
}

impl ClientPolicy {
    /// The default of [`ClientPolicy::max_clients`].
    pub const DEFAULT_MAX_CLIENTS: u32 = 16_384;

    fn default_max_clients() -> u32 {
        Self::DEFAULT_MAX_CLIENTS
    }
}

/// How a request's client is identified. On the wire: `{header: x-api-key}` or `{sourceIp: {}}`.
/// With `{header: authorization}` the client is the bearer token (`Authorization: Bearer
/// <token>`, what OpenAI SDKs send), without its scheme.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ClientIdentityWire", into = "ClientIdentityWire")]
pub enum ClientIdentity {
    /// The value of this request header (an API key, say). It is never logged or exported raw.
    Header(String),
    /// The connection's source IP address.
    SourceIp,
}

/// The wire form of [`ClientIdentity`]: exactly one field set. A plain struct rather than a
/// serde enum, so that every YAML and JSON library reads and writes it the same way.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ClientIdentityWire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    header: Option<String>,
    /// `sourceIp`; the ConnectionPolicy's spelling, `sourceIP`, is read too.
    #[serde(default, skip_serializing_if = "Option::is_none", alias = "sourceIP")]
    source_ip: Option<BTreeMap<String, serde_json::Value>>,
}

impl TryFrom<ClientIdentityWire> for ClientIdentity {
    type Error = String;

    fn try_from(w: ClientIdentityWire) -> Result<Self, String> {
        match (w.header, w.source_ip) {
            (Some(h), None) => Ok(Self::Header(h)),
            (None, Some(m)) if m.is_empty() => Ok(Self::SourceIp),
            (None, Some(_)) => {
                Err("identity.sourceIp takes no fields: write `sourceIp: {}`".into())
            }
            _ => Err("identity needs exactly one of `header: <name>` or `sourceIp: {}`".into()),
        }
    }
}

impl From<ClientIdentity> for ClientIdentityWire {
    fn from(id: ClientIdentity) -> Self {
        match id {
            ClientIdentity::Header(h) => Self {
                header: Some(h),
                source_ip: None,
            },
            ClientIdentity::SourceIp => Self {
                header: None,
                source_ip: Some(BTreeMap::new()),
            },
        }
    }
}

/// A named client with its own concurrency limit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientOverride {
    /// Name used in metrics and logs instead of the key.
    pub name: String,
    /// Hex SHA-256 of the client's identity value (the API key, or the IP address as text).
    pub key_sha256: String,
    /// This client's concurrency limit.
    pub max_concurrency: u32,
    /// This client's priority class: its calls get it whatever header they send. None: the
    /// policy's `priority` classes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<PriorityClass>,
    /// This client's own token budget, in place of the policy's. None: the policy's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenBudget>,
    /// This client's weight in the pool queue's token-fair order (1 to 100). None: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// A client's token budget: what its calls may cost in model tokens, a minute (and a day), with
/// each call's estimate reserved before it is sent and settled with the backend's `usage`
/// after (the gateway's `tokens` module).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenBudget {
    /// Tokens a minute: the bucket's size, refilled continuously over a minute.
    pub per_minute: u64,
    /// Tokens a day, a second bucket refilled over a day. None: no daily budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_day: Option<u64>,
    /// What a call costs: its total tokens (the default), its output tokens, or weighted.
    #[serde(default, skip_serializing_if = "is_total")]
    pub count: TokenCount,
    /// The weights of `count: weighted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<TokenWeights>,
    /// The output a call is assumed to reserve when it sets neither `max_completion_tokens`
    /// nor `max_tokens` (a backend's own default is often the whole context), unless its
    /// backend says its own (`BackendLimits::default_max_tokens`).
    #[serde(default = "TokenBudget::default_max_tokens")]
    pub default_max_tokens: u64,
    /// Calls a minute, a bucket of its own (OpenAI's `x-ratelimit-*-requests`). None: no
    /// request budget, and no `-requests` headers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u32>,
}

impl TokenBudget {
    /// The default of [`TokenBudget::default_max_tokens`].
    pub const DEFAULT_MAX_TOKENS: u64 = 1024;

    fn default_max_tokens() -> u64 {
        Self::DEFAULT_MAX_TOKENS
    }

    /// What a call of `input` prompt tokens and `output` completion tokens costs.
    pub fn cost(&self, input: u64, output: u64) -> f64 {
        let (wi, wo) = match (self.count, self.weights) {
            (TokenCount::Total, _) => (1.0, 1.0),
            (TokenCount::Output, _) => (0.0, 1.0),
            (TokenCount::Weighted, Some(w)) => (w.input, w.output),
            (TokenCount::Weighted, None) => (1.0, 1.0),
        };
        wi * input as f64 + wo * output as f64
    }
}

fn is_total(c: &TokenCount) -> bool {
    *c == TokenCount::Total
}

/// What a token budget counts of a call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum TokenCount {
    /// Prompt and completion tokens.
    #[default]
    Total,
    /// Completion tokens only.
    Output,
    /// `weights.input` × prompt + `weights.output` × completion tokens.
    Weighted,
}

/// The weights of a weighted token count.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenWeights {
    /// Per prompt token.
    pub input: f64,
    /// Per completion token.
    pub output: f64,
}

/// Slow-call tracking: a client whose calls are often slow is demoted for a while.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SlowCalls {
    /// A call that waited longer than this for its first response byte, or between two
    /// chunks of its response, counts as slow (never its total duration).
    pub threshold: Duration,
    /// Demote when more than this share of a client's recent calls were slow (0 < ratio ≤ 1).
    pub max_ratio: f64,
    /// Concurrency of a demoted client.
    pub demoted_concurrency: u32,
    /// How long a demotion lasts.
    pub cooldown: Duration,
    /// Calls needed in the window before the ratio is judged.
    #[serde(default = "SlowCalls::default_min_calls")]
    pub min_calls: u32,
}

impl SlowCalls {
    fn default_min_calls() -> u32 {
        10
    }
}

// === impl GatewayLimits ===

/// One thing wrong with a limits document, with where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// JSON-path-like location, e.g. `backends[1].pool.leaseTimeout`.
    pub field: String,
    /// What is wrong there.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Why a limits document was refused: every violation found, not just the first.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid limits document: {}", .violations.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct InvalidLimits {
    /// Everything found wrong.
    pub violations: Vec<Violation>,
}

impl GatewayLimits {
    /// The content revision: the first 12 hex digits of the SHA-256 of the document's canonical
    /// JSON, without `revision` and `generation`. Equal content gives equal revisions.
    pub fn content_revision(&self) -> String {
        let content = serde_json::json!({
            "listener": self.listener,
            "clientPolicies": self.client_policies,
            "backends": self.backends,
        });
        // serde_json writes maps in key order (no preserve_order), so this is canonical.
        let digest = Sha256::digest(content.to_string().as_bytes());
        hex::encode(&digest[..6])
    }

    /// Sets `revision` from the content.
    pub fn with_content_revision(mut self) -> Self {
        self.revision = self.content_revision();
        self
    }

    /// Checks every invariant the types cannot: unique names, references that resolve, positive
    /// timeouts, thresholds in range. Pure; the gateway refuses a document that fails it (422)
    /// and the operator never renders one.
    pub fn validate(&self) -> Result<(), InvalidLimits> {
        let mut v = Validator::default();
        if !self.revision.is_empty() && self.revision != self.content_revision() {
            v.push(
                "revision",
                format!(
                    "{:?} does not match the content ({})",
                    self.revision,
                    self.content_revision()
                ),
            );
        }
        if self.generation > MAX_GENERATION {
            v.push(
                "generation",
                format!("{} is above the largest, {MAX_GENERATION}", self.generation),
            );
        }
        let l = &self.listener;
        v.positive_u64("listener.maxConnections", l.max_connections.into());
        if l.max_connections_per_client == Some(0) {
            v.push(
                "listener.maxConnectionsPerClient",
                "must be at least 1 when set",
            );
        }
        if l.max_upstream_connections == Some(0) {
            v.push(
                "listener.maxUpstreamConnections",
                "must be at least 1 when set",
            );
        }
        v.positive("listener.idleTimeout", l.idle_timeout);
        v.positive("listener.headerReadTimeout", l.header_read_timeout);
        v.positive("listener.sendTimeout", l.send_timeout);
        v.positive("listener.bodyReadTimeout", l.body_read_timeout);
        if l.route_buffer_budget < u64::from(l.route_body_bytes) {
            v.push(
                "listener.routeBufferBudget",
                "must hold at least one routing buffer (routeBodyBytes)",
            );
        }
        v.positive_u64(
            "listener.http2.maxConcurrentStreams",
            l.http2.max_concurrent_streams.into(),
        );
        v.positive(
            "listener.http2.keepAliveInterval",
            l.http2.keep_alive_interval,
        );
        v.positive(
            "listener.http2.keepAliveTimeout",
            l.http2.keep_alive_timeout,
        );
        if let Some(p) = &l.trusted_proxies
            && p.cidrs.is_empty()
        {
            v.push(
                "listener.trustedProxies.cidrs",
                "name at least one proxy address range",
            );
        }
        if l.max_header_bytes < 1024 {
            v.push("listener.maxHeaderBytes", "must be at least 1024");
        }
        v.positive_u64("listener.maxHeaders", l.max_headers.into());

        let mut policy_names = BTreeSet::new();
        for (i, p) in self.client_policies.iter().enumerate() {
            let at = |f: &str| format!("clientPolicies[{i}].{f}");
            v.name(&at("name"), &p.name);
            if !policy_names.insert(p.name.as_str()) {
                v.push(at("name"), format!("duplicate client policy {:?}", p.name));
            }
            if let ClientIdentity::Header(h) = &p.identity
                && http_token(h).is_err()
            {
                v.push(
                    at("identity.header"),
                    format!("{h:?} is not a valid header name"),
                );
            }
            v.positive_u64(&at("maxConcurrency"), p.max_concurrency.into());
            v.positive(&at("queueTimeout"), p.queue_timeout);
            v.positive_u64(&at("maxClients"), p.max_clients.into());
            let mut override_names = BTreeSet::new();
            for (j, o) in p.overrides.iter().enumerate() {
                let at = |f: &str| format!("clientPolicies[{i}].overrides[{j}].{f}");
                v.name(&at("name"), &o.name);
                if o.name == "other" {
                    v.push(
                        at("name"),
                        "\"other\" is reserved for clients without an override",
                    );
                }
                if !override_names.insert(o.name.as_str()) {
                    v.push(at("name"), format!("duplicate override {:?}", o.name));
                }
                if !is_sha256_hex(&o.key_sha256) {
                    v.push(
                        at("keySha256"),
                        "must be 64 hex digits (the SHA-256 of the client's key)",
                    );
                }
                v.positive_u64(&at("maxConcurrency"), o.max_concurrency.into());
                if let Some(w) = o.weight
                    && !(1..=100).contains(&w)
                {
                    v.push(at("weight"), format!("{w} is not between 1 and 100"));
                }
                if let Some(t) = &o.tokens {
                    v.tokens(&at("tokens"), t);
                }
            }
            if let Some(t) = &p.tokens {
                v.tokens(&at("tokens"), t);
            }
            v.shares(
                &at("clientShares"),
                p.client_shares.iter().map(|c| c.key_sha256.as_str()),
            );
            for (j, c) in p.client_shares.iter().enumerate() {
                let at = |f: &str| format!("clientPolicies[{i}].clientShares[{j}].{f}");
                v.positive_u64(&at("maxConcurrency"), c.max_concurrency.into());
            }
            if !p.client_token_shares.is_empty() && p.tokens.is_none() {
                v.push(
                    at("clientTokenShares"),
                    "parts of a token budget the policy does not have (no tokens)",
                );
            }
            v.shares(
                &at("clientTokenShares"),
                p.client_token_shares.iter().map(|c| c.key_sha256.as_str()),
            );
            for (j, c) in p.client_token_shares.iter().enumerate() {
                let at = |f: &str| format!("clientPolicies[{i}].clientTokenShares[{j}].{f}");
                if let Some(t) = &p.tokens {
                    v.tokens(&at("tokens"), &c.budget(t));
                }
            }
            if let Some(prio) = &p.priority {
                if let Some(h) = &prio.header
                    && http_token(h).is_err()
                {
                    v.push(
                        at("priority.header"),
                        format!("{h:?} is not a valid header name"),
                    );
                }
                if let Some(aging) = prio.aging_after {
                    v.positive(&at("priority.agingAfter"), aging);
                    // As the CRD's rules: an aging bound a queue times out before never acts.
                    if aging >= p.queue_timeout {
                        v.push(
                            at("priority.agingAfter"),
                            format!(
                                "{aging} is not shorter than queueTimeout {}: batch calls would time out in their client queue before they age",
                                p.queue_timeout
                            ),
                        );
                    }
                    for (k, b) in self.backends.iter().enumerate() {
                        if b.client_policy.as_deref() == Some(p.name.as_str())
                            && aging >= b.pool.lease_timeout
                        {
                            v.push(
                                at("priority.agingAfter"),
                                format!(
                                    "{aging} is not shorter than backends[{k}] ({:?}) pool.leaseTimeout {}: its batch calls would time out in the pool queue before they age",
                                    b.name, b.pool.lease_timeout
                                ),
                            );
                        }
                    }
                }
                if prio
                    .batch_max_percent
                    .is_some_and(|pct| pct == 0 || pct > 100)
                {
                    v.push(at("priority.batchMaxPercent"), "must be 1 to 100");
                }
            }
            if let Some(s) = &p.slow_calls {
                v.positive(&at("slowCalls.threshold"), s.threshold);
                v.positive(&at("slowCalls.cooldown"), s.cooldown);
                if !(s.max_ratio > 0.0 && s.max_ratio <= 1.0) {
                    v.push(at("slowCalls.maxRatio"), "must be in (0, 1]");
                }
                if s.demoted_concurrency == 0 || s.demoted_concurrency > p.max_concurrency {
                    v.push(
                        at("slowCalls.demotedConcurrency"),
                        "must be between 1 and maxConcurrency",
                    );
                }
            }
        }

        let mut backend_names = BTreeSet::new();
        for (i, b) in self.backends.iter().enumerate() {
            let at = |f: &str| format!("backends[{i}].{f}");
            v.name(&at("name"), &b.name);
            if !backend_names.insert(b.name.as_str()) {
                v.push(at("name"), format!("duplicate backend {:?}", b.name));
            }
            if let Some(prefix) = &b.route.path_prefix
                && !prefix.starts_with('/')
            {
                v.push(at("match.pathPrefix"), "must start with /");
            }
            if let Some(n) = b.default_max_tokens {
                v.positive_u64(&at("defaultMaxTokens"), n);
            }
            let mut fallbacks = BTreeSet::new();
            for (j, f) in b.fallback.iter().enumerate() {
                let at = at(&format!("fallback[{j}]"));
                if *f == b.name {
                    v.push(at, "a backend cannot be its own fallback");
                } else if !self.backends.iter().any(|o| o.name == *f) {
                    v.push(at, format!("no backend {f:?} in this document"));
                } else if !fallbacks.insert(f.as_str()) {
                    v.push(at, format!("{f:?} is named twice"));
                }
            }
            for name in b.route.headers.keys() {
                if http_token(name).is_err() {
                    v.push(
                        at("match.headers"),
                        format!("{name:?} is not a valid header name"),
                    );
                }
            }
            let mut endpoint_names = BTreeSet::new();
            for (j, e) in b.endpoints.iter().enumerate() {
                if e.name.is_empty() || e.name.len() > 253 {
                    v.push(
                        at(&format!("endpoints[{j}].name")),
                        "must be 1 to 253 characters",
                    );
                }
                if !endpoint_names.insert(e.name.as_str()) {
                    v.push(
                        at(&format!("endpoints[{j}].name")),
                        format!("duplicate endpoint {:?}", e.name),
                    );
                }
                if let Some(tls) = &e.tls {
                    v.tls(&at(&format!("endpoints[{j}].tls")), tls);
                }
            }
            if let Some(c) = &b.credentials {
                v.credentials(&at("credentials"), c);
            }
            let p = &b.pool;
            v.positive_u64(
                &at("pool.maxConnectionsPerEndpoint"),
                p.max_connections_per_endpoint.into(),
            );
            v.positive(&at("pool.leaseTimeout"), p.lease_timeout);
            v.positive(&at("pool.idleTimeout"), p.idle_timeout);
            v.positive(&at("pool.maxLifetime"), p.max_lifetime);
            v.positive(&at("pool.connectTimeout"), p.connect_timeout);
            if p.burst_per_endpoint > MAX_BURST_PER_ENDPOINT {
                v.push(
                    at("pool.burstPerEndpoint"),
                    format!(
                        "{} is above the largest, {MAX_BURST_PER_ENDPOINT}",
                        p.burst_per_endpoint
                    ),
                );
            }
            if let Some(throttle) = &p.soft_throttle {
                v.positive(&at("pool.softThrottle.perPending"), throttle.per_pending);
                if throttle.max.get() > std::time::Duration::from_secs(1) {
                    v.push(
                        at("pool.softThrottle.max"),
                        format!("{} is longer than 1s", throttle.max),
                    );
                }
            }
            let t = &b.timeouts;
            v.positive(&at("timeouts.firstByte"), t.first_byte);
            v.positive(&at("timeouts.total"), t.total);
            v.positive(&at("timeouts.streamIdle"), t.stream_idle);
            if t.first_byte > t.total {
                v.push(
                    at("timeouts.firstByte"),
                    format!("{} is longer than timeouts.total {}", t.first_byte, t.total),
                );
            }
            if let Some(h) = &b.health_check {
                if !h.path.starts_with('/') {
                    v.push(at("healthCheck.path"), "must start with /");
                }
                v.positive(&at("healthCheck.interval"), h.interval);
                v.positive(&at("healthCheck.timeout"), h.timeout);
                v.positive_u64(
                    &at("healthCheck.unhealthyThreshold"),
                    h.unhealthy_threshold.into(),
                );
                v.positive_u64(
                    &at("healthCheck.healthyThreshold"),
                    h.healthy_threshold.into(),
                );
            }
            if let Some(o) = &b.outlier_detection {
                v.positive_u64(
                    &at("outlierDetection.consecutiveFailures"),
                    o.consecutive_failures.into(),
                );
                v.positive(&at("outlierDetection.baseEjection"), o.base_ejection);
                if o.max_ejected_percent > 100 {
                    v.push(
                        at("outlierDetection.maxEjectedPercent"),
                        "must be at most 100",
                    );
                }
            }
            if let Some(cp) = &b.client_policy
                && !policy_names.contains(cp.as_str())
            {
                v.push(at("clientPolicy"), format!("no client policy named {cp:?}"));
            }
        }
        v.finish()
    }
}

/// Collects violations while a document is checked.
#[derive(Default)]
struct Validator {
    violations: Vec<Violation>,
}

impl Validator {
    /// An endpoint's TLS: a server name that is a DNS name or an IP address, absolute paths.
    fn tls(&mut self, at: &str, tls: &EndpointTls) {
        if let Some(name) = &tls.server_name
            && name.parse::<std::net::IpAddr>().is_err()
            && format!("{name}:443").parse::<EndpointAddress>().is_err()
        {
            self.push(
                format!("{at}.serverName"),
                format!("{name:?} is neither a DNS name nor an IP address"),
            );
        }
        if let Some(ca) = &tls.ca_file {
            self.absolute(&format!("{at}.caFile"), ca);
        }
        if let Some(c) = &tls.client_certificate {
            self.absolute(&format!("{at}.clientCertificate.certFile"), &c.cert_file);
            self.absolute(&format!("{at}.clientCertificate.keyFile"), &c.key_file);
        }
    }

    /// A backend's credentials: an absolute key file, a valid header exactly for `Header`.
    fn credentials(&mut self, at: &str, c: &Credentials) {
        self.absolute(&format!("{at}.keyFile"), &c.key_file);
        match (c.scheme, &c.header) {
            (CredentialScheme::Header, None) => {
                self.push(
                    format!("{at}.header"),
                    "the Header scheme needs a header name",
                );
            }
            (CredentialScheme::Header, Some(h)) if http_token(h).is_err() => {
                self.push(
                    format!("{at}.header"),
                    format!("{h:?} is not a valid header name"),
                );
            }
            (CredentialScheme::Bearer | CredentialScheme::AzureApiKey, Some(_)) => {
                self.push(
                    format!("{at}.header"),
                    "only the Header scheme takes a header name",
                );
            }
            _ => {}
        }
        for h in &c.remove_headers {
            if http_token(h).is_err() {
                self.push(
                    format!("{at}.removeHeaders"),
                    format!("{h:?} is not a valid header name"),
                );
            }
        }
    }

    fn absolute(&mut self, at: &str, path: &std::path::Path) {
        if !path.is_absolute() {
            self.push(
                at.to_owned(),
                format!("{} is not an absolute path", path.display()),
            );
        }
    }
}

impl Validator {
    fn push(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.violations.push(Violation {
            field: field.into(),
            message: message.into(),
        });
    }

    fn positive(&mut self, field: &str, d: Duration) {
        if d.is_zero() {
            self.push(field, "must be longer than 0s");
        }
    }

    /// A list of per-client shares at `list`: at most [`MAX_CLIENT_SHARES`], each keyed by a
    /// SHA-256 in hex, no client twice.
    fn shares<'a>(&mut self, list: &str, keys: impl ExactSizeIterator<Item = &'a str>) {
        if keys.len() > MAX_CLIENT_SHARES {
            self.push(
                list.to_owned(),
                format!("{} shares, at most {MAX_CLIENT_SHARES}", keys.len()),
            );
        }
        let mut seen = BTreeSet::new();
        for (j, key) in keys.enumerate() {
            let field = format!("{list}[{j}].keySha256");
            if !is_sha256_hex(key) {
                self.push(
                    field,
                    "must be 64 hex digits (the SHA-256 of the client's key)",
                );
            } else if !seen.insert(key.to_ascii_lowercase()) {
                self.push(field, "duplicate client");
            }
        }
    }

    fn positive_u64(&mut self, field: &str, n: u64) {
        if n == 0 {
            self.push(field, "must be at least 1");
        }
    }

    fn tokens(&mut self, at: &str, t: &TokenBudget) {
        let field = |f: &str| format!("{at}.{f}");
        if t.per_minute == 0 || t.per_minute > MAX_TOKENS_PER_MINUTE {
            self.push(
                field("perMinute"),
                format!("must be 1 to {MAX_TOKENS_PER_MINUTE}"),
            );
        }
        if let Some(day) = t.per_day
            && (day < t.per_minute || day > MAX_TOKENS_PER_MINUTE.saturating_mul(1440))
        {
            self.push(
                field("perDay"),
                "must be at least perMinute and at most 1440 times its largest",
            );
        }
        self.positive_u64(&field("defaultMaxTokens"), t.default_max_tokens);
        if t.requests_per_minute == Some(0) {
            self.push(field("requestsPerMinute"), "must be at least 1 when set");
        }
        match (t.count, t.weights) {
            (TokenCount::Weighted, None) => {
                self.push(field("weights"), "count: weighted needs weights");
            }
            (_, Some(w)) => {
                let ok = |x: f64| x.is_finite() && (0.0..=1000.0).contains(&x);
                if !ok(w.input) || !ok(w.output) || w.input + w.output <= 0.0 {
                    self.push(
                        field("weights"),
                        "each weight must be 0 to 1000, and not both 0",
                    );
                }
            }
            _ => {}
        }
    }

    /// Names become metric label values: keep them short and printable.
    fn name(&mut self, field: &str, name: &str) {
        let ok = !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !ok {
            self.push(
                field,
                format!("{name:?} must be 1 to 63 characters of a-z, A-Z, 0-9, '-', '_', '.'"),
            );
        }
    }

    fn finish(self) -> Result<(), InvalidLimits> {
        if self.violations.is_empty() {
            Ok(())
        } else {
            Err(InvalidLimits {
                violations: self.violations,
            })
        }
    }
}

/// Whether `s` is 64 hex digits, the form of a SHA-256 of a client's key.
fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `s` is a valid HTTP header name (an RFC 9110 token).
fn http_token(s: &str) -> Result<(), ()> {
    let ok = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if ok { Ok(()) } else { Err(()) }
}

#[cfg(test)]
mod tests;
