//! The reconciler: one ConnectionPolicy at a time, as a named pipeline
//!
//! ```text
//!  observe (caches) → clients (gateways, read) → validate (pure) → plan (pure)
//!      → roll out (API + gateways) → status (API)
//! ```
//!
//! Each step is its own module with its own error type. A policy that fails validation skips the
//! rollout and reports `Accepted=False`; one in `mode: Recommend` (shadow mode) is planned the
//! same way and its plan published instead of rolled out; deleting a policy runs the cleanup (its backends leave
//! the gateways) behind a finalizer. A policy this operator cannot even read (written under a
//! newer CRD, say) is reported in an `InvalidPolicy` Event and skipped: the others go on.
//!
//! Each step is its own module with its own error type; [`pipeline`] runs them in order over
//! the shared [`context`], and [`error`] names the step that failed. This file only declares
//! the modules and re-exports the reconciler's public surface.

pub mod backoff;
pub mod clients;
pub mod context;
pub mod error;
pub mod events;
pub mod observe;
pub mod pipeline;
pub mod rollout;
pub mod status;
pub mod validate;

#[cfg(test)]
mod tests;

pub use context::{
    Config, Context, DEFAULT_ROLLOUT_CONCURRENCY, FIELD_MANAGER, PushBound, RolloutMemory,
    SentDocuments, Stores,
};
pub use error::{Error, Result};
pub use events::{event_note, implausible_generation_event, unreadable_event};
pub use pipeline::{
    FINALIZER, error_policy, failure_event, reconcile, reconcile_object, skip_unreadable,
};
