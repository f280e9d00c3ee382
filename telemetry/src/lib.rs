//! What every poolpilot binary says about itself: its version (`--version`), the standard
//! `process_*` metrics, `poolpilot_build_info`, and the `/metrics` format a scraper asked for.

mod build_info;
pub mod exposition;
mod process;

pub use build_info::{BuildInfo, LONG_VERSION, REVISION, VERSION};
pub use exposition::Format;
pub use process::{ProcessCollector, ProcessSample};

use prometheus_client::registry::Registry;

/// Registers the process collector and `poolpilot_build_info` in `registry`. Use the root
/// registry (not a prefixed sub-registry): these names are the same for every program.
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(ProcessCollector));
    registry.register_collector(Box::new(BuildInfo));
}

#[cfg(test)]
mod tests;
