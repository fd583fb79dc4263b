//! `kv-bench soak`: minutes of mixed traffic through real Envoy (BUFFERED override-host config)
//! to vllm-sim pods serving two models, with one pod frozen (SIGSTOP) and thawed every minute.
//! Samples the router's RSS and in-flight gauges; passes when nothing but the deliberately bad
//! requests failed, in-flight load returns to zero, and RSS stays flat after warm-up.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;

use kv_testkit::deploy::{
    envoy_template, find_envoy, local_router_config, Binaries, EnvoyProc, RouterProc, SimPod,
};
use kv_testkit::runner::{client, stream_request};

/// How long and how hard.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// Total run time.
    pub duration: Duration,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Seconds between RSS samples.
    pub sample_every: Duration,
    /// Envoy binary (default: found like every other bench).
    pub envoy: Option<std::path::PathBuf>,
    /// Seed of the request mix.
    pub seed: u64,
}

/// One sample of the router process.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Seconds since the load started.
    pub t: f64,
    /// VmRSS, MiB.
    pub rss_mib: f64,
    /// Sum of `kv_router_pod_inflight_requests` over pods.
    pub inflight: f64,
    /// Requests completed so far.
    pub requests: u64,
}

/// The outcome of a soak.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    /// Samples, in order.
    pub samples: Vec<Sample>,
    /// Requests that succeeded (2xx).
    pub ok: u64,
    /// Malformed or unknown-model requests sent on purpose.
    pub bad_sent: u64,
    /// Of those, answered with the expected 4xx.
    pub bad_rejected: u64,
    /// Every other failure (5xx, timeouts, resets): must stay 0.
    pub errors: u64,
    /// A few of those errors, for the reader.
    pub error_examples: Vec<String>,
    /// Times the flapping pod was frozen.
    pub flaps: u64,
    /// In-flight requests the router still counted 10 s after the load stopped.
    pub inflight_after: f64,
    /// RSS one sample after warm-up (the first fifth of the run), MiB.
    pub rss_warm_mib: f64,
    /// RSS at the end, MiB.
    pub rss_end_mib: f64,
}

impl SoakReport {
    /// Whether the run meets its bar; the reasons it does not otherwise.
    pub fn verdict(&self) -> Result<(), Vec<String>> {
        let mut why = Vec::new();
        if self.errors > 0 {
            why.push(format!("{} requests failed unexpectedly", self.errors));
        }
        if self.bad_rejected != self.bad_sent {
            why.push(format!(
                "{} of {} bad requests were not rejected with a 4xx",
                self.bad_sent - self.bad_rejected,
                self.bad_sent
            ));
        }
        if self.inflight_after != 0.0 {
            why.push(format!(
                "in-flight gauges at {} after the load",
                self.inflight_after
            ));
        }
        // Flat: at most a quarter (plus 8 MiB of noise) above the warmed-up level.
        if self.rss_end_mib > self.rss_warm_mib * 1.25 + 8.0 {
            why.push(format!(
                "RSS grew from {:.0} MiB after warm-up to {:.0} MiB",
                self.rss_warm_mib, self.rss_end_mib
            ));
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(why)
        }
    }

    /// A short markdown summary.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        s.push_str("| requests ok | bad sent / rejected | other errors | pod freezes | in-flight after | RSS after warm-up | RSS at end |\n");
        s.push_str("| --: | --: | --: | --: | --: | --: | --: |\n");
        s.push_str(&format!(
            "| {} | {} / {} | {} | {} | {} | {:.0} MiB | {:.0} MiB |\n",
            self.ok,
            self.bad_sent,
            self.bad_rejected,
            self.errors,
            self.flaps,
            self.inflight_after,
            self.rss_warm_mib,
            self.rss_end_mib
        ));
        s
    }

    /// The RSS curve as SVG.
    pub fn svg(&self) -> Result<String> {
        let rss: Vec<(f64, f64)> = self.samples.iter().map(|s| (s.t, s.rss_mib)).collect();
        super::charts::time_series(
            "kv-router RSS during the soak",
            "MiB",
            &[("RSS".into(), rss)],
        )
        .map_err(|e| anyhow::anyhow!("{e}"))
    }
}

fn rss_mib(pid: u32) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = status
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .context("VmRSS")?;
    Ok(kb / 1024.0)
}

/// Sum of one gauge family over its series in Prometheus text.
fn gauge_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Shared counters of the clients.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    bad_sent: AtomicU64,
    bad_rejected: AtomicU64,
    errors: AtomicU64,
    examples: parking_lot::Mutex<Vec<String>>,
}

impl Tally {
    fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut ex = self.examples.lock();
        if ex.len() < 5 {
            ex.push(what);
        }
    }
}

/// One client: a seeded mix of conversations, shared documents, a second model, long prompts,
/// malformed bodies and unknown models, until `stop`.
async fn client_loop(url: String, seed: u64, tally: Arc<Tally>, stop: Arc<AtomicBool>) {
    let http = client();
    let mut rng = StdRng::seed_from_u64(seed);
    let timeout = Duration::from_secs(60);
    let mut turns = [0usize; 16];
    while !stop.load(Ordering::Relaxed) {
        let roll = rng.random_range(0..100);
        if roll < 10 {
            // Malformed JSON, and a model nobody serves: both must come back as a 4xx.
            tally.bad_sent.fetch_add(1, Ordering::Relaxed);
            let (body, want) = if roll < 5 {
                ("{\"model\": \"llama\", \"prompt\": ".to_string(), 400..500)
            } else {
                (
                    json!({"model": "nobody-serves-this", "prompt": "hi"}).to_string(),
                    404..405,
                )
            };
            let r = http
                .post(format!("{url}/v1/completions"))
                .header("content-type", "application/json")
                .body(body)
                .timeout(timeout)
                .send()
                .await;
            match r {
                Ok(r) if want.contains(&r.status().as_u16()) => {
                    tally.bad_rejected.fetch_add(1, Ordering::Relaxed);
                }
                Ok(r) => tally.error(format!("bad request answered {}", r.status())),
                Err(e) => tally.error(format!("bad request: {e}")),
            }
            continue;
        }
        let (path, body, headers) = if roll < 50 {
            // A conversation: its history grows by a turn each time, pinned by a session id.
            let c = rng.random_range(0..turns.len());
            turns[c] = (turns[c] + 1) % 12;
            let mut messages = vec![
                json!({"role": "system", "content": format!("conversation {seed}-{c}: ").repeat(40)}),
            ];
            for t in 0..=turns[c] {
                messages.push(
                    json!({"role": "user", "content": format!("turn {t} of {c}: tell me more")}),
                );
            }
            let body =
                json!({"model": "llama", "messages": messages, "max_tokens": 8, "stream": true});
            (
                "/v1/chat/completions",
                body,
                vec![("x-session-id".to_string(), format!("s-{seed}-{c}"))],
            )
        } else if roll < 75 {
            let doc = rng.random_range(0..32);
            let prompt = format!(
                "{}{}",
                format!("document {doc} ").repeat(120),
                rng.random::<u32>()
            );
            (
                "/v1/completions",
                json!({"model": "llama", "prompt": prompt, "max_tokens": 8}),
                vec![],
            )
        } else if roll < 90 {
            let prompt = format!("{}{}", "the other model ".repeat(60), rng.random::<u32>());
            (
                "/v1/completions",
                json!({"model": "qwen", "prompt": prompt, "max_tokens": 8, "stream": true}),
                vec![],
            )
        } else {
            let prompt = format!("long {} ", rng.random::<u32>()).repeat(2000);
            (
                "/v1/completions",
                json!({"model": "llama", "prompt": prompt, "max_tokens": 4}),
                vec![],
            )
        };
        let out = stream_request(&http, &format!("{url}{path}"), &body, &headers, timeout).await;
        if out.ok() {
            tally.ok.fetch_add(1, Ordering::Relaxed);
        } else {
            tally.error(format!(
                "{path}: status {:?}, error {:?}",
                out.status,
                out.error.as_deref().unwrap_or("")
            ));
        }
    }
}

/// Runs the soak and returns what it saw (the verdict is the caller's).
pub async fn run(bins: &Binaries, opts: &SoakOptions) -> Result<SoakReport> {
    let sim = |model: &str| -> Vec<String> {
        [
            "--model",
            model,
            "--ttft-base-ms",
            "5",
            "--prefill-us-per-token",
            "20",
            "--decode-ms-per-token",
            "2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let mut pods = Vec::new();
    for model in ["llama", "llama", "llama", "qwen", "qwen"] {
        pods.push(SimPod::spawn(&bins.vllm_sim, &sim(model))?);
    }
    let addrs: Vec<_> = pods.iter().map(|p| p.addr).collect();
    let cfg = local_router_config(&addrs)?;
    let mut router = RouterProc::spawn(&bins.kv_router, &cfg).await?;
    router
        .wait_pods_ready(pods.len(), Duration::from_secs(20))
        .await?;
    let envoy_bin = find_envoy(opts.envoy.as_deref())?;
    let envoy = EnvoyProc::spawn(
        &envoy_bin,
        &envoy_template("override-host-buffered.yaml")?,
        Some(router.grpc),
        &addrs,
    )
    .await?;
    let pid = router.process().pid().context("router pid")?;
    let url = envoy.url();

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..opts.concurrency)
        .map(|i| {
            tokio::spawn(client_loop(
                url.clone(),
                opts.seed * 1000 + i as u64,
                tally.clone(),
                stop.clone(),
            ))
        })
        .collect();

    // One llama pod freezes for 15 s of every minute (a stalled node, a GC pause, a hung driver).
    let frozen = pods[2].pid().context("pod pid")?;
    let signal = |sig: &str| {
        let _ = std::process::Command::new("kill")
            .args([sig, &frozen.to_string()])
            .status();
    };
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut flaps = 0;
    let mut is_frozen = false;
    let mut next_sample = Duration::ZERO;
    while start.elapsed() < opts.duration {
        let t = start.elapsed();
        let freeze = (20..35).contains(&(t.as_secs() % 60));
        if freeze != is_frozen {
            signal(if freeze { "-STOP" } else { "-CONT" });
            flaps += u64::from(freeze);
            is_frozen = freeze;
        }
        if t >= next_sample {
            let metrics = router.metrics().await.unwrap_or_default();
            samples.push(Sample {
                t: t.as_secs_f64(),
                rss_mib: rss_mib(pid)?,
                inflight: gauge_sum(&metrics, "kv_router_pod_inflight_requests"),
                requests: tally.ok.load(Ordering::Relaxed)
                    + tally.bad_sent.load(Ordering::Relaxed)
                    + tally.errors.load(Ordering::Relaxed),
            });
            next_sample += opts.sample_every;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    signal("-CONT");
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut inflight_after;
    loop {
        inflight_after = gauge_sum(&router.metrics().await?, "kv_router_pod_inflight_requests");
        if inflight_after == 0.0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let warm_at = opts.duration.as_secs_f64() / 5.0;
    let rss_warm_mib = samples
        .iter()
        .find(|s| s.t >= warm_at)
        .or(samples.last())
        .map_or(0.0, |s| s.rss_mib);
    let rss_end_mib = rss_mib(pid)?;
    drop(envoy);
    let error_examples = tally.examples.lock().clone();
    Ok(SoakReport {
        samples,
        ok: tally.ok.load(Ordering::Relaxed),
        bad_sent: tally.bad_sent.load(Ordering::Relaxed),
        bad_rejected: tally.bad_rejected.load(Ordering::Relaxed),
        errors: tally.errors.load(Ordering::Relaxed),
        error_examples,
        flaps,
        inflight_after,
        rss_warm_mib,
        rss_end_mib,
    })
}

#[cfg(test)]
mod tests {
    use super::gauge_sum;

    #[test]
    fn gauges_are_summed_over_their_series_only() {
        let text = "# TYPE g gauge\ng{pod=\"a\"} 2\ng{pod=\"b\"} 3.5\ngx{pod=\"a\"} 100\ng 1\n";
        assert_eq!(gauge_sum(text, "g"), 6.5);
    }
}
