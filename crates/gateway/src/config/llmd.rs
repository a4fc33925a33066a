//! llm-d's `EndpointPickerConfig` (`--config-file FILE`, `--config-text YAML`), read as
//! kvroute's settings.
//!
//! The file names plugins (`plugins: [{name?, type, parameters?}]`, a plugin's name
//! defaulting to its type) and a scheduling profile that weighs them
//! (`schedulingProfiles: [{name, plugins: [{pluginRef, weight?}]}]`). kvroute reads it as
//! its `llm_d` policy, llm-d's weighted sum of scorers:
//!
//! - `queue-scorer`, `kv-cache-utilization-scorer` and `prefix-cache-scorer` give
//!   `llm_d_queue_weight`, `llm_d_kv_weight` and `llm_d_prefix_weight`: the profile's
//!   `weight` (1 when absent, as llm-d), 0 for a scorer the profile does not name. (The
//!   3/2/2 default is for a start without this file.) `lora-affinity-scorer` gives
//!   `llm_d_lora_weight` the same way (0 without it, and by default).
//! - `approx-prefix-cache-producer`: the prefix scorer's blocks are what the picker routed
//!   (llm-d's estimate, kvroute's `llm_d` as it is); its parameters are llm-d's tuning.
//! - `precise-prefix-cache-producer` (and the deprecated `precise-prefix-cache-scorer`,
//!   which is a producer and a prefix scorer in one): the engines' KV events, read from each
//!   endpoint at `tcp://IP:socketPort+rank` (`kvEventsConfig.podDiscoveryConfig.socketPort`,
//!   llm-d's default 5557) into `kv_events_socket_port`, and `tokenProcessorConfig`'s
//!   `blockSize` (or `blockSizeTokens`) into `block_size`. llm-d's other mode, one socket
//!   the engines publish to (`kvEventsConfig.zmqEndpoint` without pod discovery), is
//!   refused: kvroute subscribes to each engine.
//! - Accepted as no-ops, for they ask for what kvroute does anyway: [`NOOPS`].
//! - Any other plugin type is refused by name (exit status 2), as are P/D's several
//!   profiles, `flowControl` and `saturationDetector`.
//!
//! The result is the fields of [`Args`] the file sets, under the command line and
//! kvroute's `--config` file ([`Args::with_llm_d_config`]), so `--dump-config-to` shows
//! them and `--policy kv_aware` still wins.

use std::collections::HashMap;

use kvroute_core::PolicyKind;
use serde::Deserialize;
use serde_yaml_ng::Value;

use super::{Args, ConfigError};

/// The `apiVersion`s read: llm-d's, and the Gateway API Inference Extension's older one.
pub const API_VERSIONS: [&str; 2] = [
    "llm-d.ai/v1alpha1",
    "inference.networking.x-k8s.io/v1alpha1",
];

/// llm-d's `podDiscoveryConfig.socketPort` default.
const DEFAULT_SOCKET_PORT: u16 = 5557;

/// Plugin types accepted as no-ops, with why each changes nothing in kvroute.
pub const NOOPS: [(&str, &str); 9] = [
    (
        "token-producer",
        "kvroute tokenises the prompt itself (--tokenizer)",
    ),
    ("single-profile-handler", "kvroute runs the one profile"),
    (
        "max-score-picker",
        "llm_d picks the highest total, ties at random",
    ),
    (
        "metrics-data-source",
        "kvroute scrapes each engine's /metrics",
    ),
    (
        "core-metrics-extractor",
        "kvroute reads vLLM's and SGLang's queue and KV usage",
    ),
    (
        "endpoint-notification-source",
        "kvroute subscribes to each endpoint's KV events itself",
    ),
    (
        "decode-filter",
        "without prefill/decode profiles every endpoint decodes (P/D's prefill-filter and \
         profile handlers are refused)",
    ),
    ("openai-parser", "kvroute reads OpenAI requests"),
    (
        "passthrough-parser",
        "kvroute passes other bodies through untouched",
    ),
];

/// Why an llm-d config cannot be read as kvroute's settings.
#[derive(Debug, thiserror::Error)]
#[error("llm-d config {origin}: {problem}")]
pub struct LlmDConfigError {
    /// `--config-file PATH` or `--config-text`.
    pub origin: String,
    pub problem: Problem,
}

#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("cannot read it: {0}")]
    Read(std::io::Error),
    #[error("{0}")]
    Parse(serde_yaml_ng::Error),
    #[error(
        "apiVersion {0:?}: expected llm-d.ai/v1alpha1 or inference.networking.x-k8s.io/v1alpha1"
    )]
    ApiVersion(String),
    #[error("kind {0:?}: expected EndpointPickerConfig")]
    Kind(String),
    #[error("plugin type {0:?} is not supported by kvroute's endpoint picker")]
    UnsupportedPlugin(String),
    #[error("two plugins are named {0:?}")]
    DuplicateName(String),
    #[error("scheduling profile {profile:?} refers to {plugin_ref:?}, which no plugin is named")]
    UnknownRef { profile: String, plugin_ref: String },
    #[error(
        "{0} scheduling profiles: kvroute runs one (prefill/decode profiles are not supported yet)"
    )]
    Profiles(usize),
    #[error("weight of {0:?} must be a non-negative number")]
    Weight(String),
    #[error("{field} is not supported yet: {why}")]
    Unsupported {
        field: &'static str,
        why: &'static str,
    },
    #[error("plugin {plugin:?}: {parameter}: {why}")]
    Parameter {
        plugin: String,
        parameter: &'static str,
        why: &'static str,
    },
}

/// The file's top level; what is not listed here is refused by the parser.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct EndpointPickerConfig {
    api_version: String,
    kind: String,
    /// llm-d's experimental features: nothing to turn on in kvroute.
    #[serde(default)]
    #[allow(dead_code)]
    feature_gates: Vec<String>,
    #[serde(default)]
    plugins: Vec<PluginSpec>,
    #[serde(default)]
    scheduling_profiles: Vec<SchedulingProfile>,
    /// Which data sources feed which extractors: kvroute wires its own.
    #[serde(default)]
    #[allow(dead_code)]
    data_layer: Option<Value>,
    /// The request parsers: kvroute reads OpenAI requests and passes the rest through.
    #[serde(default)]
    #[allow(dead_code)]
    request_handler: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    parser: Option<Value>,
    #[serde(default)]
    flow_control: Option<Value>,
    #[serde(default)]
    saturation_detector: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PluginSpec {
    #[serde(default)]
    name: Option<String>,
    #[serde(rename = "type")]
    plugin_type: String,
    #[serde(default)]
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SchedulingProfile {
    name: String,
    #[serde(default)]
    plugins: Vec<SchedulingPlugin>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SchedulingPlugin {
    plugin_ref: String,
    #[serde(default)]
    weight: Option<f64>,
}

/// What a plugin type is to kvroute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Scorer(Scorer),
    /// The deprecated `precise-prefix-cache-scorer`: the precise producer and the prefix
    /// scorer in one.
    PreciseScorer,
    ApproxProducer,
    PreciseProducer,
    Noop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scorer {
    Queue,
    KvUtilisation,
    Prefix,
    Lora,
}

fn role(plugin_type: &str) -> Option<Role> {
    Some(match plugin_type {
        "queue-scorer" => Role::Scorer(Scorer::Queue),
        "kv-cache-utilization-scorer" => Role::Scorer(Scorer::KvUtilisation),
        "prefix-cache-scorer" => Role::Scorer(Scorer::Prefix),
        "lora-affinity-scorer" => Role::Scorer(Scorer::Lora),
        "precise-prefix-cache-scorer" => Role::PreciseScorer,
        "approx-prefix-cache-producer" => Role::ApproxProducer,
        "precise-prefix-cache-producer" => Role::PreciseProducer,
        t if NOOPS.iter().any(|(n, _)| *n == t) => Role::Noop,
        _ => return None,
    })
}

/// The settings an llm-d config gives: always the `llm_d` policy and its three weights.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct LlmDOverlay {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
    pub lora_weight: f64,
    /// The precise producer's block size.
    pub block_size: Option<usize>,
    /// The precise producer's `socketPort`.
    pub kv_events_socket_port: Option<u16>,
    /// A precise producer: the prefix is scored from the engines' KV events.
    pub precise: bool,
}

impl LlmDOverlay {
    /// Reads an `EndpointPickerConfig`'s text.
    pub fn parse(text: &str) -> Result<LlmDOverlay, Problem> {
        let config: EndpointPickerConfig = serde_yaml_ng::from_str(text).map_err(Problem::Parse)?;
        if !API_VERSIONS.contains(&config.api_version.as_str()) {
            return Err(Problem::ApiVersion(config.api_version));
        }
        if config.kind != "EndpointPickerConfig" {
            return Err(Problem::Kind(config.kind));
        }
        if config.flow_control.is_some() {
            return Err(Problem::Unsupported {
                field: "flowControl",
                why:
                    "llm-d's flow control (kvroute's admission queue is --max-concurrent-requests)",
            });
        }
        if config.saturation_detector.is_some() {
            return Err(Problem::Unsupported {
                field: "saturationDetector",
                why: "llm-d's saturation detector (kvroute's is --worker-overload-protection)",
            });
        }
        let mut overlay = LlmDOverlay {
            prefix_weight: 0.0,
            queue_weight: 0.0,
            kv_weight: 0.0,
            lora_weight: 0.0,
            block_size: None,
            kv_events_socket_port: None,
            precise: false,
        };
        let mut roles: HashMap<String, Role> = HashMap::new();
        for plugin in &config.plugins {
            let role = role(&plugin.plugin_type)
                .ok_or_else(|| Problem::UnsupportedPlugin(plugin.plugin_type.clone()))?;
            let name = plugin
                .name
                .clone()
                .unwrap_or_else(|| plugin.plugin_type.clone());
            if matches!(role, Role::PreciseProducer | Role::PreciseScorer) {
                overlay.precise(&name, plugin.parameters.as_ref())?;
            }
            if roles.insert(name.clone(), role).is_some() {
                return Err(Problem::DuplicateName(name));
            }
        }
        let refs: Vec<(String, Option<f64>)> = match config.scheduling_profiles.as_slice() {
            // No profile: llm-d makes one of every plugin.
            [] => config
                .plugins
                .iter()
                .map(|p| {
                    (
                        p.name.clone().unwrap_or_else(|| p.plugin_type.clone()),
                        None,
                    )
                })
                .collect(),
            [profile] => {
                let mut refs = Vec::new();
                for p in &profile.plugins {
                    if !roles.contains_key(&p.plugin_ref) {
                        return Err(Problem::UnknownRef {
                            profile: profile.name.clone(),
                            plugin_ref: p.plugin_ref.clone(),
                        });
                    }
                    refs.push((p.plugin_ref.clone(), p.weight));
                }
                refs
            }
            many => return Err(Problem::Profiles(many.len())),
        };
        for (name, weight) in refs {
            let weight = weight.unwrap_or(1.0);
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(Problem::Weight(name));
            }
            let slot = match roles[&name] {
                Role::Scorer(Scorer::Queue) => &mut overlay.queue_weight,
                Role::Scorer(Scorer::KvUtilisation) => &mut overlay.kv_weight,
                Role::Scorer(Scorer::Lora) => &mut overlay.lora_weight,
                Role::Scorer(Scorer::Prefix) | Role::PreciseScorer => &mut overlay.prefix_weight,
                Role::ApproxProducer | Role::PreciseProducer | Role::Noop => continue,
            };
            // The same scorer twice (two names) adds up, as llm-d sums the weighted scores.
            *slot += weight;
        }
        Ok(overlay)
    }

    /// The precise producer's parameters: where the KV events come from, the block size.
    fn precise(&mut self, plugin: &str, parameters: Option<&Value>) -> Result<(), Problem> {
        let bad = |parameter, why| Problem::Parameter {
            plugin: plugin.to_owned(),
            parameter,
            why,
        };
        let get = |path: &[&str]| {
            path.iter()
                .try_fold(parameters?, |v, key| v.get(*key))
                .filter(|v| !v.is_null())
        };
        let block = get(&["tokenProcessorConfig", "blockSize"])
            .or_else(|| get(&["tokenProcessorConfig", "blockSizeTokens"]));
        if let Some(block) = block {
            let size = block.as_u64().filter(|b| *b > 0).ok_or_else(|| {
                bad(
                    "tokenProcessorConfig.blockSize",
                    "must be a positive integer",
                )
            })?;
            self.block_size = Some(size as usize);
        }
        let discovers = get(&["kvEventsConfig", "discoverPods"]).and_then(Value::as_bool);
        let pod_discovery = get(&["kvEventsConfig", "podDiscoveryConfig"]).is_some();
        let global = get(&["kvEventsConfig", "zmqEndpoint"]).is_some();
        if global && discovers != Some(true) && !pod_discovery {
            return Err(Problem::Unsupported {
                field: "kvEventsConfig.zmqEndpoint",
                why: "one socket the engines publish to; kvroute subscribes to each endpoint \
                      (kvEventsConfig.discoverPods with podDiscoveryConfig.socketPort)",
            });
        }
        let port = match get(&["kvEventsConfig", "podDiscoveryConfig", "socketPort"]) {
            None => DEFAULT_SOCKET_PORT,
            Some(v) => v
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p > 0)
                .ok_or_else(|| {
                    bad(
                        "kvEventsConfig.podDiscoveryConfig.socketPort",
                        "must be a port number",
                    )
                })?,
        };
        self.kv_events_socket_port = Some(port);
        self.precise = true;
        Ok(())
    }
}

impl Args {
    /// These arguments over the llm-d config they name (`config_file` or `config_text`),
    /// if any: what the file sets where nothing else did.
    pub fn with_llm_d_config(self) -> Result<Args, ConfigError> {
        let (origin, text) = match (&self.config_file, &self.config_text) {
            (None, None) => return Ok(self),
            (Some(_), Some(_)) => {
                return Err(ConfigError::Invalid {
                    name: "config_file",
                    reason: "give --config-file or --config-text, not both",
                })
            }
            (Some(path), None) => {
                let origin = format!("--config-file {}", path.display());
                match std::fs::read_to_string(path) {
                    Ok(text) => (origin, text),
                    Err(e) => return Err(llm_d_error(origin, Problem::Read(e))),
                }
            }
            (None, Some(text)) => ("--config-text".to_owned(), text.clone()),
        };
        let overlay = LlmDOverlay::parse(&text).map_err(|p| llm_d_error(origin, p))?;
        Ok(self.over(overlay))
    }

    fn over(self, o: LlmDOverlay) -> Args {
        Args {
            policy: self.policy.or(Some(PolicyKind::LlmD)),
            llm_d_prefix_weight: self.llm_d_prefix_weight.or(Some(o.prefix_weight)),
            llm_d_queue_weight: self.llm_d_queue_weight.or(Some(o.queue_weight)),
            llm_d_kv_weight: self.llm_d_kv_weight.or(Some(o.kv_weight)),
            llm_d_lora_weight: self.llm_d_lora_weight.or(Some(o.lora_weight)),
            block_size: self.block_size.or(o.block_size),
            kv_events_socket_port: self.kv_events_socket_port.or(o.kv_events_socket_port),
            llm_d_precise_prefix: self.llm_d_precise_prefix || o.precise,
            ..self
        }
    }
}

fn llm_d_error(origin: String, problem: Problem) -> ConfigError {
    ConfigError::LlmD(LlmDConfigError { origin, problem })
}

#[cfg(test)]
mod tests;
