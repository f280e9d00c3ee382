//! Keepalive of upstream connections: TCP probes on every socket, HTTP/2 `PING`s on h2 ones.

use std::io;
use std::time::Duration;

use tokio::net::TcpStream;

/// Keepalive of upstream connections. TCP: the first probe after `idle` without traffic, then
/// one every `interval`; after `count` unanswered probes the kernel resets the connection.
/// HTTP/2: hyper's `PING` every `ping_interval` (while idle too), the connection dropped when one
/// goes unanswered for `ping_timeout`: a server that stopped answering (a hung process behind a
/// live TCP stack, a proxy holding the socket) is found in seconds, not after the kernel's probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// Idle time before the first probe.
    pub idle: Duration,
    /// Time between probes.
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped.
    pub count: u32,
    /// HTTP/2: a `PING` after this long without a frame from the server (idle or not).
    pub ping_interval: Duration,
    /// HTTP/2: an unanswered `PING` drops the connection after this long.
    pub ping_timeout: Duration,
}

impl Keepalive {
    pub(super) fn apply(&self, stream: &TcpStream) -> io::Result<()> {
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(self.idle)
            .with_interval(self.interval)
            .with_retries(self.count);
        socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
    }
}
