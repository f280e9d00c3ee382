//! Idle keep-alive connections outside hyper: an HTTP/1 connection with no request in flight
//! leaves hyper ([`PARK_AFTER`] without one, or at once above [`PARK_EAGERLY_ABOVE`] open
//! connections) and waits for its next request as a bare socket with its idle deadline
//! ([`Parked`]), keeping only the bytes hyper read but had not parsed; readable again, it is
//! served by a new hyper connection ([`super::h1`]), those bytes replayed first.

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use super::conn_limits::ConnLimits;
use crate::live::Gateway;
use crate::observe::{NO_CLIENT, Reclaim};

/// A keep-alive connection without a request in flight for this long leaves hyper: its
/// buffers and connection state are dropped and it waits for its next request as a bare
/// socket (see `serve_connection` in `connection.rs`).
pub const PARK_AFTER: Duration = Duration::from_millis(500);

/// Above this many open client connections, a keep-alive connection leaves hyper as soon as
/// hyper waits for its next request (memory first); below it, after [`PARK_AFTER`] (so that
/// busy connections do not rebuild hyper's state between requests).
///
/// Parking at once costs a busy connection a new hyper connection for every request (a
/// closed-loop client at `c=300` ran 1.29× faster when connections waited 20 ms before parking),
/// but that delay, tried, left connections of a burst of 10,000 closed and more memory held
/// (`poolpilot-bench` part 4), so connections park at once until that is understood.
pub const PARK_EAGERLY_ABOVE: usize = 256;

/// A connection between requests, outside hyper.
#[derive(Debug)]
pub(super) struct Parked {
    pub(super) stream: TcpStream,
    /// Bytes hyper had read but not parsed (a pipelined partial head), replayed first.
    pub(super) prefix: Bytes,
    /// When the connection last moved bytes or finished a response.
    pub(super) idle_since: Instant,
    /// When hyper began waiting for the head that `prefix` starts (its header-read timeout
    /// runs from then).
    pub(super) head_since: Instant,
    /// Whether it carried a request.
    pub(super) served: bool,
}

impl Parked {
    /// Waits until the client sends something (true), or its idle deadline or shutdown comes
    /// first (false).
    pub(super) async fn wait(
        &self,
        gw: &Gateway,
        limits: &ConnLimits,
        mut timer: Pin<&mut Sleep>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        if *shutdown.borrow() {
            return false;
        }
        let deadline = self.idle_since + limits.idle_limit(self.served);
        timer.as_mut().reset(deadline);
        tokio::select! {
            readable = self.stream.readable() => readable.is_ok(),
            _ = timer => {
                tracing::debug!("closing an idle client connection");
                gw.metrics().incidents().reclaimed(Reclaim::IdleTimeout, NO_CLIENT);
                false
            }
            _ = shutdown.wait_for(|s| *s) => false,
        }
    }

    /// Closes it as hyper closes an idle connection: FIN, then drop.
    pub(super) async fn close(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(1), self.stream.shutdown()).await;
    }
}

/// The bytes a parking connection read but did not parse: hyper's leftover, then what was
/// never handed to hyper. Copied: a slice of hyper's read buffer, even an empty one, would
/// keep the whole buffer (8 KiB) allocated for as long as the connection stays parked.
pub(super) fn unparsed(read_buf: &Bytes, prefix: &Bytes) -> Bytes {
    if read_buf.is_empty() && prefix.is_empty() {
        return Bytes::new();
    }
    Bytes::from([&read_buf[..], &prefix[..]].concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_connection_keeps_only_its_unparsed_bytes() {
        // hyper's read buffer after it parsed one head: 8 KiB allocated, 2 bytes left over.
        let mut hyper_buf = bytes::BytesMut::with_capacity(8192);
        hyper_buf.extend_from_slice(b"GET /a HTTP/1.1\r\n\r\nGE");
        let leftover = hyper_buf.split_off(19).freeze();
        let kept = unparsed(&leftover, &Bytes::from_static(b"T /b"));
        assert_eq!(kept, "GET /b");
        let kept = kept.try_into_mut().expect("a copy of its own");
        assert!(kept.capacity() < 64, "capacity {}", kept.capacity());

        // Everything parsed: an empty buffer that still owns the rest of the allocation.
        drop(hyper_buf.split_to(hyper_buf.len()));
        let nothing_left = hyper_buf.freeze();
        let kept = unparsed(&nothing_left, &Bytes::new());
        assert!(kept.is_empty());
        assert!(
            kept.try_into_mut().is_err(),
            "the static empty Bytes, no buffer"
        );
    }
}
