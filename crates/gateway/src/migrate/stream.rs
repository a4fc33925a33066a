//! What migration reads and rewrites in an event stream, as pure functions of the bytes:
//! [`Editor`] follows one request's stream across its workers, and [`continuation`] builds
//! the request that carries it on elsewhere.
//!
//! The editor splits the worker's bytes into SSE events and, for each `data:` event:
//! - keeps the text delivered so far (a chat's `delta.content`, a completion's `text`,
//!   `/generate`'s cumulative `text`) and the completion tokens delivered (from the
//!   `usage` the worker reports with `continuous_usage_stats`, else one per content chunk);
//! - rewrites a continuation's chunks to the first worker's `id`, `created` and `model`
//!   (`/generate`: the delivered text before its cumulative `text`, and its token counts
//!   made the whole request's);
//! - strips the usage the router asked for and the client did not; the usage it keeps
//!   reports the whole request (the first prompt, every completion token);
//! - reports an error event with a 5xx code as the worker's failure (vLLM's report of an
//!   engine that died mid-stream); a 4xx one is the client's answer and passes through.

use bytes::{Bytes, BytesMut};
use serde_json::{json, Map, Value};

/// The route a stream answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
    /// SGLang's `/generate`.
    Generate,
}

impl Api {
    pub fn of(route: &str) -> Option<Api> {
        match route {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completion),
            "/generate" => Some(Api::Generate),
            _ => None,
        }
    }
}

/// The usage a client asked for (`stream_options`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageWanted {
    /// The closing usage chunk (`include_usage`).
    pub last: bool,
    /// Usage on every chunk (`continuous_usage_stats`, with `include_usage`).
    pub every: bool,
}

impl UsageWanted {
    pub fn of(body: &Value) -> Self {
        let o = &body["stream_options"];
        let last = o["include_usage"].as_bool().unwrap_or(false);
        Self {
            last,
            every: last && o["continuous_usage_stats"].as_bool().unwrap_or(false),
        }
    }
}

/// Why the worker's stream is a failure to migrate from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFailure(pub String);

/// One request's stream, across the workers it goes through.
#[derive(Debug)]
pub struct Editor {
    api: Api,
    wanted: UsageWanted,
    buf: BytesMut,
    /// The text and completion tokens the client has, before this attempt and in all.
    text_before: String,
    tokens_before: u64,
    text: String,
    tokens: u64,
    /// This attempt's count: from its usage when it reports one, else its content chunks.
    attempt_usage: Option<u64>,
    attempt_chunks: u64,
    /// The first worker's chunk identity (`id`, `created`, `model`) and prompt tokens.
    identity: Option<Map<String, Value>>,
    prompt_tokens: Option<u64>,
    /// Whether this attempt is a continuation.
    continued: bool,
    done: bool,
}

impl Editor {
    pub fn new(api: Api, wanted: UsageWanted) -> Self {
        Self {
            api,
            wanted,
            buf: BytesMut::new(),
            text_before: String::new(),
            tokens_before: 0,
            text: String::new(),
            tokens: 0,
            attempt_usage: None,
            attempt_chunks: 0,
            identity: None,
            prompt_tokens: None,
            continued: false,
            done: false,
        }
    }

    /// The text the client has been sent.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The completion tokens the client has been sent.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Whether the stream ended with `[DONE]`.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The next attempt continues the stream: what was delivered stays, partial events of
    /// the failed attempt are dropped.
    pub fn continue_elsewhere(&mut self) {
        self.buf.clear();
        self.text_before = self.text.clone();
        self.tokens_before = self.tokens;
        self.attempt_usage = None;
        self.attempt_chunks = 0;
        self.continued = true;
    }

    /// Feeds the worker's bytes; appends to `out` what the client is sent. An error event
    /// of the worker's failure stops the feed (what came before it is in `out`).
    pub fn feed(&mut self, bytes: &[u8], out: &mut BytesMut) -> Result<(), EngineFailure> {
        self.buf.extend_from_slice(bytes);
        while let Some(end) = find_event_end(&self.buf) {
            let event = self.buf.split_to(end.0 + end.1).freeze();
            self.event(&event[..end.0], &event, out)?;
        }
        Ok(())
    }

    fn event(&mut self, text: &[u8], raw: &Bytes, out: &mut BytesMut) -> Result<(), EngineFailure> {
        let Ok(text) = std::str::from_utf8(text) else {
            out.extend_from_slice(raw);
            return Ok(());
        };
        let mut data = String::new();
        let mut other = false;
        for line in text.lines() {
            match line.strip_prefix("data:") {
                Some(d) => {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(d.strip_prefix(' ').unwrap_or(d));
                }
                None => other |= !line.is_empty(),
            }
        }
        if other || data.is_empty() {
            out.extend_from_slice(raw);
            return Ok(());
        }
        if data.trim() == "[DONE]" {
            self.done = true;
            out.extend_from_slice(raw);
            return Ok(());
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(&data) else {
            out.extend_from_slice(raw);
            return Ok(());
        };
        if let Some(error) = chunk.get("error") {
            if server_error(error) {
                let message = error["message"]
                    .as_str()
                    .unwrap_or("engine error")
                    .to_owned();
                return Err(EngineFailure(message));
            }
            out.extend_from_slice(raw);
            return Ok(());
        }
        if self.edit(&mut chunk) {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(Value::Object(chunk).to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        Ok(())
    }

    /// Accounts for one chunk and rewrites it; `false` drops it.
    fn edit(&mut self, chunk: &mut Map<String, Value>) -> bool {
        // Identity: the first worker's, on every chunk of the request.
        match &self.identity {
            None => {
                let mut id = Map::new();
                for k in ["id", "created", "model"] {
                    if let Some(v) = chunk.get(k) {
                        id.insert(k.to_owned(), v.clone());
                    }
                }
                self.identity = Some(id);
            }
            Some(id) if self.continued => {
                for (k, v) in id {
                    chunk.insert(k.clone(), v.clone());
                }
            }
            Some(_) => {}
        }
        let content_chunk = match self.api {
            Api::Chat => {
                let delta = chunk_choice(chunk).and_then(|c| c["delta"]["content"].as_str());
                delta
                    .inspect(|t| self.text.push_str(t))
                    .is_some_and(|t| !t.is_empty())
            }
            Api::Completion => {
                let text = chunk_choice(chunk).and_then(|c| c["text"].as_str());
                text.inspect(|t| self.text.push_str(t))
                    .is_some_and(|t| !t.is_empty())
            }
            Api::Generate => return self.edit_generate(chunk),
        };
        if content_chunk {
            self.attempt_chunks += 1;
        }
        let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) else {
            self.tokens = self.tokens_before + self.attempt_chunks;
            return true;
        };
        if let Some(n) = usage["completion_tokens"].as_u64() {
            self.attempt_usage = Some(n);
        }
        if self.prompt_tokens.is_none() {
            self.prompt_tokens = usage["prompt_tokens"].as_u64();
        }
        self.tokens = self.tokens_before + self.attempt_usage.unwrap_or(self.attempt_chunks);
        let closing = chunk
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty);
        let keep = if closing {
            self.wanted.last
        } else {
            self.wanted.every
        };
        if !keep {
            chunk.remove("usage");
            return !closing;
        }
        let whole = self.whole_usage(usage);
        chunk.insert("usage".into(), whole);
        true
    }

    /// The usage of the whole request: the first prompt, every completion token.
    fn whole_usage(&self, usage: &Value) -> Value {
        let mut whole = usage.clone();
        let prompt = self
            .prompt_tokens
            .or(usage["prompt_tokens"].as_u64())
            .unwrap_or(0);
        whole["prompt_tokens"] = json!(prompt);
        whole["completion_tokens"] = json!(self.tokens);
        whole["total_tokens"] = json!(prompt + self.tokens);
        whole
    }

    fn edit_generate(&mut self, chunk: &mut Map<String, Value>) -> bool {
        if let Some(text) = chunk.get("text").and_then(Value::as_str) {
            let whole = format!("{}{text}", self.text_before);
            self.text.clone_from(&whole);
            if self.continued {
                chunk.insert("text".into(), Value::String(whole));
            }
        }
        if let Some(meta) = chunk.get_mut("meta_info").and_then(Value::as_object_mut) {
            if let Some(n) = meta.get("completion_tokens").and_then(Value::as_u64) {
                self.attempt_usage = Some(n);
                self.tokens = self.tokens_before + n;
                meta.insert("completion_tokens".into(), json!(self.tokens));
            }
            match self.prompt_tokens {
                None => self.prompt_tokens = meta.get("prompt_tokens").and_then(Value::as_u64),
                Some(p) => {
                    meta.insert("prompt_tokens".into(), json!(p));
                }
            }
        }
        true
    }
}

fn chunk_choice(chunk: &Map<String, Value>) -> Option<&Value> {
    chunk.get("choices")?.as_array()?.first()
}

/// An error event's code is a server error: a number (or digits) of 500 or more, or a
/// 5xx-class type.
fn server_error(error: &Value) -> bool {
    let code = match &error["code"] {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    };
    match code {
        Some(c) => c >= 500,
        None => matches!(
            error["type"].as_str(),
            Some("InternalServerError" | "server_error" | "ServiceUnavailableError")
        ),
    }
}

/// The end of the first complete SSE event in `buf`: (its length, its separator's).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Why a request cannot be carried on elsewhere.
pub fn unmigratable(api: Api, body: &Value) -> Option<&'static str> {
    let n = body["n"].as_u64().unwrap_or(1);
    if n > 1 || body["best_of"].as_u64().is_some_and(|b| b > 1) {
        return Some("n > 1");
    }
    let logprobs = match api {
        Api::Chat => {
            body["logprobs"].as_bool().unwrap_or(false) || body["top_logprobs"].is_number()
        }
        Api::Completion => !body["logprobs"].is_null(),
        Api::Generate => body["return_logprob"].as_bool().unwrap_or(false),
    };
    if logprobs {
        return Some("logprobs requested");
    }
    let text_prompt = match api {
        Api::Chat => body["messages"].is_array(),
        Api::Completion => body["prompt"].is_string(),
        Api::Generate => body["text"].is_string(),
    };
    if !text_prompt {
        return Some("the prompt is not text");
    }
    None
}

/// The request that carries `original` on after `text` (and `tokens` tokens) were delivered:
/// a chat with the text as a final assistant message continued (vLLM's
/// `continue_final_message`), a completion or `/generate` with it after the prompt; the token
/// budgets less what was delivered. `None` when nothing is left to generate.
pub fn continuation(api: Api, original: &Value, text: &str, tokens: u64) -> Option<Value> {
    let mut body = original.clone();
    let less = |v: &mut Value| -> bool {
        match v.as_u64() {
            Some(n) if n <= tokens => {
                *v = json!(0);
                false
            }
            Some(n) => {
                *v = json!(n - tokens);
                true
            }
            None => true,
        }
    };
    match api {
        Api::Chat => {
            let continuing = body["continue_final_message"].as_bool().unwrap_or(false);
            let messages = body["messages"].as_array_mut()?;
            let last_open = continuing
                && messages
                    .last()
                    .is_some_and(|m| m["role"] == "assistant" && m["content"].is_string());
            if last_open {
                let last = messages.last_mut()?;
                let so_far = format!("{}{text}", last["content"].as_str().unwrap_or(""));
                last["content"] = Value::String(so_far);
            } else {
                messages.push(json!({"role": "assistant", "content": text}));
            }
            body["continue_final_message"] = json!(true);
            body["add_generation_prompt"] = json!(false);
            let mut left = true;
            for k in ["max_tokens", "max_completion_tokens"] {
                if let Some(v) = body.get_mut(k) {
                    left &= less(v);
                }
            }
            if let Some(v) = body.get_mut("min_tokens") {
                less(v);
            }
            left.then_some(body)
        }
        Api::Completion => {
            let prompt = format!("{}{text}", body["prompt"].as_str()?);
            body["prompt"] = Value::String(prompt);
            let left = body.get_mut("max_tokens").is_none_or(less);
            if let Some(v) = body.get_mut("min_tokens") {
                less(v);
            }
            left.then_some(body)
        }
        Api::Generate => {
            let prompt = format!("{}{text}", body["text"].as_str()?);
            body["text"] = Value::String(prompt);
            let params = &mut body["sampling_params"];
            let left = params.get_mut("max_new_tokens").is_none_or(less);
            if let Some(v) = params.get_mut("min_new_tokens") {
                less(v);
            }
            left.then_some(body)
        }
    }
}

/// The request as sent to a worker: with `stream_options` asking for usage on every chunk
/// (chat and completions), so the tokens delivered are counted as the engine counts them.
pub fn with_usage_stats(api: Api, body: &Value) -> Value {
    let mut body = body.clone();
    if api != Api::Generate {
        body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    }
    body
}
