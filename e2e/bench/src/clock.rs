//! The one clock every benchmark process shares: `CLOCK_MONOTONIC`, in microseconds. It is
//! system-wide, so a time written by the upstream can be compared with one read by the client.

use nix::time::{ClockId, clock_gettime};

/// Microseconds on the system-wide monotonic clock.
pub fn mono_us() -> u64 {
    clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000 + t.tv_nsec() as u64 / 1_000)
        .unwrap_or(0)
}
