//! Paired differences over `compare --repeat` rounds: each strategy against a baseline run in
//! the same round, as a mean with its 95 % interval, so a verdict like "within 1 point of
//! weighted" says how sure the runs make it (a median of five cannot: one strategy's own runs
//! span 5–12 points on a shared 2-core machine).

use std::collections::BTreeMap;

use super::report::{median, Summary};
use super::table::{Style, Table};

/// Student's t, two-sided 95 %, by degrees of freedom 1–30; past 30 the next listed row
/// below is used (a slightly wider interval, never a narrower one).
const T95: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
];

/// Student's t quantile for a two-sided 95 % interval with `df` degrees of freedom (≥ 1).
fn t95(df: usize) -> f64 {
    match df {
        0 => f64::NAN,
        1..=30 => T95[df - 1],
        31..=40 => 2.042,
        41..=60 => 2.021,
        61..=120 => 2.000,
        _ => 1.980,
    }
}

/// Mean of `d` and the half-width of its 95 % interval (NaN with fewer than two values).
pub fn mean_interval(d: &[f64]) -> (f64, f64) {
    let n = d.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mean = d.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (mean, f64::NAN);
    }
    let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, t95(n - 1) * (var / n as f64).sqrt())
}

/// A run's strategy and round from its label (`redis #3` → (`redis`, 3)).
fn strategy_round(label: &str) -> Option<(&str, usize)> {
    let (s, r) = label.rsplit_once(" #")?;
    Some((s, r.parse().ok()?))
}

/// The baseline the others are paired with: the first strategy named `weighted…`, else the
/// first one run.
fn baseline<'a>(order: &[&'a str]) -> Option<&'a str> {
    order
        .iter()
        .find(|s| s.starts_with("weighted"))
        .or(order.first())
        .copied()
}

/// The narrowest interval between order statistics, `[v₍ₖ₎, v₍ₙ₊₁₋ₖ₎]`, that holds the median
/// of whatever distribution the values came from with at least `confidence` (no assumption on
/// its shape), and that coverage: `(lo, hi, coverage)`. None when even the extremes fall short
/// (four values or fewer at 90 %).
pub fn median_interval(v: &[f64], confidence: f64) -> Option<(f64, f64, f64)> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    // P(Binomial(n, ½) < k), by k: the chance the median lies below the k-th smallest value.
    let below = |k: usize| -> f64 {
        let mut c = 1.0;
        let mut sum = 0.0;
        for i in 0..k {
            sum += c;
            c = c * (n - i) as f64 / (i + 1) as f64;
        }
        sum / 2f64.powi(n as i32)
    };
    (1..=n / 2)
        .rev()
        .map(|k| (k, 1.0 - 2.0 * below(k)))
        .find(|&(_, coverage)| coverage >= confidence)
        .map(|(k, coverage)| (s[k - 1], s[n - k], coverage))
}

/// One strategy against the baseline over the rounds both ran: per round, the hit ratio's
/// difference (points of pooled) and the log of the TTFT p99's ratio.
pub struct Pairing<'a> {
    /// The strategy.
    pub name: &'a str,
    /// The baseline it is paired with.
    pub base: &'a str,
    /// Rounds both ran.
    pub rounds: usize,
    /// Hit / pooled, strategy − baseline, in points, one per round.
    pub hits: Vec<f64>,
    /// ln(strategy's TTFT p99 / baseline's), one per round.
    pub ln_p99: Vec<f64>,
    /// The runs behind them: (round, strategy's run, baseline's run), by round.
    pub runs: Vec<(usize, &'a Summary, &'a Summary)>,
}

/// Every strategy other than the baseline paired with it by round; empty without rounds or with
/// one strategy.
pub fn pairings(runs: &[Summary]) -> Vec<Pairing<'_>> {
    let mut order: Vec<&str> = Vec::new();
    let mut by: BTreeMap<(&str, usize), &Summary> = BTreeMap::new();
    for s in runs {
        let Some((name, round)) = strategy_round(&s.label) else {
            continue;
        };
        if !order.contains(&name) {
            order.push(name);
        }
        by.insert((name, round), s);
    }
    let Some(base) = baseline(&order) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for &name in order.iter().filter(|&&n| n != base) {
        let runs: Vec<(usize, &Summary, &Summary)> = by
            .iter()
            .filter(|((n, _), _)| *n == name)
            .filter_map(|(&(_, r), &s)| by.get(&(base, r)).map(|&b| (r, s, b)))
            .collect();
        let pairs: Vec<(&Summary, &Summary)> = runs.iter().map(|&(_, s, b)| (s, b)).collect();
        out.push(Pairing {
            name,
            base,
            rounds: pairs.len(),
            hits: pairs
                .iter()
                .map(|(s, b)| (s.vs_pooled() - b.vs_pooled()) * 100.0)
                .filter(|d| d.is_finite())
                .collect(),
            ln_p99: pairs
                .iter()
                .map(|(s, b)| (s.ttft_p99_ms / b.ttft_p99_ms).ln())
                .filter(|d| d.is_finite())
                .collect(),
            runs,
        });
    }
    out
}

fn points(x: f64) -> String {
    format!("{x:+.1}")
}

fn ratio(ln: f64) -> String {
    format!("{:.2}×", ln.exp())
}

/// Per strategy other than the baseline, over the rounds both ran: the hit ratio's difference
/// (points of pooled) and the TTFT p99's ratio (geometric mean, from the mean of log ratios),
/// each with its 95 % interval and its median over the rounds, and in how many rounds it had
/// more hits. None without rounds or with one strategy.
pub fn paired_table(runs: &[Summary], style: Style) -> Option<String> {
    let pairings = pairings(runs);
    if pairings.is_empty() {
        return None;
    }
    let mut t = Table::new([
        "strategy − baseline",
        "rounds",
        "hit / pooled: mean difference (95 % interval)",
        "median",
        "rounds with more hits",
        "TTFT p99: mean ratio (95 % interval)",
        "median",
    ]);
    for p in &pairings {
        let (hm, hw) = mean_interval(&p.hits);
        let (pm, pw) = mean_interval(&p.ln_p99);
        let interval = |lo: String, hi: String, w: f64| match w.is_finite() {
            true => format!(" ({lo} to {hi})"),
            false => String::new(),
        };
        let or_dash = |x: f64, show: fn(f64) -> String| match x.is_finite() {
            true => show(x),
            false => "-".into(),
        };
        t.row(vec![
            format!("{} − {}", p.name, p.base),
            p.rounds.to_string(),
            match hm.is_finite() {
                true => format!(
                    "{} points{}",
                    points(hm),
                    interval(points(hm - hw), points(hm + hw), hw)
                ),
                false => "-".into(),
            },
            or_dash(median(&p.hits), points),
            format!(
                "{} of {}",
                p.hits.iter().filter(|&&d| d > 0.0).count(),
                p.hits.len()
            ),
            match pm.is_finite() {
                true => format!(
                    "{}{}",
                    ratio(pm),
                    interval(ratio(pm - pw), ratio(pm + pw), pw)
                ),
                false => "-".into(),
            },
            or_dash(median(&p.ln_p99), ratio),
        ]);
    }
    Some(t.render(style))
}

/// The shared index's goal: against one replica of the baseline, a median hit ratio
/// at most 1 point of pooled lower, a median TTFT p99 at most 1.05 times, no lookup that fell
/// back from the shared index.
pub const GOAL_HIT_POINTS: f64 = -1.0;
/// The goal's bound on the median TTFT p99 ratio.
pub const GOAL_P99_RATIO: f64 = 1.05;

/// The shared index's goal judged on paired rounds (hit differences in points, log TTFT p99 ratios):
/// "**met**" or "**not met: …**", then every check's figure.
pub fn judge(hits: &[f64], ln_p99: &[f64], fallbacks: &str, fell_back: bool) -> String {
    let (hit, ln) = (median(hits), median(ln_p99));
    let checks = [
        (
            hit >= GOAL_HIT_POINTS,
            format!("median hits {} points", points(hit)),
        ),
        (
            ln.exp() <= GOAL_P99_RATIO,
            format!("median TTFT p99 {:.3}×", ln.exp()),
        ),
        (!fell_back, fallbacks.to_string()),
    ];
    let missed: Vec<&str> = checks
        .iter()
        .filter(|(ok, _)| !ok)
        .map(|(_, what)| what.as_str())
        .collect();
    let all: Vec<&str> = checks.iter().map(|(_, what)| what.as_str()).collect();
    format!(
        "**{}** ({})",
        match missed.is_empty() {
            true => "met".to_string(),
            false => format!("not met: {}", missed.join(", ")),
        },
        all.join(", ")
    )
}

/// The goal's thresholds as the verdict lines state them.
pub fn goal_terms() -> String {
    format!(
        "median hits ≥ {GOAL_HIT_POINTS:+.1} points, median TTFT p99 ≤ {GOAL_P99_RATIO:.2}×, no \
         lookup falling back"
    )
}

/// The goal for `strategy` over the paired rounds of `runs` (`fallbacks`: its lookups that fell
/// back, summed over its replicas' runs); None with fewer than three rounds.
pub fn shared_index_verdict(runs: &[Summary], strategy: &str, fallbacks: u64) -> Option<String> {
    let p = pairings(runs).into_iter().find(|p| p.name == strategy)?;
    if p.rounds < 3 || !median(&p.hits).is_finite() || !median(&p.ln_p99).is_finite() {
        return None;
    }
    Some(format!(
        "Goal for `{strategy}` against `{}` over {} paired rounds ({}): {}.{}",
        p.base,
        p.rounds,
        goal_terms(),
        judge(
            &p.hits,
            &p.ln_p99,
            &format!("{fallbacks} lookups fell back"),
            fallbacks > 0
        ),
        precision(&p.hits, &p.ln_p99)
    ))
}

/// How far these rounds decide the two medians: their order-statistic intervals, and which
/// threshold lies inside its interval (a verdict these rounds cannot tell from noise on a
/// machine where one strategy's runs spread by several points). Empty with too few rounds.
pub fn precision(hits: &[f64], ln_p99: &[f64]) -> String {
    const CONFIDENCE: f64 = 0.9;
    let (hit_points, ln_bound) = (GOAL_HIT_POINTS, GOAL_P99_RATIO.ln());
    let (Some(h), Some(r)) = (
        median_interval(hits, CONFIDENCE),
        median_interval(ln_p99, CONFIDENCE),
    ) else {
        return String::new();
    };
    let inside: Vec<String> = [
        (h.0 < hit_points && hit_points < h.1).then(|| format!("{} points", points(hit_points))),
        (r.0 < ln_bound && ln_bound < r.1).then(|| ratio(ln_bound)),
    ]
    .into_iter()
    .flatten()
    .collect();
    format!(
        " Over these rounds the medians lie, with {:.0} % and {:.0} % confidence, within {} to {} \
         points and {} to {}{}",
        h.2 * 100.0,
        r.2 * 100.0,
        points(h.0),
        points(h.1),
        ratio(r.0),
        ratio(r.1),
        match inside.as_slice() {
            [] => ": both thresholds lie outside, so these rounds decide the goal.".to_string(),
            [one] =>
                format!("; {one} lies inside its interval, so more rounds are needed to decide it."),
            _ => format!(
                "; {} lie inside theirs, so more rounds are needed to decide them.",
                inside.join(" and ")
            ),
        }
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::oracle::{HitTokens, Oracles};
    use kv_testkit::runner::RunResult;

    /// A run labelled `label` whose hit ratio is `pooled` of the pooled oracle's and whose
    /// every request took `p99` ms to its first token.
    pub(crate) fn run(label: &str, pooled: f64, p99: f64) -> Summary {
        let r = RunResult {
            label: label.into(),
            workload: "w".into(),
            description: String::new(),
            target: String::new(),
            duration_s: 1.0,
            sent: Vec::new(),
            records: Vec::new(),
        };
        let mut s = Summary::of(&r, Some(2));
        s.hit_rate = pooled / 2.0;
        s.ttft_p99_ms = p99;
        let half = HitTokens {
            hit_tokens: 1,
            prompt_tokens: 2,
        };
        s.oracles = Some(Oracles {
            infinite: half,
            pooled: half,
            pooled_blocks: 1,
        });
        s
    }

    #[test]
    fn the_interval_is_students_t_on_the_differences() {
        let (m, w) = mean_interval(&[1.0, 2.0, 3.0]);
        assert!((m - 2.0).abs() < 1e-9);
        // sd 1, n 3: 4.303 / √3.
        assert!((w - 4.303 / 3f64.sqrt()).abs() < 1e-9, "{w}");
        let (m, w) = mean_interval(&[5.0]);
        assert_eq!(m, 5.0);
        assert!(w.is_nan(), "one pair has no interval");
        assert!(mean_interval(&[]).0.is_nan());
        assert_eq!(t95(5), 2.571);
        assert!(t95(35) > t95(45) && t95(45) > 1.96);
    }

    #[test]
    fn strategies_pair_with_weighted_by_round() {
        // Round 3 of redis has no weighted partner; round 9 of weighted has no redis one.
        let runs = [
            run("redis #1", 0.90, 110.0),
            run("weighted #1", 0.92, 100.0),
            run("weighted #2", 0.95, 100.0),
            run("redis #2", 0.94, 110.0),
            run("redis #3", 0.10, 900.0),
            run("weighted #9", 0.10, 1.0),
        ];
        let t = paired_table(&runs, Style::Markdown).unwrap();
        let row = t.lines().find(|l| l.starts_with("| redis")).unwrap();
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!(cells[1], "redis − weighted", "{t}");
        assert_eq!(cells[2], "2", "{t}");
        // Differences −2 and −1 points: mean −1.5, sd √0.5, t(1) 12.706.
        let w = 12.706 * (0.5f64 / 2.0).sqrt();
        let want = format!("-1.5 points ({:+.1} to {:+.1})", -1.5 - w, -1.5 + w);
        assert_eq!(cells[3], want, "{t}");
        assert_eq!(cells[4], "-1.5", "median of two: the mean of both");
        assert_eq!(cells[5], "0 of 2", "{t}");
        assert!(cells[6].starts_with("1.10× ("), "{t}");
        assert_eq!(cells[7], "1.10×", "{t}");
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    /// Rounds of `redis` against `weighted` with these hit differences (points) and p99 ratios.
    fn rounds(diffs: &[(f64, f64)]) -> Vec<Summary> {
        diffs
            .iter()
            .enumerate()
            .flat_map(|(i, &(points, p99))| {
                [
                    run(&format!("weighted #{}", i + 1), 0.90, 1000.0),
                    run(
                        &format!("redis #{}", i + 1),
                        0.90 + points / 100.0,
                        1000.0 * p99,
                    ),
                ]
            })
            .collect()
    }

    #[test]
    fn the_shared_index_goal_is_judged_on_medians_and_fallbacks() {
        // One bad round of three moves the means, not the medians.
        let runs = rounds(&[(-0.5, 1.02), (0.4, 0.98), (-9.0, 1.60)]);
        let v = shared_index_verdict(&runs, "redis", 0).unwrap();
        assert!(v.contains("**met**"), "{v}");
        assert!(
            v.contains("median hits -0.5 points, median TTFT p99 1.020×"),
            "{v}"
        );
        let v = shared_index_verdict(&runs, "redis", 4).unwrap();
        assert!(v.contains("**not met: 4 lookups fell back**"), "{v}");
        let runs = rounds(&[(-1.5, 1.00), (-1.2, 1.06), (0.0, 1.07)]);
        let v = shared_index_verdict(&runs, "redis", 0).unwrap();
        assert!(
            v.contains("not met: median hits -1.2 points, median TTFT p99 1.060×"),
            "{v}"
        );
        // Three decimals: a median of 1.047 reads as met, not as a bound of 1.05 it is under.
        let v = shared_index_verdict(&rounds(&[(0.0, 1.047); 3]), "redis", 0).unwrap();
        assert!(
            v.contains("**met** (median hits +0.0 points, median TTFT p99 1.047×"),
            "{v}"
        );
        // Two rounds are not enough to judge, and a strategy that did not run has no verdict.
        assert!(shared_index_verdict(&rounds(&[(0.0, 1.0), (0.0, 1.0)]), "redis", 0).is_none());
        assert!(shared_index_verdict(&runs, "precise", 0).is_none());
    }

    /// Coverages from the binomial: eight rounds give [2nd, 7th] at 1 − 2·9/256, five the
    /// extremes at 1 − 2/32, four nothing at 90 %.
    #[test]
    fn median_intervals_are_order_statistics_with_their_coverage() {
        let v = [8.0, 1.0, 7.0, 2.0, 6.0, 3.0, 5.0, 4.0];
        let (lo, hi, c) = median_interval(&v, 0.9).unwrap();
        assert_eq!((lo, hi), (2.0, 7.0));
        assert!((c - (1.0 - 18.0 / 256.0)).abs() < 1e-12, "{c}");
        let (lo, hi, c) = median_interval(&v, 0.95).unwrap();
        assert_eq!((lo, hi), (1.0, 8.0), "wider for more confidence");
        assert!((c - (1.0 - 2.0 / 256.0)).abs() < 1e-12, "{c}");
        let (lo, hi, c) = median_interval(&[5.0, 1.0, 4.0, 2.0, 3.0], 0.9).unwrap();
        assert_eq!((lo, hi), (1.0, 5.0));
        assert!((c - 0.9375).abs() < 1e-12, "{c}");
        assert!(median_interval(&[1.0, 2.0, 3.0, 4.0], 0.9).is_none());
        assert!(median_interval(&[], 0.9).is_none());
    }

    #[test]
    fn the_verdict_says_which_threshold_its_rounds_cannot_decide() {
        // Tight rounds far from both thresholds decide the goal.
        let tight = rounds(&[
            (0.1, 1.0),
            (0.2, 1.01),
            (0.0, 0.99),
            (0.3, 1.0),
            (0.1, 1.02),
        ]);
        let v = shared_index_verdict(&tight, "redis", 0).unwrap();
        assert!(v.contains("**met**"), "{v}");
        assert!(v.contains("94 % and 94 % confidence, within +0.0 to +0.3 points and 0.99× to 1.02×: both thresholds lie outside"), "{v}");
        // Rounds spread across −1 point: the hit verdict is noise, the tail one is not.
        let wide = rounds(&[
            (-4.0, 1.0),
            (2.0, 1.01),
            (-2.0, 0.99),
            (1.0, 1.0),
            (-1.5, 1.02),
        ]);
        let v = shared_index_verdict(&wide, "redis", 0).unwrap();
        assert!(v.contains("not met: median hits -1.5 points"), "{v}");
        assert!(
            v.contains("; -1.0 points lies inside its interval, so more rounds"),
            "{v}"
        );
        // Both spread across theirs.
        let both = rounds(&[
            (-4.0, 0.9),
            (2.0, 1.2),
            (-2.0, 1.1),
            (1.0, 1.0),
            (-1.5, 1.02),
        ]);
        let v = shared_index_verdict(&both, "redis", 0).unwrap();
        assert!(v.contains("-1.0 points and 1.05× lie inside theirs"), "{v}");
        // Three or four rounds: a verdict, no interval.
        let few = rounds(&[(0.0, 1.0), (0.0, 1.0), (0.0, 1.0)]);
        let v = shared_index_verdict(&few, "redis", 0).unwrap();
        assert!(v.ends_with("0 lookups fell back)."), "{v}");
    }

    #[test]
    fn no_table_without_rounds_or_a_second_strategy() {
        let once = [run("redis", 0.9, 1.0), run("weighted", 0.9, 1.0)];
        assert!(paired_table(&once, Style::Markdown).is_none());
        let alone = [run("weighted #1", 0.9, 1.0), run("weighted #2", 0.9, 1.0)];
        assert!(paired_table(&alone, Style::Markdown).is_none());
    }

    #[test]
    fn without_weighted_the_first_strategy_run_is_the_baseline() {
        let runs = [
            run("precise #1", 0.9, 1.0),
            run("redis #1", 0.8, 1.0),
            run("precise #2", 0.9, 1.0),
            run("redis #2", 0.8, 1.0),
        ];
        let t = paired_table(&runs, Style::Markdown).unwrap();
        assert!(t.contains("redis − precise"), "{t}");
        assert!(t.contains("-10.0 points (-10.0 to -10.0)"), "{t}");
    }
}
