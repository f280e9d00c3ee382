//! A closed-loop load generator for the scenarios and the demo: N workers, each a client that
//! calls a gateway's OpenAI-style API and calls again as soon as it has an answer (or after a set
//! pause), with every outcome counted in one-second buckets (status, the gateway's
//! machine-readable reason, `Retry-After`), so that a test reads the error rate before and after
//! the operator acts.
//!
//! Closed loop is how the callers of the lease-timeout incident behaved (a fixed number of worker threads each waiting
//! for its call): the in-flight demand at the gateways equals the number of active workers, so
//! "demand 50% above the pool" is a worker count. The count changes at run time
//! ([`Load::set_workers`]); workers beyond it idle.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What the load looks like.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// The gateways' proxy addresses; worker `i` calls `gateways[i % len]`, as a client of a
    /// Service would spread its connections.
    pub gateways: Vec<SocketAddr>,
    /// The `model` of every request body.
    pub model: String,
    /// `max_tokens` of every request (modelsim's service time grows with it).
    pub max_tokens: u32,
    /// Distinct client identities (`Authorization: Bearer load-<i % clients>`, see [`Load::start_as`]), so that the per-client
    /// limit does not dominate unless a test wants it to.
    pub clients: usize,
    /// Workers spawned (the most that [`Load::set_workers`] can activate).
    pub max_workers: usize,
    /// Timeout of one call, from sending to the end of the body.
    pub call_timeout: Duration,
    /// Wait as a refusal's `Retry-After` says (at most 5 s) before calling again, as the
    /// OpenAI SDKs do, instead of calling again at once.
    pub honour_retry_after: bool,
    /// How long a worker waits after each answer before its next call (zero: calls again at
    /// once): callers that leave pooled connections idle in between.
    pub pause: Duration,
}

impl LoadSpec {
    /// `workers` workers, each its own client identity, so that the per-client limit never
    /// interferes: the load is what the gateways' pools see.
    pub fn one_client_per_worker(
        gateways: Vec<SocketAddr>,
        model: impl Into<String>,
        max_tokens: u32,
        workers: usize,
        call_timeout: Duration,
    ) -> Self {
        Self {
            gateways,
            model: model.into(),
            max_tokens,
            clients: workers,
            max_workers: workers,
            call_timeout,
            honour_retry_after: false,
            pause: Duration::ZERO,
        }
    }
}

/// Gateway addresses for a skewed load ([`LoadSpec::gateways`], whose worker `i` calls entry
/// `i % len`): `percent`% of the entries are `gateways[onto]`, the others take the rest in turn,
/// spread evenly through the list so that any run of workers is skewed alike. What an L4 load
/// balancer does to a few clients with long-lived connections: most land on one pod.
pub fn skewed(gateways: &[SocketAddr], onto: usize, percent: u32) -> Vec<SocketAddr> {
    let others: Vec<SocketAddr> = gateways
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != onto)
        .map(|(_, g)| *g)
        .collect();
    let Some(&target) = gateways.get(onto) else {
        return gateways.to_vec();
    };
    if others.is_empty() {
        return vec![target];
    }
    let entries = 10 * others.len();
    let spread = entries - (entries * percent.min(100) as usize).div_ceil(100);
    (0..entries)
        .scan(0, |given, j| {
            let due = (j + 1) * spread / entries;
            Some(if due > *given {
                *given += 1;
                others[(*given - 1) % others.len()]
            } else {
                target
            })
        })
        .collect()
}

/// The outcomes of one second, or of a window of seconds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Calls that ended in this period.
    pub calls: u64,
    /// Of them, 2xx with the whole body read.
    pub ok: u64,
    /// Failures by reason: the gateway's JSON `error.code` (e.g. `lease_timeout`), `http_<status>`
    /// for errors without one, or `transport` / `timeout` for calls that got no response.
    pub errors: BTreeMap<String, u64>,
    /// Error responses that carried `Retry-After`.
    pub retry_after: u64,
    /// Of them, by the seconds it said (an HTTP date counts as 1) and the error's reason.
    pub retry_after_secs: BTreeMap<(String, u64), u64>,
    /// Statuses of the error responses.
    pub statuses: BTreeMap<u16, u64>,
}

impl Tally {
    /// Failed calls.
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Failed calls over all calls (0 when there were none).
    pub fn error_rate(&self) -> f64 {
        if self.calls == 0 {
            0.0
        } else {
            self.failed() as f64 / self.calls as f64
        }
    }

    /// Calls that failed for `reason`.
    pub fn errors_of(&self, reason: &str) -> u64 {
        self.errors.get(reason).copied().unwrap_or(0)
    }

    /// Adds another period's outcomes.
    pub fn add(&mut self, other: &Tally) {
        self.calls += other.calls;
        self.ok += other.ok;
        self.retry_after += other.retry_after;
        for (k, v) in &other.retry_after_secs {
            *self.retry_after_secs.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.statuses {
            *self.statuses.entry(*k).or_default() += v;
        }
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} calls, {} ok, {:.2}% errors",
            self.calls,
            self.ok,
            self.error_rate() * 100.0
        )?;
        if !self.errors.is_empty() {
            write!(f, " {:?}", self.errors)?;
        }
        Ok(())
    }
}

/// Outcome of one call.
enum Outcome {
    Ok,
    Failed {
        reason: String,
        status: Option<u16>,
        retry_after: Option<Duration>,
    },
}

#[derive(Debug, Default)]
struct Record {
    /// Whole seconds since the start → outcomes of calls that ended in that second.
    seconds: BTreeMap<u64, Tally>,
    /// Whole seconds since the start → how long each successful call that ended then took,
    /// from sending it to the end of its body.
    latencies: BTreeMap<u64, Vec<Duration>>,
    /// Each successful call's span, from sending it to the end of its body, in seconds since
    /// the start.
    spans: Vec<(f64, f64)>,
}

/// A running load. Dropping it stops the workers.
#[derive(Debug)]
pub struct Load {
    started: Instant,
    workers: watch::Sender<usize>,
    record: Arc<Mutex<Record>>,
    tasks: JoinSet<()>,
}

impl Load {
    /// Spawns `spec.max_workers` workers, `active` of which call at once, as clients
    /// `load-<i>`.
    pub fn start(spec: LoadSpec, active: usize) -> anyhow::Result<Self> {
        Self::start_as(spec, active, "load", None)
    }

    /// [`Load::start`] with the client identities `<key_prefix>-<i>` and, if given, connections
    /// from the `source` address (any 127/8 address reaches the pods), to tell several loads'
    /// clients apart at the gateways: by key for call limits, by address for connection caps.
    pub fn start_as(
        spec: LoadSpec,
        active: usize,
        key_prefix: &str,
        source: Option<std::net::IpAddr>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!spec.gateways.is_empty(), "no gateway to send load to");
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(spec.max_workers)
            .timeout(spec.call_timeout)
            .local_address(source)
            .build()?;
        let (workers, watch) = watch::channel(active);
        let record = Arc::new(Mutex::new(Record::default()));
        let started = Instant::now();
        let mut tasks = JoinSet::new();
        for i in 0..spec.max_workers {
            let url = format!(
                "http://{}/v1/chat/completions",
                spec.gateways[i % spec.gateways.len()]
            );
            let key = format!("{key_prefix}-{}", i % spec.clients.max(1));
            let body = json!({
                "model": spec.model,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": spec.max_tokens,
            })
            .to_string();
            tasks.spawn(worker(
                i,
                client.clone(),
                url,
                key,
                body,
                watch.clone(),
                Arc::clone(&record),
                (started, spec.honour_retry_after, spec.pause),
            ));
        }
        Ok(Self {
            started,
            workers,
            record,
            tasks,
        })
    }

    /// Activates the first `n` workers (the others finish their call and idle).
    pub fn set_workers(&self, n: usize) {
        self.workers.send_replace(n);
    }

    /// Workers active now.
    pub fn workers(&self) -> usize {
        *self.workers.borrow()
    }

    /// Seconds since the load started (the bucket the present falls in).
    pub fn now(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// The outcomes of calls that ended in seconds `[from, to)` since the start.
    pub fn window(&self, from: u64, to: u64) -> Tally {
        let record = self.record.lock();
        let mut total = Tally::default();
        for (_, t) in record.seconds.range(from..to) {
            total.add(t);
        }
        total
    }

    /// The outcomes of calls that ended in the last `seconds` complete seconds.
    pub fn last(&self, seconds: u64) -> Tally {
        let now = self.now();
        self.window(now.saturating_sub(seconds), now)
    }

    /// The `q` quantile (0 to 1, nearest rank) of the durations of the successful calls that
    /// ended in seconds `[from, to)` since the start; `None` without one.
    pub fn latency_quantile(&self, from: u64, to: u64, q: f64) -> Option<Duration> {
        let mut all = self.latencies(from, to);
        all.sort_unstable();
        nearest_rank(&all, q)
    }

    /// The durations of the successful calls that ended in seconds `[from, to)` since the
    /// start, in no order (to pool several windows before taking a quantile).
    pub fn latencies(&self, from: u64, to: u64) -> Vec<Duration> {
        let record = self.record.lock();
        record
            .latencies
            .range(from..to)
            .flat_map(|(_, l)| l.iter().copied())
            .collect()
    }

    /// Successful calls per second over each second of `[from, to)` since the start, each call
    /// counted over the seconds it was open (a share of `1 / its duration` per second open)
    /// rather than all in the second it ended. Over a steady load both counts agree; where
    /// calls held in a queue end together once it drains, this one shows the rate at which they
    /// were served, not a burst that no level sustains. A call still open is not counted yet:
    /// read a period once its calls have ended (a call's longest duration after it).
    pub fn served_per_second(&self, from: u64, to: u64) -> Vec<f64> {
        let record = self.record.lock();
        let mut seconds = vec![0.0; to.saturating_sub(from) as usize];
        let (lo, hi) = (from as f64, to as f64);
        for &(sent, ended) in &record.spans {
            let (start, end) = (sent.max(lo), ended.min(hi));
            if end <= start && !(sent == ended && (lo..hi).contains(&sent)) {
                continue;
            }
            let took = ended - sent;
            if took <= 0.0 {
                seconds[(sent - lo) as usize] += 1.0;
                continue;
            }
            let mut at = start;
            while at < end {
                let second = at.floor();
                let until = (second + 1.0).min(end);
                seconds[(second - lo) as usize] += (until - at) / took;
                at = until;
            }
        }
        seconds
    }

    /// Every second so far, `(second, outcomes)`, seconds without a call included.
    pub fn seconds(&self) -> Vec<(u64, Tally)> {
        let record = self.record.lock();
        (0..self.now())
            .map(|s| (s, record.seconds.get(&s).cloned().unwrap_or_default()))
            .collect()
    }

    /// Stops the workers, waiting for none of their calls.
    pub async fn stop(mut self) {
        self.tasks.shutdown().await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn worker(
    index: usize,
    client: reqwest::Client,
    url: String,
    key: String,
    body: String,
    mut active: watch::Receiver<usize>,
    record: Arc<Mutex<Record>>,
    (started, honour_retry_after, pause): (Instant, bool, Duration),
) {
    loop {
        if *active.borrow_and_update() <= index {
            if active.changed().await.is_err() {
                return;
            }
            continue;
        }
        let sent = Instant::now();
        let outcome = call(&client, &url, &key, &body).await;
        let took = sent.elapsed();
        let span = (
            sent.duration_since(started).as_secs_f64(),
            started.elapsed().as_secs_f64(),
        );
        let failed_fast = matches!(&outcome, Outcome::Failed { status: None, .. });
        let mut wait = None;
        let second = started.elapsed().as_secs();
        {
            let mut r = record.lock();
            let r = &mut *r;
            let tally = r.seconds.entry(second).or_default();
            tally.calls += 1;
            match outcome {
                Outcome::Ok => {
                    tally.ok += 1;
                    r.latencies.entry(second).or_default().push(took);
                    r.spans.push(span);
                }
                Outcome::Failed {
                    reason,
                    status,
                    retry_after,
                } => {
                    if let Some(after) = retry_after {
                        tally.retry_after += 1;
                        *tally
                            .retry_after_secs
                            .entry((reason.clone(), after.as_secs()))
                            .or_default() += 1;
                    }
                    *tally.errors.entry(reason).or_default() += 1;
                    if let Some(status) = status {
                        *tally.statuses.entry(status).or_default() += 1;
                    }
                    wait = retry_after.filter(|_| honour_retry_after);
                }
            }
        }
        if let Some(wait) = wait {
            tokio::time::sleep(wait.min(Duration::from_secs(5))).await;
        } else if failed_fast {
            // No answer at all (connection refused while a pod restarts): do not spin.
            tokio::time::sleep(Duration::from_millis(100)).await;
        } else if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}

async fn call(client: &reqwest::Client, url: &str, key: &str, body: &str) -> Outcome {
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .bearer_auth(key)
        .body(body.to_owned())
        .send()
        .await;
    let response = match response {
        Ok(r) => r,
        Err(e) => {
            return Outcome::Failed {
                reason: if e.is_timeout() {
                    "timeout"
                } else {
                    "transport"
                }
                .to_owned(),
                status: None,
                retry_after: None,
            };
        }
    };
    let status = response.status();
    // Seconds, as the gateway writes it (an HTTP date counts as present, waited for 1 s).
    let retry_after = response.headers().get("retry-after").map(|v| {
        let secs = v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok());
        Duration::from_secs(secs.unwrap_or(1))
    });
    let bytes = response.bytes().await;
    match bytes {
        Ok(_) if status.is_success() => Outcome::Ok,
        Ok(bytes) => {
            // The gateway's errors have the OpenAI shape, its reason in `error.code`.
            let reason = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("http_{}", status.as_u16()));
            Outcome::Failed {
                reason,
                status: Some(status.as_u16()),
                retry_after,
            }
        }
        Err(e) => Outcome::Failed {
            reason: if e.is_timeout() {
                "timeout"
            } else {
                "transport"
            }
            .to_owned(),
            status: Some(status.as_u16()),
            retry_after: None,
        },
    }
}

/// The `q` quantile of `sorted` (ascending) by nearest rank: the smallest value with at least
/// `q` of them at or below it (`None` when empty).
pub fn nearest_rank<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    let rank = ((q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize).max(1);
    sorted.get(rank - 1).copied()
}
#[cfg(test)]
mod tests {
    use super::*;

    /// A load without workers, whose record a test fills.
    fn recorded() -> Load {
        let (workers, _) = watch::channel(0);
        Load {
            started: Instant::now(),
            workers,
            record: Arc::new(Mutex::new(Record::default())),
            tasks: JoinSet::new(),
        }
    }

    #[tokio::test]
    async fn latency_quantiles_are_nearest_rank_over_the_window_of_successful_calls() {
        let load = recorded();
        {
            let mut r = load.record.lock();
            r.latencies
                .insert(1, (1..=50).map(Duration::from_millis).collect());
            r.latencies
                .insert(2, (51..=100).map(Duration::from_millis).collect());
            r.latencies.insert(5, vec![Duration::from_secs(9)]);
        }
        let ms = |d: Option<Duration>| d.map(|d| d.as_millis());
        assert_eq!(ms(load.latency_quantile(0, 3, 0.99)), Some(99));
        assert_eq!(ms(load.latency_quantile(0, 3, 0.5)), Some(50));
        assert_eq!(ms(load.latency_quantile(0, 3, 0.0)), Some(1));
        assert_eq!(ms(load.latency_quantile(2, 3, 1.0)), Some(100));
        assert_eq!(
            ms(load.latency_quantile(0, 6, 1.0)),
            Some(9000),
            "second 5 counts"
        );
        assert_eq!(load.latency_quantile(3, 5, 0.5), None);
    }

    #[tokio::test]
    async fn calls_served_are_spread_over_the_seconds_they_were_open() {
        let load = recorded();
        // A queue drains: four calls opened at 0 end together at 4; one call from 4.5 to 5.5;
        // one that took no time at 6.2; one opened before the period and one after it.
        load.record.lock().spans = vec![
            (0.0, 4.0),
            (0.0, 4.0),
            (0.0, 4.0),
            (0.0, 4.0),
            (4.5, 5.5),
            (6.2, 6.2),
            (-2.0, 2.0),
            (8.0, 9.0),
        ];
        let served = load.served_per_second(0, 7);
        let expected = [1.25, 1.25, 1.0, 1.0, 0.5, 0.5, 1.0];
        assert_eq!(served.len(), expected.len());
        for (second, (got, want)) in served.iter().zip(expected).enumerate() {
            assert!(
                (got - want).abs() < 1e-9,
                "second {second}: {got} != {want}"
            );
        }
        // Every call counts once in all, over any period that holds it whole.
        let total: f64 = load.served_per_second(0, 10).iter().sum();
        assert!((total - 7.5).abs() < 1e-9, "{total}");
        assert!(load.served_per_second(3, 3).is_empty());
    }

    #[test]
    fn tallies_add_up_and_rate_their_errors() {
        let mut a = Tally {
            calls: 10,
            ok: 9,
            ..Tally::default()
        };
        a.errors.insert("lease_timeout".into(), 1);
        a.statuses.insert(503, 1);
        let mut b = Tally {
            calls: 10,
            ok: 7,
            retry_after: 3,
            ..Tally::default()
        };
        b.errors.insert("lease_timeout".into(), 2);
        b.errors.insert("transport".into(), 1);
        b.statuses.insert(503, 2);
        a.add(&b);
        assert_eq!((a.calls, a.ok, a.failed()), (20, 16, 4));
        assert_eq!(a.errors_of("lease_timeout"), 3);
        assert_eq!(a.statuses[&503], 3);
        assert!((a.error_rate() - 0.2).abs() < 1e-9);
        assert_eq!(Tally::default().error_rate(), 0.0);
        assert!(a.to_string().starts_with("20 calls, 16 ok, 20.00% errors"));
    }

    #[test]
    fn a_skewed_load_puts_its_share_on_one_gateway_in_any_run_of_workers() {
        let g: Vec<SocketAddr> = (1..=3)
            .map(|i| SocketAddr::from(([127, 0, 0, i], 8080)))
            .collect();
        let list = skewed(&g, 0, 80);
        assert_eq!(list.len(), 20);
        let on = |workers: usize, gw: usize| {
            (0..workers)
                .filter(|i| list[i % list.len()] == g[gw])
                .count()
        };
        assert_eq!((on(30, 0), on(30, 1), on(30, 2)), (24, 3, 3));
        assert_eq!((on(10, 0), on(10, 1), on(10, 2)), (8, 1, 1));
        let moved = skewed(&g, 2, 80);
        assert_eq!((0..30).filter(|i| moved[i % 20] == g[2]).count(), 24);
        assert_eq!(skewed(&g[..1], 0, 80), [g[0]]);
    }
}
