//! The command line of `kvroute-sim` (vLLM's flag names where vLLM has one).

use std::path::PathBuf;

use clap::{Args, Parser, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::engine::{EngineConfig, SchedulingPolicy, TimingFamily, TimingModel};

mod lora;
pub use lora::LoraArgs;

/// The encoding of KV events on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum KvEventsFormat {
    /// vLLM 0.32: events as maps with a `type` field.
    #[default]
    Map,
    /// Older vLLM: positional arrays.
    Array,
}

/// This engine's part in prefill/decode disaggregation (see `server::pd`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Role {
    /// Computes prompts for decode engines: answers `kv_transfer_params` asking for a remote
    /// decode with the blocks it holds, and completes the bootstrap rooms it is given.
    Prefill,
    /// Decodes prompts computed by prefill engines: takes their KV (`kv_transfer_params`
    /// or bootstrap fields) after a transfer time instead of computing it.
    Decode,
    /// An aggregated engine: computes every request itself, ignoring disaggregation fields.
    #[default]
    Both,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
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
    /// Engines served by this process: engine i on --port + i, its KV events on the
    /// --kv-events-endpoint port + i (x --data-parallel-size), its instance id suffixed
    /// with -i; all on one runtime (see `fleet`).
    #[arg(long, default_value_t = 1)]
    pub engines: usize,
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
    /// vLLM's `--scheduling-policy`: `priority` orders the waiting queue by each request's
    /// `priority` field (lowest first) and preempts the lowest first; `fcfs` ignores it.
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,
    /// Divides every simulated time.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    #[command(flatten)]
    pub timing: TimingArgs,
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
    /// This engine's part in prefill/decode disaggregation.
    #[arg(long, value_enum, default_value_t = Role::Both, help_heading = "Disaggregation")]
    pub role: Role,
    /// Bytes of KV per token, for the transfer time of a decode engine: 2 (K and V) x layers
    /// x KV heads x head dim x bytes per value; the default is Llama-3-8B in fp16
    /// (2 x 32 x 8 x 128 x 2).
    #[arg(long, default_value_t = 131_072, help_heading = "Disaggregation")]
    pub kv_bytes_per_token: u64,
    /// The KV transfer link between prefill and decode engines, in gigabits per second.
    #[arg(long, default_value_t = 100.0, help_heading = "Disaggregation")]
    pub kv_transfer_gbps: f64,
    /// A prefill engine tells decode engines when a bootstrap room's prefill is done on this
    /// TCP port (on --host); without it, decode engines do not wait for the prefill.
    #[arg(long, help_heading = "Disaggregation")]
    pub bootstrap_port: Option<u16>,
    /// Serve https only, with this certificate (PEM, with its chain); with --tls-key-path.
    #[arg(long, value_name = "FILE", help_heading = "TLS")]
    pub tls_cert_path: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert-path.
    #[arg(long, value_name = "FILE", help_heading = "TLS")]
    pub tls_key_path: Option<PathBuf>,
    /// Require a client certificate (mTLS), verified against the CA certificates of this
    /// PEM file.
    #[arg(long, value_name = "FILE", help_heading = "TLS")]
    pub tls_client_ca_path: Option<PathBuf>,
    /// Log level (trace, debug, info, warn, error).
    #[arg(long, default_value = "info")]
    pub log_level: String,
    #[command(flatten)]
    pub faults: FaultSettings,
    #[command(flatten)]
    pub lora: LoraArgs,
}

/// The step-time model: a family and, to override its defaults, its coefficients (the
/// same flags in `kvroute-sim`, `kvroute-bench simulate` and `kvroute`'s embedded engines).
#[derive(Debug, Clone, PartialEq, Args)]
#[command(next_help_heading = "Step time")]
pub struct TimingArgs {
    /// Whose model: kvroute's own, or Dynamo 1.6.1's mocker exactly (its step times, its
    /// KV-utilisation measure and its scheduler's admission and caching rules).
    #[arg(long, value_enum, default_value_t = TimingFamily::Kvroute)]
    pub timing_model: TimingFamily,
    /// Prefill ms per (new token)^2 in a step [default: 4.209989e-7].
    #[arg(long)]
    pub prefill_quadratic: Option<f64>,
    /// Prefill ms per new token [default: 1.518344e-2].
    #[arg(long)]
    pub prefill_linear: Option<f64>,
    /// Prefill ms per step that prefills [default: 16.50142].
    #[arg(long)]
    pub prefill_constant: Option<f64>,
    /// Prefill ms per (new token, earlier context token) pair [default: 8.42e-7; dynamo: 0].
    #[arg(long)]
    pub prefill_context: Option<f64>,
    /// Decode ms per (KV utilisation)^2 [default: -25.74].
    #[arg(long, allow_hyphen_values = true)]
    pub decode_quadratic: Option<f64>,
    /// Decode ms per KV utilisation [default: 54.01].
    #[arg(long)]
    pub decode_linear: Option<f64>,
    /// Decode ms per step that decodes [default: 5.74].
    #[arg(long)]
    pub decode_constant: Option<f64>,
    /// Decode ms per sequence decoded [default: 0.1; dynamo: 0].
    #[arg(long)]
    pub decode_per_seq: Option<f64>,
}

impl Default for TimingArgs {
    fn default() -> Self {
        Self::from_family(TimingFamily::Kvroute)
    }
}

impl TimingArgs {
    /// A family with its default coefficients.
    pub fn from_family(timing_model: TimingFamily) -> Self {
        Self {
            timing_model,
            prefill_quadratic: None,
            prefill_linear: None,
            prefill_constant: None,
            prefill_context: None,
            decode_quadratic: None,
            decode_linear: None,
            decode_constant: None,
            decode_per_seq: None,
        }
    }

    /// The family's model with the coefficients given; transfer and speedup as the family's
    /// defaults (their flags live elsewhere).
    pub fn model(&self) -> TimingModel {
        let d = self.timing_model.timing();
        TimingModel {
            prefill_quadratic: self.prefill_quadratic.unwrap_or(d.prefill_quadratic),
            prefill_linear: self.prefill_linear.unwrap_or(d.prefill_linear),
            prefill_constant: self.prefill_constant.unwrap_or(d.prefill_constant),
            prefill_context: self.prefill_context.unwrap_or(d.prefill_context),
            decode_quadratic: self.decode_quadratic.unwrap_or(d.decode_quadratic),
            decode_linear: self.decode_linear.unwrap_or(d.decode_linear),
            decode_constant: self.decode_constant.unwrap_or(d.decode_constant),
            decode_per_seq: self.decode_per_seq.unwrap_or(d.decode_per_seq),
            ..d
        }
    }

    /// Every coefficient given is a finite number.
    pub fn validate(&self) -> Result<(), SimConfigError> {
        let coefficients = [
            ("prefill-quadratic", self.prefill_quadratic),
            ("prefill-linear", self.prefill_linear),
            ("prefill-constant", self.prefill_constant),
            ("prefill-context", self.prefill_context),
            ("decode-quadratic", self.decode_quadratic),
            ("decode-linear", self.decode_linear),
            ("decode-constant", self.decode_constant),
            ("decode-per-seq", self.decode_per_seq),
        ];
        for (flag, v) in coefficients {
            if v.is_some_and(|v| !v.is_finite()) {
                return Err(SimConfigError {
                    flag,
                    reason: "must be a finite number",
                });
            }
        }
        Ok(())
    }
}

/// The status a request failed by `--fail-rate` gets unless `--fail-status` says otherwise.
pub const DEFAULT_FAIL_STATUS: u16 = 503;

/// Injected faults, for the router's reliability tests: the flags set them at start, and
/// `POST /fault` (or [`crate::FaultHandle::set`]) changes them while the engine runs. The
/// same names are the flags (`--fail-rate`) and the keys of `/fault`'s JSON (`fail_rate`).
///
/// Only inference requests (`/v1/completions`, `/v1/chat/completions`) are faulted; health,
/// metrics, models and the admin endpoints never are.
#[derive(Debug, Clone, Copy, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Fault injection")]
#[serde(deny_unknown_fields)]
pub struct FaultSettings {
    /// Share (0 to 1) of inference requests answered at once with --fail-status and an
    /// OpenAI-style error body; drawn from a generator seeded with --seed.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// The HTTP status (400 to 599) of the requests failed by --fail-rate.
    #[arg(long, default_value_t = DEFAULT_FAIL_STATUS)]
    pub fail_status: u16,
    /// Milliseconds every inference request waits before its response starts (no header
    /// is sent meanwhile).
    #[arg(long, default_value_t = 0)]
    pub stall_ms: u64,
    /// Crash once this many inference requests have been taken by the engine (counted from
    /// its start): the last one's stream is cut after its first token, every connection
    /// is closed, the port refuses connections, KV events stop, and the binary exits with
    /// a non-zero code.
    #[arg(long)]
    pub crash_after_requests: Option<u64>,
    /// Withhold KV events (sequence numbers still advance, so subscribers see a gap when
    /// they resume).
    #[arg(long)]
    pub drop_kv_events: bool,
}

impl Default for FaultSettings {
    /// No fault.
    fn default() -> Self {
        Self {
            fail_rate: 0.0,
            fail_status: DEFAULT_FAIL_STATUS,
            stall_ms: 0,
            crash_after_requests: None,
            drop_kv_events: false,
        }
    }
}

impl FaultSettings {
    pub fn validate(&self) -> Result<(), SimConfigError> {
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(SimConfigError {
                flag: "fail-rate",
                reason: "must be between 0 and 1",
            });
        }
        if !(400..=599).contains(&self.fail_status) {
            return Err(SimConfigError {
                flag: "fail-status",
                reason: "must be an HTTP error status (400 to 599)",
            });
        }
        if self.crash_after_requests == Some(0) {
            return Err(SimConfigError {
                flag: "crash-after-requests",
                reason: "must be at least 1",
            });
        }
        Ok(())
    }
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
        positive("engines", self.engines)?;
        if self.engines > crate::fleet::MAX_ENGINES {
            return Err(SimConfigError {
                flag: "engines",
                reason: "must be at most 4096",
            });
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(SimConfigError {
                flag: "speedup",
                reason: "must be a positive number",
            });
        }
        if !(self.kv_transfer_gbps.is_finite() && self.kv_transfer_gbps > 0.0) {
            return Err(SimConfigError {
                flag: "kv-transfer-gbps",
                reason: "must be a positive number",
            });
        }
        if self.bootstrap_port.is_some() && self.role != Role::Prefill {
            return Err(SimConfigError {
                flag: "bootstrap-port",
                reason: "only a prefill engine (--role prefill) serves bootstrap rooms",
            });
        }
        if self.tls_cert_path.is_some() != self.tls_key_path.is_some() {
            return Err(SimConfigError {
                flag: "tls-cert-path",
                reason: "--tls-cert-path and --tls-key-path go together",
            });
        }
        if self.tls_client_ca_path.is_some() && self.tls_cert_path.is_none() {
            return Err(SimConfigError {
                flag: "tls-client-ca-path",
                reason: "needs --tls-cert-path and --tls-key-path (client certificates are a TLS matter)",
            });
        }
        self.timing.validate()?;
        self.lora.validate(&self.model)?;
        self.faults.validate()
    }

    /// The scheme of its URLs: https with the TLS flags.
    pub fn scheme(&self) -> &'static str {
        if self.tls_cert_path.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// The engine configuration of data-parallel rank `rank`.
    pub fn engine_config(&self, rank: usize, output_tokens: Vec<u32>) -> EngineConfig {
        EngineConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            num_gpu_blocks: self.num_gpu_blocks,
            block_size: self.block_size,
            timing: TimingModel {
                kv_bytes_per_token: self.kv_bytes_per_token,
                kv_transfer_gbps: self.kv_transfer_gbps,
                speedup: self.speedup,
                ..self.timing.model()
            },
            scheduler: self.timing.timing_model.scheduler(),
            lora: self.lora.engine(),
            policy: self.scheduling_policy,
            output_tokens,
            seed: self.seed.wrapping_add(rank as u64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Scheduler;

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
        assert_eq!(a.timing.decode_quadratic, Some(-3.0));
        assert_eq!(a.engine_config(0, vec![1]).timing.decode_quadratic, -3.0);
        assert_eq!(a.model, "x");
    }

    #[test]
    fn the_timing_model_picks_defaults_that_flags_override() {
        let c = SimArgs::default().engine_config(0, vec![1]);
        assert_eq!(
            (c.timing.family, c.scheduler),
            (TimingFamily::Kvroute, Scheduler::Kvroute)
        );
        let a = SimArgs::parse_from(["kvroute-sim", "--timing-model", "dynamo", "--speedup", "4"]);
        let c = a.engine_config(0, vec![1]);
        assert_eq!(c.timing.family, TimingFamily::Dynamo);
        assert_eq!(c.scheduler, Scheduler::Dynamo);
        assert_eq!(
            (c.timing.prefill_context, c.timing.decode_per_seq),
            (0.0, 0.0)
        );
        assert_eq!(c.timing.prefill_constant, 16.50142);
        assert_eq!(c.timing.speedup, 4.0);
        let a = SimArgs::parse_from([
            "kvroute-sim",
            "--timing-model",
            "dynamo",
            "--decode-per-seq",
            "0.2",
        ]);
        assert_eq!(a.engine_config(0, vec![1]).timing.decode_per_seq, 0.2);
        assert!(SimArgs::try_parse_from(["kvroute-sim", "--timing-model", "vllm"]).is_err());
        let bad = SimArgs::parse_from(["kvroute-sim", "--prefill-linear", "inf"]);
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--prefill-linear"));
    }

    #[test]
    fn disaggregation_flags_parse_and_validate() {
        let a = SimArgs::default();
        assert_eq!(a.role, Role::Both);
        assert_eq!((a.kv_bytes_per_token, a.kv_transfer_gbps), (131_072, 100.0));
        assert_eq!(a.bootstrap_port, None);
        let a = SimArgs::parse_from([
            "kvroute-sim",
            "--role",
            "prefill",
            "--bootstrap-port",
            "8998",
            "--kv-bytes-per-token",
            "65536",
            "--kv-transfer-gbps",
            "400",
        ]);
        assert_eq!((a.role, a.bootstrap_port), (Role::Prefill, Some(8998)));
        assert_eq!(a.engine_config(0, vec![1]).timing.kv_bytes_per_token, 65536);
        assert!(a.validate().is_ok());
        for bad in [
            &["--kv-transfer-gbps", "0"][..],
            &["--role", "decode", "--bootstrap-port", "8998"],
            &["--bootstrap-port", "8998"],
        ] {
            let a = SimArgs::parse_from(["kvroute-sim"].iter().chain(bad));
            let e = a.validate().unwrap_err().to_string();
            assert!(
                e.contains("--kv-transfer-gbps") || e.contains("--bootstrap-port"),
                "{e}"
            );
        }
        assert!(SimArgs::try_parse_from(["kvroute-sim", "--role", "router"]).is_err());
    }

    #[test]
    fn fault_flags_parse_and_validate() {
        assert_eq!(SimArgs::default().faults, FaultSettings::default());
        let a = SimArgs::parse_from([
            "kvroute-sim",
            "--fail-rate",
            "0.5",
            "--fail-status",
            "500",
            "--stall-ms",
            "20",
            "--crash-after-requests",
            "3",
            "--drop-kv-events",
        ]);
        let expected = FaultSettings {
            fail_rate: 0.5,
            fail_status: 500,
            stall_ms: 20,
            crash_after_requests: Some(3),
            drop_kv_events: true,
        };
        assert_eq!(a.faults, expected);
        assert!(a.validate().is_ok());
        for bad in [
            ["--fail-rate", "1.5"],
            ["--fail-rate", "NaN"],
            ["--fail-status", "200"],
            ["--crash-after-requests", "0"],
        ] {
            let a = SimArgs::parse_from(["kvroute-sim", bad[0], bad[1]]);
            let e = a.validate().unwrap_err().to_string();
            assert!(e.contains(bad[0]), "{e}");
        }
        // The JSON of `/fault` is the same struct.
        let json = serde_json::to_value(expected).unwrap();
        assert_eq!(json["crash_after_requests"], 3);
        assert_eq!(
            serde_json::from_value::<FaultSettings>(json).unwrap(),
            expected
        );
    }
}
