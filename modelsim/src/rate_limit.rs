//! A hosted provider's request rate limit: at most `requests` inference calls per fixed window
//! (an account's requests per minute, say); a call beyond them is answered `429` before it is
//! queued, with `Retry-After` (the whole seconds until the window ends, at least 1) and OpenAI's
//! `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests` and
//! `x-ratelimit-reset-requests`, as a provider tells its clients when to come back.

use std::time::Duration;

use http::HeaderMap;
use http::header::{HeaderValue, RETRY_AFTER};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// The limit: `requests` calls per `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimit {
    /// Calls admitted per window. At least 1.
    pub requests: u32,
    /// The window's length (fixed windows from the server's start). At least 1 ms.
    pub window: Duration,
}

/// What the limit says of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Admitted; this many are left in the window.
    Admitted { remaining: u32 },
    /// Refused until the window ends, this long from now.
    Refused { reset: Duration },
}

/// The limit's count in the current window.
#[derive(Debug)]
pub(crate) struct Limiter {
    limit: RateLimit,
    origin: Instant,
    /// (index of the window, calls admitted in it).
    window: Mutex<(u64, u32)>,
}

impl Limiter {
    pub fn new(limit: RateLimit, origin: Instant) -> Self {
        Self {
            limit,
            origin,
            window: Mutex::new((0, 0)),
        }
    }

    /// The limit.
    pub fn limit(&self) -> RateLimit {
        self.limit
    }

    /// Counts a call at `now`.
    pub fn check(&self, now: Instant) -> Verdict {
        let window = self.limit.window.max(Duration::from_millis(1));
        let since = now.saturating_duration_since(self.origin);
        let index = (since.as_nanos() / window.as_nanos()) as u64;
        let mut current = self.window.lock();
        if current.0 != index {
            *current = (index, 0);
        }
        if current.1 < self.limit.requests {
            current.1 += 1;
            return Verdict::Admitted {
                remaining: self.limit.requests - current.1,
            };
        }
        let ends = window.saturating_mul(u32::try_from(index + 1).unwrap_or(u32::MAX));
        Verdict::Refused {
            reset: ends.saturating_sub(since),
        }
    }
}

/// `Retry-After` for a refusal: the whole seconds until the window ends, at least 1.
pub(crate) fn retry_after_secs(reset: Duration) -> u64 {
    reset.as_secs_f64().ceil().max(1.0) as u64
}

/// A refusal's headers: `Retry-After` and OpenAI's `x-ratelimit-*-requests` (the reset as
/// OpenAI writes it, `1.7s`, `250ms`).
pub(crate) fn refusal_headers(headers: &mut HeaderMap, limit: RateLimit, reset: Duration) {
    headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(reset)));
    headers.insert(
        "x-ratelimit-limit-requests",
        HeaderValue::from(limit.requests),
    );
    headers.insert(
        "x-ratelimit-remaining-requests",
        HeaderValue::from_static("0"),
    );
    let text = if reset < Duration::from_secs(1) {
        format!("{}ms", reset.as_millis().max(1))
    } else {
        let secs = format!("{:.3}", reset.as_secs_f64());
        format!("{}s", secs.trim_end_matches('0').trim_end_matches('.'))
    };
    if let Ok(v) = HeaderValue::from_str(&text) {
        headers.insert("x-ratelimit-reset-requests", v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_admits_its_requests_and_refuses_the_rest_until_it_ends() {
        let origin = Instant::now();
        let limiter = Limiter::new(
            RateLimit {
                requests: 2,
                window: Duration::from_secs(2),
            },
            origin,
        );
        let at = |ms| origin + Duration::from_millis(ms);
        assert_eq!(limiter.check(at(0)), Verdict::Admitted { remaining: 1 });
        assert_eq!(limiter.check(at(100)), Verdict::Admitted { remaining: 0 });
        let Verdict::Refused { reset } = limiter.check(at(300)) else {
            panic!("the third call of the window is refused");
        };
        assert_eq!(reset, Duration::from_millis(1700));
        assert_eq!(retry_after_secs(reset), 2);
        assert_eq!(
            limiter.check(at(1999)),
            Verdict::Refused {
                reset: Duration::from_millis(1)
            }
        );
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        // The next window starts over.
        assert_eq!(limiter.check(at(2000)), Verdict::Admitted { remaining: 1 });
        // A window with no call in between is as new.
        assert_eq!(limiter.check(at(9000)), Verdict::Admitted { remaining: 1 });
    }

    #[test]
    fn a_refusal_says_when_to_come_back_as_providers_do() {
        let limit = RateLimit {
            requests: 4,
            window: Duration::from_secs(2),
        };
        let mut h = HeaderMap::new();
        refusal_headers(&mut h, limit, Duration::from_millis(1700));
        assert_eq!(h["retry-after"], "2");
        assert_eq!(h["x-ratelimit-limit-requests"], "4");
        assert_eq!(h["x-ratelimit-remaining-requests"], "0");
        assert_eq!(h["x-ratelimit-reset-requests"], "1.7s");
        refusal_headers(&mut h, limit, Duration::from_millis(250));
        assert_eq!(h["retry-after"], "1");
        assert_eq!(h["x-ratelimit-reset-requests"], "250ms");
    }
}
