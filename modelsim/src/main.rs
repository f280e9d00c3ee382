//! The `modelsim` binary: command line and environment around [`poolpilot_modelsim`], with
//! graceful SIGTERM. Every flag has a `MODELSIM_*` environment variable; in a pod, the listener
//! binds `$POD_IP` and the instance is named `$POD_NAME` unless told otherwise.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use poolpilot_modelsim::{
    Config, DEFAULT_PREFIX_CACHE_BLOCKS, Faults, Jitter, Modelsim, RateLimit, ServiceTime,
};
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum JitterKind {
    None,
    Lognormal,
    Exponential,
}

/// A simulated OpenAI-style model server that saturates like a real one: concurrency slots, a
/// bounded queue, refusals, slower decoding under load, and injectable faults.
#[derive(Debug, Parser)]
#[command(name = "modelsim", version = poolpilot_telemetry::LONG_VERSION)]
struct Args {
    /// Serving address (host:port). Default: $POD_IP (or 0.0.0.0) with --port.
    #[arg(long, env = "MODELSIM_LISTEN")]
    listen: Option<SocketAddr>,
    /// Serving port, used when --listen is not given.
    #[arg(long, env = "MODELSIM_PORT", default_value_t = 8000)]
    port: u16,
    /// Admin address (host:port): same routes, connections not counted as client connections.
    /// Point Prometheus and probes here. Default: none, or $POD_IP/0.0.0.0 with --admin-port.
    #[arg(long, env = "MODELSIM_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// Admin port, used when --admin-listen is not given.
    #[arg(long, env = "MODELSIM_ADMIN_PORT")]
    admin_port: Option<u16>,
    /// Instance name for the x-modelsim-instance header and stats. Default: $POD_NAME or "modelsim".
    #[arg(long, env = "MODELSIM_INSTANCE")]
    instance: Option<String>,
    /// Model names served (comma-separated or repeated).
    #[arg(
        long = "model",
        env = "MODELSIM_MODELS",
        value_delimiter = ',',
        default_value = "sim-model"
    )]
    models: Vec<String>,
    /// Time to first token (prefill), milliseconds.
    #[arg(long, env = "MODELSIM_BASE_LATENCY_MS", default_value_t = 20.0)]
    base_latency_ms: f64,
    /// Prefill time per prompt token not served from the prefix cache, on top of
    /// --base-latency-ms, milliseconds (0: prefill takes --base-latency-ms whatever the prompt).
    #[arg(long, env = "MODELSIM_PREFILL_PER_TOKEN_MS", default_value_t = 0.0)]
    prefill_per_token_ms: f64,
    /// Decode time per output token at low load, milliseconds.
    #[arg(long, env = "MODELSIM_PER_TOKEN_MS", default_value_t = 10.0)]
    per_token_ms: f64,
    /// Per-request jitter on the service time (mean 1).
    #[arg(long, env = "MODELSIM_JITTER", value_enum, default_value_t = JitterKind::Lognormal)]
    jitter: JitterKind,
    /// Sigma of the log-normal jitter.
    #[arg(long, env = "MODELSIM_JITTER_SIGMA", default_value_t = 0.25)]
    jitter_sigma: f64,
    /// Slowdown of prefill and every token in proportion to the share of slots busy (1.0 = twice
    /// as slow with every slot busy): a model server batching the calls in flight.
    #[arg(long, env = "MODELSIM_BATCH_SLOWDOWN", default_value_t = 0.0)]
    batch_slowdown: f64,
    /// Per-token slowdown when all slots are busy (1.0 = twice as slow), growing with load².
    #[arg(long, env = "MODELSIM_SATURATION_SLOWDOWN", default_value_t = 1.0)]
    saturation_slowdown: f64,
    /// Output tokens of a request without max_tokens.
    #[arg(long, env = "MODELSIM_DEFAULT_TOKENS", default_value_t = 16)]
    default_tokens: u32,
    /// Cap on max_tokens.
    #[arg(long, env = "MODELSIM_MAX_TOKENS", default_value_t = 4096)]
    max_tokens: u32,
    /// Requests served at once (batch slots).
    #[arg(long, env = "MODELSIM_MAX_CONCURRENCY", default_value_t = 64)]
    max_concurrency: u32,
    /// Requests that may wait for a slot; beyond them requests are refused.
    #[arg(long, env = "MODELSIM_MAX_QUEUE", default_value_t = 128)]
    max_queue: u32,
    /// Status of refusals (503 or 429).
    #[arg(long, env = "MODELSIM_REFUSE_STATUS", default_value_t = 503)]
    refuse_status: u16,
    /// A hosted provider's rate limit: at most this many inference requests per
    /// --rate-limit-window-ms; beyond, 429 with Retry-After until the window ends.
    #[arg(long, env = "MODELSIM_RATE_LIMIT_REQUESTS")]
    rate_limit_requests: Option<u32>,
    /// The rate limit's window, milliseconds (fixed windows from the start).
    #[arg(long, env = "MODELSIM_RATE_LIMIT_WINDOW_MS", default_value_t = 60_000)]
    rate_limit_window_ms: u64,
    /// Prefix cache size in blocks of 16 prompt tokens (vLLM's automatic prefix caching: a
    /// repeated prompt prefix is served from it, reported as usage's
    /// prompt_tokens_details.cached_tokens); 0 turns it off.
    #[arg(long, env = "MODELSIM_PREFIX_CACHE_BLOCKS", default_value_t = DEFAULT_PREFIX_CACHE_BLOCKS)]
    prefix_cache_blocks: usize,
    /// Seed of the random draws (jitter, fault ratios). Default: from the OS.
    #[arg(long, env = "MODELSIM_SEED")]
    seed: Option<u64>,
    /// Fault: share of requests that stall (never answered, or hang mid-response with
    /// --fault-stall-after-tokens).
    #[arg(long, env = "MODELSIM_FAULT_STALL_RATIO", default_value_t = 0.0)]
    fault_stall_ratio: f64,
    /// Fault: stalled requests hang after this many tokens instead of before the response head.
    #[arg(long, env = "MODELSIM_FAULT_STALL_AFTER_TOKENS")]
    fault_stall_after_tokens: Option<u32>,
    /// Fault: share of requests answered with --fault-error-status.
    #[arg(long, env = "MODELSIM_FAULT_ERROR_RATIO", default_value_t = 0.0)]
    fault_error_ratio: f64,
    /// Fault: status of injected errors.
    #[arg(long, env = "MODELSIM_FAULT_ERROR_STATUS", default_value_t = 500)]
    fault_error_status: u16,
    /// Fault: share of requests whose connection is reset (TCP RST).
    #[arg(long, env = "MODELSIM_FAULT_RESET_RATIO", default_value_t = 0.0)]
    fault_reset_ratio: f64,
    /// Fault: delay before every inference response head, milliseconds.
    #[arg(long, env = "MODELSIM_FAULT_SLOW_HEADERS_MS", default_value_t = 0)]
    fault_slow_headers_ms: u64,
    /// Fault: /health answers 503.
    #[arg(long, env = "MODELSIM_FAULT_HEALTH_FAILING")]
    fault_health_failing: bool,
    /// Fault: close connections idle for this many milliseconds.
    #[arg(long, env = "MODELSIM_FAULT_IDLE_CLOSE_MS")]
    fault_idle_close_ms: Option<u64>,
    /// On SIGTERM/SIGINT, how long requests in progress may take to finish, milliseconds.
    #[arg(long, env = "MODELSIM_DRAIN_TIMEOUT_MS", default_value_t = 10_000)]
    drain_timeout_ms: u64,
}

fn millis(name: &str, ms: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(ms / 1000.0).map_err(|e| anyhow::anyhow!("--{name} {ms}: {e}"))
}

impl Args {
    fn into_config(self) -> anyhow::Result<(Config, Duration)> {
        let pod_ip: Option<IpAddr> = match std::env::var("POD_IP") {
            Ok(ip) if !ip.is_empty() => Some(
                ip.parse()
                    .map_err(|e| anyhow::anyhow!("POD_IP {ip:?}: {e}"))?,
            ),
            _ => None,
        };
        let host = pod_ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let listen = self.listen.unwrap_or(SocketAddr::new(host, self.port));
        let admin_listen = self
            .admin_listen
            .or(self.admin_port.map(|port| SocketAddr::new(host, port)));
        let instance = self
            .instance
            .or_else(|| std::env::var("POD_NAME").ok().filter(|n| !n.is_empty()))
            .unwrap_or_else(|| "modelsim".to_owned());
        let jitter = match self.jitter {
            JitterKind::None => Jitter::None,
            JitterKind::Lognormal => Jitter::LogNormal {
                sigma: self.jitter_sigma,
            },
            JitterKind::Exponential => Jitter::Exponential,
        };
        let config = Config {
            listen,
            admin_listen,
            instance,
            models: self
                .models
                .into_iter()
                .map(|m| m.trim().to_owned())
                .collect(),
            service: ServiceTime {
                base_latency: millis("base-latency-ms", self.base_latency_ms)?,
                prefill_per_token: millis("prefill-per-token-ms", self.prefill_per_token_ms)?,
                per_token: millis("per-token-ms", self.per_token_ms)?,
                jitter,
                batch_slowdown: self.batch_slowdown,
                saturation_slowdown: self.saturation_slowdown,
                default_tokens: self.default_tokens,
                max_tokens: self.max_tokens,
            },
            max_concurrency: self.max_concurrency,
            max_queue: self.max_queue,
            refuse_status: self.refuse_status,
            seed: self.seed,
            prefix_cache_blocks: self.prefix_cache_blocks,
            rate_limit: self.rate_limit_requests.map(|requests| RateLimit {
                requests,
                window: Duration::from_millis(self.rate_limit_window_ms),
            }),
            faults: Faults {
                stall_ratio: self.fault_stall_ratio,
                stall_after_tokens: self.fault_stall_after_tokens,
                error_ratio: self.fault_error_ratio,
                error_status: self.fault_error_status,
                reset_ratio: self.fault_reset_ratio,
                slow_headers_ms: self.fault_slow_headers_ms,
                health_failing: self.fault_health_failing,
                idle_close_ms: self.fault_idle_close_ms,
            },
        };
        Ok((config, Duration::from_millis(self.drain_timeout_ms)))
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let (config, drain) = args.into_config()?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let sim = Modelsim::start(config).await?;
    tracing::info!(
        addr = %sim.addr(),
        admin = ?sim.admin_addr(),
        instance = %sim.config().instance,
        models = ?sim.config().models,
        max_concurrency = sim.config().max_concurrency,
        max_queue = sim.config().max_queue,
        "modelsim serving"
    );
    // One machine-readable line on stdout, for whoever started us with port 0.
    match sim.admin_addr() {
        Some(admin) => println!("modelsim listening on {} admin {admin}", sim.addr()),
        None => println!("modelsim listening on {}", sim.addr()),
    }
    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM: draining"),
        _ = sigint.recv() => tracing::info!("SIGINT: draining"),
    }
    // A second signal stops at once: the unfinished drain is dropped with the server.
    let stats = tokio::select! {
        stats = sim.shutdown(drain) => stats,
        _ = sigterm.recv() => {
            tracing::warn!("second signal: stopping without waiting for requests in progress");
            return Ok(());
        }
        _ = sigint.recv() => {
            tracing::warn!("second signal: stopping without waiting for requests in progress");
            return Ok(());
        }
    };
    tracing::info!(
        served = stats.served,
        refused = stats.refused,
        connections_accepted = stats.connections_accepted,
        connections_peak = stats.connections_peak,
        "modelsim stopped"
    );
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("modelsim: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("modelsim: {e:#}");
            ExitCode::FAILURE
        }
    }
}
