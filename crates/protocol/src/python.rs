//! Python's text forms of JSON values, where kvroute must write what Python writes: the
//! engines' chat templates render `tojson` as `json.dumps` does (the tokenizer), and vLLM
//! writes a tool call's arguments with `json.dumps` (Anthropic's Messages, [`crate::anthropic`]).

use std::fmt::Write;

/// Python's `repr(float)`: the shortest round-tripping digits, in exponent form when the
/// exponent is below -4 or at least 16 (`1e-05`, `1e+16`), else positional with `.0`.
pub fn float_repr(f: f64, json: bool) -> String {
    if f.is_nan() {
        return (if json { "NaN" } else { "nan" }).to_owned();
    }
    if f.is_infinite() {
        let inf = if json { "Infinity" } else { "inf" };
        return if f < 0.0 {
            format!("-{inf}")
        } else {
            inf.to_owned()
        };
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if f != 0.0 && !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let mut s = f.to_string();
    if !s.contains('.') {
        s.push_str(".0");
    }
    s
}

/// A JSON string literal as Python's `json` module writes it.
pub fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
