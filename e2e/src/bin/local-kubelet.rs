//! `local-kubelet`: runs the pods of the embedded cluster as local processes (see
//! `poolpilot_e2e::kubelet`). Started by `cluster up --kubelet PATH`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use poolpilot_e2e::kubelet::api::ApiTls;
use poolpilot_e2e::kubelet::{ImageResolver, KubeletConfig};

/// Makes this machine a Kubernetes node whose pods are local processes.
#[derive(Debug, Parser)]
#[command(version = poolpilot_telemetry::LONG_VERSION)]
struct Args {
    /// kubeconfig of the identity the kubelet uses.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: PathBuf,
    /// Name of the Node to register.
    #[arg(long, default_value = "poolpilot-local")]
    node_name: String,
    /// Where pod folders (volumes, logs) go.
    #[arg(long)]
    state_dir: PathBuf,
    /// A folder searched for image binaries (`<name>` or `poolpilot-<name>`); repeatable.
    #[arg(long = "bin-dir")]
    bin_dirs: Vec<PathBuf>,
    /// An explicit image mapping `IMAGE=PATH`; repeatable.
    #[arg(long = "image", value_parser = parse_image)]
    images: Vec<(String, PathBuf)>,
    /// Longest back-off between restarts of a crashing container.
    #[arg(long, default_value = "10s", value_parser = humantime_secs)]
    max_backoff: Duration,
    /// Where the kubelet API (container logs, for `kubectl logs`) listens: the Node's
    /// InternalIP and kubelet port. Needs the three TLS files; without it, no API.
    #[arg(long, requires_all = ["tls_cert_file", "tls_private_key_file", "client_ca_file"])]
    listen: Option<std::net::SocketAddr>,
    /// The API's serving certificate (PEM).
    #[arg(long)]
    tls_cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long)]
    tls_private_key_file: Option<PathBuf>,
    /// The CA of the only client certificates let in (the apiserver's), PEM.
    #[arg(long)]
    client_ca_file: Option<PathBuf>,
}

fn parse_image(s: &str) -> Result<(String, PathBuf), String> {
    let (image, path) = s.split_once('=').ok_or("expected IMAGE=PATH")?;
    Ok((image.to_owned(), PathBuf::from(path)))
}

fn humantime_secs(s: &str) -> Result<Duration, String> {
    s.parse::<poolpilot_api::Duration>()
        .map(Into::into)
        .map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let args = Args::parse();
    poolpilot_e2e::install_crypto_provider();
    let kubeconfig = kube::config::Kubeconfig::read_from(&args.kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    let host = config.cluster_url.host().unwrap_or("127.0.0.1").to_owned();
    let port = config.cluster_url.port_u16().unwrap_or(443);
    let client = kube::Client::try_from(config)?;
    let kubelet = KubeletConfig {
        node_name: args.node_name,
        state_dir: args.state_dir,
        images: ImageResolver {
            images: args.images.into_iter().collect(),
            bin_dirs: args.bin_dirs,
        },
        apiserver: (host, port),
        backoff: (Duration::from_secs(1), args.max_backoff),
        api: match (
            args.listen,
            args.tls_cert_file,
            args.tls_private_key_file,
            args.client_ca_file,
        ) {
            (Some(addr), Some(cert), Some(key), Some(client_ca)) => Some((
                addr,
                ApiTls {
                    cert,
                    key,
                    client_ca,
                },
            )),
            _ => None,
        },
    };
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    poolpilot_e2e::kubelet::run(client, kubelet, shutdown).await
}
