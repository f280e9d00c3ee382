//! What every poolpilot binary says about itself: its version (`--version`), the standard
//! `process_*` metrics, `poolpilot_build_info`, and the `/metrics` format a scraper asked for.

mod build_info;
pub mod exposition;
mod process;

pub use build_info::BuildInfo;
pub use exposition::Format;
pub use process::{ProcessCollector, ProcessSample};

use prometheus_client::registry::Registry;

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

/// Registers the process collector and `poolpilot_build_info` in `registry`. Use the root
/// registry (not a prefixed sub-registry): these names are the same for every program.
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(ProcessCollector));
    registry.register_collector(Box::new(BuildInfo));
}

#[cfg(test)]
mod tests;
