//! A Kubernetes API server's pod list and watch, on loopback: the wire format kube-rs
//! speaks, served by axum, with the behaviours discovery must survive.
//!
//! - `GET /api/v1/pods` and `/api/v1/namespaces/{ns}/pods`: a `PodList` with its
//!   `metadata.resourceVersion`, filtered by `labelSelector` (`k=v,...`).
//! - The same with `watch=true`: a chunked stream of newline-delimited `ADDED`, `MODIFIED`,
//!   `DELETED` events after the given `resourceVersion`, then a `BOOKMARK`, then each change
//!   as it happens. A pod relabelled out of (into) a selector is `DELETED` (`ADDED`) for that
//!   watch, as the API server does.
//! - A watch from a `resourceVersion` older than the compacted history gets an `ERROR` event
//!   with a `410 Expired` status.
//! - [`FakeApi::forbid`]: every call answers `403 Forbidden`; [`FakeApi::garble`]: every call
//!   answers nonsense; [`FakeApi::stop`]: the server goes away.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use http::StatusCode;
use serde_json::{json, Value};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// One change: its resourceVersion, the object before (none when added) and after (none
/// when deleted).
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    before: Option<Value>,
    after: Option<Value>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// `namespace/name` -> pod.
    pods: BTreeMap<String, Value>,
    history: Vec<Change>,
    /// Watches from before this resourceVersion are expired.
    oldest: u64,
}

struct Shared {
    store: Mutex<Store>,
    changes: broadcast::Sender<Change>,
    forbidden: std::sync::atomic::AtomicBool,
    garbled: std::sync::atomic::AtomicBool,
    /// Cancelled (and replaced) to end every open watch.
    watches: Mutex<CancellationToken>,
    stop: CancellationToken,
    lists: AtomicUsize,
    watch_calls: AtomicUsize,
}

/// The fake API server.
pub struct FakeApi {
    pub url: String,
    shared: Arc<Shared>,
    /// A kubeconfig that points at it.
    pub kubeconfig: PathBuf,
}

/// A pod as the API returns it: Running, Ready (or not), with `labels`, `annotations` and
/// `ip`, in namespace `ml`.
pub fn pod(name: &str, ip: &str, labels: &[(&str, &str)], ready: bool) -> Value {
    let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "ml", "uid": format!("uid-{name}"),
            "labels": labels, "annotations": {},
        },
        "spec": {"containers": [{"name": "engine", "image": "kvroute:dev"}]},
        "status": {
            "phase": "Running", "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    })
}

fn key(pod: &Value) -> String {
    format!(
        "{}/{}",
        pod["metadata"]["namespace"].as_str().unwrap_or(""),
        pod["metadata"]["name"].as_str().unwrap_or("")
    )
}

impl Drop for FakeApi {
    /// Stops the server and removes its kubeconfig's directory.
    fn drop(&mut self) {
        self.stop();
        if let Some(dir) = self.kubeconfig.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `k=v,k2=v2` against a pod's labels.
fn selects(selector: Option<&str>, pod: &Value) -> bool {
    selector
        .unwrap_or("")
        .split(',')
        .filter(|p| !p.is_empty())
        .all(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            pod["metadata"]["labels"][k].as_str() == Some(v)
        })
}

fn in_namespace(ns: Option<&str>, pod: &Value) -> bool {
    ns.is_none_or(|ns| pod["metadata"]["namespace"].as_str() == Some(ns))
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

impl FakeApi {
    pub async fn start() -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            changes: broadcast::channel(1024).0,
            forbidden: Default::default(),
            garbled: Default::default(),
            watches: Mutex::new(CancellationToken::new()),
            stop: CancellationToken::new(),
            lists: AtomicUsize::new(0),
            watch_calls: AtomicUsize::new(0),
        });
        let app = Router::new()
            .route("/api/v1/pods", get(all_pods))
            .route("/api/v1/namespaces/{ns}/pods", get(namespaced_pods))
            .with_state(shared.clone());
        let stop = shared.stop.clone();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        });
        let dir = std::env::temp_dir().join(format!("kvroute-kube-{:x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\n\
                 users:\n- name: tester\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: tester\n\
                 current-context: fake\n"
            ),
        )
        .unwrap();
        FakeApi {
            url,
            shared,
            kubeconfig,
        }
    }

    fn change(&self, name_key: &str, after: Option<Value>) {
        let mut store = self.shared.store.lock().unwrap();
        store.rv += 1;
        let rv = store.rv;
        let after = after.map(|mut p| {
            p["metadata"]["resourceVersion"] = json!(rv.to_string());
            p
        });
        let before = match &after {
            Some(p) => store.pods.insert(name_key.to_owned(), p.clone()),
            None => store.pods.remove(name_key),
        };
        let change = Change { rv, before, after };
        store.history.push(change.clone());
        let _ = self.shared.changes.send(change);
    }

    /// Creates or replaces a pod (`ADDED` or `MODIFIED`).
    pub fn put(&self, pod: Value) {
        self.change(&key(&pod), Some(pod));
    }

    /// Deletes a pod (`DELETED`).
    pub fn delete(&self, name: &str) {
        self.change(&format!("ml/{name}"), None);
    }

    /// Deletes a pod while no watch hears of it: the history is compacted past it (so a
    /// watch resumed from before gets `410`) and, when `drop_watches`, every open watch is
    /// cut.
    pub fn delete_unseen(&self, name: &str, drop_watches: bool) {
        {
            let mut store = self.shared.store.lock().unwrap();
            store.pods.remove(&format!("ml/{name}"));
            store.rv += 1;
            store.oldest = store.rv;
            store.history.clear();
        }
        if drop_watches {
            let mut token = self.shared.watches.lock().unwrap();
            token.cancel();
            *token = CancellationToken::new();
        }
    }

    /// While on, every call answers `403 Forbidden`.
    pub fn forbid(&self, on: bool) {
        self.shared.forbidden.store(on, Ordering::SeqCst);
    }

    /// While on, every call answers 200 with a body that is no pod list.
    pub fn garble(&self, on: bool) {
        self.shared.garbled.store(on, Ordering::SeqCst);
    }

    /// The server goes away: open watches end, new connections are refused.
    pub fn stop(&self) {
        self.shared.watches.lock().unwrap().cancel();
        self.shared.stop.cancel();
    }

    /// The list and watch calls received so far.
    pub fn calls(&self) -> (usize, usize) {
        (
            self.shared.lists.load(Ordering::SeqCst),
            self.shared.watch_calls.load(Ordering::SeqCst),
        )
    }
}

async fn all_pods(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    pods(s, None, q)
}

async fn namespaced_pods(
    State(s): State<Arc<Shared>>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    pods(s, Some(ns), q)
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [(http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn pods(s: Arc<Shared>, ns: Option<String>, q: HashMap<String, String>) -> Response {
    if s.garbled.load(Ordering::SeqCst) {
        let nonsense = json!({"kind": "PodList", "apiVersion": "v1", "items": "not a list"});
        return json_response(StatusCode::OK, &nonsense);
    }
    if s.forbidden.load(Ordering::SeqCst) {
        let message = "pods is forbidden: User \"system:serviceaccount:ml:kvroute\" cannot list resource \"pods\"";
        return json_response(StatusCode::FORBIDDEN, &status(403, "Forbidden", message));
    }
    let selector = q.get("labelSelector").map(String::as_str);
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    let store = s.store.lock().unwrap();
    if !watching {
        s.lists.fetch_add(1, Ordering::SeqCst);
        let items: Vec<&Value> = store
            .pods
            .values()
            .filter(|p| in_namespace(ns.as_deref(), p) && selects(selector, p))
            .collect();
        let list = json!({"kind": "PodList", "apiVersion": "v1",
                          "metadata": {"resourceVersion": store.rv.to_string()}, "items": items});
        return json_response(StatusCode::OK, &list);
    }
    s.watch_calls.fetch_add(1, Ordering::SeqCst);
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let event = |kind: &str, object: &Value| {
        Bytes::from(format!("{}\n", json!({"type": kind, "object": object})))
    };
    if from < store.oldest {
        let gone = status(
            410,
            "Expired",
            &format!("too old resource version: {from} ({})", store.oldest),
        );
        return Response::new(Body::from(event("ERROR", &gone)));
    }
    // What this watch sees of a change: the selector decides ADDED / MODIFIED / DELETED.
    let view = {
        let (ns, selector) = (ns.clone(), selector.map(str::to_owned));
        move |c: &Change| -> Option<Bytes> {
            fn seen<'a>(
                p: &'a Option<Value>,
                ns: Option<&str>,
                selector: Option<&str>,
            ) -> Option<&'a Value> {
                p.as_ref()
                    .filter(|p| in_namespace(ns, p) && selects(selector, p))
            }
            let (ns, selector) = (ns.as_deref(), selector.as_deref());
            let seen = |p| seen(p, ns, selector);
            match (seen(&c.before), seen(&c.after)) {
                (None, Some(after)) => Some(event("ADDED", after)),
                (Some(_), Some(after)) => Some(event("MODIFIED", after)),
                (Some(before), None) => {
                    let mut gone = c.after.clone().unwrap_or_else(|| before.clone());
                    gone["metadata"]["resourceVersion"] = json!(c.rv.to_string());
                    Some(event("DELETED", &gone))
                }
                (None, None) => None,
            }
        }
    };
    let backlog: Vec<Bytes> = store
        .history
        .iter()
        .filter(|c| c.rv > from)
        .filter_map(&view)
        .collect();
    let bookmark = event(
        "BOOKMARK",
        &json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": store.rv.to_string()}}),
    );
    let mut changes = s.changes.subscribe();
    drop(store);
    let cut = s.watches.lock().unwrap().clone();
    let stream = async_stream(backlog, bookmark, move |tx| async move {
        loop {
            tokio::select! {
                c = changes.recv() => match c {
                    Ok(c) => if let Some(bytes) = view(&c) {
                        if tx.send(Ok(bytes)).await.is_err() { return }
                    },
                    Err(_) => return,
                },
                _ = cut.cancelled() => return,
            }
        }
    });
    Response::new(stream)
}

/// A body that sends `backlog`, then `bookmark`, then whatever `rest` sends.
fn async_stream<F, Fut>(backlog: Vec<Bytes>, bookmark: Bytes, rest: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let task = rest(tx.clone());
    tokio::spawn(async move {
        for b in backlog.into_iter().chain([bookmark]) {
            if tx.send(Ok(b)).await.is_err() {
                return;
            }
        }
        drop(tx);
        task.await
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) });
    Body::from_stream(stream)
}
