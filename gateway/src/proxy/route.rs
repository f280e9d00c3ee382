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

/// What routing read of a request body's `model`, for the routes and for the 404 when none
/// matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyModel {
    /// No route needs it, so the body was not read.
    NotRead,
    /// The body's top-level `model` string.
    Found(String),
    /// The body ended without a top-level `model` string (not JSON, not a string, or none).
    Absent,
    /// The body is longer than the routing buffer (`routeBodyBytes`, the number): not parsed.
    BeyondBuffer(u32),
}

impl BodyModel {
    /// The model the routes match on.
    pub fn name(&self) -> Option<&str> {
        match self {
            Self::Found(m) => Some(m),
            _ => None,
        }
    }

    /// What the 404 adds to "no backend route matches the request".
    pub fn miss(&self) -> String {
        match self {
            Self::NotRead => String::new(),
            Self::Found(m) => {
                let shown: String = m.chars().take(64).collect();
                let cut = if shown.len() < m.len() { "…" } else { "" };
                format!(" (model {shown:?}{cut})")
            }
            Self::Absent => ": the body has no top-level \"model\" string".to_owned(),
            Self::BeyondBuffer(cap) => format!(
                ": the body's \"model\" is not within its first {cap} bytes (listener.routeBodyBytes); send \"model\" before long fields or raise routeBodyBytes"
            ),
        }
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

    #[test]
    fn a_route_miss_says_what_was_read_of_the_model_and_cuts_a_long_name() {
        assert_eq!(BodyModel::NotRead.miss(), "");
        assert_eq!(
            BodyModel::Found("gpt-9".into()).miss(),
            " (model \"gpt-9\")"
        );
        let long = BodyModel::Found("é".repeat(100)).miss();
        assert_eq!(long, format!(" (model {:?}…)", "é".repeat(64)));
        assert!(
            BodyModel::BeyondBuffer(64)
                .miss()
                .contains("first 64 bytes")
        );
        assert_eq!(BodyModel::Absent.name(), None);
    }
}
