//! `poolpilot_build_info{version, revision}`: always 1, so that a dashboard or an alert can join
//! any series to the build that produced it (`* on(pod) group_left(version) poolpilot_build_info`).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::gauge::ConstGauge;

/// The build-info collector.
#[derive(Clone, Copy, Debug, Default)]
pub struct BuildInfo;

impl Collector for BuildInfo {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        // A gauge rather than an OpenMetrics `info`: the classic text format has no info type,
        // and the series must be the same whichever format a scraper asks for.
        let gauge = ConstGauge::new(1i64);
        let labels = [("version", crate::VERSION), ("revision", crate::REVISION)];
        let mut metric = encoder.encode_descriptor(
            "poolpilot_build_info",
            "The poolpilot version and source revision this binary was built from (always 1)",
            None,
            gauge.metric_type(),
        )?;
        gauge.encode(metric.encode_family(&labels)?)
    }
}
