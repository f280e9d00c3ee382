//! The proxies compared, configured equivalently: the same number of workers (one, or two in the
//! 2-worker row), a keep-alive upstream pool with the same connection cap, access logs off, the
//! same idle timeouts, and the same forwarding headers (`X-Forwarded-For` and `Via` towards the
//! upstream, `Via` on the response, as the gateway adds them: [`check_forwarding`] refuses a
//! proxy that does not). Towards a TLS upstream ([`UpstreamTls`]) each verifies the server's
//! certificate against the run's CA for the same name, sent as SNI, and keeps sessions to resume
//! (HAProxy's per-server session cache, nginx's `proxy_ssl_session_reuse`, the gateway's
//! per-endpoint session store). Each run starts a fresh process group (so `VmHWM` is that run's peak)
//! from a config rendered here; the configs are also printed into `BENCHMARKS.md` verbatim.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::procs::Proc;

/// What a load generator is pointed at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    /// The upstream itself, no proxy: the baseline for "added latency".
    Direct,
    /// `poolpilot-gateway`.
    Poolpilot,
    /// HAProxy.
    Haproxy,
    /// nginx.
    Nginx,
}

impl Target {
    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Poolpilot => "poolpilot",
            Self::Haproxy => "haproxy",
            Self::Nginx => "nginx",
        }
    }
}

/// Settings shared by every proxy of one part.
#[derive(Clone, Debug)]
pub struct PeerSettings {
    /// Proxy listen address.
    pub listen: SocketAddr,
    /// The upstream.
    pub upstream: SocketAddr,
    /// Connection cap to the upstream (and keep-alive pool size).
    pub cap: u32,
    /// Longest wait for a pooled connection (HAProxy `timeout queue`, poolpilot `leaseTimeout`).
    pub queue_timeout_s: u32,
    /// Keep-alive idle timeout, both sides.
    pub idle_timeout_s: u32,
    /// Worker threads (gateway, HAProxy) or processes (nginx).
    pub workers: u32,
    /// TLS to the upstream (then `upstream` is its TLS address); `None`: plain HTTP.
    pub upstream_tls: Option<UpstreamTls>,
}

/// A TLS upstream: where it listens, the CA its certificate is verified against and the name
/// it is verified for (and sent as SNI).
#[derive(Clone, Debug)]
pub struct UpstreamTls {
    /// The upstream's TLS address.
    pub addr: SocketAddr,
    /// The CA certificate (PEM).
    pub ca_file: PathBuf,
    /// The name in the upstream's certificate.
    pub server_name: String,
}

/// Where binaries and files live.
#[derive(Clone, Debug)]
pub struct Env {
    /// Scratch directory for configs and logs.
    pub run_dir: PathBuf,
    /// The release `poolpilot-gateway` binary.
    pub gateway_bin: PathBuf,
    /// The core the proxy is pinned to.
    pub proxy_cpu: String,
    /// Every core (a `taskset -c` list): where a proxy with more than one worker runs.
    pub all_cpus: String,
}

/// The gateway's own config and its limits document (no access log: nginx runs with
/// `access_log off` too).
pub fn poolpilot_configs(s: &PeerSettings, admin: SocketAddr) -> (String, String) {
    let gateway = format!(
        "listeners:\n  proxy: {listen}\n  admin: {admin}\nadminTokenFile: bench-admin-token\n\
         limitsFile: bench-limits.yaml\nlimitsPollInterval: 60s\ndrainGrace: 1s\n\
         accessLog: {{enabled: false}}\n",
        listen = s.listen,
    );
    let tls = s.upstream_tls.as_ref().map_or(String::new(), |t| {
        format!(
            ", tls: {{serverName: {}, caFile: {}}}",
            t.server_name,
            t.ca_file.display()
        )
    });
    let limits = format!(
        "generation: 0\n\
         listener:\n  idleTimeout: {idle}s\n  headerReadTimeout: 10s\n\
         backends:\n\
         - name: up\n  match: {{pathPrefix: /}}\n\
         \x20 endpoints:\n  - {{name: up-0, address: \"{up}\"{tls}}}\n\
         \x20 pool:\n    maxConnectionsPerEndpoint: {cap}\n    maxPending: 4096\n\
         \x20   leaseTimeout: {queue}s\n    idleTimeout: {idle}s\n    maxLifetime: 1h\n\
         \x20   connectTimeout: 1s\n    validateAfterIdle: 2s\n\
         \x20 timeouts: {{firstByte: 15s, total: 60s, streamIdle: 15s}}\n",
        idle = s.idle_timeout_s,
        up = s.upstream,
        cap = s.cap,
        queue = s.queue_timeout_s,
    );
    (gateway, limits)
}

/// 32 random bytes in hex: the gateway refuses to start without an admin token of at least 32
/// bytes.
fn random_token() -> std::io::Result<String> {
    use std::fmt::Write as _;
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }))
}

/// `haproxy.cfg`.
pub fn haproxy_config(s: &PeerSettings) -> String {
    // HAProxy keeps the last session per server (and thread) to resume; `no-ssl-reuse` would
    // turn that off.
    let tls = s.upstream_tls.as_ref().map_or(String::new(), |t| {
        format!(
            " ssl verify required ca-file {} sni str({name}) verifyhost {name}",
            t.ca_file.display(),
            name = t.server_name
        )
    });
    format!(
        "global\n\
         \x20   nbthread {workers}\n\
         \x20   maxconn 9990\n\
         defaults\n\
         \x20   mode http\n\
         \x20   option http-keep-alive\n\
         \x20   timeout connect 1s\n\
         \x20   timeout client 60s\n\
         \x20   timeout server 60s\n\
         \x20   timeout http-keep-alive {idle}s\n\
         \x20   timeout queue {queue}s\n\
         \x20   option forwardfor\n\
         frontend fe\n\
         \x20   bind {listen}\n\
         \x20   maxconn 9990\n\
         \x20   http-request add-header Via \"1.1 haproxy\"\n\
         \x20   http-response add-header Via \"1.1 haproxy\"\n\
         \x20   use_backend be_sse if {{ path_beg /v1/sse }}\n\
         \x20   default_backend be\n\
         backend be\n\
         \x20   http-reuse always\n\
         \x20   server up0 {up} maxconn {cap}{tls}\n\
         backend be_sse\n\
         \x20   option http-no-delay\n\
         \x20   http-reuse always\n\
         \x20   server up0 {up} maxconn {cap}{tls}\n",
        idle = s.idle_timeout_s,
        queue = s.queue_timeout_s,
        listen = s.listen,
        up = s.upstream,
        cap = s.cap,
        workers = s.workers,
    )
}

/// `nginx.conf`: one worker is a single process (the master does the worker's job, as one
/// worker would); more are a master and its workers.
pub fn nginx_config(s: &PeerSettings, run_dir: &Path) -> String {
    let d = run_dir.display();
    let (scheme, tls) = s
        .upstream_tls
        .as_ref()
        .map_or(("http", String::new()), |t| {
            (
                "https",
                format!(
                    "\x20       proxy_ssl_verify on;\n\
                 \x20       proxy_ssl_trusted_certificate {};\n\
                 \x20       proxy_ssl_name {};\n\
                 \x20       proxy_ssl_server_name on;\n\
                 \x20       proxy_ssl_session_reuse on;\n",
                    t.ca_file.display(),
                    t.server_name
                ),
            )
        });
    format!(
        "daemon off;\n\
         master_process {master};\n\
         worker_processes {workers};\n\
         worker_rlimit_nofile 19000;\n\
         pid {d}/nginx.pid;\n\
         error_log {d}/nginx-error.log error;\n\
         events {{\n    worker_connections 16384;\n}}\n\
         http {{\n\
         \x20   access_log off;\n\
         \x20   client_body_temp_path {d}/nginx-body;\n\
         \x20   proxy_temp_path {d}/nginx-proxy;\n\
         \x20   fastcgi_temp_path {d}/nginx-fastcgi;\n\
         \x20   uwsgi_temp_path {d}/nginx-uwsgi;\n\
         \x20   scgi_temp_path {d}/nginx-scgi;\n\
         \x20   keepalive_timeout {idle}s;\n\
         \x20   keepalive_requests 100000000;\n\
         \x20   upstream up {{\n\
         \x20       server {up} max_conns={cap};\n\
         \x20       keepalive {cap};\n\
         \x20       keepalive_requests 100000000;\n\
         \x20       keepalive_timeout {idle}s;\n\
         \x20   }}\n\
         \x20   server {{\n\
         \x20       listen {listen};\n\
         {tls}\
         \x20       location / {{\n\
         \x20           proxy_pass {scheme}://up;\n\
         \x20           proxy_http_version 1.1;\n\
         \x20           proxy_set_header Connection \"\";\n\
         \x20           proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n\
         \x20           proxy_set_header Via \"1.1 nginx\";\n\
         \x20           add_header Via \"1.1 nginx\" always;\n\
         \x20       }}\n\
         \x20       location /v1/sse {{\n\
         \x20           proxy_pass {scheme}://up;\n\
         \x20           proxy_http_version 1.1;\n\
         \x20           proxy_set_header Connection \"\";\n\
         \x20           proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n\
         \x20           proxy_set_header Via \"1.1 nginx\";\n\
         \x20           add_header Via \"1.1 nginx\" always;\n\
         \x20           proxy_buffering off;\n\
         \x20       }}\n\
         \x20   }}\n\
         }}\n",
        idle = s.idle_timeout_s,
        up = s.upstream,
        cap = s.cap,
        listen = s.listen,
        master = if s.workers > 1 { "on" } else { "off" },
        workers = s.workers,
    )
}

/// Starts `target` (not `Direct`) with settings `s`; returns once it proxies a request.
pub async fn start(target: Target, s: &PeerSettings, env: &Env) -> anyhow::Result<Proc> {
    let dir = &env.run_dir;
    let log = dir.join(format!("{}.log", target.name()));
    let cpus = if s.workers > 1 {
        &env.all_cpus
    } else {
        &env.proxy_cpu
    };
    let mut proc = match target {
        Target::Direct => anyhow::bail!("direct has no proxy"),
        Target::Poolpilot => {
            let admin = SocketAddr::new(s.listen.ip(), s.listen.port() + 1000);
            let (gateway, limits) = poolpilot_configs(s, admin);
            std::fs::write(dir.join("bench-gateway.yaml"), gateway)?;
            std::fs::write(dir.join("bench-limits.yaml"), limits)?;
            std::fs::write(dir.join("bench-admin-token"), random_token()?)?;
            let config = dir.join("bench-gateway.yaml").display().to_string();
            Proc::spawn(
                "poolpilot",
                cpus,
                &env.gateway_bin.display().to_string(),
                &["--config".to_string(), config],
                &[
                    ("POOLPILOT_WORKER_THREADS", &s.workers.to_string()),
                    ("RUST_LOG", "warn"),
                ],
                &log,
            )?
        }
        Target::Haproxy => {
            let path = dir.join("haproxy.cfg");
            std::fs::write(&path, haproxy_config(s))?;
            Proc::spawn(
                "haproxy",
                cpus,
                "haproxy",
                &[
                    "-db".to_string(),
                    "-f".to_string(),
                    path.display().to_string(),
                ],
                &[],
                &log,
            )?
        }
        Target::Nginx => {
            let path = dir.join("nginx.conf");
            std::fs::write(&path, nginx_config(s, dir))?;
            Proc::spawn(
                "nginx",
                cpus,
                "nginx",
                &[
                    "-p".to_string(),
                    dir.display().to_string(),
                    "-c".to_string(),
                    path.display().to_string(),
                ],
                &[],
                &log,
            )?
        }
    };
    wait_ready(&mut proc, s.listen)
        .await
        .with_context(|| format!("{} not ready; see {}", target.name(), log.display()))?;
    check_forwarding(s.listen)
        .await
        .with_context(|| format!("{} is not configured like the others", target.name()))?;
    Ok(proc)
}

/// Fails unless a call through `addr` reached the upstream with `X-Forwarded-For` (naming
/// 127.0.0.1) and `Via`, and came back with `Via`: the work every proxy must do per request.
pub async fn check_forwarding(addr: SocketAddr) -> anyhow::Result<()> {
    let head = get_head(addr, "/v1/headers").await?;
    let header = |name: &str| {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
    };
    let xff = header("x-seen-xff").unwrap_or_default();
    anyhow::ensure!(
        xff.contains("127.0.0.1"),
        "the upstream saw X-Forwarded-For {xff:?}, not the client's address"
    );
    anyhow::ensure!(
        header("x-seen-via").is_some(),
        "the upstream saw no Via header"
    );
    anyhow::ensure!(header("via").is_some(), "the response has no Via header");
    Ok(())
}

/// Waits (up to 10 s) until a `GET /v1/fast` through `addr` answers 200.
pub async fn wait_ready(proc: &mut Proc, addr: SocketAddr) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        proc.check_alive()?;
        if probe(addr).await.unwrap_or(false) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("no 200 from {addr} within 10s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One `GET /v1/fast` on a fresh connection: did it answer 200?
pub async fn probe(addr: SocketAddr) -> anyhow::Result<bool> {
    Ok(get_head(addr, "/v1/fast")
        .await?
        .starts_with("HTTP/1.1 200"))
}

/// The response body of one `GET path` on a fresh connection (a body the server ends by
/// closing the connection, or of its `content-length`).
pub async fn get_body(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let response = get(addr, path).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET {path}: no complete response head"))?;
    anyhow::ensure!(
        head.starts_with("HTTP/1.1 200"),
        "GET {path}: {}",
        head.lines().next().unwrap_or_default()
    );
    Ok(body.to_string())
}

/// The response head of one `GET path` on a fresh connection.
async fn get_head(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    Ok(get(addr, path)
        .await?
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_string())
}

/// The whole response to one `GET path` on a fresh connection (`connection: close`).
async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut buf)).await??;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}
