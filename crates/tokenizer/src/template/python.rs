//! Python's text forms of template values, so rendered prompts match jinja2's byte for byte.
//!
//! - [`tojson`] is transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False,
//!   indent=None, separators=None, sort_keys=False)` with those keyword arguments. Unlike
//!   jinja2's own filter it does not escape `<`, `>`, `&`, `'`; without `indent` the
//!   separators are `", "` and `": "`, with it `","` and `": "`.
//! - [`formatter`] prints `{{ x }}` as `str(x)` would: lists and dicts as their Python
//!   `repr` (`['a', 1]`, `{'k': None}`), floats as Python's shortest repr (`1e-05`).
//!   Strings, integers, booleans (`True`) and none (`None`) print as minijinja already
//!   prints them.

use std::fmt::Write;

use kvroute_protocol::python::{float_repr, json_string};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Output, State, Value};

/// The `tojson` filter (see the module docs).
pub(crate) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = kwargs
        .get::<Option<Value>>("ensure_ascii")?
        .is_some_and(|v| v.is_true());
    let sort_keys = kwargs
        .get::<Option<Value>>("sort_keys")?
        .is_some_and(|v| v.is_true());
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(v.as_i64().map_or(0, |n| n.max(0) as usize)),
        }),
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .filter(|p: &Vec<String>| p.len() == 2)
                .ok_or_else(|| invalid("tojson separators must be two strings"))?;
            (parts[0].clone(), parts[1].clone())
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    kwargs.assert_all_used()?;
    let mut dumper = Dumper {
        out: String::new(),
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        sort_keys,
    };
    dumper.dump(value, 0)?;
    Ok(Value::from(dumper.out))
}

struct Dumper {
    out: String,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl Dumper {
    fn dump(&mut self, v: &Value, level: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined => return Err(invalid("Undefined is not JSON serializable")),
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.out.push_str(&number(v, true)),
            ValueKind::String => {
                json_string(&mut self.out, v.as_str().unwrap_or(""), self.ensure_ascii)
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for key in v.try_iter()? {
                    let item = v.get_item(&key)?;
                    entries.push((map_key(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', entries.len(), level, |d, i, lvl| {
                    json_string(&mut d.out, &entries[i].0, d.ensure_ascii);
                    d.out.push_str(&d.key_sep);
                    d.dump(&entries[i].1, lvl)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', items.len(), level, |d, i, lvl| {
                    d.dump(&items[i], lvl)
                })?;
            }
            _ => {
                return Err(invalid(format!(
                    "object of type {} is not JSON serializable",
                    v.kind()
                )))
            }
        }
        Ok(())
    }

    /// Writes `open`, `len` items (each by `item`) and `close`, as Python's encoder lays them out.
    fn container(
        &mut self,
        open: char,
        close: char,
        len: usize,
        level: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        let newline = |d: &Self, lvl: usize| {
            d.indent
                .as_ref()
                .map(|ind| format!("\n{}", ind.repeat(lvl)))
        };
        let inner = newline(self, level + 1);
        if let Some(nl) = &inner {
            self.out.push_str(nl);
        }
        for i in 0..len {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
                if let Some(nl) = &inner {
                    self.out.push_str(nl);
                }
            }
            item(self, i, level + 1)?;
        }
        if let Some(nl) = newline(self, level) {
            self.out.push_str(&nl);
        }
        self.out.push(close);
        Ok(())
    }
}

/// A dict key as `json.dumps` writes it: strings as they are, others converted.
fn map_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or("").to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number => number(key, true),
        _ => {
            return Err(invalid(format!(
                "keys must be str, int, float, bool or None, not {}",
                key.kind()
            )))
        }
    })
}

/// A number as Python writes it; `json` selects `NaN`/`Infinity` over `nan`/`inf`.
fn number(v: &Value, json: bool) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(f) => float_repr(f, json),
        Err(_) => v.to_string(),
    }
}

/// The output formatter: Python's `str()` for lists, dicts and floats (see the module docs).
pub(crate) fn formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            repr(&mut s, value)?;
            out.write_str(&s).map_err(Error::from)
        }
        ValueKind::Number if !value.is_integer() => {
            out.write_str(&number(value, false)).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a value.
fn repr(out: &mut String, v: &Value) -> Result<(), Error> {
    match v.kind() {
        ValueKind::String => str_repr(out, v.as_str().unwrap_or("")),
        ValueKind::Number => out.push_str(&number(v, false)),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr(out, &key)?;
                out.push_str(": ");
                repr(out, &v.get_item(&key)?)?;
            }
            out.push('}');
        }
        // None, True/False and the rest print as minijinja prints them.
        _ => {
            let _ = write!(out, "{v}");
        }
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`; control and other
/// non-printable characters escaped (an approximation of `str.isprintable` for the common ones).
fn str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        let n = c as u32;
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            _ if n < 0x20 || (0x7f..=0xa0).contains(&n) || n == 0xad => {
                let _ = write!(out, "\\x{n:02x}");
            }
            _ if (0x2000..=0x200f).contains(&n)
                || (0x2028..=0x202f).contains(&n)
                || (0x205f..=0x2064).contains(&n)
                || n == 0x3000
                || n == 0xfeff =>
            {
                let _ = write!(out, "\\u{n:04x}");
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.set_formatter(formatter);
        env.render_str(src, ctx).unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.5, null, true], "a": "<é\n\"", "e": {}, "f": [], "g": 1e-7}"#,
        )
        .unwrap();
        let ctx = Value::from_iter([("v", v)]);
        assert_eq!(
            render("{{ v|tojson }}", ctx.clone()),
            r#"{"b": [1, 2.5, null, true], "a": "<é\n\"", "e": {}, "f": [], "g": 1e-07}"#
        );
        assert_eq!(
            render("{{ v.b|tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.5,\n  null,\n  true\n]"
        );
        assert_eq!(
            render(
                "{{ v|tojson(separators=(',', ':'), sort_keys=true, ensure_ascii=true) }}",
                ctx
            ),
            r#"{"a":"<\u00e9\n\"","b":[1,2.5,null,true],"e":{},"f":[],"g":1e-07}"#
        );
    }

    #[test]
    fn printing_matches_python_str() {
        let v: Value =
            serde_json::from_str(r#"{"k": ["it's", "a\"b", 1.0, null, false, {"x": 0.0001}]}"#)
                .unwrap();
        let ctx = Value::from_iter([("v", v)]);
        assert_eq!(
            render("{{ v }} {{ v.k[2] }} {{ v.k[3] }} {{ v.k[4] }}", ctx),
            r#"{'k': ["it's", 'a"b', 1.0, None, False, {'x': 0.0001}]} 1.0 None False"#
        );
        assert_eq!(float_repr(1e16, false), "1e+16");
        assert_eq!(float_repr(123456.0, false), "123456.0");
        assert_eq!(float_repr(-0.0, false), "-0.0");
    }
}
