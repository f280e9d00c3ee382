//! Where a client comes from ([`Peer`]): its connection's peer, or what a trusted proxy says (a
//! PROXY protocol v2 header opening the connection, or `X-Forwarded-For`), and the source key that
//! per-source caps and source-IP client identities count by: an IPv4 address, or an IPv6 /64
//! (one host commonly holds a whole /64, so counting single IPv6 addresses caps nothing).

use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::{HeaderMap, HeaderValue};
use poolpilot_api::limits::{TrustedProxies, canonical_ip};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

/// The client side of a call: the client's address (the connection's peer, or the source a
/// trusted proxy's PROXY protocol header gave), also as a header value (formatted once per
/// connection, for `X-Forwarded-For`).
#[derive(Clone, Debug)]
pub struct Peer {
    source: IpAddr,
    ip: HeaderValue,
}

impl Peer {
    /// The client at `source`.
    pub fn new(source: IpAddr) -> Self {
        let ip = HeaderValue::from_str(&source.to_string()).expect("an IP is a header value");
        Self { source, ip }
    }

    /// The client's address: the peer, or the source a trusted proxy's PROXY protocol header
    /// gave.
    pub fn source(&self) -> IpAddr {
        self.source
    }

    /// The client's address as the value `X-Forwarded-For` appends.
    pub fn forwarded_for(&self) -> &HeaderValue {
        &self.ip
    }
}

/// The address per-source caps and identities count by: IPv4 as it is (an IPv4-mapped IPv6
/// address as IPv4), IPv6 as its /64 network.
pub fn group(ip: IpAddr) -> IpAddr {
    match canonical_ip(ip) {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
        v4 => v4,
    }
}

/// The text a source-IP client identity hashes (and an override's `keySha256` is taken of):
/// `10.1.2.3`, or `2001:db8:1:2::/64`.
pub fn key_text(ip: IpAddr) -> String {
    match group(ip) {
        IpAddr::V6(net) => format!("{net}/64"),
        v4 => v4.to_string(),
    }
}

/// The client of a request from `peer` by `X-Forwarded-For`: when `peer` is a trusted proxy,
/// the rightmost address of the header that is not one (nginx's `real_ip_recursive`); else
/// `peer`. An unparsable entry ends the walk at the address before it.
pub fn forwarded_client(headers: &HeaderMap, peer: IpAddr, trusted: &TrustedProxies) -> IpAddr {
    if !trusted.trusts(peer) {
        return peer;
    }
    let mut client = peer;
    let entries = headers
        .get_all(http::header::HeaderName::from_static("x-forwarded-for"))
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    for entry in entries.iter().rev() {
        let Ok(ip) = entry.parse::<IpAddr>() else {
            break;
        };
        client = ip;
        if !trusted.trusts(ip) {
            break;
        }
    }
    client
}

/// Why a PROXY protocol header could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProxyHeaderError {
    /// The socket failed or closed first.
    #[error("reading the PROXY protocol header failed")]
    Io(#[from] io::Error),
    /// The bytes are not a PROXY protocol v2 header.
    #[error("not a PROXY protocol v2 header: {0}")]
    Invalid(#[from] ppp::v2::ParseError),
}

/// Reads the PROXY protocol v2 header that opens a connection from a trusted proxy (nothing
/// beyond it), and returns the client's address: the header's source, or `None` for a `LOCAL`
/// connection (the proxy's own health check) or an address family without one.
pub async fn read_proxy_header(
    stream: &mut TcpStream,
) -> Result<Option<SocketAddr>, ProxyHeaderError> {
    // Signature (12), version and command, family and protocol, length (2).
    let mut buf = vec![0u8; 16];
    stream.read_exact(&mut buf).await?;
    // Check the fixed part before trusting the length it gives.
    if let Err(e @ (ppp::v2::ParseError::Prefix | ppp::v2::ParseError::Version(_))) =
        ppp::v2::Header::try_from(&buf[..])
    {
        return Err(e.into());
    }
    let len = u16::from_be_bytes([buf[14], buf[15]]) as usize;
    buf.resize(16 + len, 0);
    stream.read_exact(&mut buf[16..]).await?;
    let header = ppp::v2::Header::try_from(&buf[..])?;
    Ok(match (header.command, header.addresses) {
        (ppp::v2::Command::Proxy, ppp::v2::Addresses::IPv4(a)) => {
            Some(SocketAddr::new(a.source_address.into(), a.source_port))
        }
        (ppp::v2::Command::Proxy, ppp::v2::Addresses::IPv6(a)) => {
            Some(SocketAddr::new(a.source_address.into(), a.source_port))
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use poolpilot_api::limits::ProxyProtocol;

    use super::*;

    #[test]
    fn ipv6_sources_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff:1:2:3".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(group(a), group(b));
        assert_ne!(group(a), group(other));
        assert_eq!(key_text(a), "2001:db8:1:2::/64");
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap(); // hermetic: not a destination (an address to group)
        assert_eq!(key_text(mapped), "10.1.2.3");
        assert_eq!(group(mapped), "10.1.2.3".parse::<IpAddr>().unwrap()); // hermetic: not a destination (an address to group)
    }

    #[test]
    fn the_client_is_the_rightmost_untrusted_forwarded_address() {
        let trusted = TrustedProxies {
            cidrs: vec!["10.0.0.0/8".parse().unwrap()],
            protocol: ProxyProtocol::XForwardedFor,
        };
        let proxy: IpAddr = "10.0.0.5".parse().unwrap(); // hermetic: not a destination (a peer address)
        let mut headers = HeaderMap::new();
        let client = |h: &HeaderMap, peer| forwarded_client(h, peer, &trusted).to_string();
        assert_eq!(client(&headers, proxy), "10.0.0.5", "no header: the peer");
        headers.insert(
            "x-forwarded-for",
            "198.51.100.9, 192.0.2.1, 10.1.1.1".parse().unwrap(), // hermetic: not a destination (header)
        );
        assert_eq!(client(&headers, proxy), "192.0.2.1");
        let stranger: IpAddr = "192.0.2.99".parse().unwrap(); // hermetic: not a destination (a peer address)
        assert_eq!(
            client(&headers, stranger),
            "192.0.2.99",
            "an untrusted peer's header"
        );
        headers.insert("x-forwarded-for", "junk, 10.1.1.1".parse().unwrap());
        assert_eq!(
            client(&headers, proxy),
            "10.1.1.1",
            "the walk stops at junk"
        );
    }
}
