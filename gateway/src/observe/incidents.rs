//! The incident signals: the metrics on-call engineers looked for in the incidents poolpilot
//! comes from, beyond the pool's own metrics: the health of the gateway's runtime (scheduling
//! lag measured by a probe task, busy workers), how long clients hold pool leases and their
//! connections to the gateway, connections the gateway took back from clients that held them
//! idle or stopped reading (reclaimed, by reason and client class), the age of upstream
//! connections when they close, and how long those a backend closed had been idle.
//!
//! Client classes are the bounded client labels of the limiter (override names, `other`) or
//! `none` (no client policy on the route, or a connection-level reclaim that no call owns).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::labels::{CloseReason, Timing};

/// The client class of calls on a route without client policy, and of connection-level reclaims.
pub const NO_CLIENT: &str = "none";

/// How often the runtime probe measures the scheduling lag.
pub const LAG_PROBE_INTERVAL: Duration = Duration::from_millis(100);

/// Why the gateway took a connection back from a client (`reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reclaim {
    /// A keep-alive connection without a request for `idleTimeout`.
    IdleTimeout,
    /// A request head not complete within `headerReadTimeout`.
    HeaderTimeout,
    /// A response the client accepted no bytes of for `sendTimeout`.
    SendStall,
    /// A response the client was still not reading when `total` passed.
    ClientStalled,
    /// A request body that stalled or trickled below `minBodyRate`.
    BodyTimeout,
}

impl Reclaim {
    fn as_str(self) -> &'static str {
        match self {
            Self::IdleTimeout => "idle_timeout",
            Self::HeaderTimeout => "header_timeout",
            Self::SendStall => "send_stall",
            Self::ClientStalled => "client_stalled",
            Self::BodyTimeout => "body_timeout",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReclaimLabels {
    reason: &'static str,
    client: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HoldLabels {
    backend: String,
    client: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct AgeLabels {
    backend: String,
    reason: &'static str,
}

type Hist<L> = Family<L, Histogram, fn() -> Histogram>;

fn lag_histogram() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    ])
}

fn hold_histogram() -> Histogram {
    // 5ms .. ~160s, like the upstream durations: a lease is held for one call.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

fn long_histogram() -> Histogram {
    // 10ms .. ~11h in steps of 4: connections live from one call to days.
    Histogram::new(exponential_buckets(0.01, 4.0, 12))
}

/// The families of this module, registered beside the others. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Incidents {
    runtime_lag: Histogram,
    runtime_workers: Gauge,
    runtime_busy: Counter<f64, AtomicU64>,
    runtime_alive_tasks: Gauge,
    runtime_queue_depth: Gauge,
    busy_seen: Arc<Mutex<Duration>>,
    /// The runtime whose metrics are reported: the proxy's, recorded by the lag probe that runs
    /// on it (`/metrics` is rendered on the admin thread, another runtime).
    proxy_runtime: Arc<OnceLock<tokio::runtime::Handle>>,
    lease_hold: Hist<HoldLabels>,
    downstream_hold: Histogram,
    reclaimed: Family<ReclaimLabels, Counter>,
    connection_age: Hist<AgeLabels>,
    peer_closed_idle: Hist<BackendLabel>,
    retries: Family<RetryLabels, Counter>,
    client_concurrency: Hist<PolicyLabel>,
    throttle_delay: Family<BackendLabel, Counter<f64, AtomicU64>>,
    throttled: Family<BackendLabel, Counter>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BackendLabel {
    backend: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PolicyLabel {
    policy: String,
}

/// Buckets of the idle time at which a backend closed a pooled connection: 50 ms to ~110 s, each
/// bound 1.5× the one below, so that the 5th percentile the operator reads
/// (`histogram_quantile` interpolates within a bucket) is less than 1.5× the shortest idle time
/// in its bucket.
fn peer_idle_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.05, 1.5, 20))
}

fn concurrency_histogram() -> Histogram {
    Histogram::new([
        1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0, 256.0, 512.0,
    ])
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RetryLabels {
    client: String,
    timing: &'static str,
}

impl Incidents {
    pub(crate) fn new() -> Self {
        Self {
            runtime_lag: lag_histogram(),
            runtime_workers: Gauge::default(),
            runtime_busy: Counter::default(),
            runtime_alive_tasks: Gauge::default(),
            runtime_queue_depth: Gauge::default(),
            busy_seen: Arc::default(),
            proxy_runtime: Arc::default(),
            lease_hold: Family::new_with_constructor(hold_histogram),
            downstream_hold: long_histogram(),
            reclaimed: Family::default(),
            connection_age: Family::new_with_constructor(long_histogram),
            peer_closed_idle: Family::new_with_constructor(peer_idle_histogram),
            retries: Family::default(),
            client_concurrency: Family::new_with_constructor(concurrency_histogram),
            throttle_delay: Family::default(),
            throttled: Family::default(),
        }
    }

    pub(crate) fn register(&self, r: &mut Registry) {
        r.register_with_unit(
            "poolpilot_runtime_lag",
            "Scheduling delay of a probe task woken every 100ms: how late the gateway's runtime runs a ready task",
            Unit::Seconds,
            self.runtime_lag.clone(),
        );
        r.register(
            "poolpilot_runtime_workers",
            "Worker threads of the gateway's runtime",
            self.runtime_workers.clone(),
        );
        r.register_with_unit(
            "poolpilot_runtime_worker_busy",
            "Time the runtime's workers spent running tasks, summed over workers (rate / workers = busy share)",
            Unit::Seconds,
            self.runtime_busy.clone(),
        );
        r.register(
            "poolpilot_runtime_alive_tasks",
            "Tasks alive in the gateway's runtime (about two per open client connection)",
            self.runtime_alive_tasks.clone(),
        );
        r.register(
            "poolpilot_runtime_global_queue_depth",
            "Tasks waiting in the runtime's global queue",
            self.runtime_queue_depth.clone(),
        );
        r.register_with_unit(
            "poolpilot_pool_lease_hold",
            "Time a call held its pooled connection, from the lease to the end of the response, by client class",
            Unit::Seconds,
            self.lease_hold.clone(),
        );
        r.register_with_unit(
            "poolpilot_downstream_connection_hold",
            "Lifetime of client connections to the gateway, at their close",
            Unit::Seconds,
            self.downstream_hold.clone(),
        );
        r.register(
            "poolpilot_downstream_reclaimed",
            "Client connections or calls the gateway took back (idle, stalled, not reading), by reason and client class",
            self.reclaimed.clone(),
        );
        r.register_with_unit(
            "poolpilot_pool_connection_age",
            "Age of upstream connections when they close, by reason",
            Unit::Seconds,
            self.connection_age.clone(),
        );
        r.register_with_unit(
            "poolpilot_pool_peer_closed_idle",
            "How long upstream connections the backend closed had been idle when the gateway found them closed (at a lease, the reaper's pass, or a request on a reused connection that went unanswered): the backend's keep-alive timeout is at most this",
            Unit::Seconds,
            self.peer_closed_idle.clone(),
        );
        r.register(
            "poolpilot_client_concurrency",
            "Calls a client has in flight or queued, this one included, at each call's admission, per client policy (no client labels: the distribution maxConcurrency is set from)",
            self.client_concurrency.clone(),
        );
        r.register(
            "poolpilot_pool_soft_throttled",
            "Lease requests the soft throttle delayed",
            self.throttled.clone(),
        );
        r.register_with_unit(
            "poolpilot_pool_soft_throttle_delay",
            "Time the soft throttle delayed lease requests, in total",
            Unit::Seconds,
            self.throttle_delay.clone(),
        );
        r.register(
            "poolpilot_client_retries",
            "Calls that came back after a 429 or 503 with Retry-After, before it passed (early) or after (on_time), by client class",
            self.retries.clone(),
        );
    }

    /// A client of `policy` asked for `calls` calls at once (in flight, queued and this one).
    pub(crate) fn client_concurrency(&self, policy: &str, calls: u32) {
        self.client_concurrency
            .get_or_create(&PolicyLabel {
                policy: policy.into(),
            })
            .observe(f64::from(calls));
    }

    /// The soft throttle delayed a lease request of `backend` by `delay`.
    pub(crate) fn throttled(&self, backend: &str, delay: Duration) {
        let label = BackendLabel {
            backend: backend.into(),
        };
        self.throttled.get_or_create(&label).inc();
        self.throttle_delay
            .get_or_create(&label)
            .inc_by(delay.as_secs_f64());
    }

    /// A client of `client` class came back after a refusal.
    pub(crate) fn retried(&self, client: &str, timing: Timing) {
        self.retries
            .get_or_create(&RetryLabels {
                client: client.into(),
                timing: timing.as_str(),
            })
            .inc();
    }

    /// One measure of the runtime's scheduling lag.
    pub(crate) fn runtime_lag(&self, lag: Duration) {
        self.runtime_lag.observe(lag.as_secs_f64());
    }

    /// Reads tokio's runtime metrics (workers, busy time, tasks, global queue) into the gauges.
    pub(crate) fn refresh_runtime(&self) {
        let Some(handle) = self
            .proxy_runtime
            .get()
            .cloned()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
        else {
            return;
        };
        let m = handle.metrics();
        let workers = m.num_workers();
        self.runtime_workers.set(workers as i64);
        self.runtime_alive_tasks.set(m.num_alive_tasks() as i64);
        self.runtime_queue_depth.set(m.global_queue_depth() as i64);
        let busy: Duration = (0..workers).map(|w| m.worker_total_busy_duration(w)).sum();
        let mut seen = self.busy_seen.lock();
        if busy > *seen {
            self.runtime_busy.inc_by((busy - *seen).as_secs_f64());
            *seen = busy;
        }
    }

    /// A call of `client` held a lease of `backend` for `held`.
    pub(crate) fn lease_held(&self, backend: &str, client: &str, held: Duration) {
        self.lease_hold(backend, client).observe(held.as_secs_f64());
    }

    /// The lease-hold histogram of `backend`'s calls from `client`.
    pub(crate) fn lease_hold(&self, backend: &str, client: &str) -> Histogram {
        self.lease_hold.get_or_create_owned(&HoldLabels {
            backend: backend.into(),
            client: client.into(),
        })
    }

    /// A client connection closed after `held`.
    pub(crate) fn downstream_closed(&self, held: Duration) {
        self.downstream_hold.observe(held.as_secs_f64());
    }

    /// The gateway took back a connection or call of `client` for `reason`.
    pub(crate) fn reclaimed(&self, reason: Reclaim, client: &str) {
        self.reclaimed
            .get_or_create(&ReclaimLabels {
                reason: reason.as_str(),
                client: client.into(),
            })
            .inc();
    }

    /// How long pooled connections of `backend` found closed by the backend had been idle: the
    /// series, created at zero with the backend's pool. A series first exported with its first
    /// closes already in it shows Prometheus no increase (`rate` needs two samples), and the
    /// closes of a pool that protects itself after its first few would never be seen.
    pub(crate) fn peer_closed_idle(&self, backend: &str) -> Histogram {
        self.peer_closed_idle.get_or_create_owned(&BackendLabel {
            backend: backend.into(),
        })
    }

    /// An upstream connection of `backend` closed for `reason` at `age`.
    pub(crate) fn connection_aged(&self, backend: &str, reason: CloseReason, age: Duration) {
        self.connection_age
            .get_or_create(&AgeLabels {
                backend: backend.into(),
                reason: reason.as_str(),
            })
            .observe(age.as_secs_f64());
    }
}

/// Measures the runtime's scheduling lag every [`LAG_PROBE_INTERVAL`] for as long as the
/// gateway lives: a task that asks to wake at a deadline and notes how late it ran. A runtime
/// whose workers are all busy (or blocked) runs it late, by as much as it runs every other task.
pub fn spawn_lag_probe(incidents: Incidents) -> JoinHandle<()> {
    let _ = incidents
        .proxy_runtime
        .set(tokio::runtime::Handle::current());
    tokio::spawn(async move {
        loop {
            let due = Instant::now() + LAG_PROBE_INTERVAL;
            tokio::time::sleep_until(due).await;
            incidents.runtime_lag(Instant::now().saturating_duration_since(due));
        }
    })
}
