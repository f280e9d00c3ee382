//! modelsim's HTTP routes: the OpenAI endpoints (delegated to the engine), `/v1/models`,
//! `/health`, `/metrics`, and the admin API (`/admin/stats`, `/admin/faults`).

use std::sync::Arc;

use http::{HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{Value, json};

use super::body::SimBody;
use super::config::Faults;
use super::conn::ConnCtl;
use super::engine;
use super::openai::{self, Endpoint};
use super::response::{error_response, json_response};
use super::shared::Shared;

const ADMIN_BODY_LIMIT: usize = 64 << 10;

/// Routes one request.
pub(crate) async fn route(
    shared: Arc<Shared>,
    ctl: Arc<ConnCtl>,
    req: Request<Incoming>,
) -> Response<SimBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    match (path.as_str(), &method) {
        ("/v1/chat/completions", &Method::POST) => {
            engine::inference(shared, ctl, Endpoint::Chat, req).await
        }
        ("/v1/completions", &Method::POST) => {
            engine::inference(shared, ctl, Endpoint::Completions, req).await
        }
        ("/v1/models", &Method::GET) => json_response(
            &shared,
            StatusCode::OK,
            &openai::models(&shared.config.models, shared.started_unix),
        ),
        ("/health", &Method::GET) => health(&shared),
        ("/metrics", &Method::GET) => {
            let mut resp = Response::new(SimBody::full(shared.metrics.encode()));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            resp
        }
        ("/admin/stats", &Method::GET) => {
            let stats = shared.stats();
            json_response(
                &shared,
                StatusCode::OK,
                &serde_json::to_value(stats).unwrap_or(Value::Null),
            )
        }
        ("/admin/stats/reset-peaks", &Method::POST) => {
            shared.metrics.reset_peaks();
            let stats = shared.stats();
            json_response(
                &shared,
                StatusCode::OK,
                &serde_json::to_value(stats).unwrap_or(Value::Null),
            )
        }
        ("/admin/faults", &Method::GET) => faults_response(&shared),
        ("/admin/faults", &Method::PUT | &Method::PATCH) => {
            update_faults(&shared, &method, req).await
        }
        (
            "/v1/chat/completions"
            | "/v1/completions"
            | "/v1/models"
            | "/health"
            | "/metrics"
            | "/admin/stats"
            | "/admin/stats/reset-peaks"
            | "/admin/faults",
            _,
        ) => error_response(
            &shared,
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("{method} is not allowed on {path}"),
            "invalid_request_error",
            None,
        ),
        _ => error_response(
            &shared,
            StatusCode::NOT_FOUND,
            &format!("no route for {path}"),
            "invalid_request_error",
            None,
        ),
    }
}

fn health(shared: &Shared) -> Response<SimBody> {
    if shared.faults.borrow().health_failing {
        json_response(
            shared,
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "failing", "reason": "injected fault"}),
        )
    } else if shared.is_draining() {
        json_response(
            shared,
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "draining"}),
        )
    } else {
        json_response(shared, StatusCode::OK, &json!({"status": "ok"}))
    }
}

fn faults_response(shared: &Shared) -> Response<SimBody> {
    let faults = shared.faults.borrow().clone();
    json_response(
        shared,
        StatusCode::OK,
        &serde_json::to_value(faults).unwrap_or(Value::Null),
    )
}

/// `PUT` replaces the faults (absent fields mean "no fault"); `PATCH` changes only the fields
/// given. Either answers the faults now in force, or 400 with the old ones kept.
async fn update_faults(
    shared: &Shared,
    method: &Method,
    req: Request<Incoming>,
) -> Response<SimBody> {
    let bad = |message: String| {
        error_response(
            shared,
            StatusCode::BAD_REQUEST,
            &message,
            "invalid_request_error",
            None,
        )
    };
    let body = match Limited::new(req.into_body(), ADMIN_BODY_LIMIT)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) => return bad(format!("cannot read the request body: {e}")),
    };
    let update: Value = match serde_json::from_slice(&body) {
        Ok(Value::Object(update)) => Value::Object(update),
        Ok(_) => return bad("faults must be a JSON object".to_owned()),
        Err(e) => return bad(format!("faults are not valid JSON: {e}")),
    };
    let merged = if method == Method::PATCH {
        let mut current =
            serde_json::to_value(shared.faults.borrow().clone()).unwrap_or_else(|_| json!({}));
        if let (Value::Object(current), Value::Object(update)) = (&mut current, update) {
            current.extend(update);
        }
        current
    } else {
        update
    };
    let faults: Faults = match serde_json::from_value(merged) {
        Ok(faults) => faults,
        Err(e) => return bad(format!("invalid faults: {e}")),
    };
    if let Err(e) = shared.set_faults(faults) {
        return bad(e);
    }
    faults_response(shared)
}
