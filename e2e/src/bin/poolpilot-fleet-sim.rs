//! poolpilot-fleet-sim: the scale bench's simulated gateway fleet ([`poolpilot_e2e::fleet_sim`]):
//! N admin endpoints on loopback addresses over TLS with a bearer token, and one scrape target
//! with the series of all N pods. Runs until SIGTERM or Ctrl-C.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use poolpilot_api::Duration;
use poolpilot_e2e::credentials::{Pki, server_name};
use poolpilot_e2e::fleet_sim::{Fleet, FleetSpec, server_config};

/// Simulates N gateway pods' admin APIs and their Prometheus series, for the operator's scale
/// bench.
#[derive(Debug, Parser)]
struct Args {
    /// How many pods.
    #[arg(long, default_value_t = 1000)]
    pods: usize,
    /// The first pod's address (127/8); the others follow it, skipping `.0` and `.255`.
    #[arg(long, default_value = "127.1.0.1")]
    first_address: Ipv4Addr,
    /// The admin port of every pod (the operator's `--admin-port`).
    #[arg(long, default_value_t = 9901)]
    port: u16,
    /// The pods' namespace: the `namespace` label of their series, and the name their
    /// certificate carries (`poolpilot-gateway-admin.<namespace>.svc`).
    #[arg(long, default_value = "poolpilot")]
    namespace: String,
    /// The pods' names: this prefix and their index.
    #[arg(long, default_value = "gw-sim-")]
    prefix: String,
    /// A file holding the bearer token the pods accept (the admin-token Secret's value).
    #[arg(long, env = "POOLPILOT_SIM_TOKEN_FILE")]
    token_file: PathBuf,
    /// The pods' certificate and key (PEM). Without them, a CA and a certificate it signs are
    /// made, and the CA written to `--ca-out`.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The key of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Where to write the CA of a made certificate (the operator's `--gateway-ca-file`).
    #[arg(long, default_value = "fleet-sim-ca.crt")]
    ca_out: PathBuf,
    /// How long a pod takes to answer a PUT.
    #[arg(long, default_value = "5ms")]
    latency: Duration,
    /// The fraction of pods that answer after `--slow-latency` instead.
    #[arg(long, default_value_t = 0.01)]
    slow_fraction: f64,
    /// Their latency.
    #[arg(long, default_value = "10s")]
    slow_latency: Duration,
    /// The fraction of pods that answer every PUT 503.
    #[arg(long, default_value_t = 0.01)]
    fail_fraction: f64,
    /// Connections leased per endpoint of each backend on each pod, in the series.
    #[arg(long, default_value_t = 2.0)]
    leased: f64,
    /// Calls completed per second per backend on each pod, in the series.
    #[arg(long, default_value_t = 5.0)]
    calls_per_second: f64,
    /// Where the scrape target listens (`GET /metrics`).
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_listen: SocketAddr,
    /// Where to write the pods, one JSON object a line: name, ip, port, kind.
    #[arg(long)]
    pods_out: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    poolpilot_e2e::install_crypto_provider();
    let args = Args::parse();
    anyhow::ensure!(args.pods > 0, "--pods must be at least 1");
    for (flag, f) in [
        ("--slow-fraction", args.slow_fraction),
        ("--fail-fraction", args.fail_fraction),
    ] {
        anyhow::ensure!((0.0..=1.0).contains(&f), "{flag} {f} is not in [0, 1]");
    }
    let token = std::fs::read_to_string(&args.token_file)
        .with_context(|| format!("reading {}", args.token_file.display()))?
        .trim()
        .to_owned();
    let (cert, key) = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => (
            std::fs::read_to_string(cert)?,
            std::fs::read_to_string(key)?,
        ),
        _ => {
            let pki = Pki::generate("poolpilot fleet-sim CA", &server_name(&args.namespace))?;
            std::fs::write(&args.ca_out, &pki.ca_pem)
                .with_context(|| format!("writing {}", args.ca_out.display()))?;
            (pki.cert_pem, pki.key_pem)
        }
    };
    let spec = FleetSpec {
        pods: args.pods,
        first: args.first_address,
        port: args.port,
        namespace: args.namespace.clone(),
        prefix: args.prefix.clone(),
        token,
        latency: args.latency.get(),
        slow_fraction: args.slow_fraction,
        slow_latency: args.slow_latency.get(),
        fail_fraction: args.fail_fraction,
        leased: args.leased,
        calls_per_second: args.calls_per_second,
    };
    let mut fleet = Fleet::start(spec, server_config(&cert, &key)?).await?;
    let metrics = tokio::net::TcpListener::bind(args.metrics_listen)
        .await
        .with_context(|| format!("binding {}", args.metrics_listen))?;
    fleet.serve_metrics(metrics);
    if let Some(out) = &args.pods_out {
        let lines: String = fleet
            .pods
            .iter()
            .map(|p| {
                let kind = format!("{:?}", p.kind).to_lowercase();
                let line = serde_json::json!({
                    "name": p.name, "ip": p.addr.ip(), "port": p.addr.port(), "kind": kind,
                });
                format!("{line}\n")
            })
            .collect();
        std::fs::write(out, lines).with_context(|| format!("writing {}", out.display()))?;
    }
    let (first, last) = (&fleet.pods[0], &fleet.pods[fleet.pods.len() - 1]);
    println!(
        "fleet-sim: {} pods {} … {}, metrics on http://{}/metrics",
        fleet.pods.len(),
        first.addr,
        last.addr,
        args.metrics_listen
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}
