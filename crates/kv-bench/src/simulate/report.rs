//! The simulation's tables: setup, strategies, KV-event figures, capacity plan.

use std::fmt::Write as _;

use super::super::table::{Style, Table};
use super::capacity::{PlanOutcome, LEVEL_OFF};
use super::SimulateReport;

fn fmt_ms(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v >= 10_000.0 {
        format!("{:.1} s", v / 1e3)
    } else {
        format!("{v:.0} ms")
    }
}

impl SimulateReport {
    /// The report as markdown: setup, strategy table, capacity plan (the caller adds a heading).
    pub fn markdown(&self) -> String {
        self.render(Style::Markdown)
    }

    /// The report as aligned plain text.
    pub fn plain(&self) -> String {
        self.render(Style::Plain)
    }

    fn render(&self, style: Style) -> String {
        let p = &self.params;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "Trace {}: {} requests arriving over {:.0} s (speedup {}), mean prompt {:.0} tokens, \
             output x{}. Fleet: {} pods x {} blocks of {} tokens, max_num_seqs {}, prefill {} us/token, \
             decode {} ms/token, TTFT base {} ms; scrape every {} ms, KV events after {} ms; seed {}.",
            self.trace,
            self.requests,
            self.arrival_span_s,
            p.speedup,
            self.mean_prompt_tokens,
            p.output_scale,
            self.pods,
            p.gpu_blocks,
            p.block_tokens,
            p.max_num_seqs,
            p.prefill_us_per_token,
            p.decode_ms_per_token,
            p.ttft_base_ms,
            p.scrape_interval_ms,
            p.event_delay_ms,
            p.seed
        );
        let d = &p.divergence;
        if d.any() {
            let restarts = d
                .restart_every_s
                .map_or("none".to_string(), |s| format!("one pod every {s} s"));
            let _ = writeln!(
                out,
                "\nDivergence: {:.0} % of requests bypass the router to a random pod; restarts: \
                 {restarts}; the router is told {}x each pod's real KV size; {} pods publish no \
                 removals. Hit ratios count every request, routed or not.",
                100.0 * d.bypass,
                d.capacity_belief,
                d.lost_removals
            );
        }
        let _ = writeln!(
            out,
            "\nOracles: infinite cache {:.3}, pooled LRU of the fleet ({} blocks) {:.3}.\n",
            self.oracles.infinite.ratio(),
            self.oracles.pooled_blocks,
            self.oracles.pooled.ratio()
        );
        // Replica columns only when some run had several replicas.
        let replicated = self.strategies.iter().any(|r| r.replication.replicas > 1);
        let mut header = vec!["strategy"];
        if replicated {
            header.extend(["replicas", "delay"]);
        }
        header.extend([
            "hit ratio",
            "/ infinite",
            "/ pooled",
            "TTFT p50",
            "TTFT p90",
            "TTFT p99",
            "E2E p50",
            "E2E p99",
            "hotspot",
            "work hotspot",
            "req/pod min-max",
            "all gated",
            "sim speed",
        ]);
        let mut table = Table::new(header);
        for r in &self.strategies {
            let min = r.per_pod.iter().min().copied().unwrap_or(0);
            let max = r.per_pod.iter().max().copied().unwrap_or(0);
            let mut row = vec![r.strategy.as_str().to_string()];
            if replicated {
                let how = &r.replication;
                row.push(how.replicas.to_string());
                row.push(if how.replicas < 2 {
                    "-".into()
                } else if how.propagation_ms / 1e3 > self.arrival_span_s {
                    // Past the last arrival: replicas that never share.
                    "never".into()
                } else {
                    match how.charge_ms {
                        Some(c) => format!("{} ms (load {c} ms)", how.propagation_ms),
                        None => format!("{} ms", how.propagation_ms),
                    }
                });
            }
            row.extend([
                format!("{:.3}", r.hit_ratio),
                format!("{:.2}", r.vs_infinite),
                r.vs_pooled.map_or("-".into(), |v| format!("{v:.2}")),
                fmt_ms(r.ttft_p50_ms),
                fmt_ms(r.ttft_p90_ms),
                fmt_ms(r.ttft_p99_ms),
                fmt_ms(r.e2e_p50_ms),
                fmt_ms(r.e2e_p99_ms),
                format!("{:.2}", r.hotspot),
                format!("{:.2}", r.work_hotspot),
                format!("{min}-{max}"),
                format!("{}", r.all_saturated),
                format!("{:.0}x", r.timing.speed),
            ]);
            table.row(row);
        }
        out.push_str(&table.render(style));
        if replicated {
            let _ = writeln!(
                out,
                "\nReplicas: request i goes to replica i mod N; each decides on its own index and \
                 state, and applies the others' records `delay` later."
            );
        }
        self.write_rates(&mut out);
        if p.adapters > 0 || p.prefill_pods > 0 {
            let _ = writeln!(
                out,
                "\nWorkload: {} LoRA adapter(s), {} slot(s) per pod; {} prefill pod(s). Per strategy:",
                p.adapters, p.adapter_slots, p.prefill_pods
            );
            for r in &self.strategies {
                let _ = writeln!(
                    out,
                    "- {}: {} request(s) prefilled on a prefill pod, {} adapter load(s)",
                    r.strategy.as_str(),
                    r.disaggregated,
                    r.adapter_loads
                );
            }
        }
        let slow = p.slow_pods.min(self.pods);
        if slow > 0 && slow < self.pods {
            let _ = writeln!(
                out,
                "\nThe first {slow} pod(s) prefill {}x slower; their share of requests (even: {:.1} %):",
                p.slow_factor,
                100.0 * slow as f64 / self.pods as f64
            );
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
            for r in &self.strategies {
                let total: usize = r.per_pod.iter().sum();
                let theirs: usize = r.per_pod.iter().take(slow).sum();
                let learned = &r.learned_tokens_per_sec;
                let _ = writeln!(
                    out,
                    "- {}: {:.1} % (learned prefill speed: slow pods {:.0}, others {:.0} tokens/s)",
                    r.strategy.as_str(),
                    100.0 * theirs as f64 / total.max(1) as f64,
                    mean(&learned[..slow.min(learned.len())]),
                    mean(&learned[slow.min(learned.len())..]),
                );
            }
        }
        for r in &self.strategies {
            if let Some(k) = &r.kv_events {
                let _ = writeln!(
                    out,
                    "\n{}: KV events applied: {} blocks stored, {} removed, {} with an unknown parent.",
                    r.strategy.as_str(),
                    k.stored,
                    k.removed,
                    k.unknown_parent
                );
            }
        }
        if let Some(c) = &self.capacity {
            let o = &c.options;
            let _ = writeln!(
                out,
                "\nCapacity plan ({}, TTFT p{} <= {:.0} ms):\n",
                o.strategy.as_str(),
                o.percentile,
                o.ttft_target_ms
            );
            let ttft_col = format!("TTFT p{}", o.percentile);
            let header = [
                "pods",
                ttft_col.as_str(),
                "TTFT p99",
                "hit ratio",
                "hotspot",
                "meets",
            ];
            let mut table = Table::new(header);
            for pt in &c.points {
                table.row(vec![
                    pt.pods.to_string(),
                    fmt_ms(pt.ttft_ms),
                    fmt_ms(pt.ttft_p99_ms),
                    format!("{:.3}", pt.hit_ratio),
                    format!("{:.2}", pt.hotspot),
                    if pt.meets { "yes" } else { "no" }.into(),
                ]);
            }
            out.push_str(&table.render(style));
            let goal = format!(
                "TTFT p{} <= {:.0} ms with {}",
                o.percentile,
                o.ttft_target_ms,
                o.strategy.as_str()
            );
            let last = c.points.last();
            let _ = match (c.outcome, c.answer, last) {
                (PlanOutcome::Met, Some(n), _) => writeln!(out, "\nAnswer: {n} pods meet {goal}."),
                (PlanOutcome::LevelledOff, _, Some(pt)) => writeln!(
                    out,
                    "\nAnswer: no fleet size meets {goal}: from {} pods on the percentile levels \
                     off near {} (more pods gain under {:.0}%; prefill time dominates).",
                    pt.pods,
                    fmt_ms(pt.ttft_ms),
                    LEVEL_OFF * 100.0
                ),
                _ => writeln!(out, "\nAnswer: none of {:?} pods meets {goal}.", o.pods),
            };
        }
        let _ = writeln!(
            out,
            "\nSimulated on {} threads in {:.1} s.",
            self.threads, self.wall_s
        );
        out
    }
}

impl SimulateReport {
    /// Index records each replica publishes at the trace's arrival rate, once per strategy and
    /// replica count (the delay does not change it by much): what sizes the shared stream.
    fn write_rates(&self, out: &mut String) {
        let span = self.arrival_span_s.max(1e-9);
        let mut seen: Vec<(&str, usize)> = Vec::new();
        for r in &self.strategies {
            let key = (r.strategy.as_str(), r.replication.replicas);
            if r.writes.records == 0 || r.replication.replicas < 2 || seen.contains(&key) {
                continue;
            }
            seen.push(key);
            let n = r.replication.replicas as f64;
            let _ = writeln!(
                out,
                "\n{} x{}: each replica publishes {:.2} records/s, {:.0} block keys/s \
                 ({:.0} keys per record; the fleet {:.2} records/s).",
                key.0,
                key.1,
                r.writes.records as f64 / n / span,
                r.writes.blocks as f64 / n / span,
                r.writes.blocks as f64 / r.writes.records as f64,
                r.writes.records as f64 / span,
            );
        }
    }
}
