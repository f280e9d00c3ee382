//! Why sending a request on an upstream connection brought no response head ([`SendError`]),
//! told apart by what may be done with the request: sent again on another connection, sent
//! again only if replayable, or not at all.

use http::Request;

use crate::proxy::body::RequestBody;

/// What went wrong on an upstream connection: hyper's error (HTTP/2), an IO error or the
/// HTTP/1.1 connection's own ([`super::h1`]).
pub type UpstreamError = Box<dyn std::error::Error + Send + Sync>;

/// Why `UpstreamConn::send` brought no response head.
#[derive(Debug)]
pub enum SendError {
    /// Nothing of the request was written: it comes back, to go on another connection.
    Unsent(Box<Request<RequestBody>>, UpstreamError),
    /// The request was written (maybe in part), then the backend closed or reset the connection
    /// before a single byte of a response (HTTP/2: refused the stream): it may not have seen the
    /// request, or may have processed it; only a replayable request may be sent again.
    ClosedUnanswered(UpstreamError),
    /// Anything else: a response began and broke, or the exchange failed otherwise.
    Failed(UpstreamError),
}
