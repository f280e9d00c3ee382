//! The `poolpilot-operator` binary: parse flags, start logging, run until SIGTERM.

use clap::Parser;
use poolpilot_operator::{args::Args, controller, telemetry};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The one TLS stack is rustls with ring; reqwest is built without a provider of its own and
    // takes the process default, so it must be installed before any client is built.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    telemetry::init(&args.log_format);
    controller::run(args).await?;
    Ok(())
}
