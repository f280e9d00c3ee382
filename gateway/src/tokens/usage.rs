//! A response's token usage, read as its body passes through to the client: from a JSON body's
//! `usage` (the body's frames are held, by reference, up to [`JSON_CAP`] bytes, and parsed at its
//! end), and from an SSE stream's events, parsed one by one as their lines complete (nothing of
//! the stream is held but the line being read): the chunk with `usage` (sent last when the
//! request set `stream_options.include_usage`), the content chunks counted, and when the first
//! and the last of them came (time to first token, time per output token).

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http::header::CONTENT_TYPE;
use serde::Deserialize;
use serde::de::IgnoredAny;
use tokio::time::Instant;

/// The most of a JSON response body held to read its `usage`; a longer body is passed on
/// unread (its tokens are then the call's estimate).
pub const JSON_CAP: usize = 1 << 20;

/// The longest SSE line read; a longer one (no chunk of a model server is) is skipped whole.
pub const LINE_CAP: usize = 64 << 10;

/// Token counts a backend reported (OpenAI's `usage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// `prompt_tokens`.
    pub prompt: u64,
    /// `completion_tokens`.
    pub completion: u64,
    /// `prompt_tokens_details.cached_tokens`, when present (part of `prompt`).
    pub cached: Option<u64>,
}

#[derive(Deserialize)]
struct UsageWire {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<DetailsWire>,
}

#[derive(Deserialize)]
struct DetailsWire {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl From<UsageWire> for Usage {
    fn from(w: UsageWire) -> Self {
        Self {
            prompt: w.prompt_tokens,
            completion: w.completion_tokens,
            cached: w.prompt_tokens_details.and_then(|d| d.cached_tokens),
        }
    }
}

/// What a body with a `usage` field says of it (`null` or absent: nothing).
#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<UsageWire>,
}

/// One streamed chunk: its choices (for content) and its `usage`.
#[derive(Deserialize)]
struct ChunkWire {
    #[serde(default)]
    choices: Option<Vec<ChoiceWire>>,
    #[serde(default)]
    usage: Option<UsageWire>,
}

#[derive(Deserialize)]
struct ChoiceWire {
    /// Chat completions.
    #[serde(default)]
    delta: Option<DeltaWire>,
    /// Completions.
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct DeltaWire {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
}

impl ChoiceWire {
    /// Whether the choice carries output (text, reasoning or a tool call), not only a role
    /// or a finish reason.
    fn has_content(&self) -> bool {
        let nonempty = |s: &Option<String>| s.as_ref().is_some_and(|s| !s.is_empty());
        nonempty(&self.text)
            || self.delta.as_ref().is_some_and(|d| {
                nonempty(&d.content) || nonempty(&d.reasoning_content) || d.tool_calls.is_some()
            })
    }
}

/// How a response body is read.
#[derive(Debug)]
enum Format {
    /// `application/json`: held up to [`JSON_CAP`], parsed at the end.
    Json { held: Vec<Bytes>, len: usize },
    /// `text/event-stream`: parsed event by event.
    Sse(SseParser),
    /// Anything else, or a JSON body past its cap: not read.
    Unread,
}

/// What was read of a response once it ended (or was cut).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reading {
    /// The backend's `usage`, if it sent one.
    pub usage: Option<Usage>,
    /// Whether the response was an SSE stream.
    pub stream: bool,
    /// Stream chunks that carried output.
    pub content_chunks: u64,
    /// When the first of them arrived.
    pub first_content: Option<Instant>,
    /// When the last of them arrived.
    pub last_content: Option<Instant>,
}

/// Reads a response body's usage as its frames pass (see the module's text).
#[derive(Debug)]
pub struct UsageReader {
    format: Format,
    reading: Reading,
}

impl UsageReader {
    /// A reader for a response with `headers` (its `Content-Type` decides how it is read).
    pub fn for_response(headers: &HeaderMap) -> Self {
        let kind = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            });
        let format = match kind.as_deref() {
            Some("text/event-stream") => Format::Sse(SseParser::default()),
            Some("application/json") => Format::Json {
                held: Vec::new(),
                len: 0,
            },
            _ => Format::Unread,
        };
        let stream = matches!(format, Format::Sse(_));
        Self {
            format,
            reading: Reading {
                stream,
                ..Reading::default()
            },
        }
    }

    /// A frame of the body arrived at `now`.
    pub fn feed(&mut self, data: &Bytes, now: Instant) {
        match &mut self.format {
            Format::Json { held, len } => {
                *len += data.len();
                if *len > JSON_CAP {
                    self.format = Format::Unread;
                } else {
                    held.push(data.clone());
                }
            }
            Format::Sse(parser) => {
                let reading = &mut self.reading;
                parser.feed(data, |event| read_event(event, now, reading));
            }
            Format::Unread => {}
        }
    }

    /// What was read, the body having ended or been cut: a JSON body is parsed now (a cut one
    /// fails to parse and says nothing).
    pub fn finish(mut self) -> Reading {
        if let Format::Json { held, .. } = &self.format {
            let body: Vec<u8> = held.iter().flat_map(|b| b.iter().copied()).collect();
            if let Ok(WithUsage { usage: Some(u) }) = serde_json::from_slice::<WithUsage>(&body) {
                self.reading.usage = Some(u.into());
            }
        }
        self.reading
    }
}

/// One SSE event's data: counts a content chunk, takes its `usage`.
fn read_event(data: &[u8], now: Instant, reading: &mut Reading) {
    if data == b"[DONE]" {
        return;
    }
    let Ok(chunk) = serde_json::from_slice::<ChunkWire>(data) else {
        return;
    };
    if let Some(u) = chunk.usage {
        reading.usage = Some(u.into());
    }
    let content = chunk
        .choices
        .as_ref()
        .is_some_and(|c| c.iter().any(ChoiceWire::has_content));
    if content {
        reading.content_chunks += 1;
        reading.first_content.get_or_insert(now);
        reading.last_content = Some(now);
    }
}

/// An incremental parser of the `data` of SSE events (the WHATWG event-stream format): lines
/// end with LF or CRLF, `data:` lines of an event are joined with LF, a blank line ends the
/// event; other fields and comments are ignored. Holds only the line being read and the data of
/// the event being read.
#[derive(Debug, Default)]
pub struct SseParser {
    line: BytesMut,
    /// The line being read is longer than [`LINE_CAP`]: skip to its end.
    skipping: bool,
    data: Vec<u8>,
    has_data: bool,
}

impl SseParser {
    /// Reads `bytes`, calling `event` with the data of each event they complete.
    pub fn feed(&mut self, mut bytes: &[u8], mut event: impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            let Some(end) = bytes.iter().position(|b| *b == b'\n') else {
                self.extend(bytes);
                return;
            };
            self.extend(&bytes[..end]);
            bytes = &bytes[end + 1..];
            if std::mem::take(&mut self.skipping) {
                self.line.clear();
                continue;
            }
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.truncate(line.len() - 1);
            }
            self.line_done(&line, &mut event);
            line.clear();
            self.line = line;
        }
    }

    fn extend(&mut self, part: &[u8]) {
        if self.skipping {
            return;
        }
        if self.line.len() + part.len() > LINE_CAP {
            self.skipping = true;
            self.line.clear();
            return;
        }
        self.line.extend_from_slice(part);
    }

    fn line_done(&mut self, line: &[u8], event: &mut impl FnMut(&[u8])) {
        if line.is_empty() {
            if std::mem::take(&mut self.has_data) {
                event(&self.data);
            }
            self.data.clear();
            return;
        }
        let Some(value) = line.strip_prefix(b"data") else {
            return;
        };
        let value = match value {
            [] => value,
            [b':', b' ', rest @ ..] | [b':', rest @ ..] => rest,
            // Another field whose name starts with "data".
            _ => return,
        };
        if self.has_data {
            self.data.push(b'\n');
        }
        if self.data.len() + value.len() <= LINE_CAP {
            self.data.extend_from_slice(value);
        }
        self.has_data = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn headers(content_type: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, content_type.parse().unwrap());
        h
    }

    fn read(content_type: &str, frames: &[&[u8]]) -> Reading {
        let mut reader = UsageReader::for_response(&headers(content_type));
        let now = Instant::now();
        for f in frames {
            reader.feed(&Bytes::copy_from_slice(f), now);
        }
        reader.finish()
    }

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"the \"}}],\"usage\":null}\n\n",
        ": a comment\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"pool \"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn a_json_body_gives_its_usage() {
        let body = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;
        let (a, b) = body.split_at(20);
        let reading = read("application/json; charset=utf-8", &[a, b]);
        assert_eq!(
            reading.usage,
            Some(Usage {
                prompt: 5,
                completion: 7,
                cached: None
            })
        );
        assert!(!reading.stream);
        assert_eq!(read("application/json", &[b"{\"usage\":null}"]).usage, None);
        assert_eq!(read("application/json", &[&body[..30]]).usage, None, "cut");
        assert_eq!(read("text/plain", &[body]).usage, None, "not JSON");
    }

    #[test]
    fn a_json_body_past_its_cap_is_not_held() {
        let mut reader = UsageReader::for_response(&headers("application/json"));
        let big = Bytes::from(vec![b' '; JSON_CAP]);
        reader.feed(
            &Bytes::from_static(b"{\"usage\":{\"prompt_tokens\":1}}"),
            Instant::now(),
        );
        reader.feed(&big, Instant::now());
        assert!(matches!(reader.format, Format::Unread));
        assert_eq!(reader.finish().usage, None);
    }

    #[test]
    fn a_stream_gives_its_usage_and_counts_its_content_chunks() {
        let reading = read("text/event-stream", &[STREAM.as_bytes()]);
        assert!(reading.stream);
        assert_eq!(
            reading.content_chunks, 2,
            "role-only and finish chunks carry no output"
        );
        assert_eq!(
            reading.usage,
            Some(Usage {
                prompt: 9,
                completion: 2,
                cached: Some(4)
            })
        );
        assert!(reading.first_content.is_some());
    }

    #[test]
    fn completions_and_tool_calls_count_as_content() {
        let stream = concat!(
            "data: {\"choices\":[{\"text\":\"a \"}]}\r\n\r\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\n",
            "data:{\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\n\n",
            "data: not json\n\n",
        );
        let reading = read("text/event-stream", &[stream.as_bytes()]);
        assert_eq!((reading.content_chunks, reading.usage), (3, None));
    }

    #[test]
    fn an_event_of_several_data_lines_is_joined() {
        let mut events = Vec::new();
        let mut p = SseParser::default();
        p.feed(b"data: {\"a\":\ndata: 1}\n\nevent: x\ndatax: y\n\n", |e| {
            events.push(String::from_utf8_lossy(e).into_owned())
        });
        assert_eq!(events, vec!["{\"a\":\n1}".to_owned()]);
    }

    #[test]
    fn an_overlong_line_is_skipped_and_the_next_one_read() {
        let mut events = Vec::new();
        let mut p = SseParser::default();
        let long = vec![b'x'; LINE_CAP + 10];
        p.feed(b"data: ", |_| {});
        p.feed(&long, |_| {});
        p.feed(b"\n\ndata: ok\n\n", |e| events.push(e.to_vec()));
        assert_eq!(events, vec![b"ok".to_vec()]);
    }

    proptest! {
        /// However the stream is cut into frames, the reading is the same.
        #[test]
        fn frames_do_not_change_the_reading(cuts in proptest::collection::vec(0..STREAM.len(), 0..12)) {
            let whole = read("text/event-stream", &[STREAM.as_bytes()]);
            let mut cuts = cuts;
            cuts.sort_unstable();
            cuts.dedup();
            let bytes = STREAM.as_bytes();
            let mut frames = Vec::new();
            let mut at = 0;
            for c in cuts {
                frames.push(&bytes[at..c]);
                at = c;
            }
            frames.push(&bytes[at..]);
            let parts = read("text/event-stream", &frames);
            prop_assert_eq!(parts.usage, whole.usage);
            prop_assert_eq!(parts.content_chunks, whole.content_chunks);
        }
    }
}
