//! Loopback tests of request bodies from clients that are slow, stall or leave: a body that
//! never finishes gets 408 at `bodyReadTimeout` (while buffered for model routing and while
//! streaming to the backend), one that trickles below `minBodyRate` too; routing buffers stay
//! within the pod's `routeBufferBudget` (503 + Retry-After beyond it); the first-byte timer
//! starts once the body is sent; and nothing the client does to its body is held against the
//! backend (no outlier ejection, no upstream timeout or duration).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Limits with one backend, routed by JSON model when `by_model`, with listener fields and
/// timeouts, and outlier detection that ejects an endpoint at its first failure.
fn body_limits(
    backend: SocketAddr,
    by_model: bool,
    listener: serde_json::Value,
    timeouts: serde_json::Value,
) -> poolpilot_api::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], 8)).unwrap();
    if by_model {
        doc["backends"][0]["match"] = serde_json::json!({"model": "model-a"});
    }
    doc["backends"][0]["timeouts"] = timeouts;
    doc["backends"][0]["outlierDetection"] = serde_json::json!({"consecutiveFailures": 1, "baseEjection": "60s", "maxEjectedPercent": 100});
    for (k, v) in listener.as_object().unwrap() {
        doc["listener"][k] = v.clone();
    }
    from_json(doc)
}

fn default_timeouts() -> serde_json::Value {
    serde_json::json!({"firstByte": "5s", "total": "30s", "streamIdle": "5s"})
}

/// Opens a POST to `/v1/chat` declaring `declared` bytes of JSON body (routed to model-a) and
/// sends `sent` of them.
async fn partial_post(gw: SocketAddr, declared: usize, sent: usize) -> TcpStream {
    let mut s = TcpStream::connect(gw).await.unwrap();
    let head = format!("POST /v1/chat HTTP/1.1\r\nHost: gw\r\nContent-Length: {declared}\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    let mut body = br#"{"model":"model-a","pad":""#.to_vec();
    body.resize(sent, b'x');
    s.write_all(&body).await.unwrap();
    s
}

/// Reads the response head's status line (or "" when the connection closed without one).
async fn status_line(s: &mut TcpStream, wait: Duration) -> String {
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut buf)).await;
    String::from_utf8_lossy(&buf)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// The upstream series the operator reads, summed.
fn upstream_blame(text: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.starts_with("poolpilot_upstream_timeouts_total")
                || l.starts_with("poolpilot_upstream_request_duration_seconds_count")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_finishes_on_a_model_route_gets_408() {
    let backend = Backend::start().await;
    let gw = Gw::start(body_limits(
        backend.addr,
        true,
        serde_json::json!({"bodyReadTimeout": "500ms", "minBodyRate": 0}),
        default_timeouts(),
    ))
    .await;
    let start = Instant::now();
    let mut s = partial_post(gw.proxy, 60 * 1024, 59 * 1024).await;
    let status = status_line(&mut s, Duration::from_secs(5)).await;
    let took = start.elapsed();
    assert!(status.starts_with("HTTP/1.1 408"), "{status:?}");
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(backend.seen.requests.load(Ordering::SeqCst), 0);
    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            "poolpilot_downstream_timeouts_total{kind=\"body_read\"}"
        ),
        Some(1.0)
    );
    assert_eq!(metric(&text, "poolpilot_route_buffer_bytes"), Some(0.0));
}

/// More unfinished bodies than tokio's listen backlog (128) arrive at once while the accept
/// loop is paused at `maxConnections`: the kernel queues every one (the listener's backlog is
/// `net.core.somaxconn`), and each gets its 408 once accepted. With a backlog of 128 the
/// connections beyond it waited for SYN retransmits, and some, completed by SYN cookie, were
/// reset once their bytes arrived, without an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_bodies_queued_behind_a_paused_accept_loop_are_all_answered_408() {
    const BODIES: usize = 300;
    let backend = Backend::start().await;
    let listener = |max_connections: u32| {
        serde_json::json!({
            "maxConnections": max_connections, "bodyReadTimeout": "1s", "minBodyRate": 0
        })
    };
    let gw = Gw::start(body_limits(
        backend.addr,
        true,
        listener(1),
        default_timeouts(),
    ))
    .await;
    // The one connection the accept loop takes; the rest wait in the kernel's queue.
    let mut held = connect(gw.proxy).await;
    assert_eq!(
        held.call(request("GET", "/v1/models", &[], "")).await.0,
        200
    );
    let started = Instant::now();
    let mut bodies = tokio::task::JoinSet::new();
    for _ in 0..BODIES {
        let proxy = gw.proxy;
        bodies.spawn(async move {
            let mut s = partial_post(proxy, 60 * 1024, 60_000).await;
            let queued = started.elapsed();
            let mut answer = Vec::new();
            let end =
                tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut answer)).await;
            let line = String::from_utf8_lossy(&answer)
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned();
            let outcome = match end {
                Ok(Ok(_)) if !line.is_empty() => line,
                Ok(Ok(_)) => "closed without an answer".to_owned(),
                Ok(Err(e)) => format!("{:?} without an answer", e.kind()),
                Err(_) => "no answer".to_owned(),
            };
            (queued, outcome)
        });
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut raised = body_limits(backend.addr, true, listener(1024), default_timeouts());
    raised.generation += 1;
    gw.apply(raised);
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    let mut slowest_queue = Duration::ZERO;
    while let Some(done) = bodies.join_next().await {
        let (queued, outcome) = done.unwrap();
        slowest_queue = slowest_queue.max(queued);
        *outcomes.entry(outcome).or_default() += 1;
    }
    assert_eq!(
        outcomes.get("HTTP/1.1 408 Request Timeout"),
        Some(&BODIES),
        "{outcomes:?}"
    );
    assert!(
        slowest_queue < Duration::from_millis(700),
        "every connection and its bytes were taken by the kernel while the accept loop was \
         paused (no SYN retransmit): the slowest took {slowest_queue:?}"
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_trickling_below_the_minimum_rate_gets_408() {
    let backend = Backend::start().await;
    let gw = Gw::start(body_limits(
        backend.addr,
        true,
        serde_json::json!({"bodyReadTimeout": "60s", "minBodyRate": 1000}),
        default_timeouts(),
    ))
    .await;
    let mut s = partial_post(gw.proxy, 10_000, 30).await;
    // 20 bytes every 100 ms: 200 B/s, never a gap, far below 1000 B/s.
    let start = Instant::now();
    let trickle = async {
        loop {
            if s.write_all(&[b'x'; 20]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            if start.elapsed() > Duration::from_secs(15) {
                break;
            }
        }
    };
    trickle.await;
    let status = status_line(&mut s, Duration::from_secs(5)).await;
    assert!(status.starts_with("HTTP/1.1 408"), "{status:?}");
    let took = start.elapsed();
    // The grace (5 s) plus what 30 + 200·t bytes buy at 1000 B/s: cut after about 6 s.
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(10),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_buffers_stay_within_the_pods_budget() {
    let backend = Backend::start().await;
    let gw = Gw::start(body_limits(
        backend.addr,
        true,
        serde_json::json!({
            "bodyReadTimeout": "1500ms", "minBodyRate": 0,
            "routeBodyBytes": 65536, "routeBufferBudget": 131072
        }),
        default_timeouts(),
    ))
    .await;
    // Two stalled bodies of 60 KiB hold 120 KiB of the 128 KiB budget.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(partial_post(gw.proxy, 64 * 1024, 60 * 1024).await);
    }
    assert_eventually!(
        metric(&gw.metrics().await, "poolpilot_route_buffer_bytes") == Some(120.0 * 1024.0),
        Duration::from_secs(2),
        "the stalled bodies are buffered"
    );
    let mut third = partial_post(gw.proxy, 64 * 1024, 60 * 1024).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), third.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: "), "{answer}");
    assert!(answer.contains("route_buffer_full"), "{answer}");
    // A small body still fits.
    let (status, _, _) = post(gw.proxy, "/v1/chat", &[], r#"{"model":"model-a"}"#).await;
    assert_eq!(status, 200);
    for mut s in held {
        assert!(
            status_line(&mut s, Duration::from_secs(5))
                .await
                .starts_with("HTTP/1.1 408")
        );
    }
    let text = gw.metrics().await;
    assert_eq!(
        metric(&text, "poolpilot_route_buffer_rejected_total"),
        Some(1.0)
    );
    assert_eq!(
        metric(&text, "poolpilot_route_buffer_bytes"),
        Some(0.0),
        "every buffer went back to the budget"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_stalling_while_it_streams_to_the_backend_gets_408_and_the_backend_is_not_blamed() {
    let backend = Backend::start().await;
    let gw = Gw::start(body_limits(
        backend.addr,
        false,
        serde_json::json!({"bodyReadTimeout": "500ms", "minBodyRate": 0}),
        default_timeouts(),
    ))
    .await;
    let mut s = partial_post(gw.proxy, 20_000, 10_000).await;
    let status = status_line(&mut s, Duration::from_secs(5)).await;
    assert!(status.starts_with("HTTP/1.1 408"), "{status:?}");
    // A client that leaves mid-body is not the backend's fault either.
    drop(partial_post(gw.proxy, 20_000, 10_000).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        post(gw.proxy, "/v1/chat", &[], "{}").await.0,
        200,
        "the endpoint was not ejected (outlier detection ejects at the first failure)"
    );
    let text = gw.metrics().await;
    assert_eq!(
        upstream_blame(&text),
        1.0,
        "only the good call is in the upstream series:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_byte_timer_starts_once_the_body_is_sent() {
    let backend = Backend::start().await;
    let gw = Gw::start(body_limits(
        backend.addr,
        false,
        serde_json::json!({"bodyReadTimeout": "2s", "minBodyRate": 0}),
        serde_json::json!({"firstByte": "500ms", "total": "10s", "streamIdle": "5s"}),
    ))
    .await;
    // A body sent over 1.5 s, well within the body pace, longer than firstByte.
    let mut s = partial_post(gw.proxy, 30 + 5 * 100, 30).await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.write_all(&[b'x'; 100]).await.unwrap();
    }
    let status = status_line(&mut s, Duration::from_secs(1)).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status:?}");
}
