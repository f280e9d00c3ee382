//! Loopback tests of client identity: the `Authorization: Bearer` token as the client (what
//! OpenAI SDKs send), and a client's address taken from a trusted proxy, by PROXY protocol v2
//! (per-source connection caps then count the real client) or by `X-Forwarded-For`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One backend that holds each call `delay_ms`, and a client policy of one call per client
/// (no queue) identified as `identity`, with listener fields.
async fn one_call_each(identity: serde_json::Value, listener: serde_json::Value) -> (Backend, Gw) {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(400, Ordering::SeqCst);
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 16)).unwrap();
    doc["backends"][0]["clientPolicy"] = "callers".into();
    doc["clientPolicies"] = serde_json::json!([{
        "name": "callers", "identity": identity,
        "maxConcurrency": 1, "maxQueue": 0, "queueTimeout": "1s",
        "overrides": [{"name": "batch", "keySha256": sha256_hex("sk-batch"), "maxConcurrency": 2}]
    }]);
    for (k, v) in listener.as_object().unwrap() {
        doc["listener"][k] = v.clone();
    }
    let gw = Gw::start(from_json(doc)).await;
    (backend, gw)
}

/// Statuses of `headers.len()` calls sent at once, one per header set, in order.
async fn at_once(gw: SocketAddr, headers: Vec<Vec<(&'static str, String)>>) -> Vec<u16> {
    let calls: Vec<_> = headers
        .into_iter()
        .enumerate()
        .map(|(i, h)| {
            tokio::spawn(async move {
                // Keep them in order: each starts after the one before is in flight.
                tokio::time::sleep(Duration::from_millis(50 * i as u64)).await;
                let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
                post(gw, "/v1/chat", &h, "{}").await.0.as_u16()
            })
        })
        .collect();
    let mut out = Vec::new();
    for c in calls {
        out.push(c.await.unwrap());
    }
    out
}

fn bearer(token: &str) -> Vec<(&'static str, String)> {
    vec![("authorization", format!("Bearer {token}"))]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_token_is_the_client() {
    let (_backend, gw) = one_call_each(
        serde_json::json!({"header": "authorization"}),
        serde_json::json!({}),
    )
    .await;
    let statuses = at_once(
        gw.proxy,
        vec![
            bearer("sk-alice"),
            // The same token, the scheme written otherwise: the same client.
            vec![("authorization", "bearer sk-alice".to_owned())],
            bearer("sk-bob"),
        ],
    )
    .await;
    assert_eq!(statuses, [200, 429, 200]);
    // The override's keySha256 is the token's hash, without the scheme.
    let statuses = at_once(
        gw.proxy,
        vec![bearer("sk-batch"), bearer("sk-batch"), bearer("sk-batch")],
    )
    .await;
    assert_eq!(statuses, [200, 200, 429]);
    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            "poolpilot_client_rejected_total{client=\"batch\",reason=\"client_concurrency\"}"
        ),
        Some(1.0)
    );
}

fn xff(addr: &str) -> Vec<(&'static str, String)> {
    vec![("x-forwarded-for", addr.to_owned())]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_forwarded_for_names_the_client_only_behind_a_trusted_proxy() {
    let (backend, gw) = one_call_each(
        serde_json::json!({"sourceIp": {}}),
        serde_json::json!({
            "trustedProxies": {"cidrs": ["127.0.0.0/8"], "protocol": "xForwardedFor"}
        }),
    )
    .await;
    let statuses = at_once(
        gw.proxy,
        vec![
            xff("192.0.2.7"), // hermetic: not a destination (a forwarded client address)
            // A chain: the client is the rightmost address that is not a trusted proxy.
            xff("198.51.100.1, 192.0.2.7, 127.0.0.9"), // hermetic: not a destination (header)
            xff("192.0.2.8"), // hermetic: not a destination (a forwarded client address)
        ],
    )
    .await;
    assert_eq!(statuses, [200, 429, 200]);
    assert_eq!(backend.seen.requests.load(Ordering::SeqCst), 2);

    // Not behind a trusted proxy: the header is not believed.
    let (_backend, gw) = one_call_each(
        serde_json::json!({"sourceIp": {}}),
        serde_json::json!({
            "trustedProxies": {"cidrs": ["10.99.0.0/16"], "protocol": "xForwardedFor"} // hermetic: not a destination (a proxy range no peer is in)
        }),
    )
    .await;
    let statuses = at_once(
        gw.proxy,
        vec![
            xff("192.0.2.7"), // hermetic: not a destination (a forwarded client address)
            xff("192.0.2.8"), // hermetic: not a destination (a forwarded client address)
        ],
    )
    .await;
    assert_eq!(statuses, [200, 429], "both are 127.0.0.1");
}

/// A connection that opens with a PROXY protocol v2 header naming `client` as its source.
async fn proxied(gw: SocketAddr, client: SocketAddr) -> TcpStream {
    let header = ppp::v2::Builder::with_addresses(
        ppp::v2::Version::Two | ppp::v2::Command::Proxy,
        ppp::v2::Protocol::Stream,
        (client, gw),
    )
    .build()
    .unwrap();
    let mut s = TcpStream::connect(gw).await.unwrap();
    s.write_all(&header).await.unwrap();
    s
}

async fn call_on(s: &mut TcpStream) -> String {
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_protocol_header_names_the_client_for_caps_and_identity() {
    let (backend, gw) = one_call_each(
        serde_json::json!({"sourceIp": {}}),
        serde_json::json!({
            "maxConnectionsPerClient": 1,
            "trustedProxies": {"cidrs": ["127.0.0.1/32"], "protocol": "proxyV2"}
        }),
    )
    .await;
    backend.script.delay_ms.store(0, Ordering::SeqCst);
    let alice: SocketAddr = "192.0.2.7:40000".parse().unwrap(); // hermetic: not a destination (a PROXY header's source)
    let bob: SocketAddr = "192.0.2.8:40000".parse().unwrap(); // hermetic: not a destination (a PROXY header's source)
    let mut a1 = proxied(gw.proxy, alice).await;
    assert!(call_on(&mut a1).await.starts_with("HTTP/1.1 200"));
    // Alice's second connection is over her cap of one; Bob's is not.
    let mut a2 = proxied(gw.proxy, alice).await;
    let refused = call_on(&mut a2).await;
    assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
    let mut b1 = proxied(gw.proxy, bob).await;
    assert!(call_on(&mut b1).await.starts_with("HTTP/1.1 200"));
    // The backend hears of the real client.
    let echoed = call_on(&mut b1).await;
    assert!(echoed.contains("192.0.2.8"), "{echoed}"); // hermetic: not a destination (the client a PROXY header named)

    // From a trusted proxy, a connection without the header is closed unanswered.
    let mut bare = TcpStream::connect(gw.proxy).await.unwrap();
    bare.write_all(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), bare.read_to_end(&mut buf)).await;
    assert!(buf.is_empty(), "{}", String::from_utf8_lossy(&buf));
}
