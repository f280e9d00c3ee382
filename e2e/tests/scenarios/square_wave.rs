//! Scenario 11, the square wave: the load on two backends alternates every two autoscale
//! intervals between 30% and 150% of the pool they start from, for 14 transitions. model-a
//! (declared 64 slots, has 64, batches: slower as it fills) never reaches its knee; model-b
//! (declared 32, has 6 batch slots per instance) is past its knee at the high load. The operator
//! changes each target at most once per transition and never between them, overshoots the demand
//! by no more than 1.3 × its margin, shrinks by at most `maxStepPercent` per step, and holds
//! model-b at its knee, saying why.
//!
//! ```text
//!  per backend: 2 instances, 400 ms calls; policy min 10, max 25, margin 0.2, decisions every 5 s,
//!  scale-down over an 8 s window at most 25% per step; 2 gateways
//!  pool at the start 10 × 2 = 20 connections: low 6 callers (30%), high 30 callers (150%)
//!
//!  low ─2 decisions─► high ─2 decisions─► low … 14 transitions, each right after a decision
//!  model-a: high 10 → 18 (demand 30 × 1.2 / 2), low 18 → 14 (a 25% step), high 14 → 18, …
//!  model-b: at 10 (min) its 6 slots per instance are full and calls queue behind them (the
//!           sample's saturation query on `vllm:num_requests_waiting` reads ≥ 1): growth to 18
//!           held (BackendSaturated), the reading remembered; later highs are held at 10
//!           (the queue, or past its knee), lows keep min: the guard never takes a target
//!           below min or shrinks it under the high load
//! ```
//!
//! A transition starts right after a decision, so that each decision sees one phase only (the
//! operator averages over 4 s, read up to 2 s late); the scale-down window (8 s) keeps the
//! first decision of a low phase from shrinking on the high phase's recommendation and lets
//! the second one shrink.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use poolpilot_api::policy::{BackendStatus, DecisionAction};
use poolpilot_e2e::eventually;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, Stack, StackSpec, WAIT, quick_policy, set, share, with_stack,
};
use serde_json::json;
use tokio::time::Instant;

const SCENARIO: &str = "square-wave";
/// The autoscale interval.
const INTERVAL: Duration = Duration::from_secs(5);
/// The starting target (the policy's min) of both backends.
const MIN: u32 = 10;
/// The upper bound: model-b's capacity 32 × (1 − 0.2).
const MAX: u32 = 25;
/// Instances of each backend.
const ENDPOINTS: u32 = 2;
/// Callers of each backend at 30% and 150% of its starting pool (10 × 2).
const LOW: usize = 6;
/// See [`LOW`].
const HIGH: usize = 30;
/// `autoscale.margin`.
const MARGIN: f64 = 0.2;
/// `scaleDown.maxStepPercent`.
const MAX_STEP_PERCENT: u32 = 25;
/// Transitions between the two loads.
const TRANSITIONS: usize = 14;
/// Decisions per phase.
const PER_PHASE: usize = 2;
/// Service time of one call alone.
const SERVICE_MS: u32 = 400;
/// model-b's batch slots per instance: its knee, between the low and the high load.
const KNEE_SLOTS: u32 = 6;
/// Gateways.
const GATEWAYS: u32 = 2;
/// The backends.
const BACKENDS: [&str; 2] = ["model-a", "model-b"];

/// One backend as one decision left it.
#[derive(Clone, Debug)]
struct Seen {
    target: u32,
    action: DecisionAction,
    reason: String,
    demand: f64,
}

/// One decision of both backends.
#[derive(Clone, Debug)]
struct Decision {
    /// The phase it was made in (0: the low load before the first transition).
    phase: usize,
    high: bool,
    backends: BTreeMap<&'static str, Seen>,
}

fn is_high(phase: usize) -> bool {
    phase % 2 == 1
}

#[tokio::test]
async fn a_square_wave_changes_each_target_once_per_transition_and_holds_the_backend_at_its_knee()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: GATEWAYS,
        backends: vec![
            BackendSpec::new("model-a", ENDPOINTS, 64)
                .service_ms(SERVICE_MS)
                .arg("--batch-slowdown=1.5"),
            BackendSpec::new("model-b", ENDPOINTS, KNEE_SLOTS).service_ms(SERVICE_MS),
        ],
        ..StackSpec::default()
    };
    with_stack("square", spec, async |stack| {
        let mut policy = quick_policy()?;
        set(&mut policy, "/spec/autoscale/min", json!(MIN))?;
        set(&mut policy, "/spec/autoscale/max", json!(MAX))?;
        set(&mut policy, "/spec/autoscale/margin", json!(MARGIN))?;
        set(
            &mut policy,
            "/spec/autoscale/scaleDown",
            json!({"stabilizationWindow": "8s", "maxStepPercent": MAX_STEP_PERCENT}),
        )?;
        // The per-client limit is not what this scenario is about.
        set(&mut policy, "/spec/clients/maxConcurrency", json!(64))?;
        // Both targets start at min (not at the upper bound, which the low load would take
        // several decisions to shrink from).
        let warm = Instant::now();
        stack.apply_starting_at_min(&policy).await?;
        let gateways = stack.wait_gateways(GATEWAYS as usize).await?;
        let proxies: Vec<_> = gateways.iter().map(|g| g.proxy()).collect();
        let loads = BACKENDS
            .iter()
            .map(|b| {
                let spec = LoadSpec::one_client_per_worker(
                    proxies.clone(),
                    *b,
                    4,
                    HIGH,
                    Duration::from_secs(30),
                );
                Load::start_as(spec, LOW, &format!("square-{b}"), None)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;

        for b in BACKENDS {
            let s = stack.backend_status(b).await?;
            anyhow::ensure!(s.target == MIN, "{b} starts at min: target {}", s.target);
        }
        let start_share = MIN / GATEWAYS;
        stack
            .wait_limits("every gateway runs the min shares", GATEWAYS as usize, WAIT, |l| {
                for b in BACKENDS {
                    let share = share(l, b)?;
                    anyhow::ensure!(share == start_share, "{b}: share {share}");
                }
                Ok(())
            })
            .await?;
        figure(SCENARIO, "warm-up seconds", format!("{:.1}", warm.elapsed().as_secs_f64()));
        for b in stack.backends("model-b").await? {
            b.reset_peaks().await?;
        }

        // The wave: every PER_PHASE decisions, right after the last of them, the load flips.
        let started = Instant::now();
        let mut decisions: Vec<Decision> = Vec::new();
        let mut last_time = stack
            .backend_status("model-a")
            .await?
            .last_decision
            .map(|d| d.time);
        let mut phase = 0;
        let mut in_phase = PER_PHASE - 1; // the first flip comes after the next decision
        loop {
            let (time, backends) = next_decision(stack, last_time.as_ref()).await?;
            last_time = Some(time);
            decisions.push(Decision {
                phase,
                high: is_high(phase),
                backends,
            });
            in_phase += 1;
            if in_phase < PER_PHASE {
                continue;
            }
            if phase == TRANSITIONS {
                break;
            }
            phase += 1;
            in_phase = 0;
            let workers = if is_high(phase) { HIGH } else { LOW };
            for load in &loads {
                load.set_workers(workers);
            }
        }
        let wave = started.elapsed();
        for load in loads {
            load.stop().await;
        }

        let mut table = String::new();
        for d in &decisions {
            let _ = write!(table, "\n  phase {:>2} {:<4}", d.phase, if d.high { "high" } else { "low" });
            for (b, s) in &d.backends {
                let _ = write!(table, " | {b} {:>2} {:?} (demand {:.1})", s.target, s.action, s.demand);
            }
        }
        println!("decisions:{table}");
        figure(SCENARIO, "transitions", TRANSITIONS);
        figure(SCENARIO, "wave seconds", format!("{:.1}", wave.as_secs_f64()));

        // Per backend and phase: the target changes seen (from the last decision before).
        let mut changes: BTreeMap<(&str, usize), Vec<(u32, u32)>> = BTreeMap::new();
        for pair in decisions.windows(2) {
            for b in BACKENDS {
                let (before, after) = (&pair[0].backends[b], &pair[1].backends[b]);
                if before.target != after.target {
                    changes
                        .entry((b, pair[1].phase))
                        .or_default()
                        .push((before.target, after.target));
                }
            }
        }
        let wanted_high = ((HIGH as f64 * (1.0 + MARGIN) / f64::from(ENDPOINTS)) - 1e-9).ceil() as u32;
        for ((b, phase), seen) in &changes {
            let high = is_high(*phase);
            assert!(
                *phase > 0,
                "{b} changed before the wave: {seen:?}{table}"
            );
            assert_eq!(
                seen.len(),
                1,
                "{b}: at most one change per transition, none between (phase {phase}: {seen:?}){table}"
            );
            let (from, to) = seen[0];
            if high {
                assert!(to > from, "{b} shrank under the high load: {from} → {to}{table}");
                let demand = HIGH as f64;
                assert!(
                    f64::from(to * ENDPOINTS) <= 1.3 * demand * (1.0 + MARGIN),
                    "{b} overshoots: {to} × {ENDPOINTS} for a demand of {demand} × {}{table}",
                    1.0 + MARGIN
                );
            } else {
                assert!(to < from, "{b} grew under the low load: {from} → {to}{table}");
                let floor = (f64::from(from) * (1.0 - f64::from(MAX_STEP_PERCENT) / 100.0) - 1e-9)
                    .ceil() as u32;
                assert!(
                    to >= floor,
                    "{b} shrinks by more than {MAX_STEP_PERCENT}%: {from} → {to}{table}"
                );
            }
        }
        let high_phases: Vec<usize> = (1..=TRANSITIONS).filter(|p| is_high(*p)).collect();

        // model-a, far from its knee, gets its pool at every high phase, in one step: demand ×
        // (1 + margin) for the callers it saw (a caller between two calls is not in flight).
        let nearly = (f64::from(wanted_high) * (1.0 - 0.1)).ceil() as u32;
        for p in &high_phases {
            let end = decisions
                .iter()
                .rfind(|d| d.phase == *p)
                .context("a decision in every phase")?;
            let target = end.backends["model-a"].target;
            assert!(
                (nearly..=wanted_high).contains(&target),
                "model-a ends high phase {p} at {target}, not within 10% of {wanted_high}{table}"
            );
        }
        let a_ups = changes
            .iter()
            .filter(|((b, p), _)| *b == "model-a" && is_high(*p))
            .count();
        let a_downs = changes
            .iter()
            .filter(|((b, p), _)| *b == "model-a" && !is_high(*p))
            .count();
        figure(
            SCENARIO,
            "model-a changes up / down",
            format!("{a_ups} / {a_downs} over {TRANSITIONS} transitions"),
        );
        assert!(
            decisions.iter().all(|d| !d.backends["model-a"].reason.contains("knee")),
            "model-a is never judged past a knee{table}"
        );

        // model-b: the step past its knee added no throughput; from then on it is held there.
        let found = decisions
            .iter()
            .position(|d| {
                let s = &d.backends["model-b"];
                s.action == DecisionAction::Hold
                    && (s.reason.contains("past its knee")
                        || s.reason.contains("the backend reports saturation"))
            })
            .with_context(|| format!("model-b's knee is never found{table}"))?;
        let found_at = &decisions[found];
        figure(
            SCENARIO,
            "model-b knee found",
            format!(
                "phase {}: {}",
                found_at.phase, found_at.backends["model-b"].reason
            ),
        );
        assert!(found_at.phase <= 3, "the knee is found in the first high phases{table}");
        let later_high: Vec<&Decision> = decisions[found + 1..]
            .iter()
            .filter(|d| d.high && d.backends["model-b"].demand * (1.0 + MARGIN) / f64::from(ENDPOINTS) > f64::from(d.backends["model-b"].target) * 1.1)
            .collect();
        assert!(!later_high.is_empty(), "high phases after the knee{table}");
        for d in &later_high {
            let s = &d.backends["model-b"];
            // A decision on missing data holds too (a scrape lost on a loaded machine); it must
            // never grow.
            assert!(
                s.action == DecisionAction::Hold
                    && (s.reason.contains("knee")
                        || s.reason.contains("the backend reports saturation")
                        || s.reason.contains("missing data")),
                "model-b is held at its knee with a reason in phase {}: {s:?}{table}",
                d.phase
            );
        }
        let b_ups_after = changes
            .iter()
            .filter(|((b, p), _)| *b == "model-b" && is_high(*p) && *p > found_at.phase)
            .count();
        assert_eq!(b_ups_after, 0, "model-b never grows past its knee again{table}");
        let last_b = stack.backend_status("model-b").await?;
        figure(
            SCENARIO,
            "model-b held",
            format!(
                "target {} at the end; last high decision: {}",
                last_b.target,
                later_high.last().map_or("", |d| d.backends["model-b"].reason.as_str())
            ),
        );
        // The knee is real: model-b's instances ran every slot and queued behind them.
        for b in stack.backends("model-b").await? {
            let s = b.stats().await?;
            assert_eq!(s.in_flight_peak, u64::from(KNEE_SLOTS), "{}: {s:?}", s.instance);
            assert!(s.queued_peak > 0, "{}: {s:?}", s.instance);
        }
        Ok(())
    })
    .await
}

/// Waits for the operator's next decision (model-a's `lastDecision.time` moves past `after`) and
/// returns its time and both backends as it left them.
async fn next_decision(
    stack: &Stack<'_>,
    after: Option<&Time>,
) -> anyhow::Result<(Time, BTreeMap<&'static str, Seen>)> {
    eventually("the next decision", INTERVAL * 4, || async {
        let policy = stack.policy(POLICY).await?;
        let status = policy.status.context("no status")?;
        let of = |b: &str| -> anyhow::Result<&BackendStatus> {
            status
                .backends
                .iter()
                .find(|s| s.name == b)
                .with_context(|| format!("no {b}"))
        };
        let a = of("model-a")?
            .last_decision
            .clone()
            .context("no decision yet")?;
        anyhow::ensure!(after.is_none_or(|t| a.time.0 > t.0), "no new decision");
        let mut seen = BTreeMap::new();
        for b in BACKENDS {
            let s = of(b)?;
            let d = s.last_decision.clone().context("no decision yet")?;
            anyhow::ensure!(d.time == a.time, "{b} not decided yet");
            seen.insert(
                b,
                Seen {
                    target: s.target,
                    action: d.action,
                    reason: d.reason,
                    demand: s.leased.unwrap_or_default() + s.pending.unwrap_or_default(),
                },
            );
        }
        Ok((a.time, seen))
    })
    .await
}
