//! The trace turned into what pods and router need (prompt tokens, block keys, arrival times),
//! once for every run, expansion and hashing split across the worker threads.

use kv_router::blocks::{namespace_seed, token_keys};

use super::super::oracle::OracleRequest;
use super::options::{SimulateOptions, BLOCK_TOKENS, MODEL};
use kv_testkit::trace::{Expansion, Trace};

/// The trace turned into what pods and router need, computed once and shared by every run.
pub(super) struct Prepared {
    /// Arrival, virtual µs.
    pub(super) at_us: Vec<u64>,
    /// Prompt token ids.
    pub(super) tokens: Vec<Vec<u32>>,
    /// Full-block keys (the pods' keys) and prompt size.
    pub(super) oracle: Vec<OracleRequest>,
    /// Tokens to generate.
    pub(super) max_tokens: Vec<u32>,
}

impl Prepared {
    pub(super) fn new(trace: &Trace, opts: &SimulateOptions, threads: usize) -> Self {
        let seed = namespace_seed(MODEL, None);
        let exp = Expansion::default();
        let recs = &trace.records;
        let chunk = recs.len().div_ceil(threads.max(1)).max(1);
        // Expansion and hashing dominate preparation: split them across the workers.
        let parts: Vec<Vec<(Vec<u32>, OracleRequest)>> = std::thread::scope(|s| {
            let handles: Vec<_> = recs
                .chunks(chunk)
                .map(|part| {
                    s.spawn(move || {
                        part.iter()
                            .map(|r| {
                                let tokens = exp.prompt(r);
                                let keys = token_keys(seed, &tokens, BLOCK_TOKENS, usize::MAX);
                                let prompt_tokens = tokens.len() as u64;
                                (
                                    tokens,
                                    OracleRequest {
                                        keys,
                                        prompt_tokens,
                                    },
                                )
                            })
                            .collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("expansion thread panicked"))
                .collect()
        });
        let (tokens, oracle) = parts.into_iter().flatten().unzip();
        Self {
            at_us: trace.arrivals_us(opts.speedup, opts.spread_clumps),
            tokens,
            oracle,
            max_tokens: recs
                .iter()
                .map(|r| ((f64::from(r.output_length) * opts.output_scale).round() as u32).max(1))
                .collect(),
        }
    }
}
