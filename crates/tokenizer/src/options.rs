//! A chat request's fields that change its prompt besides the messages ([`ChatOptions`]),
//! the request fields they are read from ([`ChatFields`], so that the router and
//! `kvroute-sim` read a request alike), and how they decide the end of the rendered chat.
//!
//! vLLM hands the chat template `add_generation_prompt` (default true) and transformers
//! `continue_final_message` (default false), then merges the request's
//! `chat_template_kwargs` over them; transformers refuses the two both set. So the kwargs
//! decide first, and both set after that is an error. (vLLM's request validator also refuses
//! both set as request fields whatever the kwargs say; plain bools cannot tell an absent
//! `add_generation_prompt` from `true`, so only the merged values are checked.)

use std::sync::OnceLock;

use kvroute_protocol::fallback::ChatEnd;
use serde::Deserialize;
use serde_json::{Map, Value as Json};

use crate::TokenizerError;

/// `chat_template_kwargs` keys that would clash with the call itself (vLLM and transformers
/// refuse them too).
const RESERVED_KWARGS: [&str; 4] = ["chat_template", "tokenize", "messages", "conversation"];

/// A chat request's fields that change its prompt, besides the messages. The defaults are
/// vLLM's for `/v1/chat/completions`.
#[derive(Debug, Clone, Copy)]
pub struct ChatOptions<'a> {
    /// End with the assistant's turn opening. Default true.
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open so the model continues it. Default false;
    /// setting both this and `add_generation_prompt` is an error, as in vLLM.
    pub continue_final_message: bool,
    /// The request's `tools`, as given; `None` when absent.
    pub tools: Option<&'a Json>,
    /// The request's `documents`, as given; `None` when absent.
    pub documents: Option<&'a Json>,
    /// The request's `chat_template_kwargs`, an object of extra template variables, which
    /// override the fields above and the special tokens.
    pub chat_template_kwargs: Option<&'a Json>,
    /// Let the tokenizer add special tokens to the rendered chat too. Default false.
    pub add_special_tokens: bool,
}

impl Default for ChatOptions<'_> {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            continue_final_message: false,
            tools: None,
            documents: None,
            chat_template_kwargs: None,
            add_special_tokens: false,
        }
    }
}

impl<'a> ChatOptions<'a> {
    /// The request's `chat_template_kwargs`: an object (or absent), without the reserved keys.
    pub(crate) fn kwargs(&self) -> Result<&'a Map<String, Json>, TokenizerError> {
        static EMPTY: OnceLock<Map<String, Json>> = OnceLock::new();
        let kwargs = match self.chat_template_kwargs {
            None | Some(Json::Null) => EMPTY.get_or_init(Map::new),
            Some(Json::Object(m)) => m,
            Some(_) => {
                return Err(TokenizerError::InvalidOptions(
                    "chat_template_kwargs must be an object".into(),
                ))
            }
        };
        match RESERVED_KWARGS.iter().find(|k| kwargs.contains_key(**k)) {
            Some(k) => Err(TokenizerError::InvalidOptions(format!(
                "chat_template_kwargs may not set {k:?}"
            ))),
            None => Ok(kwargs),
        }
    }

    /// How the rendered chat ends: `add_generation_prompt` and `continue_final_message`,
    /// each overridden by a `chat_template_kwargs` key of the same name.
    pub(crate) fn chat_end(&self) -> Result<ChatEnd, TokenizerError> {
        let kwargs = self.kwargs()?;
        let flag = |key: &str, given: bool| kwargs.get(key).map_or(given, truthy);
        match (
            flag("add_generation_prompt", self.add_generation_prompt),
            flag("continue_final_message", self.continue_final_message),
        ) {
            (true, true) => Err(TokenizerError::InvalidOptions(
                "add_generation_prompt and continue_final_message cannot both be set".into(),
            )),
            (true, false) => Ok(ChatEnd::GenerationPrompt),
            (false, false) => Ok(ChatEnd::Closed),
            (false, true) => Ok(ChatEnd::ContinueFinal),
        }
    }
}

/// The fields of a chat request body that make its prompt, as vLLM reads them; every other
/// field is ignored. Deserialise a body into it, then take [`ChatFields::options`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatFields {
    pub messages: Json,
    #[serde(default)]
    pub tools: Option<Json>,
    #[serde(default)]
    pub documents: Option<Json>,
    #[serde(default)]
    pub chat_template_kwargs: Option<Json>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
}

impl ChatFields {
    /// The options these fields give, vLLM's defaults for the absent ones.
    pub fn options(&self) -> ChatOptions<'_> {
        let defaults = ChatOptions::default();
        ChatOptions {
            add_generation_prompt: self
                .add_generation_prompt
                .unwrap_or(defaults.add_generation_prompt),
            continue_final_message: self
                .continue_final_message
                .unwrap_or(defaults.continue_final_message),
            tools: self.tools.as_ref(),
            documents: self.documents.as_ref(),
            chat_template_kwargs: self.chat_template_kwargs.as_ref(),
            add_special_tokens: self
                .add_special_tokens
                .unwrap_or(defaults.add_special_tokens),
        }
    }
}

/// Python truthiness of a JSON value.
pub(crate) fn truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn end(fields: Json) -> Result<ChatEnd, TokenizerError> {
        let mut fields = fields;
        fields["messages"] = json!([]);
        let fields: ChatFields = serde_json::from_value(fields).unwrap();
        fields.options().chat_end()
    }

    #[test]
    fn the_chat_end_follows_vllm() {
        assert_eq!(end(json!({})).unwrap(), ChatEnd::GenerationPrompt);
        assert_eq!(
            end(json!({"add_generation_prompt": false})).unwrap(),
            ChatEnd::Closed
        );
        let continuation = json!({"add_generation_prompt": false, "continue_final_message": true});
        assert_eq!(end(continuation).unwrap(), ChatEnd::ContinueFinal);
        // Both set, or continuing with the generation prompt left at its default.
        for both in [
            json!({"add_generation_prompt": true, "continue_final_message": true}),
            json!({"continue_final_message": true}),
            json!({"chat_template_kwargs": {"continue_final_message": true}}),
        ] {
            let err = end(both.clone()).unwrap_err().to_string();
            assert!(err.contains("cannot both be set"), "{both}: {err}");
        }
        // The kwargs win over the fields, with Python's truthiness.
        let by_kwargs = json!({"continue_final_message": true,
                               "chat_template_kwargs": {"add_generation_prompt": 0}});
        assert_eq!(end(by_kwargs).unwrap(), ChatEnd::ContinueFinal);
        let undone = json!({"add_generation_prompt": false, "continue_final_message": true,
                            "chat_template_kwargs": {"continue_final_message": ""}});
        assert_eq!(end(undone).unwrap(), ChatEnd::Closed);
    }

    #[test]
    fn kwargs_must_be_an_object_without_reserved_keys() {
        let err = end(json!({"chat_template_kwargs": [1]})).unwrap_err();
        assert!(err.to_string().contains("must be an object"), "{err}");
        let err = end(json!({"chat_template_kwargs": {"tokenize": true}})).unwrap_err();
        assert!(err.to_string().contains("\"tokenize\""), "{err}");
        assert!(end(json!({"chat_template_kwargs": null})).is_ok());
    }

    #[test]
    fn absent_fields_take_vllm_defaults() {
        let fields: ChatFields = serde_json::from_value(json!({
            "messages": [], "model": "m", "stream": true, "add_special_tokens": true
        }))
        .unwrap();
        let opts = fields.options();
        assert!(opts.add_generation_prompt && !opts.continue_final_message);
        assert!(opts.add_special_tokens);
        assert!(opts.tools.is_none() && opts.documents.is_none());
    }
}
