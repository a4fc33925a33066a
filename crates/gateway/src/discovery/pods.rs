//! Which pods are workers, and the worker each one is: a pure function of the pod.
//!
//! A pod is a worker while its labels match a selector, it is `Running` and `Ready`, it has
//! a pod IP and it is not being deleted. Its URL is `http://{podIP}:{port}` (`https://` with
//! the annotation `kvroute.io/scheme: https`), and that URL is its worker id. The config
//! file's worker fields come from annotations under `kvroute.io/`; a malformed one is left
//! out, with a warning that names the pod.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;

use crate::config::{Selector, WorkerRole, WorkerSource, WorkerSpec};

/// The annotation prefix of the worker fields.
pub const PREFIX: &str = "kvroute.io/";
/// SGLang's (and smg's) annotation for a prefill pod's bootstrap port.
pub const SGLANG_BOOTSTRAP_PORT: &str = "sglang.ai/bootstrap-port";

/// A pod that is a worker now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodWorker {
    /// `namespace/name`.
    pub pod: String,
    /// Validated, with its source set.
    pub spec: WorkerSpec,
    /// What was wrong with its annotations (left out of the spec).
    pub warnings: Vec<String>,
}

/// `namespace/name` of a pod.
pub fn pod_name(pod: &Pod) -> String {
    let m = &pod.metadata;
    format!(
        "{}/{}",
        m.namespace.as_deref().unwrap_or(""),
        m.name.as_deref().unwrap_or("")
    )
}

/// Whether the pod is one a request may go to now: Running, Ready, with an IP, not being
/// deleted.
fn serving(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// The worker this pod is under `selector`, or `None` when it is not one now.
pub fn pod_worker(pod: &Pod, selector: &Selector, port: u16) -> Option<PodWorker> {
    let empty = BTreeMap::new();
    let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
    if !selector.matches(|k| labels.get(k).map(String::as_str)) {
        return None;
    }
    serving_worker(pod, port, selector.role)
}

/// The worker this pod is at `port` whatever its labels (the API server selected it), with
/// `role` unless it is `Both` (then the pod's annotation may narrow it); `None` when the pod
/// does not serve now.
pub fn serving_worker(pod: &Pod, port: u16, role: WorkerRole) -> Option<PodWorker> {
    let empty = BTreeMap::new();
    let ip = serving(pod)?;
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let get = |name: &str| {
        annotations
            .get(&format!("{PREFIX}{name}"))
            .map(|v| v.trim())
    };
    let mut warnings = Vec::new();
    let mut bad = |name: &str, value: &str, expected: &str| {
        warnings.push(format!("{name}: '{value}' is not {expected}"));
    };
    let host = match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    };
    let scheme = match get("scheme") {
        None | Some("http") => "http",
        Some("https") => "https",
        Some(other) => {
            bad("kvroute.io/scheme", other, "http or https");
            "http"
        }
    };
    let mut spec = WorkerSpec::url(format!("{scheme}://{host}:{port}"));
    spec.source = WorkerSource::Kubernetes { pod: pod_name(pod) };
    let mut endpoint = |name: &str| -> Option<String> {
        let value = get(name)?;
        let endpoint = match value.parse::<u16>() {
            Ok(port) if port > 0 => format!("tcp://{host}:{port}"),
            _ => value.replace("{podIP}", &host),
        };
        let port_ok = endpoint
            .strip_prefix("tcp://")
            .and_then(|rest| rest.rsplit_once(':'))
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if port_ok {
            Some(endpoint)
        } else {
            bad(
                &format!("{PREFIX}{name}"),
                value,
                "a port or tcp://HOST:PORT",
            );
            None
        }
    };
    spec.kv_events = endpoint("kv-events");
    spec.kv_events_replay = endpoint("kv-events-replay");
    let mut number = |name: &str, max: u64| -> Option<u64> {
        let value = get(name)?;
        match value.parse::<u64>() {
            Ok(n) if n <= max => Some(n),
            _ => {
                bad(
                    &format!("{PREFIX}{name}"),
                    value,
                    &format!("a number up to {max}"),
                );
                None
            }
        }
    };
    spec.dp_size = number("dp-size", 1024).filter(|n| *n > 0).map(|n| n as u32);
    spec.dp_start_rank = number("dp-start-rank", u32::MAX as u64 - 1024).map(|n| n as u32);
    spec.max_num_batched_tokens = number("max-num-batched-tokens", u64::MAX).filter(|n| *n > 0);
    spec.num_gpu_blocks = number("num-gpu-blocks", u64::MAX).filter(|n| *n > 0);
    spec.max_model_len = number("max-model-len", u64::MAX).filter(|n| *n > 0);
    spec.model = get("model").filter(|m| !m.is_empty()).map(str::to_owned);
    if let Some(taints) = get("taints") {
        spec.taints = taints
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect();
    }
    let annotated_role = match get("role") {
        None => None,
        Some("prefill") => Some(WorkerRole::Prefill),
        Some("decode") => Some(WorkerRole::Decode),
        Some("both") => Some(WorkerRole::Both),
        Some(other) => {
            bad("kvroute.io/role", other, "prefill, decode or both");
            None
        }
    };
    // A prefill or decode selector decides the role; under --selector the annotation may.
    spec.role = match role {
        WorkerRole::Both => annotated_role.unwrap_or(WorkerRole::Both),
        role => role,
    };
    let bootstrap = get("bootstrap-port")
        .map(|v| (format!("{PREFIX}bootstrap-port"), v))
        .or_else(|| {
            annotations
                .get(SGLANG_BOOTSTRAP_PORT)
                .map(|v| (SGLANG_BOOTSTRAP_PORT.to_owned(), v.trim()))
        });
    if let Some((name, value)) = bootstrap {
        match value.parse::<u16>() {
            Ok(p) if p > 0 => spec.bootstrap_port = Some(p),
            _ => bad(&name, value, "a port"),
        }
    }
    let spec = spec.validated().ok()?;
    Some(PodWorker {
        pod: pod_name(pod),
        spec,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(labels: &[(&str, &str)], annotations: &[(&str, &str)], ip: &str) -> Pod {
        let map = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "engine-0", "namespace": "ml", "uid": "u1",
                         "labels": map(labels), "annotations": map(annotations)},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap()
    }

    fn selector(role: WorkerRole) -> Selector {
        Selector {
            labels: vec![("app".into(), "vllm".into())],
            role,
        }
    }

    #[test]
    fn a_ready_matching_pod_is_a_worker_at_its_ip_and_port() {
        let p = pod(&[("app", "vllm"), ("x", "y")], &[], "10.0.0.7");
        let w = pod_worker(&p, &selector(WorkerRole::Both), 8000).unwrap();
        assert_eq!(w.spec.url, "http://10.0.0.7:8000");
        assert_eq!(w.spec.id.as_deref(), Some("http://10.0.0.7:8000"));
        assert_eq!(w.pod, "ml/engine-0");
        assert_eq!(
            w.spec.source,
            WorkerSource::Kubernetes {
                pod: "ml/engine-0".into()
            }
        );
        assert!(w.warnings.is_empty());
        let v6 = pod(&[("app", "vllm")], &[], "fd00::7");
        let w = pod_worker(&v6, &selector(WorkerRole::Both), 80).unwrap();
        assert_eq!(w.spec.url, "http://[fd00::7]:80");
    }

    #[test]
    fn only_matching_running_ready_pods_with_an_ip_not_being_deleted_are_workers() {
        let s = selector(WorkerRole::Both);
        assert!(pod_worker(&pod(&[("app", "sglang")], &[], "10.0.0.7"), &s, 80).is_none());
        assert!(pod_worker(&pod(&[], &[], "10.0.0.7"), &s, 80).is_none());
        let mut not_ready = pod(&[("app", "vllm")], &[], "10.0.0.7");
        not_ready
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()[0]
            .status = "False".into();
        assert!(pod_worker(&not_ready, &s, 80).is_none());
        let mut pending = pod(&[("app", "vllm")], &[], "10.0.0.7");
        pending.status.as_mut().unwrap().phase = Some("Pending".into());
        assert!(pod_worker(&pending, &s, 80).is_none());
        let mut no_ip = pod(&[("app", "vllm")], &[], "10.0.0.7");
        no_ip.status.as_mut().unwrap().pod_ip = None;
        assert!(pod_worker(&no_ip, &s, 80).is_none());
        let mut deleting = pod(&[("app", "vllm")], &[], "10.0.0.7");
        deleting.metadata.deletion_timestamp =
            Some(serde_json::from_value(serde_json::json!("2026-12-01T00:00:00Z")).unwrap());
        assert!(pod_worker(&deleting, &s, 80).is_none());
    }

    #[test]
    fn annotations_carry_the_worker_fields() {
        let p = pod(
            &[("app", "vllm")],
            &[
                ("kvroute.io/kv-events", "5557"),
                ("kvroute.io/kv-events-replay", "tcp://{podIP}:5558"),
                ("kvroute.io/dp-size", "4"),
                ("kvroute.io/dp-start-rank", "8"),
                ("kvroute.io/taints", "gpu-h100, zone-a"),
                ("kvroute.io/max-num-batched-tokens", "8192"),
                ("kvroute.io/num-gpu-blocks", "16384"),
                ("kvroute.io/max-model-len", "32768"),
                ("kvroute.io/role", "decode"),
                ("kvroute.io/scheme", "https"),
                ("kvroute.io/model", "llama"),
                ("sglang.ai/bootstrap-port", "8998"),
            ],
            "10.0.0.7",
        );
        let w = pod_worker(&p, &selector(WorkerRole::Both), 8000).unwrap();
        let s = &w.spec;
        assert_eq!(s.url, "https://10.0.0.7:8000");
        assert_eq!(s.kv_events.as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(s.kv_events_replay.as_deref(), Some("tcp://10.0.0.7:5558"));
        assert_eq!((s.dp_size, s.dp_start_rank), (Some(4), Some(8)));
        assert_eq!(s.taints, ["gpu-h100", "zone-a"]);
        assert_eq!(s.max_num_batched_tokens, Some(8192));
        assert_eq!(s.num_gpu_blocks, Some(16384));
        assert_eq!(s.max_model_len, Some(32768));
        assert_eq!(s.role, WorkerRole::Decode);
        assert_eq!(s.model.as_deref(), Some("llama"));
        assert_eq!(s.bootstrap_port, Some(8998));
        assert!(w.warnings.is_empty(), "{:?}", w.warnings);
        // A prefill selector decides the role whatever the annotation says.
        let w = pod_worker(&p, &selector(WorkerRole::Prefill), 8000).unwrap();
        assert_eq!(w.spec.role, WorkerRole::Prefill);
    }

    #[test]
    fn malformed_annotations_are_left_out_with_a_warning() {
        let p = pod(
            &[("app", "vllm")],
            &[
                ("kvroute.io/kv-events", "zmq://nowhere"),
                ("kvroute.io/dp-size", "four"),
                ("kvroute.io/role", "leader"),
                ("kvroute.io/scheme", "gopher"),
                ("sglang.ai/bootstrap-port", "99999"),
            ],
            "10.0.0.7",
        );
        let w = pod_worker(&p, &selector(WorkerRole::Both), 8000).unwrap();
        assert_eq!(w.spec.url, "http://10.0.0.7:8000");
        assert_eq!(w.spec.kv_events, None);
        assert_eq!(w.spec.dp_size, None);
        assert_eq!(w.spec.role, WorkerRole::Both);
        assert_eq!(w.spec.bootstrap_port, None);
        assert_eq!(w.warnings.len(), 5, "{:?}", w.warnings);
        assert!(w
            .warnings
            .iter()
            .any(|m| m.contains("kvroute.io/dp-size") && m.contains("four")));
    }
}
