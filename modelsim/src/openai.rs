//! The OpenAI wire format as modelsim speaks it: parsing `/v1/chat/completions` and
//! `/v1/completions` requests, and rendering complete responses, SSE chunks and errors.

use serde_json::{Value, json};

/// Which inference endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            Self::Chat => "chatcmpl",
            Self::Completions => "cmpl",
        }
    }
}

/// The parts of an inference request that modelsim acts on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct InferenceRequest {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<u32>,
    pub prompt_tokens: u32,
}

/// Parses a request body; the error is a message for a 400 answer.
pub(crate) fn parse_request(endpoint: Endpoint, body: &[u8]) -> Result<InferenceRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    let obj = value
        .as_object()
        .ok_or("request body must be a JSON object")?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err("`model` must be a string".to_owned()),
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("`stream` must be a boolean".to_owned()),
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let max_tokens = match obj
        .get("max_completion_tokens")
        .or_else(|| obj.get("max_tokens"))
    {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Some(u32::try_from(n).unwrap_or(u32::MAX)),
            _ => return Err("`max_tokens` must be an integer ≥ 1".to_owned()),
        },
    };
    let prompt_chars = match endpoint {
        Endpoint::Chat => {
            let messages = obj
                .get("messages")
                .and_then(Value::as_array)
                .ok_or("`messages` must be an array")?;
            if messages.is_empty() {
                return Err("`messages` must not be empty".to_owned());
            }
            messages
                .iter()
                .map(|m| text_len(m.get("content").unwrap_or(&Value::Null)))
                .sum()
        }
        Endpoint::Completions => match obj.get("prompt") {
            Some(p @ (Value::String(_) | Value::Array(_))) => text_len(p),
            _ => return Err("`prompt` must be a string or an array".to_owned()),
        },
    };
    Ok(InferenceRequest {
        model,
        stream,
        include_usage,
        max_tokens,
        prompt_tokens: u32::try_from(prompt_chars.div_ceil(4).max(1)).unwrap_or(u32::MAX),
    })
}

/// Characters of text in a message content (a string, or an array of parts with `text`).
fn text_len(v: &Value) -> usize {
    match v {
        Value::String(s) => s.chars().count(),
        Value::Array(parts) => parts.iter().map(text_len).sum(),
        Value::Object(o) => o.get("text").map_or(0, text_len),
        _ => 0,
    }
}

const WORDS: &[&str] = &[
    "the",
    "pool",
    "keeps",
    "every",
    "backend",
    "busy",
    "but",
    "never",
    "flooded",
    "while",
    "clients",
    "wait",
    "their",
    "turn",
    "in",
    "a",
    "short",
    "queue",
    "and",
    "leaked",
    "connections",
    "are",
    "reclaimed",
];

/// The text of output token `i` (a word and a space).
pub(crate) fn token_text(i: u32) -> String {
    let word = WORDS[usize::try_from(i).unwrap_or(0) % WORDS.len()];
    format!("{word} ")
}

/// What every response of one request shares.
#[derive(Debug, Clone)]
pub(crate) struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    pub fn new(endpoint: Endpoint, instance: &str, seq: u64, created: u64, model: String) -> Self {
        let id = format!("{}-{instance}-{seq}", endpoint.id_prefix());
        Self {
            endpoint,
            id,
            created,
            model,
        }
    }
}

fn usage(prompt_tokens: u32, completion_tokens: u32) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": u64::from(prompt_tokens) + u64::from(completion_tokens),
    })
}

/// A complete (non-streaming) response.
pub(crate) fn completion(
    meta: &ResponseMeta,
    text: &str,
    finish_reason: &str,
    prompt_tokens: u32,
    completion_tokens: u32,
) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }),
        Endpoint::Completions => json!({
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": finish_reason,
        }),
    };
    json!({
        "id": meta.id,
        "object": match meta.endpoint { Endpoint::Chat => "chat.completion", Endpoint::Completions => "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    })
}

/// One SSE chunk carrying token `index` (`text`), or the final chunk with `finish_reason`.
pub(crate) fn chunk(
    meta: &ResponseMeta,
    index: u32,
    text: Option<&str>,
    finish_reason: Option<&str>,
) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat => {
            let delta = match (index, text) {
                (0, Some(t)) => json!({"role": "assistant", "content": t}),
                (_, Some(t)) => json!({"content": t}),
                (_, None) => json!({}),
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
        }
        Endpoint::Completions => {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish_reason})
        }
    };
    json!({
        "id": meta.id,
        "object": match meta.endpoint { Endpoint::Chat => "chat.completion.chunk", Endpoint::Completions => "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

/// The usage chunk sent before `[DONE]` when `stream_options.include_usage` is set.
pub(crate) fn usage_chunk(
    meta: &ResponseMeta,
    prompt_tokens: u32,
    completion_tokens: u32,
) -> Value {
    let mut v = chunk(meta, 1, None, None);
    v["choices"] = json!([]);
    v["usage"] = usage(prompt_tokens, completion_tokens);
    v
}

/// An SSE event carrying a JSON value.
pub(crate) fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// The SSE event that ends a stream.
pub(crate) const SSE_DONE: &str = "data: [DONE]\n\n";

/// An OpenAI-style error body.
pub(crate) fn error(message: &str, kind: &str, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// The `/v1/models` list.
pub(crate) fn models(models: &[String], created: u64) -> Value {
    let data: Vec<Value> = models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": created, "owned_by": "modelsim"}))
        .collect();
    json!({"object": "list", "data": data})
}

/// Wall-clock seconds since the Unix epoch, for the OpenAI `created` fields.
#[expect(
    clippy::disallowed_methods,
    reason = "the OpenAI `created` field is wall-clock time by definition; nothing is timed with it"
)]
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chat_requests() {
        let body =
            br#"{"model":"m","messages":[{"role":"user","content":"hello world, twenty chars"}],
                       "stream":true,"max_tokens":7,"stream_options":{"include_usage":true}}"#;
        let req = parse_request(Endpoint::Chat, body).unwrap();
        assert_eq!(
            req,
            InferenceRequest {
                model: Some("m".to_owned()),
                stream: true,
                include_usage: true,
                max_tokens: Some(7),
                prompt_tokens: 7,
            }
        );
        let parts = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"abcd"}]}],
                        "max_completion_tokens":3}"#;
        let req = parse_request(Endpoint::Chat, parts).unwrap();
        assert_eq!(
            (req.model, req.stream, req.max_tokens, req.prompt_tokens),
            (None, false, Some(3), 1)
        );
    }

    #[test]
    fn rejects_malformed_requests() {
        for (endpoint, body) in [
            (Endpoint::Chat, &b"not json"[..]),
            (Endpoint::Chat, b"[]"),
            (Endpoint::Chat, br#"{"model":"m"}"#),
            (Endpoint::Chat, br#"{"messages":[]}"#),
            (
                Endpoint::Chat,
                br#"{"messages":[{"content":"x"}],"max_tokens":0}"#,
            ),
            (
                Endpoint::Chat,
                br#"{"messages":[{"content":"x"}],"stream":"yes"}"#,
            ),
            (Endpoint::Completions, br#"{"model":"m"}"#),
        ] {
            assert!(
                parse_request(endpoint, body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(parse_request(Endpoint::Completions, br#"{"prompt":"hi"}"#).is_ok());
    }

    #[test]
    fn renders_openai_shapes() {
        let meta = ResponseMeta::new(Endpoint::Chat, "pod-1", 3, 1, "m".to_owned());
        let full = completion(&meta, "a b ", "length", 5, 2);
        assert_eq!(full["id"], "chatcmpl-pod-1-3");
        assert_eq!(full["choices"][0]["message"]["content"], "a b ");
        assert_eq!(full["usage"]["total_tokens"], 7);
        let first = chunk(&meta, 0, Some("a "), None);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert!(sse(&first).starts_with("data: {") && sse(&first).ends_with("}\n\n"));
        let last = chunk(&meta, 2, None, Some("stop"));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        let meta = ResponseMeta::new(Endpoint::Completions, "pod-1", 4, 1, "m".to_owned());
        assert_eq!(
            completion(&meta, "x", "stop", 1, 1)["choices"][0]["text"],
            "x"
        );
        assert_eq!(usage_chunk(&meta, 1, 2)["usage"]["completion_tokens"], 2);
    }
}
