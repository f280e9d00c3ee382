//! The official OpenAI Python SDK against the gateway over loopback: a burst of calls from one
//! client, more than its connection cap, gets 429s with `Retry-After` that the SDK honours and
//! retries, never an `APIConnectionError`; the SDK parses the gateway's error bodies.
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
