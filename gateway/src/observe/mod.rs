//! What the gateway tells its operators: the Prometheus metrics of the contract
//! (`metrics`), the label values they share (`labels`), the incident signals beyond the
//! contract (`incidents`), one access log line per call (`access`), and the logs with their
//! run-time filter ([`logging`]).

pub(crate) mod access;
pub(crate) mod incidents;
pub(crate) mod labels;
pub mod logging;
pub(crate) mod metrics;

pub(crate) use incidents::{NO_CLIENT, Reclaim};
pub(crate) use labels::{
    AdminFile, CloseReason, DownstreamTimeout, Refusal, RetryReason, TimeoutKind, Timing,
    TlsFailure, TlsHandshake,
};
pub(crate) use metrics::CallSignals;
pub use metrics::Metrics;
