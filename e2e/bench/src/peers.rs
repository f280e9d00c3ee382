//! The proxies compared, configured equivalently: one worker, a keep-alive upstream pool with the
//! same connection cap, access logs off, the same idle timeouts. Each run starts a fresh process
//! (so `VmHWM` is that run's peak) from a config rendered here; the configs are also printed
//! into `BENCHMARKS.md` verbatim.

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
    let limits = format!(
        "generation: 0\n\
         listener:\n  idleTimeout: {idle}s\n  headerReadTimeout: 10s\n\
         backends:\n\
         - name: up\n  match: {{pathPrefix: /}}\n\
         \x20 endpoints:\n  - {{name: up-0, address: \"{up}\"}}\n\
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
    format!(
        "global\n\
         \x20   nbthread 1\n\
         \x20   maxconn 9990\n\
         defaults\n\
         \x20   mode http\n\
         \x20   option http-keep-alive\n\
         \x20   timeout connect 1s\n\
         \x20   timeout client 60s\n\
         \x20   timeout server 60s\n\
         \x20   timeout http-keep-alive {idle}s\n\
         \x20   timeout queue {queue}s\n\
         frontend fe\n\
         \x20   bind {listen}\n\
         \x20   maxconn 9990\n\
         \x20   use_backend be_sse if {{ path_beg /v1/sse }}\n\
         \x20   default_backend be\n\
         backend be\n\
         \x20   http-reuse always\n\
         \x20   server up0 {up} maxconn {cap}\n\
         backend be_sse\n\
         \x20   option http-no-delay\n\
         \x20   http-reuse always\n\
         \x20   server up0 {up} maxconn {cap}\n",
        idle = s.idle_timeout_s,
        queue = s.queue_timeout_s,
        listen = s.listen,
        up = s.upstream,
        cap = s.cap,
    )
}

/// `nginx.conf` (single process: the master does the worker's job, as one worker would).
pub fn nginx_config(s: &PeerSettings, run_dir: &Path) -> String {
    let d = run_dir.display();
    format!(
        "daemon off;\n\
         master_process off;\n\
         worker_processes 1;\n\
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
         \x20       location / {{\n\
         \x20           proxy_pass http://up;\n\
         \x20           proxy_http_version 1.1;\n\
         \x20           proxy_set_header Connection \"\";\n\
         \x20       }}\n\
         \x20       location /v1/sse {{\n\
         \x20           proxy_pass http://up;\n\
         \x20           proxy_http_version 1.1;\n\
         \x20           proxy_set_header Connection \"\";\n\
         \x20           proxy_buffering off;\n\
         \x20       }}\n\
         \x20   }}\n\
         }}\n",
        idle = s.idle_timeout_s,
        up = s.upstream,
        cap = s.cap,
        listen = s.listen,
    )
}

/// Starts `target` (not `Direct`) with settings `s`; returns once it proxies a request.
pub async fn start(target: Target, s: &PeerSettings, env: &Env) -> anyhow::Result<Proc> {
    let dir = &env.run_dir;
    let log = dir.join(format!("{}.log", target.name()));
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
                &env.proxy_cpu,
                &env.gateway_bin.display().to_string(),
                &["--config".to_string(), config],
                &[("POOLPILOT_WORKER_THREADS", "1"), ("RUST_LOG", "warn")],
                &log,
            )?
        }
        Target::Haproxy => {
            let path = dir.join("haproxy.cfg");
            std::fs::write(&path, haproxy_config(s))?;
            Proc::spawn(
                "haproxy",
                &env.proxy_cpu,
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
                &env.proxy_cpu,
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
    Ok(proc)
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
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /v1/fast HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")
        .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut buf)).await??;
    Ok(buf.starts_with(b"HTTP/1.1 200"))
}
