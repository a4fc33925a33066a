//! The endpoint picker's endpoints from Kubernetes (`--pool-name`, `--endpoint-selector`):
//! an InferencePool's pods, or the pods a label selector selects, one endpoint per pod and
//! target port ([`endpoints`]).
//!
//! With a pool, the InferencePool (`{group}/v1`, default `inference.networking.k8s.io`) is
//! watched by name with kube-rs's `watch_object`; its `spec.selector.matchLabels` and
//! `spec.targetPorts` are the target. The pods are watched with that selector in the pool's
//! namespace; when the pool's selector changes, the pod watch restarts with the new one (the
//! endpoints known stay until its first list replaces them); when only its ports change, the
//! endpoints change at once. A pool that does not exist (or was deleted) has no endpoints.
//! With a selector, the pods are watched with it, as given, and the ports are fixed.
//!
//! After every change the endpoints are reconciled with the set's `epp` workers
//! ([`super::reconcile`]). The guarantees are pod discovery's ([`super::kubernetes`]): a
//! periodic relist of the pool and its pods, the watcher's own relist after `410 Gone`, and
//! an API that is unreachable, forbids or answers nonsense changes nothing, is counted in
//! `kvroute_discovery_errors_total{reason}` and logged once per reason.

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;
use tokio_util::sync::CancellationToken;

use self::endpoints::{pool_target, Endpoints, Retarget, Target};
use super::kubernetes::{reason, watch_reason, ApiTrouble};
use super::{reconcile, Workers};
use crate::config::{EppEndpoints, WorkerSource};
use crate::metrics::DiscoveryMetrics;

pub mod endpoints;

/// The InferencePool resource of `group`, version `v1`.
pub fn inference_pool(group: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(group, "v1", "InferencePool"),
        "inferencepools",
    )
}

type PodEvents = BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>>;
type PoolEvents = BoxStream<'static, Result<Option<DynamicObject>, watcher::Error>>;

/// The watch, the API's state and the endpoints, driven by [`run`]'s loop.
struct Picker<W> {
    target: Arc<W>,
    pods: Api<Pod>,
    /// The pool, by name; `None` with a fixed selector.
    pool: Option<(Api<DynamicObject>, String)>,
    endpoints: Endpoints,
    pod_events: PodEvents,
    trouble: ApiTrouble,
    /// Why the pool is not a target now (missing, invalid), logged once until it is.
    no_pool: Option<String>,
}

impl<W: Workers> Picker<W> {
    fn watch_pods(&mut self) {
        self.pod_events = match self.endpoints.target() {
            Some(t) => watcher(
                self.pods.clone(),
                watcher::Config::default().labels(&t.selector),
            )
            .default_backoff()
            .boxed(),
            None => futures_util::stream::pending().boxed(),
        };
    }

    /// A new target: the pod watch follows a new selector, the endpoints new ports.
    fn retarget(&mut self, target: Target) {
        if self.no_pool.take().is_some() {
            tracing::info!("InferencePool usable again");
        }
        let (selector, ports) = (target.selector.clone(), target.ports.clone());
        match self.endpoints.retarget(target) {
            Retarget::Same => {}
            Retarget::Ports => {
                tracing::info!(%selector, ?ports, "InferencePool's target ports changed");
                self.apply();
            }
            Retarget::Selector => {
                tracing::info!(%selector, ?ports, "Watching the pods the endpoint picker selects");
                self.watch_pods();
            }
        }
    }

    /// What the API says of the pool now: it, or that it does not exist.
    fn pool(&mut self, pool: Option<DynamicObject>) {
        self.trouble.answered();
        let why = match pool.as_ref().map(pool_target) {
            Some(Ok(target)) => return self.retarget(target),
            // A pool that says nothing usable changes nothing, as garbage would.
            Some(Err(why)) => {
                self.trouble.count("invalid");
                why
            }
            None => "not found".to_owned(),
        };
        if self.no_pool.as_ref() != Some(&why) {
            let name = self.pool.as_ref().map_or("", |(_, n)| n.as_str());
            tracing::warn!(pool = name, why, "InferencePool not usable");
            self.no_pool = Some(why);
        }
        if pool.is_none() && self.endpoints.target().is_some() {
            tracing::warn!("InferencePool gone: no endpoints");
            self.endpoints.clear();
            self.watch_pods();
            self.apply();
        }
    }

    fn pod_event(&mut self, event: watcher::Event<Pod>) {
        self.trouble.answered();
        if self.endpoints.event(event) {
            self.apply();
        }
    }

    /// Lists the pool and its pods again: catches whatever a watch missed.
    async fn relist(&mut self) {
        if let Some((api, name)) = &self.pool {
            match api.get_opt(name).await {
                Ok(pool) => self.pool(pool),
                Err(error) => return self.trouble.failed(reason(&error), &error),
            }
        }
        let Some(selector) = self.endpoints.target().map(|t| t.selector.clone()) else {
            return;
        };
        match self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await
        {
            Ok(list) => {
                self.trouble.answered();
                self.endpoints.listed(list.items);
                self.apply();
            }
            Err(error) => self.trouble.failed(reason(&error), &error),
        }
    }

    fn apply(&self) {
        let (added, removed) = reconcile(
            self.target.as_ref(),
            |s| matches!(s, WorkerSource::Epp { .. }),
            self.endpoints.wanted(),
        );
        if added + removed > 0 {
            tracing::info!(added, removed, "Endpoint picker's endpoints changed");
        }
    }
}

/// Watches and re-lists the pool (or the selector) and its pods until `shutdown`, keeping
/// the set's `epp` workers to what the API says. Static endpoints: returns at once.
pub async fn run<W: Workers>(
    target: Arc<W>,
    client: Client,
    endpoints: EppEndpoints,
    kv_events_port: Option<u16>,
    interval: Duration,
    metrics: DiscoveryMetrics,
    shutdown: CancellationToken,
) {
    let (namespace, pool, fixed) = match endpoints {
        EppEndpoints::Static => return,
        EppEndpoints::Pool(pool) => {
            let api: Api<DynamicObject> = Api::namespaced_with(
                client.clone(),
                &pool.namespace,
                &inference_pool(&pool.group),
            );
            (pool.namespace, Some((api, pool.name)), None)
        }
        EppEndpoints::Selector {
            selector,
            target_ports,
            namespace,
            ..
        } => {
            let ports = target_ports;
            (namespace, None, Some(Target { selector, ports }))
        }
    };
    let mut pool_events: PoolEvents = match &pool {
        Some((api, name)) => watcher::watch_object(api.clone(), name)
            .default_backoff()
            .boxed(),
        None => futures_util::stream::pending().boxed(),
    };
    let mut picker = Picker {
        target,
        pods: Api::namespaced(client, &namespace),
        pool,
        endpoints: Endpoints::with_kv_events_port(kv_events_port),
        pod_events: futures_util::stream::pending().boxed(),
        trouble: ApiTrouble::new(metrics),
        no_pool: None,
    };
    if let Some(target) = fixed {
        picker.retarget(target);
    }
    let mut relist = tokio::time::interval(interval);
    relist.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    relist.tick().await; // the watchers' own first lists are the first ones
    loop {
        tokio::select! {
            next = pool_events.next() => match next {
                Some(Ok(pool)) => picker.pool(pool),
                Some(Err(error)) => picker.trouble.failed(watch_reason(&error), &error),
                None => return,
            },
            next = picker.pod_events.next() => match next {
                Some(Ok(event)) => picker.pod_event(event),
                Some(Err(error)) => picker.trouble.failed(watch_reason(&error), &error),
                None => return,
            },
            _ = relist.tick() => picker.relist().await,
            _ = shutdown.cancelled() => return,
        }
    }
}
