//! The objects and numbers of the fleet-scale run, decided purely: its plan (policies, pods, how
//! the pods are grouped), the Pod objects that stand for the simulated pods and the status a
//! kubelet would give them, the policies, the private Prometheus' configuration, and what the
//! operator's and Prometheus' `/metrics` say about queries per round.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use poolpilot_api::ConnectionPolicy;
use serde_json::{Value, json};

use crate::fleet_sim::FleetSpec;
use crate::stack::{metric_sum, quick_policy, set};

/// The label every simulated pod carries (the sample policy's gateway selector).
pub const GATEWAY_LABEL: (&str, &str) = ("app.kubernetes.io/name", "poolpilot-gateway");
/// The label naming a pod's group; each group policy selects one group.
pub const GROUP_LABEL: &str = "poolpilot.io/fleet-group";
/// The scheduling gate that keeps the Pod objects off every node: no scheduler binds them and no
/// kubelet runs them, so the status this run writes is the only one they get.
pub const SIMULATED_GATE: &str = "poolpilot.io/simulated";
/// The gateway pod annotation naming the limits ConfigMap its fleet mounts (the operator's
/// `poolpilot.io/limits-configmap`, as the chart sets it): one per group here.
pub const LIMITS_CONFIGMAP_ANNOTATION: &str = "poolpilot.io/limits-configmap";
/// The policy that selects every pod: the one edited to measure a rollout to all of them.
pub const FLEET_POLICY: &str = "fleet-wide";
/// Its backend.
pub const FLEET_BACKEND: &str = "fleet-b";
/// The `pool.maxPending` of the fleet-wide backend before the rollout's edit; the edit adds one.
pub const FLEET_MAX_PENDING: u32 = 16;
/// The `pool.maxPending` of every group backend before the change of every policy; the change
/// adds one.
pub const GROUP_MAX_PENDING: u32 = 16;
/// The static address every backend names: a pod-range address no pod holds. The simulated
/// gateways never call it.
pub const BACKEND_ADDRESS: Ipv4Addr = crate::hermetic::UNHELD_POD_ADDRESS;

/// How big the run is and how it is paced.
#[derive(Clone, Debug)]
pub struct FleetPlan {
    /// ConnectionPolicies in all: one fleet-wide, the rest one group each.
    pub policies: usize,
    /// Simulated gateway pods.
    pub pods: usize,
    /// Pods per group (the last group may be smaller).
    pub pods_per_group: usize,
    /// The first simulated pod's address (127/8).
    pub first_address: Ipv4Addr,
    /// How long a simulated pod takes to answer a PUT.
    pub put_latency: Duration,
    /// The private Prometheus' scrape interval, the operator's `--metrics-interval` and
    /// `--scrape-interval`, and the policies' `autoscale.interval`.
    pub interval: Duration,
    /// The operator's `--rollout-concurrency` (its default when `None`).
    pub rollout_concurrency: Option<u16>,
    /// The operator's `--concurrent-reconciles` (its default when `None`).
    pub concurrent_reconciles: Option<u16>,
    /// How long every policy has to settle after the operator starts.
    pub settle_timeout: Duration,
    /// The steady window after settling in which queries, reconciles and API requests are
    /// counted.
    pub window: Duration,
    /// How long the rollout of the fleet-wide edit may take.
    pub rollout_timeout: Duration,
}

impl FleetPlan {
    /// The acceptance's size: 2,000 policies × 1,000 pods in groups of 10.
    pub fn full() -> Self {
        Self {
            policies: 2000,
            pods: 1000,
            pods_per_group: 10,
            first_address: Ipv4Addr::new(127, 1, 0, 1),
            put_latency: Duration::from_millis(5),
            interval: Duration::from_secs(15),
            rollout_concurrency: None,
            concurrent_reconciles: None,
            settle_timeout: Duration::from_secs(300),
            window: Duration::from_secs(60),
            rollout_timeout: Duration::from_secs(120),
        }
    }

    /// A short run that validates the harness: 200 policies × 100 pods.
    pub fn quick() -> Self {
        Self {
            policies: 200,
            pods: 100,
            window: Duration::from_secs(30),
            ..Self::full()
        }
    }

    /// The e2e tier's version: 100 policies × 50 pods in groups of 10, on addresses of their
    /// own (127.2/16) so that it never meets a bench's fleet.
    pub fn small() -> Self {
        Self {
            policies: 100,
            pods: 50,
            first_address: Ipv4Addr::new(127, 2, 0, 1),
            interval: Duration::from_secs(5),
            settle_timeout: Duration::from_secs(180),
            window: Duration::from_secs(20),
            rollout_timeout: Duration::from_secs(60),
            ..Self::full()
        }
    }

    /// How many groups the pods make.
    pub fn groups(&self) -> usize {
        self.pods.div_ceil(self.pods_per_group.max(1))
    }

    /// Pod `i`'s group.
    pub fn group_of_pod(&self, i: usize) -> usize {
        i / self.pods_per_group.max(1)
    }

    /// How many pods group `g` holds.
    pub fn group_size(&self, g: usize) -> usize {
        let per = self.pods_per_group.max(1);
        self.pods.saturating_sub(g * per).min(per)
    }

    /// The group policies (every policy but the fleet-wide one).
    pub fn group_policies(&self) -> usize {
        self.policies.saturating_sub(1)
    }

    /// Group policy `k`'s group: the policies go round the groups.
    pub fn group_of_policy(&self, k: usize) -> usize {
        k % self.groups().max(1)
    }

    /// The backends every pod of group `g` runs: its group's policies' and the fleet-wide one.
    pub fn expected_backends(&self, g: usize) -> BTreeSet<String> {
        (0..self.group_policies())
            .filter(|&k| self.group_of_policy(k) == g)
            .map(backend_name)
            .chain(std::iter::once(FLEET_BACKEND.to_owned()))
            .collect()
    }

    /// The series the simulated pods export once every pod runs its document (what Prometheus
    /// holds): per pod 3 of its own, per backend 16 (one endpoint each).
    pub fn series(&self) -> usize {
        (0..self.groups())
            .map(|g| self.group_size(g) * (3 + 16 * self.expected_backends(g).len()))
            .sum()
    }

    /// The simulated fleet of this plan in `namespace`, accepting `token`, its pods answering
    /// every PUT after the plan's latency (none slow, none failing), on `port`.
    pub fn fleet_spec(&self, namespace: &str, token: &str, port: u16) -> FleetSpec {
        FleetSpec {
            pods: self.pods,
            first: self.first_address,
            port,
            namespace: namespace.to_owned(),
            prefix: "gw-sim-".to_owned(),
            token: token.to_owned(),
            latency: self.put_latency,
            slow_fraction: 0.0,
            slow_latency: Duration::from_secs(10),
            fail_fraction: 0.0,
            leased: 1.0,
            calls_per_second: 5.0,
        }
    }
}

/// Group `g`'s label value.
pub fn group_name(g: usize) -> String {
    format!("g{g:03}")
}

/// The limits ConfigMap group `g` mounts (the chart's annotation: one per gateway fleet).
pub fn group_configmap(g: usize) -> String {
    format!("gw-{}-limits", group_name(g))
}

/// Group policy `k`'s name.
pub fn policy_name(k: usize) -> String {
    format!("p-{k:04}")
}

/// Group policy `k`'s backend.
pub fn backend_name(k: usize) -> String {
    format!("b-{k:04}")
}

/// Pod `i` of `spec` as a Pod object: its group's labels and limits ConfigMap, gated off every
/// node. Its status comes apart ([`pod_status`]).
pub fn pod_object(plan: &FleetPlan, spec: &FleetSpec, i: usize) -> Value {
    let g = plan.group_of_pod(i);
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": spec.name(i),
            "labels": {GATEWAY_LABEL.0: GATEWAY_LABEL.1, GROUP_LABEL: group_name(g)},
            "annotations": {
                LIMITS_CONFIGMAP_ANNOTATION: group_configmap(g),
            },
        },
        "spec": {
            "schedulingGates": [{"name": SIMULATED_GATE}],
            "automountServiceAccountToken": false,
            "containers": [{"name": "gateway", "image": "poolpilot-fleet-sim.invalid/none"}],
        },
    })
}

/// The status a kubelet would write for a running, ready gateway pod at `ip` (a strategic merge
/// patch: the scheduler's own condition stays).
pub fn pod_status(ip: Ipv4Addr) -> Value {
    json!({
        "status": {
            "phase": "Running",
            "podIP": ip.to_string(),
            "podIPs": [{"ip": ip.to_string()}],
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
            ],
        }
    })
}

/// A policy of the run: `name` with the one backend `backend` selecting `selector`, autoscale on
/// with its bounds pinned at `target` (decisions every interval, no change), Progressive rollout
/// with one canary and `verifyIntervals: 0`. The targets give each pod 2 connections per backend
/// and the fleet reports 1 leased on each ([`FleetPlan::fleet_spec`]): demand × margin stays
/// under the target, so no backend counts as saturated.
fn policy(
    plan: &FleetPlan,
    name: &str,
    backend: &str,
    selector: Value,
    target: u32,
    max_pending: u32,
) -> anyhow::Result<Value> {
    let mut p = quick_policy()?;
    set(&mut p, "/metadata/name", json!(name))?;
    set(
        &mut p,
        "/spec/gatewaySelector",
        json!({"matchLabels": selector}),
    )?;
    set(
        &mut p,
        "/spec/backends",
        json!([{
            "name": backend,
            "match": {"pathPrefix": "/v1/", "model": backend},
            "endpoints": {"addresses": [{
                "name": format!("{backend}-0"),
                "address": format!("{BACKEND_ADDRESS}:8000"),
            }]},
            // Room for the pinned target over every pod of the selection.
            "capacity": {"maxConnectionsPerEndpoint": target * 2, "headroom": 0.2},
            "pool": {"maxPending": max_pending, "leaseTimeout": "300ms"},
        }]),
    )?;
    set(
        &mut p,
        "/spec/autoscale/interval",
        json!(format!("{}s", plan.interval.as_secs().max(1))),
    )?;
    set(&mut p, "/spec/autoscale/min", json!(target))?;
    set(&mut p, "/spec/autoscale/max", json!(target))?;
    if let Some(clients) = p["spec"]["clients"].as_object_mut() {
        clients.remove("overrides");
        clients.remove("slowCalls");
    }
    Ok(p)
}

/// Group policy `k`: one backend `b-NNNN` on its group's pods, a target of 2 connections per
/// pod, `pool.maxPending` [`GROUP_MAX_PENDING`].
pub fn group_policy(plan: &FleetPlan, k: usize) -> anyhow::Result<Value> {
    group_policy_with(plan, k, GROUP_MAX_PENDING)
}

/// [`group_policy`] with `pool.maxPending` `max_pending` (the change of every policy sets it).
pub fn group_policy_with(plan: &FleetPlan, k: usize, max_pending: u32) -> anyhow::Result<Value> {
    let g = plan.group_of_policy(k);
    let target = 2 * plan.group_size(g).max(1) as u32;
    policy(
        plan,
        &policy_name(k),
        &backend_name(k),
        json!({GROUP_LABEL: group_name(g)}),
        target,
        max_pending,
    )
}

/// The fleet-wide policy: one backend on every pod, a target of 2 connections per pod,
/// `pool.maxPending` `max_pending` (the rollout's edit changes it).
pub fn fleet_policy(plan: &FleetPlan, max_pending: u32) -> anyhow::Result<Value> {
    policy(
        plan,
        FLEET_POLICY,
        FLEET_BACKEND,
        json!({GATEWAY_LABEL.0: GATEWAY_LABEL.1}),
        2 * plan.pods.max(1) as u32,
        max_pending,
    )
}

/// Every policy of the plan, the fleet-wide one last.
pub fn all_policies(plan: &FleetPlan) -> anyhow::Result<Vec<Value>> {
    (0..plan.group_policies())
        .map(|k| group_policy(plan, k))
        .chain(std::iter::once(fleet_policy(plan, FLEET_MAX_PENDING)))
        .collect()
}

/// How many pods policy `name` selects under `plan` (`None`: not one of its policies).
pub fn selected_by(plan: &FleetPlan, name: &str) -> Option<usize> {
    if name == FLEET_POLICY {
        return Some(plan.pods);
    }
    let k: usize = name.strip_prefix("p-")?.parse().ok()?;
    (k < plan.group_policies()).then(|| plan.group_size(plan.group_of_policy(k)))
}

/// The private Prometheus' configuration: the fleet's one scrape target every `interval`, its
/// own `namespace` and `pod` labels kept (`honor_labels`).
pub fn prometheus_config(target: SocketAddr, interval: Duration) -> String {
    let secs = interval.as_secs().max(1);
    // A scrape of 1,000 pods' series takes a while: allow most of the interval.
    let timeout = (secs * 8 / 10).max(1);
    format!(
        "global:\n  scrape_interval: {secs}s\n  scrape_timeout: {timeout}s\n  evaluation_interval: {secs}s\n\
         scrape_configs:\n- job_name: fleet-sim\n  honor_labels: true\n  static_configs:\n  - targets: ['{target}']\n"
    )
}

/// Whether `policy` has settled for `plan`: `Accepted=True` and `RolledOut=True` for its
/// current generation, and every pod it should select selected and updated.
pub fn settled(plan: &FleetPlan, policy: &ConnectionPolicy) -> bool {
    let Some(expected) = policy
        .metadata
        .name
        .as_deref()
        .and_then(|n| selected_by(plan, n))
    else {
        return false;
    };
    let Some(status) = &policy.status else {
        return false;
    };
    let current = |kind: &str| {
        status.conditions.iter().any(|c| {
            c.type_ == kind
                && c.status == "True"
                && c.observed_generation == policy.metadata.generation
        })
    };
    current("Accepted")
        && current("RolledOut")
        && status
            .pods
            .as_ref()
            .is_some_and(|p| p.selected as usize == expected && p.updated as usize == expected)
}

/// Why `policy` has not settled for `plan`, in one line (`None`: it has): its generation,
/// each condition with its generation, reason and message, and its pods.
pub fn unsettled_why(plan: &FleetPlan, policy: &ConnectionPolicy) -> Option<String> {
    if settled(plan, policy) {
        return None;
    }
    let name = policy.metadata.name.as_deref().unwrap_or("?");
    let expected = selected_by(plan, name);
    let Some(status) = &policy.status else {
        return Some(format!("{name}: no status"));
    };
    let conditions: Vec<String> = status
        .conditions
        .iter()
        .map(|c| {
            format!(
                "{}={} (generation {:?}, {}: {})",
                c.type_, c.status, c.observed_generation, c.reason, c.message
            )
        })
        .collect();
    let pods = status.pods.as_ref().map_or("no pods".to_owned(), |p| {
        format!("{} selected, {} updated", p.selected, p.updated)
    });
    Some(format!(
        "{name} generation {:?}, {pods} of {expected:?} expected; {}",
        policy.metadata.generation,
        conditions.join("; ")
    ))
}

/// PromQL queries the operator counted per round, by query (`poolpilot_operator_prometheus_
/// queries_total{query}` ÷ `_rounds_total`) between two `/metrics` texts, and the rounds.
pub fn queries_per_round(before: &str, after: &str) -> (BTreeMap<String, f64>, f64) {
    let rounds = metric_sum(after, "poolpilot_operator_prometheus_rounds_total", &[])
        - metric_sum(before, "poolpilot_operator_prometheus_rounds_total", &[]);
    let mut by_query = BTreeMap::new();
    for query in query_labels(after) {
        let label = format!("query=\"{query}\"");
        let n = metric_sum(
            after,
            "poolpilot_operator_prometheus_queries_total",
            &[&label],
        ) - metric_sum(
            before,
            "poolpilot_operator_prometheus_queries_total",
            &[&label],
        );
        by_query.insert(query, if rounds > 0.0 { n / rounds } else { 0.0 });
    }
    (by_query, rounds)
}

/// The `query` labels of `poolpilot_operator_prometheus_queries_total` in a `/metrics` text.
pub fn query_labels(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("poolpilot_operator_prometheus_queries_total{"))
        .filter_map(|rest| {
            let labels = rest.split_once('}')?.0;
            let q = labels
                .split(',')
                .find_map(|kv| kv.strip_prefix("query=\""))?;
            Some(q.trim_end_matches('"').to_owned())
        })
        .collect()
}

/// Instant queries Prometheus served (`prometheus_http_requests_total{handler="/api/v1/query"}`
/// over every code) in its own `/metrics` text.
pub fn served_queries(text: &str) -> f64 {
    metric_sum(
        text,
        "prometheus_http_requests_total",
        &["handler=\"/api/v1/query\""],
    )
}

/// A process' resident memory in bytes from its `/proc/<pid>/status` text (`VmRSS`, or
/// `VmHWM` for its peak).
pub fn status_bytes(status: &str, field: &str) -> Option<u64> {
    let line = status
        .lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    let kb: u64 = line[field.len() + 1..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// A process' CPU time in seconds (user + system) from its `/proc/<pid>/stat` line (Linux
/// reports it in USER_HZ, 100 per second).
pub fn stat_cpu_seconds(stat: &str) -> Option<f64> {
    // The command name may hold spaces and parentheses: the fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the line, utime 14 and stime 15.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}
