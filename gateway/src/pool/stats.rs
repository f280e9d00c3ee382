//! The pool's counts as `/v1/stats` shows them and the gauges are set from at each scrape
//! ([`PoolStats`], per endpoint [`EndpointStats`], per priority class [`ClassStats`], the burst
//! [`BurstStats`]).

use std::net::SocketAddr;

/// Counts of one endpoint, for `/v1/stats` and the gauges.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointStats {
    /// Endpoint name.
    pub name: String,
    /// Its address.
    pub address: SocketAddr,
    /// Slots carrying a request (an HTTP/1.1 connection, or a stream of an HTTP/2 one).
    pub leased: u32,
    /// Slots idle in the pool.
    pub idle: u32,
    /// Slots being opened.
    pub connecting: u32,
    /// Slots closed by the pool whose connection the peer has not closed yet (they keep their
    /// place under the cap).
    pub closing: u32,
    /// Sockets open (or being opened) to it, what its file descriptors count: the slots of
    /// HTTP/1.1, one per HTTP/2 connection however many streams it carries.
    pub sockets: u32,
    /// The smallest `SETTINGS_MAX_CONCURRENT_STREAMS` of its usable HTTP/2 connections
    /// (`4294967295`: the server set none); absent without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_streams_per_connection: Option<u32>,
    /// A `protocol: auto` endpoint called over HTTP/1.1 for the fallback cooldown: why, and
    /// for how much longer; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http2_fallback: Option<Fallback>,
    /// The cap in force: the share, beyond which only burst connections are opened.
    pub max: u32,
    /// Whether requests may be sent to it (probes pass, not ejected).
    pub healthy: bool,
    /// Whether passive outlier detection has it ejected.
    pub ejected: bool,
    /// Whether an operator drained it by hand (`POST .../drain`).
    pub drained: bool,
    /// Connections opened to it so far.
    pub created: u64,
    /// Leases it served with an idle pooled connection so far.
    pub reused: u64,
    /// How long a connection to it may stay idle, milliseconds: `idleTimeout`, or less once it
    /// was seen closing idle connections sooner.
    pub idle_timeout_ms: u64,
    /// The least idle time at which it closed a pooled connection, milliseconds, while that
    /// keeps the idle timeout lower; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_closed_idle_ms: Option<u64>,
}

/// An `auto` endpoint's HTTP/2 fallback in force, as `/v1/stats` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Fallback {
    /// `alpn_http1` (the server picked `http/1.1`) or `h2_refused` (it picked `h2`, then failed
    /// the HTTP/2 handshake).
    pub reason: &'static str,
    /// Whole seconds until new connections offer `h2` again (rounded up).
    pub remaining_seconds: u64,
}

/// Counts of one backend's pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Lease requests waiting.
    pub pending: u32,
    /// Per priority class, interactive first.
    pub classes: [ClassStats; 2],
    /// The most connections batch calls may hold (`batchMaxPercent` of the cap over the live
    /// endpoints); none: no cap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_cap: Option<u32>,
    /// The burst allowance and its use.
    pub burst: BurstStats,
    /// `maxPending` in force.
    pub max_pending: u32,
    /// Per endpoint.
    pub endpoints: Vec<EndpointStats>,
}

/// A pool's burst: connections it may open beyond the share, and those open beyond it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BurstStats {
    /// Connections per endpoint allowed beyond the share (`pool.burstPerEndpoint`, lowered by
    /// `listener.maxUpstreamConnections`).
    pub allowance: u32,
    /// Connections open beyond the share now, summed over the endpoints (closing ones
    /// included: the backend still counts them).
    pub bursting: u32,
}

/// Counts of one priority class in a pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ClassStats {
    /// `interactive` or `batch`.
    pub class: &'static str,
    /// Its lease requests waiting.
    pub pending: u32,
    /// Connections its calls hold (leased, or being opened for them).
    pub held: u32,
}
