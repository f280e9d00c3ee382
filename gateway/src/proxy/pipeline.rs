//! The pipeline of one proxied call, phase by phase: drain → head → the gateway's own answers →
//! route → cooldown → identity → class → tokens → admission → upstream head → forward; and the
//! one place where a failed phase becomes the client's response (the rescue:
//! [`super::error`]), remembered when it told the client when to come back.

use std::time::Duration;

use http::header::{self, CONTENT_LENGTH, HeaderValue};
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use poolpilot_api::limits::PriorityClass;
use tokio::time::Instant;

use super::body::{BodyPace, ResponseBody};
use super::call::CallContext;
use super::deadline::DeadlineSlot;
use super::error::{ProxyError, RETRY_AFTER_MS};
use super::replay::Replay;
use super::{fallback, forward, head, headers, identity, models, route};
use crate::limits::fair;
use crate::listen::source::Peer;
use crate::live::Gateway;
use crate::observe::NO_CLIENT;
use crate::observe::access::{self, Record};
use crate::tokens;
use crate::tokens::budget::TokenReservation;

/// Proxies one request; every failure becomes a response through [`ProxyError`]. The
/// response's deadlines go into `slot` once its head has arrived (see [`super::deadline`]).
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
    // 0. drain: a gateway shutting down takes no new call (503)
    if gw.is_draining() {
        return Err(ProxyError::ShuttingDown);
    }
    let snapshot = gw.snapshot();
    let listener = &snapshot.limits.listener;
    // 1. head: its limits (431, 413), then the MUSTs of RFC 9110/9112 (400, 501); an
    //    `OPTIONS` that `Max-Forwards` ends here is answered
    head::check_limits(&req, listener)?;
    req.headers_mut()
        .insert(access::X_REQUEST_ID, record.request_id());
    if let head::Verdict::Answer(response) = head::check(&mut req)? {
        return Ok(response);
    }
    // 2. the gateway's own answers: `GET /v1/models` from the routes in force
    if let Some(response) = models::answer(&req, &snapshot.routes) {
        return Ok(response);
    }
    // 3. route: path prefix, headers, and the body's JSON `model` when a route needs it (read
    //    at the body pace, 408, within `routeBodyBytes` and the pod's budget, 503); no match 404
    let pace = BodyPace::new(Instant::now(), listener);
    let (mut parts, incoming) = req.into_parts();
    let (route, body) = route::route(gw, &snapshot, &parts, incoming, pace).await?;
    record.backend(&route.backend.name);
    //    cooldown: a backend whose provider asked to wait hands the call to its first fallback
    //    that did not (the call, and its log line, are then the fallback's), or the call is
    //    refused with the shortest wait left (429)
    let route = fallback::past_cooldown(&snapshot, route, gw.metrics(), Instant::now())?;
    record.backend(&route.backend.name);
    // 4. identity: its client policy's identity, or its source address without a policy; and
    //    whether it comes back after a refusal, early or on time
    let key = identity::client_key_of(
        route.limiter.as_ref(),
        &parts.headers,
        peer,
        listener.trusted_proxies.as_ref(),
    );
    record.key(key);
    let refusals = gw.refusals();
    if !refusals.is_empty()
        && let Some((timing, class)) = refusals.arrived(&key, Instant::now())
    {
        record.retry(timing);
        gw.metrics().incidents().retried(&class, timing);
    }
    // 5. class: by its policy's rules (an override's class, the header when the policy takes
    //    it); a call without a client policy is interactive
    let priority = route
        .limiter
        .as_ref()
        .map_or(PriorityClass::Interactive, |l| {
            l.classify(key, &parts.headers)
        });
    record.class(priority);
    // 6. tokens: the call's estimate (`max_tokens`, else its backend's `defaultMaxTokens`, else
    //    its budget's; the prompt's bytes ÷ 4) reserved in its client's token budget, or 429
    //    `rate_limit_exceeded` before anything reaches a backend
    let length = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or_else(|| body.progress().received());
    let default_max = tokens::estimate::default_output(
        route.default_max_tokens,
        route.limiter.as_ref().map(|l| l.default_max_tokens(&key)),
    );
    let estimate = tokens::estimate::estimate(body.held().as_deref(), length, default_max);
    let reservation = match &route.limiter {
        Some(limiter) => limiter
            .reserve_tokens(key, estimate)
            .inspect_err(|refused| record.client(Some(&refused.client), key.short()))?,
        None => None,
    };
    let quote = reservation.as_ref().map(TokenReservation::quote);
    // 7. admission: the client's concurrency and queue (429; 503 when its table is full); the
    //    token reservation rides in the permit
    let permit = match &route.limiter {
        Some(limiter) => {
            let acquired = limiter.acquire_as(key, priority).await;
            let name = match &acquired {
                Ok(permit) => Some(permit.label()),
                Err(rejection) => rejection.client(),
            };
            record.client(name, key.short());
            let mut permit = acquired?;
            permit.hold_tokens(reservation);
            Some(permit)
        }
        None => None,
    };
    // 8. upstream head: hop-by-hop headers dropped, `X-Forwarded-For` and `Via` added; the
    //    client's credentials out and the provider's in
    headers::prepare_upstream_head(&mut parts, peer);
    if let Some(key) = route.backend.credentials() {
        key.apply(&mut parts.headers);
    }
    // The call's turn in the pool queue, fair between clients by tokens: a call with a body
    // costs its estimate (settled with the tokens counted at its end), one without costs 1.
    let settle_fair = length > 0;
    let weight = route
        .limiter
        .as_ref()
        .map_or(fair::DEFAULT_WEIGHT, |l| l.weight_of(&key));
    let cost = if settle_fair {
        estimate.prompt.saturating_add(estimate.output)
    } else {
        1
    };
    let ticket = fair::Ticket::new(key.fair_id(), weight, cost);
    let progress = body.progress();
    record.body(progress.clone());
    let replay = Replay::of(&parts, &body);
    let req = Request::from_parts(parts, body.boxed_unsync());
    // 9. forward: lease (503), send (again on another connection when a reused one failed it
    //    unanswered: unsent, or replayable), the response head within its timeouts (504, 502);
    //    the body then streams back under its deadlines, its usage read as it passes, and its
    //    end settles the token reservation; the head carries the client's `x-ratelimit-*`
    let call = CallContext {
        metrics: gw.metrics(),
        route,
        priority,
        body: &progress,
        send_timeout: listener.send_timeout.get(),
        slot,
        record,
        estimate,
        ticket,
        settle_fair,
    };
    let mut response = forward::forward(call, req, replay, permit).await?;
    if let Some(quote) = &quote {
        tokens::headers::insert(response.headers_mut(), quote);
    }
    Ok(response)
}

/// Remembers a refusal that told the client when to come back (429, 503), for the next call of
/// the same client to be counted early or on time (by `retry-after-ms`, the earlier of its two
/// headers); an early retry refused again is told to wait `earlyRetries.penaltyFactor` times
/// longer, in both.
fn remember_refusal(
    gw: &Gateway,
    record: &Record,
    error: &ProxyError,
    response: &mut Response<ResponseBody>,
) {
    let (Some(key), Some(retry_after), Some(mut ms)) = (
        record.client_key(),
        error.retry_after(),
        error.retry_after_ms(),
    ) else {
        return;
    };
    if !matches!(error.status().as_u16(), 429 | 503) {
        return;
    }
    if record.early_retry() && gw.early_retry_penalty() > 1 {
        let factor = u64::from(gw.early_retry_penalty());
        let secs = retry_after.as_secs().max(1) * factor;
        ms = ms.saturating_mul(factor);
        let headers = response.headers_mut();
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        headers.insert(RETRY_AFTER_MS, HeaderValue::from(ms));
    }
    let class = record.client_name().unwrap_or_else(|| NO_CLIENT.into());
    gw.refusals()
        .refused(key, class, Duration::from_millis(ms), Instant::now());
}
