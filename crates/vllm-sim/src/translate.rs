//! The one translation of the engine's cache events into vLLM KV events, used by the `vllm-sim`
//! publisher (vLLM `sha256_cbor` hashes) and by `kv-bench simulate` (the engine's own keys as
//! hashes: the router treats engine hashes as opaque and re-keys blocks from their token ids).

use std::collections::HashMap;

use kv_router::blocks::BlockKey;
use kv_router::events::{BlockHash, ExtraKey, KvEvent};

use super::cache::CacheEvent;
use super::vllm_hash::{digest_u64, BlockDigest};

/// Which block hashes the published events carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Hashes {
    /// vLLM digests folded to u64 (vLLM's default wire form). Needs the engine's vLLM info.
    #[default]
    U64,
    /// vLLM 32-byte digests. Needs the engine's vLLM info.
    Bytes,
    /// The engine's own block keys.
    EngineKeys,
}

/// Turns the simulator's cache events into vLLM events. With vLLM hashes it remembers which
/// hash each cached key has, so evictions are reported under the hash the store announced.
#[derive(Debug, Default)]
pub struct Translator {
    hashes: Hashes,
    /// vLLM digest of every cached key that was announced.
    by_key: HashMap<BlockKey, BlockDigest>,
    /// How many cached keys share a digest (model aliases hash alike); a hash is announced
    /// when its count leaves 0 and removed when it returns to 0.
    refs: HashMap<BlockDigest, u32>,
}

fn stored(
    block_hashes: Vec<BlockHash>,
    parent_block_hash: Option<BlockHash>,
    token_ids: Vec<u32>,
    block_size: usize,
    lora: Option<&(String, i64)>,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size: block_size as u32,
        lora_id: lora.map(|(_, id)| *id),
        medium: Some("GPU".into()),
        lora_name: lora.map(|(name, _)| name.clone()),
        extra_keys,
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        kv_cache_spec_sliding_window: None,
    }
}

fn removed(hash: BlockHash) -> KvEvent {
    // vLLM emits one BlockRemoved per evicted hash.
    KvEvent::BlockRemoved {
        block_hashes: vec![hash],
        medium: Some("GPU".into()),
        group_idx: Some(0),
    }
}

impl Translator {
    /// A translator publishing `hashes`.
    pub fn new(hashes: Hashes) -> Self {
        Self {
            hashes,
            ..Self::default()
        }
    }

    fn hash(&self, d: &BlockDigest) -> BlockHash {
        if self.hashes == Hashes::Bytes {
            BlockHash::Bytes(d.to_vec())
        } else {
            BlockHash::Int(digest_u64(d))
        }
    }

    /// The vLLM events for one engine step's cache events, in order.
    pub fn translate(&mut self, events: Vec<CacheEvent>) -> Vec<KvEvent> {
        let mut out = Vec::new();
        for ev in events {
            match ev {
                CacheEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    ..
                } if self.hashes == Hashes::EngineKeys => out.push(stored(
                    block_hashes.iter().map(|k| BlockHash::Int(k.0)).collect(),
                    parent_block_hash.map(|k| BlockHash::Int(k.0)),
                    token_ids,
                    block_size,
                    None,
                    None,
                )),
                CacheEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    block_size,
                    vllm,
                    ..
                } => {
                    let Some(v) = vllm else {
                        // Engine without hashing info: nothing vLLM-like to say.
                        continue;
                    };
                    // Blocks whose digest is newly cached, in runs of consecutive blocks.
                    let mut run: Option<(usize, usize)> = None;
                    let mut runs = Vec::new();
                    for (i, (key, digest)) in block_hashes.iter().zip(&v.hashes).enumerate() {
                        self.by_key.insert(*key, *digest);
                        let count = self.refs.entry(*digest).or_insert(0);
                        *count += 1;
                        if *count == 1 {
                            run = match run {
                                Some((s, e)) if e == i => Some((s, i + 1)),
                                Some(r) => {
                                    runs.push(r);
                                    Some((i, i + 1))
                                }
                                None => Some((i, i + 1)),
                            };
                        }
                    }
                    runs.extend(run);
                    for (s, e) in runs {
                        let parent = if s == 0 {
                            v.parent
                        } else {
                            Some(v.hashes[s - 1])
                        };
                        let extra = v.extra_keys[s..e]
                            .iter()
                            .map(|k| {
                                k.as_ref()
                                    .map(|ks| ks.iter().map(|s| ExtraKey::Str(s.clone())).collect())
                            })
                            .collect();
                        out.push(stored(
                            v.hashes[s..e].iter().map(|d| self.hash(d)).collect(),
                            parent.map(|d| self.hash(&d)),
                            token_ids[s * block_size..e * block_size].to_vec(),
                            block_size,
                            v.lora.as_ref(),
                            Some(extra),
                        ));
                    }
                }
                CacheEvent::BlockRemoved { block_hashes } if self.hashes == Hashes::EngineKeys => {
                    out.extend(block_hashes.iter().map(|k| removed(BlockHash::Int(k.0))));
                }
                CacheEvent::BlockRemoved { block_hashes } => {
                    for key in block_hashes {
                        let Some(digest) = self.by_key.remove(&key) else {
                            continue;
                        };
                        let gone = match self.refs.get_mut(&digest) {
                            Some(c) if *c > 1 => {
                                *c -= 1;
                                false
                            }
                            _ => {
                                self.refs.remove(&digest);
                                true
                            }
                        };
                        if gone {
                            out.push(removed(self.hash(&digest)));
                        }
                    }
                }
                CacheEvent::AllBlocksCleared => {
                    self.by_key.clear();
                    self.refs.clear();
                    out.push(KvEvent::AllBlocksCleared);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::cache::VllmStored;
    use super::*;

    fn stored(keys: &[u64], digests: &[u8], parent: Option<u8>) -> CacheEvent {
        CacheEvent::BlockStored {
            block_hashes: keys.iter().map(|&k| BlockKey(k)).collect(),
            parent_block_hash: None,
            token_ids: (0..keys.len() as u32 * 2).collect(),
            block_size: 2,
            vllm: Some(VllmStored {
                hashes: digests.iter().map(|&d| [d; 32]).collect(),
                parent: parent.map(|p| [p; 32]),
                extra_keys: vec![None; keys.len()],
                lora: None,
            }),
        }
    }

    #[test]
    fn shared_digests_are_announced_once_and_removed_last() {
        let mut t = Translator::new(Hashes::U64);
        let h = |d: u8| BlockHash::Int(digest_u64(&[d; 32]));
        let out = t.translate(vec![stored(&[1, 2], &[1, 2], None)]);
        assert_eq!(out.len(), 1);
        // Another model alias: same digests 1, 2 plus a new 3 → only 3, parent 2.
        let out = t.translate(vec![stored(&[11, 12, 13], &[1, 2, 3], None)]);
        match &out[..] {
            [KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            }] => {
                assert_eq!(block_hashes, &vec![h(3)]);
                assert_eq!(parent_block_hash, &Some(h(2)));
                assert_eq!(token_ids, &vec![4, 5]);
            }
            other => panic!("{other:?}"),
        }
        let out = t.translate(vec![CacheEvent::BlockRemoved {
            block_hashes: vec![BlockKey(2), BlockKey(13), BlockKey(99)],
        }]);
        assert_eq!(
            out,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![h(3)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            }]
        );
        let out = t.translate(vec![CacheEvent::BlockRemoved {
            block_hashes: vec![BlockKey(12)],
        }]);
        assert_eq!(out.len(), 1);
        assert_eq!(
            t.translate(vec![CacheEvent::AllBlocksCleared]),
            vec![KvEvent::AllBlocksCleared]
        );
        assert!(t.by_key.is_empty() && t.refs.is_empty());
    }

    #[test]
    fn engine_keys_are_published_as_they_are() {
        let mut t = Translator::new(Hashes::EngineKeys);
        let mut ev = stored(&[1, 2], &[9, 9], None);
        if let CacheEvent::BlockStored {
            parent_block_hash, ..
        } = &mut ev
        {
            *parent_block_hash = Some(BlockKey(7));
        }
        let out = t.translate(vec![
            ev,
            CacheEvent::BlockRemoved {
                block_hashes: vec![BlockKey(2), BlockKey(1)],
            },
        ]);
        match &out[..] {
            [KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                extra_keys: None,
                ..
            }, KvEvent::BlockRemoved {
                block_hashes: r2, ..
            }, KvEvent::BlockRemoved {
                block_hashes: r1, ..
            }] => {
                assert_eq!(block_hashes, &vec![BlockHash::Int(1), BlockHash::Int(2)]);
                assert_eq!(parent_block_hash, &Some(BlockHash::Int(7)));
                assert_eq!(
                    (r2, r1),
                    (&vec![BlockHash::Int(2)], &vec![BlockHash::Int(1)])
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(t.by_key.is_empty(), "nothing to remember");
    }
}
