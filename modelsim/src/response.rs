//! The responses every route builds: JSON, OpenAI-style errors and the head of an SSE stream,
//! each carrying the `x-modelsim-instance` header.

use http::{HeaderValue, StatusCode, header};
use hyper::Response;
use serde_json::Value;

use super::body::SimBody;
use super::openai;
use super::shared::Shared;

fn with_instance(shared: &Shared, mut resp: Response<SimBody>) -> Response<SimBody> {
    if let Some(instance) = &shared.instance_header {
        resp.headers_mut()
            .insert("x-modelsim-instance", instance.clone());
    }
    resp
}

/// A JSON response.
pub(crate) fn json_response(
    shared: &Shared,
    status: StatusCode,
    value: &Value,
) -> Response<SimBody> {
    let mut resp = Response::new(SimBody::full(value.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    with_instance(shared, resp)
}

/// An OpenAI-style error response.
pub(crate) fn error_response(
    shared: &Shared,
    status: StatusCode,
    message: &str,
    kind: &str,
    code: Option<&str>,
) -> Response<SimBody> {
    json_response(shared, status, &openai::error(message, kind, code))
}

/// The head of a streamed (SSE) answer.
pub(crate) fn sse_response(shared: &Shared, body: SimBody) -> Response<SimBody> {
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    with_instance(shared, resp)
}
