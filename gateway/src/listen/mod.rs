//! The client-facing listener: accepting connections under the total and per-source caps,
//! serving each with hyper (HTTP/1.1, or h2 with prior knowledge) under the limits of its
//! accept, parking idle HTTP/1 keep-alive connections outside hyper, cutting connections and h2
//! streams at their deadlines, and the graceful drain on shutdown. Each request goes to
//! `crate::proxy`.
//!
//! ```text
//!  accept ─► PROXY v2 header (from a trusted proxy) ─► admit (per-source cap, else 429)
//!    │
//!    ▼  a task per connection: its first bytes
//!  HTTP/2 preface ─► h2: hyper-util auto, each stream cut at its deadlines
//!  else HTTP/1    ─► h1: hyper  ──── no request in flight (PARK_AFTER) ───►  parked: a bare
//!                          ▲                                                  socket, idle
//!                          └──────────────────── readable ───────────────────  deadline
//! ```
//!
//! | file | owns |
//! |---|---|
//! | `accept.rs` | bind (the kernel's backlog), the accept loop, PROXY v2 from trusted proxies, `429` answers to refused connections, drain |
//! | `registry.rs` | the open connections, total and per source; the per-source cap; the answer budget of refusals |
//! | `connection.rs` | one connection's life: HTTP/2 or HTTP/1 by its first bytes, then served and parked in turn |
//! | `conn_limits.rs` | the limits a connection keeps from its accept on |
//! | `h1.rs` | an HTTP/1 connection in hyper: idle timeout, parking, drain, cuts at deadlines and send stalls |
//! | `h2.rs` | an h2 connection: streams, pings, idle timeout, each stream cut at its deadlines |
//! | `parking.rs` | an idle keep-alive connection outside hyper |
//! | `activity.rs` | what a connection's task knows of it: bytes moved, requests in flight, stalled writes |
//! | `service.rs` | the hyper service: request id, access record, deadline slot, the proxy pipeline |
//! | `source.rs` | where a client comes from: `source::Peer`, PROXY v2, `X-Forwarded-For`, IPv6 /64 grouping |

mod accept;
mod activity;
mod conn_limits;
mod connection;
mod h1;
mod h2;
mod parking;
mod registry;
mod service;
pub(crate) mod source;

pub(crate) use accept::{bind, drain, serve};
pub use parking::{PARK_AFTER, PARK_EAGERLY_ABOVE};
pub(crate) use registry::Connections;
