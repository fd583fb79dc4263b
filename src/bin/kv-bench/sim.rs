//! The parts of `vllm-sim` the fleet simulation and the oracles reuse, mounted from its files:
//! the engine with its cache and hashing, the cache-event translation, the OpenAI request
//! reading. Only part of them is live here; vllm-sim's own build, which uses them all, is where
//! rustc checks these files for dead code.
#![allow(dead_code)]

#[path = "../../sim/cache.rs"]
pub mod cache;
#[path = "../../sim/engine.rs"]
pub mod engine;
#[path = "../../sim/openai.rs"]
pub mod openai;
#[path = "../../sim/translate.rs"]
pub mod translate;
#[path = "../../sim/vllm_hash.rs"]
pub mod vllm_hash;
