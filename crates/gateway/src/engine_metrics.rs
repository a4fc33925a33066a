//! The engine metrics scraper: what each engine says about its own load, read from its
//! Prometheus `/metrics`, for the policies and thresholds that use it (`llm_d`, `kv_aware`'s
//! busy thresholds).
//!
//! One [`EngineMetricsScraper`] per worker polls `GET {url}/metrics` every
//! `--metrics-refresh-ms` (50 ms by default): one request at a time, the next started no
//! sooner than one interval after the previous one started, each bounded by a timeout. The
//! first scrape is at once; the second comes one interval plus a random phase of it later
//! ([`crate::health::phase`]), so a thousand workers added together are scraped spread over
//! the interval, not in one burst. In a large fleet the interval stretches, so that all the
//! workers' scrapes together stay under `--metrics-scrapes-per-sec` ([`ScrapePace`]).
//! The body is parsed ([`parse()`]: vLLM's and SGLang's gauge names, per data-parallel rank)
//! and each rank's reading is stored, with its time, in that rank's [`EngineGauges`], which
//! requests read lock-free through [`EngineGauges::load`]. A failed scrape (connection
//! refused, timeout, non-2xx status, a body over 16 MiB, not UTF-8, not Prometheus text)
//! stores nothing and is logged at debug level and counted ([`ScrapeStats`]); the previous
//! reading then ages, and after [`STALE_AFTER`] (2 s) it reads as unknown (`None`), which
//! the policies treat as neutral. A rank the body does not mention goes stale the same way.
//!
//! Rank matching: a rank configured as `Some(r)` takes the reading labelled `r` (`engine` in
//! vLLM, `dp_rank` in SGLang); a worker without ranks (`None`) takes rank 0, which is also
//! what an unlabelled series belongs to. When the worker has a single rank and the body a
//! single engine, they are matched whatever the label (an external-load-balancer
//! deployment may number its only engine by its global rank).
//!
//! Lifecycle: constructors do no I/O; [`EngineMetricsScraper::run`] is the background task,
//! started by the server and stopped by its shutdown token.

mod gauges;
mod pace;
mod parse;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use tokio_util::sync::CancellationToken;

use crate::error::BoxError;
use crate::health::random_phase;
use crate::http::HttpClient;

pub use gauges::{EngineGauges, STALE_AFTER};
pub use pace::{ScrapePace, Scraping, MAX_STRETCH};
pub use parse::{parse, EngineReadings, LoraReading, ParseError, RankReading};

/// The largest `/metrics` body read (vLLM's is tens of kilobytes).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// How often and how patiently to scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrapeTiming {
    /// The least time between the starts of two scrapes (`--metrics-refresh-ms`).
    pub interval: Duration,
    /// The most one scrape (connection, answer and body) may take.
    pub timeout: Duration,
}

impl Default for ScrapeTiming {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
        }
    }
}

/// Why one scrape gave no reading.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("invalid metrics url '{url}': {source}")]
    InvalidUrl {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    #[error("request failed: {0}")]
    Request(#[source] crate::http::ClientError),
    #[error("answered {0}")]
    Status(StatusCode),
    #[error("cannot read the body: {0}")]
    Body(#[source] BoxError),
    #[error("the body is not UTF-8")]
    NotUtf8(#[source] std::str::Utf8Error),
    #[error("the body is not Prometheus text: {0}")]
    NotPrometheus(#[from] ParseError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Scrapes that succeeded and failed, since the scraper was made.
#[derive(Debug, Default)]
pub struct ScrapeStats {
    ok: AtomicU64,
    failed: AtomicU64,
}

impl ScrapeStats {
    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
}

/// Polls one worker's `/metrics` into the gauges of its ranks.
#[derive(Debug)]
pub struct EngineMetricsScraper {
    worker: String,
    uri: Uri,
    ranks: Vec<(Option<u32>, Arc<EngineGauges>)>,
    timing: ScrapeTiming,
    /// The fleet's pace, when the interval follows it (else `timing.interval`).
    pace: Option<Arc<ScrapePace>>,
    stats: Arc<ScrapeStats>,
}

impl EngineMetricsScraper {
    /// A scraper of `{base_url}/metrics` for the worker named `worker` (used in logs), whose
    /// data-parallel ranks (`None` for a worker without ranks) store into the given gauges.
    pub fn new(
        worker: impl Into<String>,
        base_url: &str,
        ranks: Vec<(Option<u32>, Arc<EngineGauges>)>,
        timing: ScrapeTiming,
    ) -> Result<Self, ScrapeError> {
        let url = format!("{}/metrics", base_url.trim_end_matches('/'));
        let uri = url
            .parse::<Uri>()
            .map_err(|source| ScrapeError::InvalidUrl { url, source })?;
        Ok(Self {
            worker: worker.into(),
            uri,
            ranks,
            timing,
            pace: None,
            stats: Arc::default(),
        })
    }

    /// The same, its interval taken from `pace` before each scrape (see [`ScrapePace`]).
    pub fn paced(self, pace: Arc<ScrapePace>) -> Self {
        Self {
            pace: Some(pace),
            ..self
        }
    }

    /// The interval before the next scrape.
    fn interval(&self) -> Duration {
        let interval = self
            .pace
            .as_ref()
            .map_or(self.timing.interval, |p| p.interval());
        interval.max(Duration::from_millis(1))
    }

    /// The scraper's counters (shared: they keep counting while [`run`](Self::run) runs).
    pub fn stats(&self) -> Arc<ScrapeStats> {
        self.stats.clone()
    }

    /// Scrapes until `shutdown` is cancelled.
    pub async fn run(self, client: HttpClient, shutdown: CancellationToken) {
        let _counted = self.pace.as_ref().map(ScrapePace::join);
        let mut next = tokio::time::Instant::now();
        let mut first = true;
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(next) => {}
            }
            // The next scrape starts one interval (as the pace has it now) after this one
            // started, or at once if this one takes longer. After the first, scraped at
            // once, each worker keeps its own phase of the interval.
            let interval = self.interval();
            next = tokio::time::Instant::now() + interval;
            if std::mem::take(&mut first) {
                next += random_phase(interval);
            }
            let result = tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                r = tokio::time::timeout(self.timing.timeout, self.scrape_once(&client)) => {
                    r.unwrap_or(Err(ScrapeError::Timeout(self.timing.timeout)))
                }
            };
            match result {
                Ok(readings) => {
                    self.store(&readings, Instant::now());
                    self.stats.ok.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) => {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(worker = %self.worker, %error, "Engine metrics scrape failed");
                }
            }
        }
    }

    /// One `GET /metrics`, parsed.
    pub async fn scrape_once(&self, client: &HttpClient) -> Result<EngineReadings, ScrapeError> {
        let request = http::Request::get(self.uri.clone())
            .header(http::header::ACCEPT, "text/plain")
            .body(Full::new(Bytes::new()))
            .expect("a GET with a valid uri is a valid request");
        let response = client
            .request(request)
            .await
            .map_err(ScrapeError::Request)?;
        if !response.status().is_success() {
            return Err(ScrapeError::Status(response.status()));
        }
        let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(ScrapeError::Body)?
            .to_bytes();
        let text = std::str::from_utf8(&body).map_err(ScrapeError::NotUtf8)?;
        Ok(parse(text)?)
    }

    /// Stores each rank's reading, taken at `at`; ranks the body lacks are left to age. The
    /// engine's adapters go to every rank.
    pub fn store(&self, readings: &EngineReadings, at: Instant) {
        if let Some(lora) = &readings.lora {
            let lora = Arc::new(lora.clone());
            for (_, gauges) in &self.ranks {
                gauges.record_lora(lora.clone(), at);
            }
        }
        if let ([(_, gauges)], 1) = (self.ranks.as_slice(), readings.len()) {
            if let Some((_, reading)) = readings.iter().next() {
                gauges.record(reading, at);
            }
            return;
        }
        for (rank, gauges) in &self.ranks {
            if let Some(reading) = readings.rank(rank.unwrap_or(0)) {
                gauges.record(reading, at);
            }
        }
    }
}
