//! From a parsed request to block keys: exact token blocks when the model has a tokenizer
//! (precise mode, matching the keys computed from vLLM's KV events), else approximate text blocks.

use std::sync::Arc;

use crate::blocks::{namespace_seed, token_keys, BlockKey, BlockScheme};
use crate::config::TokenizerConfig;
use crate::request::RoutingRequest;
use crate::tokenize::{TokenizeError, TokenizerRegistry, TokenizerSpec};

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
    /// Tokenization failed (closed kind); the keys fell back to text blocks.
    pub tokenize_error: Option<&'static str>,
}

/// Turns requests into keys.
#[derive(Clone)]
pub struct Keyer {
    scheme: BlockScheme,
    block_tokens: usize,
    tokenizers: Arc<TokenizerRegistry>,
}

/// Builds the tokenizer registry a config asks for (files are read now; errors name the model).
pub fn load_tokenizers(specs: &[TokenizerConfig]) -> Result<TokenizerRegistry, TokenizeError> {
    let specs: Vec<(String, TokenizerSpec)> = specs
        .iter()
        .map(|t| {
            let spec = match &t.tokenizer_json {
                Some(json) if !t.builtin => TokenizerSpec::Files {
                    tokenizer_json: json.clone(),
                    tokenizer_config: t.tokenizer_config.clone(),
                    chat_template: t.chat_template.clone(),
                },
                _ => TokenizerSpec::Builtin,
            };
            (t.model.clone(), spec)
        })
        .collect();
    TokenizerRegistry::from_specs(specs.iter().map(|(m, s)| (m.as_str(), s)), None)
}

impl Keyer {
    /// A keyer over a tokenizer registry (empty = approximate keys for every model).
    pub fn new(
        scheme: BlockScheme,
        block_tokens: usize,
        tokenizers: Arc<TokenizerRegistry>,
    ) -> Self {
        Self {
            scheme,
            block_tokens: block_tokens.max(1),
            tokenizers,
        }
    }

    /// Keys of a request.
    pub fn keys(&self, req: &RoutingRequest) -> Keys {
        let model = req.model.as_deref().unwrap_or("");
        let mut tokenize_error = None;
        if let Some(tokenizer) = self.tokenizers.get(model) {
            match tokenizer.request_tokens(req) {
                Ok(tokens) => {
                    let seed = namespace_seed(model, req.cache_salt.as_deref());
                    return Keys {
                        keys: token_keys(seed, &tokens, self.block_tokens, self.scheme.max_blocks),
                        tokens_per_block: self.block_tokens,
                        prompt_tokens: tokens.len() as u64,
                        precise: true,
                        tokenize_error: None,
                    };
                }
                Err(e) => tokenize_error = Some(e.kind()),
            }
        }
        Keys {
            keys: self.scheme.keys(req),
            tokens_per_block: self.scheme.size_tokens(),
            prompt_tokens: req.prompt.approx_tokens(),
            precise: false,
            tokenize_error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::pseudo_tokens;
    use crate::request::parse;

    #[test]
    fn builtin_models_get_token_keys_matching_the_sim() {
        let reg = load_tokenizers(&[TokenizerConfig {
            model: "sim-model".into(),
            tokenizer_json: None,
            tokenizer_config: None,
            chat_template: None,
            builtin: true,
        }])
        .unwrap();
        let keyer = Keyer::new(BlockScheme::default(), 16, Arc::new(reg));
        let text = "x".repeat(200);
        let body = format!(r#"{{"model":"sim-model","prompt":"{text}"}}"#);
        let req = parse("/v1/completions", body.as_bytes()).unwrap();
        let k = keyer.keys(&req);
        assert!(k.precise);
        let want = token_keys(
            namespace_seed("sim-model", None),
            &pseudo_tokens(text.as_bytes()),
            16,
            4096,
        );
        assert_eq!(k.keys, want);
        let other = parse("/v1/completions", br#"{"model":"other","prompt":"hello"}"#).unwrap();
        assert!(
            !keyer.keys(&other).precise,
            "models without a tokenizer stay approximate"
        );
    }
}
