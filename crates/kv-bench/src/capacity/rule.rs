//! The capacity rule, pure: from one ladder's per-rung TTFT percentiles to the highest load the
//! fleet carries within the SLO, and the spread of that figure over repeated ladders.

use serde::Serialize;

/// One rung of one ladder: the offered load and the TTFT percentile measured there.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RungPoint {
    /// Offered load, requests per second.
    pub qps: f64,
    /// TTFT at the report's percentile, ms (infinite when failed requests reach the percentile,
    /// NaN when the rung measured nothing).
    pub ttft_ms: f64,
}

/// Whether a rung meets the SLO: a measured percentile at most `slo_ms` (a rung that measured
/// nothing, or whose failures reach the percentile, does not).
pub fn passes(ttft_ms: f64, slo_ms: f64) -> bool {
    ttft_ms.is_finite() && ttft_ms <= slo_ms
}

/// The capacity of one ladder: the highest load `q` such that every rung at or below `q` meets
/// the SLO. A rung that passes above one that failed does not count (a fleet that broke its SLO
/// at 8 QPS is not rated for 12 because one 12-QPS run was lucky). None when the lowest rung
/// fails or there is no rung. Rungs may come in any order; two runs of one load must both pass.
pub fn capacity(points: &[RungPoint], slo_ms: f64) -> Option<f64> {
    let mut sorted: Vec<RungPoint> = points.to_vec();
    sorted.sort_by(|a, b| a.qps.total_cmp(&b.qps));
    let first_fail = sorted
        .iter()
        .find(|p| !passes(p.ttft_ms, slo_ms))
        .map(|p| p.qps);
    sorted
        .iter()
        .rev()
        .find(|p| first_fail.is_none_or(|f| p.qps < f))
        .map(|p| p.qps)
}

/// The percentile `p` (0–100, nearest rank) of per-request TTFTs in ms, a failed request (None)
/// counting as slower than any SLO; NaN for no requests.
pub fn ttft_percentile(ttfts: &[Option<f64>], p: f64) -> f64 {
    if ttfts.is_empty() {
        return f64::NAN;
    }
    let mut v: Vec<f64> = ttfts
        .iter()
        .map(|t| t.filter(|x| x.is_finite()).unwrap_or(f64::INFINITY))
        .collect();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Minimum, median and maximum of one strategy's capacity over repeated ladders (None: below
/// the lowest rung, ordered under every rung). The median of an even count is the lower middle
/// one, so it is always a rung that was measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Lowest capacity of the repeats.
    pub min: Option<f64>,
    /// Median (lower middle).
    pub median: Option<f64>,
    /// Highest.
    pub max: Option<f64>,
}

/// The spread of `caps`; None without repeats.
pub fn spread(caps: &[Option<f64>]) -> Option<Spread> {
    let mut v = caps.to_vec();
    // None sorts first: below every rung.
    v.sort_by(|a, b| match (a, b) {
        (None, None) => std::cmp::Ordering::Equal,
        (None, Some(_)) => std::cmp::Ordering::Less,
        (Some(_), None) => std::cmp::Ordering::Greater,
        (Some(x), Some(y)) => x.total_cmp(y),
    });
    Some(Spread {
        min: *v.first()?,
        median: v[(v.len() - 1) / 2],
        max: *v.last()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ladder(ttfts: &[(f64, f64)]) -> Vec<RungPoint> {
        ttfts
            .iter()
            .map(|&(qps, ttft_ms)| RungPoint { qps, ttft_ms })
            .collect()
    }

    #[test]
    fn the_highest_rung_below_the_first_failure() {
        let slo = 500.0;
        let l = ladder(&[(4.0, 100.0), (8.0, 300.0), (12.0, 500.0), (16.0, 700.0)]);
        assert_eq!(capacity(&l, slo), Some(12.0), "500 ms meets a 500 ms SLO");
        // A pass above a failure does not count.
        let l = ladder(&[(4.0, 100.0), (8.0, 600.0), (12.0, 400.0), (16.0, 450.0)]);
        assert_eq!(capacity(&l, slo), Some(4.0));
        // Order of the rungs does not matter.
        let l = ladder(&[(16.0, 450.0), (4.0, 100.0), (12.0, 400.0), (8.0, 600.0)]);
        assert_eq!(capacity(&l, slo), Some(4.0));
        // Every rung passes: the top one.
        let l = ladder(&[(4.0, 1.0), (6.0, 2.0)]);
        assert_eq!(capacity(&l, slo), Some(6.0));
        // The lowest fails: none.
        let l = ladder(&[(4.0, 501.0), (6.0, 2.0)]);
        assert_eq!(capacity(&l, slo), None);
        assert_eq!(capacity(&[], slo), None);
        // A rung that measured nothing, or whose failures reach the percentile, fails.
        let l = ladder(&[(4.0, 1.0), (6.0, f64::NAN), (8.0, 1.0)]);
        assert_eq!(capacity(&l, slo), Some(4.0));
        let l = ladder(&[(4.0, 1.0), (6.0, f64::INFINITY)]);
        assert_eq!(capacity(&l, slo), Some(4.0));
        // Two runs of one load: both must pass.
        let l = ladder(&[(4.0, 1.0), (8.0, 1.0), (8.0, 900.0), (12.0, 1.0)]);
        assert_eq!(capacity(&l, slo), Some(4.0));
    }

    /// Scaling every TTFT of a ladder up never raises its capacity, over many ladders and
    /// factors; and in a constructed case it lowers it strictly.
    #[test]
    fn a_slower_strategy_never_carries_more() {
        let slo = 500.0;
        let mut rng = kv_testkit::splitmix::SplitMix64::new(7);
        for _ in 0..2000 {
            let n = rng.range(1, 7);
            // Noisy ladders: TTFTs need not grow with load.
            let l: Vec<RungPoint> = (0..n)
                .map(|i| RungPoint {
                    qps: 4.0 + 2.0 * i as f64,
                    ttft_ms: rng.unit() * 800.0,
                })
                .collect();
            let factor = 1.0 + rng.unit() * 2.0;
            let slower: Vec<RungPoint> = l
                .iter()
                .map(|p| RungPoint {
                    ttft_ms: p.ttft_ms * factor,
                    ..*p
                })
                .collect();
            let (fast, slow) = (capacity(&l, slo), capacity(&slower, slo));
            assert!(
                slow.unwrap_or(0.0) <= fast.unwrap_or(0.0),
                "{l:?} x{factor}: {fast:?} -> {slow:?}"
            );
        }
        // Growing TTFT with load: 1.5x slower crosses 500 ms two rungs earlier.
        let l = ladder(&[(4.0, 150.0), (8.0, 250.0), (12.0, 350.0), (16.0, 450.0)]);
        let slower: Vec<RungPoint> = l
            .iter()
            .map(|p| RungPoint {
                ttft_ms: p.ttft_ms * 1.5,
                ..*p
            })
            .collect();
        assert_eq!(capacity(&l, slo), Some(16.0));
        assert_eq!(capacity(&slower, slo), Some(8.0));
    }

    #[test]
    fn percentiles_count_failures_as_too_slow() {
        let t: Vec<Option<f64>> = (1..=10).map(|i| Some(i as f64 * 10.0)).collect();
        assert_eq!(ttft_percentile(&t, 90.0), 90.0);
        assert_eq!(ttft_percentile(&t, 50.0), 50.0);
        assert_eq!(ttft_percentile(&t, 100.0), 100.0);
        let mut failed = t.clone();
        failed[0] = None;
        failed[1] = None;
        assert_eq!(ttft_percentile(&failed, 90.0), f64::INFINITY);
        assert_eq!(ttft_percentile(&failed, 80.0), 100.0);
        assert!(ttft_percentile(&[], 90.0).is_nan());
    }

    #[test]
    fn spreads_order_none_below_every_rung() {
        assert_eq!(spread(&[]), None);
        let s = spread(&[Some(12.0), None, Some(8.0)]).unwrap();
        assert_eq!((s.min, s.median, s.max), (None, Some(8.0), Some(12.0)));
        let s = spread(&[Some(12.0), Some(8.0), Some(10.0), Some(14.0)]).unwrap();
        assert_eq!(s.median, Some(10.0), "lower middle of an even count");
    }
}
