//! The `kv_aware` policy's weights from the command line and the config file.

use kvroute_core::{CostModel, KvAwareConfig, MemoryCost};

use super::validate::weight;
use super::*;

impl Args {
    /// The `kv_aware` policy's weights (`--router-*`, `--shared-cache-multiplier`).
    pub(super) fn kv_aware_config(&self) -> Result<KvAwareConfig, ConfigError> {
        let kv = KvAwareConfig::default();
        Ok(KvAwareConfig {
            overlap_score_credit: weight(
                "router_kv_overlap_score_credit",
                self.router_kv_overlap_score_credit,
                kv.overlap_score_credit,
            )?,
            prefill_load_scale: weight(
                "router_prefill_load_scale",
                self.router_prefill_load_scale,
                kv.prefill_load_scale,
            )?,
            decode_active_request_weight: weight(
                "router_decode_active_request_weight",
                self.router_decode_active_request_weight,
                kv.decode_active_request_weight,
            )?,
            memory_cost: match self.router_kv_memory_cost {
                Some(MemoryCostArg::Linear) => MemoryCost::Linear,
                Some(MemoryCostArg::Utilisation) => MemoryCost::Utilisation,
                None => kv.memory_cost,
            },
            cost_model: match self.router_cost_model {
                Some(CostModelArg::Weighted) => CostModel::Weighted,
                Some(CostModelArg::Predicted) => CostModel::Predicted,
                Some(CostModelArg::Calibrated) => CostModel::Calibrated,
                None => kv.cost_model,
            },
            prefill_interference_weight: weight(
                "router_prefill_interference_weight",
                self.router_prefill_interference_weight,
                kv.prefill_interference_weight,
            )?,
            kv_overflow_weight: weight(
                "router_kv_overflow_weight",
                self.router_kv_overflow_weight,
                kv.kv_overflow_weight,
            )?,
            temperature: weight(
                "router_temperature",
                self.router_temperature,
                kv.temperature,
            )?,
            host_cache_hit_weight: weight(
                "router_host_cache_hit_weight",
                self.router_host_cache_hit_weight,
                kv.host_cache_hit_weight,
            )?,
            disk_cache_hit_weight: weight(
                "router_disk_cache_hit_weight",
                self.router_disk_cache_hit_weight,
                kv.disk_cache_hit_weight,
            )?,
            shared_cache_multiplier: weight(
                "shared_cache_multiplier",
                self.shared_cache_multiplier,
                kv.shared_cache_multiplier,
            )?,
            answers_counted: self.router_track_output_blocks,
            ..kv
        })
    }
}
