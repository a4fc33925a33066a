//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), read as vLLM reads
//! it: [`chat_request`] turns a Messages body into the OpenAI chat request vLLM builds from it,
//! so the router tokenises a conversation on this route exactly as the engine will (and as the
//! chat route would), and kvroute-sim serves both routes from one engine path.
//!
//! vLLM's conversion, field by field:
//! - `system` (a string, or text blocks) and any `role: "system"` message, joined with no
//!   separator, become one leading system message. A text block that starts with
//!   `x-anthropic-billing-header` (a per-request hash Claude Code sends) is left out: it would
//!   defeat prefix caching.
//! - A message's string content stays a string. Its blocks: `text` becomes a text part (one
//!   text part alone becomes a string), `image` an `image_url` part (a data URI for base64),
//!   `thinking` the message's `reasoning`, `tool_use` a tool call whose arguments are
//!   `json.dumps(input)` (Python's separators and ASCII escapes), `tool_result` in a user
//!   message a `role: "tool"` message placed before it (its text blocks joined with newlines),
//!   in an assistant message a text part `Tool result: ...`. A user message left with no
//!   content (only tool results) is dropped.
//! - `tools` become functions (`name`, `description`, `parameters` from `input_schema`);
//!   `tool_choice` `auto`, `any`, `none`, `tool` become `auto`, `required`, `none` and a named
//!   function (`auto` when tools are given without a choice).
//! - `max_tokens`, `stop_sequences` (as `stop`), `temperature`, `top_p`, `top_k`, `stream`
//!   and `chat_template_kwargs` carry over.

use serde_json::{json, Map, Value};

use crate::python::{float_repr, json_string};

/// Why a Messages body cannot be read (Anthropic's `invalid_request_error`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRequest(pub String);

fn invalid(message: impl Into<String>) -> InvalidRequest {
    InvalidRequest(message.into())
}

/// The OpenAI chat request vLLM builds from the Messages `body` (see the module docs).
pub fn chat_request(body: &Value) -> Result<Value, InvalidRequest> {
    let Some(request) = body.as_object() else {
        return Err(invalid("the request body must be a JSON object"));
    };
    let messages = match request.get("messages") {
        Some(Value::Array(messages)) => messages,
        Some(_) => return Err(invalid("messages: must be a list")),
        None => return Err(invalid("messages: field required")),
    };
    let mut out = Vec::with_capacity(messages.len() + 1);
    system(request.get("system"), messages, &mut out)?;
    for (i, message) in messages.iter().enumerate() {
        convert_message(i, message, &mut out)?;
    }
    let mut chat = Map::new();
    for key in [
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stream",
    ] {
        if let Some(v) = request.get(key).filter(|v| !v.is_null()) {
            chat.insert(key.to_owned(), v.clone());
        }
    }
    if let Some(max) = request.get("max_tokens").filter(|v| !v.is_null()) {
        chat.insert("max_completion_tokens".into(), max.clone());
    }
    if let Some(stop) = request.get("stop_sequences").filter(|v| !v.is_null()) {
        chat.insert("stop".into(), stop.clone());
    }
    if let Some(kwargs) = request.get("chat_template_kwargs").filter(|v| !v.is_null()) {
        chat.insert("chat_template_kwargs".into(), kwargs.clone());
    }
    chat.insert("messages".into(), Value::Array(out));
    tools(request, &mut chat)?;
    Ok(Value::Object(chat))
}

const BILLING_HEADER: &str = "x-anthropic-billing-header";

fn system(
    top: Option<&Value>,
    messages: &[Value],
    out: &mut Vec<Value>,
) -> Result<(), InvalidRequest> {
    let mut parts = String::new();
    let mut add = |content: &Value, what: &str| -> Result<(), InvalidRequest> {
        match content {
            Value::Null => {}
            Value::String(s) => parts.push_str(s),
            Value::Array(blocks) => {
                for block in blocks {
                    if block["type"] == "text" {
                        let text = block["text"].as_str().unwrap_or_default();
                        if !text.is_empty() && !text.starts_with(BILLING_HEADER) {
                            parts.push_str(text);
                        }
                    }
                }
            }
            _ => {
                return Err(invalid(format!(
                    "{what}: must be a string or a list of blocks"
                )))
            }
        }
        Ok(())
    };
    add(top.unwrap_or(&Value::Null), "system")?;
    for m in messages.iter().filter(|m| m["role"] == "system") {
        add(&m["content"], "messages.content")?;
    }
    if !parts.is_empty() {
        out.push(json!({"role": "system", "content": parts}));
    }
    Ok(())
}

fn convert_message(i: usize, message: &Value, out: &mut Vec<Value>) -> Result<(), InvalidRequest> {
    let Some(m) = message.as_object() else {
        return Err(invalid(format!("messages.{i}: must be an object")));
    };
    let role = match m.get("role").and_then(Value::as_str) {
        Some("system") => return Ok(()),
        Some(role @ ("user" | "assistant")) => role,
        Some(other) => {
            return Err(invalid(format!(
                "messages.{i}.role: must be user or assistant, not {other:?}"
            )))
        }
        None => return Err(invalid(format!("messages.{i}.role: field required"))),
    };
    let mut msg = Map::new();
    msg.insert("role".into(), role.into());
    match m.get("content") {
        Some(Value::String(s)) => {
            msg.insert("content".into(), s.clone().into());
        }
        Some(Value::Array(blocks)) => blocks_into(i, role, blocks, &mut msg, out)?,
        Some(_) => {
            return Err(invalid(format!(
                "messages.{i}.content: must be a string or a list of blocks"
            )))
        }
        None => return Err(invalid(format!("messages.{i}.content: field required"))),
    }
    if role != "user" || msg.contains_key("content") {
        out.push(Value::Object(msg));
    }
    Ok(())
}

fn blocks_into(
    i: usize,
    role: &str,
    blocks: &[Value],
    msg: &mut Map<String, Value>,
    out: &mut Vec<Value>,
) -> Result<(), InvalidRequest> {
    let mut parts = Vec::new();
    let mut tool_calls = Vec::new();
    let mut reasoning = String::new();
    let mut any_reasoning = false;
    for (j, block) in blocks.iter().enumerate() {
        let kind = block["type"]
            .as_str()
            .ok_or_else(|| invalid(format!("messages.{i}.content.{j}.type: field required")))?;
        match kind {
            "text" => {
                let text = block["text"].as_str().unwrap_or_default();
                if !text.is_empty() {
                    parts.push(json!({"type": "text", "text": text}));
                }
            }
            "image" => {
                if let Some(source) = block.get("source").filter(|s| s.is_object()) {
                    let url = image_url(source);
                    parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
                }
            }
            "thinking" => {
                if let Some(t) = block["thinking"].as_str() {
                    reasoning.push_str(t);
                    any_reasoning = true;
                }
            }
            "tool_use" => {
                let input = block.get("input").filter(|v| !v.is_null());
                tool_calls.push(json!({
                    "id": block["id"].as_str().unwrap_or_default(),
                    "type": "function",
                    "function": {
                        "name": block["name"].as_str().unwrap_or_default(),
                        "arguments": python_json(input.unwrap_or(&json!({}))),
                    },
                }));
            }
            "tool_result" if role == "user" => tool_result(block, out),
            "tool_result" => {
                let text = match &block["content"] {
                    Value::Null => String::new(),
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
            }
            // Opaque (redacted reasoning) or expanded elsewhere (tool references): accepted,
            // rendered as nothing, as vLLM does.
            "redacted_thinking"
            | "tool_reference"
            | "document"
            | "server_tool_use"
            | "web_search_tool_result" => {}
            other => {
                return Err(invalid(format!(
                    "messages.{i}.content.{j}.type: unknown block type {other:?}"
                )))
            }
        }
    }
    if any_reasoning {
        msg.insert("reasoning".into(), reasoning.into());
    }
    if !tool_calls.is_empty() {
        msg.insert("tool_calls".into(), tool_calls.into());
    }
    if parts.len() == 1 && parts[0]["type"] == "text" {
        msg.insert("content".into(), parts[0]["text"].clone());
    } else if !parts.is_empty() {
        msg.insert("content".into(), parts.into());
    }
    Ok(())
}

/// A user's tool result: a `tool` message (and a user message with its images).
fn tool_result(block: &Value, out: &mut Vec<Value>) {
    let id = block["tool_use_id"].as_str().unwrap_or_default();
    let mut images = Vec::new();
    let text = match &block["content"] {
        Value::String(s) => s.clone(),
        Value::Array(items) => {
            let mut texts = Vec::new();
            for item in items {
                match item["type"].as_str() {
                    Some("text") => texts.push(item["text"].as_str().unwrap_or_default()),
                    Some("image") => {
                        let url = image_url(&item["source"]);
                        if !url.is_empty() {
                            images.push(json!({"type": "image_url", "image_url": {"url": url}}));
                        }
                    }
                    _ => {}
                }
            }
            texts.join("\n")
        }
        _ => String::new(),
    };
    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !images.is_empty() {
        out.push(json!({"role": "user", "content": images}));
    }
}

fn image_url(source: &Value) -> String {
    if source["type"] == "url" {
        return source["url"].as_str().unwrap_or_default().to_owned();
    }
    let media = source["media_type"].as_str().unwrap_or("image/jpeg");
    let data = source["data"].as_str().unwrap_or_default();
    format!("data:{media};base64,{data}")
}

fn tools(
    request: &Map<String, Value>,
    chat: &mut Map<String, Value>,
) -> Result<(), InvalidRequest> {
    let choice = match request.get("tool_choice").filter(|v| !v.is_null()) {
        None => None,
        Some(c) => Some(match c["type"].as_str() {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": c["name"]}}),
            _ => return Err(invalid("tool_choice.type: must be auto, any, none or tool")),
        }),
    };
    match request.get("tools").filter(|v| !v.is_null()) {
        None => {
            if let Some(choice) = choice {
                chat.insert("tool_choice".into(), choice);
            }
        }
        Some(Value::Array(tools)) => {
            let converted: Vec<Value> = tools
                .iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t["name"], "description": t["description"],
                        "parameters": t["input_schema"],
                    }})
                })
                .collect();
            chat.insert("tools".into(), converted.into());
            chat.insert(
                "tool_choice".into(),
                choice.unwrap_or_else(|| json!("auto")),
            );
        }
        Some(_) => return Err(invalid("tools: must be a list")),
    }
    Ok(())
}

/// Anthropic's error `type` for an HTTP status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(status: u16, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// `json.dumps(value)` as Python writes it: `", "` and `": "` separators, non-ASCII as
/// `\uXXXX` escapes (surrogate pairs beyond the BMP), keys in the order given.
pub fn python_json(value: &Value) -> String {
    let mut out = String::new();
    write_python(value, &mut out);
    out
}

fn write_python(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) => out.push_str(&float_repr(f, true)),
            None => out.push_str(&n.to_string()),
        },
        Value::String(s) => json_string(out, s, true),
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python(v, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                json_string(out, k, true);
                out.push_str(": ");
                write_python(v, out);
            }
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversation_converts_as_vllm_converts_it() {
        let body = json!({
            "model": "m", "max_tokens": 64, "stream": true, "stop_sequences": ["END"],
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
                {"type": "text", "text": "You are terse."},
            ],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris", "unit": "°C"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "12"}, {"type": "text", "text": "cloudy"}]},
                ]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        });
        let chat = chat_request(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "reasoning": "Use the tool.", "content": "Checking.",
                 "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                     "name": "get_weather",
                     "arguments": "{\"city\": \"Paris\", \"unit\": \"\\u00b0C\"}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "12\ncloudy"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ])
        );
        assert_eq!(chat["max_tokens"], 64);
        assert_eq!(chat["max_completion_tokens"], 64);
        assert_eq!(chat["stop"], json!(["END"]));
        assert_eq!(chat["stream"], true);
        assert_eq!(chat["tool_choice"], "auto");
        assert_eq!(
            chat["tools"][0]["function"],
            json!({"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}})
        );
    }

    #[test]
    fn python_json_matches_json_dumps() {
        // Each right side is what Python 3's json.dumps prints.
        let cases = [
            (
                json!({"b": 1, "a": [true, null, 2.5]}),
                r#"{"b": 1, "a": [true, null, 2.5]}"#,
            ),
            (json!({"x": 1.0, "y": -3}), r#"{"x": 1.0, "y": -3}"#),
            (
                json!("tab\tquote\"é😀"),
                r#""tab\tquote\"\u00e9\ud83d\ude00""#,
            ),
            (json!({}), "{}"),
        ];
        for (value, want) in cases {
            assert_eq!(python_json(&value), want);
        }
    }

    #[test]
    fn malformed_bodies_are_refused_with_the_field_named() {
        for (body, names) in [
            (json!([1]), "JSON object"),
            (json!({"model": "m"}), "messages: field required"),
            (json!({"messages": "hi"}), "messages: must be a list"),
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages.0.role",
            ),
            (
                json!({"messages": [{"role": "user"}]}),
                "messages.0.content",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "video"}]}]}),
                "unknown block type",
            ),
            (json!({"messages": [], "tools": {}}), "tools"),
        ] {
            let e = chat_request(&body).unwrap_err();
            assert!(e.0.contains(names), "{body}: {e}");
        }
    }
}
