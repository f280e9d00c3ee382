//! The headers the gateway changes on their way through, both ways: hop-by-hop fields (RFC 9110
//! §7.6.1) and those `Connection` names are dropped, `Via` is added (§7.6.3); towards the
//! backend also `X-Forwarded-For`, `Host` from an absolute-form target (RFC 9112 §3.2.2, or an
//! HTTP/2 `:authority`) without userinfo, and an origin-form HTTP/1.1 request line.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Uri, Version};

use crate::listen::source::Peer;

/// `X-Forwarded-For`.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Whether `name` is a hop-by-hop header of RFC 9110 §7.6.1 (or a legacy one).
fn is_hop_by_hop(name: &HeaderName) -> bool {
    *name == header::CONNECTION
        || *name == header::PROXY_AUTHENTICATE
        || *name == header::PROXY_AUTHORIZATION
        || *name == header::TE
        || *name == header::TRAILER
        || *name == header::TRANSFER_ENCODING
        || *name == header::UPGRADE
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus those the `Connection` header names.
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most heads carry none: one pass over the names instead of a lookup per name.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

/// The `Via` value the gateway adds to a message of `version` (RFC 9110 §7.6.3).
pub(super) fn via_value(version: Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        Version::HTTP_09 => "0.9 poolpilot",
        Version::HTTP_10 => "1.0 poolpilot",
        Version::HTTP_2 => "2 poolpilot",
        Version::HTTP_3 => "3 poolpilot",
        _ => "1.1 poolpilot",
    })
}

/// Turns the client's head into the upstream head: origin-form URI, HTTP/1.1, `Host` kept,
/// or replaced by the target's authority (an absolute-form target, RFC 9112 §3.2.2, or an
/// HTTP/2 `:authority`), hop-by-hop headers dropped, `X-Forwarded-For` and `Via` appended.
pub(super) fn prepare_upstream_head(parts: &mut http::request::Parts, peer: &Peer) {
    strip_hop_by_hop(&mut parts.headers);
    if let Some(authority) = parts.uri.authority() {
        // Without userinfo (RFC 9110 §4.2.4: never forwarded).
        let host = match authority.as_str().rsplit_once('@') {
            Some((_, host)) => HeaderValue::from_str(host),
            None => HeaderValue::from_str(authority.as_str()),
        };
        if let Ok(host) = host {
            parts.headers.insert(header::HOST, host);
        }
    }
    let xff = match parts
        .headers
        .get(X_FORWARDED_FOR)
        .and_then(|v| v.to_str().ok())
    {
        None => Some(peer.forwarded_for().clone()),
        Some(prior) => {
            let ip = peer.forwarded_for().to_str().unwrap_or_default();
            HeaderValue::from_str(&format!("{prior}, {ip}")).ok()
        }
    };
    if let Some(xff) = xff {
        parts.headers.insert(X_FORWARDED_FOR, xff);
    }
    parts.headers.append(header::VIA, via_value(parts.version));
    // Already origin-form (every HTTP/1.1 request but a proxy-style one): keep it as it is.
    if parts.uri.scheme().is_some() || parts.uri.authority().is_some() {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = Uri::try_from(path).unwrap_or_else(|_| Uri::from_static("/"));
    } else if parts.uri.path_and_query().is_none() {
        parts.uri = Uri::from_static("/");
    }
    parts.version = Version::HTTP_11;
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    #[test]
    fn upstream_head_drops_hop_by_hop_and_adds_forwarding_headers() {
        let req = Request::builder()
            .method("POST")
            .uri("http://gw.example:8080/v1/chat?stream=true")
            .version(Version::HTTP_11)
            .header("connection", "keep-alive, x-secret-hop")
            .header("x-secret-hop", "1")
            .header("keep-alive", "timeout=5")
            .header("transfer-encoding", "chunked")
            .header("x-forwarded-for", "10.0.0.1")
            .header("authorization", "Bearer kept")
            .body(())
            .unwrap();
        let (mut parts, ()) = req.into_parts();
        prepare_upstream_head(&mut parts, &Peer::new([192, 168, 1, 7].into()));
        let h = &parts.headers;
        for gone in [
            "connection",
            "x-secret-hop",
            "keep-alive",
            "transfer-encoding",
        ] {
            assert!(!h.contains_key(gone), "{gone} must not be forwarded");
        }
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 192.168.1.7");
        assert_eq!(h["via"], "1.1 poolpilot");
        assert_eq!(h["host"], "gw.example:8080");
        assert_eq!(h["authorization"], "Bearer kept");
        assert_eq!(parts.uri, "/v1/chat?stream=true");
    }
}
