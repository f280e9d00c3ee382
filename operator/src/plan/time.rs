//! The planner's clock type: every instant is passed in as a [`Timestamp`] (the planner reads no
//! clock), and durations between two of them never go negative.

pub use k8s_openapi::jiff::Timestamp;

/// Time from `then` to `now`; zero if `then` is in the future.
pub(crate) fn elapsed(then: Timestamp, now: Timestamp) -> std::time::Duration {
    let d = now.duration_since(then);
    if d.is_negative() {
        std::time::Duration::ZERO
    } else {
        d.unsigned_abs()
    }
}

/// `d` after `now` (the latest instant there is, if that overflows).
pub(crate) fn later(now: Timestamp, d: std::time::Duration) -> Timestamp {
    now.checked_add(d).unwrap_or(Timestamp::MAX)
}
