//! One strategy's processes under `kv-bench compare`: its kv-router replicas, the Envoy in front
//! of them and, for the shared index, the Redis they share; what they report at the end of a run
//! (shared-index counters, CPU time).

use std::time::Duration;

use anyhow::{Context, Result};

use super::{envoy_options, wait_caught_up, CompareFleet};
use kv_router::config::Config;
use kv_testkit::deploy::{self, Binaries, EnvoyOptions, EnvoyProc, RedisProc, RouterProc};

/// One strategy's processes: its kv-router replicas, the Envoy in front of them and, for the
/// shared index, the Redis they share. Dropping it stops them all.
pub(crate) struct Stack {
    envoy: EnvoyProc,
    routers: Vec<RouterProc>,
    redis: Option<RedisProc>,
}

impl Stack {
    /// The URL of its Envoy.
    pub(crate) fn envoy_url(&self) -> String {
        self.envoy.url()
    }

    /// CPU seconds its routers and Redis have used so far (None if one cannot say).
    pub(crate) fn cpu_seconds(&self) -> Option<f64> {
        let routers = self.routers.iter().map(RouterProc::cpu_seconds);
        let redis = self.redis.iter().map(RedisProc::cpu_seconds);
        routers.chain(redis).sum()
    }

    /// Process ids of its kv-router replicas (those still running).
    pub(crate) fn router_pids(&mut self) -> Vec<u32> {
        self.routers
            .iter_mut()
            .filter_map(|r| r.process().pid())
            .collect()
    }

    /// The first replica's `/metrics`.
    pub(crate) async fn first_metrics(&self) -> Result<String> {
        self.routers[0]
            .metrics()
            .await
            .context("reading a router's /metrics")
    }

    /// Writes each replica's `/metrics` to `dir/<label>-<replica>.prom`.
    pub(crate) async fn save_metrics(&self, dir: &std::path::Path, label: &str) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (i, r) in self.routers.iter().enumerate() {
            let stem = format!("{}-{i}", label.replace(' ', ""));
            let path = dir.join(format!("{stem}.prom"));
            let text = r.metrics().await.context("reading a router's /metrics")?;
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            // Its log too (with `RUST_LOG=kv_router=debug`, one line per decision).
            let log = dir.join(format!("{stem}.log"));
            std::fs::copy(r.log_path(), &log)
                .with_context(|| format!("writing {}", log.display()))?;
        }
        Ok(())
    }

    /// Each replica's shared-index counters (lookups by source, fallbacks by reason), one line
    /// per replica, and the lookups that fell back from the shared index summed over them; None
    /// without Redis. Shows whether a run measured the shared index or the fallback.
    pub(crate) async fn redis_counters(&self) -> Option<(Vec<String>, u64)> {
        self.redis.as_ref()?;
        let mut out = Vec::new();
        let mut fallbacks = 0;
        for (i, r) in self.routers.iter().enumerate() {
            let text = r
                .metrics()
                .await
                .unwrap_or_else(|e| format!("# unreachable: {e:#}"));
            let counters: Vec<String> = text
                .lines()
                .filter(|l| {
                    l.starts_with("kv_router_redis_lookups_total")
                        || l.starts_with("kv_router_redis_fallbacks_total")
                        || l.starts_with("kv_router_redis_writes_dropped_total")
                        || l.starts_with("kv_router_redis_mirror_reloads_total")
                        || l.starts_with("kv_router_redis_mirror_publish_dropped_total")
                        || l.starts_with("kv_router_redis_mirror_applied_total")
                        || l.starts_with("kv_router_redis_record_skipped_total")
                        || l.starts_with("kv_router_redis_load_charges_total")
                        || l.starts_with("kv_router_redis_load_dropped_total")
                        || l.starts_with("kv_router_redis_load_peer_charges_total")
                        || l.starts_with("kv_router_redis_load_peer_dropped_total")
                })
                .map(|l| l.trim_start_matches("kv_router_redis_").to_string())
                .collect();
            // p50 and p99 of a lag histogram, in ms, when it has observations.
            let lag = |what: &str, metric: &str| {
                let q = |q| histogram_quantile(&text, metric, q);
                match (q(0.5), q(0.99)) {
                    (Some(p50), Some(p99)) => format!(
                        ", {what} lag p50 ≤ {:.2} ms, p99 ≤ {:.2} ms",
                        p50 * 1e3,
                        p99 * 1e3
                    ),
                    _ => String::new(),
                }
            };
            let lag = [
                lag("mirror", "kv_router_redis_mirror_lag_seconds"),
                lag("load", "kv_router_redis_load_lag_seconds"),
                lag("datagram", "kv_router_redis_load_peer_lag_seconds"),
            ]
            .concat();
            out.push(format!("replica {i}: {}{lag}", counters.join(", ")));
            // An unreachable replica's lookups are unknown: count it as one that fell back.
            fallbacks += counter_sum(&text, "kv_router_redis_fallbacks_total").unwrap_or(1);
        }
        Some((out, fallbacks))
    }

    /// `replicas` routers with `cfg` (pointed at a fresh Redis from `redis_bin` when given),
    /// each with every pod ready, then Envoy with all of them in its `kv_router` cluster.
    pub(crate) async fn start(
        bins: &Binaries,
        fleet: &CompareFleet,
        cfg: Config,
        replicas: usize,
        redis_bin: Option<&std::path::Path>,
    ) -> Result<Self> {
        Self::start_behind(
            bins,
            fleet,
            cfg,
            replicas,
            redis_bin,
            "override-host-buffered.yaml",
        )
        .await
    }

    /// [`Self::start`] behind Envoy's configuration `envoy_template` (a file under `envoy/`).
    pub(crate) async fn start_behind(
        bins: &Binaries,
        fleet: &CompareFleet,
        mut cfg: Config,
        replicas: usize,
        redis_bin: Option<&std::path::Path>,
        envoy_template: &str,
    ) -> Result<Self> {
        let redis = redis_bin.map(RedisProc::start).transpose()?;
        if let Some(r) = &redis {
            cfg.index.redis.url = r.url();
        }
        let addrs = fleet.addrs();
        let mut routers = Vec::new();
        for _ in 0..replicas.max(1) {
            let mut c = cfg.clone();
            // Each replica its own ports (spawn retries with fresh ones on a clash).
            c.listen.grpc = format!("127.0.0.1:{}", deploy::free_port()?);
            c.listen.admin = format!("127.0.0.1:{}", deploy::free_port()?);
            let router = RouterProc::spawn(&bins.kv_router, &c).await?;
            router
                .wait_pods_ready(addrs.len(), Duration::from_secs(20))
                .await?;
            if c.kv_events.enabled {
                wait_caught_up(&router, addrs.len(), Duration::from_secs(90)).await?;
            }
            routers.push(router);
        }
        let envoy = EnvoyProc::spawn_with(
            &fleet.envoy_bin,
            &deploy::envoy_template(envoy_template)?,
            Some(routers[0].grpc),
            &addrs,
            &EnvoyOptions {
                more_pickers: routers[1..].iter().map(|r| r.grpc).collect(),
                ..envoy_options()
            },
        )
        .await?;
        Ok(Self {
            envoy,
            routers,
            redis,
        })
    }
}

/// The sum of every sample of counter `name` in a Prometheus text (0 when it has none); None for
/// a text that is not a scrape (an unreachable replica).
pub fn counter_sum(text: &str, name: &str) -> Option<u64> {
    if text.starts_with("# unreachable") {
        return None;
    }
    let sum = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            // `name{labels} v` or `name v`, not a longer name that starts with it.
            let value = match rest.chars().next()? {
                '{' => rest.split_once("} ")?.1,
                ' ' => rest,
                _ => return None,
            };
            value.trim().parse::<f64>().ok()
        })
        .sum::<f64>();
    Some(sum as u64)
}

/// The cumulative buckets (upper bound, count) of histogram `name` in a Prometheus text.
fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The upper bound of the bucket holding quantile `q` of histogram `name` in a Prometheus text
/// (`None` when it has no observations).
pub fn histogram_quantile(text: &str, name: &str, q: f64) -> Option<f64> {
    let buckets = buckets(text, name);
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}

/// Quantile `q` of histogram `name` interpolated linearly inside its bucket, as Prometheus'
/// `histogram_quantile` does (the first bucket starts at 0; one in `+Inf` gives the last finite
/// bound). `None` when it has no observations.
pub fn histogram_quantile_linear(text: &str, name: &str, q: f64) -> Option<f64> {
    let buckets = buckets(text, name);
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let i = buckets.iter().position(|(_, c)| *c >= rank)?;
    let (lo, below) = match i {
        0 => (0.0, 0.0),
        _ => buckets[i - 1],
    };
    let (hi, count) = buckets[i];
    if !hi.is_finite() {
        return Some(lo);
    }
    let inside = count - below;
    Some(match inside > 0.0 {
        true => lo + (hi - lo) * (rank - below) / inside,
        false => hi,
    })
}

#[cfg(test)]
mod quantile_tests {
    use super::{counter_sum, histogram_quantile, histogram_quantile_linear};

    #[test]
    fn counter_sums_add_every_label_and_no_longer_name() {
        let text = "# HELP x_total x\nx_total{reason=\"timeout\"} 3\nx_total{reason=\"retry_wait\"} 2\nx_total_other 9\ny_total 4\n";
        assert_eq!(counter_sum(text, "x_total"), Some(5));
        assert_eq!(counter_sum(text, "y_total"), Some(4));
        assert_eq!(counter_sum(text, "z_total"), Some(0));
        assert_eq!(counter_sum("# unreachable: refused", "x_total"), None);
    }

    #[test]
    fn quantiles_are_bucket_upper_bounds() {
        let text = "x_bucket{le=\"0.001\"} 50\nx_bucket{le=\"0.01\"} 98\nx_bucket{le=\"0.1\"} 100\nx_bucket{le=\"+Inf\"} 100\n";
        assert_eq!(histogram_quantile(text, "x", 0.5), Some(0.001));
        assert_eq!(histogram_quantile(text, "x", 0.99), Some(0.1));
        assert_eq!(histogram_quantile("", "x", 0.5), None);
    }

    #[test]
    fn linear_quantiles_interpolate_inside_the_bucket() {
        let text =
            "x_bucket{le=\"0.001\"} 50\nx_bucket{le=\"0.002\"} 100\nx_bucket{le=\"+Inf\"} 100\n";
        assert_eq!(histogram_quantile_linear(text, "x", 0.25), Some(0.0005));
        assert_eq!(histogram_quantile_linear(text, "x", 0.75), Some(0.0015));
        let over = "x_bucket{le=\"0.001\"} 1\nx_bucket{le=\"+Inf\"} 4\n";
        assert_eq!(histogram_quantile_linear(over, "x", 0.9), Some(0.001));
        assert_eq!(histogram_quantile_linear("", "x", 0.5), None);
    }
}
