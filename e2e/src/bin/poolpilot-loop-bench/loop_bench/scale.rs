//! Part 6: the operator with many policies. 5 gateway pods; policies `scale-NNN`, each with one
//! backend `b-NNN` (distinct names, so none is Conflicted) at a static address, selecting the same
//! 5 pods (the first keeps the sample's name `models`), autoscale on with its bounds pinned, deciding every 15 s. At each policy count the
//! operator's own metrics are read before and after a window: reconcile latency (p50/p99 from
//! its histogram), PromQL queries per round and per interval, Kubernetes API requests per
//! interval, and its resident memory.
//!
//! ```text
//!  kubectl apply 1 → 20 → 50 → 200 policies ─► wait Accepted & RolledOut for all (their status)
//!  scrape /metrics ── window ── scrape /metrics  ─► deltas per 15 s interval
//! ```

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use poolpilot_api::ConnectionPolicy;
use poolpilot_e2e::eventually;
use poolpilot_e2e::stack::{
    OPERATOR_LABELS, Stack, StackSpec, bucket_delta, histogram, metric_sum, operator_metrics,
    quantile, quick_policy, set,
};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::Plan;

/// Gateway pods every policy selects.
pub const PODS: u32 = 5;
/// The policies' autoscale interval (the sample's): the unit of "per interval".
pub const INTERVAL: Duration = Duration::from_secs(15);
/// How long a policy count may take to be accepted and rolled out everywhere.
pub const SETTLE: Duration = Duration::from_secs(120);
/// A static address in the pod range that no pod holds: the gateways pool lazily and no call
/// is made in this part, and whatever is tried fails on this machine.
static ADDRESS: LazyLock<String> =
    LazyLock::new(|| format!("{}:8000", poolpilot_e2e::hermetic::UNHELD_POD_ADDRESS));
const PREFIX: &str = "poolpilot_operator_";

/// The stack of this part: 5 gateways with room for 200 backends' pools, no model backends.
pub fn stack() -> StackSpec {
    StackSpec {
        gateways: PODS,
        backends: Vec::new(),
        nofile_limit: Some(8192),
        gateway_cpu_request: Some("10m"),
        ..StackSpec::default()
    }
}

/// The operator at one policy count.
#[derive(Clone, Debug)]
pub struct ScaleRow {
    /// Policies in the namespace.
    pub policies: usize,
    /// Seconds from applying this count's policies to all of them Accepted and RolledOut
    /// (`None`: not within the settle time).
    pub settle: Option<f64>,
    /// Policies Accepted=True and RolledOut=True when the window ended.
    pub accepted: usize,
    /// See `accepted`.
    pub rolled_out: usize,
    /// The window measured.
    pub window: Duration,
    /// Reconciles in the window, per interval.
    pub reconciles_per_interval: f64,
    /// Reconcile latency p50 and p99 in the window, seconds (bucket interpolation).
    pub reconcile_p50: Option<f64>,
    /// See `reconcile_p50`.
    pub reconcile_p99: Option<f64>,
    /// PromQL queries per round in the window.
    pub queries_per_round: f64,
    /// PromQL queries per interval.
    pub queries_per_interval: f64,
    /// Kubernetes API requests per interval, total and by verb.
    pub api_per_interval: f64,
    /// See `api_per_interval`.
    pub api_by_verb: BTreeMap<String, f64>,
    /// Mean time per pipeline step in the window (`step_duration_seconds`), seconds.
    pub step_means: BTreeMap<String, f64>,
    /// Gateway PUTs per interval.
    pub puts_per_interval: f64,
    /// The operator's resident memory, highest sample in the window, bytes.
    pub rss_max: f64,
    /// Operator container restarts before and after the window: when they differ, the
    /// counters restarted inside it and the deltas mean nothing.
    pub restarts: (u32, u32),
    /// Why the operator container last ended, if it did.
    pub last_exit: Option<String>,
}

impl ScaleRow {
    /// Whether the counters ran through the whole window (no operator restart inside it).
    pub fn valid(&self) -> bool {
        self.restarts.0 == self.restarts.1
    }
}

/// One policy of this part.
pub fn policy(i: usize) -> anyhow::Result<Value> {
    let mut p = quick_policy()?;
    let name = format!("b-{i:03}");
    // The first keeps the sample's name: the gateway Deployment mounts its ConfigMap
    // `models-limits`, and a gateway is Ready once it runs a limits document.
    if i > 0 {
        set(&mut p, "/metadata/name", json!(format!("scale-{i:03}")))?;
    }
    set(
        &mut p,
        "/spec/backends",
        json!([{
            "name": name,
            "match": {"pathPrefix": "/v1/", "model": name},
            "endpoints": {"addresses": [{"name": format!("{name}-0"), "address": ADDRESS.as_str()}]},
            "capacity": {"maxConnectionsPerEndpoint": 8, "headroom": 0.2},
            "pool": {"maxPending": 16, "leaseTimeout": "300ms"},
        }]),
    )?;
    set(
        &mut p,
        "/spec/autoscale/interval",
        json!(format!("{}s", INTERVAL.as_secs())),
    )?;
    set(&mut p, "/spec/autoscale/min", json!(PODS))?;
    set(&mut p, "/spec/autoscale/max", json!(PODS))?;
    if let Some(clients) = p["spec"]["clients"].as_object_mut() {
        clients.remove("overrides");
        clients.remove("slowCalls");
    }
    Ok(p)
}

/// Applies policies up to each count of the plan and measures the operator at each. A count
/// that does not settle is measured as it is, and the larger counts are not attempted.
pub async fn run(stack: &Stack<'_>, plan: &Plan) -> anyhow::Result<Vec<ScaleRow>> {
    let mut rows = Vec::new();
    let mut applied = 0;
    for &n in &plan.policy_levels {
        let items = (applied..n)
            .map(policy)
            .collect::<anyhow::Result<Vec<_>>>()?;
        let start = Instant::now();
        stack
            .apply(&json!({"apiVersion": "v1", "kind": "List", "items": items}))
            .await
            .with_context(|| format!("applying policies {applied}..{n}"))?;
        if applied == 0 {
            stack.wait_gateways(PODS as usize).await?;
        }
        applied = n;
        let settle = settle(stack, n, start).await;
        eprintln!(
            "poolpilot-loop-bench:   {n} policies: settled {}",
            settle.map_or("never".to_owned(), |s| format!("in {s:.1} s"))
        );
        let row = measure(stack, n, settle, plan.scale_window).await?;
        eprintln!(
            "poolpilot-loop-bench:   {n} policies: reconcile p50 {:?} p99 {:?}, {:.1} queries/round, {:.0} API requests/interval, RSS {:.1} MiB, operator restarts {:?}",
            row.reconcile_p50,
            row.reconcile_p99,
            row.queries_per_round,
            row.api_per_interval,
            row.rss_max / 1048576.0,
            row.restarts
        );
        rows.push(row);
        if settle.is_none() {
            break;
        }
    }
    Ok(rows)
}

/// Policies whose status has `Accepted=True` and `RolledOut=True` for their current
/// generation (read from the API, so that an operator restarting does not blank them).
async fn accepted_rolled_out(stack: &Stack<'_>) -> anyhow::Result<(usize, usize)> {
    let api: Api<ConnectionPolicy> = stack.ns().api();
    let policies = api.list(&ListParams::default()).await?;
    let with = |kind: &str| {
        policies
            .items
            .iter()
            .filter(|p| {
                p.status.as_ref().is_some_and(|s| {
                    s.conditions.iter().any(|c| {
                        c.type_ == kind
                            && c.status == "True"
                            && c.observed_generation == p.metadata.generation
                    })
                })
            })
            .count()
    };
    Ok((with("Accepted"), with("RolledOut")))
}

/// Container restarts of the operator pods so far, and why the last one ended (the kubelet's
/// `lastState.terminated` reason), if one did.
async fn operator_restarts(stack: &Stack<'_>) -> anyhow::Result<(u32, Option<String>)> {
    let pods: Api<Pod> = stack.ns().api();
    let list = pods
        .list(&ListParams::default().labels(OPERATOR_LABELS))
        .await?;
    let statuses: Vec<_> = list
        .items
        .iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
        .flatten()
        .collect();
    let restarts = statuses.iter().map(|c| c.restart_count.max(0) as u32).sum();
    let last = statuses.iter().find_map(|c| {
        let t = c.last_state.as_ref()?.terminated.as_ref()?;
        Some(format!(
            "exit {}: {}",
            t.exit_code,
            t.reason.clone().unwrap_or_default()
        ))
    });
    Ok((restarts, last))
}

/// The operator's `/metrics` text, from whichever operator pod is Ready now (it may restart).
async fn scrape(stack: &Stack<'_>) -> anyhow::Result<String> {
    operator_metrics(&stack.operator_metrics_url().await?).await
}

/// [`scrape`], retried for up to 30 s (an operator pod restarting in between).
async fn scrape_patiently(stack: &Stack<'_>) -> anyhow::Result<String> {
    eventually("the operator's /metrics", Duration::from_secs(30), || {
        scrape(stack)
    })
    .await
}

/// Waits until `n` policies are Accepted and RolledOut; the seconds since `start`, or `None`.
async fn settle(stack: &Stack<'_>, n: usize, start: Instant) -> Option<f64> {
    while start.elapsed() < SETTLE {
        if let Ok((accepted, rolled_out)) = accepted_rolled_out(stack).await
            && accepted >= n
            && rolled_out >= n
        {
            return Some(start.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    None
}

/// Reads the operator's metrics across `window`.
async fn measure(
    stack: &Stack<'_>,
    n: usize,
    settle: Option<f64>,
    window: Duration,
) -> anyhow::Result<ScaleRow> {
    let (restarts_before, _) = operator_restarts(stack).await?;
    let before = scrape_patiently(stack).await?;
    let start = Instant::now();
    let mut rss_max = metric_sum(&before, "process_resident_memory_bytes", &[]);
    while start.elapsed() < window {
        tokio::time::sleep(Duration::from_secs(5).min(window.saturating_sub(start.elapsed())))
            .await;
        if let Ok(text) = scrape(stack).await {
            rss_max = rss_max.max(metric_sum(&text, "process_resident_memory_bytes", &[]));
        }
    }
    let after = scrape_patiently(stack).await?;
    let (restarts_after, last_exit) = operator_restarts(stack).await?;
    let (accepted, rolled_out) = accepted_rolled_out(stack).await?;
    let seconds = start.elapsed().as_secs_f64();
    let intervals = seconds / INTERVAL.as_secs_f64();
    let delta = |name: &str, labels: &[&str]| {
        let name = format!("{PREFIX}{name}");
        metric_sum(&after, &name, labels) - metric_sum(&before, &name, labels)
    };
    let rounds = delta("prometheus_rounds_total", &[]);
    let queries = delta("prometheus_queries_total", &[]);
    let mut api_by_verb = BTreeMap::new();
    for verb in [
        "get", "watch", "create", "update", "patch", "delete", "other",
    ] {
        let v = delta("kube_requests_total", &[&format!("verb=\"{verb}\"")]);
        if v > 0.0 {
            api_by_verb.insert(verb.to_owned(), v / intervals);
        }
    }
    let mut step_means = BTreeMap::new();
    for step in ["observe", "validate", "plan", "rollout", "status"] {
        let label = format!("step=\"{step}\"");
        let count = delta("step_duration_seconds_count", &[&label]);
        if count > 0.0 {
            step_means.insert(
                step.to_owned(),
                delta("step_duration_seconds_sum", &[&label]) / count,
            );
        }
    }
    let buckets = |text: &str| histogram(text, "poolpilot_operator_reconcile_duration_seconds");
    let hist = bucket_delta(&buckets(&before), &buckets(&after));
    anyhow::ensure!(
        after.contains("poolpilot_operator_prometheus_queries_total"),
        "the operator exports no poolpilot_operator_prometheus_queries_total: rebuild it \
         (cargo build -p poolpilot-operator)"
    );
    Ok(ScaleRow {
        policies: n,
        settle,
        accepted,
        rolled_out,
        window: Duration::from_secs_f64(seconds),
        reconciles_per_interval: delta("reconciles_total", &[]) / intervals,
        reconcile_p50: quantile(&hist, 0.5),
        reconcile_p99: quantile(&hist, 0.99),
        queries_per_round: if rounds > 0.0 { queries / rounds } else { 0.0 },
        queries_per_interval: queries / intervals,
        api_per_interval: api_by_verb.values().fold(0.0, |a, b| a + b),
        api_by_verb,
        step_means,
        puts_per_interval: delta("gateway_puts_total", &[]) / intervals,
        restarts: (restarts_before, restarts_after),
        last_exit,
        rss_max,
    })
}

#[cfg(test)]
mod tests {
    use poolpilot_e2e::stack::POLICY;

    use super::*;

    #[test]
    fn policies_have_distinct_backends_and_pinned_bounds() {
        let a = policy(1).unwrap();
        let b = policy(2).unwrap();
        assert_ne!(
            a["spec"]["backends"][0]["name"],
            b["spec"]["backends"][0]["name"]
        );
        assert_eq!(a["metadata"]["name"], "scale-001");
        assert_eq!(policy(0).unwrap()["metadata"]["name"], POLICY);
        assert_eq!(a["spec"]["autoscale"]["min"], a["spec"]["autoscale"]["max"]);
        assert_eq!(a["spec"]["gatewaySelector"], b["spec"]["gatewaySelector"]);
    }
}
