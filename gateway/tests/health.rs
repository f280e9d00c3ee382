//! Loopback tests of health: an endpoint that starts failing is ejected and gets no traffic,
//! and returns once its probes pass.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use support::*;

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
