//! Real servers as the gateway's backends, started by the tests on 127.0.0.1 from the Debian
//! packages `make upstream-peers` installs (nginx, dnsmasq): each in a temporary folder with its own
//! configuration, stopped when the test drops it. The tests that need one are `#[ignore]`d
//! with the reason, and `make unit` runs them (`-- --ignored reused:: dns:: upstream_tls::`).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::net::TcpStream;

/// A port on 127.0.0.1 free a moment ago, for a server that must be told its port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server process this test started; killed when dropped.
pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    pub dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `program args` in `dir`, and waits (up to 5 s) until `addr` takes TCP connections.
    async fn spawn(program: &str, args: &[&str], dir: tempfile::TempDir, addr: SocketAddr) -> Self {
        let child = Command::new(program)
            .args(args)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("stderr")).unwrap(),
            ))
            .spawn()
            .unwrap_or_else(|e| panic!("{program} runs (make upstream-peers): {e}"));
        let server = Self { child, addr, dir };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(addr).await.is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{program} listens on {addr}: {}",
                server.log("stderr")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server
    }

    /// A file of its folder, as text.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }
}

/// nginx as a model backend: one process (`master_process off`), answering every request with
/// a small JSON body, closing keep-alive connections after `keepalive_timeout` idle and
/// `keepalive_requests` requests; `server` is added to the `server` block.
pub async fn nginx(keepalive_timeout: &str, keepalive_requests: u32, server: &str) -> Server {
    nginx_listening(keepalive_timeout, keepalive_requests, "", server, |_| {
        String::new()
    })
    .await
}

/// [`nginx`] over TLS with `(cert, key)` (PEM), its session cache and tickets on (a client may
/// resume), logging to `access.log` of its folder, per request, whether the session was
/// resumed (`r` or `.`), the SNI and the protocol.
pub async fn nginx_tls(keepalive_requests: u32, (cert, key): &(String, String)) -> Server {
    let log = "access_log access.log tls;";
    nginx_listening("60s", keepalive_requests, " ssl", log, |dir| {
        write(dir, "tls.crt", cert);
        write(dir, "tls.key", key);
        let d = dir.display();
        format!(
            "ssl_certificate {d}/tls.crt; ssl_certificate_key {d}/tls.key; \
             ssl_session_cache shared:SSL:1m; ssl_session_tickets on; \
             log_format tls '$ssl_session_reused $ssl_server_name $ssl_protocol';"
        )
    })
    .await
}

async fn nginx_listening(
    keepalive_timeout: &str,
    keepalive_requests: u32,
    listen: &str,
    server: &str,
    http: impl FnOnce(&Path) -> String,
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let d = dir.path().display();
    let http = http(dir.path());
    let conf = format!(
        r#"daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    keepalive_timeout {keepalive_timeout};
    keepalive_requests {keepalive_requests};
    {http}
    server {{
        listen 127.0.0.1:{port}{listen};
        {server}
        location / {{
            default_type application/json;
            return 200 '{{"ok":true}}';
        }}
    }}
}}
"#
    );
    write(dir.path(), "nginx.conf", &conf);
    let conf_path = dir.path().join("nginx.conf");
    let prefix = format!("{d}/");
    Server::spawn(
        "nginx",
        &["-p", &prefix, "-c", conf_path.to_str().unwrap()],
        dir,
        ([127, 0, 0, 1], port).into(),
    )
    .await
}

pub fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

/// dnsmasq as the DNS server of DNS-named endpoints, on 127.0.0.1 at a port of its own: it
/// answers only from the hosts files in its folder's `hosts/` (re-read when they change, with
/// TTL `ttl` seconds), forwards nothing and reads none of the machine's configuration.
pub async fn dnsmasq(ttl: u32, hosts: &str) -> Server {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("hosts")).unwrap();
    write(&dir.path().join("hosts"), "answer", hosts);
    let port = free_port();
    let hosts_dir = format!("--hostsdir={}", dir.path().join("hosts").display());
    let args = [
        "--keep-in-foreground".to_owned(),
        "--conf-file=/dev/null".to_owned(),
        "--no-resolv".to_owned(),
        "--no-hosts".to_owned(),
        "--no-poll".to_owned(),
        "--user=root".to_owned(),
        "--pid-file=".to_owned(),
        "--listen-address=127.0.0.1".to_owned(),
        "--bind-interfaces".to_owned(),
        format!("--port={port}"),
        format!("--local-ttl={ttl}"),
        "--log-queries".to_owned(),
        "--log-facility=-".to_owned(),
        hosts_dir,
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    Server::spawn_udp("dnsmasq", &args, dir, addr).await
}

impl Server {
    /// [`Server::spawn`] for a server that answers on UDP: waits (up to 5 s) until its log
    /// says it started, then a little more.
    async fn spawn_udp(
        program: &str,
        args: &[&str],
        dir: tempfile::TempDir,
        addr: SocketAddr,
    ) -> Self {
        let child = Command::new(program)
            .args(args)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("stderr")).unwrap(),
            ))
            .spawn()
            .unwrap_or_else(|e| panic!("{program} runs (make upstream-peers): {e}"));
        let mut server = Self { child, addr, dir };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !server.log("stderr").contains("started") {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("{program} exited with {status}: {}", server.log("stderr"));
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{program} starts: {}",
                server.log("stderr")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server
    }

    /// Changes a file of its folder (`hosts/answer` for dnsmasq), atomically.
    pub fn rewrite(&self, name: &str, text: &str) {
        let tmp = self.dir.path().join(format!("{name}.new"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, self.dir.path().join(name)).unwrap();
    }

    /// Stops it now.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
