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
            at_us: {
                let mut at: Vec<u64> = recs
                    .iter()
                    .map(|r| (r.timestamp as f64 * 1e3 / opts.speedup).round() as u64)
                    .collect();
                if opts.spread_clumps {
                    spread_clumps(&mut at);
                }
                at
            },
            tokens,
            oracle,
            max_tokens: recs
                .iter()
                .map(|r| ((f64::from(r.output_length) * opts.output_scale).round() as u32).max(1))
                .collect(),
        }
    }
}

/// Arrivals that share one instant (`at_us`, ascending) spread evenly from it until the next
/// distinct instant; a clump at the end spreads over one millisecond.
pub(super) fn spread_clumps(at_us: &mut [u64]) {
    let mut i = 0;
    while i < at_us.len() {
        let t = at_us[i];
        let end = i + at_us[i..].iter().take_while(|&&a| a == t).count();
        let next = at_us.get(end).copied().unwrap_or(t + 1_000);
        let k = (end - i) as u64;
        for (n, a) in (0u64..).zip(&mut at_us[i..end]) {
            *a = t + (next - t) * n / k;
        }
        i = end;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn clumps_spread_evenly_until_the_next_arrival() {
        let mut at = vec![0, 0, 0, 3_000, 3_000, 4_000, 9_000, 9_000];
        super::spread_clumps(&mut at);
        assert_eq!(at, vec![0, 1_000, 2_000, 3_000, 3_500, 4_000, 9_000, 9_500]);
        let mut none: Vec<u64> = vec![];
        super::spread_clumps(&mut none);
    }
}
