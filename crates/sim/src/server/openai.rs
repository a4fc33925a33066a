//! vLLM's OpenAI-compatible request and response bodies, as far as the simulator needs.
//!
//! Differences from vLLM, on purpose: a request produces exactly `max_tokens` tokens (16
//! when absent, for chats too: vLLM's chat default is the rest of the context), and a
//! stream without `stream_options` ends with a usage chunk (vLLM sends it only with
//! `stream_options.include_usage`), so clients always see
//! `usage.prompt_tokens_details.cached_tokens`. Given `stream_options`, the sim reads them as
//! vLLM does (see [`StreamUsage`]).

use axum::http::StatusCode;
use kvroute_tokenizer::ChatFields;
use serde::Deserialize;
use serde_json::{json, Value};

use super::pd::DisaggFields;

pub const DEFAULT_MAX_TOKENS: usize = 16;

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Value,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// vLLM's `priority` (lower first), under `--scheduling-policy priority`.
    #[serde(default)]
    pub priority: i64,
    #[serde(flatten)]
    pub disagg: DisaggFields,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// The messages and the options that shape the prompt (`add_generation_prompt`,
    /// `continue_final_message`, `chat_template_kwargs`, `tools`, ...), read as the router
    /// reads them.
    #[serde(flatten)]
    pub prompt: ChatFields,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// vLLM's `priority` (lower first), under `--scheduling-policy priority`.
    #[serde(default)]
    pub priority: i64,
    #[serde(flatten)]
    pub disagg: DisaggFields,
}

/// vLLM's `stream_options`; inside it `include_usage` defaults to true.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// Which chunks of a stream carry a `usage` object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamUsage {
    /// None (`include_usage: false`).
    None,
    /// A closing chunk with no choices and the whole usage, before `[DONE]` (the sim's
    /// default, and `include_usage`).
    Final,
    /// That closing chunk, and every chunk before it with the usage so far: the prompt's
    /// tokens and the completion tokens sent up to and including that chunk (0 in a chat's
    /// role chunk) (`continuous_usage_stats`, which vLLM honours only with `include_usage`).
    Continuous,
}

impl StreamUsage {
    /// vLLM's reading of `stream_options`, except that without them the sim still closes
    /// the stream with a usage chunk.
    pub fn of(options: Option<&StreamOptions>) -> Self {
        let Some(options) = options else {
            return Self::Final;
        };
        match (
            options.include_usage.unwrap_or(true),
            options.continuous_usage_stats.unwrap_or(false),
        ) {
            (false, _) => Self::None,
            (true, false) => Self::Final,
            (true, true) => Self::Continuous,
        }
    }
}

/// Which API a request came through: it decides the shape of every answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completion,
    Chat,
    /// Anthropic's Messages API: its bodies and its stream's events.
    Messages,
}

/// What the answers of one request share.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub api: Api,
    /// The replica's `--instance-id`.
    pub fingerprint: String,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompt_tokens: usize,
}

pub fn usage(meta: &ResponseMeta, completion_tokens: usize, cached_tokens: usize) -> Value {
    if meta.api == Api::Messages {
        return json!({
            "input_tokens": meta.prompt_tokens - cached_tokens.min(meta.prompt_tokens),
            "cache_read_input_tokens": cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": completion_tokens,
        });
    }
    json!({
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": meta.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// The whole answer of a non-streaming request.
pub fn full_response(
    meta: &ResponseMeta,
    text: &str,
    completion_tokens: usize,
    cached_tokens: usize,
) -> Value {
    let choice = match meta.api {
        Api::Messages => {
            return json!({
                "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": "max_tokens", "stop_sequence": null,
                "usage": usage(meta, completion_tokens, cached_tokens),
            })
        }
        Api::Completion => json!({
            "index": 0, "text": text, "logprobs": null,
            "finish_reason": "length", "stop_reason": null,
        }),
        Api::Chat => json!({
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": null, "finish_reason": "length", "stop_reason": null,
        }),
    };
    json!({
        "id": meta.id,
        "object": match meta.api { Api::Completion => "text_completion", Api::Chat | Api::Messages => "chat.completion" },
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": [choice],
        "usage": usage(meta, completion_tokens, cached_tokens),
    })
}

fn chunk_object(api: Api) -> &'static str {
    match api {
        Api::Completion => "text_completion",
        Api::Chat | Api::Messages => "chat.completion.chunk",
    }
}

/// One SSE event: `data: {json}\n\n`.
pub fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// The chat stream's opening chunk (the assistant role).
pub fn role_chunk(meta: &ResponseMeta) -> Value {
    json!({
        "id": meta.id, "object": chunk_object(meta.api), "created": meta.created, "model": meta.model,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
    })
}

/// The usage a chunk carries with `continuous_usage_stats`: counts only, as vLLM writes it.
pub fn running_usage(meta: &ResponseMeta, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": meta.prompt_tokens + completion_tokens,
    })
}

/// An Anthropic stream event: `event: <type>`, then its data.
pub fn event(value: &Value) -> String {
    format!(
        "event: {}\ndata: {value}\n\n",
        value["type"].as_str().unwrap_or("")
    )
}

/// A Messages stream's opening events: the message (its input usage known once the engine
/// took the request), its text block, a ping.
pub fn messages_prelude(meta: &ResponseMeta, cached_tokens: usize) -> String {
    let mut message = full_response(meta, "", 0, cached_tokens);
    message["content"] = json!([]);
    message["stop_reason"] = Value::Null;
    let mut out = event(&json!({"type": "message_start", "message": message}));
    out.push_str(&event(&json!({
        "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""},
    })));
    out.push_str(&event(&json!({"type": "ping"})));
    out
}

/// A Messages stream's closing events, with its usage (`output_tokens` cumulative).
pub fn messages_end(meta: &ResponseMeta, completion_tokens: usize, cached_tokens: usize) -> String {
    let mut out = event(&json!({"type": "content_block_stop", "index": 0}));
    out.push_str(&event(&json!({
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
        "usage": usage(meta, completion_tokens, cached_tokens),
    })));
    out.push_str(&event(&json!({"type": "message_stop"})));
    out
}

/// A token's chunk.
pub fn token_chunk(meta: &ResponseMeta, text: &str, finished: bool) -> Value {
    if meta.api == Api::Messages {
        return json!({
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text},
        });
    }
    let finish = if finished {
        json!("length")
    } else {
        Value::Null
    };
    let choice = match meta.api {
        Api::Completion => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null})
        }
        Api::Chat | Api::Messages => {
            json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish, "stop_reason": null})
        }
    };
    json!({
        "id": meta.id, "object": chunk_object(meta.api), "created": meta.created, "model": meta.model,
        "choices": [choice],
    })
}

/// The stream's closing usage chunk.
pub fn usage_chunk(meta: &ResponseMeta, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "id": meta.id, "object": chunk_object(meta.api), "created": meta.created, "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": [], "usage": usage(meta, completion_tokens, cached_tokens),
    })
}

/// The OpenAI error type of a status, as the OpenAI clients name their exceptions.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "BadRequestError",
        401 => "AuthenticationError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        409 => "ConflictError",
        422 => "UnprocessableEntityError",
        429 => "RateLimitError",
        503 => "ServiceUnavailableError",
        s if s >= 500 => "InternalServerError",
        _ => "BadRequestError",
    }
}

/// vLLM's error body.
pub fn error_body(status: u16, kind: &str, message: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}})
}

/// A token chunk's SSE text around the token's JSON string, computed once per request so a
/// token costs one string escape and two copies.
#[derive(Debug, Clone)]
pub struct ChunkTemplate {
    prefix: String,
    suffix: String,
    final_suffix: String,
}

impl ChunkTemplate {
    pub fn new(meta: &ResponseMeta) -> Self {
        const MARK: &str = "\u{1}kvroute-token\u{1}";
        let quoted = serde_json::to_string(MARK).expect("a string serialises");
        let split = |finished| {
            let chunk = token_chunk(meta, MARK, finished);
            let text = match meta.api {
                Api::Messages => event(&chunk),
                _ => sse(&chunk),
            };
            let at = text.find(&quoted).expect("the mark is in the chunk");
            (text[..at].to_owned(), text[at + quoted.len()..].to_owned())
        };
        let (prefix, suffix) = split(false);
        let (_, final_suffix) = split(true);
        Self {
            prefix,
            suffix,
            final_suffix,
        }
    }

    /// Appends the SSE event of one token to `out`; with `usage`, the chunk carries it
    /// (see [`running_usage`]).
    pub fn push(&self, out: &mut String, text: &str, finished: bool, usage: Option<&Value>) {
        out.push_str(&self.prefix);
        out.push_str(&serde_json::to_string(text).expect("a string serialises"));
        let suffix = if finished {
            &self.final_suffix
        } else {
            &self.suffix
        };
        match usage {
            None => out.push_str(suffix),
            Some(usage) => {
                // The suffix closes the chunk's object with `}\n\n`: the usage goes before.
                let open = suffix.trim_end().strip_suffix('}').expect("a JSON object");
                out.push_str(open);
                out.push_str(",\"usage\":");
                out.push_str(&usage.to_string());
                out.push_str("}\n\n");
            }
        }
    }
}
