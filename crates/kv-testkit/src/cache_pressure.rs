//! The cache-pressure workload: many prefix groups in hot / warm / cold popularity tiers whose
//! prefixes together overflow the fleet's KV cache, one-shot completions at Poisson times.
//!
//! Each request is one group's prefix (a long shared document or system prompt) followed by a
//! question of its own. Which group a request belongs to is drawn by tier: a tier holds a share
//! of the groups and draws a share of the requests, uniformly among its groups. With the
//! defaults the hot and warm tiers fit in the fleet's pooled cache only when each group lives on
//! few pods, so spraying requests evicts what affinity would keep.

use serde::Serialize;
use serde_json::Value;

use super::prose::prose_tokens;
use super::splitmix::SplitMix64;
use super::workload::{completion_body, Api, Arrivals, OneShot, PlannedRequest, Session, Workload};

/// One popularity tier: the share of the groups it holds and of the requests it draws.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tier {
    /// Percent of the groups.
    pub groups_pct: f64,
    /// Percent of the requests.
    pub requests_pct: f64,
}

/// The three tiers, hottest first.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tiers(pub [Tier; 3]);

/// Tier names, in [`Tiers`] order.
pub const TIER_NAMES: [&str; 3] = ["hot", "warm", "cold"];

impl Default for Tiers {
    /// 10 % of the groups draw 60 % of the requests, 30 % draw 30 %, the other 60 % draw 10 %.
    fn default() -> Self {
        let t = |groups_pct, requests_pct| Tier {
            groups_pct,
            requests_pct,
        };
        Tiers([t(10.0, 60.0), t(30.0, 30.0), t(60.0, 10.0)])
    }
}

impl Tiers {
    /// Parses `G:R,G:R,G:R` (hot, warm, cold; percent of groups : percent of requests), e.g.
    /// `10:60,30:30,60:10`. Each column must add up to 100.
    pub fn parse(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let [hot, warm, cold] = parts.as_slice() else {
            return Err(format!(
                "{} tiers in {s:?}: give three, hot,warm,cold, each GROUPS%:REQUESTS%",
                parts.len()
            ));
        };
        let tier = |name: &str, t: &str| -> Result<Tier, String> {
            let (g, r) = t
                .split_once(':')
                .ok_or_else(|| format!("{name} tier {t:?} is not GROUPS%:REQUESTS%"))?;
            let num = |v: &str| -> Result<f64, String> {
                let x: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("{name} tier: {v:?} is not a number"))?;
                if !(0.0..=100.0).contains(&x) {
                    return Err(format!("{name} tier: {x} is not a percentage"));
                }
                Ok(x)
            };
            Ok(Tier {
                groups_pct: num(g)?,
                requests_pct: num(r)?,
            })
        };
        let tiers = Tiers([tier("hot", hot)?, tier("warm", warm)?, tier("cold", cold)?]);
        let sum = |f: fn(&Tier) -> f64| tiers.0.iter().map(f).sum::<f64>();
        for (what, total) in [
            ("groups", sum(|t| t.groups_pct)),
            ("requests", sum(|t| t.requests_pct)),
        ] {
            if (total - 100.0).abs() > 1e-6 {
                return Err(format!("the tiers' {what} add up to {total} %, not 100 %"));
            }
        }
        Ok(tiers)
    }

    /// Groups per tier out of `groups`: rounded shares, the cold tier taking the remainder.
    pub fn group_counts(&self, groups: usize) -> [usize; 3] {
        let share = |t: &Tier| ((t.groups_pct / 100.0) * groups as f64).round() as usize;
        let hot = share(&self.0[0]).min(groups);
        let warm = share(&self.0[1]).min(groups - hot);
        [hot, warm, groups - hot - warm]
    }
}

/// Parameters of the cache-pressure workload (sizes in the sim's tokens: 4 bytes of text each).
#[derive(Debug, Clone, Serialize)]
pub struct CachePressureSpec {
    /// Prefix groups.
    pub groups: usize,
    /// Popularity tiers.
    pub tiers: Tiers,
    /// Prefix length of every group, tokens.
    pub prefix_tokens: usize,
    /// Each request's own question after the prefix, tokens.
    pub question_tokens: usize,
    /// Output length, tokens.
    pub output_tokens: u32,
    /// Requests to send.
    pub requests: usize,
    /// Poisson arrival rate, requests per second.
    pub rate: f64,
    /// `model` field.
    pub model: String,
    /// Seed of the groups' prefixes (the same documents whatever the request stream).
    pub seed: u64,
    /// Seed of the request stream: which group each request draws, its question, its arrival.
    pub stream_seed: u64,
}

impl Default for CachePressureSpec {
    fn default() -> Self {
        Self {
            groups: 300,
            tiers: Tiers::default(),
            prefix_tokens: 3072,
            question_tokens: 128,
            output_tokens: 64,
            requests: 100,
            rate: 4.0,
            model: "sim-model".into(),
            seed: 1,
            stream_seed: 1,
        }
    }
}

impl CachePressureSpec {
    /// Why the spec cannot build, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.groups == 0 || self.prefix_tokens == 0 {
            return Err("the cache-pressure workload needs groups and a prefix".into());
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(format!("arrival rate {} is not a positive rate", self.rate));
        }
        let counts = self.tiers.group_counts(self.groups);
        for (i, t) in self.tiers.0.iter().enumerate() {
            if t.requests_pct > 0.0 && counts[i] == 0 {
                return Err(format!(
                    "the {} tier draws {} % of the requests but holds none of the {} groups",
                    TIER_NAMES[i], t.requests_pct, self.groups
                ));
            }
        }
        Ok(())
    }

    /// The group and tier of request `i` of the stream.
    fn draw(&self, i: usize, counts: [usize; 3]) -> (usize, usize) {
        let mut rng = SplitMix64::derive(self.stream_seed, "cp-group", i as u64);
        let u = rng.unit() * 100.0;
        let mut acc = 0.0;
        // The last tier with requests takes any rounding left at the top.
        let last = (0..3).rev().find(|&k| counts[k] > 0).unwrap_or(2);
        let mut tier = last;
        for (k, t) in self.tiers.0.iter().enumerate() {
            acc += t.requests_pct;
            if u < acc && counts[k] > 0 {
                tier = k;
                break;
            }
        }
        let first: usize = counts[..tier].iter().sum();
        (first + rng.range(0, counts[tier].max(1) - 1), tier)
    }

    /// Builds the requests (one one-shot session each, ids `cp-<stream seed>-<n>-<tier>`) with
    /// Poisson arrivals at `rate`. Panics on a spec that fails [`Self::check`].
    pub fn build(&self) -> Workload {
        if let Err(e) = self.check() {
            panic!("cache-pressure spec: {e}");
        }
        let counts = self.tiers.group_counts(self.groups);
        let mut prefixes: Vec<Option<String>> = vec![None; self.groups];
        let sessions: Vec<Box<dyn Session>> = (0..self.requests)
            .map(|i| {
                let (g, tier) = self.draw(i, counts);
                let prefix = prefixes[g].get_or_insert_with(|| {
                    prose_tokens(
                        &mut SplitMix64::derive(self.seed, "cp-prefix", g as u64),
                        self.prefix_tokens,
                    )
                });
                let mut q = SplitMix64::derive(self.stream_seed, "cp-question", i as u64);
                let prompt = format!("{prefix}{}", prose_tokens(&mut q, self.question_tokens));
                Box::new(OneShot {
                    id: format!("cp-{}-{i}-{}", self.stream_seed, TIER_NAMES[tier]),
                    request: Some(PlannedRequest {
                        api: Api::Completions,
                        body: completion_body(
                            &self.model,
                            Value::String(prompt),
                            self.output_tokens,
                        ),
                        headers: Vec::new(),
                        turn: 0,
                        not_before: None,
                        think: None,
                    }),
                }) as Box<dyn Session>
            })
            .collect();
        let [h, w, c] = counts;
        let t = &self.tiers.0;
        Workload {
            name: "cache-pressure".into(),
            description: format!(
                "{} prefix groups (hot {h} / warm {w} / cold {c} drawing {} / {} / {} % of \
                 requests), prefix {} / question {} / output {} tokens, seed {}",
                self.groups,
                t[0].requests_pct,
                t[1].requests_pct,
                t[2].requests_pct,
                self.prefix_tokens,
                self.question_tokens,
                self.output_tokens,
                self.seed
            ),
            requests: sessions.len(),
            sessions,
        }
        .with_arrivals(Arrivals::Poisson { rate: self.rate }, self.stream_seed)
    }

    /// Request `n` of the stream from its session id (`cp-<seed>-<n>-<tier>`).
    pub fn ordinal(session: &str) -> Option<usize> {
        session.strip_prefix("cp-")?.split('-').nth(1)?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> CachePressureSpec {
        CachePressureSpec {
            groups: 20,
            prefix_tokens: 32,
            question_tokens: 8,
            output_tokens: 4,
            requests: 2000,
            rate: 10.0,
            ..Default::default()
        }
    }

    fn prompts(w: &mut Workload) -> Vec<(String, String, Option<std::time::Duration>)> {
        w.sessions
            .iter_mut()
            .map(|s| {
                let id = s.id().to_string();
                let r = s.next_request(None).unwrap();
                let p = r.body["prompt"].as_str().unwrap().to_string();
                (id, p, r.not_before)
            })
            .collect()
    }

    #[test]
    fn tiers_parse_and_refuse_bad_shares() {
        assert_eq!(Tiers::parse("10:60,30:30,60:10").unwrap(), Tiers::default());
        assert!(Tiers::parse("10:60,30:30").unwrap_err().contains("2 tiers"));
        assert!(Tiers::parse("10:60,30:30,50:10")
            .unwrap_err()
            .contains("groups add up to 90"));
        assert!(Tiers::parse("10:60,30:30,60:x")
            .unwrap_err()
            .contains("not a number"));
        assert!(Tiers::parse("10:160,30:30,60:10")
            .unwrap_err()
            .contains("not a percentage"));
        assert_eq!(Tiers::default().group_counts(300), [30, 90, 180]);
        assert_eq!(Tiers::default().group_counts(7), [1, 2, 4]);
    }

    #[test]
    fn a_tier_with_requests_needs_groups() {
        let spec = CachePressureSpec {
            groups: 3,
            ..small()
        };
        assert!(spec.check().unwrap_err().contains("hot tier"), "0 of 3 hot");
        assert!(CachePressureSpec {
            rate: 0.0,
            ..small()
        }
        .check()
        .is_err());
    }

    #[test]
    fn deterministic_with_tiered_popularity() {
        let spec = small();
        let (mut a, mut b) = (spec.build(), spec.build());
        let (pa, pb) = (prompts(&mut a), prompts(&mut b));
        assert_eq!(pa, pb, "same seeds, same requests and times");
        let other = prompts(
            &mut CachePressureSpec {
                stream_seed: 2,
                ..small()
            }
            .build(),
        );
        assert_ne!(pa, other, "another stream");
        // Every request is prefix + question; groups are told by their prefix.
        let prefix_bytes = spec.prefix_tokens * 4;
        let mut per_group = std::collections::BTreeMap::<&str, (usize, &str)>::new();
        for (id, p, _) in &pa {
            assert_eq!(p.len(), (spec.prefix_tokens + spec.question_tokens) * 4);
            let tier = id.rsplit('-').next().unwrap();
            let e = per_group.entry(&p[..prefix_bytes]).or_insert((0, tier));
            assert_eq!(e.1, tier, "a group stays in its tier");
            e.0 += 1;
        }
        assert_eq!(per_group.len(), spec.groups, "every group drawn");
        let tier_share = |t: &str| {
            pa.iter().filter(|(id, _, _)| id.ends_with(t)).count() as f64 / pa.len() as f64
        };
        // 2,000 draws: each share within 4 points of the tier's.
        for (t, want) in [("-hot", 0.6), ("-warm", 0.3), ("-cold", 0.1)] {
            assert!(
                (tier_share(t) - want).abs() < 0.04,
                "{t}: {}",
                tier_share(t)
            );
        }
        let [h, w, _] = Tiers::default().group_counts(spec.groups);
        let groups_of = |t: &str| per_group.values().filter(|v| v.1 == t).count();
        assert_eq!((groups_of("hot"), groups_of("warm")), (h, w));
        // Poisson at 10/s: 2,000 arrivals over about 200 s, in order.
        let times: Vec<f64> = pa.iter().map(|x| x.2.unwrap().as_secs_f64()).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        let span = times.last().unwrap();
        assert!((170.0..230.0).contains(span), "{span}");
        assert_eq!(CachePressureSpec::ordinal(&pa[17].0), Some(17));
        assert_eq!(CachePressureSpec::ordinal("sp-1-2"), None);
    }
}
