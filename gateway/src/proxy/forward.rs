//! The forward phase of a call: the soft throttle's delay, a pool lease (503), the request on
//! the leased connection, and the wait for the response head under `timeouts.firstByte` (from
//! the end of the request body) and `timeouts.total` (504); a failed exchange is 502. Who caused
//! a failure decides what is counted: a body the client failed is never held against the
//! backend.
//!
//! A request goes again on another connection when a *reused* connection failed it before a
//! single byte of a response came, the race of a keep-alive connection the backend closed on its
//! own timer just as the request arrived: always when nothing of it was written (hyper hands it
//! back), and after it was written only when it is replayable ([`super::replay`]: idempotent, or
//! with an `Idempotency-Key`, and its body held whole). A fresh connection's failure is never
//! retried, and neither is a request the backend may have begun to answer.
//!
//! A backend that carries the provider's key cools down when the provider refuses with a time
//! to come back (`crate::limits::cooldown`): until then its calls go to a fallback or are
//! answered `429` (`super::fallback`).

use std::future::poll_fn;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use http::{Request, Response};
use tokio::time::Instant;

use super::body::{BodyFailure, BodyProgress, RequestBody, ResponseBody};
use super::call::CallContext;
use super::error::ProxyError;
use super::replay::Replay;
use super::response;
use crate::limits::limiter::ClientPermit;
use crate::observe::{
    CloseReason, DownstreamTimeout, Metrics, NO_CLIENT, Reclaim, RetryReason, TimeoutKind,
};
use crate::pool::PoolError;
use crate::upstream::SendError;

/// Re-sends after reused connections failed a request unanswered: enough to get past a few
/// stale keep-alive connections, bounded so a dying backend cannot loop a request. A re-send
/// that lands on a fresh connection is the last one (a fresh connection's failure is final).
const MAX_RETRIES: usize = 3;

/// Leases a connection, sends, waits for the head, and wraps the response body.
///
/// The first-byte timer starts once the request body has been sent in full (a slow upload is
/// the body pace's business, not the backend's); `total` runs from the send. A failure the
/// client caused (its body too slow, too large or broken) closes the upstream connection but is
/// never counted against the backend: no outlier report, no upstream duration or timeout.
pub(super) async fn forward(
    call: CallContext<'_>,
    mut req: Request<RequestBody>,
    replay: Option<Replay>,
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
    // Its provider's refusals with a time to come back cool it down (a call meanwhile goes to a
    // fallback or is refused before it gets here: `super::fallback`).
    let shared_key = backend.credentials().is_some();
    // The soft throttle: a short delay while others wait, before joining them.
    let delay = backend.pool.throttle_delay();
    if !delay.is_zero() {
        metrics.incidents().throttled(&backend.name, delay);
        tokio::time::sleep(delay).await;
    }
    loop {
        let mut lease = backend
            .pool
            .lease_for(call.priority, call.ticket)
            .await
            .inspect_err(|e| {
                if let Some(endpoint) = e.endpoint() {
                    backend.pool.report_call(endpoint, false);
                }
                if matches!(e, PoolError::ConnectTimeout { .. }) {
                    metrics.upstream_timeout(&backend.name, TimeoutKind::Connect);
                }
            })?;
        record.leased(lease.endpoint(), lease.wait(), lease.burst());
        let sent_at = Instant::now();
        let total_at = sent_at + timeouts.total.get();
        let first_byte = timeouts.first_byte.get();
        let exchange = async {
            let conn = lease.conn();
            if let Err(e) = conn.ready().await {
                return Err(SendError::Unsent(Box::new(req), e));
            }
            conn.send(req).await
        };
        let result = until_first_byte(exchange, body, total_at, first_byte).await;
        let endpoint = lease.endpoint().clone();
        match result {
            Ok(Ok(response)) => {
                record.upstream_head(sent_at.elapsed());
                if shared_key
                    && let Some(wait) =
                        backend
                            .cooldown
                            .note(response.status(), response.headers(), Instant::now())
                {
                    metrics.upstream_cooldown(&backend.name);
                    tracing::info!(backend = %backend.name, status = response.status().as_u16(), ?wait, "the provider refused with Retry-After; no calls until then");
                }
                return Ok(response::respond(
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
            Ok(Err(SendError::Unsent(unsent, error)))
                if lease.reused() && retries < MAX_RETRIES =>
            {
                tracing::debug!(backend = %backend.name, %endpoint, %error, "reused connection failed before sending; retrying");
                lease.discard(CloseReason::PeerClosed);
                metrics.upstream_retry(&backend.name, RetryReason::ReusedConnectionUnsent);
                record.retried();
                retries += 1;
                req = *unsent;
            }
            Ok(Err(SendError::ClosedUnanswered(error)))
                if lease.reused() && retries < MAX_RETRIES =>
            {
                // The backend closed a keep-alive connection as the request came (its idle
                // timer fired): it never answered; the request goes again if that is safe.
                lease.discard(CloseReason::PeerClosed);
                let Some(replay) = &replay else {
                    tracing::debug!(backend = %backend.name, %endpoint, %error, "reused connection closed unanswered; the request is not replayable");
                    backend
                        .signals
                        .duration(502, sent_at.elapsed().as_secs_f64());
                    return Err(ProxyError::UpstreamClosed {
                        backend: backend.name.to_string(),
                        source: error,
                    });
                };
                tracing::debug!(backend = %backend.name, %endpoint, %error, "reused connection closed unanswered; replaying");
                metrics.upstream_retry(&backend.name, RetryReason::ReusedConnectionClosed);
                record.retried();
                retries += 1;
                req = replay.request();
            }
            Ok(Err(
                SendError::Unsent(_, error)
                | SendError::ClosedUnanswered(error)
                | SendError::Failed(error),
            )) => {
                lease.discard(CloseReason::Error);
                backend.pool.report_call(&endpoint, false);
                backend
                    .signals
                    .duration(502, sent_at.elapsed().as_secs_f64());
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
        // A body sent from another task (an HTTP/2 upstream's) wakes this one as it ends, so
        // that the first-byte timer starts then.
        body.wake_on_end(cx.waker());
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
    backend
        .signals
        .duration(504, sent_at.elapsed().as_secs_f64());
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
