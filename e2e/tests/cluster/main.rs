//! The cluster tests: the embedded control plane, its node, Prometheus' discovery, the
//! hermetic routes, the manifests, the Helm chart, the operator under its RBAC, the operator at
//! 100 policies × 50 simulated pods and the product's `/metrics` on the embedded cluster, one
//! module per subject (the scenarios are their own binary, `tests/scenarios/`). One binary, so that they are compiled and linked once and their
//! tests, which mostly wait on the cluster, overlap on the test threads (`make e2e` runs 4).
//!
//! Tests of different modules run at the same time on one cluster: each works in its own
//! namespace ([`poolpilot_e2e::with_namespace`]), names its own cluster-scoped objects after it,
//! applies the shared ones (the CRD, the operator's ClusterRole and admission policy) with
//! [`poolpilot_e2e::Cluster::apply`], which is safe when several tests apply them at once, and
//! takes a lock of [`exclusive`] where a cluster-wide effect must be its own alone.

mod chart;
mod chart_prometheus_operator;
mod chart_values;
mod control_plane;
mod discovery;
mod docs;
mod exclusive;
mod exposition;
mod fleet;
mod hermetic;
mod manifests;
mod node;
mod operator;
mod prometheus_auth;
