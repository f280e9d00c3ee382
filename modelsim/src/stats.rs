//! What a modelsim reports of itself: the [`Stats`] snapshot (`GET /admin/stats`,
//! [`Modelsim::stats`](crate::Modelsim::stats), [`Remote::stats`](crate::Remote::stats)) and the
//! per-connection detail of the connection peak. Plain data, shared by the server and its clients.

use serde::{Deserialize, Serialize};

/// A snapshot of a modelsim's state, from [`Modelsim::stats`](crate::Modelsim::stats) or
/// `GET /admin/stats` (same JSON field names).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// The instance name.
    pub instance: String,
    /// TCP connections on the serving listener that are open right now (accepted and not yet
    /// closed by either side). Connections still in the kernel's accept backlog are not counted.
    pub connections_open: u64,
    /// Highest `connections_open` since start or the last peak reset.
    pub connections_peak: u64,
    /// The serving connections open when `connections_open` last reached `connections_peak`
    /// (or when the peaks were reset), oldest first; empty when the peak was above
    /// [`PEAK_DETAIL_LIMIT`].
    #[serde(default)]
    pub connections_at_peak: Vec<ConnectionAtPeak>,
    /// Connections accepted on the serving listener since start.
    pub connections_accepted: u64,
    /// Connections closed by the idle-close fault.
    pub connections_closed_idle: u64,
    /// Connections reset by the reset fault.
    pub connections_reset: u64,
    /// Failed accepts (e.g. EMFILE when the process is out of file descriptors).
    pub accept_errors: u64,
    /// Connections open on the admin listener (not part of `connections_open`).
    pub admin_connections_open: u64,
    /// Inference requests holding a concurrency slot now.
    pub in_flight: u64,
    /// Highest `in_flight` since start or the last peak reset.
    pub in_flight_peak: u64,
    /// Inference requests waiting for a slot now.
    pub queued: u64,
    /// Highest `queued` since start or the last peak reset.
    pub queued_peak: u64,
    /// Inference requests hanging on the stall fault now (before their response head).
    pub stalled: u64,
    /// Configured concurrency slots.
    pub max_concurrency: u64,
    /// Configured queue length.
    pub max_queue: u64,
    /// Inference requests received (well-formed or not).
    pub requests_received: u64,
    /// Inference requests answered in full.
    pub served: u64,
    /// Inference requests refused because the queue was full.
    pub refused: u64,
    /// Inference requests refused by the provider's rate limit (429 with `Retry-After`).
    #[serde(default)]
    pub rate_limited: u64,
    /// Inference requests rejected as malformed (400) or for an unknown model (404).
    pub rejected_invalid: u64,
    /// Inference requests abandoned by their client before the answer was complete.
    pub cancelled: u64,
    /// Injected error responses.
    pub errors_injected: u64,
    /// Injected connection resets.
    pub resets_injected: u64,
    /// Injected stalls (before the head or mid-response).
    pub stalls_injected: u64,
    /// Output tokens produced.
    pub tokens_generated: u64,
    /// Prompt tokens looked up in the prefix cache (`vllm:prefix_cache_queries_total`; 0 while
    /// the cache is off).
    #[serde(default)]
    pub prefix_cache_queries: u64,
    /// Of them, tokens served from it (`vllm:prefix_cache_hits_total`).
    #[serde(default)]
    pub prefix_cache_hits: u64,
    /// The server is shutting down.
    pub draining: bool,
}

/// Peaks above this many connections are counted without the per-connection detail (taking it
/// at every new peak costs O(open connections)).
pub const PEAK_DETAIL_LIMIT: usize = 1024;

/// One serving connection as it was at the connection peak.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionAtPeak {
    /// The peer's address.
    pub peer: String,
    /// Milliseconds since it was accepted.
    pub age_ms: u64,
    /// Milliseconds since a byte last moved or a request finished on it (0 while a request is
    /// in progress).
    pub idle_ms: u64,
    /// Whether a request was in progress on it.
    pub in_request: bool,
    /// The `X-Forwarded-For` header of the last request it carried, if any: which client a
    /// proxy in front was serving on it.
    pub forwarded_for: Option<String>,
}
