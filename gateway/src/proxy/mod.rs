//! The request path of one proxied call:
//!
//! ```text
//! head limits (431/413) → RFC 9110/9112 checks (400/501, `head`) → route (path, headers,
//!   buffered JSON `model`: body pace 408, pod budget 503) → client limiter (429)
//!   → pool lease (503) → send on the leased connection, retried only when a *reused*
//!     connection failed before any byte was sent → first-byte timeout once the body is
//!     sent (504)
//!   → stream the response back frame by frame, reporting to its deadlines (`deadline`)
//! ```
//!
//! The lease and the client permit live in the response body (`UpstreamBody`) until the last
//! frame: a connection returns to the pool only after a complete exchange, and a client's call
//! counts against its concurrency for as long as it streams. When a deadline cuts the response,
//! the task serving it drops the body, which releases both at once. What the client causes is
//! never held against the backend.

pub mod body;
pub mod deadline;
pub mod error;
pub mod head;
pub mod models;
pub mod route;
pub mod route_budget;

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri, Version};
use http_body::{Body, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use poolpilot_api::limits::{
    ClientIdentity, ListenerLimits, PriorityClass, ProxyProtocol, TrustedProxies,
};
use prometheus_client::metrics::counter::Counter;
use tokio::time::Instant;

use crate::limits::limiter::{ClientKey, ClientPermit};
use crate::listen::source::Peer;
use crate::live::{Backend, Gateway, Route};
use crate::observe::access::Record;
use crate::observe::{CloseReason, DownstreamTimeout, Metrics, TimeoutKind};
use crate::observe::{NO_CLIENT, Reclaim};
use crate::pool::Lease;
use crate::proxy::body::{
    BodyFailure, BodyPace, BodyProgress, BoxError, ClientBody, PolledFrame, RequestBody,
    ResponseBody,
};
use crate::proxy::deadline::{Cut, DeadlineSlot, ResponseDeadline};
use crate::proxy::error::ProxyError;
use crate::proxy::route::BodyModel;
use crate::upstream::HttpConnector;

/// Re-sends after a reused connection failed before sending: enough to get past a few stale
/// keep-alive connections, bounded so a dying backend cannot loop a request.
const MAX_RETRIES: usize = 3;

/// `X-Forwarded-For`.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Proxies one request; every failure becomes a response through [`ProxyError`]. The
/// response's deadlines go into `slot` once its head has arrived (see [`crate::deadline`]).
pub async fn handle(
    gw: Gateway,
    peer: &Peer,
    req: Request<Incoming>,
    slot: &DeadlineSlot,
    record: &Record,
) -> Response<ResponseBody> {
    match proxy(&gw, peer, req, slot, record).await {
        Ok(response) => response,
        Err(error) => {
            tracing::debug!(%error, reason = error.reason(), request_id = ?record.request_id(), "request not proxied");
            record.rejected(error.reason());
            let mut response = error.to_response();
            remember_refusal(&gw, record, &error, &mut response);
            response
        }
    }
}

async fn proxy(
    gw: &Gateway,
    peer: &Peer,
    mut req: Request<Incoming>,
    slot: &DeadlineSlot,
    record: &Record,
) -> Result<Response<ResponseBody>, ProxyError> {
    if gw.is_draining() {
        return Err(ProxyError::ShuttingDown);
    }
    let snapshot = gw.snapshot();
    let listener = &snapshot.limits.listener;
    check_head(&req, listener)?;
    if let head::Verdict::Answer(response) = head::check(&mut req)? {
        return Ok(response);
    }
    if let Some(response) = crate::proxy::models::answer(&req, &snapshot.routes) {
        return Ok(response);
    }
    let pace = BodyPace::new(Instant::now(), listener);
    let (mut parts, incoming) = req.into_parts();

    // Route, reading at most `routeBodyBytes` of the body when a route needs its `model`.
    let (model, body) = if snapshot.needs_model && !incoming.is_end_stream() {
        buffer_for_model(gw, incoming, listener, pace).await?
    } else {
        let model = if snapshot.needs_model {
            BodyModel::Absent
        } else {
            BodyModel::NotRead
        };
        (
            model,
            ClientBody::new(None, None, Some(incoming), listener.max_body_bytes, pace),
        )
    };
    let route = snapshot
        .routes
        .iter()
        .find(|r| route::matches(&r.matcher, &parts, model.name()))
        .ok_or_else(|| ProxyError::NoRoute(model.miss()))?;
    record.backend(&route.backend.name);

    // Who the client is: its policy's identity, or its source address without a policy.
    let key = match &route.limiter {
        Some(limiter) => client_key(
            &limiter.identity(),
            &parts.headers,
            peer,
            listener.trusted_proxies.as_ref(),
        ),
        None => ClientKey::of(crate::listen::source::key_text(peer.source()).as_bytes()),
    };
    record.key(key);
    if let Some((timing, class)) = gw.refusals().arrived(&key, Instant::now()) {
        record.retry(timing);
        gw.metrics().incidents().retried(&class, timing);
    }
    // Its priority class, by its policy's rules (an override's class, the header when the
    // policy takes it); a call without a client policy is interactive.
    let priority = route
        .limiter
        .as_ref()
        .map_or(PriorityClass::Interactive, |l| {
            l.classify(key, &parts.headers)
        });
    record.class(priority);
    let permit = match &route.limiter {
        Some(limiter) => {
            let acquired = limiter.acquire_as(key, priority).await;
            let name = match &acquired {
                Ok(permit) => Some(permit.label()),
                Err(rejection) => rejection.client(),
            };
            record.client(name, key.short());
            Some(acquired?)
        }
        None => None,
    };

    prepare_upstream_head(&mut parts, peer);
    let progress = body.progress();
    record.body(progress.clone());
    let req = Request::from_parts(parts, body.boxed_unsync());
    let call = CallContext {
        metrics: gw.metrics(),
        route,
        priority,
        body: &progress,
        send_timeout: listener.send_timeout.get(),
        slot,
        record,
    };
    forward(call, req, permit).await
}

/// Remembers a refusal that told the client when to come back (429, 503), for the next call of
/// the same client to be counted early or on time; an early retry refused again is told to wait
/// `earlyRetries.penaltyFactor` times longer.
fn remember_refusal(
    gw: &Gateway,
    record: &Record,
    error: &ProxyError,
    response: &mut Response<ResponseBody>,
) {
    let (Some(key), Some(retry_after)) = (record.client_key(), error.retry_after()) else {
        return;
    };
    if !matches!(error.status().as_u16(), 429 | 503) {
        return;
    }
    let mut secs = retry_after.as_secs().max(1);
    if record.early_retry() && gw.early_retry_penalty() > 1 {
        secs *= u64::from(gw.early_retry_penalty());
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    let class = record
        .client_name()
        .unwrap_or_else(|| crate::observe::NO_CLIENT.into());
    gw.refusals()
        .refused(key, class, Duration::from_secs(secs), Instant::now());
}

/// 431 for too many or too large headers, 413 for a declared body over the limit. hyper
/// enforces the same limits while parsing HTTP/1 heads; this covers HTTP/2 and limits below
/// hyper's smallest read buffer.
fn check_head<B>(req: &Request<B>, limits: &ListenerLimits) -> Result<(), ProxyError> {
    if req.headers().len() > limits.max_headers as usize {
        return Err(ProxyError::HeadersTooLarge("too many headers"));
    }
    let head_bytes: usize = uri_len(req.uri())
        + req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>();
    if head_bytes > limits.max_header_bytes as usize {
        return Err(ProxyError::HeadersTooLarge("request head too large"));
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limits.max_body_bytes) {
        return Err(ProxyError::BodyTooLarge {
            limit: limits.max_body_bytes,
        });
    }
    Ok(())
}

/// The length of the URI as written (`Uri`'s `Display`), without formatting it in the common
/// origin-form case.
fn uri_len(uri: &Uri) -> usize {
    match (uri.scheme(), uri.authority(), uri.path_and_query()) {
        (None, None, Some(pq)) => pq.as_str().len(),
        _ => uri.to_string().len(),
    }
}

/// Reads up to `routeBodyBytes` of the body, at the listener's body pace and within the
/// pod's routing budget. A body that ends within it is parsed for `model`; a longer one routes
/// without a model. Either way nothing read is lost.
async fn buffer_for_model(
    gw: &Gateway,
    mut incoming: Incoming,
    limits: &ListenerLimits,
    pace: BodyPace,
) -> Result<(BodyModel, ClientBody), ProxyError> {
    let cap = limits.route_body_bytes as usize;
    let mut buf = BytesMut::new();
    let mut reserved = gw.route_budget().reservation();
    let mut last = Instant::now();
    loop {
        if buf.len() > cap {
            let prefix = buf.freeze();
            return Ok((
                BodyModel::BeyondBuffer(limits.route_body_bytes),
                ClientBody::new(
                    Some(prefix),
                    Some(reserved),
                    Some(incoming),
                    limits.max_body_bytes,
                    pace,
                ),
            ));
        }
        let deadline = pace.deadline(buf.len() as u64, last);
        let Ok(frame) = tokio::time::timeout_at(deadline, incoming.frame()).await else {
            gw.metrics().downstream_timeout(DownstreamTimeout::BodyRead);
            gw.metrics()
                .incidents()
                .reclaimed(Reclaim::BodyTimeout, NO_CLIENT);
            return Err(ProxyError::BodyTimeout);
        };
        match frame {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if (buf.len() + data.len()) as u64 > limits.max_body_bytes {
                        return Err(ProxyError::BodyTooLarge {
                            limit: limits.max_body_bytes,
                        });
                    }
                    if !reserved.grow(data.len() as u64, limits.route_buffer_budget) {
                        gw.metrics().route_buffer_rejected();
                        return Err(ProxyError::RouteBufferFull);
                    }
                    buf.extend_from_slice(&data);
                    last = Instant::now();
                }
            }
            Some(Err(e)) => return Err(ProxyError::ClientBody(e.into())),
            None => {
                let body = buf.freeze();
                let model = route::model_of(&body).map_or(BodyModel::Absent, BodyModel::Found);
                return Ok((
                    model,
                    ClientBody::new(
                        Some(body),
                        Some(reserved),
                        None,
                        limits.max_body_bytes,
                        pace,
                    ),
                ));
            }
        }
    }
}

/// The client's identity, hashed: the configured header's value (for `authorization`, the
/// bearer token without its scheme), or, without it or for a source-IP policy, the client's
/// address ([`crate::listen::source::key_text`]: an IPv6 client counts by its /64), taken from
/// `X-Forwarded-For` when the peer is a trusted proxy that passes it so.
fn client_key(
    identity: &ClientIdentity,
    headers: &HeaderMap,
    peer: &Peer,
    trusted: Option<&TrustedProxies>,
) -> ClientKey {
    if let ClientIdentity::Header(name) = identity
        && let Some(value) = headers.get(name.as_str())
    {
        if name.eq_ignore_ascii_case("authorization")
            && let Some(token) = bearer_token(value)
        {
            return ClientKey::of(token);
        }
        return ClientKey::of(value.as_bytes());
    }
    let ip = match trusted {
        Some(t) if t.protocol == ProxyProtocol::XForwardedFor => {
            crate::listen::source::forwarded_client(headers, peer.source(), t)
        }
        _ => peer.source(),
    };
    ClientKey::of(crate::listen::source::key_text(ip).as_bytes())
}

/// The token of an `Authorization: Bearer <token>` value (the scheme in any case).
fn bearer_token(value: &HeaderValue) -> Option<&[u8]> {
    let value = value.as_bytes();
    let space = value.iter().position(|b| *b == b' ')?;
    let (scheme, token) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = token.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Whether `name` is a hop-by-hop header of RFC 9110 §7.6.1 (or a legacy one).
fn is_hop_by_hop(name: &HeaderName) -> bool {
    *name == header::CONNECTION
        || *name == header::PROXY_AUTHENTICATE
        || *name == header::PROXY_AUTHORIZATION
        || *name == header::TE
        || *name == header::TRAILER
        || *name == header::TRANSFER_ENCODING
        || *name == header::UPGRADE
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus those the `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most heads carry none: one pass over the names instead of a lookup per name.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

fn via_value(version: Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        Version::HTTP_09 => "0.9 poolpilot",
        Version::HTTP_10 => "1.0 poolpilot",
        Version::HTTP_2 => "2 poolpilot",
        Version::HTTP_3 => "3 poolpilot",
        _ => "1.1 poolpilot",
    })
}

/// Turns the client's head into the upstream head: origin-form URI, HTTP/1.1, `Host` kept,
/// or replaced by the target's authority (an absolute-form target, RFC 9112 §3.2.2, or an
/// HTTP/2 `:authority`), hop-by-hop headers dropped, `X-Forwarded-For` and `Via` appended.
fn prepare_upstream_head(parts: &mut http::request::Parts, peer: &Peer) {
    strip_hop_by_hop(&mut parts.headers);
    if let Some(authority) = parts.uri.authority() {
        // Without userinfo (RFC 9110 §4.2.4: never forwarded).
        let host = match authority.as_str().rsplit_once('@') {
            Some((_, host)) => HeaderValue::from_str(host),
            None => HeaderValue::from_str(authority.as_str()),
        };
        if let Ok(host) = host {
            parts.headers.insert(header::HOST, host);
        }
    }
    let xff = match parts
        .headers
        .get(X_FORWARDED_FOR)
        .and_then(|v| v.to_str().ok())
    {
        None => Some(peer.forwarded_for().clone()),
        Some(prior) => {
            let ip = peer.forwarded_for().to_str().unwrap_or_default();
            HeaderValue::from_str(&format!("{prior}, {ip}")).ok()
        }
    };
    if let Some(xff) = xff {
        parts.headers.insert(X_FORWARDED_FOR, xff);
    }
    parts.headers.append(header::VIA, via_value(parts.version));
    // Already origin-form (every HTTP/1.1 request but a proxy-style one): keep it as it is.
    if parts.uri.scheme().is_some() || parts.uri.authority().is_some() {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = Uri::try_from(path).unwrap_or_else(|_| Uri::from_static("/"));
    } else if parts.uri.path_and_query().is_none() {
        parts.uri = Uri::from_static("/");
    }
    parts.version = Version::HTTP_11;
}

/// Why a send did not produce a response head.
enum SendFailure {
    /// Nothing was written: the request can go on another connection.
    NotSent(Box<Request<RequestBody>>, hyper::Error),
    /// The exchange failed after (possibly) writing.
    Failed(hyper::Error),
}

/// What a call needs besides its request and permit.
struct CallContext<'a> {
    metrics: &'a Metrics,
    route: &'a Route,
    /// The call's priority class, in the pool queue.
    priority: PriorityClass,
    /// The request body's progress: when it was sent in full, how the client failed it.
    body: &'a BodyProgress,
    send_timeout: Duration,
    slot: &'a DeadlineSlot,
    /// The call's access log record.
    record: &'a Record,
}

/// Leases a connection, sends, waits for the head, and wraps the response body.
///
/// The first-byte timer starts once the request body has been sent in full (a slow upload is
/// the body pace's business, not the backend's); `total` runs from the send. A failure the
/// client caused (its body too slow, too large or broken) closes the upstream connection but is
/// never counted against the backend: no outlier report, no upstream duration or timeout.
async fn forward(
    call: CallContext<'_>,
    mut req: Request<RequestBody>,
    permit: Option<ClientPermit>,
) -> Result<Response<ResponseBody>, ProxyError> {
    let CallContext {
        metrics,
        route,
        body,
        record,
        ..
    } = call;
    let backend = &route.backend;
    let timeouts = &route.timeouts;
    let mut retries = 0;
    // The soft throttle: a short delay while others wait, before joining them.
    let delay = backend.pool.throttle_delay();
    if !delay.is_zero() {
        metrics.incidents().throttled(&backend.name, delay);
        tokio::time::sleep(delay).await;
    }
    loop {
        let mut lease = backend
            .pool
            .lease_as(call.priority)
            .await
            .inspect_err(|e| {
                if let Some(endpoint) = e.endpoint() {
                    backend.pool.report_call(endpoint, false);
                }
                if matches!(e, crate::pool::PoolError::ConnectTimeout { .. }) {
                    metrics.upstream_timeout(&backend.name, TimeoutKind::Connect);
                }
            })?;
        record.leased(lease.endpoint(), lease.wait());
        let sent_at = Instant::now();
        let total_at = sent_at + timeouts.total.get();
        let first_byte = timeouts.first_byte.get();
        let exchange = async {
            let conn = lease.conn();
            if let Err(e) = conn.ready().await {
                return Err(SendFailure::NotSent(Box::new(req), e));
            }
            conn.send(req)
                .await
                .map_err(|mut e| match e.take_message() {
                    Some(req) => SendFailure::NotSent(Box::new(req), e.into_error()),
                    None => SendFailure::Failed(e.into_error()),
                })
        };
        let result = until_first_byte(exchange, body, total_at, first_byte).await;
        let endpoint = lease.endpoint().clone();
        match result {
            Ok(Ok(response)) => {
                record.upstream_head(sent_at.elapsed());
                return Ok(respond(
                    &call,
                    backend.clone(),
                    lease,
                    permit,
                    response,
                    sent_at,
                ));
            }
            Ok(Err(_)) if body.failed().is_some() => {
                // The client's doing: the backend got part of a request, so the connection
                // goes, but the backend is not blamed.
                lease.discard(CloseReason::Error);
                if body.failed() == Some(BodyFailure::Timeout) {
                    let client = permit.as_ref().map_or(NO_CLIENT, |p| p.label());
                    metrics.incidents().reclaimed(Reclaim::BodyTimeout, client);
                }
                return Err(client_failed(metrics, body.failed()));
            }
            Ok(Err(SendFailure::NotSent(unsent, error)))
                if lease.reused() && retries < MAX_RETRIES =>
            {
                tracing::debug!(backend = %backend.name, %endpoint, %error, "reused connection failed before sending; retrying");
                lease.discard(CloseReason::PeerClosed);
                metrics.upstream_retry(&backend.name);
                record.retried();
                retries += 1;
                req = *unsent;
            }
            Ok(Err(SendFailure::NotSent(_, error) | SendFailure::Failed(error))) => {
                lease.discard(CloseReason::Error);
                backend.pool.report_call(&endpoint, false);
                metrics.upstream_duration(&backend.name, 502, sent_at.elapsed().as_secs_f64());
                return Err(ProxyError::Upstream {
                    backend: backend.name.to_string(),
                    source: error,
                });
            }
            Err(()) => {
                // Dropping the send future closed the connection; count it and move on.
                lease.discard(CloseReason::Timeout);
                let Some(body_sent) = body.sent_at() else {
                    if body.waiting_for_client() {
                        // `total` passed while the client was still sending its body.
                        metrics.downstream_timeout(DownstreamTimeout::BodyRead);
                        return Err(ProxyError::BodyTimeout);
                    }
                    // The backend stopped taking the body.
                    return Err(upstream_timeout(
                        metrics,
                        &call,
                        &endpoint,
                        TimeoutKind::Total,
                        sent_at,
                    ));
                };
                let kind = if body_sent + first_byte < total_at {
                    TimeoutKind::FirstByte
                } else {
                    TimeoutKind::Total
                };
                return Err(upstream_timeout(metrics, &call, &endpoint, kind, sent_at));
            }
        }
    }
}

/// Drives `exchange` until the response head, or gives up (`Err`) at `total_at` or
/// `first_byte` after the request body was sent in full, whichever comes first.
async fn until_first_byte<T>(
    exchange: impl Future<Output = T>,
    body: &BodyProgress,
    total_at: Instant,
    first_byte: Duration,
) -> Result<T, ()> {
    let mut exchange = pin!(exchange);
    let mut timer = pin!(tokio::time::sleep_until(total_at));
    poll_fn(|cx| {
        // The exchange moves the body first: the deadline below sees a body sent just now.
        if let Poll::Ready(out) = exchange.as_mut().poll(cx) {
            return Poll::Ready(Ok(out));
        }
        let deadline = body
            .sent_at()
            .map_or(total_at, |sent| total_at.min(sent + first_byte));
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        timer.as_mut().poll(cx).map(|()| Err(()))
    })
    .await
}

/// A timeout of the backend before the response head: counted, reported, 504.
fn upstream_timeout(
    metrics: &Metrics,
    call: &CallContext<'_>,
    endpoint: &str,
    kind: TimeoutKind,
    sent_at: Instant,
) -> ProxyError {
    let backend = &call.route.backend;
    backend.pool.report_call(endpoint, false);
    metrics.upstream_timeout(&backend.name, kind);
    metrics.upstream_duration(&backend.name, 504, sent_at.elapsed().as_secs_f64());
    ProxyError::UpstreamTimeout {
        backend: backend.name.to_string(),
        kind,
    }
}

/// The error of a request body the client failed.
fn client_failed(metrics: &Metrics, failure: Option<BodyFailure>) -> ProxyError {
    match failure {
        Some(BodyFailure::TooLarge(limit)) => ProxyError::BodyTooLarge { limit },
        Some(BodyFailure::Timeout) => {
            metrics.downstream_timeout(DownstreamTimeout::BodyRead);
            ProxyError::BodyTimeout
        }
        Some(BodyFailure::Broken) | None => ProxyError::ClientBody(BodyFailure::Broken.into()),
    }
}

fn respond(
    call: &CallContext<'_>,
    backend: Arc<Backend>,
    lease: Lease<HttpConnector>,
    permit: Option<ClientPermit>,
    response: Response<Incoming>,
    sent_at: Instant,
) -> Response<ResponseBody> {
    let timeouts = &call.route.timeouts;
    let (mut parts, body) = response.into_parts();
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
        bytes: call.metrics.upstream_response_bytes(&backend.name),
        first_byte: false,
        backend,
        lease,
        permit,
        status: parts.status.as_u16(),
        sent_at,
    };
    let body = UpstreamBody::new(body, done, deadline);
    Response::from_parts(parts, body.boxed_unsync())
}

/// One call in progress: what must happen when its response ends.
struct Call {
    metrics: Metrics,
    backend: Arc<Backend>,
    lease: Lease<HttpConnector>,
    /// The client's slot: released when the call ends; told of each frame (slow calls are
    /// judged on the waits between them).
    permit: Option<ClientPermit>,
    status: u16,
    sent_at: Instant,
    /// Response body bytes of this backend, counted as they arrive.
    bytes: Counter,
    /// Whether the body's first byte arrived (and its time was observed).
    first_byte: bool,
}

/// How a response body ended.
#[derive(Clone, Copy, Debug)]
enum End {
    /// The backend sent all of it.
    Complete,
    /// Reading it failed.
    Failed,
    /// A deadline cut it.
    Cut(Cut),
    /// The client went away first.
    Abandoned,
}

impl Call {
    /// `n` bytes of the response body arrived; the first of them is its time to first byte.
    fn received(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        if let Some(permit) = &mut self.permit {
            permit.frame();
        }
        if !self.first_byte {
            self.first_byte = true;
            self.metrics
                .upstream_first_byte(&self.backend.name, self.sent_at.elapsed().as_secs_f64());
        }
        self.bytes.inc_by(n as u64);
    }

    fn finish(mut self, end: End) {
        let name = &self.backend.name;
        let client = self.permit.as_ref().map_or(NO_CLIENT, |p| p.label());
        self.metrics
            .incidents()
            .lease_held(name, client, self.sent_at.elapsed());
        if !self.first_byte && matches!(end, End::Complete) {
            // A response without a body: its end is its first byte.
            self.metrics
                .upstream_first_byte(name, self.sent_at.elapsed().as_secs_f64());
        }
        let endpoint = self.lease.endpoint().clone();
        let took = self.sent_at.elapsed().as_secs_f64();
        match end {
            End::Complete => {
                self.metrics.upstream_duration(name, self.status, took);
                self.lease.keep();
                self.backend.pool.report_call(&endpoint, self.status < 500);
            }
            End::Failed => {
                self.metrics.upstream_duration(name, 502, took);
                self.lease.discard(CloseReason::Error);
                self.backend.pool.report_call(&endpoint, false);
            }
            End::Cut(cut) => {
                tracing::debug!(backend = %name, %endpoint, ?cut, "response cut by a deadline");
                self.lease.discard(CloseReason::Timeout);
                match cut {
                    Cut::Total | Cut::StreamIdle => {
                        let kind = if cut == Cut::Total {
                            TimeoutKind::Total
                        } else {
                            TimeoutKind::StreamIdle
                        };
                        self.metrics.upstream_duration(name, 504, took);
                        self.metrics.upstream_timeout(name, kind);
                        self.backend.pool.report_call(&endpoint, false);
                    }
                    Cut::Send => {
                        self.metrics.downstream_timeout(DownstreamTimeout::Send);
                        self.metrics
                            .incidents()
                            .reclaimed(Reclaim::SendStall, client);
                    }
                    Cut::TotalClientStalled => {
                        self.metrics.downstream_timeout(DownstreamTimeout::Total);
                        self.metrics
                            .incidents()
                            .reclaimed(Reclaim::ClientStalled, client);
                    }
                }
            }
            // The client's doing: nothing is held against the backend.
            End::Abandoned => self.lease.discard(CloseReason::Error),
        }
        // The lease goes back to the pool and the client permit is released here.
    }
}

/// The backend's response body on its way to the client: streamed frame by frame (SSE
/// chunks are never buffered), reporting to its [`ResponseDeadline`] whether it waits for the
/// backend or for the client. The deadlines themselves are fired by the task serving the
/// response, which drops this body; its drop releases the lease and the client permit.
pub(crate) struct UpstreamBody {
    inner: Incoming,
    call: Option<Call>,
    deadline: Arc<ResponseDeadline>,
}

impl UpstreamBody {
    fn new(inner: Incoming, call: Call, deadline: Arc<ResponseDeadline>) -> Self {
        let mut body = Self {
            inner,
            call: Some(call),
            deadline,
        };
        if body.inner.is_end_stream() {
            body.end(End::Complete);
        }
        body
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
        // The upstream connection is driven here, in the client connection's task.
        let mut frame = Pin::new(&mut this.inner).poll_frame(cx);
        if frame.is_pending() {
            call.lease.conn().drive(cx);
            frame = Pin::new(&mut this.inner).poll_frame(cx);
        }
        match frame {
            Poll::Ready(Some(Ok(frame))) => {
                this.deadline.handed_frame();
                if let (Some(call), Some(data)) = (this.call.as_mut(), frame.data_ref()) {
                    call.received(data.len());
                }
                if this.inner.is_end_stream() {
                    this.end(End::Complete);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.end(End::Failed);
                Poll::Ready(Some(Err(e.into())))
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
        self.call.is_none() || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        let end = self.deadline.cut().map_or(End::Abandoned, End::Cut);
        self.end(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_head_drops_hop_by_hop_and_adds_forwarding_headers() {
        let req = Request::builder()
            .method("POST")
            .uri("http://gw.example:8080/v1/chat?stream=true")
            .version(Version::HTTP_11)
            .header("connection", "keep-alive, x-secret-hop")
            .header("x-secret-hop", "1")
            .header("keep-alive", "timeout=5")
            .header("transfer-encoding", "chunked")
            .header("x-forwarded-for", "10.0.0.1")
            .header("authorization", "Bearer kept")
            .body(())
            .unwrap();
        let (mut parts, ()) = req.into_parts();
        prepare_upstream_head(&mut parts, &Peer::new(([192, 168, 1, 7], 5555).into()));
        let h = &parts.headers;
        for gone in [
            "connection",
            "x-secret-hop",
            "keep-alive",
            "transfer-encoding",
        ] {
            assert!(!h.contains_key(gone), "{gone} must not be forwarded");
        }
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 192.168.1.7");
        assert_eq!(h["via"], "1.1 poolpilot");
        assert_eq!(h["host"], "gw.example:8080");
        assert_eq!(h["authorization"], "Bearer kept");
        assert_eq!(parts.uri, "/v1/chat?stream=true");
    }

    #[test]
    fn head_limits_give_431_and_413() {
        let limits = ListenerLimits {
            max_headers: 3,
            max_header_bytes: 1024,
            max_body_bytes: 10,
            ..Default::default()
        };
        let mut b = Request::builder().uri("/");
        for i in 0..4 {
            b = b.header(format!("x-h{i}"), "v");
        }
        let err = check_head(&b.body(()).unwrap(), &limits).unwrap_err();
        assert_eq!(err.status(), 431);
        let big = Request::builder()
            .uri("/")
            .header("x-big", "v".repeat(2000))
            .body(())
            .unwrap();
        assert_eq!(check_head(&big, &limits).unwrap_err().status(), 431);
        let body = Request::builder()
            .uri("/")
            .header("content-length", "11")
            .body(())
            .unwrap();
        assert_eq!(check_head(&body, &limits).unwrap_err().status(), 413);
        let fine = Request::builder()
            .uri("/")
            .header("content-length", "10")
            .body(())
            .unwrap();
        assert!(check_head(&fine, &limits).is_ok());
    }

    #[test]
    fn identity_is_the_header_or_else_the_source_ip() {
        let peer = &Peer::new(([10, 1, 2, 3], 4000).into());
        let mut headers = HeaderMap::new();
        let by_header = ClientIdentity::Header("x-api-key".into());
        assert_eq!(
            client_key(&by_header, &headers, peer, None),
            ClientKey::of(b"10.1.2.3")
        );
        headers.insert("x-api-key", HeaderValue::from_static("sk-1"));
        assert_eq!(
            client_key(&by_header, &headers, peer, None),
            ClientKey::of(b"sk-1")
        );
        assert_eq!(
            client_key(&ClientIdentity::SourceIp, &headers, peer, None),
            ClientKey::of(b"10.1.2.3")
        );
        let by_token = ClientIdentity::Header("authorization".into());
        for value in ["Bearer sk-2", "bearer  sk-2 ", "BEARER sk-2"] {
            headers.insert("authorization", HeaderValue::from_str(value).unwrap());
            assert_eq!(
                client_key(&by_token, &headers, peer, None),
                ClientKey::of(b"sk-2"),
                "{value:?}"
            );
        }
        headers.insert("authorization", HeaderValue::from_static("Basic dTpw"));
        assert_eq!(
            client_key(&by_token, &headers, peer, None),
            ClientKey::of(b"Basic dTpw"),
            "another scheme: the whole value"
        );
        let v6 = &Peer::new("[2001:db8:7:7::42]:4000".parse().unwrap());
        assert_eq!(
            client_key(&ClientIdentity::SourceIp, &headers, v6, None),
            ClientKey::of(b"2001:db8:7:7::/64")
        );
    }
}
