//! The LoRA adapters the server serves: those of `--lora-modules`, those loaded at run time
//! (`POST /v1/load_lora_adapter`, until `POST /v1/unload_lora_adapter`), and with
//! `--lora-any` every name a request has used. A request names its adapter in `model`; the
//! base model's name runs without one.
//!
//! Each adapter gets the next id, from 1 (vLLM's `lora_int_id`), and ids are never reused: an
//! adapter unloaded and loaded again is a new one to the engine, as in vLLM. An unloaded
//! adapter keeps its name for its requests still in the engine (the metrics name them), but
//! is no longer listed nor accepted.
//!
//! The endpoints answer as vLLM's do (`vllm/entrypoints/openai/serving_models.py`, served
//! when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set; kvroute-sim serves them whenever adapters
//! are on): 200 with a plain-text `Success: ...` line; 400 `InvalidUserInput` for a missing
//! name or path, or an adapter already loaded; 404 `NotFoundError` for unloading one that
//! is not loaded. The path is not read.

use std::sync::{Arc, RwLock};

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::error::{json_body, ApiError};
use super::AppState;
use crate::config::LoraArgs;
use crate::engine::LoraId;

#[derive(Debug)]
pub struct Adapters {
    enabled: bool,
    any: bool,
    base_model: String,
    state: RwLock<Served>,
}

#[derive(Debug, Default)]
struct Served {
    /// Every adapter's name, by id (the id is the position plus one).
    issued: Vec<String>,
    /// The adapters served now, in the order they were loaded.
    listed: Vec<LoraId>,
}

impl Served {
    fn find(&self, name: &str) -> Option<LoraId> {
        self.listed
            .iter()
            .copied()
            .find(|id| self.issued[id.0 as usize - 1] == name)
    }

    fn add(&mut self, name: &str) -> LoraId {
        self.issued.push(name.to_owned());
        let id = LoraId(self.issued.len() as u32);
        self.listed.push(id);
        id
    }
}

impl Adapters {
    pub(super) fn new(args: &LoraArgs, base_model: &str) -> Self {
        let mut served = Served::default();
        for name in args.names() {
            served.add(&name);
        }
        Self {
            enabled: args.enabled(),
            any: args.lora_any,
            base_model: base_model.to_owned(),
            state: RwLock::new(served),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Served> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Served> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn enabled(&self) -> bool {
        self.enabled
    }

    /// The adapter `model` names, registered now with `--lora-any`; vLLM's 404 when it names
    /// none (nor the base model, checked by the caller).
    pub(super) fn resolve(&self, model: &str) -> Result<LoraId, ApiError> {
        if let Some(id) = self.read().find(model) {
            return Ok(id);
        }
        if !(self.enabled && self.any) || model.is_empty() {
            return Err(ApiError::not_found(format!(
                "The model `{model}` does not exist."
            )));
        }
        let mut served = self.write();
        if let Some(id) = served.find(model) {
            return Ok(id);
        }
        tracing::info!(adapter = model, "LoRA adapter loaded on first use");
        Ok(served.add(model))
    }

    /// `POST /v1/load_lora_adapter`'s answer for `name` at `path` (see the module docs);
    /// `in_place` reloads one already loaded.
    fn load(&self, name: &str, path: &str, in_place: bool) -> Result<String, ApiError> {
        if name.is_empty() || path.is_empty() {
            return Err(ApiError::invalid_user_input(
                "Both 'lora_name' and 'lora_path' must be provided.",
            ));
        }
        self.check_enabled()?;
        if name == self.base_model {
            return Err(ApiError::invalid_user_input(format!(
                "'{name}' is the base model's name, not an adapter's."
            )));
        }
        let mut served = self.write();
        if let Some(id) = served.find(name) {
            if !in_place {
                return Err(ApiError::invalid_user_input(format!(
                    "The lora adapter '{name}' has already been loaded."
                )));
            }
            served.listed.retain(|&l| l != id);
        }
        served.add(name);
        tracing::info!(adapter = name, path, "LoRA adapter loaded");
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }

    /// `POST /v1/unload_lora_adapter`'s answer for `name` (see the module docs).
    fn unload(&self, name: &str, int_id: Option<u32>) -> Result<String, ApiError> {
        if name.is_empty() && int_id.is_none() {
            return Err(ApiError::invalid_user_input(
                "either 'lora_name' and 'lora_int_id' needs to be provided.",
            ));
        }
        self.check_enabled()?;
        let mut served = self.write();
        let Some(id) = served.find(name) else {
            return Err(ApiError::not_found(format!(
                "The lora adapter '{name}' cannot be found."
            )));
        };
        served.listed.retain(|&l| l != id);
        tracing::info!(adapter = name, "LoRA adapter unloaded");
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    }

    /// vLLM's engine refuses adapters when LoRA is off (`--enable-lora`).
    fn check_enabled(&self) -> Result<(), ApiError> {
        if self.enabled {
            Ok(())
        } else {
            Err(ApiError::bad_request(
                "LoRA is not enabled: start the server with --enable-lora",
            ))
        }
    }

    /// The name of adapter `id` (also of one unloaded since).
    pub(super) fn name(&self, id: LoraId) -> Option<String> {
        let served = self.read();
        served.issued.get((id.0 as usize).checked_sub(1)?).cloned()
    }

    /// The names of the adapters served now, in the order they were loaded.
    pub(super) fn names(&self) -> Vec<String> {
        let served = self.read();
        served
            .listed
            .iter()
            .map(|id| served.issued[id.0 as usize - 1].clone())
            .collect()
    }

    /// Names of `ids`, comma-separated (the gauge's label values).
    pub(super) fn joined(&self, ids: &[LoraId]) -> String {
        let names: Vec<String> = ids.iter().filter_map(|&i| self.name(i)).collect();
        names.join(",")
    }
}

/// vLLM's `LoadLoRAAdapterRequest`.
#[derive(Debug, Deserialize)]
struct LoadRequest {
    #[serde(default)]
    lora_name: String,
    #[serde(default)]
    lora_path: String,
    #[serde(default)]
    load_inplace: bool,
}

/// vLLM's `UnloadLoRAAdapterRequest`.
#[derive(Debug, Deserialize)]
struct UnloadRequest {
    #[serde(default)]
    lora_name: String,
    #[serde(default)]
    lora_int_id: Option<u32>,
}

/// `POST /v1/load_lora_adapter`.
pub(super) async fn load_adapter(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, r): (_, LoadRequest) = json_body(req).await?;
    let done = state
        .adapters
        .load(&r.lora_name, &r.lora_path, r.load_inplace)?;
    Ok(done.into_response())
}

/// `POST /v1/unload_lora_adapter`.
pub(super) async fn unload_adapter(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, r): (_, UnloadRequest) = json_body(req).await?;
    let done = state.adapters.unload(&r.lora_name, r.lora_int_id)?;
    Ok(done.into_response())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::config::SimArgs;

    fn adapters(argv: &[&str]) -> Adapters {
        let args = SimArgs::parse_from(["s"].iter().chain(argv));
        Adapters::new(&args.lora, "base")
    }

    #[test]
    fn adapters_load_and_unload_at_run_time_with_vllms_answers() {
        let a = adapters(&["--lora-modules", "sql"]);
        assert_eq!(a.names(), ["sql"]);
        let ok = a.load("chat", "/adapters/chat", false).unwrap();
        assert_eq!(ok, "Success: LoRA adapter 'chat' added successfully.");
        assert_eq!(a.names(), ["sql", "chat"]);
        let chat = a.resolve("chat").unwrap();
        let again = a.load("chat", "/x", false).unwrap_err();
        assert_eq!(
            (again.status.as_u16(), again.kind()),
            (400, "InvalidUserInput")
        );
        assert!(again.message().contains("already been loaded"));
        let missing = a.load("", "/x", false).unwrap_err();
        assert_eq!(missing.status.as_u16(), 400);
        assert!(a.load("base", "/x", false).is_err());
        // Unloading: no longer listed nor accepted; its id still names its requests.
        let ok = a.unload("chat", None).unwrap();
        assert_eq!(ok, "Success: LoRA adapter 'chat' removed successfully.");
        assert_eq!(a.names(), ["sql"]);
        assert_eq!(a.resolve("chat").unwrap_err().status.as_u16(), 404);
        assert_eq!(a.name(chat).as_deref(), Some("chat"));
        let unknown = a.unload("chat", None).unwrap_err();
        assert_eq!(
            (unknown.status.as_u16(), unknown.kind()),
            (404, "NotFoundError")
        );
        assert!(unknown.message().contains("cannot be found"));
        assert_eq!(a.unload("", None).unwrap_err().status.as_u16(), 400);
        // Loaded again, it is a new adapter to the engine; a static one unloads too.
        a.load("chat", "/adapters/chat", false).unwrap();
        assert_ne!(a.resolve("chat").unwrap(), chat);
        a.unload("sql", None).unwrap();
        assert_eq!(a.names(), ["chat"]);
        // In place: reloaded under a new id, listed once.
        let before = a.resolve("chat").unwrap();
        a.load("chat", "/v2", true).unwrap();
        assert_eq!(a.names(), ["chat"]);
        assert_ne!(a.resolve("chat").unwrap(), before);
    }

    #[test]
    fn without_lora_the_engine_refuses_adapters() {
        let a = adapters(&[]);
        let e = a.load("chat", "/x", false).unwrap_err();
        assert_eq!((e.status.as_u16(), e.kind()), (400, "BadRequestError"));
        assert!(a.names().is_empty());
    }
}
