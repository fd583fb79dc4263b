//! What each KV-event kind does to one pod's state, in order: `BlockStored` (full blocks, or an
//! offload placeholder that only adds a tier), `BlockRemoved`, `AllBlocksCleared`.

use std::collections::hash_map::Entry;

use smallvec::SmallVec;

use super::guess::Guesses;
use super::{
    hold, purge, release, Chain, EngineBlock, EventIndexConfig, KeyHolder, PodState, Touched,
};
use crate::blocks::{chain_token_block, namespace_seed};
use crate::events::{BlockHash, ExtraKey, KvEvent, Medium};
use crate::index::table::{Holders, Slot};
use crate::index::ApplyStats;

/// Applies one batch of one (pod, rank) under the index's write lock.
pub(super) struct Apply<'a> {
    cfg: &'a EventIndexConfig,
    state: &'a mut PodState,
    holders: &'a mut Holders<KeyHolder>,
    slot: Slot,
    rank: u32,
    buf: Vec<u8>,
    /// What the batch did so far.
    pub(super) stats: ApplyStats,
    /// Keys whose hold changed, when someone mirrors this index.
    pub(super) touched: Option<Touched>,
    /// Keys whose guess ended with its decision's group, when someone mirrors this index.
    pub(super) settled: Option<Touched>,
}

impl<'a> Apply<'a> {
    pub(super) fn new(
        cfg: &'a EventIndexConfig,
        state: &'a mut PodState,
        holders: &'a mut Holders<KeyHolder>,
        slot: Slot,
        rank: u32,
    ) -> Self {
        Self {
            cfg,
            state,
            holders,
            slot,
            rank,
            buf: Vec::with_capacity(cfg.block_tokens.max(1) * 4),
            stats: ApplyStats::default(),
            touched: None,
            settled: None,
        }
    }

    /// Applies one event. `model` seeds the keys of root blocks without a LoRA name.
    pub(super) fn event(&mut self, model: &str, event: &KvEvent) {
        match event {
            KvEvent::AllBlocksCleared => self.cleared(),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => {
                if self.indexed_group(*group_idx) {
                    self.removed(block_hashes, is_gpu(medium));
                }
            }
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                ..
            } => {
                if !self.indexed_group(*group_idx) {
                    return;
                }
                let gpu = is_gpu(medium);
                if token_ids.is_empty() || *block_size == 0 {
                    return self.tier_added(block_hashes, gpu);
                }
                let chain = match parent_block_hash {
                    None => Chain {
                        prev: namespace_seed(
                            lora_name.as_deref().unwrap_or(model),
                            salt_of(extra_keys.as_ref(), lora_name.as_deref()).as_deref(),
                        ),
                        pending: SmallVec::new(),
                        root: 0,
                    },
                    Some(p) => match self.state.blocks.get(&(self.rank, p.as_u64())) {
                        Some(b) => b.end.clone(),
                        None => {
                            // Without the parent the chain cannot be continued (llm-d drops too).
                            self.stats.unknown_parent += 1;
                            return;
                        }
                    },
                };
                self.stored(block_hashes, chain, token_ids, *block_size as usize, gpu);
            }
        }
    }

    /// Only the first KV-cache group is indexed: other groups (sliding window, Mamba) report
    /// blocks that do not make a prefix hit by themselves.
    fn indexed_group(&mut self, group_idx: Option<u32>) -> bool {
        let first = group_idx.unwrap_or(0) == 0;
        if !first {
            self.stats.ignored += 1;
        }
        first
    }

    /// `AllBlocksCleared`: the rank's cache was reset.
    fn cleared(&mut self) {
        purge(
            self.state,
            self.holders,
            self.slot,
            Some(self.rank),
            &mut self.touched,
        );
        self.stats.cleared += 1;
    }

    /// `BlockRemoved`: each named block loses the tier; a block with no tier left goes.
    fn removed(&mut self, hashes: &[BlockHash], gpu: bool) {
        for h in hashes {
            let k = (self.rank, h.as_u64());
            let Some(block) = self.state.blocks.get_mut(&k) else {
                self.stats.unknown += 1;
                continue;
            };
            if std::mem::take(tier(block, gpu)) {
                note(&mut self.touched, block);
                for key in &block.keys {
                    release(self.holders, key, self.slot, gpu);
                }
            }
            if !block.gpu && !block.cpu {
                self.state.blocks.remove(&k);
            }
            self.stats.removed += 1;
        }
    }

    /// An offload placeholder (`BlockStored` without tokens): blocks already known by hash gain
    /// the tier; unknown ones cannot be keyed.
    fn tier_added(&mut self, hashes: &[BlockHash], gpu: bool) {
        for h in hashes {
            let Some(block) = self.state.blocks.get_mut(&(self.rank, h.as_u64())) else {
                self.stats.unknown += 1;
                continue;
            };
            let (holders, spec) = (&mut *self.holders, &mut self.state.speculative);
            let marks = (&mut self.touched, &mut self.settled);
            add_tier(holders, spec, marks, self.slot, block, gpu);
            self.stats.stored += 1;
        }
    }

    /// `BlockStored` with tokens: continues the router-key chain from `chain` over each engine
    /// block of `engine_tokens` tokens and records the keys each one completes.
    fn stored(
        &mut self,
        hashes: &[BlockHash],
        mut chain: Chain,
        tokens: &[u32],
        engine_tokens: usize,
        gpu: bool,
    ) {
        let r = self.cfg.block_tokens.max(1);
        // Room for the whole batch up front: one growth of each map, not one per doubling.
        let blocks = hashes.len().min(tokens.len() / engine_tokens.max(1));
        self.state.blocks.reserve(blocks);
        self.holders
            .reserve((chain.pending.len() + blocks * engine_tokens) / r);
        for (i, h) in hashes.iter().enumerate() {
            let Some(block_tokens) = tokens.get(i * engine_tokens..(i + 1) * engine_tokens) else {
                // Fewer tokens than blocks × block size: the rest cannot be keyed.
                self.stats.ignored += 1;
                break;
            };
            let mut keys = SmallVec::new();
            chain.pending.extend_from_slice(block_tokens);
            while chain.pending.len() >= r {
                let key = chain_token_block(chain.prev, &chain.pending[..r], &mut self.buf);
                chain.prev = key.0;
                if chain.root == 0 {
                    chain.root = key.0;
                }
                chain.pending.drain(..r);
                keys.push(key);
            }
            let k = (self.rank, h.as_u64());
            if self.state.blocks.len() >= self.cfg.max_engine_blocks_per_pod
                && !self.state.blocks.contains_key(&k)
            {
                // Far more blocks than any KV cache holds: the pod's state cannot be trusted.
                self.stats.overflow += 1;
                purge(self.state, self.holders, self.slot, None, &mut self.touched);
                break;
            }
            match self.state.blocks.entry(k) {
                Entry::Occupied(mut o) => {
                    // Re-announced block (e.g. a hit reported in full): same content.
                    let (holders, spec) = (&mut *self.holders, &mut self.state.speculative);
                    let marks = (&mut self.touched, &mut self.settled);
                    add_tier(holders, spec, marks, self.slot, o.get_mut(), gpu);
                }
                Entry::Vacant(v) => {
                    if let Some(t) = &mut self.touched {
                        t.extend(keys.iter().map(|&k| (chain.root, k)));
                    }
                    for &key in &keys {
                        hold(
                            self.holders,
                            &mut self.state.speculative,
                            &mut self.settled,
                            key,
                            self.slot,
                            gpu,
                        );
                    }
                    v.insert(EngineBlock {
                        keys,
                        end: chain.clone(),
                        gpu,
                        cpu: !gpu,
                    });
                }
            }
            self.stats.stored += 1;
        }
    }
}

/// A known block now also held in `gpu`'s tier: its keys gain the pod as a holder in that tier
/// (no-op when the block already had it). `marks`: the touched and settled keys, when tracked.
fn add_tier(
    holders: &mut Holders<KeyHolder>,
    speculative: &mut Guesses,
    (touched, settled): (&mut Option<Touched>, &mut Option<Touched>),
    slot: Slot,
    block: &mut EngineBlock,
    gpu: bool,
) {
    if std::mem::replace(tier(block, gpu), true) {
        return;
    }
    note(touched, block);
    for &key in &block.keys {
        hold(holders, speculative, settled, key, slot, gpu);
    }
}

/// Notes `block`'s keys as touched, when tracked.
fn note(touched: &mut Option<Touched>, block: &EngineBlock) {
    if let Some(t) = touched {
        t.extend(block.keys.iter().map(|&k| (block.end.root, k)));
    }
}

fn is_gpu(medium: &Option<String>) -> bool {
    Medium::parse(medium.as_deref()) == Medium::Gpu
}

fn tier(block: &mut EngineBlock, gpu: bool) -> &mut bool {
    if gpu {
        &mut block.gpu
    } else {
        &mut block.cpu
    }
}

/// The cache salt published in block 0's extra keys (the string that is not the LoRA name).
fn salt_of(extra: Option<&Vec<Option<Vec<ExtraKey>>>>, lora: Option<&str>) -> Option<String> {
    let first = extra?.first()?.as_ref()?;
    let mut lora_seen = false;
    first.iter().find_map(|k| match k {
        ExtraKey::Str(s) if lora == Some(s.as_str()) && !lora_seen => {
            lora_seen = true;
            None
        }
        ExtraKey::Str(s) => Some(s.clone()),
        _ => None,
    })
}
