//! The watch of the pool namespace's InferenceObjectives (`flow_control.objective_api`): list +
//! watch (kube-rs' `watcher`, resumed, relisted on 410, backed off on errors) of every object of
//! the kind, since a `spec.poolRef` cannot be selected server-side; [`Watched`] keeps the ones
//! naming the pool. A list is gathered whole, then swapped in, so a relist forgets deleted ones.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use tracing::{info, warn};

use crate::flow::objectives::MAX_WATCHED;
use crate::flow::{Objective, Watched};
use crate::telemetry::{ErrorKind, Errors};

/// Plural of InferenceObjective (the same in both groups).
pub const OBJECTIVES_RESOURCE: &str = "inferenceobjectives";

/// Where and what to watch.
pub(super) struct ObjectiveWatch {
    pub client: kube::Client,
    pub namespace: String,
    pub pool: String,
    pub group: String,
    pub version: String,
    pub watched: Arc<Watched>,
    pub errors: Option<Errors>,
}

fn read(o: &DynamicObject, pool: &str) -> Option<Objective> {
    let name = o.metadata.name.as_deref()?;
    Some(Objective::from_spec(name, o.data.get("spec"), pool))
}

/// Runs forever (restarts the stream should it ever end).
pub(super) async fn run(w: ObjectiveWatch) {
    let gvk = GroupVersionKind::gvk(&w.group, &w.version, "InferenceObjective");
    let ar = ApiResource::from_gvk_with_plural(&gvk, OBJECTIVES_RESOURCE);
    info!(
        api = %format!("{}/{}", w.group, w.version),
        namespace = %w.namespace,
        pool = %w.pool,
        "watching InferenceObjectives for request priorities"
    );
    loop {
        let api: Api<DynamicObject> = Api::namespaced_with(w.client.clone(), &w.namespace, &ar);
        let wc = watcher::Config::default().any_semantic();
        let mut events = watcher::watcher(api, wc).default_backoff().boxed();
        let mut buffer: Option<Vec<Objective>> = None;
        while let Some(ev) = events.next().await {
            match ev {
                Ok(Event::Init) => buffer = Some(Vec::new()),
                Ok(Event::InitApply(o)) => {
                    let (Some(buf), Some(obj)) = (buffer.as_mut(), read(&o, &w.pool)) else {
                        continue;
                    };
                    if !obj.for_pool {
                        continue;
                    }
                    // Bounded while gathered too.
                    if buf.len() < MAX_WATCHED {
                        buf.push(obj);
                    } else {
                        w.watched.dropped();
                    }
                }
                Ok(Event::InitDone) => {
                    let objs = buffer.take().unwrap_or_default();
                    w.watched.replace(&objs);
                    info!(
                        objectives = w.watched.len(),
                        "InferenceObjective list synced"
                    );
                }
                Ok(Event::Apply(o)) => {
                    if let Some(obj) = read(&o, &w.pool) {
                        w.watched.apply(&obj);
                    }
                }
                Ok(Event::Delete(o)) => {
                    if let Some(name) = &o.metadata.name {
                        w.watched.delete(name);
                    }
                }
                Err(watcher::Error::WatchError(s)) if s.code == 410 => {
                    info!("InferenceObjective watch expired (410 Gone); relisting")
                }
                Err(e) => {
                    if let Some(m) = &w.errors {
                        m.inc(ErrorKind::KubernetesWatch);
                    }
                    // A 404 here: the CRD of this group/version is not installed.
                    warn!(error = %e, api = %format!("{}/{}", w.group, w.version),
                        "InferenceObjective watch failed (is the CRD installed? flow_control.objective_api names which); retrying with backoff");
                }
            }
        }
        warn!("InferenceObjective watch ended; restarting");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
