//! modelsim's counters and gauges: the Prometheus registry served at `/metrics` and the
//! [`Stats`] snapshot served at `/admin/stats`, both read from the same atomics.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::conn::ConnCtl;
use super::stats::{ConnectionAtPeak, PEAK_DETAIL_LIMIT, Stats};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Open serving connections and the detail of the peak.
#[derive(Debug, Default)]
struct Open {
    /// By connection id.
    conns: BTreeMap<u64, Arc<ConnCtl>>,
    next_id: u64,
    /// `conns` when `connections_peak` was last raised or reset.
    at_peak: Vec<ConnectionAtPeak>,
}

impl Open {
    fn snapshot(&mut self) {
        self.at_peak = if self.conns.len() <= PEAK_DETAIL_LIMIT {
            self.conns.values().map(|c| c.at_peak()).collect()
        } else {
            Vec::new()
        };
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResponseLabels {
    pub endpoint: &'static str,
    pub code: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct FaultLabels {
    pub kind: &'static str,
}

pub(crate) const FAULT_STALL: FaultLabels = FaultLabels { kind: "stall" };
pub(crate) const FAULT_ERROR: FaultLabels = FaultLabels { kind: "error" };
pub(crate) const FAULT_RESET: FaultLabels = FaultLabels { kind: "reset" };
pub(crate) const FAULT_SLOW_HEADERS: FaultLabels = FaultLabels {
    kind: "slow_headers",
};

/// All metrics of one modelsim. Gauges and counters are shared atomics: cloning one (as the
/// registry does) shares the value.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    pub in_flight: Gauge,
    pub in_flight_peak: Gauge,
    pub queued: Gauge,
    pub queued_peak: Gauge,
    pub stalled: Gauge,
    pub max_concurrency: Gauge,
    pub max_queue: Gauge,
    pub requests_received: Counter,
    pub responses: Family<ResponseLabels, Counter>,
    pub served: Counter,
    pub refused: Counter,
    pub rate_limited: Counter,
    pub rejected_invalid: Counter,
    pub cancelled: Counter,
    pub faults: Family<FaultLabels, Counter>,
    pub tokens: Counter,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
    pub duration: Histogram,
    pub queue_wait: Histogram,
    pub time_to_first_token: Histogram,
    pub connections_open: Gauge,
    pub connections_peak: Gauge,
    /// The open serving connections and those at the peak; changed together with the two gauges
    /// above, under this lock, so that the detail matches the peak.
    open: Mutex<Open>,
    pub connections_accepted: Counter,
    pub connections_closed_idle: Counter,
    pub connections_reset: Counter,
    pub accept_errors: Counter,
    pub admin_connections_open: Gauge,
    pub health_failing: Gauge,
}

fn latency_buckets() -> Histogram {
    // 1 ms … ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl Metrics {
    pub fn new(max_concurrency: u32, max_queue: u32) -> Self {
        let mut registry = Registry::default();
        let m = Self {
            in_flight: Gauge::default(),
            in_flight_peak: Gauge::default(),
            queued: Gauge::default(),
            queued_peak: Gauge::default(),
            stalled: Gauge::default(),
            max_concurrency: Gauge::default(),
            max_queue: Gauge::default(),
            requests_received: Counter::default(),
            responses: Family::default(),
            served: Counter::default(),
            refused: Counter::default(),
            rate_limited: Counter::default(),
            rejected_invalid: Counter::default(),
            cancelled: Counter::default(),
            faults: Family::default(),
            tokens: Counter::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            duration: latency_buckets(),
            queue_wait: latency_buckets(),
            time_to_first_token: latency_buckets(),
            connections_open: Gauge::default(),
            connections_peak: Gauge::default(),
            open: Mutex::default(),
            connections_accepted: Counter::default(),
            connections_closed_idle: Counter::default(),
            connections_reset: Counter::default(),
            accept_errors: Counter::default(),
            admin_connections_open: Gauge::default(),
            health_failing: Gauge::default(),
            registry: Registry::default(),
        };
        m.max_concurrency.set(i64::from(max_concurrency));
        m.max_queue.set(i64::from(max_queue));
        let r = &mut registry;
        r.register(
            "modelsim_requests_in_flight",
            "Inference requests holding a concurrency slot",
            m.in_flight.clone(),
        );
        r.register(
            "modelsim_requests_in_flight_peak",
            "Highest in-flight requests since start or peak reset",
            m.in_flight_peak.clone(),
        );
        r.register(
            "modelsim_requests_queued",
            "Inference requests waiting for a concurrency slot",
            m.queued.clone(),
        );
        // The same two gauges under the names vLLM exports them by, so that a policy's
        // saturation query reads modelsim as it reads vLLM (docs/vllm.md).
        r.register(
            "vllm:num_requests_waiting",
            "Requests waiting for a batch slot (as vLLM names it: modelsim_requests_queued)",
            m.queued.clone(),
        );
        r.register(
            "vllm:num_requests_running",
            "Requests in the running batch (as vLLM names it: modelsim_requests_in_flight)",
            m.in_flight.clone(),
        );
        r.register(
            "modelsim_requests_queued_peak",
            "Highest queued requests since start or peak reset",
            m.queued_peak.clone(),
        );
        r.register(
            "modelsim_requests_stalled",
            "Inference requests hanging on the stall fault before their response head",
            m.stalled.clone(),
        );
        r.register(
            "modelsim_max_concurrency",
            "Configured concurrency slots",
            m.max_concurrency.clone(),
        );
        r.register(
            "modelsim_max_queue",
            "Configured queue length beyond the slots",
            m.max_queue.clone(),
        );
        r.register(
            "modelsim_requests_received",
            "Inference requests received",
            m.requests_received.clone(),
        );
        r.register(
            "modelsim_responses",
            "Inference responses by endpoint and status code",
            m.responses.clone(),
        );
        r.register(
            "modelsim_requests_served",
            "Inference requests answered in full",
            m.served.clone(),
        );
        r.register(
            "modelsim_requests_refused",
            "Inference requests refused because the queue was full",
            m.refused.clone(),
        );
        r.register(
            "modelsim_requests_rate_limited",
            "Inference requests refused with 429 and Retry-After by the provider's rate limit",
            m.rate_limited.clone(),
        );
        r.register(
            "modelsim_requests_rejected_invalid",
            "Inference requests rejected as malformed or for an unknown model",
            m.rejected_invalid.clone(),
        );
        r.register(
            "modelsim_requests_cancelled",
            "Inference requests abandoned by the client before completion",
            m.cancelled.clone(),
        );
        r.register(
            "modelsim_faults_injected",
            "Injected faults by kind",
            m.faults.clone(),
        );
        r.register(
            "modelsim_tokens_generated",
            "Output tokens produced",
            m.tokens.clone(),
        );
        // vLLM's prefix cache counters, by its names (v1: `vllm:prefix_cache_queries_total`,
        // `vllm:prefix_cache_hits_total`), in prompt tokens; counted only while the cache is on.
        r.register(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            m.prefix_cache_queries.clone(),
        );
        r.register(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            m.prefix_cache_hits.clone(),
        );
        r.register(
            "modelsim_request_duration_seconds",
            "Time from arrival to the end of the response, of requests served in full",
            m.duration.clone(),
        );
        r.register(
            "modelsim_queue_wait_seconds",
            "Time spent waiting for a concurrency slot",
            m.queue_wait.clone(),
        );
        r.register(
            "modelsim_time_to_first_token_seconds",
            "Time from arrival to the first output token",
            m.time_to_first_token.clone(),
        );
        r.register(
            "modelsim_connections_open",
            "TCP connections held open by clients on the serving listener",
            m.connections_open.clone(),
        );
        r.register(
            "modelsim_connections_peak",
            "Highest open client connections since start or peak reset",
            m.connections_peak.clone(),
        );
        r.register(
            "modelsim_connections_accepted",
            "TCP connections accepted on the serving listener",
            m.connections_accepted.clone(),
        );
        r.register(
            "modelsim_connections_closed_idle",
            "Connections closed by the idle-close fault",
            m.connections_closed_idle.clone(),
        );
        r.register(
            "modelsim_connections_reset",
            "Connections reset by the reset fault",
            m.connections_reset.clone(),
        );
        r.register(
            "modelsim_accept_errors",
            "Failed accepts (e.g. EMFILE when out of file descriptors)",
            m.accept_errors.clone(),
        );
        r.register(
            "modelsim_admin_connections_open",
            "TCP connections open on the admin listener",
            m.admin_connections_open.clone(),
        );
        r.register(
            "modelsim_health_failing",
            "1 while /health answers 503",
            m.health_failing.clone(),
        );
        // The standard process metrics (process_open_fds and process_max_fds among them).
        poolpilot_telemetry::register(r);
        Self { registry, ..m }
    }

    /// Raises `peak` to `value` if it is higher.
    pub fn raise_peak(peak: &Gauge, value: i64) {
        peak.inner().fetch_max(value, Ordering::Relaxed);
    }

    /// Sets every peak to the current value.
    pub fn reset_peaks(&self) {
        self.in_flight_peak.set(self.in_flight.get());
        self.queued_peak.set(self.queued.get());
        let mut open = self.open.lock();
        self.connections_peak.set(self.connections_open.get());
        open.snapshot();
    }

    /// Counts a connection accepted on the serving listener; returns its id for
    /// [`Self::connection_closed`].
    pub fn connection_opened(&self, ctl: &Arc<ConnCtl>) -> u64 {
        self.connections_accepted.inc();
        let mut open = self.open.lock();
        let id = open.next_id;
        open.next_id += 1;
        open.conns.insert(id, Arc::clone(ctl));
        let now = self.connections_open.inc() + 1;
        if now > self.connections_peak.get() {
            self.connections_peak.set(now);
            open.snapshot();
        }
        id
    }

    /// Counts the end of serving connection `id`.
    pub fn connection_closed(&self, id: u64) {
        let mut open = self.open.lock();
        open.conns.remove(&id);
        self.connections_open.dec();
    }

    fn fault_count(&self, labels: &FaultLabels) -> u64 {
        self.faults.get(labels).map_or(0, |c| c.get())
    }

    pub fn stats(&self, instance: &str, draining: bool) -> Stats {
        let g = |g: &Gauge| u64::try_from(g.get()).unwrap_or(0);
        // Under the lock that opening and closing hold: a connection counted open is in the
        // peak too (read apart, a snapshot could see 30 open and a peak of 29).
        let (connections_open, connections_peak, connections_at_peak) = {
            let open = self.open.lock();
            (
                g(&self.connections_open),
                g(&self.connections_peak),
                open.at_peak.clone(),
            )
        };
        Stats {
            instance: instance.to_owned(),
            connections_open,
            connections_peak,
            connections_at_peak,
            connections_accepted: self.connections_accepted.get(),
            connections_closed_idle: self.connections_closed_idle.get(),
            connections_reset: self.connections_reset.get(),
            accept_errors: self.accept_errors.get(),
            admin_connections_open: g(&self.admin_connections_open),
            in_flight: g(&self.in_flight),
            in_flight_peak: g(&self.in_flight_peak),
            queued: g(&self.queued),
            queued_peak: g(&self.queued_peak),
            stalled: g(&self.stalled),
            max_concurrency: g(&self.max_concurrency),
            max_queue: g(&self.max_queue),
            requests_received: self.requests_received.get(),
            served: self.served.get(),
            refused: self.refused.get(),
            rate_limited: self.rate_limited.get(),
            rejected_invalid: self.rejected_invalid.get(),
            cancelled: self.cancelled.get(),
            errors_injected: self.fault_count(&FAULT_ERROR),
            resets_injected: self.fault_count(&FAULT_RESET),
            stalls_injected: self.fault_count(&FAULT_STALL),
            tokens_generated: self.tokens.get(),
            prefix_cache_queries: self.prefix_cache_queries.get(),
            prefix_cache_hits: self.prefix_cache_hits.get(),
            draining,
        }
    }

    /// The OpenMetrics text exposition (the process metrics read from `/proc/self` now).
    pub fn encode(&self) -> String {
        poolpilot_telemetry::exposition::encode(
            &self.registry,
            poolpilot_telemetry::Format::OpenMetrics,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_and_the_batch_are_also_exported_under_vllms_names() {
        let m = Metrics::new(4, 8);
        m.queued.set(3);
        m.in_flight.set(4);
        let text = m.encode();
        for line in [
            "modelsim_requests_queued 3",
            "vllm:num_requests_waiting 3",
            "modelsim_requests_in_flight 4",
            "vllm:num_requests_running 4",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
    }

    #[test]
    fn exposition_names_the_contract_metrics() {
        let m = Metrics::new(4, 8);
        m.refused.inc();
        m.faults.get_or_create(&FAULT_SLOW_HEADERS).inc();
        let text = m.encode();
        for name in [
            "modelsim_requests_in_flight ",
            "modelsim_requests_queued ",
            "modelsim_requests_refused_total 1",
            "modelsim_requests_served_total 0",
            "modelsim_request_duration_seconds_bucket",
            "modelsim_connections_open ",
            "modelsim_connections_accepted_total ",
            "modelsim_faults_injected_total{kind=\"slow_headers\"} 1",
            "modelsim_max_concurrency 4",
            "vllm:prefix_cache_queries_total 0",
            "vllm:prefix_cache_hits_total 0",
            "process_open_fds ",
            "process_max_fds ",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }
}
