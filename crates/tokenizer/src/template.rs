//! A model's chat templates, compiled once into a minijinja environment set up like
//! transformers' jinja2 one (`_compile_jinja_template`):
//!
//! - `trim_blocks`, `lstrip_blocks`, no trailing newline kept, no autoescape;
//! - loop controls (`{% break %}`, `{% continue %}`), and `{% generation %}` blocks rendered
//!   as their body (transformers' `AssistantTracker` does that when not tracking);
//! - `raise_exception(msg)`, `strftime_now(fmt)` and transformers' `tojson` (no HTML
//!   escaping, Python's separators, `indent`/`separators`/`sort_keys`/`ensure_ascii`);
//! - Python string/dict/list methods (`.strip()`, `.items()`, ...) from minijinja-contrib's
//!   pycompat, and Python's `str()` when printing lists, dicts and floats.
//!
//! Known gaps against jinja2: behaviour minijinja does not share (for instance `|string` of
//! a list, Python tuples) renders differently; a template minijinja cannot parse is refused
//! at load.

mod content_format;
mod python;
mod strftime;

use std::borrow::Cow;
use std::fmt;
use std::path::Path;

use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};

pub use content_format::ContentFormat;

use crate::TokenizerError;

/// The compiled templates, by name, each with its vLLM content format.
pub(crate) struct ChatTemplates {
    env: Environment<'static>,
    templates: Vec<(String, ContentFormat)>,
}

impl fmt::Debug for ChatTemplates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.templates.iter().map(|(n, c)| (n, c)))
            .finish()
    }
}

impl ChatTemplates {
    /// Compiles `(name, source)` templates; `path` names their file in errors.
    pub fn compile(templates: Vec<(String, String)>, path: &Path) -> Result<Self, TokenizerError> {
        let mut env = environment();
        let mut compiled = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            let format = content_format::detect(&source);
            let source = rewrite_generation_tags(&source).into_owned();
            env.add_template_owned(name.clone(), source)
                .map_err(|source| TokenizerError::TemplateSyntax {
                    path: path.to_path_buf(),
                    name: name.clone(),
                    source,
                })?;
            compiled.push((name, format));
        }
        Ok(Self {
            env,
            templates: compiled,
        })
    }

    /// transformers' choice: `tool_use` when tools are given and it exists, else `default`
    /// (a lone template is named `default`).
    pub fn select(&self, with_tools: bool) -> Result<(&str, ContentFormat), TokenizerError> {
        let find = |name: &str| self.templates.iter().find(|(n, _)| n == name);
        let found = (if with_tools { find("tool_use") } else { None }).or_else(|| find("default"));
        match found {
            Some((name, format)) => Ok((name.as_str(), *format)),
            None if self.templates.is_empty() => Err(TokenizerError::NoChatTemplate),
            None => Err(TokenizerError::NoDefaultChatTemplate),
        }
    }

    /// Whether template `name`'s source contains `text` (transformers checks that the
    /// template mentions `content` before continuing a final message).
    pub fn source_contains(&self, name: &str, text: &str) -> bool {
        self.env
            .get_template(name)
            .is_ok_and(|t| t.source().contains(text))
    }

    pub fn render(&self, name: &str, ctx: Value) -> Result<String, TokenizerError> {
        self.env
            .get_template(name)
            .and_then(|t| t.render(ctx))
            .map_err(render_error)
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python::formatter);
    env.add_filter("tojson", python::tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |format: &str| {
        strftime::strftime_now(format)
    });
    env
}

/// What `raise_exception` raises, found again in the error's sources.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = message.to_string();
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn render_error(err: Error) -> TokenizerError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(Raised(message)) = e.downcast_ref::<Raised>() {
            return TokenizerError::TemplateRaised(message.clone());
        }
        source = e.source();
    }
    TokenizerError::TemplateRender { source: err }
}

/// `{% generation %}` / `{% endgeneration %}` become `{% if true %}` / `{% endif %}`, keeping
/// their whitespace-control marks, so the body renders as transformers renders it.
fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return Cow::Owned(out);
        };
        let (whole, after) = tag.split_at(end + 2);
        let inner = &whole[2..whole.len() - 2];
        let open_mark = inner.strip_prefix(['-', '+']).map_or("", |_| &inner[..1]);
        let body = &inner[open_mark.len()..];
        let close_mark = body
            .strip_suffix(['-', '+'])
            .map_or("", |_| &body[body.len() - 1..]);
        let word = body[..body.len() - close_mark.len()].trim();
        match word {
            "generation" => out.push_str(&format!("{{%{open_mark} if true {close_mark}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{open_mark} endif {close_mark}%}}")),
            _ => out.push_str(whole),
        }
        rest = after;
    }
    out.push_str(rest);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(src: &str) -> ChatTemplates {
        ChatTemplates::compile(vec![("default".into(), src.into())], Path::new("t")).unwrap()
    }

    #[test]
    fn generation_tags_render_their_body() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}c"),
            "a{%- if true -%}b{% endif %}c"
        );
        let t = compile(
            "{% for m in messages %}{% generation %}\n{{ m }}\n{% endgeneration %}{% endfor %}",
        );
        let ctx = Value::from_iter([("messages", Value::from(vec!["x", "y"]))]);
        assert_eq!(t.render("default", ctx).unwrap(), "x\ny\n");
    }

    #[test]
    fn hf_environment_features() {
        let t = compile(
            "{%- for m in messages -%}\n  {%- if loop.index0 == 1 %}{% break %}{% endif -%}\n  \
             [{{ m.strip().upper() }}]\n{% endfor %}{{ strftime_now('%Y')|length }}",
        );
        let ctx = Value::from_iter([("messages", Value::from(vec![" a ", "b"]))]);
        assert_eq!(t.render("default", ctx).unwrap(), "[A]\n4");
    }

    #[test]
    fn raise_exception_is_reported_as_raised() {
        let t = compile("{{ raise_exception('only user and assistant roles') }}");
        let err = t.render("default", Value::UNDEFINED).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::TemplateRaised(m) if m == "only user and assistant roles"),
            "{err:?}"
        );
    }

    #[test]
    fn template_selection_follows_transformers() {
        let named = |names: &[&str]| {
            let ts = names
                .iter()
                .map(|n| (n.to_string(), "x".to_string()))
                .collect();
            ChatTemplates::compile(ts, Path::new("t")).unwrap()
        };
        assert_eq!(
            named(&["default", "tool_use"]).select(true).unwrap().0,
            "tool_use"
        );
        assert_eq!(
            named(&["default", "tool_use"]).select(false).unwrap().0,
            "default"
        );
        assert_eq!(named(&["default"]).select(true).unwrap().0, "default");
        assert!(matches!(
            named(&["rag"]).select(false),
            Err(TokenizerError::NoDefaultChatTemplate)
        ));
        assert!(matches!(
            named(&[]).select(false),
            Err(TokenizerError::NoChatTemplate)
        ));
    }
}
