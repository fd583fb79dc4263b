//! A stub Kubernetes API server on 127.0.0.1 for the discovery tests: list + watch of pods,
//! InferencePools and InferenceObjectives (llm-d.ai and the older x-k8s.io group) with resourceVersions, label/field selectors, bookmarks, watches that end,
//! 410 Gone for compacted versions, bearer-token auth, and a log of every request (for RBAC).
//! It speaks the wire protocol kube-rs (and client-go) use; it is not a mock of our code.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

/// The bearer token the generated kubeconfig carries; anything else gets 401.
pub const TOKEN: &str = "stub-token";

/// A resource kind the stub serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// core/v1 pods.
    Pod,
    /// inference.networking.k8s.io/v1 inferencepools.
    Pool,
    /// llm-d.ai/v1alpha2 inferenceobjectives.
    Objective,
    /// inference.networking.x-k8s.io/v1alpha2 inferenceobjectives (GIE up to v1.5).
    LegacyObjective,
}

impl Kind {
    fn api_version(self) -> &'static str {
        match self {
            Kind::Pod => "v1",
            Kind::Pool => "inference.networking.k8s.io/v1",
            Kind::Objective => "llm-d.ai/v1alpha2",
            Kind::LegacyObjective => "inference.networking.x-k8s.io/v1alpha2",
        }
    }
    fn kind(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Pool => "InferencePool",
            Kind::Objective | Kind::LegacyObjective => "InferenceObjective",
        }
    }
    /// `(apiGroup, resource)` as RBAC names it.
    pub fn rbac(self) -> (&'static str, &'static str) {
        match self {
            Kind::Pod => ("", "pods"),
            Kind::Pool => ("inference.networking.k8s.io", "inferencepools"),
            Kind::Objective => ("llm-d.ai", "inferenceobjectives"),
            Kind::LegacyObjective => ("inference.networking.x-k8s.io", "inferenceobjectives"),
        }
    }
}

/// One request the stub answered.
#[derive(Debug, Clone)]
pub struct Request {
    /// `list` or `watch`.
    pub verb: &'static str,
    /// What was asked for.
    pub kind: Kind,
    /// Namespace in the path.
    pub namespace: String,
    /// `resourceVersion` query parameter.
    pub resource_version: Option<String>,
    /// `labelSelector`.
    pub label_selector: Option<String>,
    /// `fieldSelector`.
    pub field_selector: Option<String>,
}

#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    kind: Kind,
    ns: String,
    old: Option<Value>,
    new: Option<Value>,
}

#[derive(Debug, Clone)]
enum Signal {
    Change(Arc<Change>),
    Bookmark(u64),
    Close,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    /// Watches from a version older than this get 410 Gone.
    compacted: u64,
    objects: BTreeMap<(Kind, String, String), Value>,
    history: Vec<Arc<Change>>,
    requests: Vec<Request>,
}

struct Shared {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Signal>,
}

/// A running stub API server.
pub struct KubeStub {
    /// Its address (`http://` only).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
    dir: tempfile::TempDir,
}

impl Drop for KubeStub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KubeStub {
    /// Starts on a random port of 127.0.0.1.
    pub async fn start() -> Self {
        let (tx, _) = broadcast::channel(1024);
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                rv: 100,
                ..Default::default()
            }),
            tx,
        });
        let app = Router::new()
            .route("/api/v1/namespaces/{ns}/pods", get(handler(Kind::Pod)))
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
                get(handler(Kind::Pool)),
            )
            .route(
                "/apis/llm-d.ai/v1alpha2/namespaces/{ns}/inferenceobjectives",
                get(handler(Kind::Objective)),
            )
            .route(
                "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives",
                get(handler(Kind::LegacyObjective)),
            )
            .fallback(|| async { (StatusCode::NOT_FOUND, "not served by the stub") })
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            addr,
            shared,
            task,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Writes a kubeconfig pointing at the stub (context namespace `namespace`) and returns it.
    pub fn kubeconfig(&self, namespace: &str) -> PathBuf {
        let path = self.dir.path().join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters:\n- name: stub\n  cluster: {{ server: \"http://{}\" }}\n\
             users:\n- name: stub\n  user: {{ token: {TOKEN} }}\n\
             contexts:\n- name: stub\n  context: {{ cluster: stub, user: stub, namespace: {namespace} }}\n\
             current-context: stub\n",
            self.addr
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Creates or replaces an object (name and namespace from its metadata).
    pub fn apply(&self, kind: Kind, mut obj: Value) {
        let mut inner = self.shared.inner.lock();
        inner.rv += 1;
        let rv = inner.rv;
        let ns = obj["metadata"]["namespace"]
            .as_str()
            .expect("metadata.namespace")
            .to_string();
        let name = obj["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_string();
        obj["apiVersion"] = json!(kind.api_version());
        obj["kind"] = json!(kind.kind());
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        obj["metadata"]["uid"] = json!(format!("uid-{name}"));
        let old = inner.objects.insert((kind, ns.clone(), name), obj.clone());
        self.record(&mut inner, kind, ns, old, Some(obj));
    }

    /// Deletes an object.
    pub fn delete(&self, kind: Kind, ns: &str, name: &str) {
        let mut inner = self.shared.inner.lock();
        let Some(mut old) = inner
            .objects
            .remove(&(kind, ns.to_string(), name.to_string()))
        else {
            panic!("stub: no {kind:?} {ns}/{name} to delete");
        };
        inner.rv += 1;
        // A DELETED event carries the object at the deletion's version.
        old["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        self.record(&mut inner, kind, ns.to_string(), Some(old), None);
    }

    fn record(
        &self,
        inner: &mut Inner,
        kind: Kind,
        ns: String,
        old: Option<Value>,
        new: Option<Value>,
    ) {
        let change = Arc::new(Change {
            rv: inner.rv,
            kind,
            ns,
            old,
            new,
        });
        inner.history.push(change.clone());
        let _ = self.shared.tx.send(Signal::Change(change));
    }

    /// The current object, if any.
    pub fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        self.shared
            .inner
            .lock()
            .objects
            .get(&(kind, ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Ends every open watch (as an API server restart or a watch timeout does); `during`
    /// runs before any new watch can start, so its changes fall in the gap.
    pub fn end_watches(&self, during: impl FnOnce(&Self)) {
        let guard = self.shared.inner.lock();
        let _ = self.shared.tx.send(Signal::Close);
        drop(guard);
        during(self);
    }

    /// Ends every watch and forgets history: resuming from any version seen so far gets 410
    /// Gone, so clients must list again. `during` runs in the gap.
    pub fn expire(&self, during: impl FnOnce(&Self)) {
        {
            let mut inner = self.shared.inner.lock();
            let _ = self.shared.tx.send(Signal::Close);
            // Another write in the cluster moved the global version past everything seen.
            inner.rv += 1;
            inner.compacted = inner.rv;
        }
        during(self);
    }

    /// Sends a BOOKMARK at the current version to every watch that asked for bookmarks.
    pub fn bookmark(&self) {
        let rv = self.shared.inner.lock().rv;
        let _ = self.shared.tx.send(Signal::Bookmark(rv));
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Request> {
        self.shared.inner.lock().requests.clone()
    }

    /// Current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.inner.lock().rv
    }
}

/// A pod object as the kubelet reports it.
pub fn pod(
    ns: &str,
    name: &str,
    labels: Value,
    ip: Option<&str>,
    ready: bool,
    ports: &[(&str, u16)],
) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, p)| json!({"name": n, "containerPort": p, "protocol": "TCP"}))
        .collect();
    let mut status = json!({
        "phase": if ready { "Running" } else { "Pending" },
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": if ready { "True" } else { "False" }}
        ]
    });
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
        status["podIPs"] = json!([{"ip": ip}]);
    }
    json!({
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm", "ports": ports}]},
        "status": status
    })
}

/// An InferencePool v1 object.
pub fn pool(ns: &str, name: &str, match_labels: Value, ports: &[u16]) -> Value {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": match_labels},
            "targetPorts": ports,
            "endpointPickerRef": {"name": "kv-router", "port": {"number": 9002}}
        }
    })
}

/// An InferenceObjective (either group's: the same spec) for `pool` with `priority`.
pub fn objective(ns: &str, name: &str, pool: &str, priority: Option<i64>) -> Value {
    let mut spec = json!({"poolRef": {"group": "inference.networking.k8s.io", "name": pool}});
    if let Some(p) = priority {
        spec["priority"] = json!(p);
    }
    json!({"metadata": {"name": name, "namespace": ns}, "spec": spec})
}

type Params = Query<BTreeMap<String, String>>;

/// The list/watch handler for one kind.
fn handler(
    kind: Kind,
) -> impl Fn(State<Arc<Shared>>, Path<String>, HeaderMap, Params) -> std::future::Ready<Response>
       + Clone
       + Send
       + 'static {
    move |State(s), Path(ns), headers, Query(q)| std::future::ready(serve(s, kind, ns, headers, q))
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// Equality-based label selectors (`a=b,c==d,e!=f`) and `metadata.name=` field selectors.
fn matches(obj: &Value, labels: Option<&str>, fields: Option<&str>) -> bool {
    let label_ok = labels.filter(|s| !s.is_empty()).is_none_or(|sel| {
        sel.split(',').all(|term| {
            let (k, v, neg) = if let Some((k, v)) = term.split_once("!=") {
                (k, v, true)
            } else if let Some((k, v)) = term.split_once("==") {
                (k, v, false)
            } else if let Some((k, v)) = term.split_once('=') {
                (k, v, false)
            } else {
                panic!("stub: unsupported label selector term {term:?}");
            };
            let has = obj["metadata"]["labels"][k.trim()].as_str() == Some(v.trim());
            has != neg
        })
    });
    let field_ok = fields.filter(|s| !s.is_empty()).is_none_or(|sel| {
        let (k, v) = sel
            .split_once('=')
            .unwrap_or_else(|| panic!("stub: unsupported field selector {sel:?}"));
        assert_eq!(
            k, "metadata.name",
            "stub: only metadata.name field selectors"
        );
        obj["metadata"]["name"].as_str() == Some(v)
    });
    label_ok && field_ok
}

fn serve(
    s: Arc<Shared>,
    kind: Kind,
    ns: String,
    headers: HeaderMap,
    q: BTreeMap<String, String>,
) -> Response {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if auth != format!("Bearer {TOKEN}") {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(status(401, "Unauthorized", "Unauthorized")),
        )
            .into_response();
    }
    let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    let labels = q.get("labelSelector").cloned();
    let fields = q.get("fieldSelector").cloned();
    let rv = q.get("resourceVersion").cloned();
    let mut inner = s.inner.lock();
    inner.requests.push(Request {
        verb: if watch { "watch" } else { "list" },
        kind,
        namespace: ns.clone(),
        resource_version: rv.clone(),
        label_selector: labels.clone(),
        field_selector: fields.clone(),
    });
    let select = |o: &Value| matches(o, labels.as_deref(), fields.as_deref());
    if !watch {
        let items: Vec<Value> = inner
            .objects
            .iter()
            .filter(|((k, n, _), o)| *k == kind && *n == ns && select(o))
            .map(|(_, o)| o.clone())
            .collect();
        let list = json!({
            "apiVersion": kind.api_version(),
            "kind": format!("{}List", kind.kind()),
            "metadata": {"resourceVersion": inner.rv.to_string()},
            "items": items
        });
        return axum::Json(list).into_response();
    }
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let from: u64 = match rv.as_deref() {
        None | Some("") | Some("0") => 0,
        Some(v) => v.parse().unwrap_or(0),
    };
    let (tx, rx) = mpsc::channel::<Result<bytes::Bytes, std::convert::Infallible>>(256);
    let line = |v: Value| {
        let mut b = serde_json::to_vec(&v).unwrap();
        b.push(b'\n');
        Ok(bytes::Bytes::from(b))
    };
    let mut initial = Vec::new();
    let mut live = None;
    if from > 0 && from < inner.compacted {
        initial.push(line(
            json!({"type": "ERROR", "object": status(410, "Expired",
            &format!("too old resource version: {from} ({})", inner.compacted))}),
        ));
    } else if from == 0 {
        // "Any version": synthetic ADDED for the current state, then live changes.
        for ((k, n, _), o) in &inner.objects {
            if *k == kind && *n == ns && select(o) {
                initial.push(line(json!({"type": "ADDED", "object": o})));
            }
        }
        live = Some((s.tx.subscribe(), inner.rv));
    } else {
        for c in inner.history.iter().filter(|c| c.rv > from) {
            if let Some(ev) = event(c, kind, &ns, &select) {
                initial.push(line(ev));
            }
        }
        live = Some((s.tx.subscribe(), inner.rv));
    }
    drop(inner);
    let labels2 = labels.clone();
    let fields2 = fields.clone();
    tokio::spawn(async move {
        for l in initial {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        let Some((mut sub, seen)) = live else { return };
        let select = |o: &Value| matches(o, labels2.as_deref(), fields2.as_deref());
        loop {
            let msg = tokio::select! {
                m = sub.recv() => m,
                _ = tokio::time::sleep(Duration::from_secs(300)) => return,
            };
            let ev = match msg {
                Ok(Signal::Change(c)) if c.rv > seen => event(&c, kind, &ns, &select),
                Ok(Signal::Change(_)) => None,
                Ok(Signal::Bookmark(rv)) if bookmarks => Some(json!({"type": "BOOKMARK",
                    "object": {"apiVersion": kind.api_version(), "kind": kind.kind(),
                               "metadata": {"resourceVersion": rv.to_string()}}})),
                Ok(Signal::Bookmark(_)) => None,
                Ok(Signal::Close) | Err(_) => return,
            };
            if let Some(ev) = ev {
                let mut b = serde_json::to_vec(&ev).unwrap();
                b.push(b'\n');
                if tx.send(Ok(bytes::Bytes::from(b))).await.is_err() {
                    return;
                }
            }
        }
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap()
}

/// The watch event a change produces for one watcher (objects leaving the selection are
/// DELETED, entering it ADDED, as the API server's watch cache reports them).
fn event(c: &Change, kind: Kind, ns: &str, select: &dyn Fn(&Value) -> bool) -> Option<Value> {
    if c.kind != kind || c.ns != ns {
        return None;
    }
    let was = c.old.as_ref().is_some_and(select);
    let is = c.new.as_ref().is_some_and(select);
    let (ty, obj) = match (was, is) {
        (false, true) => ("ADDED", c.new.clone()?),
        (true, true) => ("MODIFIED", c.new.clone()?),
        (true, false) => {
            let mut o = c.new.clone().or_else(|| c.old.clone())?;
            o["metadata"]["resourceVersion"] = json!(c.rv.to_string());
            ("DELETED", o)
        }
        (false, false) => return None,
    };
    Some(json!({"type": ty, "object": obj}))
}
