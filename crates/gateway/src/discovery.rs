//! The sources that change the worker set at run time, and how a wanted list is applied.
//!
//! A source says which workers it wants; [`reconcile`] brings the worker set to that list: ids
//! whose spec changed or that are no longer wanted are removed (their in-flight requests
//! finish), new ids are added. Today's source is the config file, re-read on SIGHUP
//! ([`config_file_workers`]).

use std::path::Path;

use crate::config::{Args, ConfigError, Settings, WorkerSpec};
use crate::error::GatewayError;
use crate::workers::WorkerSet;

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

/// Brings `set` to `wanted`: removes every worker whose spec is not wanted, then adds every
/// wanted id that is not there (`add` and `remove` also start and stop the worker's tasks).
/// Returns how many were added and removed.
pub(crate) fn reconcile(
    set: &WorkerSet,
    wanted: Vec<WorkerSpec>,
    mut add: impl FnMut(WorkerSpec) -> Result<(), GatewayError>,
    mut remove: impl FnMut(&str) -> bool,
) -> (usize, usize) {
    let (mut added, mut removed) = (0, 0);
    for w in set.workers().iter() {
        let keep = wanted.iter().any(|s| w.spec == *s);
        if !keep && remove(w.id.as_str()) {
            removed += 1;
        }
    }
    for spec in wanted {
        let id = spec.id.clone().unwrap_or_default();
        if set.get(&id).is_none() {
            match add(spec) {
                Ok(()) => added += 1,
                Err(error) => tracing::warn!(worker = %id, %error, "Cannot add worker"),
            }
        }
    }
    (added, removed)
}
