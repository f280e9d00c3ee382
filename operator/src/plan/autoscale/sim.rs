//! A closed-loop simulation for the autoscale law's tests: callers, the gateways' pools and
//! queue, and a modelsim-like backend (batch slots, its own queue beyond them, the service-time
//! law of modelsim/src/config.rs), stepped in small time steps; every interval the law decides
//! on the sample the gateways' metrics would give, and the pool follows its target. Trajectories
//! show what the cluster would: calls started at an earlier level still in flight after a step,
//! a backend queue that drains, completions that lag the in-flight.

use std::collections::VecDeque;
use std::time::Duration;

use super::{BackendMemory, Bounds, Decision, decide};
use crate::metrics::decision_kind;
use crate::plan::input::{BackendSample, SaturationSignal};
use crate::plan::time::Timestamp;

/// Response bytes of one output token (what modelsim's JSON answer comes to).
const TOKEN_BYTES: f64 = 8.64;
/// The simulation's time step, seconds.
const DT: f64 = 0.05;
/// What the saturation query averages, seconds: the sample policy's `avg_over_time` over 10 s
/// (one interval: over 30 s it lags a step by three decisions and reads a queue that is gone).
const QUERY_WINDOW: f64 = 10.0;

/// A modelsim-like backend: `slots` batch slots per endpoint; with `u` of them busy a token
/// takes `per_token·(1 + batch·u + saturation·u²)`, a call `base·(1 + batch·u)` more; calls
/// beyond the slots wait in the backend's own queue.
#[derive(Clone, Copy, Debug)]
pub struct Backend {
    pub endpoints: usize,
    pub slots: usize,
    pub base: f64,
    pub per_token: f64,
    pub batch: f64,
    pub saturation: f64,
    pub tokens: f64,
    /// Whether the policy configures the waiting-queue query.
    pub query: bool,
}

#[derive(Clone, Copy, Debug)]
struct Call {
    sent: f64,
    /// Work left: seconds of service at no slowdown.
    left: f64,
}

/// The simulation's clock at `t` seconds.
fn clock(t: f64) -> Timestamp {
    Timestamp::from_millisecond(1_800_000_000_000 + (t * 1000.0).round() as i64)
        .expect("within jiff's range")
}

/// One decision as the simulation saw it.
#[derive(Clone, Debug)]
pub struct Row {
    pub t: f64,
    pub callers: usize,
    pub target: u32,
    pub kind: &'static str,
    pub reason: String,
    /// Calls completed per second over the interval (fleet).
    pub completed: f64,
}

/// The whole loop.
pub struct Sim {
    pub backend: Backend,
    pub bounds: Bounds,
    pub mem: BackendMemory,
    t: f64,
    /// Per endpoint: calls holding a slot, calls in the backend's queue.
    active: Vec<Vec<Call>>,
    queued: Vec<VecDeque<Call>>,
    /// Lease requests waiting in the gateways (their send times).
    pending: VecDeque<f64>,
    /// Callers not waiting for a call (they send at once).
    idle: usize,
    callers: usize,
    /// Waiting calls in the backend (largest instance) per step, for the query.
    waiting: VecDeque<(f64, f64)>,
    /// xorshift64 state: each call's work varies by modelsim's jitter (lognormal, σ 0.1).
    rng: u64,
}

impl Sim {
    pub fn new(backend: Backend, bounds: Bounds, start: u32) -> Self {
        let mem = BackendMemory::start(Some(start), &bounds, clock(0.0));
        Self {
            backend,
            bounds,
            mem,
            t: 0.0,
            active: vec![Vec::new(); backend.endpoints],
            queued: vec![VecDeque::new(); backend.endpoints],
            pending: VecDeque::new(),
            idle: 0,
            callers: 0,
            waiting: VecDeque::new(),
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// A lognormal factor with σ 0.1 (Box–Muller on two xorshift draws).
    fn jitter(&mut self) -> f64 {
        let mut unit = || {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            ((self.rng >> 11) as f64 / (1u64 << 53) as f64).max(1e-12)
        };
        let (u, v) = (unit(), unit());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 0.1).exp()
    }

    /// Callers from now on (closed loop: each sends its next call when its last one ends).
    pub fn set_callers(&mut self, n: usize) {
        if n >= self.callers {
            self.idle += n - self.callers;
        } else {
            // Callers leave: the idle first, then queued requests.
            let mut gone = self.callers - n;
            let from_idle = gone.min(self.idle);
            self.idle -= from_idle;
            gone -= from_idle;
            while gone > 0 && self.pending.pop_back().is_some() {
                gone -= 1;
            }
            // Callers whose call is in flight leave when it ends.
            self.idle = self.idle.saturating_sub(gone);
        }
        self.callers = n;
    }

    fn leased(&self, e: usize) -> usize {
        self.active[e].len() + self.queued[e].len()
    }

    fn in_flight(&self) -> usize {
        (0..self.backend.endpoints).map(|e| self.leased(e)).sum()
    }

    /// Runs one interval and decides: the row of the decision.
    pub fn interval(&mut self) -> Row {
        let b = self.backend;
        let step = self.bounds.interval.as_secs_f64();
        let (mut leased_sum, mut pending_sum, mut steps) = (0.0, 0.0, 0.0);
        let (mut done, mut bytes, mut firsts) = (0.0, 0.0, Vec::new());
        let end = self.t + step;
        while self.t < end - 1e-9 {
            self.t += DT;
            let target = self.mem.target as usize;
            // Callers send; the gateways lease to the endpoint with the fewest leases.
            for _ in 0..self.idle {
                self.pending.push_back(self.t);
            }
            self.idle = 0;
            while !self.pending.is_empty() {
                let e = (0..b.endpoints)
                    .min_by_key(|e| self.leased(*e))
                    .unwrap_or(0);
                if self.leased(e) >= target {
                    break;
                }
                let sent = self.pending.pop_front().unwrap_or(self.t);
                let call = Call {
                    sent,
                    left: (b.base + b.tokens * b.per_token) * self.jitter(),
                };
                if self.active[e].len() < b.slots {
                    self.active[e].push(call);
                } else {
                    self.queued[e].push_back(call);
                }
            }
            // The backend works.
            let mut widest = 0.0f64;
            for e in 0..b.endpoints {
                let u = self.active[e].len() as f64 / b.slots as f64;
                let slow = 1.0 + b.batch * u + b.saturation * u * u;
                let mut finished: u32 = 0;
                self.active[e].retain_mut(|c| {
                    c.left -= DT / slow;
                    if c.left <= 0.0 {
                        finished += 1;
                        firsts.push(self.t - c.sent);
                        false
                    } else {
                        true
                    }
                });
                done += f64::from(finished);
                bytes += f64::from(finished) * b.tokens * TOKEN_BYTES;
                self.idle += finished as usize;
                while self.active[e].len() < b.slots {
                    let Some(c) = self.queued[e].pop_front() else {
                        break;
                    };
                    self.active[e].push(c);
                }
                widest = widest.max(self.queued[e].len() as f64);
            }
            // Callers that left do not send again.
            let total = self.idle + self.pending.len() + self.in_flight();
            if total > self.callers {
                self.idle = self.idle.saturating_sub(total - self.callers);
            }
            self.waiting.push_back((self.t, widest));
            while self
                .waiting
                .front()
                .is_some_and(|(t, _)| *t < self.t - QUERY_WINDOW)
            {
                self.waiting.pop_front();
            }
            leased_sum += self.in_flight() as f64;
            pending_sum += self.pending.len() as f64;
            steps += 1.0;
        }
        firsts.sort_by(f64::total_cmp);
        let waiting =
            self.waiting.iter().map(|w| w.1).sum::<f64>() / self.waiting.len().max(1) as f64;
        let sample = BackendSample {
            leased: Some(leased_sum / steps),
            pending: Some(pending_sum / steps),
            leased_now: Some(self.in_flight() as f64),
            pending_now: Some(self.pending.len() as f64),
            completed: Some(done / step),
            bytes: Some(bytes / step),
            ttfb: firsts.get(firsts.len() / 2).copied(),
            window: Duration::from_secs_f64(step),
            saturation: if b.query {
                SaturationSignal::Value(waiting)
            } else {
                SaturationSignal::NotConfigured
            },
            unscraped: 0,
            current: None,
            classes: Default::default(),
            h2_max_streams: None,
            h2_fallback: None,
        };
        let now = clock(self.t);
        let d: Decision = decide(
            &self.bounds,
            &mut self.mem,
            &sample,
            b.endpoints as u32,
            now,
        );
        Row {
            t: self.t,
            callers: self.callers,
            target: self.mem.target,
            kind: decision_kind(&d),
            reason: self
                .mem
                .last_decision
                .as_ref()
                .map(|e| e.reason.clone())
                .unwrap_or_default(),
            completed: done / step,
        }
    }
}

/// The rows as a table, one line each.
pub fn table(name: &str, rows: &[Row]) -> String {
    rows.iter()
        .map(|r| {
            format!(
                "  {name} {:>6.1}s {:>3} callers {:>3} {:<18} {:>5.2} calls/s  {}\n",
                r.t, r.callers, r.target, r.kind, r.completed, r.reason
            )
        })
        .collect()
}

// === the cluster's scenarios, closed loop ===

/// The long-calls scenario's backends (e2e/tests/scenarios/long_calls_knee.rs): 2 instances,
/// 100 tokens × 40 ms, `--batch-slowdown=0.3`; model-a 12 slots and `--saturation-slowdown=6`
/// (its throughput peaks at 12/√6 ≈ 4.9 in flight per instance), model-b 32 slots, no
/// thrashing. The policy: min 2, max 25, every 10 s, scale-down over 30 s at most 50%, the
/// waiting-queue query with threshold 1.
fn long_calls(slots: usize, saturation: f64, capacity: u32) -> Sim {
    let backend = Backend {
        endpoints: 2,
        slots,
        base: 0.05,
        per_token: 0.04,
        batch: 0.3,
        saturation,
        tokens: 100.0,
        query: true,
    };
    let bounds = Bounds {
        min: 2,
        upper: 25,
        margin: 0.2,
        window: Duration::from_secs(30),
        max_step_percent: 50,
        capacity,
        interval: Duration::from_secs(10),
        saturation_threshold: Some(1.0),
    };
    Sim::new(backend, bounds, 2)
}

/// Light load (2 callers) for 3 decisions, then the crowd for 24 (240 s, as the scenario).
fn crowd(sim: &mut Sim, callers: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    sim.set_callers(2);
    for _ in 0..3 {
        rows.push(sim.interval());
    }
    sim.set_callers(callers);
    for _ in 0..24 {
        rows.push(sim.interval());
    }
    rows
}

/// The scenario's bounds, checked on the simulated trajectory.
#[test]
fn long_calls_knee_closed_loop() {
    let mut a = long_calls(12, 6.0, 64);
    let rows = crowd(&mut a, 40);
    let table = self::table("model-a", &rows);
    eprintln!("long_calls_knee, model-a:\n{table}");
    let grew = rows
        .iter()
        .position(|r| r.kind == "scale_up")
        .expect("model-a grows");
    let named = rows[grew + 1..].iter().take(4).any(|r| {
        r.reason.contains("knee")
            || r.reason.contains("the backend reports saturation")
            || r.reason.contains("stepped back")
    });
    assert!(named, "a knee reason within 4 decisions:\n{table}");
    let end = rows.last().unwrap().target;
    assert!(
        (f64::from(end) - 4.9).abs() <= 0.25 * 4.9 + 0.5,
        "ends within ±25% of the knee: {end}\n{table}"
    );
    // Completed calls/s: the last 60 s against the best 60 s under the crowd (a step back
    // releases the calls queued in the backend in a burst no level sustains: over 60 s, six
    // to ten call durations, it averages out with the lull before it).
    let under: Vec<f64> = rows[3..].iter().map(|r| r.completed).collect();
    let minute: Vec<f64> = under
        .windows(6)
        .map(|w| w.iter().sum::<f64>() / 6.0)
        .collect();
    let best = minute.iter().copied().fold(0.0, f64::max);
    let last = *minute.last().unwrap();
    eprintln!("model-a completed calls/s: best 60 s {best:.2}, last 60 s {last:.2}");
    assert!(last >= 0.9 * best, "{last:.2} < 90% of {best:.2}\n{table}");

    let mut b = long_calls(32, 0.0, 32);
    let rows = crowd(&mut b, 24);
    let table = self::table("model-b", &rows);
    eprintln!("long_calls_knee, model-b:\n{table}");
    let first = rows
        .iter()
        .find(|r| r.kind == "scale_up")
        .expect("model-b grows");
    assert_eq!(first.target, 15, "one step to ⌈24 × 1.2 / 2⌉\n{table}");
    assert!(
        rows.iter()
            .skip_while(|r| r.kind != "scale_up")
            .all(|r| r.target >= 15 && !r.reason.contains("knee")),
        "model-b keeps its pool\n{table}"
    );
}

/// The square wave (e2e/tests/scenarios/square_wave.rs): 2 instances, 400 ms calls; model-a 64
/// slots, batch slowdown 1.5, model-b 6 slots; min 10, max 25, every 5 s, scale-down over 8 s
/// at most 25%; 6 / 30 callers alternating every 2 decisions, 14 transitions.
#[test]
fn square_wave_closed_loop() {
    for (name, slots, batch, capacity) in [("model-a", 64, 1.5, 64), ("model-b", 6, 0.0, 32)] {
        let backend = Backend {
            endpoints: 2,
            slots,
            base: 0.4,
            per_token: 0.0,
            batch,
            saturation: 0.0,
            tokens: 4.0,
            query: true,
        };
        let bounds = Bounds {
            min: 10,
            upper: 25,
            margin: 0.2,
            window: Duration::from_secs(8),
            max_step_percent: 25,
            capacity,
            interval: Duration::from_secs(5),
            saturation_threshold: Some(1.0),
        };
        let mut sim = Sim::new(backend, bounds, 10);
        let mut rows = Vec::new();
        sim.set_callers(6);
        rows.push(sim.interval());
        for phase in 1..=14 {
            sim.set_callers(if phase % 2 == 1 { 30 } else { 6 });
            for _ in 0..2 {
                rows.push(sim.interval());
            }
        }
        let table = self::table(name, &rows);
        eprintln!("square_wave, {name}:\n{table}");
        for (i, pair) in rows.windows(2).enumerate() {
            let (from, to) = (pair[0].target, pair[1].target);
            let high = pair[1].callers == 30;
            assert!(to >= 10, "{name} never below min: {from} → {to}\n{table}");
            if to < from {
                assert!(
                    !high,
                    "{name} shrank under the high load: {from} → {to} (decision {})\n{table}",
                    i + 1
                );
                assert!(
                    f64::from(to) >= (f64::from(from) * 0.75 - 1e-9).ceil(),
                    "{name} shrinks by more than 25%: {from} → {to}\n{table}"
                );
            }
            if to > from {
                assert!(
                    high,
                    "{name} grew under the low load: {from} → {to}\n{table}"
                );
            }
        }
        // Each phase changes a target at most once.
        for phase in rows[1..].chunks(2) {
            let changes = phase
                .windows(2)
                .filter(|w| w[0].target != w[1].target)
                .count();
            assert!(changes <= 1, "{name}: one change per phase\n{table}");
        }
    }
}
