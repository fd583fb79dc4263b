//! The prefix index and the session store (shared through Redis with `backend: redis`), and in
//! precise mode the KV-event ingestion that feeds the index.

use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::config::{Config, IndexBackend};
use crate::index::{build_index_among, KvIndex, MembersFeed, PodMembers, RedisMetrics};
use crate::ingest::{self, CatchUp, IngestMetrics};
use crate::pods::PodRegistry;
use crate::scoring::SessionStore;
use crate::share::LoadShare;
use crate::supervise::Supervisor;

/// The index, its replica load sharing and the session store.
type Built = (Arc<dyn KvIndex>, Arc<dyn LoadShare>, Arc<SessionStore>);

/// Builds the index, its replica load sharing and the session store; a shared index's mirror
/// keeps records for the pods in `members` only. Fails only on a Redis setting that cannot work.
pub(super) fn build(
    cfg: &Config,
    redis: Option<RedisMetrics>,
    members: PodMembers,
) -> anyhow::Result<Built> {
    let built = build_index_among(&cfg.index, &cfg.kv_events, &cfg.blocks, redis, members)?;
    let mut sessions = SessionStore::new(cfg.scorers.session.capacity, cfg.scorers.session.ttl_ms);
    if let Some(shared) = built.sessions {
        let budget = Duration::from_millis(cfg.index.redis.lookup_budget_ms);
        sessions = sessions.with_shared(shared, budget);
    }
    Ok((built.index, built.share, Arc::new(sessions)))
}

/// Precise mode: starts the `kv_events` loop and returns the start-up catch-ups readiness waits
/// for; `None` when KV events are off.
pub(super) fn start_ingestion(
    cfg: &Config,
    supervisor: &Supervisor,
    pods: &Arc<PodRegistry>,
    index: &Arc<dyn KvIndex>,
    metrics: Arc<IngestMetrics>,
) -> Option<Arc<CatchUp>> {
    let catch_up = cfg.kv_events.enabled.then(|| Arc::new(CatchUp::default()));
    if let Some(catch_up) = &catch_up {
        for model in cfg.tokenizers.iter().map(|t| t.model.as_str()) {
            info!(model, "precise keys (tokenizer configured)");
        }
        if cfg.tokenizers.is_empty() {
            warn!("KV events are on but no tokenizer is configured: request keys stay approximate and only speculative entries can match");
        }
        let (ev, pods, index) = (cfg.kv_events.clone(), pods.clone(), index.clone());
        let catch_up = catch_up.clone();
        supervisor.spawn("kv_events", move || {
            ingest::run(
                ev.clone(),
                pods.clone(),
                index.clone(),
                metrics.clone(),
                catch_up.clone(),
            )
        });
    }
    catch_up
}

/// With `backend: redis`, starts the `pod_members` loop: every change of the registry's pod set
/// goes to the shared index's mirror through `feed`.
pub(super) fn follow_pods(
    cfg: &Config,
    supervisor: &Supervisor,
    pods: &Arc<PodRegistry>,
    feed: MembersFeed,
) {
    if !matches!(cfg.index.backend, IndexBackend::Redis) {
        return;
    }
    let pods = pods.clone();
    supervisor.spawn("pod_members", move || {
        let (pods, feed) = (pods.clone(), feed.clone());
        async move {
            let mut changed = pods.watch();
            loop {
                // Generation 0: the sources have not listed anything yet.
                if *changed.borrow_and_update() > 0 {
                    feed.list(pods.snapshot().pods().iter().map(|p| p.id().clone()));
                }
                if changed.changed().await.is_err() {
                    return;
                }
            }
        }
    });
}
