//! The `poolpilot-gateway` binary: parse the command line, set up logs, run.

use std::io::IsTerminal as _;

use clap::Parser;
use poolpilot_gateway::config::{Args, LogFormat};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
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
    poolpilot_gateway::run(config).await?;
    Ok(())
}
