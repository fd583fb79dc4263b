//! Pod sources: the configured list, and DNS names of headless Services re-resolved periodically.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use async_trait::async_trait;
use thiserror::Error;

use super::{PodId, PodSpec};
use crate::config::{DnsSource as DnsConfig, StaticPod};

/// A source could not list its pods.
#[derive(Debug, Error)]
pub enum PodSourceError {
    /// DNS resolution failed.
    #[error("resolving {name}: {source}")]
    Dns {
        /// The name.
        name: String,
        /// The resolver error.
        source: std::io::Error,
    },
}

/// Lists the full current set of pods a source knows.
#[async_trait]
pub trait PodSource: Send + Sync {
    /// Stable name for logs.
    fn name(&self) -> String;
    /// The full current pod list.
    async fn pods(&self) -> Result<Vec<PodSpec>, PodSourceError>;
}

/// Pods listed in the config file.
#[derive(Debug, Clone)]
pub struct StaticSource {
    pods: Vec<PodSpec>,
}

impl StaticSource {
    /// From validated config entries.
    pub fn new(pods: &[StaticPod]) -> Self {
        let pods = pods
            .iter()
            .filter_map(|p| {
                let addr: SocketAddr = p.address.parse().ok()?;
                let mut labels = p.labels.clone();
                super::role::set_role(&mut labels, p.role);
                Some(PodSpec {
                    id: PodId::from(addr),
                    addr,
                    models: p.models.clone(),
                    labels,
                    kv_events_endpoint: p.kv_events_endpoint.clone(),
                    kv_events_replay_endpoint: p.kv_events_replay_endpoint.clone(),
                })
            })
            .collect();
        Self { pods }
    }
}

#[async_trait]
impl PodSource for StaticSource {
    fn name(&self) -> String {
        "static".into()
    }

    async fn pods(&self) -> Result<Vec<PodSpec>, PodSourceError> {
        Ok(self.pods.clone())
    }
}

/// Every address a DNS name resolves to is a pod (Kubernetes headless Service).
#[derive(Debug, Clone)]
pub struct DnsSource {
    cfg: DnsConfig,
    models: Vec<String>,
}

impl DnsSource {
    /// From a config entry and the models DNS pods serve (empty = learn).
    pub fn new(cfg: DnsConfig, models: Vec<String>) -> Self {
        Self { cfg, models }
    }
}

#[async_trait]
impl PodSource for DnsSource {
    fn name(&self) -> String {
        format!("dns:{}", self.cfg.name)
    }

    async fn pods(&self) -> Result<Vec<PodSpec>, PodSourceError> {
        let addrs = tokio::net::lookup_host((self.cfg.name.as_str(), self.cfg.port))
            .await
            .map_err(|source| PodSourceError::Dns {
                name: self.cfg.name.clone(),
                source,
            })?;
        let mut seen: Vec<SocketAddr> = addrs.collect();
        seen.sort();
        seen.dedup();
        let mut labels = BTreeMap::new();
        labels.insert("source".to_string(), self.name());
        super::role::set_role(&mut labels, self.cfg.role);
        Ok(seen
            .into_iter()
            .map(|addr| PodSpec {
                id: PodId::from(addr),
                addr,
                models: self.models.clone(),
                labels: labels.clone(),
                kv_events_endpoint: None,
                kv_events_replay_endpoint: None,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dns_source_resolves_localhost() {
        let src = DnsSource::new(
            DnsConfig {
                name: "localhost".into(),
                port: 8000,
                refresh_ms: 1000,
                engine: None,
                role: None,
            },
            vec!["m".into()],
        );
        let pods = src.pods().await.unwrap();
        assert!(pods
            .iter()
            .any(|p| p.addr.ip().is_loopback() && p.addr.port() == 8000));
        assert!(pods.iter().all(|p| p.models == vec!["m".to_string()]));
    }

    #[tokio::test]
    async fn dns_failure_is_an_error() {
        let src = DnsSource::new(
            DnsConfig {
                name: "no-such-host.invalid".into(),
                port: 1,
                refresh_ms: 1000,
                engine: None,
                role: None,
            },
            vec![],
        );
        assert!(src.pods().await.is_err());
    }
}
