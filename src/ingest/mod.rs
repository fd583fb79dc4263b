//! KV-event ingestion, the service of precise mode: keeps one subscription per (pod, DP rank)
//! while KV events are enabled, decodes each delivery, applies it to the index strictly in order
//! per (pod, rank) (different pods run in parallel) and counts what happened in its own metric
//! families. A pod that leaves loses its subscriptions and its series; a subscription that dies
//! is restarted and counted.

mod catch_up;
mod metrics;
mod subscriber;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::task::JoinHandle;
use tokio::time::{interval, MissedTickBehavior};
use tracing::{debug, info, warn};

use crate::config::KvEventsConfig;
use crate::events::decode_batch;
use crate::index::KvIndex;
use crate::pods::{Pod, PodId, PodRegistry};
pub(crate) use catch_up::CatchUp;
use metrics::DecodeErrorType;
pub(crate) use metrics::IngestMetrics;
use subscriber::{Delivery, SubscriberHandle, SubscriptionSpec};

/// How often the subscription set is checked besides pod-set changes (restarts of ended ones).
const RECONCILE_EVERY: Duration = Duration::from_millis(500);
/// A subscription that ended is started again no sooner than this after its last start.
const RESTART_AFTER: Duration = Duration::from_secs(2);

/// Resolves a pod's endpoints for rank `rank` from its overrides or the config templates.
fn subscription_for(cfg: &KvEventsConfig, pod: &Pod, rank: u32) -> SubscriptionSpec {
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
        // Checked: config validation refuses a last rank past 65535, a template port may not.
        Some((head, port)) => match port
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .and_then(|p| u16::try_from(rank).ok()?.checked_add(p))
        {
            Some(p) => format!("{head}:{p}"),
            None => endpoint.to_string(),
        },
        None => endpoint.to_string(),
    }
}

struct Running {
    spec: SubscriptionSpec,
    _handle: SubscriberHandle,
    task: JoinHandle<()>,
    started: Instant,
}

/// Runs the subscription set until the process ends; `catch_up` learns when each start-up
/// catch-up ends (readiness waits for them).
pub(crate) async fn run(
    cfg: KvEventsConfig,
    pods: Arc<PodRegistry>,
    index: Arc<dyn KvIndex>,
    metrics: Arc<IngestMetrics>,
    catch_up: Arc<CatchUp>,
) {
    let mut running: HashMap<(PodId, u32), Running> = HashMap::new();
    let mut tick = interval(RECONCILE_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut changed = pods.watch();
    loop {
        // At once when the pod set changes; the tick restarts subscriptions that ended.
        tokio::select! {
            _ = tick.tick() => {}
            Ok(()) = changed.changed() => {}
        }
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
        stop_unwanted(&mut running, &wanted, &metrics, &catch_up).await;
        for (key, (pod, spec)) in wanted {
            if running.contains_key(&key) {
                continue;
            }
            let name = format!("{}#{}", key.0, key.1);
            match subscriber::spawn(spec.clone(), name) {
                Ok((handle, rx)) => {
                    info!(pod = %key.0, rank = key.1, endpoint = %spec.endpoint, "KV-event subscription started");
                    metrics.init_pod(key.0.as_str());
                    catch_up.started(&key.0, key.1, spec.replay_endpoint.is_some());
                    let task = tokio::spawn(apply_loop(
                        pod,
                        key.1,
                        rx,
                        index.clone(),
                        metrics.clone(),
                        catch_up.clone(),
                    ));
                    running.insert(
                        key,
                        Running {
                            spec,
                            _handle: handle,
                            task,
                            started: Instant::now(),
                        },
                    );
                }
                Err(e) => {
                    warn!(pod = %key.0, error = %e, "cannot start KV-event subscriber thread");
                    // No catch-up is coming: readiness must not wait for one.
                    catch_up.started(&key.0, key.1, false);
                }
            }
        }
    }
}

/// Stops subscriptions no longer wanted (pod gone, endpoint changed) and drops the series of
/// pods that left; forgets subscriptions that ended on their own so they start again.
async fn stop_unwanted(
    running: &mut HashMap<(PodId, u32), Running>,
    wanted: &HashMap<(PodId, u32), (Arc<Pod>, SubscriptionSpec)>,
    metrics: &IngestMetrics,
    catch_up: &CatchUp,
) {
    let mut stop = Vec::new();
    for (key, r) in running.iter() {
        if wanted.get(key).is_none_or(|(_, spec)| *spec != r.spec) {
            info!(pod = %key.0, rank = key.1, "KV-event subscription stopped");
            catch_up.stopped(&key.0, key.1);
            stop.push(key.clone());
        } else if r.task.is_finished() && r.started.elapsed() >= RESTART_AFTER {
            warn!(pod = %key.0, rank = key.1, "KV-event subscription ended; restarting it");
            metrics.restarted(key.0.as_str());
            stop.push(key.clone());
        }
    }
    let mut left = Vec::new();
    for key in stop {
        let Some(r) = running.remove(&key) else {
            continue;
        };
        r.task.abort();
        // Wait for the cancellation so no late increment recreates a dropped series.
        let _ = r.task.await;
        if !wanted.keys().any(|(pod, _)| *pod == key.0) {
            left.push(key.0);
        }
    }
    for pod in left {
        if !running.keys().any(|(p, _)| *p == pod) {
            metrics.forget_pod(pod.as_str());
        }
    }
}

async fn apply_loop(
    pod: Arc<Pod>,
    rank: u32,
    mut rx: tokio::sync::mpsc::Receiver<Delivery>,
    index: Arc<dyn KvIndex>,
    metrics: Arc<IngestMetrics>,
    catch_up: Arc<CatchUp>,
) {
    let id = pod.id().clone();
    let label = id.as_str();
    while let Some(d) = rx.recv().await {
        match d {
            Delivery::Batch {
                seq,
                payload,
                replayed,
            } => {
                let batch = match decode_batch(&payload) {
                    Ok(b) => b,
                    Err(e) => {
                        debug!(pod = %id, rank, seq, replayed, error = %e, "undecodable KV-event batch");
                        metrics.decode_error(label, DecodeErrorType::from(&e));
                        continue;
                    }
                };
                // Keys of blocks without a LoRA name are seeded with the pod's (first) model.
                let model = pod.models().into_iter().next().unwrap_or_default();
                match index.apply_events(&id, rank, &model, &batch).await {
                    Ok(stats) => {
                        metrics.applied(label, &batch.events, &stats);
                        let now = SystemTime::now()
                            .duration_since(UNIX_EPOCH)
                            .map(|d| d.as_secs_f64())
                            .unwrap_or(0.0);
                        // A replayed batch (catch-up, gap) is old by design, not late.
                        if !replayed && batch.ts > 0.0 && now >= batch.ts {
                            metrics.lag(now - batch.ts);
                        }
                    }
                    Err(e) => {
                        warn!(pod = %id, error = %e, retryable = e.retryable(), "applying KV events failed");
                        metrics.apply_error(label);
                    }
                }
            }
            Delivery::Purge(reason) => {
                info!(pod = %id, rank, ?reason, "purging the pod's KV-event state");
                metrics.purged(label, reason);
                if let Err(e) = index.forget_rank(&id, rank).await {
                    warn!(pod = %id, error = %e, "purge failed");
                    metrics.apply_error(label);
                }
            }
            Delivery::GapSeen => metrics.gap(label),
            Delivery::Replay { complete } => {
                metrics.replay(label, complete);
                // The subscription's first replay is its catch-up (later ones heal gaps).
                catch_up.finished(&id, rank);
            }
            Delivery::BadFrames => metrics.decode_error(label, DecodeErrorType::Frames),
        }
    }
    catch_up.finished(&id, rank);
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::blocks::{namespace_seed, token_keys};
    use crate::events::{encode_batch, BlockHash, KvEvent, KvEventBatch};
    use crate::index::{EventIndex, EventIndexConfig};
    use crate::pods::PodSpec;

    #[test]
    fn ports_offset_by_rank() {
        assert_eq!(offset_port("tcp://10.0.0.5:5557", 0), "tcp://10.0.0.5:5557");
        assert_eq!(offset_port("tcp://10.0.0.5:5557", 2), "tcp://10.0.0.5:5559");
        assert_eq!(offset_port("tcp://10.0.0.5:0", 2), "tcp://10.0.0.5:0");
        assert_eq!(offset_port("ipc:///tmp/x", 1), "ipc:///tmp/x");
        // Past the last port there is no rank endpoint: never a wrapped or invalid port.
        assert_eq!(offset_port("tcp://h:65535", 1), "tcp://h:65535");
        assert_eq!(offset_port("tcp://h:4294967295", 1), "tcp://h:4294967295");
    }

    fn spec(id: &str, endpoint: String) -> PodSpec {
        PodSpec {
            id: PodId::new(id),
            addr: id.parse().unwrap(),
            models: vec!["m".into()],
            labels: Default::default(),
            kv_events_endpoint: Some(endpoint),
            kv_events_replay_endpoint: None,
        }
    }

    /// The ingest service with a real index and metrics, on `pods`.
    fn start(pods: &Arc<PodRegistry>) -> (Arc<EventIndex>, Arc<Registry>) {
        let mut registry = Registry::default();
        let metrics = Arc::new(IngestMetrics::register(&mut registry));
        let index = Arc::new(EventIndex::new(EventIndexConfig {
            block_tokens: 4,
            ..EventIndexConfig::default()
        }));
        tokio::spawn(run(
            KvEventsConfig::default(),
            pods.clone(),
            index.clone(),
            metrics,
            Arc::new(CatchUp::default()),
        ));
        (index, Arc::new(registry))
    }

    fn text(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    /// The value of the series `name{labels}` (0 when absent: series start at zero).
    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// Polls `cond` on the metrics text for up to 10 s.
    async fn wait_for(registry: &Registry, what: &str, cond: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let t = text(registry);
            if cond(&t) {
                return;
            }
            assert!(Instant::now() < deadline, "{what} never happened:\n{t}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn applies_a_pods_events_and_drops_its_series_when_it_leaves() {
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB).unwrap();
        // An ephemeral port bound here: probing for a free one first races other tests.
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
        let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
        let pods = Arc::new(PodRegistry::default());
        let id = "127.0.0.1:9";
        pods.update(vec![spec(id, format!("tcp://127.0.0.1:{port}"))]);
        let (index, registry) = start(&pods);
        let tokens: Vec<u32> = (0..8).collect();
        let stored = encode_batch(&KvEventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored {
                block_hashes: vec![BlockHash::Int(1), BlockHash::Int(2)],
                parent_block_hash: None,
                token_ids: tokens.clone(),
                block_size: 4,
                lora_id: None,
                medium: None,
                lora_name: None,
                extra_keys: None,
                group_idx: None,
                kv_cache_spec_kind: None,
                kv_cache_spec_sliding_window: None,
            }],
            data_parallel_rank: Some(0),
        });
        // Publish until the subscriber has joined and applied (ZMQ drops messages before that).
        let applied =
            format!(r#"kv_router_kv_events_applied_total{{pod="{id}",type="BlockStored"}}"#);
        let mut seq = 0u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        while value(&text(&registry), &applied) == 0.0 {
            assert!(Instant::now() < deadline, "no batch applied");
            let payload = if seq.is_multiple_of(2) {
                stored.clone()
            } else {
                b"\xc1".to_vec()
            };
            publisher
                .send_multipart([b"kv".to_vec(), seq.to_be_bytes().to_vec(), payload], 0)
                .unwrap();
            seq += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let keys = token_keys(namespace_seed("m", None), &tokens, 4, 8);
        assert_eq!(
            index.lookup(&keys, &[PodId::new(id)], 0).await.unwrap(),
            vec![2.0]
        );
        wait_for(&registry, "a decode error", |t| {
            let prefix = format!(r#"kv_router_kv_event_decode_errors_total{{pod="{id}","#);
            t.lines()
                .filter(|l| l.starts_with(&prefix))
                .any(|l| !l.ends_with(" 0"))
        })
        .await;
        assert!(
            value(
                &text(&registry),
                &format!(r#"kv_router_kv_event_blocks_total{{pod="{id}",type="stored"}}"#)
            ) > 0.0,
            "ApplyStats reach the metrics"
        );
        pods.update(Vec::new());
        wait_for(&registry, "dropping the departed pod's series", |t| {
            !t.contains(id)
        })
        .await;
    }

    #[tokio::test]
    async fn a_subscription_that_dies_is_restarted_and_counted() {
        let pods = Arc::new(PodRegistry::default());
        let id = "127.0.0.1:10";
        // libzmq refuses the transport: the subscriber thread ends at once.
        pods.update(vec![spec(id, "bogus://nowhere".into())]);
        let (_index, registry) = start(&pods);
        wait_for(&registry, "a restart", |t| {
            t.contains(&format!(
                r#"kv_router_kv_event_subscription_restarts_total{{pod="{id}"}}"#
            ))
        })
        .await;
    }
}
