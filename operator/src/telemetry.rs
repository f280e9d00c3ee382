//! Logging: `tracing` to stderr, text or JSON, filtered by `RUST_LOG` (default `info`). The plain
//! format is coloured only when stderr is a terminal: a log file (the kubelet's, a redirect) gets
//! no ANSI escape codes.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `format` is `text` (alias `plain`) or `json`.
pub fn init(format: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
