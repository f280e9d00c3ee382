//! What the pool pools: a [`Poolable`] connection, the [`Connect`] that opens one (and probes
//! an endpoint the same way, and says which of its slots share a socket: [`Multiplexed`]), and how long
//! a closed connection may keep its slot while the peer still holds its side ([`CLOSE_GRACE`]).
//! The pool is generic over them, so that its tests pool fake connections and its benchmark
//! measures the pool, not a socket.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

/// A connection the pool can keep between leases.
pub trait Poolable: Send + std::fmt::Debug + 'static {
    /// Cheap check that the peer has not closed the connection (no blocking; at most the IO
    /// that is already possible without waiting).
    fn is_open(&mut self) -> bool;

    /// When the connection was opened, if it knows (its age at close is measured from it).
    fn opened_at(&self) -> Option<Instant> {
        None
    }

    /// Whether this new connection rides on one that was open before (a stream slot of an
    /// HTTP/2 connection): the pool counts its lease as a reuse, and its age from that
    /// connection's opening.
    fn shares_connection(&self) -> bool {
        false
    }

    /// The check run before reusing a connection that sat idle longer than
    /// `validateAfterIdle`: it must be open *and* ready to carry a request right now.
    fn validate(&mut self) -> bool {
        self.is_open()
    }

    /// Closes the connection. When the peer may still hold its side, returns a future that
    /// resolves once the peer has let go of it too (closed or failed), and the pool keeps the
    /// slot until then (at most [`CLOSE_GRACE`]); `None` when nothing is left to wait for. The
    /// default closes at once.
    fn close(self) -> Option<impl Future<Output = ()> + Send + 'static>
    where
        Self: Sized,
    {
        drop(self);
        None::<std::future::Ready<()>>
    }
}

/// The longest a connection the pool closed keeps its slot waiting for the peer to close its
/// side. A backend that ignores the close (or is wedged) cannot keep a slot for longer.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The connections to one address that carry many pooled slots each (HTTP/2: a slot is a
/// stream), as `/v1/stats` and the gauges count them; the rest of the address's slots are a
/// connection each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Multiplexed {
    /// Connections (sockets) open, going away ones included.
    pub connections: u32,
    /// Stream slots on them, leased or idle in the pool.
    pub streams: u32,
    /// The smallest `SETTINGS_MAX_CONCURRENT_STREAMS` of the usable ones (`u32::MAX`: a
    /// server that sent none); `None` without one.
    pub max_streams: Option<u32>,
    /// The address is called over HTTP/1.1 until then instead of asking for HTTP/2 (the
    /// `auto` fallback), and why.
    pub fallback: Option<(Instant, &'static str)>,
}

/// Opens connections to endpoints.
pub trait Connect: Send + Sync + std::fmt::Debug + 'static {
    /// The connection type pooled.
    type Conn: Poolable;

    /// Opens one connection to `addr`. The pool bounds it with `connectTimeout`.
    fn connect(&self, addr: SocketAddr) -> impl Future<Output = io::Result<Self::Conn>> + Send;

    /// One active health probe of `addr` (see [`super::probe::exchange`]): whether `GET path`
    /// answers 2xx within `timeout`, on a connection opened the way this connector opens
    /// them. The default probes over plain TCP.
    fn probe(
        &self,
        addr: SocketAddr,
        path: &str,
        timeout: Duration,
    ) -> impl Future<Output = bool> + Send {
        super::probe::plain(addr, path, timeout)
    }

    /// The connections to `addr` that carry many slots, and their slots. The default: none,
    /// every slot is a connection of its own.
    fn multiplexed(&self, addr: SocketAddr) -> Multiplexed {
        let _ = addr;
        Multiplexed::default()
    }
}
