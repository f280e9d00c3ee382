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
