//! The knee guard: finds the in-flight level per endpoint where a backend gives the most
//! throughput, and keeps the target from growing past it (more connections only queue in a
//! backend past its knee, and a model server that thrashes gets slower for every call). It judges
//! by evidence accumulated per in-flight level over as many intervals as it takes, so long model
//! calls (a few completions per interval) are judged as surely as short ones
//! (docs/autoscaling.md has the rule, its parameters and a worked example):
//!
//! ```text
//!  level        every interval with a steady load adds to the level of its in-flight (rounded,
//!               per endpoint): throughput (response bytes/s; calls/s when no bytes are
//!               sampled), calls seen (the evidence), intervals, time to first byte
//!  noise        of a level: max(1/√evidence, the spread of its intervals (≥ 3), 2%); a level
//!               noisier than 25% is no evidence yet
//!  significant  beyond SIGNIFICANCE × the two levels' combined noise; a healthy step gives at
//!               least rise^FLAT_GRADIENT and what batching at the declared capacity allows
//!  judging      a step to a new level holds further growth while its gain so far is short of
//!               a healthy step's and the evidence does not suffice, ≤ 3 decisions
//!  knee         among the levels that are evidence, the best level (the lowest one that ties
//!               with the most throughput measured) with a level above it that gave no more
//!               (flat on enough evidence, short, lower, or 2× and ×rise the time to first
//!               byte), or below it one from which the step to it fell short
//!  peak         with levels on both sides of the best one, and one above the most throughput
//!               that gave 10% less: the vertex of a parabola fitted to log throughput over log
//!               in-flight (weights 1/noise²), within its neighbours; the flat top of a
//!               throughput curve hides its peak from pairwise comparisons
//!  then         probe the middle of the bracket around the best level (judged against it;
//!               a tie: the lower level wins; below it, no lower than a level whose in-flight
//!               over the call time measured at or below it may still tie), step back to the
//!               peak, or hold there;
//!               without a knee, measure a too noisy lower level again
//!  queue        once the backend's own queue showed, only the levels at or under what it
//!               serves at once are evidence, nothing above it is probed, and a knee the
//!               queue alone shows is probed below once (within maxStepPercent)
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use super::words::{bytes_text, round};
use crate::plan::time::{Timestamp, elapsed};

/// A difference is significant beyond this many times the combined noise of two levels.
pub const SIGNIFICANCE: f64 = 2.0;
/// No level is known better than this relative noise.
pub const NOISE_FLOOR: f64 = 0.02;
/// A level noisier than this (relative) is no evidence yet: it is compared once it has
/// accumulated more.
pub const MAX_LEVEL_NOISE: f64 = 0.25;
/// Intervals a level needs before the spread of its intervals counts in its noise.
pub const SPREAD_INTERVALS: u32 = 3;
/// Decisions a step is judged for at most, holding growth, before its comparison counts as it
/// stands.
pub const MAX_JUDGING: u32 = 3;
/// Decisions a probe waits at most for its level to be measured: the intervals after a step
/// do not count until the calls started before it are done (one mean call duration).
pub const MAX_PROBE_WAIT: u32 = 8;
/// A step that rose in-flight ×r and throughput less than `r^FLAT_GRADIENT` (significantly)
/// fell short: a backend below its knee gives more, even batching.
pub const FLAT_GRADIENT: f64 = 0.3;
/// How much longer a call may take with every declared slot of its endpoint busy than alone,
/// from batching (linear in between): what a backend below its knee may lose in throughput per
/// call as in-flight rises.
pub const BATCHING_SLOWDOWN: f64 = 3.0;
/// Slack on that allowance: a step is short of a healthy one only below its gain / `SLACK`.
pub const SLACK: f64 = 1.25;
/// Two levels whose throughput differs by less than this share are a tie even when the
/// evidence cannot say more: the lower level wins.
pub const TIE: f64 = 0.1;
/// Levels closer than this ratio of in-flight are not compared: the difference drowns in noise.
pub const MIN_RATIO: f64 = 1.2;
/// A bracket around the best level narrower than this ratio is not probed further.
pub const NARROW: f64 = 1.45;
/// Time to first byte this many times the lower level's at a level that gave no more throughput:
/// the calls wait in the backend.
pub const TTFB_TOLERANCE: f64 = 2.0;
/// How long a level's evidence is kept after its last interval: a level not measured for
/// longer is forgotten, so a knee found from it is probed again (the level the target holds
/// at keeps its evidence as long as it is measured).
pub const KNEE_MEMORY: Duration = Duration::from_secs(600);
/// A level above the one with the most throughput that gives this share less than it shows a
/// throughput that falls past a peak (rather than staying flat): the peak is located.
pub const FALL: f64 = 0.1;
/// Levels within this in-flight ratio of the best one take part in the estimate of the peak.
pub const PEAK_SPAN: f64 = 3.0;
/// The peak's standard error (of its log: relative) up to which its estimate stands; above it,
/// the levels around it are measured more.
pub const PEAK_ERROR: f64 = 0.08;
/// The levels measured to locate an uncertain peak: this ratio below and above it.
pub const REFINE_SPAN: f64 = 2.0;
/// Such a level is measured well enough with this many intervals ...
pub const REFINE_INTERVALS: u32 = 8;
/// ... or this relative noise.
pub const REFINE_NOISE: f64 = 0.08;
/// A level within this ratio of a level to measure counts as it.
const NEAR: f64 = 1.25;
/// The target stays at the level it measures while that level's noise is at least this share
/// of the noisier one's (no churn between two as noisy).
const STAY: f64 = 0.8;
/// Decisions in a row that must see a level well above the backend's queue reading served
/// without a queue before the reading is dropped. One is not enough: a saturation query
/// averages over its own window (often longer than the operator's), so the first decision after
/// a load rises sees the gateways' new in-flight at once and the backend's queue only diluted.
pub const UNQUEUED_TO_FORGET: u32 = 3;
/// Little's law measures a level only from this many timed calls on.
pub const MIN_TIMED: f64 = 5.0;
/// The spread of call durations is known once the levels' intervals give it this many degrees
/// of freedom (intervals beyond each level's first).
pub const MIN_SPREAD_DOF: f64 = 8.0;
/// The relative spread of call durations is taken to be at least this.
pub const MIN_CV: f64 = 0.1;
/// At most this many levels are kept (the oldest go first).
const MAX_LEVELS: usize = 64;

/// One interval of a backend as the gateways saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    /// When.
    pub at: Timestamp,
    /// Calls in flight to the backend (leased connections) per endpoint, averaged.
    pub in_flight: f64,
    /// Calls completed without a 5xx per second, per endpoint.
    pub completed: f64,
    /// Response body bytes received per second, per endpoint.
    pub bytes: f64,
    /// Median time to first byte, in seconds (`None`: not measured).
    pub ttfb: Option<f64>,
    /// Calls completed within the interval, all endpoints.
    pub calls: f64,
    /// Calls in flight past their response's first byte, all endpoints: each streamed bytes
    /// within the interval (none when answers come whole).
    pub streams: f64,
    /// The mean duration of the calls completed within the interval, seconds (`None`: none
    /// completed, or not measured).
    pub duration: Option<f64>,
}

/// What a level's throughput is measured in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Measure {
    /// Response bytes per second (every interval of the levels compared had some).
    Bytes,
    /// Completed calls per second.
    Calls,
    /// Calls per second by Little's law: the mean in-flight over the mean duration of the calls
    /// completed, known to `cv / √calls` where `cv` is the relative spread of call durations
    /// (pooled over the levels' intervals): far sharper than `1 / √calls` for calls of similar
    /// length, as long model calls at one level are.
    Little {
        /// The relative spread of one call's duration.
        cv: f64,
    },
}

/// Call durations of a level: Σ n, Σ n·w and Σ n·w² over its intervals, each interval's mean
/// duration `w` weighted by its `n` completed calls.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timed {
    /// Σ n: the calls timed.
    pub calls: f64,
    /// Σ n·w.
    pub total: f64,
    /// Σ n·w².
    pub squares: f64,
    /// Intervals that timed calls.
    pub intervals: u32,
}

impl Timed {
    fn add(&mut self, calls: f64, duration: f64) {
        self.calls += calls;
        self.total += calls * duration;
        self.squares += calls * duration * duration;
        self.intervals += 1;
    }

    /// The mean duration of the calls timed.
    pub fn mean(&self) -> Option<f64> {
        (self.calls > 0.0 && self.total > 0.0).then(|| self.total / self.calls)
    }

    /// The spread of the intervals' means around the level's, relative, with its degrees of
    /// freedom: `Σ n·(w − w̄)² / w̄²` over `intervals − 1`. An interval's mean over `n` calls
    /// varies as `σ² / n`, so the sum estimates `(intervals − 1)·cv²`.
    pub fn dispersion(&self) -> Option<(f64, f64)> {
        let mean = self.mean()?;
        (self.intervals >= 2).then(|| {
            let ss = (self.squares - self.total * self.total / self.calls).max(0.0);
            (ss / (mean * mean), f64::from(self.intervals - 1))
        })
    }
}

/// A sum of per-interval values and of their squares.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sum {
    /// Σ x.
    pub total: f64,
    /// Σ x².
    pub squares: f64,
}

impl Sum {
    fn add(&mut self, x: f64) {
        self.total += x;
        self.squares += x * x;
    }
}

/// What was observed at one in-flight level per endpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Level {
    /// The level: in-flight per endpoint, rounded.
    pub in_flight: u32,
    /// Intervals observed.
    pub intervals: u32,
    /// Σ in-flight per endpoint over its intervals (unrounded).
    pub in_flight_sum: f64,
    /// Response bytes per second per endpoint, per interval.
    pub bytes: Sum,
    /// Completed calls per second per endpoint, per interval.
    pub calls: Sum,
    /// Whether every interval had response bytes.
    pub all_bytes: bool,
    /// Calls completed over its intervals, all endpoints.
    pub completions: f64,
    /// Calls that streamed within its intervals, all endpoints (in flight, summed per interval).
    pub streams: f64,
    /// Σ median time to first byte over the intervals that had one, and how many did.
    pub ttfb: (f64, u32),
    /// The durations of the calls completed in its intervals.
    pub timed: Timed,
    /// Σ in-flight ÷ mean duration per interval, and of its squares (the intervals that timed
    /// calls): their spread.
    pub little: Sum,
    /// Its first interval.
    pub first: Timestamp,
    /// Its last interval.
    pub last: Timestamp,
}

impl Level {
    fn new(in_flight: u32, at: Timestamp) -> Self {
        Self {
            in_flight,
            intervals: 0,
            in_flight_sum: 0.0,
            bytes: Sum::default(),
            calls: Sum::default(),
            all_bytes: true,
            completions: 0.0,
            streams: 0.0,
            ttfb: (0.0, 0),
            timed: Timed::default(),
            little: Sum::default(),
            first: at,
            last: at,
        }
    }

    fn add(&mut self, o: &Observation) {
        self.intervals += 1;
        self.in_flight_sum += o.in_flight;
        self.bytes.add(o.bytes);
        self.calls.add(o.completed);
        self.all_bytes &= o.bytes > 0.0;
        self.completions += o.calls;
        self.streams += o.streams;
        if let Some(t) = o.ttfb {
            self.ttfb.0 += t;
            self.ttfb.1 += 1;
        }
        if let Some(w) = o.duration.filter(|w| *w > 0.0 && w.is_finite())
            && o.calls > 0.0
        {
            self.timed.add(o.calls, w);
            self.little.add(o.in_flight / w);
        }
        self.last = o.at;
    }

    /// Its mean in-flight per endpoint (the level itself is rounded).
    pub fn mean_in_flight(&self) -> f64 {
        if self.intervals > 0 {
            self.in_flight_sum / f64::from(self.intervals)
        } else {
            f64::from(self.in_flight)
        }
    }

    /// Whether its throughput is counted in response bytes.
    pub fn by_bytes(&self) -> bool {
        self.all_bytes && self.bytes.total > 0.0
    }

    fn sum(&self, bytes: bool) -> &Sum {
        if bytes { &self.bytes } else { &self.calls }
    }

    /// Mean throughput per endpoint: bytes/s (`bytes`) or completed calls/s.
    pub fn throughput(&self, bytes: bool) -> f64 {
        self.sum(bytes).total / f64::from(self.intervals.max(1))
    }

    /// Its relative noise: `1/√evidence` (evidence: the calls that made the throughput, those
    /// that completed and, for bytes, those that streamed), the standard error of its intervals'
    /// spread once it has [`SPREAD_INTERVALS`], at least [`NOISE_FLOOR`].
    pub fn noise(&self, bytes: bool) -> f64 {
        let evidence = if bytes {
            self.completions + self.streams
        } else {
            self.completions
        };
        let counted = 1.0 / evidence.max(1.0).sqrt();
        let n = f64::from(self.intervals);
        let mean = self.throughput(bytes);
        let spread = if self.intervals >= SPREAD_INTERVALS && mean > 0.0 {
            let s = self.sum(bytes);
            let var = ((s.squares - s.total * s.total / n) / (n - 1.0)).max(0.0);
            var.sqrt() / mean / n.sqrt()
        } else {
            0.0
        };
        counted.max(spread).max(NOISE_FLOOR)
    }

    /// Its throughput measured as `m` says (Little's law: calls/s per endpoint; counted
    /// completions when it timed none).
    pub fn rate(&self, m: Measure) -> f64 {
        match m {
            Measure::Bytes => self.throughput(true),
            Measure::Calls => self.throughput(false),
            Measure::Little { .. } => self
                .timed
                .mean()
                .map_or_else(|| self.throughput(false), |w| self.mean_in_flight() / w),
        }
    }

    /// Its relative noise measured as `m` says: for Little's law `cv / √calls timed`, or the
    /// standard error of its intervals' spread once it has [`SPREAD_INTERVALS`] of them,
    /// whichever is larger, at least [`NOISE_FLOOR`].
    pub fn uncertainty(&self, m: Measure) -> f64 {
        match m {
            Measure::Bytes => self.noise(true),
            Measure::Calls => self.noise(false),
            Measure::Little { cv } => {
                let counted = cv / self.timed.calls.max(1.0).sqrt();
                let n = f64::from(self.timed.intervals);
                let mean = self.little.total / n.max(1.0);
                let spread = if self.timed.intervals >= SPREAD_INTERVALS && mean > 0.0 {
                    let s = &self.little;
                    let var = ((s.squares - s.total * s.total / n) / (n - 1.0)).max(0.0);
                    var.sqrt() / mean / n.sqrt()
                } else {
                    0.0
                };
                counted.max(spread).max(NOISE_FLOOR)
            }
        }
    }

    /// Mean median time to first byte, seconds.
    pub fn ttfb(&self) -> Option<f64> {
        (self.ttfb.1 > 0).then(|| self.ttfb.0 / f64::from(self.ttfb.1))
    }

    /// Its throughput in words.
    fn text(&self, m: Measure) -> String {
        let t = self.rate(m);
        match m {
            Measure::Bytes => format!("{}/s", bytes_text(t)),
            Measure::Calls | Measure::Little { .. } => format!("{} calls/s", round(t)),
        }
    }
}

/// What a higher level did compared with a lower one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Significantly more throughput, as a backend below its knee gives.
    Better,
    /// No significant difference either way.
    Flat,
    /// More throughput, but significantly less than `rise^FLAT_GRADIENT`.
    Short,
    /// Significantly less throughput.
    Worse,
    /// No more throughput and at least [`TTFB_TOLERANCE`]× the time to first byte, and at least
    /// as many times as in-flight rose (a batch that fills slows every call's first token too,
    /// by less than it adds calls while it gives more).
    Slower,
}

/// A higher level against a lower one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// The lower level.
    pub lower: Level,
    /// The higher level.
    pub higher: Level,
    /// What throughput is compared in.
    pub measure: Measure,
    /// Throughput at the higher level over the lower's.
    pub gain: f64,
    /// The least gain a backend below its knee gives for this rise ([`Comparison::least`]).
    pub least: f64,
    /// A difference beyond this (relative) is significant: [`SIGNIFICANCE`] × the combined noise.
    pub significant: f64,
    /// Whether both levels are evidence ([`MAX_LEVEL_NOISE`]); otherwise the effect is flat.
    pub trusted: bool,
    /// What it shows.
    pub effect: Effect,
}

impl Comparison {
    /// `higher` (more in flight) against `lower`, for a backend declared with `capacity` slots
    /// per endpoint, in response bytes when both have them, else in completed calls.
    pub fn of(higher: &Level, lower: &Level, capacity: u32) -> Self {
        let m = if higher.by_bytes() && lower.by_bytes() {
            Measure::Bytes
        } else {
            Measure::Calls
        };
        Self::measured(higher, lower, capacity, m)
    }

    /// [`Comparison::of`], throughput measured as `m` says.
    pub fn measured(higher: &Level, lower: &Level, capacity: u32, m: Measure) -> Self {
        let (h, l) = (higher.rate(m), lower.rate(m));
        let gain = if l > 0.0 {
            h / l
        } else if h > 0.0 {
            f64::INFINITY
        } else {
            1.0
        };
        let (nh, nl) = (higher.uncertainty(m), lower.uncertainty(m));
        let noise = nh.hypot(nl);
        let trusted = nh.max(nl) <= MAX_LEVEL_NOISE;
        let significant = SIGNIFICANCE * noise;
        let least = Self::least_for(higher.mean_in_flight(), lower.mean_in_flight(), capacity);
        let rise = higher.mean_in_flight() / lower.mean_in_flight().max(f64::MIN_POSITIVE);
        let slower = higher
            .ttfb()
            .zip(lower.ttfb())
            .is_some_and(|(h, l)| l > 0.0 && h >= TTFB_TOLERANCE.max(rise) * l);
        // The noise is relative: the gain is uncertain by a factor of (1 + significant).
        let optimistic = gain * (1.0 + significant);
        let effect = if !trusted {
            Effect::Flat
        } else if optimistic < 1.0 {
            Effect::Worse
        } else if slower && gain <= 1.0 + significant {
            Effect::Slower
        } else if optimistic < least {
            Effect::Short
        } else if gain > 1.0 + significant {
            Effect::Better
        } else {
            Effect::Flat
        };
        Self {
            lower: *lower,
            higher: *higher,
            measure: m,
            gain,
            least,
            significant,
            trusted,
            effect,
        }
    }

    /// The least gain a backend below its knee gives for a rise from `lower` to `higher` in
    /// flight per endpoint with `capacity` declared slots: the larger of `rise^FLAT_GRADIENT`
    /// and the rise less what batching may cost each call (up to [`BATCHING_SLOWDOWN`]× with
    /// every declared slot busy, linearly in between), less [`SLACK`].
    pub fn least_for(higher: f64, lower: f64, capacity: u32) -> f64 {
        let (h, l) = (higher, lower.max(0.5));
        let rise = (h / l).max(1.0);
        let per_slot = (BATCHING_SLOWDOWN - 1.0) / f64::from(capacity.max(1));
        let batching = (1.0 + per_slot * l) / (1.0 + per_slot * h);
        (rise * batching / SLACK).max(rise.powf(FLAT_GRADIENT))
    }

    /// The least gain a backend below its knee gives for this rise.
    pub fn least(&self) -> f64 {
        self.least
    }

    /// Whether the evidence suffices: the effect is significant, or the noise is small enough
    /// that a step below the knee would have shown as better and a flat one as short.
    pub fn sufficient(&self) -> bool {
        self.trusted
            && (self.effect != Effect::Flat || self.significant <= (self.least() - 1.0) / 2.0)
    }

    /// Whether the higher level shows, on sufficient evidence, that it gives no more than the
    /// lower: less, short of a healthy step, slower, or flat with noise too small to hide one.
    pub fn no_more(&self) -> bool {
        match self.effect {
            Effect::Worse | Effect::Short | Effect::Slower => true,
            Effect::Flat => self.sufficient(),
            Effect::Better => false,
        }
    }

    /// Whether the higher level gives no more than the lower, for the choice of the best
    /// level (a tie: the lower wins): no more and slower to the first byte, flat with noise
    /// small enough to have shown a healthy step, or flat or short within [`TIE`].
    pub fn tie(&self) -> bool {
        self.trusted
            && match self.effect {
                Effect::Slower => true,
                Effect::Flat => self.sufficient() || self.gain <= 1.0 + TIE,
                Effect::Short => self.gain <= 1.0 + TIE,
                Effect::Better | Effect::Worse => false,
            }
    }

    /// Whether the higher level gave less than a healthy step so far (significant or not).
    pub fn suspicious(&self) -> bool {
        self.gain < self.least()
    }

    /// Whether the higher level gave significantly more throughput than the lower.
    pub fn more(&self) -> bool {
        self.trusted && self.gain > 1.0 + self.significant
    }

    /// The comparison in words, with its numbers.
    pub fn describe(&self) -> String {
        let (l, h) = (&self.lower, &self.higher);
        let unit = match self.measure {
            Measure::Bytes => "response bytes",
            Measure::Calls => "completed calls",
            Measure::Little { .. } => "calls (in flight ÷ call time)",
        };
        let what = match self.effect {
            Effect::Better => "more",
            Effect::Flat => "no significant change",
            Effect::Short => "short of a healthy step",
            Effect::Worse => "less",
            Effect::Slower => "no more, and slower to the first byte",
        };
        let ttfb = match (l.ttfb(), h.ttfb()) {
            (Some(a), Some(b)) if self.effect == Effect::Slower => {
                format!(", time to first byte {}s → {}s", round(a), round(b))
            }
            _ => String::new(),
        };
        format!(
            "{unit} {} at {} in flight per endpoint → {} at {} (×{}, {what}: significant beyond ±{}%, {} and {} calls seen){ttfb}",
            l.text(self.measure),
            l.in_flight,
            h.text(self.measure),
            h.in_flight,
            round(self.gain),
            round(self.significant * 100.0),
            round(l.completions),
            round(h.completions),
        )
    }
}

/// Where a backend gives the most, and the evidence that more in flight does not pay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Knee {
    /// The best level: the lowest one not significantly below the most throughput measured.
    pub best: Level,
    /// The lowest level above it (at least [`MIN_RATIO`]) that shows it gives no more, against
    /// it.
    pub above: Option<Comparison>,
    /// It against the highest level below it (at least [`MIN_RATIO`]).
    pub below: Option<Comparison>,
    /// Where the throughput peaks, from the levels on both sides of the best one
    /// ([`KneeMemory::peak`]; `None`: not measured on both sides yet).
    pub peak: Option<Peak>,
    /// Whether a level above the one with the most throughput gave at least [`FALL`] less than
    /// it: the throughput has a peak to locate (otherwise it stays flat past the best level,
    /// which stands).
    pub falls: bool,
    /// The backend's own queue, when it showed: the knee is at or below what it serves at once.
    pub ceiling: Option<Ceiling>,
    /// Whether a level above the best one is evidence (it gave no more than the best: the
    /// best is the lowest level that ties with the most).
    pub measured_above: bool,
}

/// The estimated peak of a backend's throughput.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peak {
    /// In flight per endpoint.
    pub at: f64,
    /// The standard error of its log (relative).
    pub error: f64,
}

impl Knee {
    /// The largest target per endpoint worth having: the estimated peak, or the best level
    /// until the levels on both sides of it are measured. The peak is rounded to the whole
    /// level of the two around it that the fitted parabola gives more: up from beyond their
    /// geometric mean (the fit is in log in-flight).
    pub fn cap(&self) -> u32 {
        let cap = self.peak.map_or(self.best.in_flight, |p| {
            let floor = p.at.floor().clamp(1.0, f64::from(u32::MAX - 1));
            let up = p.at >= (floor * (floor + 1.0)).sqrt();
            floor as u32 + u32::from(up)
        });
        match self.ceiling {
            // Only the backend's queue says where growth stops: at what it serves at once (the
            // levels measured are all below it, and none is known better than it) or, once a
            // level above the best one below it was measured too, at the best one.
            Some(c) if self.queue_alone() => c.level,
            Some(c) => cap.min(c.level),
            None => cap,
        }
    }

    /// Whether only the backend's queue says where growth stops: [`Knee::cap`] is what it
    /// serves at once.
    pub fn queue_alone(&self) -> bool {
        self.ceiling.is_some() && !self.own() && !self.measured_above
    }

    /// Whether the levels themselves show the knee (not only the backend's queue).
    pub fn own(&self) -> bool {
        self.above.is_some()
            || self
                .below
                .is_some_and(|b| matches!(b.effect, Effect::Short | Effect::Slower))
    }

    /// What the backend serves at once, when only its queue shows the knee and the best level
    /// is well below that ([`MIN_RATIO`]): only the light load's level was measured, and the
    /// queue's level must be measured before anything below it is probed.
    pub fn unmeasured_ceiling(&self) -> Option<u32> {
        self.ceiling
            .filter(|c| {
                !self.own() && f64::from(c.level) >= f64::from(self.best.in_flight) * MIN_RATIO
            })
            .map(|c| c.level)
    }

    /// Whether there is evidence that more in flight does not pay: a level above that gave no
    /// more, or a step from below that fell short.
    fn evident(&self) -> bool {
        self.own() || self.ceiling.is_some()
    }

    /// The evidence in words.
    pub fn evidence(&self) -> String {
        let mut parts = Vec::new();
        if let Some(a) = &self.above {
            parts.push(a.describe());
        }
        if let Some(b) = &self.below {
            parts.push(b.describe());
        }
        let peak = match self.peak {
            Some(p) if self.cap() != self.best.in_flight => format!(
                "; its peak, from the levels around it, is at {} per endpoint (±{}%)",
                round(p.at),
                round(p.error * 100.0)
            ),
            _ => String::new(),
        };
        if let Some(c) = &self.ceiling {
            parts.push(c.describe());
        }
        format!(
            "the most throughput is at {} in flight per endpoint ({}){peak}",
            self.best.in_flight,
            parts.join("; ")
        )
    }
}

/// A step being judged: growth waits until its level's evidence suffices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Judging {
    /// The target stepped to.
    pub target: u32,
    /// The level it runs at (the target, or the demand when that is less).
    pub level: u32,
    /// The level it is judged against.
    pub reference: u32,
    /// Decisions since the step.
    pub decisions: u32,
    /// Of those, decisions that held growth on a trusted comparison that pointed to a knee.
    pub judged: u32,
    /// Whether the guard made the step (a probe inside the bracket around the best level): it
    /// holds until its level has a settled interval that is evidence, for at most
    /// [`MAX_PROBE_WAIT`] decisions; a step the law made holds growth only while its evidence
    /// points to a knee.
    pub probe: bool,
}

impl Judging {
    /// A probe the guard makes to `to`, judged against the level `reference`.
    fn probe(to: u32, reference: u32) -> Self {
        Self {
            target: to,
            level: to,
            reference,
            decisions: 0,
            judged: 0,
            probe: true,
        }
    }
}

/// What the guard says about the target.
#[derive(Clone, Debug, PartialEq)]
pub enum Move {
    /// No evidence of a knee: the law decides.
    Free,
    /// The step to the current level is being judged: hold growth.
    Judging {
        /// The step.
        step: Judging,
        /// Its comparison so far (`None`: no interval at the new level yet).
        so_far: Option<Comparison>,
    },
    /// Try this level inside the bracket around the best level.
    Probe {
        /// The level.
        to: u32,
        /// The knee it probes.
        knee: Knee,
    },
    /// Stay at this level, one of those around an uncertain peak, to measure it more.
    Measure {
        /// The level (the current target).
        at: u32,
        /// The knee whose peak it locates.
        knee: Knee,
    },
    /// Return to the best level.
    Back {
        /// The best level.
        to: u32,
        /// The evidence.
        knee: Knee,
    },
    /// Grow to at most the best level; at it, hold.
    Cap(Knee),
    /// The knee last found at `best` rests on levels above it since forgotten
    /// ([`KNEE_MEMORY`]): growth probes one step above it, judged against it, before the demand
    /// may take the target further.
    Recheck {
        /// The probe's level.
        to: u32,
        /// The best level of the knee last found (still measured).
        best: u32,
    },
}

/// Why the guard holds growth.
// One per backend and decision, moved, never kept in bulk: boxing the evidence buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Hold {
    /// The backend's own saturation query is at or above its threshold.
    BackendSaturated {
        /// The query's value.
        value: f64,
        /// `saturation.threshold`.
        threshold: f64,
    },
    /// The saturation query is configured but has not been run since it was (the poller picks
    /// new queries up at its next round).
    SaturationPending,
    /// The last step's evidence does not suffice yet.
    Judging {
        /// The step.
        step: Judging,
        /// Its comparison so far (`None`: no interval at the new level yet).
        so_far: Option<Comparison>,
    },
    /// The target reaches the best level: more in flight gave no more throughput.
    AtKnee(Knee),
    /// The target reaches what the backend served at once when its own queue last showed
    /// (remembered across holds: growth after the queue drained stops there).
    AtCeiling(Ceiling),
    /// Past its knee, whose peak is still uncertain: the target stays at a level around it
    /// to measure it.
    Measuring {
        /// The level measured.
        at: u32,
        /// The knee.
        knee: Knee,
    },
}

impl Hold {
    /// The hold in words, with its numbers.
    pub fn describe(&self) -> String {
        match self {
            Self::BackendSaturated { value, threshold } => format!(
                "the backend reports saturation: its saturation query is {} ≥ threshold {}",
                round(*value),
                round(*threshold)
            ),
            Self::SaturationPending => {
                "the backend's saturation query has not been evaluated yet".to_owned()
            }
            Self::Judging { step, so_far } => format!(
                "judging the {} to {} in flight per endpoint against {} (decision {} of at most {}): {}",
                if step.probe { "knee's probe" } else { "step" },
                step.level,
                step.reference,
                step.decisions,
                if step.probe {
                    MAX_PROBE_WAIT
                } else {
                    MAX_JUDGING
                },
                so_far.as_ref().map_or_else(
                    || format!("no steady interval at {} yet", step.level),
                    |c| format!("{}, not enough evidence yet", c.describe())
                )
            ),
            Self::AtKnee(knee) => format!("past its knee: {}", knee.evidence()),
            Self::AtCeiling(c) => format!("past its knee: {}", c.describe()),
            Self::Measuring { at, knee } => format!(
                "past its knee, measuring {at} in flight per endpoint to locate its peak: {}",
                knee.evidence()
            ),
        }
    }
}

/// What the backend's own queue said: at `seen_at` in flight per endpoint it had `waiting`
/// calls waiting for a batch slot, so it serves about `level` at once. Growth stops there
/// (calls beyond wait in the gateways' queues, not in the backend), and the knee is at or
/// below it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ceiling {
    /// What the backend serves at once per endpoint: in flight less its queue (at least 1).
    pub level: u32,
    /// In flight per endpoint when its queue showed.
    pub seen_at: f64,
    /// Its saturation query then.
    pub waiting: f64,
    /// When it was last read.
    pub at: Timestamp,
}

impl Ceiling {
    /// From a reading of the backend's queue (`waiting`, the largest over its instances) at
    /// `in_flight` per endpoint.
    pub fn read(in_flight: f64, waiting: f64, at: Timestamp) -> Self {
        let level = (in_flight - waiting)
            .floor()
            .clamp(1.0, f64::from(u32::MAX)) as u32;
        Self {
            level,
            seen_at: in_flight,
            waiting,
            at,
        }
    }

    /// The reading in words.
    pub fn describe(&self) -> String {
        format!(
            "the backend's own queue read {} at {} in flight per endpoint: it serves about {} at once",
            round(self.waiting),
            round(self.seen_at),
            self.level
        )
    }
}

/// What the guard remembers about one backend: its levels and the step being judged.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KneeMemory {
    /// By in-flight per endpoint.
    pub levels: BTreeMap<u32, Level>,
    /// The step being judged, if one is.
    pub judging: Option<Judging>,
    /// The declared capacity per endpoint (`capacity.maxConnectionsPerEndpoint`): what batching
    /// may cost a call is measured against it (0: unknown, a step only needs `rise^0.3`).
    pub capacity: u32,
    /// `autoscale.scaleDown.maxStepPercent`: a probe below the best level into levels never
    /// measured is a shrink without evidence, at most this share of it (0: 50%).
    pub max_step_percent: u32,
    /// The backend's own queue, the last time it showed (kept across holds: growth after the
    /// queue drains stops here), until [`KNEE_MEMORY`] passes without a reading or a level above
    /// it is served without a queue on [`UNQUEUED_TO_FORGET`] decisions in a row.
    pub ceiling: Option<Ceiling>,
    /// Decisions in a row that saw a level well above the ceiling served without a queue.
    pub unqueued: u32,
    /// The best level of the last knee the levels showed: while the target still measures it,
    /// growth past it after the evidence above has been forgotten is one probe step, not the
    /// demand's jump.
    pub last_best: Option<u32>,
}

/// The level an interval at `in_flight` per endpoint counts in (`None`: too few in flight).
pub fn level_of(in_flight: f64) -> Option<u32> {
    (in_flight.is_finite() && in_flight >= 0.5)
        .then(|| in_flight.round().min(f64::from(u32::MAX)) as u32)
}

impl KneeMemory {
    /// Adds this interval to its level, first forgetting levels not measured for longer than
    /// [`KNEE_MEMORY`].
    pub fn observe(&mut self, obs: Observation) {
        let now = obs.at;
        self.levels
            .retain(|_, l| elapsed(l.last, now) <= KNEE_MEMORY);
        self.forget_old_ceiling(now);
        let Some(key) = level_of(obs.in_flight) else {
            return;
        };
        if !self.levels.contains_key(&key) && self.levels.len() >= MAX_LEVELS {
            let oldest = self
                .levels
                .iter()
                .min_by_key(|(_, l)| l.last)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.levels.remove(&k);
            }
        }
        self.levels
            .entry(key)
            .or_insert_with(|| Level::new(key, now))
            .add(&obs);
    }

    /// Takes the backend's saturation query as it read (`queued`: at or above its threshold)
    /// at `in_flight_now` per endpoint, `settled` the in-flight of this decision's steady
    /// interval (`None`: the interval was not steady). A queue is remembered as what the
    /// backend serves at once; the reading is dropped only once a level well above it
    /// ([`MIN_RATIO`]), steady and now, went without a queue on [`UNQUEUED_TO_FORGET`]
    /// decisions in a row: the backend got more slots (or faster).
    pub fn read_queue(
        &mut self,
        queued: bool,
        waiting: f64,
        in_flight_now: f64,
        settled: Option<f64>,
        now: Timestamp,
    ) {
        if queued {
            self.ceiling = Some(Ceiling::read(in_flight_now, waiting, now));
            self.unqueued = 0;
            return;
        }
        let Some(c) = self.ceiling else {
            self.unqueued = 0;
            return;
        };
        let above = f64::from(c.level) * MIN_RATIO;
        if in_flight_now >= above && settled.is_some_and(|s| s >= above) {
            self.unqueued += 1;
            if self.unqueued >= UNQUEUED_TO_FORGET {
                self.ceiling = None;
                self.unqueued = 0;
            }
        } else {
            self.unqueued = 0;
        }
    }

    /// Forgets the backend's queue reading once [`KNEE_MEMORY`] passed without another: the
    /// backend may have been rolled out with more slots since.
    pub fn forget_old_ceiling(&mut self, now: Timestamp) {
        if self
            .ceiling
            .is_some_and(|c| elapsed(c.at, now) > KNEE_MEMORY)
        {
            self.ceiling = None;
        }
    }

    /// Whether the backend serves `level` at once, as far as its queue's last reading tells: a
    /// level above that is the reading's level of calls served plus a queue, its throughput that
    /// of the reading's level measured while the queue filled or drained (after a step back the
    /// gateways' in-flight stays high until the calls queued in the backend are done). Such a
    /// level is no evidence of where the backend gives the most.
    pub fn served(&self, level: &Level) -> bool {
        self.ceiling.is_none_or(|c| level.in_flight <= c.level)
    }

    /// The relative spread of one call's duration, pooled over the levels' intervals (within
    /// each level), at least [`MIN_CV`]; `None` until they give [`MIN_SPREAD_DOF`] degrees of
    /// freedom.
    pub fn cv(&self) -> Option<f64> {
        let (ss, dof) = self
            .levels
            .values()
            .filter_map(|l| l.timed.dispersion())
            .fold((0.0, 0.0), |(s, d), (ls, ld)| (s + ls, d + ld));
        (dof >= MIN_SPREAD_DOF).then(|| (ss / dof).sqrt().max(MIN_CV))
    }

    /// What `levels` are compared in: Little's law once the spread of call durations is known
    /// and each timed [`MIN_TIMED`] calls, else response bytes when each has them, else
    /// completed calls.
    pub fn measure(&self, levels: &[&Level]) -> Measure {
        match self.cv() {
            Some(cv) if levels.iter().all(|l| l.timed.calls >= MIN_TIMED) => Measure::Little { cv },
            _ if levels.iter().all(|l| l.by_bytes()) => Measure::Bytes,
            _ => Measure::Calls,
        }
    }

    /// `higher` against `lower`, measured as [`KneeMemory::measure`] says for the two.
    fn compare(&self, higher: &Level, lower: &Level) -> Comparison {
        Comparison::measured(higher, lower, self.capacity, self.measure(&[higher, lower]))
    }

    /// The knee, when the levels show one.
    pub fn knee(&self) -> Option<Knee> {
        // Only levels that are evidence take part: one noisier than MAX_LEVEL_NOISE could give
        // the most throughput by luck, and every comparison with it would be untrusted; and,
        // once the backend's queue is known, only the levels it serves at once.
        let trusted = |l: &&Level| l.uncertainty(self.measure(&[l])) <= MAX_LEVEL_NOISE;
        let any_served = self.levels.values().filter(trusted).any(|l| self.served(l));
        let evidence = move || {
            self.levels
                .values()
                .filter(trusted)
                .filter(move |l| !any_served || self.served(l))
        };
        let max = evidence().max_by(|a, b| {
            let m = self.measure(&[a, b]);
            a.rate(m).total_cmp(&b.rate(m))
        })?;
        // The lowest level that gives as much as the most throughput measured, on sufficient
        // evidence (flat: the lower level wins).
        let best = evidence()
            .find(|l| l.in_flight >= max.in_flight || self.compare(max, l).tie())
            .unwrap_or(max);
        let far =
            |a: &Level, b: &Level| a.mean_in_flight() >= b.mean_in_flight() * MIN_RATIO - 1e-9;
        let above = evidence()
            .filter(|l| l.in_flight > best.in_flight && far(l, best))
            .map(|l| self.compare(l, best))
            .find(Comparison::no_more);
        let below = evidence()
            .filter(|l| l.in_flight < best.in_flight)
            .rev()
            .find(|l| far(best, l))
            .map(|l| self.compare(best, l));
        // A curve that falls past the most throughput measured has a peak there to locate;
        // one that stays flat (the knee of a backend that queues what it cannot serve) is held
        // at its lowest level that gives the most. Against the most, not the best level: the
        // best is the lowest level that ties with it, up to a tie below the peak, and a curve
        // that falls as far past the peak stays within a tie of the best.
        let falls = evidence()
            .filter(|l| l.in_flight > max.in_flight)
            .any(|l| self.compare(l, max).gain < 1.0 - FALL);
        let knee = Knee {
            best: *best,
            above,
            below,
            peak: if falls { self.peak(best) } else { None },
            falls,
            ceiling: self.ceiling,
            measured_above: evidence().any(|l| l.in_flight > best.in_flight && far(l, best)),
        };
        knee.evident().then_some(knee)
    }

    /// Where the throughput peaks, estimated from the levels within [`PEAK_SPAN`] of the best
    /// one that are evidence ([`MAX_LEVEL_NOISE`]), once at least one lies on each side of it:
    /// the vertex of the parabola fitted to log throughput over log in-flight, each level
    /// weighted by 1/noise², kept within the levels fitted, with its standard error. Near its
    /// peak a throughput curve is flat: levels ±25% around it differ by a few percent, less
    /// than their noise, and the best level measured is as likely one of them as the peak; the
    /// curvature of the levels on both sides locates it. `None` without a level on each side,
    /// or when the fit is not concave (no peak between them).
    pub fn peak(&self, best: &Level) -> Option<Peak> {
        let around: Vec<&Level> = self
            .levels
            .values()
            .filter(|l| {
                let r = l.mean_in_flight() / best.mean_in_flight();
                (1.0 / PEAK_SPAN..=PEAK_SPAN).contains(&r)
                    && l.intervals > 0
                    && (self.served(l) || !self.served(best))
            })
            .collect();
        let m = self.measure(&around);
        let x0 = best.mean_in_flight().ln();
        let points: Vec<(f64, f64, f64)> = around
            .iter()
            .filter(|l| l.uncertainty(m) <= MAX_LEVEL_NOISE && l.rate(m) > 0.0)
            .map(|l| {
                let n = l.uncertainty(m);
                (l.mean_in_flight().ln() - x0, l.rate(m).ln(), 1.0 / (n * n))
            })
            .collect();
        let xs = || points.iter().map(|p| p.0);
        let lo = xs().filter(|x| *x < -1e-9).min_by(f64::total_cmp)?;
        let hi = xs().filter(|x| *x > 1e-9).max_by(f64::total_cmp)?;
        // Weighted least squares of y = a + b·x + c·x²: the normal equations, whose inverse is
        // the covariance of (a, b, c).
        let mut m = [[0.0f64; 3]; 3];
        let mut v = [0.0f64; 3];
        for &(x, y, w) in &points {
            let basis = [1.0, x, x * x];
            for i in 0..3 {
                for j in 0..3 {
                    m[i][j] += w * basis[i] * basis[j];
                }
                v[i] += w * basis[i] * y;
            }
        }
        let cov = inverse3(m)?;
        let [_, b, c] = [0, 1, 2].map(|i| (0..3).map(|j| cov[i][j] * v[j]).sum::<f64>());
        if c >= 0.0 {
            return None;
        }
        let vertex = -b / (2.0 * c);
        // The vertex's standard error, to first order in (b, c).
        let g = [0.0, -1.0 / (2.0 * c), b / (2.0 * c * c)];
        let var: f64 = (0..3)
            .flat_map(|i| (0..3).map(move |j| (i, j)))
            .map(|(i, j)| g[i] * cov[i][j] * g[j])
            .sum();
        Some(Peak {
            at: (x0 + vertex.clamp(lo, hi)).exp(),
            error: var.max(0.0).sqrt(),
        })
    }

    /// The level to measure next while the peak is uncertain (its standard error above
    /// [`PEAK_ERROR`]): the noisier of the levels [`REFINE_SPAN`]× below and above it (an
    /// existing level within [`NEAR`] of each counts as it), until each has
    /// [`REFINE_INTERVALS`] intervals or noise at most [`REFINE_NOISE`]; the current target
    /// while it is one of them and not much less noisy than the other. `None`: the peak is
    /// known well enough (or cannot be measured better), the knee's cap stands.
    fn refine(&self, knee: &Knee, current: u32, (min, top): (u32, u32)) -> Option<u32> {
        if !knee.falls || knee.peak.is_some_and(|p| p.error <= PEAK_ERROR) {
            return None;
        }
        let centre = knee.peak.map_or(knee.best.mean_in_flight(), |p| p.at);
        let near = |x: f64| {
            self.levels
                .values()
                .filter(|l| (l.mean_in_flight() / x).ln().abs() <= NEAR.ln())
                .min_by(|a, b| {
                    let d = |l: &Level| (l.mean_in_flight() / x).ln().abs();
                    d(a).total_cmp(&d(b))
                })
                .map_or_else(
                    || {
                        (x.round().max(0.0).min(f64::from(u32::MAX)) as u32)
                            .clamp(min, top.max(min))
                    },
                    |l| l.in_flight,
                )
        };
        let noise = |k: u32| {
            self.levels
                .get(&k)
                .map_or(f64::INFINITY, |l| l.uncertainty(self.measure(&[l])))
        };
        let done = |k: u32| {
            self.levels.get(&k).is_some_and(|l| {
                l.intervals >= REFINE_INTERVALS || l.uncertainty(self.measure(&[l])) <= REFINE_NOISE
            })
        };
        let open: Vec<u32> = [near(centre / REFINE_SPAN), near(centre * REFINE_SPAN)]
            .into_iter()
            .filter(|k| (min..=top).contains(k) && *k != knee.best.in_flight && !done(*k))
            .collect();
        let noisiest = open
            .iter()
            .copied()
            .max_by(|a, b| noise(*a).total_cmp(&noise(*b)))?;
        Some(
            if open.contains(&current) && noise(current) >= STAY * noise(noisiest) {
                current
            } else {
                noisiest
            },
        )
    }

    /// The most a level of `in_flight` per endpoint can give, calls/s per endpoint, by Little's
    /// law: its in-flight over the mean call time measured at a level at or below it, less that
    /// time's noise, the least of those (a call takes at least as long beside more calls: a
    /// batch slows each call as it fills, a queue delays it). `None`: no level at or below it
    /// timed [`MIN_TIMED`] calls, or the spread of call times is not known yet.
    pub fn most_at(&self, in_flight: u32) -> Option<f64> {
        let cv = self.cv()?;
        self.levels
            .range(..=in_flight)
            .filter(|(_, l)| l.timed.calls >= MIN_TIMED)
            .filter_map(|(_, l)| {
                let noise = l.uncertainty(Measure::Little { cv });
                let w = l.timed.mean()? * (1.0 - SIGNIFICANCE * noise);
                (w > 0.0).then(|| f64::from(in_flight) / w)
            })
            .min_by(f64::total_cmp)
    }

    /// The lowest level from `from` up that may give as much as `best` (within [`TIE`]), by
    /// [`KneeMemory::most_at`], and is still [`MIN_RATIO`] below it: a probe below the best
    /// level to a level that cannot tie with it costs its throughput and tells nothing. `from`
    /// itself when the calls were not timed.
    fn least_that_may_tie(&self, from: u32, best: &Level) -> Option<u32> {
        let cv = self.cv();
        let most = cv
            .filter(|_| best.timed.calls >= MIN_TIMED)
            .map(|cv| best.rate(Measure::Little { cv }) * (1.0 - TIE));
        (from..best.in_flight)
            .take_while(|m| f64::from(best.in_flight) >= f64::from(*m) * MIN_RATIO)
            .find(|m| {
                most.zip(self.most_at(*m))
                    .is_none_or(|(most, bound)| bound >= most)
            })
    }

    /// The largest target per endpoint worth having, when a knee is known.
    pub fn cap(&self) -> Option<u32> {
        self.knee().map(|k| k.cap())
    }

    /// What the target `current` should do while demand recommends `wanted` (targets per
    /// endpoint, within [`min`, `upper`]) and this interval ran at `level` (`None`: no steady
    /// interval).
    pub fn plan(
        &mut self,
        current: u32,
        wanted: u32,
        (min, upper): (u32, u32),
        level: Option<u32>,
    ) -> Move {
        if let Some(mut step) = self.judging.take() {
            step.decisions += 1;
            let most = if step.probe {
                MAX_PROBE_WAIT
            } else {
                MAX_JUDGING
            };
            if step.target == current
                && step.decisions <= most
                && let Some(reference) = self.levels.get(&step.reference)
            {
                let so_far = self.levels.get(&step.level).map(|l| {
                    if l.in_flight >= reference.in_flight {
                        self.compare(l, reference)
                    } else {
                        self.compare(reference, l)
                    }
                });
                match so_far {
                    // A probe stands until its level is measured: leaving it on no evidence
                    // would undo it before it told anything.
                    None if step.probe => {
                        self.judging = Some(step);
                        return Move::Judging { step, so_far };
                    }
                    Some(c) if step.probe && !c.trusted => {
                        self.judging = Some(step);
                        return Move::Judging { step, so_far };
                    }
                    Some(c) if c.sufficient() => {}
                    // Growth waits only where the evidence so far points to a knee.
                    Some(c) if c.suspicious() && step.judged < MAX_JUDGING => {
                        if c.trusted {
                            step.judged += 1;
                        }
                        self.judging = Some(step);
                        return Move::Judging { step, so_far };
                    }
                    _ => self.judging = Some(step),
                }
            }
        }
        let Some(knee) = self.knee() else {
            // A knee whose evidence above its best level was forgotten while the target held at
            // that level is checked again by one step above it: a crowd that outlasts the
            // memory would otherwise take the demand's whole jump past the knee again, and wait
            // out calls that last minutes there before stepping back.
            if let Some(best) = self.last_best.filter(|b| self.levels.contains_key(b)) {
                let to = ((f64::from(best) * NARROW).ceil() as u32)
                    .max(best + 1)
                    .min(wanted)
                    .min(upper);
                if current < to {
                    self.judging = Some(Judging::probe(to, best));
                    return Move::Recheck { to, best };
                }
            }
            // No evidence of a knee: the law decides. A level is never left for a lower one on
            // evidence too thin to call it worse (a step down to the light load's level undoes
            // growth the crowd needs, and judges nothing: it is the next step up that repeats).
            let _ = level;
            self.last_best = None;
            return Move::Free;
        };
        // Only a knee the levels show: one known from the backend's queue alone is checked by
        // the queue itself, which shows within a decision of any growth past it.
        self.last_best = knee.own().then_some(knee.best.in_flight);
        let (best, cap) = (knee.best.in_flight, knee.cap());
        if wanted < cap.min(best) {
            return Move::Free;
        }
        let measured = |l: u32| self.levels.contains_key(&l);
        let middle = |a: u32, b: u32| (f64::from(a) * f64::from(b)).sqrt().round() as u32;
        // A probe below the best level into levels never measured is a shrink without
        // evidence: at most maxStepPercent of it, or as far as the nearest level it can be
        // compared with ([`MIN_RATIO`]) when that is further (a best level of 7 at 20% would
        // probe 6, too close to compare, and so never probe at all).
        let share = match self.max_step_percent {
            0 => 0.5,
            p => f64::from(p.min(100)) / 100.0,
        };
        let comparable = (f64::from(best) / MIN_RATIO + 1e-9).floor() as u32;
        let floor = ((f64::from(best) * (1.0 - share) - 1e-9).ceil() as u32)
            .min(comparable)
            .max(min);
        // What the backend served at once when its queue last showed (no reading: no bound).
        let at_once = knee.ceiling.map_or(u32::MAX, |c| c.level);
        // Above first (towards the demand), then below; never above what the backend serves
        // at once (its queue takes the rest).
        let up = knee.above.and_then(|a| {
            let hi = a.higher.in_flight;
            let m = middle(best, hi).min(upper);
            (f64::from(hi) > f64::from(best) * NARROW
                && m > best
                && m < hi
                && m <= wanted
                && m <= at_once)
                .then_some(m)
        });
        let down = match knee.below {
            Some(b) => {
                let lo = b.lower.in_flight;
                let m = middle(lo, best);
                (f64::from(best) > f64::from(lo) * NARROW && m > lo && m < best).then_some(m)
            }
            None => {
                let m = (best / 2).max(floor);
                (m < best && f64::from(best) >= f64::from(m) * MIN_RATIO).then_some(m)
            }
        };
        let down = down
            .map(|m| m.max(min))
            .and_then(|m| self.least_that_may_tie(m, &knee.best));
        let fresh = |m: &u32| !measured(*m) && *m != current;
        let (up, down) = if knee.own() {
            (up, down)
        } else if knee.ceiling.is_some()
            && best <= at_once
            && knee.unmeasured_ceiling().is_none()
            && self.levels.range(floor.min(best)..best).next().is_none()
        {
            // Only the backend's queue says where growth stops: at what it serves at once.
            // Whether it gives more below that (a batch that thrashes as it fills) only a
            // level below can tell: one probe, within maxStepPercent of the best level, and
            // none while a level there is remembered (a backend that gives less below is
            // not probed again until that level is forgotten). The best level must be what
            // the backend serves at once: a best level well below it is only the light load's,
            // and the target first goes to the queue's level to measure it (a probe below the
            // light level, with the crowd waiting, would undo growth the queue allows).
            (None, down.map(|m| m.max(floor)).filter(|m| *m < best))
        } else {
            (None, None)
        };
        if let Some(to) = up.filter(fresh).or(down.filter(fresh)) {
            self.judging = Some(Judging::probe(to, best));
            return Move::Probe { to, knee };
        }
        match self
            .refine(&knee, current, (min, wanted.min(upper).min(at_once)))
            .filter(|_| knee.own())
        {
            Some(at) if at == current => return Move::Measure { at, knee },
            Some(to) => return Move::Probe { to, knee },
            None => {}
        }
        let cap = cap.max(min);
        if current > cap {
            return Move::Back { to: cap, knee };
        }
        Move::Cap(knee)
    }

    /// Records that the law grew the target to `target`, where the demand fills `level`, from
    /// the level `from` (this interval's, or the old target's without one): the step is judged
    /// against it.
    pub fn stepped(&mut self, from: u32, target: u32, level: u32) {
        let (lo, hi) = (from.min(level), from.max(level));
        self.judging = (f64::from(hi) >= f64::from(lo.max(1)) * MIN_RATIO).then_some(Judging {
            target,
            level,
            reference: from,
            decisions: 0,
            judged: 0,
            probe: false,
        });
    }
}

/// The inverse of `m` (its adjugate over its determinant), `None` when `m` is singular.
fn inverse3(m: [[f64; 3]; 3]) -> Option<[[f64; 3]; 3]> {
    let minor =
        |r0: usize, r1: usize, c0: usize, c1: usize| m[r0][c0] * m[r1][c1] - m[r0][c1] * m[r1][c0];
    let det =
        m[0][0] * minor(1, 2, 1, 2) - m[0][1] * minor(1, 2, 0, 2) + m[0][2] * minor(1, 2, 0, 1);
    let scale = m.iter().flatten().fold(0.0f64, |a, x| a.max(x.abs()));
    if !det.is_finite() || det.abs() <= 1e-12 * scale.powi(3) {
        return None;
    }
    let others = |i: usize| match i {
        0 => (1, 2),
        1 => (0, 2),
        _ => (0, 1),
    };
    let mut out = [[0.0; 3]; 3];
    for (i, row) in out.iter_mut().enumerate() {
        for (j, x) in row.iter_mut().enumerate() {
            // The cofactor of m[j][i] (transposed: the adjugate).
            let (r0, r1) = others(j);
            let (c0, c1) = others(i);
            let sign = if (i + j) % 2 == 0 { 1.0 } else { -1.0 };
            *x = sign * minor(r0, r1, c0, c1) / det;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests;
