//! The gateway's live state ([`Gateway`]): the limits document in force and what was built from
//! it (the [`Snapshot`]: routes, each with its backend's pool and its client policy's limiter),
//! the registry of pools and limiters that a new document updates *in place* ([`apply`]: pools
//! resize and keep their connections, limiters keep their clients), readiness and shutdown, and
//! what the state reports ([`report`]: `/v1/stats`, the gauges set at each scrape). A backend's
//! pool endpoints are made of its document's ([`endpoints`]: one per address of a DNS name),
//! set anew whenever the resolver's answer changes ([`Gateway::spawn_dns_refresh`]), and its
//! TLS clients ([`upstream_tls`]) are kept while current and rebuilt when their files change.
//!
//! Readers take an `Arc<Snapshot>` (one read lock, one clone) and never block an apply; an
//! apply is serialised by its own lock, builds the new snapshot and swaps it in.

mod apply;
mod endpoints;
mod report;
#[cfg(test)]
mod tests;
mod upstream_tls;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use poolpilot_api::GatewayLimits;
use poolpilot_api::limits::{
    Endpoint as DocEndpoint, HealthCheck, PoolLimits, RouteMatch, Timeouts,
};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::limits::cooldown::Cooldown;
use crate::limits::limiter::ClientLimiter;
use crate::limits::refusals::RefusalMemory;
use crate::observe::access::AccessLog;
use crate::observe::{CallSignals, Metrics};
use crate::pool::{EndpointStats, Pool};
use crate::proxy::credentials::ProviderKey;
use crate::proxy::route_budget::ByteBudget;
use crate::resolve::{DnsConfig, Resolver};
use crate::upstream::{HttpConnector, TlsClient, TlsError};
pub use apply::{ApplyError, LimitsSource};

/// The TLS clients of one backend's endpoints, by endpoint name ([`upstream_tls`]).
pub(crate) type TlsClients = HashMap<String, Arc<TlsClient>>;

/// An endpoint whose TLS settings could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("backends[{backend}].endpoints[{endpoint}].tls: {source}")]
pub struct EndpointTlsError {
    /// The backend.
    pub backend: String,
    /// The endpoint.
    pub endpoint: String,
    /// Why.
    #[source]
    pub source: Box<TlsError>,
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
    /// Resolves the DNS-named endpoints.
    resolver: Resolver,
}

#[derive(Debug, Default)]
struct Registry {
    backends: HashMap<String, Arc<Backend>>,
    limiters: HashMap<String, ClientLimiter>,
}

/// One backend: its pool, its health checker, and the document's endpoints and pool limits the
/// pool's are made of ([`endpoints`]).
#[derive(Debug)]
pub(crate) struct Backend {
    pub(crate) name: Arc<str>,
    /// The metric handles its calls observe.
    pub(crate) signals: CallSignals,
    pub(crate) pool: Pool<HttpConnector>,
    /// The pool's connector (shared with it): which addresses take TLS.
    connector: HttpConnector,
    /// The TLS clients of its endpoints, by endpoint name.
    tls: Mutex<TlsClients>,
    /// The provider's key set on its calls, if it has `credentials`.
    credentials: RwLock<Option<Arc<ProviderKey>>>,
    /// Until when the provider asked not to be called (only with `credentials`).
    pub(crate) cooldown: Cooldown,
    health: Mutex<Option<(HealthCheck, JoinHandle<()>)>>,
    document: Mutex<(Vec<DocEndpoint>, PoolLimits)>,
}

/// The limits in force and what was built from them.
#[derive(Debug)]
pub struct Snapshot {
    /// The document, with its revision set.
    pub limits: GatewayLimits,
    pub(crate) routes: Vec<Route>,
    pub(crate) needs_model: bool,
    /// Whether requests' bodies are read before routing: a route needs the `model`, or a
    /// client policy has token budgets (a call's estimate reads `max_tokens` and the prompt).
    pub(crate) needs_body: bool,
}

/// One backend's route with what a request on it needs.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) matcher: RouteMatch,
    pub(crate) backend: Arc<Backend>,
    pub(crate) timeouts: Timeouts,
    pub(crate) limiter: Option<ClientLimiter>,
    /// The routes of its fallback backends, in order (indices into [`Snapshot::routes`]).
    pub(crate) fallback: Vec<usize>,
    /// The output tokens its model server produces for a call that does not say
    /// (`defaultMaxTokens`), if the document says.
    pub(crate) default_max_tokens: Option<u64>,
}

// === impl Gateway ===

impl Gateway {
    /// A gateway with no backends (every request gets 503 `no_backends`) until limits are
    /// applied, and no access log.
    pub fn new(metrics: Metrics) -> Self {
        Self::configured(
            metrics,
            AccessLog::off(),
            HttpConnector::default(),
            1,
            DnsConfig::default(),
        )
    }

    /// [`Gateway::new`], writing one line per call to `access_log`, opening upstream
    /// connections with `connector`, multiplying the `Retry-After` of an early retry refused
    /// again by `early_retry_penalty`, and resolving DNS-named endpoints as `dns` says.
    pub fn configured(
        metrics: Metrics,
        access_log: AccessLog,
        connector: HttpConnector,
        early_retry_penalty: u32,
        dns: DnsConfig,
    ) -> Self {
        let resolver = Resolver::new(dns, metrics.clone());
        let limits = GatewayLimits::default().with_content_revision();
        metrics.set_limits_info(&limits.revision, limits.generation);
        Self {
            inner: Arc::new(Inner {
                metrics,
                snapshot: RwLock::new(Arc::new(Snapshot {
                    limits,
                    routes: Vec::new(),
                    needs_model: false,
                    needs_body: false,
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
                resolver,
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

    /// Ready (`/readyz` 200): shutdown has not begun and the gateway is not waiting for the
    /// operator. A pod without limits is ready too: it serves, answering every call 503
    /// `no_backends` (no ConnectionPolicy selects it yet), so that a fresh install, before any
    /// policy, passes `helm install --wait` and Argo CD's health check. `/readyz?requireLimits=true`
    /// asks for [`Gateway::is_ready_with_limits`] instead.
    pub fn is_ready(&self) -> bool {
        !self.inner.leaving.load(Ordering::Acquire)
            && !self.is_draining()
            && !self.is_awaiting_operator()
    }

    /// Ready and running a limits document (from the limits file or a `PUT /v1/limits`).
    pub fn is_ready_with_limits(&self) -> bool {
        self.limits_loaded() && self.is_ready()
    }

    /// Whether a limits document was loaded, from the limits file or a `PUT /v1/limits` (the
    /// gauge `poolpilot_limits_loaded`).
    pub fn limits_loaded(&self) -> bool {
        self.inner.loaded.load(Ordering::Acquire)
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

    /// Sets the pools of DNS-named endpoints anew whenever an answer changes, for as long as the
    /// gateway lives.
    pub fn spawn_dns_refresh(&self) -> JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        let mut changes = self.inner.resolver.changes();
        tokio::spawn(async move {
            while changes.changed().await.is_ok() {
                let Some(inner) = weak.upgrade() else { return };
                let backends: Vec<Arc<Backend>> =
                    inner.registry.lock().backends.values().cloned().collect();
                for backend in backends.iter().filter(|b| b.has_hosts()) {
                    backend.refresh(&inner.resolver);
                }
            }
        })
    }

    /// Reads the backends' mounted Secrets again every `poll` (TLS files, provider keys), for
    /// as long as the gateway lives: a rotated one is used from the next connection or call on.
    pub fn spawn_secret_refresh(&self, poll: Duration) -> JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(poll);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let backends: Vec<Arc<Backend>> =
                    inner.registry.lock().backends.values().cloned().collect();
                for b in backends {
                    b.reload_tls(&inner.resolver, &inner.metrics);
                    b.reload_credentials();
                }
            }
        })
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
    /// The provider's key set on its calls, if it has `credentials`.
    pub(crate) fn credentials(&self) -> Option<Arc<ProviderKey>> {
        self.credentials.read().clone()
    }

    /// How long its provider still asked not to be called at `now` (`None`: it takes calls).
    /// Only a backend carrying the provider's key cools down: a refusal of a client's own key
    /// is about that client.
    pub(crate) fn cooling_for(&self, now: Instant) -> Option<std::time::Duration> {
        self.credentials.read().as_ref()?;
        self.cooldown.remaining(now)
    }

    /// Reads the provider key's file again (a rotated Secret).
    fn reload_credentials(&self) {
        let Some(key) = self.credentials() else {
            return;
        };
        match key.reload() {
            Ok(true) => {
                tracing::info!(backend = %self.name, "provider key changed; the next calls carry the new one")
            }
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(backend = %self.name, %error, "provider key file does not load; the key in force stays")
            }
        }
    }

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
            let task = crate::pool::health::spawn(self.pool.clone(), check.clone());
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
