//! The estimate of a call's tokens before it is sent, what a token budget admits it on: its
//! output, the most it may produce (`max_completion_tokens`, else `max_tokens`, else the
//! backend's `defaultMaxTokens`, else the budget's: [`default_output`]; times `n` choices), and
//! its prompt, the bytes of its text
//! (messages' contents, or `prompt`) divided by [`BYTES_PER_TOKEN`]. A body the gateway does not
//! hold whole (longer than the routing buffer) or cannot read as JSON is estimated from its
//! length: all of it counts as prompt.

use poolpilot_api::limits::TokenBudget;
use serde::Deserialize;
use serde_json::Value;

/// Bytes of prompt text per token, the estimate's ratio: about what the BPE tokenizers of
/// current model families give for English text (≈ 4 characters a token). Measured against
/// o200k_base and cl100k_base on sample prompts (`estimate/accuracy.rs`): English prose is
/// estimated a fifth high, code and JSON of words within a tenth or two, Chinese right for
/// o200k_base and a third low for cl100k_base, numbers (logs, tables) about half; the framing
/// of each chat message is not counted. The estimate only decides admission; settlement uses
/// the backend's count.
pub const BYTES_PER_TOKEN: u64 = 4;

/// A call's tokens as estimated before it is sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Estimate {
    /// Prompt (input) tokens.
    pub prompt: u64,
    /// The most output tokens it may produce.
    pub output: u64,
}

#[derive(Deserialize)]
struct RequestWire {
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    messages: Option<Vec<MessageWire>>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    input: Option<Value>,
}

#[derive(Deserialize)]
struct MessageWire {
    #[serde(default)]
    content: Option<Value>,
}

/// Bytes of text in a content value: a string, an array of them or of parts with `text`.
fn text_bytes(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.len() as u64,
        Value::Array(parts) => parts.iter().map(text_bytes).sum(),
        Value::Object(o) => o.get("text").map_or(0, text_bytes),
        _ => 0,
    }
}

/// The output a call that sets neither `max_completion_tokens` nor `max_tokens` is assumed to
/// produce: what its backend's model server produces then (`backend`, the backend's
/// `defaultMaxTokens`), else its client budget's `defaultMaxTokens` (`budget`), else
/// [`TokenBudget::DEFAULT_MAX_TOKENS`] (a call without a client budget: the pool queue's
/// token-fair order still charges it).
pub fn default_output(backend: Option<u64>, budget: Option<u64>) -> u64 {
    backend
        .or(budget)
        .unwrap_or(TokenBudget::DEFAULT_MAX_TOKENS)
}

/// Prompt tokens of `bytes` bytes of text: rounded up, at least 1.
pub fn prompt_tokens(bytes: u64) -> u64 {
    bytes.div_ceil(BYTES_PER_TOKEN).max(1)
}

/// The estimate of a call whose body is `body` when the gateway holds it whole, else of
/// `length` bytes (its `Content-Length`, or what was read of it), with `default_max_tokens`
/// when the request does not say.
pub fn estimate(body: Option<&[u8]>, length: u64, default_max_tokens: u64) -> Estimate {
    let parsed = body.and_then(|b| serde_json::from_slice::<RequestWire>(b).ok());
    let Some(req) = parsed else {
        return Estimate {
            prompt: prompt_tokens(length),
            output: default_max_tokens,
        };
    };
    let text = req
        .messages
        .iter()
        .flatten()
        .map(|m| m.content.as_ref().map_or(0, text_bytes))
        .sum::<u64>()
        + req.prompt.as_ref().map_or(0, text_bytes)
        + req.input.as_ref().map_or(0, text_bytes);
    let output = req
        .max_completion_tokens
        .or(req.max_tokens)
        .unwrap_or(default_max_tokens);
    Estimate {
        prompt: prompt_tokens(text),
        output: output.saturating_mul(req.n.unwrap_or(1).clamp(1, 128)),
    }
}

#[cfg(test)]
mod accuracy;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_the_most_the_call_may_produce() {
        let e = |b: &str| estimate(Some(b.as_bytes()), b.len() as u64, 256);
        let chat =
            r#"{"model":"m","messages":[{"role":"user","content":"abcdefgh"}],"max_tokens":10}"#;
        assert_eq!(
            e(chat),
            Estimate {
                prompt: 2,
                output: 10
            }
        );
        let newer = r#"{"messages":[{"content":"abcdefghi"}],"max_tokens":10,"max_completion_tokens":20,"n":2}"#;
        assert_eq!(
            e(newer),
            Estimate {
                prompt: 3,
                output: 40
            }
        );
        let parts =
            r#"{"messages":[{"content":[{"type":"text","text":"abcd"},{"type":"image_url"}]}]}"#;
        assert_eq!(
            e(parts),
            Estimate {
                prompt: 1,
                output: 256
            }
        );
        let completion = r#"{"prompt":["abcd","efgh"],"max_tokens":3}"#;
        assert_eq!(
            e(completion),
            Estimate {
                prompt: 2,
                output: 3
            }
        );
    }

    #[test]
    fn the_calls_own_field_then_the_backends_default_then_the_budgets_then_the_constant() {
        let asks = r#"{"messages":[{"content":"abcd"}],"max_tokens":10}"#;
        let silent = r#"{"messages":[{"content":"abcd"}]}"#;
        let output = |body: &str, backend, budget| {
            estimate(
                Some(body.as_bytes()),
                body.len() as u64,
                default_output(backend, budget),
            )
            .output
        };
        assert_eq!(output(asks, Some(4096), Some(256)), 10, "the call's own");
        assert_eq!(output(silent, Some(4096), Some(256)), 4096, "the backend's");
        assert_eq!(output(silent, None, Some(256)), 256, "the budget's");
        assert_eq!(
            output(silent, None, None),
            TokenBudget::DEFAULT_MAX_TOKENS,
            "the constant"
        );
        // A body that is not read is estimated with the same default.
        assert_eq!(
            estimate(None, 40, default_output(Some(77), Some(5))).output,
            77
        );
    }

    #[test]
    fn a_body_not_held_or_not_json_counts_as_prompt() {
        assert_eq!(
            estimate(None, 4000, 64),
            Estimate {
                prompt: 1000,
                output: 64
            }
        );
        assert_eq!(
            estimate(Some(b"not json"), 8, 64),
            Estimate {
                prompt: 2,
                output: 64
            }
        );
        assert_eq!(estimate(None, 0, 64).prompt, 1);
    }

    /// The ratio against modelsim's count (characters ÷ 4, what the simulated backends report):
    /// exact for ASCII text, and for UTF-8 text with multi-byte characters the estimate is
    /// higher (bytes, not characters), never lower.
    #[test]
    fn the_estimate_is_at_least_modelsims_count() {
        for text in [
            "How many connections does a pool need?",
            "größer als ein Pool",
            "連接池",
        ] {
            let body = serde_json::json!({"messages": [{"content": text}]}).to_string();
            let est = estimate(Some(body.as_bytes()), body.len() as u64, 1).prompt;
            let sim = (text.chars().count() as u64).div_ceil(4).max(1);
            assert!(est >= sim, "{text}: {est} < {sim}");
            if text.is_ascii() {
                assert_eq!(est, sim, "{text}");
            }
        }
    }
}
