//! Tests of the knee guard's parts: a level's noise, what a comparison of two levels shows and
//! when its evidence suffices, which level is best and what brackets it, what a step is judged
//! for, where the guard probes, steps back or holds, and how long levels are kept.

use std::collections::BTreeMap;

use super::*;

/// No declared capacity known: batching may cost anything, a step only needs `rise^0.3`.
const WIDE: u32 = 0;

fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

/// An interval at `in_flight` per endpoint (one endpoint) giving `bytes` per second, with
/// `calls` completed in it and a time to first byte of 0.2 s.
fn obs(secs: i64, in_flight: f64, bytes: f64, calls: f64) -> Observation {
    Observation {
        duration: None,
        at: at(secs),
        in_flight,
        completed: calls / 10.0,
        bytes,
        ttfb: Some(0.2),
        calls,
        streams: 0.0,
    }
}

/// A level of `intervals` intervals at `bytes` per second each, `calls` completed in each.
fn level(in_flight: u32, bytes: f64, calls: f64, intervals: u32) -> Level {
    let mut m = KneeMemory::default();
    for i in 0..intervals {
        m.observe(obs(i64::from(i) * 10, f64::from(in_flight), bytes, calls));
    }
    m.levels[&in_flight]
}

#[test]
fn a_levels_noise_is_counted_measured_or_floored() {
    // 25 calls: 1/√25 = 20%.
    assert!((level(10, 1000.0, 25.0, 1).noise(true) - 0.2).abs() < 1e-12);
    // 4 intervals of 2500 calls: 1%, floored at 2%.
    assert_eq!(level(10, 1000.0, 2500.0, 4).noise(true), NOISE_FLOOR);
    // Streams count for bytes, not for calls.
    let mut m = KneeMemory::default();
    m.observe(Observation {
        streams: 75.0,
        ..obs(0, 10.0, 1000.0, 25.0)
    });
    let l = m.levels[&10];
    assert!((l.noise(true) - 0.1).abs() < 1e-12, "1/√100");
    assert!((l.noise(false) - 0.2).abs() < 1e-12, "1/√25");
    // Intervals that disagree more than their calls say: the spread's standard error counts.
    let mut m = KneeMemory::default();
    for (i, b) in [800.0, 1200.0, 800.0, 1200.0].into_iter().enumerate() {
        m.observe(obs(i as i64 * 10, 10.0, b, 2500.0));
    }
    let spread = m.levels[&10].noise(true);
    // sd 230.9 of a mean 1000, over √4.
    assert!((spread - 0.1155).abs() < 1e-3, "{spread}");
}

#[test]
fn a_comparison_tells_better_flat_short_worse_and_slower() {
    let l = level(10, 1000.0, 400.0, 1); // 5% noise
    let effect = |h: Level| Comparison::of(&h, &l, WIDE).effect;
    // Significant beyond 2 × √(5%² + 5%²) = 14.1%.
    assert_eq!(effect(level(20, 1800.0, 400.0, 1)), Effect::Better);
    // ×2 in flight: a healthy step gives at least 2^0.3 = 1.23. ×1.1 is within the noise of
    // that, ×1.05 short of it.
    assert_eq!(effect(level(20, 1100.0, 400.0, 1)), Effect::Flat);
    assert_eq!(effect(level(20, 1050.0, 400.0, 1)), Effect::Short);
    assert_eq!(
        effect(level(40, 1100.0, 400.0, 1)),
        Effect::Short,
        "4^0.3 = 1.52"
    );
    assert_eq!(effect(level(20, 800.0, 400.0, 1)), Effect::Worse);
    let mut slow = level(20, 1000.0, 400.0, 1);
    slow.ttfb = (0.4, 1);
    assert_eq!(
        effect(slow),
        Effect::Slower,
        "2× the first byte, no more throughput"
    );
    let mut slow_but_more = level(20, 1800.0, 400.0, 1);
    slow_but_more.ttfb = (0.4, 1);
    assert_eq!(
        effect(slow_but_more),
        Effect::Better,
        "batching: slower, but more"
    );
    // A batch that fills, on little evidence (25 calls a level: significant beyond ±56.6%):
    // the first byte 2.15× later at 2.7× the calls, and no less throughput. Slower would need
    // the first byte at least 2.7× later (calls waiting in the backend, not a batch).
    let few = level(10, 1000.0, 25.0, 1);
    let effect_few = |h: Level| Comparison::of(&h, &few, WIDE).effect;
    let mut batch = level(27, 1040.0, 25.0, 1);
    batch.ttfb = (0.43, 1);
    assert_eq!(effect_few(batch), Effect::Flat, "a batch, not a queue");
    batch.ttfb = (0.55, 1);
    assert_eq!(effect_few(batch), Effect::Slower, "2.75× the first byte");
    // Calls count where a level has no bytes.
    let mut no_bytes = level(20, 0.0, 400.0, 1);
    no_bytes.calls = Sum {
        total: 20.0,
        squares: 400.0,
    };
    let c = Comparison::of(&no_bytes, &l, WIDE);
    assert!(
        c.measure == Measure::Calls && (c.gain - 0.5).abs() < 1e-12,
        "{c:?}"
    );
    assert_eq!(
        Comparison::of(&level(20, 800.0, 400.0, 1), &l, WIDE).describe(),
        "response bytes 1 kB/s at 10 in flight per endpoint → 800 B/s at 20 (×0.8, less: significant beyond ±14.14%, 400 and 400 calls seen)"
    );
}

#[test]
fn a_flat_step_is_judged_once_its_noise_could_not_hide_a_healthy_one() {
    // ×4 in flight: a healthy step gives at least ×1.52; a flat one is told from it once the
    // significance is at most half of 0.52.
    let noisy = Comparison::of(
        &level(40, 1100.0, 16.0, 1),
        &level(10, 1000.0, 16.0, 1),
        WIDE,
    );
    assert_eq!(noisy.effect, Effect::Flat);
    assert!(!noisy.sufficient() && !noisy.no_more(), "{noisy:?}");
    let sure = Comparison::of(
        &level(40, 1100.0, 16.0, 8),
        &level(10, 1000.0, 16.0, 8),
        WIDE,
    );
    assert!(sure.sufficient() && sure.no_more(), "{sure:?}");
}

#[test]
fn the_best_level_is_the_lowest_one_not_significantly_below_the_most() {
    let mut m = KneeMemory::default();
    // 5% noise each; 10 gives 1000, 14 gives 1050 (not significantly more, nor short of a
    // healthy step), 20 gives 700.
    for (i, (c, b)) in [(10.0, 1000.0), (14.0, 1050.0), (20.0, 700.0)]
        .into_iter()
        .enumerate()
    {
        m.observe(obs(i as i64 * 10, c, b, 400.0));
    }
    let knee = m.knee().expect("20 gave less");
    assert_eq!(knee.best.in_flight, 10, "flat: the lower level");
    assert_eq!(
        knee.above.map(|a| (a.higher.in_flight, a.effect)),
        Some((20, Effect::Worse)),
        "{knee:?}"
    );
    assert_eq!(knee.below, None);
    assert_eq!(m.cap(), Some(10));
    // A backend whose throughput follows: no knee.
    let mut m = KneeMemory::default();
    for (i, c) in [4.0, 8.0, 16.0].into_iter().enumerate() {
        m.observe(obs(i as i64 * 10, c, c * 100.0, 400.0));
    }
    assert_eq!(m.knee(), None);
    // A step from below that fell short: the knee is inside it.
    let mut m = KneeMemory::default();
    m.observe(obs(0, 4.0, 400.0, 400.0));
    m.observe(obs(10, 40.0, 600.0, 400.0));
    let knee = m.knee().expect("×10 in flight, ×1.5 throughput");
    assert_eq!(knee.best.in_flight, 40);
    assert_eq!(knee.below.map(|b| b.effect), Some(Effect::Short));
}

#[test]
fn a_step_is_judged_while_its_evidence_points_to_a_knee_for_at_most_three_decisions() {
    let mut m = KneeMemory::default();
    m.observe(obs(0, 10.0, 1000.0, 16.0));
    m.stepped(10, 20, 20);
    // No interval at 20 yet: no evidence, no hold.
    assert_eq!(m.plan(20, 30, (1, 40), None), Move::Free);
    // 20 gave as much as 10, within the noise of 16 calls: judged, growth waits (decisions 2
    // and 3 of 3).
    for (i, decision) in [(1, 2), (2, 3)] {
        m.observe(obs(10 * i, 20.0, 1000.0, 16.0));
        let Move::Judging { step, so_far } = m.plan(20, 30, (1, 40), None) else {
            panic!("judging")
        };
        assert_eq!(
            (step.level, step.reference, step.decisions),
            (20, 10, decision)
        );
        assert_eq!(so_far.unwrap().effect, Effect::Flat);
    }
    // Then the comparison counts as it stands: flat, not a knee on this evidence.
    m.observe(obs(30, 20.0, 1000.0, 16.0));
    assert_eq!(m.plan(20, 30, (1, 40), None), Move::Free);
    assert_eq!(m.judging, None);
    // A step whose throughput rose as a healthy one does is never held.
    let mut m = KneeMemory::default();
    m.observe(obs(0, 10.0, 1000.0, 16.0));
    m.stepped(10, 20, 20);
    m.observe(obs(10, 20.0, 1900.0, 16.0));
    assert_eq!(m.plan(20, 30, (1, 40), None), Move::Free);
}

#[test]
fn the_guard_probes_the_bracket_then_steps_back_or_holds_at_the_peak() {
    let mut m = KneeMemory::default();
    m.observe(obs(0, 10.0, 1000.0, 400.0));
    m.observe(obs(10, 40.0, 600.0, 400.0));
    // 40 gave less than 10: probe the middle (above first), judged against 10.
    let Move::Probe { to, knee } = m.plan(40, 48, (1, 48), None) else {
        panic!("probe")
    };
    assert_eq!((to, knee.cap()), (20, 10));
    assert_eq!(m.judging.map(|j| (j.level, j.reference)), Some((20, 10)));
    // 20 gave less too: the middle of [10, 20].
    m.observe(obs(20, 20.0, 850.0, 400.0));
    assert!(matches!(
        m.plan(20, 48, (1, 48), None),
        Move::Probe { to: 14, .. }
    ));
    // 14 fell short of a healthy step (×1.4 in flight, ×0.95): [10, 14] is narrow; below 10
    // nothing is known: probe half of it.
    m.observe(obs(30, 14.0, 950.0, 400.0));
    assert!(matches!(
        m.plan(14, 48, (1, 48), None),
        Move::Probe { to: 5, .. }
    ));
    // 5 gave less than 10: the middle of [5, 10].
    m.observe(obs(40, 5.0, 600.0, 400.0));
    assert!(matches!(
        m.plan(5, 48, (1, 48), None),
        Move::Probe { to: 7, .. }
    ));
    m.observe(obs(50, 7.0, 800.0, 400.0));
    // Every bracket is narrow now. 40, 20 and 14 gave less than 10: the curve falls past it,
    // and the parabola through the levels within 3× of 10 puts its peak at 12.1 (±4.9%):
    // grow to 12, back to it from above, and hold there.
    let knee = m.knee().unwrap();
    assert!(knee.falls);
    let peak = knee.peak.unwrap();
    assert!(
        (peak.at - 12.14).abs() < 0.01 && (peak.error - 0.049).abs() < 0.001,
        "{peak:?}"
    );
    assert_eq!((knee.best.in_flight, knee.cap()), (10, 12));
    assert!(matches!(m.plan(7, 48, (1, 48), None), Move::Cap(_)));
    assert!(matches!(
        m.plan(14, 48, (1, 48), None),
        Move::Back { to: 12, .. }
    ));
    assert!(matches!(m.plan(12, 48, (1, 48), None), Move::Cap(_)));
    // Demand below the best level: the law decides.
    assert_eq!(m.plan(14, 9, (1, 48), None), Move::Free);
}

#[test]
fn levels_are_measured_anew_after_ten_minutes() {
    let mut m = KneeMemory::default();
    m.observe(obs(0, 10.0, 1000.0, 400.0));
    m.observe(obs(10, 20.0, 600.0, 400.0));
    assert!(m.knee().is_some());
    m.observe(obs(600, 20.0, 600.0, 400.0));
    assert!(m.knee().is_some(), "10 is ten minutes old, not older");
    m.observe(obs(601, 20.0, 600.0, 400.0));
    assert_eq!(m.levels.keys().copied().collect::<Vec<_>>(), [20]);
    assert_eq!(m.knee(), None);
    // Too few in flight to be a level.
    m.observe(obs(610, 0.4, 0.0, 0.0));
    assert_eq!(m.levels.len(), 1);
}

#[test]
fn a_level_the_target_holds_at_keeps_its_evidence_while_it_is_measured() {
    let mut m = KneeMemory::default();
    m.observe(obs(0, 10.0, 1000.0, 400.0));
    m.observe(obs(10, 20.0, 600.0, 400.0));
    for t in [300, 590, 700] {
        m.observe(obs(t, 10.0, 1000.0, 400.0));
    }
    // 20 was last measured 690 s ago, 10 just now.
    assert_eq!(m.levels.keys().copied().collect::<Vec<_>>(), [10]);
    assert_eq!(m.levels[&10].intervals, 4);
}

#[test]
fn a_knee_whose_evidence_above_was_forgotten_is_checked_again_by_one_step_not_the_demands_jump() {
    // 7 → 10 rose, 14 gave less than a healthy step above 10: the target is held at 10 while a
    // crowd wants 48.
    let knee_at_ten = || {
        let mut m = KneeMemory::default();
        m.observe(obs(0, 7.0, 700.0, 400.0));
        m.observe(obs(10, 10.0, 1000.0, 400.0));
        m.observe(obs(20, 14.0, 920.0, 400.0));
        let first = m.plan(10, 48, (1, 48), Some(10));
        assert!(matches!(first, Move::Cap(_)), "{first:?}");
        // Held there for more than ten minutes: 7 and 14 are forgotten, 10 measured all along.
        for t in (100..=700).step_by(100) {
            m.observe(obs(t, 10.0, 1000.0, 400.0));
        }
        assert_eq!(m.levels.keys().copied().collect::<Vec<_>>(), [10]);
        assert_eq!(m.knee(), None);
        m
    };
    let mut m = knee_at_ten();
    // One step above the best level (×1.45), judged against it; not the jump to 48.
    assert_eq!(
        m.plan(10, 48, (1, 48), Some(10)),
        Move::Recheck { to: 15, best: 10 }
    );
    let step = m.judging.expect("the probe is judged");
    assert_eq!((step.target, step.reference, step.probe), (15, 10, true));
    // It gives less than a healthy step: the knee stands again, and the target goes back
    // towards 10 (through the middle of the bracket, as after any step past a knee).
    m.observe(obs(730, 15.0, 900.0, 400.0));
    match m.plan(15, 48, (1, 48), Some(15)) {
        Move::Probe { to, knee } | Move::Back { to, knee } => {
            assert!((10..15).contains(&to), "{to}");
            assert_eq!(knee.best.in_flight, 10);
        }
        other => panic!("{other:?}"),
    }
    // A backend that gives more there now (its capacity grew): no knee, and after the probe
    // the law decides again.
    let mut m = knee_at_ten();
    assert!(matches!(
        m.plan(10, 48, (1, 48), Some(10)),
        Move::Recheck { to: 15, .. }
    ));
    m.observe(obs(730, 15.0, 1500.0, 400.0));
    assert_eq!(m.plan(15, 48, (1, 48), Some(15)), Move::Free);
    assert_eq!(m.last_best, None);
    // A knee whose best level was forgotten too (the load left) is not checked again: the crowd
    // that comes back takes the demand's step, and the guard judges that.
    let mut m = KneeMemory::default();
    m.observe(obs(0, 7.0, 700.0, 400.0));
    m.observe(obs(10, 10.0, 1000.0, 400.0));
    m.observe(obs(20, 14.0, 920.0, 400.0));
    let _ = m.plan(10, 48, (1, 48), Some(10));
    m.observe(obs(700, 2.0, 200.0, 400.0));
    assert_eq!(m.plan(2, 48, (1, 48), Some(2)), Move::Free);
}

/// Throughput per endpoint of a backend whose batch thrashes, peaking at `peak` in flight with
/// 1000 B/s: symmetric in log in-flight around the peak, as modelsim's law is.
fn thrashing(c: f64, peak: f64) -> f64 {
    let x = c / peak;
    2000.0 * x / (1.0 + x * x)
}

#[test]
fn the_peak_of_a_backend_that_thrashes_is_located_from_the_levels_on_both_sides() {
    let mut m = KneeMemory::default();
    for (i, c) in [2.0, 3.0, 5.0, 8.0, 12.0, 16.0].into_iter().enumerate() {
        m.observe(obs(i as i64 * 10, c, thrashing(c, 7.0), 2500.0));
    }
    let knee = m.knee().expect("16 gave less than 5 and 8");
    // 5 and 8 tie within their noise (946 and 991 B/s, ±2% each): the lower is the best level;
    // 16 gave 22% less than it: the curve falls.
    assert_eq!(knee.best.in_flight, 5);
    assert!(knee.falls);
    let peak = knee.peak.expect("levels on both sides of 5");
    assert!((peak.at - 7.0).abs() < 0.35, "{peak:?}");
    assert!(peak.error < PEAK_ERROR, "{peak:?}");
    assert_eq!(knee.cap(), 7);
    assert!(
        knee.evidence().ends_with(&format!(
            "; its peak, from the levels around it, is at {} per endpoint (±{}%)",
            round(peak.at),
            round(peak.error * 100.0)
        )),
        "{}",
        knee.evidence()
    );
    // The target holds at the peak, not at the best level measured (after probing the bracket
    // [5, 8] at its middle, 6, which moves the peak by less than it rounds to).
    let (end, visits) = settle(&mut m, 16, 60, |c| obs(0, c, thrashing(c, 7.0), 2500.0));
    assert_eq!(end, 7, "{visits:?}");
}

/// Follows the guard's moves from `current` for at most `decisions` intervals (each observed
/// by `interval` at its in-flight, 10 s after the last) while demand wants 40: where the target
/// ends once the guard caps it (at the cap), and how often each level was visited.
fn settle(
    m: &mut KneeMemory,
    mut current: u32,
    decisions: u32,
    interval: impl Fn(f64) -> Observation,
) -> (u32, BTreeMap<u32, u32>) {
    let mut visits = BTreeMap::new();
    let mut t = m.levels.values().map(|l| l.last).max().unwrap_or(at(0));
    for _ in 0..decisions {
        t = Timestamp::from_second(t.as_second() + 10).unwrap();
        m.observe(Observation {
            at: t,
            ..interval(f64::from(current))
        });
        *visits.entry(current).or_insert(0) += 1;
        match m.plan(current, 40, (1, 40), Some(current)) {
            Move::Measure { at, .. } => assert_eq!(at, current),
            Move::Judging { .. } => {}
            Move::Probe { to, .. } | Move::Back { to, .. } => current = to,
            Move::Cap(k) if k.cap() == current => return (current, visits),
            Move::Cap(k) => current = k.cap(),
            other => panic!("{other:?} after {visits:?}"),
        }
    }
    panic!("not capped in {decisions} decisions: {visits:?}")
}

#[test]
fn a_backend_that_stays_flat_past_its_knee_is_held_at_the_lowest_level_that_gives_the_most() {
    let mut m = KneeMemory::default();
    for (i, (c, b)) in [(5.0, 500.0), (10.0, 1000.0), (15.0, 1010.0), (24.0, 1000.0)]
        .into_iter()
        .enumerate()
    {
        m.observe(obs(i as i64 * 10, c, b, 2500.0));
    }
    let knee = m.knee().expect("15 and 24 gave no more than 10");
    assert!(!knee.falls, "no level gave 10% less than 10");
    assert_eq!((knee.best.in_flight, knee.peak, knee.cap()), (10, None, 10));
}

#[test]
fn a_lucky_interval_on_a_noisy_level_is_no_evidence() {
    let mut m = KneeMemory::default();
    m.observe(obs(0, 10.0, 1000.0, 400.0));
    // 9 calls: noise 1/√9 = 33%, more than 25%.
    m.observe(obs(10, 14.0, 2000.0, 9.0));
    m.observe(obs(20, 20.0, 700.0, 400.0));
    let knee = m.knee().expect("20 gave less than 10");
    assert_eq!(
        knee.best.in_flight, 10,
        "14's one lucky interval counts for nothing"
    );
    assert_eq!(
        knee.above.map(|a| (a.higher.in_flight, a.effect)),
        Some((20, Effect::Worse))
    );
}

#[test]
fn an_uncertain_peak_is_measured_at_the_levels_around_it_then_held() {
    let mut m = KneeMemory::default();
    // Few calls per interval: the levels around the best one are noisy, and so is the peak.
    let mut t = 0;
    let mut at = |m: &mut KneeMemory, c: f64| {
        t += 10;
        m.observe(obs(t, c, thrashing(c, 8.0), 30.0));
    };
    for c in [4.0, 8.0, 8.0, 8.0, 16.0, 32.0] {
        at(&mut m, c);
    }
    let knee = m.knee().expect("16 and 32 gave less");
    assert!(knee.falls);
    assert!(knee.peak.is_none_or(|p| p.error > PEAK_ERROR), "{knee:?}");
    // The levels around the peak are measured (the noisier of those 2× below and above it,
    // staying there while it is the noisier) until each has 8 intervals or the peak is known,
    // then the target holds at the peak.
    let (current, visits) = settle(&mut m, 8, 60, |c| obs(0, c, thrashing(c, 8.0), 30.0));
    assert!(
        visits.values().any(|v| *v > 1),
        "a level was measured over several intervals: {visits:?}"
    );
    let knee = m.knee().unwrap();
    assert!(
        visits.values().all(|v| *v <= REFINE_INTERVALS),
        "each level around the peak measured at most {REFINE_INTERVALS} times: {visits:?}"
    );
    assert_eq!(knee.cap(), current, "{visits:?}");
    assert!(
        (6..=10).contains(&current),
        "held near 8: {current}, {knee:?}"
    );
}

/// The memory of the cluster's long-calls run held at the backend's queue: the light load at 1
/// per endpoint, the target held at 9 (what the backend served at once when its queue showed),
/// and one interval at 17 measured while the calls queued in the backend drained after a step
/// back, higher than 9 by luck.
fn held_at_the_queue(at_nine: f64) -> KneeMemory {
    let mut m = KneeMemory {
        capacity: 64,
        max_step_percent: 50,
        ceiling: Some(Ceiling::read(20.0, 11.0, at(20))),
        ..KneeMemory::default()
    };
    m.observe(obs(0, 1.0, 200.0, 30.0));
    m.observe(obs(30, 17.0, 1200.0, 60.0));
    for t in [40, 50, 60, 70] {
        m.observe(obs(t, 9.0, at_nine, 60.0));
    }
    m
}

#[test]
fn a_level_above_what_the_backend_serves_at_once_is_never_the_best_one() {
    let m = held_at_the_queue(1000.0);
    let knee = m.knee().expect("the backend's queue");
    assert_eq!(knee.ceiling.map(|c| c.level), Some(9));
    assert_eq!(
        knee.best.in_flight, 9,
        "17 is 9 calls served and 8 queued in the backend: {knee:?}"
    );
    assert_eq!(knee.cap(), 9);
}

#[test]
fn a_knee_known_only_from_the_backends_queue_is_probed_below_once() {
    // Held at what the backend serves at once: whether it gives more below (a batch that
    // thrashes as it fills) is probed, within maxStepPercent (50%: 5, not the middle 3 of
    // [1, 9]).
    let mut m = held_at_the_queue(1000.0);
    let Move::Probe { to, knee } = m.plan(9, 24, (2, 25), Some(9)) else {
        panic!("a probe below the queue's level")
    };
    assert_eq!((to, knee.best.in_flight), (5, 9));
    assert_eq!(
        m.judging.map(|j| (j.level, j.reference, j.probe)),
        Some((5, 9, true))
    );
    // A backend that gives less below: back at 9, and not probed again while 5 is remembered.
    for t in [80, 90, 100] {
        m.observe(obs(t, 5.0, 600.0, 60.0));
    }
    let mv = m.plan(5, 24, (2, 25), Some(5));
    assert!(matches!(mv, Move::Cap(k) if k.cap() == 9), "{mv:?}");
    m.observe(obs(110, 9.0, 1000.0, 60.0));
    let mv = m.plan(9, 24, (2, 25), Some(9));
    assert!(matches!(mv, Move::Cap(k) if k.cap() == 9), "{mv:?}");
    // A backend that thrashes gives more at 5: its own knee now, probed between 5 and 9.
    let mut m = held_at_the_queue(1000.0);
    m.plan(9, 24, (2, 25), Some(9));
    for t in [80, 90, 100] {
        m.observe(obs(t, 5.0, 1250.0, 60.0));
    }
    let mv = m.plan(5, 24, (2, 25), Some(5));
    let Move::Probe { to: 7, knee } = mv else {
        panic!("the middle of [5, 9]: {mv:?}")
    };
    assert_eq!(knee.best.in_flight, 5);
    assert!(knee.own() && !knee.queue_alone(), "{knee:?}");
    // A new reading below every level measured but the light load's: those levels were
    // calls served and queued, no evidence; the reading alone caps, at what it serves at once.
    let mut m = held_at_the_queue(1000.0);
    m.ceiling = Some(Ceiling::read(20.0, 14.0, at(75)));
    let knee = m.knee().expect("the backend's queue");
    assert_eq!((knee.best.in_flight, knee.cap()), (1, 6), "{knee:?}");
    assert!(!knee.own() && !knee.measured_above, "{knee:?}");
    let mv = m.plan(9, 24, (2, 25), Some(9));
    assert!(matches!(mv, Move::Back { to: 6, .. }), "{mv:?}");
}

#[test]
fn a_queue_far_above_the_light_loads_level_is_measured_before_anything_below_it_is_probed() {
    // The light load at 4 per endpoint is the only level measured; the crowd's step filled the
    // backend's queue, which says it serves about 27 at once. Below the light load's level there
    // is nothing to learn (the crowd waits): the target goes to the queue's level first, even
    // from within the deadband above it, where no level is evidence.
    let mut m = KneeMemory {
        capacity: 76,
        max_step_percent: 20,
        ceiling: Some(Ceiling::read(29.0, 2.0, at(20))),
        ..KneeMemory::default()
    };
    for t in [0, 10, 20] {
        m.observe(obs(t, 4.0, 100.0, 40.0));
    }
    let knee = m.knee().expect("the backend's queue");
    assert_eq!(
        (knee.best.in_flight, knee.unmeasured_ceiling()),
        (4, Some(27))
    );
    assert!(knee.queue_alone() && knee.cap() == 27, "{knee:?}");
    let mv = m.plan(29, 63, (1, 78), Some(29));
    assert!(matches!(mv, Move::Back { to: 27, .. }), "{mv:?}");
    // Measured there, and more than the light load: the queue's level is the best, and whether
    // a batch that thrashes gives more below it is probed once.
    for t in [60, 70, 80] {
        m.observe(obs(t, 27.0, 400.0, 40.0));
    }
    let mv = m.plan(27, 63, (1, 78), Some(27));
    let Move::Probe { to, knee } = mv else {
        panic!("a probe below the queue's level: {mv:?}")
    };
    assert_eq!(
        (to, knee.best.in_flight, knee.unmeasured_ceiling()),
        (22, 27, None)
    );
}

#[test]
fn a_probe_below_a_small_best_level_reaches_a_level_it_can_be_compared_with() {
    // Best at 7, nothing measured below it but the light load's 1, maxStepPercent 20%: 20%
    // below 7 is 6 (rounded up), closer than 1.2× and never compared; the probe goes to 5.
    let mut m = KneeMemory {
        capacity: 20,
        max_step_percent: 20,
        ceiling: Some(Ceiling::read(9.5, 2.0, at(20))),
        ..KneeMemory::default()
    };
    m.observe(obs(0, 1.0, 100.0, 40.0));
    for t in [30, 40, 50] {
        m.observe(obs(t, 7.0, 500.0, 40.0));
    }
    let mv = m.plan(7, 15, (1, 15), Some(7));
    let Move::Probe { to, knee } = mv else {
        panic!("a probe below the queue's level: {mv:?}")
    };
    assert_eq!((to, knee.best.in_flight), (5, 7));
}

#[test]
fn no_level_above_what_the_backend_serves_at_once_is_probed_or_measured() {
    // A batch that thrashes, peaking at 5, measured on few calls per interval (its peak stays
    // uncertain, and the levels 2× around it are measured, 10 among them): 60 decisions never go
    // above the 9 the backend served at once when its queue showed.
    let mut m = held_at_the_queue(thrashing(9.0, 5.0));
    // And 10, measured on the way down as the backend drained its queue.
    m.observe(obs(35, 10.0, 900.0, 30.0));
    let mut current = 9;
    let mut visited = BTreeMap::new();
    for i in 0..60 {
        let c = f64::from(current);
        m.observe(obs(80 + i * 10, c, thrashing(c, 5.0), 12.0));
        *visited.entry(current).or_insert(0) += 1;
        current = match m.plan(current, 24, (2, 25), Some(current)) {
            Move::Probe { to, .. } | Move::Back { to, .. } | Move::Recheck { to, .. } => to,
            Move::Measure { at, .. } => at,
            Move::Cap(k) => k.cap().min(24),
            Move::Judging { .. } | Move::Free => current,
        };
        assert!(current <= 9, "decision {i}: {current}, after {visited:?}");
    }
    assert!(visited.len() > 1, "levels below 9 probed: {visited:?}");
}

#[test]
fn a_curve_that_falls_past_its_most_throughput_has_a_peak_even_within_a_tie_of_its_best_level() {
    // Peaks at 5: 4 ties with it (2.4% less) and is the best level; 8 gives 10.1% less than 5
    // but only 7.9% less than 4. The fall is measured from the most throughput: the peak is
    // located, and the target held there rather than at the lowest level within a tie.
    let mut m = KneeMemory::default();
    for (i, c) in [3.0, 4.0, 5.0, 6.0, 8.0].into_iter().enumerate() {
        m.observe(obs(i as i64 * 10, c, thrashing(c, 5.0), 2500.0));
    }
    let knee = m.knee().expect("8 gave less than 5");
    assert_eq!(knee.best.in_flight, 4, "{knee:?}");
    assert!(knee.falls, "{knee:?}");
    let peak = knee.peak.expect("levels on both sides of 4");
    assert!((peak.at - 5.0).abs() < 0.5, "{peak:?}");
    assert_eq!(knee.cap(), 5);
}

/// An interval at `in_flight` on one endpoint completing `rate` calls a second, each taking
/// `duration` seconds (bytes in proportion).
fn timed(secs: i64, in_flight: f64, rate: f64, duration: f64) -> Observation {
    Observation {
        duration: Some(duration),
        calls: rate * 10.0,
        ..obs(secs, in_flight, rate * 1000.0, rate * 10.0)
    }
}

/// A light load at 1 in flight whose calls took `light` seconds, then a flat top: 4, 5 and 6
/// in flight within 2% of each other (calls taking in-flight ÷ throughput), as the cluster's
/// long calls measured them.
fn flat_top(light: f64) -> KneeMemory {
    let mut m = KneeMemory {
        capacity: 12,
        max_step_percent: 50,
        ..KneeMemory::default()
    };
    let mut t = 0;
    let mut add = |m: &mut KneeMemory, c: f64, rate: f64, n: usize| {
        for _ in 0..n {
            t += 10;
            m.observe(timed(t, c, rate, c / rate));
        }
    };
    add(&mut m, 1.0, 1.0 / light, 5);
    add(&mut m, 4.0, 0.566, 5);
    add(&mut m, 6.0, 0.566, 4);
    add(&mut m, 5.0, 0.577, 4);
    m
}

#[test]
fn a_probe_below_the_best_level_goes_no_lower_than_a_level_that_may_give_as_much() {
    // Calls took 4.4 s alone: at 2 in flight the backend gives at most 2 ÷ 4.4 s (0.45 calls/s,
    // less their noise), short of 90% of the 0.57 at 4; at 3, up to 0.68. The probe below the
    // best level (the middle of [1, 4] is 2) goes to 3.
    let mut m = flat_top(4.4);
    let knee = m.knee().expect("6 gave no more than 4");
    assert_eq!(knee.best.in_flight, 4, "{knee:?}");
    let most = m.most_at(2).expect("1 timed its calls");
    assert!(most < 0.566 * (1.0 - TIE), "{most}");
    let mv = m.plan(5, 20, (2, 25), Some(5));
    assert!(matches!(mv, Move::Probe { to: 3, .. }), "{mv:?}");
    // Calls that took 7 s alone (as long as at 4: the backend does not slow as it fills): no
    // level below 4 can give 90% of it, and none is probed: the target holds at 4.
    let mut m = flat_top(7.0);
    let mv = m.plan(4, 20, (2, 25), Some(4));
    assert!(matches!(mv, Move::Cap(k) if k.cap() == 4), "{mv:?}");
}
