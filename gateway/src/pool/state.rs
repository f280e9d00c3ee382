//! The pool's shared state, behind one lock per backend: the backend's [`Inner`] (connector,
//! metrics, the locked [`State`]), the waiter queue and the per-class holds, each endpoint's
//! counts, idle connections and [`Health`] record, and the grants handed to waiters. What only
//! reads the state lives here (lookups, the batch share cap, a full pool's `Retry-After`); what
//! changes it under the lock is in `dispatch`, the health rules in `health`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use poolpilot_api::limits::{HealthCheck, OutlierDetection, PoolLimits, Priority, PriorityClass};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::connect::{Connect, Poolable};
use super::keep_alive::KeepAlive;
use super::rate::{self, HoldTime, ReleaseRate};
use crate::limits::fair::FairQueue;
use crate::observe::{CloseReason, Metrics};

/// One backend's pool, shared by its [`super::Pool`] handles, leases, probe slots and the
/// reaper.
#[derive(Debug)]
pub(super) struct Inner<C: Connect> {
    pub(super) backend: Arc<str>,
    pub(super) connector: C,
    pub(super) metrics: Metrics,
    pub(super) lease_wait: Histogram,
    /// Lease waits per priority class, interactive first.
    pub(super) class_wait: [Histogram; 2],
    pub(super) lease_timeouts: Counter,
    /// Burst connections opened (`poolpilot_pool_bursts_total`).
    pub(super) bursts: Counter,
    /// Grants that token fairness made before an older waiter of the same class
    /// (`poolpilot_pool_fair_reordered_total`).
    pub(super) fair_reordered: Counter,
    /// How long connections the backend closed had been idle
    /// (`poolpilot_pool_peer_closed_idle_seconds`).
    pub(super) peer_closed_idle: Histogram,
    pub(super) state: Mutex<State<C::Conn>>,
    /// Notified whenever a slot frees other than by a lease returning to a live pool: a closing
    /// connection's peer let go, an abandoned connect or grant came back, or a lease returned
    /// to a retired pool. [`super::Pool::close_all`] waits on it.
    pub(super) slot_freed: tokio::sync::Notify,
}

#[derive(Debug)]
pub(super) struct State<T> {
    pub(super) limits: PoolLimits,
    pub(super) health_check: Option<HealthCheck>,
    pub(super) outlier: Option<OutlierDetection>,
    pub(super) endpoints: Vec<EndpointState<T>>,
    pub(super) next_endpoint_id: u64,
    pub(super) waiters: FairQueue<oneshot::Sender<Grant<T>>>,
    pub(super) next_waiter_id: u64,
    /// How the queue treats batch (the backend's client policy's `priority`).
    pub(super) priority: Priority,
    /// Connections held per class (granted and not yet returned), interactive first.
    pub(super) held: [u32; 2],
    pub(super) releases: ReleaseRate,
    pub(super) hold: HoldTime,
    pub(super) retired: bool,
}

#[derive(Debug)]
pub(super) struct EndpointState<T> {
    pub(super) id: u64,
    pub(super) name: Arc<str>,
    pub(super) address: SocketAddr,
    /// Most recently returned last: reuse pops the warmest, so the coldest idle out.
    pub(super) idle: Vec<IdleConn<T>>,
    pub(super) leased: u32,
    pub(super) connecting: u32,
    /// Closed by the pool, waiting for the peer to close its side.
    pub(super) closing: u32,
    /// Held by active health probes: a probe's connection counts against the cap.
    pub(super) probing: u32,
    /// Dropped from the limits: no new leases; closes as its connections come back.
    pub(super) removed: bool,
    /// Drained by hand through the admin API: no new leases, its connections close as they
    /// come back, until restored (kept across limits documents).
    pub(super) drained: bool,
    pub(super) health: Health,
    /// Its keep-alive as the connections it closed showed it, and the idle timeout kept under
    /// it ([`EndpointState::idle_timeout`]).
    pub(super) keep_alive: KeepAlive,
    pub(super) created: Counter,
    pub(super) reused: Counter,
    /// Output tokens of the calls it served (`poolpilot_endpoint_output_tokens_total`), handed
    /// to each lease.
    pub(super) output_tokens: Counter,
}

#[derive(Debug)]
pub(super) struct Health {
    /// Active probes say it is up (presumed up until probes say otherwise).
    pub(super) probe_up: bool,
    pub(super) probe_passes: u32,
    pub(super) probe_failures: u32,
    /// Passive ejection end, if ejected.
    pub(super) ejected_until: Option<Instant>,
    /// Probes passed in a row since the current ejection began.
    pub(super) passes_since_ejection: u32,
    pub(super) consecutive_failures: u32,
    pub(super) ejections: u32,
}

#[derive(Debug)]
pub(super) struct IdleConn<T> {
    pub(super) conn: T,
    pub(super) created_at: Instant,
    pub(super) idle_since: Instant,
}

impl<T: Poolable> IdleConn<T> {
    /// Why this idle connection must be closed, of what is known without a request: past its
    /// `maxLifetime`, idle past `idle_timeout` (its endpoint's,
    /// [`EndpointState::idle_timeout`]), or closed by the peer. `None`: it may serve.
    pub(super) fn expired(
        &mut self,
        limits: &PoolLimits,
        idle_timeout: Duration,
        now: Instant,
    ) -> Option<CloseReason> {
        if now.duration_since(self.created_at) >= limits.max_lifetime.get() {
            Some(CloseReason::Lifetime)
        } else if now.duration_since(self.idle_since) >= idle_timeout {
            Some(CloseReason::Idle)
        } else if !self.conn.is_open() {
            Some(CloseReason::PeerClosed)
        } else {
            None
        }
    }
}

/// What a waiter is handed. `burst`: granted beyond the endpoint's share, on its burst
/// allowance (see `dispatch`'s `find_grant`).
#[derive(Debug)]
pub(super) enum Grant<T> {
    /// An idle connection, already counted as leased.
    Conn {
        endpoint: u64,
        idle: IdleConn<T>,
        burst: bool,
    },
    /// A reserved slot at an endpoint: the waiter connects.
    Slot { endpoint: u64, burst: bool },
}

// === impl State ===

impl<T: Poolable> State<T> {
    pub(super) fn endpoint(&self, id: u64) -> Option<&EndpointState<T>> {
        self.endpoints.iter().find(|ep| ep.id == id)
    }

    pub(super) fn endpoint_mut(&mut self, id: u64) -> Option<&mut EndpointState<T>> {
        self.endpoints.iter_mut().find(|ep| ep.id == id)
    }

    /// The listed (not removed) endpoint named `name`.
    pub(super) fn listed_endpoint_mut(&mut self, name: &str) -> Option<&mut EndpointState<T>> {
        self.endpoints
            .iter_mut()
            .find(|ep| !ep.removed && *ep.name == *name)
    }
    /// The most connections batch calls may hold: `batchMaxPercent` of the cap over the
    /// endpoints that take leases (not removed or drained), rounded down, at least 1; none
    /// without a cap. The cap is the share (`maxConnectionsPerEndpoint`), never share + burst:
    /// batch calls do not burst.
    pub(super) fn batch_cap(&self) -> Option<u32> {
        let percent = self.priority.batch_max_percent?;
        let live = self
            .endpoints
            .iter()
            .filter(|ep| !ep.removed && !ep.drained)
            .count() as u64;
        let total = u64::from(self.limits.max_connections_per_endpoint) * live;
        Some(((total * u64::from(percent) / 100).max(1)).min(u64::from(u32::MAX)) as u32)
    }

    /// Connections open beyond the share, summed over the listed endpoints: what the pool holds
    /// on its burst allowance now (closing ones included: the backend still counts them).
    pub(super) fn bursting(&self) -> u32 {
        let max = self.limits.max_connections_per_endpoint;
        self.endpoints
            .iter()
            .filter(|ep| !ep.removed)
            .map(|ep| ep.open().saturating_sub(max))
            .sum()
    }

    /// Whether a call of `class` may be handed a connection now: interactive always, batch
    /// while it holds fewer than its cap.
    pub(super) fn may_serve(&self, class: PriorityClass) -> bool {
        match (class, self.batch_cap()) {
            (PriorityClass::Batch, Some(cap)) => self.held[PriorityClass::Batch.index()] < cap,
            _ => true,
        }
    }

    /// Retry-After for a full pool: the time for the queue ahead (and this request) to drain
    /// at the observed release rate; before any release was seen, the mean hold time spread
    /// over the capacity; before any lease completed, the lease timeout.
    pub(super) fn retry_after(&self, now: Instant) -> Duration {
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
}

// === impl EndpointState ===

impl<T> EndpointState<T> {
    /// How long a connection to it may stay idle: `idleTimeout`, or less once it was seen
    /// closing idle connections sooner ([`KeepAlive`]).
    pub(super) fn idle_timeout(&self, limits: &PoolLimits, now: Instant) -> Duration {
        self.keep_alive.idle_timeout(limits.idle_timeout.get(), now)
    }

    /// Open connections: the number the cap bounds, counting those the peer still holds. No
    /// new connection is opened while this is at the cap.
    pub(super) fn open(&self) -> u32 {
        self.usable() + self.closing + self.probing
    }

    /// The connections this pool can still use (idle, leased, being opened): the ones a
    /// shrink closes down to the cap. Closing ones are on their way out already.
    pub(super) fn usable(&self) -> u32 {
        self.idle.len() as u32 + self.leased + self.connecting
    }

    /// Connections that cannot take a new request.
    pub(super) fn busy(&self) -> u32 {
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
