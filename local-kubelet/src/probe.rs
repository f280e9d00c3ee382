//! Container probes (readiness and liveness): HTTP GET (`scheme: HTTPS` over TLS without
//! verifying the certificate, as the kubelet does), TCP connect and exec, with their timing from
//! the pod spec.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Probe;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

/// When and how often a probe runs, from the spec (Kubernetes defaults where unset).
#[derive(Clone, Copy, Debug)]
pub struct ProbeTiming {
    /// Wait this long after the container starts before the first probe.
    pub initial_delay: Duration,
    /// Time between probes.
    pub period: Duration,
    /// Timeout of one probe.
    pub timeout: Duration,
    /// Consecutive successes that make a failing probe pass.
    pub success_threshold: u32,
    /// Consecutive failures that make a passing probe fail.
    pub failure_threshold: u32,
}

impl ProbeTiming {
    /// Timing of `probe` with Kubernetes' defaults.
    pub fn of(probe: &Probe) -> Self {
        let secs =
            |v: Option<i32>, default: i32| Duration::from_secs(v.unwrap_or(default).max(0) as u64);
        Self {
            initial_delay: secs(probe.initial_delay_seconds, 0),
            period: secs(probe.period_seconds, 10).max(Duration::from_secs(1)),
            timeout: secs(probe.timeout_seconds, 1).max(Duration::from_secs(1)),
            success_threshold: probe.success_threshold.unwrap_or(1).max(1) as u32,
            failure_threshold: probe.failure_threshold.unwrap_or(3).max(1) as u32,
        }
    }
}

/// Runs `probe` once against the container at `pod_ip`; `Err` carries why it failed.
/// Named ports are looked up in `ports` (the container's `ports[].name`).
pub async fn run(
    probe: &Probe,
    pod_ip: &str,
    ports: &BTreeMap<String, u16>,
    env: &BTreeMap<String, String>,
) -> Result<(), String> {
    let timeout = ProbeTiming::of(probe).timeout;
    match tokio::time::timeout(timeout, run_once(probe, pod_ip, ports, env)).await {
        Ok(result) => result,
        Err(_) => Err(format!("probe timed out after {timeout:?}")),
    }
}

async fn run_once(
    probe: &Probe,
    pod_ip: &str,
    ports: &BTreeMap<String, u16>,
    env: &BTreeMap<String, String>,
) -> Result<(), String> {
    if let Some(http) = &probe.http_get {
        let port = port_of(&http.port, ports)?;
        let host = http.host.clone().unwrap_or_else(|| pod_ip.to_owned());
        let path = http.path.clone().unwrap_or_else(|| "/".into());
        let stream = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("connect {host}:{port}: {e}"))?;
        let mut request = format!(
            "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.37\r\nConnection: close\r\n"
        );
        for h in http.http_headers.clone().unwrap_or_default() {
            request.push_str(&format!("{}: {}\r\n", h.name, h.value));
        }
        request.push_str("\r\n");
        let code = match http.scheme.as_deref() {
            Some("HTTPS") => {
                let name = rustls::pki_types::ServerName::try_from(host.clone())
                    .map_err(|e| format!("{host}: {e}"))?;
                let tls = tokio_rustls::TlsConnector::from(TRUSTING_CLIENT.clone())
                    .connect(name, stream)
                    .await
                    .map_err(|e| format!("TLS handshake with {host}:{port}: {e}"))?;
                status_code(tls, &request).await?
            }
            _ => status_code(stream, &request).await?,
        };
        return if (200..400).contains(&code) {
            Ok(())
        } else {
            Err(format!("HTTP probe failed with statuscode: {code}"))
        };
    }
    if let Some(tcp) = &probe.tcp_socket {
        let port = port_of(&tcp.port, ports)?;
        let host = tcp.host.clone().unwrap_or_else(|| pod_ip.to_owned());
        tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("connect {host}:{port}: {e}"))?;
        return Ok(());
    }
    if let Some(exec) = &probe.exec {
        let command = exec.command.clone().unwrap_or_default();
        let (program, args) = command
            .split_first()
            .ok_or("exec probe without a command")?;
        let status = tokio::process::Command::new(program)
            .args(args)
            .env_clear()
            .envs(env)
            .kill_on_drop(true)
            .status()
            .await
            .map_err(|e| format!("exec {program}: {e}"))?;
        return if status.success() {
            Ok(())
        } else {
            Err(format!("exec probe exited with {status}"))
        };
    }
    Err("probe has no handler (httpGet, tcpSocket or exec)".into())
}

/// Sends `request` and reads the status code of the answer.
async fn status_code(
    mut stream: impl AsyncRead + AsyncWrite + Unpin,
    request: &str,
) -> Result<u16, String> {
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut head = vec![0u8; 64];
    let n = stream.read(&mut head).await.map_err(|e| e.to_string())?;
    let line = String::from_utf8_lossy(&head[..n]);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {line:?}"))
}

/// The kubelet's HTTPS probes do not verify the certificate (the pod is reached by IP, and a
/// probe asks whether it answers, not who it is): a TLS client that accepts any.
static TRUSTING_CLIENT: LazyLock<Arc<rustls::ClientConfig>> = LazyLock::new(|| {
    Arc::new(poolpilot_tls::any_server_config().expect("ring supports the default versions"))
});

fn port_of(port: &IntOrString, ports: &BTreeMap<String, u16>) -> Result<u16, String> {
    match port {
        IntOrString::Int(p) => u16::try_from(*p).map_err(|_| format!("bad port {p}")),
        IntOrString::String(name) => ports
            .get(name)
            .copied()
            .ok_or_else(|| format!("no container port named {name:?}")),
    }
}
