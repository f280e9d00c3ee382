//! The request as it goes out on an HTTP/1.1 upstream connection: how its body is framed
//! (RFC 9112 §6: the `Content-Length` it came with, the body's exact size, or chunked), the head
//! written in one pass from the request's parts into the connection's write buffer, and each
//! body frame in that framing.
//!
//! The framing follows the same rules as hyper's client, so that a backend sees the same
//! request whichever wrote it: a `Content-Length` the request carries is kept and held to (a
//! body longer or shorter than it fails the exchange, since the backend would read the next
//! request's bytes as this one's or wait for bytes that never come); else a body that is empty
//! gets no length header, one of known size a `Content-Length`, and one of unknown size
//! `Transfer-Encoding: chunked` (whatever the method: hyper's client sends a `GET`, `HEAD` or
//! `CONNECT` body of unknown size as no body at all). Trailers follow the last chunk, without
//! the fields that must not trail ([`may_trail`]). Hop-by-hop fields, `Transfer-Encoding`
//! among them, were dropped before (`crate::proxy::headers`): the gateway never forwards a
//! client's chunking.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::request::Parts;

/// How a request body is delimited on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Framing {
    /// Exactly this many bytes are still to come.
    Length(u64),
    /// Chunks, ended by the last chunk (`0\r\n\r\n`, trailers before the empty line).
    Chunked,
}

/// Why a request cannot be framed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum FramingError {
    /// The request's own `Content-Length` is not one number.
    #[error("the request's Content-Length is not a single length")]
    InvalidLength,
    /// The body went past the length the head announced.
    #[error("the request body is longer than its Content-Length ({0} bytes)")]
    BodyTooLong(u64),
    /// The body ended before the length the head announced.
    #[error("the request body ended {0} bytes short of its Content-Length")]
    BodyTooShort(u64),
}

/// The framing of a request with `headers` and a body that is `empty` or of `exact` size, and
/// the header the head gets for it (`None`: the head says what it needs already, or nothing).
pub(super) fn framing(
    headers: &HeaderMap,
    empty: bool,
    exact: Option<u64>,
) -> Result<(Framing, Option<(header::HeaderName, HeaderValue)>), FramingError> {
    if let Some(length) = content_length(headers).map_err(|()| FramingError::InvalidLength)? {
        return Ok((Framing::Length(length), None));
    }
    if empty {
        return Ok((Framing::Length(0), None));
    }
    Ok(match exact {
        Some(length) => (
            Framing::Length(length),
            Some((header::CONTENT_LENGTH, HeaderValue::from(length))),
        ),
        None => (
            Framing::Chunked,
            Some((
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            )),
        ),
    })
}

/// The one length that every `Content-Length` field of `headers` names (a list of the same
/// number is that number, RFC 9110 §8.6), `None` without the field; `Err` when they name none
/// or several. Requests and responses alike.
pub(super) fn content_length(headers: &HeaderMap) -> Result<Option<u64>, ()> {
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for part in value.as_bytes().split(|b| *b == b',') {
            let n = parse_length(trim(part)).ok_or(())?;
            if length.is_some_and(|l| l != n) {
                return Err(());
            }
            length = Some(n);
        }
    }
    Ok(length)
}

/// A decimal length of 1 to 19 digits (no sign, no space: RFC 9110 §8.6's `1*DIGIT`, below
/// `u64`'s overflow).
fn parse_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0, |n, d| n * 10 + u64::from(d - b'0')))
}

/// `bytes` without optional whitespace (spaces and tabs) around it.
pub(super) fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |e| e + 1);
    &bytes[start..end]
}

/// Appends the request line and the header section of `parts` (origin-form target, HTTP/1.1),
/// with `extra` (the framing's header) and `host` (replacing the request's) among the fields.
pub(super) fn write_head(
    out: &mut Vec<u8>,
    parts: &Parts,
    extra: Option<&(header::HeaderName, HeaderValue)>,
    host: Option<&HeaderValue>,
) {
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    out.reserve(64 + target.len() + parts.headers.len() * 32);
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if let Some(host) = host {
        field(out, header::HOST.as_str(), host);
    }
    for (name, value) in &parts.headers {
        if host.is_some() && name == header::HOST {
            continue;
        }
        field(out, name.as_str(), value);
    }
    if let Some((name, value)) = extra {
        field(out, name.as_str(), value);
    }
    out.extend_from_slice(b"\r\n");
}

/// One `name: value` line (a `HeaderValue` holds no CR or LF: nothing can be injected).
fn field(out: &mut Vec<u8>, name: &str, value: &HeaderValue) {
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Whether a field may go in a request's trailer section: not one that frames, routes,
/// authenticates or describes the content (RFC 9110 §6.5.1), which a backend merging trailers
/// into the head would act on after the fact. The same fields hyper's client leaves out.
fn may_trail(name: &header::HeaderName) -> bool {
    !matches!(
        *name,
        header::AUTHORIZATION
            | header::CACHE_CONTROL
            | header::CONTENT_ENCODING
            | header::CONTENT_LENGTH
            | header::CONTENT_RANGE
            | header::CONTENT_TYPE
            | header::HOST
            | header::MAX_FORWARDS
            | header::SET_COOKIE
            | header::TRAILER
            | header::TRANSFER_ENCODING
            | header::TE
    )
}

/// The framing's state as the body goes out.
#[derive(Debug)]
pub(super) struct BodyEncoder {
    framing: Framing,
}

impl BodyEncoder {
    pub(super) fn new(framing: Framing) -> Self {
        Self { framing }
    }

    /// Appends `data` in the framing; an empty frame adds nothing (an empty chunk would end a
    /// chunked body).
    pub(super) fn data(&mut self, out: &mut Vec<u8>, data: &Bytes) -> Result<(), FramingError> {
        if data.is_empty() {
            return Ok(());
        }
        match &mut self.framing {
            Framing::Length(left) => {
                let len = data.len() as u64;
                if len > *left {
                    return Err(FramingError::BodyTooLong(len - *left));
                }
                *left -= len;
                out.extend_from_slice(data);
            }
            Framing::Chunked => {
                out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
                out.extend_from_slice(data);
                out.extend_from_slice(b"\r\n");
            }
        }
        Ok(())
    }

    /// Appends the end of the body: the last chunk with `trailers` (chunked; those that
    /// [`may_trail`]), or nothing once the whole length went out (a length body has no room
    /// for trailers: they are dropped, as hyper drops them).
    pub(super) fn end(
        &mut self,
        out: &mut Vec<u8>,
        trailers: Option<&HeaderMap>,
    ) -> Result<(), FramingError> {
        match self.framing {
            Framing::Length(0) => Ok(()),
            Framing::Length(left) => Err(FramingError::BodyTooShort(left)),
            Framing::Chunked => {
                out.extend_from_slice(b"0\r\n");
                for (name, value) in trailers.into_iter().flatten() {
                    if may_trail(name) {
                        field(out, name.as_str(), value);
                    }
                }
                out.extend_from_slice(b"\r\n");
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut req = Request::builder().method("POST").uri("/v1/chat?x=1");
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        req.body(()).unwrap().into_parts().0
    }

    #[test]
    fn a_request_keeps_its_own_length_and_else_gets_one_or_chunks() {
        let with = parts(&[("content-length", "12")]);
        assert_eq!(
            framing(&with.headers, false, None).unwrap(),
            (Framing::Length(12), None)
        );
        let without = parts(&[]);
        assert_eq!(
            framing(&without.headers, true, Some(0)).unwrap(),
            (Framing::Length(0), None),
            "an empty body gets no length field"
        );
        let (f, extra) = framing(&without.headers, false, Some(5)).unwrap();
        assert_eq!(f, Framing::Length(5));
        assert_eq!(extra.unwrap().1, "5");
        let (f, extra) = framing(&without.headers, false, None).unwrap();
        assert_eq!(f, Framing::Chunked);
        assert_eq!(
            extra.unwrap(),
            (header::TRANSFER_ENCODING, "chunked".parse().unwrap())
        );
    }

    #[test]
    fn conflicting_or_malformed_lengths_are_refused() {
        for bad in [
            "1, 2",
            "-1",
            "+5",
            "0x10",
            "",
            "99999999999999999999",
            "1 2",
        ] {
            let p = parts(&[("content-length", bad)]);
            assert_eq!(
                framing(&p.headers, false, None),
                Err(FramingError::InvalidLength),
                "{bad:?}"
            );
        }
        let same = parts(&[("content-length", "7, 7"), ("content-length", "7")]);
        assert_eq!(
            framing(&same.headers, false, None).unwrap().0,
            Framing::Length(7)
        );
    }

    #[test]
    fn the_head_is_written_as_one_request_line_and_its_fields() {
        let p = parts(&[("host", "model-a"), ("x-a", "1"), ("x-a", "2")]);
        let mut out = Vec::new();
        let extra = (header::CONTENT_LENGTH, HeaderValue::from(3u64));
        write_head(&mut out, &p, Some(&extra), None);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/chat?x=1 HTTP/1.1\r\nhost: model-a\r\nx-a: 1\r\nx-a: 2\r\n\
             content-length: 3\r\n\r\n"
        );
        let mut out = Vec::new();
        write_head(
            &mut out,
            &p,
            None,
            Some(&HeaderValue::from_static("api.example")),
        );
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("host: api.example\r\n"), "{text}");
        assert!(
            !text.contains("model-a"),
            "the TLS server name replaces the Host: {text}"
        );
    }

    #[test]
    fn a_body_is_held_to_its_length_and_chunks_end_with_trailers() {
        let mut out = Vec::new();
        let mut length = BodyEncoder::new(Framing::Length(5));
        length.data(&mut out, &Bytes::from_static(b"abc")).unwrap();
        assert_eq!(
            length.end(&mut out, None),
            Err(FramingError::BodyTooShort(2))
        );
        assert_eq!(
            length.data(&mut out, &Bytes::from_static(b"defg")),
            Err(FramingError::BodyTooLong(2))
        );
        length.data(&mut out, &Bytes::from_static(b"de")).unwrap();
        length.end(&mut out, None).unwrap();
        assert_eq!(out, b"abcde");

        let mut out = Vec::new();
        let mut chunked = BodyEncoder::new(Framing::Chunked);
        chunked
            .data(&mut out, &Bytes::from(vec![b'x'; 26]))
            .unwrap();
        chunked.data(&mut out, &Bytes::new()).unwrap();
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", HeaderValue::from_static("abc"));
        trailers.insert("content-length", HeaderValue::from_static("0"));
        trailers.insert("host", HeaderValue::from_static("elsewhere"));
        chunked.end(&mut out, Some(&trailers)).unwrap();
        let expected = format!("1a\r\n{}\r\n0\r\nx-checksum: abc\r\n\r\n", "x".repeat(26));
        assert_eq!(String::from_utf8(out).unwrap(), expected);
    }
}
