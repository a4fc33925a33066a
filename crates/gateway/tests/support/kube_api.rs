//! A Kubernetes API server's pods and InferencePools, on loopback: the wire format kube-rs
//! speaks, served by axum, with the behaviours discovery must survive.
//!
//! - `GET /api/v1/pods`, `/api/v1/namespaces/{ns}/pods` and
//!   `/apis/{group}/v1/namespaces/{ns}/inferencepools`: a list with its
//!   `metadata.resourceVersion`, filtered by `labelSelector` (`k=v`, `k==v`, `k!=v`,
//!   `k in (a,b)`, `k notin (a,b)`, `k`, `!k`, comma-separated) and `fieldSelector`
//!   (`metadata.name=...`, `metadata.namespace=...`).
//! - `GET /apis/{group}/v1/namespaces/{ns}/inferencepools/{name}`: the pool, or `404`.
//! - The lists with `watch=true`: a chunked stream of newline-delimited `ADDED`, `MODIFIED`,
//!   `DELETED` events after the given `resourceVersion`, then a `BOOKMARK`, then each change
//!   as it happens. An object changed out of (into) a selector is `DELETED` (`ADDED`) for
//!   that watch, as the API server does. Every kind shares one resourceVersion sequence and
//!   one history, as objects in etcd do.
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

/// An object's key: its kind and `namespace/name`.
type Key = (String, String);

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
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

/// The InferencePool the API returns for `name` in namespace `ml` (group
/// `inference.networking.k8s.io`): `selector`'s labels, `ports` as target ports.
pub fn inference_pool(name: &str, selector: &[(&str, &str)], ports: &[u16]) -> Value {
    let labels: BTreeMap<&str, &str> = selector.iter().copied().collect();
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-pool-{name}")},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": ports,
            "endpointPickerRef": {"name": "kvroute-epp", "port": {"number": 9002}},
        },
    })
}

/// The InferencePool's `apiVersion` (GIE v1).
pub const POOL_API_VERSION: &str = "inference.networking.k8s.io/v1";

fn key(object: &Value) -> Key {
    let m = &object["metadata"];
    let name = format!(
        "{}/{}",
        m["namespace"].as_str().unwrap_or(""),
        m["name"].as_str().unwrap_or("")
    );
    (object["kind"].as_str().unwrap_or("").to_owned(), name)
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

/// The requirements of a selector: split on the commas outside parentheses.
fn requirements(selector: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(selector[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(selector[start..].trim());
    out.retain(|r| !r.is_empty());
    out
}

/// Whether `value` (a label, or a field) meets every requirement of `selector`.
fn meets<'a>(selector: Option<&str>, value: impl Fn(&str) -> Option<&'a str>) -> bool {
    requirements(selector.unwrap_or("")).into_iter().all(|r| {
        let set = |rest: &str| -> Vec<String> {
            let rest = rest.trim().trim_start_matches('(').trim_end_matches(')');
            rest.split(',').map(|v| v.trim().to_owned()).collect()
        };
        if let Some((k, rest)) = r.split_once(" notin ") {
            return value(k.trim()).is_none_or(|v| !set(rest).iter().any(|s| s == v));
        }
        if let Some((k, rest)) = r.split_once(" in ") {
            return value(k.trim()).is_some_and(|v| set(rest).iter().any(|s| s == v));
        }
        if let Some((k, v)) = r.split_once("!=") {
            return value(k.trim()) != Some(v.trim());
        }
        if let Some((k, v)) = r.split_once("==").or_else(|| r.split_once('=')) {
            return value(k.trim()) == Some(v.trim());
        }
        match r.strip_prefix('!') {
            Some(k) => value(k.trim()).is_none(),
            None => value(r).is_some(),
        }
    })
}

/// An object against a `labelSelector` and a `fieldSelector`.
fn selects(labels: Option<&str>, fields: Option<&str>, object: &Value) -> bool {
    let meta = &object["metadata"];
    meets(labels, |k| meta["labels"][k].as_str())
        && meets(fields, |f| match f {
            "metadata.name" => meta["name"].as_str(),
            "metadata.namespace" => meta["namespace"].as_str(),
            _ => None,
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
            .route(
                "/apis/{group}/v1/namespaces/{ns}/inferencepools",
                get(inference_pools),
            )
            .route(
                "/apis/{group}/v1/namespaces/{ns}/inferencepools/{name}",
                get(inference_pool_by_name),
            )
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

    fn change(&self, key: Key, after: Option<Value>) {
        let mut store = self.shared.store.lock().unwrap();
        store.rv += 1;
        let rv = store.rv;
        let after = after.map(|mut p| {
            p["metadata"]["resourceVersion"] = json!(rv.to_string());
            p
        });
        let before = match &after {
            Some(p) => store.objects.insert(key, p.clone()),
            None => store.objects.remove(&key),
        };
        let change = Change { rv, before, after };
        store.history.push(change.clone());
        let _ = self.shared.changes.send(change);
    }

    /// Creates or replaces an object, a pod or an InferencePool (`ADDED` or `MODIFIED`).
    pub fn put(&self, object: Value) {
        self.change(key(&object), Some(object));
    }

    /// Deletes a pod in `ml` (`DELETED`).
    pub fn delete(&self, name: &str) {
        self.change(("Pod".into(), format!("ml/{name}")), None);
    }

    /// Deletes an InferencePool in `ml` (`DELETED`).
    pub fn delete_pool(&self, name: &str) {
        self.change(("InferencePool".into(), format!("ml/{name}")), None);
    }

    /// Deletes a pod while no watch hears of it: the history is compacted past it (so a
    /// watch resumed from before gets `410`) and, when `drop_watches`, every open watch is
    /// cut.
    pub fn delete_unseen(&self, name: &str, drop_watches: bool) {
        let key = ("Pod".to_owned(), format!("ml/{name}"));
        self.shared.store.lock().unwrap().objects.remove(&key);
        self.compact(drop_watches);
    }

    /// Compacts the history: a watch resumed from before now gets `410`; when
    /// `drop_watches`, every open watch is cut (and resumes from before).
    pub fn compact(&self, drop_watches: bool) {
        {
            let mut store = self.shared.store.lock().unwrap();
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

/// The objects a list or watch call is about: their kind, `apiVersion` and namespace.
#[derive(Clone)]
struct Scope {
    kind: &'static str,
    api_version: String,
    namespace: Option<String>,
}

impl Scope {
    fn pods(namespace: Option<String>) -> Self {
        Scope {
            kind: "Pod",
            api_version: "v1".into(),
            namespace,
        }
    }

    fn pools(group: &str, namespace: String) -> Self {
        Scope {
            kind: "InferencePool",
            api_version: format!("{group}/v1"),
            namespace: Some(namespace),
        }
    }

    fn plural(&self) -> &'static str {
        match self.kind {
            "Pod" => "pods",
            _ => "inferencepools",
        }
    }

    fn holds(&self, object: &Value) -> bool {
        object["kind"].as_str() == Some(self.kind)
            && object["apiVersion"].as_str() == Some(self.api_version.as_str())
            && in_namespace(self.namespace.as_deref(), object)
    }
}

async fn all_pods(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(s, Scope::pods(None), q)
}

async fn namespaced_pods(
    State(s): State<Arc<Shared>>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(s, Scope::pods(Some(ns)), q)
}

async fn inference_pools(
    State(s): State<Arc<Shared>>,
    Path((group, ns)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(s, Scope::pools(&group, ns), q)
}

async fn inference_pool_by_name(
    State(s): State<Arc<Shared>>,
    Path((group, ns, name)): Path<(String, String, String)>,
) -> Response {
    let scope = Scope::pools(&group, ns);
    if let Some(trouble) = trouble(&s, &scope) {
        return trouble;
    }
    let store = s.store.lock().unwrap();
    let ns = scope.namespace.as_deref().unwrap_or("");
    match store
        .objects
        .get(&(scope.kind.to_owned(), format!("{ns}/{name}")))
        .filter(|p| scope.holds(p))
    {
        Some(pool) => json_response(StatusCode::OK, pool),
        None => {
            let message = format!("inferencepools.{group} \"{name}\" not found");
            json_response(StatusCode::NOT_FOUND, &status(404, "NotFound", &message))
        }
    }
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [(http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The answer of a garbling or forbidding server, if it is one now.
fn trouble(s: &Shared, scope: &Scope) -> Option<Response> {
    if s.garbled.load(Ordering::SeqCst) {
        let nonsense = json!({"kind": format!("{}List", scope.kind), "apiVersion": scope.api_version,
                              "metadata": "not metadata", "items": "not a list"});
        return Some(json_response(StatusCode::OK, &nonsense));
    }
    if s.forbidden.load(Ordering::SeqCst) {
        let message = format!(
            "{} is forbidden: User \"system:serviceaccount:ml:kvroute\" cannot list resource \"{}\"",
            scope.plural(),
            scope.plural()
        );
        return Some(json_response(
            StatusCode::FORBIDDEN,
            &status(403, "Forbidden", &message),
        ));
    }
    None
}

fn list_or_watch(s: Arc<Shared>, scope: Scope, q: HashMap<String, String>) -> Response {
    if let Some(trouble) = trouble(&s, &scope) {
        return trouble;
    }
    let labels = q.get("labelSelector").cloned();
    let fields = q.get("fieldSelector").cloned();
    let wanted = {
        let scope = scope.clone();
        move |p: &Value| scope.holds(p) && selects(labels.as_deref(), fields.as_deref(), p)
    };
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    let store = s.store.lock().unwrap();
    if !watching {
        s.lists.fetch_add(1, Ordering::SeqCst);
        let items: Vec<&Value> = store.objects.values().filter(|p| wanted(p)).collect();
        let list = json!({"kind": format!("{}List", scope.kind), "apiVersion": scope.api_version,
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
    // What this watch sees of a change: the selectors decide ADDED / MODIFIED / DELETED.
    let view = move |c: &Change| -> Option<Bytes> {
        let seen = |p: &Option<Value>| p.clone().filter(|p| wanted(p));
        match (seen(&c.before), seen(&c.after)) {
            (None, Some(after)) => Some(event("ADDED", &after)),
            (Some(_), Some(after)) => Some(event("MODIFIED", &after)),
            (Some(before), None) => {
                let mut gone = c.after.clone().unwrap_or(before);
                gone["metadata"]["resourceVersion"] = json!(c.rv.to_string());
                Some(event("DELETED", &gone))
            }
            (None, None) => None,
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
        &json!({"kind": scope.kind, "apiVersion": scope.api_version,
                "metadata": {"resourceVersion": store.rv.to_string()}}),
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
