//! The standard Prometheus process metrics (`process_cpu_seconds_total`, `process_open_fds`,
//! `process_max_fds`, `process_resident_memory_bytes`, `process_virtual_memory_bytes`,
//! `process_virtual_memory_max_bytes`, `process_start_time_seconds`, `process_threads`), read from
//! `/proc/self` through `procfs` at every scrape, under the names every dashboard already knows.

use procfs::process::{LimitValue, Process};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// One reading of `/proc/self`. A field is `None` where the kernel did not answer (no `/proc`,
/// a restricted sandbox): its metric is then left out rather than reported as zero.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessSample {
    pub cpu_seconds: Option<f64>,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
    pub resident_memory_bytes: Option<u64>,
    pub virtual_memory_bytes: Option<u64>,
    pub virtual_memory_max_bytes: Option<u64>,
    pub start_time_seconds: Option<f64>,
    pub threads: Option<u64>,
}

impl ProcessSample {
    /// Reads this process.
    pub fn read() -> Self {
        let Ok(me) = Process::myself() else {
            return Self::default();
        };
        let mut sample = Self {
            open_fds: me.fd_count().ok().map(|n| n as u64),
            ..Self::default()
        };
        if let Ok(stat) = me.stat() {
            let ticks = procfs::ticks_per_second() as f64;
            sample.cpu_seconds = Some((stat.utime + stat.stime) as f64 / ticks);
            sample.virtual_memory_bytes = Some(stat.vsize);
            sample.resident_memory_bytes = Some(stat.rss * procfs::page_size());
            sample.threads = u64::try_from(stat.num_threads).ok();
            sample.start_time_seconds = procfs::boot_time_secs()
                .ok()
                .map(|boot| boot as f64 + stat.starttime as f64 / ticks);
        }
        if let Ok(limits) = me.limits() {
            sample.max_fds = finite(limits.max_open_files.soft_limit);
            // Unlimited address space is reported as the largest value, as client_golang does.
            sample.virtual_memory_max_bytes =
                Some(finite(limits.max_address_space.soft_limit).unwrap_or(u64::MAX));
        }
        sample
    }
}

fn finite(limit: LimitValue) -> Option<u64> {
    match limit {
        LimitValue::Value(v) => Some(v),
        LimitValue::Unlimited => None,
    }
}

/// The process collector: registered once per registry, it reads `/proc/self` on every encode.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        encode_sample(&ProcessSample::read(), encoder)
    }
}

/// A gauge's value: counts print as integers (`process_open_fds 12`), not `12.0`.
enum Number {
    Int(i64),
    Float(f64),
}

/// Encodes one reading; split from [`ProcessCollector`] so that tests can encode a known one.
pub(crate) fn encode_sample(
    s: &ProcessSample,
    mut encoder: DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    if let Some(cpu) = s.cpu_seconds {
        let counter = ConstCounter::new(cpu);
        let metric = encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            counter.metric_type(),
        )?;
        counter.encode(metric)?;
    }
    let int = |v: Option<u64>| v.map(|v| Number::Int(i64::try_from(v).unwrap_or(i64::MAX)));
    let gauges: [(&str, &str, Option<Number>); 7] = [
        (
            "process_open_fds",
            "Number of open file descriptors",
            int(s.open_fds),
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors (the soft RLIMIT_NOFILE)",
            int(s.max_fds),
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            int(s.resident_memory_bytes),
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            int(s.virtual_memory_bytes),
        ),
        (
            "process_virtual_memory_max_bytes",
            "Maximum amount of virtual memory available in bytes",
            // Unlimited is u64::MAX; as a float it stays the huge number client_golang reports.
            s.virtual_memory_max_bytes.map(|v| Number::Float(v as f64)),
        ),
        (
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            s.start_time_seconds.map(Number::Float),
        ),
        (
            "process_threads",
            "Number of OS threads in the process",
            int(s.threads),
        ),
    ];
    for (name, help, value) in gauges {
        let Some(value) = value else { continue };
        let metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        match value {
            Number::Int(v) => ConstGauge::new(v).encode(metric)?,
            Number::Float(v) => ConstGauge::new(v).encode(metric)?,
        }
    }
    Ok(())
}
