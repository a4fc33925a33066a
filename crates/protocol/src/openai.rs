//! The fields of an OpenAI-style request that routing reads, as a borrowing view.
//!
//! The router forwards the request body as the bytes that came in; it deserialises only
//! [`RoutingFields`], whose strings borrow from the body wherever JSON escaping allows, and
//! skips every other field without building it. The same view covers
//! `/v1/chat/completions` (`messages`), `/v1/completions` (`prompt`), SGLang's `/generate`
//! (`text`, `input_ids`) and `/v1/embeddings` or `/v1/responses` (`input`).
//!
//! [`RoutingFields::routing_text`] is the text the text-based policies key on: for a chat,
//! the messages' text contents joined with single spaces (SGLang's router does the same);
//! for a completion, the prompt (several prompts joined with spaces); token-id prompts
//! become their decimal ids joined with spaces.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;

/// What routing reads from a request body. Unknown fields are skipped, not stored.
#[derive(Debug, Default, Deserialize)]
pub struct RoutingFields<'a> {
    #[serde(borrow, default)]
    pub model: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "null_as_false")]
    pub stream: bool,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(borrow, default)]
    pub user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub prompt: Option<Prompt<'a>>,
    #[serde(borrow, default)]
    pub messages: Option<Vec<Message<'a>>>,
    /// SGLang `/generate`.
    #[serde(borrow, default)]
    pub text: Option<Prompt<'a>>,
    /// SGLang `/generate`.
    #[serde(default)]
    pub input_ids: Option<Prompt<'a>>,
    /// `/v1/embeddings`, `/v1/responses`.
    #[serde(borrow, default)]
    pub input: Option<Prompt<'a>>,
    /// Dynamo's request extension (the fields kvroute reads of it).
    #[serde(default)]
    pub nvext: Option<NvExt>,
}

/// Dynamo's `nvext`: of its fields, those with a counterpart in kvroute's routing hints and
/// its router queue. The others (`annotations`, `session_control`, ...) are left to the engine.
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
pub struct NvExt {
    /// The router queue's hints.
    #[serde(default)]
    pub agent_hints: Option<AgentHints>,
    /// Send to this worker instance: the worker whose id is this number.
    #[serde(default)]
    pub backend_instance_id: Option<u64>,
    /// The decode worker of a disaggregated request (the same pin as `backend_instance_id`).
    #[serde(default)]
    pub decode_worker_id: Option<u64>,
    /// The prefill worker of a disaggregated request.
    #[serde(default)]
    pub prefill_worker_id: Option<u64>,
    /// The data-parallel rank of the pinned worker.
    #[serde(default)]
    pub dp_rank: Option<u32>,
}

/// Dynamo 1.6's `nvext.agent_hints`, the fields its router reads. A value of the wrong type is
/// ignored (the engine may still read it), never a reason to refuse the request.
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
pub struct AgentHints {
    /// The strict pending-queue tier (u32): a higher tier always goes first.
    #[serde(default, deserialize_with = "lenient_u32")]
    pub strict_priority: Option<u32>,
    /// The soft priority (i32 in Dynamo), in the router queue a head start in seconds under
    /// FCFS; `latency_sensitivity` is its deprecated name.
    #[serde(
        default,
        alias = "latency_sensitivity",
        deserialize_with = "lenient_f64"
    )]
    pub priority: Option<f64>,
    /// The expected output length in tokens (u32): with `--router-track-output-blocks`, the
    /// request's exclusive blocks decay as its output nears it.
    #[serde(default, deserialize_with = "lenient_u32")]
    pub osl: Option<u32>,
}

impl NvExt {
    /// `agent_hints.osl`, if the request gave one.
    pub fn osl(nvext: Option<&NvExt>) -> Option<u32> {
        nvext
            .and_then(|n| n.agent_hints.as_ref())
            .and_then(|h| h.osl)
    }
}

fn lenient_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(v.as_u64().map(|n| n.min(u64::from(u32::MAX)) as u32))
}

fn lenient_f64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(v.as_f64().filter(|f| f.is_finite()))
}

fn null_as_false<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

impl<'a> RoutingFields<'a> {
    /// Parses the routing view of a JSON body. The body must be a JSON object.
    pub fn from_json(body: &'a [u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }

    /// The text text-based policies key on (see the module docs). Borrows when the
    /// request has a single plain-text prompt.
    pub fn routing_text(&self) -> Cow<'_, str> {
        if let Some(messages) = &self.messages {
            let mut out = String::new();
            for m in messages {
                m.content.append_text(&mut out);
            }
            return Cow::Owned(out);
        }
        let prompt = self
            .prompt
            .as_ref()
            .or(self.text.as_ref())
            .or(self.input_ids.as_ref())
            .or(self.input.as_ref());
        match prompt {
            Some(p) => p.text(),
            None => Cow::Borrowed(""),
        }
    }
}

/// A prompt: a string, several strings, token ids, or several token-id lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt<'a> {
    Text(Cow<'a, str>),
    Texts(Vec<Cow<'a, str>>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

impl Prompt<'_> {
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            Prompt::Text(t) => Cow::Borrowed(t),
            Prompt::Texts(ts) => Cow::Owned(ts.join(" ")),
            Prompt::Tokens(ids) => Cow::Owned(join_ids(ids)),
            Prompt::TokenBatches(bs) => {
                Cow::Owned(bs.iter().map(|b| join_ids(b)).collect::<Vec<_>>().join(" "))
            }
        }
    }
}

fn join_ids(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 4);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(&id.to_string());
    }
    s
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

/// One element of a prompt array: decides which array shape the prompt has.
enum PromptItem<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptItem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = PromptItem<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a token id or a list of token ids")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        d.deserialize_any(ItemVisitor)
    }
}

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a list of strings, or token ids")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Prompt::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Prompt::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let Some(first) = seq.next_element::<PromptItem<'de>>()? else {
            return Ok(Prompt::Texts(Vec::new()));
        };
        let mismatch = || de::Error::custom("prompt array mixes strings and token ids");
        match first {
            PromptItem::Text(t) => {
                let mut out = vec![t];
                while let Some(item) = seq.next_element::<PromptItem<'de>>()? {
                    match item {
                        PromptItem::Text(t) => out.push(t),
                        _ => return Err(mismatch()),
                    }
                }
                Ok(Prompt::Texts(out))
            }
            PromptItem::Token(id) => {
                let mut out = vec![id];
                while let Some(id) = seq.next_element::<u32>()? {
                    out.push(id);
                }
                Ok(Prompt::Tokens(out))
            }
            PromptItem::Tokens(ids) => {
                let mut out = vec![ids];
                while let Some(ids) = seq.next_element::<Vec<u32>>()? {
                    out.push(ids);
                }
                Ok(Prompt::TokenBatches(out))
            }
        }
    }
}

/// A chat message; only its content matters to routing.
#[derive(Debug, Default, Deserialize)]
pub struct Message<'a> {
    #[serde(borrow, default)]
    pub role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub content: Content<'a>,
}

/// A message's content: a string, or a list of parts of which the `text` ones count.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub enum Content<'a> {
    #[default]
    Empty,
    Text(Cow<'a, str>),
    Parts(Vec<Cow<'a, str>>),
}

impl Content<'_> {
    /// Appends this content's text to `out`, space-separated from what is already there.
    pub fn append_text(&self, out: &mut String) {
        let mut push = |t: &str| {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(t);
        };
        match self {
            Content::Empty => {}
            Content::Text(t) => push(t),
            Content::Parts(parts) => parts.iter().for_each(|t| push(t)),
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = Content<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a list of content parts, or null")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::Empty)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::Empty)
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element::<Part<'de>>()? {
                    if let Some(t) = part.text {
                        parts.push(t);
                    }
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(ContentVisitor)
    }
}

/// A content part (`{"type": "text", "text": ...}`, `{"type": "image_url", ...}`).
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(flatten)]
    _rest: IgnoredRest,
}

/// Swallows the other keys of a part without storing them.
#[derive(Default)]
struct IgnoredRest;

impl<'de> Deserialize<'de> for IgnoredRest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        IgnoredAny::deserialize(d).map(|_| IgnoredRest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_text_joins_contents_and_skips_non_text_parts() {
        let body = br#"{"model":"m","stream":true,"unknown":{"x":[1,2]},"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"hello"},{"type":"image_url","image_url":{"url":"u"}}]},
            {"role":"assistant","content":null}]}"#;
        let f = RoutingFields::from_json(body).unwrap();
        assert_eq!(f.model.as_deref(), Some("m"));
        assert!(f.stream);
        assert_eq!(f.routing_text(), "be brief hello");
    }

    #[test]
    fn completion_prompt_shapes() {
        let f = RoutingFields::from_json(br#"{"prompt":"abc"}"#).unwrap();
        assert!(matches!(f.routing_text(), Cow::Borrowed("abc")));
        let f = RoutingFields::from_json(br#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(f.routing_text(), "a b");
        let f = RoutingFields::from_json(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(f.prompt, Some(Prompt::Tokens(vec![1, 2, 3])));
        assert_eq!(f.routing_text(), "1 2 3");
        let f = RoutingFields::from_json(br#"{"prompt":[[1],[2,3]]}"#).unwrap();
        assert_eq!(
            f.prompt,
            Some(Prompt::TokenBatches(vec![vec![1], vec![2, 3]]))
        );
        assert!(RoutingFields::from_json(br#"{"prompt":["a",1]}"#).is_err());
        let f = RoutingFields::from_json(br#"{"text":"gen","stream":null}"#).unwrap();
        assert_eq!(f.routing_text(), "gen");
        assert!(!f.stream);
    }

    #[test]
    fn escaped_strings_are_decoded() {
        let f = RoutingFields::from_json(br#"{"prompt":"a\"b\u00e9"}"#).unwrap();
        assert_eq!(f.routing_text(), "a\"b\u{e9}");
    }

    #[test]
    fn malformed_bodies_are_errors() {
        assert!(RoutingFields::from_json(b"{").is_err());
        assert!(RoutingFields::from_json(b"[1]").is_err());
        assert!(RoutingFields::from_json(br#"{"model":3}"#).is_err());
        assert!(RoutingFields::from_json(br#"{"messages":"x"}"#).is_err());
    }

    #[test]
    fn agent_hints_are_read_leniently() {
        let hints = |body: &str| {
            let f = RoutingFields::from_json(body.as_bytes()).unwrap();
            f.nvext.and_then(|n| n.agent_hints).unwrap_or_default()
        };
        let h = hints(r#"{"nvext":{"agent_hints":{"strict_priority":2,"priority":-3}}}"#);
        assert_eq!((h.strict_priority, h.priority), (Some(2), Some(-3.0)));
        // The deprecated name, with a fraction (Dynamo 1.5's f64 seconds).
        let h = hints(r#"{"nvext":{"agent_hints":{"latency_sensitivity":1.2}}}"#);
        assert_eq!(h.priority, Some(1.2));
        // Wrong types are ignored, not a reason to refuse the request.
        let h = hints(r#"{"nvext":{"agent_hints":{"strict_priority":"high","priority":null}}}"#);
        assert_eq!((h.strict_priority, h.priority), (None, None));
        let h = hints(r#"{"nvext":{"agent_hints":{"strict_priority":-1,"osl":5}}}"#);
        assert_eq!((h.strict_priority, h.osl), (None, Some(5)));
    }

    #[test]
    fn osl_is_read_leniently() {
        let osl = |body: &str| {
            let f = RoutingFields::from_json(body.as_bytes()).unwrap();
            NvExt::osl(f.nvext.as_ref())
        };
        assert_eq!(osl(r#"{"nvext":{"agent_hints":{"osl":512}}}"#), Some(512));
        assert_eq!(osl(r#"{"nvext":{"agent_hints":{"osl":0}}}"#), Some(0));
        // Beyond u32: the largest (Dynamo's field is a u32).
        assert_eq!(
            osl(r#"{"nvext":{"agent_hints":{"osl":9999999999}}}"#),
            Some(u32::MAX)
        );
        // Wrong types are ignored: a string, a negative, a fraction, null.
        for bad in [r#""512""#, "-1", "1.5", "null", "[1]"] {
            let body = format!(r#"{{"nvext":{{"agent_hints":{{"osl":{bad}}}}}}}"#);
            assert_eq!(osl(&body), None, "{bad}");
        }
        assert_eq!(osl(r#"{"nvext":{}}"#), None);
        assert_eq!(
            osl(r#"{"max_tokens":7}"#),
            None,
            "max_tokens is not an osl (Dynamo's)"
        );
    }
}
