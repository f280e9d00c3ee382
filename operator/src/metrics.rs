//! The operator's own Prometheus metrics: reconciles (count, whole-reconcile duration, duration
//! and errors by pipeline step), autoscale decisions by kind, Prometheus queries sent and failed,
//! Kubernetes API requests by verb, gateway PUT outcomes, the number of policies per condition
//! status and reason, and whether this replica leads. Labels are bounded (step, kind, query, verb,
//! outcome, condition and reason names from code, never object names). The process metrics and
//! `poolpilot_build_info` come from `poolpilot-telemetry`, registered at the root by [`registry`].

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use parking_lot::RwLock;
use poolpilot_api::ConnectionPolicy;
use poolpilot_api::policy::conditions::CONDITIONS;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::plan::autoscale::Decision;
use crate::plan::autoscale::knee::Hold;

/// A pipeline step.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabel {
    /// `observe`, `validate`, `plan`, `rollout`, `status`, `cleanup`.
    pub step: &'static str,
}

/// A decision kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// See [`decision_kind`].
    pub kind: &'static str,
}

/// A Prometheus query.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueryLabel {
    /// The query's name.
    pub query: &'static str,
}

/// A Kubernetes API request's verb.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabel {
    /// See [`kube_verb`].
    pub verb: &'static str,
}

/// A condition type, status and reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ConditionLabel {
    /// The condition `type` (`Accepted`, `MetricsAvailable`, ...).
    pub condition: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// The CamelCase reason (`Halted`, `OverBudget`, ...).
    pub reason: String,
}

/// A gateway PUT outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `acked`, `refused`, `failed`.
    pub outcome: &'static str,
}

fn step_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 14))
}

/// Whole reconciles: 0.5 ms to ~60 s in steps of 1.5×, fine enough for p50/p99 estimates.
fn reconcile_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 1.5, 30))
}

/// Every metric of the operator.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Reconciles started.
    pub reconciles: Counter,
    /// Reconcile failures by the step that failed.
    pub errors: Family<StepLabel, Counter>,
    /// Time spent per step.
    pub step_duration: Family<StepLabel, Histogram, fn() -> Histogram>,
    /// Time spent per whole reconcile (every step, finalizer included).
    pub reconcile_duration: Histogram,
    /// Autoscale decisions by kind.
    pub decisions: Family<KindLabel, Counter>,
    /// Failed Prometheus queries by query.
    pub query_errors: Family<QueryLabel, Counter>,
    /// Prometheus queries sent, by query.
    pub queries: Family<QueryLabel, Counter>,
    /// Rounds of Prometheus queries (one per metrics interval, for every policy).
    pub query_rounds: Counter,
    /// Requests sent to the Kubernetes API, by verb (watches counted when opened).
    pub kube_requests: Family<VerbLabel, Counter>,
    /// Gateway PUTs by outcome.
    pub puts: Family<OutcomeLabel, Counter>,
    /// Policies per condition status and reason (counted at scrape time).
    pub policies: PolicyConditions,
    /// 1 while this replica holds the leader lease, else 0.
    pub leader: Gauge,
    /// Generations read back that were too large to be real, and ignored.
    pub generations_ignored: Counter,
    /// Reconciles by how they got their namespace's plan: a pass planned for them (and every
    /// reconcile waiting with them), or the last one reused (nothing it was made from changed).
    pub passes: Family<OutcomeLabel, Counter>,
    /// Status writes by outcome: written, or deferred (only observations moved, and the
    /// policy's turn to refresh them has not come).
    pub status_writes: Family<OutcomeLabel, Counter>,
    /// How late each periodic reconcile was handed to the Controller (its time came while every
    /// reconcile slot was taken).
    pub requeue_lag: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            reconciles: Counter::default(),
            errors: Family::default(),
            step_duration: Family::new_with_constructor(step_histogram),
            reconcile_duration: reconcile_histogram(),
            decisions: Family::default(),
            query_errors: Family::default(),
            queries: Family::default(),
            query_rounds: Counter::default(),
            kube_requests: Family::default(),
            puts: Family::default(),
            policies: PolicyConditions::default(),
            leader: Gauge::default(),
            generations_ignored: Counter::default(),
            passes: Family::default(),
            status_writes: Family::default(),
            requeue_lag: reconcile_histogram(),
        }
    }
}

impl Metrics {
    /// Registers every metric under `registry` (prefix it `poolpilot_operator`).
    pub fn register(self, registry: &mut Registry) -> Self {
        registry.register("reconciles", "Reconciles started", self.reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Reconcile failures by pipeline step",
            self.errors.clone(),
        );
        registry.register(
            "step_duration_seconds",
            "Time spent per pipeline step",
            self.step_duration.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time spent per whole reconcile",
            self.reconcile_duration.clone(),
        );
        registry.register(
            "decisions",
            "Autoscale decisions by kind",
            self.decisions.clone(),
        );
        registry.register(
            "prometheus_query_errors",
            "Failed Prometheus queries",
            self.query_errors.clone(),
        );
        registry.register(
            "prometheus_queries",
            "PromQL queries sent to Prometheus, by query",
            self.queries.clone(),
        );
        registry.register(
            "prometheus_rounds",
            "Rounds of batched PromQL queries (one per metrics interval for every policy)",
            self.query_rounds.clone(),
        );
        registry.register(
            "kube_requests",
            "Requests sent to the Kubernetes API, by verb (a watch counts once, when opened)",
            self.kube_requests.clone(),
        );
        registry.register(
            "gateway_puts",
            "Limits documents sent to gateway pods, by outcome",
            self.puts.clone(),
        );
        registry.register(
            "generations_ignored",
            "Generations read back (ConfigMap annotations, pod answers, statuses) too large to be real, and ignored",
            self.generations_ignored.clone(),
        );
        registry.register(
            "namespace_passes",
            "Namespace plans reconciles got, by outcome: planned (a pass for every reconcile waiting), reused (nothing it was made from changed) or private (the policy handed over is newer than the cache: planned on its own)",
            self.passes.clone(),
        );
        registry.register(
            "status_writes",
            "Status writes by outcome: written, or deferred (only the observations moved and the policy's refresh, --status-refresh-rate, is not due)",
            self.status_writes.clone(),
        );
        registry.register(
            "requeue_lag_seconds",
            "How late periodic reconciles were handed to the controller: above zero, every reconcile slot was taken when their time came",
            self.requeue_lag.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader lease and reconciles, 0 on a standby",
            self.leader.clone(),
        );
        registry.register_collector(Box::new(self.policies.clone()));
        self
    }

    /// A request mapper for the Kubernetes client's service stack
    /// (`tower::util::MapRequestLayer`) that counts every request by verb.
    pub fn kube_request_counter<B>(
        &self,
    ) -> impl Fn(http::Request<B>) -> http::Request<B> + Clone + use<B> {
        let requests = self.kube_requests.clone();
        move |req| {
            let verb = kube_verb(req.method(), req.uri().query());
            requests.get_or_create(&VerbLabel { verb }).inc();
            req
        }
    }

    /// Marks this replica the leader (`poolpilot_operator_leader` 1) and counts policies from
    /// `store`, until the returned guard is dropped at the end of the term.
    #[must_use = "the term ends when the guard is dropped"]
    pub fn leading(&self, store: Store<DeserializeGuard<ConnectionPolicy>>) -> Leading {
        self.leader.set(1);
        Leading {
            leader: self.leader.clone(),
            _tracking: self.policies.track(store),
        }
    }

    /// Counts one re-division of a target over the same pods (`kind="rebalance"`).
    pub fn rebalance(&self) {
        self.decisions
            .get_or_create(&KindLabel { kind: "rebalance" })
            .inc();
    }

    /// Counts one decision.
    pub fn decision(&self, d: &Decision) {
        self.decisions
            .get_or_create(&KindLabel {
                kind: decision_kind(d),
            })
            .inc();
    }
}

/// The operator's registry: the process metrics and `poolpilot_build_info` at the root, every
/// family of `metrics` under `poolpilot_operator_`.
pub fn registry(metrics: Metrics) -> (Registry, Metrics) {
    let mut root = Registry::default();
    poolpilot_telemetry::register(&mut root);
    let metrics = metrics.register(root.sub_registry_with_prefix("poolpilot_operator"));
    (root, metrics)
}

/// `poolpilot_operator_policies{condition,status,reason}`: how many ConnectionPolicies report
/// each condition status with each reason, counted at every scrape from the policy cache of the
/// replica that leads (a standby exports nothing, so `max` over replicas is the fleet's number).
/// While a cache is tracked, every documented (type, status, reason) is exported even when no
/// policy has it (zero, not absent), so that alerts on `RolledOut=False/Halted` or `Ready=False`
/// see a 0 rather than nothing.
#[derive(Clone, Debug, Default)]
pub struct PolicyConditions(Arc<RwLock<Option<Store<DeserializeGuard<ConnectionPolicy>>>>>);

/// A leadership term: sets `poolpilot_operator_leader` back to 0 and stops counting policies
/// when dropped.
#[derive(Debug)]
pub struct Leading {
    leader: Gauge,
    _tracking: Tracking,
}

impl Drop for Leading {
    fn drop(&mut self) {
        self.leader.set(0);
    }
}

/// Stops the tracking of a policy cache when dropped (the leadership term ended).
#[derive(Debug)]
pub struct Tracking(PolicyConditions);

impl Drop for Tracking {
    fn drop(&mut self) {
        *self.0.0.write() = None;
    }
}

impl PolicyConditions {
    /// Counts from `store` until the returned guard is dropped.
    #[must_use = "tracking stops when the guard is dropped"]
    pub fn track(&self, store: Store<DeserializeGuard<ConnectionPolicy>>) -> Tracking {
        *self.0.write() = Some(store);
        Tracking(self.clone())
    }
}

impl Collector for PolicyConditions {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(store) = self.0.read().clone() else {
            return Ok(());
        };
        let policies = store.state();
        let counts = condition_counts(policies.iter().filter_map(|p| p.0.as_ref().ok()));
        let mut family = encoder.encode_descriptor(
            "policies",
            "ConnectionPolicies per condition type and status (leader only)",
            None,
            MetricType::Gauge,
        )?;
        for (label, n) in &counts {
            ConstGauge::new(*n).encode(family.encode_family(label)?)?;
        }
        let unreadable = policies.iter().filter(|p| p.0.is_err()).count();
        ConstGauge::new(unreadable as i64).encode(encoder.encode_descriptor(
            "policies_unreadable",
            "ConnectionPolicies this operator cannot read (skipped; each has an InvalidPolicy Event) (leader only)",
            None,
            MetricType::Gauge,
        )?)?;
        Ok(())
    }
}

/// The number of `policies` per condition type, status and reason; every documented
/// (type, status, reason) of [`CONDITIONS`] appears (zero when no policy has it).
pub fn condition_counts<'a>(
    policies: impl IntoIterator<Item = &'a ConnectionPolicy>,
) -> BTreeMap<ConditionLabel, i64> {
    let mut counts = BTreeMap::new();
    for doc in CONDITIONS {
        for r in doc.reasons {
            counts.insert(
                ConditionLabel {
                    condition: doc.type_.to_owned(),
                    status: r.status.to_owned(),
                    reason: r.reason.to_owned(),
                },
                0,
            );
        }
    }
    for c in policies
        .into_iter()
        .filter_map(|p| p.status.as_ref())
        .flat_map(|s| &s.conditions)
    {
        *counts
            .entry(ConditionLabel {
                condition: c.type_.clone(),
                status: c.status.clone(),
                reason: c.reason.clone(),
            })
            .or_default() += 1;
    }
    counts
}

/// The verb of a Kubernetes API request: `watch` (a GET with `watch=true` or `watch=1`), `get`
/// (reads and lists), `create`, `update`, `patch`, `delete` or `other`.
pub fn kube_verb(method: &http::Method, query: Option<&str>) -> &'static str {
    let watch = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    match *method {
        http::Method::GET if watch => "watch",
        http::Method::GET => "get",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE => "delete",
        _ => "other",
    }
}

/// A decision's metric label.
pub fn decision_kind(d: &Decision) -> &'static str {
    match d {
        Decision::ScaleUp(_) => "scale_up",
        Decision::ScaleDown(_) => "scale_down",
        Decision::StepBack(_) => "step_back",
        Decision::Steady { .. } => "steady",
        Decision::WithinDeadband { .. } => "within_deadband",
        Decision::Held { hold, .. } => match hold {
            Hold::BackendSaturated { .. } => "backend_saturated",
            Hold::SaturationPending => "saturation_pending",
            Hold::Judging { .. } => "judging",
            Hold::AtKnee(_) => "at_knee",
            Hold::AtCeiling(_) => "at_backend_queue",
            Hold::Measuring { .. } => "measuring_knee",
        },
        Decision::AtUpperBound { .. } => "at_upper_bound",
        Decision::Stabilizing { .. } => "stabilizing",
        Decision::MissingData { .. } => "missing_data",
        Decision::Recovering { .. } => "recovering",
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::{reflector, watcher};
    use serde_json::json;

    use super::*;

    fn policy(name: &str, conditions: &[(&str, &str)]) -> ConnectionPolicy {
        let conditions: Vec<_> = conditions
            .iter()
            .map(|(t, s)| {
                json!({"type": t, "status": s, "reason": "Test", "message": "",
                       "lastTransitionTime": "2026-01-01T00:00:00Z"})
            })
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "poolpilot.io/v1alpha1",
            "kind": "ConnectionPolicy",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {
                "gatewaySelector": {"matchLabels": {"app": "gw"}},
                "backends": [{
                    "name": "model-a",
                    "endpoints": {"addresses": [{"name": "a-0", "address": "10.0.0.10:8000"}]},
                    "capacity": {"maxConnectionsPerEndpoint": 64},
                }],
            },
            "status": {"conditions": conditions},
        }))
        .expect("test policy parses")
    }

    fn encode(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn policies_are_counted_per_condition_status_while_tracked() {
        let mut registry = Registry::with_prefix("poolpilot_operator");
        let m = Metrics::default().register(&mut registry);
        let (store, mut writer) = reflector::store();
        for p in [
            policy("a", &[("Accepted", "True"), ("MetricsAvailable", "False")]),
            policy(
                "b",
                &[("Accepted", "True"), ("MetricsAvailable", "Unknown")],
            ),
            policy("c", &[]),
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(DeserializeGuard(Ok(p))));
        }
        // One this operator cannot read: counted apart.
        let mut unreadable = serde_json::to_value(policy("d", &[])).unwrap();
        unreadable["spec"]["rollout"] = serde_json::json!({"strategy": "BlueGreen"});
        writer.apply_watcher_event(&watcher::Event::Apply(
            serde_json::from_value::<DeserializeGuard<ConnectionPolicy>>(unreadable).unwrap(),
        ));
        assert!(
            !encode(&registry).contains("poolpilot_operator_policies"),
            "a standby (no tracked cache) exports nothing"
        );

        let tracking = m.policies.track(store);
        let out = encode(&registry);
        for line in [
            "# TYPE poolpilot_operator_policies gauge",
            "poolpilot_operator_policies{condition=\"Accepted\",status=\"True\",reason=\"Test\"} 2",
            "poolpilot_operator_policies{condition=\"Accepted\",status=\"False\",reason=\"Invalid\"} 0",
            "poolpilot_operator_policies{condition=\"MetricsAvailable\",status=\"False\",reason=\"Test\"} 1",
            "poolpilot_operator_policies{condition=\"MetricsAvailable\",status=\"Unknown\",reason=\"Test\"} 1",
            "poolpilot_operator_policies{condition=\"Ready\",status=\"True\",reason=\"Ready\"} 0",
            "poolpilot_operator_policies{condition=\"RolledOut\",status=\"False\",reason=\"Halted\"} 0",
            "poolpilot_operator_policies_unreadable 1",
        ] {
            assert!(
                out.contains(&format!("{line}\n")),
                "{line:?} missing:\n{out}"
            );
        }
        assert!(!out.contains("name="), "no object names in labels:\n{out}");

        // A policy leaves the cache: the count follows at the next scrape.
        writer.apply_watcher_event(&watcher::Event::Delete(DeserializeGuard(Ok(policy(
            "a",
            &[],
        )))));
        let out = encode(&registry);
        // An undocumented reason is counted while some policy has it, and then goes.
        assert!(
            !out.contains("condition=\"MetricsAvailable\",status=\"False\",reason=\"Test\""),
            "{out}"
        );
        assert!(
            out.contains(
                "poolpilot_operator_policies{condition=\"Accepted\",status=\"True\",reason=\"Test\"} 1\n"
            ),
            "{out}"
        );

        drop(tracking);
        assert!(
            !encode(&registry).contains("poolpilot_operator_policies"),
            "the term ended: nothing exported"
        );
    }

    #[test]
    fn metrics_encode_with_the_prefix() {
        let mut registry = Registry::with_prefix("poolpilot_operator");
        let m = Metrics::default().register(&mut registry);
        m.reconciles.inc();
        m.errors.get_or_create(&StepLabel { step: "rollout" }).inc();
        m.decision(&Decision::Steady { recommendation: 3 });
        m.step_duration
            .get_or_create(&StepLabel { step: "plan" })
            .observe(0.002);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(
            out.contains("poolpilot_operator_reconciles_total 1"),
            "{out}"
        );
        assert!(
            out.contains("poolpilot_operator_reconcile_errors_total{step=\"rollout\"} 1"),
            "{out}"
        );
        assert!(
            out.contains("poolpilot_operator_decisions_total{kind=\"steady\"} 1"),
            "{out}"
        );
        assert!(
            out.contains("poolpilot_operator_step_duration_seconds_count{step=\"plan\"} 1"),
            "{out}"
        );
    }

    #[test]
    fn kube_requests_are_counted_by_verb() {
        let mut registry = Registry::with_prefix("poolpilot_operator");
        let m = Metrics::default().register(&mut registry);
        let count = m.kube_request_counter::<()>();
        let request = |method: http::Method, uri: &str| {
            http::Request::builder()
                .method(method)
                .uri(uri)
                .body(())
                .unwrap()
        };
        for (method, uri) in [
            (
                http::Method::GET,
                "/api/v1/namespaces/ns/pods?labelSelector=a%3Db",
            ),
            (http::Method::GET, "/api/v1/namespaces/ns/secrets/token"),
            (
                http::Method::GET,
                "/api/v1/pods?watch=true&resourceVersion=1",
            ),
            (
                http::Method::PATCH,
                "/apis/poolpilot.io/v1alpha1/namespaces/ns/connectionpolicies/p/status",
            ),
            (
                http::Method::POST,
                "/apis/events.k8s.io/v1/namespaces/ns/events",
            ),
        ] {
            let req = count(request(method.clone(), uri));
            assert_eq!(req.method(), method, "the request passes unchanged");
        }
        let out = encode(&registry);
        for line in [
            "poolpilot_operator_kube_requests_total{verb=\"get\"} 2",
            "poolpilot_operator_kube_requests_total{verb=\"watch\"} 1",
            "poolpilot_operator_kube_requests_total{verb=\"patch\"} 1",
            "poolpilot_operator_kube_requests_total{verb=\"create\"} 1",
        ] {
            assert!(
                out.contains(&format!("{line}\n")),
                "{line:?} missing:\n{out}"
            );
        }
        assert_eq!(kube_verb(&http::Method::GET, Some("watch=false")), "get");
        assert_eq!(kube_verb(&http::Method::GET, Some("a=1&watch=1")), "watch");
        assert_eq!(kube_verb(&http::Method::PUT, None), "update");
        assert_eq!(kube_verb(&http::Method::DELETE, None), "delete");
        assert_eq!(kube_verb(&http::Method::HEAD, None), "other");
    }

    #[test]
    fn queries_rounds_reconciles_and_the_leader_are_exported() {
        let mut registry = Registry::with_prefix("poolpilot_operator");
        let m = Metrics::default().register(&mut registry);
        m.query_rounds.inc();
        m.queries
            .get_or_create(&QueryLabel { query: "leased" })
            .inc_by(2);
        m.reconcile_duration.observe(0.003);
        m.leader.set(1);
        let out = encode(&registry);
        for line in [
            "poolpilot_operator_prometheus_rounds_total 1",
            "poolpilot_operator_prometheus_queries_total{query=\"leased\"} 2",
            "poolpilot_operator_reconcile_duration_seconds_count 1",
            "poolpilot_operator_reconcile_duration_seconds_bucket{le=\"0.0005\"} 0",
            "poolpilot_operator_leader 1",
        ] {
            assert!(
                out.contains(&format!("{line}\n")),
                "{line:?} missing:\n{out}"
            );
        }
    }

    #[test]
    fn the_registry_has_the_process_metrics_and_the_build_at_the_root() {
        let (registry, m) = registry(Metrics::default());
        m.reconciles.inc();
        let out =
            poolpilot_telemetry::exposition::encode(&registry, poolpilot_telemetry::Format::Text);
        for needle in [
            "\nprocess_resident_memory_bytes ",
            "\nprocess_open_fds ",
            "\nprocess_cpu_seconds_total ",
            "\npoolpilot_build_info{version=",
            "\npoolpilot_operator_reconciles_total 1\n",
            "# TYPE poolpilot_operator_reconciles_total counter\n",
        ] {
            assert!(out.contains(needle), "{needle:?} missing:\n{out}");
        }
        assert!(!out.contains("poolpilot_operator_process_"), "{out}");
    }

    #[test]
    fn every_documented_reason_is_counted_even_at_zero() {
        let counts = condition_counts([]);
        let documented: usize = CONDITIONS.iter().map(|c| c.reasons.len()).sum();
        assert_eq!(counts.len(), documented);
        assert!(counts.values().all(|n| *n == 0));
    }
}
