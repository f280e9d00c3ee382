//! The gateway's loopback integration tests, one test binary: the real gateway (in-process, or
//! the real binary where a test needs a process of its own) against small backends on
//! 127.0.0.1, each module one area. One crate rather than one per file: `support` is compiled
//! once, one binary is linked, and the tests of every module run side by side in one process
//! (`cargo test -p poolpilot-gateway --test loopback -- admin::` runs one module).
//!
//! What the modules share in that process, and how they keep out of each other's way: each
//! test starts its own gateway and backends on ports the kernel picks (127.0.0.1:0); the one
//! process-wide logger, which `operability`'s log-level test installs, is told apart by request
//! id and turned off again when that test ends; the file-descriptor limit is the process's
//! (`hardening` holds 10,000 client sockets in it for one test).

#[macro_use]
mod support;

mod admin;
mod admin_access;
mod bodies;
mod burst;
mod clients;
mod conformance;
mod credentials;
mod deadlines;
mod dns;
mod fair;
mod h2_upstream;
mod hardening;
mod health;
mod identity;
mod openai_sdk;
mod operability;
mod parking;
mod peers;
mod pool;
mod priority;
mod reused;
mod signals;
mod soft_throttle;
mod timeouts;
mod tokens;
mod upstream_framing;
mod upstream_tls;
