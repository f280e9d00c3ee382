//! What a pool learns of an endpoint's keep-alive from the idle connections the endpoint closed,
//! and the idle timeout it keeps under it ([`KeepAlive`]).
//!
//! Reusing a connection the backend is about to close races its close: a request sent as the
//! close crosses it on the wire is lost, and one that is not safe to send twice fails (the
//! forward phase re-sends only what it may). The operator lowers `idleTimeout` under the closes
//! every gateway finds, but only on its next round and once the pods run the new document; until
//! then each pod protects itself, from its own findings:
//!
//! ```text
//!  finding   a pooled connection to the endpoint found closed by the backend after `a` idle:
//!            at a lease, at the reaper's pass (every quarter of the idle timeout, at most 1 s),
//!            or when a request on a reused connection went unanswered. The keep-alive k ≤ a,
//!            and a ≤ k + the reaper's period
//!  kept      no connection to the endpoint stays idle past max(FLOOR, HEADROOM × least a),
//!            when that is under `idleTimeout` (HEADROOM: 3/5, and FLOOR as the operator's:
//!            operator/src/plan/idle_timeout.rs). Each lowering shortens the reaper's period,
//!            and later findings lower it further
//!  forgotten FORGET_AFTER after the last finding (the closes stopped: the pool closes first,
//!            or they came from a restart, which closes connections of every age), and when
//!            `idleTimeout` changes (the operator's lowered value, or an edit, starts over)
//! ```
//!
//! Per endpoint: a backend instance that restarts closes all its connections, young ones too,
//! and the shorter timeout that teaches stays with that instance and lasts FORGET_AFTER at most.

use std::time::Duration;

use tokio::time::Instant;

/// The idle timeout kept is this share of the least idle time at which the endpoint closed a
/// connection, three fifths (the operator's `HEADROOM` for `idleTimeout`, 0.6).
pub(super) const HEADROOM: (u32, u32) = (3, 5);
/// ... and never below this (the operator's `FLOOR`): an endpoint that closes connections
/// sooner makes pooling moot.
pub(super) const FLOOR: Duration = Duration::from_millis(100);
/// A finding is forgotten this long after the last one.
pub(super) const FORGET_AFTER: Duration = Duration::from_secs(600);

/// An endpoint's keep-alive as its closes showed it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct KeepAlive {
    /// The least idle time of a close found, and when the last close was found.
    found: Option<(Duration, Instant)>,
}

impl KeepAlive {
    /// The least idle time at which the endpoint closed a connection, unless forgotten.
    pub(super) fn closed_after(&self, now: Instant) -> Option<Duration> {
        self.found
            .filter(|(_, last)| now.saturating_duration_since(*last) < FORGET_AFTER)
            .map(|(least, _)| least)
    }

    /// How long a connection to the endpoint may stay idle: `configured`, or less under its
    /// closes.
    pub(super) fn idle_timeout(&self, configured: Duration, now: Instant) -> Duration {
        self.closed_after(now).map_or(configured, |a| {
            configured.min((a * HEADROOM.0 / HEADROOM.1).max(FLOOR))
        })
    }

    /// Notes a connection found closed by the endpoint after `idle` without a call; returns
    /// the idle timeout under `configured` when this lowered it.
    pub(super) fn found(
        &mut self,
        idle: Duration,
        configured: Duration,
        now: Instant,
    ) -> Option<Duration> {
        let before = self.idle_timeout(configured, now);
        let least = self.closed_after(now).map_or(idle, |least| least.min(idle));
        self.found = Some((least, now));
        let after = self.idle_timeout(configured, now);
        (after < before).then_some(after)
    }

    /// Forgets the findings: `idleTimeout` changed.
    pub(super) fn forget(&mut self) {
        self.found = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: Duration = Duration::from_secs(30);

    fn secs(s: f64) -> Duration {
        Duration::from_millis((s * 1000.0).round() as u64)
    }

    #[test]
    fn without_findings_the_configured_timeout_holds() {
        let k = KeepAlive::default();
        let now = Instant::now();
        assert_eq!(k.idle_timeout(SPEC, now), SPEC);
        assert_eq!(k.closed_after(now), None);
    }

    #[test]
    fn the_first_close_lowers_the_timeout_under_it_and_later_ones_only_lower_it() {
        let mut k = KeepAlive::default();
        let t0 = Instant::now();
        assert_eq!(k.found(secs(2.5), SPEC, t0), Some(secs(1.5)));
        assert_eq!(k.idle_timeout(SPEC, t0), secs(1.5));
        // A close found later after longer idle (the reaper's pass came late) changes nothing.
        assert_eq!(k.found(secs(4.0), SPEC, t0 + secs(5.0)), None);
        assert_eq!(k.idle_timeout(SPEC, t0 + secs(5.0)), secs(1.5));
        // A closer finding lowers it further.
        let lower = k.found(Duration::from_millis(2050), SPEC, t0 + secs(9.0));
        assert_eq!(lower, Some(Duration::from_millis(1230)));
        // A configured timeout already under the closes is kept, and never raised.
        let mut short = KeepAlive::default();
        assert_eq!(short.found(secs(5.0), secs(1.0), t0), None);
        assert_eq!(short.idle_timeout(secs(1.0), t0), secs(1.0));
    }

    #[test]
    fn closes_within_a_tenth_of_a_second_meet_the_floor() {
        let mut k = KeepAlive::default();
        let now = Instant::now();
        assert_eq!(k.found(secs(0.02), SPEC, now), Some(FLOOR));
        assert_eq!(k.idle_timeout(SPEC, now), FLOOR);
    }

    #[test]
    fn findings_are_forgotten_after_a_quiet_spell_and_on_a_new_idle_timeout() {
        let mut k = KeepAlive::default();
        let t0 = Instant::now();
        k.found(secs(2.0), SPEC, t0);
        // Every finding restarts the spell.
        k.found(secs(3.0), SPEC, t0 + FORGET_AFTER - secs(1.0));
        let later = t0 + FORGET_AFTER + secs(1.0);
        assert_eq!(k.closed_after(later), Some(secs(2.0)));
        assert_eq!(k.idle_timeout(SPEC, later), secs(1.2));
        let quiet = t0 + FORGET_AFTER * 2;
        assert_eq!(k.closed_after(quiet), None);
        assert_eq!(k.idle_timeout(SPEC, quiet), SPEC);
        // After a quiet spell a new finding starts over rather than matching the old least.
        assert_eq!(k.found(secs(4.0), SPEC, quiet), Some(secs(2.4)));
        k.forget();
        assert_eq!(k.idle_timeout(SPEC, quiet), SPEC);
    }
}
