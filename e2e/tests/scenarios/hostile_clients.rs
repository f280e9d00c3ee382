//! Scenario 11, hostile clients: a steady well-behaved load runs through every gateway pod while,
//! for 60 s, five attackers hit one of them at once:
//!
//! - clients that send streaming calls and never read the answers (HTTP/1, a 4 KiB receive
//!   buffer): cut at the send timeout (or at `total`), their backend connections freed;
//! - HTTP/2 clients with a zero flow-control window and 100 streams per connection: every
//!   stream answered (200 or 429) and reset at the send timeout;
//! - bodies that never finish on a model route (60 KiB declared, the last bytes never sent,
//!   300 at a time, each from its own address): 408 at the body-read timeout;
//! - a client rotating its API key at 1,000 keys a second;
//! - a source opening connections above its cap (192 at a time for a cap of 64): answered 429
//!   (or closed, beyond the answer rate), the connections within the cap reclaimed at the
//!   header-read timeout.
//!
//! Asserted: the good load keeps under 0.5% errors, the attacked pod is not restarted and its
//! RSS stays under half its memory limit, every attacker's connection is answered or closed
//! within its deadline (plus a slack for the loaded 2-core machine), every unfinished body is
//! answered 408 (none reset), the key rotator reaches its 1,000 keys a second (less 1%) and
//! the client table stays within `maxClients`, and no backend instance sees more connections
//! than its budget (capacity × (1 − headroom)).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use parking_lot::Mutex;
use poolpilot_e2e::cluster::client_source;
use poolpilot_e2e::load::{Load, LoadSpec};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, GatewayPod, POLICY, Stack, StackSpec, WAIT, metric_sum, quick_policy, set,
    with_stack,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;

const SCENARIO: &str = "hostile-clients";
/// How long the attackers run.
const ATTACK: Duration = Duration::from_secs(60);
/// The policy's listener `sendTimeout` and `bodyReadTimeout`, and model-a's `total`.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(5);
const TOTAL: Duration = Duration::from_secs(20);
/// The listener's header-read timeout (default): a keep-alive connection that sends no next
/// request is closed then.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the gateway keeps a refused connection to answer it (`REFUSAL_GRACE` in
/// `gateway/src/listen/accept.rs`).
const REFUSAL_GRACE: Duration = Duration::from_secs(2);
/// `clients.maxConcurrency` and the connection cap per source.
const MAX_CONCURRENCY: u32 = 4;
const MAX_CONNECTIONS_PER_CLIENT: u32 = 64;
/// `clients.maxClients`: the client table's cap (the default).
const MAX_CLIENTS: u32 = 16_384;
/// What a deadline may be overrun by: the attacked pod, the backends, the load and the attackers
/// share a 2-core machine with other builds (load averages of 5 to 11 were seen), so a pod may
/// take seconds to get to a timer. The figures report the distribution; this bounds it.
const SLACK: Duration = Duration::from_secs(10);
/// model-a's and model-b's capacity per instance: the budget is 80% of it.
const CAPACITY_A: u32 = 64;
const CAPACITY_B: u32 = 32;
const HEADROOM: f64 = 0.2;

/// The attackers' and the good load's source addresses (each maps to one of 10.244.128.0/18 that
/// the node routes back here, `cluster::client_source`).
const GOOD: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 99);
const NON_READER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 81);
const H2: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 82);
const ROTATOR: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 83);
const CAPPED: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 84);
/// The key rotator's aim, and its HTTP/2 connections (100 streams each, a quarter of its
/// connection cap): its calls take under 0.1 s at the median but 2–4 s when the loaded machine
/// stalls the pod (a CI run measured p99 2.0 s, worst 3.8 s, and 800 streams skipped 3.7% of the
/// sends), so 1,600 streams ride out a stall of 1.6 s at the full rate.
const KEYS_PER_SEC: u64 = 1000;
const ROTATOR_CONNECTIONS: usize = 16;
/// Unfinished bodies per wave, each from its own address (`127.<10 + wave>.x.y`).
const BODIES: u32 = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_get_cut_answered_or_refused_in_time_while_a_good_load_is_served()
-> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        backends: vec![
            // Streams as fast as the reader takes them, long enough to fill every buffer.
            BackendSpec::new("model-a", 3, 64)
                .arg("--per-token-ms=0")
                .arg("--max-tokens=200000"),
            BackendSpec::new("model-b", 2, 32).service_ms(5),
        ],
        ..StackSpec::default()
    };
    with_stack("hostile", spec, async |stack| scenario(stack).await).await
}

/// The quick sample with short client-side deadlines, no active health checks (their probe
/// connections would blur the backends' connection counts), autoscale off and every pod updated
/// at once.
fn policy() -> anyhow::Result<Value> {
    let mut p = quick_policy()?;
    for b in p["spec"]["backends"]
        .as_array_mut()
        .context("backends")?
        .iter_mut()
    {
        b.as_object_mut()
            .context("a backend")?
            .remove("healthCheck");
        set(
            b,
            "/timeouts",
            json!({"firstByte": "10s", "total": format!("{}s", TOTAL.as_secs()), "streamIdle": "10s"}),
        )?;
    }
    set(&mut p, "/spec/autoscale/enabled", json!(false))?;
    // The most model-b allows (32 × 0.8): about 8 connections per endpoint and pod, so that
    // the attackers' keys (at most 12 calls in flight on model-a) leave the good load room.
    set(&mut p, "/spec/autoscale/max", json!(25))?;
    set(&mut p, "/spec/rollout", json!({"strategy": "AllAtOnce"}))?;
    let clients = p["spec"]["clients"].as_object_mut().context("clients")?;
    clients.remove("overrides");
    clients.remove("slowCalls");
    set(
        &mut p,
        "/spec/clients/maxConcurrency",
        json!(MAX_CONCURRENCY),
    )?;
    set(&mut p, "/spec/clients/maxQueue", json!(4))?;
    set(&mut p, "/spec/clients/maxClients", json!(MAX_CLIENTS))?;
    // Per pod: the attackers aim at one pod.
    set(&mut p, "/spec/clients/scope", json!("PerPod"))?;
    set(&mut p, "/spec/clients/queueTimeout", json!("1s"))?;
    set(
        &mut p,
        "/spec/clients/maxConnectionsPerClient",
        json!(MAX_CONNECTIONS_PER_CLIENT),
    )?;
    set(
        &mut p,
        "/spec/listener",
        json!({
            "maxConnections": 1024,
            "sendTimeout": format!("{}s", SEND_TIMEOUT.as_secs()),
            "bodyReadTimeout": format!("{}s", BODY_READ_TIMEOUT.as_secs()),
        }),
    )?;
    Ok(p)
}

async fn scenario(stack: &Stack<'_>) -> anyhow::Result<()> {
    stack.apply(&policy()?).await?;
    let gateways = stack.wait_gateways(3).await?;
    stack
        .wait_condition(POLICY, "RolledOut", "True", WAIT)
        .await?;
    stack
        .wait_limits(
            "every gateway has the hostile-client limits",
            3,
            WAIT,
            |l| {
                anyhow::ensure!(
                    l.listener.send_timeout.get() == SEND_TIMEOUT
                        && l.listener.body_read_timeout.get() == BODY_READ_TIMEOUT
                        && l.listener.header_read_timeout.get() == HEADER_READ_TIMEOUT
                        && l.listener.max_connections_per_client
                            == Some(MAX_CONNECTIONS_PER_CLIENT),
                    "listener {:?}",
                    l.listener
                );
                Ok(())
            },
        )
        .await?;
    let victim = gateways[0].clone();
    let pods: Api<Pod> = stack.ns().api();
    let (restarts_before, memory_limit) = pod_facts(&pods, &victim.name).await?;

    // The good load: 6 callers, each its own key, spread over the three pods.
    let good = Load::start_as(
        LoadSpec::one_client_per_worker(
            gateways.iter().map(GatewayPod::proxy).collect(),
            "model-a",
            8,
            6,
            Duration::from_secs(30),
        ),
        6,
        "good",
        Some(client_source(GOOD).into()),
    )?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let backends_a = stack.backends("model-a").await?;
    let backends_b = stack.backends("model-b").await?;
    for b in backends_a.iter().chain(&backends_b) {
        b.reset_peaks().await?;
    }

    let from = good.now();
    let until = Instant::now() + ATTACK;
    let proxy = victim.proxy();
    println!("attacked pod {} at {proxy}", victim.name);
    let sampled = Arc::new(Mutex::new(Peaks::default()));
    let mut attacks = JoinSet::new();
    attacks.spawn(non_readers(proxy, until));
    attacks.spawn(h2_zero_window(proxy, until));
    attacks.spawn(unfinished_bodies(proxy, until));
    attacks.spawn(rotator(proxy, until));
    attacks.spawn(capped_source(proxy, until));
    let sampler = tokio::spawn(sample_peaks(victim.clone(), until, sampled.clone()));
    let mut reports = BTreeMap::new();
    while let Some(report) = attacks.join_next().await {
        let report = report??;
        reports.insert(report.name, report);
    }
    sampler.await?;
    let to = good.now();
    let good_tally = good.window(from, to);
    good.stop().await;

    // The backends, the attacked pod, its metrics.
    let mut peaks = BTreeMap::new();
    for (name, backends, capacity) in [
        ("model-a", &backends_a, CAPACITY_A),
        ("model-b", &backends_b, CAPACITY_B),
    ] {
        let budget = (f64::from(capacity) * (1.0 - HEADROOM)).floor() as u64;
        for b in backends {
            let stats = b.stats().await?;
            assert!(
                stats.connections_peak <= budget,
                "{name} instance {} saw {} connections, over its budget of {budget}",
                stats.instance,
                stats.connections_peak
            );
            peaks.insert(stats.instance, (stats.connections_peak, budget));
        }
    }
    let (restarts_after, _) = pod_facts(&pods, &victim.name).await?;
    let Peaks {
        rss: rss_max,
        clients: clients_max,
    } = *sampled.lock();
    let metrics = victim.metrics().await?;

    figure(
        SCENARIO,
        "load average during the attack (1 min)",
        load_average(),
    );
    figure(
        SCENARIO,
        "good load errors % (calls)",
        format!(
            "{:.3} ({})",
            good_tally.error_rate() * 100.0,
            good_tally.calls
        ),
    );
    figure(
        SCENARIO,
        "attacked pod RSS peak MiB / memory limit MiB, restarts",
        format!(
            "{:.1} / {:.0}, {}",
            rss_max / MIB,
            memory_limit / MIB,
            restarts_after - restarts_before
        ),
    );
    figure(
        SCENARIO,
        "attacked pod client table peak (entries) / maxClients",
        format!("{clients_max} / {MAX_CLIENTS}"),
    );
    figure(
        SCENARIO,
        "backend connection peaks (instance: peak / budget)",
        format!("{peaks:?}"),
    );
    for report in reports.values() {
        figure(SCENARIO, report.name, report.summary());
    }
    for (series, labels) in [
        ("poolpilot_downstream_timeouts_total", "kind=\"send\""),
        ("poolpilot_downstream_timeouts_total", "kind=\"total\""),
        ("poolpilot_downstream_timeouts_total", "kind=\"body_read\""),
        (
            "poolpilot_downstream_connections_rejected_total",
            "outcome=\"answered\"",
        ),
        (
            "poolpilot_downstream_connections_rejected_total",
            "outcome=\"dropped\"",
        ),
        ("poolpilot_route_buffer_rejected_total", ""),
        ("poolpilot_client_evictions_total", ""),
        ("poolpilot_upstream_timeouts_total", ""),
    ] {
        let wanted: Vec<&str> = [labels].into_iter().filter(|l| !l.is_empty()).collect();
        // `+ 0.0`: a sum of no series is -0.0.
        let value = metric_sum(&metrics, series, &wanted) + 0.0;
        figure(
            SCENARIO,
            &format!("attacked pod {series}{{{labels}}}"),
            value,
        );
    }
    for report in reports.values() {
        println!("{report}");
    }
    println!("good: {good_tally}");
    assert!(good_tally.calls >= 100, "the good load made {good_tally}");
    assert!(
        good_tally.error_rate() < 0.005,
        "the good load's errors: {good_tally}"
    );
    assert_eq!(
        restarts_after, restarts_before,
        "the attacked pod restarted"
    );
    assert!(rss_max > 0.0, "the RSS was sampled");
    assert!(
        rss_max < memory_limit / 2.0,
        "RSS {:.1} MiB, over half the memory limit {:.0} MiB",
        rss_max / MIB,
        memory_limit / MIB
    );
    for report in reports.values() {
        assert!(report.tries > 0, "{} never ran", report.name);
        assert_eq!(report.late, 0, "{report}");
    }
    let (rotator, offered) = reports
        .values()
        .find_map(|r| r.rate)
        .context("the key rotator's rate")?;
    // The generator kept its pace (less 1% for its own clock on the loaded machine), and the
    // keys it could not send are only those offered while the pod held every one of its 1,600
    // streams: the attack at its fullest, not a weaker one (a CI run at load 6 on 2 cores
    // skipped 1.5%, one with half the streams 3.7%).
    assert!(
        offered >= KEYS_PER_SEC as f64 * 0.99,
        "the key rotator offered {offered:.0} new keys/s, not {KEYS_PER_SEC}"
    );
    assert!(
        rotator >= KEYS_PER_SEC as f64 * 0.95,
        "the key rotator sent {rotator:.0} new keys/s of the {offered:.0} it offered"
    );
    // 60 s of new keys at that rate is 60,000 clients: only those with calls in flight (or
    // history) may be held.
    assert!(clients_max > 0.0, "the client table was sampled");
    assert!(
        clients_max <= f64::from(MAX_CLIENTS),
        "the client table held {clients_max} entries, over maxClients {MAX_CLIENTS}"
    );

    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;

/// The machine's 1-minute load average (`/proc/loadavg`), for the figures.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

/// The gateway container's restarts and memory limit (bytes) of pod `name`.
async fn pod_facts(pods: &Api<Pod>, name: &str) -> anyhow::Result<(i32, f64)> {
    let pod = pods.get(name).await?;
    let restarts = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map_or(0, |c| c.restart_count);
    let limit = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
        .context("the gateway has a memory limit")?;
    Ok((restarts, quantity_bytes(&limit.0)?))
}

/// A memory quantity (`256Mi`, `1Gi`, `500M`, bytes) in bytes.
fn quantity_bytes(q: &str) -> anyhow::Result<f64> {
    let (number, factor) = [
        ("Ki", 1024.0),
        ("Mi", MIB),
        ("Gi", MIB * 1024.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
    ]
    .iter()
    .find_map(|(suffix, f)| q.strip_suffix(suffix).map(|n| (n, *f)))
    .unwrap_or((q, 1.0));
    Ok(number.parse::<f64>().context("a memory quantity")? * factor)
}

/// The highest RSS (bytes) and client table size (entries) sampled.
#[derive(Clone, Copy, Debug, Default)]
struct Peaks {
    rss: f64,
    clients: f64,
}

/// Samples the attacked pod's RSS and client table once a second until `until`, keeping the
/// highest.
async fn sample_peaks(victim: GatewayPod, until: Instant, peaks: Arc<Mutex<Peaks>>) {
    while Instant::now() < until + SLACK {
        if let Ok(text) = victim.metrics().await {
            let rss = metric_sum(&text, "process_resident_memory_bytes", &[]);
            let clients = metric_sum(&text, "poolpilot_clients_tracked", &[]);
            let mut peaks = peaks.lock();
            peaks.rss = peaks.rss.max(rss);
            peaks.clients = peaks.clients.max(clients);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What one attacker saw.
#[derive(Debug, Default)]
struct Report {
    name: &'static str,
    /// Connections (or streams, or calls) tried.
    tries: u64,
    /// Their outcomes.
    outcomes: BTreeMap<String, u64>,
    /// Of them, not answered or closed within their deadline plus [`SLACK`].
    late: u64,
    /// The times to the answer or close, and the deadline they are held to.
    times: Vec<Duration>,
    deadline: Duration,
    /// Extra facts (rates).
    note: String,
    /// The rate it achieved, where it has one to hold (new keys a second for the key rotator),
    /// and the rate it offered (sends found no free stream included).
    rate: Option<(f64, f64)>,
}

impl Report {
    fn new(name: &'static str, deadline: Duration) -> Self {
        Self {
            name,
            deadline,
            ..Self::default()
        }
    }

    /// Records one try that ended with `outcome` after `took` (known to have ended by then),
    /// and whether that was within its deadline plus [`SLACK`].
    fn record(&mut self, outcome: impl Into<String>, took: Duration, in_time: bool) {
        self.tries += 1;
        *self.outcomes.entry(outcome.into()).or_default() += 1;
        self.times.push(took);
        if !in_time {
            self.late += 1;
        }
    }

    fn merge(&mut self, other: Report) {
        self.tries += other.tries;
        for (k, v) in other.outcomes {
            *self.outcomes.entry(k).or_default() += v;
        }
        self.late += other.late;
        self.times.extend(other.times);
    }

    /// The `q` quantile of the times (0 without any).
    fn quantile(&self, q: f64) -> Duration {
        let mut times = self.times.clone();
        times.sort();
        let i = ((times.len() as f64 - 1.0) * q).round() as usize;
        times.get(i).copied().unwrap_or_default()
    }

    fn summary(&self) -> String {
        format!(
            "{} tries {:?}; answered or closed after {:.1}s (median) / {:.1}s (p99) / {:.1}s (worst) for a deadline of {:.0}s; {} late{}",
            self.tries,
            self.outcomes,
            self.quantile(0.5).as_secs_f64(),
            self.quantile(0.99).as_secs_f64(),
            self.quantile(1.0).as_secs_f64(),
            self.deadline.as_secs_f64(),
            self.late,
            self.note
        )
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.name, self.summary())
    }
}

/// A socket bound to `source`.
fn socket_from(source: Ipv4Addr) -> anyhow::Result<TcpSocket> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(IpAddr::V4(client_source(source)), 0))?;
    Ok(socket)
}

/// Reads what is buffered until the peer closes, for at most `wait`: the bytes, and whether
/// the close came (a FIN, or a reset).
async fn drain(stream: &mut TcpStream, wait: Duration) -> (Vec<u8>, bool) {
    let (out, end) = drain_to_end(stream, wait).await;
    (out, end.is_some())
}

/// How a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Fin,
    Reset,
}

/// [`drain`], telling a FIN from a reset (`None`: still open after `wait`).
async fn drain_to_end(stream: &mut TcpStream, wait: Duration) -> (Vec<u8>, Option<End>) {
    let mut out = Vec::new();
    let end = match tokio::time::timeout(wait, stream.read_to_end(&mut out)).await {
        Ok(Ok(_)) => Some(End::Fin),
        Ok(Err(_)) => Some(End::Reset),
        Err(_) => None,
    };
    (out, end)
}

/// The status of an HTTP/1.1 response that starts `bytes`.
fn status(bytes: &[u8]) -> Option<u16> {
    std::str::from_utf8(bytes.get(9..12)?).ok()?.parse().ok()
}

/// Streaming calls whose answers are never read, 16 at a time under one key (4 in flight at
/// most, the rest 429): each is cut at the send timeout once the buffers between the gateway and
/// the client are full (or at `total` at the latest).
async fn non_readers(gw: SocketAddr, until: Instant) -> anyhow::Result<Report> {
    let mut tasks = JoinSet::new();
    for _ in 0..16 {
        tasks.spawn(async move {
            let mut report = Report::new("non-reading clients", TOTAL);
            while Instant::now() < until {
                let socket = socket_from(NON_READER)?;
                socket.set_recv_buffer_size(4096)?;
                let mut s = socket.connect(gw).await?;
                let body = json!({"model": "model-a", "stream": true, "max_tokens": 200000,
                    "messages": [{"role": "user", "content": "go on"}]})
                .to_string();
                let head = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer non-reader\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let sent = Instant::now();
                s.write_all(head.as_bytes()).await?;
                let mut first = [0u8; 64];
                let n = tokio::time::timeout(Duration::from_secs(15), s.read(&mut first))
                    .await
                    .context("a response head")??;
                match status(&first[..n]) {
                    Some(200) => {
                        // Never read until the deadline has passed (any read would let the
                        // gateway send more): by then the gateway must have cut the response,
                        // at the send timeout once the buffers were full, or at `total`.
                        tokio::time::sleep_until(sent + TOTAL + SLACK).await;
                        let looked = sent.elapsed();
                        let (bytes, closed) = drain(&mut s, Duration::from_secs(2)).await;
                        let cut = closed && !bytes.ends_with(b"0\r\n\r\n");
                        report.record(if cut { "200, cut" } else { "200, not cut" }, looked, cut);
                    }
                    Some(code) => {
                        drain(&mut s, Duration::from_secs(2)).await;
                        report.record(code.to_string(), sent.elapsed(), true);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    None => report.record("no answer", sent.elapsed(), false),
                }
            }
            Ok::<_, anyhow::Error>(report)
        });
    }
    let mut report = collect(tasks, Report::new("non-reading clients", TOTAL)).await?;
    report.note = "; a 200's time is when the client looked (any earlier read would have let \
                   the gateway send more): the gateway's cut times are its send and total \
                   timeout counters"
        .to_owned();
    Ok(report)
}

/// HTTP/2 connections that give no flow-control window, 100 streams each under one key per
/// connection, two at a time: every stream is answered (its head needs no window) and reset at
/// the send timeout.
async fn h2_zero_window(gw: SocketAddr, until: Instant) -> anyhow::Result<Report> {
    let mut tasks = JoinSet::new();
    for c in 0..2 {
        tasks.spawn(async move {
            let mut report = Report::new("h2 zero window, 100 streams", SEND_TIMEOUT);
            while Instant::now() < until {
                let stream = socket_from(H2)?.connect(gw).await?;
                let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                    .initial_stream_window_size(0)
                    .handshake::<_, Full<Bytes>>(TokioIo::new(stream))
                    .await?;
                tokio::spawn(conn);
                let mut streams = JoinSet::new();
                for _ in 0..100 {
                    let mut sender = sender.clone();
                    streams.spawn(async move {
                        let body = json!({"model": "model-a", "stream": true, "max_tokens": 200000,
                            "messages": [{"role": "user", "content": "go on"}]})
                        .to_string();
                        let req = http::Request::post("http://gateway/v1/chat/completions") // hermetic: not a destination (the :authority on a connection to the pod)
                            .header("authorization", format!("Bearer h2-{c}"))
                            .body(Full::new(Bytes::from(body)))
                            .expect("a request");
                        let sent = Instant::now();
                        let Ok(response) = sender.send_request(req).await else {
                            return ("refused stream".to_owned(), sent.elapsed(), true);
                        };
                        let status = response.status().as_u16();
                        let head_at = Instant::now();
                        let end = tokio::time::timeout(
                            SEND_TIMEOUT + SLACK + Duration::from_secs(5),
                            response.into_body().collect(),
                        )
                        .await;
                        let took = head_at.elapsed();
                        let (outcome, ended) = match end {
                            Ok(Err(_)) => (format!("{status}, reset"), true),
                            Ok(Ok(_)) => (format!("{status}, ended"), true),
                            Err(_) => (format!("{status}, hanging"), false),
                        };
                        (outcome, took, ended && took <= SEND_TIMEOUT + SLACK)
                    });
                }
                while let Some(done) = streams.join_next().await {
                    let (outcome, took, in_time) = done?;
                    report.record(outcome, took, in_time);
                }
            }
            Ok::<_, anyhow::Error>(report)
        });
    }
    collect(
        tasks,
        Report::new("h2 zero window, 100 streams", SEND_TIMEOUT),
    )
    .await
}

/// Waves of 300 calls on a model route, each declaring 60 KiB of body and sending 60,000 bytes
/// of it, each from its own address: each is answered 408 at the body-read timeout.
async fn unfinished_bodies(gw: SocketAddr, until: Instant) -> anyhow::Result<Report> {
    let mut report = Report::new("unfinished bodies, 300 at a time", BODY_READ_TIMEOUT);
    let mut wave = 0u8;
    while Instant::now() < until {
        let mut tasks = JoinSet::new();
        wave += 1;
        for i in 0..BODIES {
            tasks.spawn(async move {
                // A new address for every call of every wave, as 300 clients would come.
                let source = Ipv4Addr::new(127, 10 + wave, (i / 200) as u8, 1 + (i % 200) as u8);
                let mut s = socket_from(source)?.connect(gw).await?;
                let mut body = br#"{"model":"model-a","messages":[{"role":"user","content":""#.to_vec();
                body.resize(60_000, b'x');
                let head = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer body-{i}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    60 * 1024
                );
                s.write_all(head.as_bytes()).await?;
                s.write_all(&body).await?;
                let last_byte = Instant::now();
                let (answer, end) =
                    drain_to_end(&mut s, BODY_READ_TIMEOUT + SLACK + Duration::from_secs(5)).await;
                let took = last_byte.elapsed();
                let outcome = match (status(&answer), end) {
                    (Some(code), _) => code.to_string(),
                    (None, Some(end)) => {
                        format!("{end:?} without an answer after {}s", took.as_secs())
                    }
                    (None, None) => "no answer".to_owned(),
                };
                // Answered 408, not merely closed: a reset loses the answer.
                let in_time = status(&answer) == Some(408) && took <= BODY_READ_TIMEOUT + SLACK;
                Ok::<_, anyhow::Error>((outcome, took, in_time))
            });
        }
        while let Some(done) = tasks.join_next().await {
            let (outcome, took, in_time) = done??;
            report.record(outcome, took, in_time);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    Ok(report)
}

/// One client calling model-b with a new API key each time, [`KEYS_PER_SEC`] keys a second,
/// open loop over [`ROTATOR_CONNECTIONS`] HTTP/2 connections of at most 100 streams each (the
/// gateway's `maxConcurrentStreams`): a send that finds every connection at 100 calls in flight
/// is skipped and counted. Its rate is the keys sent over the attack, and the keys answered.
async fn rotator(gw: SocketAddr, until: Instant) -> anyhow::Result<Report> {
    let mut connections = Vec::new();
    for _ in 0..ROTATOR_CONNECTIONS {
        let stream = socket_from(ROTATOR)?.connect(gw).await?;
        let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake::<_, Full<Bytes>>(TokioIo::new(stream))
            .await?;
        tokio::spawn(conn);
        connections.push((sender, Arc::new(tokio::sync::Semaphore::new(100))));
    }
    let report = Arc::new(Mutex::new(Report::new(
        "key rotation at 1000 keys/s",
        Duration::from_secs(10),
    )));
    let body = Bytes::from(
        json!({"model": "model-b", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]})
        .to_string(),
    );
    let per_tick = KEYS_PER_SEC / 100;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let started = Instant::now();
    let (mut sent, mut skipped, mut next) = (0u64, 0u64, 0usize);
    let mut calls = JoinSet::new();
    let mut last_tick = started;
    while Instant::now() < until {
        last_tick = tick.tick().await;
        for _ in 0..per_tick {
            // The next connection with a free stream, round robin.
            let free = (0..ROTATOR_CONNECTIONS).find_map(|i| {
                let c = (next + i) % ROTATOR_CONNECTIONS;
                let permit = connections[c].1.clone().try_acquire_owned().ok()?;
                Some((c, permit))
            });
            let Some((c, permit)) = free else {
                skipped += 1;
                continue;
            };
            next = c + 1;
            sent += 1;
            let mut sender = connections[c].0.clone();
            let report = report.clone();
            let req = http::Request::post("http://gateway/v1/chat/completions") // hermetic: not a destination (the :authority on a connection to the pod)
                .header("authorization", format!("Bearer rotating-{sent}"))
                .header("content-type", "application/json")
                .body(Full::new(body.clone()))?;
            calls.spawn(async move {
                let at = Instant::now();
                let answer = tokio::time::timeout(Duration::from_secs(10), async {
                    let response = sender.send_request(req).await?;
                    let code = response.status().as_u16();
                    response.into_body().collect().await?;
                    Ok::<_, hyper::Error>(code)
                })
                .await;
                let (outcome, answered) = match answer {
                    Ok(Ok(code)) => (code.to_string(), true),
                    Ok(Err(_)) => ("stream error".to_owned(), false),
                    Err(_) => ("timeout".to_owned(), false),
                };
                report.lock().record(outcome, at.elapsed(), answered);
                drop(permit);
            });
        }
        while calls.try_join_next().is_some() {}
    }
    // Each tick's sends stand for its 10 ms (a tick that fell behind is late, which counts).
    let sends_done = Instant::now();
    let window = (last_tick + Duration::from_millis(10))
        .max(sends_done)
        .duration_since(started)
        .as_secs_f64();
    while calls.join_next().await.is_some() {}
    let mut report = Arc::try_unwrap(report)
        .map_err(|_| anyhow::anyhow!("calls still running"))?
        .into_inner();
    let answered: u64 = report
        .outcomes
        .iter()
        .filter(|(outcome, _)| outcome.parse::<u16>().is_ok())
        .map(|(_, n)| n)
        .sum();
    report.rate = Some((sent as f64 / window, (sent + skipped) as f64 / window));
    report.note = format!(
        "; {:.0} new keys/s sent, {:.0} answered, over {window:.1}s; {skipped} sends skipped \
         ({} connections × 100 streams)",
        sent as f64 / window,
        answered as f64 / window,
        ROTATOR_CONNECTIONS
    );
    Ok(report)
}

/// A source keeping 192 connections open (3 × its cap of 64), each with one call, reopening
/// each as soon as it closes: over the cap they are answered 429 (or closed, beyond the answer
/// rate) at once; within it they are served and reclaimed at the header-read timeout.
async fn capped_source(gw: SocketAddr, until: Instant) -> anyhow::Result<Report> {
    let mut tasks = JoinSet::new();
    for i in 0..3 * MAX_CONNECTIONS_PER_CLIENT {
        tasks.spawn(async move {
            let mut report = Report::new("over the connection cap", HEADER_READ_TIMEOUT);
            while Instant::now() < until {
                let mut s = socket_from(CAPPED)?.connect(gw).await?;
                let opened = Instant::now();
                let _ = s
                    .write_all(
                        format!(
                            "GET /v1/models HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer capped-{i}\r\n\r\n"
                        )
                        .as_bytes(),
                    )
                    .await;
                let (answer, closed) =
                    drain(&mut s, HEADER_READ_TIMEOUT + SLACK + Duration::from_secs(5)).await;
                let took = opened.elapsed();
                let (outcome, deadline) = match status(&answer) {
                    Some(429) => ("429".to_owned(), REFUSAL_GRACE),
                    Some(code) => (format!("{code}, then reclaimed"), HEADER_READ_TIMEOUT),
                    None => ("closed unanswered".to_owned(), REFUSAL_GRACE),
                };
                report.record(outcome, took, closed && took <= deadline + SLACK);
                // Reopen a second later: about 130 connections a second from this source.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok::<_, anyhow::Error>(report)
        });
    }
    collect(
        tasks,
        Report::new("over the connection cap", HEADER_READ_TIMEOUT),
    )
    .await
}

/// Merges the reports of an attacker's tasks.
async fn collect(
    mut tasks: JoinSet<anyhow::Result<Report>>,
    mut total: Report,
) -> anyhow::Result<Report> {
    while let Some(report) = tasks.join_next().await {
        total.merge(report??);
    }
    Ok(total)
}
