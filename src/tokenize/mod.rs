//! Precise-mode tokenization: the token ids vLLM computes for a request.
//!
//! * `/v1/completions` string prompt → `encode(prompt, add_special_tokens = true)`; token-id
//!   prompts are returned as given.
//! * `/v1/chat/completions` → the model's chat template rendered from [`ChatInput`] like vLLM's
//!   `apply_hf_chat_template` ([`ChatTemplate`]), then `encode(rendered, add_special_tokens =
//!   false)`.
//! * `/v1/responses`, `/v1/embeddings` → the canonical prompt text with special tokens (best
//!   effort: vLLM renders Responses input through the chat template; see docs/tokenizers.md).
//!
//! Text encodings without special tokens go through a [`PrefixCache`] that reuses the tokens
//! of previously seen prefixes ending at an added token such as `<|im_end|>` and is exactly
//! equal to a full tokenization. No error message contains prompt text. Nothing here downloads
//! anything: tokenizers are loaded from local files only.

mod cache;
mod template;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value as Json;
use thiserror::Error;

pub use cache::{CacheConfig, CacheStats, PrefixCache};
pub use template::{normalize_messages, strftime_utc, ChatTemplate, ContentFormat};

use crate::blocks::pseudo_tokens;
use crate::request::{Api, ChatInput, Prompt, RoutingRequest};
use cache::{Checkpoint, IdsAndOffsets, OffsetEncoder};

/// Why a tokenizer could not be built or a request not tokenized. Never contains prompt text.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// A configured file does not exist.
    #[error("model '{model}': file not found: {path}")]
    FileMissing {
        /// Model name.
        model: String,
        /// The missing path.
        path: PathBuf,
    },
    /// A file could not be read.
    #[error("model '{model}': cannot read {path}: {detail}")]
    Io {
        /// Model name.
        model: String,
        /// The path.
        path: PathBuf,
        /// OS error.
        detail: String,
    },
    /// A JSON file is malformed (or not a valid `tokenizer.json`).
    #[error("model '{model}': invalid JSON in {path}: {detail}")]
    BadJson {
        /// Model name.
        model: String,
        /// The path.
        path: PathBuf,
        /// Parser message.
        detail: String,
    },
    /// The chat template does not compile.
    #[error("model '{model}': chat template syntax error: {detail}")]
    TemplateSyntax {
        /// Model name.
        model: String,
        /// minijinja's message (template name and line).
        detail: String,
    },
    /// A chat request for a model without a chat template.
    #[error("model '{model}': no chat template configured")]
    NoChatTemplate {
        /// Model name.
        model: String,
    },
    /// A chat request without structured input.
    #[error("chat request without messages")]
    MissingChatInput,
    /// Rendering failed (`raise_exception`, type errors, ...).
    #[error("model '{model}': chat template rendering failed: {detail}")]
    Render {
        /// Model name.
        model: String,
        /// minijinja's message.
        detail: String,
    },
    /// The tokenizer failed.
    #[error("model '{model}': tokenization failed: {detail}")]
    Encode {
        /// Model name.
        model: String,
        /// The tokenizer's message.
        detail: String,
    },
    /// No tokenizer registered for the model.
    #[error("no tokenizer for model '{0}'")]
    UnknownModel(String),
}

impl TokenizeError {
    /// Stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenizeError::FileMissing { .. } => "file_missing",
            TokenizeError::Io { .. } => "io",
            TokenizeError::BadJson { .. } => "bad_json",
            TokenizeError::TemplateSyntax { .. } => "template_syntax",
            TokenizeError::NoChatTemplate { .. } => "no_chat_template",
            TokenizeError::MissingChatInput => "missing_chat_input",
            TokenizeError::Render { .. } => "render",
            TokenizeError::Encode { .. } => "encode",
            TokenizeError::UnknownModel(_) => "unknown_model",
        }
    }
}

/// Where a model's tokenizer comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSpec {
    /// HuggingFace files on local disk.
    Files {
        /// `tokenizer.json`.
        tokenizer_json: PathBuf,
        /// `tokenizer_config.json` (chat template, special-token strings).
        tokenizer_config: Option<PathBuf>,
        /// A standalone `.jinja` chat template (overrides the config's template).
        chat_template: Option<PathBuf>,
    },
    /// The crate's deterministic pseudo tokenizer over the canonical prompt (what `vllm-sim`
    /// does), for end-to-end tests of precise mode against the simulator.
    Builtin,
}

/// Special-token variables handed to chat templates.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A model's tokenizer.
pub struct Tokenizer {
    model: String,
    backend: Backend,
}

enum Backend {
    Builtin,
    Hf(Box<HfBackend>),
}

struct HfBackend {
    inner: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    cache: Option<PrefixCache>,
    /// Added tokens usable as checkpoints, indexed by first byte, longest first.
    added_by_first_byte: Vec<Vec<(Box<str>, u32)>>,
    /// `encode(t, true) == prefix ++ encode(t, false) ++ suffix`, when that decomposition holds.
    special_wrap: Option<(Vec<u32>, Vec<u32>)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model)
            .field("builtin", &matches!(self.backend, Backend::Builtin))
            .finish_non_exhaustive()
    }
}

impl OffsetEncoder for tokenizers::Tokenizer {
    fn encode_with_offsets(&self, text: &str) -> Result<IdsAndOffsets, String> {
        let e = self.encode(text, false).map_err(|e| e.to_string())?;
        Ok((e.get_ids().to_vec(), e.get_offsets().to_vec()))
    }

    fn encode_ids(&self, text: &str) -> Result<Vec<u32>, String> {
        let e = self.encode_fast(text, false).map_err(|e| e.to_string())?;
        Ok(e.get_ids().to_vec())
    }
}

fn read_file(model: &str, path: &Path) -> Result<Vec<u8>, TokenizeError> {
    std::fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            TokenizeError::FileMissing {
                model: model.into(),
                path: path.into(),
            }
        } else {
            TokenizeError::Io {
                model: model.into(),
                path: path.into(),
                detail: e.to_string(),
            }
        }
    })
}

/// Template sources and special tokens from a `tokenizer_config.json` value.
fn parse_config(config: &Json) -> (Vec<(String, String)>, BTreeMap<String, Json>) {
    let token_str = |v: &Json| match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(String::from),
        _ => None,
    };
    let mut specials = BTreeMap::new();
    for key in SPECIAL_TOKEN_KEYS {
        if let Some(s) = config.get(key).and_then(token_str) {
            specials.insert(key.to_string(), Json::String(s));
        }
    }
    if let Some(Json::Array(list)) = config.get("additional_special_tokens") {
        let list: Vec<Json> = list
            .iter()
            .filter_map(token_str)
            .map(Json::String)
            .collect();
        specials.insert("additional_special_tokens".into(), Json::Array(list));
    }
    let templates = match config.get("chat_template") {
        Some(Json::String(s)) => vec![("default".to_string(), s.clone())],
        Some(Json::Array(list)) => list
            .iter()
            .filter_map(|t| {
                Some((
                    t.get("name")?.as_str()?.to_string(),
                    t.get("template")?.as_str()?.to_string(),
                ))
            })
            .collect(),
        _ => Vec::new(),
    };
    (templates, specials)
}

impl Tokenizer {
    /// The built-in pseudo tokenizer (see [`crate::blocks::pseudo_tokens`]).
    pub fn builtin(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            backend: Backend::Builtin,
        }
    }

    /// Builds a tokenizer from a spec. `cache: None` disables the prefix cache.
    pub fn from_spec(
        model: &str,
        spec: &TokenizerSpec,
        cache: Option<CacheConfig>,
    ) -> Result<Self, TokenizeError> {
        let TokenizerSpec::Files {
            tokenizer_json,
            tokenizer_config,
            chat_template,
        } = spec
        else {
            return Ok(Self::builtin(model));
        };
        let bytes = read_file(model, tokenizer_json)?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizeError::BadJson {
                model: model.into(),
                path: tokenizer_json.clone(),
                detail: e.to_string(),
            })?;
        let (mut templates, specials) = match tokenizer_config {
            Some(path) => {
                let bytes = read_file(model, path)?;
                let json: Json =
                    serde_json::from_slice(&bytes).map_err(|e| TokenizeError::BadJson {
                        model: model.into(),
                        path: path.clone(),
                        detail: e.to_string(),
                    })?;
                parse_config(&json)
            }
            None => (Vec::new(), BTreeMap::new()),
        };
        if let Some(path) = chat_template {
            let bytes = read_file(model, path)?;
            let source = String::from_utf8(bytes).map_err(|e| TokenizeError::Io {
                model: model.into(),
                path: path.clone(),
                detail: e.to_string(),
            })?;
            templates = vec![("default".into(), source)];
        }
        let template = if templates.is_empty() {
            None
        } else {
            Some(ChatTemplate::new(templates, specials).map_err(|detail| {
                TokenizeError::TemplateSyntax {
                    model: model.into(),
                    detail,
                }
            })?)
        };
        Self::from_hf(model, inner, template, cache)
    }

    /// Wraps an in-memory `tokenizers::Tokenizer` (truncation and padding are switched off,
    /// as transformers does for an un-truncated `encode`).
    pub fn from_hf(
        model: &str,
        mut inner: tokenizers::Tokenizer,
        template: Option<ChatTemplate>,
        cache: Option<CacheConfig>,
    ) -> Result<Self, TokenizeError> {
        let encode_err = |e: tokenizers::Error| TokenizeError::Encode {
            model: model.into(),
            detail: e.to_string(),
        };
        inner.with_truncation(None).map_err(encode_err)?;
        inner.with_padding(None);
        let mut added_by_first_byte: Vec<Vec<(Box<str>, u32)>> = vec![Vec::new(); 256];
        for (id, tok) in inner.get_added_tokens_decoder() {
            if tok.normalized || tok.single_word || tok.content.is_empty() {
                continue;
            }
            let first = tok.content.as_bytes()[0] as usize;
            added_by_first_byte[first].push((tok.content.as_str().into(), id));
        }
        for list in &mut added_by_first_byte {
            list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        let special_wrap = probe_special_wrap(&inner);
        Ok(Self {
            model: model.into(),
            backend: Backend::Hf(Box::new(HfBackend {
                inner,
                template,
                cache: cache.map(PrefixCache::new),
                added_by_first_byte,
                special_wrap,
            })),
        })
    }

    /// The model this tokenizer serves.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether this is the built-in pseudo tokenizer.
    pub fn is_builtin(&self) -> bool {
        matches!(self.backend, Backend::Builtin)
    }

    /// The chat template, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        match &self.backend {
            Backend::Hf(hf) => hf.template.as_ref(),
            Backend::Builtin => None,
        }
    }

    /// Prefix-cache counters (zero when there is no cache).
    pub fn cache_stats(&self) -> CacheStats {
        match &self.backend {
            Backend::Hf(hf) => hf
                .cache
                .as_ref()
                .map(PrefixCache::stats)
                .unwrap_or_default(),
            Backend::Builtin => CacheStats::default(),
        }
    }

    /// The token ids vLLM computes for this request's (first) prompt.
    pub fn request_tokens(&self, req: &RoutingRequest) -> Result<Vec<u32>, TokenizeError> {
        if let Prompt::Tokens(ids) = &req.prompt {
            return Ok(ids.clone());
        }
        if self.is_builtin() {
            return Ok(match &req.prompt {
                Prompt::Text(t) => pseudo_tokens(t.as_bytes()),
                _ => Vec::new(),
            });
        }
        match req.api {
            Api::ChatCompletions => {
                let chat = req.chat.as_ref().ok_or(TokenizeError::MissingChatInput)?;
                let text = self.render_chat(chat)?;
                self.encode(&text, false)
            }
            _ => match &req.prompt {
                Prompt::Text(t) => self.encode(t, true),
                _ => Ok(Vec::new()),
            },
        }
    }

    /// Renders a chat conversation with the model's template.
    pub fn render_chat(&self, chat: &ChatInput) -> Result<String, TokenizeError> {
        let template = self
            .chat_template()
            .ok_or_else(|| TokenizeError::NoChatTemplate {
                model: self.model.clone(),
            })?;
        template
            .render(chat)
            .map_err(|detail| TokenizeError::Render {
                model: self.model.clone(),
                detail,
            })
    }

    /// Encodes text, using the prefix cache when configured. Always equal to
    /// [`Tokenizer::encode_uncached`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let hf = match &self.backend {
            Backend::Builtin => return Ok(pseudo_tokens(text.as_bytes())),
            Backend::Hf(hf) => hf,
        };
        let Some(cache) = &hf.cache else {
            return self.encode_uncached(text, add_special_tokens);
        };
        let wrap = if add_special_tokens {
            match &hf.special_wrap {
                Some(w) => Some(w),
                None => return self.encode_uncached(text, true),
            }
        } else {
            None
        };
        let checkpoints = hf.checkpoints(text);
        let ids = cache
            .encode(&hf.inner, text, &checkpoints)
            .map_err(|detail| self.encode_error(detail))?;
        Ok(match wrap {
            Some((pre, post)) => {
                let mut out = Vec::with_capacity(pre.len() + ids.len() + post.len());
                out.extend_from_slice(pre);
                out.extend_from_slice(&ids);
                out.extend_from_slice(post);
                out
            }
            None => ids,
        })
    }

    /// Encodes text without the prefix cache.
    pub fn encode_uncached(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        match &self.backend {
            Backend::Builtin => Ok(pseudo_tokens(text.as_bytes())),
            Backend::Hf(hf) => hf
                .inner
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| self.encode_error(e.to_string())),
        }
    }

    fn encode_error(&self, detail: String) -> TokenizeError {
        TokenizeError::Encode {
            model: self.model.clone(),
            detail,
        }
    }
}

impl HfBackend {
    /// Verbatim added-token occurrences, leftmost-longest, non-overlapping.
    fn checkpoints(&self, text: &str) -> Vec<Checkpoint> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            let candidates = &self.added_by_first_byte[bytes[i] as usize];
            if let Some((tok, id)) = candidates
                .iter()
                .find(|(tok, _)| bytes[i..].starts_with(tok.as_bytes()))
            {
                out.push(Checkpoint {
                    start: i,
                    end: i + tok.len(),
                    id: *id,
                });
                i += tok.len();
            } else {
                i += 1;
            }
        }
        out
    }
}

/// Finds `(prefix, suffix)` such that `encode(t, true) == prefix ++ encode(t, false) ++ suffix`
/// on probe texts (BOS/EOS templates); `None` if the post-processor does anything else.
fn probe_special_wrap(tok: &tokenizers::Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
    for probe in ["Hello world", "a", " x\ny 12"] {
        let with = tok.encode_fast(probe, true).ok()?.get_ids().to_vec();
        let without = tok.encode_fast(probe, false).ok()?.get_ids().to_vec();
        if without.is_empty() || with.len() < without.len() {
            return None;
        }
        let pos = (0..=with.len() - without.len())
            .find(|&p| with[p..p + without.len()] == without[..])?;
        let wrap = (with[..pos].to_vec(), with[pos + without.len()..].to_vec());
        match &found {
            Some(f) if *f != wrap => return None,
            _ => found = Some(wrap),
        }
    }
    found
}

/// Model name → tokenizer.
#[derive(Debug, Default, Clone)]
pub struct TokenizerRegistry {
    models: HashMap<String, Arc<Tokenizer>>,
}

impl TokenizerRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds every spec; the first failure is returned (it names its model).
    pub fn from_specs<'a, I>(specs: I, cache: Option<CacheConfig>) -> Result<Self, TokenizeError>
    where
        I: IntoIterator<Item = (&'a str, &'a TokenizerSpec)>,
    {
        let mut reg = Self::new();
        for (model, spec) in specs {
            reg.insert(Arc::new(Tokenizer::from_spec(model, spec, cache)?));
        }
        Ok(reg)
    }

    /// Adds (or replaces) a tokenizer under its model name.
    pub fn insert(&mut self, tokenizer: Arc<Tokenizer>) {
        self.models.insert(tokenizer.model.clone(), tokenizer);
    }

    /// The tokenizer for a model.
    pub fn get(&self, model: &str) -> Option<&Arc<Tokenizer>> {
        self.models.get(model)
    }

    /// Model names, unordered.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }

    /// Number of models.
    pub fn len(&self) -> usize {
        self.models.len()
    }

    /// Whether no model is registered.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// Tokenizes a request with its model's tokenizer.
    pub fn request_tokens(&self, req: &RoutingRequest) -> Result<Vec<u32>, TokenizeError> {
        let model = req.model.as_deref().unwrap_or("");
        self.get(model)
            .ok_or_else(|| TokenizeError::UnknownModel(model.into()))?
            .request_tokens(req)
    }
}

#[cfg(test)]
mod tests;
