//! Body types: the boxed request/response bodies, and the client request body on its way to
//! the backend: it replays what the router buffered, enforces `maxBodyBytes` and the listener's
//! body-read timeout and minimum rate while streaming, and records when it was sent in full (the
//! first-byte timer starts then) or how the client failed it (so that the backend is not blamed).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use parking_lot::Mutex;
use poolpilot_api::limits::{BODY_RATE_GRACE, ListenerLimits};
use tokio::time::{Instant, Sleep};

use super::route_budget::Reservation;

/// A boxed, thread-safe error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What `poll_frame` of the gateway's own bodies returns: the next frame, an error, or the end.
pub type PolledFrame = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

/// What the gateway sends back to clients.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// What the gateway sends to backends.
pub type RequestBody = UnsyncBoxBody<Bytes, BoxError>;

/// How a client failed its request body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BodyFailure {
    /// It went over `maxBodyBytes` (413).
    #[error("request body exceeds {0} bytes")]
    TooLarge(u64),
    /// It stalled longer than `bodyReadTimeout`, or arrived slower than `minBodyRate` (408).
    #[error("request body not received in time")]
    Timeout,
    /// The client's stream failed (it went away, or sent a malformed body).
    #[error("reading the request body failed")]
    Broken,
}

/// The pace a request body must keep: the next bytes within `bodyReadTimeout`, and once it has
/// taken longer than [`BODY_RATE_GRACE`], on average at least `minBodyRate` bytes a second.
#[derive(Clone, Copy, Debug)]
pub struct BodyPace {
    started: Instant,
    read_timeout: Duration,
    min_rate: u32,
}

impl BodyPace {
    /// The pace of a body whose head arrived at `started`.
    pub fn new(started: Instant, limits: &ListenerLimits) -> Self {
        Self {
            started,
            read_timeout: limits.body_read_timeout.get(),
            min_rate: limits.min_body_rate,
        }
    }

    /// When a body that received `received` bytes, the last of them at `last`, is too slow.
    pub fn deadline(&self, received: u64, last: Instant) -> Instant {
        let gap = last + self.read_timeout;
        if self.min_rate == 0 {
            return gap;
        }
        let rate = self.started
            + BODY_RATE_GRACE
            + Duration::from_secs_f64(received as f64 / f64::from(self.min_rate));
        gap.min(rate)
    }
}

/// What the proxy learns about a request body while it streams to the backend.
#[derive(Debug, Default)]
pub struct BodyProgress(Mutex<Progress>);

#[derive(Debug, Default)]
struct Progress {
    sent_at: Option<Instant>,
    failed: Option<BodyFailure>,
    /// The body's last poll found no bytes from the client (the gateway waits for the client,
    /// not for the backend to take more).
    waiting_for_client: bool,
    /// Bytes of the body read from the client so far (the access log's `bytes_in`).
    received: u64,
    /// Woken when the body ends or fails: the task waiting for the response head, when the
    /// body is sent from another task (HTTP/2 upstreams pipe it from one of their own).
    waiter: Option<Waker>,
}

impl BodyProgress {
    /// When the whole body was handed to the backend connection.
    pub fn sent_at(&self) -> Option<Instant> {
        self.0.lock().sent_at
    }

    /// How the client failed the body, if it did.
    pub fn failed(&self) -> Option<BodyFailure> {
        self.0.lock().failed
    }

    /// Whether the gateway is waiting for the client's next bytes.
    pub fn waiting_for_client(&self) -> bool {
        self.0.lock().waiting_for_client
    }

    /// Bytes of the body read from the client so far.
    pub fn received(&self) -> u64 {
        self.0.lock().received
    }

    /// Wakes `waker` when the body ends or fails (the last one registered).
    pub fn wake_on_end(&self, waker: &Waker) {
        let mut progress = self.0.lock();
        match &progress.waiter {
            Some(w) if w.will_wake(waker) => {}
            _ => progress.waiter = Some(waker.clone()),
        }
    }
}

impl Progress {
    fn wake(&mut self) {
        if let Some(waiter) = self.waiter.take() {
            waiter.wake();
        }
    }
}

/// A client request body: the bytes the router already buffered, then the rest of the
/// stream, failing past `limit` bytes or when it is too slow.
#[derive(Debug)]
pub struct ClientBody {
    prefix: Option<Bytes>,
    /// Holds the routing buffer's share of the pod-wide budget until the prefix is handed on.
    _reserved: Option<Reservation>,
    rest: Option<Incoming>,
    seen: u64,
    limit: u64,
    pace: BodyPace,
    last_read: Instant,
    timer: Option<Pin<Box<Sleep>>>,
    progress: Arc<BodyProgress>,
}

impl ClientBody {
    /// A body of `prefix` (already read, counted, holding `reserved` of the routing budget)
    /// followed by `rest`.
    pub fn new(
        prefix: Option<Bytes>,
        reserved: Option<Reservation>,
        rest: Option<Incoming>,
        limit: u64,
        pace: BodyPace,
    ) -> Self {
        let seen = prefix.as_ref().map_or(0, |p| p.len() as u64);
        let body = Self {
            prefix: prefix.filter(|p| !p.is_empty()),
            _reserved: reserved,
            rest,
            seen,
            limit,
            pace,
            last_read: Instant::now(),
            timer: None,
            progress: Arc::default(),
        };
        body.progress.0.lock().received = seen;
        if body.is_end_stream() {
            body.progress.0.lock().sent_at = Some(Instant::now());
        }
        body
    }

    /// What the proxy reads while the body streams.
    pub fn progress(&self) -> Arc<BodyProgress> {
        self.progress.clone()
    }

    /// The whole body, when the gateway holds all of it before sending (the router buffered it
    /// to its end, or there is none); `None` while part of it is still with the client.
    pub fn held(&self) -> Option<Bytes> {
        self.rest
            .as_ref()
            .is_none_or(|r| r.is_end_stream())
            .then(|| self.prefix.clone().unwrap_or_default())
    }

    /// A body of `bytes` sent again: it reports to `progress` (the first send's) as if it were
    /// the first, so the first-byte timer starts when it has been written anew.
    pub fn replay(bytes: Bytes, progress: Arc<BodyProgress>) -> Self {
        let now = Instant::now();
        {
            let mut p = progress.0.lock();
            p.sent_at = bytes.is_empty().then_some(now);
            p.waiting_for_client = false;
        }
        Self {
            seen: bytes.len() as u64,
            prefix: Some(bytes).filter(|b| !b.is_empty()),
            _reserved: None,
            rest: None,
            limit: u64::MAX,
            // Never consulted: a body without `rest` never waits for the client.
            pace: BodyPace {
                started: now,
                read_timeout: Duration::MAX,
                min_rate: 0,
            },
            last_read: now,
            timer: None,
            progress,
        }
    }

    fn fail(&mut self, failure: BodyFailure) -> PolledFrame {
        self.rest = None;
        self.timer = None;
        let mut progress = self.progress.0.lock();
        progress.failed = Some(failure);
        progress.waiting_for_client = false;
        progress.wake();
        Poll::Ready(Some(Err(failure.into())))
    }

    fn ended(&mut self) {
        self.rest = None;
        self.timer = None;
        let mut progress = self.progress.0.lock();
        progress.sent_at = Some(Instant::now());
        progress.waiting_for_client = false;
        progress.wake();
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> PolledFrame {
        if let Some(prefix) = self.prefix.take() {
            self._reserved = None;
            if self.rest.as_ref().is_none_or(|r| r.is_end_stream()) {
                self.ended();
            }
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        let Some(rest) = self.rest.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.seen += data.len() as u64;
                    self.last_read = Instant::now();
                    if self.seen > self.limit {
                        let limit = self.limit;
                        return self.fail(BodyFailure::TooLarge(limit));
                    }
                }
                {
                    let mut progress = self.progress.0.lock();
                    progress.waiting_for_client = false;
                    progress.received = self.seen;
                }
                if self.rest.as_ref().is_some_and(|r| r.is_end_stream()) {
                    self.ended();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(_))) => self.fail(BodyFailure::Broken),
            Poll::Ready(None) => {
                self.ended();
                Poll::Ready(None)
            }
            Poll::Pending => {
                let deadline = self.pace.deadline(self.seen, self.last_read);
                let timer = self
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return self.fail(BodyFailure::Timeout);
                }
                self.progress.0.lock().waiting_for_client = true;
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |r| r.size_hint());
        let mut hint = SizeHint::new();
        hint.set_lower(prefix + rest.lower());
        if let Some(upper) = rest.upper() {
            hint.set_upper(prefix + upper);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_body_must_keep_both_its_gap_and_its_rate() {
        let limits = ListenerLimits {
            body_read_timeout: poolpilot_api::Duration::from_secs(10),
            min_body_rate: 100,
            ..ListenerLimits::default()
        };
        let start = Instant::now();
        let pace = BodyPace::new(start, &limits);
        // Nothing yet: the rate allows the grace (5 s), the gap 10 s.
        assert_eq!(pace.deadline(0, start), start + BODY_RATE_GRACE);
        // 1000 bytes by 2 s: the rate allows 5 + 10 s, the gap 2 + 10 s.
        let last = start + Duration::from_secs(2);
        assert_eq!(pace.deadline(1000, last), last + Duration::from_secs(10));
        // 100 bytes by 9 s: the rate's 5 + 1 s came first.
        let last = start + Duration::from_secs(9);
        assert_eq!(pace.deadline(100, last), start + Duration::from_secs(6));
        let no_rate = BodyPace::new(
            start,
            &ListenerLimits {
                min_body_rate: 0,
                ..limits
            },
        );
        assert_eq!(no_rate.deadline(0, last), last + Duration::from_secs(10));
    }
}
