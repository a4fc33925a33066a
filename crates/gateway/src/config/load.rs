//! How the command line and the config file are read: the flags' value parsers, the file's
//! text, and the merge of the two into [`Settings`] (with `--dump-config-to`).

use std::path::Path;

use kvroute_core::PolicyKind;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Args, ConfigError, Settings};

pub(super) fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    s.parse::<PolicyKind>().map_err(|e| e.to_string())
}

pub(super) fn ser_policy<S: Serializer>(
    policy: &Option<PolicyKind>,
    s: S,
) -> Result<S::Ok, S::Error> {
    policy.map(PolicyKind::name).serialize(s)
}

/// Whole seconds: an integer, or a float with no fraction (Dynamo writes `120.0`).
pub(super) fn parse_whole_secs(s: &str) -> Result<u64, String> {
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(secs);
    }
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 0.0 && f.fract() == 0.0 && f < u64::MAX as f64 => {
            Ok(f as u64)
        }
        Ok(f) if f.is_finite() && f > 0.0 && f.fract() != 0.0 => Err(format!(
            "{s} has a fraction of a second; kvroute takes whole seconds"
        )),
        _ => Err(format!("{s} is not a whole number of seconds")),
    }
}

/// A boolean as Go's `strconv.ParseBool` reads it (llm-d's flags are Go flags).
pub(crate) fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("{s} is not a boolean (true or false)")),
    }
}

pub(super) fn de_policy<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PolicyKind>, D::Error> {
    let Some(name) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    name.parse().map(Some).map_err(serde::de::Error::custom)
}

/// The command line's worker flags: on a reload they stay over the re-read file's, as they
/// did at start.
#[derive(Debug, Clone, Default)]
pub struct CliWorkers {
    pub worker_urls: Vec<String>,
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    pub pd_disaggregation: bool,
    /// Whether kvroute started as the endpoint picker (a re-read file's picker flags are
    /// then valid).
    pub epp: bool,
}

impl CliWorkers {
    /// These flags over `file`, merged as at start.
    pub fn over(&self, file: Args) -> Args {
        Args {
            worker_urls: self.worker_urls.clone(),
            prefill: self.prefill.clone(),
            decode: self.decode.clone(),
            pd_disaggregation: self.pd_disaggregation,
            epp: self.epp,
            ..Args::default()
        }
        .merge(file)
    }
}

impl Args {
    /// Reads the `--config` file, if any, under the command line.
    pub fn load(self) -> Result<Settings, ConfigError> {
        let cli_workers = CliWorkers {
            worker_urls: self.worker_urls.clone(),
            prefill: self.prefill.clone(),
            decode: self.decode.clone(),
            pd_disaggregation: self.pd_disaggregation,
            epp: false,
        };
        let merged = match self.config.clone() {
            Some(path) => self.merge(Args::from_file(&path)?),
            None => self,
        }
        .with_llm_d_config()?;
        // Written once the settings are known to be valid: a bad config exits first.
        let dump = merged
            .dump_config_to
            .clone()
            .map(|path| (path, merged.dump_json()));
        let mut settings = merged.into_settings()?;
        if let Some((path, text)) = dump {
            super::dump::write(&path, &text)?;
        }
        settings.cli_workers = CliWorkers {
            epp: settings.epp.is_some(),
            ..cli_workers
        };
        Ok(settings)
    }

    pub fn from_file(path: &Path) -> Result<Args, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Args::from_text(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })
    }

    /// Parses a config file's text. YAML is a superset of JSON, so one parser reads both.
    pub fn from_text(text: &str) -> Result<Args, serde_yaml_ng::Error> {
        if text.trim().is_empty() {
            return Ok(Args::default());
        }
        serde_yaml_ng::from_str(text)
    }
}
