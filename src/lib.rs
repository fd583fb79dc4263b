//! kv-router: an Envoy ext_proc endpoint picker that sends each LLM request to the vLLM pod
//! whose KV cache already holds the most of its prompt, without letting any pod drown.
//!
//! ```text
//! ext_proc stream ─► request (parse) ─► blocks (keys) ─► index (lookup) ─► scoring ─► picker ─► reply
//!                                                             ▲                       │
//!                                                             └── record decision ◄───┘
//! ```
//! Only [`decide`] calls the stages in order; only [`app`] constructs them.

pub(crate) mod admin;
pub mod app;
pub mod blocks;
pub mod config;
pub mod decide;
pub mod events;
pub mod extproc;
pub mod index;
pub mod keys;
pub(crate) mod pick_api;
pub mod picker;
pub mod pods;
pub mod request;
pub mod scoring;
pub mod telemetry;
pub mod tokenize;
