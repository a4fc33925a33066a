//! A Hugging Face tokenizer (`tokenizer.json`) with its chat templates, used as vLLM uses it.

use std::fmt;
use std::path::Path;

use kvroute_protocol::fallback::ChatEnd;
use minijinja::Value;
use serde_json::{Map, Value as Json};

use crate::conversation;
use crate::load::{ModelFiles, TokenizerConfig};
use crate::prefix::Cuts;
use crate::template::ChatTemplates;
use crate::{ChatOptions, TokenizerError};

/// transformers' marker for `continue_final_message`, appended to the final message's text
/// before rendering and cut off (with everything after it) afterwards.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

pub(crate) struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    templates: Option<ChatTemplates>,
    config: TokenizerConfig,
    eos_token_id: Option<u32>,
    /// Where its prompts may be cut for the prefix cache.
    pub cuts: Cuts,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.config.special_tokens)
            .field("eos_token_id", &self.eos_token_id)
            .field("templates", &self.templates)
            .field("cuts", &self.cuts)
            .finish_non_exhaustive()
    }
}

impl HfTokenizer {
    pub fn load(path: &Path) -> Result<Self, TokenizerError> {
        let files = ModelFiles::locate(path)?;
        let json_path = &files.tokenizer_json;
        let bytes = std::fs::read(json_path).map_err(|source| TokenizerError::Read {
            path: json_path.clone(),
            source,
        })?;
        serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).map_err(|source| {
            TokenizerError::InvalidJson {
                path: json_path.clone(),
                source,
            }
        })?;
        let invalid = |source| TokenizerError::InvalidTokenizer {
            path: json_path.clone(),
            source,
        };
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(invalid)?;
        // transformers turns off the file's truncation and padding unless a call asks.
        tokenizer.with_truncation(None).map_err(invalid)?;
        tokenizer.with_padding(None);
        let mut config = TokenizerConfig::read(&files)?;
        let templates = match std::mem::take(&mut config.templates) {
            t if t.is_empty() => None,
            t => Some(ChatTemplates::compile(t, &config.template_path)?),
        };
        let eos_token_id = config
            .special_token("eos_token")
            .and_then(|t| tokenizer.token_to_id(t));
        let cuts = Cuts::of(&tokenizer);
        Ok(Self {
            tokenizer,
            templates,
            config,
            eos_token_id,
            cuts,
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|source| TokenizerError::Tokenize { source })?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let text = self
            .tokenizer
            .decode(ids, true)
            .map_err(|source| TokenizerError::Tokenize { source })?;
        Ok(if self.config.clean_up_tokenization_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    pub fn vocab_size(&self) -> u32 {
        u32::try_from(self.tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX)
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// The prompt vLLM renders for a chat (see [`crate::Tokenizer::render_chat`]).
    pub fn render_chat(
        &self,
        messages: &Json,
        opts: &ChatOptions<'_>,
    ) -> Result<String, TokenizerError> {
        let templates = self
            .templates
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        // Request kwargs override the request's own fields, as in vLLM.
        let kwargs = opts.kwargs()?;
        let continue_final = opts.chat_end()? == ChatEnd::ContinueFinal;
        let tools = match kwargs.get("tools").or(opts.tools) {
            None | Some(Json::Null) => None,
            Some(t) => Some(conversation::tools(t)?),
        };
        let (name, format) = templates.select(tools.is_some())?;
        let mut messages = conversation::conversation(messages, format)?;
        let final_text = if continue_final {
            if !templates.source_contains(name, "content") {
                return Err(TokenizerError::InvalidOptions(
                    "continue_final_message is set but the chat template does not use \"content\""
                        .into(),
                ));
            }
            Some(mark_final_message(&mut messages)?)
        } else {
            None
        };
        let messages = Value::from(
            messages
                .into_iter()
                .map(Value::from_iter)
                .collect::<Vec<_>>(),
        );
        let rendered = templates.render(name, self.context(messages, tools, opts, kwargs))?;
        match final_text {
            Some(text) => cut_at_final_message(rendered, &text),
            None => Ok(rendered),
        }
    }

    /// The template's variables, as transformers passes them: `messages`, `tools`,
    /// `documents`, `add_generation_prompt`, the special tokens, then the kwargs (which
    /// override all but `messages`).
    fn context(
        &self,
        messages: Value,
        tools: Option<Value>,
        opts: &ChatOptions<'_>,
        kwargs: &Map<String, Json>,
    ) -> Value {
        let none = || Value::from(());
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", messages),
            ("tools", tools.unwrap_or_else(none)),
            (
                "documents",
                opts.documents.map_or_else(none, Value::from_serialize),
            ),
            (
                "add_generation_prompt",
                Value::from(opts.add_generation_prompt),
            ),
        ];
        for (key, token) in &self.config.special_tokens {
            ctx.push((*key, Value::from(token.as_str())));
        }
        if !self.config.additional_special_tokens.is_empty() {
            let extra = Value::from_serialize(&self.config.additional_special_tokens);
            ctx.push(("additional_special_tokens", extra));
        }
        for (key, value) in kwargs {
            if key != "tools" && key != "continue_final_message" {
                ctx.push((key.as_str(), Value::from_serialize(value)));
            }
        }
        Value::from_iter(ctx)
    }
}

/// Appends [`CONTINUE_TAG`] to the final message's text (its last text part in the openai
/// format) and returns that text as it was.
fn mark_final_message(
    messages: &mut [Vec<(&'static str, Value)>],
) -> Result<String, TokenizerError> {
    let no_text = || {
        TokenizerError::InvalidOptions(
            "continue_final_message is set but the final message has no text to continue".into(),
        )
    };
    let last = messages.last_mut().ok_or_else(no_text)?;
    let content = last
        .iter_mut()
        .find(|(k, _)| *k == "content")
        .ok_or_else(no_text)?;
    if let Some(text) = content.1.as_str() {
        let text = text.to_owned();
        content.1 = Value::from(format!("{text}{CONTINUE_TAG}"));
        return Ok(text);
    }
    let mut parts: Vec<Value> = content.1.try_iter().map_err(|_| no_text())?.collect();
    let key = Value::from("text");
    let index = parts
        .iter()
        .rposition(|p| p.get_item(&key).is_ok_and(|t| !t.is_undefined()))
        .ok_or_else(no_text)?;
    let text = parts[index]
        .get_item(&key)
        .map(|t| t.to_string())
        .unwrap_or_default();
    let marked = format!("{text}{CONTINUE_TAG}");
    let part = &parts[index];
    let rebuilt = part
        .try_iter()
        .map_err(|_| no_text())?
        .map(|k| {
            let v = if k == key {
                Value::from(marked.as_str())
            } else {
                part.get_item(&k).unwrap_or_default()
            };
            (k, v)
        })
        .collect::<Vec<_>>();
    parts[index] = Value::from_iter(rebuilt);
    content.1 = Value::from(parts);
    Ok(text)
}

/// transformers' cut: everything from the tag on goes; when the template trimmed the tag's
/// trailing space, trailing whitespace before it goes too.
fn cut_at_final_message(mut rendered: String, final_text: &str) -> Result<String, TokenizerError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_text.trim()) || !rendered.contains(tag) {
        return Err(TokenizerError::InvalidOptions(
            "continue_final_message is set but the final message does not appear in the rendered chat".into(),
        ));
    }
    let at = rendered.rfind(tag).unwrap_or(rendered.len());
    let spaced = rendered[at..].starts_with(CONTINUE_TAG);
    rendered.truncate(at);
    if !spaced {
        rendered.truncate(rendered.trim_end().len());
    }
    Ok(rendered)
}

/// transformers' `clean_up_tokenization`, applied by `decode` when the config asks.
fn clean_up_tokenization(text: &str) -> String {
    [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ]
    .iter()
    .fold(text.to_owned(), |s, (from, to)| s.replace(from, to))
}
