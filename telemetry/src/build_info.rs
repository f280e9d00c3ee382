//! `poolpilot_build_info{version, revision}`: always 1, so that a dashboard or an alert can join
//! any series to the build that produced it (`* on(pod) group_left(version) poolpilot_build_info`),
//! and the version and revision it carries (`--version` of every binary).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::gauge::ConstGauge;

/// The workspace version every binary reports.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The source revision (short git hash, or `POOLPILOT_REVISION` set by an image build, or
/// `unknown`).
pub const REVISION: &str = env!("POOLPILOT_REVISION");

/// `--version` text of every binary: `0.1.0 (revision 1a2b3c4d5e6f)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (revision ",
    env!("POOLPILOT_REVISION"),
    ")"
);

/// The build-info collector.
#[derive(Clone, Copy, Debug, Default)]
pub struct BuildInfo;

impl Collector for BuildInfo {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        // A gauge rather than an OpenMetrics `info`: the classic text format has no info type,
        // and the series must be the same whichever format a scraper asks for.
        let gauge = ConstGauge::new(1i64);
        let labels = [("version", VERSION), ("revision", REVISION)];
        let mut metric = encoder.encode_descriptor(
            "poolpilot_build_info",
            "The poolpilot version and source revision this binary was built from (always 1)",
            None,
            gauge.metric_type(),
        )?;
        gauge.encode(metric.encode_family(&labels)?)
    }
}
