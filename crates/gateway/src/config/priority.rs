//! smg's priority scheduler (`--priority-scheduler-enabled`, `--priority-scheduler-config`,
//! `--priority-scheduler-default-max-class`) and the router queue's order between tenants
//! (`--router-queue-fairness`), validated once: a bad priority file names its entry.
//!
//! The file is smg's YAML as is: `classes.<class>` (`reserved_floor`, `reserved_per_slot`,
//! `queue_size`, `queue_timeout_secs`, `starvation_threshold_secs`, `can_preempt`) over smg's
//! built-in defaults, and `tenant_policies.<tenant key>.max_class`. kvroute adds an optional
//! `tenant_policies.<tenant key>.weight`, the tenant's VTC weight.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use super::{Args, ConfigError};

/// smg's four priority classes, lowest first (so `min` clamps to a tenant's `max_class`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Deserialize, Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum PriorityClass {
    Bulk,
    Default,
    Interactive,
    System,
}

impl PriorityClass {
    /// Highest first: the router queue's tiers, by index.
    pub const TIERS: [PriorityClass; 4] = [
        PriorityClass::System,
        PriorityClass::Interactive,
        PriorityClass::Default,
        PriorityClass::Bulk,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PriorityClass::Bulk => "bulk",
            PriorityClass::Default => "default",
            PriorityClass::Interactive => "interactive",
            PriorityClass::System => "system",
        }
    }

    /// The router queue's tier of this class (0 the highest).
    pub fn tier(self) -> usize {
        3 - self as usize
    }

    /// smg's `x-smg-priority`: case-insensitive, trimmed; anything else is `default`.
    pub fn from_header(value: &str) -> PriorityClass {
        let v = value.trim();
        [Self::System, Self::Interactive, Self::Bulk]
            .into_iter()
            .find(|c| v.eq_ignore_ascii_case(c.as_str()))
            .unwrap_or(Self::Default)
    }
}

/// One class's settings: smg's defaults, overridden by the file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassSettings {
    pub reserved_floor: u16,
    pub reserved_per_slot: f64,
    /// The most requests of this class the router queue holds; 429 beyond.
    pub queue_size: u32,
    /// The longest a request of this class waits in the router queue; 503 beyond.
    pub queue_timeout: Duration,
    /// Waited longer, a request is promoted ahead of every class.
    pub starvation_threshold: Duration,
    /// Whether a request of this class may preempt a lower-class one before its first byte.
    pub can_preempt: bool,
}

impl ClassSettings {
    /// smg 1.13's built-in defaults.
    pub fn default_for(class: PriorityClass) -> ClassSettings {
        let (floor, per_slot, size, timeout, starvation, preempt) = match class {
            PriorityClass::System => (32, 0.0, 64, 30, 5, true),
            PriorityClass::Interactive => (128, 0.25, 256, 30, 5, true),
            PriorityClass::Default => (0, 0.10, 512, 60, 30, false),
            PriorityClass::Bulk => (0, 0.0, 1024, 300, 120, false),
        };
        ClassSettings {
            reserved_floor: floor,
            reserved_per_slot: per_slot,
            queue_size: size,
            queue_timeout: Duration::from_secs(timeout),
            starvation_threshold: Duration::from_secs(starvation),
            can_preempt: preempt,
        }
    }
}

/// The priority scheduler, when `--priority-scheduler-enabled`.
#[derive(Debug, Clone, PartialEq)]
pub struct PrioritySettings {
    /// By tier (index 0 `system`, as [`PriorityClass::TIERS`]).
    pub classes: [ClassSettings; 4],
    /// Each listed tenant's highest class.
    pub max_class: HashMap<String, PriorityClass>,
    /// The highest class of any other tenant.
    pub default_max_class: PriorityClass,
}

impl PrioritySettings {
    /// `tenant`'s highest class.
    pub fn max_class_of(&self, tenant: &str) -> PriorityClass {
        self.max_class
            .get(tenant)
            .copied()
            .unwrap_or(self.default_max_class)
    }

    pub fn class(&self, class: PriorityClass) -> &ClassSettings {
        &self.classes[class.tier()]
    }
}

/// How the router queue orders tenants within a class (`--router-queue-fairness`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TenantOrder {
    /// Tenants ignored: arrival order (or WSPT) within a class.
    Fcfs,
    /// Virtual token counters: the tenant served the fewest tokens goes next.
    #[default]
    Vtc,
}

/// `--engine-priority`: whose `priority` field the router writes into each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnginePriorityArg {
    /// Nothing written.
    Off,
    /// vLLM's (`--scheduling-policy priority`): lower first.
    Vllm,
    /// SGLang's (`--enable-priority-scheduling`): higher first.
    Sglang,
}

impl From<EnginePriorityArg> for kvroute_core::queue::engine_priority::EnginePriority {
    fn from(arg: EnginePriorityArg) -> Self {
        match arg {
            EnginePriorityArg::Off => Self::Off,
            EnginePriorityArg::Vllm => Self::Vllm,
            EnginePriorityArg::Sglang => Self::Sglang,
        }
    }
}

/// The router queue's sharing: its order between tenants, its priority classes and weights.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct QueueSharing {
    pub fairness: TenantOrder,
    pub priority: Option<PrioritySettings>,
    /// Tenants' VTC weights (`tenant_policies.<key>.weight`); others have 1.
    pub weights: BTreeMap<String, f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PriorityFile {
    #[serde(default)]
    classes: BTreeMap<PriorityClass, ClassEntry>,
    #[serde(default)]
    tenant_policies: BTreeMap<String, TenantEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClassEntry {
    reserved_floor: Option<u16>,
    reserved_per_slot: Option<f64>,
    queue_size: Option<u32>,
    queue_timeout_secs: Option<u64>,
    starvation_threshold_secs: Option<u64>,
    can_preempt: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    max_class: Option<PriorityClass>,
    weight: Option<f64>,
}

fn bad(path: &Path, entry: String, reason: impl Into<String>) -> ConfigError {
    ConfigError::PriorityFile {
        path: path.to_owned(),
        entry,
        reason: reason.into(),
    }
}

fn class_settings(
    path: &Path,
    class: PriorityClass,
    e: &ClassEntry,
) -> Result<ClassSettings, ConfigError> {
    let d = ClassSettings::default_for(class);
    let entry = |field: &str| format!("classes.{}.{field}", class.as_str());
    let secs = |field: &str, v: Option<u64>, d: Duration| match v {
        Some(0) => Err(bad(path, entry(field), "must be > 0")),
        Some(s) => Ok(Duration::from_secs(s)),
        None => Ok(d),
    };
    let per_slot = e.reserved_per_slot.unwrap_or(d.reserved_per_slot);
    if !per_slot.is_finite() || per_slot < 0.0 {
        return Err(bad(
            path,
            entry("reserved_per_slot"),
            "must be finite and >= 0",
        ));
    }
    Ok(ClassSettings {
        reserved_floor: e.reserved_floor.unwrap_or(d.reserved_floor),
        reserved_per_slot: per_slot,
        queue_size: e.queue_size.unwrap_or(d.queue_size),
        queue_timeout: secs("queue_timeout_secs", e.queue_timeout_secs, d.queue_timeout)?,
        starvation_threshold: secs(
            "starvation_threshold_secs",
            e.starvation_threshold_secs,
            d.starvation_threshold,
        )?,
        can_preempt: e.can_preempt.unwrap_or(d.can_preempt),
    })
}

/// Reads and checks the priority file; every error names the file and the entry.
fn read_file(path: &Path) -> Result<PriorityFile, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| bad(path, "(the file)".into(), e.to_string()))?;
    if text.trim().is_empty() {
        return Ok(PriorityFile::default());
    }
    serde_yaml_ng::from_str(&text).map_err(|e| {
        let entry = e.to_string();
        // serde_yaml_ng says where: "classes.bulk.queue_size: invalid type ... at line 3".
        let (entry, reason) = entry.split_once(": ").unwrap_or(("(the file)", &entry));
        bad(path, entry.to_owned(), reason)
    })
}

impl Args {
    /// `--priority-scheduler-*` and `--router-queue-fairness`.
    pub(super) fn take_queue_sharing(&mut self) -> Result<QueueSharing, ConfigError> {
        let fairness = self.router_queue_fairness.unwrap_or_default();
        let file = match self.priority_scheduler_config.take() {
            Some(path) => Some((read_file(&path)?, path)),
            None => None,
        };
        if !self.priority_scheduler_enabled {
            if self.priority_scheduler_default_max_class.is_some() || file.is_some() {
                return Err(ConfigError::Invalid {
                    name: "priority_scheduler_config",
                    reason: "--priority-scheduler-config and --priority-scheduler-default-max-class need --priority-scheduler-enabled",
                });
            }
            return Ok(QueueSharing {
                fairness,
                ..Default::default()
            });
        }
        let (file, path) = file.unwrap_or_else(|| (PriorityFile::default(), PathBuf::new()));
        let mut classes = PriorityClass::TIERS.map(ClassSettings::default_for);
        for (class, entry) in &file.classes {
            classes[class.tier()] = class_settings(&path, *class, entry)?;
        }
        let mut max_class = HashMap::new();
        let mut weights = BTreeMap::new();
        for (tenant, entry) in file.tenant_policies {
            if let Some(w) = entry.weight {
                if !w.is_finite() || w <= 0.0 {
                    let at = format!("tenant_policies.{tenant}.weight");
                    return Err(bad(&path, at, "must be a positive number"));
                }
                weights.insert(tenant.clone(), w);
            }
            if let Some(c) = entry.max_class {
                max_class.insert(tenant, c);
            }
        }
        let priority = PrioritySettings {
            classes,
            max_class,
            default_max_class: self
                .priority_scheduler_default_max_class
                .unwrap_or(PriorityClass::Default),
        };
        Ok(QueueSharing {
            fairness,
            priority: Some(priority),
            weights,
        })
    }
}
