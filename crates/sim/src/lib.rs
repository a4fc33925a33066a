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
//! Prefill/decode disaggregation (`--role prefill|decode`, [`Role`]): a prefill engine answers
//! vLLM's `kv_transfer_params` and serves SGLang-style bootstrap rooms; a decode engine
//! receives a prompt's KV after a transfer time instead of computing it
//! ([`engine::PromptKv::Transfer`]); each publishes the KV events of the blocks it holds.
//!
//! Fault injection ([`FaultSettings`]: failed requests, stalls, a crash, lost KV events),
//! set by flags and changed at runtime by `POST /fault` or a [`FaultHandle`], serves the
//! router's reliability tests; [`SimInstance`] runs an engine that a test can crash and
//! restart on the same ports. [`Fleet`] runs many engines in one process (`--engines N`),
//! as tasks on one runtime.

pub mod config;
pub mod engine;
pub mod fleet;
pub mod server;

pub use config::{FaultSettings, Role, SimArgs, TimingArgs};
pub use fleet::Fleet;
pub use server::{Crashed, FaultHandle, SimInstance, SimServer};

/// `len` pseudo-random lowercase letters from `seed` (xorshift): distinct prompts for tests
/// and load generators, the same for the same seed.
pub fn text(len: usize, seed: u64) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (b'a' + (x % 26) as u8) as char
        })
        .collect()
}
