//! The operator's own Prometheus metrics: reconciles (count, duration and errors by pipeline
//! step), autoscale decisions by kind, Prometheus query errors, gateway PUT outcomes and the
//! number of policies per condition status. Labels are bounded (step, kind, query, outcome and
//! condition names from code, never object names).

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::runtime::reflector::Store;
use parking_lot::RwLock;
use poolpilot_api::ConnectionPolicy;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::plan::autoscale::Decision;
use crate::plan::conditions::Kind;

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

/// A condition type and status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ConditionLabel {
    /// The condition `type` (`Accepted`, `MetricsAvailable`, ...).
    pub condition: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
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

/// Every metric of the operator.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Reconciles started.
    pub reconciles: Counter,
    /// Reconcile failures by the step that failed.
    pub errors: Family<StepLabel, Counter>,
    /// Time spent per step.
    pub step_duration: Family<StepLabel, Histogram, fn() -> Histogram>,
    /// Autoscale decisions by kind.
    pub decisions: Family<KindLabel, Counter>,
    /// Failed Prometheus queries by query.
    pub query_errors: Family<QueryLabel, Counter>,
    /// Gateway PUTs by outcome.
    pub puts: Family<OutcomeLabel, Counter>,
    /// Policies per condition status (counted at scrape time).
    pub policies: PolicyConditions,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            reconciles: Counter::default(),
            errors: Family::default(),
            step_duration: Family::new_with_constructor(step_histogram),
            decisions: Family::default(),
            query_errors: Family::default(),
            puts: Family::default(),
            policies: PolicyConditions::default(),
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
            "gateway_puts",
            "Limits documents sent to gateway pods, by outcome",
            self.puts.clone(),
        );
        registry.register_collector(Box::new(self.policies.clone()));
        self
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

/// `poolpilot_operator_policies{condition,status}`: how many ConnectionPolicies report each
/// condition status, counted at every scrape from the policy cache of the replica that leads (a
/// standby exports nothing, so `max` over replicas is the fleet's number). While a cache is
/// tracked, the six condition types are exported with `True` and `False` even when no policy has
/// them (zero, not absent).
#[derive(Clone, Debug, Default)]
pub struct PolicyConditions(Arc<RwLock<Option<Store<ConnectionPolicy>>>>);

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
    pub fn track(&self, store: Store<ConnectionPolicy>) -> Tracking {
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
        let counts = condition_counts(policies.iter().map(|p| &**p));
        let mut family = encoder.encode_descriptor(
            "policies",
            "ConnectionPolicies per condition type and status (leader only)",
            None,
            MetricType::Gauge,
        )?;
        for (label, n) in &counts {
            ConstGauge::new(*n).encode(family.encode_family(label)?)?;
        }
        Ok(())
    }
}

/// The number of `policies` per condition type and status; every [`Kind`] appears with `True`
/// and `False` (zero when no policy has it).
pub fn condition_counts<'a>(
    policies: impl IntoIterator<Item = &'a ConnectionPolicy>,
) -> BTreeMap<ConditionLabel, i64> {
    let mut counts = BTreeMap::new();
    for kind in Kind::ALL {
        for status in ["True", "False"] {
            counts.insert(
                ConditionLabel {
                    condition: kind.as_str().to_owned(),
                    status: status.to_owned(),
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
            })
            .or_default() += 1;
    }
    counts
}

/// A decision's metric label.
pub fn decision_kind(d: &Decision) -> &'static str {
    match d {
        Decision::ScaleUp(_) => "scale_up",
        Decision::ScaleDown(_) => "scale_down",
        Decision::Steady { .. } => "steady",
        Decision::LatencyGuard { .. } => "latency_guard",
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
            writer.apply_watcher_event(&watcher::Event::Apply(p));
        }
        assert!(
            !encode(&registry).contains("poolpilot_operator_policies"),
            "a standby (no tracked cache) exports nothing"
        );

        let tracking = m.policies.track(store);
        let out = encode(&registry);
        for line in [
            "# TYPE poolpilot_operator_policies gauge",
            "poolpilot_operator_policies{condition=\"Accepted\",status=\"True\"} 2",
            "poolpilot_operator_policies{condition=\"Accepted\",status=\"False\"} 0",
            "poolpilot_operator_policies{condition=\"MetricsAvailable\",status=\"False\"} 1",
            "poolpilot_operator_policies{condition=\"MetricsAvailable\",status=\"Unknown\"} 1",
            "poolpilot_operator_policies{condition=\"Ready\",status=\"True\"} 0",
        ] {
            assert!(
                out.contains(&format!("{line}\n")),
                "{line:?} missing:\n{out}"
            );
        }
        assert!(!out.contains("name="), "no object names in labels:\n{out}");

        // A policy leaves the cache: the count follows at the next scrape.
        writer.apply_watcher_event(&watcher::Event::Delete(policy("a", &[])));
        let out = encode(&registry);
        assert!(
            out.contains(
                "poolpilot_operator_policies{condition=\"MetricsAvailable\",status=\"False\"} 0\n"
            ),
            "{out}"
        );
        assert!(
            out.contains("poolpilot_operator_policies{condition=\"Accepted\",status=\"True\"} 1\n"),
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
}
