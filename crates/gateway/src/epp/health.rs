//! gRPC health (`grpc.health.v1.Health`) for the picker, as llm-d answers without leader
//! election: every service name is SERVING once the endpoints are known (the router is
//! ready), NOT_SERVING before. llm-d's chart probes `""`, `liveness`, `readiness`,
//! `envoy.service.ext_proc.v3.ExternalProcessor` and `inference-extension`.

use std::pin::Pin;

use futures_util::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::Health;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// Answers every service name from the router's readiness.
#[derive(Debug, Clone)]
pub struct PickerHealth {
    ready: watch::Receiver<bool>,
}

impl PickerHealth {
    pub fn new(ready: watch::Receiver<bool>) -> Self {
        Self { ready }
    }

    fn status(ready: bool) -> HealthCheckResponse {
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        HealthCheckResponse {
            status: status as i32,
        }
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for PickerHealth {
    async fn check(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        Ok(Response::new(Self::status(*self.ready.borrow())))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let mut ready = self.ready.clone();
        let stream = async_stream(move |tx| async move {
            let mut last = None;
            loop {
                let now = *ready.borrow_and_update();
                if last != Some(now) {
                    last = Some(now);
                    if tx.send(Ok(Self::status(now))).await.is_err() {
                        return;
                    }
                }
                if ready.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }
}

/// A stream fed by a task: `body` sends into the channel until it returns.
fn async_stream<F, Fut>(body: F) -> WatchStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<HealthCheckResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(body(tx));
    Box::pin(ReceiverStream(rx))
}

/// An mpsc receiver as a stream.
#[derive(Debug)]
pub(crate) struct ReceiverStream<T>(pub(crate) tokio::sync::mpsc::Receiver<T>);

impl<T> Stream for ReceiverStream<T> {
    type Item = T;
    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}
