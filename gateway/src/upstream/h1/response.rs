//! The response head read off an HTTP/1.1 upstream connection: parsed by `httparse` into a stack
//! array of fields, its values kept as slices of the bytes read (no copy), and what the head
//! says about the body that follows and the connection after it (RFC 9112 §6.3, §9.3).
//!
//! A pooled connection carries the next client's request after this one, so a body delimited
//! wrongly would hand one client's bytes to another: every ambiguity here fails the exchange or
//! closes the connection after it. A `Content-Length` must be one number (a list of the same
//! number is that number); `Transfer-Encoding` beside it wins, the length is not passed on, and
//! the connection is not reused; a `Transfer-Encoding` that does not end in `chunked` is read
//! until the backend closes (in HTTP/1.0 it fails the exchange); a response with neither is read
//! until close.

use bytes::BytesMut;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Version};

use super::request::{content_length, trim};

/// The most fields a response head may have (hyper's default too).
pub(super) const MAX_HEADERS: usize = 100;

/// The largest response head read: past it, the exchange fails (a head this large is no model
/// server's; a backend that sends one without end must not fill the gateway's memory).
pub(super) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// How the response body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BodyFraming {
    /// This many bytes (0: no body, as for `HEAD`, 1xx, 204 and 304).
    Length(u64),
    /// Chunked.
    Chunked,
    /// Until the backend closes the connection.
    Close,
}

/// A parsed response head.
#[derive(Debug)]
pub(super) struct Head {
    pub(super) status: StatusCode,
    pub(super) version: Version,
    pub(super) headers: HeaderMap,
    pub(super) body: BodyFraming,
    /// Whether the connection may carry another request after this response.
    pub(super) keep_alive: bool,
}

/// Why a response head was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum HeadError {
    #[error("the response head is malformed: {0}")]
    Malformed(httparse::Error),
    #[error("the response head is larger than {MAX_HEAD_BYTES} bytes")]
    TooLarge,
    #[error("the response has an invalid status code")]
    InvalidStatus,
    #[error("the response has a field that is not a valid header")]
    InvalidField,
    #[error("the response's Content-Length is not a single length")]
    InvalidLength,
    #[error("the response's Transfer-Encoding applies chunked more than once")]
    InvalidTransferEncoding,
    #[error("the HTTP/1.0 response has a Transfer-Encoding")]
    CodingInHttp10,
    #[error("the backend switched protocols, which the gateway never asks for")]
    UnaskedUpgrade,
}

/// Reads heads as their bytes arrive: each byte is looked at once for the blank line that ends a
/// head, and `httparse` runs only when one has come, so a backend that sends its head a byte at
/// a time costs time in proportion to the head, not to its square.
#[derive(Debug, Default)]
pub(super) struct HeadReader {
    /// The bytes at the front of the buffer already looked at, without a blank line among them.
    scanned: usize,
}

impl HeadReader {
    /// [`parse`], once the bytes at the front of `buf` hold a blank line.
    pub(super) fn read(
        &mut self,
        buf: &mut BytesMut,
        head_request: bool,
    ) -> Result<Option<Head>, HeadError> {
        // A blank line ends in `\n\n` or `\n\r\n`: look again from two bytes before the new ones.
        let from = self.scanned.saturating_sub(2).min(buf.len());
        let new = &buf[from..];
        let ended = new.windows(2).any(|w| w == b"\n\n") || new.windows(3).any(|w| w == b"\n\r\n");
        if !ended {
            self.scanned = buf.len();
            if buf.len() >= MAX_HEAD_BYTES {
                return Err(HeadError::TooLarge);
            }
            return Ok(None);
        }
        let parsed = parse(buf, head_request);
        self.scanned = match &parsed {
            Ok(None) => buf.len(),
            _ => 0,
        };
        parsed
    }
}

/// The head at the start of `buf`, taken from it, if all of it is there (`Ok(None)` while more
/// is needed). Informational (1xx) heads come back like any other (the caller skips them).
pub(super) fn parse(buf: &mut BytesMut, head_request: bool) -> Result<Option<Head>, HeadError> {
    if buf.is_empty() {
        return Ok(None);
    }
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut fields);
    let len = match response.parse(buf) {
        Ok(httparse::Status::Complete(len)) if len > MAX_HEAD_BYTES => {
            return Err(HeadError::TooLarge);
        }
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD_BYTES => {
            return Err(HeadError::TooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(e) => return Err(HeadError::Malformed(e)),
    };
    let code = response.code.ok_or(HeadError::InvalidStatus)?;
    let status = StatusCode::from_u16(code).map_err(|_| HeadError::InvalidStatus)?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(HeadError::UnaskedUpgrade);
    }
    let version = if response.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // Where each field's name and value lie in the head, so that the values become slices of
    // the head once it is taken out of the buffer (no copy).
    let base = buf.as_ptr() as usize;
    let span = |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        start..start + s.len()
    };
    let mut spans = [const { (0..0, 0..0) }; MAX_HEADERS];
    let count = response.headers.len();
    for (slot, field) in spans.iter_mut().zip(response.headers.iter()) {
        *slot = (span(field.name.as_bytes()), span(field.value));
    }
    let head = buf.split_to(len).freeze();
    let mut headers = HeaderMap::with_capacity(count);
    for (name, value) in spans.into_iter().take(count) {
        let name = HeaderName::from_bytes(&head[name]).map_err(|_| HeadError::InvalidField)?;
        let value = HeaderValue::from_maybe_shared(head.slice(value))
            .map_err(|_| HeadError::InvalidField)?;
        headers.append(name, value);
    }
    let (body, mut keep_alive) = framing(&headers, status, version, head_request)?;
    keep_alive &= persistent(&headers, version);
    if headers.contains_key(header::TRANSFER_ENCODING) {
        // RFC 9112 §6.3: the coding overrides a length, which must not be passed on (the client
        // would be told a length the body does not have).
        headers.remove(header::CONTENT_LENGTH);
    }
    Ok(Some(Head {
        status,
        version,
        headers,
        body,
        keep_alive,
    }))
}

/// The body's framing (RFC 9112 §6.3) and whether it leaves the connection reusable.
fn framing(
    headers: &HeaderMap,
    status: StatusCode,
    version: Version,
    head_request: bool,
) -> Result<(BodyFraming, bool), HeadError> {
    if head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok((BodyFraming::Length(0), true));
    }
    let length = content_length(headers).map_err(|()| HeadError::InvalidLength)?;
    let mut codings = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(trim)
        .filter(|c| !c.is_empty())
        .peekable();
    if codings.peek().is_none() {
        return Ok(match length {
            Some(length) => (BodyFraming::Length(length), true),
            None => (BodyFraming::Close, false),
        });
    }
    if version == Version::HTTP_10 {
        // RFC 9112 §6.1: an HTTP/1.0 message with a coding is faulty framing (hyper's client
        // refuses it too).
        return Err(HeadError::CodingInHttp10);
    }
    let codings: Vec<&[u8]> = codings.collect();
    let chunked = |c: &[u8]| c.eq_ignore_ascii_case(b"chunked");
    let last_chunked = codings.last().is_some_and(|c| chunked(c));
    if codings.iter().filter(|c| chunked(c)).count() > 1 {
        return Err(HeadError::InvalidTransferEncoding);
    }
    // A length beside the coding is ignored, and the connection goes after this response:
    // whoever sent both may frame the next one wrongly too.
    let reusable = length.is_none();
    Ok(if last_chunked {
        (BodyFraming::Chunked, reusable)
    } else {
        (BodyFraming::Close, false)
    })
}

/// Whether the backend keeps the connection open after the response: HTTP/1.1 unless it says
/// `Connection: close`, HTTP/1.0 only when it says `keep-alive`.
fn persistent(headers: &HeaderMap, version: Version) -> bool {
    let has = |token: &[u8]| {
        headers.get_all(header::CONNECTION).iter().any(|v| {
            v.as_bytes()
                .split(|b| *b == b',')
                .any(|t| trim(t).eq_ignore_ascii_case(token))
        })
    };
    if version == Version::HTTP_10 {
        has(b"keep-alive") && !has(b"close")
    } else {
        !has(b"close")
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::Strategy;
    use proptest::prelude::prop;

    use super::*;

    fn head(text: &str) -> Result<Option<Head>, HeadError> {
        parse(&mut BytesMut::from(text.as_bytes()), false)
    }

    fn framed(text: &str) -> (BodyFraming, bool) {
        let h = head(text).unwrap().unwrap();
        (h.body, h.keep_alive)
    }

    #[test]
    fn a_head_is_parsed_once_it_is_whole() {
        let mut partial = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-le"[..]);
        assert!(parse(&mut partial, false).unwrap().is_none());
        assert_eq!(partial.len(), 27, "nothing taken until the head is whole");
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\nX-A: 2\r\n\r\nhi"[..],
        );
        let h = parse(&mut buf, false).unwrap().unwrap();
        assert_eq!(&buf[..], b"hi", "the head taken, the body left");
        assert_eq!(h.status, 200);
        assert_eq!(h.version, Version::HTTP_11);
        let xa: Vec<_> = h.headers.get_all("x-a").iter().collect();
        assert_eq!(xa, ["1", "2"]);
        assert_eq!(h.body, BodyFraming::Length(2));
        assert!(h.keep_alive);
    }

    #[test]
    fn the_body_is_framed_as_rfc_9112_says() {
        assert_eq!(
            framed("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
            (BodyFraming::Chunked, true)
        );
        assert_eq!(
            framed("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
            (BodyFraming::Chunked, true)
        );
        assert_eq!(
            framed("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"),
            (BodyFraming::Close, false),
            "not ending in chunked: read until close"
        );
        assert_eq!(
            framed("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"),
            (BodyFraming::Chunked, false),
            "chunked wins over a length, and the connection goes after"
        );
        let both =
            head("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap()
                .unwrap();
        assert!(
            !both.headers.contains_key(header::CONTENT_LENGTH),
            "the overridden length is not passed on"
        );
        assert_eq!(
            head("HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap_err(),
            HeadError::CodingInHttp10
        );
        assert_eq!(
            framed("HTTP/1.1 200 OK\r\n\r\n"),
            (BodyFraming::Close, false)
        );
        assert_eq!(
            framed("HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"),
            (BodyFraming::Length(0), true)
        );
        assert_eq!(
            framed("HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n"),
            (BodyFraming::Length(0), true)
        );
        let h = parse(
            &mut BytesMut::from(&b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n"[..]),
            true,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            h.body,
            BodyFraming::Length(0),
            "the answer to a HEAD has no body"
        );
        assert_eq!(
            framed("HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\nContent-Length: 3\r\n\r\n"),
            (BodyFraming::Length(3), true)
        );
    }

    #[test]
    fn ambiguous_framing_is_refused() {
        for bad in [
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 3, 4\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 0x3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
        ] {
            assert_eq!(head(bad).unwrap_err(), HeadError::InvalidLength, "{bad:?}");
        }
        assert_eq!(
            head("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n").unwrap_err(),
            HeadError::InvalidTransferEncoding
        );
        assert!(matches!(
            head("HTTP/1.1 200 OK\r\nBad Field: x\r\n\r\n").unwrap_err(),
            HeadError::Malformed(_)
        ));
        assert!(
            matches!(
                head("HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\n\r\n").unwrap_err(),
                HeadError::Malformed(_)
            ),
            "obsolete line folding"
        );
        // Bare LF line ends in a head are read as httparse (and so hyper) reads them; the body's
        // chunk lines are stricter (`body`).
        assert_eq!(
            head("HTTP/1.1 200 OK\nContent-Length: 0\n\n")
                .unwrap()
                .unwrap()
                .body,
            BodyFraming::Length(0)
        );
        assert_eq!(
            head("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n").unwrap_err(),
            HeadError::UnaskedUpgrade
        );
        assert_eq!(
            head("HTTP/1.1 999 Odd\r\n\r\n").unwrap().unwrap().status,
            999
        );
    }

    #[test]
    fn a_head_sent_a_byte_at_a_time_is_read_when_its_blank_line_comes() {
        for text in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\n\r\nok"[..],
            b"HTTP/1.1 204 No Content\n\n",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        ] {
            let mut reader = HeadReader::default();
            let mut buf = BytesMut::new();
            let mut heads = Vec::new();
            for byte in text {
                buf.extend_from_slice(&[*byte]);
                while let Some(head) = reader.read(&mut buf, false).unwrap() {
                    heads.push(head.status);
                }
            }
            let whole = parse(&mut BytesMut::from(text), false).unwrap().unwrap();
            assert_eq!(heads.first(), Some(&whole.status), "{text:?}");
            assert_eq!(
                heads.len(),
                1 + usize::from(whole.status == 100),
                "{text:?}"
            );
        }
        let mut reader = HeadReader::default();
        let mut endless = BytesMut::new();
        let mut result = Ok(None);
        while result == Ok(None) {
            endless.extend_from_slice(b"x-filler: aaaaaaaaaaaaaaaa\r\n");
            result = reader
                .read(&mut endless, false)
                .map(|h| h.map(|h| h.status));
        }
        assert_eq!(result, Err(HeadError::TooLarge));
        assert!(endless.len() < MAX_HEAD_BYTES + 64);
    }

    #[test]
    fn a_head_without_end_stops_at_its_limit() {
        let mut text = String::from("HTTP/1.1 200 OK\r\n");
        while text.len() < MAX_HEAD_BYTES {
            text.push_str("x-filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        assert!(matches!(head(&text), Err(HeadError::TooLarge)));
        let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: 1\r\n")).collect();
        assert_eq!(
            head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")).unwrap_err(),
            HeadError::TooLarge
        );
    }

    #[test]
    fn the_connection_persists_as_the_version_and_connection_field_say() {
        assert!(!framed("HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").1);
        assert!(!framed("HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: x, Close\r\n\r\n").1);
        assert!(!framed("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n").1);
        assert!(framed("HTTP/1.0 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n").1);
    }

    /// Field lines a backend could use to frame a response ambiguously: lengths that disagree,
    /// codings that hide `chunked`, whitespace where RFC 9112 allows none, line folding.
    fn smuggling_field() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "Content-Length: 5\r\n",
            "Content-Length: 6\r\n",
            "Content-Length: 5, 5\r\n",
            "Content-Length: 5, 6\r\n",
            "Content-Length:5\r\n",
            "Content-Length : 5\r\n",
            "Content-Length: +5\r\n",
            "Content-Length: 0x5\r\n",
            "Content-Length: 18446744073709551616\r\n",
            "Transfer-Encoding: chunked\r\n",
            "Transfer-Encoding: Chunked\r\n",
            "Transfer-Encoding: xchunked\r\n",
            "Transfer-Encoding: chunked, identity\r\n",
            "Transfer-Encoding: gzip, chunked\r\n",
            "Transfer-Encoding:\tchunked\r\n",
            "Transfer-Encoding: chunked\r\n chunked\r\n",
            " Transfer-Encoding: chunked\r\n",
            "Transfer-Encoding\r\n",
            "Connection: close\r\n",
            "Connection: keep-alive\r\n",
            "X-Other: 1\r\n",
        ])
    }

    proptest::proptest! {
        /// Arbitrary bytes never panic the parser, and it takes exactly one head or nothing.
        #[test]
        fn arbitrary_bytes_never_panic_the_head_parser(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1024),
            head_request in proptest::prelude::any::<bool>(),
        ) {
            let mut buf = BytesMut::from(&bytes[..]);
            match parse(&mut buf, head_request) {
                Ok(Some(_)) => proptest::prop_assert!(buf.len() < bytes.len()),
                _ => proptest::prop_assert_eq!(buf.len(), bytes.len(), "nothing taken"),
            }
        }

        /// However a backend combines ambiguous framing fields, the connection is never left to
        /// guess: a `Transfer-Encoding` is never overridden by a length, lengths that disagree
        /// fail the call, and a connection stays open only for a head framed one way.
        #[test]
        fn ambiguous_framing_never_leaves_a_reused_connection_guessing(
            fields in proptest::collection::vec(smuggling_field(), 0..5),
        ) {
            let text = format!("HTTP/1.1 200 OK\r\n{}\r\n", fields.concat());
            let Ok(Some(head)) = parse(&mut BytesMut::from(text.as_bytes()), false) else {
                return Ok(());
            };
            let coded = head.headers.contains_key(header::TRANSFER_ENCODING);
            // The lengths the backend sent (a coded head passes none on).
            let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let _ = httparse::Response::new(&mut fields).parse(text.as_bytes());
            let lengths: std::collections::BTreeSet<&[u8]> = fields
                .iter()
                .filter(|f| f.name.eq_ignore_ascii_case("content-length"))
                .flat_map(|f| f.value.split(|b| *b == b','))
                .map(trim)
                .collect();
            proptest::prop_assert!(lengths.len() <= 1, "disagreeing lengths accepted: {text:?}");
            if coded {
                proptest::prop_assert!(
                    !matches!(head.body, BodyFraming::Length(_)),
                    "a length overrode a coding: {text:?}"
                );
                proptest::prop_assert!(
                    !head.headers.contains_key(header::CONTENT_LENGTH),
                    "an overridden length passed on: {text:?}"
                );
            }
            if head.keep_alive {
                proptest::prop_assert!(!coded || lengths.is_empty(), "{text:?}");
                proptest::prop_assert!(head.body != BodyFraming::Close, "{text:?}");
            }
        }
    }
}
