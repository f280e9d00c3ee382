//! Model tokens, the resource a model server spends: what a call is estimated to cost before it
//! is sent, what it used once its response ended, the client budgets that admit it, and the
//! token metrics of every call ([`Meter`]).
//!
//! | file | owns |
//! |---|---|
//! | `estimate.rs` | a call's tokens before it is sent: `max_tokens`, the prompt's bytes ÷ 4 |
//! | `estimate/accuracy.rs` | tests: the estimate against o200k_base and cl100k_base on sample prompts |
//! | `usage.rs` | a response's `usage`, read as it passes: JSON at its end, SSE event by event |
//! | `budget.rs` | the clients' token buckets: reserve, settle, refuse with the wait |
//! | `headers.rs` | OpenAI's `x-ratelimit-*` headers |
//!
//! What a call is counted, when its response ends (or is cut, or the client goes away), by
//! where the count comes from (the `source` label of `poolpilot_tokens_total`):
//!
//! | the response | input | output |
//! |---|---|---|
//! | with `usage` (a JSON body's, or a stream's chunk: `stream_options.include_usage`) | `prompt_tokens` (`usage`) | `completion_tokens` (`usage`) |
//! | a stream without it (the gateway does not ask for it) | the estimate (`estimate`) | content chunks streamed (`chunks`) |
//! | a complete JSON body without it | the estimate (`estimate`) | the estimate: the most it may produce (`estimate`) |
//! | a JSON body cut before its end | the estimate (`estimate`) | none |
//! | a backend's error (not 2xx) | none | none |
//!
//! A content chunk is one carrying text, reasoning or a tool call (not a role or a finish
//! reason alone): one per token for servers that stream a token a chunk (vLLM, modelsim), so
//! the count is exact for them and low for servers that send several tokens a chunk. A call's
//! reservation is settled with the same counts.

pub mod budget;
pub mod estimate;
pub mod headers;
pub mod usage;

use std::hash::Hash;

use bytes::Bytes;
use http::HeaderMap;
use tokio::time::Instant;

use self::budget::TokenReservation;
use self::estimate::Estimate;
use self::usage::{Reading, UsageReader};
use crate::observe::Metrics;
use crate::observe::labels::{TokenDirection, TokenSource};

/// One call's token accounting, from its response head to its end.
#[derive(Debug)]
pub(crate) struct Meter<K: Copy + Eq + Hash> {
    reader: UsageReader,
    estimate: Estimate,
    sent_at: Instant,
    reservation: Option<TokenReservation<K>>,
}

/// A call's tokens as counted at its end, with where each count came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Counted {
    pub(crate) input: Option<(u64, TokenSource)>,
    pub(crate) cached: Option<u64>,
    pub(crate) output: Option<(u64, TokenSource)>,
}

impl Counted {
    /// What the call's counts settle in its budget.
    fn settled(&self) -> (u64, u64) {
        (
            self.input.map_or(0, |(n, _)| n),
            self.output.map_or(0, |(n, _)| n),
        )
    }
}

/// The counts of a call (see the module's table).
pub(crate) fn count(reading: &Reading, estimate: Estimate, status: u16, complete: bool) -> Counted {
    if !(200..300).contains(&status) {
        return Counted {
            input: None,
            cached: None,
            output: None,
        };
    }
    if let Some(u) = reading.usage {
        return Counted {
            input: Some((u.prompt, TokenSource::Usage)),
            cached: u.cached,
            output: Some((u.completion, TokenSource::Usage)),
        };
    }
    let output = if reading.stream {
        Some((reading.content_chunks, TokenSource::Chunks))
    } else if complete {
        Some((estimate.output, TokenSource::Estimate))
    } else {
        None
    };
    Counted {
        input: Some((estimate.prompt, TokenSource::Estimate)),
        cached: None,
        output,
    }
}

impl<K: Copy + Eq + Hash> Meter<K> {
    /// The meter of a call whose response head `headers` arrived, sent at `sent_at`.
    pub(crate) fn new(
        headers: &HeaderMap,
        estimate: Estimate,
        sent_at: Instant,
        reservation: Option<TokenReservation<K>>,
    ) -> Self {
        Self {
            reader: UsageReader::for_response(headers),
            estimate,
            sent_at,
            reservation,
        }
    }

    /// A frame of the response body arrived.
    pub(crate) fn received(&mut self, data: &Bytes) {
        self.reader.feed(data, Instant::now());
    }

    /// The call ended (`complete`: the backend sent all of it) with `status`: its tokens are
    /// counted, a stream's token times observed, and its reservation settled. Returns its
    /// tokens as counted, input and output: what its pool lease is settled with (their sum)
    /// and its client's recent tokens count.
    pub(crate) fn finish(
        self,
        metrics: &Metrics,
        backend: &str,
        status: u16,
        complete: bool,
    ) -> (u64, u64) {
        let reading = self.reader.finish();
        let counted = count(&reading, self.estimate, status, complete);
        if let Some((n, source)) = counted.input {
            metrics.tokens(backend, TokenDirection::Input, source, n);
        }
        if let Some(n) = counted.cached {
            metrics.tokens(backend, TokenDirection::CachedInput, TokenSource::Usage, n);
        }
        if let Some((n, source)) = counted.output {
            metrics.tokens(backend, TokenDirection::Output, source, n);
        }
        if let Some(first) = reading.first_content {
            metrics.time_to_first_token(backend, (first - self.sent_at).as_secs_f64());
            let tokens = reading
                .usage
                .map_or(reading.content_chunks, |u| u.completion);
            if let Some(last) = reading.last_content
                && tokens >= 2
            {
                let per = (last - first).as_secs_f64() / (tokens - 1) as f64;
                metrics.time_per_output_token(backend, per);
            }
        }
        let (input, output) = counted.settled();
        if let Some(reservation) = self.reservation {
            reservation.settle(input, output);
        }
        (input, output)
    }
}

#[cfg(test)]
mod tests {
    use super::usage::Usage;
    use super::*;

    #[test]
    fn counts_come_from_usage_else_chunks_else_the_estimate() {
        let est = Estimate {
            prompt: 10,
            output: 100,
        };
        let usage = Reading {
            usage: Some(Usage {
                prompt: 7,
                completion: 3,
                cached: Some(2),
            }),
            ..Reading::default()
        };
        assert_eq!(
            count(&usage, est, 200, true),
            Counted {
                input: Some((7, TokenSource::Usage)),
                cached: Some(2),
                output: Some((3, TokenSource::Usage)),
            }
        );
        let stream = Reading {
            stream: true,
            content_chunks: 4,
            ..Reading::default()
        };
        let cut = count(&stream, est, 200, false);
        assert_eq!(cut.input, Some((10, TokenSource::Estimate)));
        assert_eq!(cut.output, Some((4, TokenSource::Chunks)));
        let json = Reading::default();
        assert_eq!(
            count(&json, est, 200, true).output,
            Some((100, TokenSource::Estimate))
        );
        assert_eq!(count(&json, est, 200, false).output, None);
        assert_eq!(count(&usage, est, 503, true).settled(), (0, 0));
    }
}
