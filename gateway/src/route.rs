//! Request routing: which backend a request goes to, by path prefix, headers and the JSON
//! body's top-level `model` field (read from a bounded buffer).

use http::request::Parts;
use poolpilot_api::limits::RouteMatch;

/// Whether `m` matches a request with head `parts` and body model `model` (`None` when the
/// body was not read, is not JSON, is larger than the routing buffer, or has no `model`).
pub fn matches(m: &RouteMatch, parts: &Parts, model: Option<&str>) -> bool {
    if let Some(prefix) = &m.path_prefix
        && !parts.uri.path().starts_with(prefix.as_str())
    {
        return false;
    }
    for (name, value) in &m.headers {
        let present = parts
            .headers
            .get_all(name.as_str())
            .iter()
            .any(|v| v.as_bytes() == value.as_bytes());
        if !present {
            return false;
        }
    }
    match &m.model {
        Some(wanted) => model == Some(wanted.as_str()),
        None => true,
    }
}

/// The top-level `model` string of a JSON body, if there is one.
pub fn model_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Model {
        model: Option<String>,
    }
    serde_json::from_slice::<Model>(body).ok()?.model
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(path: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().uri(path);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn every_condition_must_hold() {
        let m: RouteMatch = serde_json::from_value(serde_json::json!({
            "pathPrefix": "/v1/", "headers": {"X-Model": "a"}, "model": "llama"
        }))
        .unwrap();
        let ok = parts("/v1/chat", &[("x-model", "a")]);
        assert!(matches(&m, &ok, Some("llama")));
        assert!(!matches(&m, &ok, Some("mistral")));
        assert!(!matches(&m, &ok, None));
        assert!(!matches(
            &m,
            &parts("/v2/chat", &[("x-model", "a")]),
            Some("llama")
        ));
        assert!(!matches(
            &m,
            &parts("/v1/chat", &[("x-model", "b")]),
            Some("llama")
        ));
        assert!(matches(
            &RouteMatch::default(),
            &parts("/anything", &[]),
            None
        ));
    }

    #[test]
    fn reads_the_model_field_only() {
        assert_eq!(
            model_of(br#"{"model":"llama","messages":[]}"#).as_deref(),
            Some("llama")
        );
        assert_eq!(model_of(br#"{"messages":[]}"#), None);
        assert_eq!(model_of(b"not json"), None);
        assert_eq!(model_of(br#"{"model":7}"#), None);
    }
}
