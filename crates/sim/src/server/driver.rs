//! The engine driver: one task per data-parallel rank that owns an [`EngineCore`] and runs
//! it in real time.
//!
//! Loop: take new commands; if the engine has work, `step(now)`, wait until the step's
//! simulated end (see `run` for sub-millisecond steps), then deliver its tokens to the
//! requests' channels and its cache events to the publisher. A request whose receiver is
//! gone (the client disconnected) is aborted and its blocks freed. A step with nothing to
//! do while KV transfers are in flight waits until the first lands, or a command comes.

use std::collections::HashMap;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::metrics::EngineSeries;
use crate::engine::{
    AddError, BlockId, CacheEvent, EngineCore, EngineRequest, PromptKv, RequestId, TokenOutput,
};

/// Below this, a sleep would overshoot: tokio's timer counts whole milliseconds.
const TIMER_RESOLUTION: std::time::Duration = std::time::Duration::from_millis(1);
/// The most the engine's clock may trail the wall clock before the lag is forgiven.
const MAX_LAG: std::time::Duration = std::time::Duration::from_millis(100);

/// A token delivered to a request, or why it was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    Token {
        token: u32,
        index: usize,
        finished: bool,
        cached_tokens: usize,
        /// With the last token: the blocks that held the prompt.
        prompt_blocks: Vec<BlockId>,
    },
    Rejected(AddError),
}

#[derive(Debug)]
pub enum Command {
    Add {
        request: EngineRequest,
        prompt_kv: PromptKv,
        tx: mpsc::UnboundedSender<Delivery>,
    },
    Abort(RequestId),
    Reset(oneshot::Sender<bool>),
    /// A new speed factor (`POST /speed`).
    Speed(f64),
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
        // The engine's clock: the simulated end of the last step. While the engine is busy it
        // advances by the steps' durations only; when it is ahead of the wall clock the
        // driver sleeps, when behind (steps shorter than the timer's 1 ms resolution, or a
        // busy machine) it runs steps back to back to catch up, so the engine keeps the
        // model's pace on average at any speedup. A lag beyond `MAX_LAG` is forgiven rather
        // than caught up in a burst.
        let mut clock = start;
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
                clock = Instant::now();
                continue;
            }
            let now = Instant::now();
            if clock + MAX_LAG < now {
                self.series
                    .lag_forgiven
                    .inc_by((now - MAX_LAG - clock).as_secs_f64());
                clock = now - MAX_LAG;
            }
            let out = self.core.step(clock - start);
            if out.is_idle() {
                // Nothing can run until a KV transfer lands.
                self.publish(out.events);
                self.export();
                let wake = self.core.next_transfer_done().map(|t| start + t);
                tokio::select! {
                    _ = sleep_until_some(wake) => {
                        clock = clock.max(wake.expect("slept until it"));
                    }
                    cmd = self.commands.recv() => match cmd {
                        Some(cmd) => self.handle(cmd, &mut streams),
                        None => return,
                    },
                    _ = shutdown.cancelled() => return,
                }
                clock = clock.max(Instant::now());
                continue;
            }
            clock += out.duration;
            if clock > Instant::now() + TIMER_RESOLUTION {
                tokio::select! {
                    _ = tokio::time::sleep_until(clock) => {}
                    _ = shutdown.cancelled() => return,
                }
            } else {
                // Let the server's other tasks (new requests, streams) run.
                tokio::task::yield_now().await;
            }
            // The metrics first: a client that has its answer sees them count it.
            self.export();
            if self.deliver(out.tokens, &mut streams) {
                self.export();
            }
            let mut events = out.events;
            events.extend(self.core.take_events());
            self.publish(events);
        }
    }

    /// Sends the tokens to their requests; true when one was aborted (its client gone).
    fn deliver(
        &mut self,
        tokens: Vec<TokenOutput>,
        streams: &mut HashMap<RequestId, Stream>,
    ) -> bool {
        let now = Instant::now();
        let mut aborted = false;
        for t in tokens {
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
                    prompt_blocks: t.prompt_blocks,
                })
                .is_ok();
            if t.finished {
                streams.remove(&t.id);
            } else if !delivered {
                streams.remove(&t.id);
                self.core.abort(t.id);
                aborted = true;
            }
        }
        aborted
    }

    fn handle(&mut self, cmd: Command, streams: &mut HashMap<RequestId, Stream>) {
        match cmd {
            Command::Add {
                request,
                prompt_kv,
                tx,
            } => {
                let id = request.id;
                match self.core.add_request_from(request, prompt_kv) {
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
            Command::Speed(speedup) => self.core.set_speedup(speedup),
        }
        self.export();
    }

    /// The engine's stats and adapters, to its metrics.
    fn export(&self) {
        self.series.update(&self.core.stats());
        self.series.update_lora(|| self.core.lora_state());
    }

    fn publish(&self, events: Vec<CacheEvent>) {
        if let (Some(tx), false) = (&self.events, events.is_empty()) {
            let _ = tx.send(events);
        }
    }
}

/// Sleeps until `at`, or forever.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
