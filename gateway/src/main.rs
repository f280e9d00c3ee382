//! The `poolpilot-gateway` binary: parse the command line, set up logs, build the runtime, run.

use clap::Parser;
use poolpilot_gateway::config::{Args, Command};

/// mimalloc instead of glibc's malloc: a proxied call allocates and frees many small buffers,
/// and at 256 connections glibc's malloc cost about a third of the gateway's user time per
/// request (15.2–16.9 µs against 10.0–10.7 µs; `e2e/bench/analysis.md`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Command::Validate { config, limits }) = &args.command {
        let ok =
            poolpilot_gateway::validate::run(config, limits.as_deref(), &mut std::io::stderr());
        std::process::exit(if ok { 0 } else { 1 });
    }
    poolpilot_gateway::observe::logging::init(args.log_format);
    let config = args.load_config()?;
    args.runtime()?.block_on(poolpilot_gateway::run(config))?;
    Ok(())
}
