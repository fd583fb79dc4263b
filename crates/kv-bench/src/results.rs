//! The results document (`docs/results.md` + `docs/images/*.svg` + `results.json`): sections,
//! each headed by the exact command that produced it, and the machine they ran on.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::charts;
use super::compare::Comparison;
use super::report;
use super::table::Style;

/// One chart of a section.
#[derive(Debug, Clone, Serialize)]
pub struct Chart {
    /// File name under `images/`.
    pub file: String,
    /// Alt text / caption.
    pub alt: String,
    /// The SVG document.
    #[serde(skip)]
    pub svg: String,
}

/// One section of the results document.
#[derive(Debug, Clone, Serialize)]
pub struct Section {
    /// Heading.
    pub title: String,
    /// The `kv-bench …` command that produced it.
    pub command: String,
    /// Markdown body (tables, notes).
    pub body: String,
    /// Per-replica detail that `results-details.md` holds instead (empty: none); the body links it.
    #[serde(skip)]
    pub detail: String,
    /// Charts shown under the body.
    pub charts: Vec<Chart>,
    /// Machine-readable results.
    pub json: serde_json::Value,
    /// Wall time of the command, seconds.
    pub seconds: f64,
}

/// The machine a report ran on, one line.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    format!("{cpu}, {cores} cores, {mem_gib:.0} GiB RAM, Linux {kernel}")
}

/// The section of a strategy comparison: table, skipped strategies, three charts; `pooled`: the
/// goal judged over the rounds on record (`compare --pool`), under this invocation's verdict.
pub fn comparison_section(
    title: &str,
    slug: &str,
    command: &str,
    cmp: &Comparison,
    seconds: f64,
    pooled: &str,
) -> Result<Section> {
    let summaries = cmp.summaries();
    let mut body = format!("{}\n\n", cmp.workload_line());
    body.push_str(&report::table(&summaries, Style::Markdown));
    if let Some(spread) = report::spread_table(&summaries, Style::Markdown) {
        body.push_str("\nMedian (min–max) of each strategy's runs:\n\n");
        body.push_str(&spread);
    }
    if let Some(paired) = crate::paired::paired_table(&summaries, Style::Markdown) {
        body.push_str(
            "\nEach strategy against the baseline run in the same round (95 % intervals from \
             Student's t over the rounds; an interval that holds 0 does not rank the two):\n\n",
        );
        body.push_str(&paired);
        let verdicts = cmp.shared_index_verdicts();
        if !verdicts.is_empty() {
            body.push('\n');
            body.push_str(&verdicts);
        }
        if !pooled.is_empty() {
            body.push('\n');
            body.push_str(pooled);
        }
    }
    let note = cmp.skipped_note();
    if !note.is_empty() {
        body.push('\n');
        body.push_str(&note);
    }
    let counters = cmp.counters_note();
    let detail = if counters.is_empty() {
        String::new()
    } else {
        body.push_str(&format!(
            "\nShared-index counters of each replica at the end of its run: \
             [{DETAILS_FILE}]({DETAILS_FILE}#{}).\n",
            anchor(title)
        ));
        format!(
            "Shared-index counters of each replica at the end of its run (`kv_router_redis_*`: \
             lookups by source, fallbacks and dropped writes by reason, the mirror's applies and \
             reloads, its lag):\n\n{counters}"
        )
    };
    let pd = cmp.pd_rows();
    if cmp.pd_prefill > 0 && !pd.is_empty() {
        body.push_str(
            "\nPrefill/decode view, from every pod's own counters over each run. The hit column \
             above takes the clients' `cached_tokens`, which on a decode pod include the blocks \
             it received; here *fleet prefix hits* = 1 − prompt tokens computed on any pod / \
             prompt tokens sent, and ITL = (end-to-end − TTFT) / (tokens − 1) per request:\n\n",
        );
        body.push_str(&crate::pd_report::table(&pd));
    }
    let ttft: Vec<(String, Vec<f64>)> = cmp
        .runs
        .iter()
        .filter_map(|r| {
            let run = r.run.as_ref()?;
            let v = run.records.iter().filter_map(|x| x.ttft_ms).collect();
            Some((r.label.clone(), v))
        })
        .collect();
    let bars: Vec<(String, f64)> = summaries
        .iter()
        .map(|s| (s.label.clone(), s.hit_rate))
        .collect();
    let oracles = summaries.iter().find_map(|s| s.oracles);
    let load: Vec<(String, Vec<usize>)> = summaries
        .iter()
        .map(|s| {
            // Fleet order pod-0, pod-1, …; pods that served nothing show as 0. Pods named
            // otherwise (a fleet managed elsewhere) in name order, padded to the fleet size.
            let counts = if s.per_pod.keys().all(|k| k.starts_with("pod-")) {
                (0..s.pods)
                    .map(|i| s.per_pod.get(&format!("pod-{i}")).copied().unwrap_or(0))
                    .collect()
            } else {
                let mut c: Vec<usize> = s.per_pod.values().copied().collect();
                c.resize(c.len().max(s.pods), 0);
                c
            };
            (s.label.clone(), counts)
        })
        .collect();
    let charts = three_charts(
        title,
        slug,
        "",
        &ttft,
        &bars,
        oracles.map_or((f64::NAN, f64::NAN), |o| {
            (o.infinite.ratio(), o.pooled.ratio())
        }),
        &load,
    )?;
    Ok(Section {
        title: title.to_string(),
        command: command.to_string(),
        body,
        detail,
        charts,
        json: serde_json::json!({
            "workload": cmp.workload,
            "description": cmp.description,
            "pods": cmp.pods,
            "gpu_blocks": cmp.gpu_blocks,
            "fleet": cmp.fleet,
            "summaries": summaries,
            "skipped": cmp.runs.iter().filter(|r| r.skipped.is_some())
                .map(|r| serde_json::json!({"strategy": r.label, "why": r.skipped}))
                .collect::<Vec<_>>(),
            // Per run on the shared index: its lookups that fell back, over all its replicas.
            "redis_fallbacks": cmp.runs.iter()
                .filter_map(|r| Some(serde_json::json!({"run": r.label, "fallbacks": r.redis_fallbacks?})))
                .collect::<Vec<_>>(),
        }),
        seconds,
    })
}

/// The section of a fleet simulation: its tables and the same three charts as a comparison.
pub fn simulate_section(
    title: &str,
    slug: &str,
    command: &str,
    r: &super::simulate::SimulateReport,
    seconds: f64,
) -> Result<Section> {
    let ttft: Vec<(String, Vec<f64>)> = r
        .strategies
        .iter()
        .map(|s| (s.strategy.as_str().to_string(), s.ttft_cdf_ms.clone()))
        .collect();
    let bars: Vec<(String, f64)> = r
        .strategies
        .iter()
        .map(|s| (s.strategy.as_str().to_string(), s.hit_ratio))
        .collect();
    let load: Vec<(String, Vec<usize>)> = r
        .strategies
        .iter()
        .map(|s| (s.strategy.as_str().to_string(), s.per_pod.clone()))
        .collect();
    let charts = three_charts(
        title,
        slug,
        "modeled ",
        &ttft,
        &bars,
        (r.oracles.infinite.ratio(), r.oracles.pooled.ratio()),
        &load,
    )?;
    Ok(Section {
        title: title.to_string(),
        command: command.to_string(),
        body: r.markdown(),
        detail: String::new(),
        charts,
        json: serde_json::to_value(r)?,
        seconds,
    })
}

/// The three charts of a strategy comparison: TTFT CDF, hit ratio vs the (infinite, pooled)
/// oracles, requests per pod. `ttft_kind` prefixes the TTFT captions ("modeled " in simulations).
fn three_charts(
    title: &str,
    slug: &str,
    ttft_kind: &str,
    ttft: &[(String, Vec<f64>)],
    bars: &[(String, f64)],
    (infinite, pooled): (f64, f64),
    load: &[(String, Vec<usize>)],
) -> Result<Vec<Chart>> {
    Ok(vec![
        Chart {
            file: format!("{slug}-ttft-cdf.svg"),
            alt: format!("{title}: {ttft_kind}TTFT CDF per strategy"),
            svg: charts::ttft_cdf(&format!("{title}: {ttft_kind}time to first token"), ttft)?,
        },
        Chart {
            file: format!("{slug}-hit-vs-oracle.svg"),
            alt: format!("{title}: prefix hit ratio per strategy vs the oracles"),
            svg: charts::hit_vs_oracle(
                &format!("{title}: prefix hit ratio vs oracles"),
                bars,
                infinite,
                pooled,
            )?,
        },
        Chart {
            file: format!("{slug}-per-pod.svg"),
            alt: format!("{title}: requests per pod per strategy"),
            svg: charts::per_pod_load(&format!("{title}: requests per pod"), load)?,
        },
    ])
}

/// Renders the whole document.
pub fn render(title: &str, intro: &str, machine: &str, sections: &[Section]) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let date = kv_router::tokenize::strftime_utc("%Y-%m-%d", i64::try_from(now).unwrap_or(0));
    let mut md = format!("# {title}\n\n{intro}\n\nMachine: {machine}. Date: {date} (UTC).\n\n");
    md.push_str("Contents:\n\n");
    for s in sections {
        md.push_str(&format!("- [{}](#{})\n", s.title, anchor(&s.title)));
    }
    for s in sections {
        md.push_str(&format!(
            "\n## {}\n\n```sh\n{}\n```\n\n_{:.0} s on {machine}._\n\n{}\n",
            s.title, s.command, s.seconds, s.body
        ));
        for c in &s.charts {
            md.push_str(&format!("\n![{}](images/{})\n", c.alt, c.file));
        }
    }
    md
}

/// The companion of `results.md` that holds each section's per-replica detail, so the results
/// themselves stay a readable length.
pub const DETAILS_FILE: &str = "results-details.md";

/// `results-details.md`: one heading per section with detail, titled as in `results.md` (empty
/// when no section has any).
pub fn render_details(sections: &[Section]) -> String {
    let with: Vec<&Section> = sections.iter().filter(|s| !s.detail.is_empty()).collect();
    if with.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "# kv-router benchmark results: per-replica detail\n\nGenerated by `make bench` with \
         [results.md](results.md); each heading is the section of the same title there, where the \
         command and machine are.\n",
    );
    for s in with {
        md.push_str(&format!("\n## {}\n\n{}", s.title, s.detail));
    }
    md
}

/// GitHub's heading anchor: lower case, spaces to dashes, punctuation dropped.
fn anchor(title: &str) -> String {
    title
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Everything after this line of `results.md` was measured by hand (commands given beside each
/// figure); regenerating the document keeps it.
pub const HAND_MARKER: &str =
    "<!-- Measured by hand below this line, each with its command; `make bench` keeps it. -->";

/// The hand-measured tail of an existing `results.md` (from the marker on), if any.
fn hand_tail(existing: &str) -> Option<&str> {
    existing.find(HAND_MARKER).map(|i| &existing[i..])
}

/// Writes `results.md`, `results.json` and `images/*.svg` into `dir` (images replaced, the
/// hand-measured tail of an existing `results.md` kept).
pub fn write(dir: &Path, md: &str, sections: &[Section]) -> Result<()> {
    let images = dir.join("images");
    std::fs::create_dir_all(&images).with_context(|| format!("creating {}", images.display()))?;
    for s in sections {
        for c in &s.charts {
            let p = images.join(&c.file);
            std::fs::write(&p, &c.svg).with_context(|| format!("writing {}", p.display()))?;
        }
    }
    let existing = std::fs::read_to_string(dir.join("results.md")).unwrap_or_default();
    let md = match hand_tail(&existing) {
        Some(tail) => format!("{}\n{tail}", md.trim_end()),
        None => md.to_string(),
    };
    std::fs::write(dir.join("results.md"), md).context("writing results.md")?;
    let details = render_details(sections);
    let path = dir.join(DETAILS_FILE);
    if details.is_empty() {
        // A report without per-replica detail leaves no stale companion behind.
        if path.exists() {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    } else {
        std::fs::write(&path, details).with_context(|| format!("writing {}", path.display()))?;
    }
    let json = serde_json::json!({ "sections": sections });
    std::fs::write(dir.join("results.json"), serde_json::to_vec_pretty(&json)?)
        .context("writing results.json")?;
    Ok(())
}

/// Checks a written report: every section has its command and a table, every linked image
/// exists and is an SVG document, and `results.json` parses.
pub fn check(dir: &Path, expected_sections: usize) -> Result<()> {
    let whole = std::fs::read_to_string(dir.join("results.md")).context("reading results.md")?;
    let md = whole.split(HAND_MARKER).next().unwrap_or_default();
    let sections: Vec<&str> = md.split("\n## ").skip(1).collect();
    if sections.len() != expected_sections {
        bail!(
            "results.md has {} sections, expected {expected_sections}",
            sections.len()
        );
    }
    for s in &sections {
        let title = s.lines().next().unwrap_or("");
        if !s.contains("```sh\nkv-bench ") {
            bail!("section {title:?} lacks its kv-bench command");
        }
        if !s
            .lines()
            .any(|l| l.starts_with("| ---") || l.starts_with("|---"))
        {
            bail!("section {title:?} has no markdown table");
        }
    }
    let mut images = 0;
    for line in md.lines() {
        if let Some(rest) = line.strip_prefix("![") {
            let file = rest
                .split("](")
                .nth(1)
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(|| anyhow::anyhow!("malformed image link {line:?}"))?;
            let svg = std::fs::read_to_string(dir.join(file))
                .with_context(|| format!("image {file} linked but missing"))?;
            if !svg.starts_with("<svg") || !svg.trim_end().ends_with("</svg>") {
                bail!("{file} is not an SVG document");
            }
            images += 1;
        }
    }
    if images == 0 {
        bail!("results.md links no chart");
    }
    let json: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("results.json")).context("reading results.json")?,
    )
    .context("results.json does not parse")?;
    let n = json["sections"].as_array().map_or(0, Vec::len);
    if n != expected_sections {
        bail!("results.json has {n} sections, expected {expected_sections}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(title: &str, with_chart: bool) -> Section {
        Section {
            title: title.into(),
            command: "kv-bench compare --pods 2".into(),
            body: "| metric | a |\n| ------ | -: |\n| x | 1 |\n".into(),
            detail: String::new(),
            charts: if with_chart {
                vec![Chart {
                    file: "x.svg".into(),
                    alt: "x".into(),
                    svg: charts::ttft_cdf("x", &[("a".into(), vec![1.0, 2.0])]).unwrap(),
                }]
            } else {
                vec![]
            },
            json: serde_json::json!({"a": 1}),
            seconds: 1.0,
        }
    }

    #[test]
    fn written_reports_pass_the_check_and_broken_ones_fail() {
        let dir = tempfile::tempdir().unwrap();
        let secs = vec![section("Multi-turn chat", true), section("Overhead", false)];
        let md = render("Results", "intro", &machine(), &secs);
        assert!(md.contains("- [Multi-turn chat](#multi-turn-chat)"));
        assert!(md.contains(". Date: 20"), "the report is dated");
        write(dir.path(), &md, &secs).unwrap();
        check(dir.path(), 2).unwrap();
        assert!(check(dir.path(), 3).is_err(), "section count is checked");
        std::fs::remove_file(dir.path().join("images/x.svg")).unwrap();
        let e = check(dir.path(), 2).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn per_replica_detail_goes_to_its_own_file_and_a_report_without_it_removes_that_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut with = section("Replicas sharing the index", false);
        with.detail = "- `redis #1` replica 0: lookups 3\n".into();
        let secs = vec![with, section("Overhead", false)];
        write(
            dir.path(),
            &render("Results", "intro", &machine(), &secs),
            &secs,
        )
        .unwrap();
        let details = std::fs::read_to_string(dir.path().join(DETAILS_FILE)).unwrap();
        assert!(details.contains("\n## Replicas sharing the index\n\n- `redis #1` replica 0"));
        assert!(
            !details.contains("Overhead"),
            "sections without detail have no heading"
        );
        let md = std::fs::read_to_string(dir.path().join("results.md")).unwrap();
        assert!(!md.contains("lookups 3"), "the detail is not in results.md");
        let plain = vec![section("Overhead", false)];
        write(
            dir.path(),
            &render("Results", "intro", &machine(), &plain),
            &plain,
        )
        .unwrap();
        assert!(!dir.path().join(DETAILS_FILE).exists());
    }

    #[test]
    fn regenerating_keeps_the_hand_measured_tail() {
        let dir = tempfile::tempdir().unwrap();
        let secs = vec![section("Multi-turn chat", true)];
        let md = render("Results", "intro", &machine(), &secs);
        let hand = format!("{HAND_MARKER}\n\n## By hand\n\n```sh\nkv-bench soak\n```\n");
        std::fs::write(dir.path().join("results.md"), format!("old\n{hand}")).unwrap();
        write(dir.path(), &md, &secs).unwrap();
        let written = std::fs::read_to_string(dir.path().join("results.md")).unwrap();
        assert!(written.starts_with("# Results") && written.ends_with(&hand));
        assert!(!written.contains("old\n"));
        check(dir.path(), 1).unwrap();
    }

    #[test]
    fn machine_line_names_cores() {
        assert!(machine().contains("cores"));
    }
}
