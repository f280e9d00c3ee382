//! Loopback tests of the per-client limiter through the real gateway: 429 with Retry-After
//! for one client while another is unaffected, the allowlist, slow-call demotion, and the
//! client table of a client rotating its key.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;

fn with_policy(
    backend: std::net::SocketAddr,
    policy: serde_json::Value,
) -> poolpilot_api::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], 64)).unwrap();
    doc["clientPolicies"] = serde_json::json!([policy]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    from_json(doc)
}

fn policy() -> serde_json::Value {
    client_policy(
        2,
        1,
        "300ms",
        &[client_override("batch-team", "batch-key", 6)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_over_its_limit_gets_429_while_another_is_unaffected() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(500, Ordering::SeqCst);
    let gw = Gw::start(with_policy(backend.addr, policy())).await;

    let mut alice = Vec::new();
    for _ in 0..5 {
        let proxy = gw.proxy;
        alice.push(tokio::spawn(async move {
            post(proxy, "/v1/x", &[("x-api-key", "alice")], "{}").await
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let bob = post(gw.proxy, "/v1/x", &[("x-api-key", "bob")], "{}").await;
    assert_eq!(bob.0, 200, "another client is unaffected");

    let mut statuses = Vec::new();
    for a in alice {
        let (status, headers, body) = a.await.unwrap();
        if status == 429 {
            let json: serde_json::Value = serde_json::from_str(&body).unwrap();
            let reason = json["error"]["code"].as_str().unwrap().to_owned();
            assert_eq!(json["error"]["type"], "rate_limit_error");
            assert!(
                headers["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
                    >= 1
            );
            statuses.push(reason);
        } else {
            statuses.push(status.as_u16().to_string());
        }
    }
    statuses.sort();
    // 2 in flight, 1 queued (times out at 300ms, before a slot frees at 500ms), 2 refused.
    assert_eq!(
        statuses,
        [
            "200",
            "200",
            "client_concurrency",
            "client_concurrency",
            "client_queue_timeout"
        ]
    );

    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            "poolpilot_client_rejected_total{client=\"other\",reason=\"client_concurrency\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &text,
            "poolpilot_client_rejected_total{client=\"other\",reason=\"client_queue_timeout\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            "poolpilot_client_queue_wait_seconds_count{client=\"other\"}"
        ),
        Some(3.0),
        "alice ×2 and bob"
    );
    assert_eq!(
        metric(&text, "poolpilot_client_inflight{client=\"other\"}"),
        Some(0.0)
    );
    assert_eq!(
        metric(&text, "poolpilot_client_inflight{client=\"batch-team\"}"),
        Some(0.0)
    );
    assert!(
        !text.contains("alice") && !text.contains("bob"),
        "client keys never reach the metrics"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowlisted_client_gets_its_higher_limit() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(300, Ordering::SeqCst);
    let gw = Gw::start(with_policy(backend.addr, policy())).await;
    let batch: Vec<_> = (0..6)
        .map(|_| spawn_post(gw.proxy, "/v1/x", &[("x-api-key", "batch-key")], "{}"))
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats: serde_json::Value =
        serde_json::from_str(&gw.admin_get("/v1/stats").await.2).unwrap();
    assert_eq!(stats["topClients"][0]["client"], "batch-team");
    assert_eq!(stats["topClients"][0]["inflight"], 6);
    for b in batch {
        assert_eq!(
            b.await.unwrap(),
            200,
            "six concurrent calls fit the override"
        );
    }
    assert_eq!(backend.seen.max_inflight.load(Ordering::SeqCst), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_demoted_then_restored_after_the_cooldown() {
    let backend = Backend::start().await;
    let mut p = policy();
    p["maxQueue"] = 0.into();
    p["slowCalls"] = serde_json::json!({
        "threshold": "100ms", "maxRatio": 0.5, "demotedConcurrency": 1, "cooldown": "1s", "minCalls": 2
    });
    let gw = Gw::start(with_policy(backend.addr, p)).await;
    let key = [("x-api-key", "slowpoke")];

    backend.script.delay_ms.store(150, Ordering::SeqCst);
    for _ in 0..2 {
        assert_eq!(post(gw.proxy, "/v1/x", &key, "{}").await.0, 200);
    }
    // Demoted: a second concurrent call is refused, with the cooldown as Retry-After.
    backend.script.delay_ms.store(300, Ordering::SeqCst);
    let first = spawn_post(gw.proxy, "/v1/x", &key, "{}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, headers, body) = post(gw.proxy, "/v1/x", &key, "{}").await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(headers["retry-after"], "1", "the rest of the 1s cooldown");
    assert_eq!(first.await.unwrap(), 200);

    tokio::time::sleep(Duration::from_millis(1100)).await;
    backend.script.delay_ms.store(200, Ordering::SeqCst);
    let both = [
        tokio::spawn({
            let proxy = gw.proxy;
            async move { post(proxy, "/v1/x", &key, "{}").await.0 }
        }),
        tokio::spawn({
            let proxy = gw.proxy;
            async move { post(proxy, "/v1/x", &key, "{}").await.0 }
        }),
    ];
    for b in both {
        assert_eq!(
            b.await.unwrap(),
            200,
            "restored to two concurrent calls after the cooldown"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_rotating_its_key_holds_table_entries_only_for_calls_in_flight() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(400, Ordering::SeqCst);
    let mut policy = policy();
    policy["maxClients"] = 8.into();
    let gw = Gw::start(with_policy(backend.addr, policy)).await;

    // 20 new keys at once: 8 entries, each with its call in flight; the other 12 find the
    // table full of busy clients.
    let calls: Vec<_> = (0..20)
        .map(|i| {
            let key = format!("rotating-{i}");
            spawn_post(gw.proxy, "/v1/x", &[("x-api-key", &key)], "{}")
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        metric(&gw.metrics().await, "poolpilot_clients_tracked"),
        Some(8.0)
    );
    let mut statuses = Vec::new();
    for c in calls {
        statuses.push(c.await.unwrap().as_u16());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [[200; 8].as_slice(), &[503; 12]].concat());

    // Keys with nothing to remember are forgotten as their call ends: 50 more, one after the
    // other, leave the table empty and evict nobody.
    backend.script.delay_ms.store(0, Ordering::SeqCst);
    for i in 20..70 {
        let key = format!("rotating-{i}");
        assert_eq!(
            post(gw.proxy, "/v1/x", &[("x-api-key", &key)], "{}")
                .await
                .0,
            200
        );
    }
    let text = gw.metrics().await;
    assert_eq!(metric(&text, "poolpilot_clients_tracked"), Some(0.0));
    assert_eq!(metric(&text, "poolpilot_client_evictions_total"), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_clients_lists_each_policys_busiest_clients_and_a_share_raises_a_clients_limit() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(500, Ordering::SeqCst);
    // One call at a time and no queue per client, but alice's share in this pod is 3.
    let mut policy = client_policy(1, 0, "300ms", &[]);
    policy["clientShares"] = serde_json::json!([
        {"keySha256": sha256_hex("alice"), "maxConcurrency": 3, "maxQueue": 0}
    ]);
    let gw = Gw::start(with_policy(backend.addr, policy)).await;

    let started = tokio::time::Instant::now();
    let alice: Vec<_> = (0..3)
        .map(|_| spawn_post(gw.proxy, "/v1/x", &[("x-api-key", "alice")], "{}"))
        .collect();
    let bob = spawn_post(gw.proxy, "/v1/x", &[("x-api-key", "bob")], "{}");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let second_bob = post(gw.proxy, "/v1/x", &[("x-api-key", "bob")], "{}").await;
    assert_eq!(second_bob.0, 429, "bob has the policy's limit of 1");

    let (status, headers, body) = gw.admin_get("/v1/clients").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["content-type"], "application/json");
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    let policies = doc["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 1, "{doc}");
    assert_eq!(policies[0]["name"], "default");
    let clients = policies[0]["clients"].as_array().unwrap();
    assert_eq!(clients.len(), 2, "{doc}");
    let find = |key: &str| {
        clients
            .iter()
            .find(|c| c["keySha256"] == sha256_hex(key).as_str())
            .cloned()
            .unwrap_or_else(|| panic!("{key} not in {doc}"))
    };
    let (a, b) = (find("alice"), find("bob"));
    assert_eq!(
        (a["inFlight"].as_u64(), a["queued"].as_u64()),
        (Some(3), Some(0))
    );
    assert_eq!(
        (b["inFlight"].as_u64(), b["queued"].as_u64()),
        (Some(1), Some(0))
    );
    let demand = |c: &serde_json::Value| c["demand"].as_f64().unwrap();
    assert!(demand(&a) > demand(&b) && demand(&b) > 0.0, "{doc}");
    assert_eq!(
        clients[0]["keySha256"],
        sha256_hex("alice").as_str(),
        "busiest first"
    );
    for c in clients {
        let keys: Vec<&String> = c.as_object().unwrap().keys().collect();
        assert_eq!(
            keys.len(),
            6,
            "exactly keySha256, inFlight, queued, demand, inputTokensPerSecond, outputTokensPerSecond: {c}"
        );
    }
    assert!(
        !body.contains("\"alice\"") && !body.contains("\"bob\""),
        "never a raw key"
    );

    for call in alice {
        assert_eq!(
            call.await.unwrap(),
            200,
            "alice's three calls fit her share"
        );
    }
    assert_eq!(bob.await.unwrap(), 200);
    let took = started.elapsed().as_secs_f64();
    // Done, but the last 10 s remember them: each call held at least the backend's 0.5 s and
    // at most the time all of them took, over 10 s (rounded to 3 decimals).
    let doc: serde_json::Value =
        serde_json::from_str(&gw.admin_get("/v1/clients").await.2).unwrap();
    let clients = doc["policies"][0]["clients"].as_array().unwrap().clone();
    assert_eq!(clients.len(), 2, "{doc}");
    let a = clients[0]["demand"].as_f64().unwrap();
    let b = clients[1]["demand"].as_f64().unwrap();
    assert!(
        (3.0 * 0.5 / 10.0 - 0.001..=3.0 * took / 10.0 + 0.001).contains(&a),
        "alice {a} (calls took {took} s): {doc}"
    );
    assert!(
        (0.5 / 10.0 - 0.001..=took / 10.0 + 0.001).contains(&b),
        "bob {b} (calls took {took} s): {doc}"
    );
    assert_eq!(clients[0]["inFlight"], 0);

    // Like the rest of /v1/*: the token, and GET only.
    let (status, _, _) = get(gw.admin, "/v1/clients", &[]).await;
    assert_eq!(status, 401);
    assert_eq!(gw.admin_call("POST", "/v1/clients", "").await.0, 405);
}
