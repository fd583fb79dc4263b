//! `--engine llama`: the strategies of one cell on real llama.cpp `llama-server` pods that
//! kv-bench starts itself (opt-in; `make llama` builds the server and fetches a small model).
//! Every strategy gets a fresh fleet, so each starts with empty prompt caches; the hit ratio is
//! the engines' own (`usage.prompt_tokens_details.cached_tokens`), and Envoy names the serving
//! pod in `x-vllm-sim-pod` since llama.cpp does not. No oracle: a llama.cpp slot keeps one
//! prompt, not an LRU of blocks, so the block oracles do not describe it.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use super::report::Summary;
use super::strategy::Strategy;
use kv_router::config::{EngineSetting, Preset};
use kv_testkit::deploy::{
    self, check_llama, Binaries, EnvoyOptions, EnvoyProc, LlamaOptions, LlamaPod, RouterProc,
};
use kv_testkit::runner::{self, RunOptions};
use kv_testkit::workload::Workload;

/// Strategies a llama.cpp fleet can run: not `precise` (llama.cpp publishes no KV events) nor
/// the `redis` ones (one router here).
pub fn supported(s: Strategy) -> bool {
    !matches!(
        s,
        Strategy::Precise | Strategy::Redis | Strategy::RedisOwnLoad
    )
}

/// One cell: `pods` llama.cpp pods per strategy, `workload()` through Envoy (round robin
/// without a router, the others through kv-router), in the order given.
#[allow(clippy::too_many_arguments)] // one call site, each argument a separate knob of the run
pub async fn compare(
    bins: &Binaries,
    envoy: Option<&Path>,
    llama: &LlamaOptions,
    pods: usize,
    strategies: &[Strategy],
    workload: impl Fn() -> Workload,
    concurrency: Option<usize>,
) -> Result<Vec<Summary>> {
    check_llama(llama)?;
    let envoy_bin = deploy::find_envoy(envoy)?;
    let mut out = Vec::new();
    for &strategy in strategies {
        let label = strategy.as_str().to_string();
        if !supported(strategy) {
            eprintln!("kv-bench: {label}: skipped (not on llama.cpp pods)");
            continue;
        }
        let fleet = LlamaPod::fleet(llama, pods).await?;
        let addrs: Vec<_> = fleet.iter().map(|p| p.addr).collect();
        let eopts = EnvoyOptions {
            concurrency: 2,
            pod_header: true,
            ..Default::default()
        };
        let mut router = None;
        let envoy = match strategy {
            Strategy::RoundRobin => {
                let t = deploy::envoy_template("round-robin.yaml")?;
                EnvoyProc::spawn_with(&envoy_bin, &t, None, &addrs, &eopts).await?
            }
            _ => {
                let mut cfg =
                    strategy.router_config(&deploy::local_router_config(&addrs)?, &llama.alias);
                cfg.log.level = "warn".into();
                cfg.pods.engine = EngineSetting::Preset(Preset::Llamacpp);
                let r = RouterProc::spawn(&bins.kv_router, &cfg)
                    .await
                    .with_context(|| format!("starting {label}"))?;
                r.wait_pods_ready(pods, Duration::from_secs(30)).await?;
                let t = deploy::envoy_template(strategy.envoy_template())?;
                let e = EnvoyProc::spawn_with(&envoy_bin, &t, Some(r.grpc), &addrs, &eopts).await?;
                router = Some(r);
                e
            }
        };
        eprintln!("kv-bench: {label} on {pods} llama.cpp pods");
        let run = runner::run(
            workload(),
            &RunOptions {
                target: envoy.url(),
                concurrency,
                request_timeout: Duration::from_secs(600),
                label: label.clone(),
                progress: false,
            },
        )
        .await?;
        // A failed request's reason (status and body excerpt; no prompt text is sent back).
        for r in run.records.iter().filter(|r| r.error.is_some()) {
            eprintln!(
                "kv-bench: {label}: session {} turn {} failed on {}: {}",
                r.session,
                r.turn,
                r.pod.as_deref().unwrap_or("?"),
                r.error.as_deref().unwrap_or_default()
            );
        }
        // The engines' own prompt counters, beside the responses' cached tokens.
        for (i, p) in fleet.iter().enumerate() {
            let m = p.metrics().await.unwrap_or_default();
            eprintln!("kv-bench: {label}: pod {i}: {}", prompt_counters(&m));
        }
        drop((envoy, router, fleet));
        out.push(Summary::of(&run, Some(pods)));
    }
    Ok(out)
}

/// `llamacpp:prompt_tokens_total` (prompt tokens the engine computed, cache hits excluded) and
/// `llamacpp:prompt_seconds_total` of one pod, as one line.
pub fn prompt_counters(metrics: &str) -> String {
    let get = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or("?")
            .to_string()
    };
    format!(
        "prompt tokens computed {}, prompt seconds {}",
        get("llamacpp:prompt_tokens_total"),
        get("llamacpp:prompt_seconds_total")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_engines_prompt_counters_and_skips_what_it_cannot_run() {
        let m = "# HELP x\nllamacpp:prompt_tokens_total 1234\nllamacpp:prompt_seconds_total 15.5\n";
        assert_eq!(
            prompt_counters(m),
            "prompt tokens computed 1234, prompt seconds 15.5"
        );
        assert!(prompt_counters("").contains('?'));
        assert!(supported(Strategy::Weighted) && supported(Strategy::RoundRobin));
        assert!(!supported(Strategy::Precise) && !supported(Strategy::Redis));
    }
}
