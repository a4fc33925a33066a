//! The engine driver: one task per data-parallel rank that owns an [`EngineCore`] and runs
//! it in real time.
//!
//! Loop: take new commands; if the engine has work, `step(now)`, sleep until the step's
//! simulated end, then deliver its tokens to the requests' channels and its cache events
//! to the publisher. A request whose receiver is gone (the client disconnected) is aborted
//! and its blocks freed.

use std::collections::HashMap;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::metrics::EngineSeries;
use crate::engine::{AddError, CacheEvent, EngineCore, EngineRequest, RequestId};

/// A token delivered to a request, or why it was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    Token {
        token: u32,
        index: usize,
        finished: bool,
        cached_tokens: usize,
    },
    Rejected(AddError),
}

#[derive(Debug)]
pub enum Command {
    Add {
        request: EngineRequest,
        tx: mpsc::UnboundedSender<Delivery>,
    },
    Abort(RequestId),
    Reset(oneshot::Sender<bool>),
}

struct Stream {
    tx: mpsc::UnboundedSender<Delivery>,
    arrival: Instant,
    last_token: Option<Instant>,
}

pub struct Driver {
    pub core: EngineCore,
    pub commands: mpsc::UnboundedReceiver<Command>,
    pub series: EngineSeries,
    pub events: Option<mpsc::UnboundedSender<Vec<CacheEvent>>>,
}

impl Driver {
    pub async fn run(mut self, shutdown: CancellationToken) {
        let start = Instant::now();
        let mut streams: HashMap<RequestId, Stream> = HashMap::new();
        loop {
            while let Ok(cmd) = self.commands.try_recv() {
                self.handle(cmd, &mut streams);
            }
            if !self.core.has_work() {
                tokio::select! {
                    cmd = self.commands.recv() => match cmd {
                        Some(cmd) => self.handle(cmd, &mut streams),
                        None => return,
                    },
                    _ = shutdown.cancelled() => return,
                }
                continue;
            }
            let step_start = Instant::now();
            let out = self.core.step(step_start - start);
            tokio::select! {
                _ = tokio::time::sleep_until(step_start + out.duration) => {}
                _ = shutdown.cancelled() => return,
            }
            let now = Instant::now();
            for t in &out.tokens {
                let Some(stream) = streams.get_mut(&t.id) else {
                    continue;
                };
                match stream.last_token {
                    None => self
                        .series
                        .ttft
                        .observe((now - stream.arrival).as_secs_f64()),
                    Some(last) => self.series.itl.observe((now - last).as_secs_f64()),
                }
                stream.last_token = Some(now);
                let delivered = stream
                    .tx
                    .send(Delivery::Token {
                        token: t.token,
                        index: t.index,
                        finished: t.finished,
                        cached_tokens: t.cached_tokens,
                    })
                    .is_ok();
                if t.finished {
                    streams.remove(&t.id);
                } else if !delivered {
                    streams.remove(&t.id);
                    self.core.abort(t.id);
                }
            }
            let mut events = out.events;
            events.extend(self.core.take_events());
            self.publish(events);
            self.series.update(&self.core.stats());
        }
    }

    fn handle(&mut self, cmd: Command, streams: &mut HashMap<RequestId, Stream>) {
        match cmd {
            Command::Add { request, tx } => {
                let id = request.id;
                match self.core.add_request(request) {
                    Ok(()) => {
                        streams.insert(
                            id,
                            Stream {
                                tx,
                                arrival: Instant::now(),
                                last_token: None,
                            },
                        );
                    }
                    Err(e) => {
                        let _ = tx.send(Delivery::Rejected(e));
                    }
                }
            }
            Command::Abort(id) => {
                if streams.remove(&id).is_some() {
                    self.core.abort(id);
                }
            }
            Command::Reset(reply) => {
                let done = self.core.reset_prefix_cache();
                let events = self.core.take_events();
                self.publish(events);
                let _ = reply.send(done);
            }
        }
        self.series.update(&self.core.stats());
    }

    fn publish(&self, events: Vec<CacheEvent>) {
        if let (Some(tx), false) = (&self.events, events.is_empty()) {
            let _ = tx.send(events);
        }
    }
}
