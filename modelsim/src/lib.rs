//! modelsim, the simulated model backend: an OpenAI-style HTTP server that behaves like a
//! saturating model server (vLLM-like), with fault injection and exact connection accounting.
//! Used in-process by loopback tests and as the `modelsim` binary in pods, the demo and benches.
//!
//! ```text
//!  client ─► listener ─► connection (counted: open / peak / accepted; idle close; reset)
//!                           └─► request ─► faults (slow headers, reset, error, stall)
//!                                           └─► admission: slot free? ─► serve
//!                                                queue < max_queue? ─► wait (latency rises)
//!                                                else ─► refuse (503 + Retry-After)
//!                                 prefix cache: the prompt's cached blocks (vLLM's automatic prefix caching)
//!                                 serve (u = in_flight/max_concurrency):
//!                                        prefill of the uncached prompt × jitter × (1 + batch_slowdown·u)
//!                                        + per-token time × jitter
//!                                          × (1 + batch_slowdown·u + saturation_slowdown·u²)
//!                                        complete JSON, or one SSE event per token + [DONE]
//! ```
//!
//! Routes (on the serving listener, and on the optional admin listener whose connections are
//! not counted as client connections):
//! - `POST /v1/chat/completions`, `POST /v1/completions` (`stream: true` for SSE; `max_tokens`
//!   or `max_completion_tokens` sets the output length), `GET /v1/models`. Token usage is
//!   reported as vLLM reports it: `usage` (`prompt_tokens`: the prompt's characters ÷ 4,
//!   `completion_tokens`, `total_tokens`) in every complete answer; on a stream only when the
//!   request sets `stream_options.include_usage`, then in a last chunk before `[DONE]` with
//!   `choices: []`, every chunk before it carrying `"usage": null`. Prompt tokens served from
//!   the prefix cache are `usage.prompt_tokens_details.cached_tokens`, present only when there
//!   are some, as vLLM writes it (with `--enable-prompt-tokens-details`; OpenAI's API sends
//!   `cached_tokens: 0` too)
//! - the prefix cache (`prefix_cache`, `--prefix-cache-blocks`, default 8,192 blocks; 0 turns it
//!   off): as vLLM's automatic prefix caching, the prompt in blocks of 16 tokens (64
//!   characters) hashed in a chain over the prefix, full blocks only, the least recently used
//!   evicted first; a prompt whose leading blocks are cached (a repeated system prompt, a
//!   conversation's earlier turns) is served from them, short of its last token, and costs no
//!   prefill for them (`--prefill-per-token-ms`); counted in vLLM's
//!   `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (prompt tokens)
//! - `GET /health`: 200, or 503 when the `health_failing` fault is set or while draining
//! - `GET /metrics`: Prometheus/OpenMetrics text (`modelsim_*` and the standard
//!   `process_*` metrics)
//! - `GET /admin/stats` ([`Stats`] as JSON), `POST /admin/stats/reset-peaks`
//! - `GET /admin/faults`, `PUT /admin/faults` (replace, absent fields = no fault),
//!   `PATCH /admin/faults` (change only the given fields); body: [`Faults`] as JSON; from Rust,
//!   [`Remote`] calls these on a modelsim running in a pod or another process
//!
//! HTTP/1.1 and HTTP/2 (prior knowledge) are both served. Connection counts are of TCP
//! connections: every probe or scrape on the serving listener counts as a client connection,
//! so in a pod give modelsim an admin port (`--admin-port 9000`) and point the readiness probe
//! and the `prometheus.io/port` annotation at it; then `connections_open`/`connections_peak`
//! count the gateway's connections only.
//!
//! Modules, each importing only modules above it in this list (no circle):
//! `config`, `prefix_cache` (the cached prompt blocks), `openai` and `stats` (plain data and the
//! OpenAI wire format) · `conn` (one
//! connection's state) · `metrics` · `admission` (slots and queue) · `shared` (the state of one
//! modelsim) · `body` · `response` (JSON, error and SSE heads) · `engine` (inference) · `handler`
//! (routes) · `server` (accept loops, connection tasks) · `remote` (a client of the admin API).
//!
//! In a test:
//! ```no_run
//! # async fn demo() -> Result<(), poolpilot_modelsim::ModelsimError> {
//! use poolpilot_modelsim::{Config, Faults, Modelsim};
//! let sim = Modelsim::start(Config { max_concurrency: 4, max_queue: 8, ..Config::default() }).await?;
//! let url = sim.url(); // http://127.0.0.1:PORT
//! sim.set_faults(Faults { error_ratio: 0.5, ..Faults::default() })?;
//! let stats = sim.stats();
//! assert!(stats.connections_peak <= 64);
//! sim.shutdown(std::time::Duration::from_secs(5)).await;
//! # Ok(()) }
//! ```

mod admission;
mod body;
mod config;
mod conn;
mod engine;
mod handler;
mod metrics;
mod openai;
mod prefix_cache;
mod rate_limit;
mod remote;
mod response;
mod server;
mod shared;
mod stats;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

pub use config::{Config, DEFAULT_PREFIX_CACHE_BLOCKS, Faults, Jitter, ServiceTime};
pub use prefix_cache::BLOCK_TOKENS;
pub use rate_limit::RateLimit;
pub use remote::Remote;
pub use stats::{ConnectionAtPeak, PEAK_DETAIL_LIMIT, Stats};

use shared::Shared;

/// Why a modelsim could not start or do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum ModelsimError {
    /// The configuration makes no sense.
    #[error("invalid modelsim configuration: {0}")]
    Config(String),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why binding failed.
        source: std::io::Error,
    },
    /// The faults are invalid (the previous ones stay in force).
    #[error("invalid faults: {0}")]
    Faults(String),
    /// [`Modelsim::wait_for`] timed out.
    #[error("timed out after {timeout:?} waiting for {what}; last stats: {last:?}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long.
        timeout: Duration,
        /// The stats last seen.
        last: Box<Stats>,
    },
}

/// A running modelsim. Dropping it stops the server at once (connections are dropped); use
/// [`Modelsim::shutdown`] for a graceful stop.
#[derive(Debug)]
pub struct Modelsim {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    accept_loops: Vec<JoinHandle<()>>,
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ModelsimError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ModelsimError::Bind { addr, source })
}

impl Modelsim {
    /// Validates `config`, binds its listeners and starts serving on the current tokio runtime.
    pub async fn start(config: Config) -> Result<Self, ModelsimError> {
        config.validate().map_err(ModelsimError::Config)?;
        let listener = bind(config.listen).await?;
        let admin_listener = match config.admin_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let local = |l: &TcpListener, asked: SocketAddr| {
            l.local_addr().map_err(|source| ModelsimError::Bind {
                addr: asked,
                source,
            })
        };
        let addr = local(&listener, config.listen)?;
        let admin_addr = match (&admin_listener, config.admin_listen) {
            (Some(l), Some(asked)) => Some(local(l, asked)?),
            _ => None,
        };
        let shared = Arc::new(Shared::new(config));
        let mut accept_loops = vec![tokio::spawn(server::accept_loop(
            Arc::clone(&shared),
            listener,
            false,
        ))];
        if let Some(admin_listener) = admin_listener {
            accept_loops.push(tokio::spawn(server::accept_loop(
                Arc::clone(&shared),
                admin_listener,
                true,
            )));
        }
        Ok(Self {
            addr,
            admin_addr,
            shared,
            accept_loops,
        })
    }

    /// The serving listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin listener's address, if one was configured.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// `http://ADDR` of the serving listener.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The configuration it runs with (faults as they were at start).
    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// A snapshot of its counters and gauges.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    /// The faults in force.
    pub fn faults(&self) -> Faults {
        self.shared.faults.borrow().clone()
    }

    /// Replaces the faults; running connections and requests arriving from now on see them.
    pub fn set_faults(&self, faults: Faults) -> Result<(), ModelsimError> {
        self.shared
            .set_faults(faults)
            .map_err(ModelsimError::Faults)
    }

    /// Changes some faults: `update(&mut current)`.
    pub fn update_faults(&self, update: impl FnOnce(&mut Faults)) -> Result<(), ModelsimError> {
        let mut faults = self.faults();
        update(&mut faults);
        self.set_faults(faults)
    }

    /// Sets every peak (connections, in flight, queued) to its current value.
    pub fn reset_peaks(&self) {
        self.shared.metrics.reset_peaks();
    }

    /// The `/metrics` text as a scrape would see it.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics.encode()
    }

    /// Polls the stats until `condition` holds (returning them) or `timeout` passes.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        condition: impl Fn(&Stats) -> bool,
    ) -> Result<Stats, ModelsimError> {
        let deadline = Instant::now() + timeout;
        loop {
            let stats = self.stats();
            if condition(&stats) {
                return Ok(stats);
            }
            if Instant::now() >= deadline {
                return Err(ModelsimError::Timeout {
                    what: what.to_owned(),
                    timeout,
                    last: Box::new(stats),
                });
            }
            sleep(Duration::from_millis(5)).await;
        }
    }

    /// Graceful stop: no new connections, `/health` answers 503, idle connections close, requests
    /// in progress (streams included) finish for up to `drain`, then the rest are dropped.
    /// Returns the final stats.
    pub async fn shutdown(mut self, drain: Duration) -> Stats {
        self.shared.shutdown.cancel();
        for accept_loop in self.accept_loops.drain(..) {
            if let Err(e) = accept_loop.await {
                tracing::warn!(error = %e, "accept loop ended abnormally");
            }
        }
        self.shared.drain(drain).await;
        self.shared.stats()
    }
}

impl Drop for Modelsim {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
        self.shared.hard_stop.cancel();
    }
}
