//! The queue's configuration: priority tiers and fairness between tenants, validated once.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{PolicyClass, QueueConfigError};

/// A priority tier; index 0 is the highest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriorityTier {
    /// The name clients ask for (smg's `x-smg-priority`).
    pub name: String,
    /// Waited longer than this, a request is promoted to tier 0; `None`: never.
    pub starvation: Option<Duration>,
}

/// How tenants share a class.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Fairness {
    /// One queue per class, tenants ignored (every request under one tenant).
    #[default]
    Off,
    /// Virtual token counters (see [`vtc`](super::vtc)).
    Vtc(VtcConfig),
}

/// The weights of [`Fairness::Vtc`].
#[derive(Debug, Clone, PartialEq)]
pub struct VtcConfig {
    /// Weighted tokens charged per output token reported with [`DrrQueue::charge`](super::DrrQueue::charge) (a
    /// prompt token is 1).
    pub output_weight: f64,
    /// Tenants' weights (their counters grow by tokens / weight); others have 1.
    pub tenant_weights: BTreeMap<String, f64>,
}

impl Default for VtcConfig {
    fn default() -> Self {
        Self {
            output_weight: 2.0,
            tenant_weights: BTreeMap::new(),
        }
    }
}

/// Tiers and fairness between tenants; [`Default`] is one tier, `default`, with no starvation
/// threshold and fairness off: a plain DRR over classes.
#[derive(Debug, Clone, PartialEq)]
pub struct Sharing {
    pub tiers: Vec<PriorityTier>,
    pub fairness: Fairness,
}

impl Default for Sharing {
    fn default() -> Self {
        Self {
            tiers: vec![PriorityTier {
                name: "default".into(),
                starvation: None,
            }],
            fairness: Fairness::Off,
        }
    }
}

impl Sharing {
    /// smg's four priority classes, highest first, with their starvation thresholds.
    pub fn smg(starvation: [Option<Duration>; 4], fairness: Fairness) -> Self {
        let names = ["system", "interactive", "default", "bulk"];
        Self {
            tiers: names
                .iter()
                .zip(starvation)
                .map(|(name, starvation)| PriorityTier {
                    name: (*name).into(),
                    starvation,
                })
                .collect(),
            fairness,
        }
    }
}

fn check_weight(what: impl FnOnce() -> String, value: f64) -> Result<(), QueueConfigError> {
    if value.is_finite() && value > 0.0 {
        return Ok(());
    }
    Err(QueueConfigError::BadWeight {
        what: what(),
        value,
    })
}

pub(super) fn validate(classes: &[PolicyClass], sharing: &Sharing) -> Result<(), QueueConfigError> {
    if classes.is_empty() {
        return Err(QueueConfigError::NoClasses);
    }
    for (i, class) in classes.iter().enumerate() {
        if class.weight == 0 {
            return Err(QueueConfigError::ZeroWeight {
                class: class.name.clone(),
            });
        }
        if classes[..i].iter().any(|c| c.name == class.name) {
            return Err(QueueConfigError::DuplicateClass {
                class: class.name.clone(),
            });
        }
    }
    if sharing.tiers.is_empty() {
        return Err(QueueConfigError::NoTiers);
    }
    for (i, tier) in sharing.tiers.iter().enumerate() {
        if sharing.tiers[..i].iter().any(|t| t.name == tier.name) {
            return Err(QueueConfigError::DuplicateTier {
                tier: tier.name.clone(),
            });
        }
    }
    if let Fairness::Vtc(vtc) = &sharing.fairness {
        check_weight(|| "the output weight".into(), vtc.output_weight)?;
        for (tenant, &w) in &vtc.tenant_weights {
            check_weight(|| format!("tenant '{tenant}''s weight"), w)?;
        }
    }
    Ok(())
}
