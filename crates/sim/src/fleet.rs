//! Many engines in one process (`kvroute-sim --engines N`), for clusters of hundreds of
//! engines on a few cores.
//!
//! Engine `i` (from 0) is the engine the same flags would start alone, with
//! [`engine_args`]: its API on `--port + i` (each on a port of the system's choosing when
//! `--port` is 0), its KV events on the `--kv-events-endpoint` port `+ i * D` (`D` the
//! `--data-parallel-size`: rank `r` of engine `i` on `+ i * D + r`, so one rank is `+ i`), its
//! bootstrap port `+ i`, its instance id `ID-i` and its seed `--seed + i`. With one engine the
//! flags are unchanged.
//!
//! Every engine runs on the caller's tokio runtime as tasks (an engine is a handful: its
//! API, one driver and one publisher per rank), never a thread of its own, so 256 engines at
//! `--speedup 20` run on two cores. [`Fleet::start`] binds every engine's sockets before it
//! returns: a port taken is an error naming it, and the engines already started stop.

use std::sync::Arc;

use kvroute_tokenizer::Tokenizer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{SimArgs, SimConfigError};
use crate::server::SimInstance;

/// The most engines one process serves.
pub const MAX_ENGINES: usize = 4096;

/// The flags of engine `i` of `args.engines` (see the module docs).
pub fn engine_args(args: &SimArgs, i: usize) -> Result<SimArgs, SimConfigError> {
    if args.engines <= 1 {
        return Ok(args.clone());
    }
    let overflow = |flag| SimConfigError {
        flag,
        reason: "the port plus the engine's offset exceeds 65535",
    };
    let offset = |port: u16, by: usize, flag| {
        u16::try_from(usize::from(port) + by).map_err(|_| overflow(flag))
    };
    let mut one = args.clone();
    one.engines = 1;
    if args.port != 0 {
        one.port = offset(args.port, i, "port")?;
    }
    if let Some(endpoint) = &args.kv_events_endpoint {
        let (base, port) = endpoint.rsplit_once(':').ok_or(SimConfigError {
            flag: "kv-events-endpoint",
            reason: "has no port (expected tcp://HOST:PORT)",
        })?;
        let port: u16 = port.parse().map_err(|_| SimConfigError {
            flag: "kv-events-endpoint",
            reason: "has an invalid port",
        })?;
        let by = i * args.data_parallel_size.max(1);
        let last = by + args.data_parallel_size.max(1) - 1;
        offset(port, last, "kv-events-endpoint")?;
        one.kv_events_endpoint = Some(format!("{base}:{}", offset(port, by, "")?));
    }
    if let Some(port) = args.bootstrap_port {
        one.bootstrap_port = Some(offset(port, i, "bootstrap-port")?);
    }
    one.instance_id = format!("{}-{i}", args.instance_id);
    one.seed = args.seed.wrapping_add(i as u64);
    Ok(one)
}

/// `args.engines` engines serving on the current runtime; each stops when the fleet is
/// dropped or stopped.
#[derive(Debug)]
pub struct Fleet {
    engines: Vec<SimInstance>,
}

impl Fleet {
    /// Starts every engine: binds its API on `--host:--port + i` and its KV-event sockets.
    /// Returns once all are bound, or the first error (with the engine's number).
    pub async fn start(args: &SimArgs, tokenizer: Arc<Tokenizer>) -> anyhow::Result<Fleet> {
        args.validate()?;
        // A port past 65535 is an error before any engine starts.
        engine_args(args, args.engines - 1)?;
        let mut engines = Vec::with_capacity(args.engines);
        for i in 0..args.engines {
            let one = engine_args(args, i)?;
            let addr = format!("{}:{}", one.host, one.port);
            let listener = TcpListener::bind(&addr)
                .await
                .map_err(|e| anyhow::anyhow!("engine {i}: cannot listen on {addr}: {e}"))?;
            let engine = SimInstance::start(one, tokenizer.clone(), listener)
                .await
                .map_err(|e| e.context(format!("engine {i}")))?;
            engines.push(engine);
        }
        Ok(Fleet { engines })
    }

    /// The engines, in order.
    pub fn engines(&self) -> &[SimInstance] {
        &self.engines
    }

    /// The engines' URLs, in order.
    pub fn urls(&self) -> Vec<String> {
        self.engines.iter().map(SimInstance::url).collect()
    }

    /// Serves until `shutdown` (every engine stops gracefully) or until an engine ends (an
    /// injected crash): then the others stop too, and its result is returned, with its
    /// number.
    pub async fn serve(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let mut running = tokio::task::JoinSet::new();
        let stop = CancellationToken::new();
        for (i, mut engine) in self.engines.into_iter().enumerate() {
            let (shutdown, stop) = (shutdown.clone(), stop.clone());
            running.spawn(async move {
                let token = engine.shutdown_token();
                let wait = engine.wait();
                tokio::pin!(wait);
                let result = tokio::select! {
                    result = &mut wait => result,
                    () = shutdown.cancelled() => { token.cancel(); wait.await }
                    () = stop.cancelled() => { token.cancel(); wait.await }
                };
                (i, result)
            });
        }
        let mut first = Ok(());
        while let Some(ended) = running.join_next().await {
            stop.cancel();
            let (i, result) = ended?;
            if first.is_ok() {
                first = result.map_err(|e| e.context(format!("engine {i}")));
            }
        }
        first
    }

    /// Stops every engine gracefully and waits for them.
    pub async fn stop(self) -> anyhow::Result<()> {
        for result in
            futures_util::future::join_all(self.engines.into_iter().map(SimInstance::stop)).await
        {
            result?;
        }
        Ok(())
    }
}

/// The first port the system hands out for a bind to port 0 (Linux's default
/// `ip_local_port_range` starts here): a run of ports below it is never taken by another
/// test's free port.
const EPHEMERAL_START: u16 = 32768;

/// A base port `p` with `p .. p + n` each free on 127.0.0.1 when tried, chosen at random
/// below the system's ephemeral range: for a fleet's `--kv-events-endpoint`, whose ports are
/// consecutive. `None` when `n` ports do not fit or 100 tries found no free run.
pub fn free_port_run(n: usize) -> Option<u16> {
    use rand::Rng;
    let n = u16::try_from(n).ok()?;
    let lowest = 10_000u16;
    let highest = EPHEMERAL_START.checked_sub(n)?;
    if highest <= lowest {
        return None;
    }
    let mut rng = rand::rng();
    (0..100).find_map(|_| {
        let base = rng.random_range(lowest..highest);
        let free = (base..base + n).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok());
        free.then_some(base)
    })
}
