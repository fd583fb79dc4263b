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

/// The upper bound of the bucket holding quantile `q` of histogram `name` in a Prometheus text
/// (`None` when it has no observations).
pub fn histogram_quantile(text: &str, name: &str, q: f64) -> Option<f64> {
    let prefix = format!("{name}_bucket{{le=\"");
    let buckets: Vec<(f64, f64)> = text
        .lines()
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
        .collect();
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}

#[cfg(test)]
mod quantile_tests {
    use super::{counter_sum, histogram_quantile};

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
}
