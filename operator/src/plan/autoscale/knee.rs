//! The knee guard: tells a backend past its knee (more connections only queue in it) from one
//! that is merely busier (model servers batch, so their calls slow down as concurrency rises
//! long before they saturate). Growth is held only on evidence, each kind with numbers a user
//! can check in Prometheus (docs/autoscaling.md has the rule, its parameters and a worked
//! example):
//!
//! ```text
//!  backend's own signal   saturation query ≥ threshold                          BackendSaturated
//!  a measured step        in-flight rose ≥ 1.5× since a recent interval, and
//!                         throughput (completed calls/s or response bytes/s,
//!                         whichever rose more) rose less than a backend below
//!                         its knee gives: rise^0.3, and what batching allows
//!                         for a backend with the declared capacity              StepFellShort → knee
//!  a remembered knee      growth stops at the in-flight where throughput
//!                         stopped following (10 minutes, or until throughput
//!                         beyond it shows the backend takes more)                AtKnee
//!  latency, only at ≥ ½   median time to first byte ≥ 2× what it was at a
//!  declared capacity      comparable in-flight (±20%)                            SlowerAtSameLoad
//! ```
//!
//! What batching allows: a call may take up to [`BATCHING_SLOWDOWN`]× as long with every
//! declared slot busy as alone, linearly in between, and a quarter more for noise. A backend
//! whose throughput per call in flight fell further than that did not take the calls as a
//! backend with its declared capacity would: they queued.
//!
//! Throughput counts response bytes as well as calls: longer outputs make fewer calls per
//! second but not fewer bytes, so output lengths alone never look like a knee. Below half the
//! declared capacity latency alone never holds growth: batching slows calls there, and the
//! declared capacity is the user's word that the backend takes more.

use std::collections::VecDeque;
use std::time::Duration;

use super::words::{bytes_text, ratio_text, round};
use crate::plan::time::{Timestamp, elapsed};

/// In-flight (per endpoint) must have risen at least this much since the reference interval
/// for the step to be judged: smaller steps drown in noise.
pub const MIN_RISE: f64 = 1.5;
/// A step whose throughput gain stays below `rise^FLAT_GRADIENT` added connections and next to
/// no throughput, whatever the declared capacity: the backend is past its knee.
pub const FLAT_GRADIENT: f64 = 0.3;
/// How much longer a call may take with every declared slot of its endpoint busy than alone,
/// from batching (linear in between): what a backend below its knee may lose in throughput per
/// call as in-flight rises.
pub const BATCHING_SLOWDOWN: f64 = 3.0;
/// Slack on that for noise: a step falls short only below its expected gain / `NOISE`.
pub const NOISE: f64 = 1.25;
/// The reference of a step is at most this many intervals old.
pub const REFERENCE_INTERVALS: u32 = 10;
/// Completed calls an interval needs before its throughput is judged (fewer: too noisy).
pub const MIN_CALLS: f64 = 30.0;
/// How long a knee (and the intervals kept to compare with) is remembered; after that growth
/// may probe past it once, and the probe's effect is judged again.
pub const KNEE_MEMORY: Duration = Duration::from_secs(600);
/// Throughput this many times the knee's, measured beyond the knee, shows the backend takes
/// more now (it was scaled up, or a noisy neighbour left): the knee is forgotten.
pub const KNEE_MOVED: f64 = 1.25;
/// Latency holds growth only at or above this share of the declared capacity per endpoint.
pub const TRUST_FRACTION: f64 = 0.5;
/// Time to first byte this many times its value at a comparable in-flight holds growth.
pub const TTFB_TOLERANCE: f64 = 2.0;
/// In-flight levels within this relative distance count as comparable.
pub const COMPARABLE: f64 = 0.2;
/// At most this many intervals are kept.
const MAX_OBSERVATIONS: usize = 256;

/// One interval of a backend as the gateways saw it: the point a later step is judged from.
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
    /// Calls completed over the averaging window, all endpoints: how much the throughput
    /// figures can be trusted.
    pub calls: f64,
}

impl Observation {
    /// Whether enough calls completed to judge its throughput.
    fn judged(&self) -> bool {
        self.calls >= MIN_CALLS && (self.completed > 0.0 || self.bytes > 0.0)
    }

    /// The larger of its throughput gains over `then` (calls and bytes each, where `then` had
    /// some); `None` when neither can be compared.
    fn gain_over(&self, then: &Observation) -> Option<f64> {
        let ratio = |now: f64, then: f64| (then > 0.0).then(|| now / then);
        match (
            ratio(self.completed, then.completed),
            ratio(self.bytes, then.bytes),
        ) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A rise in in-flight between two intervals, and what it did to throughput.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    /// The reference interval (lower in-flight).
    pub from: Observation,
    /// This interval.
    pub to: Observation,
}

impl Step {
    /// In-flight now over in-flight then.
    pub fn rise(&self) -> f64 {
        self.to.in_flight / self.from.in_flight
    }

    /// The larger throughput gain (calls or bytes).
    pub fn gain(&self) -> f64 {
        self.to.gain_over(&self.from).unwrap_or(0.0)
    }

    /// `ln(gain) / ln(rise)`: 1 when throughput rose with the connections, 0 when it stayed
    /// flat, negative when it fell.
    pub fn gradient(&self) -> f64 {
        self.gain().max(f64::MIN_POSITIVE).ln() / self.rise().ln()
    }

    /// The least throughput gain a backend below its knee gives for this rise, with `capacity`
    /// declared slots per endpoint: `rise^FLAT_GRADIENT`, and the rise less what batching from
    /// `from` to `to` in-flight may cost per call (up to [`BATCHING_SLOWDOWN`]× at capacity),
    /// less [`NOISE`]; whichever is larger.
    pub fn expected(&self, capacity: u32) -> f64 {
        let per_slot = (BATCHING_SLOWDOWN - 1.0) / f64::from(capacity.max(1));
        let batching =
            (1.0 + per_slot * self.from.in_flight) / (1.0 + per_slot * self.to.in_flight);
        (self.rise() * batching / NOISE).max(self.rise().powf(FLAT_GRADIENT))
    }

    /// Where throughput stopped following: the in-flight per endpoint that, at the reference
    /// interval's throughput per call, yields today's throughput (within the step).
    pub fn knee(&self) -> f64 {
        (self.from.in_flight * self.gain()).clamp(self.from.in_flight, self.to.in_flight)
    }

    /// The step in words, with its numbers.
    pub fn describe(&self) -> String {
        let (from, to) = (&self.from, &self.to);
        format!(
            "in flight {} → {} per endpoint (×{}), completed calls {} → {}/s (×{}), response bytes {} → {}/s (×{})",
            round(from.in_flight),
            round(to.in_flight),
            round(self.rise()),
            round(from.completed),
            round(to.completed),
            ratio_text(to.completed, from.completed),
            bytes_text(from.bytes),
            bytes_text(to.bytes),
            ratio_text(to.bytes, from.bytes),
        )
    }
}

/// Where a backend's throughput stopped following its in-flight calls.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Knee {
    /// In-flight per endpoint beyond which throughput did not follow.
    pub in_flight: f64,
    /// The measured step that found it.
    pub step: Step,
    /// The gain that step should have had ([`Step::expected`]).
    pub expected: f64,
}

impl Knee {
    /// The largest target per endpoint worth having: the knee, rounded up.
    pub fn cap(&self) -> u32 {
        (self.in_flight - 1e-9)
            .ceil()
            .clamp(1.0, f64::from(u32::MAX)) as u32
    }

    /// When it was found.
    pub fn found(&self) -> Timestamp {
        self.step.to.at
    }

    /// The step that found it, in words.
    fn evidence(&self) -> String {
        format!(
            "{}: ×{} where a backend below its knee gives at least ×{}",
            self.step.describe(),
            round(self.step.gain()),
            round(self.expected)
        )
    }
}

/// Why the guard holds growth.
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
    /// This interval's step added in-flight calls and less throughput than a backend below its
    /// knee gives.
    StepFellShort(Knee),
    /// The target already reaches the remembered knee.
    AtKnee(Knee),
    /// The backend is slower at the same load than it was.
    SlowerAtSameLoad {
        /// Median time to first byte now, seconds.
        ttfb: f64,
        /// The comparable interval.
        then: Observation,
        /// In-flight per endpoint now.
        in_flight: f64,
        /// The declared capacity per endpoint.
        capacity: u32,
    },
}

impl Hold {
    /// The hold in words, with its numbers, relative to `now`.
    pub fn describe(&self, now: Timestamp) -> String {
        match self {
            Self::BackendSaturated { value, threshold } => format!(
                "the backend reports saturation: its saturation query is {} ≥ threshold {}",
                round(*value),
                round(*threshold)
            ),
            Self::SaturationPending => {
                "the backend's saturation query has not been evaluated yet".to_owned()
            }
            Self::StepFellShort(knee) => format!(
                "throughput did not follow in-flight: {}; knee ≈ {} in flight per endpoint",
                knee.evidence(),
                round(knee.in_flight)
            ),
            Self::AtKnee(knee) => format!(
                "past its knee: throughput stopped following above {} in flight per endpoint ({} ago: {})",
                round(knee.in_flight),
                ago(knee.found(), now),
                knee.evidence()
            ),
            Self::SlowerAtSameLoad {
                ttfb,
                then,
                in_flight,
                capacity,
            } => format!(
                "slower at the same load: median time to first byte {}s is {}× the {}s measured {} ago at a comparable {} in flight per endpoint (now {}, {}% of the declared capacity {})",
                round(*ttfb),
                round(ttfb / then.ttfb.unwrap_or(f64::NAN)),
                round(then.ttfb.unwrap_or(f64::NAN)),
                ago(then.at, now),
                round(then.in_flight),
                round(*in_flight),
                (in_flight / f64::from((*capacity).max(1)) * 100.0).round(),
                capacity
            ),
        }
    }
}

/// `1m30s`, `45s`.
fn ago(then: Timestamp, now: Timestamp) -> String {
    let secs = elapsed(then, now).as_secs();
    if secs >= 60 {
        format!("{}m{}s", secs / 60, secs % 60)
    } else {
        format!("{secs}s")
    }
}

/// The guard's answer to growth.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Grow to this target per endpoint (the one wanted, or a knee's cap below it).
    Grow(u32),
    /// Hold the target, for this reason.
    Hold(Hold),
}

/// What the guard remembers about one backend: recent intervals and the knee, if known.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KneeMemory {
    /// Recent intervals, oldest first (within [`KNEE_MEMORY`]).
    pub observations: VecDeque<Observation>,
    /// The knee, if a step found one within [`KNEE_MEMORY`].
    pub knee: Option<Knee>,
}

impl KneeMemory {
    /// Records this interval, forgetting what is too old, the knee when throughput beyond it
    /// shows the backend takes more, and learning a knee when the step from a recent interval
    /// with clearly fewer calls in flight fell short of what a backend with `capacity` declared
    /// slots per endpoint gives. Returns that knee when this interval found it. `interval` is
    /// the autoscale interval (the reference's age limit).
    pub fn observe(&mut self, obs: Observation, interval: Duration, capacity: u32) -> Option<Knee> {
        let now = obs.at;
        while self
            .observations
            .front()
            .is_some_and(|o| elapsed(o.at, now) > KNEE_MEMORY)
            || self.observations.len() >= MAX_OBSERVATIONS
        {
            self.observations.pop_front();
        }
        if let Some(knee) = self.knee {
            let expired = elapsed(knee.found(), now) > KNEE_MEMORY;
            let moved = obs.judged()
                && obs.in_flight > knee.in_flight * (1.0 + COMPARABLE / 2.0)
                && obs
                    .gain_over(&knee.step.to)
                    .is_some_and(|g| g >= KNEE_MOVED);
            if expired || moved {
                self.knee = None;
            }
        }
        let found = self.step_to(&obs, interval).and_then(|step| {
            let expected = step.expected(capacity);
            (step.gain() < expected).then(|| Knee {
                in_flight: step.knee(),
                step,
                expected,
            })
        });
        if found.is_some() {
            self.knee = found;
        }
        self.observations.push_back(obs);
        found
    }

    /// The step from the most recent judged interval, at most [`REFERENCE_INTERVALS`] old,
    /// whose in-flight was at most `obs`'s / [`MIN_RISE`].
    fn step_to(&self, obs: &Observation, interval: Duration) -> Option<Step> {
        if !obs.judged() {
            return None;
        }
        let oldest = interval.mul_f64(f64::from(REFERENCE_INTERVALS) + 0.5);
        self.observations
            .iter()
            .rev()
            .take_while(|o| elapsed(o.at, obs.at) <= oldest)
            .find(|o| o.judged() && o.in_flight > 0.0 && o.in_flight * MIN_RISE <= obs.in_flight)
            .map(|from| Step {
                from: *from,
                to: *obs,
            })
    }

    /// The most recent earlier judged interval at an in-flight within [`COMPARABLE`] of
    /// `obs`'s, with a time to first byte.
    fn comparable(&self, obs: &Observation) -> Option<&Observation> {
        self.observations.iter().rev().find(|o| {
            o.at < obs.at
                && o.judged()
                && o.ttfb.is_some_and(|t| t > 0.0)
                && (o.in_flight - obs.in_flight).abs() <= COMPARABLE * obs.in_flight
        })
    }

    /// Whether growth from `current` may go to `wanted` (targets per endpoint), given this
    /// interval's observation (`None`: nothing to judge, growth is not held by the guard) and
    /// the knee it found, if any: grow (to at most `wanted`, capped at a known knee) or hold.
    pub fn judge(
        &self,
        obs: Option<&Observation>,
        found_now: Option<Knee>,
        current: u32,
        wanted: u32,
        capacity: u32,
    ) -> Verdict {
        if let Some(knee) = found_now {
            return Verdict::Hold(Hold::StepFellShort(knee));
        }
        let mut to = wanted;
        if let Some(knee) = self.knee {
            if current >= knee.cap() {
                return Verdict::Hold(Hold::AtKnee(knee));
            }
            to = to.min(knee.cap());
        }
        if let Some(obs) = obs
            && obs.in_flight >= TRUST_FRACTION * f64::from(capacity)
            && let Some(ttfb) = obs.ttfb.filter(|t| *t > 0.0)
            && obs.judged()
            && let Some(then) = self.comparable(obs)
            && ttfb >= TTFB_TOLERANCE * then.ttfb.unwrap_or(f64::INFINITY)
        {
            return Verdict::Hold(Hold::SlowerAtSameLoad {
                ttfb,
                then: *then,
                in_flight: obs.in_flight,
                capacity,
            });
        }
        Verdict::Grow(to)
    }
}

#[cfg(test)]
mod tests;
