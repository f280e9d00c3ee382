//! The one place where typed failures of a proxied request become HTTP responses (the
//! "rescue" of linkerd2-proxy's server stack): status, `Retry-After`, and a body in the
//! OpenAI error shape that SDKs parse, `{"error": {"message", "type", "param", "code"}}`, with
//! the gateway's machine-readable reason as `code`; but a refusal by a token budget is worded as
//! OpenAI's own (`type` `tokens` or `requests`, `code` `rate_limit_exceeded`) and carries the
//! `x-ratelimit-*` headers ([`crate::tokens::headers`]).
//!
//! Every 503, and every 502/504 a retry can cure (another endpoint, a connection that was not
//! stale), carries `Retry-After`, and beside it `retry-after-ms` (read first by OpenAI's SDKs):
//! a token budget's refill to the millisecond, else the same whole seconds. The message a client sees names no internal address or
//! endpoint: those stay in the gateway's logs (the error's `Display`).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

use super::body::ResponseBody;
use crate::limits::limiter::ClientRejection;
use crate::observe::TimeoutKind;
use crate::pool::PoolError;
use crate::tokens::budget::TokenRejection;
use crate::tokens::headers;
use crate::upstream::TlsError;

/// `Retry-After` of failures whose cause passes quickly (a stale connection, an endpoint about
/// to be ejected, a pod going away behind its Service): come back in a second.
const RETRY_SOON: Duration = Duration::from_secs(1);

/// `retry-after-ms`: `Retry-After` in milliseconds, as OpenAI and Azure OpenAI send it;
/// OpenAI's SDKs read it before `Retry-After`.
pub const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// `Retry-After` of a gateway without backends: a policy takes a reconcile to arrive.
const NO_BACKENDS_RETRY: Duration = Duration::from_secs(5);

/// Why a request was not proxied, or not completely.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The client limiter refused it (429, or 503 when the client table is full).
    #[error(transparent)]
    Client(#[from] ClientRejection),
    /// The client's token budget refused it (429).
    #[error(transparent)]
    Tokens(#[from] Box<TokenRejection>),
    /// The pool could not lease a connection (503, or 502/504 for connect failures).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// No backend's route matches (404); the text says what routing read of the body's
    /// `model` when a route needs it ([`super::route::BodyModel::miss`]).
    #[error("no backend route matches the request{0}")]
    NoRoute(String),
    /// The gateway has no backends at all (503): no ConnectionPolicy selects this pod yet, or
    /// the last one that did was deleted.
    #[error(
        "this gateway has no backends: no ConnectionPolicy selects this gateway pod yet (see its /readyz and the poolpilot_limits_loaded gauge)"
    )]
    NoBackends,
    /// The request head is larger than `maxHeaderBytes` or has more than `maxHeaders` (431).
    #[error("request headers exceed the limit ({0})")]
    HeadersTooLarge(&'static str),
    /// The request body is larger than `maxBodyBytes` (413).
    #[error("request body exceeds {limit} bytes")]
    BodyTooLarge {
        /// `maxBodyBytes`.
        limit: u64,
    },
    /// The request body stalled past `bodyReadTimeout` or arrived slower than `minBodyRate`
    /// (408).
    #[error("the request body was not received in time")]
    BodyTimeout,
    /// Buffering the body for routing would take the pod over `routeBufferBudget` (503).
    #[error("the gateway holds too many request bodies for routing")]
    RouteBufferFull,
    /// The backend sent no response head in time (504): `firstByte` after the request body was
    /// sent, or `total`.
    #[error("backend {backend} sent no response in time ({})", kind.as_str())]
    UpstreamTimeout {
        /// The backend.
        backend: String,
        /// Which timeout.
        kind: TimeoutKind,
    },
    /// The backend failed the exchange (502).
    #[error("backend {backend} failed the request")]
    Upstream {
        /// The backend.
        backend: String,
        /// What went wrong on the connection.
        #[source]
        source: crate::upstream::UpstreamError,
    },
    /// The backend closed a reused keep-alive connection after the request was written and
    /// before any byte of a response (its idle timer fired as the request came), and the
    /// request is not safe to send twice (502): not idempotent and without `Idempotency-Key`,
    /// or its body was streamed, not held.
    #[error(
        "backend {backend} closed a reused connection before answering; the request was not retried because it may not be safe to send twice (not idempotent, no Idempotency-Key, or its body was streamed)"
    )]
    UpstreamClosed {
        /// The backend.
        backend: String,
        /// What went wrong on the connection.
        #[source]
        source: crate::upstream::UpstreamError,
    },
    /// Reading the client's request body failed (400).
    #[error("reading the request body failed")]
    ClientBody(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The gateway is draining (503).
    #[error("the gateway is shutting down")]
    ShuttingDown,
    /// The request head breaks a MUST of RFC 9110/9112 (400).
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// The request target's path holds `.`/`..` or empty segments, or encoded slashes (400).
    #[error("the request path has dot segments, empty segments or encoded slashes")]
    BadTarget,
    /// The provider refused a call with `Retry-After` a moment ago, and that time has not
    /// passed (429, with what is left of it).
    #[error("the provider of backend {backend} asked not to be called for {retry_after:?} more")]
    CoolingDown {
        /// The backend.
        backend: String,
        /// What is left of the provider's `Retry-After`.
        retry_after: Duration,
    },
    /// `CONNECT` or `TRACE` (501).
    #[error("this method is not supported by the gateway")]
    MethodNotImplemented,
    /// The connection's source holds `maxConnectionsPerClient` connections already (429, and
    /// the connection is closed).
    #[error("this client holds too many connections to the gateway: reuse or close some")]
    TooManyConnections,
}

impl ProxyError {
    /// The TLS failure behind a connect failure, if that is what it was.
    fn tls(&self) -> Option<&TlsError> {
        match self {
            Self::Pool(PoolError::Connect { source, .. }) => source.get_ref()?.downcast_ref(),
            _ => None,
        }
    }

    /// The HTTP status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Client(ClientRejection::TableFull { .. }) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Client(_)
            | Self::Tokens(_)
            | Self::TooManyConnections
            | Self::CoolingDown { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Pool(e) => match e {
                PoolError::QueueFull { .. }
                | PoolError::LeaseTimeout { .. }
                | PoolError::NoHealthyEndpoint { .. }
                | PoolError::Retired { .. } => StatusCode::SERVICE_UNAVAILABLE,
                PoolError::ConnectTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
                PoolError::Connect { .. } => StatusCode::BAD_GATEWAY,
            },
            Self::NoRoute(_) => StatusCode::NOT_FOUND,
            Self::NoBackends => StatusCode::SERVICE_UNAVAILABLE,
            Self::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::RouteBufferFull => StatusCode::SERVICE_UNAVAILABLE,
            Self::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Self::Upstream { .. } | Self::UpstreamClosed { .. } => StatusCode::BAD_GATEWAY,
            Self::ClientBody(_) | Self::BadRequest(_) | Self::BadTarget => StatusCode::BAD_REQUEST,
            Self::MethodNotImplemented => StatusCode::NOT_IMPLEMENTED,
            Self::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The machine-readable reason (the body's `error.code`).
    pub fn reason(&self) -> &'static str {
        if let Some(tls) = self.tls() {
            return if tls.is_verification() {
                "upstream_tls_verification_failed"
            } else {
                "upstream_tls_failed"
            };
        }
        match self {
            Self::Client(e) => e.reason(),
            Self::Tokens(_) => "client_tokens",
            Self::Pool(e) => match e {
                PoolError::QueueFull { .. } => "pool_queue_full",
                PoolError::LeaseTimeout { .. } => "lease_timeout",
                PoolError::NoHealthyEndpoint { .. } => "no_healthy_endpoint",
                PoolError::Retired { .. } => "backend_removed",
                PoolError::ConnectTimeout { .. } => "connect_timeout",
                PoolError::Connect { .. } => "connect_failed",
            },
            Self::NoRoute(_) => "no_route",
            Self::NoBackends => "no_backends",
            Self::HeadersTooLarge(_) => "headers_too_large",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::BodyTimeout => "body_timeout",
            Self::RouteBufferFull => "route_buffer_full",
            Self::UpstreamTimeout {
                kind: TimeoutKind::Total,
                ..
            } => "total_timeout",
            Self::UpstreamTimeout { .. } => "first_byte_timeout",
            Self::Upstream { .. } => "upstream_error",
            Self::UpstreamClosed { .. } => "upstream_closed_unanswered",
            Self::ClientBody(_) => "bad_request_body",
            Self::ShuttingDown => "shutting_down",
            Self::BadRequest(_) => "bad_request",
            Self::BadTarget => "bad_request_target",
            Self::MethodNotImplemented => "method_not_supported",
            Self::TooManyConnections => "too_many_connections",
            Self::CoolingDown { .. } => "backend_cooling_down",
        }
    }

    /// When the client should retry, if it should: every 503, and the 502/504s a retry can
    /// cure.
    pub fn retry_after(&self) -> Option<Duration> {
        // A certificate that does not verify will not verify in a second either.
        if self.tls().is_some_and(TlsError::is_verification) {
            return None;
        }
        match self {
            Self::Client(
                ClientRejection::Concurrency { retry_after, .. }
                | ClientRejection::QueueTimeout { retry_after, .. },
            ) => Some(*retry_after),
            Self::Client(ClientRejection::TableFull { .. }) => Some(RETRY_SOON),
            // Rounded up: a client back at the whole second is past the provider's time.
            Self::CoolingDown { retry_after, .. } => Some(Duration::from_secs(
                retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0),
            )),
            Self::Tokens(r) => Some(r.retry_after),
            Self::Pool(
                PoolError::QueueFull { retry_after, .. }
                | PoolError::LeaseTimeout { retry_after, .. }
                | PoolError::NoHealthyEndpoint { retry_after, .. },
            ) => Some(*retry_after),
            Self::Pool(
                PoolError::Retired { .. }
                | PoolError::ConnectTimeout { .. }
                | PoolError::Connect { .. },
            )
            | Self::RouteBufferFull
            | Self::UpstreamTimeout { .. }
            | Self::Upstream { .. }
            | Self::UpstreamClosed { .. }
            | Self::ShuttingDown
            | Self::TooManyConnections => Some(RETRY_SOON),
            Self::NoBackends => Some(NO_BACKENDS_RETRY),
            Self::NoRoute(_)
            | Self::HeadersTooLarge(_)
            | Self::BodyTooLarge { .. }
            | Self::BodyTimeout
            | Self::ClientBody(_)
            | Self::BadRequest(_)
            | Self::BadTarget
            | Self::MethodNotImplemented => None,
        }
    }

    /// When the client should retry, to the millisecond (`retry-after-ms`), whenever
    /// [`ProxyError::retry_after`] says it should: a token budget's wait for its refill
    /// exactly (at least 1 ms, at most `Retry-After`), else `Retry-After`'s whole seconds.
    pub fn retry_after_ms(&self) -> Option<u64> {
        let secs = self.retry_after()?.as_secs().max(1);
        Some(match self {
            Self::Tokens(r) => {
                let ms = u64::try_from(r.wait.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX);
                ms.clamp(1, secs.saturating_mul(1000))
            }
            _ => secs.saturating_mul(1000),
        })
    }

    /// What the client is told: the `Display` text, except for failures whose text names an
    /// endpoint or its address.
    fn public_message(&self) -> String {
        if let Some(tls) = self.tls() {
            return tls.public_message();
        }
        match self {
            Self::Pool(PoolError::ConnectTimeout { .. }) => {
                "connecting to a backend instance timed out".to_owned()
            }
            Self::Pool(PoolError::Connect { .. }) => {
                "connecting to a backend instance failed".to_owned()
            }
            other => other.to_string(),
        }
    }

    /// The response the client gets.
    pub fn to_response(&self) -> Response<ResponseBody> {
        let status = self.status();
        let retry_after = self.retry_after().map(|d| d.as_secs().max(1));
        let retry_after_ms = self.retry_after_ms();
        let mut response = match self {
            Self::Tokens(r) => {
                let mut response = openai_error(
                    status,
                    r.exhausted.error_type(),
                    "rate_limit_exceeded",
                    &self.public_message(),
                );
                headers::insert(response.headers_mut(), &r.quote);
                response
            }
            _ => error_response(status, self.reason(), &self.public_message()),
        };
        if let Some(secs) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Some(ms) = retry_after_ms {
            response
                .headers_mut()
                .insert(RETRY_AFTER_MS, HeaderValue::from(ms));
        }
        response
    }
}

/// The OpenAI `error.type` of a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

/// A response in the OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`.
pub fn error_response(status: StatusCode, code: &str, message: &str) -> Response<ResponseBody> {
    openai_error(status, error_type(status), code, message)
}

/// A response in the OpenAI error shape with its `type` given.
fn openai_error(
    status: StatusCode,
    kind: &str,
    code: &str,
    message: &str,
) -> Response<ResponseBody> {
    json_response(
        status,
        &serde_json::json!({
            "error": {
                "message": message,
                "type": kind,
                "param": null,
                "code": code,
            }
        }),
    )
}

/// A JSON response with `status`.
pub fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<ResponseBody> {
    let bytes = Bytes::from(body.to_string());
    let mut response = Response::new(
        Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn backend() -> Arc<str> {
        "model-a".into()
    }

    async fn body_json(r: Response<ResponseBody>) -> serde_json::Value {
        let bytes = r.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn each_failure_has_its_status_reason_and_hint() {
        let cases: Vec<(ProxyError, u16, &str, Option<u64>)> = vec![
            (
                ClientRejection::Concurrency {
                    client: "other".into(),
                    limit: 8,
                    retry_after: Duration::from_secs(3),
                }
                .into(),
                429,
                "client_concurrency",
                Some(3),
            ),
            (
                ClientRejection::QueueTimeout {
                    client: "other".into(),
                    waited: Duration::from_secs(2),
                    retry_after: Duration::from_secs(4),
                }
                .into(),
                429,
                "client_queue_timeout",
                Some(4),
            ),
            (
                PoolError::QueueFull {
                    backend: backend(),
                    pending: 128,
                    retry_after: Duration::from_secs(2),
                }
                .into(),
                503,
                "pool_queue_full",
                Some(2),
            ),
            (
                PoolError::LeaseTimeout {
                    backend: backend(),
                    waited: Duration::from_millis(300),
                    retry_after: Duration::from_secs(1),
                }
                .into(),
                503,
                "lease_timeout",
                Some(1),
            ),
            (
                PoolError::NoHealthyEndpoint {
                    backend: backend(),
                    retry_after: Duration::from_secs(10),
                }
                .into(),
                503,
                "no_healthy_endpoint",
                Some(10),
            ),
            (
                PoolError::ConnectTimeout {
                    endpoint: "ep".into(),
                    address: ([127, 0, 0, 1], 1).into(),
                    timeout: Duration::from_secs(1),
                }
                .into(),
                504,
                "connect_timeout",
                Some(1),
            ),
            (ProxyError::NoRoute(String::new()), 404, "no_route", None),
            (ProxyError::NoBackends, 503, "no_backends", Some(5)),
            (
                ProxyError::HeadersTooLarge("count"),
                431,
                "headers_too_large",
                None,
            ),
            (
                ProxyError::BodyTooLarge { limit: 10 },
                413,
                "body_too_large",
                None,
            ),
            (
                ProxyError::UpstreamTimeout {
                    backend: "model-a".into(),
                    kind: TimeoutKind::FirstByte,
                },
                504,
                "first_byte_timeout",
                Some(1),
            ),
            (ProxyError::BodyTimeout, 408, "body_timeout", None),
            (
                ProxyError::RouteBufferFull,
                503,
                "route_buffer_full",
                Some(1),
            ),
            (ProxyError::ShuttingDown, 503, "shutting_down", Some(1)),
            (
                ProxyError::TooManyConnections,
                429,
                "too_many_connections",
                Some(1),
            ),
            (
                PoolError::Retired { backend: backend() }.into(),
                503,
                "backend_removed",
                Some(1),
            ),
        ];
        for (err, status, reason, retry) in cases {
            let response = err.to_response();
            assert_eq!(response.status().as_u16(), status, "{reason}");
            let header = |name| {
                response
                    .headers()
                    .get(name)
                    .map(|v| v.to_str().unwrap().parse::<u64>().unwrap())
            };
            assert_eq!(header(header::RETRY_AFTER), retry, "{reason}");
            assert_eq!(
                header(RETRY_AFTER_MS),
                retry.map(|secs| secs * 1000),
                "{reason}: retry-after-ms beside Retry-After, the same time"
            );
            let body = body_json(response).await;
            assert_eq!(body["error"]["code"], reason);
            let kind = match status {
                429 => "rate_limit_error",
                400..=499 => "invalid_request_error",
                _ => "server_error",
            };
            assert_eq!(body["error"]["type"], kind, "{reason}");
            assert!(body["error"]["message"].is_string(), "{reason}");
            assert!(body["error"]["param"].is_null(), "{reason}");
        }
    }

    #[tokio::test]
    async fn a_token_refusal_reads_as_openais_with_its_headers() {
        use crate::tokens::budget::{Exhausted, Quote};
        let quote = Quote {
            limit_tokens: 600,
            remaining_tokens: 12,
            reset_tokens: Duration::from_millis(58_800),
            requests: None,
        };
        let error = ProxyError::from(Box::new(TokenRejection {
            client: "other".into(),
            exhausted: Exhausted::TokensPerMinute,
            limit: 600,
            remaining: 12,
            requested: 100,
            retry_after: Duration::from_secs(9),
            wait: Duration::from_micros(8_200_400),
            quote,
        }));
        assert_eq!(error.reason(), "client_tokens");
        let response = error.to_response();
        assert_eq!(response.status(), 429);
        let h = response.headers();
        assert_eq!(h[header::RETRY_AFTER], "9");
        // The refill to the millisecond, rounded up: never before the tokens are there.
        assert_eq!(h[RETRY_AFTER_MS], "8201");
        assert_eq!(h["x-ratelimit-limit-tokens"], "600");
        assert_eq!(h["x-ratelimit-remaining-tokens"], "12");
        assert_eq!(h["x-ratelimit-reset-tokens"], "58.8s");
        let body = body_json(response).await;
        assert_eq!(body["error"]["type"], "tokens");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("tokens per minute: limit 600, remaining 12, requested 100"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_client_is_never_told_an_endpoint_or_its_address() {
        let address: std::net::SocketAddr = ([10, 244, 3, 7], 8000).into(); // hermetic: not a destination (an error's text)
        let errors: Vec<ProxyError> = vec![
            PoolError::ConnectTimeout {
                endpoint: "model-a-7f9c".into(),
                address,
                timeout: Duration::from_secs(1),
            }
            .into(),
            PoolError::Connect {
                endpoint: "model-a-7f9c".into(),
                address,
                source: std::io::ErrorKind::ConnectionRefused.into(),
            }
            .into(),
        ];
        for error in errors {
            assert!(error.to_string().contains("10.244.3.7"), "the log keeps it");
            let body = body_json(error.to_response()).await.to_string();
            assert!(!body.contains("10.244.3.7"), "{body}");
            assert!(!body.contains("model-a-7f9c"), "{body}");
        }
    }
}
