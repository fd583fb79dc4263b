//! KV blocks computed by another pod (P/D disaggregation): a decode pod stores the prompt
//! blocks a prefill pod transferred, as vLLM's KV connector does, so its own prefill finds them
//! cached and computes only the rest.

use super::{annotate, BlockKey, Engine, Submission};

impl Engine {
    /// Full prompt blocks of `keys` already in this pod's prefix cache (a prefix).
    pub fn cached_blocks(&self, keys: &[BlockKey]) -> usize {
        self.cache.lookup(keys)
    }

    /// Stores the prompt's full blocks, transferred from a prefill pod, as unpinned cache
    /// entries (published as stored, like any new block). Returns the blocks newly stored.
    pub fn import(&mut self, sub: &Submission) -> usize {
        let bs = self.cfg.block_size;
        let hit = self.cache.lookup(&sub.keys);
        let keys = &sub.keys[hit..];
        let tokens = sub.tokens.get(hit * bs..).unwrap_or_default();
        let parent = hit.checked_sub(1).map(|i| sub.keys[i]);
        let start = self.events.len();
        let pinned = self.cache.insert(parent, keys, tokens, &mut self.events);
        if let Some(info) = &sub.vllm {
            annotate(&mut self.events[start..], &sub.keys, hit, info);
        }
        self.cache.release(&pinned);
        // A full cache may evict the hit prefix's own unpinned blocks while storing the rest.
        self.cache.lookup(&sub.keys).saturating_sub(hit)
    }
}

#[cfg(test)]
mod tests {
    use super::super::EngineConfig;
    use super::*;

    fn cfg() -> EngineConfig {
        EngineConfig {
            block_size: 4,
            ..EngineConfig::default()
        }
    }

    fn sub(seed: u64, len: u32, max_tokens: u32) -> Submission {
        Submission::new(seed, (0..len).collect(), max_tokens, 4)
    }

    #[test]
    fn imported_blocks_are_cached_and_published_then_hit() {
        let mut e = Engine::new(cfg());
        let s = sub(7, 100, 1);
        let full = 100 / cfg().block_size;
        assert_eq!(e.cached_blocks(&s.keys), 0);
        assert_eq!(e.import(&s), full);
        assert_eq!(e.cached_blocks(&s.keys), full);
        assert!(
            !e.drain_cache_events().is_empty(),
            "stored blocks are published"
        );
        assert_eq!(e.import(&s), 0, "nothing new the second time");
        e.submit(0, 1, s);
        let mut now = 0;
        while e.stats().prefix_cache_queries == 0 {
            now += 1_000;
            e.step(now);
        }
        // vLLM recomputes the last token: the last full block of an exact multiple is not hit.
        let hits = e.stats().prefix_cache_hits as usize;
        assert!(hits >= (full - 1) * cfg().block_size, "{hits}");
    }

    #[test]
    fn an_import_that_evicts_its_own_cached_prefix_counts_no_negative_blocks() {
        // Room for 4 blocks: a 3-block prefix, then the same prefix plus 3 more blocks, whose
        // storing evicts the (unpinned, least recent) prefix itself.
        let mut e = Engine::new(EngineConfig {
            num_gpu_blocks: 4,
            ..cfg()
        });
        assert_eq!(e.import(&sub(1, 12, 1)), 3);
        let stored = e.import(&sub(1, 24, 1));
        assert!(stored <= 3, "{stored} blocks newly stored of 3 new ones");
    }
}
