//! Logging: `tracing` to stderr, plain or JSON, filtered by `RUST_LOG` (default `info`).

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `format` is `plain` or `json`.
pub fn init(format: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
