//! Keeps one subscription per (pod, DP rank) while KV events are enabled, and applies each
//! (pod, rank)'s deliveries to the index strictly in order; different pods run in parallel.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::task::JoinHandle;
use tokio::time::{interval, MissedTickBehavior};
use tracing::{debug, info, warn};

use super::subscriber::{self, Delivery, SubscriberHandle, SubscriptionSpec};
use super::{decode_batch, KvEvent};
use crate::config::KvEventsConfig;
use crate::index::KvIndex;
use crate::pods::{Pod, PodId, PodRegistry};
use crate::telemetry::{Metrics, PodLabels, PodTypeLabels};

/// Resolves a pod's endpoints for rank `rank` from its overrides or the config templates.
pub fn subscription_for(cfg: &KvEventsConfig, pod: &Pod, rank: u32) -> SubscriptionSpec {
    let fill = |template: &str| -> String {
        let t = template
            .replace("{ip}", &pod.spec.addr.ip().to_string())
            .replace("{port}", &pod.spec.addr.port().to_string());
        offset_port(&t, rank)
    };
    let endpoint = fill(
        pod.spec
            .kv_events_endpoint
            .as_deref()
            .unwrap_or(&cfg.endpoint),
    );
    let replay = pod
        .spec
        .kv_events_replay_endpoint
        .clone()
        .unwrap_or_else(|| cfg.replay_endpoint.clone());
    SubscriptionSpec {
        endpoint,
        replay_endpoint: (!replay.is_empty()).then(|| fill(&replay)),
        topic: cfg.topic.clone(),
    }
}

/// vLLM's data-parallel convention: rank r uses tcp port + r (port 0 left alone).
fn offset_port(endpoint: &str, rank: u32) -> String {
    if rank == 0 || !endpoint.starts_with("tcp://") {
        return endpoint.to_string();
    }
    match endpoint.rsplit_once(':') {
        Some((head, port)) => match port.parse::<u32>() {
            Ok(p) if p != 0 => format!("{head}:{}", p + rank),
            _ => endpoint.to_string(),
        },
        None => endpoint.to_string(),
    }
}

struct Running {
    spec: SubscriptionSpec,
    _handle: SubscriberHandle,
    task: JoinHandle<()>,
}

/// Runs the subscription set until the process ends.
pub async fn run(
    cfg: KvEventsConfig,
    pods: Arc<PodRegistry>,
    index: Arc<dyn KvIndex>,
    metrics: Arc<Metrics>,
) {
    let mut running: HashMap<(PodId, u32), Running> = HashMap::new();
    let mut tick = interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let snapshot = pods.snapshot();
        let mut wanted = HashMap::new();
        for pod in snapshot.pods() {
            for rank in 0..cfg.data_parallel_size {
                wanted.insert(
                    (pod.id().clone(), rank),
                    (pod.clone(), subscription_for(&cfg, pod, rank)),
                );
            }
        }
        running.retain(|key, r| {
            let keep = wanted.get(key).is_some_and(|(_, spec)| *spec == r.spec);
            if !keep {
                r.task.abort();
                info!(pod = %key.0, rank = key.1, "KV-event subscription stopped");
            }
            keep
        });
        for (key, (pod, spec)) in wanted {
            if running.contains_key(&key) {
                continue;
            }
            let name = format!("{}#{}", key.0, key.1);
            match subscriber::spawn(spec.clone(), name) {
                Ok((handle, rx)) => {
                    info!(pod = %key.0, rank = key.1, endpoint = %spec.endpoint, "KV-event subscription started");
                    let task =
                        tokio::spawn(apply_loop(pod, key.1, rx, index.clone(), metrics.clone()));
                    running.insert(
                        key,
                        Running {
                            spec,
                            _handle: handle,
                            task,
                        },
                    );
                }
                Err(e) => {
                    warn!(pod = %key.0, error = %e, "cannot start KV-event subscriber thread")
                }
            }
        }
    }
}

async fn apply_loop(
    pod: Arc<Pod>,
    rank: u32,
    mut rx: tokio::sync::mpsc::Receiver<Delivery>,
    index: Arc<dyn KvIndex>,
    metrics: Arc<Metrics>,
) {
    let id = pod.id().clone();
    let label = |t: &'static str| PodTypeLabels {
        pod: id.to_string(),
        r#type: t,
    };
    while let Some(d) = rx.recv().await {
        match d {
            Delivery::Batch { payload, .. } => {
                let batch = match decode_batch(&payload) {
                    Ok(b) => b,
                    Err(e) => {
                        debug!(pod = %id, error = %e, "undecodable KV-event batch");
                        metrics
                            .event_decode_errors
                            .get_or_create(&label(e.kind()))
                            .inc();
                        continue;
                    }
                };
                // Keys of blocks without a LoRA name are seeded with the pod's (first) model.
                let model = pod.models().into_iter().next().unwrap_or_default();
                match index.apply_events(&id, rank, &model, &batch).await {
                    Ok(_) => {
                        for e in &batch.events {
                            let t = match e {
                                KvEvent::BlockStored { .. } => "BlockStored",
                                KvEvent::BlockRemoved { .. } => "BlockRemoved",
                                KvEvent::AllBlocksCleared => "AllBlocksCleared",
                            };
                            metrics.events_applied.get_or_create(&label(t)).inc();
                            if t == "AllBlocksCleared" {
                                metrics.event_purges.get_or_create(&label("cleared")).inc();
                            }
                        }
                        let now = SystemTime::now()
                            .duration_since(UNIX_EPOCH)
                            .map(|d| d.as_secs_f64())
                            .unwrap_or(0.0);
                        if batch.ts > 0.0 && now >= batch.ts {
                            metrics.event_lag.observe(now - batch.ts);
                        }
                    }
                    Err(e) => {
                        warn!(pod = %id, error = %e, "applying KV events failed");
                        metrics.error(crate::telemetry::ErrorKind::Index);
                    }
                }
            }
            Delivery::Purge(reason) => {
                info!(pod = %id, rank, reason = reason.as_str(), "purging the pod's KV-event state");
                metrics
                    .event_purges
                    .get_or_create(&label(reason.as_str()))
                    .inc();
                if let Err(e) = index.forget_rank(&id, rank).await {
                    warn!(pod = %id, error = %e, "purge failed");
                }
            }
            Delivery::GapSeen => {
                metrics
                    .event_gaps
                    .get_or_create(&PodLabels {
                        pod: id.to_string(),
                    })
                    .inc();
            }
            Delivery::Replay { complete } => {
                metrics
                    .event_replays
                    .get_or_create(&label(if complete { "complete" } else { "failed" }))
                    .inc();
            }
            Delivery::BadFrames => {
                metrics
                    .event_decode_errors
                    .get_or_create(&label("frames"))
                    .inc();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_offset_by_rank() {
        assert_eq!(offset_port("tcp://10.0.0.5:5557", 0), "tcp://10.0.0.5:5557");
        assert_eq!(offset_port("tcp://10.0.0.5:5557", 2), "tcp://10.0.0.5:5559");
        assert_eq!(offset_port("tcp://10.0.0.5:0", 2), "tcp://10.0.0.5:0");
        assert_eq!(offset_port("ipc:///tmp/x", 1), "ipc:///tmp/x");
    }
}
