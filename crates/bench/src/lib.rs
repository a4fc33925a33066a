//! `kvroute-bench`: the tools that measure routing quality.
//!
//! Owns trace parsing and prompt synthesis ([`trace`]) and the virtual-time cluster
//! simulation ([`simulate`]): the real routing core and kvroute-sim's engine core in one
//! process, deterministic for a seed, and real-time replay against any OpenAI-compatible
//! endpoint ([`replay`]).

pub mod replay;
pub mod simulate;
pub mod trace;
