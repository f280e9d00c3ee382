//! The admin API, on its own port: `GET /healthz`, `/readyz`, `/metrics`, `/v1/limits`,
//! `/v1/stats`, and `PUT /v1/limits` (bearer token, validated, swapped atomically; 200, 401,
//! 409 or 422 with the old limits kept).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use poolpilot_api::GatewayLimits;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::body::ResponseBody;
use crate::error::json_response;
use crate::gateway::{ApplyError, Gateway, LimitsSource};

/// Largest limits document accepted.
const MAX_DOCUMENT_BYTES: usize = 4 * 1024 * 1024;

/// The admin bearer token, kept only as its SHA-256.
#[derive(Clone)]
pub struct AdminToken {
    digest: Option<[u8; 32]>,
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminToken")
            .field("configured", &self.digest.is_some())
            .finish()
    }
}

impl AdminToken {
    /// A token; `None` refuses every `PUT`.
    pub fn new(token: Option<&str>) -> Self {
        Self {
            digest: token.map(|t| Sha256::digest(t.trim().as_bytes()).into()),
        }
    }

    /// Whether `authorization` is `Bearer <the token>`. Compares digests in constant time, so
    /// the time taken says nothing about how much of a guess was right.
    pub fn allows(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(expected) = &self.digest else {
            return false;
        };
        let Some(presented) = authorization.and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        else {
            return false;
        };
        let presented: [u8; 32] = Sha256::digest(presented).into();
        presented
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// Serves the admin API until `shutdown` turns true.
pub async fn serve(
    listener: TcpListener,
    gw: Gateway,
    token: AdminToken,
    mut shutdown: watch::Receiver<bool>,
) {
    let token = Arc::new(token);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let Ok((stream, _)) = accepted else {
            gw.metrics().accept_error();
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let (gw, token) = (gw.clone(), token.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let (gw, token) = (gw.clone(), token.clone());
                async move { Ok::<_, Infallible>(route(&gw, &token, req).await) }
            });
            let builder = auto::Builder::new(TokioExecutor::new());
            if let Err(error) = builder
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "admin connection ended with an error");
            }
        });
    }
}

/// Answers one admin request.
pub async fn route(
    gw: &Gateway,
    token: &AdminToken,
    req: Request<Incoming>,
) -> Response<ResponseBody> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") if gw.is_ready() => text(StatusCode::OK, "ready\n"),
        (&Method::GET, "/readyz") if gw.is_draining() => {
            text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
        }
        (&Method::GET, "/readyz") if gw.is_awaiting_operator() => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for the operator to send this pod its limits\n",
        ),
        (&Method::GET, "/readyz") => text(StatusCode::SERVICE_UNAVAILABLE, "no limits loaded\n"),
        (&Method::GET, "/metrics") => {
            let mut response = text(StatusCode::OK, gw.scrape());
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
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
        (&Method::PUT, "/v1/limits") => put_limits(gw, token, req).await,
        (&Method::GET, "/v1/stats") => json_response(StatusCode::OK, &gw.stats()),
        (_, "/healthz" | "/readyz" | "/metrics" | "/v1/limits" | "/v1/stats") => {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => error(StatusCode::NOT_FOUND, "no such admin endpoint"),
    }
}

async fn put_limits(
    gw: &Gateway,
    token: &AdminToken,
    req: Request<Incoming>,
) -> Response<ResponseBody> {
    if !token.allows(req.headers().get(header::AUTHORIZATION)) {
        let mut response = error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return response;
    }
    let yaml = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("yaml"));
    let bytes = match Limited::new(req.into_body(), MAX_DOCUMENT_BYTES)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("reading the document failed: {e}"),
            );
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
        Err(e @ ApplyError::Invalid(_)) => error(StatusCode::UNPROCESSABLE_ENTITY, &e.to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_token_is_allowed() {
        let token = AdminToken::new(Some("s3cret\n"));
        let allows = |v: &str| token.allows(Some(&HeaderValue::from_str(v).unwrap()));
        assert!(allows("Bearer s3cret"));
        assert!(!allows("Bearer s3cre"));
        assert!(!allows("Bearer s3cret2"));
        assert!(!allows("Basic s3cret"));
        assert!(!token.allows(None));
        assert!(!AdminToken::new(None).allows(Some(&HeaderValue::from_static("Bearer "))));
        assert!(!format!("{token:?}").contains("s3cret"));
    }
}
