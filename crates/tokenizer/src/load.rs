//! Finding and reading a model's tokenizer files, as `transformers` does.
//!
//! - `tokenizer.json` is required; `tokenizer_config.json`, `special_tokens_map.json` and
//!   `chat_template.jinja` beside it are optional.
//! - The chat template: `chat_template.jinja` if present (transformers lets that file
//!   override the config), else `tokenizer_config.json`'s `chat_template`, a string or a list
//!   of `{name, template}`.
//! - Special tokens (`bos_token`, `eos_token`, ...) are strings or `{"content": ...}` objects;
//!   `special_tokens_map.json` fills in the ones `tokenizer_config.json` does not set.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::TokenizerError;

/// The special tokens a chat template sees as variables (transformers' `special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Where a model's tokenizer files are.
#[derive(Debug)]
pub(crate) struct ModelFiles {
    pub tokenizer_json: PathBuf,
    dir: PathBuf,
}

impl ModelFiles {
    /// `path` is a model directory holding `tokenizer.json`, or a `tokenizer.json` file.
    pub fn locate(path: &Path) -> Result<Self, TokenizerError> {
        if path.is_dir() {
            let tokenizer_json = path.join("tokenizer.json");
            if !tokenizer_json.is_file() {
                return Err(TokenizerError::MissingTokenizerJson {
                    dir: path.to_path_buf(),
                });
            }
            return Ok(Self {
                tokenizer_json,
                dir: path.to_path_buf(),
            });
        }
        if !path.is_file() {
            return Err(TokenizerError::NotFound {
                path: path.to_path_buf(),
            });
        }
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        Ok(Self {
            tokenizer_json: path.to_path_buf(),
            dir,
        })
    }

    fn sibling(&self, name: &str) -> Option<PathBuf> {
        let p = self.dir.join(name);
        p.is_file().then_some(p)
    }
}

/// What `tokenizer_config.json` and its companions say, beyond `tokenizer.json`.
#[derive(Debug, Default)]
pub(crate) struct TokenizerConfig {
    /// `(variable, token text)` for each special token that is set.
    pub special_tokens: Vec<(&'static str, String)>,
    /// `additional_special_tokens`, as texts.
    pub additional_special_tokens: Vec<String>,
    /// `(name, source)`; a lone template is named `default`.
    pub templates: Vec<(String, String)>,
    /// The file the templates came from, for error messages.
    pub template_path: PathBuf,
    pub clean_up_tokenization_spaces: bool,
}

impl TokenizerConfig {
    pub fn read(files: &ModelFiles) -> Result<Self, TokenizerError> {
        let mut out = TokenizerConfig::default();
        if let Some(path) = files.sibling("tokenizer_config.json") {
            let config = read_json(&path)?;
            out.read_special_tokens(&config, &path)?;
            out.clean_up_tokenization_spaces = config
                .get("clean_up_tokenization_spaces")
                .and_then(Json::as_bool)
                .unwrap_or(false);
            out.templates = templates_from_config(&config, &path)?;
            out.template_path = path;
        }
        if let Some(path) = files.sibling("special_tokens_map.json") {
            let map = read_json(&path)?;
            out.read_special_tokens(&map, &path)?;
        }
        if let Some(path) = files.sibling("chat_template.jinja") {
            let source = fs::read_to_string(&path).map_err(|source| TokenizerError::Read {
                path: path.clone(),
                source,
            })?;
            out.templates = vec![("default".to_owned(), source)];
            out.template_path = path;
        }
        Ok(out)
    }

    /// Takes the special tokens `json` sets that are not set yet.
    fn read_special_tokens(&mut self, json: &Json, path: &Path) -> Result<(), TokenizerError> {
        for key in SPECIAL_TOKENS {
            if self.special_tokens.iter().any(|(k, _)| *k == key) {
                continue;
            }
            if let Some(text) = token_text(json.get(key), key, path)? {
                self.special_tokens.push((key, text));
            }
        }
        if self.additional_special_tokens.is_empty() {
            if let Some(Json::Array(tokens)) = json.get("additional_special_tokens") {
                for t in tokens {
                    let text = token_text(Some(t), "additional_special_tokens", path)?;
                    self.additional_special_tokens.extend(text);
                }
            }
        }
        Ok(())
    }

    pub fn special_token(&self, key: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn read_json(path: &Path) -> Result<Json, TokenizerError> {
    let bytes = fs::read(path).map_err(|source| TokenizerError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| TokenizerError::InvalidJson {
        path: path.to_path_buf(),
        source,
    })
}

/// A special token's text: a string, or an AddedToken object's `content`; null is unset.
fn token_text(
    value: Option<&Json>,
    key: &str,
    path: &Path,
) -> Result<Option<String>, TokenizerError> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(o)) => match o.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(invalid(path, format!("{key} has no string \"content\""))),
        },
        Some(_) => Err(invalid(
            path,
            format!("{key} must be a string or an object with \"content\""),
        )),
    }
}

fn templates_from_config(
    config: &Json,
    path: &Path,
) -> Result<Vec<(String, String)>, TokenizerError> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::String(s)) => Ok(vec![("default".to_owned(), s.clone())]),
        Some(Json::Array(list)) => list
            .iter()
            .map(|entry| {
                let name = entry.get("name").and_then(Json::as_str);
                let template = entry.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some(n), Some(t)) => Ok((n.to_owned(), t.to_owned())),
                    _ => Err(invalid(
                        path,
                        "each chat_template entry needs a string \"name\" and \"template\"".into(),
                    )),
                }
            })
            .collect(),
        Some(_) => Err(invalid(
            path,
            "chat_template must be a string or a list of {name, template}".into(),
        )),
    }
}

fn invalid(path: &Path, message: String) -> TokenizerError {
    TokenizerError::InvalidConfig {
        path: path.to_path_buf(),
        message,
    }
}
