//! Provider credentials injected, never forwarded, against the TLS model server of
//! `upstream_tls`: the client's `Authorization` and configured headers never reach the backend,
//! the provider's key from its file does (Bearer, Azure's `api-key`), a rotated key file is used
//! from the next call on, and the key shows nowhere the gateway answers or writes: `/v1/limits`,
//! `/v1/stats`, `/metrics`, the access log, error bodies. And the provider's own back-pressure:
//! its 429 with `Retry-After` cools the backend down, calls meanwhile go to its fallback (with
//! the fallback's own key) or get 429 from the gateway with the shortest wait left, and never
//! reach the provider.

use std::time::Duration;

use crate::support::*;
use crate::upstream_tls::{Pki, TlsBackend, tls_limits};

const PROVIDER_KEY: &str = "sk-provider-7f3a9c";
const ROTATED_KEY: &str = "sk-provider-rotated-51e2";
const CLIENT_KEY: &str = "client-secret-4d8b";

/// Calls with the client's own credentials in every header a client might use.
fn client_headers() -> [(&'static str, &'static str); 3] {
    [
        ("authorization", "Bearer client-secret-4d8b"),
        ("x-api-key", CLIENT_KEY),
        ("api-key", CLIENT_KEY),
    ]
}

fn header_texts(headers: &http::HeaderMap) -> String {
    headers
        .iter()
        .map(|(k, v)| format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())))
        .collect()
}

#[tokio::test]
async fn the_client_key_never_reaches_the_backend_and_the_provider_key_is_never_shown() {
    let pki = Pki::new("provider CA");
    let backend =
        TlsBackend::start([127, 0, 0, 41], &pki.leaf("api.provider.test"), None, false).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let key_file = dir.path().join("api-key");
    std::fs::write(&key_file, format!("{PROVIDER_KEY}\n")).unwrap();
    let mut doc = serde_json::to_value(tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "api.provider.test", "caFile": ca}),
    ))
    .unwrap();
    doc["backends"][0]["credentials"] = serde_json::json!({
        "keyFile": key_file,
        "scheme": "Bearer",
        "removeHeaders": ["x-api-key", "api-key"],
    });
    // Clients are still told apart by their own key (before it is taken out).
    doc["clientPolicies"] = serde_json::json!([client_policy(10, 0, "1s", &[])]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    let gw = Gw::start(from_json(doc)).await;

    for _ in 0..3 {
        let (status, _, body) = get(gw.proxy, "/v1/chat/completions", &client_headers()).await;
        assert_eq!(status, 200, "{body}");
    }
    let requests = backend.requests();
    assert_eq!(requests.len(), 3);
    for headers in &requests {
        let text = header_texts(headers);
        assert!(
            !text.contains(CLIENT_KEY),
            "the client's key reached the backend:\n{text}"
        );
        assert_eq!(
            headers["authorization"],
            format!("Bearer {PROVIDER_KEY}").as_str()
        );
        assert!(!headers.contains_key("x-api-key") && !headers.contains_key("api-key"));
    }

    // Nothing the gateway shows or writes holds the key.
    let (_, _, limits) = gw.admin_get("/v1/limits").await;
    assert!(
        limits.contains("api-key"),
        "the document names the file: {limits}"
    );
    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let metrics = gw.metrics().await;
    let access: Vec<String> = gw.access_lines().iter().map(|l| l.to_string()).collect();
    let snapshot = format!("{:?}", gw.gateway().snapshot());
    for (what, text) in [
        ("/v1/limits", limits.as_str()),
        ("/v1/stats", stats.as_str()),
        ("/metrics", metrics.as_str()),
        ("the access log", &access.join("\n")),
        ("the snapshot's Debug", snapshot.as_str()),
    ] {
        assert!(
            !text.contains(PROVIDER_KEY),
            "{what} shows the provider key"
        );
        assert!(!text.contains(CLIENT_KEY), "{what} shows the client key");
    }

    // The Secret rotates: the next calls carry the new key, no document needed.
    std::fs::write(&key_file, ROTATED_KEY).unwrap();
    assert_eventually!(
        {
            get(gw.proxy, "/", &client_headers()).await;
            backend.requests().last().unwrap()["authorization"]
                == format!("Bearer {ROTATED_KEY}").as_str()
        },
        Duration::from_secs(5),
        "the rotated key is used"
    );
    // A key file that breaks keeps the key in force.
    std::fs::write(&key_file, "").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(get(gw.proxy, "/", &client_headers()).await.0, 200);
    assert_eq!(
        backend.requests().last().unwrap()["authorization"],
        format!("Bearer {ROTATED_KEY}").as_str()
    );
}

#[tokio::test]
async fn azure_takes_its_key_as_api_key_and_a_missing_key_file_refuses_the_document() {
    let pki = Pki::new("provider CA");
    let backend = TlsBackend::start(
        [127, 0, 0, 42],
        &pki.leaf("my-resource.openai.test"),
        None,
        false,
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let key_file = dir.path().join("azure-key");
    std::fs::write(&key_file, PROVIDER_KEY).unwrap();
    let doc_with = |key_file: &std::path::Path, generation: u64| {
        let mut doc = serde_json::to_value(tls_limits(
            backend.addr,
            serde_json::json!({"serverName": "my-resource.openai.test", "caFile": ca}),
        ))
        .unwrap();
        doc["generation"] = generation.into();
        doc["backends"][0]["credentials"] =
            serde_json::json!({"keyFile": key_file, "scheme": "AzureApiKey"});
        from_json(doc)
    };
    let gw = Gw::start(doc_with(&key_file, 1)).await;
    let (status, _, body) = get(
        gw.proxy,
        "/openai/deployments/gpt/chat/completions",
        &client_headers(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let headers = &backend.requests()[0];
    assert_eq!(headers["api-key"], PROVIDER_KEY);
    assert!(
        !headers.contains_key("authorization"),
        "{}",
        header_texts(headers)
    );

    let missing = doc_with(&dir.path().join("not-mounted"), 2);
    let (status, body) = gw.put_limits(&missing).await;
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("not-mounted"), "names the file: {body}");
    assert!(!body.contains(PROVIDER_KEY));
    assert_eq!(
        get(gw.proxy, "/", &[]).await.0,
        200,
        "the limits in force stay"
    );
}

#[tokio::test]
async fn a_providers_429_with_retry_after_cools_the_backend_down_for_that_long() {
    let pki = Pki::new("provider CA");
    let backend =
        TlsBackend::start([127, 0, 0, 43], &pki.leaf("api.provider.test"), None, false).await;
    refuses(&backend, 429, ("retry-after", "2"));
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let key_file = dir.path().join("api-key");
    std::fs::write(&key_file, PROVIDER_KEY).unwrap();
    let mut doc = serde_json::to_value(tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "api.provider.test", "caFile": ca}),
    ))
    .unwrap();
    doc["backends"][0]["credentials"] =
        serde_json::json!({"keyFile": key_file, "scheme": "Bearer"});
    let gw = Gw::start(from_json(doc)).await;

    // The provider's refusal reaches the client as it came.
    let start = tokio::time::Instant::now();
    let (status, headers, _) = get(gw.proxy, "/v1/chat/completions", &[]).await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "2");
    assert_eq!(backend.requests().len(), 1);

    // For the next 2 s no call goes to the provider: the gateway answers with what is left.
    let mut refused = 0;
    while start.elapsed() < Duration::from_millis(1800) {
        let (status, headers, body) = get(gw.proxy, "/v1/chat/completions", &[]).await;
        assert_eq!(status, 429, "{body}");
        assert!(body.contains("backend_cooling_down"), "{body}");
        let secs: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        assert!((1..=2).contains(&secs), "{secs}");
        refused += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        backend.requests().len(),
        1,
        "no call went into the known refusal"
    );
    // Then calls flow again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _, body) = get(gw.proxy, "/v1/chat/completions", &[]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(backend.requests().len(), 2);
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"poolpilot_upstream_cooldowns_total{backend="model-a"}"#
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            r#"poolpilot_upstream_cooldown_refused_total{backend="model-a"}"#
        ),
        Some(refused as f64)
    );
}

/// `model-a` falling back to `model-b`, two TLS providers on 127.0.0.`ips`, each called with
/// its own key (`PROVIDER_KEY`, `ROTATED_KEY`); `model-b` is reached only as the fallback (its
/// route needs a header no client sends).
struct Providers {
    primary: TlsBackend,
    fallback: TlsBackend,
    gw: Gw,
    _dir: tempfile::TempDir,
}

impl Providers {
    async fn start(ips: [u8; 2]) -> Self {
        let pki = Pki::new("provider CA");
        let leaf = pki.leaf("api.provider.test");
        let primary = TlsBackend::start([127, 0, 0, ips[0]], &leaf, None, false).await;
        let fallback = TlsBackend::start([127, 0, 0, ips[1]], &leaf, None, false).await;
        let dir = tempfile::tempdir().unwrap();
        let ca = pki.write_ca(dir.path(), "ca.crt");
        let tls = serde_json::json!({"serverName": "api.provider.test", "caFile": ca});
        let mut doc = serde_json::to_value(tls_limits(primary.addr, tls.clone())).unwrap();
        let mut other = backend_json("model-b", &[fallback.addr], 4);
        other["endpoints"][0]["tls"] = tls;
        other["match"] = serde_json::json!({"headers": {"x-only-as-fallback": "yes"}});
        doc["backends"].as_array_mut().unwrap().push(other);
        for (i, key) in [PROVIDER_KEY, ROTATED_KEY].into_iter().enumerate() {
            let file = dir.path().join(format!("key-{i}"));
            std::fs::write(&file, key).unwrap();
            doc["backends"][i]["credentials"] =
                serde_json::json!({"keyFile": file, "scheme": "Bearer"});
        }
        doc["backends"][0]["fallback"] = serde_json::json!(["model-b"]);
        let gw = Gw::start(from_json(doc)).await;
        Self {
            primary,
            fallback,
            gw,
            _dir: dir,
        }
    }
}

/// Makes `backend` answer its next request with `status` and one header.
fn refuses(backend: &TlsBackend, status: u16, header: (&'static str, &'static str)) {
    backend
        .seen
        .answers
        .lock()
        .push_back((status, vec![header]));
}

#[tokio::test]
async fn a_cooling_backends_calls_go_to_its_fallback_with_the_fallbacks_own_key() {
    // `_dir` holds the keys' and the CA's files for the test's length.
    let Providers {
        primary,
        fallback,
        gw,
        _dir,
    } = Providers::start([45, 46]).await;
    refuses(&primary, 429, ("retry-after", "2"));

    // Its rare events' series exist from the start, at zero: Prometheus' first sample of them
    // comes before the first event, and `increase()` sees it.
    let m = gw.metrics().await;
    for series in [
        r#"poolpilot_upstream_cooldowns_total{backend="model-a"}"#,
        r#"poolpilot_upstream_cooldown_refused_total{backend="model-a"}"#,
        r#"poolpilot_upstream_fallbacks_total{backend="model-a",to="model-b"}"#,
        r#"poolpilot_upstream_tls_failures_total{backend="model-a",reason="certificate"}"#,
    ] {
        assert_eq!(metric(&m, series), Some(0.0), "{series} in {m}");
    }

    // The refusal that starts the cooldown reaches its client as it came.
    let start = tokio::time::Instant::now();
    let (status, headers, _) = get(gw.proxy, "/v1/chat/completions", &[]).await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "2");

    // For its 2 s the calls are the fallback's, carrying the fallback's key.
    let mut served = 0;
    while start.elapsed() < Duration::from_millis(1800) {
        let (status, _, body) = get(gw.proxy, "/v1/chat/completions", &client_headers()).await;
        assert_eq!(status, 200, "{body}");
        served += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(primary.requests().len(), 1, "none into the known refusal");
    let seen = fallback.requests();
    assert_eq!(seen.len(), served);
    for h in &seen {
        assert_eq!(h["authorization"], format!("Bearer {ROTATED_KEY}"));
    }
    // Then the backend takes its calls again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _, body) = get(gw.proxy, "/v1/chat/completions", &[]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(primary.requests().len(), 2);
    assert_eq!(fallback.requests().len(), served);
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"poolpilot_upstream_fallbacks_total{backend="model-a",to="model-b"}"#
        ),
        Some(served as f64),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            r#"poolpilot_upstream_cooldown_refused_total{backend="model-a"}"#
        ),
        Some(0.0),
        "no call was refused: {m}"
    );
}

#[tokio::test]
async fn with_every_fallback_cooling_too_the_client_gets_the_shortest_wait_left() {
    // `_dir` holds the keys' and the CA's files for the test's length.
    let Providers {
        primary,
        fallback,
        gw,
        _dir,
    } = Providers::start([47, 48]).await;
    refuses(&primary, 429, ("retry-after", "30"));
    refuses(&fallback, 503, ("retry-after-ms", "4000"));

    // model-a refuses for 30 s; its fallback takes the next call and refuses it for 4 s.
    let (status, _, _) = get(gw.proxy, "/v1/chat/completions", &[]).await;
    assert_eq!(status, 429);
    let (status, headers, _) = get(gw.proxy, "/v1/chat/completions", &[]).await;
    assert_eq!(status, 503);
    assert_eq!(headers["retry-after-ms"], "4000");
    // Both cool down: refused here, told to come back when the first of them takes calls.
    let (status, headers, body) = get(gw.proxy, "/v1/chat/completions", &[]).await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("backend_cooling_down"), "{body}");
    let secs: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(
        (3..=4).contains(&secs),
        "the fallback's 4 s, not model-a's 30: {secs}"
    );
    assert_eq!(primary.requests().len(), 1);
    assert_eq!(fallback.requests().len(), 1);
}

#[tokio::test]
async fn without_a_shared_key_a_429_refuses_one_client_not_the_backend() {
    let pki = Pki::new("provider CA");
    let backend =
        TlsBackend::start([127, 0, 0, 44], &pki.leaf("api.provider.test"), None, false).await;
    refuses(&backend, 429, ("retry-after", "30"));
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.crt");
    let gw = Gw::start(tls_limits(
        backend.addr,
        serde_json::json!({"serverName": "api.provider.test", "caFile": ca}),
    ))
    .await;
    assert_eq!(get(gw.proxy, "/", &[]).await.0, 429);
    assert_eq!(
        get(gw.proxy, "/", &[]).await.0,
        200,
        "the next client's call goes through"
    );
    assert_eq!(backend.requests().len(), 2);
}
