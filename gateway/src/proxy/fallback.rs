//! The cooldown phase of a call: a backend whose provider asked not to be called yet
//! (`crate::limits::cooldown`) hands the call to the first of its fallbacks (`fallback` in the
//! limits document, in order) that is not cooling down; the call is then entirely that
//! backend's (its credentials, pool, timeouts and client policy). When every one is cooling
//! down, or there are none, the call is answered `429` `backend_cooling_down` with the
//! shortest wait left among them, before any admission: nothing is sent into a refusal the
//! gateway already knows of.

use tokio::time::Instant;

use super::error::ProxyError;
use crate::live::{Route, Snapshot};
use crate::observe::Metrics;

/// The route a call on `route` takes at `now`: its own, one of its fallbacks, or a refusal.
pub(super) fn past_cooldown<'a>(
    snapshot: &'a Snapshot,
    route: &'a Route,
    metrics: &Metrics,
    now: Instant,
) -> Result<&'a Route, ProxyError> {
    let Some(mut shortest) = route.backend.cooling_for(now) else {
        return Ok(route);
    };
    for &i in &route.fallback {
        let Some(other) = snapshot.routes.get(i) else {
            continue;
        };
        match other.backend.cooling_for(now) {
            None => {
                metrics.upstream_fallback(&route.backend.name, &other.backend.name);
                return Ok(other);
            }
            Some(wait) => shortest = shortest.min(wait),
        }
    }
    metrics.upstream_cooldown_refused(&route.backend.name);
    Err(ProxyError::CoolingDown {
        backend: route.backend.name.to_string(),
        retry_after: shortest,
    })
}
