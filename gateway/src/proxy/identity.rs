//! Who the client of a call is, as its client policy counts it: the hashed value of the
//! policy's header (an `Authorization` bearer token without its scheme), or its source address
//! (an IPv6 client by its /64; behind a trusted proxy, from `X-Forwarded-For` or the PROXY
//! protocol header: [`crate::listen::source`]); on a route without a client policy, its source
//! address. Keys are hashed at once ([`ClientKey`]): a raw key is never kept.

use http::header::{HeaderMap, HeaderValue};
use poolpilot_api::limits::{ClientIdentity, ProxyProtocol, TrustedProxies};

use crate::limits::limiter::{ClientKey, ClientLimiter};
use crate::listen::source::{Peer, forwarded_client, key_text};

/// The key a call counts by: its policy's identity (see [`client_key`]) on a route with a
/// client limiter, else its source address.
pub(super) fn client_key_of(
    limiter: Option<&ClientLimiter>,
    headers: &HeaderMap,
    peer: &Peer,
    trusted: Option<&TrustedProxies>,
) -> ClientKey {
    match limiter {
        Some(limiter) => client_key(&limiter.identity(), headers, peer, trusted),
        None => ClientKey::of(key_text(peer.source()).as_bytes()),
    }
}

/// The client's identity, hashed: the configured header's value (for `authorization`, the
/// bearer token without its scheme), or, without it or for a source-IP policy, the client's
/// address ([`key_text`]: an IPv6 client counts by its /64), taken from
/// `X-Forwarded-For` when the peer is a trusted proxy that passes it so.
fn client_key(
    identity: &ClientIdentity,
    headers: &HeaderMap,
    peer: &Peer,
    trusted: Option<&TrustedProxies>,
) -> ClientKey {
    if let ClientIdentity::Header(name) = identity
        && let Some(value) = headers.get(name.as_str())
    {
        if name.eq_ignore_ascii_case("authorization")
            && let Some(token) = bearer_token(value)
        {
            return ClientKey::of(token);
        }
        return ClientKey::of(value.as_bytes());
    }
    let ip = match trusted {
        Some(t) if t.protocol == ProxyProtocol::XForwardedFor => {
            forwarded_client(headers, peer.source(), t)
        }
        _ => peer.source(),
    };
    ClientKey::of(key_text(ip).as_bytes())
}

/// The token of an `Authorization: Bearer <token>` value (the scheme in any case).
fn bearer_token(value: &HeaderValue) -> Option<&[u8]> {
    let value = value.as_bytes();
    let space = value.iter().position(|b| *b == b' ')?;
    let (scheme, token) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = token.trim_ascii();
    (!token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_the_header_or_else_the_source_ip() {
        let peer = &Peer::new([10, 1, 2, 3].into());
        let mut headers = HeaderMap::new();
        let by_header = ClientIdentity::Header("x-api-key".into());
        assert_eq!(
            client_key(&by_header, &headers, peer, None),
            ClientKey::of(b"10.1.2.3")
        );
        headers.insert("x-api-key", HeaderValue::from_static("sk-1"));
        assert_eq!(
            client_key(&by_header, &headers, peer, None),
            ClientKey::of(b"sk-1")
        );
        assert_eq!(
            client_key(&ClientIdentity::SourceIp, &headers, peer, None),
            ClientKey::of(b"10.1.2.3")
        );
        let by_token = ClientIdentity::Header("authorization".into());
        for value in ["Bearer sk-2", "bearer  sk-2 ", "BEARER sk-2"] {
            headers.insert("authorization", HeaderValue::from_str(value).unwrap());
            assert_eq!(
                client_key(&by_token, &headers, peer, None),
                ClientKey::of(b"sk-2"),
                "{value:?}"
            );
        }
        headers.insert("authorization", HeaderValue::from_static("Basic dTpw"));
        assert_eq!(
            client_key(&by_token, &headers, peer, None),
            ClientKey::of(b"Basic dTpw"),
            "another scheme: the whole value"
        );
        let v6 = &Peer::new("2001:db8:7:7::42".parse().unwrap());
        assert_eq!(
            client_key(&ClientIdentity::SourceIp, &headers, v6, None),
            ClientKey::of(b"2001:db8:7:7::/64")
        );
    }
}
