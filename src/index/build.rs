//! The index a configuration asks for, and how much of it each pod may fill: the one place that
//! turns `Config` into an index, used by the router (`app`) and `kv-bench simulate` alike.

use std::sync::Arc;

use super::{
    EventIndex, EventIndexConfig, KvIndex, Local, MemoryIndex, RedisIndex, RedisMetrics, Tuning,
};
use crate::config::{Config, IndexBackend};
use crate::scoring::SharedSessions;

/// An index and, when it is shared between replicas, the session map shared with it.
pub struct BuiltIndex {
    /// The index.
    pub index: Arc<dyn KvIndex>,
    /// Sessions shared through the same backend (`backend: redis`).
    pub sessions: Option<Arc<dyn SharedSessions>>,
}

/// The router's index for `cfg`: fed by KV events when they are enabled, else learned from the
/// router's own decisions; shared through Redis with `backend: redis`, whose metric families
/// go to `metrics` (unregistered when `None`). Fails only on a Redis setting that cannot work
/// (an unreadable password file, a malformed URL). Must run inside a tokio runtime.
pub fn build_index(cfg: &Config, metrics: Option<RedisMetrics>) -> anyhow::Result<BuiltIndex> {
    // A new backend must say here how it is built.
    Ok(match cfg.index.backend {
        IndexBackend::Memory => BuiltIndex {
            index: match local_index(cfg) {
                Local::Memory(m) => Arc::new(m),
                Local::Events(e) => Arc::new(e),
            },
            sessions: None,
        },
        IndexBackend::Redis => {
            let tuning = Tuning {
                record_ttl_ms: if cfg.kv_events.enabled {
                    cfg.kv_events.speculative_ttl_ms
                } else {
                    cfg.index.ttl_ms
                },
                default_capacity: if cfg.kv_events.enabled {
                    EventIndexConfig::default().speculative_capacity
                } else {
                    cfg.index.default_capacity_blocks
                },
                gpu_weight: cfg.kv_events.gpu_weight,
                cpu_weight: cfg.kv_events.cpu_weight,
            };
            let metrics = metrics.unwrap_or_else(RedisMetrics::unregistered);
            let index = RedisIndex::new(&cfg.index.redis, local_index(cfg), tuning, metrics)
                .map_err(anyhow::Error::msg)?;
            BuiltIndex {
                sessions: Some(index.sessions()),
                index: Arc::new(index),
            }
        }
    })
}

/// The in-process index for `cfg` (the whole index with `backend: memory`, the fallback with
/// `backend: redis`).
fn local_index(cfg: &Config) -> Local {
    if cfg.kv_events.enabled {
        Local::Events(EventIndex::new(EventIndexConfig {
            block_tokens: cfg.kv_events.block_tokens,
            max_blocks: cfg.blocks.max_blocks,
            gpu_weight: cfg.kv_events.gpu_weight,
            cpu_weight: cfg.kv_events.cpu_weight,
            speculative_ttl_ms: cfg.kv_events.speculative_ttl_ms,
            ..EventIndexConfig::default()
        }))
    } else {
        Local::Memory(MemoryIndex::new(
            cfg.index.ttl_ms,
            cfg.index.default_capacity_blocks,
        ))
    }
}

/// Index capacity (router blocks) of a pod whose KV cache holds `num_gpu_blocks` engine blocks
/// of `engine_block_tokens` tokens: its cache in router blocks (`size_chars` bytes ≈
/// `size_chars / 4` tokens), times `index.capacity_factor`.
pub fn index_capacity(cfg: &Config, num_gpu_blocks: u64, engine_block_tokens: u64) -> usize {
    let router_block = (cfg.blocks.size_chars / 4).max(1) as f64;
    (num_gpu_blocks as f64 * engine_block_tokens as f64 / router_block * cfg.index.capacity_factor)
        as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_the_pods_cache_in_router_blocks() {
        let mut cfg = Config::default();
        cfg.blocks.size_chars = 256;
        cfg.index.capacity_factor = 1.5;
        // 1000 blocks of 16 tokens = 16 000 tokens = 250 router blocks of 64 tokens, x 1.5.
        assert_eq!(index_capacity(&cfg, 1000, 16), 375);
    }
}
