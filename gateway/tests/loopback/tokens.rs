//! Loopback tests of token budgets and token metrics: the real gateway against modelsim (which
//! reports `usage` as vLLM does) on 127.0.0.1. A call over its client's budget is refused 429
//! in OpenAI's shape, with `Retry-After`, `retry-after-ms` (the refill to the millisecond)
//! and the `x-ratelimit-*` headers, before any byte
//! reaches the backend; every admitted response carries the headers, the remaining tokens
//! falling call by call (and a `requestsPerMinute` budget its `-requests` triple, refusing
//! the call over it as `type: requests`); reservations are settled with the backend's usage (a JSON body, a
//! stream's usage chunk), with the content chunks of a stream without usage, and, for a call
//! cut by a deadline or abandoned by its client, with what was streamed; a prompt modelsim
//! serves from its prefix cache is counted as cached input, as modelsim reports it; clients
//! ranked by tokens in `/v1/clients?by=tokens`, and the top-10 gauge bounded among 1,000
//! clients; a call without `max_tokens` estimated with its backend's `defaultMaxTokens`;
//! output tokens counted by the endpoint that served them.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::BodyExt;
use poolpilot_modelsim::{Config, Faults, Modelsim, ServiceTime};
use serde_json::{Value, json};

use crate::support::*;

/// A modelsim producing at most `tokens` tokens a call, `per_token_ms` apart.
async fn modelsim(tokens: u32, per_token_ms: u64) -> Modelsim {
    Modelsim::start(Config {
        service: ServiceTime::fixed(
            Duration::from_millis(1),
            Duration::from_millis(per_token_ms),
            tokens,
        ),
        ..Config::default()
    })
    .await
    .expect("modelsim starts")
}

/// One backend on `sim` behind the client policy `default` (by `x-api-key`) with `tokens` as
/// its token budget.
fn budget_limits(sim: SocketAddr, tokens: Value) -> poolpilot_api::limits::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[sim], 8)).unwrap();
    let mut policy = client_policy(8, 0, "1s", &[]);
    policy["tokens"] = tokens;
    doc["clientPolicies"] = json!([policy]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    doc["backends"][0]["timeouts"]["streamIdle"] = "300ms".into();
    from_json(doc)
}

/// A chat call: 40 bytes of prompt (10 tokens by the gateway's estimate and modelsim's count),
/// `max_tokens`, streamed or not, asking for usage on the stream or not.
fn chat(max_tokens: u32, stream: bool, include_usage: bool) -> String {
    let mut body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "How many connections does a pool need??"}],
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if include_usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    body.to_string()
}

/// Asserts a 429 in OpenAI's error shape: `error.type` `kind`, code `rate_limit_exceeded`, a
/// message naming the bucket (`says`).
fn refused(status: http::StatusCode, body: &str, kind: &str, says: &str) {
    assert_eq!(status, 429, "{body}");
    let error: Value = serde_json::from_str(body).unwrap();
    assert_eq!(error["error"]["type"], kind, "{error}");
    assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(says)),
        "{error}"
    );
}

fn header(headers: &http::HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.parse().ok()
}

async fn call(gw: &Gw, key: &str, body: &str) -> (http::StatusCode, http::HeaderMap, String) {
    post(
        gw.proxy,
        "/v1/chat/completions",
        &[("x-api-key", key), ("content-type", "application/json")],
        body,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remaining_tokens_fall_call_by_call_and_the_call_over_budget_never_reaches_the_backend() {
    let sim = modelsim(100, 0).await;
    let gw = Gw::start(budget_limits(sim.addr(), json!({"perMinute": 400}))).await;
    let mut remaining = Vec::new();
    // Each call costs 10 prompt + 50 completion tokens: 6 fit in 400.
    for _ in 0..6 {
        let (status, headers, body) = call(&gw, "alice", &chat(50, false, false)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some(400));
        assert!(
            headers.contains_key("x-ratelimit-reset-tokens"),
            "{headers:?}"
        );
        remaining.push(header(&headers, "x-ratelimit-remaining-tokens").unwrap());
    }
    assert!(
        remaining.windows(2).all(|w| w[1] < w[0]),
        "remaining tokens {remaining:?}"
    );
    // 60 a call; the bucket refills by 400 a minute (under 7 a second) meanwhile.
    assert!((340..360).contains(&remaining[0]), "{remaining:?}");
    assert!(remaining[5] < 60, "{remaining:?}");
    let served = sim.stats().requests_received;
    assert_eq!(served, 6);

    let (status, headers, body) = call(&gw, "alice", &chat(50, false, false)).await;
    refused(status, &body, "tokens", "tokens per minute");
    let retry = header(&headers, "retry-after").expect("Retry-After");
    assert!((1..=10).contains(&retry), "{retry}");
    // The same wait to the millisecond: Retry-After is it rounded up to whole seconds.
    let retry_ms = header(&headers, "retry-after-ms").expect("retry-after-ms");
    assert!(
        retry_ms > (retry - 1) * 1000 && retry_ms <= retry * 1000,
        "retry-after-ms {retry_ms}, Retry-After {retry}"
    );
    assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some(400));
    assert!(header(&headers, "x-ratelimit-remaining-tokens").unwrap() < 60);
    assert!(headers.contains_key("x-ratelimit-reset-tokens"));
    assert_eq!(
        sim.stats().requests_received,
        served,
        "the refused call reached the backend"
    );
    // Another client has a budget of its own.
    assert_eq!(call(&gw, "bob", &chat(50, false, false)).await.0, 200);

    let text = gw.metrics().await;
    let tokens = |direction: &str, source: &str| {
        metric(
            &text,
            &format!(
                "poolpilot_tokens_total{{backend=\"model-a\",direction=\"{direction}\",source=\"{source}\"}}"
            ),
        )
    };
    assert_eq!(tokens("output", "usage"), Some(350.0), "{text}");
    assert_eq!(tokens("input", "usage"), Some(70.0), "{text}");
    assert_eq!(
        metric(
            &text,
            "poolpilot_client_rejected_total{client=\"other\",reason=\"client_tokens\"}"
        ),
        Some(1.0),
        "{text}"
    );
    // What the budgets were charged, settled: 7 calls of 60 (alice's 6, bob's 1; the refusal
    // costs nothing), the series the operator divides fleet-wide budgets by.
    assert_eq!(
        metric(
            &text,
            "poolpilot_client_tokens_total{client_policy=\"default\",client=\"other\"}"
        ),
        Some(420.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_budget_counts_calls_and_refuses_the_one_over_it_with_openais_requests_headers()
{
    let sim = modelsim(100, 0).await;
    let budget = json!({"perMinute": 100_000, "requestsPerMinute": 3});
    let gw = Gw::start(budget_limits(sim.addr(), budget)).await;
    let mut remaining = Vec::new();
    for _ in 0..3 {
        let (status, headers, body) = call(&gw, "alice", &chat(5, false, false)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some(3));
        assert!(
            headers.contains_key("x-ratelimit-reset-requests"),
            "{headers:?}"
        );
        remaining.push(header(&headers, "x-ratelimit-remaining-requests").unwrap());
        // The token headers stay beside them.
        assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some(100_000));
    }
    // The bucket refills 3 a minute (one every 20 s): nothing comes back within the test.
    assert_eq!(remaining, [2, 1, 0]);
    assert_eq!(sim.stats().requests_received, 3);

    let (status, headers, body) = call(&gw, "alice", &chat(5, false, false)).await;
    refused(status, &body, "requests", "requests per minute");
    // A call a 20 s refill away: Retry-After says so (rounded up), and the headers agree.
    let retry = header(&headers, "retry-after").expect("Retry-After");
    assert!((15..=21).contains(&retry), "Retry-After {retry}");
    assert_eq!(header(&headers, "x-ratelimit-remaining-requests"), Some(0));
    assert_eq!(
        sim.stats().requests_received,
        3,
        "the refused call reached the backend"
    );
    assert_eq!(
        metric(
            &gw.metrics().await,
            "poolpilot_client_rejected_total{client=\"other\",reason=\"client_tokens\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_are_settled_with_the_backends_usage_streamed_or_not() {
    // modelsim produces 10 tokens whatever `max_tokens` asks: the estimate (10 + 200) is far
    // above what the calls use (10 + 10).
    let sim = modelsim(10, 1).await;
    let gw = Gw::start(budget_limits(sim.addr(), json!({"perMinute": 1200}))).await;
    for (what, stream, include_usage) in [
        ("json", false, false),
        ("stream with usage", true, true),
        ("stream without usage", true, false),
    ] {
        let key = format!("client-{what}");
        let (status, headers, body) = call(&gw, &key, &chat(200, stream, include_usage)).await;
        assert_eq!(status, 200, "{what}: {body}");
        let first = header(&headers, "x-ratelimit-remaining-tokens").unwrap();
        // 1200 − (10 + 200), the bucket full before.
        assert_eq!(first, 990, "{what}");
        let (_, headers, _) = call(&gw, &key, &chat(200, stream, include_usage)).await;
        let second = header(&headers, "x-ratelimit-remaining-tokens").unwrap();
        // Settled at 20 (not the 210 reserved): 1200 − 20 − 210, and the refill meanwhile (20
        // tokens a second); unsettled it would be 780.
        assert!(
            (970..990).contains(&second),
            "{what}: {first} then {second}"
        );
    }
    let text = gw.metrics().await;
    let series = |direction: &str, source: &str| {
        metric(
            &text,
            &format!(
                "poolpilot_tokens_total{{backend=\"model-a\",direction=\"{direction}\",source=\"{source}\"}}"
            ),
        )
    };
    assert_eq!(series("output", "usage"), Some(40.0), "{text}");
    assert_eq!(series("output", "chunks"), Some(20.0), "{text}");
    assert_eq!(series("input", "estimate"), Some(20.0), "{text}");
    assert!(
        metric(
            &text,
            "poolpilot_time_to_first_token_seconds_count{backend=\"model-a\"}"
        )
        .is_some_and(|n| n == 4.0),
        "{text}"
    );
    assert!(
        metric(
            &text,
            "poolpilot_time_per_output_token_seconds_count{backend=\"model-a\"}"
        )
        .is_some_and(|n| n == 4.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_or_abandoned_call_is_settled_with_what_was_streamed() {
    let sim = modelsim(1000, 5).await;
    let gw = Gw::start(budget_limits(sim.addr(), json!({"perMinute": 1200}))).await;
    // The stream stops after 3 tokens and hangs: streamIdle (300 ms) cuts it.
    sim.set_faults(Faults {
        stall_ratio: 1.0,
        stall_after_tokens: Some(3),
        ..Faults::default()
    })
    .unwrap();
    let (status, headers, _) = call(&gw, "carol", &chat(100, true, true)).await;
    assert_eq!(status, 200);
    // 1200 − (10 + 100).
    let first = header(&headers, "x-ratelimit-remaining-tokens").unwrap();
    assert_eq!(first, 1090);
    sim.set_faults(Faults::default()).unwrap();
    let (_, headers, _) = call(&gw, "carol", &chat(100, false, false)).await;
    let second = header(&headers, "x-ratelimit-remaining-tokens").unwrap();
    // Settled at 10 + 3: 1200 − 13 − 110, and the refill meanwhile (20 tokens a second);
    // unsettled it would be 980.
    assert!((1077..1100).contains(&second), "{first} then {second}");

    // A client that goes away after the first chunks: settled with those.
    let mut conn = connect(gw.proxy).await;
    let response = conn
        .send(request(
            "POST",
            "/v1/chat/completions",
            &[("x-api-key", "dave"), ("content-type", "application/json")],
            &chat(1000, true, false),
        ))
        .await
        .unwrap();
    let mut body = response.into_body();
    let mut seen = 0;
    while seen < 3 {
        let frame = body.frame().await.unwrap().unwrap();
        if let Ok(data) = frame.into_data() {
            seen += String::from_utf8_lossy(&data)
                .matches("\"content\"")
                .count();
        }
    }
    drop(body);
    drop(conn);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, headers, _) = call(&gw, "dave", &chat(10, false, false)).await;
    let after = header(&headers, "x-ratelimit-remaining-tokens").unwrap();
    // Settled with what was streamed by the time the gateway saw the client go (a few chunks
    // more than the 3 read, 5 ms apart), not the 1010 reserved: unsettled it would be under 200.
    assert!(after > 900, "{after}");
    let text = gw.metrics().await;
    assert!(
        metric(
            &text,
            "poolpilot_tokens_total{backend=\"model-a\",direction=\"output\",source=\"chunks\"}"
        )
        .is_some_and(|n| n >= 6.0),
        "3 chunks of the cut call, at least 3 of the abandoned one: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_served_from_the_backends_prefix_cache_is_counted_as_cached_input() {
    let sim = modelsim(4, 0).await;
    let gw = Gw::start(budget_limits(sim.addr(), json!({"perMinute": 1_000_000}))).await;
    // A 2,000-character system prompt (500 tokens, 31 full blocks of modelsim's 16 tokens)
    // and a question: 505 prompt tokens.
    let system = "Answer in one line, citing the pool's settings. ".repeat(42)[..2000].to_owned();
    let body = |question: &str, stream: bool| {
        let mut body = json!({
            "model": "sim-model",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 4,
            "stream": stream,
        });
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body.to_string()
    };
    let series = |text: &str, direction: &str| {
        metric(
            text,
            &format!(
                "poolpilot_tokens_total{{backend=\"model-a\",direction=\"{direction}\",source=\"usage\"}}"
            ),
        )
    };

    let (status, _, cold) = call(&gw, "alice", &body("How long is a lease?", false)).await;
    assert_eq!(status, 200, "{cold}");
    let cold: Value = serde_json::from_str(&cold).unwrap();
    assert_eq!(cold["usage"]["prompt_tokens"], 505);
    assert_eq!(cold["usage"].get("prompt_tokens_details"), None, "{cold}");
    let text = gw.metrics().await;
    assert_eq!(series(&text, "input"), Some(505.0), "{text}");
    assert_eq!(series(&text, "cached_input"), None, "nothing cached yet");

    // The same prompt again: modelsim serves its system prompt's 31 blocks from its cache and
    // says so; the gateway counts what it said.
    let (status, _, warm) = call(&gw, "alice", &body("How long is a lease?", false)).await;
    assert_eq!(status, 200, "{warm}");
    let warm: Value = serde_json::from_str(&warm).unwrap();
    let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached tokens reported");
    assert_eq!(cached, 31 * u64::from(poolpilot_modelsim::BLOCK_TOKENS));
    let text = gw.metrics().await;
    assert_eq!(series(&text, "input"), Some(1010.0), "{text}");
    assert_eq!(series(&text, "cached_input"), Some(cached as f64), "{text}");

    // A stream with usage: its last chunk says it too.
    let (status, _, streamed) = call(&gw, "alice", &body("And an idle one?", true)).await;
    assert_eq!(status, 200, "{streamed}");
    let text = gw.metrics().await;
    assert_eq!(
        series(&text, "cached_input"),
        Some(2.0 * cached as f64),
        "{text}"
    );
    assert_eq!(series(&text, "input"), Some(1010.0 + 504.0), "{text}");
    assert_eq!(sim.stats().prefix_cache_hits, 2 * cached);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_are_ranked_by_tokens_and_the_top_tokens_gauge_names_ten_of_a_thousand() {
    let sim = modelsim(100, 0).await;
    let gw = Gw::start(budget_limits(sim.addr(), json!({"perMinute": 100_000_000}))).await;
    // 988 light clients (10 prompt + 1 output tokens a call) and 12 heavy ones (10 + 20 + 5k):
    // 1,000 distinct clients, 16 calls at a time.
    let mut calls: Vec<(String, u32)> = (0..988).map(|i| (format!("light-{i}"), 1)).collect();
    calls.extend((0..12).map(|k| (format!("heavy-{k}"), 20 + 5 * k)));
    let total_tokens: u32 = calls.iter().map(|(_, out)| 10 + out).sum();
    let started = tokio::time::Instant::now();
    let gw = std::sync::Arc::new(gw);
    let mut pending = calls.into_iter();
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        while tasks.len() < 16 {
            let Some((key, out)) = pending.next() else {
                break;
            };
            let gw = gw.clone();
            tasks.spawn(async move { call(&gw, &key, &chat(out, false, false)).await.0 });
        }
        let Some(status) = tasks.join_next().await else {
            break;
        };
        assert_eq!(status.unwrap(), 200);
    }
    let took = started.elapsed();
    // Every call is within the 10 s window when the rates are read.
    assert!(took < Duration::from_secs(8), "1,000 calls took {took:?}");

    let (status, _, body) = gw.admin_get("/v1/clients?by=tokens").await;
    assert_eq!(status, 200, "{body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    let clients = doc["policies"][0]["clients"].as_array().unwrap();
    assert_eq!(clients.len(), 32, "at most 32 listed");
    let rate = |c: &Value| {
        c["inputTokensPerSecond"].as_f64().unwrap() + c["outputTokensPerSecond"].as_f64().unwrap()
    };
    assert!(
        clients.windows(2).all(|w| rate(&w[0]) >= rate(&w[1])),
        "most tokens first: {doc}"
    );
    // The heaviest: 10 + 75 tokens over the 10 s window.
    assert_eq!(clients[0]["keySha256"], sha256_hex("heavy-11").as_str());
    assert_eq!(clients[0]["inputTokensPerSecond"].as_f64(), Some(1.0));
    assert_eq!(clients[0]["outputTokensPerSecond"].as_f64(), Some(7.5));
    let heavy: Vec<String> = (0..12).map(|k| sha256_hex(&format!("heavy-{k}"))).collect();
    assert!(
        clients[..12]
            .iter()
            .all(|c| heavy.iter().any(|h| c["keySha256"] == h.as_str())),
        "the 12 heavy clients first"
    );
    let (status, _, _) = gw.admin_get("/v1/clients?by=bytes").await;
    assert_eq!(status, 400, "an unknown ranking is refused");
    // By demand (the default): every client held one call for about as long.
    let (_, _, by_demand) = gw.admin_get("/v1/clients").await;
    let by_demand: Value = serde_json::from_str(&by_demand).unwrap();
    assert_eq!(
        by_demand["policies"][0]["clients"].as_array().map(Vec::len),
        Some(32)
    );

    // The gauge: 10 clients and `other`, two directions each, out of 1,000 clients.
    let text = gw.metrics().await;
    let series: Vec<(&str, f64)> = text
        .lines()
        .filter(|l| l.starts_with("poolpilot_client_top_tokens_per_second{"))
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').unwrap();
            (name, value.parse().unwrap())
        })
        .collect();
    assert_eq!(series.len(), 22, "{text}");
    let top = |client: &str, direction: &str| {
        metric(
            &text,
            &format!(
                "poolpilot_client_top_tokens_per_second{{client_policy=\"default\",client=\"{client}\",direction=\"{direction}\"}}"
            ),
        )
    };
    // Named by the short hash of the key's digest: sha256: and 12 hex digits.
    let short = format!("sha256:{}", &sha256_hex("heavy-11")[..12]);
    assert_eq!(top(&short, "output"), Some(7.5), "{text}");
    assert_eq!(top(&short, "input"), Some(1.0), "{text}");
    let light = format!("sha256:{}", &sha256_hex("light-0")[..12]);
    assert_eq!(
        top(&light, "input"),
        None,
        "a light client is folded into other"
    );
    // The rest: 988 light calls and the two lightest heavy ones (20 and 25 output tokens).
    let other_output = top("other", "output").unwrap();
    assert!(
        (other_output - (988.0 + 45.0) / 10.0).abs() < 1e-6,
        "{other_output}"
    );
    let sum: f64 = series.iter().map(|(_, v)| v).sum();
    assert!(
        (sum * 10.0 - f64::from(total_tokens)).abs() < 1e-3,
        "every token of every client is in one series: {sum} × 10 s against {total_tokens}"
    );
}

/// A chat call without `max_tokens` or `max_completion_tokens`: 40 bytes of prompt (10 tokens).
fn chat_without_max_tokens() -> String {
    json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "How many connections does a pool need??"}],
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_max_tokens_reserves_its_backends_default_over_its_budgets() {
    // 4 tokens, 100 ms apart: a call holds its reservation for 400 ms.
    let sim = modelsim(4, 100).await;
    let budget = json!({"perMinute": 1000, "defaultMaxTokens": 100});
    let mut doc = budget_limits(sim.addr(), budget.clone());
    doc.backends[0].default_max_tokens = Some(600);
    let gw = std::sync::Arc::new(Gw::start(doc).await);

    // 10 + 600 reserved, not the budget's 10 + 100: 390 of 1,000 left.
    let first = {
        let gw = gw.clone();
        tokio::spawn(async move { call(&gw, "alice", &chat_without_max_tokens()).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Another call without max_tokens would reserve 610 again: refused, before the backend.
    let received = sim.stats().requests_received;
    let (status, headers, body) = call(&gw, "alice", &chat_without_max_tokens()).await;
    refused(status, &body, "tokens", "requested 610");
    let remaining = header(&headers, "x-ratelimit-remaining-tokens").unwrap();
    assert!((390..400).contains(&remaining), "{remaining}");
    assert_eq!(sim.stats().requests_received, received);
    // A call that says max_tokens is estimated with its own: 10 + 100 fits.
    let (status, _, body) = call(&gw, "alice", &chat(100, false, false)).await;
    assert_eq!(status, 200, "{body}");
    let (status, headers, body) = first.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&headers, "x-ratelimit-remaining-tokens"), Some(390));

    // Without the backend's default, the budget's: the same two calls both fit (110 each).
    let mut without = budget_limits(sim.addr(), budget);
    without.generation += 1;
    gw.apply(without);
    let second = {
        let gw = gw.clone();
        tokio::spawn(async move { call(&gw, "bob", &chat_without_max_tokens()).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (status, headers, body) = call(&gw, "bob", &chat_without_max_tokens()).await;
    assert_eq!(status, 200, "{body}");
    let remaining = header(&headers, "x-ratelimit-remaining-tokens").unwrap();
    assert!(
        (780..790).contains(&remaining),
        "1000 − 2 × 110: {remaining}"
    );
    assert_eq!(second.await.unwrap().0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_tokens_are_counted_by_the_endpoint_that_served_them() {
    // Two instances of one backend, one producing 10 tokens a call and the other 30.
    let (ten, thirty) = (modelsim(10, 0).await, modelsim(30, 0).await);
    let gw = Gw::start(limits("model-a", &[ten.addr(), thirty.addr()], 8)).await;
    for _ in 0..12 {
        let (status, _, body) = post(
            gw.proxy,
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            &chat(100, false, false),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let (served_ten, served_thirty) = (
        ten.stats().requests_received,
        thirty.stats().requests_received,
    );
    assert_eq!(served_ten + served_thirty, 12);
    let text = gw.metrics().await;
    let endpoint = |name: &str| {
        metric(
            &text,
            &format!(
                "poolpilot_endpoint_output_tokens_total{{backend=\"model-a\",endpoint=\"{name}\"}}"
            ),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(endpoint("model-a-0"), 10.0 * served_ten as f64, "{text}");
    assert_eq!(endpoint("model-a-1"), 30.0 * served_thirty as f64, "{text}");
    assert_eq!(
        metric(
            &text,
            "poolpilot_tokens_total{backend=\"model-a\",direction=\"output\",source=\"usage\"}"
        ),
        Some(endpoint("model-a-0") + endpoint("model-a-1")),
        "the endpoints' counts add up to the backend's: {text}"
    );
}
