//! The response phase of a call: the backend's response on its way back to the client
//! ([`UpstreamBody`]), streamed frame by frame (SSE chunks are never buffered; their usage is
//! read as they pass: [`crate::tokens::usage`]), reporting to its
//! deadlines ([`super::deadline`]) whether it waits for the backend or for the client, and
//! settling the call ([`super::call::Call::finish`]) when it ends, fails, is cut or is dropped.
//! The lease and the client permit live in the body until its last frame: a connection returns
//! to the pool only after a complete exchange, and a client's call counts against its
//! concurrency for as long as it streams.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Response;
use http::header;
use http_body::{Body, SizeHint};
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::body::{BoxError, PolledFrame, ResponseBody};
use super::call::{Call, CallContext, End};
use super::deadline::ResponseDeadline;
use super::headers::{strip_hop_by_hop, via_value};
use crate::limits::limiter::ClientPermit;
use crate::live::Backend;
use crate::pool::Lease;
use crate::tokens::Meter;
use crate::upstream::{HttpConnector, ResponseStream};

/// The response of a call whose head arrived: hop-by-hop headers dropped and `Via` added, its
/// deadlines armed in the call's slot, and its body wrapped to settle the call when it ends.
pub(super) fn respond(
    call: &CallContext<'_>,
    backend: Arc<Backend>,
    lease: Lease<HttpConnector>,
    mut permit: Option<ClientPermit>,
    response: Response<ResponseStream>,
    sent_at: Instant,
) -> Response<ResponseBody> {
    let timeouts = &call.route.timeouts;
    let (mut parts, body) = response.into_parts();
    let reservation = permit.as_mut().and_then(ClientPermit::take_tokens);
    let meter = Meter::new(&parts.headers, call.estimate, sent_at, reservation);
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.append(header::VIA, via_value(parts.version));
    let deadline = ResponseDeadline::new(
        sent_at + timeouts.total.get(),
        timeouts.stream_idle.get(),
        call.send_timeout,
    );
    call.slot.arm(deadline.clone());
    let done = Call {
        metrics: call.metrics.clone(),
        first_byte: false,
        meter,
        backend,
        lease,
        permit,
        status: parts.status.as_u16(),
        sent_at,
        settle_fair: call.settle_fair,
    };
    let body = UpstreamBody::new(body, done, deadline);
    Response::from_parts(parts, body.boxed_unsync())
}

/// The backend's response body on its way to the client: streamed frame by frame (SSE
/// chunks are never buffered), reporting to its [`ResponseDeadline`] whether it waits for the
/// backend or for the client. The deadlines themselves are fired by the task serving the
/// response, which drops this body; its drop releases the lease and the client permit.
pub(crate) struct UpstreamBody {
    inner: ResponseStream,
    call: Option<Call>,
    deadline: Arc<ResponseDeadline>,
}

impl UpstreamBody {
    fn new(inner: ResponseStream, call: Call, deadline: Arc<ResponseDeadline>) -> Self {
        let mut body = Self {
            inner,
            call: Some(call),
            deadline,
        };
        if body.ended() {
            body.end(End::Complete);
        }
        body
    }

    /// Whether the backend's body has ended (the call is settled once it has).
    fn ended(&self) -> bool {
        self.call
            .as_ref()
            .is_none_or(|call| call.lease.conn_ref().body_ended(&self.inner))
    }

    fn end(&mut self, end: End) {
        if let Some(call) = self.call.take() {
            call.finish(end);
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> PolledFrame {
        let this = &mut *self;
        let Some(call) = this.call.as_mut() else {
            return Poll::Ready(None);
        };
        // An HTTP/1.1 body is read off the connection here, in the client connection's task.
        match call.lease.conn().poll_frame(&mut this.inner, cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.deadline.handed_frame();
                if let (Some(call), Some(data)) = (this.call.as_mut(), frame.data_ref()) {
                    call.received(data);
                }
                if this.ended() {
                    this.end(End::Complete);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.end(End::Failed);
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.end(End::Complete);
                Poll::Ready(None)
            }
            Poll::Pending => {
                this.deadline.waiting_for_upstream();
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.call {
            Some(call) => call.lease.conn_ref().body_size_hint(&self.inner),
            None => SizeHint::with_exact(0),
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        let end = self.deadline.cut().map_or(End::Abandoned, End::Cut);
        self.end(end);
    }
}
