//! The autoscale law for one backend: grow in ONE step to demand × (1 + margin) unless the
//! backend is past its knee (the guard in [`knee`]: a bigger pool makes a saturated backend
//! slower, but a model server that merely slows down as it batches more calls is not
//! saturated), and step back to the best level when growth made throughput worse; shrink slowly (the highest recommendation over the stabilization window, at most
//! `maxStepPercent`, at most once per window); ignore changes inside a 10% deadband; on missing
//! data hold, flag the metrics unavailable after three misses and resume only after two fresh
//! samples. Every decision, whatever it does, is recorded with its reason and numbers.

pub mod knee;
mod words;

use std::collections::VecDeque;
use std::time::Duration;

use poolpilot_api::ConnectionPolicySpec;
use poolpilot_api::policy::{BackendSpec, DecisionAction};

use self::knee::{Hold, Knee, KneeMemory, Move, Observation};
use self::words::round;
use super::input::{BackendSample, SaturationSignal};
use super::time::{Timestamp, elapsed, later};

/// Relative changes smaller than this are ignored.
pub const DEADBAND: f64 = 0.10;
/// Missed samples in a row after which the metrics are reported unavailable.
pub const MISSES_BEFORE_UNAVAILABLE: u32 = 3;
/// Fresh samples in a row needed to act again after a miss.
pub const FRESH_TO_RESUME: u32 = 2;
/// Decisions in a row that held growth after which the hold is told in an Event.
pub const HELD_EVENT_AFTER: u32 = 3;
/// A window whose average in-flight differs from its latest by more than this share saw the
/// load change: the knee guard does not judge its throughput.
pub const UNSTEADY: f64 = 0.25;
/// The calls in flight are evidence of a byte rate only when they spend at least this share of
/// their time past their first byte: streamed answers (whose first byte comes after the prefill
/// and any wait in the backend's queue) do; a whole answer's first byte is its end, and the
/// ratio of two noisy readings of the same time is not exactly 1.
pub const STREAMING: f64 = 0.3;
/// A run this much earlier than the interval still counts as due (requeues jitter a little).
const DUE_SLACK: f64 = 0.9;

/// Where a backend's fleet-wide target per endpoint may go, and what its guard judges by.
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
    /// `capacity.maxConnectionsPerEndpoint`: the declared capacity of one endpoint.
    pub capacity: u32,
    /// `autoscale.interval`.
    pub interval: Duration,
    /// `saturation.threshold`, when the backend has a saturation query.
    pub saturation_threshold: Option<f64>,
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
            capacity: b.capacity.max_connections_per_endpoint,
            interval: a.interval.get(),
            saturation_threshold: b.saturation.as_ref().map(|s| s.threshold),
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
    /// The last decision, with its reason.
    pub last_decision: Option<Explained>,
    /// When the target last changed (any direction).
    pub last_change: Option<Timestamp>,
    /// When the load last moved its in-flight on its own (a crowd began or left), and the
    /// window's in-flight per endpoint at the last fresh decision it is judged against.
    pub load_change: Option<Timestamp>,
    pub last_in_flight: Option<f64>,
    /// Missed samples in a row.
    pub misses: u32,
    /// Fresh samples in a row.
    pub fresh: u32,
    /// Whether the metrics count as available (false after three misses until two fresh samples).
    pub metrics_available: bool,
    /// Before this time misses do not make the metrics unavailable: a backend the planner has
    /// only just seen has no samples until its pods run it, are scraped and queried
    /// ([`BackendMemory::first_samples_by`]). `None`: from the first miss.
    pub first_samples_due: Option<Timestamp>,
    /// True after a miss: act again only after [`FRESH_TO_RESUME`] fresh samples.
    pub recovering: bool,
    /// The input missing at the last decision, if one was.
    pub missing: Option<&'static str>,
    /// The last change, for status.
    pub last_scale: Option<Scale>,
    /// Why the backend counts as saturated after the last decision on fresh data, if it does.
    pub saturation: Option<String>,
    /// Decisions in a row that held growth (0: the last one did not).
    pub held: u32,
    /// What the knee guard remembers.
    pub knee: KneeMemory,
}

/// One decision, explained.
#[derive(Clone, Debug, PartialEq)]
pub struct Explained {
    /// When.
    pub at: Timestamp,
    /// What it did.
    pub action: DecisionAction,
    /// Why, with the numbers.
    pub reason: String,
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
// One per backend and interval, moved, never kept in bulk: boxing the hold buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Grew the target in one step.
    ScaleUp(Scale),
    /// Shrank the target by one capped step.
    ScaleDown(Scale),
    /// The recommendation equals the target.
    Steady { recommendation: u32 },
    /// The recommendation differs from the target by less than the deadband.
    WithinDeadband { recommendation: u32 },
    /// Demand wants more, but the backend is past its knee (or says it is saturated, or the
    /// last step is being judged).
    Held { recommendation: u32, hold: Hold },
    /// Returned toward the level that gave the most throughput (or probed below it): growth
    /// made things worse, and the calls beyond wait in the gateways' queues.
    StepBack(Scale),
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
            Self::ScaleUp(s) | Self::ScaleDown(s) | Self::StepBack(s) => Some(s),
            _ => None,
        }
    }

    /// Whether the backend is saturated: it wants more than it can safely get.
    pub fn saturated(&self) -> bool {
        match self {
            Self::Held { hold, .. } => {
                !matches!(hold, Hold::SaturationPending | Hold::Judging { .. })
            }
            Self::StepBack(_) => true,
            Self::AtUpperBound { .. } => true,
            _ => false,
        }
    }

    /// Whether growth was wanted and held (the guard or the upper bound).
    pub fn holds_growth(&self) -> bool {
        matches!(self, Self::Held { .. } | Self::AtUpperBound { .. })
    }

    /// What it did, as status reports it.
    pub fn action(&self) -> DecisionAction {
        match self {
            Self::ScaleUp(_) => DecisionAction::ScaleUp,
            Self::ScaleDown(_) | Self::StepBack(_) => DecisionAction::ScaleDown,
            Self::Steady { .. } | Self::WithinDeadband { .. } => DecisionAction::NoChange,
            Self::Held { .. }
            | Self::AtUpperBound { .. }
            | Self::Stabilizing { .. }
            | Self::MissingData { .. }
            | Self::Recovering { .. } => DecisionAction::Hold,
        }
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
            load_change: None,
            last_in_flight: None,
            misses: 0,
            fresh: 0,
            metrics_available: true,
            first_samples_due: None,
            recovering: false,
            missing: None,
            last_scale: None,
            saturation: None,
            held: 0,
            knee: KneeMemory::default(),
        }
    }

    /// The same, for a backend seen at `now` whose first samples take up to `horizon` to reach
    /// the planner (its pods must run it, be scraped, and the scrape be queried): its misses
    /// until then hold its target without calling its metrics unavailable, so that thousands of
    /// new backends do not each warn `MetricsMissing` before their data could exist.
    #[must_use]
    pub fn first_samples_by(mut self, now: Timestamp, horizon: Duration) -> Self {
        self.first_samples_due = (!horizon.is_zero()).then(|| later(now, horizon));
        self
    }

    /// Whether a decision is due at `now` for this `interval`.
    pub fn due(&self, interval: Duration, now: Timestamp) -> bool {
        self.last_decision
            .as_ref()
            .is_none_or(|d| elapsed(d.at, now).as_secs_f64() >= interval.as_secs_f64() * DUE_SLACK)
    }
}

/// A usable gauge or rate: finite and not negative.
fn usable(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite() && *v >= 0.0)
}

/// The demand inputs every decision needs, or the first one missing. A backend without
/// endpoints has no pool and so no leased connections (the gateways export none): zero, not
/// missing.
fn demand_inputs(s: &BackendSample, endpoints: u32) -> Result<(f64, f64), &'static str> {
    let leased = match usable(s.leased) {
        Some(l) => l,
        None if endpoints == 0 && s.leased.is_none() => 0.0,
        None => return Err("leased"),
    };
    let pending = usable(s.pending).ok_or("pending")?;
    Ok((leased, pending))
}

/// The first input the guard needs to judge growth that is missing, if one is.
fn guard_input_missing(s: &BackendSample, bounds: &Bounds) -> Option<&'static str> {
    if usable(s.completed).is_none() {
        Some("completed calls")
    } else if usable(s.bytes).is_none() {
        Some("response bytes")
    } else if bounds.saturation_threshold.is_some() && s.saturation == SaturationSignal::Missing {
        Some("saturation query")
    } else {
        None
    }
}

/// This interval as the knee guard keeps it, when the sample has its throughput and the load
/// held steady over its window (a window across a change of load mixes two loads, and its
/// averages and rates do not match each other). The calls it counts are those of the interval
/// (`interval` long, or the window when that is shorter): windows of successive samples
/// overlap, and no call counts twice.
fn observation(
    s: &BackendSample,
    leased: f64,
    endpoints: u32,
    interval: Duration,
    (now, last_change): (Timestamp, Option<Timestamp>),
) -> Option<Observation> {
    let e = f64::from(endpoints);
    let completed = usable(s.completed)?;
    let bytes = usable(s.bytes)?;
    if !settled(s, leased, completed, (now, last_change)) {
        return None;
    }
    if let Some(latest) = usable(s.leased_now)
        && (latest - leased).abs() > UNSTEADY * latest.max(leased)
    {
        return None;
    }
    (endpoints > 0).then(|| Observation {
        at: now,
        in_flight: leased / e,
        completed: completed / e,
        bytes: bytes / e,
        ttfb: usable(s.ttfb).filter(|t| *t > 0.0),
        calls: completed * s.window.min(interval).as_secs_f64(),
        streams: streaming(leased, completed, s.ttfb, usable(s.busy)),
        duration: usable(s.busy)
            .filter(|_| completed > 0.0)
            .map(|busy| busy / completed),
    })
}

/// Whether a window's in-flight per endpoint moved from `before` (the last decision's) to `now`
/// by more than [`UNSTEADY`] of the larger and at least one call: a load that began, grew or
/// left. The calls then in flight began together, and those that complete first are the short
/// ones: until they have turned over, completions read the level as faster than it is.
fn load_moved(before: f64, now: f64) -> bool {
    let moved = (now - before).abs();
    moved >= 1.0 && moved > UNSTEADY * now.max(before)
}

/// The calls in flight that streamed bytes over the window. A call spends its mean duration at
/// the backend (the calls timed within the window, `busy / completed`; by Little's law
/// `leased / completed` when they were not timed), and the first byte of its response's body
/// comes `ttfb` into it; the share of the calls in flight past their first byte is
/// `1 − ttfb / duration`, counted only from [`STREAMING`] on. A whole answer's first byte comes
/// with its end (`ttfb` ≈ the duration): such calls stream nothing while in flight, and only
/// their completions are evidence (on the cluster, whole answers of 8–20 s right after a step
/// read as about as many streams as completions, and a level of 8 completions as measured to
/// ±24%, which decided a probe). With nothing completed the calls outlast the window, and every
/// call past its first byte streams; with no first byte measured, none counts.
fn streaming(leased: f64, completed: f64, ttfb: Option<f64>, busy: Option<f64>) -> f64 {
    let Some(ttfb) = usable(ttfb).filter(|t| *t > 0.0) else {
        return 0.0;
    };
    let timed = busy
        .filter(|b| *b > 0.0 && completed > 0.0)
        .map(|b| b / completed);
    let past_first_byte = timed
        .or_else(|| mean_call_duration(leased, completed))
        .filter(|d| *d > 0.0)
        .map_or(1.0, |d| (1.0 - ttfb / d).clamp(0.0, 1.0));
    if past_first_byte < STREAMING {
        return 0.0;
    }
    leased * past_first_byte
}

/// The mean time a call spends at the backend, by Little's law over the window: calls in flight
/// over calls completed per second (`None`: nothing completed, the calls last longer than the
/// window).
pub fn mean_call_duration(leased: f64, completed: f64) -> Option<f64> {
    (completed > 0.0 && leased.is_finite()).then(|| leased / completed)
}

/// Whether the window of `s` shows the current target alone: it began at least one mean call
/// duration after the target or the load last changed. Before that, calls started at the
/// earlier level are still in flight (and complete, or not, at its pace): their window mixes
/// two levels, and a step judged on it is judged on what the old level left behind; and the
/// calls a new load started together complete shortest first.
fn settled(
    s: &BackendSample,
    leased: f64,
    completed: f64,
    (now, last_change): (Timestamp, Option<Timestamp>),
) -> bool {
    let Some(changed) = last_change else {
        return true;
    };
    let Some(by_count) = mean_call_duration(leased, completed) else {
        return false;
    };
    // The calls timed within the window, when they took longer (calls started before a step
    // up still complete at the old level's pace, and the count alone reads them as fast).
    let duration = usable(s.busy).map_or(by_count, |busy| by_count.max(busy / completed));
    elapsed(changed, now).as_secs_f64() + 1e-9 >= s.window.as_secs_f64() + duration
}

/// Makes one decision for a backend with `endpoints` endpoints from `sample`, updating `mem`
/// (its last decision records what was decided and why).
pub fn decide(
    bounds: &Bounds,
    mem: &mut BackendMemory,
    sample: &BackendSample,
    endpoints: u32,
    now: Timestamp,
) -> Decision {
    let (decision, reason) = decide_why(bounds, mem, sample, endpoints, now);
    mem.held = if decision.holds_growth() {
        mem.held.saturating_add(1)
    } else {
        0
    };
    mem.last_decision = Some(Explained {
        at: now,
        action: decision.action(),
        reason,
    });
    decision
}

/// The decision and its reason.
fn decide_why(
    bounds: &Bounds,
    mem: &mut BackendMemory,
    sample: &BackendSample,
    endpoints: u32,
    now: Timestamp,
) -> (Decision, String) {
    // Bounds are configuration, not data: a lowered max applies even while data is missing.
    let current = bounds.clamp(mem.target);
    if current != mem.target {
        let reason = format!("bounds changed to [{}, {}]", bounds.min, bounds.upper);
        let scale = change(mem, current, reason, now);
        let why = format!("{} → {}: {}", scale.from, scale.to, scale.reason);
        return if scale.to > scale.from {
            (Decision::ScaleUp(scale), why)
        } else {
            (Decision::ScaleDown(scale), why)
        };
    }
    match demand_inputs(sample, endpoints) {
        Ok((leased, pending)) => {
            decide_fresh(bounds, mem, sample, (leased, pending), endpoints, now)
        }
        Err(missing) => missed(mem, missing, sample.unscraped, now),
    }
}

/// A miss: nothing changes; unavailable after three in a row; two fresh samples to resume.
/// `unscraped` ready gateway pods had no fresh samples (the reason says so: they made it missing).
fn missed(
    mem: &mut BackendMemory,
    missing: &'static str,
    unscraped: u32,
    now: Timestamp,
) -> (Decision, String) {
    mem.misses += 1;
    mem.fresh = 0;
    mem.recovering = true;
    mem.missing = Some(missing);
    let expected = mem.first_samples_due.is_none_or(|due| now >= due);
    if mem.misses >= MISSES_BEFORE_UNAVAILABLE && expected {
        mem.metrics_available = false;
    }
    let pods = match unscraped {
        0 => String::new(),
        1 => ", a ready gateway pod has no fresh samples".to_owned(),
        n => format!(", {n} ready gateway pods have no fresh samples"),
    };
    let why = format!(
        "held at {}: missing data: no usable {missing} sample{pods} ({} in a row)",
        mem.target, mem.misses
    );
    (Decision::MissingData { missing }, why)
}

fn decide_fresh(
    bounds: &Bounds,
    mem: &mut BackendMemory,
    s: &BackendSample,
    (leased, pending): (f64, f64),
    endpoints: u32,
    now: Timestamp,
) -> (Decision, String) {
    // Demand: the window's average, or the latest scrape when it is higher (a crowd that began
    // within the window is judged whole, in one step).
    let (demand_leased, demand_pending) = match (usable(s.leased_now), usable(s.pending_now)) {
        (Some(l), Some(p)) if l + p > leased + pending => (l, p),
        _ => (leased, pending),
    };
    let demand = demand_leased + demand_pending;
    let per_endpoint = demand * (1.0 + bounds.margin) / f64::from(endpoints.max(1));
    // The epsilon keeps float noise (450 × 1.2 = 540.0000000000001) from adding a connection.
    let wanted = (per_endpoint - 1e-9).ceil().clamp(0.0, f64::from(u32::MAX)) as u32;
    let recommendation = bounds.clamp(wanted);
    let current = mem.target;
    let band = f64::from(current) * DEADBAND;
    let grows = recommendation > current && f64::from(recommendation - current) >= band;
    // The guard's inputs count only when growth is wanted: a backend without traffic has no
    // throughput to judge and needs none.
    if grows && let Some(missing) = guard_input_missing(s, bounds) {
        return missed(mem, missing, s.unscraped, now);
    }
    mem.misses = 0;
    mem.missing = None;
    mem.fresh = mem.fresh.saturating_add(1);
    mem.recommendations.push_back((now, recommendation));
    while mem
        .recommendations
        .front()
        .is_some_and(|(t, _)| elapsed(*t, now) > bounds.window)
    {
        mem.recommendations.pop_front();
    }
    // A move of the in-flight right after the target changed is the target's doing (the
    // pool filling up to it, or draining down to it): `last_change` covers it.
    let per_endpoint_now = leased / f64::from(endpoints.max(1));
    let target_moved_it = mem
        .last_decision
        .as_ref()
        .zip(mem.last_change)
        .is_some_and(|(d, changed)| changed >= d.at);
    if !target_moved_it
        && mem
            .last_in_flight
            .is_some_and(|before| load_moved(before, per_endpoint_now))
    {
        mem.load_change = Some(now);
    }
    mem.last_in_flight = Some(per_endpoint_now);
    let obs = observation(
        s,
        leased,
        endpoints,
        bounds.interval,
        (now, mem.last_change.max(mem.load_change)),
    );
    mem.knee.capacity = bounds.capacity;
    mem.knee.max_step_percent = bounds.max_step_percent;
    mem.knee.forget_old_ceiling(now);
    let in_flight_now = usable(s.leased_now).unwrap_or(leased) / f64::from(endpoints.max(1));
    if let (SaturationSignal::Value(value), Some(threshold)) =
        (s.saturation, bounds.saturation_threshold)
        && endpoints > 0
    {
        mem.knee.read_queue(
            value >= threshold,
            value,
            in_flight_now,
            obs.map(|o| o.in_flight),
            now,
        );
    }
    if let Some(o) = obs {
        mem.knee.observe(o);
    }
    let level = obs.and_then(|o| knee::level_of(o.in_flight));

    let demand_text = format!(
        "demand {} (leased {} + pending {}) × {} over {endpoints} endpoints",
        round(demand),
        round(demand_leased),
        round(demand_pending),
        round(1.0 + bounds.margin),
    );
    if mem.recovering {
        if mem.fresh < FRESH_TO_RESUME {
            let why = format!(
                "held at {current}: {} of {FRESH_TO_RESUME} fresh samples after missing data ({demand_text})",
                mem.fresh
            );
            return (Decision::Recovering { fresh: mem.fresh }, why);
        }
        mem.recovering = false;
        mem.metrics_available = true;
    }
    mem.saturation = None;

    let query_hold = match s.saturation {
        SaturationSignal::Value(value)
            if bounds.saturation_threshold.is_some_and(|t| value >= t) =>
        {
            Some(Hold::BackendSaturated {
                value,
                threshold: bounds.saturation_threshold.unwrap_or_default(),
            })
        }
        SaturationSignal::NotConfigured | SaturationSignal::Pending
            if bounds.saturation_threshold.is_some() =>
        {
            Some(Hold::SaturationPending)
        }
        _ => None,
    };
    // The guard's move: it acts only where demand wants more than the best level it knows, or
    // while a step is judged.
    // The backend's own queue at the current in-flight: step back to what it serves at once
    // (evidence, not a guess: the calls beyond wait in the gateways' queues instead, where
    // lease timeouts and Retry-After reach the clients).
    if let (Some(Hold::BackendSaturated { value, threshold }), Some(c)) =
        (&query_hold, mem.knee.ceiling)
    {
        let to = bounds.clamp(c.level);
        if to < current && f64::from(current - to) >= band {
            let reason = format!(
                "{demand_text}; stepped back: the backend reports saturation: its saturation query is {} ≥ threshold {}: {}; calls beyond {to} per endpoint wait in the gateways' queues",
                round(*value),
                round(*threshold),
                c.describe()
            );
            mem.saturation = Some(format!("the backend reports saturation: {}", c.describe()));
            mem.knee.judging = None;
            let scale = change(mem, to, reason, now);
            let why = format!("{} → {}: {}", scale.from, scale.to, scale.reason);
            return (Decision::StepBack(scale), why);
        }
    }
    let mv = mem
        .knee
        .plan(current, recommendation, (bounds.min, bounds.upper), level);
    match &mv {
        // A level above what the backend serves at once is no evidence (its calls wait in the
        // backend's queue): a target held there within the deadband, while the queue's level is
        // still to be measured, would never be.
        Move::Back { to, knee }
            if *to < current
                && (f64::from(current - to) >= band
                    || knee.unmeasured_ceiling().is_some_and(|c| current > c)) =>
        {
            // Only the backend's queue stops growth: the target goes to what it serves at once,
            // not to a best level.
            let whither = if knee.queue_alone() {
                "what the backend serves at once"
            } else {
                "the best level"
            };
            let reason = format!(
                "{demand_text}; stepped back to {whither}: {}; calls beyond {to} per endpoint wait in the gateways' queues",
                knee.evidence()
            );
            return step_back(mem, *to, reason, knee, now);
        }
        // While the backend still reports its queue, a probe below the best level waits: its
        // throughput would be judged while the backend drains what it queued.
        Move::Probe { to, knee } if *to < current && query_hold.is_none() => {
            let reason = format!(
                "{demand_text}; probing {} in flight per endpoint against the best level {}: {}",
                to,
                knee.best.in_flight,
                knee.evidence()
            );
            return step_back(mem, *to, reason, knee, now);
        }
        Move::Probe { to, knee } if *to > current && query_hold.is_none() => {
            let reason = format!(
                "{demand_text}; probing {} in flight per endpoint against the best level {}: {}",
                to,
                knee.best.in_flight,
                knee.evidence()
            );
            let scale = change(mem, *to, reason, now);
            let why = format!("{} → {}: {}", scale.from, scale.to, scale.reason);
            return (Decision::ScaleUp(scale), why);
        }
        Move::Recheck { to, best } if *to > current && query_hold.is_none() => {
            let reason = format!(
                "{demand_text}; probing {to} in flight per endpoint against {best}, the best level of the knee last found, whose evidence above it is older than {}",
                poolpilot_api::Duration::from(knee::KNEE_MEMORY)
            );
            let scale = change(mem, *to, reason, now);
            let why = format!("{} → {}: {}", scale.from, scale.to, scale.reason);
            return (Decision::ScaleUp(scale), why);
        }
        _ => {}
    }
    let knee = match &mv {
        Move::Cap(k)
        | Move::Back { knee: k, .. }
        | Move::Probe { knee: k, .. }
        | Move::Measure { knee: k, .. } => Some(*k),
        Move::Free | Move::Judging { .. } | Move::Recheck { .. } => None,
    };

    if recommendation > current {
        let over_upper = (wanted > bounds.upper).then(|| {
            format!(
                "demand wants {wanted} per endpoint, upper bound is {}",
                bounds.upper
            )
        });
        if !grows {
            mem.saturation = over_upper;
            return if wanted > bounds.upper {
                let why = format!(
                    "held at {current}: {demand_text} wants {wanted} per endpoint; the upper bound {} is within {}% of the target{}",
                    bounds.upper,
                    round(DEADBAND * 100.0),
                    limits(knee.as_ref(), s.saturation)
                );
                (Decision::AtUpperBound { recommendation }, why)
            } else {
                let why = format!(
                    "no change: {demand_text} recommends {recommendation}, within {}% of the target {current}",
                    round(DEADBAND * 100.0)
                );
                (Decision::WithinDeadband { recommendation }, why)
            };
        }
        let hold = query_hold.or_else(|| match &mv {
            Move::Judging { step, so_far } => Some(Hold::Judging {
                step: *step,
                so_far: *so_far,
            }),
            Move::Measure { at, knee } => Some(Hold::Measuring {
                at: *at,
                knee: *knee,
            }),
            _ => knee
                .filter(|k| k.cap() <= current || f64::from(k.cap() - current) < band)
                .map(Hold::AtKnee)
                .or_else(|| {
                    mem.knee
                        .ceiling
                        .filter(|c| {
                            knee.is_none()
                                && (c.level <= current || f64::from(c.level - current) < band)
                        })
                        .map(Hold::AtCeiling)
                }),
        });
        if let Some(hold) = hold {
            let what = hold.describe();
            if !matches!(hold, Hold::SaturationPending | Hold::Judging { .. }) {
                mem.saturation = Some(format!("{what}: growth to {recommendation} held"));
            }
            let why = format!("held at {current}: growth to {recommendation} held: {what}");
            return (
                Decision::Held {
                    recommendation,
                    hold,
                },
                why,
            );
        }
        let ceiling = mem.knee.ceiling.filter(|_| knee.is_none());
        let to = knee.map_or(recommendation, |k| {
            recommendation.min(k.cap().max(bounds.min))
        });
        let to = ceiling.map_or(to, |c| to.min(c.level.max(bounds.min)));
        mem.saturation = over_upper;
        let reason = if let Some(k) = knee.filter(|_| to < recommendation) {
            format!("{demand_text}, capped at the knee: {}", k.evidence())
        } else if let Some(c) = ceiling.filter(|_| to < recommendation) {
            format!(
                "{demand_text}, capped below the backend's own queue: {}",
                c.describe()
            )
        } else if wanted > bounds.upper {
            format!("{demand_text}, capped at the upper bound {}", bounds.upper)
        } else {
            demand_text
        };
        if knee.is_none() {
            let fills = (demand / f64::from(endpoints.max(1))).min(f64::from(to));
            mem.knee.stepped(
                level.unwrap_or(current),
                to,
                knee::level_of(fills).unwrap_or(to),
            );
        }
        let scale = change(mem, to, reason, now);
        let why = format!("{} → {}: {}", scale.from, scale.to, scale.reason);
        return (Decision::ScaleUp(scale), why);
    }
    if wanted > bounds.upper && recommendation == current {
        mem.saturation = Some(format!(
            "demand wants {wanted} per endpoint, upper bound is {}",
            bounds.upper
        ));
        let why = format!(
            "held at {current}: {demand_text} wants {wanted} per endpoint, the upper bound is {}{}",
            bounds.upper,
            limits(knee.as_ref(), s.saturation)
        );
        return (Decision::AtUpperBound { recommendation }, why);
    }
    if recommendation == current {
        let why = format!("no change: {demand_text} recommends {recommendation}, the target");
        return (Decision::Steady { recommendation }, why);
    }

    // Scale down: the highest recommendation over the window, only beyond the deadband, at most
    // one capped step per window.
    if f64::from(current - recommendation) < band {
        let why = format!(
            "no change: {demand_text} recommends {recommendation}, within {}% of the target {current}",
            round(DEADBAND * 100.0)
        );
        return (Decision::WithinDeadband { recommendation }, why);
    }
    let window = poolpilot_api::Duration::from(bounds.window);
    let stabilized = mem
        .recommendations
        .iter()
        .map(|(_, r)| *r)
        .max()
        .unwrap_or(recommendation);
    let stabilizing = |why: String| {
        (
            Decision::Stabilizing { recommendation },
            format!("held at {current}: {demand_text} recommends {recommendation}, but {why}"),
        )
    };
    if f64::from(current.saturating_sub(stabilized)) < band {
        return stabilizing(format!(
            "the highest recommendation over the last {window} is {stabilized}"
        ));
    }
    if let Some(t) = mem.last_change.filter(|t| elapsed(*t, now) < bounds.window) {
        return stabilizing(format!(
            "the target changed {}s ago, within the stabilization window of {window}",
            elapsed(t, now).as_secs()
        ));
    }
    let floor = (f64::from(current) * (1.0 - f64::from(bounds.max_step_percent) / 100.0) - 1e-9)
        .ceil() as u32;
    let to = bounds.clamp(stabilized.max(floor));
    if to >= current {
        return stabilizing(format!(
            "a step of at most {}% from {current} rounds to no change",
            bounds.max_step_percent
        ));
    }
    let reason = format!(
        "{demand_text} recommends {recommendation}; highest over {window} is {stabilized}, step capped at {}%",
        bounds.max_step_percent,
    );
    let scale = change(mem, to, reason, now);
    let why = format!("{} → {}: {}", scale.from, scale.to, scale.reason);
    (Decision::ScaleDown(scale), why)
}

/// What else limits a backend held at its upper bound, in words (empty: only the bound): the
/// knee evidence, and the backend's own queue when its saturation query reads one.
fn limits(knee: Option<&Knee>, saturation: SaturationSignal) -> String {
    let mut out = String::new();
    if let Some(k) = knee {
        out.push_str(&format!("; past its knee: {}", k.evidence()));
    }
    if let SaturationSignal::Value(v) = saturation
        && v > 0.0
    {
        out.push_str(&format!(
            "; the backend reports a queue: its saturation query is {}",
            round(v)
        ));
    }
    out
}

/// Lowers the target to `to` for the knee guard (back to the best level, or a probe below it).
fn step_back(
    mem: &mut BackendMemory,
    to: u32,
    reason: String,
    knee: &Knee,
    now: Timestamp,
) -> (Decision, String) {
    mem.saturation = Some(format!("past its knee: {}", knee.evidence()));
    let scale = change(mem, to, reason, now);
    let why = format!("{} → {}: {}", scale.from, scale.to, scale.reason);
    (Decision::StepBack(scale), why)
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

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
