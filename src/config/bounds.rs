//! Upper bounds and overflow checks: a value that parses but would crash or silently misbehave
//! at run time (an allocation of 2^64 sessions, a wrapped gRPC limit, a port past 65535, an
//! unparsable log filter) is a config error, and so is a YAML text too large or too deeply
//! nested to parse in bounded time.

use super::{Config, ConfigError};

/// Largest config file (or layer) read; real ones are a few KiB.
pub const MAX_YAML_BYTES: usize = 1 << 20;
/// Deepest nesting accepted, flow (`[`/`{`), block sequence (`- - x`) or block mapping
/// (indentation) alike; the schema itself is 5 levels deep.
pub const MAX_YAML_DEPTH: usize = 64;
/// Largest request body the router buffers (both body modes).
pub const MAX_BODY_LIMIT_BYTES: usize = 1 << 30;
/// Most sessions remembered (each costs ~100 bytes; see docs/config.md).
pub const MAX_SESSIONS: usize = 10_000_000;
/// Longest period or TTL (`*_ms`) accepted: 7 days; longer ones overflow timer arithmetic.
pub const MAX_MS: u64 = 7 * 24 * 3_600_000;

/// Rejects YAML text larger than [`MAX_YAML_BYTES`] or nested deeper than [`MAX_YAML_DEPTH`]
/// before the YAML parser sees it (100k nested `[` once took 25 s of CPU).
pub fn check_yaml_shape(text: &str) -> Result<(), ConfigError> {
    if text.len() > MAX_YAML_BYTES {
        return Err(ConfigError::Shape(format!(
            "{} bytes; at most {MAX_YAML_BYTES} are read",
            text.len()
        )));
    }
    let mut depth = 0usize;
    // Block mappings nest by indentation: one level per deeper indent still open.
    let mut indents: Vec<usize> = Vec::new();
    for line in text.lines() {
        let body = line.trim_start();
        if !body.is_empty() && !body.starts_with('#') {
            let indent = line.len() - body.len();
            while indents.last().is_some_and(|&top| top > indent) {
                indents.pop();
            }
            if indents.last().is_none_or(|&top| top < indent) {
                indents.push(indent);
            }
            if indents.len() > MAX_YAML_DEPTH {
                return Err(ConfigError::Shape(format!(
                    "nested deeper than {MAX_YAML_DEPTH} levels"
                )));
            }
        }
        let mut quote: Option<char> = None;
        let mut prev = ' ';
        for c in line.chars() {
            match (quote, c) {
                (Some(q), c) if c == q && prev != '\\' => quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') => quote = Some(c),
                (None, '#') if prev.is_whitespace() => break,
                (None, '[' | '{') => {
                    depth += 1;
                    if depth > MAX_YAML_DEPTH {
                        return Err(ConfigError::Shape(format!(
                            "nested deeper than {MAX_YAML_DEPTH} levels"
                        )));
                    }
                }
                (None, ']' | '}') => depth = depth.saturating_sub(1),
                _ => {}
            }
            prev = c;
        }
        // Block sequences nest too: `- - - x` is three levels on one line.
        let dashes = line
            .trim_start()
            .split_inclusive(' ')
            .take_while(|t| t.trim_end() == "-")
            .count();
        if dashes > MAX_YAML_DEPTH {
            return Err(ConfigError::Shape(format!(
                "nested deeper than {MAX_YAML_DEPTH} levels"
            )));
        }
    }
    Ok(())
}

/// Upper bounds and overflow checks, reported through `bad(key, reason)`.
pub(super) fn upper_bounds(cfg: &Config, bad: &mut impl FnMut(&str, &str)) {
    if cfg.body_limit_bytes > MAX_BODY_LIMIT_BYTES {
        bad("body_limit_bytes", "must be at most 1073741824 (1 GiB)");
    }
    if cfg.scorers.session.capacity > MAX_SESSIONS {
        bad("scorers.session.capacity", "must be at most 10000000");
    }
    if !(1024..=1 << 30).contains(&cfg.pods.max_response_bytes) {
        bad("pods.max_response_bytes", "must be in 1024..=1073741824");
    }
    if cfg.blocks.max_blocks > 1 << 20 {
        bad("blocks.max_blocks", "must be at most 1048576");
    }
    if cfg.blocks.size_chars > 1 << 20 {
        bad("blocks.size_chars", "must be at most 1048576");
    }
    if !(1..=1 << 24).contains(&cfg.scorers.load.max_prompt_tokens) {
        bad("scorers.load.max_prompt_tokens", "must be in 1..=16777216");
    }
    if !(1..=1 << 20).contains(&cfg.server.max_concurrent_streams) {
        bad("server.max_concurrent_streams", "must be in 1..=1048576");
    }
    if !(1..=1 << 16).contains(&cfg.receipts.recent_decisions) {
        bad("receipts.recent_decisions", "must be in 1..=65536");
    }
    if !(1024..=MAX_BODY_LIMIT_BYTES).contains(&cfg.pick_api.max_message_bytes) {
        bad("pick_api.max_message_bytes", "must be in 1024..=1073741824");
    }
    if !(cfg.pick_api.max_message_bytes..=MAX_BODY_LIMIT_BYTES)
        .contains(&cfg.pick_api.max_buffered_bytes)
    {
        bad(
            "pick_api.max_buffered_bytes",
            "must be in pick_api.max_message_bytes..=1073741824 (one full message must fit)",
        );
    }
    if !(1..=300_000).contains(&cfg.server.message_timeout_ms) {
        bad("server.message_timeout_ms", "must be in 1..=300000 (5 min)");
    }
    if !(1..=1_000_000).contains(&cfg.server.max_extproc_streams) {
        bad("server.max_extproc_streams", "must be in 1..=1000000");
    }
    if cfg.server.max_buffered_body_bytes < cfg.body_limit_bytes {
        bad(
            "server.max_buffered_body_bytes",
            "must be at least body_limit_bytes (one full body must fit)",
        );
    }
    if !(1..=1_000_000).contains(&cfg.server.max_connections) {
        bad("server.max_connections", "must be in 1..=1000000");
    }
    if !(100..=60_000).contains(&cfg.server.handshake_timeout_ms) {
        bad("server.handshake_timeout_ms", "must be in 100..=60000");
    }
    if cfg.server.shutdown_delay_ms > 60_000 {
        bad("server.shutdown_delay_ms", "must be at most 60000 (1 min)");
    }
    if cfg.server.shutdown_grace_ms > 300_000 {
        bad("server.shutdown_grace_ms", "must be at most 300000 (5 min)");
    }
    let tls = &cfg.server.tls;
    if tls.cert_file.is_some() != tls.key_file.is_some() {
        bad(
            "server.tls.cert_file",
            "set both cert_file and key_file, or neither",
        );
    }
    if tls.client_ca_file.is_some() && tls.cert_file.is_none() {
        bad(
            "server.tls.client_ca_file",
            "needs cert_file and key_file (mTLS is TLS first)",
        );
    }
    if cfg.pods.idle_scrape_interval_ms >= cfg.pods.stale_after_ms {
        bad(
            "pods.idle_scrape_interval_ms",
            "must be below pods.stale_after_ms (an idle pod's load would go stale between scrapes)",
        );
    }
    if cfg.kv_events.block_tokens > 1 << 16 {
        bad("kv_events.block_tokens", "must be at most 65536");
    }
    for (key, v) in [
        ("scorers.session.ttl_ms", cfg.scorers.session.ttl_ms),
        ("pods.health_interval_ms", cfg.pods.health_interval_ms),
        ("pods.scrape_interval_ms", cfg.pods.scrape_interval_ms),
        (
            "pods.idle_scrape_interval_ms",
            cfg.pods.idle_scrape_interval_ms,
        ),
        ("pods.stale_after_ms", cfg.pods.stale_after_ms),
        ("pods.probe_timeout_ms", cfg.pods.probe_timeout_ms),
        ("pods.models_refresh_ms", cfg.pods.models_refresh_ms),
        (
            "kv_events.speculative_ttl_ms",
            cfg.kv_events.speculative_ttl_ms,
        ),
    ] {
        if v > MAX_MS {
            bad(key, "must be at most 604800000 (7 days)");
        }
    }
    for (i, d) in cfg.pods.dns.iter().enumerate() {
        if d.refresh_ms > MAX_MS {
            bad(
                &format!("pods.dns[{i}].refresh_ms"),
                "must be at most 604800000 (7 days)",
            );
        }
    }
    // Rank r publishes on port + r: the last rank's port must exist.
    let last_rank = u64::from(cfg.kv_events.data_parallel_size.saturating_sub(1));
    let endpoints = std::iter::once(("kv_events.endpoint".to_string(), &cfg.kv_events.endpoint))
        .chain(
            cfg.pods
                .static_pods
                .iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    p.kv_events_endpoint
                        .as_ref()
                        .map(|e| (format!("pods.static[{i}].kv_events_endpoint"), e))
                }),
        );
    for (key, endpoint) in endpoints {
        if let Some(port) = literal_tcp_port(endpoint) {
            if port + last_rank > u64::from(u16::MAX) {
                bad(
                    &key,
                    "port + kv_events.data_parallel_size - 1 must be at most 65535",
                );
            }
        }
    }
    if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&cfg.log.level) {
        bad("log.level", &format!("not a tracing filter: {e}"));
    }
}

/// The numeric port of a `tcp://host:port` endpoint (templates such as `{port}` have none).
pub(crate) fn literal_tcp_port(endpoint: &str) -> Option<u64> {
    let rest = endpoint.strip_prefix("tcp://")?;
    rest.rsplit_once(':')?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = "pods: { static: [{ address: 127.0.0.1:8000 }] }\n";

    fn problems(extra: &str) -> String {
        match Config::from_yaml(&format!("{POD}{extra}")) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn values_that_crashed_serve_are_config_errors() {
        for (yaml, key) in [
            (
                "scorers: { session: { capacity: 18446744073709551615 } }",
                "scorers.session.capacity",
            ),
            (
                "scorers: { session: { capacity: 1000000000000 } }",
                "scorers.session.capacity",
            ),
            ("body_limit_bytes: 18446744073709551615", "body_limit_bytes"),
            ("log: { level: \"info,[[[\" }", "log.level"),
            (
                "kv_events: { endpoint: \"tcp://{ip}:65535\", data_parallel_size: 2 }",
                "kv_events.endpoint",
            ),
            (
                "kv_events: { endpoint: \"tcp://{ip}:4294967295\", data_parallel_size: 2 }",
                "kv_events.endpoint",
            ),
            (
                "scorers: { session: { ttl_ms: 18446744073709551615 } }",
                "scorers.session.ttl_ms",
            ),
        ] {
            let text = problems(yaml);
            assert!(text.contains(key), "{yaml}: {key} not reported in {text:?}");
        }
        assert_eq!(
            problems("kv_events: { endpoint: \"tcp://{ip}:65534\", data_parallel_size: 2 }"),
            ""
        );
        assert_eq!(problems("log: { level: \"kv_router=debug,info\" }"), "");
    }

    #[test]
    fn grpc_port_limits_are_validated() {
        for (yaml, key) in [
            (
                "server: { message_timeout_ms: 0 }",
                "server.message_timeout_ms",
            ),
            (
                "server: { max_extproc_streams: 0 }",
                "server.max_extproc_streams",
            ),
            (
                "pick_api: { max_buffered_bytes: 1048576 }",
                "pick_api.max_buffered_bytes",
            ),
        ] {
            let text = problems(yaml);
            assert!(text.contains(key), "{yaml}: {key} not reported in {text:?}");
        }
        assert_eq!(
            problems("pick_api: { max_message_bytes: 1048576, max_buffered_bytes: 1048576 }"),
            ""
        );
    }

    #[test]
    fn deep_or_huge_yaml_is_refused_before_parsing() {
        let deep = format!("pods: {}{}\n", "[".repeat(100_000), "]".repeat(100_000));
        let started = std::time::Instant::now();
        let err = Config::from_yaml(&deep).unwrap_err().to_string();
        assert!(err.contains("nested deeper"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        let dashes = format!("pods:\n  {}x\n", "- ".repeat(1000));
        assert!(Config::from_yaml(&dashes)
            .unwrap_err()
            .to_string()
            .contains("nested deeper"));
        // Block mappings by indentation: 1,400 levels once passed here and failed later as a
        // type error; the config's own shape (a few levels) still passes.
        let block: String = (0..1400)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect();
        let err = Config::from_yaml(&format!("pods:\n{block}")).unwrap_err();
        assert!(err.to_string().contains("nested deeper"), "{err}");
        let shallow: String = (0..MAX_YAML_DEPTH - 1)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect();
        assert!(check_yaml_shape(&shallow).is_ok());
        let huge = format!("{POD}# {}\n", "x".repeat(MAX_YAML_BYTES));
        assert!(Config::from_yaml(&huge)
            .unwrap_err()
            .to_string()
            .contains("bytes"));
        // Brackets inside quotes and comments are text.
        assert_eq!(
            problems(&format!(
                "log: {{ level: \"info\" }} # {}\n",
                "[".repeat(100)
            )),
            ""
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
            #[test]
            fn any_yaml_text_loads_or_errors_never_panics(
                text in prop_oneof![
                    "[a-z_:{}\\[\\], \n\"'0-9.-]{0,200}",
                    any::<String>(),
                ],
                key in prop_oneof![
                    Just("body_limit_bytes"), Just("scorers: { session: { capacity"),
                    Just("kv_events: { data_parallel_size"), Just("log: { level"),
                    Just("pods: { scrape_interval_ms"), Just("server: { max_concurrent_streams"),
                ],
                number in prop_oneof![Just(u64::MAX.to_string()), Just("-1".into()), Just("1e400".into()), any::<u64>().prop_map(|n| n.to_string())],
            ) {
                let _ = Config::from_yaml(&text);
                let closing = "}".repeat(key.matches('{').count());
                let _ = Config::from_yaml(&format!("{POD}{key}: {number}{closing}\n"));
            }
        }
    }
}
