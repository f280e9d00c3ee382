//! Label values shared by the metrics and the modules that report them: why a pooled
//! connection closed, how an upstream TLS handshake went or failed, how a call came back after a refusal, which timeout cut a call (the
//! backend's or the client's), what became of a connection over its source's cap, which
//! admin file changed, and which tokens a count is of and where it came from. A leaf: it imports nothing of the crate, so that the pool, the listener,
//! the proxy, the incident signals and the metrics can all name them without importing each
//! other (`e2e/src/module_graph.rs` holds it to that).

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
    /// Returned beyond the share (a burst connection) with no lease request to take it.
    Burst,
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
            Self::Burst => "burst",
        }
    }
}

impl EncodeLabelValue for CloseReason {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        self.as_str().encode(encoder)
    }
}

/// Why a request was sent again on another upstream connection (`reason` label of
/// `poolpilot_upstream_retries_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetryReason {
    /// A reused connection was found closed before anything of the request was written.
    ReusedConnectionUnsent,
    /// A reused connection closed after the request was written and before any byte of a
    /// response; the request was replayable.
    ReusedConnectionClosed,
}

impl RetryReason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ReusedConnectionUnsent => "reused_connection_unsent",
            Self::ReusedConnectionClosed => "reused_connection_closed",
        }
    }
}

impl EncodeLabelValue for RetryReason {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        self.as_str().encode(encoder)
    }
}

/// How an upstream TLS handshake went (`kind` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TlsHandshake {
    /// A full handshake: certificate chain sent and verified, new keys agreed.
    Full,
    /// An abbreviated one: a session of an earlier connection resumed (ticket or session ID).
    Resumed,
}

impl EncodeLabelValue for TlsHandshake {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        match self {
            Self::Full => "full",
            Self::Resumed => "resumed",
        }
        .encode(encoder)
    }
}

/// Why an upstream TLS handshake failed (`reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TlsFailure {
    /// The server's certificate did not verify (unknown issuer, wrong name, expired, none).
    Certificate,
    /// The server refused the handshake with an alert (e.g. no or a refused client
    /// certificate).
    Alert,
    /// Anything else: a protocol error, the connection lost mid-handshake.
    Handshake,
}

impl EncodeLabelValue for TlsFailure {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        match self {
            Self::Certificate => "certificate",
            Self::Alert => "alert",
            Self::Handshake => "handshake",
        }
        .encode(encoder)
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

/// Kinds of upstream timeout (`kind` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TimeoutKind {
    /// `connectTimeout`.
    Connect,
    /// `timeouts.firstByte`.
    FirstByte,
    /// `timeouts.total`.
    Total,
    /// `timeouts.streamIdle`.
    StreamIdle,
}

impl TimeoutKind {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::FirstByte => "first_byte",
            Self::Total => "total",
            Self::StreamIdle => "stream_idle",
        }
    }
}

impl EncodeLabelValue for TimeoutKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        self.as_str().encode(encoder)
    }
}

/// Client-caused deadlines (`kind` label of `poolpilot_downstream_timeouts_total`): never
/// counted as upstream timeouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DownstreamTimeout {
    /// The client accepted nothing of a response for `sendTimeout`.
    Send,
    /// A response reached `timeouts.total` while its client was not reading.
    Total,
    /// A request body stalled past `bodyReadTimeout` or arrived slower than `minBodyRate`.
    BodyRead,
}

impl DownstreamTimeout {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Send => "send",
            Self::Total => "total",
            Self::BodyRead => "body_read",
        }
    }
}

impl EncodeLabelValue for DownstreamTimeout {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        self.as_str().encode(encoder)
    }
}

/// What happened to a connection over its source's cap (`outcome` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Answered `429` with `Retry-After` and `Connection: close`.
    Answered,
    /// Closed at once: more refusals than the answer rate allows.
    Dropped,
}

impl EncodeLabelValue for Refusal {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        match self {
            Self::Answered => "answered",
            Self::Dropped => "dropped",
        }
        .encode(encoder)
    }
}

/// A file of the admin API that the gateway follows (`file` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AdminFile {
    /// `adminTokenFile`.
    Token,
    /// `adminTls.certFile` with its `keyFile`.
    Certificate,
}

impl EncodeLabelValue for AdminFile {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        match self {
            Self::Token => "token",
            Self::Certificate => "certificate",
        }
        .encode(encoder)
    }
}

/// Which tokens a count is of (`direction` label of `poolpilot_tokens_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenDirection {
    /// Prompt tokens.
    Input,
    /// Prompt tokens the backend served from its cache (a part of `input`, when it says).
    CachedInput,
    /// Completion tokens.
    Output,
}

impl TokenDirection {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Input => "input",
            Self::CachedInput => "cached_input",
            Self::Output => "output",
        }
    }
}

impl EncodeLabelValue for TokenDirection {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        self.as_str().encode(encoder)
    }
}

/// Where a token count came from (`source` label of `poolpilot_tokens_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenSource {
    /// The backend's `usage`.
    Usage,
    /// The content chunks of a stream without `usage`, one token each.
    Chunks,
    /// The gateway's estimate before the call (the prompt's bytes ÷ 4, `max_tokens`).
    Estimate,
}

impl TokenSource {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Usage => "usage",
            Self::Chunks => "chunks",
            Self::Estimate => "estimate",
        }
    }
}

impl EncodeLabelValue for TokenSource {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        self.as_str().encode(encoder)
    }
}
