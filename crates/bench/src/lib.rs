//! `kvroute-bench`: the tools that measure routing quality.
//!
//! Owns trace parsing and prompt synthesis ([`trace`]) and the virtual-time cluster
//! simulation ([`simulate`]): the real routing core and kvroute-sim's engine core in one
//! process, deterministic for a seed, and real-time replay against any OpenAI-compatible
//! endpoint ([`replay`]); synthetic workloads in the trace's form ([`synthetic`]) and TTFT
//! figures ([`plot`]). Beside the policies, the pooled-LRU reference
//! ([`simulate::reference`]: each request alone on an idle engine with what one LRU cache of
//! the cluster's capacity would hold) and SLO goodput ([`goodput`]: the highest rate at which
//! a simulated cluster meets a latency objective, by bisection); the tables printed ([`report`]) and the commands that print them ([`commands`]); runs at
//! several loads gathered for the TTFT-against-load figure ([`sweep`]); KV-event replay
//! against the indexer ([`index`]); KV events published as a fleet of engines publishes them,
//! for a router to absorb ([`firehose`]).

pub mod commands;
pub mod firehose;
pub mod goodput;
pub mod index;
pub mod plot;
pub mod replay;
pub mod report;
pub mod simulate;
pub mod sweep;
pub mod synthetic;
pub mod tenants;
pub mod trace;
