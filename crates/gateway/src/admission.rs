//! Admission into the router: `--max-concurrent-requests` with smg's bounded FIFO in front
//! of it (`--queue-size`, `--queue-timeout-secs`) and its sustained rate
//! (`--rate-limit-tokens-per-second`).
//!
//! A request takes a permit of the concurrency limit, held until its answer (the stream
//! included) is complete. When none is free it waits, in arrival order (tokio's semaphore is
//! fair), if fewer than `queue_size` already wait; else it is refused at once with 429
//! `too_many_requests`. A wait longer than `queue_timeout` ends in 503 `admission_timeout`,
//! a code distinct from the routing queue's `queue_timeout`. With a rate, each admission also
//! takes a token from a bucket that refills at that rate and holds at most the concurrency
//! limit (or one second of the rate without a limit); waiting for a token counts against the
//! same queue and timeout, and a request whose token would come after its timeout is told at
//! once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::config::AdmissionSettings;
use crate::error::GatewayError;

/// The router's admission control; see the module docs.
#[derive(Debug)]
pub struct Admission {
    settings: AdmissionSettings,
    limit: Option<Arc<Semaphore>>,
    /// Requests waiting for a permit or a token (`kvroute_admission_waiting`).
    waiting: Gauge,
    bucket: Option<Mutex<Bucket>>,
}

/// A token bucket: `tokens` at `at`, refilled at `rate` per second up to `burst`.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
    rate: f64,
    burst: f64,
}

impl Bucket {
    /// Takes a token, or says how long until one is there.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.rate))
        }
    }
}

/// A place in the queue, given back when the wait ends however it ends.
struct Waiting<'a>(&'a Gauge);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Admission {
    pub fn new(settings: AdmissionSettings, now: Instant, waiting: Gauge) -> Self {
        let bucket = settings.rate.map(|rate| {
            let burst = settings.limit.map_or(rate.max(1.0), |n| n as f64);
            Mutex::new(Bucket {
                tokens: burst,
                at: now,
                rate,
                burst,
            })
        });
        Self {
            limit: settings.limit.map(|n| Arc::new(Semaphore::new(n))),
            settings,
            waiting,
            bucket,
        }
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.get().max(0) as usize
    }

    fn refused(&self) -> GatewayError {
        GatewayError::TooManyRequests(self.settings.limit.unwrap_or(0))
    }

    /// A place in the queue, if there is one.
    fn enqueue(&self) -> Result<Waiting<'_>, GatewayError> {
        let before = self.waiting.inc().max(0) as usize;
        let place = Waiting(&self.waiting);
        if before >= self.settings.queue_size {
            return Err(self.refused());
        }
        Ok(place)
    }

    /// Admits a request: its permit (none without a concurrency limit), once it has one and
    /// a token, or the refusal.
    pub async fn admit(&self) -> Result<Option<OwnedSemaphorePermit>, GatewayError> {
        let deadline = tokio::time::Instant::now() + self.settings.queue_timeout;
        let timeout = || GatewayError::AdmissionTimeout(self.settings.queue_timeout.as_secs());
        let permit = match &self.limit {
            None => None,
            Some(limit) => match limit.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    let _place = self.enqueue()?;
                    match tokio::time::timeout_at(deadline, limit.clone().acquire_owned()).await {
                        Ok(Ok(permit)) => Some(permit),
                        Ok(Err(_)) => return Err(GatewayError::ShuttingDown),
                        Err(_) => return Err(timeout()),
                    }
                }
            },
        };
        let Some(bucket) = &self.bucket else {
            return Ok(permit);
        };
        let mut place = None;
        loop {
            let wait = match bucket.lock().expect("not poisoned").take(Instant::now()) {
                Ok(()) => return Ok(permit),
                Err(wait) => wait,
            };
            if place.is_none() {
                place = Some(self.enqueue()?);
            }
            let at = tokio::time::Instant::now() + wait;
            // No token comes in time: say so now rather than at the deadline.
            if at > deadline {
                return Err(timeout());
            }
            tokio::time::sleep_until(at).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(limit: Option<usize>, queue: usize, rate: Option<f64>) -> Arc<Admission> {
        Arc::new(Admission::new(
            AdmissionSettings {
                limit,
                queue_size: queue,
                queue_timeout: Duration::from_secs(60),
                rate,
            },
            Instant::now(),
            Gauge::default(),
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn beyond_the_limit_requests_wait_in_order_then_the_queue_refuses() {
        let a = admission(Some(1), 2, None);
        let first = a.admit().await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..2 {
            let (a, tx) = (a.clone(), tx.clone());
            tokio::spawn(async move {
                let permit = a.admit().await.unwrap();
                tx.send(i).unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(permit);
            });
            tokio::task::yield_now().await;
        }
        assert_eq!(a.waiting(), 2);
        // The queue is full: the next is refused at once.
        assert!(matches!(
            a.admit().await,
            Err(GatewayError::TooManyRequests(1))
        ));
        assert_eq!(a.waiting(), 2);
        drop(first);
        assert_eq!(rx.recv().await, Some(0));
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(a.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_past_the_timeout_is_an_admission_timeout() {
        let a = admission(Some(1), 10, None);
        let _held = a.admit().await.unwrap();
        let started = tokio::time::Instant::now();
        let refused = a.admit().await.unwrap_err();
        assert!(matches!(refused, GatewayError::AdmissionTimeout(60)));
        assert_eq!(refused.code(), "admission_timeout");
        assert_eq!(started.elapsed(), Duration::from_secs(60));
        assert_eq!(a.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn no_queue_refuses_at_once() {
        let a = admission(Some(1), 0, None);
        let _held = a.admit().await.unwrap();
        assert!(matches!(
            a.admit().await,
            Err(GatewayError::TooManyRequests(1))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_due_after_the_timeout_is_refused_at_once() {
        // One request per 100 s, a 60 s timeout: the second cannot be admitted in time.
        let a = admission(None, 10, Some(0.01));
        assert!(a.admit().await.unwrap().is_none());
        let started = tokio::time::Instant::now();
        assert!(matches!(
            a.admit().await,
            Err(GatewayError::AdmissionTimeout(60))
        ));
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(a.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_rate_bursts_to_the_limit_then_admits_at_its_pace() {
        let a = admission(Some(4), 100, Some(2.0));
        let started = tokio::time::Instant::now();
        let mut permits = Vec::new();
        for _ in 0..4 {
            permits.push(a.admit().await.unwrap());
        }
        assert_eq!(started.elapsed(), Duration::ZERO, "the burst");
        permits.clear();
        for _ in 0..4 {
            drop(a.admit().await.unwrap());
        }
        // Four more at 2 per second: 2 s.
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(1990) && took <= Duration::from_millis(2010),
            "{took:?}"
        );
    }
}
