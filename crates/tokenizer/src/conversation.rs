//! The request's messages and tools as vLLM hands them to the chat template
//! (`vllm/entrypoints/chat_utils.py`: `_parse_chat_message_content`, `_postprocess_messages`;
//! the serving layer's `tool.model_dump()`).
//!
//! Each message becomes a fresh dict with, in this order: `role`; `content` (see
//! [`ContentFormat`]: the text parts joined with `\n`, or a list of `{"type": "text",
//! "text": ...}` parts; a string content counts as one text part, a null one as none; in
//! the string format empty texts are dropped); for an assistant, `tool_calls` (unless null;
//! an empty list is dropped; each call's `function.arguments` JSON string parsed into an
//! object, `{}` when it is not valid JSON) and `reasoning` (copied to `reasoning_content`);
//! for a tool message, `tool_call_id` and a content list of only text parts joined with
//! `\n`; `name` and `task` when strings; for a developer message, `tools`. Other fields are
//! dropped. Media parts (images, audio, video) are refused: their tokens depend on the
//! model's multimodal processor, which this crate does not have.
//!
//! Each tool becomes `{"type", "function": {"name", "description", "parameters", ...},
//! ...}` with `description` and `parameters` null when absent, as pydantic's `model_dump`
//! writes them.

use minijinja::Value;
use serde_json::{Map, Value as Json};

use crate::template::ContentFormat;
use crate::TokenizerError;

/// A part of a message's content that reaches the template.
enum Part<'a> {
    Text(&'a str),
    ToolReference(&'a str),
}

/// The messages array as vLLM's conversation, ready for the template.
pub(crate) fn conversation(
    messages: &Json,
    format: ContentFormat,
) -> Result<Vec<Vec<(&'static str, Value)>>, TokenizerError> {
    let Json::Array(messages) = messages else {
        return Err(invalid("messages must be an array"));
    };
    messages.iter().map(|m| message(m, format)).collect()
}

fn message(
    msg: &Json,
    format: ContentFormat,
) -> Result<Vec<(&'static str, Value)>, TokenizerError> {
    let Json::Object(msg) = msg else {
        return Err(invalid("each message must be an object"));
    };
    let role = msg
        .get("role")
        .and_then(Json::as_str)
        .ok_or_else(|| invalid("each message needs a string \"role\""))?;
    let parts = parts(msg.get("content"))?;
    let mut content = match format {
        ContentFormat::String => {
            let texts: Vec<&str> = parts
                .iter()
                .map(Part::text)
                .filter(|t| !t.is_empty())
                .collect();
            Value::from(texts.join("\n"))
        }
        ContentFormat::OpenAi => Value::from(parts.iter().map(Part::to_value).collect::<Vec<_>>()),
    };
    // vLLM flattens a tool message's parts to text when they are all text.
    let all_text = parts.iter().all(|p| matches!(p, Part::Text(_)));
    if role == "tool" && format == ContentFormat::OpenAi && all_text {
        let texts: Vec<&str> = parts.iter().map(Part::text).collect();
        content = Value::from(texts.join("\n"));
    }
    let mut out = vec![("role", Value::from(role)), ("content", content)];
    match role {
        "assistant" => {
            match msg.get("tool_calls") {
                None | Some(Json::Null) => {}
                Some(Json::Array(calls)) if calls.is_empty() => {}
                Some(Json::Array(calls)) => {
                    let calls = calls.iter().map(tool_call).collect::<Result<Vec<_>, _>>()?;
                    out.push(("tool_calls", Value::from(calls)));
                }
                Some(_) => return Err(invalid("tool_calls must be a list")),
            }
            if let Some(reasoning) = msg.get("reasoning").filter(|r| !r.is_null()) {
                out.push(("reasoning", Value::from_serialize(reasoning)));
                out.push(("reasoning_content", Value::from_serialize(reasoning)));
            }
        }
        "tool" => {
            if let Some(id) = msg.get("tool_call_id") {
                out.push(("tool_call_id", Value::from_serialize(id)));
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(Json::String(s)) = msg.get(key) {
            out.push((key, Value::from(s.as_str())));
        }
    }
    if role == "developer" {
        out.push((
            "tools",
            msg.get("tools")
                .map_or(Value::from(()), Value::from_serialize),
        ));
    }
    Ok(out)
}

impl Part<'_> {
    fn text(&self) -> &str {
        match self {
            Part::Text(t) | Part::ToolReference(t) => t,
        }
    }

    fn to_value(&self) -> Value {
        match self {
            Part::Text(t) => Value::from_iter([("type", "text"), ("text", *t)]),
            Part::ToolReference(n) => Value::from_iter([("type", "tool_reference"), ("name", *n)]),
        }
    }
}

fn parts(content: Option<&Json>) -> Result<Vec<Part<'_>>, TokenizerError> {
    let items = match content {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::String(s)) => return Ok(vec![Part::Text(s)]),
        Some(Json::Array(items)) => items,
        Some(_) => {
            return Err(invalid(
                "content must be a string, a list of parts, or null",
            ))
        }
    };
    let mut parts = Vec::with_capacity(items.len());
    for item in items {
        let part = match item {
            Json::String(s) => Some(Part::Text(s)),
            Json::Object(o) => object_part(o)?,
            _ => return Err(invalid("each content part must be a string or an object")),
        };
        parts.extend(part);
    }
    Ok(parts)
}

/// A part object; `None` for a text part without text, which vLLM skips.
fn object_part(part: &Map<String, Json>) -> Result<Option<Part<'_>>, TokenizerError> {
    const MEDIA: [&str; 9] = [
        "image_url",
        "input_image",
        "image_pil",
        "image_embeds",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
        "prompt_embeds",
    ];
    let kind = match part.get("type") {
        Some(Json::String(t)) => t.as_str(),
        None | Some(Json::Null) => {
            return Err(match MEDIA.iter().find(|m| part.contains_key(**m)) {
                Some(m) => TokenizerError::UnsupportedContentPart((*m).to_owned()),
                None => invalid("a content part has no \"type\""),
            })
        }
        Some(_) => return Err(invalid("a content part's \"type\" must be a string")),
    };
    let field = match kind {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        "tool_reference" => "name",
        other => return Err(TokenizerError::UnsupportedContentPart(other.to_owned())),
    };
    match part.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) if kind == "tool_reference" => Ok(Some(Part::ToolReference(s))),
        Some(Json::String(s)) => Ok(Some(Part::Text(s))),
        Some(_) => Err(invalid(&format!(
            "a {kind} part's \"{field}\" must be a string"
        ))),
    }
}

/// A tool call with `function.arguments` parsed as vLLM parses it (a missing one is `{}`).
fn tool_call(call: &Json) -> Result<Value, TokenizerError> {
    let Json::Object(call) = call else {
        return Err(invalid("each tool call must be an object"));
    };
    let Some(Json::Object(function)) = call.get("function") else {
        return Err(invalid("each tool call needs a \"function\" object"));
    };
    let mut entries: Vec<(&str, Value)> = function
        .iter()
        .map(|(k, v)| {
            let v = if k == "arguments" {
                arguments(v)
            } else {
                Value::from_serialize(v)
            };
            (k.as_str(), v)
        })
        .collect();
    if !function.contains_key("arguments") {
        entries.push(("arguments", empty_map()));
    }
    let function = Value::from_iter(entries);
    Ok(Value::from_iter(call.iter().map(|(k, v)| {
        let v = if k == "function" {
            function.clone()
        } else {
            Value::from_serialize(v)
        };
        (k.as_str(), v)
    })))
}

/// A JSON string is parsed (keeping its key order), `{}` when invalid; objects and arrays
/// stay; anything else becomes `{}`.
fn arguments(args: &Json) -> Value {
    match args {
        Json::String(s) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| empty_map()),
        Json::Object(_) | Json::Array(_) => Value::from_serialize(args),
        _ => empty_map(),
    }
}

fn empty_map() -> Value {
    Value::from_iter(std::iter::empty::<(Value, Value)>())
}

/// The request's tools as `tool.model_dump()` writes them.
pub(crate) fn tools(tools: &Json) -> Result<Value, TokenizerError> {
    let Json::Array(tools) = tools else {
        return Err(TokenizerError::InvalidOptions(
            "tools must be an array".into(),
        ));
    };
    let bad = |m: &str| TokenizerError::InvalidOptions(m.to_owned());
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        let Json::Object(tool) = tool else {
            return Err(bad("each tool must be an object"));
        };
        let Some(Json::Object(function)) = tool.get("function") else {
            return Err(bad("each tool needs a \"function\" object"));
        };
        if !function.get("name").is_some_and(Json::is_string) {
            return Err(bad("each tool function needs a string \"name\""));
        }
        let mut f: Vec<(&str, Value)> = ["name", "description", "parameters"]
            .into_iter()
            .map(|k| {
                (
                    k,
                    function
                        .get(k)
                        .map_or(Value::from(()), Value::from_serialize),
                )
            })
            .collect();
        f.extend(
            function
                .iter()
                .filter(|(k, _)| !["name", "description", "parameters"].contains(&k.as_str()))
                .map(|(k, v)| (k.as_str(), Value::from_serialize(v))),
        );
        let kind = tool
            .get("type")
            .map_or(Value::from("function"), Value::from_serialize);
        let mut t = vec![("type", kind), ("function", Value::from_iter(f))];
        t.extend(
            tool.iter()
                .filter(|(k, _)| !["type", "function"].contains(&k.as_str()))
                .map(|(k, v)| (k.as_str(), Value::from_serialize(v))),
        );
        out.push(Value::from_iter(t));
    }
    Ok(Value::from(out))
}

fn invalid(message: &str) -> TokenizerError {
    TokenizerError::InvalidMessages(message.to_owned())
}
