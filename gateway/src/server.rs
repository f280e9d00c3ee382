//! The client-facing listener: the accept loop (total and per-source-IP connection caps,
//! accept errors such as EMFILE survived with back-off), one hyper-util auto (HTTP/1.1 + h2)
//! connection per socket with the head limits and header-read timeout of the limits in force,
//! the keep-alive idle timeout, and graceful drain on shutdown.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::body::{BoxError, ResponseBody};
use crate::gateway::Gateway;

/// hyper's smallest HTTP/1 read buffer; smaller head limits are enforced per request.
const MIN_BUF: usize = 8192;

/// Open client connections, in total and per source IP.
#[derive(Debug, Default)]
pub struct Connections {
    total: AtomicUsize,
    by_ip: Mutex<HashMap<IpAddr, u32>>,
    closed: Notify,
}

/// One counted client connection; uncounts itself when dropped.
#[derive(Debug)]
struct ConnGuard {
    conns: Arc<Connections>,
    ip: IpAddr,
    gw: Gateway,
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
        let Some(guard) = admit(&gw, &conns, peer.ip()) else {
            gw.metrics().downstream_rejected();
            tracing::debug!("client connection refused: its source holds too many");
            drop(stream);
            continue;
        };
        tokio::spawn(serve_connection(
            stream,
            peer,
            gw.clone(),
            guard,
            shutdown.clone(),
        ));
    }
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

fn admit(gw: &Gateway, conns: &Arc<Connections>, ip: IpAddr) -> Option<ConnGuard> {
    let per_client = gw.snapshot().limits.listener.max_connections_per_client;
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
    })
}

/// Serves one client connection until it closes, its keep-alive idle timeout passes, or
/// shutdown asks it to finish its in-flight requests and close.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    gw: Gateway,
    guard: ConnGuard,
    mut shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let limits = gw.snapshot().limits.listener.clone();
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(ActivityIo {
        inner: stream,
        activity: activity.clone(),
    });

    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout.get())
        .max_headers(limits.max_headers as usize)
        .max_buf_size((limits.max_header_bytes as usize).max(MIN_BUF));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(limits.max_header_bytes);

    let service = {
        let activity = activity.clone();
        service_fn(move |req: Request<Incoming>| {
            let gw = gw.clone();
            let active = ActiveRequest::new(activity.clone());
            async move {
                let response = crate::proxy::handle(gw, peer, req).await;
                Ok::<_, std::convert::Infallible>(response.map(|body| {
                    Tracked {
                        inner: body,
                        _active: active,
                    }
                    .boxed_unsync()
                }))
            }
        })
    };
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let idle_timeout = limits.idle_timeout.get();
    let mut draining = false;
    loop {
        let idle_check = tokio::time::sleep(activity.idle_check_in(idle_timeout));
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "client connection ended with an error");
                }
                break;
            }
            _ = idle_check, if !draining => {
                if activity.idle_for(idle_timeout) {
                    tracing::debug!("closing an idle client connection");
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
    drop(guard);
}

/// When a connection last moved bytes, and how many of its requests are in flight.
#[derive(Debug)]
struct Activity {
    base: Instant,
    last_ms: AtomicU64,
    in_flight: AtomicUsize,
}

impl Activity {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            last_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        }
    }

    fn touch(&self) {
        self.last_ms
            .store(self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn idle_since(&self) -> Instant {
        self.base + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Idle: no request in flight and no bytes for `timeout`.
    fn idle_for(&self, timeout: Duration) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0 && self.idle_since().elapsed() >= timeout
    }

    /// When to check next.
    fn idle_check_in(&self, timeout: Duration) -> Duration {
        let due = (self.idle_since() + timeout).saturating_duration_since(Instant::now());
        due.max(Duration::from_millis(10))
    }
}

/// The client socket, noting activity on every read and write.
#[derive(Debug)]
struct ActivityIo {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for ActivityIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        result
    }
}

impl AsyncWrite for ActivityIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
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
        activity.touch();
        Self(activity)
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in flight until it is done.
struct Tracked {
    inner: ResponseBody,
    _active: ActiveRequest,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
            a.idle_check_in(Duration::from_secs(5)),
            Duration::from_secs(5)
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(a.idle_for(Duration::from_secs(5)));
    }
}
