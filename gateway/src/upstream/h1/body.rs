//! The response body read off an HTTP/1.1 upstream connection, in its framing: a length, chunks
//! (RFC 9112 §7.1), or until the backend closes. The decoder takes bytes from the front of the
//! connection's read buffer and hands out slices of it (no copy); it never takes a byte past
//! the body's end, so what is left after it is the next message's (or garbage that condemns the
//! connection).
//!
//! Chunked framing is read strictly, since a pooled connection's next response depends on it:
//! sizes are hex without sign or space and at most 16 digits (no overflow), every line ends in
//! CRLF (a bare LF fails the exchange), extensions are skipped but bounded, trailer fields are
//! parsed as header fields and bounded like a head.

use bytes::{Bytes, BytesMut};
use http::HeaderMap;

use super::response::{BodyFraming, MAX_HEAD_BYTES, MAX_HEADERS};

/// The longest chunk-size line (size and extensions) read.
const MAX_CHUNK_LINE: usize = 4096;

/// What the decoder got from the bytes it was shown.
#[derive(Debug, PartialEq)]
pub(super) enum Decoded {
    /// Body bytes.
    Data(Bytes),
    /// The trailer fields of a chunked body (its end follows).
    Trailers(HeaderMap),
    /// The body is complete.
    End,
    /// More bytes are needed.
    Need,
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum BodyError {
    #[error("the response body's chunk framing is malformed: {0}")]
    Chunk(&'static str),
    #[error("the response's trailer fields are malformed")]
    Trailers,
    #[error("the backend closed the connection {0} bytes before the end of the response body")]
    Incomplete(u64),
    #[error("the backend closed the connection inside a chunked response body")]
    IncompleteChunked,
}

/// The decoder's place in the body.
#[derive(Debug)]
pub(super) struct Decoder {
    state: State,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// This many bytes of a length body left.
    Length(u64),
    /// At a chunk-size line.
    Size,
    /// This many bytes of the current chunk left.
    Chunk(u64),
    /// After a chunk's data: its CRLF.
    ChunkEnd,
    /// After the last chunk: trailer fields, or the empty line.
    Trailers,
    /// Until the connection closes.
    Close,
    Done,
}

impl Decoder {
    pub(super) fn new(framing: BodyFraming) -> Self {
        Self {
            state: match framing {
                BodyFraming::Length(0) => State::Done,
                BodyFraming::Length(n) => State::Length(n),
                BodyFraming::Chunked => State::Size,
                BodyFraming::Close => State::Close,
            },
        }
    }

    /// Whether the body is complete.
    pub(super) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The bytes of a length body still to come.
    pub(super) fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// Takes what it can from the front of `buf`.
    pub(super) fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, BodyError> {
        loop {
            match self.state {
                State::Done => return Ok(Decoded::End),
                State::Length(left) | State::Chunk(left) => {
                    if buf.is_empty() {
                        return Ok(Decoded::Need);
                    }
                    let take = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                    let data = buf.split_to(take).freeze();
                    let left = left - take as u64;
                    self.state = match self.state {
                        State::Length(_) if left == 0 => State::Done,
                        State::Length(_) => State::Length(left),
                        _ if left == 0 => State::ChunkEnd,
                        _ => State::Chunk(left),
                    };
                    return Ok(Decoded::Data(data));
                }
                State::Close => {
                    if buf.is_empty() {
                        return Ok(Decoded::Need);
                    }
                    return Ok(Decoded::Data(buf.split().freeze()));
                }
                State::Size => {
                    let Some(line) = line(buf, MAX_CHUNK_LINE)? else {
                        return Ok(Decoded::Need);
                    };
                    let size = chunk_size(&line)?;
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::Chunk(size)
                    };
                }
                State::ChunkEnd => {
                    if buf.len() < 2 {
                        return Ok(Decoded::Need);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(BodyError::Chunk("chunk data not followed by CRLF"));
                    }
                    let _ = buf.split_to(2);
                    self.state = State::Size;
                }
                State::Trailers => {
                    if buf.starts_with(b"\r\n") {
                        let _ = buf.split_to(2);
                        self.state = State::Done;
                        return Ok(Decoded::End);
                    }
                    return match trailers(buf)? {
                        Some(fields) => {
                            self.state = State::Done;
                            Ok(Decoded::Trailers(fields))
                        }
                        None => Ok(Decoded::Need),
                    };
                }
            }
        }
    }

    /// The connection's end of stream: the end of a body read until close, else an error.
    pub(super) fn eof(&mut self) -> Result<Decoded, BodyError> {
        match self.state {
            State::Close | State::Done => {
                self.state = State::Done;
                Ok(Decoded::End)
            }
            State::Length(left) => Err(BodyError::Incomplete(left)),
            _ => Err(BodyError::IncompleteChunked),
        }
    }
}

/// A CRLF-ended line from the front of `buf`, without its CRLF (taken from `buf`); `None` while
/// it is incomplete.
fn line(buf: &mut BytesMut, max: usize) -> Result<Option<BytesMut>, BodyError> {
    let Some(lf) = buf.iter().take(max + 2).position(|b| *b == b'\n') else {
        if buf.len() > max + 1 {
            return Err(BodyError::Chunk("chunk-size line too long"));
        }
        return Ok(None);
    };
    if lf == 0 || buf[lf - 1] != b'\r' {
        return Err(BodyError::Chunk("bare LF in chunk-size line"));
    }
    let mut line = buf.split_to(lf + 1);
    line.truncate(lf - 1);
    Ok(Some(line))
}

/// The size of a chunk-size line (`1*HEXDIG [ BWS ";" ext ]`), at most 16 hex digits.
fn chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    let digits = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    if digits == 0 {
        return Err(BodyError::Chunk("no chunk size"));
    }
    if digits > 16 {
        return Err(BodyError::Chunk("chunk size overflows"));
    }
    let rest = &line[digits..];
    let ext = rest
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .map_or(&[][..], |i| &rest[i..]);
    if !ext.is_empty() && (ext[0] != b';' || ext.iter().any(|b| *b == b'\r' || *b == 0)) {
        return Err(BodyError::Chunk("junk after the chunk size"));
    }
    let mut size = 0u64;
    for d in &line[..digits] {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            _ => d - b'A' + 10,
        };
        size = (size << 4) | u64::from(v);
    }
    Ok(size)
}

/// The trailer section at the front of `buf` (fields, then the empty line), taken from `buf`
/// when whole; `None` while incomplete.
fn trailers(buf: &mut BytesMut) -> Result<Option<HeaderMap>, BodyError> {
    let end = find(buf, b"\r\n\r\n");
    let section = &buf[..end.map_or(buf.len(), |e| e + 4)];
    let bare_lf = section.first() == Some(&b'\n')
        || section.windows(2).any(|w| w[1] == b'\n' && w[0] != b'\r');
    if bare_lf {
        return Err(BodyError::Trailers);
    }
    let Some(end) = end else {
        if buf.len() > MAX_HEAD_BYTES {
            return Err(BodyError::Trailers);
        }
        return Ok(None);
    };
    let section = buf.split_to(end + 4).freeze();
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    match httparse::parse_headers(&section, &mut fields) {
        Ok(httparse::Status::Complete((len, parsed))) if len == section.len() => {
            let mut map = HeaderMap::with_capacity(parsed.len());
            for f in parsed {
                let name = http::HeaderName::from_bytes(f.name.as_bytes())
                    .map_err(|_| BodyError::Trailers)?;
                let value = http::HeaderValue::from_maybe_shared(section.slice_ref(f.value))
                    .map_err(|_| BodyError::Trailers)?;
                map.append(name, value);
            }
            Ok(Some(map))
        }
        _ => Err(BodyError::Trailers),
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::Strategy as _;

    use super::*;

    /// A body's bytes, its trailers, and what was left after its end.
    type Read = (Vec<u8>, Option<HeaderMap>, Vec<u8>);

    /// Feeds `wire` to a decoder `step` bytes at a time and collects the body, the trailers and
    /// what is left after the end.
    fn run(framing: BodyFraming, wire: &[u8], step: usize, eof: bool) -> Result<Read, BodyError> {
        let mut decoder = Decoder::new(framing);
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        let mut trailers = None;
        let mut fed = 0;
        loop {
            match decoder.decode(&mut buf)? {
                Decoded::Data(d) => body.extend_from_slice(&d),
                Decoded::Trailers(t) => trailers = Some(t),
                Decoded::End => return Ok((body, trailers, buf.to_vec())),
                Decoded::Need if fed < wire.len() => {
                    let next = (fed + step).min(wire.len());
                    buf.extend_from_slice(&wire[fed..next]);
                    fed = next;
                }
                Decoded::Need if eof => match decoder.eof()? {
                    Decoded::End => return Ok((body, trailers, buf.to_vec())),
                    other => panic!("{other:?}"),
                },
                Decoded::Need => return Err(BodyError::IncompleteChunked),
            }
        }
    }

    #[test]
    fn chunks_decode_whole_or_byte_by_byte_and_leave_what_follows() {
        let wire = b"5\r\nhello\r\n1;ext=1\r\n!\r\n0\r\n\r\nHTTP/1.1";
        for step in [1, 2, 3, 7, wire.len()] {
            let (body, trailers, rest) = run(BodyFraming::Chunked, wire, step, false).unwrap();
            assert_eq!(body, b"hello!", "step {step}");
            assert!(trailers.is_none());
            assert!(
                b"HTTP/1.1".starts_with(&rest),
                "nothing past the end is taken"
            );
        }
        let wire = b"A\r\n0123456789\r\n0\r\nx-sum: 45\r\nx-n: 10\r\n\r\n";
        for step in [1, 5, wire.len()] {
            let (body, trailers, rest) = run(BodyFraming::Chunked, wire, step, false).unwrap();
            assert_eq!(body, b"0123456789");
            let t = trailers.expect("trailers");
            assert_eq!(t["x-sum"], "45");
            assert_eq!(t["x-n"], "10");
            assert!(rest.is_empty());
        }
    }

    #[test]
    fn malformed_chunks_fail() {
        for (wire, why) in [
            (&b"5\nhello\r\n0\r\n\r\n"[..], "bare LF after the size"),
            (b"5\r\nhello\n0\r\n\r\n", "data not followed by CRLF"),
            (b"5\r\nhelloXX0\r\n\r\n", "data longer than its size"),
            (b"-5\r\nhello\r\n0\r\n\r\n", "a signed size"),
            (b" 5\r\nhello\r\n0\r\n\r\n", "space before the size"),
            (b"5 x\r\nhello\r\n0\r\n\r\n", "junk after the size"),
            (b"0x5\r\nhello\r\n0\r\n\r\n", "0x prefix"),
            (b"\r\nhello\r\n0\r\n\r\n", "no size"),
            (b"10000000000000000\r\n", "17 hex digits"),
            (b"0\r\nx-a: 1\nx-b: 2\r\n\r\n", "bare LF in the trailers"),
            (b"0\r\nbad field\r\n\r\n", "a malformed trailer"),
        ] {
            for step in [1, wire.len()] {
                assert!(
                    run(BodyFraming::Chunked, wire, step, false).is_err(),
                    "{why} (step {step})"
                );
            }
        }
        let long = format!("1;{}\r\n", "e".repeat(MAX_CHUNK_LINE + 10));
        assert_eq!(
            run(BodyFraming::Chunked, long.as_bytes(), 64, false),
            Err(BodyError::Chunk("chunk-size line too long"))
        );
        assert_eq!(
            chunk_size(b"ffffffffffffffff").unwrap(),
            u64::MAX,
            "16 digits fit"
        );
    }

    #[test]
    fn a_length_body_takes_its_length_and_a_close_body_takes_all() {
        let (body, _, rest) = run(BodyFraming::Length(5), b"helloHTTP", 2, false).unwrap();
        assert_eq!(body, b"hello");
        assert_eq!(rest, b"H", "at most a read's worth past it, never taken");
        assert_eq!(
            run(BodyFraming::Length(9), b"hello", 2, true),
            Err(BodyError::Incomplete(4))
        );
        let (body, _, _) = run(BodyFraming::Close, b"all of it", 4, true).unwrap();
        assert_eq!(body, b"all of it");
        assert_eq!(
            run(BodyFraming::Chunked, b"5\r\nhel", 2, true),
            Err(BodyError::IncompleteChunked)
        );
        assert!(Decoder::new(BodyFraming::Length(0)).is_done());
    }

    proptest::proptest! {
        /// Arbitrary bytes, fed in arbitrary steps, never panic the decoder or make it loop,
        /// and it never hands out more than it was given.
        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(
            wire in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
            step in 1usize..64,
            framing in proptest::prop_oneof![
                (0u64..300).prop_map(BodyFraming::Length),
                proptest::strategy::Just(BodyFraming::Chunked),
                proptest::strategy::Just(BodyFraming::Close),
            ],
        ) {
            if let Ok((body, _, rest)) = run(framing, &wire, step, true) {
                proptest::prop_assert!(body.len() + rest.len() <= wire.len());
                if let BodyFraming::Length(n) = framing {
                    proptest::prop_assert_eq!(body.len() as u64, n);
                }
            }
        }

        /// What the request side's chunked encoder writes, the decoder reads back whole,
        /// however the bytes arrive.
        #[test]
        fn chunks_written_by_the_encoder_read_back_whole(
            frames in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300), 0..8),
            step in 1usize..128,
        ) {
            use super::super::request::{BodyEncoder, Framing};
            let mut wire = Vec::new();
            let mut encoder = BodyEncoder::new(Framing::Chunked);
            for frame in &frames {
                encoder.data(&mut wire, &Bytes::copy_from_slice(frame)).unwrap();
            }
            encoder.end(&mut wire, None).unwrap();
            let (body, trailers, rest) = run(BodyFraming::Chunked, &wire, step, false).unwrap();
            proptest::prop_assert_eq!(body, frames.concat());
            proptest::prop_assert!(trailers.is_none() && rest.is_empty());
        }
    }
}
