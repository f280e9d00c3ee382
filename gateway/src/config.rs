//! The gateway's own configuration: command line (clap, and the tokio runtime its
//! `--worker-threads` asks for) and the YAML file it names (listeners, the admin API's token,
//! certificate and limits, limits file, drain grace). The limits themselves are the separate, hot-reloadable
//! [`poolpilot_api::GatewayLimits`] document.

use std::fs;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use poolpilot_api::Duration;
use serde::Deserialize;

pub use crate::observe::access::AccessLogConfig;

/// Command line of `poolpilot-gateway`.
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "poolpilot-gateway",
    version = poolpilot_telemetry::LONG_VERSION,
    about = "poolpilot's pooled, throttled AI gateway",
    subcommand_negates_reqs = true
)]
pub struct Args {
    /// What to do instead of serving.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// The gateway configuration file (YAML).
    #[arg(long, env = "POOLPILOT_GATEWAY_CONFIG", required = true)]
    pub config: Option<PathBuf>,
    /// Where the proxy listens, overriding `listeners.proxy` of the config file
    /// (e.g. `$(POD_IP):8080`; an IPv6 address in brackets: `[fd00::1]:8080`).
    #[arg(long, env = "POOLPILOT_PROXY_LISTEN", value_name = "ADDR")]
    pub proxy_listen: Option<SocketAddr>,
    /// Where the admin API listens, overriding `listeners.admin` of the config file.
    #[arg(long, env = "POOLPILOT_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,
    /// Log format.
    #[arg(long, env = "POOLPILOT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Threads serving connections; default: the CPUs this process may use (its cgroup's CPU
    /// limit included). With 1 the gateway runs tokio's single-threaded scheduler, which
    /// spends nothing on cross-thread wake-ups and work stealing.
    #[arg(long, env = "POOLPILOT_WORKER_THREADS", value_name = "N")]
    pub worker_threads: Option<NonZeroUsize>,
}

/// Commands other than serving.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum Command {
    /// Checks a configuration file and its limits document without starting (like `nginx -t`):
    /// exit status 0 when both are fit to serve, 1 when not.
    Validate {
        /// The gateway configuration file (YAML).
        #[arg(long)]
        config: PathBuf,
        /// The limits document to check (default: the configuration's `limitsFile`, if any).
        #[arg(long)]
        limits: Option<PathBuf>,
    },
}

impl Args {
    /// Loads the config file named by `--config`, with the listeners given on the command line
    /// (or in their environment variables) in place of the file's.
    pub fn load_config(&self) -> Result<GatewayConfig, ConfigError> {
        let path = self
            .config
            .as_deref()
            .ok_or(ConfigError::Invalid("--config is required".to_owned()))?;
        let mut config = GatewayConfig::load(path)?;
        config
            .listeners
            .override_with(self.proxy_listen, self.admin_listen);
        Ok(config)
    }

    /// The tokio runtime for `--worker-threads`.
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let threads = self
            .worker_threads
            .or_else(|| std::thread::available_parallelism().ok())
            .map_or(1, NonZeroUsize::get);
        let mut builder = if threads == 1 {
            tokio::runtime::Builder::new_current_thread()
        } else {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(threads);
            builder
        };
        builder.enable_all().build()
    }
}

/// How logs are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The configuration file.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewayConfig {
    /// Where to listen.
    pub listeners: Listeners,
    /// File holding the admin API's bearer token (required: at least 32 bytes; re-read when it
    /// changes). See `crate::admin::token`.
    #[serde(default)]
    pub admin_token_file: Option<PathBuf>,
    /// How long the previous token stays accepted after the token file changed.
    #[serde(default = "GatewayConfig::default_token_overlap")]
    pub admin_token_overlap: Duration,
    /// HTTPS on the admin listener, from these files (re-read when they change). Omitted: plain
    /// HTTP, for an admin listener on loopback.
    #[serde(default)]
    pub admin_tls: Option<AdminTlsFiles>,
    /// How long the admin listener waits on a client: for a TLS handshake, a request's head
    /// (and between requests on a keep-alive connection), a request body, and a response it
    /// does not take.
    #[serde(default = "GatewayConfig::default_admin_header_read_timeout")]
    pub admin_header_read_timeout: Duration,
    /// Admin connections open at once; a connection beyond them is closed at once.
    #[serde(default = "GatewayConfig::default_admin_max_connections")]
    pub admin_max_connections: u32,
    /// The limits document (YAML or JSON), loaded at start and re-applied when it changes.
    #[serde(default)]
    pub limits_file: Option<PathBuf>,
    /// How often the limits file is checked for changes.
    #[serde(default = "GatewayConfig::default_poll")]
    pub limits_poll_interval: Duration,
    /// How long in-flight requests may take to finish after SIGTERM.
    #[serde(default = "GatewayConfig::default_grace")]
    pub drain_grace: Duration,
    /// After SIGTERM, how long the gateway keeps accepting and serving as usual with `/readyz`
    /// failing, so that Services and load balancers stop routing to it before it drains.
    #[serde(default = "GatewayConfig::default_shutdown_delay")]
    pub shutdown_delay: Duration,
    /// How long a pod started from the limits file stays unready waiting for the operator to
    /// send it its own document (its share for the fleet that now includes it); zero, the
    /// default, serves the file at once (a gateway without operator).
    #[serde(default)]
    pub await_operator: Duration,
    /// The access log: one JSON line per call (see `crate::observe::access`).
    #[serde(default)]
    pub access_log: AccessLogConfig,
    /// How some metrics are measured.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// TCP keepalive of the connections to backends.
    #[serde(default)]
    pub upstream_keepalive: KeepaliveConfig,
    /// What happens to calls that come back before their `Retry-After`.
    #[serde(default)]
    pub early_retries: crate::limits::refusals::EarlyRetryConfig,
    /// How DNS-named endpoints (`host:port`) are resolved.
    #[serde(default)]
    pub dns: crate::resolve::DnsConfig,
}

/// The `upstreamKeepalive` section: TCP keepalive probes on idle upstream connections, so that a
/// connection a middlebox dropped without a word is reset by the kernel (and dropped by the pool)
/// before a request is sent on it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeepaliveConfig {
    /// Whether upstream connections send keepalive probes.
    #[serde(default = "KeepaliveConfig::default_enabled")]
    pub enabled: bool,
    /// Idle time before the first probe.
    #[serde(default = "KeepaliveConfig::default_idle")]
    pub idle: Duration,
    /// Time between probes.
    #[serde(default = "KeepaliveConfig::default_interval")]
    pub interval: Duration,
    /// Unanswered probes before the kernel drops the connection.
    #[serde(default = "KeepaliveConfig::default_count")]
    pub count: u32,
    /// HTTP/2 connections: a `PING` after this long without a frame from the server, idle
    /// connections included.
    #[serde(default = "KeepaliveConfig::default_http2_ping_interval")]
    pub http2_ping_interval: Duration,
    /// HTTP/2 connections: a `PING` unanswered this long drops the connection (its streams
    /// fail as if it closed unanswered: replayable calls go again on a fresh one).
    #[serde(default = "KeepaliveConfig::default_http2_ping_timeout")]
    pub http2_ping_timeout: Duration,
}

impl KeepaliveConfig {
    fn default_enabled() -> bool {
        true
    }

    /// Below the idle timeouts of common load balancers and NAT tables (AWS NLB 350 s, GCP
    /// 600 s, conntrack's established timeout far above): probes keep such a path open.
    fn default_idle() -> Duration {
        Duration::from_secs(30)
    }

    fn default_interval() -> Duration {
        Duration::from_secs(10)
    }

    fn default_count() -> u32 {
        3
    }

    /// As often as the TCP probes go once they start; an HTTP/2 `PING` costs a frame, not a
    /// socket, and the path's load balancers see traffic.
    fn default_http2_ping_interval() -> Duration {
        Duration::from_secs(10)
    }

    fn default_http2_ping_timeout() -> Duration {
        Duration::from_secs(5)
    }

    /// The settings for the connector; `None` when off.
    pub fn settings(&self) -> Option<crate::upstream::Keepalive> {
        self.enabled.then(|| crate::upstream::Keepalive {
            idle: self.idle.get(),
            interval: self.interval.get(),
            count: self.count,
            ping_interval: self.http2_ping_interval.get(),
            ping_timeout: self.http2_ping_timeout.get(),
        })
    }
}

impl Default for KeepaliveConfig {
    fn default() -> Self {
        Self {
            enabled: Self::default_enabled(),
            idle: Self::default_idle(),
            interval: Self::default_interval(),
            count: Self::default_count(),
            http2_ping_interval: Self::default_http2_ping_interval(),
            http2_ping_timeout: Self::default_http2_ping_timeout(),
        }
    }
}

/// The `metrics` section of the configuration file.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetricsConfig {
    /// Upper bounds of the buckets of `poolpilot_pool_lease_wait_seconds`; include your
    /// lease-time SLO's bound so that the share of leases within it is exact. Default: 0.5 ms ×
    /// 2ⁿ up to ~16 s, and 50 ms.
    #[serde(default)]
    pub lease_wait_buckets: Option<Vec<Duration>>,
}

impl MetricsConfig {
    /// The lease-wait buckets in seconds.
    pub fn lease_wait_buckets(&self) -> Vec<f64> {
        match &self.lease_wait_buckets {
            Some(buckets) => buckets.iter().map(|d| d.get().as_secs_f64()).collect(),
            None => crate::observe::metrics::default_lease_wait_buckets(),
        }
    }
}

/// The admin listener's certificate, in the layout of a `kubernetes.io/tls` Secret (cert-manager
/// writes `tls.crt`, `tls.key` and `ca.crt`; the gateway needs the first two).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdminTlsFiles {
    /// The certificate, then its chain (PEM).
    pub cert_file: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// Listener addresses.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Listeners {
    /// The proxy (client-facing) address.
    pub proxy: SocketAddr,
    /// The admin API address (health, metrics, limits).
    pub admin: SocketAddr,
}

impl Listeners {
    /// Replaces the addresses that are given; the others stay.
    pub fn override_with(&mut self, proxy: Option<SocketAddr>, admin: Option<SocketAddr>) {
        if let Some(proxy) = proxy {
            self.proxy = proxy;
        }
        if let Some(admin) = admin {
            self.admin = admin;
        }
    }
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Reading a file failed.
    #[error("reading {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// The configuration is not valid YAML of the expected shape.
    #[error("parsing {path} failed")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_norway::Error,
    },
    /// A setting is out of its range.
    #[error("{0}")]
    Invalid(String),
}

impl GatewayConfig {
    fn default_poll() -> Duration {
        Duration::from_secs(2)
    }

    fn default_grace() -> Duration {
        Duration::from_secs(30)
    }

    fn default_shutdown_delay() -> Duration {
        Duration::from_secs(5)
    }

    /// Long enough for the kubelet to refresh every pod's copy of a rotated Secret (its sync
    /// period, a minute, plus its cache) while the operator already sends the new token.
    fn default_token_overlap() -> Duration {
        Duration::from_secs(5 * 60)
    }

    /// HAProxy's usual `timeout http-request 10s`.
    fn default_admin_header_read_timeout() -> Duration {
        Duration::from_secs(10)
    }

    /// Probes, Prometheus and the operator need a handful.
    fn default_admin_max_connections() -> u32 {
        64
    }

    /// Loads `path`; relative file paths in it are taken relative to its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        let mut config: Self =
            serde_norway::from_str(&text).map_err(|source| ConfigError::Parse {
                path: path.into(),
                source,
            })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let tls = config
            .admin_tls
            .iter_mut()
            .flat_map(|t| [&mut t.cert_file, &mut t.key_file]);
        for file in [&mut config.admin_token_file, &mut config.limits_file]
            .into_iter()
            .flatten()
            .chain(tls)
        {
            if file.is_relative() {
                *file = base.join(&*file);
            }
        }
        if config.admin_header_read_timeout.is_zero() {
            return Err(ConfigError::Invalid(format!(
                "{}: adminHeaderReadTimeout must be longer than 0s",
                path.display()
            )));
        }
        if let Err(message) = config.access_log.validate() {
            return Err(ConfigError::Invalid(format!(
                "{}: {message}",
                path.display()
            )));
        }
        if config
            .metrics
            .lease_wait_buckets
            .as_ref()
            .is_some_and(|b| b.is_empty() || b.iter().any(|d| d.is_zero()))
        {
            return Err(ConfigError::Invalid(format!(
                "{}: metrics.leaseWaitBuckets must list at least one bound, each longer than 0s",
                path.display()
            )));
        }
        let keepalive = &config.upstream_keepalive;
        if keepalive.enabled
            && (keepalive.idle.get() < std::time::Duration::from_secs(1)
                || keepalive.interval.get() < std::time::Duration::from_secs(1)
                || keepalive.count == 0
                || keepalive.http2_ping_interval.get().is_zero()
                || keepalive.http2_ping_timeout.get().is_zero())
        {
            return Err(ConfigError::Invalid(format!(
                "{}: upstreamKeepalive needs idle and interval of at least 1s, a count of at least 1, and HTTP/2 ping interval and timeout longer than 0s",
                path.display()
            )));
        }
        if let Some(problem) = config.dns.problems().first() {
            return Err(ConfigError::Invalid(format!(
                "{}: {problem}",
                path.display()
            )));
        }
        if config.early_retries.penalty_factor == 0 {
            return Err(ConfigError::Invalid(format!(
                "{}: earlyRetries.penaltyFactor must be at least 1",
                path.display()
            )));
        }
        if config.admin_max_connections == 0 {
            return Err(ConfigError::Invalid(format!(
                "{}: adminMaxConnections must be at least 1",
                path.display()
            )));
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_config_loads_with_paths_resolved() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gateway.yaml");
        let config = GatewayConfig::load(&path).expect("the example config is valid");
        assert_eq!(config.listeners.proxy.port(), 8080);
        assert_eq!(
            config.limits_file.as_deref(),
            Some(path.parent().unwrap().join("limits.yaml").as_path())
        );
        assert_eq!(config.drain_grace, Duration::from_secs(30));
        assert_eq!(config.shutdown_delay, Duration::from_secs(5));
    }

    #[test]
    fn the_shipped_deployment_gives_a_shutdown_all_the_time_it_may_take() {
        let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/gateway");
        let config = GatewayConfig::load(&manifests.join("gateway.yaml")).unwrap();
        let deployment: serde_norway::Value =
            serde_norway::from_str(&fs::read_to_string(manifests.join("deployment.yaml")).unwrap())
                .unwrap();
        let grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("the Deployment sets its grace period");
        let needed =
            config.shutdown_delay.get() + config.drain_grace.get() + crate::pool::CLOSE_GRACE;
        assert!(
            std::time::Duration::from_secs(grace) > needed,
            "terminationGracePeriodSeconds {grace} must cover shutdownDelay + drainGrace + the close grace ({needed:?})"
        );
    }

    #[test]
    fn listen_flags_override_the_listeners_of_the_file() {
        use clap::Parser;
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gateway.yaml");
        let config = path.to_str().unwrap();

        let args = Args::try_parse_from(["gw", "--config", config]).unwrap();
        let file = GatewayConfig::load(&path).unwrap();
        assert_eq!(
            args.load_config().unwrap(),
            file,
            "no flag: the file's listeners"
        );

        let args = Args::try_parse_from([
            "gw",
            "--config",
            config,
            "--proxy-listen=10.1.2.3:8080",
            "--admin-listen",
            "[fd00::7]:9901",
        ])
        .unwrap();
        let loaded = args.load_config().unwrap();
        assert_eq!(loaded.listeners.proxy, "10.1.2.3:8080".parse().unwrap());
        assert_eq!(loaded.listeners.admin, "[fd00::7]:9901".parse().unwrap());
        assert_eq!(
            loaded.limits_file, file.limits_file,
            "the rest is the file's"
        );

        let args = Args::try_parse_from(["gw", "--config", config, "--admin-listen=10.1.2.3:9901"])
            .unwrap();
        let loaded = args.load_config().unwrap();
        assert_eq!(
            loaded.listeners.proxy, file.listeners.proxy,
            "only one given"
        );
        assert_eq!(loaded.listeners.admin, "10.1.2.3:9901".parse().unwrap());

        let err = Args::try_parse_from(["gw", "--config", config, "--proxy-listen=10.1.2.3"])
            .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
    }

    #[test]
    fn one_worker_thread_runs_the_single_threaded_scheduler() {
        use clap::Parser as _;
        use tokio::runtime::RuntimeFlavor;
        let flavor = |threads: &str| {
            let args =
                Args::try_parse_from(["gw", "--config", "x", "--worker-threads", threads]).unwrap();
            args.runtime().unwrap().handle().runtime_flavor()
        };
        assert_eq!(flavor("1"), RuntimeFlavor::CurrentThread);
        assert_eq!(flavor("2"), RuntimeFlavor::MultiThread);
        let zero = Args::try_parse_from(["gw", "--config", "x", "--worker-threads", "0"]);
        assert_eq!(
            zero.unwrap_err().kind(),
            clap::error::ErrorKind::ValueValidation
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gw.yaml");
        fs::write(
            &path,
            "listeners: {proxy: '127.0.0.1:1', admin: '127.0.0.1:2'}\nlimitFile: x\n",
        )
        .unwrap();
        let err = GatewayConfig::load(&path).unwrap_err();
        assert!(format!("{:?}", err).contains("limitFile"), "{err:?}");
    }
}
