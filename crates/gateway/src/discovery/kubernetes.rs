//! Kubernetes service discovery: the pods that match the selectors, watched with kube-rs's
//! watcher and re-listed every `--discovery-check-interval-secs`.
//!
//! One watcher per selector (a label selector cannot say "or"), merged into one stream.
//! Each keeps the worker of every pod it saw, by pod UID; after every change the union is
//! reconciled with the set's Kubernetes workers ([`super::reconcile`]). The watcher relists
//! on its own after a `410 Gone`; the periodic list catches whatever a watch missed (a
//! DELETE lost while the watch was down). An API server that is unreachable or forbids the
//! call changes nothing: the workers stay, one log line says why (again only when the
//! reason changes) and `kvroute_discovery_errors_total{reason}` counts every failure.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Config};
use tokio_util::sync::CancellationToken;

use super::pods::{pod_worker, PodWorker};
use super::{reconcile, Workers};
use crate::config::{KubernetesDiscovery, WorkerSource};
use crate::metrics::DiscoveryMetrics;

/// Builds the client: `--kubeconfig`; else the in-cluster config inside a pod; else
/// `$KUBECONFIG` or `~/.kube/config`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, String> {
    // kube's rustls client takes the process's provider: ring, as everywhere in kvroute.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("cannot read kubeconfig {}: {e}", path.display()))?;
            Config::from_custom_kubeconfig(file, &Default::default())
                .await
                .map_err(|e| format!("invalid kubeconfig {}: {e}", path.display()))?
        }
        None if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() => {
            Config::incluster().map_err(|e| format!("in-cluster config: {e}"))?
        }
        None => Config::infer().await.map_err(|e| e.to_string())?,
    };
    Client::try_from(config).map_err(|e| format!("cannot build the Kubernetes client: {e}"))
}

/// Why a call to the API failed, as the `reason` label says it.
pub(super) fn reason(error: &kube::Error) -> &'static str {
    match error {
        kube::Error::Api(status) => status_reason(status.code),
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => {
            "unreachable"
        }
        kube::Error::SerdeError(_) => "invalid",
        _ => "api",
    }
}

fn status_reason(code: u16) -> &'static str {
    match code {
        401 => "unauthorized",
        403 => "forbidden",
        410 => "gone",
        _ => "api",
    }
}

pub(super) fn watch_reason(error: &watcher::Error) -> &'static str {
    match error {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => reason(e),
        watcher::Error::WatchError(status) => status_reason(status.code),
        watcher::Error::NoResourceVersion => "api",
    }
}

/// The pods each selector sees, by UID, and what the API last said.
struct Discovered {
    settings: KubernetesDiscovery,
    /// Per selector: pod UID -> the worker it is.
    pods: Vec<BTreeMap<String, PodWorker>>,
    /// Per selector: the pods of a relist in progress (between `Init` and `InitDone`).
    listing: Vec<Option<BTreeMap<String, PodWorker>>>,
    trouble: ApiTrouble,
}

/// What the API last said: each failure counted, logged once per reason until it answers.
pub(super) struct ApiTrouble {
    /// The last failure's reason, logged once until the API answers again.
    failing: Option<&'static str>,
    metrics: DiscoveryMetrics,
}

impl ApiTrouble {
    pub(super) fn new(metrics: DiscoveryMetrics) -> Self {
        Self {
            failing: None,
            metrics,
        }
    }

    /// Counts a failure without logging it (the caller logs).
    pub(super) fn count(&self, reason: &'static str) {
        self.metrics.error(reason);
    }

    pub(super) fn failed(&mut self, reason: &'static str, error: &dyn std::fmt::Display) {
        self.metrics.error(reason);
        if self.failing != Some(reason) {
            tracing::error!(reason, %error, "Kubernetes API call failed: keeping the current workers");
            self.failing = Some(reason);
        }
    }

    pub(super) fn answered(&mut self) {
        if self.failing.take().is_some() {
            tracing::info!("Kubernetes API answering again");
        }
    }
}

fn uid(pod: &Pod) -> String {
    pod.metadata
        .uid
        .clone()
        .unwrap_or_else(|| super::pods::pod_name(pod))
}

impl Discovered {
    fn worker(&self, selector: usize, pod: &Pod) -> Option<PodWorker> {
        pod_worker(pod, &self.settings.selectors[selector], self.settings.port)
    }

    /// Stores `worker` under `key`, warning about its annotations when it is new or changed.
    fn store(
        map: &mut BTreeMap<String, PodWorker>,
        key: String,
        worker: Option<PodWorker>,
        old: Option<&PodWorker>,
    ) {
        match worker {
            Some(w) => {
                if !w.warnings.is_empty() && old != Some(&w) {
                    tracing::warn!(pod = %w.pod, problems = ?w.warnings, "Malformed worker annotations: the pod is a worker without those fields");
                }
                map.insert(key, w);
            }
            None => {
                map.remove(&key);
            }
        }
    }

    fn event(&mut self, selector: usize, event: watcher::Event<Pod>) -> bool {
        match event {
            watcher::Event::Init => {
                self.listing[selector] = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(pod) => {
                let (key, worker) = (uid(&pod), self.worker(selector, &pod));
                let old = self.pods[selector].get(&key).cloned();
                if let Some(listing) = &mut self.listing[selector] {
                    Self::store(listing, key, worker, old.as_ref());
                }
                false
            }
            watcher::Event::InitDone => {
                if let Some(listing) = self.listing[selector].take() {
                    self.pods[selector] = listing;
                }
                true
            }
            watcher::Event::Apply(pod) => {
                let (key, worker) = (uid(&pod), self.worker(selector, &pod));
                let old = self.pods[selector].get(&key).cloned();
                Self::store(&mut self.pods[selector], key, worker, old.as_ref());
                true
            }
            watcher::Event::Delete(pod) => {
                self.pods[selector].remove(&uid(&pod));
                true
            }
        }
    }

    /// A full list of one selector's pods replaces what it knew.
    fn listed(&mut self, selector: usize, pods: Vec<Pod>) {
        let mut next = BTreeMap::new();
        for pod in pods {
            let (key, worker) = (uid(&pod), self.worker(selector, &pod));
            let old = self.pods[selector].get(&key);
            Self::store(&mut next, key, worker, old);
        }
        self.pods[selector] = next;
    }

    /// The union of the selectors' workers, the first selector's where two share an id.
    fn wanted(&self) -> Vec<crate::config::WorkerSpec> {
        let mut seen = std::collections::HashSet::new();
        let mut wanted = Vec::new();
        for map in &self.pods {
            for w in map.values() {
                if seen.insert(w.spec.url.clone()) {
                    wanted.push(w.spec.clone());
                }
            }
        }
        wanted
    }

    fn apply(&self, target: &impl Workers) {
        let (added, removed) = reconcile(
            target,
            |s| matches!(s, WorkerSource::Kubernetes { .. }),
            self.wanted(),
        );
        if added + removed > 0 {
            tracing::info!(added, removed, "Kubernetes workers changed");
        }
    }
}

/// Watches and re-lists the pods until `shutdown`, keeping the set's Kubernetes workers
/// to what the API says.
pub async fn run(
    target: Arc<impl Workers>,
    client: Client,
    settings: KubernetesDiscovery,
    interval: Duration,
    metrics: DiscoveryMetrics,
    shutdown: CancellationToken,
) {
    let api: Api<Pod> = match &settings.namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let queries: Vec<String> = settings.selectors.iter().map(|s| s.query()).collect();
    let streams = queries.iter().enumerate().map(|(i, q)| {
        watcher(api.clone(), watcher::Config::default().labels(q))
            .default_backoff()
            .map(move |event| (i, event))
            .boxed()
    });
    let mut events = futures_util::stream::select_all(streams);
    let n = settings.selectors.len();
    let mut state = Discovered {
        settings,
        pods: vec![BTreeMap::new(); n],
        listing: vec![None; n],
        trouble: ApiTrouble::new(metrics),
    };
    let mut relist = tokio::time::interval(interval);
    relist.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    relist.tick().await; // the watcher's own first list is the first one
    loop {
        tokio::select! {
            next = events.next() => match next {
                Some((i, Ok(event))) => {
                    state.trouble.answered();
                    if state.event(i, event) {
                        state.apply(target.as_ref());
                    }
                }
                Some((_, Err(error))) => state.trouble.failed(watch_reason(&error), &error),
                None => return,
            },
            _ = relist.tick() => {
                for (i, q) in queries.iter().enumerate() {
                    match api.list(&ListParams::default().labels(q)).await {
                        Ok(list) => {
                            state.trouble.answered();
                            state.listed(i, list.items);
                        }
                        Err(error) => state.trouble.failed(reason(&error), &error),
                    }
                }
                state.apply(target.as_ref());
            }
            _ = shutdown.cancelled() => return,
        }
    }
}
