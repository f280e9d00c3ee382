//! The cluster tests: the embedded control plane, the local kubelet, Prometheus' discovery, the
//! hermetic routes, the manifests, the Helm chart, the operator under its RBAC and the product's
//! `/metrics` on the embedded cluster, one module per subject (the scenarios are their own
//! binary, `tests/scenarios/`). One binary, so that they are compiled and linked once and their
//! tests, which mostly wait on the cluster, overlap on the test threads (`make e2e` runs 4).

mod chart;
mod control_plane;
mod discovery;
mod exposition;
mod hermetic;
mod kubelet;
mod manifests;
mod operator;
mod prometheus_auth;
