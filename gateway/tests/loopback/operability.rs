//! Loopback tests of what an operator runs the gateway with: the access log (one JSON line per
//! call, successes sampled, refusals always), the request id (kept or generated, sent upstream
//! and back), `GET /v1/models` from the routes in force, the 404 of a call no model route
//! takes, `validate` (the real binary), the log level changed at run time, and draining one
//! endpoint by hand.

use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;

/// One backend `model-a` serving models `m-a` and `m-a-mini` (two routes), `model-b` serving
/// `m-b`, the first behind a client policy with an override and a concurrency of 1.
fn model_limits(a: std::net::SocketAddr, b: std::net::SocketAddr) -> poolpilot_api::GatewayLimits {
    let mut first = backend_json("model-a", &[a], 8);
    first["match"] = serde_json::json!({"model": "m-a"});
    first["clientPolicy"] = "default".into();
    let mut mini = backend_json("model-a-mini", &[a], 8);
    mini["match"] = serde_json::json!({"model": "m-a-mini"});
    let mut second = backend_json("model-b", &[b], 8);
    second["match"] = serde_json::json!({"model": "m-b"});
    from_json(serde_json::json!({
        "generation": 1,
        "listener": {"idleTimeout": "30s", "headerReadTimeout": "2s"},
        "clientPolicies": [
            client_policy(1, 0, "100ms", &[client_override("team-a", "secret-key-a", 1)]),
        ],
        "backends": [first, mini, second],
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_gets_one_access_log_line_naming_the_client_never_its_key() {
    let (a, b) = (Backend::start().await, Backend::start().await);
    let gw = Gw::start(model_limits(a.addr, b.addr)).await;

    let body = r#"{"model":"m-a","messages":[]}"#;
    let (status, headers, text) = post(
        gw.proxy,
        "/v1/chat/completions",
        &[("x-api-key", "secret-key-a"), ("x-request-id", "call-1")],
        body,
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(headers["x-request-id"], "call-1");

    // A second call of the same client while the first holds its only slot: 429.
    a.script.delay_ms.store(400, Ordering::SeqCst);
    let proxy = gw.proxy;
    let slow = tokio::spawn(async move {
        post(
            proxy,
            "/v1/chat/completions",
            &[("x-api-key", "secret-key-a")],
            body,
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (refused, refused_headers, _) = post(
        gw.proxy,
        "/v1/chat/completions",
        &[("x-api-key", "secret-key-a")],
        body,
    )
    .await;
    assert_eq!(refused, 429);
    assert_eq!(slow.await.unwrap().0, 200);
    // No route: the gateway's own 404.
    let (none, ..) = post(gw.proxy, "/v1/chat/completions", &[], r#"{"model":"nope"}"#).await;
    assert_eq!(none, 404);

    assert_eventually!(
        gw.access_lines().len() == 4,
        Duration::from_secs(5),
        "{:?}",
        gw.access_lines()
    );
    let lines = gw.access_lines();
    let raw = std::fs::read_to_string(gw.dir.path().join("access.log")).unwrap();
    assert!(
        !raw.contains("secret-key-a"),
        "the key is never logged: {raw}"
    );

    let first = lines
        .iter()
        .find(|l| l["request_id"] == "call-1")
        .expect("the first call");
    assert_eq!(first["method"], "POST");
    assert_eq!(first["path"], "/v1/chat/completions");
    assert_eq!(first["status"], 200);
    assert_eq!(first["client"], "team-a");
    assert!(first["client_id"].as_str().unwrap().starts_with("sha256:"));
    assert_eq!(first["backend"], "model-a");
    assert_eq!(first["endpoint"], "model-a-0");
    assert_eq!(first["reason"], serde_json::Value::Null);
    assert_eq!(first["complete"], true);
    assert_eq!(first["bytes_in"], body.len());
    assert_eq!(first["bytes_out"].as_u64().unwrap() as usize, text.len());
    assert!(first["lease_wait_ms"].as_f64().unwrap() >= 0.0);
    assert!(first["upstream_ms"].as_f64().unwrap() >= 0.0);
    assert!(first["duration_ms"].as_f64().unwrap() >= first["upstream_ms"].as_f64().unwrap());
    assert!(first["ts"].as_str().unwrap().ends_with('Z'));

    let slow_line = lines
        .iter()
        .find(|l| l["status"] == 200 && l["request_id"] != "call-1")
        .expect("the slow call");
    assert!(
        slow_line["duration_ms"].as_f64().unwrap() >= 400.0,
        "{slow_line}"
    );
    let rejected = lines
        .iter()
        .find(|l| l["status"] == 429)
        .expect("the refusal");
    assert_eq!(rejected["reason"], "client_concurrency");
    assert_eq!(rejected["client"], "team-a");
    assert_eq!(rejected["backend"], "model-a");
    assert_eq!(
        rejected["endpoint"],
        serde_json::Value::Null,
        "never leased"
    );
    assert_eq!(
        rejected["request_id"],
        refused_headers["x-request-id"].to_str().unwrap()
    );
    let no_route = lines.iter().find(|l| l["status"] == 404).expect("the 404");
    assert_eq!(no_route["reason"], "no_route");
    assert_eq!(no_route["backend"], serde_json::Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successes_are_sampled_and_refusals_always_logged() {
    let backend = Backend::start().await;
    let gw = Gw::start_edited(None, Duration::from_secs(5), Duration::ZERO, |config, _| {
        config.access_log.success_sample_rate = 0.0;
    })
    .await;
    gw.apply(limits("model-a", &[backend.addr], 4));
    for _ in 0..20 {
        assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    }
    backend.script.status.store(503, Ordering::SeqCst);
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 503);
    // A head the gateway refuses (too many headers would need a limit; an encoded slash is
    // refused by default).
    assert_eq!(get(gw.proxy, "/v1/a%2Fb", &[]).await.0, 400);
    assert_eventually!(
        gw.access_lines().len() == 2,
        Duration::from_secs(5),
        "{:?}",
        gw.access_lines()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let lines = gw.access_lines();
    assert_eq!(lines.len(), 2, "no success logged at rate 0: {lines:?}");
    assert_eq!(lines[0]["status"], 503);
    assert_eq!(
        lines[0]["reason"],
        serde_json::Value::Null,
        "the backend's answer"
    );
    assert_eq!(lines[1]["status"], 400);
    assert_eq!(lines[1]["reason"], "bad_request_target");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_is_kept_or_generated_and_sent_upstream_and_back() {
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;

    let (status, headers, body) =
        post(gw.proxy, "/v1/x", &[("x-request-id", "abc-123")], "{}").await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-request-id"], "abc-123");
    let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        seen["headers"]
            .as_str()
            .unwrap()
            .contains(r#""x-request-id": "abc-123""#),
        "the backend got the client's id: {seen}"
    );

    let mut ids = Vec::new();
    for given in [None, Some("has a space"), Some("")] {
        let headers: Vec<(&str, &str)> = given.map(|g| ("x-request-id", g)).into_iter().collect();
        let (status, answer, body) = post(gw.proxy, "/v1/x", &headers, "{}").await;
        assert_eq!(status, 200);
        let id = answer["x-request-id"].to_str().unwrap().to_owned();
        assert_eq!(id.len(), 32, "a generated id replaces {given:?}: {id}");
        let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(
            seen["headers"].as_str().unwrap().contains(&id),
            "the backend got the same id: {seen}"
        );
        ids.push(id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 3, "every generated id is new");

    // The gateway's own answers carry it too.
    let (status, headers, _) = get(gw.proxy, "/v1/a%2Fb", &[("x-request-id", "bad-1")]).await;
    assert_eq!(status, 400);
    assert_eq!(headers["x-request-id"], "bad-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_no_model_route_takes_is_told_what_model_the_gateway_read_from_its_body() {
    let (a, b) = (Backend::start().await, Backend::start().await);
    let gw = Gw::start(model_limits(a.addr, b.addr)).await;
    let messages = format!(
        r#""messages":[{{"role":"user","content":"{}"}}]"#,
        "x".repeat(70_000)
    );
    let cases = [
        (
            r#"{"model":"gpt-9"}"#.to_owned(),
            r#"no backend route matches the request (model "gpt-9")"#,
        ),
        (
            r#"{"model":42}"#.to_owned(),
            r#"no backend route matches the request: the body has no top-level "model" string"#,
        ),
        (
            "not json".to_owned(),
            r#"no backend route matches the request: the body has no top-level "model" string"#,
        ),
        (
            String::new(),
            r#"no backend route matches the request: the body has no top-level "model" string"#,
        ),
        // The SDKs that write `messages` first: a long prompt pushes `model` past the
        // routing buffer (64 KiB by default).
        (
            format!(r#"{{{messages},"model":"m-a"}}"#),
            r#"no backend route matches the request: the body's "model" is not within its first 65536 bytes (listener.routeBodyBytes); send "model" before long fields, or match this backend by a header too (a policy's match.headers)"#,
        ),
    ];
    for (body, expected) in &cases {
        let (status, _, text) = post(gw.proxy, "/v1/chat/completions", &[], body).await;
        assert_eq!(status, 404, "{text}");
        let error: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["code"], "no_route");
        assert_eq!(error["error"]["message"], *expected);
    }
    let long = "m".repeat(1000);
    let (_, _, text) = post(gw.proxy, "/v1/x", &[], &format!(r#"{{"model":"{long}"}}"#)).await;
    let error: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(
        error["error"]["message"].as_str().unwrap().len() < 200,
        "a long model name is cut in the message: {text}"
    );
    assert_eq!(a.seen.requests.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_models_lists_the_models_of_the_routes_in_force() {
    let (a, b) = (Backend::start().await, Backend::start().await);
    let gw = Gw::start(model_limits(a.addr, b.addr)).await;

    let (status, headers, body) = get(gw.proxy, "/v1/models", &[]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["content-type"], "application/json");
    let list: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list["object"], "list");
    let ids: Vec<(&str, &str)> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["object"], "model");
            (m["id"].as_str().unwrap(), m["owned_by"].as_str().unwrap())
        })
        .collect();
    assert_eq!(
        ids,
        [
            ("m-a", "model-a"),
            ("m-a-mini", "model-a-mini"),
            ("m-b", "model-b")
        ]
    );
    let (status, _, body) = get(gw.proxy, "/v1/models/m-b", &[]).await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["id"],
        "m-b"
    );
    let (status, _, body) = get(gw.proxy, "/v1/models/gpt-9", &[]).await;
    assert_eq!(status, 404);
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "model_not_found");
    assert_eq!(
        a.seen.requests.load(Ordering::SeqCst),
        0,
        "no backend was asked"
    );
    assert_eq!(b.seen.requests.load(Ordering::SeqCst), 0);

    // The list follows the limits in force.
    gw.apply({
        let mut doc = serde_json::to_value(model_limits(a.addr, b.addr)).unwrap();
        doc["generation"] = 2.into();
        doc["backends"].as_array_mut().unwrap().truncate(1);
        from_json(doc)
    });
    let (_, _, body) = get(gw.proxy, "/v1/models", &[]).await;
    let list: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list["data"].as_array().unwrap().len(), 1, "{list}");

    // Without model routes, the backend's own /v1/models is proxied.
    let mut plain = serde_json::to_value(limits("model-a", &[a.addr], 4)).unwrap();
    plain["generation"] = 3.into();
    gw.apply(from_json(plain));
    let (status, _, body) = get(gw.proxy, "/v1/models", &[]).await;
    assert_eq!(status, 200);
    assert!(body.contains("\"ok\":true"), "the backend answered: {body}");
    assert_eq!(a.seen.requests.load(Ordering::SeqCst), 1);
}

/// Runs the real `poolpilot-gateway validate`: (exit code, stderr).
fn validate(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_poolpilot-gateway"))
        .arg("validate")
        .args(args)
        .env_remove("POOLPILOT_GATEWAY_CONFIG")
        .output()
        .expect("the binary runs");
    (
        out.status.code().expect("an exit code"),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn validate_checks_a_configuration_like_nginx_t() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    std::fs::write(dir.path().join("token"), format!("{TEST_TOKEN}\n")).unwrap();
    let limits =
        serde_json::to_string(&limits("model-a", &["127.0.0.1:9".parse().unwrap()], 4)).unwrap();
    std::fs::write(dir.path().join("limits.yaml"), &limits).unwrap();
    let config = "listeners: {proxy: '127.0.0.1:0', admin: '127.0.0.1:0'}\nadminTokenFile: token\nlimitsFile: limits.yaml\n";
    std::fs::write(dir.path().join("gw.yaml"), config).unwrap();

    let (code, out) = validate(&["--config", &path("gw.yaml")]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!(
            "the configuration file {} syntax is ok",
            path("gw.yaml")
        )),
        "{out}"
    );
    assert!(
        out.contains("is valid (generation 1, 1 backend, 0 client policies)"),
        "{out}"
    );
    assert!(out.trim_end().ends_with("test is successful"), "{out}");

    // A limits document that breaks a rule: exit 1, the rule named.
    let mut bad: serde_json::Value = serde_json::from_str(&limits).unwrap();
    bad["backends"][0]["pool"]["maxConnectionsPerEndpoint"] = 0.into();
    std::fs::write(dir.path().join("bad.yaml"), bad.to_string()).unwrap();
    let (code, out) = validate(&["--config", &path("gw.yaml"), "--limits", &path("bad.yaml")]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[emerg]") && out.contains("maxConnectionsPerEndpoint"),
        "{out}"
    );
    assert!(out.trim_end().ends_with("test failed"), "{out}");

    // An unknown field in the configuration, a token too short, a missing limits file.
    std::fs::write(
        dir.path().join("typo.yaml"),
        format!("{config}limitFile: x\n"),
    )
    .unwrap();
    let (code, out) = validate(&["--config", &path("typo.yaml")]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("limitFile"), "{out}");
    std::fs::write(dir.path().join("token"), "short\n").unwrap();
    let (code, out) = validate(&["--config", &path("gw.yaml")]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("token"), "{out}");
    std::fs::write(dir.path().join("token"), format!("{TEST_TOKEN}\n")).unwrap();
    let (code, out) = validate(&["--config", &path("gw.yaml"), "--limits", &path("none.yaml")]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("none.yaml"), "{out}");
    // A sample rate that is not a share.
    std::fs::write(
        dir.path().join("rate.yaml"),
        format!("{config}accessLog: {{successSampleRate: 2}}\n"),
    )
    .unwrap();
    let (code, out) = validate(&["--config", &path("rate.yaml")]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("successSampleRate"), "{out}");

    // A command-line error: clap's usage error, exit 2.
    let (code, out) = validate(&[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("--config"), "{out}");
}

/// The request ids of the log-level test's calls.
const ID_PREFIX: &str = "log-level-test-";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_level_changes_at_run_time_through_the_admin_api() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gateway.log");
    let file = std::fs::File::create(&log).unwrap();
    poolpilot_gateway::observe::logging::init_with(
        poolpilot_gateway::config::LogFormat::Json,
        "info",
        move || file.try_clone().unwrap(),
        false,
    );
    let backend = Backend::start().await;
    let gw = Gw::start(limits("model-a", &[backend.addr], 4)).await;
    // The logger is the process's: the gateways of tests running beside this one log through
    // it too, so only the debug lines of this test's own calls (told by request id) count.
    let debug_lines = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.contains("request not proxied") && l.contains(ID_PREFIX))
            .count()
    };
    let refused = |n: &str| {
        let id = format!("{ID_PREFIX}{n}");
        async move {
            get(gw.proxy, "/v1/a%2Fb", &[("x-request-id", id.as_str())])
                .await
                .0
        }
    };

    let (status, body) = gw.admin_call("GET", "/v1/log-level", "").await;
    assert_eq!(status, 200);
    assert_eq!(body, r#"{"level":"info"}"#);
    assert_eq!(refused("info").await, 400);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(debug_lines(), 0, "refusals are debug lines");

    let (status, body) = gw
        .admin_call("PUT", "/v1/log-level", r#"{"level":"debug"}"#)
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, r#"{"level":"debug","previous":"info"}"#);
    assert_eq!(refused("debug").await, 400);
    assert_eventually!(
        debug_lines() == 1,
        Duration::from_secs(2),
        "the debug line appears"
    );
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .contains(&format!("{ID_PREFIX}debug")),
        "with its request id"
    );

    // RUST_LOG syntax, plain text.
    let (status, body) = gw
        .admin_call("PUT", "/v1/log-level", "info,poolpilot_gateway::pool=trace")
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(refused("trace").await, 400);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(debug_lines(), 1, "proxy debug lines are off again");

    for bad in ["", r#"{"level":"loud=="}"#, r#"{"lvl":"debug"}"#] {
        let (status, body) = gw.admin_call("PUT", "/v1/log-level", bad).await;
        assert_eq!(status, 422, "{bad:?}: {body}");
    }
    let (_, body) = gw.admin_call("GET", "/v1/log-level", "").await;
    assert_eq!(
        body, r#"{"level":"info,poolpilot_gateway::pool=trace"}"#,
        "a refusal changes nothing"
    );
    let (status, ..) = get(gw.admin, "/v1/log-level", &[]).await;
    assert_eq!(status, 401, "behind the token");

    // The logger stays installed for the rest of the test process, where it would format the
    // lines of every other test's gateway into a file already deleted: quiet, as before it.
    let (status, body) = gw
        .admin_call("PUT", "/v1/log-level", r#"{"level":"off"}"#)
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_drained_by_hand_takes_no_calls_until_restored() {
    let (one, two) = (Backend::start().await, Backend::start().await);
    let gw = Gw::start(limits("model-a", &[one.addr, two.addr], 4)).await;
    for _ in 0..10 {
        assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    }
    assert!(one.seen.requests.load(Ordering::SeqCst) > 0);
    assert!(two.seen.requests.load(Ordering::SeqCst) > 0);
    assert_eventually!(
        one.seen.connections.load(Ordering::SeqCst) > 0,
        Duration::from_secs(1),
        "an idle pooled connection to the first"
    );

    let (status, body) = gw
        .admin_call("POST", "/v1/backends/model-a/endpoints/model-a-0/drain", "")
        .await;
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["drained"], true);
    assert_eq!(answer["backend"], "model-a");
    assert_eq!(answer["idle"], 0, "its idle connections closed");
    assert_eventually!(
        one.seen.connections.load(Ordering::SeqCst) == 0,
        Duration::from_secs(2),
        "the backend saw its connections close"
    );
    let before = one.seen.requests.load(Ordering::SeqCst);
    for _ in 0..10 {
        assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    }
    assert_eq!(
        one.seen.requests.load(Ordering::SeqCst),
        before,
        "no call went to it"
    );
    let (_, _, stats) = gw.admin_get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(
        stats["backends"]["model-a"]["endpoints"][0]["drained"],
        true
    );
    assert_eq!(
        stats["backends"]["model-a"]["endpoints"][1]["drained"],
        false
    );
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains(r#"reason="drained""#),
        "closes counted by reason"
    );

    let (status, body) = gw
        .admin_call(
            "POST",
            "/v1/backends/model-a/endpoints/model-a-0/restore",
            "",
        )
        .await;
    assert_eq!(status, 200, "{body}");
    for _ in 0..10 {
        assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    }
    assert!(
        one.seen.requests.load(Ordering::SeqCst) > before,
        "it serves again"
    );

    for (method, path, want) in [
        ("POST", "/v1/backends/model-a/endpoints/nope/drain", 404),
        ("POST", "/v1/backends/nope/endpoints/model-a-0/drain", 404),
        (
            "POST",
            "/v1/backends/model-a/endpoints/model-a-0/explode",
            404,
        ),
        ("GET", "/v1/backends/model-a/endpoints/model-a-0/drain", 405),
    ] {
        assert_eq!(
            gw.admin_call(method, path, "").await.0,
            want,
            "{method} {path}"
        );
    }
    let (status, ..) = connect(gw.admin)
        .await
        .call(request(
            "POST",
            "/v1/backends/model-a/endpoints/model-a-0/drain",
            &[],
            "",
        ))
        .await;
    assert_eq!(status, 401, "behind the token");
}
