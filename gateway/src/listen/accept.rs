//! The proxy listener: bound with the kernel's accept queue, accepting until shutdown (accept
//! errors such as EMFILE survived with back-off, new connections left in the backlog beyond
//! `maxConnections`), the PROXY protocol v2 header read first from a trusted proxy, each
//! connection admitted under its source's cap ([`super::registry`]) and served in its own task
//! ([`super::connection`]), or refused with a `429` while the answer rate allows; and the drain
//! at shutdown.

use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use poolpilot_api::limits::ProxyProtocol;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;

use super::connection::serve_connection;
use super::registry::{Connections, admit};
use crate::live::Gateway;
use crate::observe::Refusal;
use crate::proxy::error::ProxyError;

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
                admit_and_serve(stream, peer.ip(), false, &gw, &conns, &shutdown);
            }
            None => admit_and_serve(stream, peer.ip(), true, &gw, &conns, &shutdown),
        }
    }
}

/// Counts a connection from `source` (against its cap when `capped`) and serves it, or
/// refuses it: an answer (429) while the answer rate allows, else a close.
fn admit_and_serve(
    stream: TcpStream,
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
    let source =
        match tokio::time::timeout(wait, super::source::read_proxy_header(&mut stream)).await {
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
    admit_and_serve(stream, source, true, &gw, &conns, &shutdown);
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

/// Shuts down gracefully: the listener stops accepting (the caller flips `shutdown`), every
/// connection finishes its in-flight requests, and this waits for them up to `grace`.
/// Returns how many connections were still open when the grace ran out.
pub async fn drain(conns: &Connections, grace: Duration) -> usize {
    match tokio::time::timeout(grace, conns.all_closed()).await {
        Ok(()) => 0,
        Err(_) => conns.open(),
    }
}
