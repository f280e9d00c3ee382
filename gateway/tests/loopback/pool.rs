//! Loopback tests of the connection pool through the real gateway: the per-endpoint cap,
//! queueing and rejection, reuse, idle reclamation, resizing under load, the slot of a
//! closed connection held until the backend lets go of it, and the pod-wide cap shared across
//! backends.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::*;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_never_exceed_the_per_pod_cap_of_eight() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(40, Ordering::SeqCst);
    let gw = Gw::start(limits("model-a", &[backend.addr], 8)).await;

    let mut clients = Vec::new();
    for i in 0..200 {
        let proxy = gw.proxy;
        clients.push(tokio::spawn(async move {
            post(
                proxy,
                "/v1/chat/completions",
                &[],
                &format!("{{\"client\":{i}}}"),
            )
            .await
            .0
        }));
    }
    // Mid-flight, the saturation the operator reads: the cap in use and requests pending.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let text = gw.metrics().await;
    let leased = metric(
        &text,
        "poolpilot_pool_connections{backend=\"model-a\",endpoint=\"model-a-0\",state=\"leased\"}",
    );
    let pending = metric(&text, "poolpilot_pool_pending{backend=\"model-a\"}").unwrap();
    assert_eq!(leased, Some(8.0), "{text}");
    assert!(pending > 0.0, "requests beyond the cap wait: {pending}");
    for c in clients {
        assert_eq!(
            c.await.unwrap(),
            200,
            "queued requests complete when capacity frees"
        );
    }
    let seen = &backend.seen;
    assert_eq!(seen.requests.load(Ordering::SeqCst), 200);
    let max = seen.max_connections.load(Ordering::SeqCst);
    assert!(
        max <= 8,
        "the backend saw {max} concurrent connections from the gateway"
    );
    assert_eq!(max, 8, "the cap is used in full under load");
    let text = gw.metrics().await;
    let created = metric(
        &text,
        "poolpilot_pool_connections_created_total{backend=\"model-a\",endpoint=\"model-a-0\"}",
    )
    .unwrap();
    let reused = metric(
        &text,
        "poolpilot_pool_connections_reused_total{backend=\"model-a\",endpoint=\"model-a-0\"}",
    )
    .unwrap();
    assert!(
        created <= 8.0 && created + reused == 200.0,
        "created {created}, reused {reused}"
    );
    let waited = metric(
        &text,
        "poolpilot_pool_lease_wait_seconds_count{backend=\"model-a\"}",
    )
    .unwrap();
    assert_eq!(waited, 200.0, "every lease records its wait");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_pending_or_lease_timeout_clients_get_503_with_retry_after() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(400, Ordering::SeqCst);
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 1)).unwrap();
    doc["backends"][0]["pool"]["maxPending"] = 2.into();
    doc["backends"][0]["pool"]["leaseTimeout"] = "600ms".into();
    let gw = Gw::start(from_json(doc)).await;

    let mut calls = Vec::new();
    for _ in 0..6 {
        let proxy = gw.proxy;
        calls.push(tokio::spawn(async move {
            post(proxy, "/v1/x", &[], "{}").await
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut reasons = Vec::new();
    for c in calls {
        let (status, headers, body) = c.await.unwrap();
        if status == 503 {
            let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
            assert!(retry_after >= 1, "{retry_after}");
            let json: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(json["error"]["type"], "server_error");
            reasons.push(json["error"]["code"].as_str().unwrap().to_owned());
        } else {
            assert_eq!(status, 200);
            reasons.push("ok".into());
        }
    }
    // 1 leased + 2 pending; 3 refused at once; of the 2 waiting, one is served at 400ms and
    // the other times out at 600ms (the connection is busy until 800ms).
    assert_eq!(
        reasons.iter().filter(|r| *r == "pool_queue_full").count(),
        3,
        "{reasons:?}"
    );
    assert_eq!(
        reasons.iter().filter(|r| *r == "lease_timeout").count(),
        1,
        "{reasons:?}"
    );
    assert_eq!(
        reasons.iter().filter(|r| *r == "ok").count(),
        2,
        "{reasons:?}"
    );
    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            "poolpilot_pool_lease_timeouts_total{backend=\"model-a\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_keep_alive_load_reuses_connections() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 8)).await;
    let mut client = connect(gw.proxy).await;
    for _ in 0..100 {
        let (status, _, _) = client.call(request("POST", "/v1/chat", &[], "{}")).await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        backend.seen.accepted.load(Ordering::SeqCst),
        1,
        "one upstream connection carried every call"
    );
    let text = gw.metrics().await;
    let series = "{backend=\"model-a\",endpoint=\"model-a-0\"}";
    assert_eq!(
        metric(
            &text,
            &format!("poolpilot_pool_connections_created_total{series}")
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            &format!("poolpilot_pool_connections_reused_total{series}")
        ),
        Some(99.0)
    );
    assert_eq!(
        metric(
            &text,
            "poolpilot_pool_connections{backend=\"model-a\",endpoint=\"model-a-0\",state=\"idle\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_after_the_idle_timeout() {
    let backend = Backend::start().await;
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 8)).unwrap();
    doc["backends"][0]["pool"]["idleTimeout"] = "300ms".into();
    let gw = Gw::start(from_json(doc)).await;
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    assert_eq!(backend.seen.connections.load(Ordering::SeqCst), 1);
    assert_eventually!(
        backend.seen.connections.load(Ordering::SeqCst) == 0,
        Duration::from_secs(2),
        "the idle upstream connection is closed after idleTimeout"
    );
    let text = gw.metrics().await;
    assert_eq!(closed_connections(&text, "idle"), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_closing_idle_connections_causes_no_client_errors() {
    let backend = Backend::start().await;
    backend.script.idle_close_ms.store(100, Ordering::SeqCst);
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    for _ in 0..8 {
        let (status, _, body) = post(gw.proxy, "/v1/x", &[], "{}").await;
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_millis(180)).await;
    }
    assert!(
        backend.seen.accepted.load(Ordering::SeqCst) >= 2,
        "the backend did close idle connections"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growing_a_cap_under_load_raises_backend_concurrency_within_a_second() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(100, Ordering::SeqCst);
    let gw = Gw::start(limits("model-a", &[backend.addr], 2)).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..16 {
        let (proxy, stop) = (gw.proxy, stop.clone());
        load.push(tokio::spawn(async move {
            let mut client = connect(proxy).await;
            let mut failures = 0;
            while !stop.load(Ordering::SeqCst) {
                if client.call(request("POST", "/v1/x", &[], "{}")).await.0 != 200 {
                    failures += 1;
                }
            }
            failures
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(backend.seen.max_inflight.load(Ordering::SeqCst) <= 2);

    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 8)).unwrap();
    doc["generation"] = 2.into();
    let applied = tokio::time::Instant::now();
    gw.apply(from_json(doc));
    assert_eventually!(
        backend.seen.inflight.load(Ordering::SeqCst) > 2,
        Duration::from_secs(1),
        "backend concurrency rises within a second of the new cap"
    );
    println!(
        "backend concurrency rose {:?} after the cap grew",
        applied.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    for l in load {
        assert_eq!(l.await.unwrap(), 0, "no request failed");
    }
    assert!(backend.seen.max_connections.load(Ordering::SeqCst) <= 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrinking_a_cap_fails_no_in_flight_request() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(500, Ordering::SeqCst);
    let gw = Gw::start(limits("model-a", &[backend.addr], 8)).await;
    let mut calls = Vec::new();
    for _ in 0..8 {
        let proxy = gw.proxy;
        calls.push(tokio::spawn(async move {
            post(proxy, "/v1/x", &[], "{}").await.0
        }));
    }
    assert_eventually!(
        backend.seen.inflight.load(Ordering::SeqCst) == 8,
        Duration::from_secs(2),
        "eight calls in flight"
    );
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 2)).unwrap();
    doc["generation"] = 2.into();
    gw.apply(from_json(doc));
    for c in calls {
        assert_eq!(
            c.await.unwrap(),
            200,
            "a shrink never fails an in-flight request"
        );
    }
    assert_eventually!(
        backend.seen.connections.load(Ordering::SeqCst) <= 2,
        Duration::from_secs(2),
        "excess connections close as they come back"
    );
    let text = gw.metrics().await;
    assert_eq!(closed_connections(&text, "shrink"), Some(6.0));
    assert_eq!(
        metric(
            &text,
            "poolpilot_pool_max_connections{backend=\"model-a\",endpoint=\"model-a-0\"}"
        ),
        Some(2.0)
    );
}

/// A backend that, like a model server mid-generation, finishes a request whatever its client
/// does: it reads the request, works `work`, answers, and closes once it reads the client's
/// close. Counts the connections it holds, and the most at once.
#[derive(Clone, Default)]
struct StubbornBackend {
    open: Arc<AtomicUsize>,
    max_open: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
}

impl StubbornBackend {
    async fn start(work: Duration) -> (SocketAddr, Self) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let this = Self::default();
        let b = this.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let b = b.clone();
                b.accepted.fetch_add(1, Ordering::SeqCst);
                let now = b.open.fetch_add(1, Ordering::SeqCst) + 1;
                b.max_open.fetch_max(now, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut got = Vec::new();
                    loop {
                        let n = stream.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            break;
                        }
                        got.extend_from_slice(&buf[..n]);
                        if got.windows(4).any(|w| w == b"\r\n\r\n") {
                            got.clear();
                            tokio::time::sleep(work).await;
                            let _ = stream
                                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                .await;
                        }
                    }
                    drop(stream);
                    b.open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        (addr, this)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_abandoned_by_its_client_keeps_its_slot_until_the_backend_lets_go() {
    let (addr, backend) = StubbornBackend::start(Duration::from_millis(400)).await;
    let gw = Gw::start(limits("model-a", &[addr], 1)).await;

    // The first client gives up mid-request: the gateway closes its upstream connection, but
    // the backend is still working on it.
    let mut first = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    first
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\n\r\n{}")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let text = gw.metrics().await;
    let closing =
        "poolpilot_pool_connections{backend=\"model-a\",endpoint=\"model-a-0\",state=\"closing\"}";
    assert_eq!(metric(&text, closing), Some(1.0), "{text}");

    // The next request waits for that slot instead of opening a second connection.
    let start = Instant::now();
    let (status, _, _) = post(gw.proxy, "/v1/chat/completions", &[], "{}").await;
    assert_eq!(status, 200);
    assert!(
        start.elapsed() >= Duration::from_millis(200),
        "served only after the backend finished the abandoned request: {:?}",
        start.elapsed()
    );
    assert_eq!(backend.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(
        backend.max_open.load(Ordering::SeqCst),
        1,
        "the backend never held more connections than the cap"
    );
    assert_eq!(metric(&gw.metrics().await, closing), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_wide_upstream_cap_is_shared_fairly_across_backends() {
    let (a, b, c) = (
        Backend::start().await,
        Backend::start().await,
        Backend::start().await,
    );
    for backend in [&a, &b, &c] {
        backend.script.delay_ms.store(300, Ordering::SeqCst);
    }
    // a and b may open 8 each, c 2; a cap of 10 for the pod: c keeps its 2, a and b get 4 each.
    let mut doc = serde_json::json!({
        "generation": 1,
        "listener": {"idleTimeout": "30s", "headerReadTimeout": "2s", "maxUpstreamConnections": 10},
        "backends": [
            backend_json("model-a", &[a.addr], 8),
            backend_json("model-b", &[b.addr], 8),
            backend_json("model-c", &[c.addr], 2),
        ],
    });
    for (i, name) in ["model-a", "model-b", "model-c"].iter().enumerate() {
        doc["backends"][i]["match"] = serde_json::json!({"pathPrefix": format!("/{name}/")});
    }
    let gw = Gw::start(from_json(doc)).await;
    let mut calls = Vec::new();
    for name in ["model-a", "model-b", "model-c"] {
        for _ in 0..12 {
            let proxy = gw.proxy;
            calls.push(tokio::spawn(async move {
                post(proxy, &format!("/{name}/v1/x"), &[], "{}").await.0
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["maxUpstreamConnections"], 10);
    assert!(
        stats["upstreamConnections"].as_u64().unwrap() <= 10,
        "{stats}"
    );
    for (backend, max) in [("model-a", 4), ("model-b", 4), ("model-c", 2)] {
        assert_eq!(
            stats["backends"][backend]["endpoints"][0]["max"], max,
            "{stats}"
        );
    }
    for call in calls {
        assert_eq!(call.await.unwrap(), 200, "every call is served, queued");
    }
    assert_eq!(a.seen.max_connections.load(Ordering::SeqCst), 4);
    assert_eq!(b.seen.max_connections.load(Ordering::SeqCst), 4);
    assert_eq!(c.seen.max_connections.load(Ordering::SeqCst), 2);
}
