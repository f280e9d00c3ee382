//! A provider's own back-pressure: a `429` or `503` from a backend that says when to come back
//! (`Retry-After` in seconds or as an HTTP date, or Azure's and OpenAI's `retry-after-ms`) puts
//! the whole backend in a cooldown for that long, at most [`MAX_COOLDOWN`]: calls meanwhile are
//! answered `429` with the `Retry-After` that is left, without being sent into a refusal the
//! gateway already knows of. Only backends whose calls carry the provider's key (`credentials`)
//! cool down: their refusal is about the one account all clients share, where a backend that
//! forwards the clients' own keys refuses one client, not all of them.

use std::time::Duration;

use http::{HeaderMap, StatusCode, header};
use parking_lot::Mutex;
use tokio::time::Instant;

/// The longest cooldown a refusal can start: a provider asking for more is asked again then.
pub const MAX_COOLDOWN: Duration = Duration::from_secs(60);

/// `retry-after-ms`: Azure OpenAI's (and OpenAI's) `Retry-After` in milliseconds.
const RETRY_AFTER_MS: &str = "retry-after-ms";

/// One backend's cooldown.
#[derive(Debug, Default)]
pub struct Cooldown {
    until: Mutex<Option<Instant>>,
}

impl Cooldown {
    /// Reads a response head: a `429` or `503` saying when to come back starts (or extends) the
    /// cooldown to then. Returns how long, when it did.
    pub fn note(&self, status: StatusCode, headers: &HeaderMap, now: Instant) -> Option<Duration> {
        if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
            return None;
        }
        let wait = retry_after(headers, jiff::Timestamp::now())?.min(MAX_COOLDOWN);
        if wait.is_zero() {
            return None;
        }
        let mut until = self.until.lock();
        let end = now + wait;
        if until.is_none_or(|u| u < end) {
            *until = Some(end);
        }
        Some(wait)
    }

    /// How long the cooldown still lasts at `now`; `None`: the backend takes calls.
    pub fn remaining(&self, now: Instant) -> Option<Duration> {
        let until = (*self.until.lock())?;
        (until > now).then(|| until - now)
    }
}

/// When a response says to come back: `retry-after-ms`, else `Retry-After` as delta-seconds or
/// an HTTP date (from `now`, wall-clock).
fn retry_after(headers: &HeaderMap, now: jiff::Timestamp) -> Option<Duration> {
    let text = |name| headers.get(name)?.to_str().ok().map(str::trim);
    if let Some(ms) = text(RETRY_AFTER_MS).and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(
            ms.min(MAX_COOLDOWN.as_millis() as f64) / 1000.0,
        ));
    }
    let value = text(header::RETRY_AFTER.as_str())?;
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let date = jiff::fmt::rfc2822::parse(value).ok()?.timestamp();
    let ahead = date.duration_since(now);
    Some(Duration::try_from(ahead).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn retry_after_is_read_in_seconds_milliseconds_and_as_a_date() {
        let now: jiff::Timestamp = "2026-12-02T13:00:00Z".parse().unwrap();
        let at = |pairs| retry_after(&headers(pairs), now);
        assert_eq!(at(&[("retry-after", "2")]), Some(Duration::from_secs(2)));
        assert_eq!(
            at(&[("retry-after", "2"), ("retry-after-ms", "1500")]),
            Some(Duration::from_millis(1500)),
            "the finer one wins"
        );
        assert_eq!(
            at(&[("retry-after", "Wed, 02 Dec 2026 13:00:07 GMT")]),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            at(&[("retry-after", "Wed, 02 Dec 2026 12:59:00 GMT")]),
            Some(Duration::ZERO),
            "a date past"
        );
        assert_eq!(at(&[("retry-after", "soon")]), None);
        assert_eq!(at(&[("retry-after-ms", "-5")]), None);
        assert_eq!(at(&[]), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_with_retry_after_cools_the_backend_down_for_that_long() {
        let cooldown = Cooldown::default();
        let now = Instant::now();
        let refusal = headers(&[("retry-after", "2")]);
        assert_eq!(cooldown.note(StatusCode::OK, &refusal, now), None);
        assert_eq!(
            cooldown.note(StatusCode::TOO_MANY_REQUESTS, &headers(&[]), now),
            None,
            "no Retry-After, no cooldown"
        );
        assert_eq!(cooldown.remaining(now), None);
        assert_eq!(
            cooldown.note(StatusCode::TOO_MANY_REQUESTS, &refusal, now),
            Some(Duration::from_secs(2))
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(
            cooldown.remaining(Instant::now()),
            Some(Duration::from_millis(1500))
        );
        // A shorter one later does not cut it short.
        let short = headers(&[("retry-after-ms", "100")]);
        cooldown.note(StatusCode::SERVICE_UNAVAILABLE, &short, Instant::now());
        assert_eq!(
            cooldown.remaining(Instant::now()),
            Some(Duration::from_millis(1500))
        );
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(cooldown.remaining(Instant::now()), None);
        // Never longer than the cap.
        let long = headers(&[("retry-after", "86400")]);
        assert_eq!(
            cooldown.note(StatusCode::TOO_MANY_REQUESTS, &long, Instant::now()),
            Some(MAX_COOLDOWN)
        );
    }
}
