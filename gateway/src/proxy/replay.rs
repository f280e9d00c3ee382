//! What makes a request safe to send again after it was written to a connection the backend
//! then closed unanswered, and the copy the forward phase keeps to send it: the head and the
//! whole body, which the gateway must still hold (the router buffered it, or there is none).
//!
//! A request is replayable when its method is idempotent (RFC 9110 §9.2.2: `GET`, `HEAD`,
//! `OPTIONS`, `PUT`, `DELETE`; the set nginx's `proxy_next_upstream` retries without
//! `non_idempotent`), or when it carries an `Idempotency-Key` (the client says a second
//! delivery is harmless). The body copy shares the routing buffer's bytes (no second copy).

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Uri, Version};
use http_body_util::BodyExt;

use super::body::{BodyProgress, ClientBody, RequestBody};

/// The header by which a client marks a non-idempotent request as safe to deliver twice
/// (the IETF `httpapi` draft; what Stripe and OpenAI-compatible servers accept).
const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// A request the gateway can send once more, head and body.
#[derive(Debug)]
pub(super) struct Replay {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    body: Bytes,
    progress: Arc<BodyProgress>,
}

impl Replay {
    /// The copy of the request about to go upstream (`parts` as prepared for the backend), when
    /// it is replayable and `body` is held whole; `None` otherwise.
    pub(super) fn of(parts: &http::request::Parts, body: &ClientBody) -> Option<Self> {
        if !replayable(&parts.method, &parts.headers) {
            return None;
        }
        Some(Self {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            version: parts.version,
            headers: parts.headers.clone(),
            body: body.held()?,
            progress: body.progress(),
        })
    }

    /// The request, to send again; its body reports to the call's progress as the first did.
    pub(super) fn request(&self) -> Request<RequestBody> {
        let mut req = Request::new(
            ClientBody::replay(self.body.clone(), self.progress.clone()).boxed_unsync(),
        );
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers.clone();
        req
    }
}

/// Whether a request of `method` with `headers` may be delivered twice.
pub(super) fn replayable(method: &Method, headers: &HeaderMap) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE
    ) || headers.contains_key(IDEMPOTENCY_KEY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotent_methods_and_idempotency_keys_are_replayable() {
        let none = HeaderMap::new();
        for method in [
            Method::GET,
            Method::HEAD,
            Method::OPTIONS,
            Method::PUT,
            Method::DELETE,
        ] {
            assert!(replayable(&method, &none), "{method}");
        }
        for method in [Method::POST, Method::PATCH] {
            assert!(!replayable(&method, &none), "{method}");
        }
        let mut keyed = HeaderMap::new();
        keyed.insert("Idempotency-Key", "8e03978e".parse().unwrap());
        assert!(replayable(&Method::POST, &keyed));
    }
}
