//! The endpoint picker's endpoints as a pure function of what the API said: the pool's
//! selector and target ports, and the pods that selector selects.
//!
//! A pod is an endpoint per target port while it serves (Running, Ready, with an IP, not
//! being deleted; see [`serving_worker`]), named as llm-d names it: `<pod>-rank-<i>`, `i` the
//! port's index in `targetPorts` (a pod's ports are its data-parallel ranks). llm-d's
//! `llm-d.ai/active-ports` annotation (or GIE's older `inference.networking.k8s.io/active-ports`)
//! narrows the ports a pod serves on; the `kvroute.io/` annotations mean what they mean for
//! discovered pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::runtime::watcher;
use serde::Deserialize;

use crate::config::{WorkerRole, WorkerSource, WorkerSpec};
use crate::discovery::pods::{pod_name, serving_worker, PodWorker};

/// llm-d's annotation: the target ports a pod serves on, comma-separated.
pub const ACTIVE_PORTS: &str = "llm-d.ai/active-ports";
/// GIE's older name for it.
pub const LEGACY_ACTIVE_PORTS: &str = "inference.networking.k8s.io/active-ports";

/// Which pods, and which of their ports are endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// A label selector as the API server takes it.
    pub selector: String,
    pub ports: Vec<u16>,
}

/// An InferencePool's (`inference.networking.k8s.io/v1`) spec, as far as the picker reads it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSpec {
    selector: PoolSelector,
    target_ports: Vec<PoolPort>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSelector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct PoolPort {
    number: u16,
}

/// The target an InferencePool names; why not, when its spec is not one (no selector, no
/// port, port 0). An empty selector would select every pod in the namespace: refused.
pub fn pool_target(pool: &DynamicObject) -> Result<Target, String> {
    let spec = pool.data.get("spec").cloned().unwrap_or_default();
    let spec: PoolSpec = serde_json::from_value(spec).map_err(|e| format!("spec: {e}"))?;
    if spec.selector.match_labels.is_empty() {
        return Err("spec.selector.matchLabels is empty".into());
    }
    if spec.target_ports.is_empty() || spec.target_ports.iter().any(|p| p.number == 0) {
        return Err("spec.targetPorts must list ports from 1 to 65535".into());
    }
    let pairs: Vec<String> = spec
        .selector
        .match_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    Ok(Target {
        selector: pairs.join(","),
        ports: spec.target_ports.iter().map(|p| p.number).collect(),
    })
}

/// The ports a pod's active-ports annotation lets it serve on; all when it has none.
fn active(pod: &Pod, port: u16) -> bool {
    let annotations = pod.metadata.annotations.as_ref();
    let value =
        annotations.and_then(|a| a.get(ACTIVE_PORTS).or_else(|| a.get(LEGACY_ACTIVE_PORTS)));
    match value {
        None => true,
        Some(list) => list.split(',').any(|p| p.trim().parse::<u16>() == Ok(port)),
    }
}

/// The endpoints a pod is now, one per target port it serves on. With `kv_events_port`
/// (llm-d's `podDiscoveryConfig.socketPort`), an endpoint without a `kvroute.io/kv-events`
/// annotation publishes its KV events at `tcp://podIP:kv_events_port+rank`, as llm-d dials.
pub fn pod_endpoints(pod: &Pod, ports: &[u16], kv_events_port: Option<u16>) -> Vec<PodWorker> {
    let name = pod.metadata.name.as_deref().unwrap_or("");
    ports
        .iter()
        .enumerate()
        .filter(|(_, port)| active(pod, **port))
        .filter_map(|(rank, &port)| {
            let mut w = serving_worker(pod, port, WorkerRole::Both)?;
            w.spec.id = Some(format!("{name}-rank-{rank}"));
            w.spec.source = WorkerSource::Epp { pod: pod_name(pod) };
            if let (None, Some(base), Some(ip)) = (
                &w.spec.kv_events,
                kv_events_port,
                pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()),
            ) {
                let port = base.checked_add(rank as u16)?;
                w.spec.kv_events = Some(format!("tcp://{ip}:{port}"));
            }
            Some(w)
        })
        .collect()
}

fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_else(|| pod_name(pod))
}

/// The target in force and the pods its selector selected, by UID.
#[derive(Default)]
pub struct Endpoints {
    target: Option<Target>,
    pods: BTreeMap<String, Pod>,
    /// The pods of a relist in progress (between `Init` and `InitDone`).
    listing: Option<BTreeMap<String, Pod>>,
    /// llm-d's KV-event socket port (rank 0's), for pods that do not say theirs.
    kv_events_port: Option<u16>,
}

/// What a new target asks of the pod watch.
#[derive(Debug, PartialEq, Eq)]
pub enum Retarget {
    /// Nothing changed.
    Same,
    /// Only the ports: the endpoints change now, from the pods known.
    Ports,
    /// Another selector: watch it; the pods known stay until its first list replaces them.
    Selector,
}

impl Endpoints {
    /// Endpoints whose KV events are at `tcp://podIP:port+rank` unless a pod says otherwise.
    pub fn with_kv_events_port(port: Option<u16>) -> Self {
        Self {
            kv_events_port: port,
            ..Self::default()
        }
    }

    pub fn target(&self) -> Option<&Target> {
        self.target.as_ref()
    }

    /// Takes a new target (the pool's spec changed or was first read).
    pub fn retarget(&mut self, target: Target) -> Retarget {
        let change = match &self.target {
            Some(t) if *t == target => Retarget::Same,
            Some(t) if t.selector == target.selector => Retarget::Ports,
            _ => Retarget::Selector,
        };
        if change == Retarget::Selector {
            self.listing = None;
        }
        self.target = Some(target);
        change
    }

    /// No pool: no target, no endpoints.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Stores a pod, warning about its annotations when it is new or they changed.
    fn store(&self, map: &mut BTreeMap<String, Pod>, pod: Pod) {
        let key = uid(&pod);
        let old = self.pods.get(&key);
        let changed = old.is_none_or(|o| o.metadata.annotations != pod.metadata.annotations);
        if changed {
            let ports = self.target.as_ref().map_or(&[][..], |t| &t.ports);
            if let Some(w) = pod_endpoints(&pod, ports, self.kv_events_port).first() {
                if !w.warnings.is_empty() {
                    tracing::warn!(pod = %w.pod, problems = ?w.warnings, "Malformed worker annotations: the pod is an endpoint without those fields");
                }
            }
        }
        map.insert(key, pod);
    }

    /// A watch event; whether the endpoints may have changed.
    pub fn event(&mut self, event: watcher::Event<Pod>) -> bool {
        match event {
            watcher::Event::Init => {
                self.listing = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(pod) => {
                if let Some(mut listing) = self.listing.take() {
                    self.store(&mut listing, pod);
                    self.listing = Some(listing);
                }
                false
            }
            watcher::Event::InitDone => {
                if let Some(listing) = self.listing.take() {
                    self.pods = listing;
                }
                true
            }
            watcher::Event::Apply(pod) => {
                let mut pods = std::mem::take(&mut self.pods);
                self.store(&mut pods, pod);
                self.pods = pods;
                true
            }
            watcher::Event::Delete(pod) => {
                self.pods.remove(&uid(&pod));
                true
            }
        }
    }

    /// A full list of the selected pods replaces what was known.
    pub fn listed(&mut self, pods: Vec<Pod>) {
        let mut next = BTreeMap::new();
        for pod in pods {
            self.store(&mut next, pod);
        }
        self.pods = next;
    }

    /// Every endpoint now.
    pub fn wanted(&self) -> Vec<WorkerSpec> {
        let Some(target) = &self.target else {
            return Vec::new();
        };
        self.pods
            .values()
            .flat_map(|pod| pod_endpoints(pod, &target.ports, self.kv_events_port))
            .map(|w| w.spec)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, annotations: &[(&str, &str)], ready: bool) -> Pod {
        let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ml", "uid": format!("u-{name}"),
                         "labels": {"app": "vllm"}, "annotations": annotations},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
        }))
        .unwrap()
    }

    fn pool(spec: serde_json::Value) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "ml"}, "spec": spec,
        }))
        .unwrap()
    }

    fn ids(ws: &[PodWorker]) -> Vec<(&str, &str)> {
        ws.iter()
            .map(|w| (w.spec.id.as_deref().unwrap(), w.spec.url.as_str()))
            .collect()
    }

    #[test]
    fn a_pool_spec_is_its_selector_and_ports() {
        let p = pool(serde_json::json!({
            "selector": {"matchLabels": {"b": "2", "a": "1"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        }));
        let t = pool_target(&p).unwrap();
        assert_eq!(t.selector, "a=1,b=2");
        assert_eq!(t.ports, [8000, 8001]);
        for bad in [
            serde_json::json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 80}]}),
            serde_json::json!({"selector": {"matchLabels": {"a": "1"}}, "targetPorts": []}),
            serde_json::json!({"selector": {"matchLabels": {"a": "1"}}, "targetPorts": [{"number": 0}]}),
            serde_json::json!({"selector": "a=1", "targetPorts": [{"number": 80}]}),
            serde_json::json!(null),
        ] {
            assert!(pool_target(&pool(bad.clone())).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_serving_pod_is_an_endpoint_per_target_port_named_by_rank() {
        let p = pod(
            "vllm-0",
            "10.0.0.7",
            &[("kvroute.io/kv-events", "5557")],
            true,
        );
        let ws = pod_endpoints(&p, &[8000, 8001], None);
        assert_eq!(
            ids(&ws),
            [
                ("vllm-0-rank-0", "http://10.0.0.7:8000"),
                ("vllm-0-rank-1", "http://10.0.0.7:8001")
            ]
        );
        assert_eq!(
            ws[0].spec.source,
            WorkerSource::Epp {
                pod: "ml/vllm-0".into()
            }
        );
        assert_eq!(ws[1].spec.kv_events.as_deref(), Some("tcp://10.0.0.7:5557"));
        assert!(pod_endpoints(&pod("vllm-1", "10.0.0.8", &[], false), &[8000], None).is_empty());
    }

    #[test]
    fn llm_ds_socket_port_gives_each_rank_its_kv_events_endpoint() {
        let p = pod("vllm-2", "10.0.0.9", &[], true);
        let ws = pod_endpoints(&p, &[8000, 8001], Some(5557));
        let events: Vec<_> = ws.iter().map(|w| w.spec.kv_events.as_deref()).collect();
        assert_eq!(
            events,
            vec![Some("tcp://10.0.0.9:5557"), Some("tcp://10.0.0.9:5558")]
        );
        let ws = pod_endpoints(&p, &[8000], None);
        assert_eq!(ws[0].spec.kv_events, None);
    }

    #[test]
    fn active_ports_narrow_a_pods_endpoints_keeping_the_rank_names() {
        let p = pod("v", "10.0.0.7", &[(ACTIVE_PORTS, "8000, 8002,9999")], true);
        let ws = pod_endpoints(&p, &[8000, 8001, 8002], None);
        assert_eq!(
            ids(&ws),
            [
                ("v-rank-0", "http://10.0.0.7:8000"),
                ("v-rank-2", "http://10.0.0.7:8002")
            ]
        );
        let legacy = pod("v", "10.0.0.7", &[(LEGACY_ACTIVE_PORTS, "8001")], true);
        assert_eq!(
            ids(&pod_endpoints(&legacy, &[8000, 8001], None))[0].0,
            "v-rank-1"
        );
        let none = pod("v", "10.0.0.7", &[(ACTIVE_PORTS, "")], true);
        assert!(pod_endpoints(&none, &[8000], None).is_empty());
    }

    #[test]
    fn a_port_change_keeps_the_pods_and_a_selector_change_waits_for_its_list() {
        let mut e = Endpoints::default();
        let t = |selector: &str, ports: &[u16]| Target {
            selector: selector.into(),
            ports: ports.to_vec(),
        };
        assert_eq!(e.retarget(t("app=vllm", &[8000])), Retarget::Selector);
        e.listed(vec![pod("a", "10.0.0.1", &[], true)]);
        assert_eq!(e.wanted().len(), 1);
        assert_eq!(e.retarget(t("app=vllm", &[8000])), Retarget::Same);
        assert_eq!(e.retarget(t("app=vllm", &[8000, 8001])), Retarget::Ports);
        assert_eq!(e.wanted().len(), 2);
        assert_eq!(e.retarget(t("app=sglang", &[8000])), Retarget::Selector);
        // The old pods stay until the new selector's list is in.
        assert_eq!(e.wanted().len(), 1);
        assert!(!e.event(watcher::Event::Init));
        assert!(!e.event(watcher::Event::InitApply(pod("b", "10.0.0.2", &[], true))));
        assert!(e.event(watcher::Event::InitDone));
        assert_eq!(e.wanted()[0].id.as_deref(), Some("b-rank-0"));
        assert!(e.event(watcher::Event::Delete(pod("b", "10.0.0.2", &[], true))));
        assert!(e.wanted().is_empty());
        e.clear();
        assert!(e.target().is_none());
    }
}
