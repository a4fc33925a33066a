//! The LoRA adapters the server knows: those of `--lora-modules`, and with `--lora-any` every
//! name a request has used. An adapter's id is its position, from 1 (vLLM's `lora_int_id`).
//! A request names its adapter in `model`; the base model's name runs without one.

use std::sync::RwLock;

use super::error::ApiError;
use crate::config::LoraArgs;
use crate::engine::LoraId;

#[derive(Debug)]
pub struct Adapters {
    enabled: bool,
    any: bool,
    names: RwLock<Vec<String>>,
}

impl Adapters {
    pub(super) fn new(args: &LoraArgs) -> Self {
        Self {
            enabled: args.enabled(),
            any: args.lora_any,
            names: RwLock::new(args.names()),
        }
    }

    pub(super) fn enabled(&self) -> bool {
        self.enabled
    }

    /// The adapter `model` names, registered now with `--lora-any`; vLLM's 404 when it names
    /// none (nor the base model, checked by the caller).
    pub(super) fn resolve(&self, model: &str) -> Result<LoraId, ApiError> {
        let id = |i: usize| LoraId(i as u32 + 1);
        let read = self.names.read().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = read.iter().position(|n| n == model) {
            return Ok(id(i));
        }
        drop(read);
        if !(self.enabled && self.any) || model.is_empty() {
            return Err(ApiError::not_found(format!(
                "The model `{model}` does not exist."
            )));
        }
        let mut names = self.names.write().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = names.iter().position(|n| n == model) {
            return Ok(id(i));
        }
        names.push(model.to_owned());
        tracing::info!(adapter = model, "LoRA adapter loaded on first use");
        Ok(id(names.len() - 1))
    }

    /// The name of adapter `id`.
    pub(super) fn name(&self, id: LoraId) -> Option<String> {
        let names = self.names.read().unwrap_or_else(|e| e.into_inner());
        names.get((id.0 as usize).checked_sub(1)?).cloned()
    }

    /// Every adapter's name, in id order.
    pub(super) fn names(&self) -> Vec<String> {
        self.names.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Names of `ids`, comma-separated (the gauge's label values).
    pub(super) fn joined(&self, ids: &[LoraId]) -> String {
        let names: Vec<String> = ids.iter().filter_map(|&i| self.name(i)).collect();
        names.join(",")
    }
}
