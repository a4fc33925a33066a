//! The values of `kvroute`'s enumerated flags (clap's value enums, serde's in the file).

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    #[value(alias = "warning")]
    #[serde(alias = "warning")]
    Warn,
    /// vllm-router's `critical` is `error`: kvroute logs nothing above it.
    #[value(alias = "critical")]
    #[serde(alias = "critical")]
    Error,
}

impl LogLevel {
    pub fn as_filter(self) -> &'static str {
        match self {
            LogLevel::Trace => "trace",
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AssignmentModeArg {
    /// Also the peers' spelling, `min_load`.
    #[value(alias = "min_load")]
    MinLoad,
    Random,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrderArg {
    Fcfs,
    Wspt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryCostArg {
    Linear,
    Utilisation,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CostModelArg {
    Weighted,
    Predicted,
    Calibrated,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AffinityModeArg {
    Hard,
    Soft,
}
