//! poolpilot's operator: tunes each ConnectionPolicy's connection-pool targets from Prometheus,
//! checks them against the gateway pods' file-descriptor limits and rolls the rendered limits
//! out, pod by pod, telling the user in status what it did and why.
//!
//! ```text
//!   watches (policies, pods, EndpointSlices, ConfigMaps)      PromQL every interval (prom)
//!                 │                                                   │
//!                 ▼                                                   ▼
//!   reconcile: observe → validate → plan → roll out → status    Snapshot (shared)
//!                         └─ plan: pure, `now` passed in ─┘
//!                 │                        │                  │
//!                 ▼                        ▼                  ▼
//!        ConfigMap (SSA, owned)   PUT /v1/limits per pod   status (SSA) + Events
//! ```
//!
//! [`plan`] is the pure planning core (no client, no IO, no clock); [`reconcile`] runs the
//! pipeline around it; [`controller`] wires watches, leader election, the Prometheus poller and
//! the `/metrics` + `/healthz` server.

pub mod admin;
pub mod args;
pub mod clock;
pub mod controller;
pub mod gateway;
pub mod metrics;
pub mod plan;
pub mod prom;
pub mod prom_connection;
pub mod reconcile;
pub mod telemetry;

/// A reconcile failure, by the pipeline step that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Observing the namespace failed.
    #[error("observe step failed")]
    Observe(#[from] reconcile::observe::ObserveError),
    /// The planner produced no plan for the policy (a bug).
    #[error("plan step failed: {0}")]
    Plan(String),
    /// Rolling out failed.
    #[error("rollout step failed")]
    Rollout(#[from] reconcile::rollout::RolloutError),
    /// Writing status failed.
    #[error("status step failed")]
    Status(#[from] reconcile::status::StatusError),
    /// Adding or removing the finalizer failed, or the cleanup behind it did.
    #[error("finalizer failed")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

impl Error {
    /// The step that failed, as a bounded metric label.
    pub fn step(&self) -> &'static str {
        match self {
            Self::Observe(_) => "observe",
            Self::Plan(_) => "plan",
            Self::Rollout(_) => "rollout",
            Self::Status(_) => "status",
            Self::Finalizer(e) => match &**e {
                kube::runtime::finalizer::Error::ApplyFailed(inner)
                | kube::runtime::finalizer::Error::CleanupFailed(inner) => inner.step(),
                _ => "finalizer",
            },
        }
    }

    /// What failed, for people (the note of a `ReconcileFailed` Event): the step and the causes
    /// below it, without the finalizer's wrapping and with each Kubernetes API error given once,
    /// as the apiserver's message and reason. For example `rollout step failed: failed to apply
    /// ConfigMap models-limits: configmaps "models-limits" is forbidden: User "..." cannot create
    /// resource "configmaps" ...: Forbidden`.
    pub fn describe(&self) -> String {
        use kube::runtime::finalizer::Error as F;
        let step = self.step();
        match self {
            Self::Observe(e) => format!("{step} step failed: {}", brief_report(e)),
            Self::Plan(why) => format!("{step} step failed: {why}"),
            Self::Rollout(e) => format!("{step} step failed: {}", brief_report(e)),
            Self::Status(e) => format!("{step} step failed: {}", brief_report(e)),
            Self::Finalizer(e) => match &**e {
                F::ApplyFailed(inner) | F::CleanupFailed(inner) => inner.describe(),
                F::AddFinalizer(e) => {
                    format!(
                        "{step} step failed: failed to add the finalizer: {}",
                        brief_report(e)
                    )
                }
                F::RemoveFinalizer(e) => format!(
                    "{step} step failed: failed to remove the finalizer: {}",
                    brief_report(e)
                ),
                other => format!("{step} step failed: {other}"),
            },
        }
    }
}

/// Result with the reconcile [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error with its whole `source()` chain, for logs and status messages.
pub fn report(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Like [`report`], for people: a Kubernetes API error ends the chain with the apiserver's
/// message and reason only (kube's own text repeats the message, then dumps the whole Status).
pub fn brief_report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = Vec::new();
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(kube::Error::Api(status)) = c.downcast_ref::<kube::Error>() {
            parts.push(status.to_string());
            break;
        }
        parts.push(c.to_string());
        cur = c.source();
    }
    parts.join(": ")
}

/// The builder of every HTTP client the operator makes (to gateways, to Prometheus): reqwest on
/// rustls with ring, the workspace's one TLS stack. reqwest is built without a crypto provider
/// of its own, so ring becomes the process default here (idempotent) before any client is built.
pub fn http_client() -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
}
