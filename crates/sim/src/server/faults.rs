//! Fault injection, for the router's reliability tests: failed requests, stalls, a crash,
//! lost KV events.
//!
//! [`Faults`] is shared by the inference handlers, the KV publishers and the listener. Its
//! settings ([`FaultSettings`]) are atomics, read on every inference request without a lock,
//! and changed at runtime through `POST /fault` or a [`FaultHandle`].
//!
//! A crash is a [`CancellationToken`]: the engine's own stop token is its child, so drivers
//! and publishers stop; every accepted connection's I/O ([`CrashIo`]) fails from then on
//! (an idle connection is woken to fail at once), so open streams are cut without their
//! final chunk, and answers still being computed never reach their client; the server then
//! drops its listener and [`super::SimServer::serve`] returns [`Crashed`].

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::error::{json_body, ApiError};
use super::AppState;
use crate::config::{FaultSettings, SimConfigError};

/// What [`super::SimServer::serve`] returns (inside its `anyhow::Error`) after a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the engine crashed (fault injection)")]
pub struct Crashed;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    kind: &'static str,
}

/// `kvroute_sim_faults_injected_total{kind}`, one series per kind of fault.
#[derive(Debug)]
struct FaultMetrics {
    /// Requests answered with `fail_status`.
    error_status: Counter,
    /// Requests stalled by `stall_ms`.
    stall: Counter,
    /// Crashes (at most one per engine).
    crash: Counter,
    /// KV-event messages withheld.
    kv_events_dropped: Counter,
}

impl FaultMetrics {
    fn register(registry: &mut Registry) -> Self {
        let family = Family::<FaultLabels, Counter>::default();
        registry.register(
            "kvroute_sim_faults_injected",
            "Faults injected by kvroute-sim's fault injection, by kind",
            family.clone(),
        );
        let kind = |kind| family.get_or_create(&FaultLabels { kind }).clone();
        Self {
            error_status: kind("error_status"),
            stall: kind("stall"),
            crash: kind("crash"),
            kv_events_dropped: kind("kv_events_dropped"),
        }
    }
}

/// `crash_after_requests` as stored: 0 is none.
const NEVER: u64 = 0;

/// The engine's faults: the settings, the crash, the counts.
#[derive(Debug)]
pub(crate) struct Faults {
    fail_rate: AtomicU64,
    fail_status: AtomicU16,
    stall_ms: AtomicU64,
    crash_after: AtomicU64,
    drop_kv_events: AtomicBool,
    /// Inference requests the engine took.
    accepted: AtomicU64,
    /// Draws which requests fail; seeded, so a sequence of requests fails the same way
    /// on every run.
    rng: Mutex<SmallRng>,
    crashed: AtomicBool,
    crash: CancellationToken,
    metrics: FaultMetrics,
}

impl Faults {
    /// Faults set as `settings` (already validated), failures drawn from `seed`.
    pub(crate) fn new(settings: FaultSettings, seed: u64, registry: &mut Registry) -> Self {
        let faults = Self {
            fail_rate: AtomicU64::new(0),
            fail_status: AtomicU16::new(0),
            stall_ms: AtomicU64::new(0),
            crash_after: AtomicU64::new(NEVER),
            drop_kv_events: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            // Not the engines' stream (they use seed + rank): failures do not shift outputs.
            rng: Mutex::new(SmallRng::seed_from_u64(seed ^ 0xfa01_7fa0_17fa_017f)),
            crashed: AtomicBool::new(false),
            crash: CancellationToken::new(),
            metrics: FaultMetrics::register(registry),
        };
        faults.store(&settings);
        faults
    }

    fn store(&self, s: &FaultSettings) {
        self.fail_rate
            .store(s.fail_rate.to_bits(), Ordering::Relaxed);
        self.fail_status.store(s.fail_status, Ordering::Relaxed);
        self.stall_ms.store(s.stall_ms, Ordering::Relaxed);
        self.crash_after
            .store(s.crash_after_requests.unwrap_or(NEVER), Ordering::Relaxed);
        self.drop_kv_events
            .store(s.drop_kv_events, Ordering::Relaxed);
    }

    fn settings(&self) -> FaultSettings {
        FaultSettings {
            fail_rate: f64::from_bits(self.fail_rate.load(Ordering::Relaxed)),
            fail_status: self.fail_status.load(Ordering::Relaxed),
            stall_ms: self.stall_ms.load(Ordering::Relaxed),
            crash_after_requests: Some(self.crash_after.load(Ordering::Relaxed))
                .filter(|&n| n != NEVER),
            drop_kv_events: self.drop_kv_events.load(Ordering::Relaxed),
        }
    }

    /// The token a crash cancels; the engine's stop token is made its child.
    pub(crate) fn crash_token(&self) -> &CancellationToken {
        &self.crash
    }

    pub(crate) fn is_crashed(&self) -> bool {
        self.crashed.load(Ordering::Acquire)
    }

    pub(crate) fn crash(&self) {
        if !self.crashed.swap(true, Ordering::AcqRel) {
            self.metrics.crash.inc();
            tracing::warn!(
                requests = self.accepted.load(Ordering::Relaxed),
                "Crashing (fault injection)"
            );
            self.crash.cancel();
        }
    }

    /// Runs before an inference request is read: fails it or stalls it as set. A stall
    /// ends early with an error (never seen: the connection goes too) when `stopping`.
    pub(super) async fn before_inference(
        &self,
        stopping: &CancellationToken,
    ) -> Result<(), ApiError> {
        let rate = f64::from_bits(self.fail_rate.load(Ordering::Relaxed));
        if rate > 0.0 {
            let draw: f64 = self.rng.lock().unwrap_or_else(|e| e.into_inner()).random();
            if draw < rate {
                self.metrics.error_status.inc();
                let status = StatusCode::from_u16(self.fail_status.load(Ordering::Relaxed))
                    .unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
                return Err(ApiError::injected(status));
            }
        }
        let stall = self.stall_ms.load(Ordering::Relaxed);
        if stall > 0 {
            self.metrics.stall.inc();
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(stall)) => {}
                _ = stopping.cancelled() => return Err(ApiError::unavailable("engine stopped")),
            }
        }
        Ok(())
    }

    /// Counts a request the engine took. True when `crash_after_requests` makes it the
    /// last: the caller crashes the engine once its first token is on the wire.
    pub(super) fn accept(&self) -> bool {
        let n = self.accepted.fetch_add(1, Ordering::Relaxed) + 1;
        let limit = self.crash_after.load(Ordering::Relaxed);
        limit != NEVER && n >= limit
    }

    /// True when a KV-event message must be withheld (and counts it).
    pub(crate) fn drop_kv_message(&self) -> bool {
        let drop = self.drop_kv_events.load(Ordering::Relaxed);
        if drop {
            self.metrics.kv_events_dropped.inc();
        }
        drop
    }
}

/// Controls a running engine's faults: from a test, or behind `/fault`. Cheap to clone;
/// stays valid after the engine ended.
#[derive(Debug, Clone)]
pub struct FaultHandle(pub(crate) Arc<Faults>);

impl FaultHandle {
    /// The faults as now set.
    pub fn settings(&self) -> FaultSettings {
        self.0.settings()
    }

    /// Sets every fault, e.g. `h.set(FaultSettings { drop_kv_events: true, ..h.settings() })`.
    /// A `crash_after_requests` at or below [`Self::requests_accepted`] makes the next
    /// request the engine takes the last.
    pub fn set(&self, settings: FaultSettings) -> Result<(), SimConfigError> {
        settings.validate()?;
        self.0.store(&settings);
        tracing::info!(?settings, "Faults set");
        Ok(())
    }

    /// Crashes the engine now, as `crash_after_requests` would: open streams are cut, the
    /// listener and the KV-event sockets close, and `serve` returns [`Crashed`] once they
    /// are closed. Does nothing after the first time.
    pub fn crash(&self) {
        self.0.crash();
    }

    pub fn is_crashed(&self) -> bool {
        self.0.is_crashed()
    }

    /// Completes when the engine has crashed (its sockets may still be closing).
    pub async fn crashed(&self) {
        self.0.crash.cancelled().await;
    }

    /// Inference requests the engine took since it started.
    pub fn requests_accepted(&self) -> u64 {
        self.0.accepted.load(Ordering::Relaxed)
    }
}

/// The server's listener: hands out connections that die with the engine.
pub(super) struct CrashListener {
    inner: TcpListener,
    faults: Arc<Faults>,
}

impl CrashListener {
    pub(super) fn new(inner: TcpListener, faults: Arc<Faults>) -> Self {
        Self { inner, faults }
    }
}

impl axum::serve::Listener for CrashListener {
    type Io = CrashIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (CrashIo, SocketAddr) {
        let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        (CrashIo::new(io, self.faults.clone()), addr)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection whose every read and write fails once the engine crashed. A pending read
/// is woken by the crash, so idle keep-alive connections close at once too.
pub(super) struct CrashIo {
    io: TcpStream,
    faults: Arc<Faults>,
    crash: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl CrashIo {
    /// `io`, cut when the engine crashes.
    pub(super) fn new(io: TcpStream, faults: Arc<Faults>) -> Self {
        let crash = Box::pin(faults.crash.clone().cancelled_owned());
        Self { io, faults, crash }
    }
}

fn cut() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "kvroute-sim crashed (fault injection)",
    )
}

impl AsyncRead for CrashIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.faults.is_crashed() || this.crash.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(cut()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for CrashIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.faults.is_crashed() {
            return Poll::Ready(Err(cut()));
        }
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.faults.is_crashed() {
            return Poll::Ready(Err(cut()));
        }
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.faults.is_crashed() {
            return Poll::Ready(Err(cut()));
        }
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.faults.is_crashed() {
            return Poll::Ready(Err(cut()));
        }
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

/// `GET /fault`: the settings and the requests counted towards a crash.
pub(super) async fn get_faults(State(state): State<Arc<AppState>>) -> Response {
    fault_report(&FaultHandle(state.faults.clone()))
}

/// `POST /fault`: changes the settings it names; answers as `GET /fault`.
pub(super) async fn post_faults(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, patch) = json_body::<serde_json::Value>(req).await?;
    let handle = FaultHandle(state.faults.clone());
    apply_patch(&handle, patch).map_err(ApiError::bad_request)?;
    Ok(fault_report(&handle))
}

fn fault_report(handle: &FaultHandle) -> Response {
    let mut report = serde_json::to_value(handle.settings()).unwrap_or_default();
    report["requests_accepted"] = handle.requests_accepted().into();
    Json(report).into_response()
}

/// `POST /fault`'s body: some of [`FaultSettings`]' keys, applied over the current ones.
fn apply_patch(handle: &FaultHandle, patch: serde_json::Value) -> Result<FaultSettings, String> {
    let serde_json::Value::Object(patch) = patch else {
        return Err("expected a JSON object of fault settings".to_owned());
    };
    let mut settings = serde_json::to_value(handle.settings()).map_err(|e| e.to_string())?;
    let fields = settings
        .as_object_mut()
        .ok_or_else(|| "fault settings are an object".to_owned())?;
    for (key, value) in patch {
        if !fields.contains_key(&key) {
            return Err(format!(
                "unknown fault setting `{key}` (known: fail_rate, fail_status, stall_ms, crash_after_requests, drop_kv_events)"
            ));
        }
        fields.insert(key, value);
    }
    let settings: FaultSettings =
        serde_json::from_value(settings).map_err(|e| format!("invalid fault settings: {e}"))?;
    handle.set(settings).map_err(|e| e.to_string())?;
    Ok(settings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn handle(settings: FaultSettings) -> FaultHandle {
        FaultHandle(Arc::new(Faults::new(settings, 7, &mut Registry::default())))
    }

    #[test]
    fn a_patch_changes_only_its_keys_and_is_validated() {
        let h = handle(FaultSettings {
            crash_after_requests: Some(9),
            ..FaultSettings::default()
        });
        let s = apply_patch(&h, json!({"fail_rate": 0.25, "drop_kv_events": true})).unwrap();
        assert_eq!(s, h.settings());
        assert_eq!((s.fail_rate, s.fail_status), (0.25, 503));
        assert!(s.drop_kv_events);
        assert_eq!(s.crash_after_requests, Some(9));
        let s = apply_patch(&h, json!({"crash_after_requests": null})).unwrap();
        assert_eq!(s.crash_after_requests, None);
        for bad in [
            json!({"fail_rate": 2}),
            json!({"fail_status": 200}),
            json!({"stall_ms": -1}),
            json!({"crash": true}),
            json!([1]),
        ] {
            assert!(apply_patch(&h, bad.clone()).is_err(), "{bad}");
        }
        assert_eq!(
            h.settings().fail_rate,
            0.25,
            "a refused patch changes nothing"
        );
    }

    #[test]
    fn the_crash_comes_with_the_nth_request_and_once() {
        let h = handle(FaultSettings {
            crash_after_requests: Some(2),
            ..FaultSettings::default()
        });
        assert!(!h.0.accept());
        assert!(h.0.accept());
        assert!(h.0.accept(), "later ones are cut too");
        assert_eq!(h.requests_accepted(), 3);
        assert!(!h.is_crashed());
        h.crash();
        h.crash();
        assert!(h.is_crashed() && h.0.crash_token().is_cancelled());
        assert_eq!(h.0.metrics.crash.get(), 1);
    }

    #[tokio::test]
    async fn failures_follow_the_rate_and_the_seed() {
        let run = |rate| async move {
            let h = handle(FaultSettings {
                fail_rate: rate,
                fail_status: 429,
                ..FaultSettings::default()
            });
            let mut failed = Vec::new();
            for _ in 0..200 {
                match h.0.before_inference(&CancellationToken::new()).await {
                    Ok(()) => failed.push(false),
                    Err(e) => {
                        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
                        assert_eq!(e.kind(), "RateLimitError");
                        failed.push(true);
                    }
                }
            }
            failed
        };
        let half = run(0.5).await;
        assert_eq!(
            half,
            run(0.5).await,
            "the same seed fails the same requests"
        );
        let n = half.iter().filter(|&&f| f).count();
        assert!((60..140).contains(&n), "{n} of 200");
        assert!(run(1.0).await.iter().all(|&f| f));
        assert!(run(0.0).await.iter().all(|&f| !f));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_waits_and_ends_when_the_engine_stops() {
        let h = handle(FaultSettings {
            stall_ms: 60_000,
            ..FaultSettings::default()
        });
        let stopping = CancellationToken::new();
        let start = tokio::time::Instant::now();
        assert!(h.0.before_inference(&stopping).await.is_ok());
        assert_eq!(start.elapsed(), Duration::from_secs(60));
        let stalled = h.0.before_inference(&stopping);
        stopping.cancel();
        assert!(stalled.await.is_err());
        assert_eq!(h.0.metrics.stall.get(), 2);
    }
}
