//! Endpoint health, in one place: active probes (every `interval`, one `GET <path>` per endpoint
//! on a fresh connection that takes a slot of the endpoint's cap: a probe never waits behind
//! traffic, and never takes an endpoint over its cap; when every slot is taken the endpoint is
//! skipped that round, its pooled calls report to outlier detection; a 2xx within `timeout`
//! passes), their thresholds (`unhealthyThreshold`, `healthyThreshold`), passive ejection on
//! consecutive failures of proxied calls (at most `maxEjectedPercent` of the endpoints, for
//! `baseEjection` × the ejections so far, up to 10×), and which endpoints may take leases now.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use poolpilot_api::limits::{HealthCheck, OutlierDetection};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use super::Pool;
use super::connect::Connect;
use super::rate;
use super::state::{EndpointState, Health, Inner, State};
use crate::observe::CloseReason;

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

// === impl Pool ===

impl<C: Connect> Pool<C> {
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
}

// === impl State ===

impl<T> State<T> {
    /// Whether new leases may go to `ep`: listed, probes pass, not ejected (or back from
    /// ejection: its time is over and, with active checks, probes have passed since).
    pub(super) fn eligible(&self, ep: &EndpointState<T>, now: Instant) -> bool {
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

    /// Retry-After when no endpoint is eligible: until the first ejection ends, or the time
    /// probes need to pass `healthyThreshold` times.
    pub(super) fn recovery_hint(&self, now: Instant) -> Duration {
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

impl Health {
    /// Whether passive outlier detection has it ejected now.
    pub(super) fn is_ejected(&self, now: Instant) -> bool {
        self.ejected_until.is_some_and(|until| now < until)
    }
}

// === active probes ===

/// Spawns the probe loop of one backend; abort the handle to stop it.
pub(crate) fn spawn<C: Connect>(pool: Pool<C>, check: HealthCheck) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(check.interval.get());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let mut probes = JoinSet::new();
            for (name, address) in pool.probe_targets() {
                let Some(slot) = pool.probe_slot(&name) else {
                    tracing::trace!(backend = %pool.backend(), endpoint = %name, "probe skipped: every slot taken");
                    continue;
                };
                let path = check.path.clone();
                let timeout = check.timeout.get();
                let connector = pool.clone();
                probes.spawn(async move {
                    let connector = &connector.inner.connector;
                    let passed = connector.probe(address, &path, timeout).await;
                    // The probe's connection is closed: its slot frees.
                    drop(slot);
                    (name, passed)
                });
            }
            while let Some(result) = probes.join_next().await {
                if let Ok((name, passed)) = result {
                    tracing::trace!(backend = %pool.backend(), endpoint = %name, passed, "probe");
                    pool.report_probe(&name, passed);
                }
            }
        }
    })
}
