//! Request routing: which backend a request goes to, by path prefix, headers and the JSON
//! body's top-level `model` field, read from a bounded buffer (`routeBodyBytes`) at the
//! listener's body pace (408) and within the pod-wide budget of routing buffers (503:
//! [`super::route_budget`]); nothing read is lost, the body is forwarded whole. The body of a
//! replayable request, and of any request when a token budget estimates calls from their
//! bodies, is read into the same buffer (to send it twice, to estimate it).

use bytes::BytesMut;
use http::request::Parts;
use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use poolpilot_api::limits::{ListenerLimits, RouteMatch};
use tokio::time::Instant;

use super::body::{BodyPace, ClientBody};
use super::error::ProxyError;
use super::replay;
use crate::live::{Gateway, Route, Snapshot};
use crate::observe::{DownstreamTimeout, NO_CLIENT, Reclaim};

/// Finds the route of a request: reads up to `routeBodyBytes` of its body first when a route
/// needs its JSON `model` ([`buffer_for_model`]), and returns the route with the body to forward
/// (what was read, then the rest). No route matches: 404, saying what was read of `model`; no
/// route at all (no policy selects this pod): 503.
pub(super) async fn route<'a>(
    gw: &Gateway,
    snapshot: &'a Snapshot,
    parts: &Parts,
    incoming: Incoming,
    pace: BodyPace,
) -> Result<(&'a Route, ClientBody), ProxyError> {
    if snapshot.routes.is_empty() {
        return Err(ProxyError::NoBackends);
    }
    let listener = &snapshot.limits.listener;
    // Route, reading at most `routeBodyBytes` of the body when a route needs its `model`, when
    // a token budget or the pool queue's fairness between a client policy's clients estimates
    // calls from it (`crate::tokens::estimate`, `crate::limits::fair`), or when the request
    // is replayable (the forward phase can send it again only if the gateway holds its body
    // whole: `super::replay`).
    let buffer = snapshot.needs_body || replay::replayable(&parts.method, &parts.headers);
    let (model, body) = if buffer && !incoming.is_end_stream() {
        buffer_for_model(gw, incoming, listener, pace).await?
    } else {
        let model = if snapshot.needs_model {
            BodyModel::Absent
        } else {
            BodyModel::NotRead
        };
        (
            model,
            ClientBody::new(None, None, Some(incoming), listener.max_body_bytes, pace),
        )
    };
    let route = snapshot
        .routes
        .iter()
        .find(|r| matches(&r.matcher, parts, model.name()))
        .ok_or_else(|| ProxyError::NoRoute(model.miss()))?;
    Ok((route, body))
}

/// Reads up to `routeBodyBytes` of the body, at the listener's body pace and within the
/// pod's routing budget. A body that ends within it is parsed for `model`; a longer one routes
/// without a model. Either way nothing read is lost.
async fn buffer_for_model(
    gw: &Gateway,
    mut incoming: Incoming,
    limits: &ListenerLimits,
    pace: BodyPace,
) -> Result<(BodyModel, ClientBody), ProxyError> {
    let cap = limits.route_body_bytes as usize;
    let mut buf = BytesMut::new();
    let mut reserved = gw.route_budget().reservation();
    let mut last = Instant::now();
    loop {
        if buf.len() > cap {
            let prefix = buf.freeze();
            return Ok((
                BodyModel::BeyondBuffer(limits.route_body_bytes),
                ClientBody::new(
                    Some(prefix),
                    Some(reserved),
                    Some(incoming),
                    limits.max_body_bytes,
                    pace,
                ),
            ));
        }
        let deadline = pace.deadline(buf.len() as u64, last);
        let Ok(frame) = tokio::time::timeout_at(deadline, incoming.frame()).await else {
            gw.metrics().downstream_timeout(DownstreamTimeout::BodyRead);
            gw.metrics()
                .incidents()
                .reclaimed(Reclaim::BodyTimeout, NO_CLIENT);
            return Err(ProxyError::BodyTimeout);
        };
        match frame {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if (buf.len() + data.len()) as u64 > limits.max_body_bytes {
                        return Err(ProxyError::BodyTooLarge {
                            limit: limits.max_body_bytes,
                        });
                    }
                    if !reserved.grow(data.len() as u64, limits.route_buffer_budget) {
                        gw.metrics().route_buffer_rejected();
                        return Err(ProxyError::RouteBufferFull);
                    }
                    buf.extend_from_slice(&data);
                    last = Instant::now();
                }
            }
            Some(Err(e)) => return Err(ProxyError::ClientBody(e.into())),
            None => {
                let body = buf.freeze();
                let model = model_of(&body).map_or(BodyModel::Absent, BodyModel::Found);
                return Ok((
                    model,
                    ClientBody::new(
                        Some(body),
                        Some(reserved),
                        None,
                        limits.max_body_bytes,
                        pace,
                    ),
                ));
            }
        }
    }
}

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
                ": the body's \"model\" is not within its first {cap} bytes (listener.routeBodyBytes); send \"model\" before long fields, or match this backend by a header too (a policy's match.headers)"
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
