//! Loopback tests of priority classes through the real gateway: a saturated pool serves
//! interactive calls before the batch calls that queued first, a client cannot raise itself to
//! interactive with the header the policy does not trust, batch is held to its share cap of
//! the backend's connections while interactive calls use them all, and the class shows in the
//! access log and the per-class metrics.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use support::*;

const HEADER: &str = "x-poolpilot-priority";

/// One backend of `cap` connections behind a client policy with priority classes: `nightly`
/// (the key `batch-key`) is pinned to batch, other clients are interactive unless they ask for
/// batch with the header (which the policy does not trust for `interactive`).
fn prioritized(
    backend: std::net::SocketAddr,
    cap: u32,
    batch_max_percent: Option<u32>,
) -> poolpilot_api::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], cap)).unwrap();
    let mut priority = serde_json::json!({"header": HEADER, "agingAfter": "3s"});
    if let Some(pct) = batch_max_percent {
        priority["batchMaxPercent"] = pct.into();
    }
    doc["clientPolicies"] = serde_json::json!([{
        "name": "default",
        "identity": {"header": "x-api-key"},
        "maxConcurrency": 100,
        "maxQueue": 100,
        "queueTimeout": "10s",
        "overrides": [{
            "name": "nightly",
            "keySha256": sha256_hex("batch-key"),
            "maxConcurrency": 100,
            "class": "batch"
        }],
        "priority": priority
    }]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    from_json(doc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_pool_serves_interactive_calls_before_the_batch_calls_queued_first() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(100, Ordering::SeqCst);
    let gw = Gw::start(prioritized(backend.addr, 2, None)).await;

    // Eight batch calls fill the pool (2) and queue (6); the hostile one says it is
    // interactive, which the policy does not let it be.
    let mut batch = Vec::new();
    for i in 0..8 {
        let proxy = gw.proxy;
        let claim = if i == 7 { "interactive" } else { "batch" };
        batch.push(tokio::spawn(async move {
            post(
                proxy,
                "/v1/x",
                &[("x-api-key", "batch-key"), (HEADER, claim)],
                "{}",
            )
            .await
            .0
        }));
    }
    tokio::time::sleep(Duration::from_millis(40)).await;
    let text = gw.metrics().await;
    let pending = |class: &str| {
        metric(
            &text,
            &format!("poolpilot_pool_class_pending{{backend=\"model-a\",class=\"{class}\"}}"),
        )
    };
    assert_eq!(pending("batch"), Some(6.0), "{text}");
    assert_eq!(pending("interactive"), Some(0.0));

    // Four interactive clients arrive after them, and a caller that lowers itself to batch.
    let mut interactive = Vec::new();
    for i in 0..4 {
        let proxy = gw.proxy;
        interactive.push(tokio::spawn(async move {
            post(proxy, "/v1/x", &[("x-api-key", &format!("user-{i}"))], "{}")
                .await
                .0
        }));
    }
    let lowered = post(
        gw.proxy,
        "/v1/x",
        &[("x-api-key", "polite"), (HEADER, "Batch")],
        "{}",
    );
    for c in interactive {
        assert_eq!(c.await.unwrap(), 200);
    }
    assert_eq!(lowered.await.0, 200);
    for c in batch {
        assert_eq!(c.await.unwrap(), 200);
    }

    let lines = gw.access_lines();
    assert_eq!(lines.len(), 13);
    let wait = |l: &serde_json::Value| l["lease_wait_ms"].as_f64().unwrap();
    let of = |name: &str| -> Vec<&serde_json::Value> {
        lines.iter().filter(|l| l["client"] == name).collect()
    };
    let nightly = of("nightly");
    assert_eq!(nightly.len(), 8);
    assert!(
        nightly.iter().all(|l| l["class"] == "batch"),
        "the override pins batch whatever the header says: {nightly:?}"
    );
    let others = of("other");
    let interactive_waits: Vec<f64> = others
        .iter()
        .filter(|l| l["class"] == "interactive")
        .map(|l| wait(l))
        .collect();
    assert_eq!(interactive_waits.len(), 4);
    assert_eq!(
        others.iter().filter(|l| l["class"] == "batch").count(),
        1,
        "a caller may lower itself to batch"
    );
    // Four interactive calls over 2 connections of 100ms calls: served in two rounds, within
    // ~200ms, ahead of the six batch calls that queued 40ms before them (the last of those
    // waits three rounds more). Slack for a loaded machine: a round may take longer.
    let worst_interactive = interactive_waits.iter().copied().fold(0.0, f64::max);
    let batch_waits: Vec<f64> = nightly.iter().map(|l| wait(l)).collect();
    let worst_batch = batch_waits.iter().copied().fold(0.0, f64::max);
    assert!(
        worst_interactive < 350.0,
        "interactive waited up to {worst_interactive}ms"
    );
    assert!(
        worst_batch > worst_interactive + 100.0,
        "batch takes the wait: {batch_waits:?} vs interactive {interactive_waits:?}"
    );

    let text = gw.metrics().await;
    let count = |class: &str| {
        metric(
            &text,
            &format!(
                "poolpilot_pool_class_lease_wait_seconds_count{{backend=\"model-a\",class=\"{class}\"}}"
            ),
        )
    };
    assert_eq!(
        (count("interactive"), count("batch")),
        (Some(4.0), Some(9.0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_holds_at_most_its_share_of_the_connections_while_interactive_uses_them_all() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(150, Ordering::SeqCst);
    // 4 connections; batch may hold 50%: 2.
    let gw = Gw::start(prioritized(backend.addr, 4, Some(50))).await;

    let mut batch = Vec::new();
    for _ in 0..6 {
        let proxy = gw.proxy;
        batch.push(tokio::spawn(async move {
            post(proxy, "/v1/x", &[("x-api-key", "batch-key")], "{}")
                .await
                .0
        }));
    }
    tokio::time::sleep(Duration::from_millis(60)).await;
    let text = gw.metrics().await;
    let series = |name: &str, class: &str| {
        metric(
            &text,
            &format!("{name}{{backend=\"model-a\",class=\"{class}\"}}"),
        )
    };
    assert_eq!(
        series("poolpilot_pool_class_leased", "batch"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(series("poolpilot_pool_class_pending", "batch"), Some(4.0));
    assert_eq!(
        backend.seen.inflight.load(Ordering::SeqCst),
        2,
        "two connections stay free for interactive calls"
    );
    let (_, _, body) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
    let pool = &stats["backends"]["model-a"];
    assert_eq!(pool["batch_cap"], 2, "{stats}");
    assert_eq!(pool["classes"][1]["class"], "batch");
    assert_eq!(
        (&pool["classes"][1]["held"], &pool["classes"][1]["pending"]),
        (&serde_json::json!(2), &serde_json::json!(4))
    );

    // Interactive calls take the free connections at once, past the waiting batch calls.
    let (a, b) = tokio::join!(
        post(gw.proxy, "/v1/x", &[("x-api-key", "alice")], "{}"),
        post(gw.proxy, "/v1/x", &[("x-api-key", "bob")], "{}"),
    );
    assert_eq!((a.0.as_u16(), b.0.as_u16()), (200, 200));
    let lines = gw.access_lines();
    let interactive: Vec<f64> = lines
        .iter()
        .filter(|l| l["class"] == "interactive")
        .map(|l| l["lease_wait_ms"].as_f64().unwrap())
        .collect();
    assert_eq!(interactive.len(), 2, "{lines:?}");
    assert!(
        interactive.iter().all(|w| *w < 20.0),
        "interactive calls did not wait for batch: {interactive:?}"
    );
    for c in batch {
        assert_eq!(c.await.unwrap(), 200, "batch makes progress under its cap");
    }
    assert_eq!(backend.seen.max_inflight.load(Ordering::SeqCst), 4);
}
