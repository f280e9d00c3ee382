//! The state one modelsim shares between its listeners, connections and requests:
//! configuration, faults in force, metrics, admission, the draining and stop signals.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use http::{HeaderValue, StatusCode};
use parking_lot::Mutex;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, timeout_at};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::admission::Admission;
use super::config::{Config, Faults};
use super::metrics::Metrics;
use super::openai::unix_now;
use super::prefix_cache::PrefixCache;
use super::rate_limit::Limiter;
use super::stats::Stats;

/// State shared by every connection and request of one modelsim.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: Config,
    pub faults: watch::Sender<Faults>,
    pub metrics: Metrics,
    pub admission: Admission,
    /// The provider's rate limit, when it has one.
    pub rate_limit: Option<Limiter>,
    pub rng: Mutex<StdRng>,
    /// The prompt blocks cached (vLLM's automatic prefix caching).
    pub prefix_cache: Mutex<PrefixCache>,
    pub refuse_status: StatusCode,
    pub instance_header: Option<HeaderValue>,
    pub started_unix: u64,
    seq: AtomicU64,
    draining: AtomicBool,
    /// The origin of the connections' activity clocks.
    pub epoch: Instant,
    /// Stop accepting and close connections once their current request is answered.
    pub shutdown: CancellationToken,
    /// Drop every connection now.
    pub hard_stop: CancellationToken,
    connections_changed: Notify,
}

impl Shared {
    /// Builds the state of a validated configuration.
    pub fn new(config: Config) -> Self {
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let metrics = Metrics::new(config.max_concurrency, config.max_queue);
        metrics
            .health_failing
            .set(i64::from(config.faults.health_failing));
        Self {
            faults: watch::Sender::new(config.faults.clone()),
            admission: Admission::new(config.max_concurrency, config.max_queue),
            rate_limit: config.rate_limit.map(|l| Limiter::new(l, Instant::now())),
            rng: Mutex::new(rng),
            prefix_cache: Mutex::new(PrefixCache::new(config.prefix_cache_blocks)),
            refuse_status: StatusCode::from_u16(config.refuse_status)
                .unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            instance_header: HeaderValue::from_str(&config.instance).ok(),
            started_unix: unix_now(),
            seq: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            epoch: Instant::now(),
            shutdown: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            connections_changed: Notify::new(),
            metrics,
            config,
        }
    }

    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> Stats {
        self.metrics
            .stats(&self.config.instance, self.is_draining())
    }

    /// Validates and installs new faults; running connections see them at once.
    pub fn set_faults(&self, faults: Faults) -> Result<(), String> {
        faults.validate()?;
        self.metrics
            .health_failing
            .set(i64::from(faults.health_failing));
        self.faults.send_replace(faults);
        Ok(())
    }

    /// Wakes whoever waits for the connections to close: one has just closed.
    pub fn connection_closed(&self) {
        self.connections_changed.notify_waiters();
    }

    fn open_connections(&self) -> i64 {
        self.metrics.connections_open.get() + self.metrics.admin_connections_open.get()
    }

    /// Waits until no connection is open or `deadline` passes; true when none is open.
    async fn connections_closed(&self, deadline: Instant) -> bool {
        loop {
            let notified = self.connections_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.open_connections() == 0 {
                return true;
            }
            if timeout_at(deadline, notified).await.is_err() {
                return self.open_connections() == 0;
            }
        }
    }

    /// Graceful shutdown: stop accepting (the caller ends the accept loops), let requests in
    /// progress finish for up to `drain`, then drop whatever is left.
    pub async fn drain(&self, drain: Duration) {
        self.draining.store(true, Ordering::Relaxed);
        self.shutdown.cancel();
        if !self.connections_closed(Instant::now() + drain).await {
            warn!(
                open = self.open_connections(),
                "drain timeout: dropping the connections left"
            );
        }
        self.hard_stop.cancel();
        self.connections_closed(Instant::now() + Duration::from_secs(1))
            .await;
    }
}
