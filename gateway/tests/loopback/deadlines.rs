//! Loopback tests of the deadlines that must fire whatever the client does: a client that stops
//! reading a streaming response (HTTP/1 or an HTTP/2 stream with a zero window) is cut at
//! `total` or at the listener's `sendTimeout`, its pooled upstream connection and its client
//! permit are released at once, the HTTP/1 connection is closed and the h2 stream reset; a cut
//! response is an error on the wire (no last chunk, a reset stream), never a clean end; h2
//! connections hold at most `maxConcurrentStreams` streams and are closed when keep-alive
//! pings go unanswered. The stalled-client probes run against an HTTP/2 upstream too (the cut
//! resets the upstream stream; the pool's slot, the connection's last, closes it).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

/// One backend `model-a` with a pool of `cap`, the given call timeouts and listener fields, and
/// a client policy allowing each client `concurrency` calls.
fn limits_with(
    backend: SocketAddr,
    cap: u32,
    timeouts: serde_json::Value,
    listener: serde_json::Value,
    concurrency: u32,
) -> poolpilot_api::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], cap)).unwrap();
    doc["backends"][0]["timeouts"] = timeouts;
    doc["backends"][0]["clientPolicy"] = "per-key".into();
    doc["clientPolicies"] = serde_json::json!([{
        "name": "per-key", "identity": {"header": "x-api-key"},
        "maxConcurrency": concurrency, "maxQueue": 0, "queueTimeout": "1s"
    }]);
    let mut l = doc["listener"].clone();
    for (k, v) in listener.as_object().unwrap() {
        l[k] = v.clone();
    }
    doc["listener"] = l;
    from_json(doc)
}

/// A backend streaming 64 KiB SSE chunks as fast as it can, for a long time.
async fn firehose() -> Backend {
    firehose_over(false).await
}

/// [`firehose`], speaking h2c when `h2`.
async fn firehose_over(h2: bool) -> Backend {
    let backend = if h2 {
        Backend::start_h2(100).await
    } else {
        Backend::start().await
    };
    backend.script.sse_chunks.store(100_000, Ordering::SeqCst);
    backend.script.sse_interval_ms.store(1, Ordering::SeqCst);
    backend
        .script
        .sse_chunk_bytes
        .store(64 * 1024, Ordering::SeqCst);
    backend
}

/// A client socket with a small receive buffer that sends one streaming call and then reads
/// only the first bytes of the response: the gateway's writes stall soon after.
async fn stop_reading_after_head(gw: SocketAddr, key: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(gw).await.unwrap();
    let req = format!(
        "POST /v1/chat HTTP/1.1\r\nHost: gw\r\nx-api-key: {key}\r\nContent-Length: 15\r\n\r\n{{\"stream\":true}}"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = [0u8; 64];
    let n = s.read(&mut head).await.unwrap();
    assert!(head[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &head[..n]);
    s
}

/// Reads what is left until the gateway closes the connection (or `wait` passes: then None).
async fn read_to_close(s: &mut TcpStream, wait: Duration) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    match tokio::time::timeout(wait, s.read_to_end(&mut out)).await {
        Ok(_) => Some(out),
        Err(_) => None,
    }
}

/// `doc` with its backend speaking HTTP/2 when `h2`.
fn over(mut doc: poolpilot_api::GatewayLimits, h2: bool) -> poolpilot_api::GatewayLimits {
    if h2 {
        doc.backends[0].protocol = poolpilot_api::limits::UpstreamProtocol::Http2;
    }
    doc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_at_total_and_frees_its_lease_and_permit() {
    stops_reading_cut_at_total(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_an_h2_upstreams_stream_is_cut_at_total() {
    stops_reading_cut_at_total(true).await;
}

async fn stops_reading_cut_at_total(h2: bool) {
    let backend = firehose_over(h2).await;
    let gw = Gw::start(over(
        limits_with(
            backend.addr,
            1,
            serde_json::json!({"firstByte": "1s", "total": "1s", "streamIdle": "5s"}),
            serde_json::json!({"sendTimeout": "60s"}),
            1,
        ),
        h2,
    ))
    .await;
    let start = Instant::now();
    let mut stalled = stop_reading_after_head(gw.proxy, "k1").await;
    // Within the deadline (and a margin for a loaded machine) the upstream connection is gone:
    // the pool's only slot and the client's only permit are free again.
    assert_eventually!(
        backend.seen.connections.load(Ordering::SeqCst) == 0,
        Duration::from_secs(4),
        "the stalled call's upstream connection is closed at the total deadline"
    );
    let cut_after = start.elapsed();
    assert!(cut_after >= Duration::from_millis(900), "{cut_after:?}");
    backend.script.sse_chunks.store(0, Ordering::SeqCst);
    let (status, _, _) = post(gw.proxy, "/v1/x", &[("x-api-key", "k1")], "{}").await;
    assert_eq!(
        status, 200,
        "the same client gets its permit back, the pool its slot"
    );
    // The client's connection was closed, mid-stream: no chunked terminator at the end.
    let rest = read_to_close(&mut stalled, Duration::from_secs(30))
        .await
        .expect("the gateway closed the stalled client's connection");
    assert!(
        !rest.ends_with(b"0\r\n\r\n"),
        "a cut response has no last chunk"
    );
    let text = gw.metrics().await;
    assert_eq!(closed_connections(&text, "timeout"), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_at_the_send_timeout_without_blaming_the_backend() {
    stops_reading_cut_at_send_timeout(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_an_h2_upstreams_stream_is_cut_at_the_send_timeout() {
    stops_reading_cut_at_send_timeout(true).await;
}

async fn stops_reading_cut_at_send_timeout(h2: bool) {
    let backend = firehose_over(h2).await;
    let mut doc = limits_with(
        backend.addr,
        1,
        serde_json::json!({"firstByte": "5s", "total": "60s", "streamIdle": "30s"}),
        serde_json::json!({"sendTimeout": "1s"}),
        4,
    );
    doc = over(doc, h2);
    doc.backends[0].outlier_detection = Some(poolpilot_api::limits::OutlierDetection {
        consecutive_failures: 1,
        base_ejection: poolpilot_api::Duration::from_secs(60),
        max_ejected_percent: 100,
    });
    let gw = Gw::start(doc).await;
    let start = Instant::now();
    let mut stalled = stop_reading_after_head(gw.proxy, "k1").await;
    assert_eventually!(
        backend.seen.connections.load(Ordering::SeqCst) == 0,
        Duration::from_secs(5),
        "the stalled call is cut once the client accepted nothing for sendTimeout"
    );
    assert!(start.elapsed() >= Duration::from_millis(900));
    assert!(
        read_to_close(&mut stalled, Duration::from_secs(30))
            .await
            .is_some(),
        "the client connection is closed"
    );
    backend.script.sse_chunks.store(0, Ordering::SeqCst);
    assert_eq!(
        post(gw.proxy, "/v1/x", &[], "{}").await.0,
        200,
        "the endpoint was not ejected for the client's stall"
    );
    let text = gw.metrics().await;
    assert_eq!(
        metric(&text, "poolpilot_downstream_timeouts_total{kind=\"send\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            "poolpilot_downstream_reclaimed_total{reason=\"send_stall\",client=\"other\"}"
        ),
        Some(1.0),
        "a reclaimed call, by client class: {text}"
    );
    for kind in ["total", "stream_idle", "first_byte"] {
        assert_eq!(
            upstream_timeouts(&text, kind),
            None,
            "a client's stall is no upstream timeout ({kind})"
        );
    }
}

/// An HTTP/2 connection to the gateway whose streams get `window` bytes of flow-control
/// window (0: the gateway may send no DATA at all).
async fn h2_client(
    gw: SocketAddr,
    window: u32,
) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
    let stream = TcpStream::connect(gw).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(window)
        .handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

fn h2_call(key: &str) -> http::Request<Full<Bytes>> {
    http::Request::post("http://gateway.test/v1/chat")
        .header("x-api-key", key)
        .body(Full::new(Bytes::from_static(b"{\"stream\":true}")))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_streams_with_a_zero_window_are_reset_at_the_deadline_and_free_their_leases() {
    let backend = firehose().await;
    let gw = Gw::start(limits_with(
        backend.addr,
        8,
        serde_json::json!({"firstByte": "1s", "total": "1s", "streamIdle": "5s"}),
        serde_json::json!({}),
        100,
    ))
    .await;
    let sender = h2_client(gw.proxy, 0).await;
    let mut streams = Vec::new();
    for i in 0..8 {
        let mut sender = sender.clone();
        streams.push(tokio::spawn(async move {
            let response = sender
                .send_request(h2_call(&format!("k{i}")))
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            // No window: no DATA can arrive. The stream must end with a reset, not hang.
            response.into_body().collect().await.map(|_| ())
        }));
    }
    assert_eventually!(
        backend.seen.max_connections.load(Ordering::SeqCst) == 8,
        Duration::from_secs(3),
        "every stream leased a connection"
    );
    assert_eventually!(
        backend.seen.connections.load(Ordering::SeqCst) == 0,
        Duration::from_secs(4),
        "every stalled stream's upstream connection is closed at the total deadline"
    );
    for s in streams {
        let ended = tokio::time::timeout(Duration::from_secs(5), s)
            .await
            .expect("the stream ended")
            .unwrap();
        assert!(
            ended.is_err(),
            "a cut h2 stream is reset, not ended cleanly"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_window_is_reset_and_its_connection_then_closes_idle_despite_pings() {
    let backend = Backend::start().await;
    let mut doc = limits_with(
        backend.addr,
        4,
        serde_json::json!({"firstByte": "5s", "total": "10s", "streamIdle": "5s"}),
        serde_json::json!({
            "idleTimeout": "1s",
            "sendTimeout": "1s",
            "http2": {"keepAliveInterval": "200ms", "keepAliveTimeout": "5s"}
        }),
        4,
    );
    doc.backends[0].route.path_prefix = Some("/v1/".into());
    let gw = Gw::start(doc).await;
    // A client that gives no window: the gateway's own answer (404, no route) cannot be sent.
    // The client answers the pings.
    let mut sender = h2_client(gw.proxy, 0).await;
    let req = http::Request::post("http://gateway.test/elsewhere")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let start = Instant::now();
    let response = sender.send_request(req).await.unwrap();
    assert_eq!(response.status(), 404);
    let end = tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
        .await
        .expect("the stuck answer ends");
    assert!(end.is_err(), "it is reset at the send timeout");
    assert!(start.elapsed() >= Duration::from_millis(900));
    assert_eventually!(
        gw.open_connections() == 0,
        Duration::from_secs(5),
        "then the connection closes at its idle timeout; pings are no activity"
    );
    assert!(start.elapsed() >= Duration::from_millis(1800));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_connection_carries_at_most_max_concurrent_streams() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(300, Ordering::SeqCst);
    let gw = Gw::start(limits_with(
        backend.addr,
        64,
        serde_json::json!({"firstByte": "5s", "total": "10s", "streamIdle": "5s"}),
        serde_json::json!({"http2": {"maxConcurrentStreams": 5}}),
        100,
    ))
    .await;
    let mut sender = h2_client(gw.proxy, 65_535).await;
    // One call first: the client then knows the gateway's SETTINGS (before them, streams over
    // the limit would be refused with REFUSED_STREAM rather than queued by the client).
    let first = sender.send_request(h2_call("k")).await.unwrap();
    first.into_body().collect().await.unwrap();
    let mut calls = Vec::new();
    for i in 0..20 {
        let mut sender = sender.clone();
        calls.push(tokio::spawn(async move {
            let response = sender.send_request(h2_call(&format!("k{i}"))).await?;
            let status = response.status();
            response.into_body().collect().await?;
            Ok::<_, hyper::Error>(status)
        }));
    }
    for c in calls {
        assert_eq!(c.await.unwrap().unwrap(), 200);
    }
    let most = backend.seen.max_inflight.load(Ordering::SeqCst);
    assert!(
        most <= 5,
        "{most} calls of one h2 connection were in flight at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_connection_that_answers_no_ping_is_closed() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits_with(
        backend.addr,
        4,
        serde_json::json!({"firstByte": "5s", "total": "10s", "streamIdle": "5s"}),
        serde_json::json!({
            "idleTimeout": "60s",
            "http2": {"keepAliveInterval": "300ms", "keepAliveTimeout": "300ms"}
        }),
        4,
    ))
    .await;
    // A client that says hello and then never reads again: its pings go unanswered.
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let start = Instant::now();
    assert_eventually!(
        gw.open_connections() == 1,
        Duration::from_secs(2),
        "the gateway accepted the connection"
    );
    assert_eventually!(
        gw.open_connections() == 0,
        Duration::from_secs(5),
        "the silent h2 connection is closed after its keep-alive ping times out"
    );
    let closed_after = start.elapsed();
    assert!(
        closed_after >= Duration::from_millis(500),
        "{closed_after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_stream_idle_is_an_error_over_http1_and_h2() {
    let backend = Backend::start().await;
    backend.script.sse_chunks.store(10, Ordering::SeqCst);
    backend.script.sse_interval_ms.store(20, Ordering::SeqCst);
    backend.script.sse_stall_after.store(2, Ordering::SeqCst);
    let gw = Gw::start(limits_with(
        backend.addr,
        4,
        serde_json::json!({"firstByte": "2s", "total": "10s", "streamIdle": "300ms"}),
        serde_json::json!({}),
        4,
    ))
    .await;

    // HTTP/1: the connection closes without the chunked terminator.
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    s.write_all(b"POST /v1/chat HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    let all = read_to_close(&mut s, Duration::from_secs(5))
        .await
        .expect("the connection is closed at streamIdle");
    let text = String::from_utf8_lossy(&all);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(text.matches("data: ").count(), 2, "{text}");
    assert!(!text.ends_with("0\r\n\r\n"), "no last chunk: {text}");

    // h2: the stream is reset.
    let mut sender = h2_client(gw.proxy, 65_535).await;
    let response = sender.send_request(h2_call("k")).await.unwrap();
    let mut body = response.into_body();
    let mut chunks = 0;
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("the stream ends at streamIdle")
        {
            Some(Ok(_)) => chunks += 1,
            Some(Err(e)) => break Err(e),
            None => break Ok(()),
        }
    };
    assert_eq!(chunks, 2);
    assert!(end.is_err(), "the cut h2 stream is reset");
}
