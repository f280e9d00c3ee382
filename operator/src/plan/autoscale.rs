//! The autoscale law of DESIGN §5 for one backend: grow in ONE step to demand × (1 + margin)
//! while the backend's latency stays within 1.25× its baseline; shrink slowly (the highest
//! recommendation over the stabilization window, at most `maxStepPercent`, at most once per
//! window); ignore changes inside a 10% deadband; on missing data hold, flag the metrics
//! unavailable after three misses and resume only after two fresh samples.

use std::collections::VecDeque;
use std::time::Duration;

use poolpilot_api::ConnectionPolicySpec;
use poolpilot_api::policy::BackendSpec;

use super::{BackendSample, Timestamp, elapsed};

/// Backend latency above this multiple of its baseline blocks growth: a bigger pool makes a
/// saturated backend slower.
pub const LATENCY_GUARD: f64 = 1.25;
/// Relative changes smaller than this are ignored.
pub const DEADBAND: f64 = 0.10;
/// Missed samples in a row after which the metrics are reported unavailable.
pub const MISSES_BEFORE_UNAVAILABLE: u32 = 3;
/// Fresh samples in a row needed to act again after a miss.
pub const FRESH_TO_RESUME: u32 = 2;
/// A run this much earlier than the interval still counts as due (requeues jitter a little).
const DUE_SLACK: f64 = 0.9;

/// Where a backend's fleet-wide target per endpoint may go.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    /// `autoscale.min`, never above `upper`.
    pub min: u32,
    /// min(`autoscale.max`, capacity × (1 − headroom)).
    pub upper: u32,
    /// `autoscale.margin`.
    pub margin: f64,
    /// `autoscale.scaleDown.stabilizationWindow`.
    pub window: Duration,
    /// `autoscale.scaleDown.maxStepPercent`.
    pub max_step_percent: u32,
}

impl Bounds {
    /// The bounds of backend `b` under `spec`.
    pub fn of(spec: &ConnectionPolicySpec, b: &BackendSpec) -> Self {
        let a = &spec.autoscale;
        let budget = b.capacity.budget();
        let upper = a.max.map_or(budget, |m| m.min(budget)).max(1);
        Self {
            min: a.min.clamp(1, upper),
            upper,
            margin: a.margin,
            window: a.scale_down.stabilization_window.get(),
            max_step_percent: a.scale_down.max_step_percent.clamp(1, 100),
        }
    }

    /// `t` forced into [min, upper].
    pub fn clamp(&self, t: u32) -> u32 {
        t.clamp(self.min, self.upper)
    }
}

/// What the autoscaler remembers about one backend between decisions.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendMemory {
    /// The fleet-wide target per endpoint in force.
    pub target: u32,
    /// Recommendations (time, value) within the stabilization window, oldest first.
    pub recommendations: VecDeque<(Timestamp, u32)>,
    /// When the last decision was made.
    pub last_decision: Option<Timestamp>,
    /// When the target last changed (any direction).
    pub last_change: Option<Timestamp>,
    /// Missed samples in a row.
    pub misses: u32,
    /// Fresh samples in a row.
    pub fresh: u32,
    /// Whether the metrics count as available (false after three misses until two fresh samples).
    pub metrics_available: bool,
    /// True after a miss: act again only after [`FRESH_TO_RESUME`] fresh samples.
    pub recovering: bool,
    /// The last change, for status.
    pub last_scale: Option<Scale>,
    /// Why the backend counts as saturated after the last decision on fresh data, if it does.
    pub saturation: Option<String>,
}

/// One change of the target.
#[derive(Clone, Debug, PartialEq)]
pub struct Scale {
    /// When.
    pub at: Timestamp,
    /// Before.
    pub from: u32,
    /// After.
    pub to: u32,
    /// Why, with the numbers.
    pub reason: String,
}

/// What one decision did.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Grew the target in one step.
    ScaleUp(Scale),
    /// Shrank the target by one capped step.
    ScaleDown(Scale),
    /// The recommendation equals the target, or differs by less than the deadband.
    Steady { recommendation: u32 },
    /// Demand wants more, but the backend is slower than 1.25× its baseline.
    LatencyGuard {
        recommendation: u32,
        latency: f64,
        baseline: f64,
    },
    /// Demand wants more than the upper bound allows: the target sits at the bound.
    AtUpperBound { recommendation: u32 },
    /// Demand wants less, but the stabilization window holds the target.
    Stabilizing { recommendation: u32 },
    /// An input is missing: nothing changes.
    MissingData { missing: &'static str },
    /// Inputs are fresh again but not yet for long enough to act.
    Recovering { fresh: u32 },
}

impl Decision {
    /// Whether the target changed.
    pub fn scale(&self) -> Option<&Scale> {
        match self {
            Self::ScaleUp(s) | Self::ScaleDown(s) => Some(s),
            _ => None,
        }
    }

    /// Whether the backend is saturated: it wants more than it can safely get.
    pub fn saturated(&self) -> bool {
        matches!(self, Self::LatencyGuard { .. } | Self::AtUpperBound { .. })
    }
}

// === impl BackendMemory ===

impl BackendMemory {
    /// Fresh memory: the target a previous status recorded (clamped to today's bounds), or the
    /// upper bound, which is what a static configuration would run (no slow cold start).
    pub fn start(previous: Option<u32>, bounds: &Bounds, now: Timestamp) -> Self {
        let target = bounds.clamp(previous.unwrap_or(bounds.upper));
        Self {
            target,
            // The starting target counts as a recommendation: nothing shrinks for one window.
            recommendations: VecDeque::from([(now, target)]),
            last_decision: None,
            last_change: None,
            misses: 0,
            fresh: 0,
            metrics_available: true,
            recovering: false,
            last_scale: None,
            saturation: None,
        }
    }

    /// Whether a decision is due at `now` for this `interval`.
    pub fn due(&self, interval: Duration, now: Timestamp) -> bool {
        self.last_decision
            .is_none_or(|t| elapsed(t, now).as_secs_f64() >= interval.as_secs_f64() * DUE_SLACK)
    }
}

/// Which input of a sample is missing, if any.
pub fn missing_inputs(s: &BackendSample) -> Option<&'static str> {
    let ok = |v: Option<f64>| v.is_some_and(|v| v.is_finite() && v >= 0.0);
    if !ok(s.leased) {
        Some("leased")
    } else if !ok(s.pending) {
        Some("pending")
    } else if !ok(s.latency_p90) {
        Some("latency")
    } else if !s.latency_baseline.is_some_and(|v| v.is_finite() && v > 0.0) {
        Some("latency baseline")
    } else {
        None
    }
}

/// Makes one decision for a backend with `endpoints` endpoints from `sample`, updating `mem`.
pub fn decide(
    bounds: &Bounds,
    mem: &mut BackendMemory,
    sample: &BackendSample,
    endpoints: u32,
    now: Timestamp,
) -> Decision {
    mem.last_decision = Some(now);
    // Bounds are configuration, not data: a lowered max applies even while data is missing.
    let current = bounds.clamp(mem.target);
    if current != mem.target {
        let reason = format!("bounds changed to [{}, {}]", bounds.min, bounds.upper);
        let scale = change(mem, current, reason, now);
        return if scale.to > scale.from {
            Decision::ScaleUp(scale)
        } else {
            Decision::ScaleDown(scale)
        };
    }

    let Some(missing) = missing_inputs(sample) else {
        return decide_fresh(bounds, mem, sample, endpoints, now);
    };
    mem.misses += 1;
    mem.fresh = 0;
    mem.recovering = true;
    if mem.misses >= MISSES_BEFORE_UNAVAILABLE {
        mem.metrics_available = false;
    }
    Decision::MissingData { missing }
}

fn decide_fresh(
    bounds: &Bounds,
    mem: &mut BackendMemory,
    s: &BackendSample,
    endpoints: u32,
    now: Timestamp,
) -> Decision {
    let (leased, pending) = (s.leased.unwrap_or_default(), s.pending.unwrap_or_default());
    let (latency, baseline) = (
        s.latency_p90.unwrap_or_default(),
        s.latency_baseline.unwrap_or(1.0),
    );
    mem.misses = 0;
    mem.fresh = mem.fresh.saturating_add(1);

    let demand = leased + pending;
    let per_endpoint = demand * (1.0 + bounds.margin) / f64::from(endpoints.max(1));
    // The epsilon keeps float noise (450 × 1.2 = 540.0000000000001) from adding a connection.
    let wanted = (per_endpoint - 1e-9).ceil().clamp(0.0, f64::from(u32::MAX)) as u32;
    let recommendation = bounds.clamp(wanted);
    mem.recommendations.push_back((now, recommendation));
    while mem
        .recommendations
        .front()
        .is_some_and(|(t, _)| elapsed(*t, now) > bounds.window)
    {
        mem.recommendations.pop_front();
    }

    if mem.recovering {
        if mem.fresh < FRESH_TO_RESUME {
            return Decision::Recovering { fresh: mem.fresh };
        }
        mem.recovering = false;
        mem.metrics_available = true;
    }
    mem.saturation = None;

    let current = mem.target;
    let band = f64::from(current) * DEADBAND;
    if recommendation > current {
        if latency > LATENCY_GUARD * baseline {
            mem.saturation = Some(format!(
                "latency p90 {}s > {LATENCY_GUARD} × baseline {}s: growth to {recommendation} held",
                round(latency),
                round(baseline)
            ));
            return Decision::LatencyGuard {
                recommendation,
                latency,
                baseline,
            };
        }
        if wanted > bounds.upper {
            mem.saturation = Some(format!(
                "demand wants {wanted} per endpoint, upper bound is {}",
                bounds.upper
            ));
        }
        if f64::from(recommendation - current) < band {
            return if wanted > bounds.upper {
                Decision::AtUpperBound { recommendation }
            } else {
                Decision::Steady { recommendation }
            };
        }
        let reason = format!(
            "demand {} (leased {} + pending {}) × {} over {endpoints} endpoints",
            round(demand),
            round(leased),
            round(pending),
            round(1.0 + bounds.margin),
        );
        let reason = if wanted > bounds.upper {
            format!("{reason}, capped at the upper bound {}", bounds.upper)
        } else {
            reason
        };
        return Decision::ScaleUp(change(mem, recommendation, reason, now));
    }
    if wanted > bounds.upper && recommendation == current {
        mem.saturation = Some(format!(
            "demand wants {wanted} per endpoint, upper bound is {}",
            bounds.upper
        ));
        return Decision::AtUpperBound { recommendation };
    }
    if recommendation == current {
        return Decision::Steady { recommendation };
    }

    // Scale down: the highest recommendation over the window, only beyond the deadband, at most
    // one capped step per window.
    if f64::from(current - recommendation) < band {
        return Decision::Steady { recommendation };
    }
    let stabilized = mem
        .recommendations
        .iter()
        .map(|(_, r)| *r)
        .max()
        .unwrap_or(recommendation);
    if f64::from(current.saturating_sub(stabilized)) < band {
        return Decision::Stabilizing { recommendation };
    }
    if mem
        .last_change
        .is_some_and(|t| elapsed(t, now) < bounds.window)
    {
        return Decision::Stabilizing { recommendation };
    }
    let floor = (f64::from(current) * (1.0 - f64::from(bounds.max_step_percent) / 100.0) - 1e-9)
        .ceil() as u32;
    let to = bounds.clamp(stabilized.max(floor));
    if to >= current {
        return Decision::Stabilizing { recommendation };
    }
    let reason = format!(
        "demand {} (leased {} + pending {}) × {} recommends {recommendation}; highest over {} is {stabilized}, step capped at {}%",
        round(demand),
        round(leased),
        round(pending),
        round(1.0 + bounds.margin),
        poolpilot_api::Duration::from(bounds.window),
        bounds.max_step_percent,
    );
    Decision::ScaleDown(change(mem, to, reason, now))
}

/// Sets the target and records the change.
fn change(mem: &mut BackendMemory, to: u32, reason: String, now: Timestamp) -> Scale {
    let scale = Scale {
        at: now,
        from: mem.target,
        to,
        reason,
    };
    mem.target = to;
    mem.last_change = Some(now);
    mem.last_scale = Some(scale.clone());
    scale
}

/// Numbers in reasons: at most two decimals, no trailing zeros.
fn round(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests;
