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
pub mod client;
pub mod clock;
pub mod controller;
pub mod errors;
pub mod gateway;
pub mod metrics;
pub mod plan;
pub mod prom;
pub mod prom_connection;
pub mod reconcile;
pub mod telemetry;

pub use client::http_client;
pub use errors::{brief_report, report};
pub use reconcile::{Error, Result};
