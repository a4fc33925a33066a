//! The edges of kvroute: the `kvroute` binary's HTTP gateway.
//!
//! Owns the axum server (OpenAI-compatible routes, SGLang's `/generate`, health, readiness,
//! `/workers`; over TLS when configured), the pooled HTTP client to the workers (TLS to
//! `https://` ones), streaming passthrough with in-flight accounting, worker discovery,
//! configuration and Prometheus metrics. Routing decisions are delegated to `kvroute-core`,
//! synchronously, over a snapshot of the workers.
//!
//! Invariants: request bodies are forwarded as received; a response stream is never
//! buffered; every in-flight count is a guard owned by the response body; errors become
//! HTTP responses in one place ([`error::GatewayError`]); constructors do no I/O and every
//! background task is started by [`Gateway::serve`] and joined on shutdown.
//!
//! The modules stand in five layers; each imports only from its own layer or below, with no
//! cycle between modules (`tests/layers.rs` checks it):
//! 1. foundation: `config` (settings and validation), `error`, `auth`, `metrics`, `http`, `otlp`
//!    (the trace exporter and spans), `tls`, `usage` (the usage tap on a response body);
//! 2. engine edge, one engine at a time: `engine_metrics`, `kv_events`, `health` (probes, circuit);
//! 3. state: `workers` (the set and its routing-table snapshot), `kv`, `prompts` (tokens and
//!    the tokenizer prefix cache), `busy`, `rate_limit` (the tenants' token buckets), `engine_priority` (the tenants' tokens
//!    in flight, for `--engine-priority`), `peer_metrics` (`--metrics-compat`: the peers' metric
//!    names over the workers' series);
//! 4. request path: `admission` (the concurrency limit, its queue and rate), `routing`, `recent` (the last decisions), `queue`, `proxy`, `sync`, `context`,
//!    `pick` (the stages both front doors share: admission, queue, pick, learn),
//!    `migrate`, `pd`, `forward`, `epp` (the endpoint picker: Envoy's ext_proc),
//!    `discovery`;
//! 5. server: `server` (the axum app, admin API, background tasks) and `main`.

// 1. Foundation.
pub mod auth;
pub mod config;
pub mod error;
pub mod http;
pub mod metrics;
pub mod otlp;
pub mod tls;
pub mod usage;

// 2. The engine edge.
pub mod engine_metrics;
pub mod health;
pub mod kv_events;

// 3. State.
pub mod busy;
pub mod engine_priority;
pub mod kv;
pub mod peer_metrics;
pub mod prompts;
pub mod rate_limit;
pub mod workers;

// 4. The request path.
pub mod admission;
pub(crate) mod context;
pub(crate) mod discovery;
pub mod epp;
pub(crate) mod forward;
pub mod migrate;
pub mod pd;
pub(crate) mod pick;
pub mod proxy;
pub mod queue;
pub mod recent;
pub mod routing;
pub mod sync;

// 5. The server.
pub mod server;

pub use config::{Args, Settings, WorkerSpec};
pub use server::{metrics_app, Gateway};
