//! Routing strategies under comparison: a name and the router configuration it stands for. One
//! type for `kv-bench compare` (live processes) and `kv-bench simulate` (virtual time).

use serde::Serialize;

use kv_router::config::{Config, IndexBackend, Policy, TokenizerConfig};

/// A routing strategy: one router configuration, named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Round robin (`compare` runs it as Envoy's own round robin, without ext_proc).
    RoundRobin,
    /// `policy: random`.
    Random,
    /// `policy: least-loaded` (the load scorer's busy signal).
    LeastLoaded,
    /// Pure prefix affinity: the weighted policy with the prefix scorer alone and every gate
    /// off (no saturation gate, no hot-pod spill). Shows what load awareness adds.
    PrefixOnly,
    /// Router defaults: prefix + session + load scorers behind the gates, approximate index
    /// learned from the router's own decisions.
    Weighted,
    /// `policy: predicted-ttft` on the approximate index: the lowest predicted time to first
    /// token from each pod's learned prefill speed.
    PredictedTtft,
    /// The defaults on the precise index fed by the pods' KV events (exact token blocks).
    Precise,
    /// The defaults on the shared Redis index.
    Redis,
    /// The shared Redis index with `index.redis.mirror_load` off: each replica counts only its
    /// own in-flight load and conversation placements (not in compare's default set: run it
    /// beside `redis` to measure what sharing the load view changes).
    RedisOwnLoad,
    /// The defaults behind Envoy's FULL_DUPLEX_STREAMED configuration (`gie-full-duplex.yaml`,
    /// the Endpoint Picker Protocol) instead of BUFFERED: the router also sees each response,
    /// its start and its end. Run beside `weighted`, it shows what the body mode changes.
    WeightedFullDuplex,
    /// Weighted on a prefill/decode fleet: the router disaggregates long uncached prompts
    /// (the pods' roles kept; every other strategy sees the same pods as aggregated).
    Pd,
    /// Precise on a prefill/decode fleet.
    PrecisePd,
}

impl Strategy {
    /// Every strategy an aggregated fleet runs (`compare`'s default): all but the P/D ones.
    pub const AGGREGATED: [Strategy; 8] = [
        Strategy::RoundRobin,
        Strategy::Random,
        Strategy::LeastLoaded,
        Strategy::PrefixOnly,
        Strategy::Weighted,
        Strategy::PredictedTtft,
        Strategy::Precise,
        Strategy::Redis,
    ];

    /// Every strategy, baselines first: the aggregated ones, `redis-own-load`,
    /// `weighted-full-duplex`, then the P/D ones.
    pub const ALL: [Strategy; 12] = {
        let mut all = [Strategy::Pd; 12];
        let mut i = 0;
        while i < Strategy::AGGREGATED.len() {
            all[i] = Strategy::AGGREGATED[i];
            i += 1;
        }
        all[8] = Strategy::RedisOwnLoad;
        all[9] = Strategy::WeightedFullDuplex;
        all[10] = Strategy::Pd;
        all[11] = Strategy::PrecisePd;
        all
    };

    /// Stable name (CLI value, report label).
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::RoundRobin => "round-robin",
            Strategy::Random => "random",
            Strategy::LeastLoaded => "least-loaded",
            Strategy::PrefixOnly => "prefix-only",
            Strategy::Weighted => "weighted",
            Strategy::PredictedTtft => "predicted-ttft",
            Strategy::Precise => "precise",
            Strategy::Redis => "redis",
            Strategy::RedisOwnLoad => "redis-own-load",
            Strategy::WeightedFullDuplex => "weighted-full-duplex",
            Strategy::Pd => "pd",
            Strategy::PrecisePd => "precise-pd",
        }
    }

    /// Why `kv-bench simulate` (one router in virtual time) cannot run the strategy, if it
    /// cannot. `kv-bench compare` runs every strategy.
    pub fn unavailable(self) -> Option<&'static str> {
        match self {
            Strategy::Redis | Strategy::RedisOwnLoad => Some(
                "the fleet simulator runs one router in one process; the shared Redis index \
                 needs live replicas (kv-bench compare; simulate models them with --replicas)",
            ),
            Strategy::Pd | Strategy::PrecisePd => Some(
                "the fleet simulator models aggregated pods only; prefill/decode roles need \
                 live pods (kv-bench compare --pd-prefill)",
            ),
            Strategy::WeightedFullDuplex => {
                Some("body modes are Envoy's: the fleet simulator has no Envoy (kv-bench compare)")
            }
            _ => None,
        }
    }

    /// Whether the strategy routes by the pods' prefill/decode roles.
    pub fn disaggregates(self) -> bool {
        matches!(self, Strategy::Pd | Strategy::PrecisePd)
    }

    /// Every strategy the fleet simulator can run, baselines first.
    pub fn available() -> Vec<Strategy> {
        Self::ALL
            .into_iter()
            .filter(|s| s.unavailable().is_none())
            .collect()
    }

    /// kv-router replicas `compare` puts behind Envoy for this strategy by default: two for the
    /// shared index (what it is for), one otherwise, none for Envoy's own round robin.
    pub fn default_replicas(self) -> usize {
        match self {
            Strategy::RoundRobin => 0,
            Strategy::Redis | Strategy::RedisOwnLoad => 2,
            _ => 1,
        }
    }

    /// The Envoy configuration (under `envoy/`) the strategy's routers sit behind.
    pub fn envoy_template(self) -> &'static str {
        match self {
            Strategy::WeightedFullDuplex => "gie-full-duplex.yaml",
            _ => "override-host-buffered.yaml",
        }
    }

    /// Whether the strategy needs a Redis/Valkey server.
    pub fn needs_redis(self) -> bool {
        matches!(self, Strategy::Redis | Strategy::RedisOwnLoad)
    }

    /// The router configuration of this strategy on top of `base`, for requests naming `model`
    /// (precise mode gets vllm-sim's pseudo tokenizer for it). `redis` leaves `index.redis.url`
    /// to the caller, who knows where the server runs. Only the P/D strategies keep the static
    /// pods' roles: the others route the same pods as one aggregated fleet.
    pub fn router_config(self, base: &Config, model: &str) -> Config {
        let mut cfg = base.clone();
        cfg.policy = Policy::Weighted;
        if !self.disaggregates() {
            for p in &mut cfg.pods.static_pods {
                p.role = None;
            }
        }
        match self {
            Strategy::RoundRobin => cfg.policy = Policy::RoundRobin,
            Strategy::Random => cfg.policy = Policy::Random,
            Strategy::LeastLoaded => cfg.policy = Policy::LeastLoaded,
            Strategy::PrefixOnly => {
                cfg.scorers.prefix.weight = 1.0;
                cfg.scorers.session.weight = 0.0;
                cfg.scorers.load.weight = 0.0;
                cfg.gate.enabled = false;
            }
            Strategy::Weighted | Strategy::WeightedFullDuplex | Strategy::Pd => {}
            Strategy::PredictedTtft => cfg.policy = Policy::PredictedTtft,
            Strategy::Redis | Strategy::RedisOwnLoad => {
                cfg.index.backend = IndexBackend::Redis;
                cfg.index.redis.key_prefix = "kv-bench".into();
                if self == Strategy::RedisOwnLoad {
                    cfg.index.redis.mirror_load = false;
                }
            }
            Strategy::Precise | Strategy::PrecisePd => {
                cfg.kv_events.enabled = true;
                cfg.kv_events.block_tokens = 16;
                cfg.tokenizers = vec![TokenizerConfig {
                    model: model.into(),
                    tokenizer_json: None,
                    tokenizer_config: None,
                    chat_template: None,
                    builtin: true,
                }];
            }
        }
        cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn strategies_map_to_router_configs() {
        let base = Config::default();
        let cfg = |s: Strategy| s.router_config(&base, "m");
        assert_eq!(cfg(Strategy::RoundRobin).policy, Policy::RoundRobin);
        assert_eq!(cfg(Strategy::Random).policy, Policy::Random);
        let p = cfg(Strategy::PrefixOnly);
        assert_eq!(
            (
                p.policy,
                p.scorers.prefix.weight,
                p.scorers.session.weight,
                p.scorers.load.weight,
                p.gate.enabled
            ),
            (Policy::Weighted, 1.0, 0.0, 0.0, false)
        );
        assert_eq!(cfg(Strategy::PredictedTtft).policy, Policy::PredictedTtft);
        let w = cfg(Strategy::Weighted);
        assert!(!w.kv_events.enabled);
        assert_eq!(w.scorers, base.scorers, "weighted is the defaults");
        assert_eq!(w.gate, base.gate);
        let precise = cfg(Strategy::Precise);
        assert!(precise.kv_events.enabled);
        assert_eq!(precise.tokenizers[0].model, "m");
        assert!(precise.tokenizers[0].builtin);
        let r = cfg(Strategy::Redis);
        assert_eq!(r.index.backend, IndexBackend::Redis);
        assert_eq!(
            (&r.scorers, &r.gate),
            (&w.scorers, &w.gate),
            "redis is weighted, shared"
        );
        assert!(r.index.redis.mirror_load, "redis keeps the default");
        let own = cfg(Strategy::RedisOwnLoad);
        assert_eq!(own.index.backend, IndexBackend::Redis);
        assert!(!own.index.redis.mirror_load);
        assert_eq!((&own.scorers, &own.gate), (&w.scorers, &w.gate));
        assert!(Strategy::RedisOwnLoad.needs_redis());
        assert_eq!(Strategy::RedisOwnLoad.default_replicas(), 2);
        assert_eq!(Strategy::Redis.default_replicas(), 2);
        assert_eq!(Strategy::Weighted.default_replicas(), 1);
        assert!(
            Strategy::Redis.unavailable().is_some(),
            "not in the simulator"
        );
        assert!(!Strategy::available().contains(&Strategy::Redis));
    }

    #[test]
    fn only_the_pd_strategies_keep_the_pods_roles() {
        let mut base = Config::default();
        let mut pod = kv_router::config::StaticPod::new("127.0.0.1:1", &["m"]);
        pod.role = Some(kv_router::pods::PodRole::Prefill);
        base.pods.static_pods.push(pod);
        let role = |s: Strategy| s.router_config(&base, "m").pods.static_pods[0].role;
        for s in Strategy::ALL {
            let want = s
                .disaggregates()
                .then_some(kv_router::pods::PodRole::Prefill);
            assert_eq!(role(s), want, "{}", s.as_str());
        }
        let (pd, w) = (
            cfg_of(Strategy::Pd, &base),
            cfg_of(Strategy::Weighted, &base),
        );
        assert_eq!(
            (pd.scorers, pd.gate, pd.kv_events.enabled),
            (w.scorers, w.gate, false)
        );
        assert!(cfg_of(Strategy::PrecisePd, &base).kv_events.enabled);
        assert!(Strategy::Pd.unavailable().is_some(), "not in the simulator");
        let aggregated: Vec<Strategy> = Strategy::ALL
            .into_iter()
            .filter(|s| {
                !s.disaggregates()
                    && !matches!(s, Strategy::RedisOwnLoad | Strategy::WeightedFullDuplex)
            })
            .collect();
        assert_eq!(aggregated, Strategy::AGGREGATED, "compare's default");
    }

    fn cfg_of(s: Strategy, base: &Config) -> Config {
        s.router_config(base, "m")
    }

    #[test]
    fn one_name_per_strategy_everywhere() {
        for s in Strategy::ALL {
            let cli = s.to_possible_value().unwrap();
            assert_eq!(cli.get_name(), s.as_str());
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
    }
}
