//! Scenario 10, client protection through the full stack: a greedy client (three times over its
//! concurrency) is throttled with 429 + Retry-After, and a leaking client (opens connections from
//! its own address, makes one call on each and never closes them, like the leaking client
//! library of the AI-gateway incident) is capped at `maxConnectionsPerClient` (connections over it are answered 429 with
//! Retry-After) and reclaimed once the connections sit idle for the header-read timeout, while a
//! well-behaved client keeps a ≥ 99.5% success rate.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_e2e::cluster::client_source;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, POLICY, Stack, StackSpec, WAIT, metric_sum, quick_policy, set, with_stack,
};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

const SCENARIO: &str = "client-protection";
/// Calls in flight per client and gateway pod.
const MAX_CONCURRENCY: u32 = 4;
/// Downstream connections per client address and gateway pod.
const MAX_CONNECTIONS_PER_CLIENT: u32 = 16;
/// The clients' own source addresses (each maps to one of 10.244.128.0/18 that the node routes
/// back here, `cluster::client_source`): the connection cap counts per address.
const LEAKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 77);
const GREEDY: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 88);
const GOOD: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 99);
/// The gateway's header-read timeout (listener default), after which a keep-alive connection
/// that served a request and sends no next one is closed.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn greedy_and_leaking_clients_are_throttled_and_reclaimed_while_a_good_client_is_served()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        backends: vec![BackendSpec::new("model-a", 3, 64).service_ms(100)],
        ..StackSpec::default()
    };
    with_stack("clients", spec, async |stack| scenario(stack).await).await
}

async fn scenario(stack: &Stack<'_>) -> anyhow::Result<()> {
    let mut policy = quick_policy()?;
    // model-a only, with plenty of pooled connections: the clients are the only limit here.
    let backends = policy["spec"]["backends"]
        .as_array_mut()
        .context("backends")?;
    backends.truncate(1);
    set(&mut policy, "/spec/autoscale/max", json!(48))?;
    set(&mut policy, "/spec/autoscale/min", json!(24))?;
    set(
        &mut policy,
        "/spec/clients/maxConcurrency",
        json!(MAX_CONCURRENCY),
    )?;
    set(&mut policy, "/spec/clients/maxQueue", json!(4))?;
    // The limits hold on each pod: a client's calls through one pod are what is measured.
    set(&mut policy, "/spec/clients/scope", json!("PerPod"))?;
    set(&mut policy, "/spec/clients/queueTimeout", json!("500ms"))?;
    set(
        &mut policy,
        "/spec/clients/maxConnectionsPerClient",
        json!(MAX_CONNECTIONS_PER_CLIENT),
    )?;
    stack.apply(&policy).await?;
    let gateways = stack.wait_gateways(3).await?;
    stack
        .wait_condition(POLICY, "RolledOut", "True", WAIT)
        .await?;
    let limits = stack
        .wait_limits("every gateway has the client limits", 3, WAIT, |l| {
            let c = l.client_policies.first().context("a client policy")?;
            anyhow::ensure!(
                c.max_concurrency == MAX_CONCURRENCY
                    && l.listener.max_connections_per_client == Some(MAX_CONNECTIONS_PER_CLIENT),
                "client limits {c:?}, listener {:?}",
                l.listener
            );
            Ok(())
        })
        .await?;
    let header_read_timeout = limits[0].1.listener.header_read_timeout.get();
    anyhow::ensure!(
        header_read_timeout == HEADER_READ_TIMEOUT,
        "the listener's header-read timeout is {header_read_timeout:?}; update this scenario"
    );

    let load = |targets: Vec<SocketAddr>, workers: usize| LoadSpec {
        gateways: targets,
        model: "model-a".to_owned(),
        max_tokens: 8,
        clients: 1,
        max_workers: workers,
        call_timeout: Duration::from_secs(30),
        honour_retry_after: false,
        pause: Duration::ZERO,
    };
    // The good client: 2 calls at a time, spread over the gateways, well within its limit.
    let all: Vec<SocketAddr> = gateways.iter().map(|g| g.proxy()).collect();
    let good = Load::start_as(load(all, 2), 2, "good", Some(client_source(GOOD).into()))?;
    // The greedy client: 12 at a time at one gateway pod, three times its concurrency (and
    // within its connection cap: this one is throttled per call).
    let victim = &gateways[0];
    let greedy = Load::start_as(
        load(vec![victim.proxy()], 12),
        12,
        "greedy",
        Some(client_source(GREEDY).into()),
    )?;

    // The leaker: 3 × its connection cap from its own address at the same pod, one call on
    // each and then nothing (the connections leak). Connections over the cap are answered
    // 429 with Retry-After and closed; the others stay until the header-read timeout reclaims
    // them.
    let started = Instant::now();
    let mut leaked = Vec::new();
    let mut answered_429 = 0;
    for _ in 0..3 * MAX_CONNECTIONS_PER_CLIENT {
        let socket = TcpSocket::new_v4()?;
        socket.bind(SocketAddr::new(IpAddr::V4(client_source(LEAKER)), 0))?;
        let mut stream = socket.connect(victim.proxy()).await?;
        stream
            .write_all(
                b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer leaker\r\n\r\n",
            )
            .await?;
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await??;
        let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
        if head.starts_with("http/1.1 429") {
            anyhow::ensure!(
                head.contains("retry-after: ") && head.contains("too_many_connections"),
                "the refusal says when to come back: {head}"
            );
            answered_429 += 1;
        } else {
            anyhow::ensure!(
                head.starts_with("http/1.1 "),
                "the leaker's call got {head:?}"
            );
            leaked.push(stream);
        }
    }
    let held = leaked.len();
    assert_eq!(
        (answered_429, held),
        (
            2 * MAX_CONNECTIONS_PER_CLIENT as usize,
            MAX_CONNECTIONS_PER_CLIENT as usize
        ),
        "over the cap answered 429 at once, the cap held"
    );
    let metrics = victim.metrics().await?;
    let refused = metric_sum(
        &metrics,
        "poolpilot_downstream_connections_rejected_total",
        &[],
    );
    assert!(
        refused >= f64::from(2 * MAX_CONNECTIONS_PER_CLIENT),
        "the gateway counts the refused connections: {refused}"
    );
    let reclaimed_at = {
        let closed =
            closed_within(&mut leaked, HEADER_READ_TIMEOUT + Duration::from_secs(10)).await;
        assert_eq!(closed, held, "every held connection is reclaimed");
        started.elapsed()
    };
    assert!(
        reclaimed_at >= HEADER_READ_TIMEOUT.saturating_sub(Duration::from_secs(1)),
        "reclaimed by the header-read timeout, not earlier: {reclaimed_at:?}"
    );
    // After the reclaim the leaker's address may connect again, up to the cap.
    let again = TcpSocket::new_v4()?;
    again.bind(SocketAddr::new(IpAddr::V4(client_source(LEAKER)), 0))?;
    let mut again = again.connect(victim.proxy()).await?;
    assert!(
        !closed(&mut again, Duration::from_millis(500)).await,
        "a reclaimed address may connect again"
    );

    // Let both loads run a while longer, then read the tallies.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (good_tally, greedy_tally) = (good.window(0, good.now()), greedy.window(0, greedy.now()));
    let greedy_seconds = greedy.now().max(1) as f64;
    good.stop().await;
    greedy.stop().await;
    println!("good:   {good_tally}");
    println!("greedy: {greedy_tally}");
    let good_success = good_tally.ok as f64 / good_tally.calls.max(1) as f64;
    assert!(good_tally.calls >= 100, "the good client made {good_tally}");
    assert!(
        good_success >= 0.995,
        "the good client's success rate is {:.2}%: {good_tally}",
        good_success * 100.0
    );
    let throttled = greedy_tally.errors_of("client_concurrency")
        + greedy_tally.errors_of("client_queue_timeout");
    assert!(
        throttled > 0 && greedy_tally.statuses.get(&429).copied().unwrap_or(0) == throttled,
        "the greedy client is throttled with 429: {greedy_tally}"
    );
    assert_eq!(
        greedy_tally.retry_after,
        greedy_tally.failed(),
        "every refusal carries Retry-After: {greedy_tally}"
    );
    assert!(
        greedy_tally.ok > 0,
        "the greedy client still gets its share: {greedy_tally}"
    );
    // What the greedy client got through is bounded by its concurrency: ok calls per second
    // ≤ maxConcurrency / service time (100 ms), with a margin for jitter.
    let greedy_rate = greedy_tally.ok as f64 / greedy_seconds;
    assert!(
        greedy_rate <= f64::from(MAX_CONCURRENCY) / 0.1 * 1.2,
        "the greedy client got {greedy_rate:.1} calls/s through"
    );

    figure(
        SCENARIO,
        "good client success %",
        format!("{:.3}", good_success * 100.0),
    );
    figure(SCENARIO, "good client calls", good_tally.calls);
    figure(
        SCENARIO,
        "greedy client throttled %",
        format!("{:.1}", greedy_tally.error_rate() * 100.0),
    );
    figure(
        SCENARIO,
        "greedy client ok calls/s",
        format!("{greedy_rate:.1}"),
    );
    figure(
        SCENARIO,
        "leaked connections answered 429 / held / refused by the cap (gateway metric)",
        format!("{answered_429} / {held} / {refused}"),
    );
    figure(
        SCENARIO,
        "held leaked connections reclaimed after seconds",
        format!("{:.1}", reclaimed_at.as_secs_f64()),
    );
    Ok(())
}

/// Whether the peer closed `stream` within `wait` (a read returns end of file or an error).
async fn closed(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(wait, stream.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// Removes from `streams` the ones the peer closes within `wait`, and counts them.
async fn closed_within(streams: &mut Vec<TcpStream>, wait: Duration) -> usize {
    let deadline = Instant::now() + wait;
    let mut count = 0;
    let mut i = 0;
    while i < streams.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if closed(&mut streams[i], left.max(Duration::from_millis(1))).await {
            streams.swap_remove(i);
            count += 1;
        } else {
            i += 1;
        }
    }
    count
}
