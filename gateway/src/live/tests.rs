//! Tests of applying limits: validation, generations, in-place updates.

use std::path::Path;

use super::*;

fn example() -> GatewayLimits {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/limits.yaml");
    serde_norway::from_str(&std::fs::read_to_string(path).unwrap())
        .expect("the example limits parse")
}

#[tokio::test]
async fn the_example_applies_and_computes_its_revision() {
    let gw = Gateway::new(Metrics::new());
    assert!(
        gw.is_ready(),
        "ready before limits: it serves, 503 no_backends"
    );
    assert!(!gw.limits_loaded() && !gw.is_ready_with_limits());
    let applied = gw
        .apply(example(), LimitsSource::File)
        .expect("the example is valid");
    assert_eq!(applied.revision, example().content_revision());
    assert!(gw.is_ready() && gw.limits_loaded() && gw.is_ready_with_limits());
    assert_eq!(gw.snapshot().routes.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn waiting_for_the_operator_ends_with_its_first_put_or_the_grace() {
    let gw = Gateway::new(Metrics::new());
    gw.await_operator(Duration::from_secs(15));
    gw.apply(example(), LimitsSource::File).unwrap();
    assert!(
        gw.is_awaiting_operator() && !gw.is_ready(),
        "file limits alone"
    );
    tokio::time::advance(Duration::from_secs(14)).await;
    assert!(!gw.is_ready());
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(gw.is_ready(), "the operator is away: the file serves");

    let gw = Gateway::new(Metrics::new());
    gw.await_operator(Duration::from_secs(15));
    gw.apply(example(), LimitsSource::File).unwrap();
    gw.apply(example(), LimitsSource::Api).unwrap();
    assert!(gw.is_ready(), "the same document, confirmed by PUT");

    let gw = Gateway::new(Metrics::new());
    gw.await_operator(Duration::ZERO);
    gw.apply(example(), LimitsSource::File).unwrap();
    assert!(gw.is_ready(), "no wait configured");
}

#[tokio::test]
async fn an_invalid_document_keeps_the_old_limits() {
    let gw = Gateway::new(Metrics::new());
    let mut doc = example();
    doc.generation = 5;
    let applied = gw.apply(doc.clone(), LimitsSource::Api).unwrap();
    doc.generation = 6;
    doc.backends[0].pool.max_connections_per_endpoint = 0;
    let err = gw.apply(doc, LimitsSource::Api).unwrap_err();
    assert!(matches!(err, ApplyError::Invalid(_)), "{err}");
    assert!(
        err.to_string().contains("maxConnectionsPerEndpoint"),
        "{err}"
    );
    assert_eq!(gw.snapshot().limits.revision, applied.revision);
    assert_eq!(gw.snapshot().limits.generation, 5);
}

#[tokio::test]
async fn generations_only_move_forward() {
    let gw = Gateway::new(Metrics::new());
    let mut doc = example();
    doc.generation = 7;
    gw.apply(doc.clone(), LimitsSource::Api).unwrap();
    let same = gw
        .apply(doc.clone(), LimitsSource::File)
        .expect("re-applying the same document is fine");
    assert!(!same.changed);

    let mut older = doc.clone();
    older.generation = 6;
    assert!(matches!(
        gw.apply(older, LimitsSource::Api),
        Err(ApplyError::Stale {
            offered: 6,
            current: 7
        })
    ));

    let mut changed = doc.clone();
    changed.backends[0].pool.max_pending = 1;
    assert!(matches!(
        gw.apply(changed.clone(), LimitsSource::Api),
        Err(ApplyError::Conflict { .. })
    ));
    changed.generation = 8;
    assert!(gw.apply(changed, LimitsSource::Api).unwrap().changed);
}

#[tokio::test]
async fn hand_written_documents_apply_on_every_change() {
    let gw = Gateway::new(Metrics::new());
    let doc = example();
    assert_eq!(doc.generation, 0);
    gw.apply(doc.clone(), LimitsSource::File).unwrap();
    let mut edited = doc;
    edited.backends[0].pool.max_connections_per_endpoint = 16;
    gw.apply(edited, LimitsSource::File)
        .expect("generation 0 follows the file");
    assert_eq!(
        gw.snapshot().limits.backends[0]
            .pool
            .max_connections_per_endpoint,
        16
    );
}

#[tokio::test]
async fn pools_and_limiters_are_updated_in_place() {
    let gw = Gateway::new(Metrics::new());
    let mut doc = example();
    doc.generation = 1;
    gw.apply(doc.clone(), LimitsSource::Api).unwrap();
    let before = gw.snapshot();
    doc.generation = 2;
    doc.backends[0].pool.max_connections_per_endpoint = 3;
    gw.apply(doc.clone(), LimitsSource::Api).unwrap();
    let after = gw.snapshot();
    assert!(
        Arc::ptr_eq(&before.routes[0].backend, &after.routes[0].backend),
        "the pool is kept, resized"
    );
    assert_eq!(after.routes[0].backend.pool.stats().endpoints[0].max, 3);

    doc.generation = 3;
    doc.backends[0].name = "model-b".into();
    gw.apply(doc, LimitsSource::Api).unwrap();
    assert!(!Arc::ptr_eq(
        &before.routes[0].backend,
        &gw.snapshot().routes[0].backend
    ));
    assert!(
        matches!(
            before.routes[0].backend.pool.lease().await,
            Err(crate::pool::PoolError::Retired { .. })
        ),
        "a removed backend takes no new leases"
    );
}

#[tokio::test]
async fn metrics_follow_the_limits_in_force() {
    let gw = Gateway::new(Metrics::new());
    let mut doc = example();
    doc.generation = 4;
    let applied = gw.apply(doc, LimitsSource::Api).unwrap();
    gw.refresh_gauges();
    let text = gw.metrics().encode();
    for line in [
        format!(
            "poolpilot_limits_info{{revision=\"{}\",generation=\"4\"}} 1",
            applied.revision
        ),
        "poolpilot_pool_max_connections{backend=\"model-a\",endpoint=\"model-a-0\"} 64".into(),
        "poolpilot_pool_pending{backend=\"model-a\"} 0".into(),
        "poolpilot_endpoint_healthy{backend=\"model-a\",endpoint=\"model-a-0\"} 1".into(),
        "poolpilot_client_inflight{client=\"batch-team\"} 0".into(),
        "poolpilot_client_inflight{client=\"other\"} 0".into(),
    ] {
        assert!(text.contains(&line), "missing {line} in\n{text}");
    }
    assert!(text.contains("process_open_fds "), "{text}");
    assert!(text.contains("process_max_fds "), "{text}");
}

#[tokio::test]
async fn the_pod_wide_cap_bounds_shares_and_bursts_together() {
    // A backend listening on loopback that keeps every connection open.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepting = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let gw = Gateway::new(Metrics::new());
    let mut doc = example();
    doc.generation = 1;
    doc.listener.max_upstream_connections = Some(7);
    let backend = &mut doc.backends[0];
    backend.endpoints[0].address = addr.into();
    backend.endpoints.push(poolpilot_api::limits::Endpoint {
        name: "model-a-1".into(),
        address: addr.into(),
        tls: None,
    });
    backend.pool.max_connections_per_endpoint = 3;
    backend.pool.burst_per_endpoint = 4;
    backend.health_check = None;
    gw.apply(doc.clone(), LimitsSource::Api).unwrap();
    let pool = gw.snapshot().routes[0].backend.pool.clone();
    // Shares of 3 × 2 = 6 leave 1 of the 7: less than one per endpoint, so no burst.
    let stats = pool.stats();
    assert_eq!(stats.endpoints[0].max, 3);
    assert_eq!(stats.burst.allowance, 0);
    // 10 leave 4: 2 per endpoint.
    doc.generation = 2;
    doc.listener.max_upstream_connections = Some(10);
    gw.apply(doc.clone(), LimitsSource::Api).unwrap();
    assert_eq!(pool.stats().burst.allowance, 2);
    let mut leases = Vec::new();
    for _ in 0..10 {
        leases.push(pool.lease().await.expect("within share + burst"));
    }
    assert_eq!(leases.iter().filter(|l| l.burst()).count(), 4);
    assert!(
        matches!(
            pool.lease().await,
            Err(crate::pool::PoolError::LeaseTimeout { .. })
        ),
        "the eleventh waits: the pod-wide cap holds"
    );
    let stats: serde_json::Value = gw.stats();
    assert_eq!(stats["upstreamConnections"], 10);
    assert_eq!(
        stats["backends"]["model-a"]["burst"],
        serde_json::json!({"allowance": 2, "bursting": 4}),
        "{stats}"
    );
    gw.refresh_gauges();
    let text = gw.metrics().encode();
    for line in [
        "poolpilot_pool_burst_allowance{backend=\"model-a\"} 2",
        "poolpilot_pool_burst_connections{backend=\"model-a\"} 4",
        "poolpilot_pool_bursts_total{backend=\"model-a\"} 4",
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
    drop(leases);
    accepting.abort();
}
