//! The one place where typed failures of a proxied request become HTTP responses (the
//! "rescue" of linkerd2-proxy's server stack): status, `Retry-After` and a small JSON body
//! `{"error": <reason>, "message": ..., "retryAfterSeconds": ...}`.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

use crate::body::ResponseBody;
use crate::limiter::ClientRejection;
use crate::pool::PoolError;

/// Why a request was not proxied, or not completely.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The client limiter refused it (429).
    #[error(transparent)]
    Client(#[from] ClientRejection),
    /// The pool could not lease a connection (503, or 502/504 for connect failures).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// No backend's route matches (404).
    #[error("no backend route matches the request")]
    NoRoute,
    /// The request head is larger than `maxHeaderBytes` or has more than `maxHeaders` (431).
    #[error("request headers exceed the limit ({0})")]
    HeadersTooLarge(&'static str),
    /// The request body is larger than `maxBodyBytes` (413).
    #[error("request body exceeds {limit} bytes")]
    BodyTooLarge {
        /// `maxBodyBytes`.
        limit: u64,
    },
    /// The backend sent no response head within `timeouts.firstByte` (504).
    #[error("backend {backend} sent no response within {timeout:?}")]
    FirstByteTimeout {
        /// The backend.
        backend: String,
        /// The timeout in force.
        timeout: Duration,
    },
    /// The backend failed the exchange (502).
    #[error("backend {backend} failed the request")]
    Upstream {
        /// The backend.
        backend: String,
        /// What hyper reported.
        #[source]
        source: hyper::Error,
    },
    /// Reading the client's request body failed (400).
    #[error("reading the request body failed")]
    ClientBody(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The gateway is draining (503).
    #[error("the gateway is shutting down")]
    ShuttingDown,
}

impl ProxyError {
    /// The HTTP status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Client(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Pool(e) => match e {
                PoolError::QueueFull { .. }
                | PoolError::LeaseTimeout { .. }
                | PoolError::NoHealthyEndpoint { .. }
                | PoolError::Retired { .. } => StatusCode::SERVICE_UNAVAILABLE,
                PoolError::ConnectTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
                PoolError::Connect { .. } => StatusCode::BAD_GATEWAY,
            },
            Self::NoRoute => StatusCode::NOT_FOUND,
            Self::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::FirstByteTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Self::Upstream { .. } => StatusCode::BAD_GATEWAY,
            Self::ClientBody(_) => StatusCode::BAD_REQUEST,
            Self::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The machine-readable reason in the JSON body.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Client(e) => e.reason(),
            Self::Pool(e) => match e {
                PoolError::QueueFull { .. } => "pool_queue_full",
                PoolError::LeaseTimeout { .. } => "lease_timeout",
                PoolError::NoHealthyEndpoint { .. } => "no_healthy_endpoint",
                PoolError::Retired { .. } => "backend_removed",
                PoolError::ConnectTimeout { .. } => "connect_timeout",
                PoolError::Connect { .. } => "connect_failed",
            },
            Self::NoRoute => "no_route",
            Self::HeadersTooLarge(_) => "headers_too_large",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::FirstByteTimeout { .. } => "first_byte_timeout",
            Self::Upstream { .. } => "upstream_error",
            Self::ClientBody(_) => "bad_request_body",
            Self::ShuttingDown => "shutting_down",
        }
    }

    /// When the client should retry, if it should.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Client(
                ClientRejection::Concurrency { retry_after, .. }
                | ClientRejection::QueueTimeout { retry_after, .. },
            ) => Some(*retry_after),
            Self::Pool(
                PoolError::QueueFull { retry_after, .. }
                | PoolError::LeaseTimeout { retry_after, .. }
                | PoolError::NoHealthyEndpoint { retry_after, .. },
            ) => Some(*retry_after),
            _ => None,
        }
    }

    /// The response the client gets.
    pub fn to_response(&self) -> Response<ResponseBody> {
        let retry_after = self.retry_after().map(|d| d.as_secs().max(1));
        let mut body = serde_json::json!({
            "error": self.reason(),
            "message": self.to_string(),
        });
        if let Some(secs) = retry_after {
            body["retryAfterSeconds"] = secs.into();
        }
        let mut response = json_response(self.status(), &body);
        if let Some(secs) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
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
                None,
            ),
            (ProxyError::NoRoute, 404, "no_route", None),
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
                ProxyError::FirstByteTimeout {
                    backend: "model-a".into(),
                    timeout: Duration::from_secs(15),
                },
                504,
                "first_byte_timeout",
                None,
            ),
        ];
        for (err, status, reason, retry) in cases {
            let response = err.to_response();
            assert_eq!(response.status().as_u16(), status, "{reason}");
            let header = response
                .headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
            assert_eq!(header, retry, "{reason}");
            let body = body_json(response).await;
            assert_eq!(body["error"], reason);
            assert_eq!(body["retryAfterSeconds"].as_u64(), retry);
        }
    }
}
