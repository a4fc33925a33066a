//! [`SimInstance`]: an engine running on a task, for tests that crash, restart and stop
//! engines on fixed ports.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvroute_tokenizer::Tokenizer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{FaultHandle, SimServer};
use crate::config::SimArgs;

/// How long a restart keeps trying to bind the old ports (another socket may hold one for
/// a moment, e.g. a client connection the kernel gave the same local port).
const REBIND_TIMEOUT: Duration = Duration::from_secs(10);
const REBIND_PAUSE: Duration = Duration::from_millis(50);

/// A simulated engine serving on the current tokio runtime.
///
/// ```no_run
/// # async fn demo(tokenizer: std::sync::Arc<kvroute_tokenizer::Tokenizer>) -> anyhow::Result<()> {
/// use kvroute_sim::{FaultSettings, SimArgs, SimInstance};
/// let args = SimArgs {
///     kv_events_endpoint: Some("tcp://127.0.0.1:5557".into()),
///     ..SimArgs::default()
/// };
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
/// let mut sim = SimInstance::start(args, tokenizer, listener).await?;
/// let faults = sim.faults().clone();
/// faults.set(FaultSettings { stall_ms: 5_000, ..faults.settings() })?;
/// sim.crash();
/// assert!(sim.wait().await.unwrap_err().is::<kvroute_sim::Crashed>());
/// let sim = sim.restart().await?; // same ports, empty cache, KV-event seq from 0
/// sim.stop().await?;
/// # Ok(()) }
/// ```
pub struct SimInstance {
    args: SimArgs,
    tokenizer: Arc<Tokenizer>,
    addr: SocketAddr,
    faults: FaultHandle,
    shutdown: CancellationToken,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl std::fmt::Debug for SimInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimInstance")
            .field("addr", &self.addr)
            .field("kv_events_endpoint", &self.args.kv_events_endpoint)
            .field("crashed", &self.faults.is_crashed())
            .finish()
    }
}

impl SimInstance {
    /// Starts an engine serving HTTP on `listener` and publishing KV events where `args`
    /// say. Returns once the KV-event sockets are bound (an error if they cannot be);
    /// requests are served from then on.
    pub async fn start(
        args: SimArgs,
        tokenizer: Arc<Tokenizer>,
        listener: TcpListener,
    ) -> anyhow::Result<Self> {
        args.validate()?;
        let addr = listener.local_addr()?;
        let server = SimServer::new(args.clone(), tokenizer.clone());
        let faults = server.faults();
        let bound = server.bind().await?;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(bound.run(listener, shutdown.clone()));
        Ok(Self {
            args,
            tokenizer,
            addr,
            faults,
            shutdown,
            task: Some(task),
        })
    }

    /// The HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://` (`https://` with the TLS flags) and the HTTP address.
    pub fn url(&self) -> String {
        format!("{}://{}", self.args.scheme(), self.addr)
    }

    pub fn args(&self) -> &SimArgs {
        &self.args
    }

    /// The engine's faults, to change while it runs.
    pub fn faults(&self) -> &FaultHandle {
        &self.faults
    }

    /// Crashes the engine now (see [`FaultHandle::crash`]); [`Self::wait`] for its ports.
    pub fn crash(&self) {
        self.faults.crash();
    }

    /// Waits until the engine has ended and its sockets are closed. An error holding
    /// [`super::Crashed`] after a crash; `Ok` when it was already waited for.
    pub async fn wait(&mut self) -> anyhow::Result<()> {
        match self.task.take() {
            Some(task) => task.await?,
            None => Ok(()),
        }
    }

    /// Cancelling this token stops the engine gracefully (as [`Self::stop`], without waiting).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops the engine gracefully and waits for it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.wait().await
    }

    /// Kills the engine if it still runs (a crash), then starts a new one with the same
    /// args on the same HTTP address and KV-event endpoint, as a restarted vLLM: an empty
    /// cache, KV-event sequence numbers from 0, the faults as the args set them.
    pub async fn restart(self) -> anyhow::Result<Self> {
        let args = self.args.clone();
        self.restart_with(args).await
    }

    /// [`Self::restart`] with other args (e.g. without `crash_after_requests`). The HTTP
    /// address stays; the KV-event endpoint is the one in `args`.
    pub async fn restart_with(mut self, args: SimArgs) -> anyhow::Result<Self> {
        args.validate()?;
        self.crash();
        let _ = self.wait().await;
        let deadline = tokio::time::Instant::now() + REBIND_TIMEOUT;
        loop {
            let started = match TcpListener::bind(self.addr).await {
                Ok(listener) => {
                    SimInstance::start(args.clone(), self.tokenizer.clone(), listener).await
                }
                Err(e) => Err(e.into()),
            };
            match started {
                Ok(sim) => return Ok(sim),
                Err(error) if tokio::time::Instant::now() < deadline => {
                    tracing::debug!(%error, addr = %self.addr, "Restart cannot bind yet");
                    tokio::time::sleep(REBIND_PAUSE).await;
                }
                Err(error) => {
                    return Err(error.context(format!("cannot restart on {}", self.addr)));
                }
            }
        }
    }
}

impl Drop for SimInstance {
    /// A dropped instance stops (in the background).
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
