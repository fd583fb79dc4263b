//! The prefill/decode view of a comparison (`kv-bench compare --pd-prefill N`): the same fleet
//! of `prefill`- and `decode`-role vllm-sim pods serves every strategy; only `pd` and
//! `precise-pd` route by roles. A decode pod counts the blocks it received as cached, so the
//! clients' `cached_tokens` overstate a P/D run's hits: this view counts, from every pod's own
//! counters over exactly the run, the prompt tokens the fleet computed, wherever that was.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use super::report::percentile;
use kv_testkit::runner::{self, RunResult};

/// Pod counters summed over the fleet (or their change over one run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PodWork {
    /// Prompt tokens looked up in a prefix cache (`vllm:prefix_cache_queries`), every pod.
    pub queries: f64,
    /// Of those, found (`vllm:prefix_cache_hits`), every pod.
    pub hits: f64,
    /// Lookups on the prefill-role pods only.
    pub prefill_queries: f64,
    /// Hits on the prefill-role pods only.
    pub prefill_hits: f64,
    /// Remote prefills that worked (decode pods).
    pub remote_ok: f64,
    /// Remote prefills that failed, the decode pod prefilling itself.
    pub remote_failed: f64,
    /// KV blocks transferred from prefill to decode pods.
    pub transfer_blocks: f64,
}

/// Σ of every sample of `name` (any labels) in a Prometheus text.
fn sum_of(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let rest = match rest.as_bytes().first() {
                Some(b'{') => &rest[rest.find('}')? + 1..],
                Some(b' ') => rest,
                _ => return None,
            };
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// The value of `name` on samples whose labels contain `label`.
fn labelled(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

impl PodWork {
    /// One pod's counters from its `/metrics` text.
    pub fn of_pod(text: &str, prefill_role: bool) -> Self {
        let queries = sum_of(text, "vllm:prefix_cache_queries_total");
        let hits = sum_of(text, "vllm:prefix_cache_hits_total");
        let (pq, ph) = if prefill_role {
            (queries, hits)
        } else {
            (0.0, 0.0)
        };
        let remote = "vllm_sim:remote_prefills_total";
        Self {
            queries,
            hits,
            prefill_queries: pq,
            prefill_hits: ph,
            remote_ok: labelled(text, remote, "outcome=\"ok\""),
            remote_failed: labelled(text, remote, "outcome=\"failed\""),
            transfer_blocks: sum_of(text, "vllm_sim:kv_transfer_blocks_total"),
        }
    }

    fn zip(self, o: Self, f: impl Fn(f64, f64) -> f64) -> Self {
        Self {
            queries: f(self.queries, o.queries),
            hits: f(self.hits, o.hits),
            prefill_queries: f(self.prefill_queries, o.prefill_queries),
            prefill_hits: f(self.prefill_hits, o.prefill_hits),
            remote_ok: f(self.remote_ok, o.remote_ok),
            remote_failed: f(self.remote_failed, o.remote_failed),
            transfer_blocks: f(self.transfer_blocks, o.transfer_blocks),
        }
    }

    /// What changed since `before`.
    pub fn since(self, before: Self) -> Self {
        self.zip(before, |a, b| (a - b).max(0.0))
    }

    /// Prompt tokens computed anywhere in the fleet.
    pub fn computed(&self) -> f64 {
        (self.queries - self.hits).max(0.0)
    }
}

/// Every pod's counters, summed; `pods` = (address, is a prefill-role pod).
pub async fn scrape(pods: &[(SocketAddr, bool)]) -> Result<PodWork> {
    let client = runner::client();
    let mut total = PodWork::default();
    for &(addr, prefill) in pods {
        let text = client
            .get(format!("http://{addr}/metrics"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .with_context(|| format!("GET http://{addr}/metrics"))?
            .text()
            .await
            .with_context(|| format!("reading http://{addr}/metrics"))?;
        total = total.zip(PodWork::of_pod(&text, prefill), |a, b| a + b);
    }
    Ok(total)
}

/// Each request's mean inter-token latency, ms: (e2e − TTFT) over the tokens after the first.
pub fn itls_ms(run: &RunResult) -> Vec<f64> {
    run.records
        .iter()
        .filter(|r| r.error.is_none())
        .filter_map(|r| {
            let n = r.completion_tokens.filter(|&n| n >= 2)?;
            Some((r.e2e_ms - r.ttft_ms?).max(0.0) / (n - 1) as f64)
        })
        .collect()
}

/// One run's row of the P/D table.
#[derive(Debug, Clone, Serialize)]
pub struct PdRow {
    /// Run label.
    pub label: String,
    /// TTFT p50 / p99, ms.
    pub ttft_p50_ms: f64,
    /// p99 TTFT, ms.
    pub ttft_p99_ms: f64,
    /// Inter-token latency p50 / p99 over requests, ms.
    pub itl_p50_ms: f64,
    /// p99 ITL, ms.
    pub itl_p99_ms: f64,
    /// 1 − prompt tokens computed anywhere / prompt tokens sent.
    pub fleet_hit: f64,
    /// `fleet_hit` over the pooled oracle's hit ratio.
    pub of_pooled: f64,
    /// Hits / lookups on the prefill-role pods (NaN: none looked up).
    pub prefill_pod_hit: f64,
    /// Requests prefilled on a prefill pod, share of requests.
    pub disaggregated: f64,
    /// KV blocks transferred per request.
    pub transfer_blocks_per_req: f64,
    /// Remote prefills that failed.
    pub remote_failed: f64,
    /// Failed requests.
    pub errors: usize,
}

impl PdRow {
    /// The row of `run`, whose pods did `work`, against the pooled oracle's hit ratio.
    pub fn of(label: &str, run: &RunResult, work: &PodWork, pooled: f64) -> Self {
        let ok: Vec<_> = run.records.iter().filter(|r| r.error.is_none()).collect();
        let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        let mut itl = itls_ms(run);
        let prompt: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
        let fleet_hit = if prompt == 0 {
            f64::NAN
        } else {
            1.0 - work.computed() / prompt as f64
        };
        let n = run.records.len().max(1) as f64;
        Self {
            label: label.to_string(),
            ttft_p50_ms: percentile(&mut ttft, 50.0),
            ttft_p99_ms: percentile(&mut ttft, 99.0),
            itl_p50_ms: percentile(&mut itl, 50.0),
            itl_p99_ms: percentile(&mut itl, 99.0),
            fleet_hit,
            of_pooled: fleet_hit / pooled,
            prefill_pod_hit: work.prefill_hits / work.prefill_queries,
            disaggregated: work.remote_ok / n,
            transfer_blocks_per_req: work.transfer_blocks / n,
            remote_failed: work.remote_failed,
            errors: run.records.len() - ok.len(),
        }
    }
}

/// The P/D table (Markdown), then each strategy's medians when a strategy ran more than once.
pub fn table(rows: &[PdRow]) -> String {
    let mut out = String::from(
        "| run | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | fleet prefix hits | of pooled | \
         prefill pods' hits | disaggregated | KV blocks moved / req | remote prefill failed | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let pct = |v: f64| {
        if v.is_finite() {
            format!("{:.1} %", v * 100.0)
        } else {
            "–".into()
        }
    };
    let line = |r: &PdRow| {
        format!(
            "| {} | {:.0} ms | {:.0} ms | {:.2} ms | {:.2} ms | {} | {} | {} | {} | {:.1} | {:.0} | {} |\n",
            r.label,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.itl_p99_ms,
            pct(r.fleet_hit),
            pct(r.of_pooled),
            pct(r.prefill_pod_hit),
            pct(r.disaggregated),
            r.transfer_blocks_per_req,
            r.remote_failed,
            r.errors
        )
    };
    for r in rows {
        out.push_str(&line(r));
    }
    let mut names: Vec<&str> = Vec::new();
    for r in rows {
        let base = base_label(&r.label);
        if !names.contains(&base) {
            names.push(base);
        }
    }
    let medians: Vec<PdRow> = names
        .iter()
        .filter_map(|name| {
            let of: Vec<&PdRow> = rows
                .iter()
                .filter(|r| base_label(&r.label) == *name)
                .collect();
            (of.len() > 1).then(|| median_row(name, &of))
        })
        .collect();
    if !medians.is_empty() {
        out.push_str("| **medians** | | | | | | | | | | | |\n");
        for r in &medians {
            out.push_str(&line(r));
        }
    }
    out
}

/// `weighted #2` → `weighted`.
fn base_label(label: &str) -> &str {
    label.split(" #").next().unwrap_or(label)
}

fn median_row(name: &str, rows: &[&PdRow]) -> PdRow {
    let m = |f: &dyn Fn(&PdRow) -> f64| {
        let mut v: Vec<f64> = rows
            .iter()
            .map(|r| f(r))
            .filter(|x| x.is_finite())
            .collect();
        percentile(&mut v, 50.0)
    };
    PdRow {
        label: format!("{name} (median of {})", rows.len()),
        ttft_p50_ms: m(&|r| r.ttft_p50_ms),
        ttft_p99_ms: m(&|r| r.ttft_p99_ms),
        itl_p50_ms: m(&|r| r.itl_p50_ms),
        itl_p99_ms: m(&|r| r.itl_p99_ms),
        fleet_hit: m(&|r| r.fleet_hit),
        of_pooled: m(&|r| r.of_pooled),
        prefill_pod_hit: m(&|r| r.prefill_pod_hit),
        disaggregated: m(&|r| r.disaggregated),
        transfer_blocks_per_req: m(&|r| r.transfer_blocks_per_req),
        remote_failed: m(&|r| r.remote_failed),
        errors: rows.iter().map(|r| r.errors).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_testkit::runner::RequestRecord;

    const DECODE: &str = "vllm:prefix_cache_queries_total{model_name=\"m\"} 1000.0\n\
        vllm:prefix_cache_hits_total{model_name=\"m\"} 960.0\n\
        vllm_sim:remote_prefills_total{outcome=\"ok\"} 3.0\n\
        vllm_sim:remote_prefills_total{outcome=\"failed\"} 1.0\n\
        vllm_sim:kv_transfer_blocks_total{} 40.0\n";
    const PREFILL: &str = "# HELP vllm:prefix_cache_queries_total x\n\
        vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 900.0\n\
        vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 300.0\n\
        vllm:prefix_cache_hits_total_created{model_name=\"m\"} 5.0\n";

    #[test]
    fn pod_counters_sum_by_role_and_subtract() {
        let d = PodWork::of_pod(DECODE, false);
        let p = PodWork::of_pod(PREFILL, true);
        assert_eq!((d.queries, d.hits, d.prefill_queries), (1000.0, 960.0, 0.0));
        assert_eq!(
            (d.remote_ok, d.remote_failed, d.transfer_blocks),
            (3.0, 1.0, 40.0)
        );
        assert_eq!(
            (p.prefill_queries, p.prefill_hits),
            (900.0, 300.0),
            "no _created"
        );
        let fleet = d.zip(p, |a, b| a + b);
        // The fleet computed 40 tokens on the decode pod and 600 on the prefill pod.
        assert_eq!(fleet.computed(), 640.0);
        assert_eq!(fleet.since(d).queries, 900.0);
        assert_eq!(
            d.since(fleet).queries,
            0.0,
            "a counter reset reads as no work"
        );
    }

    fn record(ttft: f64, e2e: f64, completion: u64, prompt: u64) -> RequestRecord {
        RequestRecord {
            session: "s".into(),
            turn: 0,
            start_ms: 0.0,
            headers_ms: None,
            ttft_ms: Some(ttft),
            e2e_ms: e2e,
            status: Some(200),
            error: None,
            prompt_tokens: Some(prompt),
            cached_tokens: Some(prompt),
            completion_tokens: Some(completion),
            pod: None,
        }
    }

    fn run(records: Vec<RequestRecord>) -> RunResult {
        RunResult {
            label: "x".into(),
            workload: "w".into(),
            description: String::new(),
            target: String::new(),
            duration_s: 1.0,
            records,
            sent: Vec::new(),
        }
    }

    #[test]
    fn a_row_counts_computed_tokens_not_the_clients_cached_tokens() {
        // 11 tokens in 100 ms after the first: 10 ms apart; a one-token answer has no ITL.
        let r = run(vec![
            record(50.0, 150.0, 11, 1000),
            record(20.0, 20.0, 1, 600),
        ]);
        assert_eq!(itls_ms(&r), vec![10.0]);
        let work = PodWork {
            queries: 2600.0,
            hits: 1600.0,
            prefill_queries: 1000.0,
            prefill_hits: 200.0,
            remote_ok: 1.0,
            transfer_blocks: 50.0,
            ..PodWork::default()
        };
        let row = PdRow::of("pd #1", &r, &work, 0.5);
        // 1,000 of 1,600 prompt tokens computed, though the clients were told all were cached.
        assert!((row.fleet_hit - 0.375).abs() < 1e-9);
        assert!((row.of_pooled - 0.75).abs() < 1e-9);
        assert!((row.prefill_pod_hit - 0.2).abs() < 1e-9);
        assert_eq!(
            (row.disaggregated, row.transfer_blocks_per_req),
            (0.5, 25.0)
        );
        let mut second = row.clone();
        second.label = "pd #2".into();
        second.ttft_p99_ms = 90.0;
        let t = table(&[row, second]);
        assert!(t.contains("| pd (median of 2) |"), "{t}");
        assert!(t.contains("| pd #1 | 20 ms | 50 ms | 10.00 ms"), "{t}");
    }
}
