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
pub mod cluster;
pub mod credentials;
pub mod hermetic;
pub mod kubelet;
pub mod load;
pub mod modelsim;
pub mod namespace;
pub mod paths;
pub mod pool_view;
pub mod relay;
pub mod scenario;
pub mod stack;
pub mod standalone;
pub mod wait;

pub use cluster::Cluster;

/// Makes ring the process's TLS crypto provider. Needed by every binary and test before it
/// builds a kube or reqwest client: reqwest is built without a provider of its own (the
/// workspace links one TLS stack, rustls with ring) and takes the process default. Idempotent.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
pub use namespace::{TestNamespace, with_namespace};
pub use wait::{eventually, wait_for};
