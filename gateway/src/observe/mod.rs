//! What the gateway tells its operators: the Prometheus metrics of the contract
//! ([`metrics`]), the label values they share ([`labels`]), the incident signals beyond the
//! contract ([`incidents`]), one access log line per call ([`access`]), and the logs with their
//! run-time filter ([`logging`]).

pub mod access;
pub mod incidents;
pub mod labels;
pub mod logging;
pub mod metrics;

pub use incidents::{Incidents, NO_CLIENT, Reclaim};
pub use labels::{AdminFile, CloseReason, DownstreamTimeout, Refusal, TimeoutKind, Timing};
pub use metrics::Metrics;
