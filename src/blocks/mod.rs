//! Block keys: the prompt cut into fixed-size blocks, each identified by a chained stable hash.
//!
//! Scheme (approximate mode, documented in `docs/block-keys.md`):
//! `seed = XXH3-64("kv-router/v1\0" ‖ model ‖ "\0" ‖ cache_salt)`,
//! `key_0 = XXH3-64_seed(block_0, seed)`, `key_i = XXH3-64_seed(block_i, key_{i-1})`.
//! Text blocks are `size_chars` bytes of the canonical prompt; token blocks are
//! `size_chars / 4` token ids, each as 4 little-endian bytes. Only full blocks get a key.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::request::{Prompt, RoutingRequest};

/// A chained block identifier; equal keys imply equal prompts up to and including that block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

/// How prompts are cut into blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockScheme {
    /// Bytes of canonical text per block (4 bytes ≈ 1 token).
    pub size_chars: usize,
    /// At most this many leading blocks are keyed per request.
    pub max_blocks: usize,
}

impl Default for BlockScheme {
    fn default() -> Self {
        Self {
            size_chars: 64,
            max_blocks: 4096,
        }
    }
}

impl BlockScheme {
    /// Tokens per block for token-id prompts (and the approximate token count of a text block).
    pub fn size_tokens(&self) -> usize {
        (self.size_chars / 4).max(1)
    }

    /// Keys of the request's full blocks (at most `max_blocks`).
    pub fn keys(&self, req: &RoutingRequest) -> Vec<BlockKey> {
        let seed = namespace_seed(
            req.model.as_deref().unwrap_or(""),
            req.cache_salt.as_deref(),
        );
        self.prompt_keys(seed, &req.prompt)
    }

    /// Keys of a prompt's full blocks under a namespace seed.
    pub fn prompt_keys(&self, seed: u64, prompt: &Prompt) -> Vec<BlockKey> {
        match prompt {
            Prompt::Text(text) => text_keys(
                seed,
                text.as_bytes(),
                self.size_chars.max(1),
                self.max_blocks,
            ),
            Prompt::Tokens(ids) => token_keys(seed, ids, self.size_tokens(), self.max_blocks),
            Prompt::Empty => Vec::new(),
        }
    }
}

/// Namespace seed: different models, adapters or cache salts never share keys.
pub fn namespace_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let mut buf = Vec::with_capacity(16 + model.len() + cache_salt.map_or(0, str::len));
    buf.extend_from_slice(b"kv-router/v1\0");
    buf.extend_from_slice(model.as_bytes());
    buf.push(0);
    if let Some(salt) = cache_salt {
        buf.extend_from_slice(salt.as_bytes());
    }
    xxh3_64(&buf)
}

/// Chained keys over full `size`-byte blocks of `bytes`.
pub fn text_keys(seed: u64, bytes: &[u8], size: usize, max_blocks: usize) -> Vec<BlockKey> {
    let mut prev = seed;
    bytes
        .chunks_exact(size)
        .take(max_blocks)
        .map(|block| {
            prev = xxh3_64_with_seed(block, prev);
            BlockKey(prev)
        })
        .collect()
}

/// Chained keys over full `size`-token blocks of `ids` (each id as 4 little-endian bytes).
pub fn token_keys(seed: u64, ids: &[u32], size: usize, max_blocks: usize) -> Vec<BlockKey> {
    let mut prev = seed;
    let mut buf = Vec::with_capacity(size * 4);
    ids.chunks_exact(size)
        .take(max_blocks)
        .map(|block| {
            let key = chain_token_block(prev, block, &mut buf);
            prev = key.0;
            key
        })
        .collect()
}

/// One step of the token chain: the key of `block` after the key (or seed) `prev`.
/// `buf` is scratch space reused across calls.
pub fn chain_token_block(prev: u64, block: &[u32], buf: &mut Vec<u8>) -> BlockKey {
    // Sized once and filled in fixed 4-byte chunks: on little-endian targets this compiles to a
    // copy, where pushing four bytes at a time checked capacity per id.
    buf.clear();
    buf.resize(block.len() * 4, 0);
    for (dst, id) in buf.chunks_exact_mut(4).zip(block) {
        dst.copy_from_slice(&id.to_le_bytes());
    }
    BlockKey(xxh3_64_with_seed(buf, prev))
}

/// The built-in deterministic tokenizer shared with `vllm-sim`: every 4 bytes of canonical text
/// (the last chunk may be shorter) become one token id in `1000..101000`. Approximate mode
/// assumes pods tokenize like this; block boundaries then coincide with text blocks.
pub fn pseudo_tokens(text: &[u8]) -> Vec<u32> {
    text.chunks(4)
        .map(|chunk| 1000 + (xxh3_64(chunk) % 100_000) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_full_blocks_and_prefix_stable() {
        let s = BlockScheme {
            size_chars: 4,
            max_blocks: 100,
        };
        let a = s.prompt_keys(1, &Prompt::Text("aaaabbbbcc".into()));
        let b = s.prompt_keys(1, &Prompt::Text("aaaabbbbccccdddd".into()));
        assert_eq!(a.len(), 2);
        assert_eq!(b.len(), 4);
        assert_eq!(a[..], b[..2]);
    }

    #[test]
    fn chaining_distinguishes_position() {
        let s = BlockScheme {
            size_chars: 4,
            max_blocks: 100,
        };
        let a = s.prompt_keys(1, &Prompt::Text("xxxxyyyy".into()));
        let b = s.prompt_keys(1, &Prompt::Text("zzzzyyyy".into()));
        assert_ne!(
            a[1], b[1],
            "same block after different prefixes must differ"
        );
    }

    #[test]
    fn namespaces_separate_models_and_salts() {
        assert_ne!(namespace_seed("a", None), namespace_seed("b", None));
        assert_ne!(namespace_seed("a", None), namespace_seed("a", Some("t1")));
        assert_ne!(
            namespace_seed("a", Some("t1")),
            namespace_seed("a", Some("t2"))
        );
        // The separator keeps "ab"+"" apart from "a"+"b".
        assert_ne!(namespace_seed("ab", None), namespace_seed("a", Some("b")));
    }

    #[test]
    fn pseudo_tokens_are_four_bytes_each() {
        let t = pseudo_tokens(b"abcdabcdab");
        assert_eq!(t.len(), 3);
        assert_eq!(t[0], t[1]);
        assert!(t.iter().all(|id| (1000..101_000).contains(id)));
    }

    #[test]
    fn keys_stop_at_max_blocks() {
        let s = BlockScheme {
            size_chars: 1,
            max_blocks: 3,
        };
        assert_eq!(s.prompt_keys(0, &Prompt::Text("abcdef".into())).len(), 3);
    }

    #[test]
    fn token_prompts_are_keyed_by_whole_token_blocks() {
        let s = BlockScheme {
            size_chars: 8,
            max_blocks: 10,
        };
        let k = s.prompt_keys(7, &Prompt::Tokens(vec![1, 2, 3, 4, 5]));
        assert_eq!(k.len(), 2);
        assert_eq!(k, token_keys(7, &[1, 2, 3, 4], 2, 10));
    }

    #[test]
    fn token_blocks_hash_their_ids_as_little_endian_bytes() {
        let ids = [1u32, 0x0102_0304, u32::MAX];
        let bytes = [1, 0, 0, 0, 4, 3, 2, 1, 255, 255, 255, 255];
        let mut buf = vec![9; 40]; // stale scratch contents must not leak into the key
        assert_eq!(
            chain_token_block(42, &ids, &mut buf),
            BlockKey(xxh3_64_with_seed(&bytes, 42))
        );
    }

    #[test]
    fn specified_hash_vector() {
        // Pins the scheme: changing it silently would split shared Redis indexes across versions.
        let seed = namespace_seed("m", None);
        let keys = text_keys(seed, b"0123456789abcdef", 8, 10);
        assert_eq!(keys[0].0, xxh3_64_with_seed(b"01234567", seed));
        assert_eq!(keys[1].0, xxh3_64_with_seed(b"89abcdef", keys[0].0));
    }
}
