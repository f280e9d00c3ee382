//! The deadlines of a response on its way to a client, enforced whether or not the client
//! reads: `timeouts.total` and `timeouts.streamIdle` of the call, and the listener's
//! `sendTimeout`.
//!
//! hyper polls a response body only while the client side has room (an HTTP/1 write buffer
//! with space, an HTTP/2 stream with flow-control window), so timers inside the body would
//! never fire for a client that stops reading. Instead the body reports what it is waiting
//! for ([`ResponseDeadline`]) and a [`Watcher`] polled by the task that serves the response
//! (the connection's task for HTTP/1, the stream's task for HTTP/2) fires the deadline and
//! cuts the response: the HTTP/1 connection is closed, the HTTP/2 stream reset. Dropping the
//! body then releases the pool lease and the client permit at once.
//!
//! ```text
//!   hyper asks for a frame ──► body: none yet ──► waiting for the upstream: streamIdle runs
//!                              body: a frame  ──► waiting for the client:   sendTimeout runs
//!   total runs throughout; whichever comes first cuts the response, and the cut is blamed on
//!   whoever was being waited for (only the upstream's count as upstream timeouts)
//! ```
//!
//! A request has a [`DeadlineSlot`] from its head on; the proxy arms it when the response head
//! arrives. Both run in one task, so a watcher polled right after the connection (or stream)
//! sees every change the body made.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::{Instant, Sleep};

/// Why a response was cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// `timeouts.total` passed while the gateway waited for the backend.
    Total,
    /// `timeouts.streamIdle` passed without a frame from the backend.
    StreamIdle,
    /// `timeouts.total` passed while the client was not reading (the client's doing).
    TotalClientStalled,
    /// The client accepted nothing for `sendTimeout`.
    Send,
}

impl Cut {
    /// Whether the backend caused it (it then counts as an upstream timeout: the call's
    /// accounting in `call.rs` counts `Total` and `StreamIdle` so).
    #[cfg(test)]
    pub fn upstream(self) -> bool {
        matches!(self, Self::Total | Self::StreamIdle)
    }
}

/// What a response in flight waits for, and its deadlines. Shared by the response body (which
/// reports progress) and the [`Watcher`] (which fires).
#[derive(Debug)]
pub struct ResponseDeadline {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    total_at: Instant,
    stream_idle: Duration,
    send_timeout: Duration,
    waiting: Waiting,
    /// When the backend last sent a frame (or the head).
    last_frame: Instant,
    /// Set once the response is cut; the body's drop reads it.
    cut: Option<Cut>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waiting {
    /// hyper asked for a frame and the backend has none yet.
    Upstream,
    /// A frame (or the head) was handed to hyper at this instant and hyper has not asked for
    /// the next one: the client is not taking it.
    Client(Instant),
}

impl ResponseDeadline {
    /// The deadlines of a response whose head arrived now.
    pub fn new(total_at: Instant, stream_idle: Duration, send_timeout: Duration) -> Arc<Self> {
        let now = Instant::now();
        Arc::new(Self {
            state: Mutex::new(State {
                total_at,
                stream_idle,
                send_timeout,
                waiting: Waiting::Client(now),
                last_frame: now,
                cut: None,
            }),
        })
    }

    /// The deadline of an answer the gateway wrote itself (an error, say): only `sendTimeout`
    /// applies, so that a client that gives an HTTP/2 stream no window cannot keep it.
    pub fn client_only(send_timeout: Duration) -> Arc<Self> {
        // Far enough never to fire, near enough not to overflow.
        let never = Duration::from_secs(86_400 * 365);
        Self::new(Instant::now() + never, never, send_timeout)
    }

    /// hyper asked for a frame and the backend had none.
    pub fn waiting_for_upstream(&self) {
        self.state.lock().waiting = Waiting::Upstream;
    }

    /// A frame from the backend was handed to hyper.
    pub fn handed_frame(&self) {
        let now = Instant::now();
        let mut state = self.state.lock();
        state.last_frame = now;
        state.waiting = Waiting::Client(now);
    }

    /// Why the response was cut, if it was.
    pub fn cut(&self) -> Option<Cut> {
        self.state.lock().cut
    }

    /// The next instant at which a deadline may pass (`None`: nothing to watch).
    fn next(&self) -> Option<Instant> {
        let state = self.state.lock();
        if state.cut.is_some() {
            return None;
        }
        let phase = match state.waiting {
            Waiting::Upstream => state.last_frame + state.stream_idle,
            Waiting::Client(since) => since + state.send_timeout,
        };
        Some(phase.min(state.total_at))
    }

    /// Cuts the response if a deadline has passed by `now`.
    fn expire(&self, now: Instant) -> Option<Cut> {
        let mut state = self.state.lock();
        if state.cut.is_some() {
            return None;
        }
        let cut = match state.waiting {
            Waiting::Upstream if now >= state.total_at => Cut::Total,
            Waiting::Client(_) if now >= state.total_at => Cut::TotalClientStalled,
            Waiting::Upstream if now >= state.last_frame + state.stream_idle => Cut::StreamIdle,
            Waiting::Client(since) if now >= since + state.send_timeout => Cut::Send,
            _ => return None,
        };
        state.cut = Some(cut);
        Some(cut)
    }
}

/// Where a request's response deadline appears once its head has arrived.
#[derive(Debug, Default)]
pub struct DeadlineSlot(Mutex<Option<Arc<ResponseDeadline>>>);

impl DeadlineSlot {
    /// Arms the slot with the deadline of the response being sent.
    pub fn arm(&self, deadline: Arc<ResponseDeadline>) {
        *self.0.lock() = Some(deadline);
    }

    /// Whether a deadline was armed.
    pub fn is_armed(&self) -> bool {
        self.0.lock().is_some()
    }

    fn get(&self) -> Option<Arc<ResponseDeadline>> {
        self.0.lock().clone()
    }
}

/// Fires the deadline of the response in a slot. Poll it in the task that polls the response
/// body, after that body's connection or stream: it resolves with the cut once a deadline has
/// passed.
#[derive(Debug)]
pub struct Watcher {
    sleep: Pin<Box<Sleep>>,
}

impl Default for Watcher {
    fn default() -> Self {
        Self {
            sleep: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }
    }
}

impl Watcher {
    /// Resolves with the cut once the deadline of the response in `slot` passes (pending while
    /// the slot is empty). A response is watched until it has left the gateway: its last frame
    /// too may wait for the client (an HTTP/2 stream without window).
    pub fn poll_cut(&mut self, cx: &mut Context<'_>, slot: &DeadlineSlot) -> Poll<Cut> {
        let Some(deadline) = slot.get() else {
            return Poll::Pending;
        };
        loop {
            let Some(at) = deadline.next() else {
                return Poll::Pending;
            };
            if self.sleep.deadline() != at {
                self.sleep.as_mut().reset(at);
            }
            if self.sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if let Some(cut) = deadline.expire(Instant::now()) {
                return Poll::Ready(cut);
            }
            // The deadline moved (a frame arrived): sleep until the new one.
        }
    }
}

/// A future that is dropped (not finished) when the deadline in its slot passes: an HTTP/2
/// stream's task, whose drop resets the stream.
#[derive(Debug)]
pub struct Cuttable<F> {
    inner: Option<Pin<Box<F>>>,
    slot: Option<Arc<DeadlineSlot>>,
    watcher: Watcher,
}

impl<F: Future<Output = ()>> Cuttable<F> {
    /// `inner`, cut when `slot`'s deadline passes.
    pub fn new(inner: F, slot: Option<Arc<DeadlineSlot>>) -> Self {
        Self {
            inner: Some(Box::pin(inner)),
            slot,
            watcher: Watcher::default(),
        }
    }
}

impl<F: Future<Output = ()>> Future for Cuttable<F> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(());
        };
        if inner.as_mut().poll(cx).is_ready() {
            this.inner = None;
            return Poll::Ready(());
        }
        if let Some(slot) = &this.slot
            && let Poll::Ready(cut) = this.watcher.poll_cut(cx, slot)
        {
            tracing::debug!(?cut, "response cut; resetting its stream");
            this.inner = None;
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn watch(slot: &DeadlineSlot) -> Cut {
        let mut watcher = Watcher::default();
        std::future::poll_fn(|cx| watcher.poll_cut(cx, slot)).await
    }

    fn deadline() -> Arc<ResponseDeadline> {
        ResponseDeadline::new(
            Instant::now() + Duration::from_secs(10),
            Duration::from_secs(2),
            Duration::from_secs(3),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_of_the_gateways_own_has_only_the_send_timeout() {
        let slot = DeadlineSlot::default();
        assert!(!slot.is_armed());
        slot.arm(ResponseDeadline::client_only(Duration::from_secs(2)));
        let start = Instant::now();
        assert_eq!(watch(&slot).await, Cut::Send);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_takes_nothing_is_cut_at_the_send_timeout() {
        let d = deadline();
        let slot = DeadlineSlot::default();
        slot.arm(d.clone());
        let start = Instant::now();
        let cut = watch(&slot).await;
        assert_eq!(cut, Cut::Send);
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        assert_eq!(d.cut(), Some(Cut::Send));
        assert!(!cut.upstream());
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_backend_is_cut_at_stream_idle_counted_from_its_last_frame() {
        let d = deadline();
        let slot = DeadlineSlot::default();
        slot.arm(d.clone());
        tokio::time::advance(Duration::from_secs(1)).await;
        d.handed_frame();
        d.waiting_for_upstream();
        let start = Instant::now();
        let cut = watch(&slot).await;
        assert_eq!(cut, Cut::StreamIdle);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        assert!(cut.upstream());
    }

    #[tokio::test(start_paused = true)]
    async fn total_is_blamed_on_whoever_was_being_waited_for() {
        for (client_stalled, want) in [(false, Cut::Total), (true, Cut::TotalClientStalled)] {
            let d = ResponseDeadline::new(
                Instant::now() + Duration::from_secs(1),
                Duration::from_secs(5),
                Duration::from_secs(5),
            );
            if !client_stalled {
                d.waiting_for_upstream();
            }
            let slot = DeadlineSlot::default();
            slot.arm(d);
            assert_eq!(watch(&slot).await, want);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn progress_moves_the_deadline() {
        let d = deadline();
        let slot = DeadlineSlot::default();
        slot.arm(d.clone());
        let mut watcher = Watcher::default();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for _ in 0..4 {
            tokio::time::advance(Duration::from_millis(1500)).await;
            d.handed_frame();
            assert!(watcher.poll_cut(&mut cx, &slot).is_pending());
        }
        assert_eq!(d.cut(), None);
    }
}
