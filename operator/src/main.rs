//! The `poolpilot-operator` binary: parse flags, start logging, run until SIGTERM.

use clap::Parser;
use poolpilot_operator::{args::Args, controller, telemetry};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // kube links ring and prometheus-http-query's reqwest links aws-lc-rs: pick one for rustls.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    telemetry::init(&args.log_format);
    controller::run(args).await?;
    Ok(())
}
