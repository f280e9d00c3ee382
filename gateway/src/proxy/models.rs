//! `GET /v1/models` and `GET /v1/models/{id}` answered by the gateway from the routes in force:
//! every route that matches a JSON `model` names one model, served by its backend. Clients such
//! as the OpenAI SDKs list models before calling; a backend behind a model route cannot answer
//! for the others. Without any model route the request is proxied like any other.

use http::{Method, Request, StatusCode};

use super::body::ResponseBody;
use super::error::{error_response, json_response};
use crate::live::Route;

/// The models the routes name, in route order (the first route of a model is the one that
/// serves it), each with its backend.
pub(crate) fn listed(routes: &[Route]) -> Vec<(&str, &str)> {
    let mut models: Vec<(&str, &str)> = Vec::new();
    for route in routes {
        if let Some(model) = route.matcher.model.as_deref()
            && !models.iter().any(|(m, _)| *m == model)
        {
            models.push((model, &route.backend.name));
        }
    }
    models
}

fn model_object(id: &str, backend: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id,
        "object": "model",
        "created": 0,
        "owned_by": backend,
    })
}

/// The gateway's answer to a model listing, if `req` is one and some route names a model.
pub(crate) fn answer<B>(
    req: &Request<B>,
    routes: &[Route],
) -> Option<http::Response<ResponseBody>> {
    if req.method() != Method::GET {
        return None;
    }
    let path = req.uri().path();
    let rest = path.strip_prefix("/v1/models")?;
    let models = listed(routes);
    if models.is_empty() {
        return None;
    }
    match rest {
        "" | "/" => {
            let data: Vec<_> = models.iter().map(|(m, b)| model_object(m, b)).collect();
            Some(json_response(
                StatusCode::OK,
                &serde_json::json!({"object": "list", "data": data}),
            ))
        }
        one => {
            let id = one.strip_prefix('/')?;
            Some(match models.iter().find(|(m, _)| *m == id) {
                Some((m, b)) => json_response(StatusCode::OK, &model_object(m, b)),
                None => error_response(
                    StatusCode::NOT_FOUND,
                    "model_not_found",
                    &format!("The model '{id}' does not exist"),
                ),
            })
        }
    }
}
