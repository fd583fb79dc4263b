//! How a run's capacity correction (`index.correction`) moved: the median pod's judged scale over
//! virtual time, and when it settled.

use serde::Serialize;

/// The median pod's scale after each judgement that changed it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ScaleTrack {
    /// (virtual seconds, median scale), in time order; the scale is 1 before the first point.
    pub points: Vec<(f64, f64)>,
}

/// The median of `v` (the mean of the middle two for an even count); 1 for none.
pub(super) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 1.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

impl ScaleTrack {
    /// Records the fleet's median scale at `t_s` if it moved.
    pub(super) fn record(&mut self, t_s: f64, scales: &[f64]) {
        let m = median(scales);
        if (m - self.end()).abs() > 1e-9 {
            self.points.push((t_s, m));
        }
    }

    /// The median scale at `t_s`.
    pub fn at(&self, t_s: f64) -> f64 {
        self.points
            .iter()
            .take_while(|(t, _)| *t <= t_s)
            .last()
            .map_or(1.0, |p| p.1)
    }

    /// The median scale at the end of the run.
    pub fn end(&self) -> f64 {
        self.points.last().map_or(1.0, |p| p.1)
    }

    /// The first time from which the median scale stays within a factor `1 + band` of its end
    /// value (0 when it never left that band).
    pub fn settled_s(&self, band: f64) -> f64 {
        let end = self.end();
        let within = |s: f64| s <= end * (1.0 + band) && s >= end / (1.0 + band);
        let mut since = if within(1.0) { Some(0.0) } else { None };
        for &(t, s) in &self.points {
            match (within(s), since) {
                (true, None) => since = Some(t),
                (false, _) => since = None,
                _ => {}
            }
        }
        since.unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scale_that_shrinks_then_holds_settles_when_it_enters_the_band_for_good() {
        let mut t = ScaleTrack::default();
        for (s, scales) in [
            (10.0, [1.0, 0.7, 0.7]),
            (20.0, [0.5, 0.3, 0.4]),
            (30.0, [0.6, 0.5, 0.5]),
            (40.0, [0.3, 0.3, 0.2]),
            (50.0, [0.3, 0.3, 0.2]),
            (60.0, [0.25, 0.3, 0.1]),
        ] {
            t.record(s, &scales);
        }
        // 0.7, 0.4, 0.5, 0.3 (50 s repeats it and is not recorded), 0.25.
        assert_eq!(t.points.len(), 5);
        assert_eq!(t.end(), 0.25);
        assert_eq!(t.at(5.0), 1.0);
        assert_eq!(t.at(35.0), 0.5);
        // 0.4 at 20 s is within 25 % of 0.25? No (0.3125 at most); 0.3 at 40 s is.
        assert_eq!(t.settled_s(0.25), 40.0);
        // A wider band takes in 0.5 at 30 s too, but 0.7 at 10 s left it.
        assert_eq!(t.settled_s(1.0), 20.0);
    }

    #[test]
    fn a_scale_that_never_moves_is_settled_from_the_start() {
        let mut t = ScaleTrack::default();
        t.record(10.0, &[1.0, 1.0]);
        assert!(t.points.is_empty());
        assert_eq!(t.settled_s(0.25), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0, 4.0]), 2.5);
    }
}
