//! The pool's idle timeout kept under the backend's keep-alive. A backend that closes idle
//! connections sooner than `pool.idleTimeout` says makes the gateway find pooled connections
//! closed (a new connection, and handshake, for the call) or, when the backend's close and a
//! request cross on the wire, lose the request: a call that is not safe to send twice gets a
//! 502. The gateway must close first. The gateways report how long each connection the backend
//! closed had been idle (`poolpilot_pool_peer_closed_idle_seconds`); the operator lowers the
//! idle timeout the pods run under the least of those times:
//!
//! ```text
//!  findings   p, the 5th percentile of the idle times at which the gateways found connections
//!             closed by the backend over the last ten sampling windows (present only when
//!             they found some; `prom::FINDINGS_WINDOWS`: a pod makes only its first few). The
//!             backend's keep-alive k is at most every finding, and the gateway finds a close
//!             at the next lease or reaper pass (every quarter of the idle timeout, at most
//!             1 s) after it happened
//!  lowered    in force = max(FLOOR, HEADROOM × p), rounded down to 10 ms, when that is below
//!             the idle timeout in force. The histogram's buckets are 1.5× apart and the
//!             quantile interpolates inside one, so p < 1.5 × the least finding f; with f
//!             within 10% of k (a close found within a tenth of the keep-alive) that is
//!             0.6 × 1.5 × 1.1 k ≈ 0.99 k < k. Findings later than that lower it further on
//!             the next rounds: each lowering shortens the reaper's period too
//!  kept       without findings the lowered value stays (the gateway now closes first, so none
//!             come) for RETRY_AFTER × 2^tries (at most MAX_RETRY_WAIT) after the last round
//!             that had findings
//!  tried      then the spec's value is in force again. A lowering can be wrong for good: a
//!             backend restarted in place closes connections of every age, and its youngest
//!             teach a timeout its keep-alive never asked for; a backend may lengthen its
//!             keep-alive. Trying costs little: each gateway pod keeps an endpoint's
//!             connections idle for less from the first close it finds there
//!             (gateway/src/pool/keep_alive.rs), so a keep-alive still short shows in a few
//!             closes and the next rounds lower the value again; that lowering counts a try
//!             (the next wait doubles), and a try quiet for RETRY_AFTER forgets the count
//!  edited     an edit of `pool.idleTimeout` starts over from the new value
//! ```
//!
//! Only the policy's own reconcile lowers or tries again (it tells it in an Event); a run for
//! another policy plans with the value in force.

use std::time::Duration;

use super::time::{Timestamp, elapsed};

/// The idle timeout in force is this share of the backend's closing time.
pub const HEADROOM: f64 = 0.6;
/// The idle timeout is never lowered below this: a backend that closes connections sooner makes
/// pooling moot, and the closes go on (the status says so).
pub const FLOOR: Duration = Duration::from_millis(100);
/// A lowered value is kept this long after the last finding before the spec's value is tried
/// again (doubled for each try in a row that the backend's closes ended).
pub const RETRY_AFTER: Duration = Duration::from_secs(3600);
/// The longest wait before a try, however many tries in a row ended lowered.
pub const MAX_RETRY_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A backend's idle timeout as the pods run it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdleTimeout {
    /// The spec's `pool.idleTimeout`.
    pub configured: Duration,
    /// What the pods run: the spec's value, or lower.
    pub in_force: Duration,
    /// Why it is lower, when it is.
    pub lowered: Option<Lowered>,
    /// Tries of the spec's value in a row that the backend's closes ended (the wait before the
    /// next one is `RETRY_AFTER × 2^tries`).
    pub tries: u32,
    /// The spec's value tried again, while the try is young enough that a lowering ends it.
    pub tried: Option<Tried>,
}

/// Why an idle timeout is lower than the spec's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lowered {
    /// The 5th percentile of the idle times at which the gateways found connections closed by
    /// the backend, seconds, when it was last lowered.
    pub closed_after: f64,
    /// When it was last lowered.
    pub at: Timestamp,
    /// The last round whose findings were present (lowering or not).
    pub last_finding: Timestamp,
    /// Whether this run lowered it (an Event tells).
    pub now: bool,
}

/// The spec's value in force again after a lowering.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tried {
    /// When.
    pub at: Timestamp,
    /// The lowered value it replaced.
    pub from: Duration,
    /// How long the lowered value had gone without findings.
    pub quiet: Duration,
    /// Whether this run tried it (an Event tells).
    pub now: bool,
}

impl IdleTimeout {
    /// The spec's value, in force.
    pub fn configured(configured: Duration) -> Self {
        Self {
            configured,
            in_force: configured,
            lowered: None,
            tries: 0,
            tried: None,
        }
    }

    /// How long a lowered value stays without findings before the spec's value is tried again.
    pub fn retry_wait(&self) -> Duration {
        let doubled = RETRY_AFTER.saturating_mul(1u32 << self.tries.min(16));
        doubled.min(MAX_RETRY_WAIT)
    }

    /// The idle timeout this run: `last` (remembered, or restored from status) lowered under
    /// `closed_after`, the 5th percentile of the idle times at which the gateways found the
    /// backend's closes (`None`: none found in the window), or back to the spec's value after
    /// [`IdleTimeout::retry_wait`] without findings. `own`: this is the policy's own reconcile
    /// (otherwise the value in force is kept as it is). A `last` made for another spec value
    /// is dropped.
    pub fn next(
        configured: Duration,
        last: Option<IdleTimeout>,
        closed_after: Option<f64>,
        own: bool,
        now: Timestamp,
    ) -> Self {
        let mut next = match last {
            Some(l) if l.configured == configured => IdleTimeout {
                lowered: l.lowered.map(|w| Lowered { now: false, ..w }),
                tried: l.tried.map(|t| Tried { now: false, ..t }),
                ..l
            },
            _ => Self::configured(configured),
        };
        if !own {
            return next;
        }
        // A try that stayed quiet long enough: the backend lets connections idle that long.
        if next
            .tried
            .is_some_and(|t| elapsed(t.at, now) >= RETRY_AFTER)
        {
            next.tried = None;
            next.tries = 0;
        }
        let Some(p) = closed_after.filter(|p| p.is_finite() && *p > 0.0) else {
            if let Some(l) = next.lowered
                && elapsed(l.last_finding, now) >= next.retry_wait()
            {
                next.tried = Some(Tried {
                    at: now,
                    from: next.in_force,
                    quiet: elapsed(l.last_finding, now),
                    now: true,
                });
                next.in_force = configured;
                next.lowered = None;
            }
            return next;
        };
        if let Some(l) = &mut next.lowered {
            l.last_finding = now;
        }
        // In hundredths of a second, rounded down (the epsilon keeps 0.6 × 2.05 at 1.23).
        let centis = (HEADROOM * p * 100.0 + 1e-9).floor().min(8_640_000.0);
        let under = Duration::from_millis(centis as u64 * 10).max(FLOOR);
        if under < next.in_force {
            if next.tried.take().is_some() {
                next.tries = next.tries.saturating_add(1);
            }
            next.in_force = under;
            next.lowered = Some(Lowered {
                closed_after: p,
                at: now,
                last_finding: now,
                now: true,
            });
        }
        next
    }

    /// Whether the backend closes connections sooner than even [`FLOOR`] allows for: the
    /// closes go on.
    pub fn at_floor(&self) -> bool {
        self.lowered.is_some_and(|l| {
            self.in_force == FLOOR && HEADROOM * l.closed_after < FLOOR.as_secs_f64()
        })
    }

    /// The lowering in words, for the Event (`idleTimeout 30s → 1230ms: …`).
    pub fn describe(&self) -> Option<String> {
        let l = self.lowered?;
        let floor = if self.at_floor() {
            " (its floor: the backend closes sooner than pooling can use, and its closes go on)"
        } else {
            ""
        };
        let retry = poolpilot_api::Duration::from(self.retry_wait());
        Some(format!(
            "idleTimeout {} → {}{floor}: the gateways found connections closed by the backend after {} s idle (5th percentile), so the gateway closes them first; the spec's value is tried again after {retry} without such closes",
            poolpilot_api::Duration::from(self.configured),
            poolpilot_api::Duration::from(self.in_force),
            (l.closed_after * 100.0).round() / 100.0,
        ))
    }

    /// The try of the spec's value in words, for the Event (`idleTimeout 1230ms → 30s: …`).
    pub fn describe_try(&self) -> Option<String> {
        let t = self.tried?;
        Some(format!(
            "idleTimeout {} → {}: the gateways found no connection closed by the backend for {}, so the spec's value is tried again (each gateway pod keeps an endpoint's connections idle for less from the first close it finds there, and the operator lowers it again if closes come back)",
            poolpilot_api::Duration::from(t.from),
            poolpilot_api::Duration::from(self.configured),
            poolpilot_api::Duration::from(Duration::from_secs(t.quiet.as_secs())),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    const SPEC: Duration = Duration::from_secs(30);

    #[test]
    fn without_findings_the_specs_value_is_in_force() {
        let t = IdleTimeout::next(SPEC, None, None, true, at(0));
        assert_eq!(t, IdleTimeout::configured(SPEC));
        assert_eq!(t.describe(), None);
        let nan = IdleTimeout::next(SPEC, None, Some(f64::NAN), true, at(0));
        assert_eq!(nan.in_force, SPEC, "a NaN quantile is no finding");
    }

    #[test]
    fn a_backend_closing_sooner_gets_an_idle_timeout_under_its_keep_alive() {
        // Closes found after 2.05 s idle (a keep-alive of 2 s, the quantile inside its bucket).
        let t = IdleTimeout::next(SPEC, None, Some(2.05), true, at(10));
        assert_eq!(t.in_force, Duration::from_millis(1230));
        assert!(t.in_force < Duration::from_secs(2));
        let l = t.lowered.unwrap();
        assert_eq!((l.closed_after, l.at, l.now), (2.05, at(10), true));
        let text = t.describe().unwrap();
        assert!(text.starts_with("idleTimeout 30s → 1230ms"), "{text}");
        assert!(text.contains("after 2.05 s idle"), "{text}");
    }

    #[test]
    fn the_lowered_value_stays_without_findings_and_only_goes_lower() {
        let first = IdleTimeout::next(SPEC, None, Some(4.0), true, at(0));
        assert_eq!(first.in_force, Duration::from_millis(2400));
        // The gateway closes first now: no findings, and the value stays, told once.
        let quiet = IdleTimeout::next(SPEC, Some(first), None, true, at(10));
        assert_eq!(quiet.in_force, first.in_force);
        assert!(
            !quiet.lowered.unwrap().now,
            "no Event for a value that stayed"
        );
        assert_eq!(quiet.lowered.unwrap().at, at(0));
        // A finding above it (a close found late) does not raise it.
        let late = IdleTimeout::next(SPEC, Some(quiet), Some(9.0), true, at(20));
        assert_eq!(late.in_force, first.in_force);
        assert!(!late.lowered.unwrap().now);
        // Findings still under it (the reaper now looks more often) lower it further.
        let lower = IdleTimeout::next(SPEC, Some(late), Some(2.6), true, at(30));
        assert_eq!(lower.in_force, Duration::from_millis(1560));
        assert!(lower.lowered.unwrap().now);
    }

    #[test]
    fn an_hour_without_findings_tries_the_specs_value_again_and_a_quiet_try_keeps_it() {
        // A restart closed connections of every age: the youngest taught 0.3 s.
        let lowered = IdleTimeout::next(SPEC, None, Some(0.3), true, at(0));
        assert_eq!(lowered.in_force, Duration::from_millis(180));
        assert!(
            lowered
                .describe()
                .unwrap()
                .ends_with("the spec's value is tried again after 1h without such closes")
        );
        // Findings in the window (the same closes) keep the clock from running.
        let seen = IdleTimeout::next(SPEC, Some(lowered), Some(0.3), true, at(300));
        assert_eq!(seen.lowered.unwrap().last_finding, at(300));
        let waiting = IdleTimeout::next(SPEC, Some(seen), None, true, at(300 + 3599));
        assert_eq!(waiting.in_force, Duration::from_millis(180));
        assert_eq!(waiting.tried, None);
        let tried = IdleTimeout::next(SPEC, Some(waiting), None, true, at(300 + 3600));
        assert_eq!(tried.in_force, SPEC);
        assert_eq!(tried.lowered, None);
        let t = tried.tried.unwrap();
        assert_eq!(
            (t.from, t.quiet, t.now),
            (Duration::from_millis(180), RETRY_AFTER, true)
        );
        assert!(
            tried
                .describe_try()
                .unwrap()
                .starts_with("idleTimeout 180ms → 30s: the gateways found no connection closed by the backend for 1h"),
            "{:?}",
            tried.describe_try()
        );
        // The backend was restarted, not short: the try stays quiet and is forgotten.
        let quiet = IdleTimeout::next(SPEC, Some(tried), None, true, at(300 + 2 * 3600));
        assert_eq!(quiet, IdleTimeout::configured(SPEC));
    }

    #[test]
    fn a_try_ended_by_the_backends_closes_doubles_the_next_wait_up_to_a_day() {
        let mut t = IdleTimeout::next(SPEC, None, Some(2.0), true, at(0));
        let mut now = 0;
        for tries in 1..=7u32 {
            let wait = t.retry_wait().as_secs() as i64;
            assert_eq!(
                wait,
                (3600 << (tries - 1)).min(86_400),
                "the wait before try {tries}"
            );
            now += wait;
            t = IdleTimeout::next(SPEC, Some(t), None, true, at(now));
            assert_eq!(t.in_force, SPEC, "try {tries}");
            // The keep-alive is still 2 s: the first closes come back a round later.
            now += 30;
            t = IdleTimeout::next(SPEC, Some(t), Some(2.0), true, at(now));
            assert_eq!(t.in_force, Duration::from_millis(1200));
            assert_eq!(t.tries, tries);
            assert_eq!(t.tried, None);
        }
        assert_eq!(t.retry_wait(), MAX_RETRY_WAIT);
        // An edit starts over, with no tries.
        let edited = IdleTimeout::next(Duration::from_secs(60), Some(t), None, true, at(now));
        assert_eq!(edited.tries, 0);
    }

    #[test]
    fn another_policys_run_neither_lowers_nor_tries() {
        let lowered = IdleTimeout::next(SPEC, None, Some(2.0), true, at(0));
        let kept = IdleTimeout::next(SPEC, Some(lowered), None, false, at(86_400));
        assert_eq!(kept.in_force, lowered.in_force);
        assert_eq!(kept.tried, None);
        let untouched = IdleTimeout::next(SPEC, None, Some(2.0), false, at(0));
        assert_eq!(untouched, IdleTimeout::configured(SPEC));
    }

    #[test]
    fn an_edit_of_the_spec_starts_over_from_the_new_value() {
        let lowered = IdleTimeout::next(SPEC, None, Some(2.0), true, at(0));
        let edited = IdleTimeout::next(Duration::from_secs(60), Some(lowered), None, true, at(10));
        assert_eq!(edited, IdleTimeout::configured(Duration::from_secs(60)));
        // A spec value already under the backend's closes is left alone.
        let short = IdleTimeout::next(Duration::from_secs(1), None, Some(5.0), true, at(0));
        assert_eq!(short, IdleTimeout::configured(Duration::from_secs(1)));
    }

    #[test]
    fn a_backend_closing_within_a_tenth_of_a_second_meets_the_floor() {
        let t = IdleTimeout::next(SPEC, None, Some(0.05), true, at(0));
        assert_eq!(t.in_force, FLOOR);
        assert!(t.at_floor());
        assert!(t.describe().unwrap().contains("its floor"));
        let near = IdleTimeout::next(SPEC, None, Some(0.2), true, at(0));
        assert_eq!(near.in_force, Duration::from_millis(120));
        assert!(!near.at_floor());
    }

    /// The bound of the module's doc: for any keep-alive k and a least finding f in
    /// [k, 1.1 k], any quantile the histogram can give (inside f's bucket: at most its upper
    /// bound, under 1.5 f) yields an idle timeout under k, or the floor.
    #[test]
    fn the_idle_timeout_in_force_is_under_the_keep_alive_for_findings_within_a_tenth() {
        let buckets: Vec<f64> = (0..20).map(|i| 0.05 * 1.5f64.powi(i)).collect();
        for k in (1..=600).map(|i| f64::from(i) * 0.1) {
            for f in [k, 1.05 * k, 1.1 * k] {
                let Some(upper) = buckets.iter().copied().find(|b| *b >= f) else {
                    continue;
                };
                let t = IdleTimeout::next(SPEC, None, Some(upper), true, at(0));
                assert!(
                    t.in_force.as_secs_f64() < k || t.in_force == FLOOR,
                    "keep-alive {k:.1} s, finding {f:.2} s, bucket bound {upper:.3}: {:?}",
                    t.in_force
                );
            }
        }
    }
}
