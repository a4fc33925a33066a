//! Wire types of kvroute, shared by the router and the simulated engine.
//!
//! This crate owns what crosses a process boundary: the subset of an OpenAI request that
//! routing reads ([`RoutingFields`], a borrowing view that never copies the body), the
//! OpenAI-style error body ([`ErrorBody`]), the ids used everywhere ([`WorkerId`],
//! [`ModelId`]), Anthropic's Messages API read as vLLM reads it ([`anthropic`]) and the stable hash ([`stable_hash`]) that hash-based policies and, later,
//! KV-block hashing build on.
//!
//! Invariants: every type here is plain data; the crate does no I/O and depends on no
//! runtime. Hash values are stable across processes and versions (golden tests pin them),
//! because router replicas and engines must agree on them.

pub mod anthropic;
mod error;
pub mod fallback;
mod hash;
pub mod hashers;
mod ids;
pub mod kv_events;
mod openai;
pub mod python;

pub use error::{ErrorBody, ErrorDetail};
pub use hash::{mix64, stable_hash};
pub use ids::{ModelId, WorkerId};
pub use openai::{AgentHints, Content, Message, NvExt, Prompt, RoutingFields};
