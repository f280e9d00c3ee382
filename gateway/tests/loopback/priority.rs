//! Loopback tests of priority classes through the real gateway: a saturated pool serves
//! interactive calls before the batch calls that queued first, a client cannot raise itself to
//! interactive with the header the policy does not trust, batch is held to its share cap of
//! the backend's connections while interactive calls use them all, the class shows in the
//! access log and the per-class metrics, a header sent twice counts as its lowest value, and
//! bad priority rules on `PUT /v1/limits` get a 422 that names each.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;

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
    let mut nightly = client_override("nightly", "batch-key", 100);
    nightly["class"] = "batch".into();
    let mut policy = client_policy(100, 100, "10s", &[nightly]);
    policy["priority"] = priority;
    doc["clientPolicies"] = serde_json::json!([policy]);
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
    let batch: Vec<_> = (0..8)
        .map(|i| {
            let claim = if i == 7 { "interactive" } else { "batch" };
            let headers = [("x-api-key", "batch-key"), (HEADER, claim)];
            spawn_post(gw.proxy, "/v1/x", &headers, "{}")
        })
        .collect();
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
    let interactive: Vec<_> = (0..4)
        .map(|i| {
            let key = format!("user-{i}");
            spawn_post(gw.proxy, "/v1/x", &[("x-api-key", &key)], "{}")
        })
        .collect();
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

    let batch: Vec<_> = (0..6)
        .map(|_| spawn_post(gw.proxy, "/v1/x", &[("x-api-key", "batch-key")], "{}"))
        .collect();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_header_sent_twice_or_as_a_list_counts_as_its_lowest_value() {
    let backend = Backend::start().await;
    // The policy trusts the header: a proxy in front sets it. A proxy that appends its
    // `batch` after the `interactive` its client sent must still make the call batch.
    let mut doc = serde_json::to_value(prioritized(backend.addr, 2, None)).unwrap();
    doc["clientPolicies"][0]["priority"]["trustHeader"] = true.into();
    let gw = Gw::start(from_json(doc)).await;

    let cases: [(&[(&str, &str)], &str); 4] = [
        (&[(HEADER, "interactive")], "interactive"),
        (&[(HEADER, "interactive"), (HEADER, "batch")], "batch"),
        (&[(HEADER, "INTERACTIVE, batch")], "batch"),
        (
            &[(HEADER, "urgent"), (HEADER, "interactive")],
            "interactive",
        ),
    ];
    for (i, (claims, _)) in cases.iter().enumerate() {
        let key = format!("caller-{i}");
        let mut headers = vec![("x-api-key", key.as_str())];
        headers.extend_from_slice(claims);
        assert_eq!(post(gw.proxy, "/v1/x", &headers, "{}").await.0, 200);
    }
    let lines = gw.access_lines();
    let classes: Vec<&str> = lines.iter().map(|l| l["class"].as_str().unwrap()).collect();
    let expected: Vec<&str> = cases.iter().map(|(_, class)| *class).collect();
    assert_eq!(classes, expected, "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_priority_rules_on_put_limits_get_422_naming_each_field_and_the_old_limits_stay() {
    let backend = Backend::start().await;
    let gw = Gw::start(prioritized(backend.addr, 2, None)).await;
    let (_, before) = gw.admin_call("GET", "/v1/limits", "").await;
    let before: serde_json::Value = serde_json::from_str(&before).unwrap();
    assert!(before["revision"].is_string(), "{before}");

    // The pool's leaseTimeout is 5s and the policy's queueTimeout 10s: an aging bound of 10s
    // is reached by neither queue; a header name with a space and a share over 100 are nonsense.
    let mut doc = serde_json::to_value(prioritized(backend.addr, 2, Some(101))).unwrap();
    doc["generation"] = (before["generation"].as_i64().unwrap() + 1).into();
    doc["clientPolicies"][0]["priority"]["agingAfter"] = "10s".into();
    doc["clientPolicies"][0]["priority"]["header"] = "x priority".into();
    let (status, body) = gw.admin_call("PUT", "/v1/limits", &doc.to_string()).await;
    assert_eq!(status, 422, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    let message = error["error"].as_str().unwrap();
    for expected in [
        "clientPolicies[0].priority.header: \"x priority\" is not a valid header name",
        "clientPolicies[0].priority.agingAfter: 10s is not shorter than queueTimeout 10s",
        "clientPolicies[0].priority.agingAfter: 10s is not shorter than backends[0] (\"model-a\") pool.leaseTimeout 5s",
        "clientPolicies[0].priority.batchMaxPercent: must be 1 to 100",
    ] {
        assert!(
            message.contains(expected),
            "{expected:?} missing from {message}"
        );
    }
    let (_, after) = gw.admin_call("GET", "/v1/limits", "").await;
    let after: serde_json::Value = serde_json::from_str(&after).unwrap();
    assert_eq!(after["revision"], before["revision"], "the old limits stay");
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
}
