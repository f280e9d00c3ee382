//! The per-backend connection pool: a hard cap on open connections per endpoint, waiters in
//! two priority classes (interactive first, FIFO within a class, batch aging and an optional
//! share cap on batch: [`crate::limits::queue`]) with a lease timeout, a bounded pending queue, idle reuse, idle/lifetime expiry,
//! validate-after-idle, runtime resizing, endpoint choice by spare capacity, and the health
//! state (active probes, passive ejection) that decides which endpoints may be chosen.
//!
//! The cap is kept as the backend counts: a connection the pool closes keeps its slot
//! (`closing`) until the backend has closed its side too, up to [`CLOSE_GRACE`]. A backend still
//! working on a request whose client went away, or that has not yet read the close, holds that
//! connection; a new one opened in its place at once would take it over its share.
//!
//! ```text
//!             lease()                                   Lease dropped
//!                │                                            │
//!   ┌────────────▼────────────┐  idle conn   ┌───────────┐     │ keep? ──yes──► idle stack (LIFO)
//!   │ pick endpoint (P2C on   ├─────────────►│  Lease    │◄────┘           │
//!   │ spare capacity, healthy)│  free slot   │ (RAII)    │       no ──► close (reason)
//!   └────────────┬────────────┘──connect────►└───────────┘                 │
//!                │ all full                                      dispatch(): hand idle conns
//!                ▼                                               and free slots to waiters,
//!   pending < maxPending ? waiter ──────lease timeout──► 503   interactive first, FIFO
//!                                                               in a class, batch aged
//!                        : 503 pool_queue_full
//! ```
//!
//! # Concurrency
//!
//! All state sits behind one `parking_lot::Mutex` per backend, never held across an `.await`.
//! Connecting happens outside the lock on a *reserved slot* (`connecting` counts against the
//! cap), so the cap holds while connects are in flight. A waiter is handed either a connection
//! or a reserved slot through a oneshot channel.
//!
//! # Race window
//!
//! A waiter whose lease timeout fires may race a `dispatch()` that just sent it a grant. The
//! waiter removes itself from the queue under the lock; if it is no longer there, the grant is
//! already in its channel and it takes it (`try_recv`) instead of failing. A grant sent to a
//! waiter that was dropped comes back from `send` and is undone under the same lock.

mod rate;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use poolpilot_api::limits::{
    Endpoint, HealthCheck, OutlierDetection, PoolLimits, Priority, PriorityClass,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use rand::Rng;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::limits::queue::{ClassQueue, Entry};
use crate::observe::{CloseReason, Metrics};
pub(crate) use rate::whole_seconds as rate_whole_seconds;
use rate::{HoldTime, ReleaseRate};

/// A connection the pool can keep between leases.
pub trait Poolable: Send + std::fmt::Debug + 'static {
    /// Cheap check that the peer has not closed the connection (no blocking; at most the IO
    /// that is already possible without waiting).
    fn is_open(&mut self) -> bool;

    /// When the connection was opened, if it knows (its age at close is measured from it).
    fn opened_at(&self) -> Option<Instant> {
        None
    }

    /// The check run before reusing a connection that sat idle longer than
    /// `validateAfterIdle`: it must be open *and* ready to carry a request right now.
    fn validate(&mut self) -> bool {
        self.is_open()
    }

    /// Closes the connection. When the peer may still hold its side, returns a future that
    /// resolves once the peer has let go of it too (closed or failed), and the pool keeps the
    /// slot until then (at most [`CLOSE_GRACE`]); `None` when nothing is left to wait for. The
    /// default closes at once.
    fn close(self) -> Option<impl Future<Output = ()> + Send + 'static>
    where
        Self: Sized,
    {
        drop(self);
        None::<std::future::Ready<()>>
    }
}

/// The longest a connection the pool closed keeps its slot waiting for the peer to close its
/// side. A backend that ignores the close (or is wedged) cannot keep a slot for longer.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Opens connections to endpoints.
pub trait Connect: Send + Sync + std::fmt::Debug + 'static {
    /// The connection type pooled.
    type Conn: Poolable;

    /// Opens one connection to `addr`. The pool bounds it with `connectTimeout`.
    fn connect(&self, addr: SocketAddr) -> impl Future<Output = io::Result<Self::Conn>> + Send;
}

/// Why a lease failed. Every variant that tells the client to come back carries a computed
/// `retry_after`.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// `maxPending` lease requests are already waiting.
    #[error("connection pool queue of backend {backend} is full ({pending} waiting)")]
    QueueFull {
        /// The backend.
        backend: Arc<str>,
        /// Waiters at the time.
        pending: usize,
        /// When a retry is likely to find room.
        retry_after: Duration,
    },
    /// No connection freed up within `leaseTimeout`.
    #[error("no connection to backend {backend} became free within {waited:?}")]
    LeaseTimeout {
        /// The backend.
        backend: Arc<str>,
        /// How long the request waited.
        waited: Duration,
        /// When a retry is likely to find room.
        retry_after: Duration,
    },
    /// Every endpoint is unhealthy, ejected or removed.
    #[error("backend {backend} has no healthy endpoint")]
    NoHealthyEndpoint {
        /// The backend.
        backend: Arc<str>,
        /// When an endpoint is expected back (ejection end or probes passing).
        retry_after: Duration,
    },
    /// Connecting took longer than `connectTimeout`.
    #[error("connecting to {endpoint} ({address}) timed out after {timeout:?}")]
    ConnectTimeout {
        /// The endpoint name.
        endpoint: Arc<str>,
        /// Its address.
        address: SocketAddr,
        /// The timeout in force.
        timeout: Duration,
    },
    /// Connecting failed.
    #[error("connecting to {endpoint} ({address}) failed")]
    Connect {
        /// The endpoint name.
        endpoint: Arc<str>,
        /// Its address.
        address: SocketAddr,
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// The backend was removed from the limits while the request waited.
    #[error("backend {backend} was removed")]
    Retired {
        /// The backend.
        backend: Arc<str>,
    },
}

impl PoolError {
    /// The endpoint a connect failure is about, for outlier detection.
    pub fn endpoint(&self) -> Option<&str> {
        match self {
            Self::ConnectTimeout { endpoint, .. } | Self::Connect { endpoint, .. } => {
                Some(endpoint)
            }
            _ => None,
        }
    }
}

/// Counts of one endpoint, for `/v1/stats` and the gauges.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct EndpointStats {
    /// Endpoint name.
    pub name: String,
    /// Its address.
    pub address: SocketAddr,
    /// Connections carrying a request.
    pub leased: u32,
    /// Connections idle in the pool.
    pub idle: u32,
    /// Connections being opened.
    pub connecting: u32,
    /// Connections closed by the pool that the peer has not closed yet (they keep their slot).
    pub closing: u32,
    /// The cap in force.
    pub max: u32,
    /// Whether requests may be sent to it (probes pass, not ejected).
    pub healthy: bool,
    /// Whether passive outlier detection has it ejected.
    pub ejected: bool,
    /// Whether an operator drained it by hand (`POST .../drain`).
    pub drained: bool,
}

/// Counts of one backend's pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Lease requests waiting.
    pub pending: u32,
    /// Per priority class, interactive first.
    pub classes: [ClassStats; 2],
    /// The most connections batch calls may hold (`batchMaxPercent` of the cap over the live
    /// endpoints); none: no cap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_cap: Option<u32>,
    /// `maxPending` in force.
    pub max_pending: u32,
    /// Per endpoint.
    pub endpoints: Vec<EndpointStats>,
}

/// Counts of one priority class in a pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ClassStats {
    /// `interactive` or `batch`.
    pub class: &'static str,
    /// Its lease requests waiting.
    pub pending: u32,
    /// Connections its calls hold (leased, or being opened for them).
    pub held: u32,
}

/// One backend's pool. Cheap to clone; clones share the pool.
#[derive(Debug)]
pub struct Pool<C: Connect> {
    inner: Arc<Inner<C>>,
}

impl<C: Connect> Clone for Pool<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug)]
struct Inner<C: Connect> {
    backend: Arc<str>,
    connector: C,
    metrics: Metrics,
    lease_wait: Histogram,
    /// Lease waits per priority class, interactive first.
    class_wait: [Histogram; 2],
    lease_timeouts: Counter,
    state: Mutex<State<C::Conn>>,
    /// Notified whenever a slot frees other than by a lease returning to a live pool: a closing
    /// connection's peer let go, an abandoned connect or grant came back, or a lease returned
    /// to a retired pool. [`Pool::close_all`] waits on it.
    slot_freed: tokio::sync::Notify,
}

#[derive(Debug)]
struct State<T> {
    limits: PoolLimits,
    health_check: Option<HealthCheck>,
    outlier: Option<OutlierDetection>,
    endpoints: Vec<EndpointState<T>>,
    next_endpoint_id: u64,
    waiters: ClassQueue<oneshot::Sender<Grant<T>>>,
    next_waiter_id: u64,
    /// How the queue treats batch (the backend's client policy's `priority`).
    priority: Priority,
    /// Connections held per class (granted and not yet returned), interactive first.
    held: [u32; 2],
    releases: ReleaseRate,
    hold: HoldTime,
    retired: bool,
}

#[derive(Debug)]
struct EndpointState<T> {
    id: u64,
    name: Arc<str>,
    address: SocketAddr,
    /// Most recently returned last: reuse pops the warmest, so the coldest idle out.
    idle: Vec<IdleConn<T>>,
    leased: u32,
    connecting: u32,
    /// Closed by the pool, waiting for the peer to close its side.
    closing: u32,
    /// Held by active health probes: a probe's connection counts against the cap.
    probing: u32,
    /// Dropped from the limits: no new leases; closes as its connections come back.
    removed: bool,
    /// Drained by hand through the admin API: no new leases, its connections close as they
    /// come back, until restored (kept across limits documents).
    drained: bool,
    health: Health,
    created: Counter,
    reused: Counter,
}

#[derive(Debug)]
struct Health {
    /// Active probes say it is up (presumed up until probes say otherwise).
    probe_up: bool,
    probe_passes: u32,
    probe_failures: u32,
    /// Passive ejection end, if ejected.
    ejected_until: Option<Instant>,
    /// Probes passed in a row since the current ejection began.
    passes_since_ejection: u32,
    consecutive_failures: u32,
    ejections: u32,
}

#[derive(Debug)]
struct IdleConn<T> {
    conn: T,
    created_at: Instant,
    idle_since: Instant,
}

impl<T: Poolable> IdleConn<T> {
    /// Why this idle connection must be closed, of what is known without a request: past its
    /// `maxLifetime`, idle past its `idleTimeout`, or closed by the peer. `None`: it may serve.
    fn expired(&mut self, limits: &PoolLimits, now: Instant) -> Option<CloseReason> {
        if now.duration_since(self.created_at) >= limits.max_lifetime.get() {
            Some(CloseReason::Lifetime)
        } else if now.duration_since(self.idle_since) >= limits.idle_timeout.get() {
            Some(CloseReason::Idle)
        } else if !self.conn.is_open() {
            Some(CloseReason::PeerClosed)
        } else {
            None
        }
    }
}

/// What a waiter is handed.
#[derive(Debug)]
enum Grant<T> {
    /// An idle connection, already counted as leased.
    Conn { endpoint: u64, idle: IdleConn<T> },
    /// A reserved slot at an endpoint: the waiter connects.
    Slot { endpoint: u64 },
}

/// What `lease()` does next, decided under the lock.
enum Step<T> {
    Ready(Grant<T>),
    Wait(oneshot::Receiver<Grant<T>>, u64),
}

/// What a lease in progress holds while `lease()` waits or connects: given back if the lease is
/// dropped meanwhile (its client went away) before it was settled, because a grant lost with
/// its channel, or a reservation lost with its connect, would keep a slot (or a connection)
/// taken for good.
struct Unsettled<C: Connect, H: Holding<C::Conn>> {
    pool: Arc<Inner<C>>,
    class: PriorityClass,
    held: H,
    /// The wait or the connect ended and `lease()` (or `complete()`) took over.
    settled: bool,
}

/// What an [`Unsettled`] lease may hold.
trait Holding<T> {
    /// Once the lease was dropped unsettled (under the pool's lock): the grant to give back,
    /// if it holds one.
    fn grant_to_undo(&mut self, state: &mut State<T>) -> Option<Grant<T>>;
}

/// A place in the waiter queue: the place leaves the queue, or a grant already sent to it is
/// given back.
struct QueuePlace<T> {
    rx: oneshot::Receiver<Grant<T>>,
    id: u64,
}

impl<T> Holding<T> for QueuePlace<T> {
    fn grant_to_undo(&mut self, state: &mut State<T>) -> Option<Grant<T>> {
        if state.waiters.remove(self.id).is_some() {
            return None;
        }
        self.rx.try_recv().ok()
    }
}

/// A slot of `endpoint` reserved for a connect.
struct ReservedSlot {
    endpoint: u64,
}

impl<T> Holding<T> for ReservedSlot {
    fn grant_to_undo(&mut self, _: &mut State<T>) -> Option<Grant<T>> {
        Some(Grant::Slot {
            endpoint: self.endpoint,
        })
    }
}

impl<C: Connect, H: Holding<C::Conn>> Drop for Unsettled<C, H> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let now = Instant::now();
        let mut state = self.pool.state.lock();
        if let Some(grant) = self.held.grant_to_undo(&mut state) {
            self.pool.undo(&mut state, grant, self.class);
            self.pool.freed(state, now);
        }
    }
}

/// A slot of an endpoint's cap held by an active health probe (see [`Pool::probe_slot`]).
/// Drop it once the probe's connection is closed.
#[derive(Debug)]
pub struct ProbeSlot<C: Connect> {
    pool: Arc<Inner<C>>,
    endpoint: u64,
}

impl<C: Connect> Drop for ProbeSlot<C> {
    fn drop(&mut self) {
        self.pool.give_back(self.endpoint, |ep| &mut ep.probing);
    }
}

/// A connection on loan. Dropping it returns the connection to the pool when [`Lease::keep`]
/// was called and closes it otherwise.
#[derive(Debug)]
pub struct Lease<C: Connect> {
    pool: Arc<Inner<C>>,
    endpoint: u64,
    endpoint_name: Arc<str>,
    conn: Option<C::Conn>,
    created_at: Instant,
    leased_at: Instant,
    reused: bool,
    wait: Duration,
    class: PriorityClass,
    outcome: Outcome,
}

/// What happens to a lease's connection when it is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Keep,
    Close(CloseReason),
}

// === impl Pool ===

impl<C: Connect> Pool<C> {
    /// A pool for `backend` over `endpoints`, reaping idle connections in the background for
    /// as long as the pool lives.
    pub fn new(
        backend: &str,
        limits: PoolLimits,
        endpoints: &[Endpoint],
        connector: C,
        metrics: Metrics,
    ) -> Self {
        let backend: Arc<str> = backend.into();
        let lease_wait = metrics.lease_wait(&backend);
        let class_wait = PriorityClass::ALL.map(|c| metrics.class_lease_wait(&backend, c));
        let lease_timeouts = metrics.lease_timeouts(&backend);
        let inner = Arc::new(Inner {
            backend: backend.clone(),
            connector,
            lease_wait,
            class_wait,
            lease_timeouts,
            state: Mutex::new(State {
                limits,
                health_check: None,
                outlier: None,
                endpoints: Vec::new(),
                next_endpoint_id: 0,
                waiters: ClassQueue::default(),
                next_waiter_id: 0,
                priority: Priority::default(),
                held: [0; 2],
                releases: ReleaseRate::default(),
                hold: HoldTime::default(),
                retired: false,
            }),
            slot_freed: tokio::sync::Notify::new(),
            metrics,
        });
        let pool = Self { inner };
        pool.set_endpoints(endpoints);
        tokio::spawn(reap_loop(Arc::downgrade(&pool.inner)));
        pool
    }

    /// The backend name.
    pub fn backend(&self) -> &Arc<str> {
        &self.inner.backend
    }

    /// Leases a connection for an interactive call (see [`Self::lease_as`]).
    pub async fn lease(&self) -> Result<Lease<C>, PoolError> {
        self.lease_as(PriorityClass::Interactive).await
    }

    /// Leases a connection for a call of `class`: an idle one if an eligible endpoint has one,
    /// a new one if an endpoint is below its cap, else waits up to `leaseTimeout`, served in
    /// the queue's order (interactive first, FIFO within a class, batch aging: see
    /// [`crate::limits::queue`]). A batch call also waits while batch holds its share cap.
    pub async fn lease_as(&self, class: PriorityClass) -> Result<Lease<C>, PoolError> {
        let start = Instant::now();
        let (step, lease_timeout) = {
            let mut state = self.inner.state.lock();
            let lease_timeout = state.limits.lease_timeout.get();
            (self.inner.begin(&mut state, start, class)?, lease_timeout)
        };
        let grant = match step {
            Step::Ready(grant) => grant,
            Step::Wait(rx, id) => {
                let mut waiting = Unsettled {
                    pool: Arc::clone(&self.inner),
                    class,
                    held: QueuePlace { rx, id },
                    settled: false,
                };
                let waited =
                    tokio::time::timeout_at(start + lease_timeout, &mut waiting.held.rx).await;
                // From here on this function settles its place in the queue itself.
                waiting.settled = true;
                let rx = &mut waiting.held.rx;
                match waited {
                    Ok(Ok(grant)) => grant,
                    // The sender is dropped when the pool is retired, or when an interactive
                    // call took this batch waiter's place in a full queue.
                    Ok(Err(_)) => {
                        let state = self.inner.state.lock();
                        if state.retired {
                            return Err(PoolError::Retired {
                                backend: self.inner.backend.clone(),
                            });
                        }
                        return Err(PoolError::QueueFull {
                            backend: self.inner.backend.clone(),
                            pending: state.waiters.len(),
                            retry_after: state.retry_after(Instant::now()),
                        });
                    }
                    Err(_elapsed) => {
                        let mut state = self.inner.state.lock();
                        match state.waiters.remove(id) {
                            Some(_) => {
                                self.inner.lease_timeouts.inc();
                                let waited = start.elapsed();
                                let retry_after = state.retry_after(Instant::now());
                                return Err(PoolError::LeaseTimeout {
                                    backend: self.inner.backend.clone(),
                                    waited,
                                    retry_after,
                                });
                            }
                            // Dispatched while the timer fired: the grant is in the channel.
                            None => match rx.try_recv() {
                                Ok(grant) => grant,
                                Err(_) => {
                                    return Err(PoolError::Retired {
                                        backend: self.inner.backend.clone(),
                                    });
                                }
                            },
                        }
                    }
                }
            }
        };
        self.inner.clone().complete(grant, start, class).await
    }

    /// Sets how the queue treats batch calls: the aging bound and the share cap (the
    /// `priority` of the backend's client policy; none: the defaults). Waiters are served
    /// again under the new rules at once.
    pub fn set_priority(&self, priority: Option<Priority>) {
        let mut state = self.inner.state.lock();
        state.priority = priority.unwrap_or_default();
        let now = Instant::now();
        self.inner.dispatch(&mut state, now);
    }

    /// Applies new pool limits in place. Growing the cap hands free slots to waiters at once;
    /// shrinking it closes excess idle connections now and excess leased ones as they return.
    pub fn set_limits(&self, limits: PoolLimits) {
        let mut state = self.inner.state.lock();
        state.limits = limits;
        let now = Instant::now();
        let max = state.limits.max_connections_per_endpoint;
        for ep in &mut state.endpoints {
            while ep.usable() > max && !ep.idle.is_empty() {
                let idle = ep.idle.remove(0);
                self.inner.closed(ep, CloseReason::Shrink, idle.conn);
            }
        }
        self.inner.dispatch(&mut state, now);
    }

    /// Replaces the endpoint set, matching by name and address: kept endpoints keep their
    /// connections and health; new ones start presumed healthy; dropped ones take no new
    /// leases and close their connections as they come back.
    pub fn set_endpoints(&self, endpoints: &[Endpoint]) {
        let mut state = self.inner.state.lock();
        for ep in &mut state.endpoints {
            let kept = endpoints
                .iter()
                .any(|e| *e.name == *ep.name && e.address == ep.address);
            if !kept && !ep.removed {
                ep.removed = true;
                for idle in std::mem::take(&mut ep.idle) {
                    self.inner.closed(ep, CloseReason::Removed, idle.conn);
                }
            }
        }
        for e in endpoints {
            let exists = state
                .endpoints
                .iter()
                .any(|ep| !ep.removed && *ep.name == *e.name && ep.address == e.address);
            if !exists {
                let id = state.next_endpoint_id;
                state.next_endpoint_id += 1;
                let name: Arc<str> = e.name.as_str().into();
                let (created, reused) = self
                    .inner
                    .metrics
                    .endpoint_counters(&self.inner.backend, &name);
                state.endpoints.push(EndpointState {
                    id,
                    name,
                    address: e.address,
                    idle: Vec::new(),
                    leased: 0,
                    connecting: 0,
                    closing: 0,
                    probing: 0,
                    removed: false,
                    drained: false,
                    health: Health::default(),
                    created,
                    reused,
                });
            }
        }
        state.endpoints.retain(|ep| !(ep.removed && ep.open() == 0));
        let now = Instant::now();
        self.inner.dispatch(&mut state, now);
    }

    /// Sets the health-check and outlier-detection rules (recovery needs passing probes only
    /// when a health check is configured).
    pub fn set_health_rules(&self, check: Option<HealthCheck>, outlier: Option<OutlierDetection>) {
        let mut state = self.inner.state.lock();
        if check.is_none() {
            for ep in &mut state.endpoints {
                ep.health.probe_up = true;
            }
        }
        if outlier.is_none() {
            for ep in &mut state.endpoints {
                ep.health.ejected_until = None;
                ep.health.consecutive_failures = 0;
            }
        }
        state.health_check = check;
        state.outlier = outlier;
        let now = Instant::now();
        self.inner.dispatch(&mut state, now);
    }

    /// Takes the backend out of service (see [`Self::retire`]) and waits until its
    /// connections are closed on both sides, at most [`CLOSE_GRACE`]: for a gateway about to
    /// exit, so that the backends have let go of its connections before it is gone. Returns
    /// whether they all were.
    pub async fn close_all(&self) -> bool {
        self.retire();
        let all_closed = async {
            loop {
                let notified = self.inner.slot_freed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self
                    .inner
                    .state
                    .lock()
                    .endpoints
                    .iter()
                    .all(|ep| ep.open() == 0)
                {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(CLOSE_GRACE, all_closed).await.is_ok()
    }

    /// Takes the backend out of service: waiters fail, idle connections close, leased ones
    /// close as they return.
    pub fn retire(&self) {
        let mut state = self.inner.state.lock();
        state.retired = true;
        state.waiters.clear();
        for ep in &mut state.endpoints {
            for idle in std::mem::take(&mut ep.idle) {
                self.inner.closed(ep, CloseReason::Removed, idle.conn);
            }
        }
    }

    /// The endpoints active probing should check: `(name, address)` of every live endpoint.
    pub fn probe_targets(&self) -> Vec<(Arc<str>, SocketAddr)> {
        let state = self.inner.state.lock();
        state
            .endpoints
            .iter()
            .filter(|ep| !ep.removed)
            .map(|ep| (ep.name.clone(), ep.address))
            .collect()
    }

    /// Takes a slot of `endpoint`'s cap for an active health probe, so that its connection
    /// counts against the cap like any other: `None` when every slot is taken (the endpoint is
    /// busy with pooled connections, which report to outlier detection) or it is gone. When
    /// idle connections fill the cap, the coldest of them is closed, so that the next round
    /// finds its slot free once the backend let go of it (an endpoint whose idle connections
    /// fill its pool is still probed). The slot frees, and goes to a waiter, when the
    /// [`ProbeSlot`] is dropped.
    pub fn probe_slot(&self, endpoint: &str) -> Option<ProbeSlot<C>> {
        let mut state = self.inner.state.lock();
        if state.retired {
            return None;
        }
        let max = state.limits.max_connections_per_endpoint;
        let ep = state
            .endpoints
            .iter_mut()
            .find(|ep| !ep.removed && *ep.name == *endpoint)?;
        if ep.open() >= max {
            if !ep.idle.is_empty() {
                let coldest = ep.idle.remove(0);
                self.inner.closed(ep, CloseReason::Idle, coldest.conn);
            }
            return None;
        }
        ep.probing += 1;
        Some(ProbeSlot {
            pool: self.inner.clone(),
            endpoint: ep.id,
        })
    }

    /// Records an active probe result for `endpoint`.
    pub fn report_probe(&self, endpoint: &str, passed: bool) {
        let mut state = self.inner.state.lock();
        let Some(check) = state.health_check.clone() else {
            return;
        };
        let Some(ep) = state.listed_endpoint_mut(endpoint) else {
            return;
        };
        let h = &mut ep.health;
        if passed {
            h.probe_failures = 0;
            h.probe_passes = h.probe_passes.saturating_add(1);
            if h.ejected_until.is_some() {
                h.passes_since_ejection = h.passes_since_ejection.saturating_add(1);
            }
            if !h.probe_up && h.probe_passes >= check.healthy_threshold {
                tracing::info!(backend = %self.inner.backend, endpoint, "endpoint healthy again");
                h.probe_up = true;
            }
        } else {
            h.probe_passes = 0;
            h.passes_since_ejection = 0;
            h.probe_failures = h.probe_failures.saturating_add(1);
            if h.probe_up && h.probe_failures >= check.unhealthy_threshold {
                tracing::warn!(backend = %self.inner.backend, endpoint, "endpoint failed its health checks");
                h.probe_up = false;
            }
        }
        let now = Instant::now();
        self.inner.dispatch(&mut state, now);
    }

    /// Records the outcome of a proxied call for passive outlier detection: a connect error,
    /// 5xx or timeout is a failure.
    pub fn report_call(&self, endpoint: &str, ok: bool) {
        let now = Instant::now();
        let mut state = self.inner.state.lock();
        let Some(rules) = state.outlier.clone() else {
            return;
        };
        let live = state.endpoints.iter().filter(|ep| !ep.removed).count() as u64;
        let ejected = state
            .endpoints
            .iter()
            .filter(|ep| !ep.removed && ep.health.is_ejected(now))
            .count() as u64;
        let Some(ep) = state.listed_endpoint_mut(endpoint) else {
            return;
        };
        if ep.health.is_ejected(now) {
            return;
        }
        if ok {
            ep.health.consecutive_failures = 0;
            return;
        }
        ep.health.consecutive_failures = ep.health.consecutive_failures.saturating_add(1);
        let may_eject = (ejected + 1) * 100 <= live * u64::from(rules.max_ejected_percent);
        if ep.health.consecutive_failures >= rules.consecutive_failures && may_eject {
            ep.health.ejections = ep.health.ejections.saturating_add(1);
            let factor = ep.health.ejections.min(10);
            let length = rules.base_ejection.get() * factor;
            ep.health.ejected_until = Some(now + length);
            ep.health.passes_since_ejection = 0;
            ep.health.consecutive_failures = 0;
            tracing::warn!(
                backend = %self.inner.backend,
                endpoint,
                ejection = ?length,
                "endpoint ejected after consecutive failures"
            );
        }
    }

    /// Current counts.
    pub fn stats(&self) -> PoolStats {
        let now = Instant::now();
        let state = self.inner.state.lock();
        let max = state.limits.max_connections_per_endpoint;
        PoolStats {
            pending: state.waiters.len() as u32,
            classes: PriorityClass::ALL.map(|c| ClassStats {
                class: c.as_str(),
                pending: state.waiters.len_of(c) as u32,
                held: state.held[c.index()],
            }),
            batch_cap: state.batch_cap(),
            max_pending: state.limits.max_pending,
            endpoints: state
                .endpoints
                .iter()
                .filter(|ep| !ep.removed)
                .map(|ep| EndpointStats {
                    name: ep.name.to_string(),
                    address: ep.address,
                    leased: ep.leased,
                    idle: ep.idle.len() as u32,
                    connecting: ep.connecting,
                    closing: ep.closing,
                    max,
                    healthy: state.eligible(ep, now),
                    ejected: ep.health.is_ejected(now),
                    drained: ep.drained,
                })
                .collect(),
        }
    }

    /// Closes idle connections past `idleTimeout` or `maxLifetime`, or closed by the peer, and
    /// hands freed capacity (and endpoints back from ejection) to waiters. Runs in the
    /// background; public so tests can drive it.
    pub fn reap(&self) {
        self.inner.reap(Instant::now());
    }
}

// === soft throttle ===

impl<C: Connect> Pool<C> {
    /// The delay a lease request should take before joining the pool now: the soft throttle's
    /// `min(max, pending × perPending)`, zero without one or without waiters.
    pub fn throttle_delay(&self) -> Duration {
        let state = self.inner.state.lock();
        match &state.limits.soft_throttle {
            Some(throttle) if !state.waiters.is_empty() => {
                throttle.delay(state.waiters.len() as u32)
            }
            _ => Duration::ZERO,
        }
    }
}

// === manual drain ===

impl<C: Connect> Pool<C> {
    /// Drains (`true`) or restores (`false`) the endpoint named `endpoint` by hand: a drained
    /// endpoint takes no new leases, its idle connections close now and its leased ones as they
    /// return; restored, it takes leases again (health and ejection still apply). Returns the
    /// endpoint's counts after the change, or `None` when the pool has no such endpoint.
    pub fn set_drained(&self, endpoint: &str, drained: bool) -> Option<EndpointStats> {
        {
            let mut state = self.inner.state.lock();
            let ep = state
                .endpoints
                .iter_mut()
                .find(|ep| !ep.removed && *ep.name == *endpoint)?;
            if ep.drained != drained {
                ep.drained = drained;
                tracing::info!(backend = %self.inner.backend, endpoint, drained, "endpoint drained or restored by hand");
                if drained {
                    for idle in std::mem::take(&mut ep.idle) {
                        self.inner.closed(ep, CloseReason::Drained, idle.conn);
                    }
                }
            }
            let now = Instant::now();
            self.inner.dispatch(&mut state, now);
        }
        self.stats()
            .endpoints
            .into_iter()
            .find(|e| e.name == endpoint)
    }
}

async fn reap_loop<C: Connect>(pool: Weak<Inner<C>>) {
    loop {
        let period = {
            let Some(inner) = pool.upgrade() else { return };
            let state = inner.state.lock();
            if state.retired {
                return;
            }
            (state.limits.idle_timeout.get() / 4)
                .clamp(Duration::from_millis(10), Duration::from_secs(1))
        };
        tokio::time::sleep(period).await;
        let Some(inner) = pool.upgrade() else { return };
        inner.reap(Instant::now());
    }
}

// === impl Inner ===

impl<C: Connect> Inner<C> {
    /// Decides under the lock: take an idle connection, reserve a slot, queue, or refuse.
    fn begin(
        self: &Arc<Self>,
        state: &mut State<C::Conn>,
        now: Instant,
        class: PriorityClass,
    ) -> Result<Step<C::Conn>, PoolError> {
        if state.retired {
            return Err(PoolError::Retired {
                backend: self.backend.clone(),
            });
        }
        // Waiters go first: a newcomer must not overtake the queue.
        if state.waiters.is_empty()
            && state.may_serve(class)
            && let Some(grant) = self.find_grant(state, now)
        {
            state.held[class.index()] += 1;
            self.lease_wait.observe(0.0);
            self.class_wait[class.index()].observe(0.0);
            return Ok(Step::Ready(grant));
        }
        if !state.endpoints.iter().any(|ep| state.eligible(ep, now)) {
            return Err(PoolError::NoHealthyEndpoint {
                backend: self.backend.clone(),
                retry_after: state.recovery_hint(now),
            });
        }
        if state.waiters.len() >= state.limits.max_pending as usize {
            // A full queue takes an interactive call in place of its newest batch waiter, which
            // is refused as if it had found the queue full (its sender dropped: see `lease_as`):
            // batch callers cannot fill the queue against interactive ones.
            let bumped = class == PriorityClass::Interactive
                && state.waiters.pop_back(PriorityClass::Batch).is_some();
            if !bumped {
                return Err(PoolError::QueueFull {
                    backend: self.backend.clone(),
                    pending: state.waiters.len(),
                    retry_after: state.retry_after(now),
                });
            }
        }
        let (tx, mut rx) = oneshot::channel();
        let id = state.next_waiter_id;
        state.next_waiter_id += 1;
        state.waiters.push(Entry {
            id,
            since: now,
            class,
            item: tx,
        });
        // The waiters ahead may be batch held by its share cap while a connection is free: an
        // interactive newcomer is served at once.
        self.dispatch(state, now);
        match rx.try_recv() {
            Ok(grant) => Ok(Step::Ready(grant)),
            Err(_) => Ok(Step::Wait(rx, id)),
        }
    }

    /// Finds a connection or a free slot on an eligible endpoint, choosing between two random
    /// candidates the one with more spare capacity. Marks the result leased/connecting.
    fn find_grant(
        self: &Arc<Self>,
        state: &mut State<C::Conn>,
        now: Instant,
    ) -> Option<Grant<C::Conn>> {
        let max = state.limits.max_connections_per_endpoint;
        loop {
            // Candidates: eligible endpoints with an idle connection or room for a new one.
            // Counted, then the k-th found again: no allocation on the lease path.
            let candidate = |ep: &EndpointState<C::Conn>| {
                state.eligible(ep, now) && (!ep.idle.is_empty() || ep.open() < max)
            };
            let nth = |k: usize| {
                state
                    .endpoints
                    .iter()
                    .enumerate()
                    .filter(|(_, ep)| candidate(ep))
                    .nth(k)
                    .map(|(i, _)| i)
            };
            let chosen = match state.endpoints.iter().filter(|ep| candidate(ep)).count() {
                0 => return None,
                1 => nth(0)?,
                n => {
                    let mut rng = rand::rng();
                    let i = rng.random_range(0..n);
                    let mut j = rng.random_range(0..n - 1);
                    if j >= i {
                        j += 1;
                    }
                    let (a, b) = (nth(i)?, nth(j)?);
                    let spare = |k: usize| max.saturating_sub(state.endpoints[k].busy());
                    if spare(b) > spare(a) { b } else { a }
                }
            };
            let limits = state.limits.clone();
            let ep = &mut state.endpoints[chosen];
            if let Some(mut idle) = ep.idle.pop() {
                let reason = idle.expired(&limits, now).or_else(|| {
                    let check =
                        now.duration_since(idle.idle_since) > limits.validate_after_idle.get();
                    (check && !idle.conn.validate()).then_some(CloseReason::ValidateFailed)
                });
                match reason {
                    Some(reason) => {
                        self.closed(ep, reason, idle.conn);
                        continue;
                    }
                    None => {
                        ep.leased += 1;
                        ep.reused.inc();
                        return Some(Grant::Conn {
                            endpoint: ep.id,
                            idle,
                        });
                    }
                }
            }
            ep.connecting += 1;
            return Some(Grant::Slot { endpoint: ep.id });
        }
    }

    /// Hands idle connections and free slots to waiters, in the queue's order: interactive
    /// first, FIFO within a class, aged batch as interactive (see [`crate::limits::queue`]); a batch
    /// waiter only while batch is under its share cap.
    fn dispatch(self: &Arc<Self>, state: &mut State<C::Conn>, now: Instant) {
        let aging = state.priority.aging_in(state.limits.lease_timeout.get());
        loop {
            let batch_allowed = state.may_serve(PriorityClass::Batch);
            let Some(class) = state.waiters.next(aging, batch_allowed) else {
                return;
            };
            if state
                .waiters
                .front(class)
                .is_some_and(|w| w.item.is_closed())
            {
                state.waiters.pop(class);
                continue;
            }
            let Some(grant) = self.find_grant(state, now) else {
                return;
            };
            let Some(waiter) = state.waiters.pop(class) else {
                return;
            };
            let wait = now.duration_since(waiter.since);
            state.held[class.index()] += 1;
            match waiter.item.send(grant) {
                Ok(()) => {
                    self.lease_wait.observe(wait.as_secs_f64());
                    self.class_wait[class.index()].observe(wait.as_secs_f64());
                }
                Err(grant) => self.undo(state, grant, class),
            }
        }
    }

    /// Gives back a grant nobody took (given to a call of `class`).
    fn undo(&self, state: &mut State<C::Conn>, grant: Grant<C::Conn>, class: PriorityClass) {
        state.held[class.index()] -= 1;
        match grant {
            Grant::Conn { endpoint, idle } => {
                if let Some(ep) = state.endpoint_mut(endpoint) {
                    ep.leased -= 1;
                    ep.idle.push(idle);
                }
            }
            Grant::Slot { endpoint } => {
                if let Some(ep) = state.endpoint_mut(endpoint) {
                    ep.connecting -= 1;
                }
            }
        }
    }

    /// Turns a grant into a lease, connecting when it is a slot.
    async fn complete(
        self: Arc<Self>,
        grant: Grant<C::Conn>,
        start: Instant,
        class: PriorityClass,
    ) -> Result<Lease<C>, PoolError> {
        let now = Instant::now();
        match grant {
            Grant::Conn { endpoint, idle } => {
                let name = self.endpoint_name(endpoint);
                Ok(Lease {
                    pool: self,
                    endpoint,
                    endpoint_name: name,
                    conn: Some(idle.conn),
                    created_at: idle.created_at,
                    leased_at: now,
                    reused: true,
                    wait: now.duration_since(start),
                    class,
                    outcome: Outcome::Close(CloseReason::Error),
                })
            }
            Grant::Slot { endpoint } => {
                let (name, address, timeout) = {
                    let state = self.state.lock();
                    let ep = state
                        .endpoint(endpoint)
                        .expect("a reserved endpoint stays listed");
                    (
                        ep.name.clone(),
                        ep.address,
                        state.limits.connect_timeout.get(),
                    )
                };
                let mut reservation = Unsettled {
                    pool: Arc::clone(&self),
                    class,
                    held: ReservedSlot { endpoint },
                    settled: false,
                };
                let result = tokio::time::timeout(timeout, self.connector.connect(address)).await;
                reservation.settled = true;
                drop(reservation);
                let mut state = self.state.lock();
                let ep = state
                    .endpoint_mut(endpoint)
                    .expect("a reserved endpoint stays listed");
                ep.connecting -= 1;
                let error = match result {
                    Ok(Ok(conn)) => {
                        ep.leased += 1;
                        ep.created.inc();
                        drop(state);
                        let leased_at = Instant::now();
                        return Ok(Lease {
                            pool: self,
                            endpoint,
                            endpoint_name: name,
                            conn: Some(conn),
                            created_at: leased_at,
                            leased_at,
                            reused: false,
                            wait: now.duration_since(start),
                            class,
                            outcome: Outcome::Close(CloseReason::Error),
                        });
                    }
                    Ok(Err(source)) => PoolError::Connect {
                        endpoint: name,
                        address,
                        source,
                    },
                    Err(_elapsed) => PoolError::ConnectTimeout {
                        endpoint: name,
                        address,
                        timeout,
                    },
                };
                // The reserved slot is free again.
                state.held[class.index()] -= 1;
                self.freed(state, Instant::now());
                Err(error)
            }
        }
    }

    /// Takes a leased connection back.
    fn release(
        self: &Arc<Self>,
        endpoint: u64,
        conn: Option<C::Conn>,
        outcome: Outcome,
        created_at: Instant,
        held: Duration,
        class: PriorityClass,
    ) {
        let now = Instant::now();
        let mut state = self.state.lock();
        state.held[class.index()] -= 1;
        state.releases.record(now);
        state.hold.record(held);
        let max = state.limits.max_connections_per_endpoint;
        let lifetime = state.limits.max_lifetime.get();
        let retired = state.retired;
        if let Some(ep) = state.endpoint_mut(endpoint) {
            ep.leased -= 1;
            if let Some(mut conn) = conn {
                let reason = match outcome {
                    Outcome::Close(reason) => Some(reason),
                    Outcome::Keep if ep.removed || retired => Some(CloseReason::Removed),
                    Outcome::Keep if ep.drained => Some(CloseReason::Drained),
                    Outcome::Keep if ep.usable() >= max => Some(CloseReason::Shrink),
                    Outcome::Keep if now.duration_since(created_at) >= lifetime => {
                        Some(CloseReason::Lifetime)
                    }
                    Outcome::Keep if !conn.is_open() => Some(CloseReason::PeerClosed),
                    Outcome::Keep => None,
                };
                match reason {
                    Some(reason) => self.closed(ep, reason, conn),
                    None => ep.idle.push(IdleConn {
                        conn,
                        created_at,
                        idle_since: now,
                    }),
                }
            }
        }
        state.endpoints.retain(|ep| !(ep.removed && ep.open() == 0));
        self.dispatch(&mut state, now);
        drop(state);
        if retired {
            self.slot_freed.notify_waiters();
        }
    }

    fn reap(self: &Arc<Self>, now: Instant) {
        let mut state = self.state.lock();
        let limits = state.limits.clone();
        for ep in &mut state.endpoints {
            let mut i = 0;
            while i < ep.idle.len() {
                let idle = &mut ep.idle[i];
                let reason = idle.expired(&limits, now);
                match reason {
                    Some(reason) => {
                        let idle = ep.idle.remove(i);
                        self.closed(ep, reason, idle.conn);
                    }
                    None => i += 1,
                }
            }
        }
        self.dispatch(&mut state, now);
    }

    /// Closes a connection and counts why. Its slot stays taken (`closing`) until the peer has
    /// closed its side, at most [`CLOSE_GRACE`].
    fn closed(
        self: &Arc<Self>,
        ep: &mut EndpointState<C::Conn>,
        reason: CloseReason,
        conn: C::Conn,
    ) {
        self.metrics
            .connection_closed(&self.backend, &ep.name, reason);
        if let Some(opened) = conn.opened_at() {
            let age = opened.elapsed();
            self.metrics
                .incidents()
                .connection_aged(&self.backend, reason, age);
            tracing::debug!(backend = %self.backend, endpoint = %ep.name, reason = reason.as_str(), ?age, "upstream connection closed");
        }
        let Some(peer_closed) = conn.close() else {
            return;
        };
        // Outside a runtime (a pool dropped at exit) nothing can wait: the socket just closes.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        ep.closing += 1;
        let (pool, endpoint) = (Arc::downgrade(self), ep.id);
        runtime.spawn(async move {
            let _ = tokio::time::timeout(CLOSE_GRACE, peer_closed).await;
            if let Some(pool) = pool.upgrade() {
                pool.close_done(endpoint);
            }
        });
    }

    /// Frees the slot of a closed connection whose peer let go of it (or whose grace ran out).
    fn close_done(self: &Arc<Self>, endpoint: u64) {
        self.give_back(endpoint, |ep| &mut ep.closing);
    }

    /// Gives back one slot of `endpoint`'s cap, of those `slots` counts (connects in progress,
    /// probes, closes waiting for the peer), then [`Self::freed`].
    fn give_back(
        self: &Arc<Self>,
        endpoint: u64,
        slots: fn(&mut EndpointState<C::Conn>) -> &mut u32,
    ) {
        let now = Instant::now();
        let mut state = self.state.lock();
        if let Some(ep) = state.endpoint_mut(endpoint) {
            *slots(ep) -= 1;
        }
        self.freed(state, now);
    }

    /// After a slot freed other than by a lease returning: forgets removed endpoints left with
    /// nothing open, hands the capacity to waiters, and wakes [`Pool::close_all`].
    fn freed(self: &Arc<Self>, mut state: MutexGuard<'_, State<C::Conn>>, now: Instant) {
        state.endpoints.retain(|ep| !(ep.removed && ep.open() == 0));
        self.dispatch(&mut state, now);
        drop(state);
        self.slot_freed.notify_waiters();
    }

    fn endpoint_name(&self, endpoint: u64) -> Arc<str> {
        let state = self.state.lock();
        state
            .endpoint(endpoint)
            .map(|ep| ep.name.clone())
            .expect("a leased endpoint stays listed")
    }
}

// === impl State ===

impl<T: Poolable> State<T> {
    fn endpoint(&self, id: u64) -> Option<&EndpointState<T>> {
        self.endpoints.iter().find(|ep| ep.id == id)
    }

    fn endpoint_mut(&mut self, id: u64) -> Option<&mut EndpointState<T>> {
        self.endpoints.iter_mut().find(|ep| ep.id == id)
    }

    /// The listed (not removed) endpoint named `name`.
    fn listed_endpoint_mut(&mut self, name: &str) -> Option<&mut EndpointState<T>> {
        self.endpoints
            .iter_mut()
            .find(|ep| !ep.removed && *ep.name == *name)
    }

    /// Whether new leases may go to `ep`: listed, probes pass, not ejected (or back from
    /// ejection: its time is over and, with active checks, probes have passed since).
    fn eligible(&self, ep: &EndpointState<T>, now: Instant) -> bool {
        if ep.removed || ep.drained || !ep.health.probe_up {
            return false;
        }
        match ep.health.ejected_until {
            None => true,
            Some(until) if now < until => false,
            Some(_) => match &self.health_check {
                None => true,
                Some(check) => ep.health.passes_since_ejection >= check.healthy_threshold,
            },
        }
    }

    /// The most connections batch calls may hold: `batchMaxPercent` of the cap over the
    /// endpoints that take leases (not removed or drained), rounded down, at least 1; none
    /// without a cap.
    fn batch_cap(&self) -> Option<u32> {
        let percent = self.priority.batch_max_percent?;
        let live = self
            .endpoints
            .iter()
            .filter(|ep| !ep.removed && !ep.drained)
            .count() as u64;
        let total = u64::from(self.limits.max_connections_per_endpoint) * live;
        Some(((total * u64::from(percent) / 100).max(1)).min(u64::from(u32::MAX)) as u32)
    }

    /// Whether a call of `class` may be handed a connection now: interactive always, batch
    /// while it holds fewer than its cap.
    fn may_serve(&self, class: PriorityClass) -> bool {
        match (class, self.batch_cap()) {
            (PriorityClass::Batch, Some(cap)) => self.held[PriorityClass::Batch.index()] < cap,
            _ => true,
        }
    }

    /// Retry-After for a full pool: the time for the queue ahead (and this request) to drain
    /// at the observed release rate; before any release was seen, the mean hold time spread
    /// over the capacity; before any lease completed, the lease timeout.
    fn retry_after(&self, now: Instant) -> Duration {
        let queued = self.waiters.len() as f64 + 1.0;
        let secs = if let Some(rate) = self.releases.per_second(now) {
            queued / rate
        } else if let Some(hold) = self.hold.mean() {
            let capacity = (self.limits.max_connections_per_endpoint as usize
                * self
                    .endpoints
                    .iter()
                    .filter(|ep| !ep.removed)
                    .count()
                    .max(1)) as f64;
            hold.as_secs_f64() * queued / capacity
        } else {
            self.limits.lease_timeout.get().as_secs_f64()
        };
        rate::whole_seconds(secs)
    }

    /// Retry-After when no endpoint is eligible: until the first ejection ends, or the time
    /// probes need to pass `healthyThreshold` times.
    fn recovery_hint(&self, now: Instant) -> Duration {
        let probes = self
            .health_check
            .as_ref()
            .map(|c| c.interval.get() * c.healthy_threshold.max(1));
        let ejection_end = self
            .endpoints
            .iter()
            .filter(|ep| !ep.removed)
            .filter_map(|ep| ep.health.ejected_until)
            .map(|until| until.saturating_duration_since(now))
            .min();
        let secs = match (ejection_end, probes) {
            (Some(e), Some(p)) => e.max(p),
            (Some(e), None) => e,
            (None, Some(p)) => p,
            (None, None) => self.limits.lease_timeout.get(),
        };
        rate::whole_seconds(secs.as_secs_f64())
    }
}

// === impl EndpointState ===

impl<T> EndpointState<T> {
    /// Open connections: the number the cap bounds, counting those the peer still holds. No
    /// new connection is opened while this is at the cap.
    fn open(&self) -> u32 {
        self.usable() + self.closing + self.probing
    }

    /// The connections this pool can still use (idle, leased, being opened): the ones a
    /// shrink closes down to the cap. Closing ones are on their way out already.
    fn usable(&self) -> u32 {
        self.idle.len() as u32 + self.leased + self.connecting
    }

    /// Connections that cannot take a new request.
    fn busy(&self) -> u32 {
        self.leased + self.connecting
    }
}

impl Default for Health {
    fn default() -> Self {
        Self {
            probe_up: true,
            probe_passes: 0,
            probe_failures: 0,
            ejected_until: None,
            passes_since_ejection: 0,
            consecutive_failures: 0,
            ejections: 0,
        }
    }
}

impl Health {
    fn is_ejected(&self, now: Instant) -> bool {
        self.ejected_until.is_some_and(|until| now < until)
    }
}

// === impl Lease ===

impl<C: Connect> Lease<C> {
    /// The connection.
    pub fn conn(&mut self) -> &mut C::Conn {
        self.conn
            .as_mut()
            .expect("a lease holds its connection until dropped")
    }

    /// Whether the connection was reused from the pool (not opened for this lease).
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// How long the lease waited for a connection or a free slot.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The priority class it was leased for.
    pub fn class(&self) -> PriorityClass {
        self.class
    }

    /// The endpoint's name.
    pub fn endpoint(&self) -> &Arc<str> {
        &self.endpoint_name
    }

    /// Returns the connection to the pool when the lease is dropped (the exchange completed
    /// and the connection can carry another request).
    pub fn keep(&mut self) {
        self.outcome = Outcome::Keep;
    }

    /// Closes the connection when the lease is dropped, counting `reason`.
    pub fn discard(&mut self, reason: CloseReason) {
        self.outcome = Outcome::Close(reason);
    }
}

impl<C: Connect> Drop for Lease<C> {
    fn drop(&mut self) {
        let held = self.leased_at.elapsed();
        self.pool.release(
            self.endpoint,
            self.conn.take(),
            self.outcome,
            self.created_at,
            held,
            self.class,
        );
    }
}
