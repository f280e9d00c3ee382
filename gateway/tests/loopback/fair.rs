//! Loopback test of token-fair queueing through the real gateway against modelsim: a client
//! sending long completions saturates a small pool and fills its queue; a client sending short
//! ones, arriving after, is served at the next free connection instead of behind the long
//! client's queued calls, and the reordered grants are counted.

use std::time::Duration;

use poolpilot_modelsim::{Config, Modelsim, ServiceTime};
use serde_json::json;

use crate::support::*;

/// A chat call asking for `max_tokens` (modelsim produces that many, 2 ms apart).
fn chat(max_tokens: u32) -> String {
    json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Summarize the pool's queueing rules."}],
        "max_tokens": max_tokens,
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_client_is_not_queued_behind_a_long_clients_completions() {
    let sim = Modelsim::start(Config {
        service: ServiceTime::fixed(Duration::from_millis(1), Duration::from_millis(2), 200),
        ..Config::default()
    })
    .await
    .expect("modelsim starts");
    // Two connections; the clients told apart by `x-api-key`, each free to queue in the pool.
    let mut doc = serde_json::to_value(limits("model-a", &[sim.addr()], 2)).unwrap();
    let overrides = [
        client_override("long", "long-key", 100),
        client_override("short", "short-key", 100),
    ];
    doc["clientPolicies"] = json!([client_policy(100, 100, "10s", &overrides)]);
    doc["backends"][0]["clientPolicy"] = "default".into();
    let gw = Gw::start(from_json(doc)).await;

    // Twelve calls of 200 tokens (≈ 400 ms each): 2 on the connections, 10 queued, six rounds.
    let long: Vec<_> = (0..12)
        .map(|_| {
            spawn_post(
                gw.proxy,
                "/v1/chat/completions",
                &[("x-api-key", "long-key")],
                &chat(200),
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let text = gw.metrics().await;
    assert_eq!(
        metric(&text, "poolpilot_pool_pending{backend=\"model-a\"}"),
        Some(10.0),
        "{text}"
    );
    // The short client's calls, one after another: each takes the next free connection.
    for _ in 0..3 {
        let (status, _, body) = post(
            gw.proxy,
            "/v1/chat/completions",
            &[("x-api-key", "short-key")],
            &chat(4),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    for c in long {
        assert_eq!(c.await.unwrap(), 200);
    }

    let lines = gw.access_lines();
    let waits = |name: &str| -> Vec<f64> {
        lines
            .iter()
            .filter(|l| l["client"] == name)
            .map(|l| l["lease_wait_ms"].as_f64().unwrap())
            .collect()
    };
    let (short, long) = (waits("short"), waits("long"));
    assert_eq!((short.len(), long.len()), (3, 12));
    let worst_short = short.iter().copied().fold(0.0, f64::max);
    eprintln!("lease waits (ms): short {short:?}, long {long:?}");
    let worst_long = long.iter().copied().fold(0.0, f64::max);
    // FIFO would put each short call behind the long calls queued before it (five rounds,
    // ≈ 2 s); fair, it waits for one long call to end at most (≈ 400 ms). Slack for a loaded
    // machine.
    assert!(
        worst_short < 900.0,
        "the short client waited up to {worst_short} ms: {short:?} (long: {long:?})"
    );
    assert!(
        worst_long > 1_500.0,
        "the long client saturated the pool: {long:?}"
    );
    let text = gw.metrics().await;
    let reordered = metric(
        &text,
        "poolpilot_pool_fair_reordered_total{backend=\"model-a\"}",
    );
    assert!(
        reordered.is_some_and(|n| n >= 3.0),
        "each short call went before older long ones: {reordered:?}"
    );
}
