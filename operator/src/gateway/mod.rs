//! The gateways' admin API as the operator calls it: the HTTP client ([`client`]) and the TLS
//! trust it verifies the gateways with ([`tls`]).

pub mod client;
pub mod tls;

pub use client::{Gateways, HttpGateways, MAX_ANSWER_BYTES, PutError, classify};
pub use tls::{GatewayTrust, TrustError};
