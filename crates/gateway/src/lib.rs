//! The edges of kvroute: the `kvroute` binary's HTTP gateway.
//!
//! Owns the axum server (OpenAI-compatible routes, SGLang's `/generate`, health, readiness,
//! `/workers`), the pooled HTTP client to the workers, streaming passthrough with in-flight
//! accounting, worker discovery, configuration and Prometheus metrics. Routing decisions
//! are delegated to `kvroute-core`, synchronously, over a snapshot of the workers.
//!
//! Invariants: request bodies are forwarded as received; a response stream is never
//! buffered; every in-flight count is a guard owned by the response body; errors become
//! HTTP responses in one place ([`error::GatewayError`]); constructors do no I/O and every
//! background task is started by [`Gateway::serve`] and joined on shutdown.

pub mod auth;
pub mod busy;
pub mod config;
pub mod engine_metrics;
pub mod error;
pub mod health;
pub mod kv;
pub mod kv_events;
pub mod metrics;
pub mod pd;
pub mod proxy;
pub mod queue;
pub mod routing;
pub mod server;
pub mod sync;
pub mod workers;

pub use config::{Args, Settings, WorkerSpec};
pub use server::{metrics_app, Gateway};
