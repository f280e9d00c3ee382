//! The pool's soft throttle through the real gateway: lease requests that find others waiting
//! are delayed `min(max, pending × perPending)` before joining them; and (ignored, run by hand
//! for BENCHMARKS.md) the plain queue and the soft throttle side by side under the same load.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use tokio::time::Instant;

fn throttled_limits(
    backend: std::net::SocketAddr,
    cap: u32,
    throttle: Option<(&str, &str)>,
    lease_timeout: &str,
) -> poolpilot_api::GatewayLimits {
    let mut doc = serde_json::to_value(limits("model-a", &[backend], cap)).unwrap();
    doc["backends"][0]["pool"]["leaseTimeout"] = lease_timeout.into();
    if let Some((per_pending, max)) = throttle {
        doc["backends"][0]["pool"]["softThrottle"] =
            serde_json::json!({"perPending": per_pending, "max": max});
    }
    from_json(doc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_requests_that_find_others_waiting_are_delayed_a_bounded_time() {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(200, Ordering::SeqCst);
    let gw = Gw::start(throttled_limits(
        backend.addr,
        1,
        Some(("5ms", "15ms")),
        "5s",
    ))
    .await;

    // Alone: no delay.
    assert_eq!(post(gw.proxy, "/v1/x", &[], "{}").await.0, 200);
    let text = gw.metrics().await;
    assert_eq!(
        metric(
            &text,
            r#"poolpilot_pool_soft_throttled_total{backend="model-a"}"#
        ),
        None
    );

    // One call holds the only connection; six more arrive one after another, each finding the
    // ones before it waiting.
    let mut calls = Vec::new();
    for _ in 0..7 {
        let proxy = gw.proxy;
        calls.push(tokio::spawn(async move {
            post(proxy, "/v1/x", &[], "{}").await.0
        }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    let text = gw.metrics().await;
    let throttled = metric(
        &text,
        r#"poolpilot_pool_soft_throttled_total{backend="model-a"}"#,
    )
    .expect("some lease requests were delayed");
    assert!((5.0..=6.0).contains(&throttled), "{text}");
    let delay = metric(
        &text,
        r#"poolpilot_pool_soft_throttle_delay_seconds_total{backend="model-a"}"#,
    )
    .unwrap();
    // 5, 10, 15, 15, 15 (ms) for 1..5 waiting: never above the max each.
    assert!(delay <= throttled * 0.015 + 1e-9, "{delay}");
    assert!(delay >= 0.005 * throttled, "{delay}");
}

/// One closed-loop run: `clients` callers each sending calls back to back for `run`.
/// Returns (completed/s, latency p50 ms, latency p99 ms, errors, lease wait p99 bucket ms).
async fn run_load(
    throttle: Option<(&str, &str)>,
    clients: usize,
    run: Duration,
) -> (f64, f64, f64, usize, String) {
    let backend = Backend::start().await;
    backend.script.delay_ms.store(20, Ordering::SeqCst);
    let gw = Gw::start(throttled_limits(backend.addr, 8, throttle, "150ms")).await;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let proxy = gw.proxy;
        tasks.push(tokio::spawn(async move {
            let mut conn = connect(proxy).await;
            let mut latencies = Vec::new();
            let mut errors = 0;
            while start.elapsed() < run {
                let sent = Instant::now();
                let (status, ..) = conn.call(request("POST", "/v1/x", &[], "{}")).await;
                if status == 200 {
                    latencies.push(sent.elapsed().as_secs_f64() * 1e3);
                } else {
                    errors += 1;
                    // Back off as told, briefly (the Retry-After is whole seconds).
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (l, e) = task.await.unwrap();
        latencies.extend(l);
        errors += e;
    }
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    let text = gw.metrics().await;
    let count = metric(
        &text,
        r#"poolpilot_pool_lease_wait_seconds_count{backend="model-a"}"#,
    )
    .unwrap_or(0.0);
    let p99 = text
        .lines()
        .filter(|l| l.starts_with("poolpilot_pool_lease_wait_seconds_bucket"))
        .find(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() >= 0.99 * count)
        .map(|l| l.split('"').nth(1).unwrap().to_owned())
        .unwrap_or_default();
    (
        latencies.len() as f64 / run.as_secs_f64(),
        at(0.5),
        at(0.99),
        errors,
        p99,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: `make bench` runs it (or by hand with --ignored --nocapture)"]
async fn soft_throttle_beside_the_plain_queue() {
    let run = Duration::from_secs(8);
    let mut table = String::from(
        "| pool | clients | completed/s | latency p50 ms | latency p99 ms | 503s | lease wait p99 bucket (s) |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for clients in [32, 96] {
        for (name, throttle) in [
            ("plain queue", None),
            (
                "soft throttle 2ms × pending, max 10ms",
                Some(("2ms", "10ms")),
            ),
        ] {
            let (rate, p50, p99, errors, wait) = run_load(throttle, clients, run).await;
            table.push_str(&format!(
                "| {name} | {clients} | {rate:.0} | {p50:.1} | {p99:.1} | {errors} | ≤ {wait} |\n"
            ));
        }
    }
    print!("{table}");
    // `make bench` includes this section in BENCHMARKS.md.
    if let Some(path) = std::env::var_os("POOLPILOT_BENCH_FRAGMENT") {
        let build = if cfg!(debug_assertions) {
            "a debug"
        } else {
            "a release"
        };
        let section = format!(
            "## Soft throttle beside the plain queue\n\n\
             `pool.softThrottle` delays a lease request `min(max, pending × perPending)` before it \
             joins the queue (the lease-timeout incident's client slept `min(10, pending × 2)` ms \
             before asking for a lease). Measured in-process on loopback by `make bench` (`cargo \
             test --release -p poolpilot-gateway --test loopback -- --ignored soft_throttle::`, which writes \
             this section) with {build} build: one backend answering in 20 ms, \
             `maxConnectionsPerEndpoint: 8` (ceiling 400 completed/s), `leaseTimeout: 150ms`, \
             closed-loop clients on keep-alive connections for {} s each (a 503 is retried after \
             50 ms).\n\n{table}",
            run.as_secs()
        );
        std::fs::write(path, section).expect("write the benchmark's section");
    }
}
