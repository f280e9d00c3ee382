//! The limits a client connection keeps from its accept on ([`ConnLimits`]): its idle,
//! header-read and send timeouts, head limits, HTTP/2 streams and pings. A new limits document
//! applies to the connections accepted after it.

use std::time::Duration;

use crate::live::Gateway;

/// hyper's smallest HTTP/1 read buffer; smaller head limits are enforced per request.
const MIN_BUF: usize = 8192;

/// The header count hyper's HTTP/1 parser holds when none is set (`DEFAULT_MAX_HEADERS` in its
/// `proto/h1/role.rs`): its header arrays are then built inline at no cost, while a count set
/// explicitly, even this one, fills them element by element on every request.
const HYPER_MAX_HEADERS: usize = 100;

/// The limits a connection keeps from its accept on (later limits apply to new connections).
#[derive(Clone, Copy, Debug)]
pub(super) struct ConnLimits {
    pub(super) idle_timeout: Duration,
    pub(super) header_read_timeout: Duration,
    pub(super) send_timeout: Duration,
    /// The HTTP/1 parser's header count to set: `None` when it is hyper's own.
    pub(super) h1_max_headers: Option<usize>,
    pub(super) max_headers: usize,
    pub(super) max_buf_size: usize,
    pub(super) max_header_list_size: u32,
    pub(super) h2_max_streams: u32,
    pub(super) h2_ping_interval: Duration,
    pub(super) h2_ping_timeout: Duration,
}

impl ConnLimits {
    pub(super) fn of(gw: &Gateway) -> Self {
        let snapshot = gw.snapshot();
        let limits = &snapshot.limits.listener;
        Self {
            idle_timeout: limits.idle_timeout.get(),
            header_read_timeout: limits.header_read_timeout.get(),
            send_timeout: limits.send_timeout.get(),
            h1_max_headers: Some(limits.max_headers as usize).filter(|&n| n != HYPER_MAX_HEADERS),
            max_headers: limits.max_headers as usize,
            max_buf_size: (limits.max_header_bytes as usize).max(MIN_BUF),
            max_header_list_size: limits.max_header_bytes,
            h2_max_streams: limits.http2.max_concurrent_streams,
            h2_ping_interval: limits.http2.keep_alive_interval.get(),
            h2_ping_timeout: limits.http2.keep_alive_timeout.get(),
        }
    }

    /// How long a connection may stay without a request in flight: `idleTimeout`, and after
    /// its first request also `headerReadTimeout` (hyper counts the wait for the next head
    /// against it, so an idle keep-alive connection closes at the shorter of the two).
    pub(super) fn idle_limit(&self, served: bool) -> Duration {
        if served {
            self.idle_timeout.min(self.header_read_timeout)
        } else {
            self.idle_timeout
        }
    }
}
