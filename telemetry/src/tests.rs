//! The process reading against this very process, both exposition formats on a registry with
//! every metric type the binaries use, and content negotiation with real scrapers' headers.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

use super::*;

/// What Prometheus 3 sends by default (`scrape_protocols` without the protobuf one it prefers).
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1";

#[test]
#[expect(
    clippy::disallowed_methods,
    reason = "process_start_time_seconds is wall-clock time by definition"
)]
fn this_process_reads_as_a_live_process() {
    let s = ProcessSample::read();
    let open = s.open_fds.expect("/proc/self/fd is readable");
    let max = s.max_fds.expect("RLIMIT_NOFILE is finite here");
    assert!(open >= 3 && open <= max, "{open} fds of {max}");
    assert!(s.resident_memory_bytes.expect("rss") > 1 << 20);
    assert!(s.virtual_memory_bytes.expect("vsize") >= s.resident_memory_bytes.unwrap());
    assert!(s.threads.expect("threads") >= 1);
    assert!(s.cpu_seconds.expect("cpu") >= 0.0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = s.start_time_seconds.expect("start time");
    assert!(
        started <= now + 1.0 && started > now - 86_400.0,
        "started {started}, now {now}"
    );
}

#[test]
fn an_open_file_shows_in_the_next_reading() {
    let before = ProcessSample::read().open_fds.unwrap();
    let files: Vec<_> = (0..16)
        .map(|_| std::fs::File::open("/proc/self/status").unwrap())
        .collect();
    let during = ProcessSample::read().open_fds.unwrap();
    drop(files);
    // Other tests open and close files on other threads: 16 more is the floor, not the count.
    assert!(during >= before + 16 - 4, "{before} → {during}");
}

#[test]
fn the_registry_exports_the_standard_process_names_and_the_build() {
    let mut registry = Registry::default();
    register(&mut registry);
    let text = exposition::encode(&registry, Format::Text);
    for name in [
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_max_fds",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_virtual_memory_max_bytes",
        "process_start_time_seconds",
        "process_threads",
    ] {
        assert!(
            text.contains(&format!("\n{name} ")),
            "{name} missing:\n{text}"
        );
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} help:\n{text}"
        );
    }
    let build =
        format!("poolpilot_build_info{{version=\"{VERSION}\",revision=\"{REVISION}\"}} 1\n");
    assert!(text.contains(&build), "{build} missing:\n{text}");
    assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"));
    assert!(!REVISION.is_empty());
    assert!(LONG_VERSION.starts_with(VERSION) && LONG_VERSION.contains(REVISION));
}

#[test]
fn a_missing_reading_leaves_its_metric_out_rather_than_zero() {
    #[derive(Debug)]
    struct Fixed(ProcessSample);
    impl prometheus_client::collector::Collector for Fixed {
        fn encode(
            &self,
            encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
        ) -> Result<(), std::fmt::Error> {
            process::encode_sample(&self.0, encoder)
        }
    }
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Fixed(ProcessSample {
        open_fds: Some(7),
        cpu_seconds: Some(1.5),
        ..ProcessSample::default()
    })));
    let text = exposition::encode(&registry, Format::Text);
    assert_eq!(
        text,
        "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds\n\
         # TYPE process_cpu_seconds_total counter\n\
         process_cpu_seconds_total 1.5\n\
         # HELP process_open_fds Number of open file descriptors\n\
         # TYPE process_open_fds gauge\n\
         process_open_fds 7\n"
    );
}

fn every_type() -> Registry {
    let mut r = Registry::default();
    let calls: Family<Vec<(String, String)>, Counter> = Family::default();
    calls
        .get_or_create(&vec![("outcome".into(), "ok \"quoted\"".into())])
        .inc_by(3);
    r.register("calls", "Calls by \"outcome\"", calls);
    let inflight = Gauge::<i64>::default();
    inflight.set(2);
    r.register("inflight", "Calls in flight", inflight);
    let wait = Histogram::new([0.05, 0.5]);
    wait.observe(0.03125);
    wait.observe(0.25);
    r.register_with_unit("wait", "Lease wait", Unit::Seconds, wait);
    r.register("release", "Release", Info::new(vec![("channel", "stable")]));
    r
}

#[test]
fn the_text_format_names_counters_by_their_total_and_drops_openmetrics_only_lines() {
    let text = exposition::encode(&every_type(), Format::Text);
    assert_eq!(
        text,
        "# HELP calls_total Calls by \"outcome\".\n\
         # TYPE calls_total counter\n\
         calls_total{outcome=\"ok \\\"quoted\\\"\"} 3\n\
         # HELP inflight Calls in flight.\n\
         # TYPE inflight gauge\n\
         inflight 2\n\
         # HELP wait_seconds Lease wait.\n\
         # TYPE wait_seconds histogram\n\
         wait_seconds_sum 0.28125\n\
         wait_seconds_count 2\n\
         wait_seconds_bucket{le=\"0.05\"} 1\n\
         wait_seconds_bucket{le=\"0.5\"} 2\n\
         wait_seconds_bucket{le=\"+Inf\"} 2\n\
         # HELP release_info Release.\n\
         # TYPE release_info gauge\n\
         release_info{channel=\"stable\"} 1\n"
    );
}

#[test]
fn openmetrics_is_served_untouched() {
    let page = exposition::encode(&every_type(), Format::OpenMetrics);
    assert!(page.ends_with("# EOF\n"));
    assert!(page.contains("# TYPE calls counter\n"));
    assert!(page.contains("# UNIT wait_seconds seconds\n"));
}

#[test]
fn every_text_sample_belongs_to_a_family_with_help_and_type() {
    // What `promtool check metrics` asks of a page, on the page with every metric type.
    let mut registry = every_type();
    register(&mut registry);
    let text = exposition::encode(&registry, Format::Text);
    let mut helped = std::collections::HashSet::new();
    let mut typed = std::collections::HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split(' ').next().unwrap().to_owned());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            typed.insert(name.to_owned(), kind.to_owned());
        } else {
            let sample = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    sample
                        .strip_suffix(s)
                        .filter(|f| typed.get(*f).is_some_and(|k| k == "histogram"))
                })
                .unwrap_or(sample);
            assert!(helped.contains(family), "{sample} has no help:\n{text}");
            assert!(typed.contains_key(family), "{sample} has no type:\n{text}");
            if typed[family] == "counter" {
                assert!(family.ends_with("_total"), "{family}");
            }
        }
    }
}

#[test]
fn scrapers_get_the_format_they_prefer() {
    use Format::*;
    let cases = [
        (None, Text),
        (Some("*/*"), Text),
        (Some("text/plain"), Text),
        (Some(PROMETHEUS_ACCEPT), OpenMetrics),
        (Some("application/openmetrics-text"), OpenMetrics),
        (
            Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            OpenMetrics,
        ),
        (Some("application/openmetrics-text;q=0"), Text),
        (
            Some("text/plain;q=0.9, application/openmetrics-text;q=0.5"),
            Text,
        ),
        (
            Some("text/plain;q=0.5, Application/OpenMetrics-Text;q=0.8"),
            OpenMetrics,
        ),
        (Some("application/json"), Text),
        (Some("garbage;;;q=x,,"), Text),
    ];
    for (accept, want) in cases {
        assert_eq!(Format::negotiate(accept), want, "{accept:?}");
    }
    assert!(Text.content_type().starts_with("text/plain; version=0.0.4"));
    assert!(
        OpenMetrics
            .content_type()
            .starts_with("application/openmetrics-text")
    );
}
