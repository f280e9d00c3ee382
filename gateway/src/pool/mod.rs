//! The per-backend connection pool: a hard cap on open connections per endpoint, waiters in
//! two priority classes (interactive first, batch aging and an optional share cap on batch:
//! `crate::limits::queue`; within a class token-fair between clients, FIFO for one:
//! `crate::limits::fair`) with a lease timeout, a bounded pending queue,
//! idle reuse, idle/lifetime expiry (an endpoint seen closing idle connections sooner than the
//! idle timeout keeps them idle for less), validate-after-idle, runtime resizing, endpoint choice by
//! spare capacity, and the health state (active probes, passive ejection) that decides which
//! endpoints may be chosen.
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
//!   pending < maxPending ? waiter ──────lease timeout──► 503   interactive first, batch
//!                                                               aged, token-fair in a class
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
//!
//! # Files
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`Pool`] and its public API: lease, limits, endpoints, priority, retire, drain by hand, stats |
//! | `connect.rs` | what the pool pools: [`Poolable`], [`Connect`], [`CLOSE_GRACE`] |
//! | `lease.rs` | [`Lease`]: a connection on loan, kept or discarded when dropped |
//! | `state.rs` | the state behind the lock: endpoints, idle connections, waiters, holds |
//! | `dispatch.rs` | the lock-held core: begin, complete, release, dispatch to waiters, reap, close |
//! | `select.rs` | endpoint choice: power of two choices on spare capacity (pure) |
//! | `keep_alive.rs` | an endpoint's keep-alive as its closes showed it, and the idle timeout kept under it (pure) |
//! | `health.rs` | active probes, their thresholds, passive ejection, eligibility |
//! | `probe.rs` | one probe's exchange, over the stream its connector opened |
//! | `rate.rs` | the drain-rate and hold-time estimators behind `Retry-After` |
//! | `error.rs`, `stats.rs` | [`PoolError`]; [`PoolStats`] and its parts |

mod connect;
mod dispatch;
mod error;
pub(crate) mod health;
mod keep_alive;
mod lease;
mod probe;
mod rate;
mod select;
mod state;
mod stats;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use poolpilot_api::limits::{PoolLimits, Priority, PriorityClass};
use tokio::time::Instant;

use crate::limits::fair::{Charge, FairQueue, Ticket};
use crate::observe::{CloseReason, Metrics};
pub use connect::{CLOSE_GRACE, Connect, Multiplexed, Poolable};
use dispatch::{QueuePlace, Step, Unsettled, reap_loop};
pub use error::PoolError;
pub use health::ProbeSlot;
use keep_alive::KeepAlive;
pub use lease::Lease;
pub use probe::{exchange as probe_exchange, plain as probe_exchange_plain};
pub(crate) use rate::whole_seconds as rate_whole_seconds;
use rate::{HoldTime, ReleaseRate};
use state::{EndpointState, Health, Inner, State};
pub use stats::{BurstStats, ClassStats, EndpointStats, Fallback, PoolStats};

/// One address the pool connects to, under the pool's cap per endpoint: an `ip:port` endpoint
/// of the limits document, or one address a DNS-named endpoint resolved to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The `endpoint` metric label.
    pub name: String,
    /// Where to connect.
    pub address: SocketAddr,
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
        let bursts = metrics.bursts(&backend);
        let fair_reordered = metrics.fair_reordered(&backend);
        let peer_closed_idle = metrics.incidents().peer_closed_idle(&backend);
        let inner = Arc::new(Inner {
            backend: backend.clone(),
            connector,
            lease_wait,
            class_wait,
            lease_timeouts,
            bursts,
            fair_reordered,
            peer_closed_idle,
            state: Mutex::new(State {
                limits,
                health_check: None,
                outlier: None,
                endpoints: Vec::new(),
                next_endpoint_id: 0,
                waiters: FairQueue::default(),
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

    /// Leases a connection for an interactive call of no known client (see
    /// [`Self::lease_for`]).
    pub async fn lease(&self) -> Result<Lease<C>, PoolError> {
        self.lease_as(PriorityClass::Interactive).await
    }

    /// Leases a connection for a call of `class` of no known client (each such call takes an
    /// equal turn: [`Ticket::ANONYMOUS`]); see [`Self::lease_for`].
    pub async fn lease_as(&self, class: PriorityClass) -> Result<Lease<C>, PoolError> {
        self.lease_for(class, Ticket::ANONYMOUS).await
    }

    /// Leases a connection for a call of `class` charged `ticket`: an idle one if an eligible
    /// endpoint has one, a new one if an endpoint is below its cap, else waits up to
    /// `leaseTimeout`, served in the queue's order (interactive first, batch aging: see
    /// `crate::limits::queue`; within a class the client that received the fewest tokens
    /// lately, FIFO for one client: `crate::limits::fair`). A batch call also waits while
    /// batch holds its share cap.
    pub async fn lease_for(
        &self,
        class: PriorityClass,
        ticket: Ticket,
    ) -> Result<Lease<C>, PoolError> {
        let start = Instant::now();
        let charge = Charge { class, ticket };
        let (step, lease_timeout) = {
            let mut state = self.inner.state.lock();
            let lease_timeout = state.limits.lease_timeout.get();
            (
                self.inner.begin(&mut state, start, class, ticket)?,
                lease_timeout,
            )
        };
        let grant = match step {
            Step::Ready(grant) => grant,
            Step::Wait(rx, id) => {
                let mut waiting = Unsettled {
                    pool: Arc::clone(&self.inner),
                    charge,
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
        self.inner.clone().complete(grant, start, charge).await
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

    /// Applies new pool limits in place. Growing the cap (or the burst) hands free slots to
    /// waiters at once; shrinking it closes excess idle connections now and excess leased ones
    /// as they return (so does lowering the burst: connections beyond the share are never
    /// idle, and those beyond share + burst close as they return).
    pub fn set_limits(&self, limits: PoolLimits) {
        let mut state = self.inner.state.lock();
        if limits.idle_timeout != state.limits.idle_timeout {
            // A new idle timeout (the operator's, under every gateway's findings, or an edit)
            // starts over: what the endpoints' closes showed was shown under the old one.
            for ep in &mut state.endpoints {
                ep.keep_alive.forget();
            }
        }
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
                let (created, reused, output_tokens) = self
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
                    keep_alive: KeepAlive::default(),
                    created,
                    reused,
                    output_tokens,
                });
            }
        }
        state.endpoints.retain(|ep| !(ep.removed && ep.open() == 0));
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
            burst: BurstStats {
                allowance: state.limits.burst_per_endpoint,
                bursting: state.bursting(),
            },
            max_pending: state.limits.max_pending,
            endpoints: state
                .endpoints
                .iter()
                .filter(|ep| !ep.removed)
                .map(|ep| {
                    let idle = ep.idle.len() as u32;
                    let shared = self.inner.connector.multiplexed(ep.address);
                    let slots = ep.leased + idle + ep.connecting + ep.closing;
                    EndpointStats {
                        name: ep.name.to_string(),
                        address: ep.address,
                        leased: ep.leased,
                        idle,
                        connecting: ep.connecting,
                        closing: ep.closing,
                        sockets: slots.saturating_sub(shared.streams) + shared.connections,
                        max_streams_per_connection: shared.max_streams,
                        http2_fallback: shared.fallback.filter(|(until, _)| *until > now).map(
                            |(until, reason)| Fallback {
                                reason,
                                remaining_seconds: (until - now).as_millis().div_ceil(1000) as u64,
                            },
                        ),
                        max,
                        healthy: state.eligible(ep, now),
                        ejected: ep.health.is_ejected(now),
                        drained: ep.drained,
                        created: ep.created.get(),
                        reused: ep.reused.get(),
                        idle_timeout_ms: ep.idle_timeout(&state.limits, now).as_millis() as u64,
                        peer_closed_idle_ms: ep
                            .keep_alive
                            .closed_after(now)
                            .map(|d| d.as_millis() as u64),
                    }
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
