//! The busy thresholds in force, per model, changed at run time by `POST /busy_threshold`.

use std::collections::HashMap;
use std::sync::RwLock;

use kvroute_core::eligibility::BusyThresholds;
use serde::{Deserialize, Serialize};

/// Thresholds per model; models never set use the start-up ones.
#[derive(Debug)]
pub struct BusyControl {
    default: BusyThresholds,
    per_model: RwLock<HashMap<String, BusyThresholds>>,
}

/// The body of `POST /busy_threshold` and one entry of `GET /busy_threshold` (Dynamo's
/// field names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThresholdsBody {
    pub model: String,
    #[serde(default)]
    pub active_decode_blocks_threshold: Option<f64>,
    #[serde(default)]
    pub active_prefill_tokens_threshold: Option<u64>,
    #[serde(default)]
    pub active_prefill_tokens_threshold_frac: Option<f64>,
}

impl BusyControl {
    pub fn new(default: BusyThresholds) -> Self {
        Self {
            default,
            per_model: RwLock::new(HashMap::new()),
        }
    }

    pub fn get(&self, model: &str) -> BusyThresholds {
        self.per_model
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(model)
            .copied()
            .unwrap_or(self.default)
    }

    /// Sets the fields given (the others stay) and returns what is now in force.
    pub fn set(&self, body: &ThresholdsBody) -> BusyThresholds {
        let mut map = self.per_model.write().unwrap_or_else(|e| e.into_inner());
        let t = map.entry(body.model.clone()).or_insert(self.default);
        if let Some(v) = body.active_decode_blocks_threshold {
            t.active_decode_blocks = Some(v);
        }
        if let Some(v) = body.active_prefill_tokens_threshold {
            t.active_prefill_tokens = Some(v);
        }
        if let Some(v) = body.active_prefill_tokens_threshold_frac {
            t.active_prefill_tokens_frac = Some(v);
        }
        *t
    }

    pub fn body(model: &str, t: &BusyThresholds) -> ThresholdsBody {
        ThresholdsBody {
            model: model.to_owned(),
            active_decode_blocks_threshold: t.active_decode_blocks,
            active_prefill_tokens_threshold: t.active_prefill_tokens,
            active_prefill_tokens_threshold_frac: t.active_prefill_tokens_frac,
        }
    }
}
