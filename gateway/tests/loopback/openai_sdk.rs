//! The official OpenAI Python SDK against the gateway over loopback: a burst of calls from one
//! client, more than its connection cap, gets 429s with `Retry-After` that the SDK honours and
//! retries, never an `APIConnectionError`; the SDK parses the gateway's error bodies; and a
//! client with a token budget reads `x-ratelimit-remaining-tokens` falling call by call, gets
//! OpenAI's own 429 once over it, and its retry waits out `retry-after-ms` (which the SDK reads
//! before `Retry-After`: the refill to the millisecond, not rounded up to a second), comes back
//! on time by the gateway's own count, and succeeds.
//!
//! Needs a Python with the `openai` package: `POOLPILOT_PYTHON` names it (`make sdk` installs
//! one in a virtualenv of the cache, and `make unit` runs this test with it). Ignored without.

use std::process::Command;
use std::sync::atomic::Ordering;

use crate::support::*;

/// A burst of `calls` chat calls at once from one `AsyncOpenAI` client (3 retries), printing
/// the outcomes as JSON: `ok`, `429` (a RateLimitError after its retries), `connection_error`,
/// or another status; and one call to a model no route takes, printing its parsed error.
const BURST: &str = r#"
import asyncio, json, sys, openai

async def main(base, calls):
    client = openai.AsyncOpenAI(base_url=base, api_key="sk-burst", max_retries=3, timeout=30,
                                default_headers={"x-route": "model"})
    async def one():
        try:
            await client.chat.completions.with_raw_response.create(
                model="model-a", messages=[{"role": "user", "content": "hi"}])
            return "ok"
        except openai.RateLimitError:
            return "429"
        except openai.APIConnectionError:
            return "connection_error"
        except openai.APIStatusError as e:
            return str(e.status_code)
    outcomes = await asyncio.gather(*(one() for _ in range(calls)))
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    try:
        await client.with_options(max_retries=0).chat.completions.create(
            model="model-a", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-route": "none"})
        error = None
    except openai.APIStatusError as e:
        error = {"status": e.status_code, "code": e.code, "type": e.type}
    print(json.dumps({"outcomes": counts, "error": error}))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenAI Python SDK: POOLPILOT_PYTHON (make sdk)"]
async fn a_burst_from_the_openai_sdk_gets_429s_it_honours_not_connection_errors() {
    let python =
        std::env::var("POOLPILOT_PYTHON").expect("POOLPILOT_PYTHON names a Python with openai");
    let backend = Backend::start().await;
    backend.script.delay_ms.store(300, Ordering::SeqCst);
    let mut doc = serde_json::to_value(limits("model-a", &[backend.addr], 64)).unwrap();
    doc["listener"]["maxConnectionsPerClient"] = 16.into();
    // Only requests with `x-route: model` have a route: the SDK's parsing of the gateway's
    // errors is checked on the 404 of one without.
    doc["backends"][0]["match"] =
        serde_json::json!({"pathPrefix": "/v1/", "headers": {"x-route": "model"}});
    let gw = Gw::start(from_json(doc)).await;
    let base = format!("http://{}/v1", gw.proxy);
    let calls = 200;
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-c", BURST, &base, &calls.to_string()])
            .output()
            .expect("python runs")
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    println!("{report}");
    let outcomes = &report["outcomes"];
    assert_eq!(
        outcomes["connection_error"].as_u64(),
        None,
        "no call saw a connection error: {report}"
    );
    let ok = outcomes["ok"].as_u64().unwrap_or(0);
    let limited = outcomes["429"].as_u64().unwrap_or(0);
    assert_eq!(
        ok + limited,
        calls,
        "every call ended ok or rate limited: {report}"
    );
    assert!(
        ok > 16,
        "retries after Retry-After got calls through: {report}"
    );
    let text = gw.metrics().await;
    let answered = metric(
        &text,
        "poolpilot_downstream_connections_rejected_total{outcome=\"answered\"}",
    )
    .unwrap_or(0.0);
    assert!(answered > 0.0, "the burst went over the cap: {report}");
    assert!(
        backend.seen.max_connections.load(Ordering::SeqCst) <= 64,
        "the pool cap held"
    );
    assert_eq!(
        report["error"],
        serde_json::json!({"status": 404, "code": "no_route", "type": "invalid_request_error"}),
        "the SDK reads the gateway's error"
    );
}

/// One `OpenAI` client (no retries) calling until its token budget refuses it, printing the
/// `x-ratelimit-remaining-tokens` of each answer and what the refusal said; then the same call
/// with 3 retries, printing how long it took and how many retries the SDK made.
const BUDGET: &str = r#"
import json, sys, time, openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="sk-tokens", max_retries=0, timeout=30)
call = dict(model="sim-model", max_tokens=50,
            messages=[{"role": "user", "content": "How many connections does a pool need??"}])
remaining, refused = [], None
for _ in range(20):
    try:
        raw = client.chat.completions.with_raw_response.create(**call)
        remaining.append(int(raw.headers["x-ratelimit-remaining-tokens"]))
        raw.parse()
    except openai.RateLimitError as e:
        h = e.response.headers
        refused = {"status": e.status_code, "type": e.type, "code": e.code,
                   "retry_after": h.get("retry-after"),
                   "retry_after_ms": h.get("retry-after-ms"),
                   "reset": h.get("x-ratelimit-reset-tokens"),
                   "limit": h.get("x-ratelimit-limit-tokens")}
        break
start = time.monotonic()
raw = client.with_options(max_retries=3).chat.completions.with_raw_response.create(**call)
raw.parse()
print(json.dumps({"remaining": remaining, "refused": refused, "status": raw.status_code,
                  "retries": raw.retries_taken, "waited": time.monotonic() - start}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenAI Python SDK: POOLPILOT_PYTHON (make sdk)"]
async fn the_openai_sdk_sees_its_remaining_tokens_fall_and_waits_out_a_token_refusal() {
    let python =
        std::env::var("POOLPILOT_PYTHON").expect("POOLPILOT_PYTHON names a Python with openai");
    let sim = poolpilot_modelsim::Modelsim::start(poolpilot_modelsim::Config {
        service: poolpilot_modelsim::ServiceTime::fixed(
            std::time::Duration::from_millis(1),
            std::time::Duration::ZERO,
            100,
        ),
        ..poolpilot_modelsim::Config::default()
    })
    .await
    .expect("modelsim starts");
    let mut doc = serde_json::to_value(limits("model-a", &[sim.addr()], 8)).unwrap();
    let mut policy = client_policy(8, 0, "1s", &[]);
    policy["identity"] = serde_json::json!({"header": "authorization"});
    // 400 tokens a minute: six calls of 60 (10 prompt, 50 completion), then a refusal.
    policy["tokens"] = serde_json::json!({"perMinute": 400});
    doc["clientPolicies"] = serde_json::json!([policy]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    let gw = Gw::start(from_json(doc)).await;
    let base = format!("http://{}/v1", gw.proxy);
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-c", BUDGET, &base])
            .output()
            .expect("python runs")
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    println!("{report}");
    let remaining: Vec<u64> = report["remaining"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(remaining.len(), 6, "{report}");
    assert!(
        remaining.windows(2).all(|w| w[1] < w[0]),
        "x-ratelimit-remaining-tokens falls call by call: {report}"
    );
    let refused = &report["refused"];
    assert_eq!(refused["status"], 429, "{report}");
    assert_eq!(refused["type"], "tokens", "{report}");
    assert_eq!(refused["code"], "rate_limit_exceeded", "{report}");
    assert_eq!(refused["limit"], "400", "{report}");
    assert!(
        refused["reset"].as_str().is_some_and(|r| r.ends_with('s')),
        "{report}"
    );
    let retry_after: f64 = refused["retry_after"].as_str().unwrap().parse().unwrap();
    let retry_after_ms: f64 = refused["retry_after_ms"].as_str().unwrap().parse().unwrap();
    assert!(
        retry_after_ms > (retry_after - 1.0) * 1000.0 && retry_after_ms <= retry_after * 1000.0,
        "retry-after-ms is Retry-After to the millisecond: {report}"
    );
    assert_eq!(
        report["status"], 200,
        "the SDK's retry got through: {report}"
    );
    assert!(report["retries"].as_u64().unwrap() >= 1, "{report}");
    assert!(
        report["waited"].as_f64().unwrap() >= retry_after_ms / 1000.0 - 0.1,
        "the SDK waited out retry-after-ms: {report}"
    );
    // The gateway remembers the refusal by retry-after-ms too: every retry the SDK made after
    // waiting it out was on time (its first attempt, sent at once, was early).
    let text = gw.metrics().await;
    let retries = |timing: &str| {
        metric(
            &text,
            &format!("poolpilot_client_retries_total{{client=\"other\",timing=\"{timing}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(
        retries("on_time"),
        report["retries"].as_f64().unwrap(),
        "{report}: {text}"
    );
    assert_eq!(
        sim.stats().requests_received,
        7,
        "no refused call reached modelsim"
    );
}
