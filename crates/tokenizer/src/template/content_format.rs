//! vLLM's chat-template content format: does the template loop over a message's content?
//!
//! vLLM (`_detect_content_format`, `--chat-template-content-format auto`) walks the jinja2
//! AST. A template is **openai** when it has a `{% for x in M['content'] %}` (or
//! `M.content`, optionally sliced or filtered) where `M` is the target of a
//! `{% for M in messages %}` loop, `messages` being the variable itself or one assigned from
//! it (`{% set loop_messages = messages[1:] %}`); otherwise it is **string**. vLLM then hands
//! an openai template content as a list of `{"type": "text", "text": ...}` parts and a
//! string template content as the text parts joined with `\n`.
//!
//! This is the same search over the template's `{% for %}` and `{% set %}` tags, done on the
//! tag text rather than on an AST.

/// How a message's content reaches the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// A string: the text parts joined with `\n`.
    String,
    /// A list of parts, `{"type": "text", "text": ...}`.
    OpenAi,
}

/// The content format vLLM's auto-detection picks for `source`.
pub(crate) fn detect(source: &str) -> ContentFormat {
    let tags = block_tags(source);
    let mut messages_vars = vec!["messages".to_owned()];
    // vLLM's breadth-first search over assignments from a messages variable.
    let mut i = 0;
    while i < messages_vars.len() {
        for tag in &tags {
            if let Some((lhs, rhs)) = parse_set(tag) {
                if base(rhs) == messages_vars[i] && !messages_vars.iter().any(|v| v == lhs) {
                    messages_vars.push(lhs.to_owned());
                }
            }
        }
        i += 1;
    }
    let loops: Vec<(&str, &str)> = tags.iter().filter_map(|t| parse_for(t)).collect();
    let message_vars: Vec<&str> = loops
        .iter()
        .filter(|(_, iter)| messages_vars.iter().any(|v| v == base(iter)))
        .map(|(target, _)| *target)
        .collect();
    let loops_over_content = loops.iter().any(|(_, iter)| {
        let b = base(iter);
        message_vars.iter().any(|m| is_content_of(b, m))
    });
    if loops_over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// The bodies of `{% ... %}` tags, without whitespace-control marks.
fn block_tags(source: &str) -> Vec<&str> {
    let mut tags = Vec::new();
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("%}") else { break };
        let body = after[..end].trim_start_matches(['-', '+']);
        let body = body.trim_end_matches(['-', '+']).trim();
        tags.push(body);
        rest = &after[end + 2..];
    }
    tags
}

/// `for TARGET in ITER [if ...] [recursive]` as `(TARGET, ITER...)`; single-name targets only.
fn parse_for(tag: &str) -> Option<(&str, &str)> {
    let rest = tag.strip_prefix("for")?;
    if !rest.starts_with(char::is_whitespace) {
        return None;
    }
    let (target, iter) = rest.split_once(" in ")?;
    let target = target.trim();
    is_identifier(target).then_some((target, iter.trim()))
}

/// `set NAME = EXPR` as `(NAME, EXPR)`.
fn parse_set(tag: &str) -> Option<(&str, &str)> {
    let rest = tag.strip_prefix("set")?;
    if !rest.starts_with(char::is_whitespace) {
        return None;
    }
    let (lhs, rhs) = rest.split_once('=')?;
    let lhs = lhs.trim();
    (is_identifier(lhs) && !rhs.starts_with('=')).then_some((lhs, rhs.trim()))
}

/// The part of an expression vLLM looks through filters, tests and slices to reach:
/// `messages[1:] | selectattr(...)` is `messages`.
fn base(expr: &str) -> &str {
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    let mut end = expr.len();
    for (i, c) in expr.char_indices() {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '\'' | '"' => quote = Some(c),
            '[' | '(' | '{' => depth += 1,
            ']' | ')' | '}' => depth -= 1,
            '|' if depth == 0 => {
                end = i;
                break;
            }
            c if depth == 0 && c.is_whitespace() => {
                let next = &expr[i + 1..];
                if ["if ", "is ", "recursive"]
                    .iter()
                    .any(|k| next.starts_with(k))
                {
                    end = i;
                    break;
                }
            }
            _ => {}
        }
    }
    let mut b = expr[..end].trim();
    // Strip trailing slices: `x[1:]`, `x[::-1]`.
    while b.ends_with(']') {
        let Some(open) = b.rfind('[') else { break };
        if !b[open..].contains(':') {
            break;
        }
        b = b[..open].trim_end();
    }
    b
}

/// `expr` is `message['content']`, `message["content"]` or `message.content`.
fn is_content_of(expr: &str, message: &str) -> bool {
    let Some(rest) = expr.strip_prefix(message) else {
        return false;
    };
    let rest = rest.trim_start();
    if let Some(attr) = rest.strip_prefix('.') {
        return attr.trim() == "content";
    }
    let Some(inner) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(']')) else {
        return false;
    };
    matches!(inner.trim(), "'content'" | "\"content\"")
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_templates() {
        for t in [
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
            "{% for m in messages %}{% for c in other['content'] %}{% endfor %}{% endfor %}",
            "{% for i in range(messages|length) %}{% endfor %}",
            "no tags at all",
        ] {
            assert_eq!(detect(t), ContentFormat::String, "{t}");
        }
    }

    #[test]
    fn openai_templates() {
        for t in [
            "{% for message in messages %}{% for part in message['content'] %}{% endfor %}{% endfor %}",
            "{%- for m in messages -%}{%- for p in m.content | selectattr('type', 'equalto', 'text') -%}{%- endfor -%}{%- endfor -%}",
            "{% set loop_messages = messages[1:] %}{% set lm = loop_messages %}{% for m in lm %}{% for c in m[\"content\"] if c.type == 'text' %}{% endfor %}{% endfor %}",
            "{% for m in messages|reverse %}{% for c in m['content'][1:] %}{% endfor %}{% endfor %}",
        ] {
            assert_eq!(detect(t), ContentFormat::OpenAi, "{t}");
        }
    }

    #[test]
    fn base_sees_through_filters_and_slices() {
        assert_eq!(base("messages[1:] | selectattr('role')"), "messages");
        assert_eq!(base("m['content'] if x"), "m['content']");
        assert_eq!(base("messages recursive"), "messages");
        assert_eq!(base("messages[0]"), "messages[0]");
    }
}
