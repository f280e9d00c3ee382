//! The MUST requirements of RFC 9110 (HTTP semantics) and RFC 9112 (HTTP/1.1) that bind the
//! gateway as a server and as an intermediary, one test each, over real sockets; the list with
//! the sections is in gateway/README.md ("HTTP conformance"). Where the RFC lets a server
//! choose (reject or repair), the test names the gateway's choice.

use std::fmt;
use std::time::Duration;

use crate::support::*;

/// How long a test waits for the gateway to close a connection.
const WAIT: Duration = Duration::from_secs(3);

/// What the gateway sent back to one raw request: everything it wrote until it closed the
/// connection or [`WAIT`] passed.
struct Answer {
    text: String,
    /// The gateway closed the connection within [`WAIT`].
    closed: bool,
}

impl Answer {
    /// The status code of the status line ("" when there is none).
    fn status(&self) -> &str {
        self.text.get(9..12).unwrap_or_default()
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Sends the raw bytes of `request` on a fresh connection to the gateway's proxy listener.
async fn send(gw: &Gw, request: impl AsRef<[u8]>) -> Answer {
    let (text, closed) = raw_exchange(gw.proxy, request.as_ref(), WAIT).await;
    Answer { text, closed }
}

/// Whether a test also requires the gateway to close the connection after its answer.
#[derive(Clone, Copy, PartialEq)]
enum Close {
    Required,
    NotChecked,
}

/// Sends each `(case, request)` on a fresh connection and asserts that the answer's status is
/// one of `statuses` and, with [`Close::Required`], that the gateway closed the connection.
async fn assert_each_answered<C: fmt::Display, R: AsRef<[u8]>>(
    gw: &Gw,
    statuses: &[&str],
    close: Close,
    cases: impl IntoIterator<Item = (C, R)>,
) {
    for (case, request) in cases {
        let answer = send(gw, request).await;
        assert!(
            statuses.contains(&answer.status()),
            "{case}: want {statuses:?}, got {answer}"
        );
        if close == Close::Required {
            assert!(answer.closed, "{case}: the connection is closed");
        }
    }
}

/// A backend and a gateway routing every path to it.
async fn gateway() -> (Backend, Gw) {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    (backend, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_3_2_a_request_without_exactly_one_valid_host_gets_400() {
    let (backend, gw) = gateway().await;
    let cases = [
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
    ];
    assert_each_answered(&gw, &["400"], Close::NotChecked, cases).await;
    // HTTP/1.0 has no Host requirement.
    let answer = send(&gw, "GET /v1/x HTTP/1.0\r\n\r\n").await;
    assert_eq!(answer.status(), "200", "{answer}");
    assert_eq!(backend.requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_3_2_2_an_absolute_form_target_gives_the_host_forwarded() {
    let (_backend, gw) = gateway().await;
    let answer = send(
        &gw,
        "GET http://api.test:8080/v1/x?q=1 HTTP/1.1\r\nHost: ignored.test\r\nConnection: close\r\n\r\n", // hermetic: not a destination (a request target sent to the gateway)
    )
    .await;
    assert_eq!(answer.status(), "200", "{answer}");
    assert!(
        answer.text.contains(r#"\"host\": \"api.test:8080\""#),
        "{answer}"
    );
    assert!(!answer.text.contains("ignored.test"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_6_1_a_transfer_coding_other_than_final_chunked_gets_400_and_a_close() {
    let (_backend, gw) = gateway().await;
    let cases = ["gzip", "chunked, gzip"].map(|te| {
        let request = format!(
            "POST /v1/x HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: {te}\r\n\r\n0\r\n\r\n"
        );
        (te, request)
    });
    assert_each_answered(&gw, &["400", "501"], Close::Required, cases).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_6_3_conflicting_or_invalid_framing_gets_400_and_a_close() {
    let (_backend, gw) = gateway().await;
    let cases = [
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
    ];
    assert_each_answered(&gw, &["400"], Close::Required, cases).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_6_1_transfer_encoding_beside_content_length_frames_the_body_and_closes() {
    let (_backend, gw) = gateway().await;
    let answer = send(
        &gw,
        "POST /v1/x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    // Framed by Transfer-Encoding alone: the backend got the 5 bytes and no Content-Length.
    assert_eq!(answer.status(), "200", "{answer}");
    assert!(answer.text.contains(r#""bodyBytes":5"#), "{answer}");
    assert!(
        !answer.text.contains("content-length\\\": \\\"3"),
        "{answer}"
    );
    assert!(answer.closed, "the connection is closed after the response");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_5_whitespace_before_a_colon_obs_fold_and_bare_cr_get_400() {
    let (_backend, gw) = gateway().await;
    let cases = [
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
    ];
    assert_each_answered(&gw, &["400"], Close::NotChecked, cases).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_7_6_hop_by_hop_fields_are_dropped_and_via_is_added_both_ways() {
    let (_backend, gw) = gateway().await;
    let answer = send(
        &gw,
        "GET /v1/x HTTP/1.1\r\nHost: a.test\r\nConnection: x-hop, close\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nUpgrade: h2c\r\nProxy-Authorization: Basic eDp5\r\n\r\n",
    )
    .await;
    assert_eq!(answer.status(), "200", "{answer}");
    let lower = answer.text.to_ascii_lowercase();
    let (head, echoed) = lower.split_once("\r\n\r\n").unwrap();
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
    assert!(head.contains("\r\nvia: 1.1 poolpilot"), "{head}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_7_6_2_max_forwards_zero_is_answered_by_the_gateway_and_decremented_otherwise() {
    let (backend, gw) = gateway().await;
    let options = |max_forwards: u32| {
        format!(
            "OPTIONS /v1/x HTTP/1.1\r\nHost: a.test\r\nMax-Forwards: {max_forwards}\r\nConnection: close\r\n\r\n"
        )
    };
    let answer = send(&gw, options(0)).await;
    assert_eq!(answer.status(), "200", "{answer}");
    assert_eq!(backend.requests(), 0, "not forwarded");
    let answer = send(&gw, options(3)).await;
    assert_eq!(answer.status(), "200", "{answer}");
    assert!(
        answer.text.contains(r#"\"max-forwards\": \"2\""#),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_9_3_connect_and_trace_are_not_implemented() {
    let (backend, gw) = gateway().await;
    let cases = [
        (
            "CONNECT",
            "CONNECT model.test:443 HTTP/1.1\r\nHost: model.test:443\r\n\r\n",
        ),
        ("TRACE", "TRACE /v1/x HTTP/1.1\r\nHost: a.test\r\n\r\n"),
    ];
    assert_each_answered(&gw, &["501"], Close::NotChecked, cases).await;
    assert_eq!(backend.requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_6_6_1_the_gateways_own_answers_carry_a_date() {
    let (_backend, gw) = gateway().await;
    for request in [
        "TRACE /v1/x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
        "GET /v1/../admin HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    ] {
        let answer = send(&gw, request).await;
        assert!(
            answer.text.to_ascii_lowercase().contains("\r\ndate: "),
            "{answer}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9112_9_6_close_ends_the_connection_after_the_response() {
    let (_backend, gw) = gateway().await;
    let answer = send(
        &gw,
        "GET /v1/x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(answer.status(), "200");
    assert!(answer.closed);
    assert!(
        answer
            .text
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
    let answer = send(
        &gw,
        "HEAD /v1/x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(answer.status(), "200");
    assert!(
        answer.text.ends_with("\r\n\r\n"),
        "no content: {:?}",
        answer.text
    );
    // RFC 9112 §6.1: no Transfer-Encoding to an HTTP/1.0 client; the close ends the body.
    let answer = send(&gw, "GET /v1/x HTTP/1.0\r\n\r\n").await;
    assert!(answer.closed);
    let lower = answer.text.to_ascii_lowercase();
    assert!(!lower.contains("transfer-encoding"), "{answer}");
    assert_eq!(answer.text.matches("data: ").count(), 3, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9110_10_1_1_an_expectation_in_http10_is_ignored() {
    let (_backend, gw) = gateway().await;
    let answer = send(
        &gw,
        "POST /v1/x HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await;
    assert!(
        answer.text.starts_with("HTTP/1.0 200") || answer.text.starts_with("HTTP/1.1 200"),
        "a final answer, no 100 (Continue): {answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_routes_see_only_normalized_paths() {
    let backend = Backend::start().await;
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 4)).unwrap();
    doc["backends"][0]["match"] = serde_json::json!({"pathPrefix": "/v1/"});
    let gw = Gw::start(from_json(doc)).await;
    let get = |target: &'static str| {
        let request = format!("GET {target} HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n");
        (target, request)
    };
    let refused = [
        "/v1/../internal",
        "/v1/./x",
        "/v1//x",
        "/v1/%2e%2e/internal",
        "/v1/%2E./internal",
        "/v1/a%2fb",
        "/v1/a%5cb",
        "/v1/a\\b",
        "/v1/x/..",
    ];
    assert_each_answered(&gw, &["400"], Close::NotChecked, refused.map(get)).await;
    let served = ["/v1/x", "/v1/x?next=../../y", "/v1/a%20b", "/v1/x.json"];
    assert_each_answered(&gw, &["200"], Close::NotChecked, served.map(get)).await;
}
