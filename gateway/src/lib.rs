//! poolpilot-gateway: the data plane. A reverse proxy for model backends that pools
//! connections per endpoint under a hard cap, throttles each client, cuts slow calls, tells
//! rejected clients when to come back, and exposes what the operator needs to tune it.
//!
//! ```text
//!  client ──► listen (accept caps, PROXY v2, h1/h2, parking, idle timeout, drain)
//!               │
//!               ▼
//!             proxy: head → route (path / headers / JSON model) → identity → class
//!               │      → tokens (the client's token budget: 429) → limits (per-client
//!               │      limiter: 429) → headers → forward; the response's usage settles
//!               ▼
//!             pool (per backend, per endpoint cap, FIFO waiters: 503) ──► upstream ──► backend
//!               ▲                 ▲
//!     pool::health (probes,       live (limits in force; applied by admin PUT or reload)
//!       ejection)
//!
//!  admin port: /healthz /readyz /metrics /v1/limits /v1/stats        observe: metrics, logs
//! ```
//!
//! | module | owns |
//! |---|---|
//! | [`listen`] | the client-facing listener: accept, caps, HTTP/1 and h2 connections, parking, deadlines' cuts, drain |
//! | `proxy` | one proxied call, phase by phase (`proxy/pipeline.rs`), and the one place failures become responses |
//! | [`pool`] | the per-backend connection pool: cap, waiters, idle reuse, endpoint choice, health |
//! | `upstream` | connections to backends, the pooled unit: HTTP/1.1, or stream slots of HTTP/2 ones (`upstream/h2.rs`), plain or TLS (`upstream/tls.rs`) |
//! | `limits` | per-client limiter, the waiter queue, the pod-wide upstream share, the memory of refusals |
//! | `tokens` | model tokens: a call's estimate, its response's usage, the clients' token budgets, OpenAI's rate-limit headers |
//! | `live` | the limits in force, applied in place; `/v1/stats` and the scrape's gauges |
//! | [`observe`] | metrics, label values, incident signals, the access log, logs |
//! | `admin` | the admin API on its own port: routes, listener, token, TLS |
//! | `pem` | the one PEM parser: certificate chains and private keys (admin and upstream TLS) |
//! | [`config`], [`reload`], [`validate`] | the gateway's config, the files it follows, `poolpilot-gateway validate` |
//!
//! Every failure of a request is typed and becomes a response in one place: `proxy/error.rs`.

mod admin;
pub mod config;
mod limits;
pub mod listen;
mod live;
pub mod observe;
mod pem;
pub mod pool;
mod proxy;
pub mod reload;
pub mod resolve;
mod tokens;
mod upstream;
pub mod validate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::GatewayConfig;
pub use live::{Gateway, LimitsSource};
pub use observe::Metrics;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration could not be read.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// The admin token is missing or not fit for use.
    #[error(transparent)]
    AdminToken(#[from] admin::token::TokenError),
    /// The admin listener's thread could not be started.
    #[error("the admin listener's thread could not be started")]
    AdminThread(#[source] std::io::Error),
    /// The admin certificate could not be loaded.
    #[error("the admin certificate could not be loaded")]
    AdminTls(#[from] admin::tls::TlsError),
    /// The access log file could not be opened.
    #[error("opening the access log failed")]
    AccessLog(#[source] std::io::Error),
    /// A listener could not be bound.
    #[error("binding {addr} failed")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
}

/// A started gateway.
#[derive(Debug)]
pub struct Running {
    /// The bound proxy address.
    pub proxy_addr: SocketAddr,
    /// The bound admin address.
    pub admin_addr: SocketAddr,
    /// The live state.
    pub gateway: Gateway,
    shutdown: watch::Sender<bool>,
    conns: Arc<listen::Connections>,
    tasks: Vec<JoinHandle<()>>,
    drain_grace: Duration,
    shutdown_delay: Duration,
}

/// Binds the listeners, loads the limits file if there is one, and starts serving.
pub async fn start(config: GatewayConfig) -> Result<Running, StartError> {
    let (token, token_file) = admin::token::load(config.admin_token_file.as_deref())?;
    let tokens = Arc::new(admin::AdminTokens::new(
        &token,
        config.admin_token_overlap.get(),
    ));
    let tls = config
        .admin_tls
        .as_ref()
        .map(admin::tls::AdminTls::load)
        .transpose()?;
    if tls.is_none() && !config.listeners.admin.ip().is_loopback() {
        tracing::warn!(
            admin = %config.listeners.admin,
            "the admin listener is plain HTTP off loopback: its bearer token crosses the network in clear text (set adminTls)"
        );
    }
    let bind =
        |addr: SocketAddr| listen::bind(addr).map_err(|source| StartError::Bind { addr, source });
    let proxy = bind(config.listeners.proxy)?;
    let admin = bind(config.listeners.admin)?;
    let proxy_addr = proxy.local_addr().map_err(|source| StartError::Bind {
        addr: config.listeners.proxy,
        source,
    })?;
    let admin_addr = admin.local_addr().map_err(|source| StartError::Bind {
        addr: config.listeners.admin,
        source,
    })?;

    let access_log =
        observe::access::AccessLog::open(&config.access_log).map_err(StartError::AccessLog)?;
    let metrics = Metrics::with_lease_wait_buckets(config.metrics.lease_wait_buckets());
    let connector = upstream::HttpConnector::new(config.upstream_keepalive.settings());
    let gw = Gateway::configured(
        metrics,
        access_log,
        connector,
        config.early_retries.penalty_factor,
        config.dns.clone(),
    );
    let (shutdown, shutdown_rx) = watch::channel(false);
    let conns = Arc::new(listen::Connections::default());
    let mut tasks = vec![
        gw.spawn_maintenance(),
        gw.spawn_dns_refresh(),
        gw.spawn_secret_refresh(config.limits_poll_interval.get()),
        observe::incidents::spawn_lag_probe(gw.metrics().incidents().clone()),
    ];
    let poll = config.limits_poll_interval.get();
    // Each followed file is read every `poll` until shutdown; a change goes to its `on_change`.
    let mut follow = |file: reload::FileWatch, on_change: reload::OnChange| {
        tasks.push(tokio::spawn(file.poll(
            poll,
            shutdown_rx.clone(),
            on_change,
        )));
    };
    if let Some(path) = &config.limits_file {
        gw.await_operator(config.await_operator.get());
        let seen = match reload::load_once(&gw, path) {
            Ok(watch) => watch,
            Err(error) => {
                tracing::warn!(%error, "no limits file yet; waiting for it or for PUT /v1/limits");
                reload::FileWatch::new(vec![path.clone()])
            }
        };
        follow(seen, reload::on_limits_change(gw.clone(), path.clone()));
    }
    if let Some(path) = &config.admin_token_file {
        let metrics = gw.metrics().clone();
        follow(
            token_file,
            admin::token::on_token_change(tokens.clone(), path.clone(), metrics),
        );
    }
    let tls = tls.map(|(tls, files)| {
        let metrics = gw.metrics().clone();
        follow(
            files,
            admin::tls::on_certificate_change(tls.clone(), metrics),
        );
        tls
    });
    let admin_listener = admin::AdminListener {
        timeout: config.admin_header_read_timeout.get(),
        max_connections: config.admin_max_connections as usize,
        tls,
        work: Some(tokio::runtime::Handle::current()),
    };
    // The admin socket moves to the admin thread's own reactor: its readiness must not wait
    // for a busy proxy runtime to poll its driver.
    let admin = admin.into_std().map_err(|source| StartError::Bind {
        addr: config.listeners.admin,
        source,
    })?;
    let admin_thread =
        admin::listener::spawn_thread(shutdown_rx.clone()).map_err(StartError::AdminThread)?;
    let (admin_gw, admin_shutdown) = (gw.clone(), shutdown_rx.clone());
    tasks.push(admin_thread.spawn(async move {
        match tokio::net::TcpListener::from_std(admin) {
            Ok(admin) => {
                admin_listener
                    .serve(admin, admin_gw, tokens, admin_shutdown)
                    .await;
            }
            Err(error) => {
                tracing::error!(%error, "the admin listener could not be moved to its thread")
            }
        }
    }));
    tasks.push(tokio::spawn(listen::serve(
        proxy,
        gw.clone(),
        conns.clone(),
        shutdown_rx,
    )));
    tracing::info!(%proxy_addr, %admin_addr, "gateway started");
    Ok(Running {
        proxy_addr,
        admin_addr,
        gateway: gw,
        shutdown,
        conns,
        tasks,
        drain_grace: config.drain_grace.get(),
        shutdown_delay: config.shutdown_delay.get(),
    })
}

impl Running {
    /// Client connections open now.
    pub fn open_connections(&self) -> usize {
        self.conns.open()
    }

    /// Graceful shutdown: readiness fails, the gateway keeps accepting and serving for the
    /// shutdown delay (Services and load balancers take a while to stop routing here), then
    /// the listeners stop accepting, in-flight requests finish (up to the drain grace), the
    /// upstream connections close on both sides (up to the pools' close grace), and everything
    /// stops. Returns the number of client connections still open when the drain grace ran out
    /// (0 for a clean drain).
    pub async fn shutdown(self) -> usize {
        self.gateway.set_leaving();
        if !self.shutdown_delay.is_zero() {
            tracing::info!(delay = ?self.shutdown_delay, "unready; serving until the delay is over");
            tokio::time::sleep(self.shutdown_delay).await;
        }
        self.gateway.set_draining();
        let _ = self.shutdown.send(true);
        let left = listen::drain(&self.conns, self.drain_grace).await;
        for task in &self.tasks {
            task.abort();
        }
        if left > 0 {
            tracing::warn!(left, "drain grace over; closing the remaining connections");
        } else {
            tracing::info!("drained");
        }
        let holding = self.gateway.close_upstreams().await;
        if holding > 0 {
            tracing::warn!(
                backends = holding,
                "some backends did not close their side of this gateway's connections in time"
            );
        }
        left
    }
}

/// Runs until SIGTERM or SIGINT, then drains.
pub async fn run(config: GatewayConfig) -> Result<(), StartError> {
    let running = start(config).await?;
    wait_for_signal().await;
    tracing::info!("shutdown signal received; draining");
    running.shutdown().await;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(error) => {
            tracing::warn!(%error, "cannot listen for SIGTERM; only SIGINT stops the gateway");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
