//! One TCP connection's state: its activity clock (idle close), requests in progress, the
//! `X-Forwarded-For` it last carried, the reset fault, and the stream wrapper that records
//! activity and resets with `SO_LINGER = 0`.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::HeaderValue;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::debug;

use super::stats::ConnectionAtPeak;

/// Per-connection control shared by the connection task, its IO and its requests.
#[derive(Debug)]
pub(crate) struct ConnCtl {
    epoch: Instant,
    peer: SocketAddr,
    accepted: Instant,
    /// The `X-Forwarded-For` of the last request.
    forwarded_for: Mutex<Option<HeaderValue>>,
    /// Nanoseconds since `epoch` of the last byte moved or request finished.
    last_activity_ns: AtomicU64,
    active_requests: AtomicU32,
    reset: AtomicBool,
    kill: Notify,
}

impl ConnCtl {
    pub fn new(epoch: Instant, peer: SocketAddr) -> Self {
        let ctl = Self {
            epoch,
            peer,
            accepted: Instant::now(),
            forwarded_for: Mutex::new(None),
            last_activity_ns: AtomicU64::new(0),
            active_requests: AtomicU32::new(0),
            reset: AtomicBool::new(false),
            kill: Notify::new(),
        };
        ctl.touch();
        ctl
    }

    fn touch(&self) {
        let ns = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_activity_ns.store(ns, Ordering::Relaxed);
    }

    /// Resets the connection (TCP RST) instead of answering.
    pub fn reset(&self) {
        self.reset.store(true, Ordering::Relaxed);
        self.kill.notify_one();
    }

    /// Resolves when [`Self::reset`] is called.
    pub async fn killed(&self) {
        self.kill.notified().await;
    }

    /// When the connection will have been idle for `idle` if nothing happens; while a request is
    /// in progress, a time to look again.
    pub fn idle_deadline(&self, idle: Duration) -> Instant {
        if self.active_requests.load(Ordering::Relaxed) > 0 {
            Instant::now() + idle
        } else {
            self.epoch + Duration::from_nanos(self.last_activity_ns.load(Ordering::Relaxed)) + idle
        }
    }

    /// Remembers the `X-Forwarded-For` of a request.
    pub fn forwarded_for(&self, value: Option<&HeaderValue>) {
        let mut last = self.forwarded_for.lock();
        if last.as_ref() != value {
            *last = value.cloned();
        }
    }

    /// What [`Stats::connections_at_peak`] reports of this connection now.
    pub fn at_peak(&self) -> ConnectionAtPeak {
        let now = Instant::now();
        let in_request = self.active_requests.load(Ordering::Relaxed) > 0;
        let last = self.epoch + Duration::from_nanos(self.last_activity_ns.load(Ordering::Relaxed));
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        ConnectionAtPeak {
            peer: self.peer.to_string(),
            age_ms: ms(now.saturating_duration_since(self.accepted)),
            idle_ms: if in_request {
                0
            } else {
                ms(now.saturating_duration_since(last))
            },
            in_request,
            forwarded_for: self
                .forwarded_for
                .lock()
                .as_ref()
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        }
    }

    pub fn idle_for(&self, idle: Duration) -> bool {
        self.active_requests.load(Ordering::Relaxed) == 0
            && Instant::now() >= self.idle_deadline(idle)
    }
}

/// Marks a request in progress on its connection, from the moment hyper hands it over until its
/// response body has been written out or dropped.
#[derive(Debug)]
pub(crate) struct RequestGuard(Arc<ConnCtl>);

impl RequestGuard {
    pub fn new(ctl: Arc<ConnCtl>) -> Self {
        ctl.active_requests.fetch_add(1, Ordering::Relaxed);
        Self(ctl)
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.touch();
        self.0.active_requests.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A TCP stream that records activity and, when its connection was reset by a fault, closes
/// with `SO_LINGER = 0` so the peer sees a RST.
#[derive(Debug)]
pub(crate) struct TrackedIo {
    stream: TcpStream,
    ctl: Arc<ConnCtl>,
}

impl TrackedIo {
    pub fn new(stream: TcpStream, ctl: Arc<ConnCtl>) -> Self {
        Self { stream, ctl }
    }
}

impl Drop for TrackedIo {
    fn drop(&mut self) {
        if self.ctl.reset.load(Ordering::Relaxed)
            && let Err(e) = self.stream.set_zero_linger()
        {
            debug!(error = %e, "cannot set SO_LINGER=0 to reset the connection");
        }
    }
}

impl AsyncRead for TrackedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.ctl.touch();
        }
        result
    }
}

impl AsyncWrite for TrackedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            this.ctl.touch();
        }
        result
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            this.ctl.touch();
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
