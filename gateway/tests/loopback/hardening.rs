//! Loopback tests of the client-facing hardening: malformed input, oversized heads and
//! bodies, slowloris, per-client connection caps, keep-alive idle timeout, graceful drain,
//! and — against the real binary — 10,000 idle client connections (RSS measured), EMFILE
//! survival, SIGTERM, and listen addresses from the command line.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Sends raw bytes and reads until the gateway closes or `wait` passes (see [`raw_exchange`]).
async fn raw(addr: SocketAddr, bytes: &[u8], wait: Duration) -> String {
    raw_exchange(addr, bytes, wait).await.0
}

/// At the default `maxHeaders` (100, hyper's own count, which the gateway then leaves unset)
/// the count still holds: 100 header lines are forwarded (the answer comes through the gateway,
/// with its `Via`; the test backend, a plain hyper server, may itself refuse the 103 lines it
/// then gets), 101 are refused by the gateway with 431.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_header_count_holds_at_one_hundred() {
    let backend = Backend::start().await;
    let gw = Gw::start(with_listener(backend.addr, serde_json::json!({}))).await;
    let wait = Duration::from_secs(2);
    let head = |lines: usize| {
        let extra: String = (1..lines).map(|i| format!("X-H{i}: v\r\n")).collect();
        format!("GET /v1/x HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n")
    };
    // `lines` counts Host and the X-H headers; Connection makes one more.
    let at = raw(gw.proxy, head(99).as_bytes(), wait).await;
    assert!(at.contains("via: 1.1 poolpilot"), "100 header lines: {at}");
    let over = raw(gw.proxy, head(100).as_bytes(), wait).await;
    assert!(over.starts_with("HTTP/1.1 431"), "101 header lines: {over}");
    assert!(!over.contains("via:"), "refused by the gateway: {over}");
    // Fewer than the backend's own limit allows after the gateway's three: answered.
    let ok = raw(gw.proxy, head(96).as_bytes(), wait).await;
    assert!(ok.starts_with("HTTP/1.1 200"), "97 header lines: {ok}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_requests_get_4xx_and_the_gateway_carries_on() {
    let backend = Backend::start().await;
    let gw = Gw::start(with_listener(
        backend.addr,
        serde_json::json!({"maxBodyBytes": 1000, "maxHeaders": 20}),
    ))
    .await;
    let wait = Duration::from_secs(2);

    assert!(
        raw(gw.proxy, b"GARBAGE\r\n\r\n", wait)
            .await
            .starts_with("HTTP/1.1 400")
    );
    assert!(
        raw(
            gw.proxy,
            b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
            wait
        )
        .await
        .starts_with("HTTP/1.1 400")
    );
    assert!(
        raw(gw.proxy, &[0xff; 64], wait)
            .await
            .starts_with("HTTP/1.1 400")
    );

    let huge = format!(
        "GET /v1/x HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(40_000)
    );
    assert!(
        raw(gw.proxy, huge.as_bytes(), wait)
            .await
            .starts_with("HTTP/1.1 431"),
        "an oversized head"
    );
    let many: String = (0..30).map(|i| format!("X-H{i}: v\r\n")).collect();
    let many = format!("GET /v1/x HTTP/1.1\r\nHost: x\r\n{many}\r\n");
    assert!(
        raw(gw.proxy, many.as_bytes(), wait)
            .await
            .starts_with("HTTP/1.1 431"),
        "too many headers"
    );

    let declared = b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n";
    assert!(
        raw(gw.proxy, declared, wait)
            .await
            .starts_with("HTTP/1.1 413"),
        "a declared body over the limit"
    );
    let mut chunked =
        b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..4 {
        chunked.extend_from_slice(format!("190\r\n{}\r\n", "b".repeat(400)).as_bytes());
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let response = raw(gw.proxy, &chunked, wait).await;
    assert!(
        response.starts_with("HTTP/1.1 413"),
        "a streamed body over the limit: {response}"
    );

    assert_eq!(
        post(gw.proxy, "/v1/x", &[], "{}").await.0,
        200,
        "still serving"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_client_is_cut_at_the_header_read_timeout() {
    let backend = Backend::start().await;
    let gw = Gw::start(with_listener(
        backend.addr,
        serde_json::json!({"headerReadTimeout": "400ms"}),
    ))
    .await;
    let mut slow = TcpStream::connect(gw.proxy).await.unwrap();
    let start = Instant::now();
    let mut closed_after = None;
    for byte in b"GET /v1/x HTTP/1.1\r\nHost: x\r\nX-Slow: "
        .iter()
        .chain([b'a'; 200].iter())
    {
        if slow.write_all(&[*byte]).await.is_err() {
            closed_after = Some(start.elapsed());
            break;
        }
        // Meanwhile, normal clients are served.
        tokio::time::sleep(Duration::from_millis(20)).await;
        if start.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    let closed_after = match closed_after {
        Some(t) => t,
        None => {
            let mut buf = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(1), slow.read_to_end(&mut buf)).await;
            assert!(start.elapsed() < Duration::from_secs(5));
            start.elapsed()
        }
    };
    assert!(
        closed_after < Duration::from_secs(3),
        "cut at ~400ms, not served forever: {closed_after:?}"
    );
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_its_sources_cap_is_answered_429_and_closed() {
    let backend = Backend::start().await;
    let gw = Gw::start(with_listener(
        backend.addr,
        serde_json::json!({"maxConnectionsPerClient": 3}),
    ))
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = connect(gw.proxy).await;
        assert_eq!(c.call(request("GET", "/v1/x", &[], "")).await.0, 200);
        held.push(c);
    }
    // The fourth is answered, whether or not it sent its request yet, and closed.
    let response = raw(
        gw.proxy,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
        Duration::from_secs(5),
    )
    .await;
    let (head, body) = response.split_once("\r\n\r\n").expect("a whole response");
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 429"), "{response}");
    assert!(head.contains("\r\nretry-after: "), "{response}");
    assert!(head.contains("\r\nconnection: close"), "{response}");
    let json: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
    assert_eq!(json["error"]["code"], "too_many_connections");
    assert_eq!(json["error"]["type"], "rate_limit_error");

    // Past the answer burst (1000) and rate (100/s), connections are closed without an answer,
    // and counted.
    let mut over = Vec::new();
    for _ in 0..1500 {
        let mut s = TcpStream::connect(gw.proxy).await.unwrap();
        let _ = s
            .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            .await;
        over.push(s);
    }
    let (mut answered, mut dropped) = (1, 0);
    for mut s in over {
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
        if buf.starts_with(b"HTTP/1.1 429") {
            answered += 1;
        } else {
            assert!(buf.is_empty(), "{}", String::from_utf8_lossy(&buf));
            dropped += 1;
        }
    }
    assert!(
        dropped > 0 && answered > 1000,
        "{answered} answered, {dropped} dropped"
    );
    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            "poolpilot_downstream_connections_rejected_total{outcome=\"answered\"}"
        ),
        Some(answered as f64)
    );
    assert_eq!(
        metric(
            &text,
            "poolpilot_downstream_connections_rejected_total{outcome=\"dropped\"}"
        ),
        Some(dropped as f64)
    );
    drop(held);
    assert_eventually!(
        try_get(gw.proxy, "/v1/x").await == Some(200),
        Duration::from_secs(2),
        "room again once the client closed its connections"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_connections_new_clients_wait_in_the_backlog() {
    let backend = Backend::start().await;
    let gw = Gw::start(with_listener(
        backend.addr,
        serde_json::json!({"maxConnections": 2}),
    ))
    .await;
    let mut first = connect(gw.proxy).await;
    let mut second = connect(gw.proxy).await;
    assert_eq!(first.call(request("GET", "/v1/x", &[], "")).await.0, 200);
    assert_eq!(second.call(request("GET", "/v1/x", &[], "")).await.0, 200);
    let third = tokio::spawn({
        let proxy = gw.proxy;
        async move { get(proxy, "/v1/x", &[]).await.0 }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !third.is_finished(),
        "a third connection is not served while two are open"
    );
    drop(first);
    let status = tokio::time::timeout(Duration::from_secs(2), third)
        .await
        .expect("served once one closed");
    assert_eq!(status.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_client_keep_alive_connections_are_closed() {
    let backend = Backend::start().await;
    let gw = Gw::start(with_listener(
        backend.addr,
        serde_json::json!({"idleTimeout": "300ms"}),
    ))
    .await;
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    s.write_all(b"GET /v1/x HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut buf))
        .await
        .expect("the idle keep-alive connection is closed by the gateway")
        .unwrap();
    assert!(String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200"));
    let idle = start.elapsed();
    assert!(
        idle >= Duration::from_millis(250) && idle < Duration::from_secs(2),
        "{idle:?}"
    );
    assert_eventually!(
        gw.open_connections() == 0,
        Duration::from_secs(1),
        "the connection is uncounted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_in_flight_requests_closes_upstreams_and_stops_accepting() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(500, Ordering::SeqCst);
    let mut gw = Gw::start_with(None, Duration::from_secs(5)).await;
    gw.apply(limits("model-a", &[backend.addr], 4));
    let proxy = gw.proxy;
    let in_flight = tokio::spawn(async move { post(proxy, "/v1/x", &[], "{}").await.0 });
    assert_eventually!(
        backend.seen.inflight.load(Ordering::SeqCst) == 1,
        Duration::from_secs(1),
        "in flight"
    );
    let running = gw.running.take().unwrap();
    let start = Instant::now();
    let left = running.shutdown().await;
    assert_eq!(left, 0, "drained cleanly");
    assert_eq!(
        in_flight.await.unwrap(),
        200,
        "the in-flight request completed"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "returned as the call ended, not at the drain deadline: {:?}",
        start.elapsed()
    );
    assert_eq!(
        backend.seen.connections.load(Ordering::SeqCst),
        0,
        "the backend closed its side of the pooled connection before shutdown returned"
    );
    assert!(
        TcpStream::connect(proxy).await.is_err(),
        "no longer accepting"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_shutdown_readiness_fails_first_and_traffic_is_served_for_the_shutdown_delay() {
    let backend = Backend::start().await;
    let mut gw = Gw::start_edited(None, Duration::from_secs(5), Duration::ZERO, |c, _| {
        c.shutdown_delay = Duration::from_millis(800).into();
    })
    .await;
    gw.apply(limits("model-a", &[backend.addr], 4));
    let (proxy, admin) = (gw.proxy, gw.admin);
    let mut kept = connect(proxy).await;
    assert_eq!(kept.call(request("GET", "/v1/x", &[], "")).await.0, 200);
    let running = gw.running.take().unwrap();
    let start = Instant::now();
    let shutdown = tokio::spawn(running.shutdown());
    assert_eventually!(
        try_get(admin, "/readyz").await == Some(503),
        Duration::from_millis(300),
        "readiness fails at once"
    );
    // Load balancers still route here for a while: new connections and requests are served.
    assert_eq!(post(proxy, "/v1/x", &[], "{}").await.0, 200);
    assert_eq!(kept.call(request("GET", "/v1/x", &[], "")).await.0, 200);
    assert!(start.elapsed() < Duration::from_millis(800));
    assert_eq!(shutdown.await.unwrap(), 0);
    assert!(
        start.elapsed() >= Duration::from_millis(800),
        "the drain began after the delay"
    );
    assert!(
        TcpStream::connect(proxy).await.is_err(),
        "no longer accepting"
    );
}

// === the real binary ===

/// A port free on `ip` right now.
fn free_addr(ip: &str) -> SocketAddr {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
}

struct Process {
    child: Child,
    proxy: SocketAddr,
    admin: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Process {
    /// Runs the binary with `limits`, under `ulimit -n <fds>` when given.
    async fn start(limits: &poolpilot_api::GatewayLimits, fds: Option<u32>) -> Self {
        let (proxy, admin) = (free_addr("127.0.0.1"), free_addr("127.0.0.1"));
        Self::launch(limits, fds, (proxy, admin), (proxy, admin), |_| {}).await
    }

    /// Runs the binary with a config file naming the `configured` (proxy, admin) listeners and
    /// `extra` arguments or environment; waits until it is ready on the `serving` admin address.
    async fn launch(
        limits: &poolpilot_api::GatewayLimits,
        fds: Option<u32>,
        configured: (SocketAddr, SocketAddr),
        serving: (SocketAddr, SocketAddr),
        extra: impl FnOnce(&mut Command),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (proxy, admin) = serving;
        std::fs::write(
            dir.path().join("limits.yaml"),
            serde_norway::to_string(limits).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.path().join("token"), TEST_TOKEN).unwrap();
        let config = format!(
            "listeners: {{proxy: '{}', admin: '{}'}}\nadminTokenFile: token\nlimitsFile: limits.yaml\ndrainGrace: 5s\nshutdownDelay: 200ms\n",
            configured.0, configured.1
        );
        std::fs::write(dir.path().join("gateway.yaml"), config).unwrap();
        let bin = env!("CARGO_BIN_EXE_poolpilot-gateway");
        let config_path = dir.path().join("gateway.yaml");
        let mut cmd = match fds {
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(bin);
                c
            }
            None => Command::new(bin),
        };
        cmd.arg("--config").arg(&config_path);
        extra(&mut cmd);
        let child = cmd
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let process = Self {
            child,
            proxy,
            admin,
            _dir: dir,
        };
        assert_eventually!(
            try_get(admin, "/readyz").await == Some(200),
            Duration::from_secs(10),
            "the gateway process becomes ready"
        );
        process
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// SIGTERM, then the exit status.
    async fn terminate(mut self) -> std::process::ExitStatus {
        let ok = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(ok.success());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the gateway exits after SIGTERM");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_client_connections_stay_cheap() {
    let backend = Backend::start().await;
    let process = Process::start(
        &with_listener(
            backend.addr,
            serde_json::json!({"idleTimeout": "60s", "headerReadTimeout": "60s"}),
        ),
        None,
    )
    .await;
    assert_eq!(post(process.proxy, "/v1/x", &[], "{}").await.0, 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = process.rss_kib();

    const N: usize = 10_000;
    let mut idle = Vec::with_capacity(N);
    for _ in 0..N {
        idle.push(TcpStream::connect(process.proxy).await.expect("connect"));
    }
    assert_eventually!(
        metric(
            &get(process.admin, "/metrics", &[]).await.2,
            "poolpilot_downstream_connections"
        ) == Some(N as f64),
        Duration::from_secs(20),
        "the gateway holds every idle connection"
    );
    let after = process.rss_kib();
    let per_conn = (after.saturating_sub(before)) as f64 * 1024.0 / N as f64;
    println!(
        "RSS {before} KiB → {after} KiB with {N} idle client connections: {per_conn:.0} bytes each"
    );
    assert!(
        per_conn < 64.0 * 1024.0,
        "memory per idle connection stays bounded: {per_conn:.0} bytes"
    );
    assert_eq!(
        post(process.proxy, "/v1/x", &[], "{}").await.0,
        200,
        "still serving"
    );
    drop(idle);
    let status = process.terminate().await;
    assert!(status.success(), "SIGTERM exits cleanly: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_is_survived() {
    let backend = Backend::start().await;
    let process = Process::start(&limits("model-a", &[backend.addr], 4), Some(64)).await;
    let mut held = Vec::new();
    for _ in 0..100 {
        if let Ok(s) = TcpStream::connect(process.proxy).await {
            held.push(s);
        }
    }
    // The gateway hit EMFILE accepting some of them; it must back off, not die.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let opened = held.len() as f64;
    drop(held);
    assert_eventually!(
        try_get(process.admin, "/healthz").await == Some(200),
        Duration::from_secs(10),
        "the gateway recovers once descriptors free up"
    );
    let text = get(process.admin, "/metrics", &[]).await.2;
    let errors = metric(&text, "poolpilot_listener_accept_errors_total").unwrap();
    assert!(errors >= 1.0, "accept errors were counted: {errors}");
    assert_eq!(metric(&text, "process_max_fds"), Some(64.0));
    // The connections dropped above that were still in the listen backlog are accepted (each
    // taking a descriptor) and closed in bursts between EMFILE back-offs: until the last one
    // is, a new call may find no descriptor for its upstream connection (a 502
    // `connect_failed`, seen under load). Each connection is counted in the hold histogram at
    // its close.
    let closed = || async {
        let text = get(process.admin, "/metrics", &[]).await.2;
        metric(&text, "poolpilot_downstream_connection_hold_seconds_count").unwrap_or(0.0)
    };
    assert_eventually!(
        closed().await >= opened,
        Duration::from_secs(10),
        "the gateway accepts and closes all {opened} connections the clients dropped ({} so far)",
        closed().await
    );
    let (status, _, body) = post(process.proxy, "/v1/x", &[], "{}").await;
    assert_eq!(status, 200, "{body}");
    assert!(process.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_flags_and_their_environment_override_the_config_file() {
    let backend = Backend::start().await;
    // The addresses in the file are taken (as 0.0.0.0 would be by every other pod sharing a
    // host's network): the process comes up only if it listens where it is told instead.
    let taken_proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let configured = (
        taken_proxy.local_addr().unwrap(),
        taken_admin.local_addr().unwrap(),
    );
    // Another loopback address, as a pod IP would be.
    let serving = (free_addr("127.0.0.2"), free_addr("127.0.0.2"));
    let process = Process::launch(
        &limits("model-a", &[backend.addr], 4),
        None,
        configured,
        serving,
        |cmd| {
            cmd.arg(format!("--proxy-listen={}", serving.0))
                .env("POOLPILOT_ADMIN_LISTEN", serving.1.to_string());
        },
    )
    .await;
    assert_eq!(try_get(serving.1, "/healthz").await, Some(200));
    assert_eq!(
        post(serving.0, "/v1/x", &[], "{}").await.0,
        200,
        "the proxy answers on --proxy-listen"
    );
    assert!(process.terminate().await.success(), "SIGTERM exits cleanly");
    drop((taken_proxy, taken_admin));
}
