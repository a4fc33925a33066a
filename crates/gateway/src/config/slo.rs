//! The flags of per-request latency targets (SLO headers; see `kvroute_core::slo`), a group
//! of `kvroute`'s command line flattened into [`super::Args`] (the config file's keys are
//! the same, at the top level).

use clap::Args as ClapArgs;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use kvroute_core::PolicyKind;

/// `--slo-shed`.
#[derive(Debug, Default, Clone, PartialEq, ClapArgs, Deserialize, Serialize)]
pub struct SloArgs {
    /// kv_aware: answer 503 `slo_unattainable` to a request whose latency targets
    /// (x-llm-d-slo-ttft-ms, x-sgl-ttft-slo-ms, ...) no worker is predicted to meet, instead
    /// of sending it to the fastest [default: off].
    #[arg(long)]
    #[serde(default)]
    pub slo_shed: bool,
}

impl SloArgs {
    /// The command line's group over the file's.
    pub(super) fn merge(self, file: SloArgs) -> SloArgs {
        SloArgs {
            slo_shed: self.slo_shed || file.slo_shed,
        }
    }

    /// Whether to shed, checked against the policy: only kv_aware predicts latencies.
    pub(super) fn shed(&self, policy: PolicyKind) -> Result<bool, ConfigError> {
        if self.slo_shed && policy != PolicyKind::KvAware {
            return Err(ConfigError::Invalid {
                name: "slo_shed",
                reason: "needs --policy kv_aware (the policy that predicts each worker's latency)",
            });
        }
        Ok(self.slo_shed)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::Args;
    use super::*;

    #[test]
    fn the_flag_and_the_file_key_and_the_policy_it_needs() {
        let cli = Args::try_parse_from(["kvroute", "--slo-shed"]).unwrap();
        assert!(cli.slo.slo_shed);
        let file = Args::from_text("slo_shed: true\nport: 8000\n").unwrap();
        assert!(file.slo.slo_shed);
        assert_eq!(file.port, Some(8000));
        // Unknown keys are still refused beside the group's.
        assert!(Args::from_text("slo_shedd: true\n").is_err());
        let merged = Args::try_parse_from(["kvroute"]).unwrap().merge(file);
        assert!(merged.slo.slo_shed);
        assert!(merged.slo.shed(PolicyKind::KvAware).unwrap());
        let e = merged
            .slo
            .shed(PolicyKind::RoundRobin)
            .unwrap_err()
            .to_string();
        assert!(e.contains("slo_shed") && e.contains("kv_aware"), "{e}");
        assert!(!SloArgs::default().shed(PolicyKind::RoundRobin).unwrap());
    }
}
