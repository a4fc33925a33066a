//! LoRA adapter flags, as vLLM names them (`--enable-lora`, `--lora-modules`, `--max-loras`),
//! with two of the simulator's own: `--lora-any` (any adapter name is loaded on first use, as
//! vLLM does with runtime loading and a resolver) and `--lora-load-ms`.

use std::time::Duration;

use clap::Args;

use super::SimConfigError;
use crate::engine::LoraConfig;

#[derive(Debug, Clone, PartialEq, Args)]
#[command(next_help_heading = "LoRA adapters")]
pub struct LoraArgs {
    /// Serve LoRA adapters (implied by --lora-modules and --lora-any).
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters served, each `NAME` or `NAME=PATH` (the path is not read).
    #[arg(long, num_args = 1.., value_name = "NAME[=PATH]")]
    pub lora_modules: Vec<String>,
    /// Accept any adapter name, loaded on first use and listed in /v1/models from then on.
    #[arg(long)]
    pub lora_any: bool,
    /// Adapter slots on the device: the most distinct adapters one step may run.
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Milliseconds to load an adapter into a slot (added to the step that needs it).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub lora_load_ms: f64,
}

impl LoraArgs {
    /// Whether adapters are served at all.
    pub fn enabled(&self) -> bool {
        self.enable_lora || self.lora_any || !self.lora_modules.is_empty()
    }

    /// The names of `--lora-modules`, in order.
    pub fn names(&self) -> Vec<String> {
        self.lora_modules
            .iter()
            .map(|m| m.split_once('=').map_or(m.as_str(), |(n, _)| n).to_owned())
            .collect()
    }

    /// The engine's slots and load time.
    pub fn engine(&self) -> LoraConfig {
        LoraConfig {
            max_loras: self.max_loras,
            load_time: Duration::from_secs_f64(self.lora_load_ms.max(0.0) / 1e3),
        }
    }

    pub fn validate(&self, base_model: &str) -> Result<(), SimConfigError> {
        let err = |flag, reason| Err(SimConfigError { flag, reason });
        if self.max_loras == 0 {
            return err("max-loras", "must be at least 1");
        }
        if !(self.lora_load_ms.is_finite() && self.lora_load_ms >= 0.0) {
            return err(
                "lora-load-ms",
                "must be a number of milliseconds, 0 or more",
            );
        }
        let names = self.names();
        for (i, n) in names.iter().enumerate() {
            if n.is_empty() {
                return err(
                    "lora-modules",
                    "an adapter needs a name (NAME or NAME=PATH)",
                );
            }
            if n == base_model {
                return err(
                    "lora-modules",
                    "an adapter cannot have the base model's name",
                );
            }
            if names[..i].contains(n) {
                return err("lora-modules", "each adapter name may appear once");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::config::SimArgs;

    #[test]
    fn lora_flags_parse_and_validate() {
        let a = SimArgs::parse_from(["s"]);
        assert!(!a.lora.enabled());
        assert_eq!(a.lora.max_loras, 1);
        let a = SimArgs::parse_from([
            "s",
            "--lora-modules",
            "sql=/adapters/sql",
            "chat",
            "--max-loras",
            "4",
            "--lora-load-ms",
            "25",
        ]);
        assert!(a.lora.enabled());
        assert_eq!(a.lora.names(), ["sql", "chat"]);
        assert_eq!(a.lora.engine().max_loras, 4);
        assert_eq!(a.lora.engine().load_time.as_millis(), 25);
        a.validate().unwrap();
        let bad = |args: &[&str]| {
            let a = SimArgs::parse_from(["s"].iter().chain(args));
            a.validate().unwrap_err().to_string()
        };
        assert!(bad(&["--max-loras", "0"]).contains("--max-loras"));
        assert!(bad(&["--lora-load-ms", "-1"]).contains("--lora-load-ms"));
        assert!(bad(&["--lora-modules", "a", "a=/x"]).contains("once"));
        assert!(bad(&["--lora-modules", "kvroute-sim"]).contains("base model"));
    }
}
