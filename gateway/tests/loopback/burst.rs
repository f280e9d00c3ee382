//! Loopback tests of the burst allowance end to end: a pool at its share opens burst
//! connections at once for a crowd (no 503, no wait for the operator), shows them in
//! `poolpilot_pool_burst_connections`, `/v1/stats` and the access log's `burst` field, and gives
//! them back (closed, never parked idle) once the crowd is served.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use crate::support::*;

/// One backend `model-a` on `backend`: a share of 2 connections and a burst of 2, a pool queue
/// of `max_pending` waiting up to 5 s.
fn bursting(backend: std::net::SocketAddr, max_pending: u32) -> poolpilot_api::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], 2)).unwrap();
    doc["backends"][0]["pool"]["burstPerEndpoint"] = 2.into();
    doc["backends"][0]["pool"]["maxPending"] = max_pending.into();
    from_json(doc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_over_the_share_is_served_at_once_on_burst_connections() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(1000, Ordering::SeqCst);
    // No pool queue at all: without the burst, the third and fourth calls would get 503.
    let gw = Gw::start(bursting(backend.addr, 0)).await;

    let started = Instant::now();
    let calls: Vec<_> = (0..4)
        .map(|_| spawn_post(gw.proxy, "/v1/x", &[], "{}"))
        .collect();
    // While the four run: the backend has all four in flight, two beyond the share, each
    // started before any ended (every call takes the backend 1 s).
    let mut inflight = 0;
    while started.elapsed() < Duration::from_millis(900) {
        inflight = backend.seen.inflight.load(Ordering::SeqCst);
        if inflight == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let all_started = started.elapsed();
    assert_eq!(
        inflight, 4,
        "all four calls reach the backend together (after {all_started:?})"
    );
    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            r#"poolpilot_pool_burst_connections{backend="model-a"}"#
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"poolpilot_pool_burst_allowance{backend="model-a"}"#
        ),
        Some(2.0)
    );
    let stats: serde_json::Value =
        serde_json::from_str(&gw.admin_get("/v1/stats").await.2).unwrap();
    assert_eq!(
        stats["backends"]["model-a"]["burst"],
        serde_json::json!({"allowance": 2, "bursting": 2}),
        "{stats}"
    );
    assert_eq!(stats["backends"]["model-a"]["endpoints"][0]["max"], 2);
    for call in calls {
        assert_eq!(call.await.unwrap(), 200, "no 503: the burst took the crowd");
    }
    assert_eq!(backend.seen.max_inflight.load(Ordering::SeqCst), 4);

    // The access log marks the two calls that ran beyond the share.
    assert_eventually!(
        gw.access_lines().len() == 4,
        Duration::from_secs(2),
        "four access lines"
    );
    let lines = gw.access_lines();
    let bursts = lines.iter().filter(|l| l["burst"] == true).count();
    assert_eq!(bursts, 2, "{lines:?}");
    assert!(
        lines
            .iter()
            .all(|l| l["status"] == 200 && l["burst"].is_boolean())
    );
    // None of them waited for a connection: the burst is granted at once.
    for line in &lines {
        let waited = line["lease_wait_ms"].as_f64().unwrap();
        assert!(waited < 50.0, "a lease waited {waited} ms: {line}");
    }

    // Given back once the crowd is served: the burst connections closed (the backend let go
    // of them too), the share kept idle.
    let bursting = || gw.gateway().stats()["backends"]["model-a"]["burst"]["bursting"].clone();
    assert_eventually!(
        bursting() == 0,
        Duration::from_secs(2),
        "the burst is given back: {}",
        bursting()
    );
    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            r#"poolpilot_pool_burst_connections{backend="model-a"}"#
        ),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, r#"poolpilot_pool_bursts_total{backend="model-a"}"#),
        Some(2.0)
    );
    assert_eq!(closed_connections(&text, "burst"), Some(2.0), "{text}");
    let ep = &serde_json::from_str::<serde_json::Value>(&gw.admin_get("/v1/stats").await.2)
        .unwrap()["backends"]["model-a"]["endpoints"][0];
    assert_eq!(
        (ep["idle"].as_u64(), ep["leased"].as_u64()),
        (Some(2), Some(0)),
        "{ep}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_share_and_burst_calls_wait_and_without_a_burst_they_are_refused() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(400, Ordering::SeqCst);
    let gw = Gw::start(bursting(backend.addr, 4)).await;
    // Six calls: four run at once (share 2 + burst 2), two wait for a returned connection.
    let calls: Vec<_> = (0..6)
        .map(|_| spawn_post(gw.proxy, "/v1/x", &[], "{}"))
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    assert_eq!(
        backend.seen.max_inflight.load(Ordering::SeqCst),
        4,
        "never beyond share + burst"
    );
    assert!(backend.seen.max_connections.load(Ordering::SeqCst) <= 4);

    // Burst 0 (the document before the operator hands one out): the share alone, as before.
    let mut doc = serde_json::to_value(bursting(backend.addr, 0)).unwrap();
    doc["generation"] = 2.into();
    doc["backends"][0]["pool"]["burstPerEndpoint"] = 0.into();
    gw.apply(from_json(doc));
    let calls: Vec<_> = (0..4)
        .map(|_| spawn_post(gw.proxy, "/v1/x", &[], "{}"))
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap().as_u16());
    }
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [200, 200, 503, 503],
        "no burst: a full pool refuses"
    );
}
