//! Oracles: the best prefix hit ratio any router could reach on a request sequence.
//!
//! * **infinite**: one cache of unlimited size, same request order: every block ever computed
//!   stays cached (the ideal ratio of workloads.md §1.2 at the sim's block granularity).
//! * **pooled**: one LRU cache holding the whole fleet's blocks (pods × blocks per pod), same block
//!   size and eviction order as the sim: the best a router can do with this fleet, because a
//!   router can at most make the fleet behave like a single cache of its total size.
//!
//! Hits are counted the way the sim (and vLLM) reports `cached_tokens`: the leading run of cached
//! full blocks, capped so the last prompt token is always recomputed.

use lru::LruCache;
use serde::Serialize;
use serde_json::Value;

use kv_router::blocks::{namespace_seed, token_keys, BlockKey};

/// One request as the oracles see it.
#[derive(Debug, Clone, PartialEq)]
pub struct OracleRequest {
    /// Chained keys of the prompt's full blocks (the sim's keys).
    pub keys: Vec<BlockKey>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
}

impl OracleRequest {
    /// The request the sim would see for `body` sent to `path` (None if the sim would reject it).
    pub fn from_body(path: &str, body: &Value, block_size: usize) -> Option<Self> {
        let bytes = serde_json::to_vec(body).ok()?;
        let req = vllm_sim::openai::parse(path.ends_with("/chat/completions"), &bytes).ok()?;
        let model = req.model.clone().unwrap_or_default();
        let seed = namespace_seed(&model, req.cache_salt.as_deref());
        let tokens = req.tokens;
        if tokens.is_empty() {
            return None;
        }
        Some(Self {
            keys: token_keys(seed, &tokens, block_size.max(1), usize::MAX),
            prompt_tokens: tokens.len() as u64,
        })
    }
}

/// Cached versus total prompt tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct HitTokens {
    /// Tokens served from cache.
    pub hit_tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
}

impl HitTokens {
    /// `hit / prompt` (0 when empty).
    pub fn ratio(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// Both oracles of one request sequence.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Oracles {
    /// Unlimited cache.
    pub infinite: HitTokens,
    /// One LRU of the fleet's total size.
    pub pooled: HitTokens,
    /// Capacity of the pooled cache, blocks.
    pub pooled_blocks: usize,
}

impl Oracles {
    /// Computes both over `reqs` in order, with `block_size`-token blocks and a pooled capacity
    /// of `pooled_blocks`.
    pub fn compute(reqs: &[OracleRequest], block_size: usize, pooled_blocks: usize) -> Self {
        Self {
            infinite: infinite(reqs, block_size),
            pooled: pooled(reqs, block_size, pooled_blocks),
            pooled_blocks,
        }
    }
}

/// Leading cached blocks, capped so at least one prompt token is recomputed.
fn hit_blocks(
    r: &OracleRequest,
    block_size: usize,
    mut cached: impl FnMut(&BlockKey) -> bool,
) -> usize {
    let cap = (r.prompt_tokens.saturating_sub(1) / block_size.max(1) as u64) as usize;
    r.keys.iter().take(cap).take_while(|k| cached(k)).count()
}

/// Infinite cache, request order.
pub fn infinite(reqs: &[OracleRequest], block_size: usize) -> HitTokens {
    let mut seen = ahash::AHashSet::new();
    let mut out = HitTokens::default();
    for r in reqs {
        let h = hit_blocks(r, block_size, |k| seen.contains(k));
        out.hit_tokens += (h * block_size) as u64;
        out.prompt_tokens += r.prompt_tokens;
        seen.extend(r.keys.iter().copied());
    }
    out
}

/// One LRU of `capacity` blocks, request order. Like the sim, a request's blocks are released
/// last block first, so a prompt's tail is evicted before its head.
pub fn pooled(reqs: &[OracleRequest], block_size: usize, capacity: usize) -> HitTokens {
    let mut out = HitTokens::default();
    let Some(cap) = std::num::NonZeroUsize::new(capacity) else {
        out.prompt_tokens = reqs.iter().map(|r| r.prompt_tokens).sum();
        return out;
    };
    let mut lru: LruCache<BlockKey, ()> = LruCache::new(cap);
    for r in reqs {
        let h = hit_blocks(r, block_size, |k| lru.contains(k));
        out.hit_tokens += (h * block_size) as u64;
        out.prompt_tokens += r.prompt_tokens;
        // A prompt longer than the whole cache keeps only its head, as the sim stores in order
        // and stops when no room is left.
        let kept = r.keys.len().min(capacity);
        for k in r.keys[..kept].iter().rev() {
            lru.put(*k, ());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64], tokens: u64) -> OracleRequest {
        OracleRequest {
            keys: ids.iter().map(|&i| BlockKey(i)).collect(),
            prompt_tokens: tokens,
        }
    }

    #[test]
    fn infinite_counts_leading_blocks_and_keeps_the_last_token_uncached() {
        let reqs = [
            req(&[1, 2, 3], 50),    // 3 full 16-token blocks + 2
            req(&[1, 2, 3], 48),    // exactly 3 blocks: hit capped at 2 blocks
            req(&[1, 9, 3], 64),    // diverges after block 1
            req(&[1, 2, 3, 4], 70), // 3 cached
        ];
        let h = infinite(&reqs, 16);
        assert_eq!(h.prompt_tokens, 50 + 48 + 64 + 70);
        assert_eq!(h.hit_tokens, (2 + 1 + 3) * 16);
    }

    #[test]
    fn pooled_evicts_least_recently_used_tails_first() {
        // Capacity 3: A = [1,2] then B = [7,8] evicts 2 first (tail of A released last-first,
        // so 2 is the LRU), leaving 1, then 7 and 8 in.
        let reqs = [req(&[1, 2], 40), req(&[7, 8], 40), req(&[1, 2], 40)];
        let h = pooled(&reqs, 16, 3);
        assert_eq!(h.hit_tokens, 16, "only block 1 survived");
        let big = pooled(&reqs, 16, 100);
        assert_eq!(big, infinite(&reqs, 16));
        assert_eq!(pooled(&reqs, 16, 0).hit_tokens, 0);
    }

    #[test]
    fn pooled_never_beats_infinite() {
        let mut rng = kv_testkit::splitmix::SplitMix64::new(7);
        let reqs: Vec<OracleRequest> = (0..300)
            .map(|_| {
                let root = rng.range(0, 5) as u64;
                let n = rng.range(1, 12);
                let ids: Vec<u64> = (0..n as u64).map(|i| root * 1000 + i).collect();
                req(&ids, n as u64 * 16 + rng.range(0, 15) as u64)
            })
            .collect();
        let inf = infinite(&reqs, 16);
        let mut last = 0;
        for cap in [1, 4, 16, 64, 1024] {
            let p = pooled(&reqs, 16, cap);
            assert!(p.hit_tokens <= inf.hit_tokens);
            assert!(p.hit_tokens >= last, "more capacity never hurts LRU here");
            last = p.hit_tokens;
        }
        assert_eq!(last, inf.hit_tokens);
    }

    #[test]
    fn keys_from_bodies_match_the_sims_tokenization() {
        let body = serde_json::json!({"model": "m", "prompt": "x".repeat(130)});
        let r = OracleRequest::from_body("/v1/completions", &body, 16).unwrap();
        // 130 bytes = 33 pseudo tokens (4 bytes each, the last partial) = 2 full blocks.
        assert_eq!(r.prompt_tokens, 33);
        assert_eq!(r.keys.len(), 2);
        let ids = serde_json::json!({"model": "m", "prompt": (0..40).collect::<Vec<u32>>()});
        let t = OracleRequest::from_body("/v1/completions", &ids, 16).unwrap();
        assert_eq!(t.prompt_tokens, 40);
        assert_eq!(
            t.keys,
            token_keys(
                namespace_seed("m", None),
                &(0..40).collect::<Vec<u32>>(),
                16,
                99
            )
        );
    }
}
