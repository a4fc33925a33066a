//! `kvroute-sim`: a simulated vLLM replica, for machines with no GPU.
//!
//! Owns the engine model ([`engine::EngineCore`]: continuous batching, chunked prefill, a
//! paged KV cache with prefix caching and LRU eviction, preemption, a published step-time
//! model) and, around it, an HTTP server that speaks vLLM's API, `/metrics` and KV events.
//!
//! Invariants: the engine core is pure (`step(now)` with no I/O, no clock, a seeded rng),
//! so the same code runs behind HTTP in real time and inside a virtual-time cluster
//! simulation. This crate depends on `kvroute-protocol` (and the shared tokenizer) only:
//! it cannot see the router's internals.
//!
//! Fault injection ([`FaultSettings`]: failed requests, stalls, a crash, lost KV events),
//! set by flags and changed at runtime by `POST /fault` or a [`FaultHandle`], serves the
//! router's reliability tests; [`SimInstance`] runs an engine that a test can crash and
//! restart on the same ports.

pub mod config;
pub mod engine;
pub mod server;

pub use config::{FaultSettings, SimArgs};
pub use server::{Crashed, FaultHandle, SimInstance, SimServer};
