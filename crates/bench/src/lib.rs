//! `kvroute-bench`: the tools that measure routing quality.
//!
//! Owns trace parsing and prompt synthesis ([`trace`]) and the virtual-time cluster
//! simulation ([`simulate`]): the real routing core and kvroute-sim's engine core in one
//! process, deterministic for a seed, and real-time replay against any OpenAI-compatible
//! endpoint ([`replay`]); synthetic workloads in the trace's form ([`synthetic`]) and TTFT
//! figures ([`plot`]).

pub mod plot;
pub mod replay;
pub mod simulate;
pub mod synthetic;
pub mod trace;
