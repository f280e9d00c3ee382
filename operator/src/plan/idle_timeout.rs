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
//!             closed by the backend over the last ten sampling windows (present only when they
//!             found some; `prom::FINDINGS_WINDOWS`: a pod makes only its first few). The backend's keep-alive k is at most every finding, and the gateway finds
//!             a close at the next lease or reaper pass (every quarter of the idle timeout, at
//!             most 1 s) after it happened
//!  lowered    in force = max(FLOOR, HEADROOM × p), rounded down to 10 ms, when that is below
//!             the idle timeout in force. The histogram's buckets are 1.5× apart and the
//!             quantile interpolates inside one, so p < 1.5 × the least finding f; with f
//!             within 10% of k (a close found within a tenth of the keep-alive) that is
//!             0.6 × 1.5 × 1.1 k ≈ 0.99 k < k. Findings later than that lower it further on
//!             the next rounds: each lowering shortens the reaper's period too
//!  kept       without findings the lowered value stays (the backend did not change: the
//!             gateway now closes first, so none come); it is never raised by itself, since
//!             trying the longer value again would lose calls to find out. An edit of
//!             `pool.idleTimeout` starts over from the new value
//! ```

use std::time::Duration;

use super::time::Timestamp;

/// The idle timeout in force is this share of the backend's closing time.
pub const HEADROOM: f64 = 0.6;
/// The idle timeout is never lowered below this: a backend that closes connections sooner makes
/// pooling moot, and the closes go on (the status says so).
pub const FLOOR: Duration = Duration::from_millis(100);

/// A backend's idle timeout as the pods run it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdleTimeout {
    /// The spec's `pool.idleTimeout`.
    pub configured: Duration,
    /// What the pods run: the spec's value, or lower.
    pub in_force: Duration,
    /// Why it is lower, when it is.
    pub lowered: Option<Lowered>,
}

/// Why an idle timeout is lower than the spec's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lowered {
    /// The 5th percentile of the idle times at which the gateways found connections closed by
    /// the backend, seconds, when it was last lowered.
    pub closed_after: f64,
    /// When it was last lowered.
    pub at: Timestamp,
    /// Whether this run lowered it (an Event tells).
    pub now: bool,
}

impl IdleTimeout {
    /// The spec's value, in force.
    pub fn configured(configured: Duration) -> Self {
        Self {
            configured,
            in_force: configured,
            lowered: None,
        }
    }

    /// The idle timeout this run: `last` (remembered, or restored from status) lowered under
    /// `closed_after`, the 5th percentile of the idle times at which the gateways found the
    /// backend's closes (`None`: none found in the window). A `last` made for another spec value
    /// is dropped.
    pub fn next(
        configured: Duration,
        last: Option<IdleTimeout>,
        closed_after: Option<f64>,
        now: Timestamp,
    ) -> Self {
        let mut next = match last {
            Some(l) if l.configured == configured => IdleTimeout {
                lowered: l.lowered.map(|w| Lowered { now: false, ..w }),
                ..l
            },
            _ => Self::configured(configured),
        };
        let Some(p) = closed_after.filter(|p| p.is_finite() && *p > 0.0) else {
            return next;
        };
        // In hundredths of a second, rounded down (the epsilon keeps 0.6 × 2.05 at 1.23).
        let centis = (HEADROOM * p * 100.0 + 1e-9).floor().min(8_640_000.0);
        let under = Duration::from_millis(centis as u64 * 10).max(FLOOR);
        if under < next.in_force {
            next.in_force = under;
            next.lowered = Some(Lowered {
                closed_after: p,
                at: now,
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

    /// The change in words, for the Event (`idleTimeout 30s → 1230ms: …`).
    pub fn describe(&self) -> Option<String> {
        let l = self.lowered?;
        let floor = if self.at_floor() {
            " (its floor: the backend closes sooner than pooling can use, and its closes go on)"
        } else {
            ""
        };
        Some(format!(
            "idleTimeout {} → {}{floor}: the gateways found connections closed by the backend after {} s idle (5th percentile), so the gateway closes them first",
            poolpilot_api::Duration::from(self.configured),
            poolpilot_api::Duration::from(self.in_force),
            (l.closed_after * 100.0).round() / 100.0,
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
        let t = IdleTimeout::next(SPEC, None, None, at(0));
        assert_eq!(t, IdleTimeout::configured(SPEC));
        assert_eq!(t.describe(), None);
        let nan = IdleTimeout::next(SPEC, None, Some(f64::NAN), at(0));
        assert_eq!(nan.in_force, SPEC, "a NaN quantile is no finding");
    }

    #[test]
    fn a_backend_closing_sooner_gets_an_idle_timeout_under_its_keep_alive() {
        // Closes found after 2.05 s idle (a keep-alive of 2 s, the quantile inside its bucket).
        let t = IdleTimeout::next(SPEC, None, Some(2.05), at(10));
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
        let first = IdleTimeout::next(SPEC, None, Some(4.0), at(0));
        assert_eq!(first.in_force, Duration::from_millis(2400));
        // The gateway closes first now: no findings, and the value stays, told once.
        let quiet = IdleTimeout::next(SPEC, Some(first), None, at(10));
        assert_eq!(quiet.in_force, first.in_force);
        assert!(
            !quiet.lowered.unwrap().now,
            "no Event for a value that stayed"
        );
        assert_eq!(quiet.lowered.unwrap().at, at(0));
        // A finding above it (a close found late) does not raise it.
        let late = IdleTimeout::next(SPEC, Some(quiet), Some(9.0), at(20));
        assert_eq!(late.in_force, first.in_force);
        assert!(!late.lowered.unwrap().now);
        // Findings still under it (the reaper now looks more often) lower it further.
        let lower = IdleTimeout::next(SPEC, Some(late), Some(2.6), at(30));
        assert_eq!(lower.in_force, Duration::from_millis(1560));
        assert!(lower.lowered.unwrap().now);
    }

    #[test]
    fn an_edit_of_the_spec_starts_over_from_the_new_value() {
        let lowered = IdleTimeout::next(SPEC, None, Some(2.0), at(0));
        let edited = IdleTimeout::next(Duration::from_secs(60), Some(lowered), None, at(10));
        assert_eq!(edited, IdleTimeout::configured(Duration::from_secs(60)));
        // A spec value already under the backend's closes is left alone.
        let short = IdleTimeout::next(Duration::from_secs(1), None, Some(5.0), at(0));
        assert_eq!(short, IdleTimeout::configured(Duration::from_secs(1)));
    }

    #[test]
    fn a_backend_closing_within_a_tenth_of_a_second_meets_the_floor() {
        let t = IdleTimeout::next(SPEC, None, Some(0.05), at(0));
        assert_eq!(t.in_force, FLOOR);
        assert!(t.at_floor());
        assert!(t.describe().unwrap().contains("its floor"));
        let near = IdleTimeout::next(SPEC, None, Some(0.2), at(0));
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
                let t = IdleTimeout::next(SPEC, None, Some(upper), at(0));
                assert!(
                    t.in_force.as_secs_f64() < k || t.in_force == FLOOR,
                    "keep-alive {k:.1} s, finding {f:.2} s, bucket bound {upper:.3}: {:?}",
                    t.in_force
                );
            }
        }
    }
}
