//! What the live state reports: `/v1/stats` (per backend and endpoint counts, the top clients,
//! `Retry-After` compliance), `/v1/clients` (per client policy its busiest clients by recent
//! demand, for the operator's division of client limits, or by tokens) and the metrics page,
//! with the gauges computed from live state set just before each scrape (so that they cannot
//! drift), the top clients by tokens among them.

use std::collections::HashMap;
use std::sync::Arc;

use super::Gateway;
use crate::limits::limiter::{ClientLimiter, ClientStats, OTHER, Ranking};

/// The most clients `/v1/clients` lists per client policy.
pub(crate) const BUSIEST_CLIENTS: usize = 32;

/// The clients of each client policy `poolpilot_client_top_tokens_per_second` names; the rest
/// are summed as `other`.
pub(crate) const TOP_TOKEN_CLIENTS: usize = 10;
use crate::observe::metrics::EndpointGauges;
use crate::pool::PoolStats;

impl Gateway {
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
        let (upstream, sockets) = snapshot
            .routes
            .iter()
            .flat_map(|r| r.backend.pool.stats().endpoints)
            .fold((0u32, 0u32), |(slots, sockets), e| {
                (
                    slots + e.leased + e.idle + e.connecting + e.closing,
                    sockets + e.sockets,
                )
            });
        serde_json::json!({
            "revision": snapshot.limits.revision,
            "generation": snapshot.limits.generation,
            "upstreamConnections": upstream,
            "upstreamSockets": sockets,
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

    /// Per client policy (by name), its busiest clients by demand (in flight + queued,
    /// time-weighted over the last 10 s) or by tokens (input and output tokens a second over
    /// the same 10 s), as `by` says, at most 32 each:
    /// `{"policies":[{"name":…,"clients":[{"keySha256","inFlight","queued","demand",
    /// "inputTokensPerSecond","outputTokensPerSecond"}]}]}`.
    pub fn clients(&self, by: Ranking) -> serde_json::Value {
        let mut limiters: Vec<(String, ClientLimiter)> = self
            .inner
            .registry
            .lock()
            .limiters
            .iter()
            .map(|(name, l)| (name.clone(), l.clone()))
            .collect();
        limiters.sort_by(|a, b| a.0.cmp(&b.0));
        let policies: Vec<serde_json::Value> = limiters
            .into_iter()
            .map(|(name, limiter)| {
                serde_json::json!({
                    "name": name,
                    "clients": limiter.busiest(BUSIEST_CLIENTS, by),
                })
            })
            .collect();
        serde_json::json!({ "policies": policies })
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
            m.set_pool_burst(&r.backend.name, stats.burst.allowance, stats.burst.bursting);
            m.set_pool_classes(
                &r.backend.name,
                stats.classes.clone().map(|c| (c.pending, c.held)),
            );
            m.set_reuse_ratio(
                &r.backend.name,
                stats.endpoints.iter().map(|e| e.created).sum(),
                stats.endpoints.iter().map(|e| e.reused).sum(),
            );
            let expiry = r
                .backend
                .tls
                .lock()
                .values()
                .filter_map(|c| c.client_cert_expiry())
                .min();
            if let Some(not_after) = expiry {
                m.set_client_cert_expiry(&r.backend.name, not_after);
            }
            for ep in &stats.endpoints {
                m.set_endpoint_gauges(
                    &r.backend.name,
                    EndpointGauges {
                        endpoint: &ep.name,
                        max: ep.max,
                        healthy: ep.healthy,
                        leased: ep.leased,
                        idle: ep.idle,
                        closing: ep.closing,
                        sockets: ep.sockets,
                        max_streams: ep.max_streams_per_connection,
                        h2_fallback: ep.http2_fallback.is_some(),
                    },
                );
            }
        }
        let registry = self.inner.registry.lock();
        let mut by_label: HashMap<Arc<str>, u32> = HashMap::new();
        let mut tracked = 0;
        for (policy, limiter) in &registry.limiters {
            let (top, rest) = limiter.top_by_tokens(TOP_TOKEN_CLIENTS);
            for c in &top {
                m.set_client_top_tokens(policy, &c.client, c.input, c.output);
            }
            m.set_client_top_tokens(policy, OTHER, rest.input, rest.output);
        }
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
}
