//! Applying a limits document ([`Gateway::apply`], from `PUT /v1/limits` or the limits file):
//! validated, refused when older than the one in force or when the same generation brings other
//! content, then applied in place: client limiters updated by policy name, pools resized and
//! their endpoints, health rules and priority set (caps, then burst allowances, lowered by the
//! pod-wide `maxUpstreamConnections`: [`crate::limits::share`]), removed backends retired, and the new
//! snapshot swapped in.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::{Mutex, RwLock};
use poolpilot_api::GatewayLimits;
use poolpilot_api::limits::InvalidLimits;

use super::endpoints::{expand, hosts};
use super::{Backend, Gateway, Route, Snapshot, upstream_tls};
use crate::limits::limiter::ClientLimiter;
use crate::limits::share::{per_endpoint_bursts, per_endpoint_caps};
use crate::pool::Pool;
use crate::proxy::credentials::{CredentialsError, ProviderKey};

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
    /// An endpoint's TLS files do not load (422).
    #[error(transparent)]
    Tls(#[from] super::EndpointTlsError),
    /// A backend's provider key does not load (422).
    #[error("backends[{backend}].credentials: {source}")]
    Credentials {
        /// The backend.
        backend: String,
        /// Why.
        #[source]
        source: CredentialsError,
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

// === impl Gateway ===

impl Gateway {
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

        // TLS clients first: a file that does not load refuses the document before anything
        // changed.
        let mut tls = HashMap::new();
        for b in &doc.backends {
            let current = registry.backends.get(&b.name).map(|b| b.tls.lock().clone());
            let clients = upstream_tls::clients(
                &b.name,
                &b.endpoints,
                b.protocol,
                current.as_ref(),
                &self.inner.metrics,
            )?;
            tls.insert(b.name.clone(), clients);
        }
        // Provider keys likewise: the one in force is kept (and re-read) while its settings
        // stay.
        let mut keys = HashMap::new();
        for b in &doc.backends {
            let Some(c) = &b.credentials else { continue };
            let current = registry
                .backends
                .get(&b.name)
                .and_then(|b| b.credentials())
                .filter(|k| k.is_for(c));
            let key =
                match current {
                    Some(key) => key,
                    None => Arc::new(ProviderKey::load(c).map_err(|source| {
                        ApplyError::Credentials {
                            backend: b.name.clone(),
                            source,
                        }
                    })?),
                };
            keys.insert(b.name.clone(), key);
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

        // DNS-named endpoints: resolved in the background from now on (a name no longer named
        // is forgotten); until a name's first answer it has no pool endpoint.
        self.inner
            .resolver
            .want(doc.backends.iter().flat_map(|b| hosts(&b.endpoints)));
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
        let caps = per_endpoint_caps(doc.listener.max_upstream_connections, &pools);
        // Bursts get what the shares leave of the pod-wide cap, so that every pool may burst
        // at once and the pod still holds no more than the cap.
        let asked: Vec<(u32, u32, u32)> = doc
            .backends
            .iter()
            .zip(&caps)
            .map(|(b, &cap)| (cap, b.endpoints.len() as u32, b.pool.burst_per_endpoint))
            .collect();
        let bursts = per_endpoint_bursts(doc.listener.max_upstream_connections, &asked);
        let mut backends = HashMap::new();
        let mut routes = Vec::with_capacity(doc.backends.len());
        for ((b, cap), burst) in doc.backends.iter().zip(caps).zip(bursts) {
            let mut pool_limits = b.pool.clone();
            pool_limits.max_connections_per_endpoint = cap;
            pool_limits.burst_per_endpoint = burst;
            let clients = tls.remove(&b.name).unwrap_or_default();
            let key = keys.remove(&b.name);
            let backend = match registry.backends.remove(&b.name) {
                Some(existing) => {
                    *existing.tls.lock() = clients;
                    existing.connector.set_protocol(b.protocol);
                    *existing.credentials.write() = key;
                    existing.configure(&b.endpoints, pool_limits, &self.inner.resolver);
                    existing
                }
                None => {
                    let (endpoints, limits) = expand(&b.endpoints, &pool_limits, |host| {
                        self.inner.resolver.addresses(host)
                    });
                    let connector = self.inner.connector.for_backend();
                    connector.set_protocol(b.protocol);
                    let backend = Backend {
                        name: b.name.as_str().into(),
                        signals: self.inner.metrics.call_signals(&b.name),
                        // The connector knows its TLS addresses before the pool opens any.
                        pool: Pool::new(
                            &b.name,
                            limits,
                            &[],
                            connector.clone(),
                            self.inner.metrics.clone(),
                        ),
                        connector,
                        tls: Mutex::new(clients),
                        credentials: RwLock::new(key),
                        cooldown: Default::default(),
                        health: Mutex::new(None),
                        document: Mutex::new((b.endpoints.clone(), pool_limits.clone())),
                    };
                    backend.set_tls(&b.endpoints, &pool_limits, &self.inner.resolver);
                    backend.pool.set_endpoints(&endpoints);
                    Arc::new(backend)
                }
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
            self.inner.metrics.backend_event_series(
                &b.name,
                b.credentials.is_some(),
                b.endpoints.iter().any(|e| e.tls.is_some()),
                &b.fallback,
            );
            routes.push(Route {
                matcher: b.route.clone(),
                backend: backend.clone(),
                timeouts: b.timeouts.clone(),
                limiter: b
                    .client_policy
                    .as_ref()
                    .and_then(|p| limiters.get(p).cloned()),
                // The document names other backends of it (validated): its routes, in order.
                fallback: b
                    .fallback
                    .iter()
                    .filter_map(|f| doc.backends.iter().position(|o| o.name == *f))
                    .collect(),
                default_max_tokens: b.default_max_tokens,
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
        // A call's token estimate reads its body (`max_tokens`, the prompt): for a token budget,
        // and for the pool queue's fairness between the clients a client policy tells apart
        // (`crate::limits::fair`), whose charges would otherwise be `defaultMaxTokens` each.
        let needs_body = needs_model
            || doc.backends.iter().any(|b| b.client_policy.is_some())
            || doc
                .client_policies
                .iter()
                .any(|p| p.tokens.is_some() || p.overrides.iter().any(|o| o.tokens.is_some()));
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
            needs_body,
        });
        self.inner.loaded.store(true, Ordering::Release);
        self.inner.metrics.set_limits_loaded(true);
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
}
