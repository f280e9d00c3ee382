//! modelsim's configuration: where it listens, what it serves, its service time model, its
//! capacity (concurrency slots and queue) and the faults it injects.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::rate_limit::RateLimit;

/// Everything a [`Modelsim`](super::Modelsim) needs to start. `Config::default()` listens on
/// `127.0.0.1:0` (an ephemeral port, for tests) and serves one model, `sim-model`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Address of the serving listener (OpenAI API, health, metrics, admin). Port 0 picks a free
    /// port; read it back with [`Modelsim::addr`](super::Modelsim::addr).
    pub listen: SocketAddr,
    /// Optional second listener serving the same routes, whose connections are *not* counted as
    /// client connections: point Prometheus scrapes and test probes at it so that they never
    /// disturb the exact client connection count.
    pub admin_listen: Option<SocketAddr>,
    /// Name of this instance (the pod name in a cluster), returned in the `x-modelsim-instance`
    /// response header and in stats.
    pub instance: String,
    /// Model names served; a request naming another model gets a 404. A request without a model
    /// is served as the first one.
    pub models: Vec<String>,
    /// How long a request takes.
    pub service: ServiceTime,
    /// Requests served at once (a model server's batch slots). At least 1.
    pub max_concurrency: u32,
    /// Requests waiting for a slot beyond `max_concurrency`; one more is refused.
    pub max_queue: u32,
    /// Status of a refusal when the queue is full (503 like an overloaded server, or 429).
    pub refuse_status: u16,
    /// Seed of the random draws (jitter, fault ratios); `None` seeds from the OS.
    pub seed: Option<u64>,
    /// A hosted provider's request rate limit (`None`: calls are limited by the slots and the
    /// queue alone).
    pub rate_limit: Option<RateLimit>,
    /// Blocks of 16 prompt tokens the prefix cache holds, as vLLM's automatic prefix caching
    /// holds KV blocks (the least recently used evicted first); 0 turns it off. The default,
    /// 8,192 blocks, is 131,072 tokens.
    pub prefix_cache_blocks: usize,
    /// Faults in force at start; change them at runtime with
    /// [`Modelsim::set_faults`](super::Modelsim::set_faults) or `PUT /admin/faults`.
    pub faults: Faults,
}

/// The prefix cache's default size in blocks ([`Config::prefix_cache_blocks`]).
pub const DEFAULT_PREFIX_CACHE_BLOCKS: usize = 8192;

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_listen: None,
            instance: "modelsim".to_owned(),
            models: vec!["sim-model".to_owned()],
            service: ServiceTime::default(),
            max_concurrency: 64,
            max_queue: 128,
            refuse_status: 503,
            seed: None,
            rate_limit: None,
            prefix_cache_blocks: DEFAULT_PREFIX_CACHE_BLOCKS,
            faults: Faults::default(),
        }
    }
}

impl Config {
    /// Checks the values that have no sensible meaning (no model, no slot, a non-error refusal
    /// status, invalid faults).
    pub fn validate(&self) -> Result<(), String> {
        if self.models.is_empty() || self.models.iter().any(|m| m.trim().is_empty()) {
            return Err("at least one non-empty model name is needed".to_owned());
        }
        if self.max_concurrency == 0 {
            return Err("max_concurrency must be at least 1".to_owned());
        }
        if !(400..=599).contains(&self.refuse_status) {
            return Err(format!(
                "refuse_status {} is not a 4xx or 5xx status",
                self.refuse_status
            ));
        }
        if let Some(l) = self.rate_limit
            && (l.requests == 0 || l.window < Duration::from_millis(1))
        {
            return Err(
                "rate_limit needs at least 1 request per window of at least 1 ms".to_owned(),
            );
        }
        self.service.validate()?;
        self.faults.validate()
    }
}

/// The service time model. With `u = in_flight/max_concurrency` (the share of slots busy, read
/// at every token) and `j` one jitter draw per request (mean 1), a request producing `n` tokens
/// takes
///
/// ```text
/// (base_latency + prefill_per_token·p)·j·(1 + batch_slowdown·u)  +  Σ_{i=1..n} per_token·j·(1 + batch_slowdown·u + saturation_slowdown·u²)
/// ```
///
/// where `p` is the prompt tokens not served from the prefix cache (a cached token costs no
/// prefill, as a vLLM KV block found in its cache is not computed again)
///
/// once it holds a slot: a model server batches the calls in flight, so each step (prefill and
/// every decoded token) gets slower as the batch grows, long before the slots run out
/// (`batch_slowdown`, linear), and slower still as the batch fills (`saturation_slowdown`).
/// Time spent queued for a slot comes on top: past its slots, the server's throughput is flat.

#[derive(Debug, Clone, PartialEq)]
pub struct ServiceTime {
    /// Time to the first token (prefill), per request.
    pub base_latency: Duration,
    /// Prefill time per prompt token not served from the prefix cache, on top of
    /// `base_latency` (default zero: prefill takes `base_latency` whatever the prompt).
    pub prefill_per_token: Duration,
    /// Decode time per output token at low load.
    pub per_token: Duration,
    /// Per-request multiplicative jitter.
    pub jitter: Jitter,
    /// How much slower prefill and each token get, in proportion to the share of slots busy:
    /// 1.0 means twice as slow with every slot busy, 1.5 slower at half of them.
    pub batch_slowdown: f64,
    /// How much slower each token gets, in proportion to the square of the share of slots busy:
    /// 1.0 means twice as slow when every slot is busy, barely slower at a few.
    pub saturation_slowdown: f64,
    /// Output tokens of a request that gives no `max_tokens`.
    pub default_tokens: u32,
    /// Cap on `max_tokens` (a larger request is served with this many).
    pub max_tokens: u32,
}

impl Default for ServiceTime {
    fn default() -> Self {
        Self {
            base_latency: Duration::from_millis(20),
            prefill_per_token: Duration::ZERO,
            per_token: Duration::from_millis(10),
            jitter: Jitter::LogNormal { sigma: 0.25 },
            batch_slowdown: 0.0,
            saturation_slowdown: 1.0,
            default_tokens: 16,
            max_tokens: 4096,
        }
    }
}

impl ServiceTime {
    /// A fixed service time: `base_latency` plus `tokens × per_token`, no jitter, no slowdown.
    pub fn fixed(base_latency: Duration, per_token: Duration, tokens: u32) -> Self {
        Self {
            base_latency,
            prefill_per_token: Duration::ZERO,
            per_token,
            jitter: Jitter::None,
            batch_slowdown: 0.0,
            saturation_slowdown: 0.0,
            default_tokens: tokens,
            max_tokens: tokens.max(1),
        }
    }

    /// The prefill of a prompt of `uncached` tokens not served from the prefix cache, at low
    /// load and before jitter.
    pub fn prefill(&self, uncached: u32) -> Duration {
        self.base_latency
            .saturating_add(self.prefill_per_token.saturating_mul(uncached))
    }

    /// How much slower prefill and one decoded token are with `busy` (0 to 1) of the slots
    /// busy: `(prefill factor, decode factor)`.
    pub fn slowdown(&self, busy: f64) -> (f64, f64) {
        let u = busy.clamp(0.0, 1.0);
        let batch = 1.0 + self.batch_slowdown * u;
        (batch, batch + self.saturation_slowdown * u * u)
    }

    fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("batch_slowdown", self.batch_slowdown),
            ("saturation_slowdown", self.saturation_slowdown),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be a finite number ≥ 0"));
            }
        }
        if self.default_tokens == 0 || self.max_tokens == 0 {
            return Err("default_tokens and max_tokens must be at least 1".to_owned());
        }
        if let Jitter::LogNormal { sigma } = self.jitter
            && !(sigma.is_finite() && (0.0..=3.0).contains(&sigma))
        {
            return Err("log-normal jitter sigma must be within [0, 3]".to_owned());
        }
        Ok(())
    }
}

/// Per-request multiplicative jitter on the service time, with mean 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Jitter {
    /// Every request takes exactly the configured time.
    None,
    /// `exp(σ·z − σ²/2)`, `z` standard normal: most requests near the mean, a long right tail.
    LogNormal {
        /// Standard deviation of the underlying normal.
        sigma: f64,
    },
    /// Exponentially distributed factor (mean 1): very spread out, like a memoryless server.
    Exponential,
}

/// Faults a modelsim injects. Every field defaults to "no fault", so `{}` clears them all and a
/// JSON document may carry only the fields it sets. Ratios are probabilities in `[0, 1]`, drawn
/// independently per inference request, checked in the order reset, error, stall.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Share of inference requests that are accepted and then never answered (no response head),
    /// or, with `stall_after_tokens`, that stop after that many tokens and hang. A stalled request
    /// stays stalled until the client gives up, even if the fault is later cleared.
    pub stall_ratio: f64,
    /// Make stalled requests hang mid-response after this many tokens instead of before the
    /// response head. They hold their concurrency slot while they hang.
    pub stall_after_tokens: Option<u32>,
    /// Share of inference requests answered at once with `error_status`.
    pub error_ratio: f64,
    /// Status of injected errors (default 500).
    pub error_status: u16,
    /// Share of inference requests whose connection is reset (TCP RST) instead of answered.
    pub reset_ratio: f64,
    /// Delay before the response head of every inference request, in milliseconds.
    pub slow_headers_ms: u64,
    /// `/health` answers 503.
    pub health_failing: bool,
    /// Close a connection that has been idle (no request in progress, no bytes moved) this many
    /// milliseconds, like servers that drop idle keep-alive connections.
    pub idle_close_ms: Option<u64>,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            stall_ratio: 0.0,
            stall_after_tokens: None,
            error_ratio: 0.0,
            error_status: 500,
            reset_ratio: 0.0,
            slow_headers_ms: 0,
            health_failing: false,
            idle_close_ms: None,
        }
    }
}

impl Faults {
    /// Checks ratios and the error status.
    pub fn validate(&self) -> Result<(), String> {
        for (name, ratio) in [
            ("stall_ratio", self.stall_ratio),
            ("error_ratio", self.error_ratio),
            ("reset_ratio", self.reset_ratio),
        ] {
            if !(0.0..=1.0).contains(&ratio) {
                return Err(format!("{name} must be within [0, 1], got {ratio}"));
            }
        }
        if !(400..=599).contains(&self.error_status) {
            return Err(format!(
                "error_status {} is not a 4xx or 5xx status",
                self.error_status
            ));
        }
        if self.idle_close_ms == Some(0) {
            return Err("idle_close_ms must be at least 1 (or absent)".to_owned());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batching_slows_every_step_linearly_and_a_full_batch_decodes_slower_still() {
        let service = ServiceTime {
            batch_slowdown: 1.0,
            saturation_slowdown: 1.0,
            ..ServiceTime::default()
        };
        assert_eq!(service.slowdown(0.0), (1.0, 1.0));
        assert_eq!(service.slowdown(0.5), (1.5, 1.75));
        assert_eq!(service.slowdown(1.0), (2.0, 3.0));
        assert_eq!(service.slowdown(2.0), (2.0, 3.0), "never beyond every slot");
        let bad = ServiceTime {
            batch_slowdown: -1.0,
            ..ServiceTime::default()
        };
        assert!(bad.validate().unwrap_err().contains("batch_slowdown"));
    }
}
