//! The hyper service of a client connection ([`Service`]): each request gets its request id
//! and access record, a deadline slot for its response (watched by the connection's task on
//! HTTP/1, by its stream's task on HTTP/2), and goes through the proxy pipeline in its own boxed
//! future; its response body ([`Tracked`]) keeps the request counted as in flight until it is
//! done, writes the access log line at its end, and reports an answer of the gateway's own to
//! its send deadline.

use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, SizeHint};
use hyper::body::Incoming;
use parking_lot::Mutex;

use super::activity::{ActiveRequest, Activity};
use super::source::Peer;
use crate::live::Gateway;
use crate::observe::access;
use crate::proxy::body::{BoxError, PolledFrame, ResponseBody};
use crate::proxy::deadline::{DeadlineSlot, ResponseDeadline};
use crate::proxy::pipeline;

/// The hyper service of one connection: each request is proxied in its own boxed future (so
/// that the connection can be taken apart between requests), with a [`DeadlineSlot`] for its
/// response: an HTTP/1 request's is watched by the connection's task (through its
/// [`Activity`]), an HTTP/2 request's by the task the `StreamExecutor` of `h2.rs` spawns for its stream.
#[derive(Clone, Debug)]
pub(super) struct Service {
    gw: Gateway,
    peer: Arc<Peer>,
    activity: Arc<Activity>,
    /// The slot of the HTTP/2 stream hyper is about to spawn.
    pub(super) next_stream: Arc<Mutex<Option<Arc<DeadlineSlot>>>>,
}

impl Service {
    pub(super) fn new(gw: Gateway, source: IpAddr, activity: Arc<Activity>) -> Self {
        Self {
            gw,
            peer: Arc::new(Peer::new(source)),
            activity,
            next_stream: Arc::default(),
        }
    }
}

type ServiceFuture = Pin<Box<dyn Future<Output = Result<Response<Tracked>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Service {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, req: Request<Incoming>) -> ServiceFuture {
        let gw = self.gw.clone();
        // The request id goes to the backend (the pipeline sets it once the head's limits are
        // checked: the client's header count is the client's own), back to the client, and
        // into the access log.
        let request_id = access::request_id(req.headers());
        let record = Arc::new(access::Record::new(request_id.clone(), &req));
        let peer = self.peer.clone();
        let slot = Arc::new(DeadlineSlot::default());
        if req.version() == http::Version::HTTP_2 {
            // hyper spawns this stream's task right after this call returns.
            *self.next_stream.lock() = Some(slot.clone());
        } else {
            *self.activity.current.lock() = Some(slot.clone());
        }
        let active = ActiveRequest::new(self.activity.clone());
        let activity_of_call = self.activity.clone();
        Box::pin(async move {
            let mut response = pipeline::handle(gw.clone(), &peer, req, &slot, &record).await;
            response
                .headers_mut()
                .insert(access::X_REQUEST_ID, request_id);
            record.status(response.status());
            if let Some(client) = record.client_name() {
                *activity_of_call.client.lock() = Some(client);
            }
            let access = gw
                .access_log()
                .enabled()
                .then(|| access::Finisher::new(gw.access_log().clone(), record));
            // An answer of the gateway's own (no backend body reports to the slot): the send
            // timeout alone applies to it.
            let own = (!slot.is_armed()).then(|| {
                let send_timeout = gw.snapshot().limits.listener.send_timeout.get();
                let deadline = ResponseDeadline::client_only(send_timeout);
                slot.arm(deadline.clone());
                deadline
            });
            Ok(response.map(|body| Tracked {
                inner: body,
                own,
                access,
                _active: active,
            }))
        })
    }
}

/// A response body that keeps its request counted as in flight until it is done, and reports
/// the progress of an answer of the gateway's own to its deadline. hyper holds it as it is (not
/// boxed again around the boxed body inside).
pub(super) struct Tracked {
    inner: ResponseBody,
    own: Option<Arc<ResponseDeadline>>,
    /// Writes the call's access log line when the body ends or is dropped.
    access: Option<access::Finisher>,
    _active: ActiveRequest,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> PolledFrame {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if let Some(access) = &mut self.access {
            match &frame {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        access.sent(data.len());
                    }
                }
                Poll::Ready(None) => access.completed(),
                Poll::Ready(Some(Err(_))) => access.failed(),
                Poll::Pending => {}
            }
        }
        if let Some(deadline) = &self.own {
            match &frame {
                Poll::Ready(Some(_)) => deadline.handed_frame(),
                Poll::Pending => deadline.waiting_for_upstream(),
                Poll::Ready(None) => {}
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // hyper stops polling a body that says it ended: its end is seen here.
        if let Some(access) = &mut self.access
            && self.inner.is_end_stream()
        {
            access.completed();
        }
    }
}
