//! Body types: the boxed request/response bodies, and the client request body that replays
//! what the router buffered and enforces `maxBodyBytes` while streaming.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;

/// A boxed, thread-safe error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the gateway sends back to clients.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// What the gateway sends to backends.
pub type RequestBody = UnsyncBoxBody<Bytes, BoxError>;

/// The client's body exceeded `maxBodyBytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body exceeds {0} bytes")]
pub struct BodyTooLarge(pub u64);

/// A client request body: the bytes the router already buffered, then the rest of the
/// stream, failing (and raising a flag the proxy reads) past `limit` bytes.
#[derive(Debug)]
pub struct ClientBody {
    prefix: Option<Bytes>,
    rest: Option<Incoming>,
    seen: u64,
    limit: u64,
    too_large: Arc<AtomicBool>,
}

impl ClientBody {
    /// A body of `prefix` (already read, counted) followed by `rest`.
    pub fn new(prefix: Option<Bytes>, rest: Option<Incoming>, limit: u64) -> Self {
        let seen = prefix.as_ref().map_or(0, |p| p.len() as u64);
        Self {
            prefix: prefix.filter(|p| !p.is_empty()),
            rest,
            seen,
            limit,
            too_large: Arc::default(),
        }
    }

    /// Raised when the body went over its limit.
    pub fn too_large_flag(&self) -> Arc<AtomicBool> {
        self.too_large.clone()
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        let Some(rest) = self.rest.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.seen += data.len() as u64;
                    if self.seen > self.limit {
                        self.too_large.store(true, Ordering::Relaxed);
                        self.rest = None;
                        return Poll::Ready(Some(Err(BodyTooLarge(self.limit).into())));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => {
                self.rest = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |r| r.size_hint());
        let mut hint = SizeHint::new();
        hint.set_lower(prefix + rest.lower());
        if let Some(upper) = rest.upper() {
            hint.set_upper(prefix + upper);
        }
        hint
    }
}
