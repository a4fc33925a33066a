//! Tokenising requests exactly as the engine (vLLM) does, shared by the router and
//! `kvroute-sim` so both derive the same token ids, and so the same KV-block hashes, from
//! the same request.
//!
//! **What it owns.** [`Tokenizer`]: either a Hugging Face tokenizer loaded from a model
//! directory (`tokenizer.json`, `tokenizer_config.json`, optionally `chat_template.jinja`)
//! with its chat templates, or the shared fallback of [`kvroute_protocol::fallback`].
//!
//! - A completion prompt is tokenised *with* special tokens: the tokenizer's post-processor
//!   adds what the model wants (BOS for Llama) ([`Tokenizer::encode_prompt`]).
//! - A chat is first turned into the conversation vLLM builds from the request's messages
//!   (content parts joined or kept as parts depending on the template, tool-call arguments
//!   parsed; see the `conversation` module), rendered with the model's chat template in a
//!   jinja environment set up like transformers' (see the `template` module), and that text
//!   is tokenised *without* special tokens: whatever the template writes (a BOS included)
//!   is all there is ([`Tokenizer::encode_chat`]).
//! - The fallback tokenises text as its bytes and renders chats as `role: content` lines,
//!   honouring `add_generation_prompt` and `continue_final_message` as a template does.
//!
//! **Invariants.** Loading is the only I/O and happens once; a loaded tokenizer is immutable,
//! `Send + Sync`, and meant to be shared behind an `Arc`. Every chat template is compiled at
//! load, so a template minijinja cannot parse fails the load, not a request. The same
//! request gives the same ids every time, except for templates that print the date
//! (`strftime_now`, UTC).
//!
//! **What it does not do.** No network (no hub downloads), no multimodal content (image,
//! audio, video parts are refused), no incremental detokenisation for streams, no
//! truncation, and no Mistral (`tekken`) or tiktoken tokenizers. Exactness is bounded by
//! minijinja's compatibility with jinja2 and by JSON key order: vLLM keeps the client's
//! key order inside objects (tools, tool-call fields), a `serde_json::Value` without
//! serde_json's `preserve_order` feature sorts them, which shows in templates that print
//! whole objects with `tojson`.

mod cache;
mod conversation;
mod error;
mod hf;
mod load;
mod options;
mod prefix;
mod template;

use std::fmt;
use std::path::Path;

use kvroute_protocol::fallback::{self, ChatEnd};
use serde_json::Value as Json;

pub use cache::{BlockChain, Encoded, Lookup, PrefixCache, MIN_CACHED_BYTES};
pub use error::TokenizerError;
pub use options::{ChatFields, ChatOptions};

use hf::HfTokenizer;

/// Tokenises prompts and chats as the engine does. Cheap to share: wrap it in an `Arc`.
pub struct Tokenizer {
    kind: Kind,
}

enum Kind {
    Fallback,
    HuggingFace(Box<HfTokenizer>),
}

impl Tokenizer {
    /// The fallback: bytes as tokens, chats as `role: content` lines.
    pub fn fallback() -> Self {
        Self {
            kind: Kind::Fallback,
        }
    }

    /// Loads a model's tokenizer. `path` is a model directory holding `tokenizer.json`
    /// (and usually `tokenizer_config.json`), or a `tokenizer.json` file whose directory
    /// holds the rest. Compiles the chat templates.
    pub fn load(path: &Path) -> Result<Self, TokenizerError> {
        Ok(Self {
            kind: Kind::HuggingFace(Box::new(HfTokenizer::load(path)?)),
        })
    }

    pub fn is_fallback(&self) -> bool {
        matches!(self.kind, Kind::Fallback)
    }

    /// A completion prompt's ids, with the tokenizer's special tokens (BOS for Llama).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode(text, true)
    }

    /// `text`'s ids, with or without the special tokens the tokenizer's post-processor
    /// adds. The fallback has none.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.kind {
            Kind::Fallback => Ok(fallback::encode(text)),
            Kind::HuggingFace(hf) => hf.encode(text, add_special_tokens),
        }
    }

    /// The text a chat becomes before tokenising: the chat template's rendering of vLLM's
    /// conversation, or the fallback's `role: content` lines (ended as the options say, as
    /// a template would end them). `messages` is the request's `messages` array.
    pub fn render_chat(
        &self,
        messages: &Json,
        options: &ChatOptions<'_>,
    ) -> Result<String, TokenizerError> {
        match &self.kind {
            Kind::Fallback => render_fallback_chat(messages, options),
            Kind::HuggingFace(hf) => hf.render_chat(messages, options),
        }
    }

    /// A chat's ids: [`Self::render_chat`], tokenised without special tokens unless
    /// `options.add_special_tokens`.
    pub fn encode_chat(
        &self,
        messages: &Json,
        options: &ChatOptions<'_>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let text = self.render_chat(messages, options)?;
        self.encode(&text, options.add_special_tokens)
    }

    /// [`Self::encode`] through a prefix cache: the same ids, with the prefix's tokenisation
    /// reused when a prompt goes on from one seen before (see the `cache` module). The
    /// fallback, a prompt under [`MIN_CACHED_BYTES`] and a tokenizer with no safe cut point
    /// are tokenised whole.
    pub fn encode_cached(
        &self,
        text: &str,
        add_special_tokens: bool,
        cache: &PrefixCache,
    ) -> Result<Encoded, TokenizerError> {
        let Kind::HuggingFace(hf) = &self.kind else {
            return Ok(cache.bypass(self.encode(text, add_special_tokens)?));
        };
        let start = match (add_special_tokens, &hf.cuts.special_prefix) {
            (false, _) => &[][..],
            (true, Some(prefix)) => prefix.as_slice(),
            (true, None) => return Ok(cache.bypass(hf.encode(text, true)?)),
        };
        let cuts = if text.len() < MIN_CACHED_BYTES || !hf.cuts.any() {
            Vec::new()
        } else {
            hf.cuts.find(text)
        };
        cache.encode(text, u64::from(add_special_tokens), &cuts, start, |piece| {
            hf.encode(piece, false)
        })
    }

    /// [`Self::encode_chat`] through a prefix cache (see [`Self::encode_cached`]): the chat
    /// template is rendered as always, its text tokenised through the cache.
    pub fn encode_chat_cached(
        &self,
        messages: &Json,
        options: &ChatOptions<'_>,
        cache: &PrefixCache,
    ) -> Result<Encoded, TokenizerError> {
        let text = self.render_chat(messages, options)?;
        self.encode_cached(&text, options.add_special_tokens, cache)
    }

    /// The text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        match &self.kind {
            Kind::Fallback => Ok(fallback::decode(ids)),
            Kind::HuggingFace(hf) => hf.decode(ids),
        }
    }

    /// The number of token ids, added tokens included (`len(tokenizer)`); 256 for the fallback.
    pub fn vocab_size(&self) -> u32 {
        match &self.kind {
            Kind::Fallback => 256,
            Kind::HuggingFace(hf) => hf.vocab_size(),
        }
    }

    /// The id of the configured `eos_token`; `None` for the fallback or when unset.
    pub fn eos_token_id(&self) -> Option<u32> {
        match &self.kind {
            Kind::Fallback => None,
            Kind::HuggingFace(hf) => hf.eos_token_id(),
        }
    }
}

impl Default for Tokenizer {
    fn default() -> Self {
        Self::fallback()
    }
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Fallback => f.write_str("Tokenizer::Fallback"),
            Kind::HuggingFace(hf) => f.debug_tuple("Tokenizer::HuggingFace").field(hf).finish(),
        }
    }
}

/// The fallback chat: each message's role and text (a string, its parts' texts joined with
/// single spaces, or empty for null), through [`fallback::render_chat`], ended as `options`
/// say (`chat_template_kwargs` count as for a template; see the `options` module).
fn render_fallback_chat(
    messages: &Json,
    options: &ChatOptions<'_>,
) -> Result<String, TokenizerError> {
    let end = options.chat_end()?;
    let invalid = |m: &str| TokenizerError::InvalidMessages(m.to_owned());
    let Json::Array(messages) = messages else {
        return Err(invalid("messages must be an array"));
    };
    let mut lines: Vec<(&str, String)> = Vec::with_capacity(messages.len());
    for m in messages {
        let role = m
            .get("role")
            .and_then(Json::as_str)
            .ok_or_else(|| invalid("each message needs a string \"role\""))?;
        let content = match m.get("content") {
            None | Some(Json::Null) => String::new(),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(parts)) => parts
                .iter()
                .filter_map(|p| match p {
                    Json::String(s) => Some(s.as_str()),
                    p => p.get("text").and_then(Json::as_str),
                })
                .collect::<Vec<_>>()
                .join(" "),
            Some(_) => {
                return Err(invalid(
                    "content must be a string, a list of parts, or null",
                ))
            }
        };
        lines.push((role, content));
    }
    if end == ChatEnd::ContinueFinal && lines.is_empty() {
        return Err(TokenizerError::InvalidOptions(
            "continue_final_message is set but there is no message to continue".into(),
        ));
    }
    Ok(fallback::render_chat(
        lines.iter().map(|(r, c)| (*r, c.as_str())),
        end,
    ))
}
