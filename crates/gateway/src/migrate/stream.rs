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

/// What becomes of one chunk.
enum Edit {
    /// Sent as the worker wrote it.
    Keep,
    /// Sent rewritten.
    Changed,
    /// Not sent.
    Drop,
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
        match self.edit(&mut chunk) {
            Edit::Keep => out.extend_from_slice(raw),
            Edit::Changed => {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(Value::Object(chunk).to_string().as_bytes());
                out.extend_from_slice(b"\n\n");
            }
            Edit::Drop => {}
        }
        Ok(())
    }

    /// Accounts for one chunk and rewrites it.
    fn edit(&mut self, chunk: &mut Map<String, Value>) -> Edit {
        let mut changed = false;
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
                changed = true;
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
        let keep = if changed { Edit::Changed } else { Edit::Keep };
        let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) else {
            self.tokens = self.tokens_before + self.attempt_chunks;
            return keep;
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
        let wanted = if closing {
            self.wanted.last
        } else {
            self.wanted.every
        };
        if !wanted {
            if closing {
                return Edit::Drop;
            }
            chunk.remove("usage");
            return Edit::Changed;
        }
        if !self.continued {
            // One worker so far: its usage is the request's.
            return keep;
        }
        let whole = self.whole_usage(usage);
        chunk.insert("usage".into(), whole);
        Edit::Changed
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

    fn edit_generate(&mut self, chunk: &mut Map<String, Value>) -> Edit {
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
        if self.continued {
            Edit::Changed
        } else {
            Edit::Keep
        }
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

/// The request as sent to a worker, and the usage its client asked for: with
/// `stream_options` asking for usage on every chunk (chat and completions), so the tokens
/// delivered are counted as the engine counts them.
///
/// This is on the path of every stream, so the body is not parsed: `stream_options` is added
/// after the object's last member (a body that has its own is parsed and the key replaced,
/// since a repeated key is an error for some parsers).
pub fn with_usage_stats(api: Api, body: &Bytes) -> (Bytes, UsageWanted) {
    const ASK: &str = r#""stream_options":{"include_usage":true,"continuous_usage_stats":true}"#;
    if api == Api::Generate {
        return (body.clone(), UsageWanted::default());
    }
    let has_own = body.windows(16).any(|w| w == b"\"stream_options\"");
    let trimmed = body.trim_ascii_end();
    match (has_own, trimmed.strip_suffix(b"}")) {
        (false, Some(head)) if trimmed.trim_ascii_start().starts_with(b"{") => {
            let empty = head.trim_ascii() == b"{";
            let mut out = Vec::with_capacity(body.len() + ASK.len() + 2);
            out.extend_from_slice(head);
            if !empty {
                out.push(b',');
            }
            out.extend_from_slice(ASK.as_bytes());
            out.push(b'}');
            (Bytes::from(out), UsageWanted::default())
        }
        _ => match serde_json::from_slice::<Value>(body) {
            Ok(mut v) if v.is_object() => {
                let wanted = UsageWanted::of(&v);
                v["stream_options"] =
                    json!({"include_usage": true, "continuous_usage_stats": true});
                (Bytes::from(v.to_string()), wanted)
            }
            // Not an object: sent as it came (the engine will say what is wrong).
            _ => (body.clone(), UsageWanted::default()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: &str, text: &str, usage: Option<(u64, u64)>) -> String {
        let mut v = json!({"id": id, "created": 7, "model": "m", "object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
        if let Some((p, c)) = usage {
            v["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
        }
        format!("data: {v}\n\n")
    }

    fn events(out: &BytesMut) -> Vec<Value> {
        std::str::from_utf8(out)
            .unwrap()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    #[test]
    fn a_stream_is_followed_across_a_cut_event_and_its_usage_stripped() {
        let mut e = Editor::new(Api::Chat, UsageWanted::default());
        let mut out = BytesMut::new();
        let first = chunk("a", "Hel", Some((10, 1)));
        // Cut in the middle of the second event: only the first is complete.
        let second = chunk("a", "lo", Some((10, 2)));
        let (head, tail) = second.split_at(9);
        e.feed(format!("{first}{head}").as_bytes(), &mut out)
            .unwrap();
        assert_eq!(e.text(), "Hel");
        e.feed(tail.as_bytes(), &mut out).unwrap();
        assert_eq!((e.text(), e.tokens()), ("Hello", 2));
        let sent = events(&out);
        assert_eq!(sent.len(), 2);
        assert!(sent.iter().all(|c| c.get("usage").is_none()), "{sent:?}");
        // The closing usage chunk is the router's, not the client's: dropped.
        let closing = json!({"id": "a", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2}});
        let mut out = BytesMut::new();
        e.feed(
            format!("data: {closing}\n\ndata: [DONE]\n\n").as_bytes(),
            &mut out,
        )
        .unwrap();
        assert_eq!(std::str::from_utf8(&out).unwrap(), "data: [DONE]\n\n");
        assert!(e.is_done());
    }

    #[test]
    fn a_continuation_takes_the_first_identity_and_the_usage_is_the_whole_requests() {
        let wanted = UsageWanted {
            last: true,
            every: false,
        };
        let mut e = Editor::new(Api::Chat, wanted);
        let mut out = BytesMut::new();
        e.feed(chunk("first", "ab", Some((10, 1))).as_bytes(), &mut out)
            .unwrap();
        e.continue_elsewhere();
        let mut out = BytesMut::new();
        let mut second = json!({"id": "second", "created": 9, "model": "m2",
                                "choices": [{"index": 0, "delta": {"content": "cd"}}],
                                "usage": {"prompt_tokens": 12, "completion_tokens": 1}});
        e.feed(format!("data: {second}\n\n").as_bytes(), &mut out)
            .unwrap();
        second = json!({"id": "second", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1}});
        e.feed(format!("data: {second}\n\n").as_bytes(), &mut out)
            .unwrap();
        let sent = events(&out);
        assert_eq!(
            (sent[0]["id"].as_str(), sent[0]["created"].as_u64()),
            (Some("first"), Some(7))
        );
        assert_eq!(sent[0]["model"], "m");
        assert!(sent[0].get("usage").is_none());
        assert_eq!(sent[1]["usage"]["prompt_tokens"], 10, "the first prompt");
        assert_eq!(sent[1]["usage"]["completion_tokens"], 2, "every token");
        assert_eq!(sent[1]["usage"]["total_tokens"], 12);
        assert_eq!(e.text(), "abcd");
    }

    #[test]
    fn a_5xx_error_event_is_a_failure_and_a_4xx_one_is_passed_through() {
        let mut e = Editor::new(Api::Completion, UsageWanted::default());
        let mut out = BytesMut::new();
        let bad_request =
            json!({"error": {"message": "too long", "type": "BadRequestError", "code": 400}});
        e.feed(format!("data: {bad_request}\n\n").as_bytes(), &mut out)
            .unwrap();
        assert_eq!(events(&out)[0]["error"]["code"], 400);
        let died = json!({"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}});
        let failure = e.feed(
            format!("data: {died}\n\ndata: [DONE]\n\n").as_bytes(),
            &mut out,
        );
        assert_eq!(failure, Err(EngineFailure("engine dead".into())));
        assert!(!e.is_done());
    }

    #[test]
    fn without_usage_the_tokens_are_the_content_chunks() {
        let mut e = Editor::new(Api::Completion, UsageWanted::default());
        let mut out = BytesMut::new();
        for t in ["a", "", "b", "c"] {
            let c = json!({"id": "x", "choices": [{"index": 0, "text": t}]});
            e.feed(format!("data: {c}\r\n\r\n").as_bytes(), &mut out)
                .unwrap();
        }
        assert_eq!((e.text(), e.tokens()), ("abc", 3));
    }

    #[test]
    fn generate_streams_keep_their_cumulative_text_and_counts_across_the_cut() {
        let mut e = Editor::new(Api::Generate, UsageWanted::default());
        let mut out = BytesMut::new();
        let c = json!({"text": "ab", "meta_info": {"prompt_tokens": 5, "completion_tokens": 2}});
        e.feed(format!("data: {c}\n\n").as_bytes(), &mut out)
            .unwrap();
        e.continue_elsewhere();
        let mut out = BytesMut::new();
        let c = json!({"text": "c", "meta_info": {"prompt_tokens": 7, "completion_tokens": 1}});
        e.feed(format!("data: {c}\n\n").as_bytes(), &mut out)
            .unwrap();
        let sent = events(&out);
        assert_eq!(sent[0]["text"], "abc");
        assert_eq!(sent[0]["meta_info"]["completion_tokens"], 3);
        assert_eq!(sent[0]["meta_info"]["prompt_tokens"], 5);
        assert_eq!(e.tokens(), 3);
    }

    #[test]
    fn continuations_carry_the_text_and_what_is_left_of_the_budget() {
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 10, "min_tokens": 2, "stream": true, "temperature": 0.5});
        let next = continuation(Api::Chat, &chat, "Hello", 3).unwrap();
        assert_eq!(
            next["messages"][1],
            json!({"role": "assistant", "content": "Hello"})
        );
        assert_eq!(
            (
                next["continue_final_message"].as_bool(),
                next["add_generation_prompt"].as_bool()
            ),
            (Some(true), Some(false))
        );
        assert_eq!(
            (next["max_tokens"].as_u64(), next["min_tokens"].as_u64()),
            (Some(7), Some(0))
        );
        assert_eq!(next["temperature"], 0.5);
        // A second cut extends the same open message.
        let again = continuation(Api::Chat, &next, " world", 2).unwrap();
        assert_eq!(again["messages"].as_array().unwrap().len(), 2);
        assert_eq!(again["messages"][1]["content"], "Hello world");
        assert_eq!(again["max_tokens"], 5);
        // Nothing left: no continuation.
        assert!(continuation(Api::Chat, &chat, "x", 10).is_none());
        let completion = json!({"prompt": "Once", "max_tokens": 4});
        let next = continuation(Api::Completion, &completion, " upon", 1).unwrap();
        assert_eq!(
            (next["prompt"].as_str(), next["max_tokens"].as_u64()),
            (Some("Once upon"), Some(3))
        );
        let generate = json!({"text": "Once", "sampling_params": {"max_new_tokens": 4}});
        let next = continuation(Api::Generate, &generate, " upon", 1).unwrap();
        assert_eq!(next["text"], "Once upon");
        assert_eq!(next["sampling_params"]["max_new_tokens"], 3);
    }

    #[test]
    fn usage_is_asked_for_without_parsing_unless_the_client_set_its_own() {
        let asked = |body: &str| {
            let (sent, wanted) = with_usage_stats(Api::Chat, &Bytes::from(body.to_owned()));
            (serde_json::from_slice::<Value>(&sent).unwrap(), wanted)
        };
        let every = json!({"include_usage": true, "continuous_usage_stats": true});
        let (v, wanted) = asked("{\"model\": \"m\", \"stream\": true}\n");
        assert_eq!(
            (v["stream_options"].clone(), v["model"].clone()),
            (every.clone(), json!("m"))
        );
        assert_eq!(wanted, UsageWanted::default());
        assert_eq!(asked("{ }").0, json!({"stream_options": every}));
        // The client's own stream_options: replaced, and what it asked for remembered.
        let (v, wanted) = asked(r#"{"stream_options": {"include_usage": true}}"#);
        assert_eq!(v["stream_options"], every);
        assert_eq!(
            wanted,
            UsageWanted {
                last: true,
                every: false
            }
        );
        // /generate has no stream_options.
        let raw = Bytes::from_static(b"{\"text\": \"x\"}");
        assert_eq!(with_usage_stats(Api::Generate, &raw).0, raw);
    }

    #[test]
    fn what_cannot_migrate_says_why() {
        let chat = |extra: Value| {
            let mut v = json!({"messages": [{"role": "user", "content": "hi"}]});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            v
        };
        assert_eq!(unmigratable(Api::Chat, &chat(json!({}))), None);
        assert_eq!(
            unmigratable(Api::Chat, &chat(json!({"n": 2}))),
            Some("n > 1")
        );
        assert_eq!(
            unmigratable(Api::Chat, &chat(json!({"logprobs": true}))),
            Some("logprobs requested")
        );
        assert_eq!(
            unmigratable(Api::Completion, &json!({"prompt": [1, 2]})),
            Some("the prompt is not text")
        );
        assert_eq!(
            unmigratable(Api::Completion, &json!({"prompt": "a", "logprobs": 1})),
            Some("logprobs requested")
        );
    }
}
