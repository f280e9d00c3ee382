//! Loopback tests of call timeouts and streaming: first-byte timeout → 504 with the
//! connection discarded, a stalled SSE stream cut at streamIdle (an error, not a clean end),
//! SSE chunks forwarded as they are produced, a stream timed to its first byte.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use http_body_util::BodyExt;
use tokio::time::Instant;

fn with_timeouts(
    backend: std::net::SocketAddr,
    first_byte: &str,
    stream_idle: &str,
) -> poolpilot_api::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], 4)).unwrap();
    doc["backends"][0]["timeouts"] =
        serde_json::json!({"firstByte": first_byte, "total": "10s", "streamIdle": stream_idle});
    from_json(doc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_backend_gets_504_at_first_byte_and_its_connection_discarded() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(5_000, Ordering::SeqCst);
    let gw = Gw::start(with_timeouts(backend.addr, "300ms", "5s")).await;
    let start = Instant::now();
    let (status, _, body) = post(gw.proxy, "/v1/x", &[], "{}").await;
    let took = start.elapsed();
    assert_eq!(status, 504);
    assert!(body.contains("first_byte_timeout"), "{body}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert_eventually!(
        backend.seen.connections.load(Ordering::SeqCst) == 0,
        Duration::from_secs(2),
        "the timed-out upstream connection is closed, not pooled"
    );
    let text = gw.metrics().await;
    assert_eq!(upstream_timeouts(&text, "first_byte"), Some(1.0));
    assert_eq!(closed_connections(&text, "timeout"), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_chunks_reach_the_client_as_they_are_produced() {
    let backend = Backend::start().await;
    backend.script.sse_chunks.store(5, Ordering::SeqCst);
    backend.script.sse_interval_ms.store(200, Ordering::SeqCst);
    let gw = Gw::start(with_timeouts(backend.addr, "2s", "2s")).await;
    let mut client = connect(gw.proxy).await;
    let response = client
        .send(request("POST", "/v1/chat", &[], "{\"stream\":true}"))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let start = Instant::now();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            arrivals.push(start.elapsed());
            text.push_str(std::str::from_utf8(&data).unwrap());
        }
    }
    assert_eq!(text.matches("data: ").count(), 5, "{text}");
    assert!(arrivals.len() >= 5, "{arrivals:?}");
    // Chunk k is produced at ~200ms·k; it must arrive then, not at the end of the stream.
    assert!(arrivals[0] < Duration::from_millis(150), "{arrivals:?}");
    assert!(
        arrivals[2] >= Duration::from_millis(350) && arrivals[2] < Duration::from_millis(600),
        "{arrivals:?}"
    );
}

/// Reads a response body frame by frame: its text and whether it ended cleanly.
async fn read_body(body: hyper::body::Incoming) -> (String, Result<(), hyper::Error>) {
    let mut body = body;
    let mut text = String::new();
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    text.push_str(std::str::from_utf8(&data).unwrap());
                }
            }
            Some(Err(e)) => return (text, Err(e)),
            None => return (text, Ok(())),
        }
    }
}

/// A streamed answer's time to first byte is its first token, not the whole stream: what the
/// operator compares when it asks whether a backend got slower (the whole call moves with the
/// output length). Its bytes are counted as they arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_is_timed_to_its_first_byte_and_its_bytes_counted() {
    let backend = Backend::start().await;
    backend.script.sse_chunks.store(5, Ordering::SeqCst);
    backend.script.sse_interval_ms.store(200, Ordering::SeqCst);
    let gw = Gw::start(with_timeouts(backend.addr, "2s", "2s")).await;
    let (status, _, body) = post(gw.proxy, "/v1/chat", &[], "{\"stream\":true}").await;
    assert_eq!(status, 200);
    let first_bytes = "poolpilot_upstream_time_to_first_byte_seconds_count{backend=\"model-a\"}";
    assert_eventually!(
        metric(&gw.metrics().await, first_bytes) == Some(1.0),
        Duration::from_secs(5),
        "one first byte observed"
    );
    let text = gw.metrics().await;
    let bucket = |family: &str, labels: &str, le: &str| {
        metric(&text, &format!("{family}_bucket{{le=\"{le}\",{labels}}}"))
    };
    // The first chunk comes at once, the last after ~800 ms.
    assert_eq!(
        bucket(
            "poolpilot_upstream_time_to_first_byte_seconds",
            "backend=\"model-a\"",
            "0.16"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        bucket(
            "poolpilot_upstream_request_duration_seconds",
            "backend=\"model-a\",code_class=\"2xx\"",
            "0.64"
        ),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "poolpilot_upstream_response_bytes_total{backend=\"model-a\"}"
        ),
        Some(body.len() as f64),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_stalling_midway_is_cut_at_stream_idle() {
    let backend = Backend::start().await;
    backend.script.sse_chunks.store(10, Ordering::SeqCst);
    backend.script.sse_interval_ms.store(50, Ordering::SeqCst);
    backend.script.sse_stall_after.store(3, Ordering::SeqCst);
    let gw = Gw::start(with_timeouts(backend.addr, "2s", "400ms")).await;
    let mut client = connect(gw.proxy).await;
    let start = Instant::now();
    let response = client
        .send(request("POST", "/v1/chat", &[], "{}"))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (text, end) = tokio::time::timeout(Duration::from_secs(3), read_body(response.into_body()))
        .await
        .expect("the gateway cuts the stalled stream");
    let took = start.elapsed();
    assert!(
        end.is_err(),
        "a cut stream is an error for the client, not a clean end"
    );
    assert_eq!(
        text.matches("data: ").count(),
        3,
        "the chunks before the stall arrived: {text}"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    assert_eventually!(
        backend.seen.connections.load(Ordering::SeqCst) == 0,
        Duration::from_secs(2),
        "the stalled upstream connection is discarded"
    );
    let text = gw.metrics().await;
    assert_eq!(upstream_timeouts(&text, "stream_idle"), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_total_timeout_is_cut_there() {
    let backend = Backend::start().await;
    backend.script.sse_chunks.store(100, Ordering::SeqCst);
    backend.script.sse_interval_ms.store(50, Ordering::SeqCst);
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 4)).unwrap();
    doc["backends"][0]["timeouts"] =
        serde_json::json!({"firstByte": "500ms", "total": "600ms", "streamIdle": "5s"});
    let gw = Gw::start(from_json(doc)).await;
    let start = Instant::now();
    let response = connect(gw.proxy)
        .await
        .send(request("POST", "/v1/chat", &[], "{}"))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (body, end) = read_body(response.into_body()).await;
    let took = start.elapsed();
    assert!(end.is_err(), "a cut stream is an error");
    let chunks = body.matches("data: ").count();
    assert!(
        (8..=14).contains(&chunks),
        "about 600ms of 50ms chunks: {chunks}"
    );
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    let text = gw.metrics().await;
    assert_eq!(upstream_timeouts(&text, "total"), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_refusing_connections_gives_502_and_is_ejected() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let live = Backend::start().await;
    let mut doc = serde_json::to_value(limits("model-a", &[closed, live.addr], 4)).unwrap();
    doc["backends"][0]["outlierDetection"] = serde_json::json!({"consecutiveFailures": 1, "baseEjection": "10s", "maxEjectedPercent": 50});
    let gw = Gw::start(from_json(doc)).await;
    let mut statuses = Vec::new();
    for _ in 0..10 {
        statuses.push(post(gw.proxy, "/v1/x", &[], "{}").await.0.as_u16());
    }
    let refused = statuses.iter().filter(|s| **s == 502).count();
    assert!(
        refused <= 1,
        "one refused connect ejects the endpoint: {statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 10 - refused);
    assert_eq!(live.seen.requests.load(Ordering::SeqCst), 10 - refused);
}
