//! kv-router: an Envoy ext_proc endpoint picker that sends each LLM request to the vLLM pod
//! whose KV cache already holds the most of its prompt, without letting any pod drown.
//!
//! ```text
//! ext_proc stream ─► request (parse) ─► blocks (keys) ─► index (lookup) ─► scoring ─► picker ─► reply
//!                                                             ▲                       │
//!                                                             └── record decision ◄───┘
//! ```
//! Only [`decide`] calls the stages in order; only [`app`] constructs them.

pub mod admin;
pub mod app;
/// kv-bench harness (deployments, workloads, runner, reports); not part of the router itself.
pub mod bench;
pub mod blocks;
pub mod config;
pub mod decide;
pub mod events;
pub mod extproc;
pub mod index;
mod ingest;
pub mod keys;
pub mod pick_api;
pub mod picker;
pub mod pods;
pub mod request;
pub mod scoring;
pub mod sim;
pub mod telemetry;
pub mod tokenize;
