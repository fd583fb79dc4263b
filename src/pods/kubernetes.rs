//! Kubernetes pod source: a watch (list + watch, resumed from the last resourceVersion, relisted
//! on 410 Gone, backed off on errors: kube-rs' `watcher`) of the model pods, selected by a label
//! selector or by an InferencePool's selector and target ports. Only Ready pods with an IP that
//! are not terminating are candidates; a pod that stops qualifying leaves the set.
//!
//! Who may change what: the API server is trusted for the pod list; the router needs `list` and
//! `watch` on pods (and on the one InferencePool, and with flow control's trusted headers the
//! InferenceObjectives: [`objectives`]) in one namespace — [`required_rbac`] is exactly what this
//! code calls, and the shipped Role is checked against it.

mod objectives;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod as KubePod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, watch_object, Event};
use kube::runtime::WatchStreamExt;
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::{PodId, PodSource, PodSourceError, PodSpec, ENGINE_LABEL};
use crate::config::{FlowConfig, KubernetesConfig, PortRef};
use crate::telemetry::{ErrorKind, Errors};

/// API group of InferencePool.
pub const POOL_GROUP: &str = "inference.networking.k8s.io";
/// API version of InferencePool read here.
pub const POOL_VERSION: &str = "v1";

/// One RBAC rule the source needs (namespaced Role).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RbacRule {
    /// API group (`""` = core).
    pub api_group: String,
    /// Resource (plural).
    pub resource: String,
    /// Verbs, sorted.
    pub verbs: Vec<String>,
    /// `resourceNames` restriction (empty = any).
    pub resource_names: Vec<String>,
}

pub use objectives::OBJECTIVES_RESOURCE;

/// Exactly the API calls this source makes, as Role rules: with `flow` (flow control on, trusted
/// headers, an `objective_api`) and a pool, the InferenceObjectives' watch too.
pub fn required_rbac(cfg: &KubernetesConfig, flow: &FlowConfig) -> Vec<RbacRule> {
    let lw = vec!["list".to_string(), "watch".to_string()];
    let mut rules = vec![RbacRule {
        api_group: String::new(),
        resource: "pods".into(),
        verbs: lw.clone(),
        resource_names: vec![],
    }];
    if let Some(pool) = &cfg.pool {
        // A list/watch with fieldSelector metadata.name=<pool> is authorised by resourceNames.
        rules.push(RbacRule {
            api_group: POOL_GROUP.into(),
            resource: "inferencepools".into(),
            verbs: lw.clone(),
            resource_names: vec![pool.name.clone()],
        });
        if let Some((group, _)) = flow.watched_objective_api() {
            rules.push(RbacRule {
                api_group: group.into(),
                resource: OBJECTIVES_RESOURCE.into(),
                verbs: lw,
                resource_names: vec![],
            });
        }
    }
    rules
}

/// What the pods watch selects: a label selector and the ports to route to.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    selector: String,
    ports: Ports,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Ports {
    Numbers(Vec<u16>),
    Named(String),
}

/// A pod that qualifies as a candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Member {
    ip: IpAddr,
    ports: Vec<u16>,
    models: Vec<String>,
    /// The pod's `kv-router.io/engine` annotation, else label.
    engine: Option<String>,
    /// The pod's role label (`pods.kubernetes.role_label`), when it names a role.
    role: Option<super::PodRole>,
}

#[derive(Debug, Default)]
struct View {
    /// Qualifying pods by name (namespace is fixed), as of the last complete list + events.
    members: BTreeMap<String, Member>,
}

/// Pods of a namespace, watched through the Kubernetes API.
pub struct KubernetesSource {
    name: String,
    namespace: String,
    view: Arc<Mutex<View>>,
    task: JoinHandle<()>,
    client: kube::Client,
    pool: Option<String>,
    metrics: Option<Errors>,
    objectives: Option<JoinHandle<()>>,
}

impl Drop for KubernetesSource {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(t) = &self.objectives {
            t.abort();
        }
    }
}

/// Could not start the source (no usable kubeconfig / in-cluster config).
#[derive(Debug, thiserror::Error)]
#[error("pods.kubernetes: {0}")]
pub struct StartError(String);

impl KubernetesSource {
    /// Builds the client (`kubeconfig`, else `$KUBECONFIG` / `~/.kube/config` / in-cluster) and
    /// starts the watch in the background. `models` applies to pods without a models
    /// label/annotation; errors are counted in `metrics` (`kv_router_errors_total{kind}`).
    pub async fn start(
        cfg: KubernetesConfig,
        models: Vec<String>,
        metrics: Option<Errors>,
    ) -> Result<Self, StartError> {
        let client_cfg = match &cfg.kubeconfig {
            Some(path) => {
                let kc = Kubeconfig::read_from(path)
                    .map_err(|e| StartError(format!("reading {}: {e}", path.display())))?;
                kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| StartError(format!("kubeconfig {}: {e}", path.display())))?
            }
            None => kube::Config::infer().await.map_err(|e| {
                StartError(format!(
                    "no Kubernetes client configuration (KUBECONFIG, ~/.kube/config, in-cluster service account): {e}"
                ))
            })?,
        };
        let namespace = [
            cfg.namespace.clone(),
            std::env::var("NAMESPACE").unwrap_or_default(),
            client_cfg.default_namespace.clone(),
        ]
        .into_iter()
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into());
        let client = kube::Client::try_from(client_cfg)
            .map_err(|e| StartError(format!("building the client: {e}")))?;
        let (pods_ns, name) = match &cfg.pool {
            Some(pool) => {
                let ns = if pool.namespace.is_empty() {
                    namespace.clone()
                } else {
                    pool.namespace.clone()
                };
                let name = format!("kubernetes:inferencepool {ns}/{}", pool.name);
                (ns, name)
            }
            None => {
                let name = format!("kubernetes:{namespace}/{}", cfg.selector);
                (namespace.clone(), name)
            }
        };
        info!(
            source = %name,
            replica = %std::env::var("POD_NAME").unwrap_or_default(),
            "watching model pods through the Kubernetes API"
        );
        let view = Arc::new(Mutex::new(View::default()));
        let pool = cfg.pool.as_ref().map(|p| p.name.clone());
        let watch = Watch {
            client: client.clone(),
            namespace: pods_ns.clone(),
            cfg,
            models,
            view: view.clone(),
            metrics: metrics.clone(),
        };
        let task = tokio::spawn(supervise(watch));
        Ok(Self {
            name,
            namespace: pods_ns,
            view,
            task,
            client,
            pool,
            metrics,
            objectives: None,
        })
    }

    /// Starts the watch of the pool namespace's InferenceObjectives into `watched` when `flow`
    /// watches them ([`FlowConfig::watched_objective_api`]) and pods come from a pool; else
    /// nothing. [`required_rbac`] names the same condition.
    pub fn watch_objectives(&mut self, flow: &FlowConfig, watched: Arc<crate::flow::Watched>) {
        let (Some(pool), Some((group, version))) = (&self.pool, flow.watched_objective_api())
        else {
            return;
        };
        if let Some(t) = self.objectives.take() {
            t.abort();
        }
        let w = objectives::ObjectiveWatch {
            client: self.client.clone(),
            namespace: self.namespace.clone(),
            pool: pool.clone(),
            group: group.into(),
            version: version.into(),
            watched,
            errors: self.metrics.clone(),
        };
        self.objectives = Some(tokio::spawn(objectives::run(w)));
    }
}

#[async_trait]
impl PodSource for KubernetesSource {
    fn name(&self) -> String {
        self.name.clone()
    }

    /// The qualifying pods as last seen; empty until the first list completes. An API server
    /// outage keeps the last view (the watch resumes or relists when it is back).
    async fn pods(&self) -> Result<Vec<PodSpec>, PodSourceError> {
        let view = self.view.lock();
        let mut out = Vec::new();
        for (pod, m) in &view.members {
            for port in &m.ports {
                let addr = SocketAddr::new(m.ip, *port);
                let mut labels = BTreeMap::new();
                labels.insert("source".to_string(), "kubernetes".to_string());
                labels.insert("namespace".to_string(), self.namespace.clone());
                labels.insert("pod".to_string(), pod.clone());
                if let Some(engine) = &m.engine {
                    labels.insert(ENGINE_LABEL.to_string(), engine.clone());
                }
                super::role::set_role(&mut labels, m.role);
                out.push(PodSpec {
                    id: PodId::from(addr),
                    addr,
                    models: m.models.clone(),
                    labels,
                    kv_events_endpoint: None,
                    kv_events_replay_endpoint: None,
                });
            }
        }
        Ok(out)
    }
}

struct Watch {
    client: kube::Client,
    namespace: String,
    cfg: KubernetesConfig,
    models: Vec<String>,
    view: Arc<Mutex<View>>,
    metrics: Option<Errors>,
}

impl Watch {
    fn count(&self, kind: ErrorKind) {
        if let Some(m) = &self.metrics {
            m.inc(kind);
        }
    }

    fn watch_error(&self, what: &str, e: &watcher::Error) {
        match e {
            // The API server compacted past our resourceVersion: kube-rs relists by itself.
            watcher::Error::WatchError(s) if s.code == 410 => {
                info!(what, "watch expired (410 Gone); relisting")
            }
            _ => {
                self.count(ErrorKind::KubernetesWatch);
                warn!(what, error = %e, "Kubernetes watch failed; retrying with backoff");
            }
        }
    }
}

/// Restarts the watch loop if it ever ends or panics (counted), with a pause in between.
async fn supervise(watch: Watch) {
    let watch = Arc::new(watch);
    loop {
        let w = watch.clone();
        let result = tokio::spawn(async move { run(&w).await }).await;
        watch.count(ErrorKind::KubernetesRestart);
        match result {
            Ok(()) => warn!("Kubernetes watch loop ended; restarting"),
            Err(e) => warn!(error = %e, "Kubernetes watch loop panicked; restarting"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

type PodStream = BoxStream<'static, Result<Event<KubePod>, watcher::Error>>;

fn pod_stream(w: &Watch, target: &Target) -> PodStream {
    let api: Api<KubePod> = Api::namespaced(w.client.clone(), &w.namespace);
    // `any_semantic`: the initial list is served from the API server's watch cache, as
    // client-go informers do; the watch that follows catches up.
    let wc = watcher::Config::default()
        .labels(&target.selector)
        .any_semantic();
    watcher::watcher(api, wc).default_backoff().boxed()
}

async fn run(w: &Watch) {
    match &w.cfg.pool {
        None => {
            let target = Target {
                selector: w.cfg.selector.clone(),
                ports: match &w.cfg.port {
                    PortRef::Number(n) => Ports::Numbers(vec![*n]),
                    PortRef::Name(s) => Ports::Named(s.clone()),
                },
            };
            let mut pods = pod_stream(w, &target);
            let mut buffer = None;
            while let Some(ev) = pods.next().await {
                apply(w, &target, &mut buffer, ev);
            }
        }
        Some(pool) => {
            let gvk = GroupVersionKind::gvk(POOL_GROUP, POOL_VERSION, "InferencePool");
            let ar = ApiResource::from_gvk_with_plural(&gvk, "inferencepools");
            let api: Api<DynamicObject> = Api::namespaced_with(w.client.clone(), &w.namespace, &ar);
            let mut pools = watch_object(api, &pool.name).default_backoff().boxed();
            let mut target: Option<Target> = None;
            let mut pods: Option<PodStream> = None;
            let mut buffer = None;
            loop {
                tokio::select! {
                    ev = pools.try_next() => match ev {
                        Ok(Some(obj)) => {
                            let next = obj.as_ref().and_then(|o| pool_target(&pool.name, o));
                            if next != target {
                                info!(pool = %pool.name, target = ?next, "InferencePool selection changed");
                                pods = next.as_ref().map(|t| pod_stream(w, t));
                                buffer = None;
                                if next.is_none() {
                                    w.view.lock().members.clear();
                                }
                                target = next;
                            }
                        }
                        Ok(None) => return,
                        Err(e) => w.watch_error("inferencepool", &e),
                    },
                    Some(ev) = async { match pods.as_mut() { Some(p) => p.next().await, None => std::future::pending().await } } => {
                        if let Some(t) = &target {
                            apply(w, t, &mut buffer, ev);
                        }
                    }
                }
            }
        }
    }
}

/// Applies one pods-watch event to the view; a relist is buffered and swapped in whole.
fn apply(
    w: &Watch,
    target: &Target,
    buffer: &mut Option<BTreeMap<String, Member>>,
    ev: Result<Event<KubePod>, watcher::Error>,
) {
    let member = |pod: &KubePod| member(pod, target, &w.cfg, &w.models);
    match ev {
        Ok(Event::Init) => *buffer = Some(BTreeMap::new()),
        Ok(Event::InitApply(pod)) => {
            if let (Some(buf), Some(name), Some(m)) =
                (buffer.as_mut(), pod.metadata.name.clone(), member(&pod))
            {
                buf.insert(name, m);
            }
        }
        Ok(Event::InitDone) => {
            let members = buffer.take().unwrap_or_default();
            debug!(pods = members.len(), "pod list synced");
            w.view.lock().members = members;
        }
        Ok(Event::Apply(pod)) => {
            let Some(name) = pod.metadata.name.clone() else {
                return;
            };
            let mut view = w.view.lock();
            match member(&pod) {
                Some(m) => view.members.insert(name, m),
                None => view.members.remove(&name),
            };
        }
        Ok(Event::Delete(pod)) => {
            if let Some(name) = &pod.metadata.name {
                w.view.lock().members.remove(name);
            }
        }
        Err(e) => w.watch_error("pods", &e),
    }
}

/// A pod qualifies when it is Ready, not terminating, has an IP and the target port.
fn member(
    pod: &KubePod,
    target: &Target,
    cfg: &KubernetesConfig,
    models: &[String],
) -> Option<Member> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    let ports = match &target.ports {
        Ports::Numbers(n) => n.clone(),
        Ports::Named(name) => {
            let port = pod
                .spec
                .as_ref()?
                .containers
                .iter()
                .flat_map(|c| c.ports.iter().flatten())
                .find(|p| p.name.as_deref() == Some(name.as_str()))?
                .container_port;
            vec![u16::try_from(port).ok().filter(|p| *p > 0)?]
        }
    };
    Some(Member {
        ip,
        ports,
        models: pod_models(pod, cfg).unwrap_or_else(|| models.to_vec()),
        engine: pod_engine(pod),
        role: pod_role(pod, cfg),
    })
}

/// The role the configured label names; a value that names none counts as no role (`both`).
fn pod_role(pod: &KubePod, cfg: &KubernetesConfig) -> Option<super::PodRole> {
    let v = pod.metadata.labels.as_ref()?.get(&cfg.role_label)?;
    let role = super::PodRole::parse(v);
    if role.is_none() {
        debug!(label = %cfg.role_label, "pod role label names no role; treated as both");
    }
    role
}

/// The `kv-router.io/engine` annotation, else label (a value past 64 bytes is no engine name).
fn pod_engine(pod: &KubePod) -> Option<String> {
    let m = &pod.metadata;
    [&m.annotations, &m.labels]
        .into_iter()
        .find_map(|map| map.as_ref()?.get(ENGINE_LABEL))
        .filter(|v| v.len() <= 64)
        .cloned()
}

/// Model names from the configured annotation (comma-separated), else the configured label.
fn pod_models(pod: &KubePod, cfg: &KubernetesConfig) -> Option<Vec<String>> {
    let from = |map: &Option<BTreeMap<String, String>>, key: &str| -> Option<Vec<String>> {
        if key.is_empty() {
            return None;
        }
        let v = map.as_ref()?.get(key)?;
        let models: Vec<String> = v
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        (!models.is_empty()).then_some(models)
    };
    from(&pod.metadata.annotations, &cfg.models_annotation)
        .or_else(|| from(&pod.metadata.labels, &cfg.models_label))
}

/// The selector and target ports of an InferencePool (`spec.selector.matchLabels`,
/// `spec.targetPorts[].number`); `None` when it selects nothing usable.
fn pool_target(name: &str, pool: &DynamicObject) -> Option<Target> {
    let spec = pool.data.get("spec")?;
    let labels = spec.get("selector")?.get("matchLabels")?.as_object()?;
    let mut pairs: Vec<String> = labels
        .iter()
        .filter_map(|(k, v)| Some(format!("{k}={}", v.as_str()?)))
        .collect();
    pairs.sort();
    let ports: Vec<u16> = spec
        .get("targetPorts")?
        .as_array()?
        .iter()
        .filter_map(|p| p.get("number")?.as_u64()?.try_into().ok())
        .filter(|p: &u16| *p > 0)
        .collect();
    if pairs.is_empty() || ports.is_empty() {
        warn!(
            pool = name,
            "InferencePool has no matchLabels or no targetPorts; no candidates"
        );
        return None;
    }
    Some(Target {
        selector: pairs.join(","),
        ports: Ports::Numbers(ports),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> KubePod {
        serde_json::from_value(v).unwrap()
    }

    fn ready_pod(ip: &str) -> serde_json::Value {
        json!({
            "metadata": {"name": "p", "labels": {"app": "vllm", "model": "m1"},
                         "annotations": {"kv-router.io/models": "Qwen/Qwen3-8B, lora-a"}},
            "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": 8123}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
        })
    }

    fn target(ports: Ports) -> Target {
        Target {
            selector: "app=vllm".into(),
            ports,
        }
    }

    #[test]
    fn role_from_the_configured_label() {
        let t = target(Ports::Numbers(vec![8000]));
        let mut p = ready_pod("10.0.0.5");
        let cfg = KubernetesConfig::default();
        assert_eq!(member(&pod(p.clone()), &t, &cfg, &[]).unwrap().role, None);
        p["metadata"]["labels"]["llm-d.ai/role"] = json!("prefill");
        let m = member(&pod(p.clone()), &t, &cfg, &[]).unwrap();
        assert_eq!(m.role, Some(crate::pods::PodRole::Prefill));
        p["metadata"]["labels"]["pd"] = json!("decode");
        let custom = KubernetesConfig {
            role_label: "pd".into(),
            ..Default::default()
        };
        let m = member(&pod(p.clone()), &t, &custom, &[]).unwrap();
        assert_eq!(m.role, Some(crate::pods::PodRole::Decode));
        p["metadata"]["labels"]["pd"] = json!("everything");
        assert_eq!(member(&pod(p), &t, &custom, &[]).unwrap().role, None);
    }

    #[test]
    fn only_ready_running_pods_with_an_ip_qualify() {
        let cfg = KubernetesConfig::default();
        let t = target(Ports::Numbers(vec![8000]));
        let m = member(&pod(ready_pod("10.0.0.5")), &t, &cfg, &[]).unwrap();
        assert_eq!(m.ip.to_string(), "10.0.0.5");
        assert_eq!(m.ports, vec![8000]);
        let mut not_ready = ready_pod("10.0.0.5");
        not_ready["status"]["conditions"][0]["status"] = json!("False");
        assert!(member(&pod(not_ready), &t, &cfg, &[]).is_none());
        let mut terminating = ready_pod("10.0.0.5");
        terminating["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        assert!(member(&pod(terminating), &t, &cfg, &[]).is_none());
        let mut no_ip = ready_pod("10.0.0.5");
        no_ip["status"].as_object_mut().unwrap().remove("podIP");
        assert!(member(&pod(no_ip), &t, &cfg, &[]).is_none());
        assert!(member(&pod(ready_pod("not-an-ip")), &t, &cfg, &[]).is_none());
    }

    #[test]
    fn named_ports_resolve_per_pod() {
        let cfg = KubernetesConfig::default();
        let m = member(
            &pod(ready_pod("10.0.0.5")),
            &target(Ports::Named("http".into())),
            &cfg,
            &[],
        )
        .unwrap();
        assert_eq!(m.ports, vec![8123]);
        assert!(member(
            &pod(ready_pod("10.0.0.5")),
            &target(Ports::Named("grpc".into())),
            &cfg,
            &[]
        )
        .is_none());
    }

    #[test]
    fn models_from_annotation_then_label_then_config() {
        let t = target(Ports::Numbers(vec![8000]));
        let p = pod(ready_pod("10.0.0.5"));
        let cfg = KubernetesConfig {
            models_annotation: "kv-router.io/models".into(),
            models_label: "model".into(),
            ..Default::default()
        };
        assert_eq!(
            member(&p, &t, &cfg, &[]).unwrap().models,
            vec!["Qwen/Qwen3-8B", "lora-a"]
        );
        let cfg = KubernetesConfig {
            models_label: "model".into(),
            ..Default::default()
        };
        assert_eq!(member(&p, &t, &cfg, &[]).unwrap().models, vec!["m1"]);
        let cfg = KubernetesConfig::default();
        assert_eq!(
            member(&p, &t, &cfg, &["cfg".into()]).unwrap().models,
            vec!["cfg"]
        );
    }

    #[test]
    fn engine_from_annotation_then_label() {
        let t = target(Ports::Numbers(vec![8000]));
        let cfg = KubernetesConfig::default();
        let mut p = ready_pod("10.0.0.5");
        assert_eq!(member(&pod(p.clone()), &t, &cfg, &[]).unwrap().engine, None);
        p["metadata"]["labels"][ENGINE_LABEL] = json!("sglang");
        assert_eq!(
            member(&pod(p.clone()), &t, &cfg, &[])
                .unwrap()
                .engine
                .as_deref(),
            Some("sglang")
        );
        p["metadata"]["annotations"][ENGINE_LABEL] = json!("tgi");
        assert_eq!(
            member(&pod(p), &t, &cfg, &[]).unwrap().engine.as_deref(),
            Some("tgi")
        );
    }

    #[test]
    fn pool_spec_gives_selector_and_ports() {
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "pool"},
            "spec": {"selector": {"matchLabels": {"tier": "gpu", "app": "vllm"}},
                     "targetPorts": [{"number": 8000}, {"number": 8001}]}
        }))
        .unwrap();
        assert_eq!(
            pool_target("pool", &obj),
            Some(Target {
                selector: "app=vllm,tier=gpu".into(),
                ports: Ports::Numbers(vec![8000, 8001])
            })
        );
        let empty: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "pool"},
            "spec": {"selector": {}, "targetPorts": [{"number": 8000}]}
        }))
        .unwrap();
        assert_eq!(pool_target("pool", &empty), None);
    }

    #[test]
    fn rbac_is_list_and_watch_only() {
        let mut cfg = KubernetesConfig {
            selector: "app=vllm".into(),
            ..Default::default()
        };
        let off = FlowConfig::default();
        let on = FlowConfig {
            enabled: true,
            trust_client_headers: true,
            ..Default::default()
        };
        let rules = required_rbac(&cfg, &on);
        assert_eq!(rules.len(), 1, "no pool: no objectives");
        assert_eq!(rules[0].verbs, vec!["list", "watch"]);
        cfg.pool = Some(crate::config::PoolRef {
            name: "p".into(),
            namespace: String::new(),
        });
        let rules = required_rbac(&cfg, &off);
        assert_eq!(rules.len(), 2);
        assert_eq!(rules[1].resource, "inferencepools");
        assert_eq!(rules[1].resource_names, vec!["p"]);
        let rules = required_rbac(&cfg, &on);
        assert_eq!(rules[2].api_group, "llm-d.ai");
        assert_eq!(rules[2].resource, "inferenceobjectives");
        assert_eq!(rules[2].verbs, vec!["list", "watch"]);
        assert!(rules[2].resource_names.is_empty());
        let legacy = FlowConfig {
            objective_api: "inference.networking.x-k8s.io/v1alpha2".into(),
            ..on
        };
        assert_eq!(
            required_rbac(&cfg, &legacy)[2].api_group,
            "inference.networking.x-k8s.io"
        );
    }
}
