//! A reconcile failure, by the pipeline step that failed, as a metric label and in words.

use super::{observe, rollout, status};
use crate::errors::brief_report;

/// A reconcile failure, by the pipeline step that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Observing the namespace failed.
    #[error("observe step failed")]
    Observe(#[from] observe::ObserveError),
    /// The planner produced no plan for the policy (a bug).
    #[error("plan step failed: {0}")]
    Plan(String),
    /// Rolling out failed.
    #[error("rollout step failed")]
    Rollout(#[from] rollout::RolloutError),
    /// Writing status failed.
    #[error("status step failed")]
    Status(#[from] status::StatusError),
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
