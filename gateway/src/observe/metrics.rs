//! The gateway's Prometheus metrics: exactly the names and labels of the metric contract in
//! docs/design.md (what the operator queries), plus listener and reload counters; the standard
//! process metrics come from `poolpilot-telemetry`. Labels are
//! bounded: backend and endpoint names come from the limits, client labels are configured
//! override names or `other`, reasons and kinds are enums.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use poolpilot_api::limits::PriorityClass;
use poolpilot_telemetry::Format;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use super::incidents::{Incidents, NO_CLIENT};
use super::labels::{
    AdminFile, CloseReason, DownstreamTimeout, Refusal, RetryReason, TimeoutKind, TlsFailure,
    TlsHandshake, TokenDirection, TokenSource,
};

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DownstreamTimeoutLabel {
    kind: DownstreamTimeout,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RefusalLabel {
    outcome: Refusal,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BackendLabel {
    backend: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FallbackLabels {
    backend: String,
    to: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HostLabel {
    host: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct LookupLabels {
    host: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RetryLabels {
    backend: String,
    reason: RetryReason,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HandshakeLabels {
    backend: String,
    kind: TlsHandshake,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TlsFailureLabels {
    backend: String,
    reason: TlsFailure,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BackendReasonLabels {
    backend: String,
    reason: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BackendClassLabels {
    backend: String,
    class: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClassLabel {
    class: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct EndpointLabels {
    backend: String,
    endpoint: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ConnectionLabels {
    backend: String,
    endpoint: String,
    state: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClosedLabels {
    backend: String,
    endpoint: String,
    reason: CloseReason,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DurationLabels {
    backend: String,
    code_class: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TimeoutLabels {
    backend: String,
    kind: TimeoutKind,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TokenLabels {
    backend: String,
    direction: TokenDirection,
    source: TokenSource,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClientLabel {
    client: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClientPolicyLabels {
    client_policy: String,
    client: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TopTokensLabels {
    client_policy: String,
    client: String,
    direction: TokenDirection,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClientReasonLabels {
    client: String,
    reason: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct LimitsLabels {
    revision: String,
    generation: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SourceLabel {
    source: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct AdminReloadLabels {
    file: AdminFile,
    outcome: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// One endpoint's pool as its gauges show it (`poolpilot_pool_max_connections`,
/// `poolpilot_endpoint_healthy`, `poolpilot_pool_connections` by state, `poolpilot_pool_sockets`,
/// `poolpilot_upstream_h2_max_concurrent_streams`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct EndpointGauges<'a> {
    pub(crate) endpoint: &'a str,
    pub(crate) max: u32,
    pub(crate) healthy: bool,
    pub(crate) leased: u32,
    pub(crate) idle: u32,
    pub(crate) closing: u32,
    pub(crate) sockets: u32,
    pub(crate) max_streams: Option<u32>,
    pub(crate) h2_fallback: bool,
}

/// The `code_class` label of `poolpilot_upstream_request_duration_seconds`, by status hundred.
const CODE_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// The metric handles every call to one backend observes, resolved when the backend is built:
/// a call allocates no label and takes no family's lock for them. (These families are never
/// cleared, so a handle stays the one exported.)
#[derive(Clone, Debug)]
pub(crate) struct CallSignals {
    /// `poolpilot_upstream_request_duration_seconds`, by [`CODE_CLASSES`].
    duration: [Histogram; 5],
    /// `poolpilot_upstream_time_to_first_byte_seconds`.
    first_byte: Histogram,
    /// `poolpilot_upstream_response_bytes_total`.
    response_bytes: Counter,
    /// The lease hold of calls without a client policy (`client="none"`).
    hold_without_client: Histogram,
}

impl CallSignals {
    /// A call answered `status` (a status the gateway gave for it: 502, 504) after `secs`.
    pub(crate) fn duration(&self, status: u16, secs: f64) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.duration[class].observe(secs);
    }

    /// The first byte of a response body arrived `secs` after the call was sent.
    pub(crate) fn first_byte(&self, secs: f64) {
        self.first_byte.observe(secs);
    }

    /// The response-bytes counter, for a call to add to as its body arrives.
    pub(crate) fn response_bytes(&self) -> &Counter {
        &self.response_bytes
    }

    /// A call without a client policy held its lease for `held`.
    pub(crate) fn held_without_client(&self, held: std::time::Duration) {
        self.hold_without_client.observe(held.as_secs_f64());
    }
}

/// Every metric family of the gateway, registered in one registry. Cheap to clone (one
/// reference count: calls clone it); clones share the families.
#[derive(Clone)]
pub struct Metrics(Arc<Families>);

/// The families behind [`Metrics`].
struct Families {
    registry: parking_lot::Mutex<Registry>,
    pool_connections: Family<ConnectionLabels, Gauge>,
    pool_pending: Family<BackendLabel, Gauge>,
    pool_max_connections: Family<EndpointLabels, Gauge>,
    pool_sockets: Family<EndpointLabels, Gauge>,
    h2_max_streams: Family<EndpointLabels, Gauge>,
    pool_lease_wait: Family<BackendLabel, Histogram, LeaseWaitBuckets>,
    pool_lease_timeouts: Family<BackendLabel, Counter>,
    pool_burst_allowance: Family<BackendLabel, Gauge>,
    pool_burst_connections: Family<BackendLabel, Gauge>,
    pool_bursts: Family<BackendLabel, Counter>,
    pool_fair_reordered: Family<BackendLabel, Counter>,
    pool_class_pending: Family<BackendClassLabels, Gauge>,
    pool_class_leased: Family<BackendClassLabels, Gauge>,
    pool_class_lease_wait: Family<BackendClassLabels, Histogram, LeaseWaitBuckets>,
    client_class_queued: Family<ClassLabel, Gauge>,
    client_class_queue_wait: HistogramFamily<ClassLabel>,
    pool_created: Family<EndpointLabels, Counter>,
    pool_reused: Family<EndpointLabels, Counter>,
    endpoint_output_tokens: Family<EndpointLabels, Counter>,
    pool_closed: Family<ClosedLabels, Counter>,
    upstream_duration: HistogramFamily<DurationLabels>,
    upstream_first_byte: HistogramFamily<BackendLabel>,
    upstream_response_bytes: Family<BackendLabel, Counter>,
    upstream_timeouts: Family<TimeoutLabels, Counter>,
    upstream_retries: Family<RetryLabels, Counter>,
    tls_handshake: HistogramFamily<HandshakeLabels>,
    tls_failures: Family<TlsFailureLabels, Counter>,
    h2_fallbacks: Family<BackendReasonLabels, Counter>,
    h2_fallback: Family<EndpointLabels, Gauge>,
    pool_reuse_ratio: Family<BackendLabel, Gauge<f64, AtomicU64>>,
    client_cert_expiry: Family<BackendLabel, Gauge>,
    upstream_cooldowns: Family<BackendLabel, Counter>,
    upstream_cooldown_refused: Family<BackendLabel, Counter>,
    upstream_fallbacks: Family<FallbackLabels, Counter>,
    tokens: Family<TokenLabels, Counter>,
    time_to_first_token: HistogramFamily<BackendLabel>,
    time_per_output_token: HistogramFamily<BackendLabel>,
    client_inflight: Family<ClientLabel, Gauge>,
    client_tokens: Family<ClientPolicyLabels, Counter<f64, AtomicU64>>,
    client_top_tokens: Family<TopTokensLabels, Gauge<f64, AtomicU64>>,
    client_rejected: Family<ClientReasonLabels, Counter>,
    client_queue_wait: HistogramFamily<ClientLabel>,
    endpoint_healthy: Family<EndpointLabels, Gauge>,
    limits_info: Family<LimitsLabels, Gauge>,
    limits_loaded: Gauge,
    limits_rejected: Family<SourceLabel, Counter>,
    dns_lookups: Family<LookupLabels, Counter>,
    dns_stale: Family<HostLabel, Gauge>,
    dns_addresses: Family<HostLabel, Gauge>,
    accept_errors: Counter,
    downstream_connections: Gauge,
    downstream_rejected: Family<RefusalLabel, Counter>,
    downstream_timeouts: Family<DownstreamTimeoutLabel, Counter>,
    client_evictions: Counter,
    clients_tracked: Gauge,
    route_buffer_bytes: Gauge,
    route_buffer_rejected: Counter,
    admin_connections_refused: Counter,
    admin_reloads: Family<AdminReloadLabels, Counter>,
    incidents: Incidents,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn wait_histogram() -> Histogram {
    // 0.5ms .. ~16s: lease and queue waits span sub-millisecond to the lease timeout.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The buckets of the lease-wait histogram: 0.5 ms × 2ⁿ (to ~16 s) and the lease-time SLO's
/// boundary, 50 ms, so that "the share of leases within 50 ms" is a bucket, not an estimate.
pub fn default_lease_wait_buckets() -> Vec<f64> {
    let mut buckets: Vec<f64> = exponential_buckets(0.0005, 2.0, 16).collect();
    buckets.push(LEASE_SLO_SECONDS);
    buckets.sort_by(f64::total_cmp);
    buckets
}

/// The lease-time SLO's boundary (99.5% of leases within it), in seconds.
pub const LEASE_SLO_SECONDS: f64 = 0.05;

/// Builds lease-wait histograms with the configured buckets.
#[derive(Clone, Debug)]
struct LeaseWaitBuckets(Arc<[f64]>);

impl prometheus_client::metrics::family::MetricConstructor<Histogram> for LeaseWaitBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(self.0.iter().copied())
    }
}

fn handshake_histogram() -> Histogram {
    // 0.25ms .. ~8s: a resumed handshake on loopback to a full one across a continent.
    Histogram::new(exponential_buckets(0.00025, 2.0, 16))
}

fn token_time_histogram() -> Histogram {
    // 1ms .. ~33s: a token every millisecond to a first token after a long prefill.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

fn duration_histogram() -> Histogram {
    // 5ms .. ~160s: model calls run from milliseconds to minutes.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every family, with the default lease-wait buckets.
    pub fn new() -> Self {
        Self::with_lease_wait_buckets(default_lease_wait_buckets())
    }

    /// Creates and registers every family; lease waits are counted in `buckets` (seconds,
    /// sorted and de-duplicated here).
    pub fn with_lease_wait_buckets(mut buckets: Vec<f64>) -> Self {
        buckets.retain(|b| b.is_finite() && *b > 0.0);
        buckets.sort_by(f64::total_cmp);
        buckets.dedup();
        let mut r = Registry::default();
        let buckets: Arc<[f64]> = buckets.into();
        let m = Families {
            registry: parking_lot::Mutex::default(),
            pool_connections: Family::default(),
            pool_pending: Family::default(),
            pool_max_connections: Family::default(),
            pool_sockets: Family::default(),
            h2_max_streams: Family::default(),
            pool_lease_wait: Family::new_with_constructor(LeaseWaitBuckets(buckets.clone())),
            pool_lease_timeouts: Family::default(),
            pool_burst_allowance: Family::default(),
            pool_burst_connections: Family::default(),
            pool_bursts: Family::default(),
            pool_fair_reordered: Family::default(),
            pool_class_pending: Family::default(),
            pool_class_leased: Family::default(),
            pool_class_lease_wait: Family::new_with_constructor(LeaseWaitBuckets(buckets)),
            client_class_queued: Family::default(),
            client_class_queue_wait: Family::new_with_constructor(wait_histogram),
            pool_created: Family::default(),
            pool_reused: Family::default(),
            endpoint_output_tokens: Family::default(),
            pool_closed: Family::default(),
            upstream_duration: Family::new_with_constructor(duration_histogram),
            upstream_first_byte: Family::new_with_constructor(duration_histogram),
            upstream_response_bytes: Family::default(),
            upstream_timeouts: Family::default(),
            upstream_retries: Family::default(),
            tls_handshake: Family::new_with_constructor(handshake_histogram),
            tls_failures: Family::default(),
            h2_fallbacks: Family::default(),
            h2_fallback: Family::default(),
            pool_reuse_ratio: Family::default(),
            client_cert_expiry: Family::default(),
            upstream_cooldowns: Family::default(),
            upstream_cooldown_refused: Family::default(),
            upstream_fallbacks: Family::default(),
            tokens: Family::default(),
            time_to_first_token: Family::new_with_constructor(token_time_histogram),
            time_per_output_token: Family::new_with_constructor(token_time_histogram),
            client_inflight: Family::default(),
            client_tokens: Family::default(),
            client_top_tokens: Family::default(),
            client_rejected: Family::default(),
            client_queue_wait: Family::new_with_constructor(wait_histogram),
            endpoint_healthy: Family::default(),
            limits_info: Family::default(),
            limits_loaded: Gauge::default(),
            limits_rejected: Family::default(),
            dns_lookups: Family::default(),
            dns_stale: Family::default(),
            dns_addresses: Family::default(),
            accept_errors: Counter::default(),
            downstream_connections: Gauge::default(),
            downstream_rejected: Family::default(),
            downstream_timeouts: Family::default(),
            client_evictions: Counter::default(),
            clients_tracked: Gauge::default(),
            route_buffer_bytes: Gauge::default(),
            route_buffer_rejected: Counter::default(),
            admin_connections_refused: Counter::default(),
            admin_reloads: Family::default(),
            incidents: Incidents::new(),
        };
        m.incidents.register(&mut r);
        r.register(
            "poolpilot_pool_connections",
            "Open upstream connections by state (leased, idle, closing: closed by the pool, not yet by the backend)",
            m.pool_connections.clone(),
        );
        r.register(
            "poolpilot_pool_pending",
            "Lease requests waiting for a connection",
            m.pool_pending.clone(),
        );
        r.register(
            "poolpilot_pool_max_connections",
            "Cap on open connections per endpoint in this pod (the per-pod share in force)",
            m.pool_max_connections.clone(),
        );
        r.register(
            "poolpilot_pool_sockets",
            "Sockets open or being opened to the endpoint (its file descriptors): the connections of HTTP/1.1, one per HTTP/2 connection however many streams it carries",
            m.pool_sockets.clone(),
        );
        r.register(
            "poolpilot_upstream_h2_max_concurrent_streams",
            "The smallest SETTINGS_MAX_CONCURRENT_STREAMS of the endpoint's usable HTTP/2 connections (4294967295: none set); absent without one",
            m.h2_max_streams.clone(),
        );
        r.register_with_unit(
            "poolpilot_pool_lease_wait",
            "Time a request waited for a pooled connection",
            Unit::Seconds,
            m.pool_lease_wait.clone(),
        );
        r.register(
            "poolpilot_pool_lease_timeouts",
            "Lease requests that gave up after leaseTimeout",
            m.pool_lease_timeouts.clone(),
        );
        r.register(
            "poolpilot_pool_burst_allowance",
            "Connections per endpoint this pod may open beyond its share while lease requests wait (pool.burstPerEndpoint in force)",
            m.pool_burst_allowance.clone(),
        );
        r.register(
            "poolpilot_pool_burst_connections",
            "Open upstream connections beyond the share (burst connections), summed over the endpoints",
            m.pool_burst_connections.clone(),
        );
        r.register(
            "poolpilot_pool_bursts",
            "Burst connections opened: beyond the share, on the burst allowance",
            m.pool_bursts.clone(),
        );
        r.register(
            "poolpilot_pool_fair_reordered",
            "Grants that token-fair queueing made to a client before an older waiter of the same priority class",
            m.pool_fair_reordered.clone(),
        );
        r.register(
            "poolpilot_pool_class_pending",
            "Lease requests waiting for a connection, by priority class (interactive, batch)",
            m.pool_class_pending.clone(),
        );
        r.register(
            "poolpilot_pool_class_leased",
            "Upstream connections held by calls of each priority class (leased, or being opened for them)",
            m.pool_class_leased.clone(),
        );
        r.register_with_unit(
            "poolpilot_pool_class_lease_wait",
            "Time a request waited for a pooled connection, by priority class",
            Unit::Seconds,
            m.pool_class_lease_wait.clone(),
        );
        r.register(
            "poolpilot_client_class_queued",
            "Calls waiting in their clients' queues, by priority class",
            m.client_class_queued.clone(),
        );
        r.register_with_unit(
            "poolpilot_client_class_queue_wait",
            "Time a request waited in its client's queue, by priority class",
            Unit::Seconds,
            m.client_class_queue_wait.clone(),
        );
        r.register(
            "poolpilot_pool_connections_created",
            "Upstream connections opened",
            m.pool_created.clone(),
        );
        r.register(
            "poolpilot_pool_connections_reused",
            "Leases served by an idle pooled connection",
            m.pool_reused.clone(),
        );
        r.register(
            "poolpilot_pool_connections_closed",
            "Upstream connections closed, by reason",
            m.pool_closed.clone(),
        );
        r.register_with_unit(
            "poolpilot_upstream_request_duration",
            "Upstream call duration, from sending the request to the end of the response",
            Unit::Seconds,
            m.upstream_duration.clone(),
        );
        r.register_with_unit(
            "poolpilot_upstream_time_to_first_byte",
            "Upstream time to first byte: from sending the request to the first byte of the response body (the end of a response without one); for a streamed answer, the time to its first token",
            Unit::Seconds,
            m.upstream_first_byte.clone(),
        );
        r.register_with_unit(
            "poolpilot_upstream_response",
            "Response body bytes received from the backend (a model server's work done, whatever the output lengths)",
            Unit::Bytes,
            m.upstream_response_bytes.clone(),
        );
        r.register(
            "poolpilot_upstream_timeouts",
            "Upstream calls cut by a timeout, by kind",
            m.upstream_timeouts.clone(),
        );
        r.register(
            "poolpilot_upstream_retries",
            "Requests re-sent on another connection because a reused one failed them before any byte of a response, by reason",
            m.upstream_retries.clone(),
        );
        r.register_with_unit(
            "poolpilot_upstream_tls_handshake",
            "TLS handshakes on new upstream connections, by kind (full, resumed: a session of an earlier connection)",
            Unit::Seconds,
            m.tls_handshake.clone(),
        );
        r.register(
            "poolpilot_upstream_tls_failures",
            "Upstream TLS handshakes that failed, by reason (certificate: the server's did not verify; alert: the server refused; handshake: anything else); never retried in plain text",
            m.tls_failures.clone(),
        );
        r.register(
            "poolpilot_upstream_h2_fallbacks",
            "Times an address of a protocol: auto backend went to HTTP/1.1 for the fallback cooldown, by reason (alpn_http1: the server picked http/1.1; h2_refused: it picked h2, then failed the HTTP/2 handshake)",
            m.h2_fallbacks.clone(),
        );
        r.register(
            "poolpilot_upstream_h2_fallback",
            "1 while an endpoint of a protocol: auto backend is called over HTTP/1.1 for the fallback cooldown (its TLS offers only http/1.1 until then)",
            m.h2_fallback.clone(),
        );
        r.register_with_unit(
            "poolpilot_upstream_client_cert_expiry",
            "When the client certificate the gateway offers a backend's TLS endpoints (mTLS) expires: its notAfter, unix time; the earliest over the backend's endpoints",
            Unit::Seconds,
            m.client_cert_expiry.clone(),
        );
        r.register(
            "poolpilot_pool_reuse_ratio",
            "Leases served by an idle pooled connection, as a share of all leases: reused / (created + reused), over the endpoints in the limits",
            m.pool_reuse_ratio.clone(),
        );
        r.register(
            "poolpilot_upstream_cooldowns",
            "Provider refusals (429, 503) with Retry-After that put a backend carrying the provider's key in a cooldown",
            m.upstream_cooldowns.clone(),
        );
        r.register(
            "poolpilot_upstream_cooldown_refused",
            "Calls answered 429 by the gateway while their backend's provider had asked not to be called",
            m.upstream_cooldown_refused.clone(),
        );
        r.register(
            "poolpilot_upstream_fallbacks",
            "Calls sent to a fallback backend (to) because their backend was cooling down",
            m.upstream_fallbacks.clone(),
        );
        r.register(
            "poolpilot_tokens",
            "Model tokens of calls, by backend, direction (input, cached_input: the part of input a backend served from its cache, output) and source (usage: the backend's own count; chunks: a stream without usage, one token a content chunk, exact for servers that stream a token a chunk; estimate: the gateway's estimate before the call)",
            m.tokens.clone(),
        );
        r.register(
            "poolpilot_endpoint_output_tokens",
            "Output tokens of calls by the endpoint (backend instance) that served them, counted as poolpilot_tokens_total counts them (the backend's usage, else a stream's content chunks, else the estimate): rate() is an instance's output tokens a second",
            m.endpoint_output_tokens.clone(),
        );
        r.register_with_unit(
            "poolpilot_time_to_first_token",
            "Streamed calls: from sending the request to the first SSE chunk carrying output (OpenTelemetry's gen_ai.server.time_to_first_token)",
            Unit::Seconds,
            m.time_to_first_token.clone(),
        );
        r.register_with_unit(
            "poolpilot_time_per_output_token",
            "Streamed calls: from the first output chunk to the last, over the output tokens after the first (OpenTelemetry's gen_ai.server.time_per_output_token)",
            Unit::Seconds,
            m.time_per_output_token.clone(),
        );
        r.register(
            "poolpilot_client_tokens",
            "Tokens charged to clients' token budgets, settled (the budget's units: total, output or weighted), by client policy and client (an override's name, or other); the operator divides the fleet-wide budgets by each pod's rate of it",
            m.client_tokens.clone(),
        );
        r.register(
            "poolpilot_client_top_tokens_per_second",
            "Tokens a second of each client policy's top clients by tokens over the last 10 s, by direction (input, output): at most 10 clients a policy, named as /v1/stats names them (an override's name, else sha256: and 12 hex digits of the key's digest; rank:N for a client policy that identifies clients by their address), the rest summed as client=\"other\"; set at each scrape",
            m.client_top_tokens.clone(),
        );
        r.register(
            "poolpilot_client_inflight",
            "Calls in flight per client",
            m.client_inflight.clone(),
        );
        r.register(
            "poolpilot_client_rejected",
            "Client requests rejected, by reason",
            m.client_rejected.clone(),
        );
        r.register_with_unit(
            "poolpilot_client_queue_wait",
            "Time a request waited in its client's queue",
            Unit::Seconds,
            m.client_queue_wait.clone(),
        );
        r.register(
            "poolpilot_endpoint_healthy",
            "1 when the endpoint may receive requests (probes pass, not ejected)",
            m.endpoint_healthy.clone(),
        );
        r.register(
            "poolpilot_limits_info",
            "The limits document in force",
            m.limits_info.clone(),
        );
        r.register(
            "poolpilot_limits_loaded",
            "1 once a limits document was loaded (limits file or PUT /v1/limits); 0: no ConnectionPolicy has reached this pod, which answers every call 503 no_backends",
            m.limits_loaded.clone(),
        );
        r.register(
            "poolpilot_limits_rejected",
            "Limits documents refused (invalid or stale), by source",
            m.limits_rejected.clone(),
        );
        r.register(
            "poolpilot_dns_lookups",
            "Lookups of DNS-named endpoints, by name and outcome (ok, failed)",
            m.dns_lookups.clone(),
        );
        r.register(
            "poolpilot_dns_stale",
            "1 while the last lookup of a DNS-named endpoint failed: its pools serve the last good answer (none before the first)",
            m.dns_stale.clone(),
        );
        r.register(
            "poolpilot_dns_addresses",
            "Addresses of a DNS-named endpoint's last good answer (one pool endpoint each)",
            m.dns_addresses.clone(),
        );
        r.register(
            "poolpilot_listener_accept_errors",
            "Errors accepting client connections",
            m.accept_errors.clone(),
        );
        r.register(
            "poolpilot_downstream_connections",
            "Open client connections",
            m.downstream_connections.clone(),
        );
        r.register(
            "poolpilot_downstream_connections_rejected",
            "Client connections over their source's cap: answered 429, or dropped beyond the answer rate",
            m.downstream_rejected.clone(),
        );
        r.register(
            "poolpilot_downstream_timeouts",
            "Calls cut because of the client: a response it stopped reading, a request body too slow",
            m.downstream_timeouts.clone(),
        );
        r.register(
            "poolpilot_client_evictions",
            "Idle clients forgotten to make room in a full client table",
            m.client_evictions.clone(),
        );
        r.register(
            "poolpilot_clients_tracked",
            "Entries of the client tables (clients with calls in flight or queued, or history)",
            m.clients_tracked.clone(),
        );
        r.register_with_unit(
            "poolpilot_route_buffer",
            "Request body bytes held for routing by model, pod-wide",
            Unit::Bytes,
            m.route_buffer_bytes.clone(),
        );
        r.register(
            "poolpilot_route_buffer_rejected",
            "Requests refused because their routing buffer would exceed routeBufferBudget",
            m.route_buffer_rejected.clone(),
        );
        // process_open_fds and process_max_fds are part of the metric contract: the operator's
        // fd check reads them. The standard collector reads them at every scrape.
        poolpilot_telemetry::register(&mut r);
        r.register(
            "poolpilot_admin_connections_refused",
            "Admin connections closed at once because adminMaxConnections were open",
            m.admin_connections_refused.clone(),
        );
        r.register(
            "poolpilot_admin_reloads",
            "Changes of the admin token or certificate files, applied or refused (the old one kept)",
            m.admin_reloads.clone(),
        );
        *m.registry.lock() = r;
        Self(Arc::new(m))
    }

    /// The incident signals (runtime, holds, reclaims, connection ages): `observe/incidents.rs`.
    pub fn incidents(&self) -> &Incidents {
        &self.0.incidents
    }

    /// The OpenMetrics exposition of every family.
    pub fn encode(&self) -> String {
        self.encode_as(Format::OpenMetrics)
    }

    /// The exposition of every family in the format a scraper negotiated.
    pub fn encode_as(&self, format: Format) -> String {
        poolpilot_telemetry::exposition::encode(&self.0.registry.lock(), format)
    }

    // --- pool ---

    pub(crate) fn lease_wait(&self, backend: &str) -> Histogram {
        self.0.pool_lease_wait.get_or_create_owned(&BackendLabel {
            backend: backend.into(),
        })
    }

    /// The lease-wait histogram of one class of `backend`.
    pub(crate) fn class_lease_wait(&self, backend: &str, class: PriorityClass) -> Histogram {
        self.0
            .pool_class_lease_wait
            .get_or_create_owned(&BackendClassLabels {
                backend: backend.into(),
                class: class.as_str(),
            })
    }

    /// One backend's per-class gauges: `(pending, leased)` for interactive, then batch.
    pub(crate) fn set_pool_classes(&self, backend: &str, classes: [(u32, u32); 2]) {
        for (class, (pending, leased)) in PriorityClass::ALL.into_iter().zip(classes) {
            let labels = BackendClassLabels {
                backend: backend.into(),
                class: class.as_str(),
            };
            self.0
                .pool_class_pending
                .get_or_create(&labels)
                .set(pending.into());
            self.0
                .pool_class_leased
                .get_or_create(&labels)
                .set(leased.into());
        }
    }

    pub(crate) fn lease_timeouts(&self, backend: &str) -> Counter {
        self.0
            .pool_lease_timeouts
            .get_or_create_owned(&BackendLabel {
                backend: backend.into(),
            })
    }

    /// The counter of burst connections opened to `backend`.
    pub(crate) fn bursts(&self, backend: &str) -> Counter {
        self.0.pool_bursts.get_or_create_owned(&BackendLabel {
            backend: backend.into(),
        })
    }

    /// The counter of grants that token fairness reordered on `backend`.
    pub(crate) fn fair_reordered(&self, backend: &str) -> Counter {
        self.0
            .pool_fair_reordered
            .get_or_create_owned(&BackendLabel {
                backend: backend.into(),
            })
    }

    /// One backend's burst gauges: the allowance per endpoint, the connections beyond the
    /// share.
    pub(crate) fn set_pool_burst(&self, backend: &str, allowance: u32, bursting: u32) {
        let labels = BackendLabel {
            backend: backend.into(),
        };
        self.0
            .pool_burst_allowance
            .get_or_create(&labels)
            .set(allowance.into());
        self.0
            .pool_burst_connections
            .get_or_create(&labels)
            .set(bursting.into());
    }

    /// `(created, reused, output tokens)` counters of one endpoint.
    pub(crate) fn endpoint_counters(
        &self,
        backend: &str,
        endpoint: &str,
    ) -> (Counter, Counter, Counter) {
        let labels = EndpointLabels {
            backend: backend.into(),
            endpoint: endpoint.into(),
        };
        (
            self.0.pool_created.get_or_create_owned(&labels),
            self.0.pool_reused.get_or_create_owned(&labels),
            self.0.endpoint_output_tokens.get_or_create_owned(&labels),
        )
    }

    pub(crate) fn connection_closed(&self, backend: &str, endpoint: &str, reason: CloseReason) {
        let labels = ClosedLabels {
            backend: backend.into(),
            endpoint: endpoint.into(),
            reason,
        };
        self.0.pool_closed.get_or_create(&labels).inc();
    }

    /// Clears the gauges computed from live state, before they are set again. (Never the
    /// families behind [`CallSignals`]: backends hold their handles, which a cleared family
    /// would no longer export.)
    pub(crate) fn clear_gauges(&self) {
        self.0.pool_connections.clear();
        self.0.pool_pending.clear();
        self.0.pool_burst_allowance.clear();
        self.0.pool_burst_connections.clear();
        self.0.pool_class_pending.clear();
        self.0.pool_class_leased.clear();
        self.0.client_class_queued.clear();
        self.0.pool_max_connections.clear();
        self.0.pool_sockets.clear();
        self.0.h2_fallback.clear();
        self.0.h2_max_streams.clear();
        self.0.pool_reuse_ratio.clear();
        self.0.client_cert_expiry.clear();
        self.0.endpoint_healthy.clear();
        self.0.client_inflight.clear();
        self.0.client_top_tokens.clear();
    }

    pub(crate) fn set_pool_pending(&self, backend: &str, pending: u32) {
        self.0
            .pool_pending
            .get_or_create(&BackendLabel {
                backend: backend.into(),
            })
            .set(pending.into());
    }

    /// One endpoint's pool gauges, from the pool's live state at a scrape.
    pub(crate) fn set_endpoint_gauges(&self, backend: &str, ep: EndpointGauges<'_>) {
        let labels = EndpointLabels {
            backend: backend.into(),
            endpoint: ep.endpoint.to_owned(),
        };
        self.0
            .pool_max_connections
            .get_or_create(&labels)
            .set(ep.max.into());
        self.0
            .endpoint_healthy
            .get_or_create(&labels)
            .set(ep.healthy.into());
        self.0
            .pool_sockets
            .get_or_create(&labels)
            .set(ep.sockets.into());
        if let Some(max) = ep.max_streams {
            self.0.h2_max_streams.get_or_create(&labels).set(max.into());
        }
        if ep.h2_fallback {
            self.0.h2_fallback.get_or_create(&labels).set(1);
        }
        for (state, value) in [
            ("leased", ep.leased),
            ("idle", ep.idle),
            ("closing", ep.closing),
        ] {
            let labels = ConnectionLabels {
                backend: backend.into(),
                endpoint: ep.endpoint.to_owned(),
                state,
            };
            self.0
                .pool_connections
                .get_or_create(&labels)
                .set(value.into());
        }
    }

    // --- upstream ---

    /// The handles every call to `backend` observes, resolved once (see [`CallSignals`]).
    pub(crate) fn call_signals(&self, backend: &str) -> CallSignals {
        let families = &self.0;
        let by_backend = BackendLabel {
            backend: backend.into(),
        };
        CallSignals {
            duration: CODE_CLASSES.map(|code_class| {
                families
                    .upstream_duration
                    .get_or_create_owned(&DurationLabels {
                        backend: backend.into(),
                        code_class,
                    })
            }),
            first_byte: families
                .upstream_first_byte
                .get_or_create_owned(&by_backend),
            response_bytes: families
                .upstream_response_bytes
                .get_or_create_owned(&by_backend),
            hold_without_client: families.incidents.lease_hold(backend, NO_CLIENT),
        }
    }

    pub(crate) fn tokens(
        &self,
        backend: &str,
        direction: TokenDirection,
        source: TokenSource,
        n: u64,
    ) {
        self.0
            .tokens
            .get_or_create(&TokenLabels {
                backend: backend.into(),
                direction,
                source,
            })
            .inc_by(n);
    }

    /// The counter of the tokens charged to the budgets of `client` (override name or
    /// `other`) of client policy `policy`, for a reservation to add its settled cost to.
    pub(crate) fn client_tokens(&self, policy: &str, client: &str) -> Counter<f64, AtomicU64> {
        self.0
            .client_tokens
            .get_or_create_owned(&ClientPolicyLabels {
                client_policy: policy.into(),
                client: client.into(),
            })
    }

    pub(crate) fn time_to_first_token(&self, backend: &str, secs: f64) {
        self.0
            .time_to_first_token
            .get_or_create(&BackendLabel {
                backend: backend.into(),
            })
            .observe(secs);
    }

    pub(crate) fn time_per_output_token(&self, backend: &str, secs: f64) {
        self.0
            .time_per_output_token
            .get_or_create(&BackendLabel {
                backend: backend.into(),
            })
            .observe(secs);
    }

    pub(crate) fn upstream_timeout(&self, backend: &str, kind: TimeoutKind) {
        self.0
            .upstream_timeouts
            .get_or_create(&TimeoutLabels {
                backend: backend.into(),
                kind,
            })
            .inc();
    }

    pub(crate) fn upstream_retry(&self, backend: &str, reason: RetryReason) {
        self.0
            .upstream_retries
            .get_or_create(&RetryLabels {
                backend: backend.into(),
                reason,
            })
            .inc();
    }

    pub(crate) fn tls_handshake(&self, backend: &str, kind: TlsHandshake, secs: f64) {
        self.0
            .tls_handshake
            .get_or_create(&HandshakeLabels {
                backend: backend.into(),
                kind,
            })
            .observe(secs);
    }

    pub(crate) fn h2_fallback(&self, backend: &str, reason: &'static str) {
        self.0
            .h2_fallbacks
            .get_or_create(&BackendReasonLabels {
                backend: backend.into(),
                reason,
            })
            .inc();
    }

    pub(crate) fn tls_failure(&self, backend: &str, reason: TlsFailure) {
        self.0
            .tls_failures
            .get_or_create(&TlsFailureLabels {
                backend: backend.into(),
                reason,
            })
            .inc();
    }

    pub(crate) fn upstream_cooldown(&self, backend: &str) {
        self.0
            .upstream_cooldowns
            .get_or_create(&BackendLabel {
                backend: backend.into(),
            })
            .inc();
    }

    pub(crate) fn upstream_cooldown_refused(&self, backend: &str) {
        self.0
            .upstream_cooldown_refused
            .get_or_create(&BackendLabel {
                backend: backend.into(),
            })
            .inc();
    }

    /// Creates at zero the series of a backend's rare events: its provider's refusals and the
    /// calls meanwhile (with `credentials`), its failed certificate checks (with TLS
    /// endpoints), its calls to each fallback. A series born at its first event holds it in
    /// Prometheus' first sample of it, and `increase()` shows nothing until the next one: the
    /// operator would miss an isolated refusal.
    pub(crate) fn backend_event_series(
        &self,
        backend: &str,
        credentials: bool,
        tls: bool,
        fallback: &[String],
    ) {
        let label = BackendLabel {
            backend: backend.into(),
        };
        if credentials {
            self.0.upstream_cooldowns.get_or_create(&label).inc_by(0);
            self.0
                .upstream_cooldown_refused
                .get_or_create(&label)
                .inc_by(0);
        }
        if tls {
            self.0
                .tls_failures
                .get_or_create(&TlsFailureLabels {
                    backend: backend.into(),
                    reason: TlsFailure::Certificate,
                })
                .inc_by(0);
        }
        for to in fallback {
            self.0
                .upstream_fallbacks
                .get_or_create(&FallbackLabels {
                    backend: backend.into(),
                    to: to.clone(),
                })
                .inc_by(0);
        }
    }

    pub(crate) fn upstream_fallback(&self, backend: &str, to: &str) {
        self.0
            .upstream_fallbacks
            .get_or_create(&FallbackLabels {
                backend: backend.into(),
                to: to.into(),
            })
            .inc();
    }

    /// A backend's reuse ratio, from its endpoints' counters at a scrape (none yet: unset).
    pub(crate) fn set_reuse_ratio(&self, backend: &str, created: u64, reused: u64) {
        if created + reused == 0 {
            return;
        }
        self.0
            .pool_reuse_ratio
            .get_or_create(&BackendLabel {
                backend: backend.into(),
            })
            .set(reused as f64 / (created + reused) as f64);
    }

    /// The earliest `notAfter` (unix seconds) of a backend's upstream client certificates, at a
    /// scrape.
    pub(crate) fn set_client_cert_expiry(&self, backend: &str, not_after: i64) {
        self.0
            .client_cert_expiry
            .get_or_create(&BackendLabel {
                backend: backend.into(),
            })
            .set(not_after);
    }

    // --- clients ---

    pub(crate) fn client_rejected(&self, client: &str, reason: &'static str) {
        self.0
            .client_rejected
            .get_or_create(&ClientReasonLabels {
                client: client.into(),
                reason,
            })
            .inc();
    }

    pub(crate) fn client_queue_wait(&self, client: &str, secs: f64) {
        self.0
            .client_queue_wait
            .get_or_create(&ClientLabel {
                client: client.into(),
            })
            .observe(secs);
    }

    pub(crate) fn client_class_queue_wait(&self, class: PriorityClass, secs: f64) {
        self.0
            .client_class_queue_wait
            .get_or_create(&ClassLabel {
                class: class.as_str(),
            })
            .observe(secs);
    }

    /// Calls queued in the clients' queues, interactive then batch.
    pub(crate) fn set_client_classes_queued(&self, queued: [u32; 2]) {
        for (class, n) in PriorityClass::ALL.into_iter().zip(queued) {
            self.0
                .client_class_queued
                .get_or_create(&ClassLabel {
                    class: class.as_str(),
                })
                .set(n.into());
        }
    }

    /// Tokens a second of `client` of `policy` (one of its top clients, or `other`: the rest).
    pub(crate) fn set_client_top_tokens(
        &self,
        policy: &str,
        client: &str,
        input: f64,
        output: f64,
    ) {
        for (direction, v) in [
            (TokenDirection::Input, input),
            (TokenDirection::Output, output),
        ] {
            self.0
                .client_top_tokens
                .get_or_create(&TopTokensLabels {
                    client_policy: policy.into(),
                    client: client.into(),
                    direction,
                })
                .set(v);
        }
    }

    pub(crate) fn set_client_inflight(&self, client: &str, n: u32) {
        self.0
            .client_inflight
            .get_or_create(&ClientLabel {
                client: client.into(),
            })
            .set(n.into());
    }

    // --- limits, listener, process ---

    pub(crate) fn set_limits_info(&self, revision: &str, generation: u64) {
        self.0.limits_info.clear();
        let labels = LimitsLabels {
            revision: revision.into(),
            generation: generation.to_string(),
        };
        self.0.limits_info.get_or_create(&labels).set(1);
    }

    pub(crate) fn set_limits_loaded(&self, loaded: bool) {
        self.0.limits_loaded.set(loaded.into());
    }

    pub(crate) fn limits_rejected(&self, source: &'static str) {
        self.0
            .limits_rejected
            .get_or_create(&SourceLabel { source })
            .inc();
    }

    // --- DNS-named endpoints ---

    pub(crate) fn dns_resolved(&self, host: &str, ok: bool) {
        let outcome = if ok { "ok" } else { "failed" };
        self.0
            .dns_lookups
            .get_or_create(&LookupLabels {
                host: host.into(),
                outcome,
            })
            .inc();
        self.0
            .dns_stale
            .get_or_create(&HostLabel { host: host.into() })
            .set(i64::from(!ok));
    }

    pub(crate) fn dns_addresses(&self, host: &str, count: usize) {
        self.0
            .dns_addresses
            .get_or_create(&HostLabel { host: host.into() })
            .set(count as i64);
    }

    /// A name no longer wanted: its gauges go (its counters stay, as counters do).
    pub(crate) fn dns_forget(&self, host: &str) {
        let label = HostLabel { host: host.into() };
        self.0.dns_stale.remove(&label);
        self.0.dns_addresses.remove(&label);
    }

    pub(crate) fn accept_error(&self) {
        self.0.accept_errors.inc();
    }

    pub(crate) fn downstream_connections(&self) -> &Gauge {
        &self.0.downstream_connections
    }

    pub(crate) fn downstream_rejected(&self, outcome: Refusal) {
        self.0
            .downstream_rejected
            .get_or_create(&RefusalLabel { outcome })
            .inc();
    }

    pub(crate) fn downstream_timeout(&self, kind: DownstreamTimeout) {
        self.0
            .downstream_timeouts
            .get_or_create(&DownstreamTimeoutLabel { kind })
            .inc();
    }

    pub(crate) fn client_evicted(&self) {
        self.0.client_evictions.inc();
    }

    pub(crate) fn route_buffer_rejected(&self) {
        self.0.route_buffer_rejected.inc();
    }

    pub(crate) fn set_clients_tracked(&self, n: usize) {
        self.0.clients_tracked.set(n as i64);
    }

    pub(crate) fn set_route_buffer_bytes(&self, bytes: u64) {
        self.0.route_buffer_bytes.set(bytes as i64);
    }

    // --- admin ---

    pub(crate) fn admin_connection_refused(&self) {
        self.0.admin_connections_refused.inc();
    }

    pub(crate) fn admin_file_reloaded(&self, file: AdminFile, applied: bool) {
        let outcome = if applied { "applied" } else { "refused" };
        self.0
            .admin_reloads
            .get_or_create(&AdminReloadLabels { file, outcome })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backends_call_signals_are_the_series_its_labels_name() {
        let metrics = Metrics::new();
        let signals = metrics.call_signals("models");
        signals.duration(204, 0.2);
        signals.duration(502, 0.1);
        signals.duration(504, 0.3);
        signals.first_byte(0.05);
        signals.response_bytes().inc_by(64);
        signals.held_without_client(std::time::Duration::from_millis(20));
        // Resolved again (a backend built anew by a later document): the same series.
        metrics.call_signals("models").duration(200, 0.2);
        let text = metrics.encode_as(Format::Text);
        for line in [
            r#"poolpilot_upstream_request_duration_seconds_count{backend="models",code_class="2xx"} 2"#,
            r#"poolpilot_upstream_request_duration_seconds_count{backend="models",code_class="5xx"} 2"#,
            r#"poolpilot_upstream_time_to_first_byte_seconds_count{backend="models"} 1"#,
            r#"poolpilot_upstream_response_bytes_total{backend="models"} 64"#,
            r#"poolpilot_pool_lease_hold_seconds_count{backend="models",client="none"} 1"#,
        ] {
            assert!(text.contains(line), "no {line} in\n{text}");
        }
        assert!(!text.contains(r#"code_class="1xx"} 1"#), "{text}");
    }
}
