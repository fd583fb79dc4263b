//! `index.redis`: where the shared Redis/Valkey index lives and how the router talks to it.

use serde::{Deserialize, Serialize};

/// Standalone server or Redis Cluster.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum RedisMode {
    /// One server (or a primary behind a stable address).
    #[default]
    Standalone,
    /// Redis Cluster: `url` and `cluster_seeds` are seed nodes; keys are hash-tagged per prefix
    /// root so a lookup stays on one shard.
    Cluster,
}

/// Where a replica answers index lookups with `backend: redis`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum RedisLookups {
    /// From this replica's in-process copy of the shared index, kept current from the other
    /// replicas' decisions on a Redis Stream (no Redis round trip on the decision path).
    #[default]
    Mirror,
    /// One Redis round trip per decision within `lookup_budget_ms`, falling back to the
    /// in-process index (the strictest view of the shared index, at a cost in the tail).
    Redis,
}

/// Connection and budget of the Redis index (`index.backend: redis`).
#[derive(Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://host:port[/db]`, `rediss://` (TLS) or `unix:///path/to/socket`.
    pub url: String,
    /// Standalone server or cluster.
    pub mode: RedisMode,
    /// Further seed nodes in cluster mode (`url` is the first).
    pub cluster_seeds: Vec<String>,
    /// ACL user (Redis 6+); none means the default user.
    pub username: Option<String>,
    /// Password inline (prefer `password_env` or `password_file`); never serialized or logged.
    #[serde(skip_serializing)]
    pub password: Option<String>,
    /// Name of an environment variable holding the password.
    pub password_env: Option<String>,
    /// File holding the password (trailing newline ignored), e.g. a mounted Secret.
    pub password_file: Option<String>,
    /// PEM file of the CA that signed the server's certificate (`rediss://`); default: the
    /// public web roots.
    pub tls_ca_file: Option<String>,
    /// PEM client certificate for servers that require one (`tls-auth-clients yes`).
    pub tls_cert_file: Option<String>,
    /// PEM key of `tls_cert_file`.
    pub tls_key_file: Option<String>,
    /// Prefix of every key; routers sharing one index use the same prefix.
    pub key_prefix: String,
    /// Multiplexed connections the router keeps open (requests are spread over them).
    pub pool_size: usize,
    /// Lookups slower than this fall back to the replica's in-process index.
    pub lookup_budget_ms: u64,
    /// Writes (decision records, forgets, sweeps) slower than this are abandoned and counted.
    pub write_budget_ms: u64,
    /// Added to both budgets per block: a lookup gets this per block it reads, a write twice
    /// this per block it writes. Redis spends 2-3 µs per block read on a busy machine, so a
    /// 1,500-block prompt (seconds of prefill) may wait 20 ms for its answer instead of being
    /// cut off by a budget sized for short prompts.
    pub budget_us_per_block: u64,
    /// Writes waiting for Redis at most; more are dropped and counted (the request path never
    /// waits for a write).
    pub write_queue: usize,
    /// After a failed lookup, lookups stay on the in-process index this long, then try again.
    pub retry_after_ms: u64,
    /// Lookup answers reused for this long for an identical prefix and candidate set, unless
    /// this replica wrote to that prefix since (0 disables the cache).
    pub match_cache_ms: u64,
    /// Lookup answers the match cache keeps at most.
    pub match_cache_entries: usize,
    /// Where lookups are answered: `mirror` (in-process, kept current from a Redis Stream) or
    /// `redis` (a round trip per decision).
    pub lookups: RedisLookups,
    /// Entries the mirror's stream keeps (approximately; older ones are trimmed). A replica
    /// that falls further behind than this reloads the shared index from Redis.
    pub stream_max_len: usize,
    /// A mirror whose newest applied change is older than this while more are waiting reports
    /// itself not ready.
    pub mirror_max_lag_ms: u64,
    /// With `lookups: mirror` in approximate mode, a decision does not rewrite in Redis an entry
    /// (block, pod) that any replica recorded less than this before (at most a quarter of the
    /// TTL; 0 rewrites all): lookups read the mirror, so Redis's copy only seeds a starting
    /// replica, whose entries may then expire or be evicted up to this much early.
    pub record_refresh_ms: u64,
    /// Shared sessions the mirror keeps at most (least recently set go first).
    pub mirror_sessions: usize,
    /// Each replica also counts the others' requests (from the stream) as in-flight load on
    /// their pods and records their conversation marks. Off, each replica sees only its own
    /// share of the fleet's load (docs/results.md, "Replicas sharing the load view, live").
    pub mirror_load: bool,
    /// With `mirror_load`: where this replica receives the others' loads as UDP datagrams, sent
    /// straight from their commit (no Redis hop; each signed with the sender's key, which the
    /// replicas exchange in Redis). Set a fixed port where a NetworkPolicy must admit it; empty
    /// turns datagrams off (loads still travel on the load stream).
    pub load_peers_bind: String,
    /// The `host:port` the other replicas send to; default: this host's address on the route to
    /// Redis (the pod IP in Kubernetes) and the bound port.
    pub load_peers_advertise: Option<String>,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            mode: RedisMode::Standalone,
            cluster_seeds: Vec::new(),
            username: None,
            password: None,
            password_env: None,
            password_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            key_prefix: "kvr".into(),
            pool_size: 2,
            lookup_budget_ms: 5,
            write_budget_ms: 50,
            budget_us_per_block: 10,
            write_queue: 10_000,
            retry_after_ms: 1_000,
            match_cache_ms: 50,
            match_cache_entries: 4_096,
            lookups: RedisLookups::Mirror,
            stream_max_len: 20_000,
            mirror_max_lag_ms: 1_000,
            record_refresh_ms: 5_000,
            mirror_sessions: 100_000,
            mirror_load: true,
            load_peers_bind: "0.0.0.0:0".into(),
            load_peers_advertise: None,
        }
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact_url(&self.url))
            .field("mode", &self.mode)
            .field(
                "cluster_seeds",
                &self
                    .cluster_seeds
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("password_env", &self.password_env)
            .field("password_file", &self.password_file)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("key_prefix", &self.key_prefix)
            .field("pool_size", &self.pool_size)
            .field("lookup_budget_ms", &self.lookup_budget_ms)
            .field("write_budget_ms", &self.write_budget_ms)
            .field("budget_us_per_block", &self.budget_us_per_block)
            .field("write_queue", &self.write_queue)
            .field("retry_after_ms", &self.retry_after_ms)
            .field("match_cache_ms", &self.match_cache_ms)
            .field("match_cache_entries", &self.match_cache_entries)
            .field("lookups", &self.lookups)
            .field("stream_max_len", &self.stream_max_len)
            .field("mirror_max_lag_ms", &self.mirror_max_lag_ms)
            .field("record_refresh_ms", &self.record_refresh_ms)
            .field("mirror_sessions", &self.mirror_sessions)
            .field("mirror_load", &self.mirror_load)
            .field("load_peers_bind", &self.load_peers_bind)
            .field("load_peers_advertise", &self.load_peers_advertise)
            .finish()
    }
}

/// `url` with any `user:password@` userinfo replaced, for logs and `Debug`.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}<redacted>@{}", &url[..s + 3], &url[at + 1..]),
        _ => url.to_string(),
    }
}

impl RedisConfig {
    /// Problems with these settings, as (key under `index.redis`, reason).
    pub fn problems(&self) -> Vec<(&'static str, &'static str)> {
        let mut p = Vec::new();
        let scheme_ok = |u: &str| {
            ["redis://", "rediss://", "unix://"]
                .iter()
                .any(|s| u.starts_with(s))
        };
        if !scheme_ok(&self.url) {
            p.push(("url", "must start with redis://, rediss:// or unix://"));
        }
        if !self.cluster_seeds.iter().all(|u| scheme_ok(u)) {
            p.push((
                "cluster_seeds",
                "each must start with redis://, rediss:// or unix://",
            ));
        }
        if self.mode == RedisMode::Standalone && !self.cluster_seeds.is_empty() {
            p.push(("cluster_seeds", "only used with mode: cluster"));
        }
        let tls_files = [&self.tls_ca_file, &self.tls_cert_file, &self.tls_key_file];
        if tls_files.iter().any(|f| f.is_some()) && !self.url.starts_with("rediss://") {
            p.push(("tls_ca_file", "TLS files need a rediss:// url"));
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            p.push((
                "tls_cert_file",
                "set both tls_cert_file and tls_key_file, or neither",
            ));
        }
        let sources = [&self.password, &self.password_env, &self.password_file];
        if sources.iter().filter(|s| s.is_some()).count() > 1 {
            p.push((
                "password",
                "set at most one of password, password_env, password_file",
            ));
        }
        if self.key_prefix.is_empty()
            || self
                .key_prefix
                .chars()
                .any(|c| c == '{' || c == '}' || c.is_whitespace())
        {
            p.push((
                "key_prefix",
                "must be non-empty without braces or whitespace",
            ));
        }
        if !(1..=64).contains(&self.pool_size) {
            p.push(("pool_size", "must be in 1..=64"));
        }
        if !(1..=1000).contains(&self.lookup_budget_ms) {
            p.push(("lookup_budget_ms", "must be in 1..=1000"));
        }
        if !(1..=10_000).contains(&self.write_budget_ms) {
            p.push(("write_budget_ms", "must be in 1..=10000"));
        }
        if self.budget_us_per_block > 1_000 {
            p.push(("budget_us_per_block", "must be at most 1000"));
        }
        if !(1..=1_000_000).contains(&self.write_queue) {
            p.push(("write_queue", "must be in 1..=1000000"));
        }
        if !(1..=600_000).contains(&self.retry_after_ms) {
            p.push(("retry_after_ms", "must be in 1..=600000"));
        }
        if self.match_cache_ms > 10_000 {
            p.push(("match_cache_ms", "must be at most 10000"));
        }
        if !(1..=1_000_000).contains(&self.match_cache_entries) {
            p.push(("match_cache_entries", "must be in 1..=1000000"));
        }
        if !(1_000..=10_000_000).contains(&self.stream_max_len) {
            p.push(("stream_max_len", "must be in 1000..=10000000"));
        }
        if !(10..=600_000).contains(&self.mirror_max_lag_ms) {
            p.push(("mirror_max_lag_ms", "must be in 10..=600000"));
        }
        if self.record_refresh_ms > 600_000 {
            p.push(("record_refresh_ms", "must be at most 600000"));
        }
        if !(1..=10_000_000).contains(&self.mirror_sessions) {
            p.push(("mirror_sessions", "must be in 1..=10000000"));
        }
        if !self.load_peers_bind.is_empty()
            && self
                .load_peers_bind
                .parse::<std::net::SocketAddr>()
                .is_err()
        {
            p.push((
                "load_peers_bind",
                "must be an ip:port (e.g. 0.0.0.0:9004), or empty for none",
            ));
        }
        if let Some(a) = &self.load_peers_advertise {
            if a.parse::<std::net::SocketAddr>().is_err() && a.parse::<std::net::IpAddr>().is_err()
            {
                p.push(("load_peers_advertise", "must be an ip or ip:port"));
            }
        }
        p
    }

    /// The password from whichever source is set (read at startup; errors name the source,
    /// never the secret).
    pub fn resolve_password(&self) -> Result<Option<String>, String> {
        if let Some(p) = &self.password {
            return Ok(Some(p.clone()));
        }
        if let Some(var) = &self.password_env {
            return std::env::var(var)
                .map(Some)
                .map_err(|_| format!("index.redis.password_env: ${var} is not set"));
        }
        if let Some(path) = &self.password_file {
            return std::fs::read_to_string(path)
                .map(|s| Some(s.trim_end_matches(['\r', '\n']).to_string()))
                .map_err(|e| format!("index.redis.password_file: cannot read {path}: {e}"));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_serialization_never_show_the_password() {
        let c = RedisConfig {
            url: "redis://u:hunter2@10.0.0.1:6379".into(),
            password: Some("s3cret".into()),
            ..RedisConfig::default()
        };
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("s3cret") && !dbg.contains("hunter2"), "{dbg}");
        let yaml = serde_yaml::to_string(&c).unwrap();
        assert!(!yaml.contains("s3cret"), "{yaml}");
    }

    #[test]
    fn bad_settings_are_named() {
        let c = RedisConfig {
            url: "http://x".into(),
            password: Some("a".into()),
            password_env: Some("B".into()),
            key_prefix: "a{b}".into(),
            pool_size: 0,
            lookup_budget_ms: 0,
            budget_us_per_block: 1_001,
            ..RedisConfig::default()
        };
        let keys: Vec<_> = c.problems().into_iter().map(|(k, _)| k).collect();
        assert_eq!(
            keys,
            [
                "url",
                "password",
                "key_prefix",
                "pool_size",
                "lookup_budget_ms",
                "budget_us_per_block"
            ]
        );
        assert!(RedisConfig::default().problems().is_empty());
    }

    #[test]
    fn password_file_is_read_without_its_newline() {
        let path = std::env::temp_dir().join(format!("kvr-redis-pw-{}", std::process::id()));
        std::fs::write(&path, "pw\n").unwrap();
        let c = RedisConfig {
            password_file: Some(path.display().to_string()),
            ..RedisConfig::default()
        };
        assert_eq!(c.resolve_password().unwrap().as_deref(), Some("pw"));
        std::fs::remove_file(path).unwrap();
    }
}
