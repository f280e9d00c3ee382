//! Upstream connections: HTTP/1.1 client connections to backend endpoints (hyper's low-level
//! `client::conn`), in plain text or over TLS ([`tls`]: verified, resumed, never downgraded),
//! the pooled unit of [`crate::pool`]. Each backend has its own connector, which knows which of
//! its addresses take TLS and with which client (set from the backend's endpoints whenever they
//! or their addresses change).
//!
//! A connection's IO is driven by whoever holds it, inside that task: the proxied call that
//! leased it drives it while it sends, waits for the head and streams the body (no task of its
//! own, so no hand-off through a channel and a wake-up between tasks for each request and
//! response); the pool drives it (with a no-op waker, no syscall unless the socket became
//! readable) when it checks whether an idle connection is still open, which is how a backend
//! closing an idle connection is noticed.
//!
//! Closing is a handshake: the gateway's FIN, then whatever the backend still sends is read
//! and dropped until the backend closes its side, so the pool knows when the backend has let
//! go of the connection.
//!
//! Dead connections are found before a request is sent on them: TCP keepalive probes an idle
//! connection (a peer or middlebox that dropped it silently answers none, and the kernel resets
//! the socket), and the check before reusing a connection idle longer than `validateAfterIdle`
//! asks the kernel (a non-blocking `MSG_PEEK`) whether the peer sent a FIN or a reset, instead of
//! trusting what the runtime last saw. The socket is shared for that between hyper, which reads
//! and writes it, and the connection. Over TLS the peek sees records, not the response: a FIN
//! or a reset still condemns the connection, bytes do not (a session ticket or a key update
//! the connection has not read yet); a `close_notify` is read by the connection itself and
//! ends it.

use std::future::{Future, poll_fn};
use std::io;
use std::mem::MaybeUninit;
use std::net::{Shutdown, SocketAddr};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use std::collections::HashMap;

use http::{HeaderValue, Request, Response, header};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use parking_lot::RwLock;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::client::TlsStream;

use crate::pool::{Connect, Poolable};
use crate::proxy::body::RequestBody;

pub mod tls;

pub use tls::{TlsClient, TlsError};

/// Opens HTTP/1.1 connections, in plain text or over TLS as the address asks, with TCP
/// keepalive when configured. Clones share the addresses' TLS clients.
#[derive(Clone, Debug, Default)]
pub struct HttpConnector {
    /// Keepalive of every connection opened; `None`: off.
    pub keepalive: Option<Keepalive>,
    /// The TLS client of each address that takes TLS; the others are plain.
    tls: Arc<RwLock<HashMap<SocketAddr, Arc<TlsClient>>>>,
}

impl HttpConnector {
    /// A connector with `keepalive` (`None`: off) and no TLS addresses.
    pub fn new(keepalive: Option<Keepalive>) -> Self {
        Self {
            keepalive,
            tls: Arc::default(),
        }
    }

    /// A connector with the same settings and no TLS addresses yet, for one backend.
    pub fn for_backend(&self) -> Self {
        Self {
            keepalive: self.keepalive,
            tls: Arc::default(),
        }
    }

    /// Sets which addresses take TLS, with which client: from the next connection on.
    pub fn set_tls(&self, clients: HashMap<SocketAddr, Arc<TlsClient>>) {
        *self.tls.write() = clients;
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
}

/// TCP keepalive of upstream connections: the first probe after `idle` without traffic, then one
/// every `interval`; after `count` unanswered probes the kernel resets the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// Idle time before the first probe.
    pub idle: Duration,
    /// Time between probes.
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped.
    pub count: u32,
}

impl Keepalive {
    fn apply(&self, stream: &TcpStream) -> io::Result<()> {
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(self.idle)
            .with_interval(self.interval)
            .with_retries(self.count);
        socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
    }
}

type Driver = http1::Connection<TokioIo<Transport>, RequestBody>;

/// The upstream socket and the bytes of responses read from it so far (whether a response
/// began to arrive: over TLS, the plain text only, so that a `close_notify` or a ticket is no
/// answer).
#[derive(Debug)]
struct Socket {
    tcp: TcpStream,
    read: AtomicU64,
}

/// What hyper reads and writes: the shared socket itself, or TLS over it. Counts the bytes of
/// responses read.
#[derive(Debug)]
enum Transport {
    Plain(SharedStream),
    Tls(Box<TlsStream<SharedStream>>, Arc<Socket>),
}

impl Transport {
    fn socket(&self) -> &Arc<Socket> {
        match self {
            Self::Plain(s) => &s.0,
            Self::Tls(_, socket) => socket,
        }
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = match &mut *self {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_read(cx, buf),
        };
        let read = buf.filled().len() - before;
        if read > 0 {
            self.socket().read.fetch_add(read as u64, Ordering::Relaxed);
        }
        result
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut *self {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut *self {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s, _) => s.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut *self {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    /// Plain: the write side's FIN. TLS: a `close_notify`, then the FIN.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut *self {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The upstream socket, shared by hyper (which reads and writes it through this) and the
/// connection's own checks.
#[derive(Debug)]
struct SharedStream(Arc<Socket>);

impl AsyncRead for SharedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.0.tcp.poll_read_ready(cx))?;
            // Into the buffer's uninitialised part as it is (hyper's read buffer is large and
            // fresh on every read: zeroing it first would cost a memset per read).
            match self.0.tcp.try_read_buf(buf) {
                Ok(_) => return Poll::Ready(Ok(())),
                // Readiness was stale (try_read cleared it): wait again.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for SharedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.tcp.poll_write_ready(cx))?;
            match self.0.tcp.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                result => return Poll::Ready(result),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.tcp.poll_write_ready(cx))?;
            match self.0.tcp.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                result => return Poll::Ready(result),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(socket2::SockRef::from(&self.0.tcp).shutdown(Shutdown::Write))
    }
}

/// What the kernel says of an idle connection's socket, without waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peek {
    /// Nothing to read: the peer has not closed it.
    Quiet,
    /// The peer closed its side (FIN).
    Closed,
    /// The connection was reset, or failed.
    Failed,
    /// The peer sent bytes nobody asked for: the connection cannot carry a request.
    Unexpected,
}

/// Asks the kernel (a non-blocking `MSG_PEEK` of one byte) what an idle socket holds.
pub fn peek(stream: &TcpStream) -> Peek {
    let mut byte = [MaybeUninit::<u8>::uninit(); 1];
    match socket2::SockRef::from(stream).peek(&mut byte) {
        Ok(0) => Peek::Closed,
        Ok(_) => Peek::Unexpected,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Peek::Quiet,
        Err(_) => Peek::Failed,
    }
}

/// One HTTP/1.1 connection to an endpoint: the request handle and the connection's IO state
/// machine, driven by [`UpstreamConn::drive`].
pub struct UpstreamConn {
    sender: http1::SendRequest<RequestBody>,
    /// `None` once the connection ended (closed by either side, or failed).
    driver: Option<Pin<Box<Driver>>>,
    addr: SocketAddr,
    opened: Instant,
    /// The socket, for [`peek`] and the bytes read.
    stream: Arc<Socket>,
    /// Over TLS: the `Host` of every request (the server name), when it is a DNS name.
    authority: Option<HeaderValue>,
    tls: bool,
}

impl std::fmt::Debug for UpstreamConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamConn")
            .field("addr", &self.addr)
            .field("tls", &self.tls)
            .field("open", &self.driver.is_some())
            .finish()
    }
}

impl UpstreamConn {
    /// Moves the connection's IO as far as it can go now (writes the queued request, reads the
    /// response, hands both over); `cx` is woken when it can go further. Returns whether the
    /// connection is still open.
    pub fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(driver) = self.driver.as_mut()
            && let Poll::Ready(result) = driver.as_mut().poll(cx)
        {
            if let Err(error) = result {
                tracing::debug!(addr = %self.addr, %error, "upstream connection ended with an error");
            }
            self.driver = None;
        }
        self.driver.is_some()
    }

    /// Drives the connection without anyone to wake: for connections nobody is waiting on.
    fn drive_idle(&mut self) -> bool {
        self.drive(&mut Context::from_waker(Waker::noop()))
    }

    /// Waits until the connection can take a request.
    pub async fn ready(&mut self) -> hyper::Result<()> {
        poll_fn(|cx| {
            self.drive(cx);
            self.sender.poll_ready(cx)
        })
        .await
    }

    /// Sends `req` and waits for the response head, driving the connection meanwhile. A
    /// request that was not written comes back in the error; one that was (maybe in part)
    /// says whether the connection closed before any byte of a response came.
    pub async fn send(
        &mut self,
        mut req: Request<RequestBody>,
    ) -> Result<Response<Incoming>, SendError> {
        if let Some(authority) = &self.authority {
            req.headers_mut().insert(header::HOST, authority.clone());
        }
        let read_before = self.stream.read.load(Ordering::Relaxed);
        let mut response = pin!(self.sender.try_send_request(req));
        let result = poll_fn(|cx| {
            if let Poll::Ready(result) = response.as_mut().poll(cx) {
                return Poll::Ready(result);
            }
            self.drive(cx);
            response.as_mut().poll(cx)
        })
        .await;
        result.map_err(|mut e| match e.take_message() {
            Some(req) => SendError::Unsent(Box::new(req), e.into_error()),
            None => {
                let error = e.into_error();
                let unanswered = self.stream.read.load(Ordering::Relaxed) == read_before;
                if unanswered && closed_by_peer(&error) {
                    SendError::ClosedUnanswered(error)
                } else {
                    SendError::Failed(error)
                }
            }
        })
    }
}

/// Why [`UpstreamConn::send`] brought no response head.
#[derive(Debug)]
pub enum SendError {
    /// Nothing of the request was written: it comes back, to go on another connection.
    Unsent(Box<Request<RequestBody>>, hyper::Error),
    /// The request was written (maybe in part), then the backend closed or reset the connection
    /// before a single byte of a response: it may not have seen the request, or may have
    /// processed it; only a replayable request may be sent again.
    ClosedUnanswered(hyper::Error),
    /// Anything else: a response began and broke, or the exchange failed otherwise.
    Failed(hyper::Error),
}

/// Whether `error` is the peer closing the connection: its end of the stream before a message
/// (hyper's incomplete message), or a reset, a broken pipe or an abort from the kernel.
fn closed_by_peer(error: &hyper::Error) -> bool {
    if error.is_incomplete_message() {
        return true;
    }
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<io::Error>() {
            return matches!(
                io.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::UnexpectedEof
            );
        }
        source = cause.source();
    }
    false
}

impl Poolable for UpstreamConn {
    fn opened_at(&self) -> Option<Instant> {
        Some(self.opened)
    }

    fn is_open(&mut self) -> bool {
        self.drive_idle() && !self.sender.is_closed()
    }

    fn validate(&mut self) -> bool {
        if !(self.is_open() && self.sender.is_ready()) {
            return false;
        }
        match peek(&self.stream.tcp) {
            Peek::Quiet => true,
            // TLS records the connection has not read yet: a ticket, a key update.
            Peek::Unexpected if self.tls => true,
            found => {
                tracing::debug!(addr = %self.addr, ?found, "idle upstream connection found dead before reuse");
                false
            }
        }
    }

    fn close(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let Self { sender, driver, .. } = self;
        drop(sender);
        // No driver: the connection ended, its socket is closed on both sides already.
        let mut stream = Pin::into_inner(driver?).into_parts().io.into_inner();
        // Plain: the FIN at once. TLS: `close_notify`, then the FIN, as the future runs.
        let shut = match &stream {
            Transport::Plain(s) => Some(socket2::SockRef::from(&s.0.tcp).shutdown(Shutdown::Write)),
            Transport::Tls(..) => None,
        };
        Some(async move {
            let shut = match shut {
                Some(done) => done,
                None => stream.shutdown().await,
            };
            if shut.is_ok() {
                // Until the peer's FIN (0) or an error (a reset): the rest of a response the
                // client gave up on is dropped.
                let _ = tokio::io::copy(&mut stream, &mut tokio::io::sink()).await;
            }
        })
    }
}

impl Connect for HttpConnector {
    type Conn = UpstreamConn;

    async fn connect(&self, addr: SocketAddr) -> io::Result<UpstreamConn> {
        let client = self.tls_of(addr);
        let stream = Arc::new(Socket {
            tcp: self.tcp(addr).await?,
            read: AtomicU64::new(0),
        });
        let shared = SharedStream(stream.clone());
        let (transport, authority) = match &client {
            None => (Transport::Plain(shared), None),
            Some(client) => {
                let tls = client.handshake(shared).await.map_err(io::Error::other)?;
                (
                    Transport::Tls(Box::new(tls), stream.clone()),
                    client.authority().cloned(),
                )
            }
        };
        let (sender, driver) = http1::Builder::new()
            .handshake(TokioIo::new(transport))
            .await
            .map_err(io::Error::other)?;
        Ok(UpstreamConn {
            sender,
            driver: Some(Box::pin(driver)),
            addr,
            opened: Instant::now(),
            stream,
            authority,
            tls: client.is_some(),
        })
    }

    /// Plain addresses: the pool's plain probe. TLS ones: the same exchange over a verified
    /// handshake (a probe never talks plain text to a TLS endpoint).
    async fn probe(&self, addr: SocketAddr, path: &str, timeout: Duration) -> bool {
        let Some(client) = self.tls_of(addr) else {
            return crate::pool::probe_exchange_plain(addr, path, timeout).await;
        };
        let deadline = Instant::now() + timeout;
        let connect = async {
            let tcp = self.tcp(addr).await.ok()?;
            let socket = Arc::new(Socket {
                tcp,
                read: AtomicU64::new(0),
            });
            client.handshake(SharedStream(socket)).await.ok()
        };
        let Ok(Some(stream)) = tokio::time::timeout_at(deadline, connect).await else {
            return false;
        };
        let host = client
            .authority()
            .and_then(|h| h.to_str().ok())
            .map_or_else(|| addr.to_string(), str::to_owned);
        crate::pool::probe_exchange(stream, &host, path, deadline, timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    async fn pair(connector: HttpConnector) -> (UpstreamConn, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (conn, accepted) = tokio::join!(connector.connect(addr), listener.accept());
        (conn.unwrap(), accepted.unwrap().0)
    }

    #[tokio::test]
    async fn connections_send_keepalive_probes_as_configured() {
        let keepalive = Keepalive {
            idle: Duration::from_secs(7),
            interval: Duration::from_secs(3),
            count: 4,
        };
        let (conn, _peer) = pair(HttpConnector::new(Some(keepalive))).await;
        let socket = socket2::SockRef::from(&conn.stream.tcp);
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), keepalive.idle);
        assert_eq!(socket.tcp_keepalive_interval().unwrap(), keepalive.interval);
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), keepalive.count);

        let (conn, _peer) = pair(HttpConnector::default()).await;
        let socket = socket2::SockRef::from(&conn.stream.tcp);
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
        assert_eq!(peek(&conn.stream.tcp), Peek::Quiet);
        drop(peer);
        assert_eq!(settled_peek(&conn.stream.tcp).await, Peek::Closed);

        let (mut conn, peer) = pair(HttpConnector::default()).await;
        assert!(conn.validate(), "a quiet connection is fine");
        // SO_LINGER 0: the close is a reset.
        socket2::SockRef::from(&peer)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(peer);
        assert_eq!(settled_peek(&conn.stream.tcp).await, Peek::Failed);
        assert!(!conn.validate());

        let (mut conn, mut peer) = pair(HttpConnector::default()).await;
        tokio::io::AsyncWriteExt::write_all(&mut peer, b"HTTP/1.1 200 OK\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(peek(&conn.stream.tcp), Peek::Unexpected);
        assert!(!conn.validate(), "bytes nobody asked for");
    }
}
