//! Warm start (`index.warm_start`): before it serves, a starting replica copies the memory index
//! of its live peers (`GET /debug/index/snapshot` on their admin ports), so a restart or a
//! rolling update does not start routing from nothing. Bounded in time (`timeout_ms`, the whole
//! of it) and in bytes (`max_bytes`, checked before and while reading); on any failure the
//! replica starts cold, which is logged once and counted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::config::WarmStartConfig;
use crate::index::warm::{self, Imported, Snapshot};
use crate::index::KvIndex;
use crate::pods::{PodId, PodRegistry};

/// Addresses tried per configured peer name (a headless Service lists every replica).
const MAX_ADDRS_PER_PEER: usize = 16;
/// A peer that does not accept the connection within this is skipped for the next one.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// `kv_router_warm_starts_total{result}` and the entries taken in.
#[derive(Clone, Default)]
pub(super) struct WarmMetrics {
    starts: Family<Vec<(String, String)>, Counter>,
    entries: Counter,
}

impl WarmMetrics {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "warm_starts",
            "Starts with index.warm_start.peers set, by result: warm (a peer's index taken in) or cold (no peer answered in time; see the log)",
            m.starts.clone(),
        );
        registry.register(
            "warm_start_entries",
            "(block key, pod) index entries taken in from peers at start",
            m.entries.clone(),
        );
        m
    }

    fn count(&self, result: &str) {
        self.starts
            .get_or_create(&vec![("result".to_string(), result.to_string())])
            .inc();
    }
}

/// What the warm start reads and writes.
pub(super) struct WarmStart<'a> {
    pub cfg: &'a WarmStartConfig,
    /// `admin.token`: the peers' `/debug/*` asks for it.
    pub token: Option<Arc<str>>,
    pub index: &'a Arc<dyn KvIndex>,
    pub pods: &'a PodRegistry,
    /// The router's monotonic clock (the index's time base).
    pub now_ms: &'a (dyn Fn() -> u64 + Sync),
    pub metrics: &'a WarmMetrics,
}

impl WarmStart<'_> {
    /// Takes in every answering peer's index, within `timeout_ms`; cold (logged, counted) when
    /// none does. Nothing to do without peers.
    pub(super) async fn run(self) {
        if self.cfg.peers.is_empty() {
            return;
        }
        let budget = Duration::from_millis(self.cfg.timeout_ms);
        let started = Instant::now();
        match tokio::time::timeout(budget, self.take_from_peers(started + budget)).await {
            Ok(Ok((done, peers))) => {
                self.metrics.count("warm");
                self.metrics.entries.inc_by(done.entries as u64);
                info!(
                    peers,
                    entries = done.entries,
                    pods = done.pods,
                    unknown_pods = done.unknown_pods,
                    ms = started.elapsed().as_millis() as u64,
                    "warm start: index taken in from live peers"
                );
            }
            Ok(Err(why)) => {
                self.metrics.count("cold");
                warn!(reason = %why, "warm start failed: starting with an empty index");
            }
            Err(_) => {
                self.metrics.count("cold");
                warn!(
                    timeout_ms = self.cfg.timeout_ms,
                    "warm start timed out: starting with an empty index"
                );
            }
        }
    }

    /// Every address of every peer in turn; the imports add up. Err: none answered.
    async fn take_from_peers(&self, deadline: Instant) -> Result<(Imported, usize), String> {
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .no_proxy()
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        let mut total = Imported::default();
        let mut answered = 0;
        let mut last = String::from("no peer address resolved");
        for peer in &self.cfg.peers {
            let addrs = match tokio::net::lookup_host(peer.as_str()).await {
                Ok(a) => a.take(MAX_ADDRS_PER_PEER).collect::<Vec<_>>(),
                Err(e) => {
                    last = format!("{peer}: {e}");
                    continue;
                }
            };
            for addr in addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                let snap = match self.fetch(&client, addr, left).await {
                    Ok(s) => s,
                    Err(e) => {
                        last = format!("{peer} ({addr}): {e}");
                        continue;
                    }
                };
                let known = self.pods.snapshot();
                let known = |id: &PodId| known.get(id).is_some();
                let Some(done) = self.index.warm_restore(&snap, (self.now_ms)(), &known) else {
                    return Err("this index takes no snapshot".into());
                };
                answered += 1;
                total.entries += done.entries;
                total.pods = total.pods.max(done.pods);
                total.unknown_pods = total.unknown_pods.max(done.unknown_pods);
                total.skipped += done.skipped;
            }
        }
        if answered == 0 {
            return Err(last);
        }
        Ok((total, answered))
    }

    /// One peer's snapshot, read within `left` and `max_bytes`.
    async fn fetch(
        &self,
        client: &reqwest::Client,
        addr: SocketAddr,
        left: Duration,
    ) -> Result<Snapshot, String> {
        let mut req = client
            .get(format!("http://{addr}/debug/index/snapshot"))
            .timeout(left);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let mut resp = req.send().await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("answered {}", resp.status()));
        }
        let max = self.cfg.max_bytes;
        if resp.content_length().is_some_and(|n| n > max as u64) {
            return Err(format!("snapshot larger than {max} bytes"));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
            if body.len() + chunk.len() > max {
                return Err(format!("snapshot larger than {max} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        warm::decode(&body, max, self.cfg.max_entries).map_err(|e| e.to_string())
    }
}
