//! `kvroute-bench`: the tools that measure routing quality.
//!
//! Owns trace parsing and prompt synthesis ([`trace`]) and the virtual-time cluster
//! simulation ([`simulate`]): the real routing core and kvroute-sim's engine core in one
//! process, deterministic for a seed. (Real-time replay against an HTTP endpoint is still to
//! come.)

pub mod simulate;
pub mod trace;
