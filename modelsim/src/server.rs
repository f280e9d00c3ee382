//! modelsim's connection layer: the shared server state, the accept loops, exact connection
//! accounting, per-connection control (idle close, injected resets, graceful and hard shutdown).

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, StatusCode};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout_at};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::config::{Config, Faults};
use super::engine::Admission;
use super::handler;
use super::metrics::{ConnectionAtPeak, Metrics, Stats};

/// State shared by every connection and request of one modelsim.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: Config,
    pub faults: watch::Sender<Faults>,
    pub metrics: Metrics,
    pub admission: Admission,
    pub rng: Mutex<StdRng>,
    pub refuse_status: StatusCode,
    pub instance_header: Option<HeaderValue>,
    pub started_unix: u64,
    seq: AtomicU64,
    draining: AtomicBool,
    epoch: Instant,
    /// Stop accepting and close connections once their current request is answered.
    pub shutdown: CancellationToken,
    /// Drop every connection now.
    pub hard_stop: CancellationToken,
    connections_changed: Notify,
}

impl Shared {
    /// Builds the state of a validated configuration.
    pub fn new(config: Config) -> Self {
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let metrics = Metrics::new(config.max_concurrency, config.max_queue);
        metrics
            .health_failing
            .set(i64::from(config.faults.health_failing));
        Self {
            faults: watch::Sender::new(config.faults.clone()),
            admission: Admission::new(config.max_concurrency, config.max_queue),
            rng: Mutex::new(rng),
            refuse_status: StatusCode::from_u16(config.refuse_status)
                .unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            instance_header: HeaderValue::from_str(&config.instance).ok(),
            started_unix: unix_now(),
            seq: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            epoch: Instant::now(),
            shutdown: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            connections_changed: Notify::new(),
            metrics,
            config,
        }
    }

    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> Stats {
        self.metrics
            .stats(&self.config.instance, self.is_draining())
    }

    /// Validates and installs new faults; running connections see them at once.
    pub fn set_faults(&self, faults: Faults) -> Result<(), String> {
        faults.validate()?;
        self.metrics
            .health_failing
            .set(i64::from(faults.health_failing));
        self.faults.send_replace(faults);
        Ok(())
    }

    fn open_connections(&self) -> i64 {
        self.metrics.connections_open.get() + self.metrics.admin_connections_open.get()
    }

    /// Waits until no connection is open or `deadline` passes; true when none is open.
    async fn connections_closed(&self, deadline: Instant) -> bool {
        loop {
            let notified = self.connections_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.open_connections() == 0 {
                return true;
            }
            if timeout_at(deadline, notified).await.is_err() {
                return self.open_connections() == 0;
            }
        }
    }

    /// Graceful shutdown: stop accepting (the caller ends the accept loops), let requests in
    /// progress finish for up to `drain`, then drop whatever is left.
    pub async fn drain(&self, drain: Duration) {
        self.draining.store(true, Ordering::Relaxed);
        self.shutdown.cancel();
        if !self.connections_closed(Instant::now() + drain).await {
            warn!(
                open = self.open_connections(),
                "drain timeout: dropping the connections left"
            );
        }
        self.hard_stop.cancel();
        self.connections_closed(Instant::now() + Duration::from_secs(1))
            .await;
    }
}

/// Wall-clock seconds since the Unix epoch, for the OpenAI `created` fields.
#[expect(
    clippy::disallowed_methods,
    reason = "the OpenAI `created` field is wall-clock time by definition; nothing is timed with it"
)]
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

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
    fn new(epoch: Instant, peer: SocketAddr) -> Self {
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

    /// When the connection will have been idle for `idle` if nothing happens; while a request is
    /// in progress, a time to look again.
    fn idle_deadline(&self, idle: Duration) -> Instant {
        if self.active_requests.load(Ordering::Relaxed) > 0 {
            Instant::now() + idle
        } else {
            self.epoch + Duration::from_nanos(self.last_activity_ns.load(Ordering::Relaxed)) + idle
        }
    }

    /// Remembers the `X-Forwarded-For` of a request.
    fn forwarded_for(&self, value: Option<&HeaderValue>) {
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

    fn idle_for(&self, idle: Duration) -> bool {
        self.active_requests.load(Ordering::Relaxed) == 0
            && Instant::now() >= self.idle_deadline(idle)
    }
}

/// Marks a request in progress on its connection, from the moment hyper hands it over until its
/// response body has been written out or dropped.
#[derive(Debug)]
pub(crate) struct RequestGuard(Arc<ConnCtl>);

impl RequestGuard {
    fn new(ctl: Arc<ConnCtl>) -> Self {
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
struct TrackedIo {
    stream: TcpStream,
    ctl: Arc<ConnCtl>,
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

/// Counts one open connection from accept until its task ends.
#[derive(Debug)]
struct ConnGuard {
    shared: Arc<Shared>,
    /// Its id among the serving connections, `None` on the admin listener.
    serving: Option<u64>,
}

impl ConnGuard {
    fn open(shared: &Arc<Shared>, ctl: &Arc<ConnCtl>, admin: bool) -> Self {
        let m = &shared.metrics;
        let serving = if admin {
            m.admin_connections_open.inc();
            None
        } else {
            Some(m.connection_opened(ctl))
        };
        Self {
            shared: Arc::clone(shared),
            serving,
        }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let m = &self.shared.metrics;
        match self.serving {
            Some(id) => m.connection_closed(id),
            None => {
                m.admin_connections_open.dec();
            }
        }
        self.shared.connections_changed.notify_waiters();
    }
}

/// Accepts connections until shutdown; `admin` listeners' connections are counted apart.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener, admin: bool) {
    let mut last_warning: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            () = shared.shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                if let Err(e) = stream.set_nodelay(true) {
                    debug!(error = %e, "cannot set TCP_NODELAY");
                }
                let ctl = Arc::new(ConnCtl::new(shared.epoch, peer));
                let guard = ConnGuard::open(&shared, &ctl, admin);
                tokio::spawn(serve_connection(Arc::clone(&shared), stream, ctl, guard));
            }
            Err(e) => {
                // Typically EMFILE under a low fd limit: back off instead of spinning (the
                // backlog keeps the clients), count it, and warn at most once a second.
                shared.metrics.accept_errors.inc();
                if last_warning.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                    warn!(error = %e, total = shared.metrics.accept_errors.get(), "accept failed");
                    last_warning = Some(Instant::now());
                }
                tokio::select! {
                    () = shared.shutdown.cancelled() => break,
                    () = sleep(Duration::from_millis(20)) => {}
                }
            }
        }
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn serve_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    ctl: Arc<ConnCtl>,
    guard: ConnGuard,
) {
    let _guard = guard;
    let io = TokioIo::new(TrackedIo {
        stream,
        ctl: Arc::clone(&ctl),
    });
    let service = {
        let shared = Arc::clone(&shared);
        let ctl = Arc::clone(&ctl);
        service_fn(move |req| {
            let shared = Arc::clone(&shared);
            let ctl = Arc::clone(&ctl);
            ctl.forwarded_for(req.headers().get("x-forwarded-for"));
            let guard = RequestGuard::new(Arc::clone(&ctl));
            async move {
                let mut resp = handler::route(shared, ctl, req).await;
                resp.body_mut().attach(guard);
                Ok::<_, Infallible>(resp)
            }
        })
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // No header-read timeout: an idle keep-alive connection stays open until the client closes
    // it or the idle-close fault closes it, so connection counts only move when told to.
    builder.http1().header_read_timeout(None);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut faults = shared.faults.subscribe();
    let mut closing = false;
    loop {
        let idle = if closing {
            None
        } else {
            faults
                .borrow_and_update()
                .idle_close_ms
                .map(Duration::from_millis)
        };
        let idle_deadline = idle.map(|idle| ctl.idle_deadline(idle));
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    debug!(error = %e, "connection ended with an error");
                }
                break;
            }
            () = ctl.kill.notified() => {
                shared.metrics.connections_reset.inc();
                break;
            }
            () = shared.hard_stop.cancelled() => break,
            () = shared.shutdown.cancelled(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            // A fault change may set or change the idle timeout: recompute it.
            _ = faults.changed(), if !closing => {}
            () = sleep_until_some(idle_deadline) => {
                if idle.is_some_and(|idle| ctl.idle_for(idle)) {
                    shared.metrics.connections_closed_idle.inc();
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}
