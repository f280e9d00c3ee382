//! Tests of the autoscale law: the seed-1 flash crowd in one decision, the latency guard, the
//! stabilized and step-capped scale-down, the deadband, and missing data at every input.

use super::*;

fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

fn bounds(min: u32, upper: u32) -> Bounds {
    Bounds {
        min,
        upper,
        margin: 0.2,
        window: Duration::from_secs(300),
        max_step_percent: 20,
    }
}

fn sample(leased: f64, pending: f64) -> BackendSample {
    BackendSample {
        leased: Some(leased),
        pending: Some(pending),
        latency_p90: Some(0.2),
        latency_baseline: Some(0.2),
    }
}

fn memory(b: &Bounds, target: u32) -> BackendMemory {
    BackendMemory::start(Some(target), b, at(0))
}

#[test]
fn seed_one_flash_crowd_reaches_the_target_in_one_decision() {
    // Seed 1: a pool of 300 at 800 QPS; at 2200 QPS it shows 300 leased + 150 pending.
    let b = bounds(16, 560); // capacity 700 × (1 − 0.2)
    let mut mem = memory(&b, 300);
    let d = decide(&b, &mut mem, &sample(300.0, 150.0), 1, at(15));
    let Decision::ScaleUp(s) = d else {
        panic!("expected a scale-up, got {d:?}")
    };
    assert_eq!(
        (s.from, s.to),
        (300, 540),
        "450 × 1.2 in ONE step, not ×1.2 per tick"
    );
    assert_eq!(
        s.reason,
        "demand 450 (leased 300 + pending 150) × 1.2 over 1 endpoints"
    );
    assert_eq!(mem.target, 540);
    assert_eq!(mem.saturation, None);
}

#[test]
fn flash_crowd_beyond_capacity_stops_at_the_upper_bound_and_reports_saturation() {
    let b = bounds(16, 400);
    let mut mem = memory(&b, 300);
    let d = decide(&b, &mut mem, &sample(300.0, 150.0), 1, at(15));
    assert_eq!(d.scale().map(|s| s.to), Some(400));
    assert!(
        mem.saturation
            .as_deref()
            .unwrap()
            .contains("demand wants 540 per endpoint, upper bound is 400")
    );
    let d = decide(&b, &mut mem, &sample(400.0, 150.0), 1, at(30));
    assert_eq!(
        d,
        Decision::AtUpperBound {
            recommendation: 400
        }
    );
    assert!(d.saturated());
}

#[test]
fn demand_is_divided_over_the_endpoints() {
    let b = bounds(1, 560);
    let mut mem = memory(&b, 100);
    let d = decide(&b, &mut mem, &sample(300.0, 150.0), 3, at(15));
    assert_eq!(
        d.scale().map(|s| s.to),
        Some(180),
        "450 × 1.2 / 3 endpoints"
    );
}

#[test]
fn no_growth_while_backend_latency_exceeds_the_guard() {
    let b = bounds(16, 560);
    let mut mem = memory(&b, 300);
    let slow = BackendSample {
        latency_p90: Some(0.26),
        ..sample(300.0, 150.0)
    };
    let d = decide(&b, &mut mem, &slow, 1, at(15));
    assert_eq!(
        d,
        Decision::LatencyGuard {
            recommendation: 540,
            latency: 0.26,
            baseline: 0.2
        }
    );
    assert_eq!(
        mem.target, 300,
        "a bigger pool makes a saturated backend slower"
    );
    assert!(
        mem.saturation
            .as_deref()
            .unwrap()
            .starts_with("latency p90 0.26s > 1.25 × baseline 0.2s")
    );

    // Exactly at the guard growth is allowed.
    let at_guard = BackendSample {
        latency_p90: Some(0.25),
        ..sample(300.0, 150.0)
    };
    let d = decide(&b, &mut mem, &at_guard, 1, at(30));
    assert_eq!(d.scale().map(|s| s.to), Some(540));
}

#[test]
fn latency_guard_does_not_block_scale_down() {
    let b = bounds(16, 560);
    let mut mem = memory(&b, 540);
    let slow_idle = BackendSample {
        latency_p90: Some(1.0),
        ..sample(100.0, 0.0)
    };
    let d = decide(&b, &mut mem, &slow_idle, 1, at(301));
    assert_eq!(d.scale().map(|s| (s.from, s.to)), Some((540, 432)));
}

#[test]
fn scale_down_waits_for_the_window_and_is_capped_per_step() {
    let b = bounds(16, 560);
    let mut mem = memory(&b, 540); // remembered at t=0
    let idle = sample(100.0, 0.0); // recommends 120
    let mut changes = Vec::new();
    for tick in 1..=50 {
        let now = at(tick * 15);
        if let Some(s) = decide(&b, &mut mem, &idle, 1, now).scale() {
            changes.push((tick * 15, s.from, s.to));
        }
    }
    // Nothing within the first window; then at most one step of 20% per window.
    assert_eq!(changes, [(315, 540, 432), (615, 432, 346)]);
    assert!(
        mem.last_scale
            .as_ref()
            .unwrap()
            .reason
            .contains("step capped at 20%")
    );
}

#[test]
fn scale_down_follows_the_highest_recommendation_in_the_window() {
    let b = bounds(16, 560);
    let mut mem = memory(&b, 500);
    // One busy sample (recommends 480) among idle ones keeps the target near it for a window.
    decide(&b, &mut mem, &sample(400.0, 0.0), 1, at(200));
    let d = decide(&b, &mut mem, &sample(10.0, 0.0), 1, at(310));
    assert_eq!(
        d,
        Decision::Stabilizing { recommendation: 16 },
        "480 in the window is within 10% of 500"
    );
    let d = decide(&b, &mut mem, &sample(10.0, 0.0), 1, at(520));
    assert_eq!(
        d.scale().map(|s| s.to),
        Some(400),
        "480 left the window; a 20% step from 500"
    );
}

#[test]
fn changes_inside_the_deadband_are_ignored() {
    let b = bounds(16, 560);
    let mut mem = memory(&b, 300);
    // 240 × 1.2 = 288: 4% below 300.
    assert_eq!(
        decide(&b, &mut mem, &sample(240.0, 0.0), 1, at(400)),
        Decision::Steady {
            recommendation: 288
        }
    );
    // 265 × 1.2 = 318: 6% above.
    assert_eq!(
        decide(&b, &mut mem, &sample(265.0, 0.0), 1, at(415)),
        Decision::Steady {
            recommendation: 318
        }
    );
    assert_eq!(mem.target, 300);
    // 276 × 1.2 = 331.2 → 332: 10.7% above.
    let d = decide(&b, &mut mem, &sample(276.0, 0.0), 1, at(430));
    assert_eq!(d.scale().map(|s| s.to), Some(332));
}

#[test]
fn missing_data_at_every_input_holds_the_target() {
    let b = bounds(16, 560);
    let good = sample(300.0, 150.0);
    let cases: [(&str, BackendSample); 8] = [
        (
            "leased",
            BackendSample {
                leased: None,
                ..good
            },
        ),
        (
            "leased",
            BackendSample {
                leased: Some(f64::NAN),
                ..good
            },
        ),
        (
            "pending",
            BackendSample {
                pending: None,
                ..good
            },
        ),
        (
            "pending",
            BackendSample {
                pending: Some(f64::INFINITY),
                ..good
            },
        ),
        (
            "latency",
            BackendSample {
                latency_p90: None,
                ..good
            },
        ),
        (
            "latency",
            BackendSample {
                latency_p90: Some(f64::NAN),
                ..good
            },
        ),
        (
            "latency baseline",
            BackendSample {
                latency_baseline: None,
                ..good
            },
        ),
        (
            "latency baseline",
            BackendSample {
                latency_baseline: Some(0.0),
                ..good
            },
        ),
    ];
    for (what, s) in cases {
        let mut mem = memory(&b, 300);
        for tick in 1..=3 {
            let d = decide(&b, &mut mem, &s, 1, at(tick * 15));
            assert_eq!(d, Decision::MissingData { missing: what }, "{what}: {s:?}");
            assert_eq!(
                mem.target, 300,
                "{what}: missing data never changes the target"
            );
            assert_eq!(
                mem.metrics_available,
                tick < 3,
                "{what}: unavailable after the third miss"
            );
        }
        // The first fresh sample is observed but not acted on; the second one acts.
        assert_eq!(
            decide(&b, &mut mem, &good, 1, at(60)),
            Decision::Recovering { fresh: 1 }
        );
        assert_eq!(mem.target, 300);
        assert!(!mem.metrics_available);
        let d = decide(&b, &mut mem, &good, 1, at(75));
        assert_eq!(
            d.scale().map(|s| s.to),
            Some(540),
            "{what}: resumes after two fresh samples"
        );
        assert!(mem.metrics_available);
    }
}

#[test]
fn a_single_miss_also_needs_two_fresh_samples_but_keeps_metrics_available() {
    let b = bounds(16, 560);
    let mut mem = memory(&b, 300);
    decide(&b, &mut mem, &BackendSample::default(), 1, at(15));
    assert!(mem.metrics_available);
    assert!(matches!(
        decide(&b, &mut mem, &sample(300.0, 150.0), 1, at(30)),
        Decision::Recovering { .. }
    ));
    assert!(
        decide(&b, &mut mem, &sample(300.0, 150.0), 1, at(45))
            .scale()
            .is_some()
    );
}

#[test]
fn bounds_apply_even_while_data_is_missing() {
    let mut mem = memory(&bounds(16, 560), 540);
    let d = decide(
        &bounds(16, 400),
        &mut mem,
        &BackendSample::default(),
        1,
        at(15),
    );
    assert_eq!(d.scale().map(|s| (s.from, s.to)), Some((540, 400)));
    assert_eq!(
        mem.last_scale.as_ref().unwrap().reason,
        "bounds changed to [16, 400]"
    );
}

#[test]
fn fresh_memory_starts_from_the_recorded_target_or_the_upper_bound() {
    let b = bounds(16, 560);
    assert_eq!(BackendMemory::start(None, &b, at(0)).target, 560);
    assert_eq!(BackendMemory::start(Some(300), &b, at(0)).target, 300);
    assert_eq!(BackendMemory::start(Some(900), &b, at(0)).target, 560);
    assert_eq!(BackendMemory::start(Some(2), &b, at(0)).target, 16);
}

#[test]
fn decisions_are_due_once_per_interval() {
    let b = bounds(16, 560);
    let mut mem = memory(&b, 300);
    let interval = Duration::from_secs(15);
    assert!(mem.due(interval, at(0)));
    decide(&b, &mut mem, &sample(250.0, 0.0), 1, at(0));
    assert!(!mem.due(interval, at(5)));
    assert!(
        mem.due(interval, at(14)),
        "a slightly early requeue still counts"
    );
    assert!(mem.due(interval, at(15)));
}
