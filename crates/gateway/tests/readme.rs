//! The README's first code block is the two commands a newcomer runs: the router on its
//! embedded default, then the test command, which is what CI runs (`.ci/run`).

use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The lines of the first fenced block of `text`, with its info string.
fn first_block(text: &str) -> (String, Vec<String>) {
    let mut lines = text.lines();
    let info = lines
        .by_ref()
        .find_map(|l| l.strip_prefix("```"))
        .expect("a fenced code block")
        .to_owned();
    let body = lines
        .take_while(|l| !l.starts_with("```"))
        .map(str::to_owned)
        .collect();
    (info, body)
}

#[test]
fn the_readme_opens_with_the_run_and_the_test_command() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let (info, lines) = first_block(&readme);
    assert_eq!(info, "sh");
    assert_eq!(
        lines,
        ["cargo run --release -p kvroute-gateway", ".ci/run"],
        "exactly the run command, then the test command"
    );
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(ci.starts_with("#!"), ".ci/run is a script");
    for step in [
        "cargo fmt --all -- --check",
        "cargo clippy --workspace --all-targets -- -D warnings",
        "cargo test --workspace",
        ".ci/manifests.sh",
    ] {
        assert!(ci.contains(step), ".ci/run runs {step}");
    }
}

#[test]
fn first_block_reads_the_first_fence_only() {
    let (info, lines) = first_block("# t\n\ntext\n```sh\na\nb\n```\n```sh\nc\n```\n");
    assert_eq!(
        (info.as_str(), lines),
        ("sh", vec!["a".to_owned(), "b".to_owned()])
    );
}

// ---- Links and anchors -------------------------------------------------------------------
//
// Every relative link in the top-level pages and in docs/ must lead to a file that exists, and
// every anchor (`#x`, `page.md#x`) to a heading of its page, by GitHub's slug rules.

/// The pages whose links are checked: every `*.md` at the root and in `docs/`.
fn pages() -> Vec<PathBuf> {
    let mut pages = Vec::new();
    for dir in [root(), root().join("docs")] {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    pages
}

/// `text` with every fenced block's lines (fences included) blanked, so that offsets and line
/// numbers stay those of the file.
fn without_fences(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fence: Option<String> = None;
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let marker: String = trimmed
            .chars()
            .take_while(|&c| c == '`' || c == '~')
            .collect();
        let opens = marker.len() >= 3 && marker.chars().all(|c| c == marker.as_bytes()[0] as char);
        let blank = match &fence {
            Some(open) => {
                if opens
                    && marker.starts_with(open.as_str())
                    && trimmed[marker.len()..].trim().is_empty()
                {
                    fence = None;
                }
                true
            }
            None if opens => {
                fence = Some(marker);
                true
            }
            None => false,
        };
        if blank {
            out.extend(line.chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
        } else {
            out.push_str(line);
        }
    }
    out
}

/// `text` with every inline code span blanked (a run of backticks up to the next run of the
/// same length; an unmatched run is text).
fn without_code_spans(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = bytes.to_vec();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let run = bytes[i..].iter().take_while(|&&b| b == b'`').count();
        let mut j = i + run;
        let mut close = None;
        while j < bytes.len() {
            if bytes[j] == b'`' {
                let r = bytes[j..].iter().take_while(|&&b| b == b'`').count();
                if r == run {
                    close = Some(j + r);
                    break;
                }
                j += r;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                for b in &mut out[i..end] {
                    if *b != b'\n' {
                        *b = b' ';
                    }
                }
                i = end;
            }
            None => i += run,
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

/// The targets of the links and images of a markdown text outside code, each with its line:
/// `[text](target)`, `![alt](target)` and `[label]: target`, the target without its title.
fn links(text: &str) -> Vec<(usize, String)> {
    let text = without_code_spans(&without_fences(text));
    let line_of = |at: usize| text[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find("](") {
        let start = from + i + 2;
        let rest = &text[start..];
        let end = rest.find(')').unwrap_or(rest.len());
        let target = rest[..end].split_whitespace().next().unwrap_or("");
        let target = target.trim_start_matches('<').trim_end_matches('>');
        out.push((line_of(start), target.to_owned()));
        from = start;
    }
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix('[') {
            if let Some((label, def)) = rest.split_once("]:") {
                if !label.is_empty() && !label.contains(']') {
                    if let Some(target) = def.split_whitespace().next() {
                        out.push((line_of(at), target.to_owned()));
                    }
                }
            }
        }
        at += line.len();
    }
    out.sort();
    out
}

/// GitHub's anchor for a heading's text: markup dropped (code spans keep their text, links
/// their text), lowercased, every character but letters, digits, `-`, `_` and spaces
/// removed, each space a `-`.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // A link keeps its text: `[text](url)` -> `text`.
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        match after
            .find("](")
            .and_then(|close| after[close..].find(')').map(|end| (close, close + end)))
        {
            Some((close, end)) => {
                text.push_str(&rest[..open]);
                text.push_str(&after[..close]);
                rest = &after[end + 1..];
            }
            None => {
                text.push_str(&rest[..=open]);
                rest = after;
            }
        }
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a markdown text's ATX headings, outside fenced blocks, in order; a repeated
/// slug gets `-1`, `-2`, ... as GitHub numbers them.
fn anchors(text: &str) -> Vec<String> {
    let mut seen = std::collections::HashMap::<String, usize>::new();
    let mut out = Vec::new();
    for line in without_fences(text).lines() {
        let t = line.trim_start_matches(' ');
        if line.len() - t.len() > 3 {
            continue;
        }
        let level = t.chars().take_while(|&c| c == '#').count();
        if level == 0 || level > 6 {
            continue;
        }
        let body = &t[level..];
        if !(body.is_empty() || body.starts_with(' ') || body.starts_with('\t')) {
            continue;
        }
        // A closing run of `#` after a space is not part of the text.
        let body = body.trim();
        let body = match body.trim_end_matches('#') {
            b if b.len() < body.len() && (b.is_empty() || b.ends_with(' ')) => b,
            _ => body,
        };
        let base = slug(body);
        let n = seen.entry(base.clone()).or_insert(0);
        out.push(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// `%XX` escapes of an anchor or a path decoded.
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Some(v) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What is wrong with one link of `page`, or None when it resolves.
fn broken(page: &std::path::Path, target: &str) -> Option<String> {
    let lower = target.to_ascii_lowercase();
    if ["http://", "https://", "mailto:"]
        .iter()
        .any(|p| lower.starts_with(p))
    {
        return None;
    }
    if target.is_empty() {
        return Some("an empty link".to_owned());
    }
    if target.starts_with('/') || target.contains("://") {
        return Some("not a relative link".to_owned());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(percent_decoded(a))),
        None => (target, None),
    };
    let file = if path.is_empty() {
        page.to_path_buf()
    } else {
        page.parent().unwrap().join(percent_decoded(path))
    };
    let Ok(file) = file.canonicalize() else {
        return Some(format!("no such file: {path}"));
    };
    if !file.starts_with(root().canonicalize().unwrap()) {
        return Some(format!("outside the repository: {path}"));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|e| e != "md") {
        return None; // a line anchor into source (`#L10`) is GitHub's, not a heading's
    }
    let text = std::fs::read_to_string(&file).ok()?;
    let known = anchors(&text);
    if known.contains(&anchor) {
        None
    } else {
        Some(format!(
            "no heading with the anchor #{anchor} in {}",
            file.display()
        ))
    }
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page
            .strip_prefix(root())
            .unwrap_or(&page)
            .display()
            .to_string();
        for (line, target) in links(&text) {
            checked += 1;
            if let Some(why) = broken(&page, &target) {
                problems.push(format!("{name}:{line}: ({target}) {why}"));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the extractor broken?"
    );
    assert!(
        problems.is_empty(),
        "{} broken links or anchors:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn the_readme_is_a_front_page_of_at_most_300_lines() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines: move reference to a page under docs/ and link it"
    );
}

/// The cells of a table row: split on pipes that are not escaped (GitHub splits on a pipe
/// inside a code span too, so `\|` is the only way to keep one in a cell).
fn cells(row: &str) -> usize {
    let row = row.trim();
    let row = row.strip_prefix('|').unwrap_or(row);
    let row = row
        .strip_suffix('|')
        .filter(|r| !r.ends_with('\\'))
        .unwrap_or(row);
    let mut n = 1;
    let mut escaped = false;
    for c in row.chars() {
        match c {
            '\\' if !escaped => escaped = true,
            '|' if !escaped => n += 1,
            _ => escaped = false,
        }
    }
    n
}

#[test]
fn every_table_row_has_its_headers_column_count() {
    let mut problems = Vec::new();
    let mut tables = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page
            .strip_prefix(root())
            .unwrap_or(&page)
            .display()
            .to_string();
        let plain = without_fences(&text);
        let rows: Vec<&str> = plain.lines().collect();
        let mut i = 0;
        while i + 1 < rows.len() {
            let is_rule = |l: &str| {
                let l = l.trim();
                l.starts_with('|') && l.contains("---") && l.chars().all(|c| "|-: ".contains(c))
            };
            if rows[i].trim_start().starts_with('|') && is_rule(rows[i + 1]) {
                tables += 1;
                let want = cells(rows[i]);
                if cells(rows[i + 1]) != want {
                    problems.push(format!(
                        "{name}:{}: the rule has {} cells, the header {want}",
                        i + 2,
                        cells(rows[i + 1])
                    ));
                }
                let mut j = i + 2;
                while j < rows.len() && rows[j].trim_start().starts_with('|') {
                    let got = cells(rows[j]);
                    if got != want {
                        problems.push(format!(
                            "{name}:{}: {got} cells, the header has {want}",
                            j + 1
                        ));
                    }
                    j += 1;
                }
                i = j;
            } else {
                i += 1;
            }
        }
    }
    assert!(
        tables > 20,
        "only {tables} tables found: is the check broken?"
    );
    assert!(
        problems.is_empty(),
        "tables that render broken:\n{}",
        problems.join("\n")
    );
}

#[test]
fn slugs_follow_githubs_rules() {
    assert_eq!(slug("How well does it route?"), "how-well-does-it-route");
    assert_eq!(slug("Anthropic's Messages API"), "anthropics-messages-api");
    assert_eq!(slug("kv_aware"), "kv_aware");
    assert_eq!(
        slug("Prefill/decode disaggregation"),
        "prefilldecode-disaggregation"
    );
    assert_eq!(slug("Traces (OpenTelemetry)"), "traces-opentelemetry");
    assert_eq!(slug("Peers' metric names"), "peers-metric-names");
    assert_eq!(
        slug("Routing hints, eligibility, busy thresholds, queue"),
        "routing-hints-eligibility-busy-thresholds-queue"
    );
    assert_eq!(
        slug("`--epp` and  the [picker](x.md)"),
        "--epp-and--the-picker"
    );
    assert_eq!(slug("Ünïcode Wörds 2"), "ünïcode-wörds-2");
}

#[test]
fn repeated_headings_get_numbered_anchors_and_fenced_ones_none() {
    let text =
        "# A\n## Notes\n```sh\n# not a heading\n```\n### Notes\n#hashtag\n## Notes ##\n## C#\n";
    assert_eq!(anchors(text), ["a", "notes", "notes-1", "notes-2", "c"]);
}

#[test]
fn links_are_found_outside_code_only() {
    let text = "see [a](a.md#x) and ![img](p.png \"title\")\n\
                `[not](code.md)` and ``a `[no](n.md)` b``\n\
                ```md\n[fenced](f.md)\n```\n\
                [split\nacross lines](b.md) [web](https://x.y/z)\n\
                [ref]: ref.md\n";
    assert_eq!(
        links(text),
        [
            (1, "a.md#x".to_owned()),
            (1, "p.png".to_owned()),
            (7, "b.md".to_owned()),
            (7, "https://x.y/z".to_owned()),
            (8, "ref.md".to_owned()),
        ]
    );
}

#[test]
fn broken_links_are_told_apart_from_good_ones() {
    let readme = root().join("README.md");
    assert_eq!(broken(&readme, "docs/policies.md#kv_aware"), None);
    assert_eq!(broken(&readme, "https://example.com/none"), None);
    assert!(broken(&readme, "docs/no-such-page.md").is_some());
    assert!(broken(&readme, "docs/policies.md#no-such-heading").is_some());
    assert!(broken(&readme, "#no-such-heading").is_some());
    assert!(broken(&readme, "../outside.md").is_some());
}

#[test]
fn table_rows_count_their_cells_as_github_does() {
    assert_eq!(cells("| a | b |"), 2);
    assert_eq!(cells("| a \\| b | `c` |"), 2);
    assert_eq!(cells("| `a|b` | c |"), 3);
    assert_eq!(cells("a | b"), 2);
}
