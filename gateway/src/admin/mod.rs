//! The admin API, on its own port: `GET /healthz`, `/readyz` (`?requireLimits=true`) and
//! `/metrics` for probes and Prometheus, and behind the bearer token `GET /v1/limits`, `GET /v1/stats`,
//! `GET /v1/clients` (`?by=tokens`),
//! `PUT /v1/limits` (validated, swapped atomically; 200, 401, 408, 409, 413 or 422 with the old
//! limits kept), `GET`/`PUT /v1/log-level` (the log filter, changed at run time) and
//! `POST /v1/backends/{backend}/endpoints/{endpoint}/drain` (or `/restore`).
//!
//! ```text
//!  listener: connection cap, timeouts, optional TLS (tls: certificate re-read when it changes)
//!     └─► route: token (token: re-read when it changes, old and new during an overlap) ─► gateway
//! ```

pub mod listener;
pub mod tls;
pub mod token;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use poolpilot_api::GatewayLimits;
use poolpilot_api::limits::MAX_DOCUMENT_BYTES;

pub use listener::AdminListener;
pub use token::AdminTokens;

use crate::limits::limiter::Ranking;
use crate::live::{ApplyError, Gateway, LimitsSource};
use crate::proxy::body::ResponseBody;
use crate::proxy::error::json_response;

/// Answers one admin request; a body must arrive within `body_timeout`.
pub async fn route(
    gw: &Gateway,
    tokens: &AdminTokens,
    body_timeout: Duration,
    req: Request<Incoming>,
) -> Response<ResponseBody> {
    let path = req.uri().path();
    if path.starts_with("/v1/") && !tokens.allows(req.headers().get(header::AUTHORIZATION)) {
        let mut response = error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return response;
    }
    match (req.method(), path) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") => readyz(gw, req.uri().query()),
        (&Method::GET, "/metrics") => {
            // The classic text format unless the scraper accepts OpenMetrics (Prometheus does).
            let format = poolpilot_telemetry::Format::negotiate(
                req.headers()
                    .get(header::ACCEPT)
                    .and_then(|v| v.to_str().ok()),
            );
            let mut response = text(StatusCode::OK, gw.scrape(format));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(format.content_type()),
            );
            response
        }
        (&Method::GET, "/v1/limits") => {
            let snapshot = gw.snapshot();
            json_response(
                StatusCode::OK,
                &serde_json::to_value(&snapshot.limits).unwrap_or_default(),
            )
        }
        (&Method::PUT, "/v1/limits") => put_limits(gw, body_timeout, req).await,
        (&Method::GET, "/v1/stats") => json_response(StatusCode::OK, &gw.stats()),
        (&Method::GET, "/v1/clients") => match ranking(req.uri().query()) {
            Ok(by) => json_response(StatusCode::OK, &gw.clients(by)),
            Err(bad) => error(
                StatusCode::BAD_REQUEST,
                &format!("by={bad}: rank by demand (the default) or tokens"),
            ),
        },
        (&Method::GET, "/v1/log-level") => match crate::observe::logging::level() {
            Ok(level) => json_response(StatusCode::OK, &serde_json::json!({ "level": level })),
            Err(e) => error(StatusCode::CONFLICT, &e.to_string()),
        },
        (&Method::PUT, "/v1/log-level") => put_log_level(body_timeout, req).await,
        (
            _,
            "/healthz" | "/readyz" | "/metrics" | "/v1/limits" | "/v1/stats" | "/v1/clients"
            | "/v1/log-level",
        ) => error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        (method, path) if path.starts_with("/v1/backends/") => drain_or_restore(gw, method, path),
        _ => error(StatusCode::NOT_FOUND, "no such admin endpoint"),
    }
}

/// The ranking `GET /v1/clients?by=` asks for (`demand` when absent), or the value it does not
/// know.
fn ranking(query: Option<&str>) -> Result<Ranking, String> {
    let by = query
        .unwrap_or_default()
        .split('&')
        .find_map(|pair| pair.strip_prefix("by="));
    match by {
        None => Ok(Ranking::default()),
        Some(by) => Ranking::parse(by).ok_or_else(|| by.to_owned()),
    }
}

/// `GET /readyz`: 200 while the gateway serves, limits or not (a pod no ConnectionPolicy selects
/// yet answers its calls 503 `no_backends`); 503 while draining or waiting for the operator's
/// first PUT. `?requireLimits=true`: 503 also until a limits document is loaded.
fn readyz(gw: &Gateway, query: Option<&str>) -> Response<ResponseBody> {
    let require_limits = query.unwrap_or_default().split('&').any(|pair| {
        matches!(
            pair.split_once('=').unwrap_or((pair, "true")),
            ("requireLimits", "true" | "1")
        )
    });
    let loaded = gw.limits_loaded();
    if gw.is_draining() {
        text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else if gw.is_awaiting_operator() {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for the operator to send this pod its limits\n",
        )
    } else if !gw.is_ready() {
        text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
    } else if loaded {
        text(StatusCode::OK, "ready\n")
    } else if require_limits {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "no limits loaded: no ConnectionPolicy selects this pod yet\n",
        )
    } else {
        text(
            StatusCode::OK,
            "ready, no limits loaded: no ConnectionPolicy selects this pod yet (calls get 503 no_backends)\n",
        )
    }
}

/// `POST /v1/backends/{backend}/endpoints/{endpoint}/drain` (or `/restore`).
fn drain_or_restore(gw: &Gateway, method: &Method, path: &str) -> Response<ResponseBody> {
    let parts: Vec<&str> = path
        .trim_start_matches("/v1/backends/")
        .split('/')
        .collect();
    let [backend, "endpoints", endpoint, action] = parts[..] else {
        return error(StatusCode::NOT_FOUND, "no such admin endpoint");
    };
    let drained = match action {
        "drain" => true,
        "restore" => false,
        _ => return error(StatusCode::NOT_FOUND, "no such admin endpoint"),
    };
    if method != Method::POST {
        return error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
    }
    match gw.set_endpoint_drained(backend, endpoint, drained) {
        Some(stats) => {
            let mut body = serde_json::to_value(stats).unwrap_or_default();
            body["backend"] = backend.into();
            json_response(StatusCode::OK, &body)
        }
        None => error(
            StatusCode::NOT_FOUND,
            &format!("no endpoint {endpoint:?} in backend {backend:?}"),
        ),
    }
}

/// `PUT /v1/log-level` with `{"level": "<directives>"}` (or the directives as plain text).
async fn put_log_level(body_timeout: Duration, req: Request<Incoming>) -> Response<ResponseBody> {
    let read = Limited::new(req.into_body(), 4096).collect();
    let bytes = match tokio::time::timeout(body_timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("reading the level failed: {e}"),
            );
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                "the level did not arrive in time",
            );
        }
    };
    let asked = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(doc)) => match doc.get("level").and_then(|l| l.as_str()) {
            Some(level) => level.to_owned(),
            None => {
                return error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "expected {\"level\": \"<level or RUST_LOG directives>\"}",
                );
            }
        },
        _ => String::from_utf8_lossy(&bytes).into_owned(),
    };
    match crate::observe::logging::set_level(&asked) {
        Ok(previous) => json_response(
            StatusCode::OK,
            &serde_json::json!({ "level": asked.trim(), "previous": previous }),
        ),
        Err(e @ crate::observe::logging::LogLevelError::Invalid { .. }) => {
            error(StatusCode::UNPROCESSABLE_ENTITY, &e.to_string())
        }
        Err(e) => error(StatusCode::CONFLICT, &e.to_string()),
    }
}

async fn put_limits(
    gw: &Gateway,
    body_timeout: Duration,
    req: Request<Incoming>,
) -> Response<ResponseBody> {
    let yaml = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("yaml"));
    let read = Limited::new(req.into_body(), MAX_DOCUMENT_BYTES).collect();
    let bytes = match tokio::time::timeout(body_timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("reading the document failed: {e}"),
            );
        }
        Err(_) => {
            let mut response = error(
                StatusCode::REQUEST_TIMEOUT,
                &format!("the document did not arrive within {body_timeout:?}"),
            );
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return response;
        }
    };
    let parsed: Result<GatewayLimits, String> = if yaml {
        serde_norway::from_slice(&bytes).map_err(|e| e.to_string())
    } else {
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())
    };
    let doc = match parsed {
        Ok(doc) => doc,
        Err(e) => {
            gw.metrics().limits_rejected("api");
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                &format!("not a limits document: {e}"),
            );
        }
    };
    match gw.apply(doc, LimitsSource::Api) {
        Ok(applied) => json_response(
            StatusCode::OK,
            &serde_json::to_value(applied).unwrap_or_default(),
        ),
        Err(e @ (ApplyError::Invalid(_) | ApplyError::Tls(_) | ApplyError::Credentials { .. })) => {
            error(StatusCode::UNPROCESSABLE_ENTITY, &e.to_string())
        }
        Err(e @ (ApplyError::Stale { .. } | ApplyError::Conflict { .. })) => {
            let current = gw.snapshot();
            let mut body = serde_json::json!({"error": e.to_string()});
            body["revision"] = current.limits.revision.clone().into();
            body["generation"] = current.limits.generation.into();
            json_response(StatusCode::CONFLICT, &body)
        }
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<ResponseBody> {
    let mut response = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

fn error(status: StatusCode, message: &str) -> Response<ResponseBody> {
    json_response(status, &serde_json::json!({ "error": message }))
}
