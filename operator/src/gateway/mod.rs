//! The gateways' admin API as the operator calls it: the HTTP client ([`client`]) and the TLS
//! trust it verifies the gateways with ([`tls`]).

pub mod client;
pub mod tls;

pub use client::{
    ClientsReport, Gateways, HttpGateways, MAX_ANSWER_BYTES, PolicyClients, PutError, Ranking,
    ReportError, ReportedClient, classify,
};
pub use tls::{GatewayTrust, TrustError};
