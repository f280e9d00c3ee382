//! Loopback tests of the admin API (limits PUT/GET, readiness, stats, the metric contract),
//! hot reload of the limits file, and routing by path, header and JSON `model`.

use std::time::Duration;

use crate::support::*;
use http::header::CONTENT_TYPE;
use http_body_util::BodyExt;

async fn put(gw: &Gw, token: Option<&str>, body: &str) -> (u16, serde_json::Value) {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(b) = &bearer {
        headers.push(("authorization", b.as_str()));
    }
    let mut client = connect(gw.admin).await;
    let (status, _, text) = client
        .call(request("PUT", "/v1/limits", &headers, body))
        .await;
    (
        status.as_u16(),
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

async fn limits_in_force(gw: &Gw) -> serde_json::Value {
    serde_json::from_str(&gw.admin_get("/v1/limits").await.2).unwrap()
}

/// A backend, a limits document of generation 3 for it (JSON, for the test to edit), and a
/// gateway started with that document as its limits file, waiting up to `await_operator` for a
/// PUT before it turns ready; the file's limits are checked to be in force.
async fn started_from_a_limits_file(await_operator: Duration) -> (Backend, serde_json::Value, Gw) {
    let backend = Backend::start().await;
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 4)).unwrap();
    doc["generation"] = 3.into();
    let file = serde_norway::to_string(&doc).unwrap();
    let gw = Gw::start_configured(Some(&file), Duration::from_secs(1), await_operator).await;
    assert_eq!(
        limits_in_force(&gw).await["generation"],
        3,
        "started from the file"
    );
    (backend, doc, gw)
}

/// How many limits files the gateway has refused (`None`: none yet).
async fn file_refusals(gw: &Gw) -> Option<f64> {
    metric(
        &gw.metrics().await,
        "poolpilot_limits_rejected_total{source=\"file\"}",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_limits_needs_the_token_and_keeps_the_old_limits_on_error() {
    let backend = Backend::start().await;
    let gw = Gw::start_with(None, Duration::from_secs(1)).await;
    // Without limits the gateway is ready (a fresh install passes `helm install --wait`) and
    // says why it cannot route; `requireLimits` asks for limits too.
    let (status, _, text) = get(gw.admin, "/readyz", &[]).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("no ConnectionPolicy selects this pod"),
        "{text}"
    );
    let (status, _, text) = get(gw.admin, "/readyz?requireLimits=true", &[]).await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("no limits loaded"), "{text}");
    assert_eq!(
        metric(&gw.metrics().await, "poolpilot_limits_loaded"),
        Some(0.0)
    );
    let (status, headers, body) = post(gw.proxy, "/v1/chat/completions", &[], "{}").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(headers["retry-after"], "5");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "no_backends", "{body}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no ConnectionPolicy selects this gateway pod"),
        "{body}"
    );
    assert_eq!(get(gw.admin, "/healthz", &[]).await.0, 200);

    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 4)).unwrap();
    doc["generation"] = 5.into();
    let body = doc.to_string();
    assert_eq!(put(&gw, None, &body).await.0, 401);
    assert_eq!(put(&gw, Some("wrong-token"), &body).await.0, 401);

    let (status, applied) = put(&gw, Some(&gw.token), &body).await;
    assert_eq!(status, 200, "{applied}");
    assert_eq!(applied["generation"], 5);
    let revision = applied["revision"].as_str().unwrap().to_owned();
    assert_eq!(revision.len(), 12);
    assert_eq!(limits_in_force(&gw).await["revision"], revision);
    assert_eq!(get(gw.admin, "/readyz", &[]).await.0, 200);
    assert_eq!(
        get(gw.admin, "/readyz?requireLimits=true", &[]).await.0,
        200
    );
    assert_eq!(
        metric(&gw.metrics().await, "poolpilot_limits_loaded"),
        Some(1.0)
    );
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);

    let mut invalid = doc.clone();
    invalid["generation"] = 6.into();
    invalid["backends"][0]["pool"]["leaseTimeout"] = "0s".into();
    let (status, error) = put(&gw, Some(&gw.token), &invalid.to_string()).await;
    assert_eq!(status, 422);
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .contains("backends[0].pool.leaseTimeout"),
        "{error}"
    );
    let (status, error) = put(&gw, Some(&gw.token), "{\"backendz\": []}").await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(
        limits_in_force(&gw).await["revision"],
        revision,
        "the old limits stay in force"
    );
    assert_eq!(limits_in_force(&gw).await["generation"], 5);

    let mut older = doc.clone();
    older["generation"] = 4.into();
    older["backends"][0]["pool"]["maxPending"] = 7.into();
    let (status, conflict) = put(&gw, Some(&gw.token), &older.to_string()).await;
    assert_eq!(status, 409, "{conflict}");
    // The body names what is in force, so the operator can render above it.
    assert!(
        conflict["error"]
            .as_str()
            .is_some_and(|e| e.contains("generation 4 is older")),
        "{conflict}"
    );
    assert_eq!(conflict["revision"], revision.as_str(), "{conflict}");
    assert_eq!(conflict["generation"], 5, "{conflict}");
    assert_eq!(conflict.as_object().map(|o| o.len()), Some(3), "{conflict}");

    let text = gw.metrics().await;
    assert_eq!(
        metric(&text, "poolpilot_limits_rejected_total{source=\"api\"}"),
        Some(3.0)
    );
    assert!(text.contains(&format!(
        "poolpilot_limits_info{{revision=\"{revision}\",generation=\"5\"}} 1"
    )));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_the_contract() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    let text = gw.metrics().await;
    // Families without samples are not written; the counters this traffic does not touch
    // (closed, timeouts, client rejections and waits) are checked by the tests that cause them.
    for (name, kind) in [
        ("poolpilot_pool_connections", "gauge"),
        ("poolpilot_pool_pending", "gauge"),
        ("poolpilot_pool_max_connections", "gauge"),
        ("poolpilot_pool_lease_wait_seconds", "histogram"),
        ("poolpilot_pool_lease_timeouts", "counter"),
        ("poolpilot_pool_connections_created", "counter"),
        ("poolpilot_pool_connections_reused", "counter"),
        ("poolpilot_upstream_request_duration_seconds", "histogram"),
        ("poolpilot_upstream_time_to_first_byte_seconds", "histogram"),
        ("poolpilot_upstream_response_bytes", "counter"),
        ("poolpilot_tokens", "counter"),
        ("poolpilot_endpoint_healthy", "gauge"),
        ("poolpilot_limits_info", "gauge"),
        ("poolpilot_limits_loaded", "gauge"),
        ("process_open_fds", "gauge"),
        ("process_max_fds", "gauge"),
    ] {
        // The classic text format (no Accept header): a counter family is named by its samples.
        let family = if kind == "counter" {
            format!("{name}_total")
        } else {
            name.to_owned()
        };
        assert!(
            text.contains(&format!("# TYPE {family} {kind}\n")),
            "missing {family} ({kind}) in\n{text}"
        );
        assert!(
            text.contains(&format!("# HELP {family} ")),
            "no help for {family} in\n{text}"
        );
    }
    assert!(text.contains("poolpilot_upstream_request_duration_seconds_count{backend=\"model-a\",code_class=\"2xx\"} 1"), "{text}");
    assert!(metric(&text, "process_open_fds").unwrap() > 5.0);
    assert!(metric(&text, "process_resident_memory_bytes").unwrap() > 1e6);
    assert!(
        metric(&text, "process_cpu_seconds_total").is_some(),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "poolpilot_build_info{{version=\"{}\",revision=\"{}\"}} 1\n",
            poolpilot_telemetry::VERSION,
            poolpilot_telemetry::REVISION
        )),
        "{text}"
    );
    let stats: serde_json::Value =
        serde_json::from_str(&gw.admin_get("/v1/stats").await.2).unwrap();
    let ep = &stats["backends"]["model-a"]["endpoints"][0];
    assert_eq!(
        (
            ep["leased"].as_u64(),
            ep["idle"].as_u64(),
            ep["max"].as_u64()
        ),
        (Some(0), Some(1), Some(4)),
        "{stats}"
    );
    assert_eq!(stats["backends"]["model-a"]["pending"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limits_file_is_loaded_at_start_and_reapplied_when_it_changes() {
    let (_backend, mut doc, gw) = started_from_a_limits_file(Duration::ZERO).await;
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    let path = gw.dir.path().join("limits.yaml");

    doc["generation"] = 4.into();
    doc["backends"][0]["pool"]["maxConnectionsPerEndpoint"] = 9.into();
    std::fs::write(&path, serde_norway::to_string(&doc).unwrap()).unwrap();
    assert_eventually!(
        limits_in_force(&gw).await["generation"] == 4,
        Duration::from_secs(2),
        "the changed file is applied"
    );
    assert_eq!(
        limits_in_force(&gw).await["backends"][0]["pool"]["maxConnectionsPerEndpoint"],
        9
    );

    std::fs::write(&path, "backends: [{name: broken}]\n").unwrap();
    assert_eventually!(
        file_refusals(&gw).await == Some(1.0),
        Duration::from_secs(2),
        "a broken file is refused"
    );
    doc["generation"] = 2.into();
    std::fs::write(&path, serde_norway::to_string(&doc).unwrap()).unwrap();
    assert_eventually!(
        file_refusals(&gw).await == Some(2.0),
        Duration::from_secs(2),
        "an older generation is refused"
    );
    assert_eq!(
        limits_in_force(&gw).await["generation"],
        4,
        "the limits in force stay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_put_the_limits_file_is_only_for_restarts() {
    // The operator writes one ConfigMap for every pod and PUTs each pod its own document (its
    // share, its rollout wave): once a PUT arrived, file changes must not override it.
    let (_backend, mut doc, gw) = started_from_a_limits_file(Duration::ZERO).await;

    doc["generation"] = 4.into();
    doc["backends"][0]["pool"]["maxConnectionsPerEndpoint"] = 6.into();
    let token = gw.token.clone();
    assert_eq!(put(&gw, Some(&token), &doc.to_string()).await.0, 200);

    let path = gw.dir.path().join("limits.yaml");
    let mut shared = doc.clone();
    shared["generation"] = 5.into();
    shared["backends"][0]["pool"]["maxConnectionsPerEndpoint"] = 7.into();
    std::fs::write(&path, serde_norway::to_string(&shared).unwrap()).unwrap();
    // Three poll intervals: the change is seen and left alone.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let in_force = limits_in_force(&gw).await;
    assert_eq!(
        (
            in_force["generation"].as_u64(),
            in_force["backends"][0]["pool"]["maxConnectionsPerEndpoint"].as_u64()
        ),
        (Some(4), Some(6)),
        "the PUT's document stays in force"
    );
    assert_eq!(file_refusals(&gw).await, None, "ignored, not refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_started_from_the_file_stays_unready_until_the_operator_sends_its_share() {
    // The ConfigMap's share was divided before this pod existed: serving from it could push a
    // backend past its budget. The operator confirming the very same document is enough.
    let (_backend, doc, gw) = started_from_a_limits_file(Duration::from_secs(60)).await;
    let (status, _, text) = get(gw.admin, "/readyz", &[]).await;
    assert_eq!(
        (status.as_u16(), text.as_str()),
        (
            503,
            "waiting for the operator to send this pod its limits\n"
        )
    );
    let token = gw.token.clone();
    assert_eq!(put(&gw, Some(&token), &doc.to_string()).await.0, 200);
    assert_eq!(get(gw.admin, "/readyz", &[]).await.0, 200);

    // Without an operator the file's limits serve alone once the wait is over.
    let alone = Gw::start_configured(
        Some(&serde_norway::to_string(&doc).unwrap()),
        Duration::from_secs(1),
        Duration::from_millis(300),
    )
    .await;
    assert_eq!(get(alone.admin, "/readyz", &[]).await.0, 503);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(get(alone.admin, "/readyz", &[]).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_by_model_header_and_path() {
    let a = Backend::start().await;
    let b = Backend::start().await;
    let c = Backend::start().await;
    let mut ba = backend_json("by-model", &[a.addr], 2);
    ba["match"] = serde_json::json!({"model": "llama-3"});
    let mut bb = backend_json("by-header", &[b.addr], 2);
    bb["match"] = serde_json::json!({"headers": {"x-model": "mistral"}});
    let mut bc = backend_json("by-path", &[c.addr], 2);
    bc["match"] = serde_json::json!({"pathPrefix": "/v1/"});
    let gw = Gw::start(from_json(serde_json::json!({
        "generation": 1,
        "listener": {"routeBodyBytes": 64},
        "backends": [ba, bb, bc],
    })))
    .await;

    let (status, _, body) = post(
        gw.proxy,
        "/v1/chat",
        &[],
        r#"{"model":"llama-3","messages":[]}"#,
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        body.contains("\"bodyBytes\":33"),
        "the buffered body reaches the backend whole: {body}"
    );
    post(
        gw.proxy,
        "/v1/chat",
        &[("x-model", "mistral")],
        r#"{"model":"other"}"#,
    )
    .await;
    post(gw.proxy, "/v1/chat", &[], r#"{"model":"other"}"#).await;
    let seen = |b: &Backend| b.seen.requests.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!((seen(&a), seen(&b), seen(&c)), (1, 1, 1));
    assert_eq!(post(gw.proxy, "/v2/none", &[], "{}").await.0, 404);

    // A body longer than routeBodyBytes routes without its model, and reaches the backend whole.
    let long = format!(r#"{{"model":"llama-3","padding":"{}"}}"#, "x".repeat(5000));
    let (status, _, body) = post(gw.proxy, "/v1/chat", &[], &long).await;
    assert_eq!(status, 200);
    assert!(
        body.contains(&format!("\"bodyBytes\":{}", long.len())),
        "{body}"
    );
    assert_eq!(
        (seen(&a), seen(&c)),
        (1, 2),
        "routed by path, not by the unread model"
    );

    // Forwarding headers reach the backend; hop-by-hop ones do not.
    let (_, _, body) = post(
        gw.proxy,
        "/v1/chat",
        &[
            ("x-forwarded-for", "10.244.0.7"),
            ("x-hop", "1"),
            ("connection", "x-hop"),
        ],
        "{}",
    )
    .await;
    assert!(
        body.contains(r#"\"x-forwarded-for\": \"10.244.0.7, 127.0.0.1\""#),
        "{body}"
    );
    assert!(body.contains(r#"\"via\": \"1.1 poolpilot\""#), "{body}");
    assert!(!body.contains("x-hop"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_served() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 2)).await;
    let stream = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    for _ in 0..3 {
        let req = http::Request::post("http://gateway.test/v1/chat")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        let response = sender.send_request(req).await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["via"], "1.1 poolpilot");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(String::from_utf8_lossy(&body).contains(r#"\"host\": \"gateway.test\""#));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_each_scraper_in_the_format_it_asks_for() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    let scrape = |accept: Option<&'static str>| async move {
        let headers: Vec<(&str, &str)> = accept.map(|a| ("accept", a)).into_iter().collect();
        get(gw.admin, "/metrics", &headers).await
    };
    // curl sends `*/*`: the classic text format, which `promtool check metrics` reads.
    for accept in [None, Some("*/*"), Some("text/plain")] {
        let (status, headers, text) = scrape(accept).await;
        assert_eq!(status, 200);
        assert_eq!(
            headers[CONTENT_TYPE], "text/plain; version=0.0.4; charset=utf-8",
            "{accept:?}"
        );
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE poolpilot_pool_connections_created_total counter\n"),
            "{text}"
        );
    }
    // Prometheus prefers OpenMetrics.
    let (_, headers, page) = scrape(Some(
        "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    ))
    .await;
    assert_eq!(
        headers[CONTENT_TYPE],
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(page.ends_with("# EOF\n"), "{page}");
    assert!(
        page.contains("# TYPE poolpilot_pool_connections_created counter\n"),
        "{page}"
    );
}

/// Sends `GET path` on a fresh connection and reads the status line, waiting at most `wait`;
/// `None` when nothing came back in time. Plain blocking IO: the test's own thread, outside
/// every runtime.
fn status_within(addr: std::net::SocketAddr, path: &str, wait: Duration) -> Option<String> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(wait)).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {TEST_TOKEN}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    Some(String::from_utf8_lossy(&head[9..12]).into_owned())
}

/// Blocks the calling thread: a saturated runtime worker, or the test's own thread waiting
/// outside every runtime.
#[allow(clippy::disallowed_methods)]
fn block_thread(for_: Duration) {
    std::thread::sleep(for_);
}

/// The kubelet's probes and Prometheus are answered while every proxy worker is busy (a pod
/// given a fraction of a core under a flood of clients): the admin listener runs on a thread
/// of its own. The other admin routes run on the gateway's runtime and answer once it is free.
#[test]
fn probes_are_answered_while_the_proxy_runtime_is_blocked() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let gw = runtime.block_on(Gw::start_with(None, Duration::from_secs(5)));
    let (admin, proxy) = (gw.admin, gw.proxy);
    assert_eq!(
        status_within(admin, "/healthz", Duration::from_secs(5)).as_deref(),
        Some("200")
    );

    let blocked = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = blocked.clone();
    runtime.spawn(async move {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        // What a saturated worker looks like from outside: it polls nothing else for 3 s.
        block_thread(Duration::from_secs(3));
    });
    while !blocked.load(std::sync::atomic::Ordering::SeqCst) {
        block_thread(Duration::from_millis(5));
    }
    let started = tokio::time::Instant::now();
    assert_eq!(
        status_within(proxy, "/v1/models", Duration::from_millis(500)),
        None,
        "the proxy's only worker is blocked (the premise of the test)"
    );
    for path in ["/healthz", "/readyz", "/metrics"] {
        let status = status_within(admin, path, Duration::from_millis(500));
        assert!(
            status.is_some(),
            "{path} not answered within 500 ms while the proxy runtime was blocked"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the probes were answered while the worker was still blocked"
    );
    // A route that may start pool tasks runs on the gateway's runtime: answered once it is free.
    assert_eq!(
        status_within(admin, "/v1/stats", Duration::from_secs(10)).as_deref(),
        Some("200")
    );
    runtime.block_on(async move { drop(gw) });
}
