//! The measured fleet: instant pods publishing KV events, a round-robin Envoy, the no-op processor
//! behind an Envoy, kv-router (approximate) behind an Envoy, kv-router (precise) behind an Envoy.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use super::super::noop_extproc::NoopServer;
use super::super::strategy::Strategy;
use super::PathKind;
use kv_testkit::deploy::{self, Binaries, EnvoyOptions, EnvoyProc, EventPod, RouterProc};

/// The running fleet; everything stops when it is dropped.
pub(super) struct Fleet {
    pub(super) pods: Vec<EventPod>,
    pub(super) rr_envoy: EnvoyProc,
    pub(super) router: RouterProc,
    pub(super) kv_envoy: EnvoyProc,
    pub(super) precise: RouterProc,
    pub(super) precise_envoy: EnvoyProc,
    pub(super) noop: NoopServer,
    pub(super) noop_envoy: EnvoyProc,
}

impl Fleet {
    pub(super) async fn start(bins: &Binaries, envoy: &Path, pods: usize) -> Result<Self> {
        let sim_args: Vec<String> = [
            "--prefill-us-per-token",
            "0",
            "--ttft-base-ms",
            "0",
            "--decode-ms-per-token",
            "0",
            // All sixteen 400 KB prompts (~100k tokens, 6,400 blocks each) fit on one pod.
            "--num-gpu-blocks",
            "262144",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let pods = (0..pods)
            .map(|i| EventPod::spawn(&bins.vllm_sim, &format!("pod-{i}"), &sim_args))
            .collect::<Result<Vec<_>>>()?;
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.sim.addr).collect();
        // Same Envoy options on every path, so only the filter chain differs.
        let eopts = EnvoyOptions {
            concurrency: 2,
            ..Default::default()
        };
        let buffered = deploy::envoy_template("override-host-buffered.yaml")?;
        let rr_envoy = EnvoyProc::spawn_with(
            envoy,
            &deploy::envoy_template("round-robin.yaml")?,
            None,
            &addrs,
            &eopts,
        )
        .await
        .context("starting the round-robin Envoy")?;
        // Fresh ports per router: each config from its own local_router_config.
        let router_config = || -> Result<_> {
            let mut cfg = deploy::local_router_config(&addrs)?;
            cfg.log.level = "warn".into();
            EventPod::set_endpoints(&mut cfg, &pods);
            Ok(cfg)
        };
        let cfg = router_config()?;
        let fallbacks = cfg.fallbacks;
        let router = RouterProc::spawn(&bins.kv_router, &cfg)
            .await
            .context("starting kv-router")?;
        router
            .wait_pods_ready(addrs.len(), Duration::from_secs(15))
            .await?;
        let kv_envoy = EnvoyProc::spawn_with(envoy, &buffered, Some(router.grpc), &addrs, &eopts)
            .await
            .context("starting the kv-router Envoy")?;
        // The same pods' KV events and vllm-sim's tokenizer, as `kv-bench compare`'s precise.
        let precise_cfg = Strategy::Precise.router_config(&router_config()?, super::load::MODEL);
        let precise = RouterProc::spawn(&bins.kv_router, &precise_cfg)
            .await
            .context("starting the precise kv-router")?;
        precise
            .wait_pods_ready(addrs.len(), Duration::from_secs(15))
            .await?;
        let precise_envoy =
            EnvoyProc::spawn_with(envoy, &buffered, Some(precise.grpc), &addrs, &eopts)
                .await
                .context("starting the precise kv-router Envoy")?;
        let noop = NoopServer::start(&addrs, fallbacks)?;
        let noop_envoy = EnvoyProc::spawn_with(envoy, &buffered, Some(noop.addr), &addrs, &eopts)
            .await
            .context("starting the no-op ext_proc Envoy")?;
        Ok(Self {
            pods,
            rr_envoy,
            router,
            kv_envoy,
            precise,
            precise_envoy,
            noop,
            noop_envoy,
        })
    }

    pub(super) fn urls(&self, path: PathKind) -> Vec<String> {
        let u = |base: String| vec![format!("{base}/v1/completions")];
        match path {
            PathKind::Direct => self
                .pods
                .iter()
                .map(|p| format!("{}/v1/completions", p.sim.url()))
                .collect(),
            PathKind::EnvoyRoundRobin => u(self.rr_envoy.url()),
            PathKind::EnvoyNoopExtProc => u(self.noop_envoy.url()),
            PathKind::EnvoyKvRouter => u(self.kv_envoy.url()),
            PathKind::EnvoyKvRouterPrecise => u(self.precise_envoy.url()),
        }
    }

    pub(super) fn envoy(&self, path: PathKind) -> Option<&EnvoyProc> {
        match path {
            PathKind::Direct => None,
            PathKind::EnvoyRoundRobin => Some(&self.rr_envoy),
            PathKind::EnvoyNoopExtProc => Some(&self.noop_envoy),
            PathKind::EnvoyKvRouter => Some(&self.kv_envoy),
            PathKind::EnvoyKvRouterPrecise => Some(&self.precise_envoy),
        }
    }

    pub(super) fn diag(&self) -> String {
        format!(
            "kv-router stderr:\n{}\nprecise kv-router stderr:\n{}\nkv-router Envoy stderr:\n{}\n\
             no-op Envoy stderr:\n{}",
            self.router.stderr_tail(20),
            self.precise.stderr_tail(20),
            self.kv_envoy.stderr_tail(10),
            self.noop_envoy.stderr_tail(10)
        )
    }
}
