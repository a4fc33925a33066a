//! The gateway's modules stand in the layers `src/lib.rs` names, and the sources keep to the
//! house style's sizes.
//!
//! `lib.rs` declares each top-level module under a `// N. Name.` comment: that is its layer.
//! A module may use (`crate::…`, or `super::…` climbing to the crate root) only modules of
//! its own layer or below, and the modules' graph has no cycle; an item re-exported by
//! `lib.rs` counts as the module it comes from. Test code (`#[cfg(test)]`
//! items, `tests.rs` files) is not counted: a test may reach across the crate.
//!
//! Across the workspace's `crates/*/src`, no file has more than 600 lines before its tests,
//! and no non-test function spans more than 120 lines from its `fn` to its closing brace.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most lines a source file may have before its first `#[cfg(test)]`.
const MAX_FILE_LINES: usize = 600;
/// The most the median source file may have.
const MAX_MEDIAN_LINES: usize = 200;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file below `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// How many lines a file has before its first `#[cfg(test)]` (in code, not in a comment or
/// a string).
fn lines_before_tests(text: &str) -> usize {
    let code = code_only(text);
    code.find("#[cfg(test)]")
        .map_or(code.as_str(), |i| &code[..i])
        .lines()
        .count()
}

/// The code with every `#[cfg(test)]` item blanked out (lines kept): the attribute and the
/// item after it, up to its `;` or the brace that closes its body.
fn without_test_items(code: &str) -> String {
    const ATTR: &str = "#[cfg(test)]";
    let mut out = code.to_owned();
    while let Some(at) = out.find(ATTR) {
        let rest = &out[at + ATTR.len()..];
        let mut depth = 0i32;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            match c {
                '{' | '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        let span = at..at + ATTR.len() + end;
        let blank: String = out[span.clone()]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        out.replace_range(span, &blank);
    }
    out
}

/// The byte spans of the inline `mod name { ... }` blocks in `code`.
fn inline_modules(code: &str) -> Vec<std::ops::Range<usize>> {
    let b = code.as_bytes();
    let mut spans = Vec::new();
    for (at, _) in code.match_indices("mod ") {
        if at > 0 && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_') {
            continue;
        }
        let name = ident(&code[at + 4..]);
        let after = code[at + 4 + name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue;
        }
        let open = code.len() - after.len();
        let mut depth = 0;
        for (i, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        spans.push(open..open + i);
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    spans
}

/// `// N. Name.` then `pub mod x;` lines: each module's layer.
fn layers(lib: &str) -> BTreeMap<String, u32> {
    let mut layer = None;
    let mut out = BTreeMap::new();
    for line in lib.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("// ") {
            if let Some((n, _)) = rest.split_once(". ") {
                layer = n.parse().ok();
            }
        } else if let Some(decl) = line.strip_suffix(';') {
            let Some(name) = decl.split_whitespace().skip_while(|w| *w != "mod").nth(1) else {
                continue;
            };
            let layer = layer.unwrap_or_else(|| panic!("lib.rs: mod {name} is under no layer"));
            out.insert(name.to_owned(), layer);
        }
    }
    out
}

/// `pub use module::{A, B};` lines: each item's module.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in lib.lines().map(str::trim) {
        let Some(path) = line
            .strip_prefix("pub use ")
            .and_then(|l| l.strip_suffix(';'))
        else {
            continue;
        };
        let module = ident(path).to_owned();
        let items = path[module.len()..].trim_start_matches("::");
        let items = items.trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            let name = item.rsplit("::").next().unwrap_or(item).trim();
            let name = name.rsplit(" as ").next().unwrap_or(name).trim();
            out.insert(name.to_owned(), module.clone());
        }
    }
    out
}

/// The code without comments, strings and chars (their bytes become spaces, lines kept).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut String, s: &[u8]| {
        for &c in s {
            out.push(if c == b'\n' { '\n' } else { ' ' });
        }
    };
    while i < b.len() {
        let rest = &b[i..];
        let end = if rest.starts_with(b"//") {
            rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len())
        } else if rest.starts_with(b"/*") {
            rest.windows(2)
                .position(|w| w == b"*/")
                .map_or(rest.len(), |p| p + 2)
        } else if rest.starts_with(b"r#\"") || rest.starts_with(b"r\"") {
            let hashes = rest[1..].iter().take_while(|&&c| c == b'#').count();
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let open = 2 + hashes;
            rest[open..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(rest.len(), |p| open + p + close.len())
        } else if rest[0] == b'"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            (j + 1).min(rest.len())
        } else if rest.len() > 3 && rest[0] == b'\'' && rest[1] == b'\\' {
            // An escaped char literal ('\n', '\'', '\u{..}').
            rest[3..]
                .iter()
                .position(|&c| c == b'\'')
                .map_or(1, |p| p + 4)
        } else if let Some(len) = plain_char_literal(rest) {
            len
        } else {
            out.push(rest[0] as char);
            i += 1;
            continue;
        };
        blank(&mut out, &rest[..end]);
        i += end;
    }
    out
}

/// The length of the unescaped char literal (`'a'`, `'{'`, `'é'`) that `rest` starts with, if
/// it starts with one; a lifetime (`'a`) has no closing quote.
fn plain_char_literal(rest: &[u8]) -> Option<usize> {
    let width = match *rest.get(1)? {
        b'\\' | b'\'' => return None,
        c if c < 0x80 => 1,
        c if c >= 0xf0 => 4,
        c if c >= 0xe0 => 3,
        _ => 2,
    };
    (rest[0] == b'\'' && rest.get(1 + width) == Some(&b'\'')).then_some(2 + width)
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segments of the paths in a `use` group that starts at `s` (after its `{`).
fn group_heads(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut heads) = (0usize, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                heads.push(head(&s[start..]));
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                heads.push(head(&s[start..]));
                start = i + 1;
            }
            _ => {}
        }
    }
    heads.retain(|h| !h.is_empty());
    heads
}

/// The first segment of a path: a name, or `*` for a glob.
fn head(path: &str) -> &str {
    let path = path.trim_start();
    if path.starts_with('*') {
        "*"
    } else {
        ident(path)
    }
}

/// The top-level modules a file refers to, with the line of each reference (`*` for a glob
/// of the crate root, `crate` for a renamed crate root). `depth` is how deep the file's
/// module is below the crate root (1 for `src/foo.rs`); inline `mod x { }` blocks add one.
fn references(code: &str, depth: usize) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let line_of = |i: usize| code[..i].matches('\n').count() + 1;
    let mut push_path = |rest: &str, at: usize| {
        if let Some(group) = rest.strip_prefix('{') {
            for head in group_heads(group) {
                out.push((head.to_owned(), line_of(at)));
            }
        } else {
            let head = head(rest);
            if !head.is_empty() && head != "self" {
                out.push((head.to_owned(), line_of(at)));
            }
        }
    };
    let boundary = |i: usize| {
        i == 0 || !code.as_bytes()[i - 1].is_ascii_alphanumeric() && code.as_bytes()[i - 1] != b'_'
    };
    let modules = inline_modules(code);
    let depth_at = |i: usize| depth + modules.iter().filter(|m| m.contains(&i)).count();
    for (i, _) in code.match_indices("crate") {
        let rest = &code[i + "crate".len()..];
        if !boundary(i) {
            continue;
        }
        if let Some(path) = rest.strip_prefix("::") {
            push_path(path, i);
        } else if rest.trim_start().starts_with("as ") && rest.starts_with(char::is_whitespace) {
            push_path("crate", i);
        }
    }
    for (i, _) in code.match_indices("super::") {
        if !boundary(i) || (i >= 7 && &code[i - 7..i] == "super::") {
            continue;
        }
        let mut rest = &code[i..];
        let mut climbs = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            climbs += 1;
            rest = r;
        }
        if climbs == depth_at(i) {
            push_path(rest, i);
        }
    }
    out
}

/// The top-level module of a file below `src`, and how deep its module is.
fn module_of(src: &Path, file: &Path) -> (String, usize) {
    let rel = file.strip_prefix(src).unwrap();
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    let depth = if parts.last().is_some_and(|p| p == "mod") {
        parts.len() - 1
    } else {
        parts.len()
    };
    (parts[0].clone(), depth)
}

#[test]
fn no_module_imports_from_a_layer_above_it_or_in_a_cycle() {
    let src = src();
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let layers = layers(&lib);
    let reexports = reexports(&lib);
    assert!(layers.len() > 5, "lib.rs names its modules under layers");
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut upward = Vec::new();
    for file in rust_files(&src) {
        let (module, depth) = module_of(&src, &file);
        if matches!(module.as_str(), "lib" | "main") || file.ends_with("tests.rs") {
            continue;
        }
        let Some(&own) = layers.get(&module) else {
            panic!(
                "{}: module {module} is not in lib.rs's layers",
                file.display()
            );
        };
        let text = std::fs::read_to_string(&file).unwrap();
        let code = without_test_items(&code_only(&text));
        for (used, line) in references(&code, depth) {
            let at = format!("{}:{line}", file.strip_prefix(&src).unwrap().display());
            assert!(
                used != "*" && used != "crate",
                "{at}: a glob of the crate root, or the root renamed, hides what {module} uses"
            );
            // A re-export through lib.rs is counted as the module it comes from.
            let used = reexports.get(&used).cloned().unwrap_or(used);
            if used == module {
                continue;
            }
            let Some(&theirs) = layers.get(&used) else {
                panic!("{at}: crate::{used} is neither a module nor a re-export of lib.rs");
            };
            if theirs > own {
                upward.push(format!(
                    "{at}: {module} (layer {own}) uses {used} (layer {theirs})"
                ));
            }
            edges.entry(module.clone()).or_default().insert(used);
        }
    }
    assert!(upward.is_empty(), "upward imports:\n{}", upward.join("\n"));
    if let Some(cycle) = find_cycle(&edges) {
        panic!("modules in a cycle: {}", cycle.join(" -> "));
    }
}

/// A cycle in the graph, as the modules along it, if there is one.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, done, path) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|n| visit(n, edges, &mut done, &mut Vec::new()))
}

#[test]
fn the_checker_sees_imports_in_every_form() {
    let code = code_only(
        "use crate::{a::X, b::{Y, Z}, c};\nuse crate::d;\nfn f() { crate::e::g(); super::h::i(); super::super::j(); }\n// crate::k\nconst S: &str = \"crate::l\";\n",
    );
    let found: Vec<String> = references(&code, 2).into_iter().map(|(m, _)| m).collect();
    assert_eq!(found, ["a", "b", "c", "d", "e", "j"]);
    let found: Vec<String> = references(&code, 1).into_iter().map(|(m, _)| m).collect();
    assert_eq!(found, ["a", "b", "c", "d", "e", "h"]);
    // Test items are left out, and only they; a comment naming them hides nothing.
    let code = without_test_items(&code_only(
        "//! no #[cfg(test)] here\n#[cfg(test)]\nmod tests;\nuse crate::m;\n#[cfg(test)]\nmod t {\n    use crate::n;\n}\n#[cfg(test)]\nconst A: [u8; 2] = crate::o::B;\nfn f() { crate::p::q() }\n",
    ));
    let found: Vec<String> = references(&code, 1).into_iter().map(|(m, _)| m).collect();
    assert_eq!(found, ["m", "p"]);
    // Globs of the root and a renamed root are reported; an inline module climbs one more.
    let code = code_only(
        "use super::*;\nuse crate::{x, *};\nuse crate as root;\nmod inner {\n    use super::super::y;\n}\n",
    );
    let found: Vec<String> = references(&code, 1).into_iter().map(|(m, _)| m).collect();
    assert_eq!(found, ["x", "*", "crate", "*", "y"]);
    let text = "//! #[cfg(test)] in a comment\nfn a() {}\nfn b() {}\n#[cfg(test)]\nmod tests {}\n";
    assert_eq!(lines_before_tests(text), 3);
    let lib = reexports("pub use config::{Args, Settings};\npub use server::Gateway;\n");
    assert_eq!(
        (lib["Args"].as_str(), lib["Settings"].as_str()),
        ("config", "config")
    );
    assert_eq!(lib["Gateway"], "server");
    let mut edges = BTreeMap::new();
    edges.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    edges.insert("b".to_owned(), BTreeSet::from(["c".to_owned()]));
    assert_eq!(find_cycle(&edges), None);
    edges.insert("c".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert_eq!(find_cycle(&edges).unwrap(), ["a", "b", "c", "a"]);
}

#[test]
fn source_files_stay_within_the_house_style() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut sizes = Vec::new();
    let mut long = Vec::new();
    for krate in std::fs::read_dir(crates).unwrap() {
        let src = krate.unwrap().path().join("src");
        if !src.is_dir() {
            continue;
        }
        for file in rust_files(&src) {
            let rel = file.strip_prefix(&src).unwrap();
            if file.ends_with("tests.rs") || rel.iter().any(|p| p == "tests") {
                continue;
            }
            let lines = lines_before_tests(&std::fs::read_to_string(&file).unwrap());
            if lines > MAX_FILE_LINES {
                long.push(format!("{}: {lines} lines", file.display()));
            }
            sizes.push(lines);
        }
    }
    assert!(
        long.is_empty(),
        "over {MAX_FILE_LINES} lines before #[cfg(test)]:\n{}",
        long.join("\n")
    );
    sizes.sort_unstable();
    let median = sizes[sizes.len() / 2];
    assert!(
        median <= MAX_MEDIAN_LINES,
        "median source file: {median} lines"
    );
}

/// The most lines a non-test function may span, from its `fn` line to its closing brace.
const MAX_FN_LINES: usize = 120;

/// A function with a body, as [`functions`] finds it.
#[derive(Debug, PartialEq)]
struct Function {
    name: String,
    /// The line of its `fn` keyword, from 1.
    line: usize,
    /// Lines from the `fn` line to the line of the brace that closes its body, both counted.
    lines: usize,
}

/// Every function with a body in `code` (comments, strings and chars already blanked by
/// [`code_only`]), nested ones included (and counted in their outer function's lines too).
/// A `fn` without a body (in a trait, or `extern`) is left out, and so are `fn(..)` pointer
/// types, which have no name.
fn functions(code: &str) -> Vec<Function> {
    let line_of = |i: usize| code[..i].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (at, _) in code.match_indices("fn") {
        let after = &code[at + 2..];
        let keyword = (at == 0 || !is_ident_byte(code.as_bytes()[at - 1]))
            && after.starts_with(char::is_whitespace);
        let name = ident(after.trim_start());
        if !keyword || name.is_empty() {
            continue;
        }
        let Some(open) = body_start(after).map(|o| at + 2 + o) else {
            continue;
        };
        let Some(close) = closing_brace(code, open) else {
            continue;
        };
        out.push(Function {
            name: name.to_owned(),
            line: line_of(at),
            lines: line_of(close) - line_of(at) + 1,
        });
    }
    out
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Where the body of the function whose signature starts `signature` opens: the first `{`
/// outside parentheses and brackets (generics, `where` clauses and return types hold none),
/// or `None` where a `;` ends the signature first (a declaration without a body).
fn body_start(signature: &str) -> Option<usize> {
    let mut depth = 0i32;
    for (i, c) in signature.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            '{' if depth == 0 => return Some(i),
            ';' | '}' if depth == 0 => return None,
            _ => {}
        }
    }
    None
}

/// The brace that closes the one at `open`.
fn closing_brace(code: &str, open: usize) -> Option<usize> {
    let mut depth = 0;
    for (i, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// The files of the modules a file declares under `#[cfg(test)]` (`#[cfg(test)] mod x;`),
/// with the folder that holds their own submodules.
fn test_module_paths(file: &Path, code: &str) -> Vec<PathBuf> {
    const ATTR: &str = "#[cfg(test)]";
    let stem = file.file_stem().unwrap().to_string_lossy();
    let dir = file.parent().unwrap();
    let dir = if matches!(stem.as_ref(), "lib" | "main" | "mod") {
        dir.to_owned()
    } else {
        dir.join(stem.as_ref())
    };
    let mut out = Vec::new();
    for (at, _) in code.match_indices(ATTR) {
        let Some(decl) = code[at + ATTR.len()..]
            .trim_start()
            .strip_prefix("mod ")
            .or_else(|| {
                code[at + ATTR.len()..]
                    .trim_start()
                    .strip_prefix("pub mod ")
            })
        else {
            continue;
        };
        let name = ident(decl.trim_start());
        if decl.trim_start()[name.len()..]
            .trim_start()
            .starts_with(';')
        {
            out.push(dir.join(format!("{name}.rs")));
            out.push(dir.join(name));
        }
    }
    out
}

#[test]
fn no_function_is_longer_than_120_lines() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let root = crates.parent().unwrap();
    let mut long = Vec::new();
    let mut seen = 0;
    for krate in std::fs::read_dir(crates).unwrap() {
        let src = krate.unwrap().path().join("src");
        if !src.is_dir() {
            continue;
        }
        let files = rust_files(&src);
        let codes: Vec<String> = files
            .iter()
            .map(|f| code_only(&std::fs::read_to_string(f).unwrap()))
            .collect();
        let test_paths: Vec<PathBuf> = files
            .iter()
            .zip(&codes)
            .flat_map(|(f, code)| test_module_paths(f, code))
            .collect();
        for (file, code) in files.iter().zip(&codes) {
            let rel = file.strip_prefix(&src).unwrap();
            let test_file = file
                .file_name()
                .unwrap()
                .to_string_lossy()
                .ends_with("tests.rs")
                || rel.iter().any(|p| p == "tests")
                || test_paths.iter().any(|t| file.starts_with(t));
            if test_file {
                continue;
            }
            for f in functions(&without_test_items(code)) {
                seen += 1;
                if f.lines > MAX_FN_LINES {
                    let path = file.strip_prefix(root).unwrap().display();
                    long.push(format!("{path}:{} {} {} lines", f.line, f.name, f.lines));
                }
            }
        }
    }
    assert!(seen > 500, "the check found only {seen} functions");
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines (split each into named steps):\n{}",
        long.join("\n")
    );
}

#[test]
fn the_function_finder_sees_each_body_to_its_closing_brace() {
    let text = r#"fn outer() {
    fn inner(x: u8) -> u8 {
        x
    }
    let s = "{ not a brace";
    let c = '{';
    let t = ['é','{'];
    let r = r"{\";
    inner(1);
}

pub(crate) fn generic<T: Fn() -> u8, const N: usize>(t: T, a: [u8; N]) -> Result<[u8; N], ()>
where
    T: Clone,
{
    let p: fn(u8) -> u8 = |x| x;
    Ok(a)
}

trait Shape {
    fn area(&self) -> f64;
    fn sides(&self) -> usize {
        0
    }
}
// fn commented() {
// }
"#;
    let found: Vec<(String, usize, usize)> = functions(&code_only(text))
        .into_iter()
        .map(|f| (f.name, f.line, f.lines))
        .collect();
    let expected = [
        ("outer", 1, 10),
        ("inner", 2, 3),
        ("generic", 12, 7),
        ("sides", 22, 3),
    ];
    let expected: Vec<(String, usize, usize)> = expected
        .into_iter()
        .map(|(n, l, c)| (n.to_owned(), l, c))
        .collect();
    assert_eq!(found, expected);
    // A test item's functions are not counted; a test module's file is known by its parent.
    let code = without_test_items(&code_only(
        "fn a() {}\n#[cfg(test)]\nmod t {\n    fn b() {}\n}\n",
    ));
    assert_eq!(functions(&code).len(), 1);
    let paths = test_module_paths(
        Path::new("src/policy.rs"),
        "#[cfg(test)]\nmod snap;\nmod real;\n",
    );
    assert_eq!(
        paths,
        [
            PathBuf::from("src/policy/snap.rs"),
            PathBuf::from("src/policy/snap")
        ]
    );
    let paths = test_module_paths(Path::new("src/lib.rs"), "#[cfg(test)]\nmod tests;\n");
    assert_eq!(
        paths,
        [PathBuf::from("src/tests.rs"), PathBuf::from("src/tests")]
    );
}
