//! What a client connection's task knows of it ([`Activity`]): when it last moved bytes, its
//! requests in flight, whether it carried one, whether its writes wait for the client (and
//! since when), and the deadline slot of its HTTP/1 request in flight; noted by the socket as
//! hyper sees it ([`ConnIo`], which also replays bytes an earlier hyper connection read) and
//! by each request from its head to the end of its response ([`ActiveRequest`]).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::proxy::deadline::DeadlineSlot;

/// When a connection last moved bytes, how many of its requests are in flight, whether it
/// carried one, and whether its last write had to wait for the socket.
#[derive(Debug)]
pub(super) struct Activity {
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
    pub(super) current: Mutex<Option<Arc<DeadlineSlot>>>,
    /// Whether bytes moved between requests count as activity: not on HTTP/2, whose pings
    /// and their answers would keep a connection without streams open for ever.
    bytes_count: bool,
    /// The client class of the last call on the connection (its reclaims are counted for it).
    pub(super) client: Mutex<Option<Arc<str>>>,
    /// Bytes of a next head were read since the last response ended (a header-read timeout
    /// then cuts a slow head, not an idle connection).
    pub(super) head_bytes: AtomicBool,
}

impl Activity {
    pub(super) fn new() -> Self {
        Self::waiting_since(Instant::now())
    }

    /// A connection (just resumed) whose wait for a head began at `head_since`.
    pub(super) fn waiting_since(head_since: Instant) -> Self {
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
    pub(super) fn streams_only() -> Self {
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

    pub(super) fn idle_since(&self) -> Instant {
        self.base + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Idle: no request in flight and no bytes for `timeout`.
    pub(super) fn idle_for(&self, timeout: Duration) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0 && self.idle_since().elapsed() >= timeout
    }

    /// When to check next for `timeout` of idleness: with a request in flight, not before
    /// `timeout` from now (its end touches the connection).
    pub(super) fn idle_check_at(&self, timeout: Duration) -> Instant {
        let now = Instant::now();
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return now + timeout;
        }
        (self.idle_since() + timeout).max(now + Duration::from_millis(10))
    }

    /// Whether hyper is waiting for the next request with its response written: no request
    /// in flight, the last read found nothing, the last write did not wait.
    pub(super) fn waiting_for_request(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
            && self.read_blocked_idle.load(Ordering::Relaxed)
            && !self.write_blocked()
    }

    pub(super) fn head_since(&self) -> Instant {
        self.base + Duration::from_millis(self.head_ms.load(Ordering::Relaxed))
    }

    pub(super) fn served(&self) -> bool {
        self.served.load(Ordering::Relaxed)
    }

    pub(super) fn write_blocked(&self) -> bool {
        self.write_blocked.load(Ordering::Relaxed)
    }

    /// Since when writes to the client have waited without progress, if they have.
    pub(super) fn stalled_since(&self) -> Option<Instant> {
        match self.stalled_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.base + Duration::from_millis(ms - 1)),
        }
    }
}

/// The client socket as hyper sees it: replays bytes read before (by an earlier hyper
/// connection on this socket), and notes activity on every read and write.
#[derive(Debug)]
pub(super) struct ConnIo {
    pub(super) inner: TcpStream,
    pub(super) prefix: Bytes,
    pub(super) activity: Arc<Activity>,
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
pub(super) struct ActiveRequest(Arc<Activity>);

impl ActiveRequest {
    pub(super) fn new(activity: Arc<Activity>) -> Self {
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
            a.idle_check_at(Duration::from_secs(5)),
            Instant::now() + Duration::from_secs(5)
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(a.idle_for(Duration::from_secs(5)));
    }
}
