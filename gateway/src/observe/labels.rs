//! Label values shared by the metrics and the modules that report them: why a pooled
//! connection closed, and how a call came back after a refusal. A leaf: it imports nothing of the
//! crate, so that the pool, the signals and the metrics can all name them without importing each
//! other.

use std::fmt;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};

/// Why a pooled connection was closed (`reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// Idle longer than `idleTimeout`.
    Idle,
    /// Older than `maxLifetime`.
    Lifetime,
    /// The backend closed it.
    PeerClosed,
    /// It failed the validate-after-idle check.
    ValidateFailed,
    /// The cap shrank below the open count.
    Shrink,
    /// A call on it failed or was cut short.
    Error,
    /// A call on it timed out.
    Timeout,
    /// Its endpoint or backend left the limits.
    Removed,
    /// Its endpoint was drained by hand.
    Drained,
}

impl CloseReason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Lifetime => "lifetime",
            Self::PeerClosed => "peer_closed",
            Self::ValidateFailed => "validate_failed",
            Self::Shrink => "shrink",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Removed => "removed",
            Self::Drained => "drained",
        }
    }
}

impl EncodeLabelValue for CloseReason {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        self.as_str().encode(encoder)
    }
}

/// How a call came back after a refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// Before its `Retry-After` passed.
    Early,
    /// After.
    OnTime,
}

impl Timing {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Early => "early",
            Self::OnTime => "on_time",
        }
    }
}
