//! Validation: every value range checked once at startup, all problems reported together,
//! each naming its dotted key.

use std::net::SocketAddr;

use super::{bounds, kubernetes, Config, ConfigError, IndexBackend, Problem};

impl Config {
    /// Checks every value; reports all problems at once.
    pub fn validate(self) -> Result<Self, ConfigError> {
        let mut p = Vec::new();
        let mut bad = |key: &str, reason: &str| {
            p.push(Problem {
                key: key.to_string(),
                reason: reason.to_string(),
            })
        };
        for (key, value) in [
            ("listen.grpc", &self.listen.grpc),
            ("listen.admin", &self.listen.admin),
        ] {
            if value.parse::<SocketAddr>().is_err() {
                bad(key, "must be an ip:port socket address");
            }
        }
        if !self.listen.grpc_health.is_empty()
            && self.listen.grpc_health.parse::<SocketAddr>().is_err()
        {
            bad(
                "listen.grpc_health",
                "must be an ip:port socket address, or empty",
            );
        }
        if self.body_limit_bytes < 1024 {
            bad("body_limit_bytes", "must be at least 1024");
        }
        if self.fallbacks > 16 {
            bad("fallbacks", "must be at most 16");
        }
        if self.blocks.size_chars < 4 {
            bad("blocks.size_chars", "must be at least 4");
        }
        if self.blocks.max_blocks == 0 {
            bad("blocks.max_blocks", "must be positive");
        }
        if self.index.ttl_ms == 0 {
            bad("index.ttl_ms", "must be positive");
        }
        if self.index.default_capacity_blocks == 0 {
            bad("index.default_capacity_blocks", "must be positive");
        }
        if !(self.index.capacity_factor > 0.0 && self.index.capacity_factor.is_finite()) {
            bad("index.capacity_factor", "must be a positive number");
        }
        if self.index.max_pod_cache_tokens == 0 {
            bad("index.max_pod_cache_tokens", "must be positive");
        }
        let warm = &self.index.warm_start;
        if !(1..=60_000).contains(&warm.timeout_ms) {
            bad("index.warm_start.timeout_ms", "must be in [1, 60000]");
        }
        if warm.max_bytes < 1024 {
            bad("index.warm_start.max_bytes", "must be at least 1024");
        }
        if warm.max_entries == 0 {
            bad("index.warm_start.max_entries", "must be positive");
        }
        if warm.peers.iter().any(|p| {
            p.rsplit_once(':')
                .is_none_or(|(h, port)| h.is_empty() || port.parse::<u16>().is_err())
        }) {
            bad(
                "index.warm_start.peers",
                "each must be host:port (an admin address)",
            );
        }
        if !warm.peers.is_empty()
            && (self.index.backend == IndexBackend::Redis || self.kv_events.enabled)
        {
            bad("index.warm_start.peers", "applies to the memory backend in approximate mode only (the Redis mirror reloads from Redis; KV events replay)");
        }
        if self.index.backend == IndexBackend::Redis {
            for (key, reason) in self.index.redis.problems() {
                bad(&format!("index.redis.{key}"), reason);
            }
        }
        let s = &self.scorers;
        for (key, w) in [
            ("scorers.prefix.weight", s.prefix.weight),
            ("scorers.session.weight", s.session.weight),
            ("scorers.load.weight", s.load.weight),
            ("scorers.load.queue_weight", s.load.queue_weight),
            ("scorers.load.kv_weight", s.load.kv_weight),
            ("scorers.load.tokens_weight", s.load.tokens_weight),
            ("scorers.ttft.prior_overhead_ms", s.ttft.prior_overhead_ms),
            ("scorers.ttft.tie_ms", s.ttft.tie_ms),
            ("scorers.ttft.tie_ratio", s.ttft.tie_ratio),
            ("scorers.ttft.work_weight", s.ttft.work_weight),
        ] {
            if !(w >= 0.0 && w.is_finite()) {
                bad(key, "must be a finite number >= 0");
            }
        }
        for (key, v) in [
            ("scorers.load.queue_full", s.load.queue_full),
            ("scorers.load.tokens_full", s.load.tokens_full),
            (
                "scorers.load.prefill_tokens_per_sec",
                s.load.prefill_tokens_per_sec,
            ),
            ("scorers.ttft.prior_weight", s.ttft.prior_weight),
            ("gate.max_waiting", self.gate.max_waiting),
            ("gate.max_inflight_tokens", self.gate.max_inflight_tokens),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                bad(key, "must be a positive number");
            }
        }
        if !(self.gate.hot_abs >= 0.0 && self.gate.hot_abs.is_finite()) {
            bad("gate.hot_abs", "must be a finite number >= 0");
        }
        if self.gate.spread_half_life_ms == 0 {
            bad("gate.spread_half_life_ms", "must be positive");
        }
        if !(self.gate.hot_rel >= 1.0 && self.gate.hot_rel.is_finite()) {
            bad("gate.hot_rel", "must be a finite number >= 1");
        }
        if !(self.gate.max_kv_usage > 0.0 && self.gate.max_kv_usage <= 1.0) {
            bad("gate.max_kv_usage", "must be in (0, 1]");
        }
        if s.session.capacity == 0 {
            bad("scorers.session.capacity", "must be positive");
        }
        if s.session.ttl_ms == 0 {
            bad("scorers.session.ttl_ms", "must be positive");
        }
        if s.session
            .headers
            .iter()
            .any(|h| h.is_empty() || h.chars().any(|c| c.is_ascii_uppercase()))
        {
            bad(
                "scorers.session.headers",
                "header names must be non-empty and lower-case",
            );
        }
        for (i, pod) in self.pods.static_pods.iter().enumerate() {
            if pod.address.parse::<SocketAddr>().is_err() {
                bad(
                    &format!("pods.static[{i}].address"),
                    "must be an ip:port socket address",
                );
            }
        }
        for (i, d) in self.pods.dns.iter().enumerate() {
            if d.name.is_empty() {
                bad(&format!("pods.dns[{i}].name"), "must not be empty");
            }
            if d.refresh_ms == 0 {
                bad(&format!("pods.dns[{i}].refresh_ms"), "must be positive");
            }
        }
        if let Some(k) = &self.pods.kubernetes {
            for (key, reason) in kubernetes::problems(k) {
                bad(&key, &reason);
            }
        }
        for (key, reason) in self.pods.engine_problems() {
            bad(&key, &reason);
        }
        for (key, reason) in self.pods.role_problems() {
            bad(&key, reason);
        }
        for (key, reason) in self.disaggregation.problems() {
            bad(&format!("disaggregation.{key}"), reason);
        }
        for (key, reason) in self.flow_control.problems() {
            bad(&format!("flow_control.{key}"), reason);
        }
        if self.pods.static_pods.is_empty()
            && self.pods.dns.is_empty()
            && self.pods.kubernetes.is_none()
        {
            bad(
                "pods",
                "list at least one pod under pods.static, a name under pods.dns, or set pods.kubernetes",
            );
        }
        for (key, v) in [
            ("pods.health_interval_ms", self.pods.health_interval_ms),
            ("pods.scrape_interval_ms", self.pods.scrape_interval_ms),
            (
                "pods.idle_scrape_interval_ms",
                self.pods.idle_scrape_interval_ms,
            ),
            ("pods.stale_after_ms", self.pods.stale_after_ms),
            ("pods.probe_timeout_ms", self.pods.probe_timeout_ms),
            ("pods.models_refresh_ms", self.pods.models_refresh_ms),
        ] {
            if v == 0 {
                bad(key, "must be positive");
            }
        }
        let ev = &self.kv_events;
        if ev.endpoint.is_empty() {
            bad("kv_events.endpoint", "must not be empty");
        }
        if ev.data_parallel_size == 0 || ev.data_parallel_size > 1024 {
            bad("kv_events.data_parallel_size", "must be in 1..=1024");
        }
        if ev.block_tokens == 0 {
            bad("kv_events.block_tokens", "must be positive");
        }
        for (key, w) in [
            ("kv_events.gpu_weight", ev.gpu_weight),
            ("kv_events.cpu_weight", ev.cpu_weight),
        ] {
            if !(w >= 0.0 && w.is_finite()) {
                bad(key, "must be a finite number >= 0");
            }
        }
        for (i, t) in self.tokenizers.iter().enumerate() {
            if t.model.is_empty() {
                bad(&format!("tokenizers[{i}].model"), "must not be empty");
            }
            if t.builtin == t.tokenizer_json.is_some() {
                bad(
                    &format!("tokenizers[{i}]"),
                    "set exactly one of tokenizer_json and builtin: true",
                );
            }
        }
        if self.pods.unhealthy_after == 0 {
            bad("pods.unhealthy_after", "must be at least 1");
        }
        bounds::upper_bounds(&self, &mut bad);
        if p.is_empty() {
            Ok(self)
        } else {
            Err(ConfigError::Invalid(p))
        }
    }
}
