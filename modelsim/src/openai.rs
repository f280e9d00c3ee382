//! The OpenAI wire format as modelsim speaks it: parsing `/v1/chat/completions` and
//! `/v1/completions` requests, and rendering complete responses, SSE chunks and errors.

use serde_json::{Value, json};

use super::prefix_cache::BlockHasher;

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
    /// The chained hashes of the prompt's full blocks ([`super::prefix_cache`]).
    pub prompt_blocks: Vec<u64>,
}

/// Parses a request body, a request without `model` being to `default_model`; the error is a
/// message for a 400 answer.
pub(crate) fn parse_request(
    endpoint: Endpoint,
    body: &[u8],
    default_model: &str,
) -> Result<InferenceRequest, String> {
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
    let mut blocks = BlockHasher::new(model.as_deref().unwrap_or(default_model));
    let mut prompt_chars = 0usize;
    let mut read = |blocks: &mut BlockHasher, v: &Value| {
        visit_text(v, &mut |t| {
            prompt_chars += t.chars().count();
            blocks.text(t);
        });
    };
    match endpoint {
        Endpoint::Chat => {
            let messages = obj
                .get("messages")
                .and_then(Value::as_array)
                .ok_or("`messages` must be an array")?;
            if messages.is_empty() {
                return Err("`messages` must not be empty".to_owned());
            }
            for m in messages {
                blocks.start(Some(m.get("role").and_then(Value::as_str).unwrap_or("")));
                read(&mut blocks, m.get("content").unwrap_or(&Value::Null));
            }
        }
        Endpoint::Completions => match obj.get("prompt") {
            Some(p @ (Value::String(_) | Value::Array(_))) => {
                blocks.start(None);
                read(&mut blocks, p);
            }
            _ => return Err("`prompt` must be a string or an array".to_owned()),
        },
    }
    Ok(InferenceRequest {
        model,
        stream,
        include_usage,
        max_tokens,
        prompt_tokens: u32::try_from(prompt_chars.div_ceil(4).max(1)).unwrap_or(u32::MAX),
        prompt_blocks: blocks.finish(),
    })
}

/// Calls `f` with each text of a message content, in order (a string, or an array of them or
/// of parts with `text`).
fn visit_text(v: &Value, f: &mut impl FnMut(&str)) {
    match v {
        Value::String(s) => f(s),
        Value::Array(parts) => parts.iter().for_each(|p| visit_text(p, f)),
        Value::Object(o) => {
            if let Some(text) = o.get("text") {
                visit_text(text, f);
            }
        }
        _ => {}
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

/// A call's token counts: prompt tokens, of them those served from the prefix cache, and
/// completion tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tokens {
    pub prompt: u32,
    pub cached: u32,
    pub completion: u32,
}

/// `usage` as vLLM writes it with `--enable-prompt-tokens-details`: `prompt_tokens_details`
/// (`cached_tokens`) only when some prompt tokens came from its prefix cache, absent otherwise
/// (OpenAI's API sends it always, `cached_tokens: 0` included; readers take both).
fn usage(tokens: Tokens) -> Value {
    let mut usage = json!({
        "prompt_tokens": tokens.prompt,
        "completion_tokens": tokens.completion,
        "total_tokens": u64::from(tokens.prompt) + u64::from(tokens.completion),
    });
    if tokens.cached > 0 {
        usage["prompt_tokens_details"] = json!({"cached_tokens": tokens.cached});
    }
    usage
}

/// A complete (non-streaming) response.
pub(crate) fn completion(
    meta: &ResponseMeta,
    text: &str,
    finish_reason: &str,
    tokens: Tokens,
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
        "usage": usage(tokens),
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
pub(crate) fn usage_chunk(meta: &ResponseMeta, tokens: Tokens) -> Value {
    let mut v = chunk(meta, 1, None, None);
    v["choices"] = json!([]);
    v["usage"] = usage(tokens);
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
        let req = parse_request(Endpoint::Chat, body, "m").unwrap();
        assert_eq!(
            req,
            InferenceRequest {
                model: Some("m".to_owned()),
                stream: true,
                include_usage: true,
                max_tokens: Some(7),
                prompt_tokens: 7,
                prompt_blocks: Vec::new(),
            }
        );
        let parts = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"abcd"}]}],
                        "max_completion_tokens":3}"#;
        let req = parse_request(Endpoint::Chat, parts, "m").unwrap();
        assert_eq!(
            (req.model, req.stream, req.max_tokens, req.prompt_tokens),
            (None, false, Some(3), 1)
        );
    }

    #[test]
    fn a_prompt_is_hashed_in_blocks_of_its_text_as_counted() {
        // 130 characters over two messages: 33 tokens, two full blocks of 64 characters.
        let body = serde_json::json!({"messages": [
            {"role": "system", "content": "s".repeat(100)},
            {"role": "user", "content": [{"type": "text", "text": "u".repeat(30)}]},
        ]})
        .to_string();
        let req = parse_request(Endpoint::Chat, body.as_bytes(), "m").unwrap();
        assert_eq!((req.prompt_tokens, req.prompt_blocks.len()), (33, 2));
        // Without a model, the default model's name is hashed: the same blocks.
        let named = body.replacen('{', r#"{"model":"m","#, 1);
        let named = parse_request(Endpoint::Chat, named.as_bytes(), "other").unwrap();
        assert_eq!(named.prompt_blocks, req.prompt_blocks);
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
                parse_request(endpoint, body, "m").is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(parse_request(Endpoint::Completions, br#"{"prompt":"hi"}"#, "m").is_ok());
    }

    #[test]
    fn renders_openai_shapes() {
        let meta = ResponseMeta::new(Endpoint::Chat, "pod-1", 3, 1, "m".to_owned());
        let tokens = |prompt, cached, completion| Tokens {
            prompt,
            cached,
            completion,
        };
        let full = completion(&meta, "a b ", "length", tokens(5, 0, 2));
        assert_eq!(full["id"], "chatcmpl-pod-1-3");
        assert_eq!(
            full["usage"].get("prompt_tokens_details"),
            None,
            "no cached tokens: absent, as vLLM sends it"
        );
        let cached = completion(&meta, "a b ", "length", tokens(40, 32, 2));
        assert_eq!(
            cached["usage"]["prompt_tokens_details"]["cached_tokens"],
            32
        );
        assert_eq!(cached["usage"]["prompt_tokens"], 40);
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
            completion(&meta, "x", "stop", tokens(1, 0, 1))["choices"][0]["text"],
            "x"
        );
        assert_eq!(
            usage_chunk(&meta, tokens(1, 0, 2))["usage"]["completion_tokens"],
            2
        );
        assert_eq!(
            usage_chunk(&meta, tokens(20, 16, 2))["usage"]["prompt_tokens_details"]["cached_tokens"],
            16
        );
    }
}
