//! The client-facing listener: the accept loop (total and per-source-IP connection caps,
//! accept errors such as EMFILE survived with back-off), one hyper-util auto (HTTP/1.1 + h2)
//! connection per socket with the head limits and header-read timeout of the limits in force,
//! the keep-alive idle timeout, and graceful drain on shutdown.

pub mod source;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use poolpilot_api::limits::ProxyProtocol;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, Sleep};

use crate::body::{BoxError, PolledFrame, ResponseBody};
use crate::deadline::{Cut, Cuttable, DeadlineSlot, ResponseDeadline, Watcher};
use crate::error::ProxyError;
use crate::live::Gateway;
use crate::observe::{DownstreamTimeout, Refusal};
use crate::observe::{NO_CLIENT, Reclaim};
use crate::proxy::Peer;

/// hyper's smallest HTTP/1 read buffer; smaller head limits are enforced per request.
const MIN_BUF: usize = 8192;

/// Answers to connections over their source's cap, at most this many a second sustained: each
/// costs a connection for up to [`REFUSAL_GRACE`], so a source opening connections in a loop
/// cannot make refusing them expensive. Beyond it they are closed unanswered (HAProxy and nginx
/// close them all unanswered; clients such as the OpenAI SDKs then report a connection error
/// instead of backing off).
pub const REFUSAL_ANSWERS_PER_SEC: f64 = 100.0;

/// Answers that may go out at once, above the sustained rate: an SDK sending a burst of a few
/// hundred calls opens as many connections in the same instant (the OpenAI SDKs allow up to
/// 1000), and each must get its 429 to back off instead of failing; a loop still gets at most
/// [`REFUSAL_ANSWERS_PER_SEC`] once the burst is spent.
pub const REFUSAL_ANSWER_BURST: f64 = 1000.0;

/// The longest a refused connection is kept to read its request and take its answer.
pub const REFUSAL_GRACE: Duration = Duration::from_secs(2);

/// The listen backlog where the kernel's cap cannot be read: Linux's `net.core.somaxconn`
/// default since 5.4.
pub const DEFAULT_BACKLOG: u32 = 4096;

/// The listen backlog of the gateway's listeners: the kernel's cap, `net.core.somaxconn`, as
/// Envoy (`tcp_backlog_size` unset) and Go's `net` package use; [`DEFAULT_BACKLOG`] where it
/// cannot be read. tokio's `TcpListener::bind` listens with 128 (std's value): a burst of more
/// connections than that while the accept loop was busy, or paused at `maxConnections`,
/// overflowed the accept queue, and a connection whose handshake the kernel had then completed
/// with a SYN cookie was reset once its data arrived, without an answer.
pub fn listen_backlog() -> u32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(DEFAULT_BACKLOG)
}

/// Binds a listener on `addr` with [`listen_backlog`] (and `SO_REUSEADDR`, as tokio's
/// `TcpListener::bind` sets it).
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(listen_backlog())
}

/// Open client connections, in total and per source (an IPv4 address or an IPv6 /64).
#[derive(Debug, Default)]
pub struct Connections {
    total: AtomicUsize,
    by_ip: Mutex<HashMap<IpAddr, u32>>,
    closed: Notify,
    refusals: Mutex<Option<AnswerBudget>>,
}

/// A token bucket of refusal answers.
#[derive(Debug)]
struct AnswerBudget {
    tokens: f64,
    at: Instant,
}

impl Connections {
    /// Whether a refused connection may get an answer now.
    fn may_answer(&self) -> bool {
        let now = Instant::now();
        let mut refusals = self.refusals.lock();
        let budget = refusals.get_or_insert(AnswerBudget {
            tokens: REFUSAL_ANSWER_BURST,
            at: now,
        });
        let refill = now.duration_since(budget.at).as_secs_f64() * REFUSAL_ANSWERS_PER_SEC;
        budget.tokens = (budget.tokens + refill).min(REFUSAL_ANSWER_BURST);
        budget.at = now;
        if budget.tokens >= 1.0 {
            budget.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// One counted client connection; uncounts itself when dropped.
#[derive(Debug)]
struct ConnGuard {
    conns: Arc<Connections>,
    ip: IpAddr,
    gw: Gateway,
    opened: Instant,
}

impl Connections {
    /// Open client connections now.
    pub fn open(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }

    /// Waits until every connection closed.
    pub async fn all_closed(&self) {
        loop {
            let closed = self.closed.notified();
            if self.open() == 0 {
                return;
            }
            closed.await;
        }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        {
            let mut by_ip = self.conns.by_ip.lock();
            if let Some(n) = by_ip.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    by_ip.remove(&self.ip);
                }
            }
        }
        self.conns.total.fetch_sub(1, Ordering::AcqRel);
        self.gw.metrics().downstream_connections().dec();
        self.gw
            .metrics()
            .incidents()
            .downstream_closed(self.opened.elapsed());
        self.conns.closed.notify_waiters();
    }
}

/// Accepts client connections until `shutdown` turns true, then stops accepting; each
/// connection drains on its own: it finishes its in-flight requests, then closes.
pub async fn serve(
    listener: TcpListener,
    gw: Gateway,
    conns: Arc<Connections>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(5);
    loop {
        // Beyond `maxConnections`, leave new connections in the kernel backlog.
        while conns.open() >= gw.snapshot().limits.listener.max_connections as usize {
            tokio::select! {
                _ = conns.closed.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
        }
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => {
                backoff = Duration::from_millis(5);
                pair
            }
            Err(error) => {
                gw.metrics().accept_error();
                if is_connection_error(&error) {
                    continue;
                }
                // EMFILE, ENFILE, ENOBUFS, ENOMEM: the process is out of a resource. Wait for
                // connections to close instead of spinning or dying.
                tracing::warn!(%error, ?backoff, "accept failed; backing off");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let from_proxy = gw
            .snapshot()
            .limits
            .listener
            .trusted_proxies
            .as_ref()
            .filter(|t| t.trusts(peer.ip()))
            .map(|t| t.protocol);
        match from_proxy {
            Some(ProxyProtocol::ProxyV2) => {
                // The client's address comes first, in the PROXY header: read it in the
                // connection's own task, then admit the client it names.
                tokio::spawn(serve_proxied(
                    stream,
                    peer,
                    gw.clone(),
                    conns.clone(),
                    shutdown.clone(),
                ));
            }
            Some(ProxyProtocol::XForwardedFor) => {
                // X-Forwarded-For: the proxy carries many clients' connections; the
                // per-source cap does not apply to it.
                admit_and_serve(stream, peer, peer.ip(), false, &gw, &conns, &shutdown);
            }
            None => admit_and_serve(stream, peer, peer.ip(), true, &gw, &conns, &shutdown),
        }
    }
}

/// Counts a connection from `source` (against its cap when `capped`) and serves it, or
/// refuses it: an answer (429) while the answer rate allows, else a close.
fn admit_and_serve(
    stream: TcpStream,
    peer: SocketAddr,
    source: IpAddr,
    capped: bool,
    gw: &Gateway,
    conns: &Arc<Connections>,
    shutdown: &watch::Receiver<bool>,
) {
    let Some(guard) = admit(gw, conns, source, capped) else {
        tracing::debug!("client connection refused: its source holds too many");
        if conns.may_answer() {
            gw.metrics().downstream_rejected(Refusal::Answered);
            tokio::spawn(answer_refused(stream));
        } else {
            gw.metrics().downstream_rejected(Refusal::Dropped);
            drop(stream);
        }
        return;
    };
    tokio::spawn(serve_connection(
        stream,
        peer,
        source,
        gw.clone(),
        guard,
        shutdown.clone(),
    ));
}

/// A connection from a proxy trusted to open it with a PROXY protocol v2 header: the header
/// must arrive within the header-read timeout, and names the client; a connection without one
/// is closed unanswered (HAProxy's `accept-proxy`).
async fn serve_proxied(
    mut stream: TcpStream,
    peer: SocketAddr,
    gw: Gateway,
    conns: Arc<Connections>,
    shutdown: watch::Receiver<bool>,
) {
    let wait = gw.snapshot().limits.listener.header_read_timeout.get();
    let source = match tokio::time::timeout(wait, source::read_proxy_header(&mut stream)).await {
        Ok(Ok(client)) => client.map_or(peer.ip(), |c| c.ip()),
        Ok(Err(error)) => {
            tracing::debug!(%error, %peer, "closing a connection from a trusted proxy");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "no PROXY protocol header in time; closing");
            return;
        }
    };
    admit_and_serve(stream, peer, source, true, &gw, &conns, &shutdown);
}

/// Answers every request of a connection over its source's cap with `429`, `Retry-After` and
/// `Connection: close`, for at most [`REFUSAL_GRACE`]. HTTP/2 clients get the same answer on
/// their streams.
async fn answer_refused(stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
        // Read (a bounded part of) the body first: closing with unread bytes would reset the
        // connection and could destroy the answer before the client reads it.
        let version = req.version();
        let body = http_body_util::Limited::new(req.into_body(), 64 * 1024);
        let _ = tokio::time::timeout(REFUSAL_GRACE / 2, body.collect()).await;
        let mut response = ProxyError::TooManyConnections.to_response();
        if version != http::Version::HTTP_2 {
            response.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
        Ok::<_, Infallible>(response)
    });
    let mut builder = auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(REFUSAL_GRACE)
        .keep_alive(false);
    builder.http2().max_concurrent_streams(1);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(REFUSAL_GRACE, conn).await;
}

/// Errors about one connection, not the listener: retry at once.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Counts a connection from `source` (by its [`source::group`]), unless it would take
/// the source over `maxConnectionsPerClient` (when `capped`).
fn admit(
    gw: &Gateway,
    conns: &Arc<Connections>,
    source: IpAddr,
    capped: bool,
) -> Option<ConnGuard> {
    let ip = source::group(source);
    let per_client = gw
        .snapshot()
        .limits
        .listener
        .max_connections_per_client
        .filter(|_| capped);
    {
        let mut by_ip = conns.by_ip.lock();
        let n = by_ip.entry(ip).or_default();
        if per_client.is_some_and(|max| *n >= max) {
            if *n == 0 {
                by_ip.remove(&ip);
            }
            return None;
        }
        *n += 1;
    }
    conns.total.fetch_add(1, Ordering::AcqRel);
    gw.metrics().downstream_connections().inc();
    Some(ConnGuard {
        conns: conns.clone(),
        ip,
        gw: gw.clone(),
        opened: Instant::now(),
    })
}

/// The limits a connection keeps from its accept on (later limits apply to new connections).
#[derive(Clone, Copy, Debug)]
struct ConnLimits {
    idle_timeout: Duration,
    header_read_timeout: Duration,
    send_timeout: Duration,
    max_headers: usize,
    max_buf_size: usize,
    max_header_list_size: u32,
    h2_max_streams: u32,
    h2_ping_interval: Duration,
    h2_ping_timeout: Duration,
}

impl ConnLimits {
    fn of(gw: &Gateway) -> Self {
        let snapshot = gw.snapshot();
        let limits = &snapshot.limits.listener;
        Self {
            idle_timeout: limits.idle_timeout.get(),
            header_read_timeout: limits.header_read_timeout.get(),
            send_timeout: limits.send_timeout.get(),
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
    fn idle_limit(&self, served: bool) -> Duration {
        if served {
            self.idle_timeout.min(self.header_read_timeout)
        } else {
            self.idle_timeout
        }
    }
}

/// A keep-alive connection without a request in flight for this long leaves hyper: its
/// buffers and connection state are dropped and it waits for its next request as a bare
/// socket (see [`serve_connection`]).
pub const PARK_AFTER: Duration = Duration::from_millis(500);

/// Above this many open client connections, a keep-alive connection leaves hyper as soon as
/// hyper waits for its next request (memory first); below it, after [`PARK_AFTER`] (so that
/// busy connections do not rebuild hyper's state between requests).
pub const PARK_EAGERLY_ABOVE: usize = 256;

/// The first bytes of an HTTP/2 connection with prior knowledge.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one client connection until it closes, its keep-alive idle timeout passes, or
/// shutdown asks it to finish its in-flight requests and close.
///
/// An HTTP/1 connection alternates between two states:
///
/// ```text
///  parked: a bare socket, an idle deadline,   readable   active: a hyper HTTP/1 connection
///  no buffers (a few hundred bytes) ─────────────────────► (read/write buffers, state)
///        ▲                                                    │
///        └──── no request in flight for PARK_AFTER: ──────────┘
///              hyper closes its (idle) side, hands back the socket and unparsed bytes
/// ```
///
/// so that thousands of idle keep-alive clients cost little memory. A connection whose
/// first bytes are the HTTP/2 preface is served by hyper-util's auto connection for its whole
/// life.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    source: IpAddr,
    gw: Gateway,
    guard: ConnGuard,
    mut shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let limits = ConnLimits::of(&gw);
    let mut conn = Parked {
        stream,
        prefix: Bytes::new(),
        idle_since: Instant::now(),
        head_since: Instant::now(),
        served: false,
    };
    let timer = tokio::time::sleep(limits.idle_timeout);
    tokio::pin!(timer);
    let mut first = true;
    loop {
        if conn.prefix.is_empty() && !conn.wait(&gw, &limits, timer.as_mut(), &mut shutdown).await {
            conn.close().await;
            break;
        }
        if first {
            match first_bytes(&conn.stream).await {
                First::Pending => continue,
                First::Closed => {
                    conn.close().await;
                    break;
                }
                First::H2 => {
                    // Boxed: inline, its state (2 KiB) would be part of every connection's
                    // task, idle HTTP/1 ones included.
                    Box::pin(serve_auto(
                        conn.stream,
                        (peer, source),
                        gw,
                        &limits,
                        timer.as_mut(),
                        &mut shutdown,
                    ))
                    .await;
                    break;
                }
                First::H1 => first = false,
            }
        }
        let header_read_timeout = if conn.prefix.is_empty() {
            limits.header_read_timeout
        } else {
            // A partial head was pending when the connection parked: its time counts.
            match limits
                .header_read_timeout
                .checked_sub(conn.head_since.elapsed())
            {
                Some(left) if !left.is_zero() => left,
                _ => {
                    tracing::debug!("read header from client timeout");
                    gw.metrics()
                        .incidents()
                        .reclaimed(Reclaim::HeaderTimeout, NO_CLIENT);
                    break;
                }
            }
        };
        // Boxed, like `serve_auto`: a parked connection's task then holds only what parking
        // needs, not the serving state (one allocation per return from parking).
        match Box::pin(serve_h1(
            conn,
            (peer, source),
            &gw,
            &guard.conns,
            &limits,
            header_read_timeout,
            timer.as_mut(),
            &mut shutdown,
        ))
        .await
        {
            Some(parked) => conn = parked,
            None => break,
        }
    }
    drop(guard);
}

/// A connection between requests, outside hyper.
#[derive(Debug)]
struct Parked {
    stream: TcpStream,
    /// Bytes hyper had read but not parsed (a pipelined partial head), replayed first.
    prefix: Bytes,
    /// When the connection last moved bytes or finished a response.
    idle_since: Instant,
    /// When hyper began waiting for the head that `prefix` starts (its header-read timeout
    /// runs from then).
    head_since: Instant,
    /// Whether it carried a request.
    served: bool,
}

impl Parked {
    /// Waits until the client sends something (true), or its idle deadline or shutdown comes
    /// first (false).
    async fn wait(
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
    async fn close(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(1), self.stream.shutdown()).await;
    }
}

/// What a new connection's first bytes say.
enum First {
    /// Nothing to read yet (a spurious wake-up).
    Pending,
    /// The client closed (or the socket failed) before sending anything.
    Closed,
    /// (The start of) the HTTP/2 preface.
    H2,
    /// Anything else: HTTP/1.
    H1,
}

/// Peeks at a new connection's first bytes.
async fn first_bytes(stream: &TcpStream) -> First {
    let mut bytes = [0u8; 24];
    let mut buf = ReadBuf::new(&mut bytes);
    match poll_fn(|cx| Poll::Ready(stream.poll_peek(cx, &mut buf))).await {
        Poll::Pending => First::Pending,
        Poll::Ready(Ok(0) | Err(_)) => First::Closed,
        Poll::Ready(Ok(n)) if buf.filled()[..n] == H2_PREFACE[..n] => First::H2,
        Poll::Ready(Ok(_)) => First::H1,
    }
}

/// Serves HTTP/1 requests with hyper until the connection closes (None) or has had no request
/// in flight for [`PARK_AFTER`] (the parked connection).
#[allow(clippy::too_many_arguments)]
async fn serve_h1(
    parked: Parked,
    peer: (SocketAddr, IpAddr),
    gw: &Gateway,
    conns: &Connections,
    limits: &ConnLimits,
    header_read_timeout: Duration,
    mut timer: Pin<&mut Sleep>,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Parked> {
    let served = parked.served;
    // A pending partial head keeps the time its wait began; otherwise the wait begins now.
    let activity = Arc::new(if parked.prefix.is_empty() {
        Activity::new()
    } else {
        Activity::waiting_since(parked.head_since)
    });
    let io = TokioIo::new(ConnIo {
        inner: parked.stream,
        prefix: parked.prefix,
        activity: activity.clone(),
    });
    let service = Service::new(gw.clone(), peer, activity.clone());
    let mut watch = H1Watch::default();
    let mut conn = Box::new(
        http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_read_timeout)
            .max_headers(limits.max_headers)
            .max_buf_size(limits.max_buf_size)
            .serve_connection(io, service),
    );
    // Flags shared by the branches below (atomics only because the future must be `Send`).
    let draining = AtomicBool::new(false);
    let parking = AtomicBool::new(false);
    loop {
        let idle_for = limits.idle_timeout.min(PARK_AFTER);
        timer.as_mut().reset(activity.idle_check_at(idle_for));
        tokio::select! {
            // The connection first: the watch then sees what its response body just reported.
            biased;
            result = poll_fn(|cx| {
                let result = conn.poll_without_shutdown(cx);
                // Many connections open: park as soon as hyper waits for a next request
                // with everything written, instead of after PARK_AFTER.
                if result.is_pending()
                    && !parking.load(Ordering::Relaxed)
                    && !draining.load(Ordering::Relaxed)
                    && activity.waiting_for_request()
                    && conns.open() > PARK_EAGERLY_ABOVE
                {
                    Pin::new(&mut *conn).graceful_shutdown();
                    parking.store(true, Ordering::Relaxed);
                    return conn.poll_without_shutdown(cx);
                }
                result
            }) => {
                if let Err(error) = result {
                    tracing::debug!(%error, "client connection ended with an error");
                    if error.is_timeout() {
                        // hyper's header-read timeout: on a kept-alive connection that sent
                        // nothing since its last response, an idle close.
                        let idle =
                            activity.served() && !activity.head_bytes.load(Ordering::Relaxed);
                        let reason = if idle {
                            Reclaim::IdleTimeout
                        } else {
                            Reclaim::HeaderTimeout
                        };
                        let client = activity.client.lock().clone();
                        gw.metrics()
                            .incidents()
                            .reclaimed(reason, client.as_deref().unwrap_or(NO_CLIENT));
                    }
                    return None;
                }
                break;
            }
            cut = poll_fn(|cx| watch.poll_cut(cx, &activity, limits.send_timeout)) => {
                // Dropping the connection drops the response body: its lease and permit go
                // back now, and the client sees the connection close mid-response.
                cut.count(gw, &activity);
                return None;
            }
            _ = timer.as_mut(), if !draining.load(Ordering::Relaxed) && !parking.load(Ordering::Relaxed) => {
                if activity.idle_for(limits.idle_timeout) {
                    tracing::debug!("closing an idle client connection");
                    let client = activity.client.lock().clone();
                    gw.metrics()
                        .incidents()
                        .reclaimed(Reclaim::IdleTimeout, client.as_deref().unwrap_or(NO_CLIENT));
                    Pin::new(&mut *conn).graceful_shutdown();
                    draining.store(true, Ordering::Relaxed);
                } else if activity.idle_for(PARK_AFTER) && !activity.write_blocked() {
                    // hyper is between requests with everything written: it closes its side
                    // at once and hands the socket back.
                    Pin::new(&mut *conn).graceful_shutdown();
                    parking.store(true, Ordering::Relaxed);
                }
            }
            _ = shutdown.wait_for(|s| *s), if !draining.load(Ordering::Relaxed) => {
                Pin::new(&mut *conn).graceful_shutdown();
                draining.store(true, Ordering::Relaxed);
            }
        }
    }
    let (draining, parking) = (draining.into_inner(), parking.into_inner());
    let parts = conn.into_parts();
    let ConnIo {
        inner: mut stream,
        prefix,
        ..
    } = parts.io.into_inner();
    if draining || !parking {
        // Closed by the client, the idle timeout or drain.
        let _ = tokio::time::timeout(Duration::from_secs(1), stream.shutdown()).await;
        return None;
    }
    Some(Parked {
        stream,
        prefix: unparsed(&parts.read_buf, &prefix),
        idle_since: activity.idle_since(),
        head_since: activity.head_since(),
        served: served || activity.served(),
    })
}

/// The bytes a parking connection read but did not parse: hyper's leftover, then what was
/// never handed to hyper. Copied: a slice of hyper's read buffer, even an empty one, would
/// keep the whole buffer (8 KiB) allocated for as long as the connection stays parked.
fn unparsed(read_buf: &Bytes, prefix: &Bytes) -> Bytes {
    if read_buf.is_empty() && prefix.is_empty() {
        return Bytes::new();
    }
    Bytes::from([&read_buf[..], &prefix[..]].concat())
}

/// Serves an HTTP/2 (or undecided) connection with hyper-util's auto connection, as one
/// piece: no parking.
async fn serve_auto(
    stream: TcpStream,
    peer: (SocketAddr, IpAddr),
    gw: Gateway,
    limits: &ConnLimits,
    mut timer: Pin<&mut Sleep>,
    shutdown: &mut watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::streams_only());
    let io = TokioIo::new(ConnIo {
        inner: stream,
        prefix: Bytes::new(),
        activity: activity.clone(),
    });
    let service = Service::new(gw.clone(), peer, activity.clone());
    let mut builder = auto::Builder::new(StreamExecutor {
        next: service.next_stream.clone(),
    });
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(limits.max_headers)
        .max_buf_size(limits.max_buf_size);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(limits.max_header_list_size)
        .max_concurrent_streams(limits.h2_max_streams)
        .keep_alive_interval(limits.h2_ping_interval)
        .keep_alive_timeout(limits.h2_ping_timeout);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let idle_timeout = limits.idle_timeout;
    let mut draining = false;
    // HTTP/2 streams are cut in their own tasks (`StreamExecutor`); this watches the
    // connection only when it turned out to be HTTP/1.
    let mut watch = H1Watch::default();
    loop {
        timer.as_mut().reset(activity.idle_check_at(idle_timeout));
        tokio::select! {
            biased;
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "client connection ended with an error");
                }
                break;
            }
            cut = poll_fn(|cx| watch.poll_cut(cx, &activity, limits.send_timeout)) => {
                cut.count(&gw, &activity);
                break;
            }
            _ = timer.as_mut(), if !draining => {
                if activity.idle_for(idle_timeout) {
                    tracing::debug!("closing an idle client connection");
                    let client = activity.client.lock().clone();
                    gw.metrics()
                        .incidents()
                        .reclaimed(Reclaim::IdleTimeout, client.as_deref().unwrap_or(NO_CLIENT));
                    conn.as_mut().graceful_shutdown();
                    draining = true;
                }
            }
            _ = shutdown.wait_for(|s| *s), if !draining => {
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
        }
    }
}

/// The hyper service of one connection: each request is proxied in its own boxed future (so
/// that the connection can be taken apart between requests), with a [`DeadlineSlot`] for its
/// response: an HTTP/1 request's is watched by the connection's task (through its
/// [`Activity`]), an HTTP/2 request's by the task [`StreamExecutor`] spawns for its stream.
#[derive(Clone, Debug)]
struct Service {
    gw: Gateway,
    peer: Arc<Peer>,
    activity: Arc<Activity>,
    /// The slot of the HTTP/2 stream hyper is about to spawn.
    next_stream: Arc<Mutex<Option<Arc<DeadlineSlot>>>>,
}

impl Service {
    fn new(gw: Gateway, (peer, source): (SocketAddr, IpAddr), activity: Arc<Activity>) -> Self {
        Self {
            gw,
            peer: Arc::new(Peer::proxied(peer, source)),
            activity,
            next_stream: Arc::default(),
        }
    }
}

type ServiceFuture =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Service {
    type Response = Response<ResponseBody>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, mut req: Request<Incoming>) -> ServiceFuture {
        let gw = self.gw.clone();
        // The request id goes to the backend, back to the client, and into the access log.
        let request_id = crate::observe::access::request_id(req.headers());
        req.headers_mut()
            .insert(crate::observe::access::X_REQUEST_ID, request_id.clone());
        let record = Arc::new(crate::observe::access::Record::new(
            request_id.clone(),
            &req,
        ));
        let peer = self.peer.clone();
        let slot = Arc::new(DeadlineSlot::default());
        if req.version() == http::Version::HTTP_2 {
            // hyper spawns this stream's task right after this call returns.
            *self.next_stream.lock() = Some(slot.clone());
        } else {
            *self.activity.current.lock() = Some(slot.clone());
        }
        let active = ActiveRequest::new(self.activity.clone());
        let activity_of_call = self.activity.clone();
        Box::pin(async move {
            let mut response = crate::proxy::handle(gw.clone(), &peer, req, &slot, &record).await;
            response
                .headers_mut()
                .insert(crate::observe::access::X_REQUEST_ID, request_id);
            record.status(response.status());
            if let Some(client) = record.client_name() {
                *activity_of_call.client.lock() = Some(client);
            }
            let access = gw
                .access_log()
                .enabled()
                .then(|| crate::observe::access::Finisher::new(gw.access_log().clone(), record));
            // An answer of the gateway's own (no backend body reports to the slot): the send
            // timeout alone applies to it.
            let own = (!slot.is_armed()).then(|| {
                let send_timeout = gw.snapshot().limits.listener.send_timeout.get();
                let deadline = ResponseDeadline::client_only(send_timeout);
                slot.arm(deadline.clone());
                deadline
            });
            Ok(response.map(|body| {
                Tracked {
                    inner: body,
                    own,
                    access,
                    _active: active,
                }
                .boxed_unsync()
            }))
        })
    }
}

/// Spawns hyper's HTTP/2 stream tasks, each cut (its stream reset) when its response passes a
/// deadline, whether or not the client gives it flow-control window.
#[derive(Clone, Debug)]
struct StreamExecutor {
    next: Arc<Mutex<Option<Arc<DeadlineSlot>>>>,
}

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        let slot = self.next.lock().take();
        tokio::spawn(Cuttable::new(fut, slot));
    }
}

/// Why an HTTP/1 connection is being cut.
#[derive(Clone, Copy, Debug)]
enum H1Cut {
    /// Its response passed a deadline (counted where the response ends).
    Response(Cut),
    /// Its client accepted no bytes for `sendTimeout` (after its response left the gateway's
    /// hands, or of an answer the gateway wrote itself).
    Stalled,
}

impl H1Cut {
    fn count(self, gw: &Gateway, activity: &Activity) {
        match self {
            Self::Response(cut) => tracing::debug!(?cut, "cutting a client connection"),
            Self::Stalled => {
                tracing::debug!("cutting a client connection that accepts no bytes");
                gw.metrics().downstream_timeout(DownstreamTimeout::Send);
                let client = activity.client.lock().clone();
                gw.metrics()
                    .incidents()
                    .reclaimed(Reclaim::SendStall, client.as_deref().unwrap_or(NO_CLIENT));
            }
        }
    }
}

/// Watches an HTTP/1 connection's request in flight and its writes.
#[derive(Debug)]
struct H1Watch {
    response: Watcher,
    stall: Pin<Box<Sleep>>,
}

impl Default for H1Watch {
    fn default() -> Self {
        Self {
            response: Watcher::default(),
            stall: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }
    }
}

impl H1Watch {
    fn poll_cut(
        &mut self,
        cx: &mut Context<'_>,
        activity: &Activity,
        send_timeout: Duration,
    ) -> Poll<H1Cut> {
        let current = activity.current.lock().clone();
        if let Some(slot) = current
            && let Poll::Ready(cut) = self.response.poll_cut(cx, &slot)
        {
            return Poll::Ready(H1Cut::Response(cut));
        }
        let Some(since) = activity.stalled_since() else {
            return Poll::Pending;
        };
        let at = since + send_timeout;
        if self.stall.deadline() != at {
            self.stall.as_mut().reset(at);
        }
        self.stall.as_mut().poll(cx).map(|()| H1Cut::Stalled)
    }
}

/// When a connection last moved bytes, how many of its requests are in flight, whether it
/// carried one, and whether its last write had to wait for the socket.
#[derive(Debug)]
struct Activity {
    base: Instant,
    last_ms: AtomicU64,
    in_flight: AtomicUsize,
    served: AtomicBool,
    write_blocked: AtomicBool,
    /// The last read found nothing, with no request in flight.
    read_blocked_idle: AtomicBool,
    /// When the wait for the next head began (ms after `base`): the start, or the end of the
    /// last response.
    head_ms: AtomicU64,
    /// Since when (ms after `base`, plus one; 0: not stalled) writes to the client have been
    /// waiting without progress.
    stalled_ms: AtomicU64,
    /// The deadline slot of the HTTP/1 request in flight.
    current: Mutex<Option<Arc<DeadlineSlot>>>,
    /// Whether bytes moved between requests count as activity: not on HTTP/2, whose pings
    /// and their answers would keep a connection without streams open for ever.
    bytes_count: bool,
    /// The client class of the last call on the connection (its reclaims are counted for it).
    client: Mutex<Option<Arc<str>>>,
    /// Bytes of a next head were read since the last response ended (a header-read timeout
    /// then cuts a slow head, not an idle connection).
    head_bytes: AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Self::waiting_since(Instant::now())
    }

    /// A connection (just resumed) whose wait for a head began at `head_since`.
    fn waiting_since(head_since: Instant) -> Self {
        let now = Instant::now();
        let base = head_since.min(now);
        Self {
            base,
            last_ms: AtomicU64::new(now.duration_since(base).as_millis() as u64),
            head_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            write_blocked: AtomicBool::new(false),
            read_blocked_idle: AtomicBool::new(false),
            stalled_ms: AtomicU64::new(0),
            current: Mutex::new(None),
            bytes_count: true,
            client: Mutex::new(None),
            head_bytes: AtomicBool::new(false),
        }
    }

    /// The activity of a connection served by hyper-util's auto connection (HTTP/2): idle
    /// from the end of its last stream, whatever frames it exchanges.
    fn streams_only() -> Self {
        Self {
            bytes_count: false,
            ..Self::new()
        }
    }

    fn touch(&self) {
        self.last_ms
            .store(self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Notes bytes moved: only between requests does that move the idle clock (a request in
    /// flight keeps the connection busy, and its end touches it).
    fn moved(&self) {
        if self.bytes_count && self.in_flight.load(Ordering::Relaxed) == 0 {
            self.touch();
        }
    }

    fn idle_since(&self) -> Instant {
        self.base + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Idle: no request in flight and no bytes for `timeout`.
    fn idle_for(&self, timeout: Duration) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0 && self.idle_since().elapsed() >= timeout
    }

    /// When to check next for `timeout` of idleness: with a request in flight, not before
    /// `timeout` from now (its end touches the connection).
    fn idle_check_at(&self, timeout: Duration) -> Instant {
        let now = Instant::now();
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return now + timeout;
        }
        (self.idle_since() + timeout).max(now + Duration::from_millis(10))
    }

    /// Whether hyper is waiting for the next request with its response written: no request
    /// in flight, the last read found nothing, the last write did not wait.
    fn waiting_for_request(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
            && self.read_blocked_idle.load(Ordering::Relaxed)
            && !self.write_blocked()
    }

    fn head_since(&self) -> Instant {
        self.base + Duration::from_millis(self.head_ms.load(Ordering::Relaxed))
    }

    fn served(&self) -> bool {
        self.served.load(Ordering::Relaxed)
    }

    fn write_blocked(&self) -> bool {
        self.write_blocked.load(Ordering::Relaxed)
    }

    /// Since when writes to the client have waited without progress, if they have.
    fn stalled_since(&self) -> Option<Instant> {
        match self.stalled_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.base + Duration::from_millis(ms - 1)),
        }
    }
}

/// The client socket as hyper sees it: replays bytes read before (by an earlier hyper
/// connection on this socket), and notes activity on every read and write.
#[derive(Debug)]
struct ConnIo {
    inner: TcpStream,
    prefix: Bytes,
    activity: Arc<Activity>,
}

impl ConnIo {
    fn wrote(&self, result: &Poll<io::Result<usize>>) {
        let activity = &self.activity;
        activity
            .write_blocked
            .store(result.is_pending(), Ordering::Relaxed);
        if result.is_pending() {
            if activity.stalled_ms.load(Ordering::Relaxed) == 0 {
                let now = activity.base.elapsed().as_millis() as u64;
                activity.stalled_ms.store(now + 1, Ordering::Relaxed);
            }
        } else {
            activity.stalled_ms.store(0, Ordering::Relaxed);
        }
        if matches!(result, Poll::Ready(Ok(n)) if *n > 0) {
            activity.moved();
        }
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix.split_to(n));
            self.activity.moved();
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        let blocked = result.is_pending();
        self.activity.read_blocked_idle.store(
            blocked && self.activity.in_flight.load(Ordering::Acquire) == 0,
            Ordering::Relaxed,
        );
        if buf.filled().len() > before {
            self.activity.moved();
            if self.activity.in_flight.load(Ordering::Acquire) == 0 {
                self.activity.head_bytes.store(true, Ordering::Relaxed);
            }
        }
        result
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(&result);
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(&result);
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A request in flight on a connection, from its head to the end of its response body.
#[derive(Debug)]
struct ActiveRequest(Arc<Activity>);

impl ActiveRequest {
    fn new(activity: Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        activity.served.store(true, Ordering::Relaxed);
        activity.touch();
        Self(activity)
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        *self.0.current.lock() = None;
        self.0.touch();
        self.0
            .head_ms
            .store(self.0.last_ms.load(Ordering::Relaxed), Ordering::Relaxed);
        self.0.head_bytes.store(false, Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in flight until it is done, and reports
/// the progress of an answer of the gateway's own to its deadline.
struct Tracked {
    inner: ResponseBody,
    own: Option<Arc<ResponseDeadline>>,
    /// Writes the call's access log line when the body ends or is dropped.
    access: Option<crate::observe::access::Finisher>,
    _active: ActiveRequest,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> PolledFrame {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if let Some(access) = &mut self.access {
            match &frame {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        access.sent(data.len());
                    }
                }
                Poll::Ready(None) => access.completed(),
                Poll::Ready(Some(Err(_))) => access.failed(),
                Poll::Pending => {}
            }
        }
        if let Some(deadline) = &self.own {
            match &frame {
                Poll::Ready(Some(_)) => deadline.handed_frame(),
                Poll::Pending => deadline.waiting_for_upstream(),
                Poll::Ready(None) => {}
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // hyper stops polling a body that says it ended: its end is seen here.
        if let Some(access) = &mut self.access
            && self.inner.is_end_stream()
        {
            access.completed();
        }
    }
}

/// Shuts down gracefully: the listener stops accepting (the caller flips `shutdown`), every
/// connection finishes its in-flight requests, and this waits for them up to `grace`.
/// Returns how many connections were still open when the grace ran out.
pub async fn drain(conns: &Connections, grace: Duration) -> usize {
    match tokio::time::timeout(grace, conns.all_closed()).await {
        Ok(()) => 0,
        Err(_) => conns.open(),
    }
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

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_without_requests_and_bytes() {
        let a = Arc::new(Activity::new());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(a.idle_for(Duration::from_secs(5)));
        let req = ActiveRequest::new(a.clone());
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(
            !a.idle_for(Duration::from_secs(5)),
            "a request in flight keeps it busy"
        );
        drop(req);
        assert!(
            !a.idle_for(Duration::from_secs(5)),
            "the response just ended"
        );
        assert_eq!(
            a.idle_check_at(Duration::from_secs(5)),
            Instant::now() + Duration::from_secs(5)
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(a.idle_for(Duration::from_secs(5)));
    }
}
