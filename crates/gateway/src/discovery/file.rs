//! File discovery: `--discovery-file PATH` lists workers as the config file's `workers:`
//! does, and is watched.
//!
//! The file is re-read when its directory changes (inotify through the `notify` crate;
//! watching the directory also sees editors that replace the file and Kubernetes ConfigMap
//! volumes, which swap a symlink) and every `--discovery-check-interval-secs` in case an
//! event was missed. Each read is reconciled with the set's file workers: new ids added,
//! missing ones drained, changed ones replaced. A file that does not parse, lists an
//! invalid worker, is empty or cannot be read changes nothing and is logged; a file that is
//! not there yet means no file workers yet.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::Watcher;
use serde::Deserialize;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{reconcile, Workers};
use crate::config::{WorkerSource, WorkerSpec};
use crate::metrics::DiscoveryMetrics;

/// How long the directory must be quiet before a change is read (an editor's write is
/// several events).
const SETTLE: Duration = Duration::from_millis(100);

/// The file's form: `workers: [...]` (as in the config file, optionally with smg's
/// `version: 1`), or the list alone.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkersFile {
    #[serde(default)]
    #[allow(dead_code)]
    version: Option<u32>,
    workers: Vec<WorkerSpec>,
}

/// Reads the file's workers: `Ok(None)` when the file is not there, an error (which
/// changes nothing) when it cannot be used.
pub fn read(path: &Path) -> Result<Option<Vec<WorkerSpec>>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read it: {e}")),
    };
    if text.trim().is_empty() {
        return Err("it is empty (write `workers: []` to have no workers)".into());
    }
    let value: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&text).map_err(|e| format!("not YAML or JSON: {e}"))?;
    let specs: Vec<WorkerSpec> = match value {
        serde_yaml_ng::Value::Sequence(_) => serde_yaml_ng::from_value(value),
        _ => serde_yaml_ng::from_value::<WorkersFile>(value).map(|f| f.workers),
    }
    .map_err(|e| format!("not a worker list: {e}"))?;
    let mut seen = std::collections::HashSet::new();
    let mut workers = Vec::with_capacity(specs.len());
    for spec in specs {
        let mut spec = spec.validated().map_err(|e| e.to_string())?;
        spec.source = WorkerSource::File;
        let id = spec.id.clone().unwrap_or_default();
        if !seen.insert(id.clone()) {
            return Err(format!("duplicate worker id '{id}'"));
        }
        workers.push(spec);
    }
    Ok(Some(workers))
}

/// Watches `path` until `shutdown`, keeping the set's file workers to what it lists.
pub async fn run(
    target: Arc<impl Workers>,
    path: PathBuf,
    interval: Duration,
    metrics: DiscoveryMetrics,
    shutdown: CancellationToken,
) {
    let changed = Arc::new(Notify::new());
    // Held for as long as the loop runs: dropping it stops the watch.
    let _watcher = watch_directory(&path, changed.clone());
    let mut reread = tokio::time::interval(interval);
    reread.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing: Option<String> = None;
    loop {
        // The first tick is at once: the first read.
        tokio::select! {
            _ = reread.tick() => {}
            _ = changed.notified() => {
                // Let the writer finish.
                loop {
                    tokio::select! {
                        _ = changed.notified() => continue,
                        _ = tokio::time::sleep(SETTLE) => break,
                        _ = shutdown.cancelled() => return,
                    }
                }
            }
            _ = shutdown.cancelled() => return,
        }
        match read(&path) {
            Ok(Some(wanted)) => {
                if failing.take().is_some() {
                    tracing::info!(path = %path.display(), "Discovery file readable again");
                }
                let (added, removed) =
                    reconcile(target.as_ref(), |s| *s == WorkerSource::File, wanted);
                if added + removed > 0 {
                    tracing::info!(path = %path.display(), added, removed, "Discovery file workers changed");
                }
            }
            Ok(None) => {
                if failing.as_deref() != Some("missing") {
                    tracing::warn!(path = %path.display(), "No discovery file yet: keeping the current file workers");
                    failing = Some("missing".into());
                }
            }
            Err(error) => {
                metrics.error("file");
                if failing.as_ref() != Some(&error) {
                    tracing::error!(path = %path.display(), %error, "Discovery file refused: nothing changed");
                    failing = Some(error);
                }
            }
        }
    }
}

/// Notifies `changed` on any event in the file's directory; `None` (with a warning) when
/// it cannot be watched, leaving the periodic re-read.
fn watch_directory(path: &Path, changed: Arc<Notify>) -> Option<notify::RecommendedWatcher> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let handler = move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            changed.notify_one();
        }
    };
    let watched = notify::recommended_watcher(handler).and_then(|mut w| {
        w.watch(&dir, notify::RecursiveMode::NonRecursive)?;
        Ok(w)
    });
    match watched {
        Ok(w) => Some(w),
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "Cannot watch the discovery file's directory: re-reading it every interval only");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempdir::Dir, PathBuf) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("workers.yaml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    mod tempdir {
        /// A fresh directory under the system temp dir, removed on drop.
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                let n: u64 = rand::random();
                let p = std::env::temp_dir().join(format!("kvroute-file-{n:x}"));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn both_forms_read_the_same_and_are_file_workers() {
        let (_d, a) = write("version: 1\nworkers:\n  - url: http://10.0.0.1:8000/\n    model: m\n");
        let (_e, b) = write("[{\"url\": \"http://10.0.0.1:8000\", \"model\": \"m\"}]");
        let a = read(&a).unwrap().unwrap();
        assert_eq!(a, read(&b).unwrap().unwrap());
        assert_eq!(a[0].url, "http://10.0.0.1:8000");
        assert_eq!(a[0].id.as_deref(), Some("http://10.0.0.1:8000"));
        assert_eq!(a[0].source, WorkerSource::File);
    }

    #[test]
    fn a_file_that_cannot_be_used_is_an_error_and_a_missing_one_is_none() {
        let dir = tempdir::Dir::new();
        assert_eq!(read(&dir.0.join("absent.yaml")), Ok(None));
        for (text, says) in [
            ("", "empty"),
            ("workers: [", "not YAML"),
            (
                "workers:\n  - url: http://a:1\n    colour: red\n",
                "unknown field",
            ),
            ("workers:\n  - url: ftp://a:1\n", "must start with http"),
            ("- url: http://a:1\n- url: http://a:1/\n", "duplicate"),
            ("wokers: []\n", "unknown field"),
        ] {
            let (_d, path) = write(text);
            let error = read(&path).unwrap_err();
            assert!(error.contains(says), "{text:?}: {error}");
        }
    }
}
