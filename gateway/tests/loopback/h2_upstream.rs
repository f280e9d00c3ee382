//! HTTP/2 upstreams against real h2 servers on 127.0.0.1 (hyper's, h2c with prior knowledge, and
//! TLS with ALPN): many calls on one connection with the pool's cap held on the streams; the
//! server's `SETTINGS_MAX_CONCURRENT_STREAMS` bounding each connection, a new connection opened
//! only when the open ones are full; `GOAWAY` mid-load failing no call; the deadlines (first
//! byte, stream idle, total) cutting one stream and leaving the connection to the others; ALPN
//! choosing HTTP/2 for `protocol: auto`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::support::*;
use crate::upstream_tls::{Pki, TlsBackend, handshakes, tls_limits};

/// Limits with one backend `model-a` over `backend`, `cap` streams per endpoint, HTTP/2, and
/// `timeouts`.
fn h2_limits(
    backend: std::net::SocketAddr,
    cap: u32,
    timeouts: serde_json::Value,
) -> poolpilot_api::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], cap)).unwrap();
    doc["backends"][0]["protocol"] = "http2".into();
    doc["backends"][0]["timeouts"] = timeouts;
    doc["backends"][0]["pool"]["maxPending"] = 1000.into();
    doc["backends"][0]["pool"]["leaseTimeout"] = "20s".into();
    from_json(doc)
}

fn relaxed() -> serde_json::Value {
    serde_json::json!({"firstByte": "10s", "total": "30s", "streamIdle": "10s"})
}

/// `n` calls at once; their statuses.
async fn crowd(gw: &Gw, n: usize) -> Vec<http::StatusCode> {
    let calls: Vec<_> = (0..n)
        .map(|_| {
            let proxy = gw.proxy;
            tokio::spawn(async move { get(proxy, "/v1/x", &[]).await.0 })
        })
        .collect();
    let mut statuses = Vec::new();
    for c in calls {
        statuses.push(c.await.unwrap());
    }
    statuses
}

fn stats_endpoint(stats: &serde_json::Value) -> serde_json::Value {
    stats["backends"]["model-a"]["endpoints"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_calls_share_one_connection_with_the_stream_cap_held() {
    let backend = Backend::start_h2(100).await;
    backend.script.delay_ms.store(300, Ordering::SeqCst);
    let gw = Gw::start(h2_limits(backend.addr, 8, relaxed())).await;
    let statuses = crowd(&gw, 32).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let seen = &backend.seen;
    assert_eq!(
        seen.accepted.load(Ordering::SeqCst),
        1,
        "one connection carries them all"
    );
    assert_eq!(seen.requests.load(Ordering::SeqCst), 32);
    assert_eq!(
        seen.max_inflight.load(Ordering::SeqCst),
        8,
        "the cap is on the streams: 8 at once, never more"
    );
    assert_eq!(seen.max_per_connection.load(Ordering::SeqCst), 8);
    let m = gw.metrics().await;
    let created = metric(
        &m,
        r#"poolpilot_pool_connections_created_total{backend="model-a",endpoint="model-a-0"}"#,
    );
    let reused = metric(
        &m,
        r#"poolpilot_pool_connections_reused_total{backend="model-a",endpoint="model-a-0"}"#,
    );
    assert_eq!(created, Some(1.0), "one connection opened: {m}");
    assert_eq!(reused, Some(31.0), "every other call rode on it: {m}");
    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    let ep = stats_endpoint(&stats);
    assert_eq!(ep["leased"], 0, "{stats}");
    assert_eq!(ep["max"], 8, "{stats}");
    assert!(ep["idle"].as_u64().unwrap() <= 8, "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_stream_limit_bounds_each_connection_and_new_ones_open_only_when_full() {
    // At most 3 streams a connection: a cap of 8 streams takes 3 connections, no more.
    let backend = Backend::start_h2(3).await;
    backend.script.delay_ms.store(300, Ordering::SeqCst);
    let gw = Gw::start(h2_limits(backend.addr, 8, relaxed())).await;
    let statuses = crowd(&gw, 24).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let seen = &backend.seen;
    assert_eq!(seen.max_inflight.load(Ordering::SeqCst), 8, "the cap held");
    assert_eq!(
        seen.max_per_connection.load(Ordering::SeqCst),
        3,
        "no connection carried more than the server allows"
    );
    assert_eq!(
        seen.accepted.load(Ordering::SeqCst),
        3,
        "⌈8 / 3⌉ connections, opened as the streams ran out"
    );

    // One call at a time needs one stream: no connection beyond the open ones.
    for _ in 0..5 {
        assert_eq!(get(gw.proxy, "/v1/x", &[]).await.0, 200);
    }
    assert_eq!(seen.accepted.load(Ordering::SeqCst), 3);
}

/// `/v1/stats`' endpoint of `model-a` and the pod's socket gauge for it, once `leased` slots
/// are leased (within 5 s).
async fn while_leased(gw: &Gw, leased: u64) -> (serde_json::Value, Option<f64>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, _, stats) = gw.admin_get("/v1/stats").await;
        let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
        let ep = stats_endpoint(&stats);
        if ep["leased"] == leased {
            let m = gw.metrics().await;
            let sockets = metric(
                &m,
                r#"poolpilot_pool_sockets{backend="model-a",endpoint="model-a-0"}"#,
            );
            return (stats, sockets);
        }
        assert!(Instant::now() < deadline, "never {leased} leased: {stats}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_count_streams_and_sockets_apart() {
    // 8 streams at once on connections of 3 streams each: 8 slots leased over 3 sockets.
    let backend = Backend::start_h2(3).await;
    backend.script.delay_ms.store(3000, Ordering::SeqCst);
    let gw = Gw::start(h2_limits(backend.addr, 8, relaxed())).await;
    let crowd = {
        let gw_proxy = gw.proxy;
        tokio::spawn(async move {
            let calls: Vec<_> = (0..8)
                .map(|_| tokio::spawn(async move { get(gw_proxy, "/v1/x", &[]).await.0 }))
                .collect();
            let mut statuses = Vec::new();
            for c in calls {
                statuses.push(c.await.unwrap());
            }
            statuses
        })
    };
    let (stats, sockets) = while_leased(&gw, 8).await;
    let ep = stats_endpoint(&stats);
    assert_eq!(
        ep["sockets"], 3,
        "⌈8 / 3⌉ connections carry the 8 streams: {stats}"
    );
    assert_eq!(
        ep["maxStreamsPerConnection"], 3,
        "the server's SETTINGS: {stats}"
    );
    assert_eq!(stats["upstreamSockets"], 3, "{stats}");
    assert_eq!(
        stats["upstreamConnections"], 8,
        "slots, as the caps count: {stats}"
    );
    assert_eq!(sockets, Some(3.0));
    assert_eq!(backend.seen.accepted.load(Ordering::SeqCst), 3);
    assert!(crowd.await.unwrap().iter().all(|s| *s == 200));

    // HTTP/1.1: every slot is a socket of its own, and no stream limit is shown.
    let backend = Backend::start().await;
    backend.script.delay_ms.store(3000, Ordering::SeqCst);
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    let calls: Vec<_> = (0..4)
        .map(|_| {
            let proxy = gw.proxy;
            tokio::spawn(async move { get(proxy, "/v1/x", &[]).await.0 })
        })
        .collect();
    let (stats, sockets) = while_leased(&gw, 4).await;
    let ep = stats_endpoint(&stats);
    assert_eq!(ep["sockets"], 4, "{stats}");
    assert!(ep.get("maxStreamsPerConnection").is_none(), "{stats}");
    assert_eq!(sockets, Some(4.0));
    for c in calls {
        assert_eq!(c.await.unwrap(), 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goaway_mid_load_fails_no_call() {
    let backend = Backend::start_h2(100).await;
    backend.script.delay_ms.store(40, Ordering::SeqCst);
    let gw = Gw::start(h2_limits(backend.addr, 8, relaxed())).await;
    let proxy = gw.proxy;
    let clients: Vec<_> = (0..16)
        .map(|_| {
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for _ in 0..25 {
                    statuses.push(get(proxy, "/v1/x", &[]).await.0);
                }
                statuses
            })
        })
        .collect();
    // A GOAWAY to every open connection every 150 ms while the load runs.
    let script = backend.script.clone();
    let goaways = tokio::spawn(async move {
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            script.goaway.fetch_add(1, Ordering::SeqCst);
        }
    });
    let mut statuses = Vec::new();
    for c in clients {
        statuses.extend(c.await.unwrap());
    }
    goaways.await.unwrap();
    let failed: Vec<_> = statuses.iter().filter(|s| **s != 200).collect();
    assert!(failed.is_empty(), "0 failed calls of 400: {failed:?}");
    assert_eq!(statuses.len(), 400);
    let accepted = backend.seen.accepted.load(Ordering::SeqCst);
    let m = gw.metrics().await;
    let retries = |reason: &str| {
        metric(
            &m,
            &format!("poolpilot_upstream_retries_total{{backend=\"model-a\",reason=\"{reason}\"}}"),
        )
        .unwrap_or(0.0)
    };
    eprintln!(
        "GOAWAY mid-load: {} calls, {} failed, {accepted} connections, retries: {} unsent, {} refused",
        statuses.len(),
        failed.len(),
        retries("reused_connection_unsent"),
        retries("reused_connection_closed"),
    );
    assert!(
        accepted >= 3,
        "each GOAWAY sent the next calls to a new connection: {accepted}"
    );
    assert_eq!(backend.seen.max_inflight.load(Ordering::SeqCst), 8);
}

/// Reads a streamed response to its end: the data frames, and whether it ended cleanly.
async fn drain(response: http::Response<hyper::body::Incoming>) -> (usize, bool) {
    let mut body = response.into_body();
    let mut chunks = 0;
    loop {
        match body.frame().await {
            Some(Ok(frame)) if frame.is_data() => chunks += 1,
            Some(Ok(_)) => {}
            Some(Err(_)) => return (chunks, false),
            None => return (chunks, true),
        }
    }
}

/// The deadlines hold per stream: each one cuts its own call, and the connection goes on
/// carrying the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadlines_cut_one_stream_and_leave_the_connection_to_the_others() {
    let backend = Backend::start_h2(100).await;
    let timeouts = serde_json::json!({"firstByte": "300ms", "total": "4s", "streamIdle": "300ms"});
    let gw = Gw::start(h2_limits(backend.addr, 8, timeouts)).await;

    // A long stream, a chunk every 50 ms, on the connection all along: cut at `total`.
    backend.script.sse_chunks.store(1000, Ordering::SeqCst);
    backend.script.sse_interval_ms.store(50, Ordering::SeqCst);
    let mut long_client = connect(gw.proxy).await;
    let long = long_client
        .send(request("POST", "/v1/chat", &[], "{\"stream\":true}"))
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let started = Instant::now();
    let long = tokio::spawn(async move { (drain(long).await, started.elapsed()) });

    // First byte: a backend that does not answer gets 504.
    backend.script.sse_chunks.store(0, Ordering::SeqCst);
    backend.script.delay_ms.store(5_000, Ordering::SeqCst);
    let start = Instant::now();
    let (status, _, body) = post(gw.proxy, "/v1/x", &[], "{}").await;
    let took = start.elapsed();
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("first_byte_timeout"), "{body}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    backend.script.delay_ms.store(0, Ordering::SeqCst);

    // Stream idle: a stream that stalls after two chunks is cut, an error on the wire.
    backend.script.sse_chunks.store(10, Ordering::SeqCst);
    backend.script.sse_interval_ms.store(20, Ordering::SeqCst);
    backend.script.sse_stall_after.store(2, Ordering::SeqCst);
    let mut client = connect(gw.proxy).await;
    let response = client
        .send(request("POST", "/v1/chat", &[], "{\"stream\":true}"))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let start = Instant::now();
    let (chunks, clean) = drain(response).await;
    assert!(!clean, "a cut stream is no complete answer");
    assert_eq!(chunks, 2);
    assert!(start.elapsed() < Duration::from_secs(2));

    // The connection carried every one of them, and carries the next call too.
    backend.script.sse_chunks.store(0, Ordering::SeqCst);
    backend.script.sse_stall_after.store(0, Ordering::SeqCst);
    assert_eq!(get(gw.proxy, "/v1/x", &[]).await.0, 200);
    assert_eq!(
        backend.seen.accepted.load(Ordering::SeqCst),
        1,
        "a cut resets its stream, never the connection"
    );

    // Total: the long stream is cut there.
    let ((chunks, clean), took) = long.await.unwrap();
    assert!(!clean, "cut at total");
    assert!(chunks > 20, "{chunks}");
    assert!(
        took >= Duration::from_millis(3_900) && took < Duration::from_secs(6),
        "{took:?}"
    );
    let m = gw.metrics().await;
    assert_eq!(upstream_timeouts(&m, "first_byte"), Some(1.0), "{m}");
    assert_eq!(upstream_timeouts(&m, "stream_idle"), Some(1.0), "{m}");
    assert_eq!(upstream_timeouts(&m, "total"), Some(1.0), "{m}");
    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(
        stats_endpoint(&stats)["leased"],
        0,
        "every lease given back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alpn_chooses_http2_for_protocol_auto_and_http1_by_default() {
    let pki = Pki::new("model CA");
    let backend = TlsBackend::start([127, 0, 0, 62], &pki.leaf("model.test"), None, false).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let tls = serde_json::json!({"serverName": "model.test", "caFile": ca});
    let mut doc = serde_json::to_value(tls_limits(backend.addr, tls.clone())).unwrap();
    doc["backends"][0]["protocol"] = "auto".into();
    let gw = Gw::start(from_json(doc)).await;
    let statuses = crowd(&gw, 12).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let conns = backend.conns();
    assert_eq!(conns.len(), 1, "one HTTP/2 connection: {conns:?}");
    assert_eq!(conns[0].alpn.as_deref(), Some("h2"));
    assert_eq!(conns[0].sni.as_deref(), Some("model.test"));
    let authority = format!("model.test:{}", backend.addr.port());
    for headers in backend.requests() {
        assert_eq!(
            headers.get("host").map(|h| h.to_str().unwrap()),
            Some(authority.as_str()),
            "the server's name as :authority"
        );
    }
    assert_eq!(handshakes(&gw.metrics().await, "full"), 1.0);

    // The same server, the default protocol: HTTP/1.1 by ALPN.
    let other = TlsBackend::start([127, 0, 0, 63], &pki.leaf("model.test"), None, false).await;
    let mut doc = tls_limits(other.addr, tls);
    doc.generation = 2;
    gw.apply(doc);
    assert_eq!(get(gw.proxy, "/", &[]).await.0, 200);
    assert_eq!(other.conns()[0].alpn.as_deref(), Some("http/1.1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_falls_back_to_http1_for_a_cooldown_when_the_server_refuses_h2() {
    let pki = Pki::new("model CA");
    let backend = TlsBackend::start([127, 0, 0, 64], &pki.leaf("model.test"), None, false).await;
    backend.seen.refuse_h2.store(true, Ordering::SeqCst);
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let tls = serde_json::json!({"serverName": "model.test", "caFile": ca});
    let mut doc = serde_json::to_value(tls_limits(backend.addr, tls)).unwrap();
    doc["backends"][0]["protocol"] = "auto".into();
    let gw = Gw::start(from_json(doc)).await;

    // The first call's connection picks h2 and is closed unanswered: the call goes on a new
    // connection offering http/1.1 alone, and is not lost.
    assert_eq!(get(gw.proxy, "/v1/x", &[]).await.0, 200);
    // A crowd within the cooldown: HTTP/1.1 connections side by side, none asks for h2.
    let statuses = crowd(&gw, 6).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let conns = backend.conns();
    let alpn: Vec<_> = conns
        .iter()
        .map(|c| c.alpn.clone().unwrap_or_default())
        .collect();
    assert_eq!(alpn[0], "h2", "{alpn:?}");
    assert!(
        alpn[1..].iter().all(|a| a == "http/1.1"),
        "every later connection offered http/1.1 alone: {alpn:?}"
    );
    assert!(alpn.len() >= 2, "{alpn:?}");

    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    let fallback = &stats_endpoint(&stats)["http2Fallback"];
    assert_eq!(fallback["reason"], "h2_refused", "{stats}");
    let remaining = fallback["remainingSeconds"].as_u64().unwrap();
    assert!((50..=60).contains(&remaining), "the 60 s cooldown: {stats}");
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"poolpilot_upstream_h2_fallbacks_total{backend="model-a",reason="h2_refused"}"#
        ),
        Some(1.0),
        "counted once per cooldown: {m}"
    );
    let endpoint = stats_endpoint(&stats)["name"].as_str().unwrap().to_owned();
    assert_eq!(
        metric(
            &m,
            &format!(
                r#"poolpilot_upstream_h2_fallback{{backend="model-a",endpoint="{endpoint}"}}"#
            )
        ),
        Some(1.0),
        "{m}"
    );
}

/// A TCP relay in front of `to`: connections are forwarded both ways until [`Relay::freeze`],
/// after which the connections open then stop forwarding anything (their sockets stay open: a
/// server that stopped answering behind a live TCP stack); later connections are forwarded.
struct Relay {
    addr: std::net::SocketAddr,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    frozen_below: Arc<std::sync::atomic::AtomicUsize>,
}

impl Relay {
    async fn start(to: std::net::SocketAddr) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let frozen_below = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (a, f) = (accepted.clone(), frozen_below.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let index = a.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                for (mut from, mut to, f) in [
                    (
                        Box::new(cr) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                        Box::new(sw) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                        f.clone(),
                    ),
                    (Box::new(sr), Box::new(cw), f.clone()),
                ] {
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if index < f.load(Ordering::SeqCst) {
                                // Frozen: hold both sockets, forward nothing, ever.
                                std::future::pending::<()>().await;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Self {
            addr,
            accepted,
            frozen_below,
        }
    }

    /// Stops forwarding on every connection open now.
    fn freeze(&self) {
        self.frozen_below
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// A gateway whose upstream HTTP/2 connections ping every 200 ms and give up on a ping after
/// 1 s (long enough that a loaded machine's late pong is no timeout), applying `limits`.
async fn pinging_gw(limits: poolpilot_api::GatewayLimits) -> Gw {
    let gw = Gw::start_edited(None, Duration::from_secs(5), Duration::ZERO, |config, _| {
        config.upstream_keepalive.http2_ping_interval = poolpilot_api::Duration::from_millis(200);
        config.upstream_keepalive.http2_ping_timeout = poolpilot_api::Duration::from_secs(1);
    })
    .await;
    gw.gateway()
        .apply(limits, poolpilot_gateway::LimitsSource::Api)
        .expect("test limits are valid");
    gw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pings_drop_a_connection_whose_server_stopped_answering() {
    let backend = Backend::start_h2(100).await;
    let relay = Relay::start(backend.addr).await;
    let gw = pinging_gw(h2_limits(relay.addr, 8, relaxed())).await;
    assert_eq!(get(gw.proxy, "/v1/x", &[]).await.0, 200);
    assert_eq!(relay.accepted.load(Ordering::SeqCst), 1);

    // Idle: the server goes silent; its ping goes unanswered and the connection is dropped.
    relay.freeze();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, _, stats) = gw.admin_get("/v1/stats").await;
        let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
        if stats_endpoint(&stats)["sockets"] == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the silent connection stays: {stats}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The next call gets a fresh connection.
    assert_eq!(get(gw.proxy, "/v1/x", &[]).await.0, 200);
    assert_eq!(relay.accepted.load(Ordering::SeqCst), 2);

    // In flight: a GET waiting for its answer when the server goes silent is sent again on a
    // fresh connection once the ping gives up, and answered.
    backend.script.delay_ms.store(400, Ordering::SeqCst);
    let call = tokio::spawn({
        let proxy = gw.proxy;
        async move { get(proxy, "/v1/x", &[]).await.0 }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    relay.freeze();
    let started = Instant::now();
    assert_eq!(call.await.unwrap(), 200, "not lost: a GET can go again");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(relay.accepted.load(Ordering::SeqCst), 3);
    let m = gw.metrics().await;
    assert!(
        metric(&m, r#"poolpilot_upstream_retries_total{backend="model-a",reason="reused_connection_closed"}"#)
            .is_some_and(|n| n >= 1.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_stays_on_http1_for_the_cooldown_when_alpn_picks_it() {
    let pki = Pki::new("model CA");
    let backend = TlsBackend::start_offering(
        [127, 0, 0, 65],
        &pki.leaf("model.test"),
        None,
        true,
        &[b"http/1.1"],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let tls = serde_json::json!({"serverName": "model.test", "caFile": ca});
    let mut doc = serde_json::to_value(tls_limits(backend.addr, tls)).unwrap();
    doc["backends"][0]["protocol"] = "auto".into();
    let gw = Gw::start(from_json(doc)).await;
    // `Connection: close`: every call takes a new connection. The first one asks for h2 and
    // gets http/1.1; the rest, within the cooldown, do not ask again.
    for _ in 0..4 {
        assert_eq!(get(gw.proxy, "/v1/x", &[]).await.0, 200);
    }
    let conns = backend.conns();
    assert_eq!(conns.len(), 4, "{conns:?}");
    assert!(conns.iter().all(|c| c.alpn.as_deref() == Some("http/1.1")));
    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(
        stats_endpoint(&stats)["http2Fallback"]["reason"],
        "alpn_http1",
        "{stats}"
    );
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"poolpilot_upstream_h2_fallbacks_total{backend="model-a",reason="alpn_http1"}"#
        ),
        Some(1.0),
        "once for the cooldown, not per connection: {m}"
    );
}
