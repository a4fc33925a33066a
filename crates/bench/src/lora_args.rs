//! LoRA adapters over a simulated cluster's requests (`simulate` and `goodput`).

use std::time::Duration;

use clap::Args;
use kvroute_sim::engine::LoraConfig;

#[derive(Debug, Args)]
#[command(next_help_heading = "LoRA adapters")]
pub struct LoraArgs {
    /// Give each request one of N LoRA adapters: a prefix group shares one (a Mooncake
    /// request's first hash id modulo N); 0: the base model only.
    #[arg(long, value_name = "N", default_value_t = 0)]
    loras: u32,
    /// Adapter slots per engine (vLLM's --max-loras).
    #[arg(long, value_name = "N", default_value_t = 4, requires = "loras")]
    max_loras: usize,
    /// Milliseconds an engine takes to load an adapter into a slot.
    #[arg(long, value_name = "MS", default_value_t = 50.0, requires = "loras")]
    lora_load_ms: f64,
}

impl LoraArgs {
    /// The number of adapters and the engines' slots.
    pub fn config(&self) -> anyhow::Result<(u32, LoraConfig)> {
        if self.max_loras == 0 {
            anyhow::bail!("--max-loras must be at least 1");
        }
        if !(self.lora_load_ms.is_finite() && self.lora_load_ms >= 0.0) {
            anyhow::bail!("--lora-load-ms must be a number of milliseconds, 0 or more");
        }
        Ok((
            self.loras,
            LoraConfig {
                max_loras: self.max_loras,
                load_time: Duration::from_secs_f64(self.lora_load_ms / 1e3),
            },
        ))
    }
}
