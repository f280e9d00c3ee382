//! Scenario 4, scale the gateway 3 → 6 → 2 under load: with a closed-loop load that keeps every
//! pool full (more workers than the fleet's connections), `kubectl scale` of the gateway
//! Deployment re-divides the per-pod shares (each pod's `/v1/limits` share, the shares adding up
//! to the fleet target once settled), and the backend side never sees more concurrent
//! connections than capacity × (1 − headroom) + 5%: modelsim's peak counters (connections open,
//! requests in flight) per instance, read and reset phase by phase, plus a 250 ms sampling of the
//! same gauges throughout.
//!
//! The load follows the Ready gateway pods as a Service would: a new Load starts for each pod
//! that turns Ready, and the Load of a pod that stops being Ready is stopped (its workers get
//! transport errors until then; the figures report them).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context as _;
use poolpilot_e2e::load::{Load, LoadSpec, Tally};
use poolpilot_e2e::scenario::{figure, serial};
use poolpilot_e2e::stack::{
    BackendSpec, GATEWAY_DEPLOYMENT, GatewayPod, POLICY, Stack, StackSpec, WAIT, metric_sum,
    quick_policy, set, with_stack,
};
use poolpilot_modelsim::{ConnectionAtPeak, Remote};
use serde_json::{Value, json};
use tokio::time::Instant;

const SCENARIO: &str = "scale-gateways";
/// modelsim instances of model-a (the endpoints).
const ENDPOINTS: u32 = 2;
/// Their batch slots: more than the budget, so that only the gateways bound the connections.
const SLOTS: u32 = 40;
/// capacity.maxConnectionsPerEndpoint and headroom: a budget of 25 × 0.8 = 20 per endpoint, so
/// that the acceptance's 5% is one connection. The gateways keep a closed connection's slot
/// until modelsim has closed its side, and a terminating pod exits only once modelsim let go of
/// its connections, so the budget holds exactly as modelsim counts.
const CAPACITY: u32 = 25;
const HEADROOM: f64 = 0.2;
/// The fleet target (autoscale off: at `max`, the budget).
const TARGET: u32 = 20;
/// Load workers per Ready gateway pod: with 2 pods, 48 > 20 × 2 fleet connections.
const WORKERS_PER_POD: usize = 24;
/// modelsim service time.
const SERVICE_MS: u32 = 300;
/// How long the load runs on a settled fleet in each phase.
const STEADY: Duration = Duration::from_secs(5);

/// The quick sample reduced to model-a, with the capacity above, no active health checks (their
/// probe connections would blur the connection count), autoscale off and every pod updated at
/// once.
fn policy() -> anyhow::Result<Value> {
    let mut p = quick_policy()?;
    let mut backends: Vec<Value> = p["spec"]["backends"]
        .as_array()
        .context("backends")?
        .iter()
        .filter(|b| b["name"] == "model-a")
        .cloned()
        .collect();
    let b = backends.first_mut().context("model-a")?;
    set(
        b,
        "/capacity",
        json!({"maxConnectionsPerEndpoint": CAPACITY, "headroom": HEADROOM}),
    )?;
    set(b, "/pool/leaseTimeout", json!("3s"))?;
    b.as_object_mut()
        .context("a backend")?
        .remove("healthCheck");
    set(&mut p, "/spec/backends", json!(backends))?;
    set(&mut p, "/spec/autoscale/enabled", json!(false))?;
    set(&mut p, "/spec/autoscale/max", json!(TARGET))?;
    set(&mut p, "/spec/rollout", json!({"strategy": "AllAtOnce"}))?;
    if let Some(clients) = p["spec"]["clients"].as_object_mut() {
        clients.remove("overrides");
        clients.remove("slowCalls");
    }
    Ok(p)
}

fn minus(a: &Tally, b: &Tally) -> Tally {
    Tally {
        calls: a.calls - b.calls,
        ok: a.ok - b.ok,
        retry_after: a.retry_after - b.retry_after,
        errors: a
            .errors
            .iter()
            .map(|(k, v)| (k.clone(), v - b.errors.get(k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect(),
        statuses: a
            .statuses
            .iter()
            .map(|(k, v)| (*k, v - b.statuses.get(k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect(),
        retry_after_secs: a
            .retry_after_secs
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v - b.retry_after_secs.get(k).copied().unwrap_or(0),
                )
            })
            .filter(|(_, v)| *v > 0)
            .collect(),
    }
}

/// One Load per Ready gateway pod, following the pods as they come and go.
struct Loads {
    live: BTreeMap<String, Load>,
    /// What the stopped Loads counted.
    retired: Tally,
    /// The name of every pod followed, by IP.
    pods: BTreeMap<String, String>,
}

impl Loads {
    /// Starts a Load for every Ready pod without one, stops those of pods no longer Ready.
    async fn follow(&mut self, pods: &[GatewayPod]) -> anyhow::Result<()> {
        let names: BTreeSet<&str> = pods.iter().map(|p| p.name.as_str()).collect();
        let gone: Vec<String> = self
            .live
            .keys()
            .filter(|n| !names.contains(n.as_str()))
            .cloned()
            .collect();
        for name in gone {
            let load = self.live.remove(&name).context("a live load")?;
            self.retired.add(&load.window(0, u64::MAX));
            load.stop().await;
        }
        for pod in pods {
            self.pods.insert(pod.ip.to_string(), pod.name.clone());
            if !self.live.contains_key(&pod.name) {
                let spec = LoadSpec::one_client_per_worker(
                    vec![pod.proxy()],
                    "model-a",
                    4,
                    WORKERS_PER_POD,
                    Duration::from_secs(10),
                );
                self.live
                    .insert(pod.name.clone(), Load::start(spec, WORKERS_PER_POD)?);
            }
        }
        Ok(())
    }

    /// Everything counted so far.
    fn total(&self) -> Tally {
        let mut t = self.retired.clone();
        for load in self.live.values() {
            t.add(&load.window(0, u64::MAX));
        }
        t
    }
}

/// The highest figures of one phase.
#[derive(Debug, Default)]
struct Peaks {
    /// Per instance: modelsim's own peak of open connections / requests in flight.
    connections: BTreeMap<String, u64>,
    in_flight: BTreeMap<String, u64>,
    /// Per instance: who held the connections at the connection peak (see [`holders`]).
    holders: BTreeMap<String, String>,
    /// Per instance: the highest of the 250 ms samples of the same gauges.
    sampled_connections: BTreeMap<String, u64>,
    sampled_in_flight: BTreeMap<String, u64>,
    /// The gateways' own view, sampled every second: the most connections (leased + idle) all
    /// Ready pods together held, and the sum of their pool caps (`poolpilot_pool_max_connections`,
    /// over both endpoints).
    gateway_open: f64,
    gateway_caps: f64,
}

impl Peaks {
    async fn sample(&mut self, backends: &[Remote]) {
        for b in backends {
            if let Ok(s) = b.stats().await {
                let c = self
                    .sampled_connections
                    .entry(s.instance.clone())
                    .or_default();
                *c = (*c).max(s.connections_open);
                let f = self.sampled_in_flight.entry(s.instance).or_default();
                *f = (*f).max(s.in_flight);
            }
        }
    }

    async fn sample_gateways(&mut self, ready: &[GatewayPod]) {
        let (mut open, mut caps) = (0.0, 0.0);
        for g in ready {
            if let Ok(text) = g.metrics().await {
                open += metric_sum(&text, "poolpilot_pool_connections", &[]);
                caps += metric_sum(&text, "poolpilot_pool_max_connections", &[]);
            }
        }
        self.gateway_open = self.gateway_open.max(open);
        self.gateway_caps = self.gateway_caps.max(caps);
    }

    /// Reads modelsim's peak counters, then resets them for the next phase; `pods` names the
    /// peers.
    async fn finish(
        &mut self,
        backends: &[Remote],
        pods: &BTreeMap<String, String>,
    ) -> anyhow::Result<()> {
        for b in backends {
            let s = b.stats().await?;
            b.reset_peaks().await?;
            self.holders
                .insert(s.instance.clone(), holders(&s.connections_at_peak, pods));
            self.connections
                .insert(s.instance.clone(), s.connections_peak);
            self.in_flight.insert(s.instance, s.in_flight_peak);
        }
        Ok(())
    }
}

/// Who held a backend's connections at its peak, per gateway pod: how many, how many of them in
/// a request, and how long the others had been idle. A connection is put to the pod whose
/// clients its last request came from (`X-Forwarded-For`: the load reaches a pod from the pod's
/// own IP on the local node, so that IP names the pod); one that carried no request yet is
/// put to "new".
fn holders(conns: &[ConnectionAtPeak], pods: &BTreeMap<String, String>) -> String {
    let mut by_pod: BTreeMap<&str, (usize, usize, Vec<u64>)> = BTreeMap::new();
    for c in conns {
        let pod = match c.forwarded_for.as_deref() {
            Some(ip) => pods.get(ip).map_or(ip, String::as_str),
            None => "new",
        };
        let (n, busy, idle) = by_pod.entry(pod).or_default();
        *n += 1;
        if c.in_request {
            *busy += 1;
        } else {
            idle.push(c.idle_ms);
        }
    }
    by_pod
        .iter()
        .map(|(pod, (n, busy, idle))| format!("{pod}: {n} ({busy} in a request, idle ms {idle:?})"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether the Ready pods' model-a shares are re-divided for `pods` pods: exactly `pods` of them,
/// each within one of `TARGET / pods`, adding up to `TARGET`. Returns the shares.
async fn shares(ready: &[GatewayPod], pods: usize) -> Option<Vec<u32>> {
    if ready.len() != pods {
        return None;
    }
    let mut shares = Vec::new();
    for g in ready {
        let l = g.limits().await.ok()?;
        let b = l.backends.iter().find(|b| b.name == "model-a")?;
        if b.endpoints.len() != ENDPOINTS as usize {
            return None;
        }
        shares.push(b.pool.max_connections_per_endpoint);
    }
    let base = TARGET / pods as u32;
    let settled =
        shares.iter().sum::<u32>() == TARGET && shares.iter().all(|s| *s == base || *s == base + 1);
    settled.then_some(shares)
}

/// Scales to `pods` (unless `None`: the starting fleet), keeps the load following the Ready
/// pods and samples the backends every 250 ms until the shares are re-divided, then for
/// [`STEADY`] more; reports the phase's figures.
async fn phase(
    stack: &Stack<'_>,
    loads: &mut Loads,
    backends: &[Remote],
    label: &str,
    pods: usize,
    scale: bool,
) -> anyhow::Result<Peaks> {
    let before = loads.total();
    let start = Instant::now();
    if scale {
        stack.scale(GATEWAY_DEPLOYMENT, pods as u32).await?;
    }
    let mut peaks = Peaks::default();
    let mut all_ready: Option<Duration> = None;
    let mut settled: Option<(Duration, Vec<u32>)> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut ticks = 0u32;
    loop {
        tick.tick().await;
        peaks.sample(backends).await;
        let ready = stack.gateways().await.unwrap_or_default();
        loads.follow(&ready).await?;
        ticks += 1;
        if ticks.is_multiple_of(4) {
            peaks.sample_gateways(&ready).await;
        }
        if ready.len() == pods && all_ready.is_none() {
            all_ready = Some(start.elapsed());
        }
        match &settled {
            None => {
                if let Some(s) = shares(&ready, pods).await {
                    settled = Some((start.elapsed(), s));
                }
            }
            Some((at, _)) if start.elapsed() >= *at + STEADY => break,
            Some(_) => {}
        }
        anyhow::ensure!(
            start.elapsed() < WAIT,
            "{label}: shares not re-divided over {pods} pods within {WAIT:?}"
        );
    }
    peaks.finish(backends, &loads.pods).await?;
    let (settle, shares) = settled.context("settled")?;
    let tally = minus(&loads.total(), &before);
    if scale {
        figure(
            SCENARIO,
            &format!("{label} all pods Ready ms"),
            all_ready.unwrap_or_default().as_millis(),
        );
        figure(
            SCENARIO,
            &format!("{label} re-division ms"),
            settle.as_millis(),
        );
    }
    figure(
        SCENARIO,
        &format!("{label} shares"),
        format!("{shares:?} = {}", shares.iter().sum::<u32>()),
    );
    figure(
        SCENARIO,
        &format!("{label} peak connections per instance"),
        format!("{:?}", peaks.connections),
    );
    figure(
        SCENARIO,
        &format!("{label} connections at the peak by pod"),
        format!("{:?}", peaks.holders),
    );
    figure(
        SCENARIO,
        &format!("{label} peak in flight per instance"),
        format!("{:?}", peaks.in_flight),
    );
    figure(
        SCENARIO,
        &format!("{label} sampled max connections / in flight"),
        format!(
            "{:?} / {:?}",
            peaks.sampled_connections, peaks.sampled_in_flight
        ),
    );
    figure(
        SCENARIO,
        &format!("{label} gateways' max pooled connections / pool caps (all pods, both endpoints)"),
        format!("{} / {}", peaks.gateway_open, peaks.gateway_caps),
    );
    figure(SCENARIO, &format!("{label} load"), &tally);
    assert_eq!(
        shares.iter().sum::<u32>(),
        TARGET,
        "{label}: the shares add up to the target"
    );
    Ok(peaks)
}

/// A phase with a hard deadline: an API call hanging on an overloaded apiserver fails the test
/// instead of stalling it.
async fn bounded(phase: impl Future<Output = anyhow::Result<Peaks>>) -> anyhow::Result<Peaks> {
    tokio::time::timeout(WAIT + STEADY + Duration::from_secs(30), phase)
        .await
        .context("the phase overran its deadline")?
}

#[tokio::test]
async fn scale_gateways_redivides_shares_within_the_backend_budget() -> anyhow::Result<()> {
    let _serial = serial().await?;
    let spec = StackSpec {
        gateways: 3,
        backends: vec![BackendSpec::new("model-a", ENDPOINTS, SLOTS).service_ms(SERVICE_MS)],
        ..StackSpec::default()
    };
    with_stack("scale", spec, async |stack| {
        stack.apply(&policy()?).await?;
        stack.wait_gateways(3).await?;
        stack.wait_condition(POLICY, "RolledOut", "True", WAIT).await?;
        let backends = stack.backends("model-a").await?;
        anyhow::ensure!(backends.len() == ENDPOINTS as usize, "{} model-a instances", backends.len());
        let limit = 1.05 * f64::from(CAPACITY) * (1.0 - HEADROOM);
        figure(SCENARIO, "budget per endpoint", format!("{TARGET} (limit with 5%: {limit:.1})"));

        let mut loads = Loads {
            live: BTreeMap::new(),
            retired: Tally::default(),
            pods: BTreeMap::new(),
        };
        loads.follow(&stack.gateways().await?).await?;
        // Let the pools fill, then count from a clean slate.
        tokio::time::sleep(Duration::from_secs(2)).await;
        for b in &backends {
            b.reset_peaks().await?;
        }

        let mut all = Vec::new();
        all.push(("3 pods", bounded(phase(stack, &mut loads, &backends, "3 pods", 3, false)).await?));
        all.push(("3 to 6", bounded(phase(stack, &mut loads, &backends, "3 to 6", 6, true)).await?));
        all.push(("6 to 2", bounded(phase(stack, &mut loads, &backends, "6 to 2", 2, true)).await?));
        let total = loads.total();
        figure(SCENARIO, "load overall", &total);
        figure(
            SCENARIO,
            "transport errors (workers on removed pods)",
            total.errors_of("transport") + total.errors_of("timeout"),
        );
        for (_, load) in std::mem::take(&mut loads.live) {
            load.stop().await;
        }

        let mut overall = 0;
        for (label, peaks) in &all {
            for (kind, by_instance) in [
                ("connections", &peaks.connections),
                ("requests in flight", &peaks.in_flight),
            ] {
                for (instance, peak) in by_instance {
                    overall = overall.max(*peak);
                    assert!(
                        *peak as f64 <= limit,
                        "{label}: {instance} peaked at {peak} {kind}, budget {TARGET} (+5%: {limit:.1}); \
                         connections at the peak: {}",
                        peaks.holders.get(instance).map_or("?", String::as_str)
                    );
                }
            }
        }
        figure(SCENARIO, "peak per endpoint overall", format!("{overall} of {limit:.1}"));
        // The load kept the pools full: the backends saw the whole budget in use.
        let busiest = all[0].1.in_flight.values().min().copied().unwrap_or_default();
        assert!(
            busiest as f64 >= 0.75 * f64::from(TARGET),
            "the load fills the pools at 3 pods: in-flight peaks {:?}",
            all[0].1.in_flight
        );
        anyhow::ensure!(total.ok > 0, "the load got answers: {total}");
        Ok(())
    })
    .await
}
