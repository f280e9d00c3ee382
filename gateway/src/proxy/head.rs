//! What a request head must be for the gateway to take it: within the listener's head limits
//! (`maxHeaders`, `maxHeaderBytes`: 431; a declared body over `maxBodyBytes`: 413), the MUST
//! requirements of RFC 9110 and RFC 9112 that hyper leaves to the server (exactly one valid
//! `Host` in HTTP/1.1, `Max-Forwards`, no `CONNECT` or `TRACE`), and
//! the path check that keeps prefix routing honest: a target whose path holds `.` or `..`
//! segments (also percent-encoded), empty segments (`//`), or encoded slashes or backslashes
//! could mean another path to the backend than to the router, so it is refused (Envoy and nginx
//! normalize such paths instead; refusing cannot disagree with any backend's normalization).
//!
//! The requirements hyper enforces itself (request-line and header syntax, whitespace before a
//! colon, obs-fold, bare CR, `Content-Length` values, transfer codings, `Transfer-Encoding`
//! beside `Content-Length` (framed by the former, the latter removed, the connection closed
//! after the response), `Connection: close`, HEAD, HTTP/1.0 framing) are listed with these in gateway/README.md and tested in
//! `tests/loopback/conformance.rs`.

use http::header::{self, HeaderMap, HeaderValue};
use http::uri::Authority;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Empty};

use poolpilot_api::limits::ListenerLimits;

use super::body::ResponseBody;
use super::error::ProxyError;

/// 431 for too many or too large headers, 413 for a declared body over the limit. hyper
/// enforces the same limits while parsing HTTP/1 heads; this covers HTTP/2 and limits below
/// hyper's smallest read buffer.
pub(super) fn check_limits<B>(req: &Request<B>, limits: &ListenerLimits) -> Result<(), ProxyError> {
    if req.headers().len() > limits.max_headers as usize {
        return Err(ProxyError::HeadersTooLarge("too many headers"));
    }
    let head_bytes: usize = uri_len(req.uri())
        + req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>();
    if head_bytes > limits.max_header_bytes as usize {
        return Err(ProxyError::HeadersTooLarge("request head too large"));
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limits.max_body_bytes) {
        return Err(ProxyError::BodyTooLarge {
            limit: limits.max_body_bytes,
        });
    }
    Ok(())
}

/// The length of the URI as written (`Uri`'s `Display`), without formatting it in the common
/// origin-form case.
fn uri_len(uri: &Uri) -> usize {
    match (uri.scheme(), uri.authority(), uri.path_and_query()) {
        (None, None, Some(pq)) => pq.as_str().len(),
        _ => uri.to_string().len(),
    }
}

/// What to do with a request whose head passed the checks.
#[derive(Debug)]
pub enum Verdict {
    /// Proxy it.
    Forward,
    /// Answer it here, as its final recipient (an `OPTIONS` with `Max-Forwards: 0`).
    Answer(Response<ResponseBody>),
}

/// Checks a request head, and decrements `Max-Forwards` of an `OPTIONS` to forward.
pub fn check<B>(req: &mut Request<B>) -> Result<Verdict, ProxyError> {
    if req.method() == Method::CONNECT || req.method() == Method::TRACE {
        // RFC 9110 §9.3.6, §9.3.8: a reverse proxy to model servers tunnels nothing and
        // reflects nothing.
        return Err(ProxyError::MethodNotImplemented);
    }
    check_host(req.version(), req.headers())?;
    check_path(req)?;
    if req.method() == Method::OPTIONS
        && let Some(value) = req.headers().get(header::MAX_FORWARDS)
    {
        // RFC 9110 §7.6.2: check and update it; at 0, answer as the final recipient.
        let hops: u32 = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .ok_or(ProxyError::BadRequest("Max-Forwards is not a number"))?;
        if hops == 0 {
            return Ok(Verdict::Answer(options_answer()));
        }
        req.headers_mut()
            .insert(header::MAX_FORWARDS, HeaderValue::from(hops - 1));
    }
    Ok(Verdict::Forward)
}

/// RFC 9112 §3.2: an HTTP/1.1 request has exactly one `Host`, and any `Host` is a valid
/// authority (without userinfo, RFC 9110 §4.2.4).
fn check_host(version: Version, headers: &HeaderMap) -> Result<(), ProxyError> {
    let mut hosts = headers.get_all(header::HOST).iter();
    let first = hosts.next();
    if hosts.next().is_some() {
        return Err(ProxyError::BadRequest("more than one Host header"));
    }
    match first {
        None if version == Version::HTTP_11 => Err(ProxyError::BadRequest("no Host header")),
        None => Ok(()),
        Some(host) => {
            let valid = host
                .to_str()
                .ok()
                .filter(|h| !h.is_empty() && !h.contains('@'))
                .filter(|h| h.parse::<Authority>().is_ok())
                .is_some_and(|h| {
                    // `Authority` takes any port text; RFC 3986's is digits.
                    let port = match h.rsplit_once(']') {
                        Some((_, rest)) => rest.strip_prefix(':'),
                        None => h.rsplit_once(':').map(|(_, port)| port),
                    };
                    port.is_none_or(|p| p.bytes().all(|b| b.is_ascii_digit()))
                });
            if valid {
                Ok(())
            } else {
                Err(ProxyError::BadRequest("invalid Host header"))
            }
        }
    }
}

/// Refuses targets whose path could mean another path to the backend than to the router.
fn check_path<B>(req: &Request<B>) -> Result<(), ProxyError> {
    let path = req.uri().path();
    if path == "*" && req.method() == Method::OPTIONS {
        return Ok(());
    }
    if !path.starts_with('/') {
        return Err(ProxyError::BadTarget);
    }
    let lower = path.to_ascii_lowercase();
    if lower.contains("%2f") || lower.contains("%5c") || lower.contains('\\') {
        return Err(ProxyError::BadTarget);
    }
    let segments: Vec<&str> = lower[1..].split('/').collect();
    let last = segments.len() - 1;
    for (i, segment) in segments.iter().enumerate() {
        let dots = segment.replace("%2e", ".");
        // An empty last segment is a trailing slash; any other is `//`.
        if (segment.is_empty() && i != last) || dots == "." || dots == ".." {
            return Err(ProxyError::BadTarget);
        }
    }
    Ok(())
}

/// The answer to an `OPTIONS` that may go no further.
fn options_answer() -> Response<ResponseBody> {
    let mut response = Response::new(Empty::new().map_err(|never| match never {}).boxed_unsync());
    *response.status_mut() = StatusCode::OK;
    response
        .headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path_ok(path: &str) -> bool {
        let req = Request::get(path).body(()).unwrap();
        check_path(&req).is_ok()
    }

    #[test]
    fn paths_that_could_mean_another_path_are_refused() {
        for bad in [
            "/v1/../x",
            "/v1/./x",
            "/..",
            "/v1//x",
            "//x",
            "/v1/%2e%2e/x",
            "/v1/.%2E/x",
            "/v1/%2E",
            "/v1/a%2Fb",
            "/v1/a%5cb",
        ] {
            assert!(!path_ok(bad), "{bad}");
        }
        for good in [
            "/",
            "/v1/",
            "/v1/chat/completions",
            "/v1/x.y",
            "/v1/..x",
            "/v1/a%20b",
        ] {
            assert!(path_ok(good), "{good}");
        }
    }

    #[test]
    fn host_must_be_single_and_valid_and_present_in_http11() {
        let mut h = HeaderMap::new();
        assert!(check_host(Version::HTTP_11, &h).is_err());
        assert!(check_host(Version::HTTP_10, &h).is_ok());
        assert!(check_host(Version::HTTP_2, &h).is_ok());
        h.insert(header::HOST, HeaderValue::from_static("api.test:8080"));
        assert!(check_host(Version::HTTP_11, &h).is_ok());
        h.append(header::HOST, HeaderValue::from_static("api.test"));
        assert!(check_host(Version::HTTP_2, &h).is_err());
        for bad in ["a b", "u@api.test", "api.test:port", ""] {
            h.insert(header::HOST, HeaderValue::from_static(bad));
            assert!(check_host(Version::HTTP_11, &h).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn max_forwards_is_decremented_and_zero_is_answered_here() {
        let mut req = Request::options("/v1/x")
            .header("host", "a.test")
            .header("max-forwards", "2")
            .body(())
            .unwrap();
        assert!(matches!(check(&mut req), Ok(Verdict::Forward)));
        assert_eq!(req.headers()["max-forwards"], "1");
        req.headers_mut()
            .insert("max-forwards", HeaderValue::from_static("0"));
        assert!(matches!(check(&mut req), Ok(Verdict::Answer(_))));
        req.headers_mut()
            .insert("max-forwards", HeaderValue::from_static("x"));
        assert_eq!(check(&mut req).unwrap_err().status(), 400);
    }

    #[test]
    fn head_limits_give_431_and_413() {
        let limits = ListenerLimits {
            max_headers: 3,
            max_header_bytes: 1024,
            max_body_bytes: 10,
            ..Default::default()
        };
        let mut b = Request::builder().uri("/");
        for i in 0..4 {
            b = b.header(format!("x-h{i}"), "v");
        }
        let err = check_limits(&b.body(()).unwrap(), &limits).unwrap_err();
        assert_eq!(err.status(), 431);
        let big = Request::builder()
            .uri("/")
            .header("x-big", "v".repeat(2000))
            .body(())
            .unwrap();
        assert_eq!(check_limits(&big, &limits).unwrap_err().status(), 431);
        let body = Request::builder()
            .uri("/")
            .header("content-length", "11")
            .body(())
            .unwrap();
        assert_eq!(check_limits(&body, &limits).unwrap_err().status(), 413);
        let fine = Request::builder()
            .uri("/")
            .header("content-length", "10")
            .body(())
            .unwrap();
        assert!(check_limits(&fine, &limits).is_ok());
    }
}
