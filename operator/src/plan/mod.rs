//! The pure planning core: given every policy and gateway pod of one namespace, the latest
//! Prometheus samples, the autoscale memory and `now`, decide the targets, check them against the
//! file-descriptor budget, render one limits document per pod and compute each policy's status.
//! No kube client, no IO, no clock: every decision here is a unit test.
//!
//! ```text
//!  policies + pods + endpoints + samples + memory + now
//!        │
//!   validate ──► conflicts (oldest wins) ──► accepted policies
//!        │
//!   autoscale (per backend, when its interval is due) ──► fleet targets
//!        │
//!   idle timeout under the backend's keep-alive (per backend, from the closes the pods saw)
//!        │
//!   budget: target ÷ holders ──► per-pod shares ──► fd check (clamp) ──► render per pod
//!        │
//!   status (conditions with stable transition times)
//! ```
//!
//! Each step is its own module, and the data they share has its own: [`input`] (what a run is
//! given), [`output`] (what it decides), [`memory`] (what it keeps between runs) and [`time`].
//! Dependencies go one way, from [`fleet`] (the run) down to those leaves; this file only
//! declares the modules and re-exports the planner's public surface.

pub mod autoscale;
pub mod budget;
pub mod clients;
pub mod conditions;
pub mod division;
pub mod fds;
pub mod fleet;
pub mod generations;
pub mod idle_timeout;
pub mod input;
pub mod memo;
pub mod memory;
pub mod observations;
pub mod output;
pub mod priority;
pub mod render;
pub mod selector;
pub mod shares;
pub mod status;
pub mod time;
pub mod tokens;
pub mod validate;
pub mod waves;

#[cfg(test)]
pub(crate) mod tests;

pub use budget::FdReport;
pub use fleet::{plan, plan_with};
pub use generations::{implausible_generations, plausible_generation};
pub use input::{
    Acked, BackendSample, FleetInput, GatewayPod, PodSample, PolicyInput, PolicyKey, Samples,
    SaturationSignal,
};
pub use memory::Memory;
pub use output::{BackendPlan, FleetPlan, MetricsState, PolicyPlan};
pub use time::Timestamp;
