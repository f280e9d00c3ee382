//! poolpilot's end-to-end support: drives the embedded Kubernetes control plane the way a user
//! would (processes, kubectl, the Kubernetes API) and gives tests temporary namespaces that dump
//! what happened when a test fails.
//!
//! ```text
//!  test ──► Cluster::shared() ──► reuse DIR/ready, or spawn `cluster up --dir DIR`
//!             │                      (etcd + kube-apiserver + kube-controller-manager)
//!             ├─► client()           kube::Client with the admin identity
//!             ├─► kubectl()          the version-matched kubectl built into the same binary
//!             └─► with_namespace()   temp namespace, dump of pods/events/logs on failure
//! ```

pub mod auth_proxy;
pub mod chart_readme;
pub mod cluster;
pub mod credentials;
mod crypto;
pub mod fleet_bench;
pub mod fleet_sim;
pub mod hermetic;
pub mod load;
pub mod module_graph;
pub mod namespace;
pub mod node_cpu;
pub mod paths;
pub mod pool_view;
pub mod relay;
pub mod scenario;
pub mod stack;
pub mod standalone;
pub mod wait;

pub use cluster::Cluster;
pub use crypto::install_crypto_provider;

pub use namespace::{TestNamespace, with_namespace};
pub use wait::{eventually, wait_for};
