//! modelsim's inference engine: admission into concurrency slots and the bounded queue, the
//! service time draw, fault decisions, and token generation for complete and streamed answers.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Limited};
use hyper::Response;
use hyper::body::Incoming;
use rand::Rng;
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep, sleep_until};

use super::admission::{GaugeGuard, Slot};
use super::body::SimBody;
use super::config::{Jitter, ServiceTime};
use super::conn::ConnCtl;
use super::metrics::{FAULT_ERROR, FAULT_RESET, FAULT_SLOW_HEADERS, FAULT_STALL, ResponseLabels};
use super::openai::{self, Endpoint, ResponseMeta, unix_now};
use super::rate_limit::{self, Verdict};
use super::response::{error_response, json_response, sse_response};
use super::shared::Shared;

/// Largest request body accepted.
const MAX_BODY: usize = 4 << 20;

/// A multiplicative jitter factor with mean 1.
pub(crate) fn jitter_factor(jitter: Jitter, rng: &mut impl Rng) -> f64 {
    match jitter {
        Jitter::None => 1.0,
        Jitter::LogNormal { sigma } => {
            // Box–Muller: u1 in (0, 1] so that ln(u1) is finite.
            let u1 = 1.0 - rng.random::<f64>();
            let u2 = rng.random::<f64>();
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            (sigma * z - sigma * sigma / 2.0).exp()
        }
        Jitter::Exponential => -(1.0 - rng.random::<f64>()).ln(),
    }
}

/// The per-request draws: fault dice and the jitter factor.
#[derive(Debug, Clone, Copy)]
struct Draws {
    reset: f64,
    error: f64,
    stall: f64,
    jitter: f64,
}

/// The service plan of one admitted request.
#[derive(Debug, Clone)]
struct Plan {
    tokens: u32,
    /// Whether the client capped the tokens (finish reason `length`) or not (`stop`).
    capped: bool,
    prefill: Duration,
    per_token: Duration,
    /// Hang after this many tokens (the stall fault, mid-response).
    stall_after: Option<u32>,
    prompt_tokens: u32,
    /// Of them, served from the prefix cache.
    cached_tokens: u32,
    /// The prompt's full blocks, cached once its prefill is done.
    prompt_blocks: Vec<u64>,
    include_usage: bool,
}

impl Plan {
    fn token_delay(&self, i: u32, shared: &Shared) -> Duration {
        let busy = shared.admission.load(&shared.metrics);
        let (prefill, decode) = shared.config.service.slowdown(busy);
        let decode = self.per_token.mul_f64(decode);
        if i == 0 {
            self.prefill.mul_f64(prefill) + decode
        } else {
            decode
        }
    }

    fn finish_reason(&self) -> &'static str {
        if self.capped { "length" } else { "stop" }
    }

    fn usage(&self) -> openai::Tokens {
        openai::Tokens {
            prompt: self.prompt_tokens,
            cached: self.cached_tokens,
            completion: self.tokens,
        }
    }

    /// The prefill is done (the first token came out): the prompt's blocks are cached.
    fn prefilled(&self, shared: &Shared) {
        shared.prefix_cache.lock().insert(&self.prompt_blocks);
    }
}

/// Paces token production against absolute deadlines: each token is due a delay after the
/// previous one was due, so timer granularity (1 ms) does not accumulate into drift and a zero
/// delay costs no timer at all. A token that is late by more than `CATCH_UP` (the process was
/// starved) does not make the next ones come early: like a real decode loop, it never catches up
/// on lost time.
#[derive(Debug)]
struct Pacer {
    due: Instant,
}

impl Pacer {
    const CATCH_UP: Duration = Duration::from_millis(2);

    fn start() -> Self {
        Self {
            due: Instant::now(),
        }
    }

    async fn wait(&mut self, delay: Duration) {
        let now = Instant::now();
        let floor = now.checked_sub(Self::CATCH_UP).unwrap_or(now);
        self.due = (self.due + delay).max(floor);
        if self.due > now {
            sleep_until(self.due).await;
        }
    }
}

/// Counts a request as cancelled by its client unless it reached an outcome first.
#[derive(Debug)]
struct Outcome {
    shared: Arc<Shared>,
    decided: bool,
}

impl Outcome {
    fn decided(mut self) {
        self.decided = true;
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.decided {
            self.shared.metrics.cancelled.inc();
        }
    }
}

fn count_response(shared: &Shared, endpoint: Endpoint, status: StatusCode) {
    shared
        .metrics
        .responses
        .get_or_create(&ResponseLabels {
            endpoint: endpoint.path(),
            code: status.as_u16(),
        })
        .inc();
}

/// Serves one inference request, end to end.
pub(crate) async fn inference(
    shared: Arc<Shared>,
    ctl: Arc<ConnCtl>,
    endpoint: Endpoint,
    req: hyper::Request<Incoming>,
) -> Response<SimBody> {
    let arrived = Instant::now();
    let m = &shared.metrics;
    m.requests_received.inc();

    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            m.rejected_invalid.inc();
            count_response(&shared, endpoint, StatusCode::BAD_REQUEST);
            return error_response(
                &shared,
                StatusCode::BAD_REQUEST,
                &format!("cannot read the request body: {e}"),
                "invalid_request_error",
                None,
            );
        }
    };
    let parsed = match openai::parse_request(endpoint, &body, &shared.config.models[0]) {
        Ok(parsed) => parsed,
        Err(message) => {
            m.rejected_invalid.inc();
            count_response(&shared, endpoint, StatusCode::BAD_REQUEST);
            return error_response(
                &shared,
                StatusCode::BAD_REQUEST,
                &message,
                "invalid_request_error",
                None,
            );
        }
    };
    let model = match parsed.model {
        Some(model) if shared.config.models.contains(&model) => model,
        Some(model) => {
            m.rejected_invalid.inc();
            count_response(&shared, endpoint, StatusCode::NOT_FOUND);
            let message = format!("The model `{model}` does not exist.");
            return error_response(
                &shared,
                StatusCode::NOT_FOUND,
                &message,
                "NotFoundError",
                Some("model_not_found"),
            );
        }
        None => shared.config.models[0].clone(),
    };

    let outcome = Outcome {
        shared: Arc::clone(&shared),
        decided: false,
    };
    let faults = shared.faults.borrow().clone();
    let draws = {
        let mut rng = shared.rng.lock();
        Draws {
            reset: rng.random(),
            error: rng.random(),
            stall: rng.random(),
            jitter: jitter_factor(shared.config.service.jitter, &mut *rng),
        }
    };

    if faults.slow_headers_ms > 0 {
        m.faults.get_or_create(&FAULT_SLOW_HEADERS).inc();
        sleep(Duration::from_millis(faults.slow_headers_ms)).await;
    }
    if draws.reset < faults.reset_ratio {
        m.faults.get_or_create(&FAULT_RESET).inc();
        outcome.decided();
        ctl.reset();
        // The connection task drops the connection (and this future with it).
        return std::future::pending().await;
    }
    if draws.error < faults.error_ratio {
        m.faults.get_or_create(&FAULT_ERROR).inc();
        outcome.decided();
        let status =
            StatusCode::from_u16(faults.error_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        count_response(&shared, endpoint, status);
        return error_response(
            &shared,
            status,
            "injected fault",
            "server_error",
            Some("modelsim_fault"),
        );
    }
    let stalled = draws.stall < faults.stall_ratio;
    if stalled {
        m.faults.get_or_create(&FAULT_STALL).inc();
        if faults.stall_after_tokens.is_none() {
            m.stalled.inc();
            let _stalled = GaugeGuard(m.stalled.clone());
            // Hang until the client goes away (this future is then dropped) or shutdown ends it.
            return std::future::pending().await;
        }
    }

    // A provider's rate limit refuses before anything is queued.
    if let Some(limiter) = &shared.rate_limit
        && let Verdict::Refused { reset } = limiter.check(Instant::now())
    {
        m.rate_limited.inc();
        outcome.decided();
        count_response(&shared, endpoint, StatusCode::TOO_MANY_REQUESTS);
        let mut resp = error_response(
            &shared,
            StatusCode::TOO_MANY_REQUESTS,
            "Rate limit reached for requests: try again later",
            "requests",
            Some("rate_limit_exceeded"),
        );
        rate_limit::refusal_headers(resp.headers_mut(), limiter.limit(), reset);
        return resp;
    }

    let Some((slot, waited)) = shared.admission.admit(m).await else {
        m.refused.inc();
        outcome.decided();
        count_response(&shared, endpoint, shared.refuse_status);
        let mut resp = error_response(
            &shared,
            shared.refuse_status,
            "the server is overloaded: concurrency and queue are full",
            "server_overloaded",
            Some("queue_full"),
        );
        resp.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
        return resp;
    };
    m.queue_wait.observe(waited.as_secs_f64());

    let service: &ServiceTime = &shared.config.service;
    // The prompt's cached prefix, looked up as the request enters the batch (vLLM's scheduler
    // looks it up when it schedules the request).
    let cached_tokens = {
        let mut cache = shared.prefix_cache.lock();
        let cached = cache.lookup(&parsed.prompt_blocks, parsed.prompt_tokens);
        if cache.enabled() {
            m.prefix_cache_queries
                .inc_by(u64::from(parsed.prompt_tokens));
            m.prefix_cache_hits.inc_by(u64::from(cached));
        }
        cached
    };
    let tokens = parsed
        .max_tokens
        .unwrap_or(service.default_tokens)
        .min(service.max_tokens);
    let plan = Plan {
        tokens,
        capped: parsed.max_tokens.is_some(),
        prefill: service
            .prefill(parsed.prompt_tokens - cached_tokens)
            .mul_f64(draws.jitter),
        per_token: service.per_token.mul_f64(draws.jitter),
        stall_after: if stalled {
            faults.stall_after_tokens
        } else {
            None
        },
        prompt_tokens: parsed.prompt_tokens,
        cached_tokens,
        prompt_blocks: parsed.prompt_blocks,
        include_usage: parsed.include_usage,
    };
    let meta = ResponseMeta::new(
        endpoint,
        &shared.config.instance,
        shared.next_seq(),
        unix_now(),
        model,
    );

    if parsed.stream {
        let (tx, rx) = mpsc::channel(16);
        count_response(&shared, endpoint, StatusCode::OK);
        tokio::spawn(stream_tokens(
            Arc::clone(&shared),
            meta,
            plan,
            tx,
            slot,
            arrived,
            outcome,
        ));
        return sse_response(&shared, SimBody::stream(rx));
    }

    let mut text = String::new();
    let mut pacer = Pacer::start();
    for i in 0..plan.tokens {
        if plan.stall_after == Some(i) {
            return std::future::pending().await;
        }
        pacer.wait(plan.token_delay(i, &shared)).await;
        if i == 0 {
            m.time_to_first_token
                .observe(arrived.elapsed().as_secs_f64());
            plan.prefilled(&shared);
        }
        text.push_str(&openai::token_text(i));
        m.tokens.inc();
    }
    if plan.stall_after.is_some() {
        return std::future::pending().await;
    }
    drop(slot);
    outcome.decided();
    m.served.inc();
    m.duration.observe(arrived.elapsed().as_secs_f64());
    count_response(&shared, endpoint, StatusCode::OK);
    let value = openai::completion(&meta, &text, plan.finish_reason(), plan.usage());
    json_response(&shared, StatusCode::OK, &value)
}

/// Produces a streamed answer, one SSE event per token, while holding the request's slot. Stops
/// as soon as the client is gone (the body, hence the receiver, was dropped).
async fn stream_tokens(
    shared: Arc<Shared>,
    meta: ResponseMeta,
    plan: Plan,
    tx: mpsc::Sender<Bytes>,
    slot: Slot,
    arrived: Instant,
    outcome: Outcome,
) {
    let m = &shared.metrics;
    let send = |v: &serde_json::Value| tx.send(Bytes::from(openai::sse(v)));
    // With `include_usage`, every chunk before the usage chunk says `"usage": null`, as
    // OpenAI's and vLLM's streams do.
    let chunk = |index: u32, text: Option<&str>, finish: Option<&str>| {
        let mut v = openai::chunk(&meta, index, text, finish);
        if plan.include_usage {
            v["usage"] = serde_json::Value::Null;
        }
        v
    };
    let mut pacer = Pacer::start();
    for i in 0..plan.tokens {
        if plan.stall_after == Some(i) {
            tx.closed().await;
            return;
        }
        pacer.wait(plan.token_delay(i, &shared)).await;
        if i == 0 {
            m.time_to_first_token
                .observe(arrived.elapsed().as_secs_f64());
            plan.prefilled(&shared);
        }
        let text = openai::token_text(i);
        if send(&chunk(i, Some(&text), None)).await.is_err() {
            return;
        }
        m.tokens.inc();
    }
    if plan.stall_after.is_some() {
        tx.closed().await;
        return;
    }
    if send(&chunk(plan.tokens, None, Some(plan.finish_reason())))
        .await
        .is_err()
    {
        return;
    }
    if plan.include_usage
        && send(&openai::usage_chunk(&meta, plan.usage()))
            .await
            .is_err()
    {
        return;
    }
    if tx
        .send(Bytes::from_static(openai::SSE_DONE.as_bytes()))
        .await
        .is_err()
    {
        return;
    }
    drop(slot);
    outcome.decided();
    m.served.inc();
    m.duration.observe(arrived.elapsed().as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn mean(jitter: Jitter) -> f64 {
        let mut rng = StdRng::seed_from_u64(7);
        let n = 20_000;
        (0..n).map(|_| jitter_factor(jitter, &mut rng)).sum::<f64>() / f64::from(n)
    }

    #[test]
    fn jitter_has_mean_one() {
        assert_eq!(mean(Jitter::None), 1.0);
        for jitter in [Jitter::LogNormal { sigma: 0.5 }, Jitter::Exponential] {
            let mean = mean(jitter);
            assert!((0.95..1.05).contains(&mean), "{jitter:?}: mean {mean}");
        }
        let mut rng = StdRng::seed_from_u64(1);
        assert!((0..1000).all(|_| jitter_factor(Jitter::Exponential, &mut rng).is_finite()));
    }

    #[tokio::test]
    async fn pacer_keeps_sub_millisecond_token_times() {
        // 200 tokens of 100 µs: 20 ms in all, not 200 × one 1 ms timer tick.
        let start = Instant::now();
        let mut pacer = Pacer::start();
        for _ in 0..200 {
            pacer.wait(Duration::from_micros(100)).await;
        }
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(20), "{took:?}");
        assert!(took < Duration::from_millis(150), "{took:?}");
    }
}
