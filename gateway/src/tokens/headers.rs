//! OpenAI's rate-limit headers, on every admitted response of a client with a token budget and
//! on its refusals: `x-ratelimit-limit-tokens`, `x-ratelimit-remaining-tokens`,
//! `x-ratelimit-reset-tokens` (a duration as OpenAI writes them: `1s`, `6m0s`, `120ms`), and
//! the `-requests` triple when the budget sets `requestsPerMinute`.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use super::budget::Quote;

/// The headers of `quote`, added to `headers` (replacing any the backend sent).
pub fn insert(headers: &mut HeaderMap, quote: &Quote) {
    let mut put = |name: &'static str, value: String| {
        if let Ok(v) = HeaderValue::try_from(value) {
            headers.insert(name, v);
        }
    };
    put("x-ratelimit-limit-tokens", quote.limit_tokens.to_string());
    put(
        "x-ratelimit-remaining-tokens",
        quote.remaining_tokens.to_string(),
    );
    put("x-ratelimit-reset-tokens", go_duration(quote.reset_tokens));
    if let Some((limit, remaining, reset)) = quote.requests {
        put("x-ratelimit-limit-requests", limit.to_string());
        put("x-ratelimit-remaining-requests", remaining.to_string());
        put("x-ratelimit-reset-requests", go_duration(reset));
    }
}

/// A duration as OpenAI's headers write it (Go's `time.Duration` text, to the millisecond):
/// `0s`, `120ms`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, rest) = (ms / 3_600_000, ms % 3_600_000);
    let (m, rest) = (rest / 60_000, rest % 60_000);
    let (s, frac) = (rest / 1000, rest % 1000);
    let secs = if frac == 0 {
        format!("{s}s")
    } else {
        let frac = format!("{frac:03}");
        format!("{s}.{}s", frac.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => secs,
        (0, m) => format!("{m}m{secs}"),
        (h, m) => format!("{h}h{m}m{secs}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_openai_writes_them() {
        let cases = [
            (0, "0s"),
            (120, "120ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (17_034, "17.034s"),
            (360_000, "6m0s"),
            (3_723_000, "1h2m3s"),
            (86_400_000, "24h0m0s"),
        ];
        for (ms, text) in cases {
            assert_eq!(go_duration(Duration::from_millis(ms)), text);
        }
    }

    #[test]
    fn the_requests_triple_comes_only_with_a_request_budget() {
        let mut quote = Quote {
            limit_tokens: 600,
            remaining_tokens: 500,
            reset_tokens: Duration::from_secs(10),
            requests: None,
        };
        let mut h = HeaderMap::new();
        insert(&mut h, &quote);
        assert_eq!(h["x-ratelimit-remaining-tokens"], "500");
        assert_eq!(h["x-ratelimit-reset-tokens"], "10s");
        assert!(h.get("x-ratelimit-limit-requests").is_none());
        quote.requests = Some((60, 59, Duration::from_secs(1)));
        insert(&mut h, &quote);
        assert_eq!(h["x-ratelimit-limit-requests"], "60");
        assert_eq!(h["x-ratelimit-remaining-requests"], "59");
        assert_eq!(h["x-ratelimit-reset-requests"], "1s");
    }
}
