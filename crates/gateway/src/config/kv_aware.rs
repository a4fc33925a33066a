//! The `kv_aware` policy's cost model and weights, a group of `kvroute`'s command line
//! flattened into [`super::Args`] (the config file's keys are the same, at the top level).

use clap::Args as ClapArgs;
use kvroute_core::{CostModel, KvAwareConfig, MemoryCost};
use serde::{Deserialize, Serialize};

use super::validate::weight;
use super::values::{CostModelArg, MemoryCostArg};
use super::ConfigError;

/// `--router-*` (kv_aware's weights) and `--shared-cache-multiplier`.
#[derive(Debug, Default, Clone, PartialEq, ClapArgs, Deserialize, Serialize)]
pub struct KvAwareArgs {
    /// kv_aware: credit per prefix block cached on the device [default: 2.0; Dynamo's: 1.0].
    #[arg(long)]
    pub router_kv_overlap_score_credit: Option<f64>,
    /// kv_aware: weight of the prefill term [default: 4.0; Dynamo's: 1.0].
    #[arg(long)]
    pub router_prefill_load_scale: Option<f64>,
    /// kv_aware: memory term in blocks: linear (Dynamo's) or by utilisation [default: linear].
    #[arg(long, value_enum)]
    pub router_kv_memory_cost: Option<MemoryCostArg>,
    /// kv_aware: weighted (blocks), calibrated (blocks at learned speeds), predicted (ms) [calibrated].
    #[arg(long, value_enum)]
    pub router_cost_model: Option<CostModelArg>,
    /// kv_aware: weight of uncached blocks times decoding requests (0: Dynamo's) [default: 0.25].
    #[arg(long)]
    pub router_prefill_interference_weight: Option<f64>,
    /// kv_aware: weight of KV blocks beyond 90% of an engine's (0: Dynamo's) [default: 4].
    #[arg(long)]
    pub router_kv_overflow_weight: Option<f64>,
    /// kv_aware (calibrated): weight of the request's own decode at each worker's learned speed
    /// (0: off) [default: 3000].
    #[arg(long)]
    pub router_own_decode_weight: Option<f64>,
    /// kv_aware: weight of each active request [default: 0].
    #[arg(long)]
    pub router_decode_active_request_weight: Option<f64>,
    /// kv_aware: decode load counts streamed output blocks, decayed toward agent_hints.osl.
    #[arg(alias = "track-output-blocks", long)]
    #[serde(default)]
    pub router_track_output_blocks: bool,
    /// kv_aware: sample from a softmax over costs at this temperature; 0 picks the cheapest [default: 0].
    #[arg(long)]
    pub router_temperature: Option<f64>,
    /// kv_aware: credit per prefix block cached in host memory [default: 0.75].
    #[arg(alias = "kv-penalty-host", long)]
    pub router_host_cache_hit_weight: Option<f64>,
    /// kv_aware: credit per prefix block cached on disk [default: 0.25].
    #[arg(alias = "kv-penalty-disk", long)]
    pub router_disk_cache_hit_weight: Option<f64>,
    /// kv_aware: credit per prefix block in a shared external cache [default: 0].
    #[arg(alias = "kv-penalty-external", long)]
    pub shared_cache_multiplier: Option<f64>,
}

impl KvAwareArgs {
    /// The command line's group over the file's: each weight the command line sets wins, the
    /// flag is set if either sets it.
    pub(super) fn merge(self, file: KvAwareArgs) -> KvAwareArgs {
        KvAwareArgs {
            router_kv_overlap_score_credit: self
                .router_kv_overlap_score_credit
                .or(file.router_kv_overlap_score_credit),
            router_prefill_load_scale: self
                .router_prefill_load_scale
                .or(file.router_prefill_load_scale),
            router_kv_memory_cost: self.router_kv_memory_cost.or(file.router_kv_memory_cost),
            router_cost_model: self.router_cost_model.or(file.router_cost_model),
            router_prefill_interference_weight: self
                .router_prefill_interference_weight
                .or(file.router_prefill_interference_weight),
            router_kv_overflow_weight: self
                .router_kv_overflow_weight
                .or(file.router_kv_overflow_weight),
            router_own_decode_weight: self
                .router_own_decode_weight
                .or(file.router_own_decode_weight),
            router_decode_active_request_weight: self
                .router_decode_active_request_weight
                .or(file.router_decode_active_request_weight),
            router_temperature: self.router_temperature.or(file.router_temperature),
            router_host_cache_hit_weight: self
                .router_host_cache_hit_weight
                .or(file.router_host_cache_hit_weight),
            router_disk_cache_hit_weight: self
                .router_disk_cache_hit_weight
                .or(file.router_disk_cache_hit_weight),
            shared_cache_multiplier: self
                .shared_cache_multiplier
                .or(file.shared_cache_multiplier),
            router_track_output_blocks: self.router_track_output_blocks
                || file.router_track_output_blocks,
        }
    }
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
            own_decode_weight: weight(
                "router_own_decode_weight",
                self.router_own_decode_weight,
                kv.own_decode_weight,
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::Args;
    use super::*;

    fn kv_aware(args: Args) -> KvAwareConfig {
        args.into_settings().unwrap().policy_config.kv_aware
    }

    #[test]
    fn the_own_decode_weight_from_the_flag_the_file_and_both() {
        let default = kv_aware(Args::try_parse_from(["kvroute"]).unwrap());
        assert_eq!(
            default.own_decode_weight,
            kvroute_core::policy::DEFAULT_OWN_DECODE_WEIGHT
        );
        let cli = Args::try_parse_from(["kvroute", "--router-own-decode-weight", "0"]).unwrap();
        assert_eq!(cli.kv_aware.router_own_decode_weight, Some(0.0));
        let file = Args::from_text(
            "router_own_decode_weight: 500\nrouter_kv_overflow_weight: 2\n\
             router_track_output_blocks: true\nport: 8000\n",
        )
        .unwrap();
        assert_eq!(file.port, Some(8000));
        // The command line's weight wins; the file's others stay, its flag too.
        let merged = kv_aware(cli.merge(file));
        assert_eq!(merged.own_decode_weight, 0.0);
        assert_eq!(merged.kv_overflow_weight, 2.0);
        assert!(merged.answers_counted);
        let from_file = Args::try_parse_from(["kvroute"])
            .unwrap()
            .merge(Args::from_text("router_own_decode_weight: 500\n").unwrap());
        assert_eq!(kv_aware(from_file).own_decode_weight, 500.0);
        // A negative or non-finite weight is refused by name; an unknown key beside the
        // group's still is.
        for bad in ["-1", "inf", "NaN"] {
            let flag = format!("--router-own-decode-weight={bad}");
            let e = Args::try_parse_from(["kvroute", flag.as_str()])
                .unwrap()
                .into_settings()
                .unwrap_err()
                .to_string();
            assert!(e.contains("router_own_decode_weight"), "{bad}: {e}");
        }
        assert!(Args::from_text("router_own_decode_weightt: 1\n").is_err());
    }
}
