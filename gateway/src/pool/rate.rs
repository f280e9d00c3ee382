//! The pool's drain-rate and hold-time estimators, from which `Retry-After` is computed.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Releases remembered; enough for a stable rate, small enough to stay cheap.
const RATE_SAMPLES: usize = 64;
/// Releases older than this no longer describe how fast the queue drains.
const RATE_WINDOW: Duration = Duration::from_secs(10);
/// Longest `Retry-After` advised: beyond it an estimate says little.
const MAX_RETRY_AFTER_SECS: f64 = 300.0;

/// When the last leases were released: the rate at which capacity frees up.
#[derive(Debug, Default)]
pub(crate) struct ReleaseRate {
    times: VecDeque<Instant>,
}

impl ReleaseRate {
    /// Notes a release at `now`.
    pub(crate) fn record(&mut self, now: Instant) {
        if self.times.len() == RATE_SAMPLES {
            self.times.pop_front();
        }
        self.times.push_back(now);
    }

    /// Releases per second over the recent window, if any release happened in it.
    pub(crate) fn per_second(&self, now: Instant) -> Option<f64> {
        let recent = self
            .times
            .iter()
            .filter(|t| now.duration_since(**t) <= RATE_WINDOW);
        let (count, oldest) = recent.fold((0usize, None), |(n, oldest), t| {
            (n + 1, Some(oldest.map_or(*t, |o: Instant| o.min(*t))))
        });
        let oldest = oldest?;
        // At least 100ms of span, so a burst of releases does not read as an infinite rate.
        let span = now.duration_since(oldest).max(Duration::from_millis(100));
        Some(count as f64 / span.as_secs_f64())
    }
}

/// An exponentially weighted mean of how long leases are held.
#[derive(Debug, Default)]
pub(crate) struct HoldTime {
    mean_secs: Option<f64>,
}

impl HoldTime {
    const WEIGHT: f64 = 0.2;

    /// Notes one lease's hold time.
    pub(crate) fn record(&mut self, held: Duration) {
        let x = held.as_secs_f64();
        self.mean_secs = Some(match self.mean_secs {
            None => x,
            Some(m) => m + Self::WEIGHT * (x - m),
        });
    }

    /// The mean, once a lease was released.
    pub(crate) fn mean(&self) -> Option<Duration> {
        self.mean_secs.map(Duration::from_secs_f64)
    }
}

/// Rounds an estimate up to whole seconds (the unit of `Retry-After`), at least 1.
pub(crate) fn whole_seconds(secs: f64) -> Duration {
    let secs = if secs.is_finite() {
        secs.clamp(1.0, MAX_RETRY_AFTER_SECS)
    } else {
        1.0
    };
    Duration::from_secs(secs.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn rate_follows_recent_releases() {
        let mut r = ReleaseRate::default();
        let start = Instant::now();
        assert_eq!(r.per_second(start), None);
        for _ in 0..10 {
            tokio::time::advance(Duration::from_millis(100)).await;
            r.record(Instant::now());
        }
        // 10 releases over the last second (span from first to now: 0.9s).
        let rate = r.per_second(Instant::now()).unwrap();
        assert!((rate - 10.0 / 0.9).abs() < 0.01, "{rate}");
        tokio::time::advance(RATE_WINDOW + Duration::from_secs(1)).await;
        assert_eq!(
            r.per_second(Instant::now()),
            None,
            "old releases say nothing"
        );
    }

    #[test]
    fn hold_time_is_a_moving_mean() {
        let mut h = HoldTime::default();
        assert_eq!(h.mean(), None);
        h.record(Duration::from_secs(1));
        assert_eq!(h.mean(), Some(Duration::from_secs(1)));
        h.record(Duration::from_secs(2));
        assert_eq!(h.mean(), Some(Duration::from_secs_f64(1.2)));
    }

    #[test]
    fn retry_after_is_whole_seconds_at_least_one() {
        assert_eq!(whole_seconds(0.01), Duration::from_secs(1));
        assert_eq!(whole_seconds(2.2), Duration::from_secs(3));
        assert_eq!(whole_seconds(f64::INFINITY), Duration::from_secs(1));
        assert_eq!(whole_seconds(1e9), Duration::from_secs(300));
    }
}
