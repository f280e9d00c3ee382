//! Loopback tests of health: an endpoint that starts failing is ejected and gets no traffic,
//! and returns once its probes pass.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_endpoint_is_ejected_and_returns_after_probes_pass() {
    let good = Backend::start().await;
    let bad = Backend::start().await;
    let mut doc = serde_json::to_value(limits("model-a", &[good.addr, bad.addr], 4)).unwrap();
    doc["backends"][0]["healthCheck"] = serde_json::json!({"path": "/health", "interval": "100ms", "timeout": "100ms", "unhealthyThreshold": 2, "healthyThreshold": 2});
    doc["backends"][0]["outlierDetection"] = serde_json::json!({"consecutiveFailures": 3, "baseEjection": "300ms", "maxEjectedPercent": 50});
    let gw = Gw::start(from_json(doc)).await;

    bad.script.status.store(500, Ordering::SeqCst);
    bad.script.health_status.store(503, Ordering::SeqCst);
    let mut failures = 0;
    for _ in 0..40 {
        if post(gw.proxy, "/v1/x", &[], "{}").await.0 != 200 {
            failures += 1;
        }
    }
    let bad_calls = bad.seen.requests.load(Ordering::SeqCst);
    assert!(
        bad_calls <= 4,
        "ejected after 3 consecutive failures (probes may take it out sooner): {bad_calls}"
    );
    assert_eq!(
        failures, bad_calls,
        "only calls that reached the failing endpoint failed"
    );

    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            "poolpilot_endpoint_healthy{backend=\"model-a\",endpoint=\"model-a-1\"}"
        ),
        Some(0.0)
    );
    assert_eq!(
        metric(
            &text,
            "poolpilot_endpoint_healthy{backend=\"model-a\",endpoint=\"model-a-0\"}"
        ),
        Some(1.0)
    );

    // Still ejected/unhealthy well past baseEjection while its probes fail.
    tokio::time::sleep(Duration::from_millis(600)).await;
    for _ in 0..10 {
        assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    }
    assert_eq!(
        bad.seen.requests.load(Ordering::SeqCst),
        bad_calls,
        "no traffic while probes fail"
    );

    // It recovers: probes pass, traffic returns.
    bad.script.status.store(0, Ordering::SeqCst);
    bad.script.health_status.store(0, Ordering::SeqCst);
    assert_eventually!(
        metric(
            &gw.metrics().await,
            "poolpilot_endpoint_healthy{backend=\"model-a\",endpoint=\"model-a-1\"}"
        ) == Some(1.0),
        Duration::from_secs(3),
        "the endpoint returns after its probes pass"
    );
    for _ in 0..20 {
        assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    }
    assert!(
        bad.seen.requests.load(Ordering::SeqCst) > bad_calls,
        "the recovered endpoint gets traffic again"
    );
    assert!(
        bad.seen.health_requests.load(Ordering::SeqCst) >= 4,
        "probed actively"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_endpoint_down_clients_get_503_no_healthy_endpoint() {
    let backend = Backend::start().await;
    backend.script.health_status.store(500, Ordering::SeqCst);
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 4)).unwrap();
    doc["backends"][0]["healthCheck"] = serde_json::json!({"path": "/health", "interval": "50ms", "timeout": "100ms", "unhealthyThreshold": 1, "healthyThreshold": 2});
    let gw = Gw::start(from_json(doc)).await;
    assert_eventually!(
        post(gw.proxy, "/v1/x", &[], "{}").await.0 == 503,
        Duration::from_secs(2),
        "no healthy endpoint"
    );
    let (status, headers, body) = post(gw.proxy, "/v1/x", &[], "{}").await;
    assert_eq!(status, 503);
    assert!(body.contains("no_healthy_endpoint"), "{body}");
    // Two passing probes at a 50ms interval: 100ms, rounded up to a whole second.
    assert_eq!(headers["retry-after"], "1");
}

/// Probes count against the cap: under calls that keep every slot busy, with a probe every
/// 10 ms, the backend never sees more connections than the cap (the loop bench once saw 19 on
/// an instance whose target was 17, the probes' connections on top of the pool's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_never_take_an_endpoint_over_its_cap() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(30, Ordering::SeqCst);
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 3)).unwrap();
    doc["backends"][0]["healthCheck"] = serde_json::json!({"path": "/health", "interval": "10ms", "timeout": "200ms", "unhealthyThreshold": 3, "healthyThreshold": 1});
    doc["backends"][0]["pool"]["maxPending"] = serde_json::json!(64);
    doc["backends"][0]["pool"]["leaseTimeout"] = serde_json::json!("5s");
    let gw = Gw::start(from_json(doc)).await;
    // Probes alone, then calls on every slot (two waves with a pause, so probes find free
    // slots between them), probes still running.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let probed_idle = backend.seen.health_requests.load(Ordering::SeqCst);
    for _ in 0..2 {
        let calls: Vec<_> = (0..12)
            .map(|_| tokio::spawn(async move { post(gw.proxy, "/v1/x", &[], "{}").await.0 }))
            .collect();
        for c in calls {
            assert_eq!(c.await.unwrap(), 200);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let max = backend.seen.max_connections.load(Ordering::SeqCst);
    assert!(max <= 3, "the backend saw {max} connections at once, cap 3");
    assert!(probed_idle >= 5, "probed while idle: {probed_idle}");
    assert!(
        backend.seen.health_requests.load(Ordering::SeqCst) > probed_idle,
        "probed between the waves"
    );
}
