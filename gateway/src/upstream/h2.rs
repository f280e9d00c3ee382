//! HTTP/2 upstream connections (hyper's `client::conn::http2`), pooled by the stream: one
//! connection carries many calls, and what the pool leases is a *stream slot* on it
//! ([`H2Stream`]), so that the pool's per-endpoint cap, its idle stack and its counts are streams.
//!
//! - **Streams before connections**: a new slot goes on an open connection of the address while
//!   it has fewer slots than the server's `SETTINGS_MAX_CONCURRENT_STREAMS`; a connection is
//!   opened only when every open one is full, one at a time per address (a crowd waits for the
//!   handshake in progress and shares its connection).
//! - **The server's frames are watched** (`frames::FrameWatch`, on the bytes hyper reads): its
//!   `SETTINGS` give the stream limit (a new connection's first slot waits for them), a `GOAWAY`
//!   makes the connection take no new stream while the streams it carries finish; the next call
//!   goes on another connection.
//! - **Driven by its own task**: many calls share the connection, so its IO runs in a task of its
//!   own (unlike HTTP/1.1, driven by the one call on it); a call's deadlines cut its stream
//!   (hyper resets it when the call drops it), never the connection.
//! - **Pinged**: with upstream keepalive on, hyper sends a `PING` every `http2PingInterval`
//!   (idle or not); one unanswered for `http2PingTimeout` ends the connection, its idle slots
//!   are dropped, and a stream that had no answer yet fails as closed unanswered (a replayable
//!   call goes again on a fresh connection).
//! - **Closed with its last slot**: the connection goes once no slot is left on it (hyper then
//!   ends it with a `GOAWAY`); the last slot keeps its place in the pool until the connection's
//!   IO is gone.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri, header};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::time::Instant;

use super::frames::{FrameWatch, PeerFrames};
use super::keepalive::Keepalive;
use super::send_error::SendError;
use super::transport::Transport;
use crate::pool::Multiplexed;
use crate::proxy::body::RequestBody;

/// One HTTP/2 connection, shared by its stream slots.
#[derive(Debug)]
pub(super) struct H2Conn {
    sender: http2::SendRequest<RequestBody>,
    peer: Arc<PeerFrames>,
    /// Slots alive on it (leased or idle in the pool).
    slots: AtomicU32,
    opened: Instant,
    /// Over TLS: the server name's authority, the `:authority` of every request.
    authority: Option<HeaderValue>,
    tls: bool,
}

impl H2Conn {
    /// HTTP/2 over `transport` (after its TLS handshake, if any): hyper's handshake, the
    /// connection's task, then the server's first `SETTINGS`.
    pub(super) async fn open(
        transport: Transport,
        addr: SocketAddr,
        authority: Option<HeaderValue>,
        keepalive: Option<Keepalive>,
    ) -> std::io::Result<Arc<Self>> {
        let peer = PeerFrames::new();
        let tls = transport.is_tls();
        let transport = transport.watched(FrameWatch::new(peer.clone()));
        let mut builder = http2::Builder::new(TokioExecutor::new());
        builder.timer(TokioTimer::new());
        if let Some(k) = keepalive {
            builder
                .keep_alive_interval(k.ping_interval)
                .keep_alive_timeout(k.ping_timeout)
                .keep_alive_while_idle(true);
        }
        let (sender, conn) = builder
            .handshake::<_, RequestBody>(TokioIo::new(transport))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::debug!(%addr, %error, "upstream HTTP/2 connection ended with an error");
            }
        });
        if !peer.settled().await {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the HTTP/2 server closed the connection before its SETTINGS",
            ));
        }
        Ok(Arc::new(Self {
            sender,
            peer,
            slots: AtomicU32::new(0),
            opened: Instant::now(),
            authority,
            tls,
        }))
    }

    /// Whether it takes new streams: open, and no `GOAWAY` seen.
    fn usable(&self) -> bool {
        !self.peer.going_away() && !self.peer.ended() && !self.sender.is_closed()
    }

    /// A new slot, while it has fewer than the server's limit.
    pub(super) fn slot(self: &Arc<Self>) -> Option<H2Stream> {
        if !self.usable() {
            return None;
        }
        let max = self.peer.max_streams();
        self.slots
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(H2Stream {
            sender: self.sender.clone(),
            conn: self.clone(),
        })
    }
}

/// One stream slot on an HTTP/2 connection: what the pool leases.
#[derive(Debug)]
pub struct H2Stream {
    sender: http2::SendRequest<RequestBody>,
    conn: Arc<H2Conn>,
}

impl Drop for H2Stream {
    fn drop(&mut self) {
        self.conn.slots.fetch_sub(1, Ordering::AcqRel);
    }
}

impl H2Stream {
    /// Whether its connection still takes streams.
    pub(super) fn is_open(&self) -> bool {
        self.conn.usable()
    }

    /// Whether a stream can be opened now.
    pub(super) fn is_ready(&self) -> bool {
        self.is_open() && self.sender.is_ready()
    }

    pub(super) fn opened(&self) -> Instant {
        self.conn.opened
    }

    /// Waits until the connection can take a request.
    pub(super) async fn ready(&mut self) -> hyper::Result<()> {
        self.sender.ready().await
    }

    /// Sends `req` on a new stream and waits for the response head. A request hyper did not
    /// send comes back; a stream the server refused unprocessed (`REFUSED_STREAM`, or above the
    /// last stream of its `GOAWAY`) is [`SendError::ClosedUnanswered`].
    pub(super) async fn send(
        &mut self,
        mut req: Request<RequestBody>,
    ) -> Result<Response<Incoming>, SendError> {
        let (uri, host) = (req.uri().clone(), req.headers().get(header::HOST).cloned());
        self.absolute(&mut req);
        self.sender.try_send_request(req).await.map_err(|mut e| {
            match e.take_message() {
                Some(mut req) => {
                    // As it came, for whichever connection takes it next.
                    *req.uri_mut() = uri;
                    if let Some(host) = host {
                        req.headers_mut().insert(header::HOST, host);
                    }
                    SendError::Unsent(Box::new(req), e.into_error().into())
                }
                None => {
                    let error = e.into_error();
                    // Refused, or the connection went before any answer: its ping went
                    // unanswered (a timeout), or it ended under the stream (canceled).
                    if refused(&error) || error.is_timeout() || error.is_canceled() {
                        SendError::ClosedUnanswered(error.into())
                    } else {
                        SendError::Failed(error.into())
                    }
                }
            }
        })
    }

    /// Gives `req` the `:scheme` and `:authority` HTTP/2 asks for: the connection's scheme,
    /// and the server name over TLS, else the request's `Host` (which then goes).
    fn absolute(&self, req: &mut Request<RequestBody>) {
        let host = self
            .conn
            .authority
            .as_ref()
            .or_else(|| req.headers().get(header::HOST));
        let Some(authority) = host
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.parse::<Authority>().ok())
        else {
            return;
        };
        let mut parts = req.uri().clone().into_parts();
        parts.scheme = Some(if self.conn.tls {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        });
        parts.authority = Some(authority);
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        }
        if let Ok(uri) = Uri::from_parts(parts) {
            *req.uri_mut() = uri;
            req.headers_mut().remove(header::HOST);
        }
    }

    /// Closes the slot; the last one of its connection closes the connection, and resolves once
    /// the connection's IO is gone.
    pub(super) fn close(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let conn = self.conn.clone();
        drop(self);
        let H2Conn { sender, peer, .. } = Arc::into_inner(conn)?;
        // Without a sender hyper ends the connection with a GOAWAY.
        drop(sender);
        Some(async move { peer.gone().await })
    }
}

/// Whether the server refused a stream without processing it (RFC 9113 §8.7).
fn refused(error: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(h2) = cause.downcast_ref::<::h2::Error>() {
            return h2.is_go_away() && h2.is_remote()
                || h2.reason() == Some(::h2::Reason::REFUSED_STREAM);
        }
        source = cause.source();
    }
    false
}

/// The HTTP/2 connections of one backend's addresses, for new slots.
#[derive(Debug, Default)]
pub(super) struct H2Conns {
    by_addr: Mutex<HashMap<SocketAddr, Arc<AddrConns>>>,
}

#[derive(Debug, Default)]
struct AddrConns {
    /// Held while a connection to the address is opened: one handshake at a time.
    opening: tokio::sync::Mutex<()>,
    conns: Mutex<Vec<Weak<H2Conn>>>,
    /// Its last new connection was not HTTP/2 (ALPN chose HTTP/1.1): new connections are opened
    /// side by side, as HTTP/1.1 ones are.
    other: AtomicBool,
}

impl AddrConns {
    /// A slot on an open connection with room, if there is one (gone ones are forgotten; one
    /// going away stays listed, for [`H2Conns::sockets`], while its streams finish).
    fn slot(&self) -> Option<H2Stream> {
        let mut conns = self.conns.lock();
        conns.retain(|c| c.strong_count() > 0);
        conns
            .iter()
            .filter_map(Weak::upgrade)
            .find_map(|c| c.slot())
    }
}

/// What [`H2Conns::slot`] got.
pub(super) enum Opened<T> {
    /// A slot of an HTTP/2 connection, and whether the connection was there before.
    Stream(H2Stream, bool),
    /// The address answered with another protocol.
    Other(T),
}

impl H2Conns {
    /// What is open to `addr` over HTTP/2.
    pub(super) fn sockets(&self, addr: SocketAddr) -> Multiplexed {
        let Some(entry) = self.by_addr.lock().get(&addr).cloned() else {
            return Multiplexed::default();
        };
        let conns = entry.conns.lock();
        conns
            .iter()
            .filter_map(Weak::upgrade)
            .fold(Multiplexed::default(), |mut m, c| {
                m.connections += 1;
                m.streams += c.slots.load(Ordering::Acquire);
                if c.usable() {
                    let max = c.peer.max_streams();
                    m.max_streams = Some(m.max_streams.map_or(max, |m| m.min(max)));
                }
                m
            })
    }

    /// A slot for `addr`: on an open connection while one has room (no new connection), else on
    /// the one `open` makes, one opening at a time per address.
    pub(super) async fn slot<T, F>(&self, addr: SocketAddr, open: F) -> std::io::Result<Opened<T>>
    where
        F: Future<Output = std::io::Result<Result<Arc<H2Conn>, T>>>,
    {
        let entry = self.by_addr.lock().entry(addr).or_default().clone();
        if let Some(slot) = entry.slot() {
            return Ok(Opened::Stream(slot, true));
        }
        let _opening = if entry.other.load(Ordering::Relaxed) {
            None
        } else {
            let opening = entry.opening.lock().await;
            if let Some(slot) = entry.slot() {
                return Ok(Opened::Stream(slot, true));
            }
            Some(opening)
        };
        match open.await? {
            Ok(conn) => {
                entry.other.store(false, Ordering::Relaxed);
                let slot = conn.slot().ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::ConnectionRefused,
                        "the HTTP/2 server takes no stream",
                    )
                })?;
                entry.conns.lock().push(Arc::downgrade(&conn));
                Ok(Opened::Stream(slot, false))
            }
            Err(other) => {
                entry.other.store(true, Ordering::Relaxed);
                Ok(Opened::Other(other))
            }
        }
    }
}

/// One health probe over HTTP/2 on `transport`: whether `GET path` answers 2xx by `deadline`.
pub(super) async fn probe(
    transport: Transport,
    addr: SocketAddr,
    authority: Option<HeaderValue>,
    path: &str,
    deadline: Instant,
) -> bool {
    let exchange = async {
        let conn = H2Conn::open(transport, addr, authority, None).await.ok()?;
        let mut slot = conn.slot()?;
        let body: RequestBody = http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed_unsync();
        let req = Request::get(path)
            .header(header::HOST, addr.to_string())
            .body(body)
            .ok()?;
        let response = slot.send(req).await.ok()?;
        Some(response.status())
    };
    matches!(
        tokio::time::timeout_at(deadline, exchange).await,
        Ok(Some(status)) if status.is_success()
    )
}
