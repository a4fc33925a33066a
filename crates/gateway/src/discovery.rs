//! The sources that change the worker set at run time, and how a wanted list is applied.
//!
//! A source says which workers it wants; [`reconcile`] brings the worker set to that list,
//! among the workers of that source only: ids whose spec changed or that are no longer
//! wanted are removed (their in-flight requests finish), new ids are added. The sources:
//! - the config file, re-read on SIGHUP ([`config_file_workers`]): static and config workers;
//! - the `--discovery-file`, watched ([`file`]);
//! - Kubernetes pods by label selector, watched and re-listed ([`kubernetes`]);
//! - the endpoint picker's pods: an InferencePool's, or a selector's ([`pool`]).
//!
//! A source that cannot be read (an API server down or forbidding, a file that does not
//! parse) changes nothing: it never drops every worker because it went blind.

use std::path::Path;

use crate::config::{Args, ConfigError, Settings, WorkerSource, WorkerSpec};
use crate::error::GatewayError;
use crate::workers::WorkerSet;

pub mod file;
pub mod kubernetes;
pub mod pods;
pub mod pool;

/// What a discovery source changes: the worker set, with each worker's background tasks
/// (the server implements it; a source only decides).
pub trait Workers: Send + Sync + 'static {
    fn set(&self) -> &WorkerSet;
    /// Adds a worker and starts its tasks.
    fn add(&self, spec: WorkerSpec) -> Result<(), GatewayError>;
    /// Removes a worker (its in-flight requests finish); whether it was there.
    fn remove(&self, id: &str) -> bool;
}

/// The config file, and the workers it lists now under the command line's worker flags
/// (merged as at start); `None` without a config file.
pub(crate) fn config_file_workers(
    settings: &Settings,
) -> Result<Option<(&Path, Vec<WorkerSpec>)>, ConfigError> {
    let Some(path) = &settings.config_path else {
        return Ok(None);
    };
    let file = Args::from_file(path)?;
    let workers = settings.cli_workers.over(file).into_settings()?.workers;
    Ok(Some((path, workers)))
}

/// Brings the workers of `target` whose source is `ours` to `wanted`: removes each of them
/// whose spec is not wanted, then adds every wanted id that is not there. Returns how many
/// were added and removed.
pub fn reconcile(
    target: &impl Workers,
    ours: impl Fn(&WorkerSource) -> bool,
    wanted: Vec<WorkerSpec>,
) -> (usize, usize) {
    let (mut added, mut removed) = (0, 0);
    for w in target.set().workers().iter() {
        if ours(&w.spec.source)
            && !wanted.iter().any(|s| w.spec == *s)
            && target.remove(w.id.as_str())
        {
            removed += 1;
        }
    }
    for spec in wanted {
        let id = spec.id.clone().unwrap_or_else(|| spec.url.clone());
        match target.set().get(&id) {
            None => match target.add(spec) {
                Ok(()) => added += 1,
                Err(error) => tracing::warn!(worker = %id, %error, "Cannot add worker"),
            },
            Some(w) if !ours(&w.spec.source) => {
                tracing::warn!(worker = %id, source = w.spec.source.name(), "A worker with this id already comes from another source: keeping that one")
            }
            Some(_) => {}
        }
    }
    (added, removed)
}
