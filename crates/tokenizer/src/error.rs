//! The crate's one error type.

use std::path::PathBuf;

/// Why a tokenizer could not be loaded, or a request could not be tokenised.
///
/// Load errors (`NotFound` .. `TemplateSyntax`) happen once, at start; the others are per
/// request and are the client's doing unless the template itself is at fault
/// (`TemplateRender`), and none of them is helped by retrying the same request.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer path {path} does not exist")]
    NotFound { path: PathBuf },
    #[error("tokenizer directory {dir} has no tokenizer.json")]
    MissingTokenizerJson { dir: PathBuf },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    InvalidJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path} is not a tokenizer the `tokenizers` crate can load: {source}")]
    InvalidTokenizer {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    #[error("{path}: {message}")]
    InvalidConfig { path: PathBuf, message: String },
    #[error("chat template {name:?} from {path} has a syntax error: {source}")]
    TemplateSyntax {
        path: PathBuf,
        name: String,
        #[source]
        source: minijinja::Error,
    },
    #[error("the model has no chat template (neither tokenizer_config.json nor chat_template.jinja defines one)")]
    NoChatTemplate,
    #[error("the model has several chat templates and none is named \"default\"")]
    NoDefaultChatTemplate,
    #[error("invalid chat messages: {0}")]
    InvalidMessages(String),
    #[error("unsupported chat content part type {0:?}: only text parts can be tokenised here")]
    UnsupportedContentPart(String),
    #[error("invalid chat options: {0}")]
    InvalidOptions(String),
    #[error("chat template raised an exception: {0}")]
    TemplateRaised(String),
    #[error("cannot render the chat template: {source}")]
    TemplateRender {
        #[source]
        source: minijinja::Error,
    },
    #[error("tokenizer failed: {source}")]
    Tokenize {
        #[source]
        source: tokenizers::Error,
    },
}
