//! Flow control end to end: the real Envoy 1.40 (BUFFERED, `override-host-buffered.yaml`),
//! kv-router with `flow_control` on, and two vllm-sim pods that run one request at a time, so a
//! few long requests saturate the fleet (the gate's `max_waiting: 1`). While saturated, requests
//! wait in the router and leave by priority; a waiter past `queue_timeout_ms` (longer than Envoy's
//! 2 s `message_timeout`: the extension must work) gets 429 with `Retry-After`; a sheddable one
//! is refused at once; a client that leaves takes its request out of the queue; and with the
//! router killed while it holds requests, Envoy fails them open.
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration e2e_flow::`

use crate::common;

use std::time::{Duration, Instant};

use common::deploy::RouterProc;
use common::runner::{self, StreamOutcome};
use common::{completion, metric, post_to, text, Deployment};
use kv_router::config::FlowConfig;
use serde_json::Value;

const BUFFERED: &str = "override-host-buffered.yaml";
/// Per generated token: a 100-token blocker holds its pod for 2 s.
const DECODE_MS: &str = "20";
/// Flow headers a gateway sets (the bundled Envoy configs strip the default names).
const PRIORITY: &str = "x-test-priority";
const OBJECTIVE: &str = "x-test-objective";

struct Fleet {
    d: Deployment,
}

impl Fleet {
    async fn start(flow: FlowConfig) -> Self {
        let sim = [
            "--ttft-base-ms",
            "1",
            "--prefill-us-per-token",
            "1",
            "--decode-ms-per-token",
            DECODE_MS,
            "--max-num-seqs",
            "1",
        ];
        let d = Deployment::start_sims(&sim, 2, &[BUFFERED], |cfg| {
            // Saturated with one request running and one waiting; hotness plays no part.
            cfg.gate.max_waiting = 1.0;
            cfg.gate.hot_abs = 64.0;
            cfg.pods.scrape_interval_ms = 50;
            // The bundled Envoy configs strip the default flow headers (clients must not set
            // them); a gateway that sets its own, trusted ones stands in here.
            cfg.flow_control = FlowConfig {
                enabled: true,
                trust_client_headers: true,
                priority_header: PRIORITY.into(),
                objective_header: OBJECTIVE.into(),
                ..flow
            };
        })
        .await;
        Self { d }
    }

    fn router(&self) -> &RouterProc {
        self.d.router.as_ref().expect("kv-router")
    }

    fn diag(&self) -> String {
        format!(
            "\n--- kv-router stderr (tail) ---\n{}",
            self.router().stderr_tail(40)
        )
    }

    /// Sends a completion of `max_tokens` in the background.
    fn send(
        &self,
        seed: u64,
        max_tokens: u32,
        headers: &[(&str, &str)],
    ) -> tokio::task::JoinHandle<StreamOutcome> {
        let (client, url) = (self.d.client.clone(), self.d.url(0));
        let body = completion(&text(seed, 400), max_tokens);
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        tokio::spawn(async move {
            let h: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            post_to(&client, &url, "/v1/completions", &body, &h).await
        })
    }

    async fn router_metrics(&self) -> String {
        self.router().metrics().await.unwrap_or_default()
    }

    /// `kv_router_flow_queued` with `labels`.
    async fn queued(&self, labels: &[(&str, &str)]) -> f64 {
        metric(
            &self.router_metrics().await,
            "kv_router_flow_queued",
            labels,
        )
    }

    async fn pod_waiting(&self) -> f64 {
        let mut sum = 0.0;
        for p in &self.d.pods {
            let t = self
                .d
                .client
                .get(format!("{}/metrics", p.url()))
                .send()
                .await
                .expect("pod metrics")
                .text()
                .await
                .unwrap_or_default();
            sum += metric(&t, "vllm:num_requests_waiting", &[]);
        }
        sum
    }

    /// Four long requests: both pods running one and queueing one, nothing left in the router.
    async fn saturate(&self, max_tokens: u32) -> Vec<tokio::task::JoinHandle<StreamOutcome>> {
        let blockers: Vec<_> = (0..4)
            .map(|i| self.send(100 + i, max_tokens, &[]))
            .collect();
        until("both pods running one request and queueing one", || async {
            self.pod_waiting().await == 2.0 && self.queued(&[]).await == 0.0
        })
        .await;
        blockers
    }
}

async fn until<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_flood_on_a_saturated_fleet_is_held_and_released_by_priority() {
    let f = Fleet::start(FlowConfig {
        objectives: [("interactive".to_string(), 5)].into(),
        ..FlowConfig::default()
    })
    .await;
    let blockers = f.saturate(50).await;
    // The blockers themselves may have waited for the scrapes to show their pods' queues.
    let released = |m: &str, p| {
        metric(
            m,
            "kv_router_flow_wait_seconds_count",
            &[("priority", p), ("outcome", "released")],
        )
    };
    let before = released(&f.router_metrics().await, "0");
    let low: Vec<_> = (0..3).map(|i| f.send(200 + i, 10, &[])).collect();
    until("the low-priority requests to queue", || async {
        f.queued(&[("priority", "0")]).await == 3.0
    })
    .await;
    let objective = [(OBJECTIVE, "interactive")];
    let high: Vec<_> = (0..3).map(|i| f.send(300 + i, 10, &objective)).collect();
    // Every high-priority request leaves before any low one: while one waits, all lows wait.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut saw_high_queued = false;
    loop {
        let m = f.router_metrics().await;
        let (hi, lo) = (
            metric(&m, "kv_router_flow_queued", &[("priority", "5")]),
            metric(&m, "kv_router_flow_queued", &[("priority", "0")]),
        );
        saw_high_queued |= hi > 0.0;
        assert!(
            hi == 0.0 || lo == 3.0,
            "a low-priority request left while {hi} high ones waited{}",
            f.diag()
        );
        if saw_high_queued && hi + lo == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the queue did not drain{}",
            f.diag()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for h in blockers.into_iter().chain(low).chain(high) {
        let o = h.await.unwrap();
        assert!(o.ok(), "{:?} {} {}", o.status, o.body, f.diag());
    }
    let m = f.router_metrics().await;
    assert_eq!(
        (released(&m, "5"), released(&m, "0") - before),
        (3.0, 3.0),
        "{m}"
    );
    assert_eq!(metric(&m, "kv_router_flow_rejections_total", &[]), 0.0);
}

#[tokio::test]
async fn refusals_carry_retry_after_and_a_leaving_client_leaves_the_queue() {
    // Longer than the filter's 2 s message_timeout: only the extension keeps Envoy waiting.
    let f = Fleet::start(FlowConfig {
        queue_timeout_ms: 2_500,
        retry_after_s: 3,
        shed_below: 0,
        ..FlowConfig::default()
    })
    .await;
    let _blockers = f.saturate(300).await;

    // Below shed_below while saturated: refused at once.
    let shed = f.send(400, 4, &[(PRIORITY, "-1")]).await.unwrap();
    assert_refused(&shed, "shed", &f.diag());

    // Waits past the queue timeout.
    let started = Instant::now();
    let timed_out = f.send(401, 4, &[]).await.unwrap();
    assert_refused(&timed_out, "queue_timeout", &f.diag());
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(2_400) && waited < Duration::from_secs(5),
        "answered after {waited:?}"
    );

    // A client that gives up: its request leaves the queue.
    let client = f.d.client.clone();
    let url = format!("{}/v1/completions", f.d.url(0));
    let gone = tokio::spawn(async move {
        runner::stream_request(
            &client,
            &url,
            &completion(&text(402, 400), 4),
            &[],
            Duration::from_millis(500),
        )
        .await
    });
    until("the impatient request to queue", || async {
        f.queued(&[]).await == 1.0
    })
    .await;
    let o = gone.await.unwrap();
    assert!(o.error.is_some(), "{o:?}");
    until("the cancelled request to leave the queue", || async {
        let m = f.router_metrics().await;
        metric(&m, "kv_router_flow_queued", &[]) == 0.0
            && metric(
                &m,
                "kv_router_flow_wait_seconds_count",
                &[("outcome", "cancelled")],
            ) == 1.0
    })
    .await;
    let m = f.router_metrics().await;
    let rejected = |r| metric(&m, "kv_router_flow_rejections_total", &[("reason", r)]);
    assert_eq!(
        (rejected("shed"), rejected("queue_timeout")),
        (1.0, 1.0),
        "{m}"
    );
    // Envoy honoured the extension (it counts the ones it ignores).
    let stats = f.d.envoys[0].stats().await.unwrap_or_default();
    let ignored: f64 = stats
        .lines()
        .filter(|l| l.contains("override_message_timeout_ignored"))
        .filter_map(|l| l.rsplit(':').next()?.trim().parse::<f64>().ok())
        .sum();
    assert_eq!(ignored, 0.0, "{stats}");
}

#[tokio::test]
async fn requests_held_by_a_router_that_is_killed_fail_open() {
    let mut f = Fleet::start(FlowConfig::default()).await;
    let blockers = f.saturate(100).await;
    let held: Vec<_> = (0..3).map(|i| f.send(500 + i, 4, &[])).collect();
    until("the requests to queue", || async {
        f.queued(&[]).await == 3.0
    })
    .await;
    f.d.router.as_mut().expect("kv-router").kill();
    // Envoy loses the ext_proc streams and, failure_mode_allow, routes them round robin.
    for h in blockers.into_iter().chain(held) {
        let o = h.await.unwrap();
        assert!(
            o.ok() && o.pod().is_some(),
            "status {:?}, error {:?}, body {}",
            o.status,
            o.error,
            o.body
        );
    }
}

#[track_caller]
fn assert_refused(o: &StreamOutcome, code: &str, diag: &str) {
    assert_eq!(o.status, Some(429), "{o:?}{diag}");
    assert_eq!(o.header("retry-after"), Some("3"), "{o:?}");
    let v: Value = serde_json::from_str(&o.body).unwrap_or_default();
    assert_eq!(v["error"]["code"], code, "{}", o.body);
    assert_eq!(v["error"]["type"], "RateLimitError", "{}", o.body);
}
