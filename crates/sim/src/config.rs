//! The command line of `kvroute-sim` (vLLM's flag names where vLLM has one).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use crate::engine::{EngineConfig, TimingModel};

/// The encoding of KV events on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum KvEventsFormat {
    /// vLLM 0.32: events as maps with a `type` field.
    #[default]
    Map,
    /// Older vLLM: positional arrays.
    Array,
}

/// A simulated vLLM replica.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvroute-sim",
    version,
    args_override_self = true,
    about = "A simulated vLLM replica: continuous batching, paged prefix cache, KV events"
)]
pub struct SimArgs {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The served model name.
    #[arg(long, alias = "served-model-name", default_value = "kvroute-sim")]
    pub model: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Names this replica in every response's `system_fingerprint` (to tell replicas apart
    /// behind a router that does not say which it chose).
    #[arg(long, default_value = "kvroute-sim")]
    pub instance_id: String,
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 16384)]
    pub num_gpu_blocks: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Divides every simulated time.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Prefill ms per (new token)^2 in a step.
    #[arg(long, default_value_t = 4.209989e-7)]
    pub prefill_quadratic: f64,
    /// Prefill ms per new token.
    #[arg(long, default_value_t = 1.518344e-2)]
    pub prefill_linear: f64,
    /// Prefill ms per step that prefills.
    #[arg(long, default_value_t = 16.50142)]
    pub prefill_constant: f64,
    /// Prefill ms per (new token, earlier context token) pair.
    #[arg(long, default_value_t = 8.42e-7)]
    pub prefill_context: f64,
    /// Decode ms per (KV utilisation)^2.
    #[arg(long, default_value_t = -25.74, allow_hyphen_values = true)]
    pub decode_quadratic: f64,
    /// Decode ms per KV utilisation.
    #[arg(long, default_value_t = 54.01)]
    pub decode_linear: f64,
    /// Decode ms per step that decodes.
    #[arg(long, default_value_t = 5.74)]
    pub decode_constant: f64,
    /// Decode ms per sequence decoded.
    #[arg(long, default_value_t = 0.1)]
    pub decode_per_seq: f64,
    /// A model directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Independent engine cores behind this server (vLLM's data parallelism).
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: usize,
    /// Publish KV events on a ZMQ PUB socket bound here (rank r binds port + r), e.g. tcp://*:5557.
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    #[arg(long, value_enum, default_value_t = KvEventsFormat::Map)]
    pub kv_events_format: KvEventsFormat,
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Log level (trace, debug, info, warn, error).
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

impl Default for SimArgs {
    fn default() -> Self {
        Self::parse_from(["kvroute-sim"])
    }
}

/// An invalid combination of flags.
#[derive(Debug, thiserror::Error)]
#[error("invalid value for --{flag}: {reason}")]
pub struct SimConfigError {
    pub flag: &'static str,
    pub reason: &'static str,
}

impl SimArgs {
    pub fn validate(&self) -> Result<(), SimConfigError> {
        let positive = |flag, v: usize| {
            if v == 0 {
                Err(SimConfigError {
                    flag,
                    reason: "must be at least 1",
                })
            } else {
                Ok(())
            }
        };
        positive("max-num-seqs", self.max_num_seqs)?;
        positive("max-num-batched-tokens", self.max_num_batched_tokens)?;
        positive("num-gpu-blocks", self.num_gpu_blocks)?;
        positive("block-size", self.block_size)?;
        positive("data-parallel-size", self.data_parallel_size)?;
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(SimConfigError {
                flag: "speedup",
                reason: "must be a positive number",
            });
        }
        Ok(())
    }

    /// The engine configuration of data-parallel rank `rank`.
    pub fn engine_config(&self, rank: usize, output_tokens: Vec<u32>) -> EngineConfig {
        EngineConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            num_gpu_blocks: self.num_gpu_blocks,
            block_size: self.block_size,
            timing: TimingModel {
                prefill_quadratic: self.prefill_quadratic,
                prefill_linear: self.prefill_linear,
                prefill_constant: self.prefill_constant,
                prefill_context: self.prefill_context,
                decode_quadratic: self.decode_quadratic,
                decode_linear: self.decode_linear,
                decode_constant: self.decode_constant,
                decode_per_seq: self.decode_per_seq,
                speedup: self.speedup,
            },
            output_tokens,
            seed: self.seed.wrapping_add(rank as u64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_vllms_and_flags_validate() {
        let a = SimArgs::default();
        assert_eq!((a.max_num_seqs, a.max_num_batched_tokens), (256, 8192));
        assert_eq!((a.num_gpu_blocks, a.block_size), (16384, 16));
        assert_eq!(a.engine_config(0, vec![1]).timing, TimingModel::default());
        assert!(a.validate().is_ok());
        let bad = SimArgs::parse_from(["kvroute-sim", "--speedup", "0"]);
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--speedup"));
        let bad = SimArgs::parse_from(["kvroute-sim", "--block-size", "0"]);
        assert!(bad.validate().is_err());
        let a = SimArgs::parse_from([
            "kvroute-sim",
            "--decode-quadratic",
            "-3",
            "--served-model-name",
            "x",
        ]);
        assert_eq!(a.decode_quadratic, -3.0);
        assert_eq!(a.model, "x");
    }
}
