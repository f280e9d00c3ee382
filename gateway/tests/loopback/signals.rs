//! Loopback tests of the incident signals: the lease-wait buckets holding the SLO bound (and
//! configurable), the runtime lag probe seeing a stalled runtime, lease and connection hold
//! times by client class, connections reclaimed from idle clients and slow heads, and the age of
//! upstream connections at their close.

use std::time::Duration;

use crate::support::*;
use tokio::io::AsyncWriteExt as _;

/// The count of a histogram series (`name_count{labels}`), 0 when absent.
fn count(text: &str, series: &str) -> f64 {
    metric(text, series).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_waits_are_counted_in_a_bucket_at_the_slo_bound() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    let text = gw.metrics().await;
    let within = metric(
        &text,
        r#"poolpilot_pool_lease_wait_seconds_bucket{le="0.05",backend="model-a"}"#,
    );
    assert_eq!(within, Some(1.0), "{text}");
    // The 0.5 ms × 2ⁿ bounds stay around it.
    for le in ["0.032", "0.064"] {
        assert!(text.contains(&format!(
            r#"poolpilot_pool_lease_wait_seconds_bucket{{le="{le}",backend="model-a"}}"#
        )));
    }

    // Other bounds when configured.
    let gw = Gw::start_edited(None, Duration::from_secs(5), Duration::ZERO, |config, _| {
        config.metrics.lease_wait_buckets = Some(vec![
            poolpilot_api::Duration::from_millis(20),
            poolpilot_api::Duration::from_millis(10),
        ]);
    })
    .await;
    gw.apply(limits("model-a", &[backend.addr], 4));
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    let text = gw.metrics().await;
    let buckets: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("poolpilot_pool_lease_wait_seconds_bucket"))
        .collect();
    assert_eq!(buckets.len(), 3, "{buckets:?}");
    assert!(buckets[0].contains(r#"le="0.01""#), "sorted: {buckets:?}");
    assert!(buckets[1].contains(r#"le="0.02""#));
    assert!(buckets[2].contains(r#"le="+Inf""#));
}

/// Blocks the thread of the runtime this runs on, as a CPU-bound or blocking call in the
/// gateway would.
#[allow(clippy::disallowed_methods)]
fn stall_the_runtime(for_: Duration) {
    std::thread::sleep(for_);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn the_lag_probe_sees_a_stalled_runtime() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let calm = gw.metrics().await;
    let probes = count(&calm, "poolpilot_runtime_lag_seconds_count");
    assert!(probes >= 3.0, "the probe runs every 100ms: {probes}");
    let late = |text: &str| {
        count(text, "poolpilot_runtime_lag_seconds_count")
            - count(text, r#"poolpilot_runtime_lag_seconds_bucket{le="0.1"}"#)
    };
    assert_eq!(late(&calm), 0.0, "no probe 100ms late on an idle runtime");
    assert_eq!(metric(&calm, "poolpilot_runtime_workers"), Some(1.0));

    // The only worker blocks for 300ms: the probe due meanwhile runs that late.
    tokio::spawn(async { stall_the_runtime(Duration::from_millis(300)) })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stalled = gw.metrics().await;
    assert!(late(&stalled) >= 1.0, "{stalled}");
    assert!(
        count(&stalled, "poolpilot_runtime_worker_busy_seconds_total") >= 0.3,
        "the blocked worker was busy: {stalled}"
    );
    assert!(count(&stalled, "poolpilot_runtime_alive_tasks") >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_reclaims_and_connection_ages_are_measured() {
    let backend = Backend::start().await;
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 4)).unwrap();
    doc["listener"]["idleTimeout"] = "300ms".into();
    doc["listener"]["headerReadTimeout"] = "300ms".into();
    doc["clientPolicies"] = serde_json::json!([client_policy(
        4,
        0,
        "1s",
        &[client_override("team-a", "key-a", 4)]
    )]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    let gw = Gw::start(from_json(doc)).await;
    backend
        .script
        .delay_ms
        .store(200, std::sync::atomic::Ordering::SeqCst);

    // A call of team-a holding its lease ~200ms, on a connection then left idle: reclaimed at
    // the idle timeout.
    let mut conn = connect(gw.proxy).await;
    let (status, ..) = conn
        .call(request("POST", "/v1/x", &[("x-api-key", "key-a")], "{}"))
        .await;
    assert_eq!(status, 200);
    // A client that sends half a head and stops: reclaimed at the header-read timeout.
    let mut half = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    half.write_all(b"POST /v1/x HTTP/1.1\r\nHost: gw\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;

    let text = gw.metrics().await;
    let held =
        r#"poolpilot_pool_lease_hold_seconds_bucket{le="0.16",backend="model-a",client="team-a"}"#;
    assert_eq!(
        metric(&text, held),
        Some(0.0),
        "held longer than 160ms: {text}"
    );
    assert_eq!(
        count(
            &text,
            r#"poolpilot_pool_lease_hold_seconds_count{backend="model-a",client="team-a"}"#
        ),
        1.0
    );
    assert_eq!(
        count(
            &text,
            r#"poolpilot_downstream_reclaimed_total{reason="idle_timeout",client="team-a"}"#
        ),
        1.0,
        "the connection's last call was team-a's: {text}"
    );
    assert_eq!(
        count(
            &text,
            r#"poolpilot_downstream_reclaimed_total{reason="header_timeout",client="none"}"#
        ),
        1.0,
        "{text}"
    );
    assert!(count(&text, "poolpilot_downstream_connection_hold_seconds_count") >= 2.0);
    assert_eq!(
        count(
            &text,
            r#"poolpilot_downstream_connection_hold_seconds_bucket{le="0.16"}"#
        ),
        0.0,
        "both were held at least 300ms"
    );

    // The upstream connection, drained by hand: its age at close, by reason.
    let (status, body) = gw
        .admin_call("POST", "/v1/backends/model-a/endpoints/model-a-0/drain", "")
        .await;
    assert_eq!(status, 200, "{body}");
    let text = gw.metrics().await;
    assert_eq!(
        count(
            &text,
            r#"poolpilot_pool_connection_age_seconds_count{backend="model-a",reason="drained"}"#
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        count(
            &text,
            r#"poolpilot_pool_connection_age_seconds_bucket{le="0.64",backend="model-a",reason="drained"}"#
        ),
        0.0,
        "opened before the ~1s of the call and the idle wait"
    );
}

/// A backend answering one request per connection read, keeping each connection open after
/// its answer, and resetting (SO_LINGER 0) every connection 100ms after its first answer, as a
/// middlebox that dropped it would make it look. Counts requests and connections.
async fn resetting_backend() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncReadExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = requests.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                seen.fetch_add(1, Ordering::SeqCst);
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let std = stream.into_std().unwrap();
                socket2::SockRef::from(&std)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
                drop(std);
            });
        }
    });
    (addr, requests)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_connection_reset_while_idle_is_dropped_before_a_request_is_sent_on_it() {
    let (addr, requests) = resetting_backend().await;
    let mut doc = serde_json::to_value(limits("model-a", &[addr], 4)).unwrap();
    doc["backends"][0]["pool"]["validateAfterIdle"] = "100ms".into();
    let gw = Gw::start(from_json(doc)).await;
    for call in 0..3 {
        let (status, _, body) = post(gw.proxy, "/v1/x", &[], "{}").await;
        assert_eq!(status, 200, "call {call}: {body}");
        assert_eq!(body, "ok");
        // The pooled connection is reset 100ms after its answer, while idle.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(
        requests.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "every request went out once, each on a new connection"
    );
    let text = gw.metrics().await;
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("poolpilot_upstream_retries_total{")),
        "no request was sent on a dead connection: {text}"
    );
    let closed = |reasons: &[&str]| -> f64 {
        reasons
            .iter()
            .map(|reason| {
                count(
                    &text,
                    &format!(
                        r#"poolpilot_pool_connections_closed_total{{backend="model-a",endpoint="model-a-0",reason="{reason}"}}"#
                    ),
                )
            })
            .sum()
    };
    // The first reset connection is found dropped (at the next lease); from then on the pool
    // keeps connections to the endpoint idle for less than that connection's idle time, and
    // closes the second itself before it would be used.
    let by_backend = closed(&["peer_closed", "validate_failed"]);
    assert!(
        by_backend >= 1.0,
        "the first reset connection was dropped: {text}"
    );
    assert_eq!(
        by_backend + closed(&["idle"]),
        2.0,
        "the two connections left idle were dropped or closed first: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_coming_back_before_their_retry_after_are_counted_and_can_be_told_to_wait_longer() {
    use std::sync::atomic::Ordering;
    let backend = Backend::start().await;
    backend.script.delay_ms.store(400, Ordering::SeqCst);
    let gw = Gw::start_edited(None, Duration::from_secs(5), Duration::ZERO, |config, _| {
        config.early_retries.penalty_factor = 3;
    })
    .await;
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 4)).unwrap();
    doc["clientPolicies"] = serde_json::json!([client_policy(
        1,
        0,
        "1s",
        &[client_override("team-a", "key-a", 1)]
    )]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    gw.apply(from_json(doc));

    // team-a holds its only slot; a second call is refused with a Retry-After.
    let proxy = gw.proxy;
    let busy = |key: &'static str| {
        tokio::spawn(async move { post(proxy, "/v1/x", &[("x-api-key", key)], "{}").await.0 })
    };
    let slow = busy("key-a");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, headers, _) = post(gw.proxy, "/v1/x", &[("x-api-key", "key-a")], "{}").await;
    assert_eq!(status, 429);
    let told: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(told >= 1);
    // It comes back at once, is refused again, and told to wait three times as long.
    let (status, headers, _) = post(gw.proxy, "/v1/x", &[("x-api-key", "key-a")], "{}").await;
    assert_eq!(status, 429);
    let penalized: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert_eq!(
        penalized,
        3 * told,
        "an early retry refused again waits longer"
    );
    assert_eq!(slow.await.unwrap(), 200);

    // Another client refused once and back after its Retry-After: on time.
    let slow = busy("key-b");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, headers, _) = post(gw.proxy, "/v1/x", &[("x-api-key", "key-b")], "{}").await;
    assert_eq!(status, 429);
    let told: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert_eq!(slow.await.unwrap(), 200);
    tokio::time::sleep(Duration::from_secs(told) + Duration::from_millis(50)).await;
    backend.script.delay_ms.store(0, Ordering::SeqCst);
    assert_eq!(
        post(gw.proxy, "/v1/x", &[("x-api-key", "key-b")], "{}")
            .await
            .0,
        200
    );

    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            r#"poolpilot_client_retries_total{client="team-a",timing="early"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"poolpilot_client_retries_total{client="other",timing="on_time"}"#
        ),
        Some(1.0),
        "{text}"
    );
    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(
        stats["retryAfterCompliance"],
        serde_json::json!([
            {"client": "other", "early": 0, "onTime": 1, "earlyShare": 0.0},
            {"client": "team-a", "early": 1, "onTime": 0, "earlyShare": 1.0},
        ])
    );
    // The access log tells which call came back early.
    let lines = gw.access_lines();
    assert_eq!(lines.iter().filter(|l| l["retry"] == "early").count(), 1);
    assert_eq!(lines.iter().filter(|l| l["retry"] == "on_time").count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_clients_ask_for_is_a_distribution_and_the_top_clients_are_named() {
    use std::sync::atomic::Ordering;
    let backend = Backend::start().await;
    backend.script.delay_ms.store(400, Ordering::SeqCst);
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 16)).unwrap();
    doc["clientPolicies"] = serde_json::json!([client_policy(
        2,
        8,
        "5s",
        &[client_override("team-a", "key-a", 2)]
    )]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    let gw = Gw::start(from_json(doc)).await;

    // team-a asks for 4 calls at once (2 run, 2 queue), another client for 1.
    let mut calls = Vec::new();
    for key in ["key-a", "key-a", "key-a", "key-a", "key-z"] {
        let proxy = gw.proxy;
        calls.push(tokio::spawn(async move {
            post(proxy, "/v1/x", &[("x-api-key", key)], "{}").await.0
        }));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    let top = &stats["topClients"];
    assert_eq!(top[0]["client"], "team-a", "{stats}");
    assert_eq!(top[0]["inflight"], 2);
    assert_eq!(top[0]["queued"], 2);
    assert!(
        top[1]["client"].as_str().unwrap().starts_with("sha256:"),
        "{stats}"
    );
    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    let text = gw.metrics().await;
    let bucket = |le: &str| {
        metric(
            &text,
            &format!(r#"poolpilot_client_concurrency_bucket{{le="{le}",policy="default"}}"#),
        )
    };
    assert_eq!(
        metric(
            &text,
            r#"poolpilot_client_concurrency_count{policy="default"}"#
        ),
        Some(5.0),
        "{text}"
    );
    assert_eq!(bucket("1.0"), Some(2.0), "team-a's first call and key-z's");
    assert_eq!(bucket("2.0"), Some(3.0));
    assert_eq!(bucket("3.0"), Some(4.0));
    assert_eq!(bucket("4.0"), Some(5.0), "team-a asked for 4 at once");
}
