//! Upstream connections: HTTP/1.1 client connections to backend endpoints (the gateway's own,
//! [`h1`]) and HTTP/2 ones (hyper's low-level `client::conn`), in plain text or over TLS
//! ([`tls`]: verified, resumed, never downgraded), the pooled unit of [`crate::pool`]: an
//! HTTP/1.1 connection, or a stream slot on an HTTP/2 one ([`h2`]: streams before connections,
//! the server's limit and `GOAWAY` obeyed).
//! Each backend has its own connector, which knows which of its addresses take TLS and with
//! which client (set from the backend's endpoints whenever they or their addresses change), and
//! which HTTP version its calls go out in (the backend's `protocol`: HTTP/2 by ALPN or by
//! prior knowledge).
//!
//! An HTTP/1.1 connection's IO is driven by whoever holds it, inside that task: the proxied call
//! that leased it drives it while it sends, waits for the head and reads the body straight off
//! it ([`ResponseStream::Connection`]: no task of its own, no channel, no wake-up between tasks
//! for each request and response); the pool reads it (with a no-op waker, no syscall unless the
//! socket became readable) when it checks whether an idle connection is still open, which is how
//! a backend closing an idle connection is noticed. An HTTP/2 connection, shared by many calls,
//! has a task of its own.
//!
//! Closing is a handshake: the gateway's FIN, then whatever the backend still sends is read
//! and dropped until the backend closes its side, so the pool knows when the backend has let
//! go of the connection.
//!
//! Dead connections are found before a request is sent on them: TCP keepalive probes an idle
//! connection (a peer or middlebox that dropped it silently answers none, and the kernel resets
//! the socket), and the check before reusing a connection idle longer than `validateAfterIdle`
//! asks the kernel (a non-blocking `MSG_PEEK`, [`transport`]) whether the peer sent a FIN or a
//! reset, instead of trusting what the runtime last saw. Over TLS the peek sees records, not the
//! response: a FIN or a reset still condemns the connection, bytes do not (a session ticket or a
//! key update the connection has not read yet); a `close_notify` is read by the connection
//! itself and ends it.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use parking_lot::{Mutex, RwLock};
use poolpilot_api::limits::UpstreamProtocol;
use tokio::net::TcpStream;
use tokio::time::Instant;

use self::h1::H1Conn;
use self::h2::{H2Conn, H2Conns, H2Stream, Opened};
pub use self::keepalive::Keepalive;
use crate::pool::{Connect, Multiplexed, Poolable};
use crate::proxy::body::RequestBody;
use transport::{SharedStream, Socket, Transport};

mod frames;
mod h1;
mod h2;
mod keepalive;
mod send_error;
pub mod tls;
mod transport;

pub use send_error::{SendError, UpstreamError};
pub use tls::{TlsClient, TlsError};
#[cfg(test)]
use transport::{Peek, peek};

/// Opens upstream connections, in plain text or over TLS as the address asks, HTTP/1.1 or
/// HTTP/2 as the backend's protocol and the server's ALPN answer say, with TCP keepalive when
/// configured. Clones share the addresses' TLS clients and the HTTP/2 connections.
#[derive(Clone, Debug, Default)]
pub struct HttpConnector {
    /// Keepalive of every connection opened; `None`: off.
    pub keepalive: Option<Keepalive>,
    /// The TLS client of each address that takes TLS; the others are plain.
    tls: Arc<RwLock<HashMap<SocketAddr, Arc<TlsClient>>>>,
    protocol: Arc<RwLock<UpstreamProtocol>>,
    h2: Arc<H2Conns>,
    /// `auto`: the addresses called over HTTP/1.1 until a time, and why ([`H2_FALLBACK_COOLDOWN`]).
    fallback: Arc<Mutex<HashMap<SocketAddr, (Instant, &'static str)>>>,
}

/// How long an address of an `auto` backend is called over HTTP/1.1 (its TLS offering
/// `http/1.1` alone) after its server picked `http/1.1` by ALPN, or picked `h2` and then failed
/// the HTTP/2 handshake; the first new connection after it asks for `h2` again.
pub const H2_FALLBACK_COOLDOWN: Duration = Duration::from_secs(60);

/// An HTTP/2 handshake that failed after ALPN (or prior knowledge) said HTTP/2.
#[derive(Debug, thiserror::Error)]
#[error("the server failed the HTTP/2 handshake: {0}")]
struct H2Refused(#[source] io::Error);

impl HttpConnector {
    /// A connector with `keepalive` (`None`: off) and no TLS addresses.
    pub fn new(keepalive: Option<Keepalive>) -> Self {
        Self {
            keepalive,
            ..Self::default()
        }
    }

    /// A connector with the same settings and no TLS addresses yet, for one backend.
    pub fn for_backend(&self) -> Self {
        Self::new(self.keepalive)
    }

    /// Sets which addresses take TLS, with which client: from the next connection on.
    pub fn set_tls(&self, clients: HashMap<SocketAddr, Arc<TlsClient>>) {
        *self.tls.write() = clients;
    }

    /// Sets the HTTP version of new connections (the backend's `protocol`).
    pub fn set_protocol(&self, protocol: UpstreamProtocol) {
        let mut current = self.protocol.write();
        if *current != protocol {
            self.fallback.lock().clear();
        }
        *current = protocol;
    }

    /// Whether `addr` is in its HTTP/2 fallback cooldown now (a cooldown that ran out is
    /// forgotten).
    fn cooling(&self, addr: SocketAddr) -> bool {
        let mut fallback = self.fallback.lock();
        match fallback.get(&addr) {
            Some((until, _)) if *until > Instant::now() => true,
            Some(_) => {
                fallback.remove(&addr);
                false
            }
            None => false,
        }
    }

    /// Puts `addr` in its HTTP/2 fallback cooldown for `reason`, counted once per cooldown.
    fn fall_back(&self, addr: SocketAddr, client: &TlsClient, reason: &'static str) {
        let until = Instant::now() + H2_FALLBACK_COOLDOWN;
        let before = self.fallback.lock().insert(addr, (until, reason));
        if before.is_none_or(|(was, _)| was <= Instant::now()) {
            tracing::info!(%addr, reason, cooldown = ?H2_FALLBACK_COOLDOWN, "upstream falls back to HTTP/1.1");
            client.count_h2_fallback(reason);
        }
    }

    /// The HTTP version of new connections.
    pub fn protocol(&self) -> UpstreamProtocol {
        *self.protocol.read()
    }

    /// The TLS client of `addr`, if it takes TLS.
    pub fn tls_of(&self, addr: SocketAddr) -> Option<Arc<TlsClient>> {
        self.tls.read().get(&addr).cloned()
    }

    /// A TCP connection to `addr` as every upstream connection is opened: no Nagle, keepalive
    /// as configured.
    async fn tcp(&self, addr: SocketAddr) -> io::Result<TcpStream> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        if let Some(keepalive) = &self.keepalive {
            keepalive.apply(&stream)?;
        }
        Ok(stream)
    }

    /// A new connection to `addr`, its TLS handshake done: the transport, the socket, the
    /// `Host` over TLS, and whether it speaks HTTP/2 (ALPN's answer, or prior knowledge).
    async fn transport(
        &self,
        addr: SocketAddr,
        client: Option<&TlsClient>,
        protocol: UpstreamProtocol,
        http1_only: bool,
    ) -> io::Result<(Transport, Arc<Socket>, Option<HeaderValue>, bool)> {
        let socket = Socket::new(self.tcp(addr).await?);
        let Some(client) = client else {
            let h2 = protocol == UpstreamProtocol::Http2;
            return Ok((Transport::plain(socket.clone()), socket, None, h2));
        };
        let tls = client
            .handshake_offering(SharedStream(socket.clone()), http1_only)
            .await
            .map_err(io::Error::other)?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        if protocol == UpstreamProtocol::Http2 && !h2 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the server did not agree to HTTP/2 by ALPN",
            ));
        }
        let authority = client.authority().cloned();
        Ok((Transport::tls(tls, socket.clone()), socket, authority, h2))
    }

    /// Opens one connection: HTTP/2 (`Ok`) or HTTP/1.1 (`Err`), as the server speaks; over
    /// TLS offering `http/1.1` alone when `http1_only`. An HTTP/2 handshake that fails is
    /// [`H2Refused`].
    async fn open(
        &self,
        addr: SocketAddr,
        client: Option<Arc<TlsClient>>,
        protocol: UpstreamProtocol,
        http1_only: bool,
    ) -> io::Result<Result<Arc<H2Conn>, UpstreamConn>> {
        let (transport, socket, authority, h2) = self
            .transport(addr, client.as_deref(), protocol, http1_only)
            .await?;
        if h2 {
            return match H2Conn::open(transport, addr, authority, self.keepalive).await {
                Ok(conn) => Ok(Ok(conn)),
                Err(e) => Err(io::Error::new(e.kind(), H2Refused(e))),
            };
        }
        drop(socket);
        Ok(Err(UpstreamConn(Conn::H1(Box::new(H1Conn::new(
            transport, addr, authority,
        ))))))
    }

    /// [`Self::open`] for a connection that asks for HTTP/2; for `auto` over TLS, a server that
    /// does not take it puts the address in its fallback cooldown: one that picked `http/1.1`
    /// is used as it is, one that failed the HTTP/2 handshake is left for a new connection
    /// offering `http/1.1` alone, at once (the call waiting for it is not lost).
    async fn open_asking_h2(
        &self,
        addr: SocketAddr,
        client: Option<Arc<TlsClient>>,
        protocol: UpstreamProtocol,
    ) -> io::Result<Result<Arc<H2Conn>, UpstreamConn>> {
        let opened = self.open(addr, client.clone(), protocol, false).await;
        let Some(client) = client.filter(|_| protocol == UpstreamProtocol::Auto) else {
            return opened;
        };
        match opened {
            Ok(Err(h1)) => {
                self.fall_back(addr, &client, "alpn_http1");
                Ok(Err(h1))
            }
            Err(e) if e.get_ref().is_some_and(|e| e.is::<H2Refused>()) => {
                tracing::debug!(%addr, error = %e, "HTTP/2 refused after ALPN chose it");
                self.fall_back(addr, &client, "h2_refused");
                self.open(addr, Some(client), protocol, true).await
            }
            other => other,
        }
    }
}

/// What the pool leases: an HTTP/1.1 connection, or a stream slot on an HTTP/2 one.
#[derive(Debug)]
pub struct UpstreamConn(Conn);

#[derive(Debug)]
enum Conn {
    H1(Box<H1Conn>),
    /// A slot, and whether its connection was open before it (no new connection for it).
    H2(H2Stream, bool),
}

/// A response body as its upstream connection delivers it.
#[derive(Debug)]
pub enum ResponseStream {
    /// HTTP/2: the stream's body (hyper's; the connection's task fills it).
    Stream(Incoming),
    /// HTTP/1.1: read off the leased connection itself, in the task that polls it.
    Connection,
}

impl UpstreamConn {
    /// Waits until the connection can take a request.
    pub async fn ready(&mut self) -> Result<(), UpstreamError> {
        match &mut self.0 {
            Conn::H1(c) => match c.is_open() {
                true => Ok(()),
                false => Err("the upstream connection is closed".into()),
            },
            Conn::H2(s, _) => s.ready().await.map_err(Into::into),
        }
    }

    /// Sends `req` and waits for the response head. A request that was not written comes back
    /// in the error; one that was (maybe in part) says whether the backend let it go unanswered
    /// (a connection closed before any byte of a response, an HTTP/2 stream refused).
    pub async fn send(
        &mut self,
        req: Request<RequestBody>,
    ) -> Result<Response<ResponseStream>, SendError> {
        match &mut self.0 {
            Conn::H1(c) => Ok(c.send(req).await?.map(|()| ResponseStream::Connection)),
            Conn::H2(s, _) => Ok(s.send(req).await?.map(ResponseStream::Stream)),
        }
    }

    /// The next frame of `body`, a response of this connection: HTTP/1.1 reads it off the
    /// connection here (and sends the rest of the request, when the backend answered before
    /// it had it all); `cx` is woken when there is more.
    pub fn poll_frame(
        &mut self,
        body: &mut ResponseStream,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        match (body, &mut self.0) {
            (ResponseStream::Stream(incoming), _) => {
                Pin::new(incoming).poll_frame(cx).map_err(Into::into)
            }
            (ResponseStream::Connection, Conn::H1(c)) => c.poll_frame(cx),
            (ResponseStream::Connection, Conn::H2(..)) => Poll::Ready(None),
        }
    }

    /// Whether `body`, a response of this connection, has ended.
    pub fn body_ended(&self, body: &ResponseStream) -> bool {
        match (body, &self.0) {
            (ResponseStream::Stream(incoming), _) => incoming.is_end_stream(),
            (ResponseStream::Connection, Conn::H1(c)) => c.body_ended(),
            (ResponseStream::Connection, Conn::H2(..)) => true,
        }
    }

    /// The size of `body`, a response of this connection, as far as is known.
    pub fn body_size_hint(&self, body: &ResponseStream) -> SizeHint {
        match (body, &self.0) {
            (ResponseStream::Stream(incoming), _) => incoming.size_hint(),
            (ResponseStream::Connection, Conn::H1(c)) => c.body_size_hint(),
            (ResponseStream::Connection, Conn::H2(..)) => SizeHint::with_exact(0),
        }
    }
}

impl Poolable for UpstreamConn {
    fn opened_at(&self) -> Option<Instant> {
        Some(match &self.0 {
            Conn::H1(c) => c.opened,
            Conn::H2(s, _) => s.opened(),
        })
    }

    fn is_open(&mut self) -> bool {
        match &mut self.0 {
            Conn::H1(c) => c.is_open(),
            Conn::H2(s, _) => s.is_open(),
        }
    }

    fn validate(&mut self) -> bool {
        match &mut self.0 {
            Conn::H1(c) => c.validate(),
            // The connection's task reads the socket: what it holds is frames, not a verdict.
            Conn::H2(s, _) => s.is_ready(),
        }
    }

    fn shares_connection(&self) -> bool {
        matches!(self.0, Conn::H2(_, true))
    }

    fn close(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let closing: Pin<Box<dyn Future<Output = ()> + Send>> = match self.0 {
            Conn::H1(c) => Box::pin((*c).close()),
            Conn::H2(s, _) => Box::pin(s.close()?),
        };
        Some(closing)
    }
}

impl Connect for HttpConnector {
    type Conn = UpstreamConn;

    /// HTTP/1.1: a new connection. HTTP/2 (the backend's `protocol` allows it, and for `auto` the
    /// address takes TLS): a slot on an open connection while one has room, else on a new one.
    async fn connect(&self, addr: SocketAddr) -> io::Result<UpstreamConn> {
        let client = self.tls_of(addr);
        let protocol = *self.protocol.read();
        let cooling = protocol == UpstreamProtocol::Auto && client.is_some() && self.cooling(addr);
        let h2 = match protocol {
            UpstreamProtocol::Http1 => false,
            UpstreamProtocol::Auto => client.is_some() && !cooling,
            UpstreamProtocol::Http2 => true,
        };
        if !h2 {
            return match self.open(addr, client, protocol, cooling).await? {
                Err(h1) => Ok(h1),
                // A TLS client of the protocol before the last change still offered `h2`.
                Ok(conn) => conn
                    .slot()
                    .map(|slot| UpstreamConn(Conn::H2(slot, false)))
                    .ok_or_else(|| io::Error::other("the HTTP/2 server takes no stream")),
            };
        }
        match self
            .h2
            .slot(addr, self.open_asking_h2(addr, client, protocol))
            .await?
        {
            Opened::Stream(slot, shared) => Ok(UpstreamConn(Conn::H2(slot, shared))),
            Opened::Other(h1) => Ok(h1),
        }
    }

    /// The HTTP/2 connections open to `addr` and their stream slots.
    fn multiplexed(&self, addr: SocketAddr) -> Multiplexed {
        Multiplexed {
            fallback: self.fallback.lock().get(&addr).copied(),
            ..self.h2.sockets(addr)
        }
    }

    /// Plain HTTP/1.1 addresses: the pool's plain probe. TLS ones: the same exchange over a
    /// verified handshake (a probe never talks plain text to a TLS endpoint); HTTP/2 ones (by
    /// ALPN or prior knowledge): the exchange on a stream of a connection of its own.
    async fn probe(&self, addr: SocketAddr, path: &str, timeout: Duration) -> bool {
        let client = self.tls_of(addr);
        let protocol = *self.protocol.read();
        if client.is_none() && protocol != UpstreamProtocol::Http2 {
            return crate::pool::probe_exchange_plain(addr, path, timeout).await;
        }
        let deadline = Instant::now() + timeout;
        let cooling = protocol == UpstreamProtocol::Auto && client.is_some() && self.cooling(addr);
        let connect = self.transport(addr, client.as_deref(), protocol, cooling);
        let Ok(Ok((transport, _, authority, h2))) =
            tokio::time::timeout_at(deadline, connect).await
        else {
            return false;
        };
        if h2 {
            return self::h2::probe(transport, addr, authority, path, deadline).await;
        }
        let host = authority
            .as_ref()
            .and_then(|h| h.to_str().ok())
            .map_or_else(|| addr.to_string(), str::to_owned);
        crate::pool::probe_exchange(transport, &host, path, deadline, timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    async fn pair(connector: HttpConnector) -> (H1Conn, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (conn, accepted) = tokio::join!(connector.connect(addr), listener.accept());
        let UpstreamConn(Conn::H1(conn)) = conn.unwrap() else {
            panic!("HTTP/1.1 unless the backend's protocol says otherwise");
        };
        (*conn, accepted.unwrap().0)
    }

    #[tokio::test(start_paused = true)]
    async fn the_http2_fallback_lasts_its_cooldown_and_is_forgotten_after() {
        let connector = HttpConnector::default();
        connector.set_protocol(UpstreamProtocol::Auto);
        let addr: SocketAddr = "127.0.0.1:8443".parse().unwrap();
        assert!(!connector.cooling(addr));
        let until = Instant::now() + H2_FALLBACK_COOLDOWN;
        connector
            .fallback
            .lock()
            .insert(addr, (until, "alpn_http1"));
        assert_eq!(
            connector.multiplexed(addr).fallback,
            Some((until, "alpn_http1"))
        );
        tokio::time::advance(H2_FALLBACK_COOLDOWN - Duration::from_secs(1)).await;
        assert!(
            connector.cooling(addr),
            "still cooling a second before its end"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            !connector.cooling(addr),
            "over: the next connection asks for h2"
        );
        assert_eq!(connector.multiplexed(addr).fallback, None, "and forgotten");

        connector
            .fallback
            .lock()
            .insert(addr, (Instant::now() + H2_FALLBACK_COOLDOWN, "h2_refused"));
        connector.set_protocol(UpstreamProtocol::Http2);
        assert!(!connector.cooling(addr), "a new protocol starts afresh");
    }

    #[tokio::test]
    async fn connections_send_keepalive_probes_as_configured() {
        let keepalive = Keepalive {
            idle: Duration::from_secs(7),
            interval: Duration::from_secs(3),
            count: 4,
            ping_interval: Duration::from_secs(10),
            ping_timeout: Duration::from_secs(5),
        };
        let (conn, _peer) = pair(HttpConnector::new(Some(keepalive))).await;
        let socket = socket2::SockRef::from(&conn.socket().tcp);
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), keepalive.idle);
        assert_eq!(socket.tcp_keepalive_interval().unwrap(), keepalive.interval);
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), keepalive.count);

        let (conn, _peer) = pair(HttpConnector::default()).await;
        let socket = socket2::SockRef::from(&conn.socket().tcp);
        assert!(!socket.keepalive().unwrap(), "off unless configured");
    }

    /// What a peek finds once the peer's FIN or reset has reached the socket (it is in the kernel
    /// at once; the runtime may not have seen it yet): the first answer that is not quiet, within
    /// half a second.
    async fn settled_peek(stream: &TcpStream) -> Peek {
        let mut seen = Peek::Quiet;
        for _ in 0..100 {
            seen = peek(stream);
            if seen != Peek::Quiet {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen
    }

    #[tokio::test]
    async fn validation_asks_the_kernel_about_a_fin_or_a_reset() {
        let (conn, peer) = pair(HttpConnector::default()).await;
        assert_eq!(peek(&conn.socket().tcp), Peek::Quiet);
        drop(peer);
        assert_eq!(settled_peek(&conn.socket().tcp).await, Peek::Closed);

        let (mut conn, peer) = pair(HttpConnector::default()).await;
        assert!(conn.validate(), "a quiet connection is fine");
        // SO_LINGER 0: the close is a reset.
        socket2::SockRef::from(&peer)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(peer);
        assert_eq!(settled_peek(&conn.socket().tcp).await, Peek::Failed);
        assert!(!conn.validate());

        let (mut conn, mut peer) = pair(HttpConnector::default()).await;
        tokio::io::AsyncWriteExt::write_all(&mut peer, b"HTTP/1.1 200 OK\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(peek(&conn.socket().tcp), Peek::Unexpected);
        assert!(!conn.validate(), "bytes nobody asked for");
    }
}
