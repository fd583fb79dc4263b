//! From a parsed request to block keys: exact token blocks when the model has a tokenizer
//! (precise mode, matching the keys computed from vLLM's KV events), else approximate text blocks.

use std::collections::HashSet;

use crate::blocks::{namespace_seed, pseudo_tokens, token_keys, BlockKey, BlockScheme};
use crate::request::{Prompt, RoutingRequest};

/// A request's keys and what they stand for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Keys {
    /// Chained block keys, first block first.
    pub keys: Vec<BlockKey>,
    /// Tokens per block.
    pub tokens_per_block: usize,
    /// Prompt size in tokens (exact in precise mode, estimated otherwise).
    pub prompt_tokens: u64,
    /// Whether the keys are exact token blocks.
    pub precise: bool,
}

/// Turns requests into keys.
#[derive(Debug, Clone)]
pub struct Keyer {
    scheme: BlockScheme,
    block_tokens: usize,
    builtin: HashSet<String>,
}

impl Keyer {
    /// `builtin`: models tokenized with the simulator's pseudo tokenizer.
    pub fn new(scheme: BlockScheme, block_tokens: usize, builtin: HashSet<String>) -> Self {
        Self {
            scheme,
            block_tokens: block_tokens.max(1),
            builtin,
        }
    }

    /// Whether requests for `model` get exact token keys.
    pub fn is_precise(&self, model: &str) -> bool {
        self.builtin.contains(model)
    }

    /// Keys of a request.
    pub fn keys(&self, req: &RoutingRequest) -> Keys {
        let model = req.model.as_deref().unwrap_or("");
        if self.is_precise(model) {
            let seed = namespace_seed(model, req.cache_salt.as_deref());
            let tokens = match &req.prompt {
                Prompt::Text(t) => pseudo_tokens(t.as_bytes()),
                Prompt::Tokens(ids) => ids.clone(),
                Prompt::Empty => Vec::new(),
            };
            return Keys {
                keys: token_keys(seed, &tokens, self.block_tokens, self.scheme.max_blocks),
                tokens_per_block: self.block_tokens,
                prompt_tokens: tokens.len() as u64,
                precise: true,
            };
        }
        Keys {
            keys: self.scheme.keys(req),
            tokens_per_block: self.scheme.size_tokens(),
            prompt_tokens: req.prompt.approx_tokens(),
            precise: false,
        }
    }
}
