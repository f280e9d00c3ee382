//! The reconciler: one ConnectionPolicy at a time, as a named pipeline
//!
//! ```text
//!  clients (gateways, read) → observe (caches) → validate (pure) → plan (pure)
//!      → roll out (API + gateways) → status (API)
//! ```
//!
//! Observe, validate and plan read the whole namespace, so the reconciles of a namespace share
//! them: one [`pass`] plans for every reconcile waiting, and the last one serves while nothing
//! it was made from changed.
//!
//! Each step is its own module with its own error type. A policy that fails validation skips the
//! rollout and reports `Accepted=False`; one in `mode: Recommend` (shadow mode) is planned the
//! same way and its plan published instead of rolled out; deleting a policy runs the cleanup (its backends leave
//! the gateways) behind a finalizer. A policy this operator cannot even read (written under a
//! newer CRD, say) is reported in an `InvalidPolicy` Event and skipped: the others go on.
//!
//! Each step is its own module with its own error type; [`pipeline`] runs them in order over
//! the shared [`context`], and [`error`] names the step that failed. This file declares the
//! modules, re-exports the reconciler's public surface and holds [`cpu_bound`], which the steps
//! share.

pub mod backoff;
pub mod clients;
pub mod context;
pub mod error;
pub mod events;
pub mod observe;
pub mod observed;
pub mod pass;
pub mod pipeline;
pub mod queue;
pub mod refresh;
pub mod rollout;
pub mod samples;
pub mod status;
pub mod validate;
pub mod world;

#[cfg(test)]
mod tests;

/// Runs CPU-bound work (planning a namespace with many policies takes a while), or a wait for
/// the memory lock such work holds, without holding up the runtime's other tasks, `/healthz`
/// among them: on the multi-threaded runtime the worker hands its other tasks over first. (The
/// current-thread runtime of unit tests just runs it.)
pub(crate) fn cpu_bound<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

pub use context::{
    Config, Context, DEFAULT_ROLLOUT_CONCURRENCY, FIELD_MANAGER, PushBound, RolloutMemory,
    SentDocuments, Stores,
};
pub use error::{Error, Result};
pub use events::{event_note, implausible_generation_event, unreadable_event};
pub use pipeline::{
    FINALIZER, error_policy, failure_event, reconcile, reconcile_object, skip_unreadable,
};
