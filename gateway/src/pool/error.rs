//! Why a lease failed ([`PoolError`]): each variant that tells the client to come back carries
//! the `Retry-After` the pool computed.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Why a lease failed. Every variant that tells the client to come back carries a computed
/// `retry_after`.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// `maxPending` lease requests are already waiting.
    #[error("connection pool queue of backend {backend} is full ({pending} waiting)")]
    QueueFull {
        /// The backend.
        backend: Arc<str>,
        /// Waiters at the time.
        pending: usize,
        /// When a retry is likely to find room.
        retry_after: Duration,
    },
    /// No connection freed up within `leaseTimeout`.
    #[error("no connection to backend {backend} became free within {waited:?}")]
    LeaseTimeout {
        /// The backend.
        backend: Arc<str>,
        /// How long the request waited.
        waited: Duration,
        /// When a retry is likely to find room.
        retry_after: Duration,
    },
    /// Every endpoint is unhealthy, ejected or removed.
    #[error("backend {backend} has no healthy endpoint")]
    NoHealthyEndpoint {
        /// The backend.
        backend: Arc<str>,
        /// When an endpoint is expected back (ejection end or probes passing).
        retry_after: Duration,
    },
    /// Connecting took longer than `connectTimeout`.
    #[error("connecting to {endpoint} ({address}) timed out after {timeout:?}")]
    ConnectTimeout {
        /// The endpoint name.
        endpoint: Arc<str>,
        /// Its address.
        address: SocketAddr,
        /// The timeout in force.
        timeout: Duration,
    },
    /// Connecting failed.
    #[error("connecting to {endpoint} ({address}) failed")]
    Connect {
        /// The endpoint name.
        endpoint: Arc<str>,
        /// Its address.
        address: SocketAddr,
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// The backend was removed from the limits while the request waited.
    #[error("backend {backend} was removed")]
    Retired {
        /// The backend.
        backend: Arc<str>,
    },
}

impl PoolError {
    /// The endpoint a connect failure is about, for outlier detection.
    pub fn endpoint(&self) -> Option<&str> {
        match self {
            Self::ConnectTimeout { endpoint, .. } | Self::Connect { endpoint, .. } => {
                Some(endpoint)
            }
            _ => None,
        }
    }
}
