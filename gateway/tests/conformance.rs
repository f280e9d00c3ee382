//! The MUST requirements of RFC 9110 (HTTP semantics) and RFC 9112 (HTTP/1.1) that bind the
//! gateway as a server and as an intermediary, one test each, over real sockets; the list with
//! the sections is in gateway/README.md ("HTTP conformance"). Where the RFC lets a server
//! choose (reject or repair), the test names the gateway's choice.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `bytes` and reads until the gateway closes the connection or `wait` passes.
async fn exchange(gw: SocketAddr, bytes: &[u8], wait: Duration) -> (String, bool) {
    let mut s = TcpStream::connect(gw).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let closed = tokio::time::timeout(wait, s.read_to_end(&mut out))
        .await
        .is_ok();
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

async fn gateway() -> (Backend, Gw) {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    (backend, gw)
}

fn status_of(response: &str) -> &str {
    response.get(9..12).unwrap_or_default()
}

const WAIT: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_3_2_a_request_without_exactly_one_valid_host_gets_400() {
    let (backend, gw) = gateway().await;
    for (case, request) in [
        ("no Host", "GET /v1/x HTTP/1.1\r\n\r\n"),
        (
            "two Host lines",
            "GET /v1/x HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
        ),
        (
            "an invalid Host",
            "GET /v1/x HTTP/1.1\r\nHost: a b.test\r\n\r\n",
        ),
        (
            "userinfo in Host",
            "GET /v1/x HTTP/1.1\r\nHost: user@a.test\r\n\r\n",
        ),
    ] {
        let (response, _) = exchange(gw.proxy, request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&response), "400", "{case}: {response}");
    }
    // HTTP/1.0 has no Host requirement.
    let (response, _) = exchange(gw.proxy, b"GET /v1/x HTTP/1.0\r\n\r\n", WAIT).await;
    assert_eq!(status_of(&response), "200", "{response}");
    assert_eq!(
        backend
            .seen
            .requests
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_3_2_2_an_absolute_form_target_gives_the_host_forwarded() {
    let (_backend, gw) = gateway().await;
    let (response, _) = exchange(
        gw.proxy,
        b"GET http://api.test:8080/v1/x?q=1 HTTP/1.1\r\nHost: ignored.test\r\nConnection: close\r\n\r\n", // hermetic: not a destination (a request target sent to the gateway)
        WAIT,
    )
    .await;
    assert_eq!(status_of(&response), "200", "{response}");
    assert!(
        response.contains(r#"\"host\": \"api.test:8080\""#),
        "{response}"
    );
    assert!(!response.contains("ignored.test"), "{response}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_6_1_a_transfer_coding_other_than_final_chunked_gets_400_and_a_close() {
    let (_backend, gw) = gateway().await;
    for te in ["gzip", "chunked, gzip"] {
        let request = format!(
            "POST /v1/x HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: {te}\r\n\r\n0\r\n\r\n"
        );
        let (response, closed) = exchange(gw.proxy, request.as_bytes(), WAIT).await;
        assert!(
            matches!(status_of(&response), "400" | "501"),
            "{te}: {response}"
        );
        assert!(closed, "{te}: the connection is closed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_6_3_conflicting_or_invalid_framing_gets_400_and_a_close() {
    let (_backend, gw) = gateway().await;
    for (case, request) in [
        (
            "two different Content-Length values",
            "POST /v1/x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        ),
        (
            "a Content-Length list",
            "POST /v1/x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5, 6\r\n\r\nhello!",
        ),
        (
            "a negative Content-Length",
            "POST /v1/x HTTP/1.1\r\nHost: a.test\r\nContent-Length: -1\r\n\r\n",
        ),
    ] {
        let (response, closed) = exchange(gw.proxy, request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&response), "400", "{case}: {response}");
        assert!(closed, "{case}: the connection is closed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_6_1_transfer_encoding_beside_content_length_frames_the_body_and_closes() {
    let (_backend, gw) = gateway().await;
    let (response, closed) = exchange(
        gw.proxy,
        b"POST /v1/x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        WAIT,
    )
    .await;
    // Framed by Transfer-Encoding alone: the backend got the 5 bytes and no Content-Length.
    assert_eq!(status_of(&response), "200", "{response}");
    assert!(response.contains(r#""bodyBytes":5"#), "{response}");
    assert!(
        !response.contains("content-length\\\": \\\"3"),
        "{response}"
    );
    assert!(closed, "the connection is closed after the response");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_5_whitespace_before_a_colon_obs_fold_and_bare_cr_get_400() {
    let (_backend, gw) = gateway().await;
    for (case, request) in [
        (
            "whitespace before the colon",
            "GET /v1/x HTTP/1.1\r\nHost: a.test\r\nX-A : 1\r\n\r\n",
        ),
        (
            "obs-fold",
            "GET /v1/x HTTP/1.1\r\nHost: a.test\r\nX-A: 1\r\n 2\r\n\r\n",
        ),
        (
            "a bare CR",
            "GET /v1/x HTTP/1.1\r\nHost: a.test\r\nX-A: 1\r2\r\n\r\n",
        ),
    ] {
        let (response, _) = exchange(gw.proxy, request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&response), "400", "{case}: {response}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_7_6_hop_by_hop_fields_are_dropped_and_via_is_added_both_ways() {
    let (_backend, gw) = gateway().await;
    let (response, _) = exchange(
        gw.proxy,
        b"GET /v1/x HTTP/1.1\r\nHost: a.test\r\nConnection: x-hop, close\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nUpgrade: h2c\r\nProxy-Authorization: Basic eDp5\r\n\r\n",
        WAIT,
    )
    .await;
    assert_eq!(status_of(&response), "200", "{response}");
    let lower = response.to_ascii_lowercase();
    let echoed = lower.split_once("\r\n\r\n").unwrap().1;
    for gone in [
        "x-hop",
        "keep-alive",
        "\\\"te\\\"",
        "upgrade",
        "proxy-authorization",
    ] {
        assert!(
            !echoed.contains(gone),
            "{gone} reached the backend: {echoed}"
        );
    }
    assert!(echoed.contains(r#"\"via\": \"1.1 poolpilot\""#), "{echoed}");
    let head = lower.split_once("\r\n\r\n").unwrap().0;
    assert!(head.contains("\r\nvia: 1.1 poolpilot"), "{head}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_7_6_2_max_forwards_zero_is_answered_by_the_gateway_and_decremented_otherwise() {
    let (backend, gw) = gateway().await;
    let (response, _) = exchange(
        gw.proxy,
        b"OPTIONS /v1/x HTTP/1.1\r\nHost: a.test\r\nMax-Forwards: 0\r\nConnection: close\r\n\r\n",
        WAIT,
    )
    .await;
    assert_eq!(status_of(&response), "200", "{response}");
    assert_eq!(
        backend
            .seen
            .requests
            .load(std::sync::atomic::Ordering::SeqCst),
        0,
        "not forwarded"
    );
    let (response, _) = exchange(
        gw.proxy,
        b"OPTIONS /v1/x HTTP/1.1\r\nHost: a.test\r\nMax-Forwards: 3\r\nConnection: close\r\n\r\n",
        WAIT,
    )
    .await;
    assert_eq!(status_of(&response), "200", "{response}");
    assert!(
        response.contains(r#"\"max-forwards\": \"2\""#),
        "{response}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_9_3_connect_and_trace_are_not_implemented() {
    let (backend, gw) = gateway().await;
    for request in [
        "CONNECT model.test:443 HTTP/1.1\r\nHost: model.test:443\r\n\r\n",
        "TRACE /v1/x HTTP/1.1\r\nHost: a.test\r\n\r\n",
    ] {
        let (response, _) = exchange(gw.proxy, request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&response), "501", "{request}: {response}");
    }
    assert_eq!(
        backend
            .seen
            .requests
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_6_6_1_the_gateways_own_answers_carry_a_date() {
    let (_backend, gw) = gateway().await;
    let (response, _) = exchange(
        gw.proxy,
        b"TRACE /v1/x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
        WAIT,
    )
    .await;
    let (bad, _) = exchange(
        gw.proxy,
        b"GET /v1/../admin HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
        WAIT,
    )
    .await;
    for r in [response, bad] {
        assert!(r.to_ascii_lowercase().contains("\r\ndate: "), "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_9_6_close_ends_the_connection_after_the_response() {
    let (_backend, gw) = gateway().await;
    let (response, closed) = exchange(
        gw.proxy,
        b"GET /v1/x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
        WAIT,
    )
    .await;
    assert_eq!(status_of(&response), "200");
    assert!(closed);
    assert!(
        response
            .to_ascii_lowercase()
            .contains("\r\nconnection: close")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_9_3_2_a_head_response_has_no_content_and_http10_gets_no_chunks() {
    let backend = Backend::start().await;
    backend
        .script
        .sse_chunks
        .store(3, std::sync::atomic::Ordering::SeqCst);
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    let (response, _) = exchange(
        gw.proxy,
        b"HEAD /v1/x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
        WAIT,
    )
    .await;
    assert_eq!(status_of(&response), "200");
    assert!(response.ends_with("\r\n\r\n"), "no content: {response:?}");
    // RFC 9112 §6.1: no Transfer-Encoding to an HTTP/1.0 client; the close ends the body.
    let (response, closed) = exchange(gw.proxy, b"GET /v1/x HTTP/1.0\r\n\r\n", WAIT).await;
    assert!(closed);
    let lower = response.to_ascii_lowercase();
    assert!(!lower.contains("transfer-encoding"), "{response}");
    assert_eq!(response.matches("data: ").count(), 3, "{response}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_10_1_1_an_expectation_in_http10_is_ignored() {
    let (_backend, gw) = gateway().await;
    let (response, _) = exchange(
        gw.proxy,
        b"POST /v1/x HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
        WAIT,
    )
    .await;
    assert!(
        response.starts_with("HTTP/1.0 200") || response.starts_with("HTTP/1.1 200"),
        "a final answer, no 100 (Continue): {response}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_routes_see_only_normalized_paths() {
    let backend = Backend::start().await;
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 4)).unwrap();
    doc["backends"][0]["match"] = serde_json::json!({"pathPrefix": "/v1/"});
    let gw = Gw::start(from_json(doc)).await;
    for target in [
        "/v1/../internal",
        "/v1/./x",
        "/v1//x",
        "/v1/%2e%2e/internal",
        "/v1/%2E./internal",
        "/v1/a%2fb",
        "/v1/a%5cb",
        "/v1/a\\b",
        "/v1/x/..",
    ] {
        let request = format!("GET {target} HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n");
        let (response, _) = exchange(gw.proxy, request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&response), "400", "{target}: {response}");
    }
    for target in ["/v1/x", "/v1/x?next=../../y", "/v1/a%20b", "/v1/x.json"] {
        let request = format!("GET {target} HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n");
        let (response, _) = exchange(gw.proxy, request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&response), "200", "{target}: {response}");
    }
}
