//! Tests of the knee guard's parts: a step's gradient and knee, which interval a step is judged
//! from, what is remembered and for how long, and latency at a comparable in-flight.

use super::*;

fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

/// An interval at `in_flight` per endpoint completing `completed` calls/s of 1 kB each.
fn obs(secs: i64, in_flight: f64, completed: f64) -> Observation {
    Observation {
        at: at(secs),
        in_flight,
        completed,
        bytes: completed * 1000.0,
        ttfb: Some(0.1),
        calls: completed * 30.0,
    }
}

const INTERVAL: Duration = Duration::from_secs(15);
/// A declared capacity so large that batching allows nothing: only flat steps fall short.
const WIDE: u32 = 1_000_000;

#[test]
fn a_step_that_doubles_throughput_has_gradient_one_and_a_flat_one_zero() {
    let up = Step {
        from: obs(0, 10.0, 10.0),
        to: obs(15, 20.0, 20.0),
    };
    assert!((up.gradient() - 1.0).abs() < 1e-12);
    assert_eq!(up.knee(), 20.0, "no knee inside a step that scaled");
    let flat = Step {
        from: obs(0, 10.0, 10.0),
        to: obs(15, 20.0, 10.0),
    };
    assert!(flat.gradient().abs() < 1e-12);
    assert_eq!(flat.knee(), 10.0);
    let half = Step {
        from: obs(0, 10.0, 10.0),
        to: obs(15, 20.0, 13.0),
    };
    assert_eq!(
        half.knee(),
        13.0,
        "the in-flight that makes 13/s at 1 s per call"
    );
    let fell = Step {
        from: obs(0, 10.0, 10.0),
        to: obs(15, 20.0, 5.0),
    };
    assert!(fell.gradient() < 0.0);
    assert_eq!(fell.knee(), 10.0, "never below the reference");
}

#[test]
fn a_step_falls_short_below_what_batching_at_the_declared_capacity_allows() {
    // 3 → 15 in flight per endpoint, throughput ×2: every call produced 60% less.
    let step = Step {
        from: obs(0, 3.0, 7.5),
        to: obs(15, 15.0, 15.0),
    };
    // With 32 declared slots, batching from 3 to 15 busy costs a call at most
    // (1 + 2·3/32) / (1 + 2·15/32) = 0.61 of its throughput: ×5 × 0.61 / 1.25 = ×2.45.
    assert!(
        (step.expected(32) - 2.452).abs() < 1e-3,
        "{}",
        step.expected(32)
    );
    assert_eq!(step.knee(), 6.0, "×2 from 3: 6 calls' worth");
    let mut m = KneeMemory::default();
    m.observe(step.from, INTERVAL, 32);
    let knee = m.observe(step.to, INTERVAL, 32).expect("short of ×2.45");
    assert_eq!(knee.cap(), 6);
    // A server batching like the declared one (3× as slow with all 32 slots busy) does not.
    let batching = Step {
        from: obs(0, 3.0, 3.0 / 1.1875),
        to: obs(15, 15.0, 15.0 / 1.9375),
    };
    assert!(batching.gain() > batching.expected(32) * 1.2);
    // Above the declared capacity batching allows everything; flat still falls short.
    let beyond = Step {
        from: obs(0, 40.0, 40.0),
        to: obs(15, 60.0, 41.0),
    };
    assert!((beyond.expected(32) - 1.5f64.powf(FLAT_GRADIENT)).abs() < 1e-12);
    assert!(beyond.gain() < beyond.expected(32));
}

#[test]
fn bytes_rising_with_in_flight_is_throughput_even_when_calls_per_second_are_flat() {
    // Twice the calls in flight, outputs twice as long: as many calls per second, twice the
    // bytes. The backend did twice the work.
    let longer = Step {
        from: obs(0, 10.0, 10.0),
        to: Observation {
            bytes: 20_000.0,
            ..obs(15, 20.0, 10.0)
        },
    };
    assert!((longer.gradient() - 1.0).abs() < 1e-12);
    assert_eq!(
        longer.describe(),
        "in flight 10 → 20 per endpoint (×2), completed calls 10 → 10/s (×1), response bytes 10 kB → 20 kB/s (×2)"
    );
}

#[test]
fn a_step_is_judged_from_the_latest_interval_with_clearly_fewer_calls_in_flight() {
    let mut m = KneeMemory::default();
    assert_eq!(m.observe(obs(0, 4.0, 4.0), INTERVAL, WIDE), None);
    assert_eq!(m.observe(obs(15, 9.0, 9.0), INTERVAL, WIDE), None);
    // 12 is not 1.5 × 9: the step from 4 is judged (and rose).
    assert_eq!(
        m.step_to(&obs(30, 12.0, 12.0), INTERVAL).map(|s| s.from.at),
        Some(at(0))
    );
    // 13.5 is: the step from 9.
    assert_eq!(
        m.step_to(&obs(30, 13.5, 9.0), INTERVAL).map(|s| s.from.at),
        Some(at(15))
    );
    assert!(
        m.observe(obs(30, 13.5, 9.0), INTERVAL, WIDE).is_some(),
        "9 → 13.5 in flight, no more throughput"
    );
    // Too few calls to judge, either side.
    let few = |secs, c: f64| Observation {
        calls: MIN_CALLS - 1.0,
        ..obs(secs, c, c)
    };
    let mut m = KneeMemory::default();
    m.observe(few(0, 4.0), INTERVAL, WIDE);
    assert_eq!(m.step_to(&obs(15, 20.0, 4.0), INTERVAL), None);
    assert_eq!(m.step_to(&few(15, 20.0), INTERVAL), None);
    // Too old a reference.
    let mut m = KneeMemory::default();
    m.observe(obs(0, 4.0, 4.0), INTERVAL, WIDE);
    let late = 15 * i64::from(REFERENCE_INTERVALS) + 15;
    assert_eq!(m.step_to(&obs(late, 20.0, 4.0), INTERVAL), None);
}

#[test]
fn the_knee_is_forgotten_when_the_backend_takes_more_or_after_ten_minutes() {
    let learn = || {
        let mut m = KneeMemory::default();
        m.observe(obs(0, 10.0, 10.0), INTERVAL, WIDE);
        let knee = m
            .observe(obs(15, 20.0, 10.0), INTERVAL, WIDE)
            .expect("flat");
        assert_eq!(m.knee, Some(knee));
        m
    };
    // Beyond the knee with a quarter more throughput: the backend takes more now.
    let mut m = learn();
    m.observe(obs(30, 12.0, 12.4), INTERVAL, WIDE);
    assert!(m.knee.is_some(), "×1.24 is not enough");
    m.observe(obs(45, 12.0, 12.5), INTERVAL, WIDE);
    assert_eq!(m.knee, None, "×1.25 beyond the knee");
    // Near the knee, more throughput proves nothing about beyond it.
    let mut m = learn();
    m.observe(obs(30, 10.5, 20.0), INTERVAL, WIDE);
    assert!(m.knee.is_some());
    // Ten minutes on, it is measured again.
    let mut m = learn();
    m.observe(obs(15 + 600, 10.0, 10.0), INTERVAL, WIDE);
    assert!(m.knee.is_some());
    m.observe(obs(15 + 601, 10.0, 10.0), INTERVAL, WIDE);
    assert_eq!(m.knee, None);
    assert!(
        m.observations.iter().all(|o| o.at >= at(15)),
        "older intervals are dropped too"
    );
}

#[test]
fn growth_stops_at_a_known_knee_and_is_held_from_there() {
    let mut m = KneeMemory::default();
    m.observe(obs(0, 10.0, 10.0), INTERVAL, WIDE);
    let knee = m.observe(obs(15, 20.0, 10.4), INTERVAL, WIDE).unwrap();
    assert_eq!(knee.cap(), 11);
    assert_eq!(
        m.judge(None, Some(knee), 20, 30, 100),
        Verdict::Hold(Hold::StepFellShort(knee))
    );
    assert_eq!(m.judge(None, None, 8, 30, 100), Verdict::Grow(11));
    assert_eq!(m.judge(None, None, 8, 10, 100), Verdict::Grow(10));
    assert_eq!(
        m.judge(None, None, 11, 30, 100),
        Verdict::Hold(Hold::AtKnee(knee))
    );
}

#[test]
fn latency_is_compared_at_a_comparable_in_flight_and_only_near_the_declared_capacity() {
    let with_ttfb = |secs, c: f64, ttfb| Observation {
        ttfb: Some(ttfb),
        ..obs(secs, c, c)
    };
    let mut m = KneeMemory::default();
    m.observe(with_ttfb(0, 30.0, 0.1), INTERVAL, WIDE);
    m.observe(with_ttfb(15, 60.0, 0.3), INTERVAL, WIDE);
    let now = with_ttfb(30, 55.0, 0.25);
    m.observe(now, INTERVAL, WIDE);
    // 55 compares with 60 (within 20%), not with 30: 0.25 s against 0.3 s, not against 0.1 s.
    assert_eq!(m.comparable(&now).map(|o| o.at), Some(at(15)));
    assert_eq!(m.judge(Some(&now), None, 60, 80, 100), Verdict::Grow(80));
    let slow = with_ttfb(45, 58.0, 0.6);
    m.observe(slow, INTERVAL, WIDE);
    assert!(matches!(
        m.judge(Some(&slow), None, 60, 80, 100),
        Verdict::Hold(Hold::SlowerAtSameLoad { .. })
    ));
    assert_eq!(
        m.judge(Some(&slow), None, 60, 80, 117),
        Verdict::Grow(80),
        "58 in flight is under half of 117"
    );
}
