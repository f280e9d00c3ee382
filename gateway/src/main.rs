//! The `poolpilot-gateway` binary: parse the command line, set up logs, build the runtime, run.

use std::io::IsTerminal as _;

use clap::Parser;
use poolpilot_gateway::config::{Args, LogFormat};

/// mimalloc instead of glibc's malloc: a proxied call allocates and frees many small buffers,
/// and at 256 connections glibc's malloc cost about a third of the gateway's user time per
/// request (15.2–16.9 µs against 10.0–10.7 µs; `e2e/bench/analysis.md`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // Colours only on a terminal: log files and collectors get plain text.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
    match args.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.init(),
    }
    let config = args.load_config()?;
    args.runtime()?.block_on(poolpilot_gateway::run(config))?;
    Ok(())
}
