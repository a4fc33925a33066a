//! Test data: the shared tiny Llama tokenizer, and scratch model directories built from it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// `testdata/tiny-llama`: a copy of `shared/data/tiny-llama-tokenizer` kept in the
/// repository. Fails (never skips) when absent.
pub fn tiny_dir() -> PathBuf {
    let dir = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/tiny-llama"
    ));
    assert!(
        dir.join("tokenizer.json").is_file(),
        "test data missing: {} should hold the tiny Llama tokenizer (see testdata/README.md)",
        dir.display()
    );
    dir.to_path_buf()
}

/// A fresh scratch directory, removed on drop.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "kvroute-tokenizer-{}-{name}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// A model directory with the tiny `tokenizer.json` and the given `tokenizer_config.json`.
    pub fn model(name: &str, config: &serde_json::Value) -> Self {
        let dir = Self::new(name);
        std::fs::copy(
            tiny_dir().join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        dir.write("tokenizer_config.json", &config.to_string());
        dir
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn write(&self, file: &str, contents: &str) {
        std::fs::write(self.0.join(file), contents).unwrap();
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
