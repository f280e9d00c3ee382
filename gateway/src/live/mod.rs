//! The gateway's live state: the limits document in force, the routes built from it, one pool
//! per backend and one limiter per client policy, and applying a new document *in place*
//! (pools resize and keep their connections, limiters keep their clients).
//!
//! Readers take an `Arc<Snapshot>` (one read lock, one clone) and never block an apply; an
//! apply is serialised by its own lock, builds the new snapshot and swaps it in.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use poolpilot_api::GatewayLimits;
use poolpilot_api::limits::{HealthCheck, InvalidLimits, RouteMatch, Timeouts};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::budget::ByteBudget;
use crate::health;
use crate::limits::limiter::{ClientLimiter, ClientStats};
use crate::limits::refusals::RefusalMemory;
use crate::observe::Metrics;
use crate::observe::access::AccessLog;
use crate::pool::{EndpointStats, Pool, PoolStats};
use crate::upstream::HttpConnector;

/// Where a limits document came from (metric label, logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitsSource {
    /// `PUT /v1/limits`.
    Api,
    /// The limits file.
    File,
}

impl LimitsSource {
    fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::File => "file",
        }
    }
}

/// Why a limits document was not applied. The limits in force stay.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// It fails validation (422).
    #[error(transparent)]
    Invalid(#[from] InvalidLimits),
    /// Its generation is older than the one in force (409).
    #[error("generation {offered} is older than generation {current} in force")]
    Stale {
        /// The document's generation.
        offered: u64,
        /// The generation in force.
        current: u64,
    },
    /// Same generation as the one in force, different content (409): bump the generation.
    #[error(
        "generation {generation} is in force with revision {current}; revision {offered} needs a newer generation"
    )]
    Conflict {
        /// The generation.
        generation: u64,
        /// Revision in force.
        current: String,
        /// Revision offered.
        offered: String,
    },
}

/// What an apply did.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Applied {
    /// Revision now in force.
    pub revision: String,
    /// Generation now in force.
    pub generation: u64,
    /// Whether anything changed (false when the same document was applied again).
    #[serde(skip)]
    pub changed: bool,
}

/// The live gateway. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Gateway {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    metrics: Metrics,
    snapshot: RwLock<Arc<Snapshot>>,
    registry: Mutex<Registry>,
    loaded: AtomicBool,
    /// A document arrived by `PUT /v1/limits`: the operator manages this pod from now on, and
    /// the limits file is no longer followed (see [`Gateway::managed_by_api`]).
    managed_by_api: AtomicBool,
    /// Until when the gateway stays unready waiting for its first PUT (see
    /// [`Gateway::await_operator`]); `None`: it does not wait.
    await_operator_until: Mutex<Option<Instant>>,
    draining: AtomicBool,
    /// Shutdown began: `/readyz` fails (the gateway may still serve for `shutdownDelay`).
    leaving: AtomicBool,
    /// Bytes of request bodies buffered for routing, pod-wide.
    route_budget: ByteBudget,
    /// Serialises scrapes: live gauges are cleared and set again before each one.
    scrape: Mutex<()>,
    /// One line per call.
    access_log: AccessLog,
    /// Opens the backends' connections.
    connector: HttpConnector,
    /// Recent refusals, to tell early retries.
    refusals: RefusalMemory,
    /// The factor on the `Retry-After` of an early retry refused again.
    early_retry_penalty: u32,
}

#[derive(Debug, Default)]
struct Registry {
    backends: HashMap<String, Arc<Backend>>,
    limiters: HashMap<String, ClientLimiter>,
}

/// One backend: its pool and its health checker.
#[derive(Debug)]
pub(crate) struct Backend {
    pub(crate) name: Arc<str>,
    pub(crate) pool: Pool<HttpConnector>,
    health: Mutex<Option<(HealthCheck, JoinHandle<()>)>>,
}

/// The limits in force and what was built from them.
#[derive(Debug)]
pub struct Snapshot {
    /// The document, with its revision set.
    pub limits: GatewayLimits,
    pub(crate) routes: Vec<Route>,
    pub(crate) needs_model: bool,
}

/// One backend's route with what a request on it needs.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) matcher: RouteMatch,
    pub(crate) backend: Arc<Backend>,
    pub(crate) timeouts: Timeouts,
    pub(crate) limiter: Option<ClientLimiter>,
}

// === impl Gateway ===

impl Gateway {
    /// A gateway with no backends (every request gets 404) until limits are applied, and no
    /// access log.
    pub fn new(metrics: Metrics) -> Self {
        Self::configured(metrics, AccessLog::off(), HttpConnector::default(), 1)
    }

    /// [`Gateway::new`], writing one line per call to `access_log`, opening upstream
    /// connections with `connector`, and multiplying the `Retry-After` of an early retry refused
    /// again by `early_retry_penalty`.
    pub fn configured(
        metrics: Metrics,
        access_log: AccessLog,
        connector: HttpConnector,
        early_retry_penalty: u32,
    ) -> Self {
        let limits = GatewayLimits::default().with_content_revision();
        metrics.set_limits_info(&limits.revision, limits.generation);
        Self {
            inner: Arc::new(Inner {
                metrics,
                snapshot: RwLock::new(Arc::new(Snapshot {
                    limits,
                    routes: Vec::new(),
                    needs_model: false,
                })),
                registry: Mutex::default(),
                loaded: AtomicBool::new(false),
                managed_by_api: AtomicBool::new(false),
                await_operator_until: Mutex::new(None),
                draining: AtomicBool::new(false),
                leaving: AtomicBool::new(false),
                route_budget: ByteBudget::default(),
                scrape: Mutex::new(()),
                access_log,
                connector,
                refusals: RefusalMemory::default(),
                early_retry_penalty: early_retry_penalty.max(1),
            }),
        }
    }

    /// The limits in force.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.inner.snapshot.read().clone()
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The access log.
    pub fn access_log(&self) -> &AccessLog {
        &self.inner.access_log
    }

    /// Recent refusals, to tell which clients come back before their `Retry-After`.
    pub fn refusals(&self) -> &RefusalMemory {
        &self.inner.refusals
    }

    /// The factor on the `Retry-After` of an early retry refused again (1: none).
    pub fn early_retry_penalty(&self) -> u32 {
        self.inner.early_retry_penalty
    }

    /// Ready: limits were loaded, shutdown has not begun and the gateway is not waiting for the
    /// operator.
    pub fn is_ready(&self) -> bool {
        self.inner.loaded.load(Ordering::Acquire)
            && !self.inner.leaving.load(Ordering::Acquire)
            && !self.is_draining()
            && !self.is_awaiting_operator()
    }

    /// Marks the gateway as leaving: `/readyz` fails from now on, while it still serves (the
    /// shutdown delay before the drain).
    pub fn set_leaving(&self) {
        self.inner.leaving.store(true, Ordering::Release);
    }

    /// From now on, stay unready until the operator PUTs this pod its own document, for at most
    /// `grace` (zero: do not wait). The limits file's shares were divided over the fleet as it
    /// was before this pod started: serving from them could push a backend past its budget
    /// until the operator divides again. After `grace` the file's limits serve alone (the
    /// operator is away: a restarted pod must not stay out of service).
    pub fn await_operator(&self, grace: Duration) {
        *self.inner.await_operator_until.lock() =
            (!grace.is_zero()).then(|| Instant::now() + grace);
    }

    /// Whether the gateway is still waiting for the operator's first PUT.
    pub fn is_awaiting_operator(&self) -> bool {
        !self.managed_by_api()
            && self
                .inner
                .await_operator_until
                .lock()
                .is_some_and(|until| Instant::now() < until)
    }

    /// The pod-wide budget of routing buffers.
    pub fn route_budget(&self) -> &ByteBudget {
        &self.inner.route_budget
    }

    /// Whether shutdown began.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }

    /// Whether a document was applied through `PUT /v1/limits`. From then on the operator sends
    /// this pod its own document (its share of each target, its canary wave), and changes of
    /// the limits file, a ConfigMap shared by every pod, are not followed: they would hand every
    /// pod the first pod's shares and skip the rollout's waves. The file still serves a
    /// restart, and standalone gateways (never PUT to) follow it.
    pub fn managed_by_api(&self) -> bool {
        self.inner.managed_by_api.load(Ordering::Acquire)
    }

    /// Marks the gateway as draining (`/readyz` fails from now on).
    pub fn set_draining(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    /// Closes every backend's upstream connections at once and waits until the backends have
    /// closed their sides (see [`Pool::close_all`]): the last step of a shutdown, so that no
    /// backend still counts this gateway's connections once it is gone. Returns how many
    /// backends still held some when the grace ran out.
    pub async fn close_upstreams(&self) -> usize {
        let pools: Vec<_> = self
            .inner
            .registry
            .lock()
            .backends
            .values()
            .map(|b| b.pool.clone())
            .collect();
        let mut closing = tokio::task::JoinSet::new();
        for pool in pools {
            closing.spawn(async move { (pool.close_all().await, pool) });
        }
        let mut left = 0;
        while let Some(closed) = closing.join_next().await {
            let Ok((false, pool)) = closed else { continue };
            left += 1;
            let stats = pool.stats();
            let sum = |f: fn(&EndpointStats) -> u32| stats.endpoints.iter().map(f).sum::<u32>();
            tracing::warn!(
                backend = %pool.backend(),
                leased = sum(|e| e.leased),
                connecting = sum(|e| e.connecting),
                closing = sum(|e| e.closing),
                "upstream connections still open after the close grace"
            );
        }
        left
    }

    /// Validates `doc` and swaps it in. A document older than the one in force is refused; the
    /// same generation is accepted only with the same content, except generation 0 (a
    /// hand-written file), which is applied whenever its content changes.
    pub fn apply(
        &self,
        mut doc: GatewayLimits,
        source: LimitsSource,
    ) -> Result<Applied, ApplyError> {
        let result = self.try_apply(&mut doc, source);
        if let Err(error) = &result {
            self.inner.metrics.limits_rejected(source.as_str());
            tracing::warn!(source = source.as_str(), %error, "limits refused; the limits in force stay");
        }
        result
    }

    fn try_apply(
        &self,
        doc: &mut GatewayLimits,
        source: LimitsSource,
    ) -> Result<Applied, ApplyError> {
        doc.validate()?;
        if doc.revision.is_empty() {
            doc.revision = doc.content_revision();
        }
        let mut registry = self.inner.registry.lock();
        let current = self.snapshot();
        let loaded = self.inner.loaded.load(Ordering::Acquire);
        let (cur_gen, cur_rev) = (current.limits.generation, current.limits.revision.clone());
        if loaded {
            if doc.generation < cur_gen {
                return Err(ApplyError::Stale {
                    offered: doc.generation,
                    current: cur_gen,
                });
            }
            if doc.generation == cur_gen && doc.revision == cur_rev {
                if matches!(source, LimitsSource::Api) {
                    // The operator confirmed the document in force (a pod that started from the
                    // file with its current share): it manages this pod from now on.
                    self.inner.managed_by_api.store(true, Ordering::Release);
                }
                return Ok(Applied {
                    revision: cur_rev,
                    generation: cur_gen,
                    changed: false,
                });
            }
            if doc.generation == cur_gen && cur_gen != 0 {
                return Err(ApplyError::Conflict {
                    generation: cur_gen,
                    current: cur_rev,
                    offered: doc.revision.clone(),
                });
            }
        }

        // Client limiters: keep the ones whose name stays, update them in place.
        let mut limiters = HashMap::new();
        for policy in &doc.client_policies {
            let limiter = match registry.limiters.remove(&policy.name) {
                Some(existing) => {
                    existing.set_policy(policy.clone());
                    existing
                }
                None => ClientLimiter::new(policy.clone(), self.inner.metrics.clone()),
            };
            limiters.insert(policy.name.clone(), limiter);
        }

        // Backends: resize pools in place, create new ones, retire removed ones. A pod-wide
        // upstream cap lowers the pools' caps, fairly (`share`).
        let pools: Vec<(u32, u32)> = doc
            .backends
            .iter()
            .map(|b| {
                (
                    b.pool.max_connections_per_endpoint,
                    b.endpoints.len() as u32,
                )
            })
            .collect();
        let caps =
            crate::limits::share::per_endpoint_caps(doc.listener.max_upstream_connections, &pools);
        let mut backends = HashMap::new();
        let mut routes = Vec::with_capacity(doc.backends.len());
        for (b, cap) in doc.backends.iter().zip(caps) {
            let mut pool_limits = b.pool.clone();
            pool_limits.max_connections_per_endpoint = cap;
            let backend = match registry.backends.remove(&b.name) {
                Some(existing) => {
                    existing.pool.set_endpoints(&b.endpoints);
                    existing.pool.set_limits(pool_limits);
                    existing
                }
                None => Arc::new(Backend {
                    name: b.name.as_str().into(),
                    pool: Pool::new(
                        &b.name,
                        pool_limits,
                        &b.endpoints,
                        self.inner.connector,
                        self.inner.metrics.clone(),
                    ),
                    health: Mutex::new(None),
                }),
            };
            backend
                .pool
                .set_health_rules(b.health_check.clone(), b.outlier_detection.clone());
            // The pool queue treats batch as the backend's client policy says.
            backend.pool.set_priority(
                b.client_policy
                    .as_ref()
                    .and_then(|name| doc.client_policies.iter().find(|p| p.name == *name))
                    .and_then(|p| p.priority.clone()),
            );
            backend.set_health_check(b.health_check.clone());
            routes.push(Route {
                matcher: b.route.clone(),
                backend: backend.clone(),
                timeouts: b.timeouts.clone(),
                limiter: b
                    .client_policy
                    .as_ref()
                    .and_then(|p| limiters.get(p).cloned()),
            });
            backends.insert(b.name.clone(), backend);
        }
        for (name, removed) in registry.backends.drain() {
            tracing::info!(backend = %name, "backend removed; its connections close as they return");
            removed.retire();
        }
        registry.backends = backends;
        registry.limiters = limiters;

        let needs_model = doc.backends.iter().any(|b| b.route.model.is_some());
        let applied = Applied {
            revision: doc.revision.clone(),
            generation: doc.generation,
            changed: true,
        };
        self.inner
            .metrics
            .set_limits_info(&doc.revision, doc.generation);
        *self.inner.snapshot.write() = Arc::new(Snapshot {
            limits: doc.clone(),
            routes,
            needs_model,
        });
        self.inner.loaded.store(true, Ordering::Release);
        if matches!(source, LimitsSource::Api) {
            self.inner.managed_by_api.store(true, Ordering::Release);
        }
        tracing::info!(
            source = source.as_str(),
            revision = %applied.revision,
            generation = applied.generation,
            backends = doc.backends.len(),
            "limits applied"
        );
        Ok(applied)
    }

    /// Per backend and endpoint counts, and the top clients by calls in flight.
    pub fn stats(&self) -> serde_json::Value {
        let snapshot = self.snapshot();
        let backends: serde_json::Map<String, serde_json::Value> = snapshot
            .routes
            .iter()
            .map(|r| {
                let stats: PoolStats = r.backend.pool.stats();
                (
                    r.backend.name.to_string(),
                    serde_json::to_value(stats).unwrap_or_default(),
                )
            })
            .collect();
        let registry = self.inner.registry.lock();
        let mut clients: Vec<(String, ClientStats)> = registry
            .limiters
            .iter()
            .flat_map(|(policy, l)| {
                l.top_clients(10)
                    .into_iter()
                    .map(move |c| (policy.clone(), c))
            })
            .collect();
        clients.sort_by_key(|c| std::cmp::Reverse(c.1.inflight));
        clients.truncate(10);
        let upstream: u32 = snapshot
            .routes
            .iter()
            .flat_map(|r| r.backend.pool.stats().endpoints)
            .map(|e| e.leased + e.idle + e.connecting + e.closing)
            .sum();
        serde_json::json!({
            "revision": snapshot.limits.revision,
            "generation": snapshot.limits.generation,
            "upstreamConnections": upstream,
            "retryAfterCompliance": self.inner.refusals.compliance().into_iter().map(|(client, c)| {
                let total = c.early + c.on_time;
                serde_json::json!({
                    "client": client.as_ref(),
                    "early": c.early,
                    "onTime": c.on_time,
                    "earlyShare": if total == 0 { 0.0 } else { c.early as f64 / total as f64 },
                })
            }).collect::<Vec<_>>(),
            "maxUpstreamConnections": snapshot.limits.listener.max_upstream_connections,
            "backends": backends,
            "topClients": clients.into_iter().map(|(policy, c)| {
                let mut v = serde_json::to_value(c).unwrap_or_default();
                v["policy"] = policy.into();
                v
            }).collect::<Vec<_>>(),
        })
    }

    /// Drains (`true`) or restores (`false`) one endpoint of one backend by hand (see
    /// [`Pool::set_drained`]); `None` when there is no such backend or endpoint.
    pub fn set_endpoint_drained(
        &self,
        backend: &str,
        endpoint: &str,
        drained: bool,
    ) -> Option<EndpointStats> {
        let pool = self
            .inner
            .registry
            .lock()
            .backends
            .get(backend)?
            .pool
            .clone();
        pool.set_drained(endpoint, drained)
    }

    /// The metrics page in `format`, with the gauges computed from live state set just before.
    pub fn scrape(&self, format: poolpilot_telemetry::Format) -> String {
        let _one_at_a_time = self.inner.scrape.lock();
        self.refresh_gauges();
        self.inner.metrics.encode_as(format)
    }

    /// Sets the gauges computed from live state.
    pub fn refresh_gauges(&self) {
        let m = &self.inner.metrics;
        m.clear_gauges();
        let snapshot = self.snapshot();
        for r in &snapshot.routes {
            let stats = r.backend.pool.stats();
            m.set_pool_pending(&r.backend.name, stats.pending);
            m.set_pool_classes(
                &r.backend.name,
                stats.classes.clone().map(|c| (c.pending, c.held)),
            );
            for ep in &stats.endpoints {
                m.set_endpoint_gauges(
                    &r.backend.name,
                    crate::observe::metrics::EndpointGauges {
                        endpoint: &ep.name,
                        max: ep.max,
                        healthy: ep.healthy,
                        leased: ep.leased,
                        idle: ep.idle,
                        closing: ep.closing,
                    },
                );
            }
        }
        let registry = self.inner.registry.lock();
        let mut by_label: HashMap<Arc<str>, u32> = HashMap::new();
        let mut tracked = 0;
        for limiter in registry.limiters.values() {
            for (label, n) in limiter.inflight_by_label() {
                *by_label.entry(label).or_default() += n;
            }
            tracked += limiter.tracked_clients();
        }
        m.set_clients_tracked(tracked);
        for (label, n) in by_label {
            m.set_client_inflight(&label, n);
        }
        let mut queued = [0; 2];
        for limiter in registry.limiters.values() {
            let by_class = limiter.queued_by_class();
            queued[0] += by_class[0];
            queued[1] += by_class[1];
        }
        m.set_client_classes_queued(queued);
        m.set_route_buffer_bytes(self.inner.route_budget.held());
        m.incidents().refresh_runtime();
    }

    /// Forgets idle clients periodically, for as long as the gateway lives.
    pub fn spawn_maintenance(&self) -> JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(10));
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let limiters: Vec<ClientLimiter> =
                    inner.registry.lock().limiters.values().cloned().collect();
                for l in limiters {
                    l.purge();
                }
            }
        })
    }
}

// === impl Backend ===

impl Backend {
    /// Starts, restarts or stops active health checking.
    fn set_health_check(&self, check: Option<HealthCheck>) {
        let mut health = self.health.lock();
        let unchanged = match (&*health, &check) {
            (Some((running, _)), Some(wanted)) => running == wanted,
            (None, None) => true,
            _ => false,
        };
        if unchanged {
            return;
        }
        if let Some((_, task)) = health.take() {
            task.abort();
        }
        if let Some(check) = check {
            let task = health::spawn(self.pool.clone(), check.clone());
            *health = Some((check, task));
        }
    }

    fn retire(&self) {
        if let Some((_, task)) = self.health.lock().take() {
            task.abort();
        }
        self.pool.retire();
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some((_, task)) = self.health.get_mut().take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests;
