//! The index a configuration asks for, and how much of it each pod may fill: the one place that
//! turns the configuration's `index`, `kv_events` and `blocks` sections into an index, used by
//! the router (`app`) and `kv-bench simulate` alike.

use std::sync::Arc;

use super::{
    EventIndex, EventIndexConfig, KvIndex, Local, MemoryIndex, PodMembers, RedisIndex,
    RedisMetrics, Tuning,
};
use crate::config::{BlocksConfig, IndexBackend, IndexConfig, KvEventsConfig};
use crate::scoring::SharedSessions;
use crate::share::{LoadShare, NoShare};

/// An index, how it shares load between replicas, and, when it is shared between replicas, the
/// session map shared with it.
pub struct BuiltIndex {
    /// The index.
    pub index: Arc<dyn KvIndex>,
    /// Replica load sharing: the Redis backend itself, [`NoShare`] for the in-process ones.
    pub share: Arc<dyn LoadShare>,
    /// Sessions shared through the same backend (`backend: redis`).
    pub sessions: Option<Arc<dyn SharedSessions>>,
}

/// The router's index for the `index` section: fed by KV events when `events` enables them,
/// else learned from the router's own decisions (keys of at most `blocks.max_blocks` blocks);
/// shared through Redis with `backend: redis`, whose metric families go to `metrics`
/// (unregistered when `None`). Fails only on a Redis setting that cannot work (an unreadable
/// password file, a malformed URL). Must run inside a tokio runtime. A Redis index's mirror keeps
/// records for every pod named to it: the router uses [`build_index_among`].
pub fn build_index(
    index: &IndexConfig,
    events: &KvEventsConfig,
    blocks: &BlocksConfig,
    metrics: Option<RedisMetrics>,
) -> anyhow::Result<BuiltIndex> {
    build_index_among(index, events, blocks, metrics, PodMembers::everyone())
}

/// [`build_index`], a Redis index's mirror keeping records only for the pods in `members` (the
/// router's pod set).
pub fn build_index_among(
    index: &IndexConfig,
    events: &KvEventsConfig,
    blocks: &BlocksConfig,
    metrics: Option<RedisMetrics>,
    members: PodMembers,
) -> anyhow::Result<BuiltIndex> {
    // A new backend must say here how it is built.
    Ok(match index.backend {
        IndexBackend::Memory => BuiltIndex {
            index: match local_index(index, events, blocks) {
                Local::Memory(m) => Arc::new(m),
                Local::Events(e) => Arc::new(e),
            },
            share: Arc::new(NoShare),
            sessions: None,
        },
        IndexBackend::Redis => {
            let tuning = Tuning {
                record_ttl_ms: if events.enabled {
                    events.speculative_ttl_ms
                } else {
                    index.ttl_ms
                },
                default_capacity: if events.enabled {
                    EventIndexConfig::default().speculative_capacity
                } else {
                    index.default_capacity_blocks
                },
                gpu_weight: events.gpu_weight,
                cpu_weight: events.cpu_weight,
            };
            let metrics = metrics.unwrap_or_else(RedisMetrics::unregistered);
            let local = local_index(index, events, blocks);
            let redis = Arc::new(
                RedisIndex::with_members(&index.redis, local, tuning, metrics, members)
                    .map_err(anyhow::Error::msg)?,
            );
            BuiltIndex {
                sessions: Some(redis.sessions()),
                share: redis.clone(),
                index: redis,
            }
        }
    })
}

/// The in-process index (the whole index with `backend: memory`, the fallback with
/// `backend: redis`).
fn local_index(index: &IndexConfig, events: &KvEventsConfig, blocks: &BlocksConfig) -> Local {
    if events.enabled {
        Local::Events(EventIndex::new(EventIndexConfig {
            block_tokens: events.block_tokens,
            max_blocks: blocks.max_blocks,
            gpu_weight: events.gpu_weight,
            cpu_weight: events.cpu_weight,
            speculative_ttl_ms: events.speculative_ttl_ms,
            ..EventIndexConfig::default()
        }))
    } else {
        Local::Memory(MemoryIndex::new(
            index.ttl_ms,
            index.default_capacity_blocks,
        ))
    }
}

/// Index capacity (router blocks) of a pod whose KV cache holds `num_gpu_blocks` engine blocks
/// of `engine_block_tokens` tokens (held to `index.max_pod_cache_tokens`): its cache in router
/// blocks (`size_chars` bytes ≈ `blocks.size_chars / 4` tokens), times `index.capacity_factor`.
pub fn index_capacity(
    index: &IndexConfig,
    blocks: &BlocksConfig,
    num_gpu_blocks: u64,
    engine_block_tokens: u64,
) -> usize {
    let (tokens, _) = index.pod_cache_tokens(num_gpu_blocks, engine_block_tokens);
    let router_block = (blocks.size_chars / 4).max(1) as f64;
    (tokens as f64 / router_block * index.capacity_factor) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_the_pods_cache_in_router_blocks() {
        let blocks = BlocksConfig {
            size_chars: 256,
            ..BlocksConfig::default()
        };
        let index = IndexConfig {
            capacity_factor: 1.5,
            ..IndexConfig::default()
        };
        // 1000 blocks of 16 tokens = 16 000 tokens = 250 router blocks of 64 tokens, x 1.5.
        assert_eq!(index_capacity(&index, &blocks, 1000, 16), 375);
    }

    #[test]
    fn a_reported_cache_past_the_maximum_is_held_to_it() {
        let index = IndexConfig {
            max_pod_cache_tokens: 64_000,
            ..IndexConfig::default()
        };
        let blocks = BlocksConfig::default();
        assert_eq!(index.pod_cache_tokens(4000, 16), (64_000, false));
        assert_eq!(index.pod_cache_tokens(4001, 16), (64_000, true));
        assert_eq!(index.pod_cache_tokens(u64::MAX, u64::MAX), (64_000, true));
        // 64 000 tokens in router blocks of 16 tokens.
        assert_eq!(index_capacity(&index, &blocks, 1 << 50, 16), 4000);
        assert_eq!(
            index_capacity(&index, &blocks, 16, 1 << 50),
            4000,
            "a block size too"
        );
    }
}
