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
