//! Fault runs through the REAL Envoy 1.40, kv-router and vllm-sim on 127.0.0.1 (continued from
//! `faults.rs`, which lists every fault and its test): clients aborting uploads and responses
//! mid-stream, and a pod whose `/metrics` hangs.
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration faults_streams:: -- --test-threads=1`

use crate::common;
use crate::faults_rig;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::deploy::{self, EnvoyProc, RouterProc, SimPod};
use common::{bins, chat_stream, completion, envoy_bin, metric, text, FAST_SIM};
use futures::StreamExt;
use parking_lot::Mutex;

use faults_rig::*;

// ---------------------------------------------------------------------------------------------
// 6. Clients aborting mid-upload and mid-response: ext_proc streams reset by Envoy.

/// Sum over pods of the router's in-flight gauges on `/metrics` (requests, uncached tokens).
fn inflight_gauges(m: &str) -> (f64, f64) {
    (
        metric(m, "kv_router_pod_inflight_requests", &[]),
        metric(m, "kv_router_pod_inflight_uncached_tokens", &[]),
    )
}

/// Opens a raw HTTP/1.1 upload of a `total`-byte JSON completion to `listen`, sends its headers
/// and the first `sent` bytes of the body, and returns the socket (to be reset by the caller).
async fn partial_upload(
    listen: SocketAddr,
    total: usize,
    sent: usize,
    seed: u64,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let head = r#"{"model": "sim-model", "max_tokens": 4, "prompt": ""#;
    let mut body = head.as_bytes().to_vec();
    body.extend(
        text(seed, total)
            .bytes()
            .filter(|b| *b != b'"' && *b != b'\\'),
    );
    body.truncate(total - 2);
    body.extend_from_slice(b"\"}");
    let mut s = tokio::net::TcpStream::connect(listen)
        .await
        .expect("connect to Envoy");
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: llm\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s.write_all(&body[..sent]).await.unwrap();
    s.flush().await.unwrap();
    s
}

/// Closes `s` with a TCP RST (SO_LINGER 0), as a client that dies mid-request.
// SO_LINGER 0 makes close send RST at once; it never blocks (the deprecation's concern).
#[allow(deprecated)]
fn reset(s: tokio::net::TcpStream) {
    s.set_linger(Some(Duration::ZERO)).unwrap();
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_uploads_and_responses_leave_no_inflight_load_or_buffered_bytes() {
    const MIB: usize = 1 << 20;
    let started = Instant::now();
    // A 3.5 MiB budget for bodies buffered before their decision: bytes leaked by aborted streams
    // would make the 2.5 MiB probe below fail with 503 router_overloaded. The half MiB over the
    // three held MiB is room for the message each held upload has on its way (the port reserves
    // a message's announced length as it arrives): without it one held upload was refused.
    let d = Rig::start(3, 1, &[FULL_DUPLEX, BUFFERED], |c| {
        c.body_limit_bytes = 3 * MIB;
        c.server.max_buffered_body_bytes = 3 * MIB + MIB / 2;
    })
    .await;
    let admin = d.router(0).admin_url();
    let stats_url = format!("http://{}/stats", d.envoys[0].admin);
    let msgs = "http.llm.ext_proc.stream_msgs_sent";

    // (a) Uploads reset mid-body through FULL_DUPLEX Envoy. Three are held open first, each until
    //     kv-router got part of its body (headers plus at least one body message sent on its
    //     ext_proc stream): together they fill the budget, so a 1 MiB body is refused now. That
    //     makes the probe after the resets meaningful.
    // Bytes Envoy wrote to kv-router: the half-sent MiB must all be on its way, not one message
    // of it (under load Envoy forwarded only part of it before the probe, which then fit).
    let tx = "cluster.kv_router.upstream_cx_tx_bytes_total";
    let mut held = Vec::new();
    for i in 0..3u64 {
        let st = get_text(&d.client, &stats_url).await.unwrap_or_default();
        let before = (envoy_stat(&st, msgs), envoy_stat(&st, tx));
        held.push(partial_upload(d.envoys[0].listen, 2 * MIB, MIB, 600 + i).await);
        wait_for(
            "Envoy to stream the sent part of the body to kv-router",
            POLL,
            || d.diag(),
            || async {
                let st = get_text(&d.client, &stats_url).await?;
                let sent = envoy_stat(&st, tx) >= before.1 + MIB as u64;
                (envoy_stat(&st, msgs) >= before.0 + 2 && sent).then_some(())
            },
        )
        .await;
    }
    let mut one = text(640, MIB);
    one.truncate(MIB - 200);
    let o = common::post_to(
        &d.client,
        &d.envoys[0].url(),
        "/v1/completions",
        &completion(&one, 4),
        &[],
    )
    .await;
    assert!(
        o.status == Some(503) && o.body.contains("router_overloaded"),
        "with three half-sent 2 MiB uploads open a 1 MiB body should find the 3.5 MiB budget full; \
         got {:?} {:?} {}{}",
        o.status,
        o.error,
        o.body,
        d.diag()
    );
    for s in held {
        reset(s);
    }
    // The same through BUFFERED Envoy (Envoy holds the body; kv-router saw the headers).
    for i in 0..3u64 {
        let s = partial_upload(d.envoys[1].listen, 2 * MIB, MIB, 700 + i).await;
        reset(s);
    }
    // The budget came back: a 2.5 MiB body goes through (a retry covers the moment between
    // Envoy's resets and kv-router's processing of them).
    let mut big = text(650, 5 * MIB / 2);
    big.truncate(5 * MIB / 2 - 200);
    let mut refused = 0;
    let probe_deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let o = common::post_to(
            &d.client,
            &d.envoys[0].url(),
            "/v1/completions",
            &completion(&big, 4),
            &[],
        )
        .await;
        if o.ok() {
            break;
        }
        refused += 1;
        assert!(
            Instant::now() < probe_deadline,
            "after aborted uploads a 2.5 MiB body is still refused ({refused} tries; last status \
             {:?} {:?} {}): buffered bytes of reset streams were never released{}",
            o.status,
            o.error,
            o.body,
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // (b) Long streamed responses whose clients vanish mid-stream (FULL_DUPLEX sees the
    //     response; BUFFERED does not): while open they count, after the reset they do not.
    let mut open = Vec::new();
    for (e, n) in [(0usize, 3u64), (1, 2)] {
        for j in 0..n {
            let body = chat_stream(
                &text(800 + 10 * e as u64 + j, 1500),
                "Write a long story.",
                20_000,
            );
            let resp = d
                .client
                .post(format!("{}/v1/chat/completions", d.envoys[e].url()))
                .json(&body)
                .send()
                .await
                .expect("streamed request");
            assert_eq!(resp.status(), 200, "{}", d.diag());
            let mut stream = resp.bytes_stream();
            stream
                .next()
                .await
                .expect("a first chunk")
                .expect("first chunk");
            open.push(stream);
        }
    }
    let m = wait_for(
        "the in-flight gauges to count the open FULL_DUPLEX streams",
        POLL,
        || d.diag(),
        || async {
            let m = get_text(&d.client, &format!("{admin}/metrics")).await?;
            (inflight_gauges(&m).0 >= 3.0).then_some(m)
        },
    )
    .await;
    let while_open = inflight_gauges(&m);
    drop(open);
    let reset_at = Instant::now();
    let last = Arc::new(Mutex::new(String::new()));
    wait_for(
        "the in-flight gauges to return to zero",
        POLL,
        || format!("\nlast in-flight lines:\n{}{}", last.lock(), d.diag()),
        || async {
            let m = get_text(&d.client, &format!("{admin}/metrics")).await?;
            *last.lock() = m
                .lines()
                .filter(|l| l.contains("inflight"))
                .collect::<Vec<_>>()
                .join("\n");
            (inflight_gauges(&m) == (0.0, 0.0)).then_some(())
        },
    )
    .await;
    let settled = reset_at.elapsed();
    // The live view agrees.
    let v = get_json(&d.client, &format!("{admin}/debug/pods"))
        .await
        .expect("/debug/pods");
    for p in v["pods"].as_array().unwrap() {
        assert_eq!(p["load"]["inflight_requests"], 0.0, "{p}");
    }
    eprintln!(
        "aborts: 2.5 MiB probe refused {refused} time(s); in-flight gauges {while_open:?} while \
         open, zero {settled:?} after the resets; total {:?}",
        started.elapsed()
    );
    assert_within_budget(started);
}

// ---------------------------------------------------------------------------------------------
// 7. A pod whose /metrics hangs.

/// An HTTP front for a vllm-sim that passes every request through, except `/metrics` once
/// `hang` is set: that one never answers. Counts hung scrapes and those the caller gave up on.
struct HangingMetrics {
    addr: SocketAddr,
    hang: Arc<AtomicBool>,
    hung: Arc<AtomicUsize>,
    abandoned: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HangingMetrics {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Abandoned(Arc<AtomicUsize>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

impl HangingMetrics {
    async fn start() -> (Self, SimPod) {
        use axum::body::Body;
        use axum::extract::{Request, State};
        use axum::response::Response;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // The sim names itself after the front, so responses say which pod served them.
        let mut args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
        args.extend(["--pod-name".to_string(), addr.to_string()]);
        let sim = SimPod::spawn(&bins().vllm_sim, &args).expect("start vllm-sim");
        let (hang, hung, abandoned) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        #[derive(Clone)]
        struct St {
            upstream: String,
            client: reqwest::Client,
            hang: Arc<AtomicBool>,
            hung: Arc<AtomicUsize>,
            abandoned: Arc<AtomicUsize>,
        }
        async fn pass(State(st): State<St>, req: Request) -> Response {
            if req.uri().path() == "/metrics" && st.hang.load(Ordering::Relaxed) {
                st.hung.fetch_add(1, Ordering::Relaxed);
                let _gone = Abandoned(st.abandoned.clone());
                std::future::pending::<()>().await;
            }
            let (parts, body) = req.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX)
                .await
                .unwrap_or_default();
            let pq = parts
                .uri
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or("/");
            let mut out = st
                .client
                .request(parts.method, format!("{}{pq}", st.upstream));
            for (k, v) in parts.headers.iter() {
                if !matches!(
                    k.as_str(),
                    "host" | "connection" | "content-length" | "transfer-encoding"
                ) {
                    out = out.header(k, v);
                }
            }
            match out.body(body).send().await {
                Ok(r) => {
                    let mut b = Response::builder().status(r.status());
                    for (k, v) in r.headers() {
                        if !matches!(
                            k.as_str(),
                            "connection" | "content-length" | "transfer-encoding"
                        ) {
                            b = b.header(k, v);
                        }
                    }
                    b.body(Body::from_stream(r.bytes_stream())).unwrap()
                }
                Err(e) => Response::builder()
                    .status(502)
                    .body(Body::from(e.to_string()))
                    .unwrap(),
            }
        }
        let st = St {
            upstream: sim.url(),
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
            hang: hang.clone(),
            hung: hung.clone(),
            abandoned: abandoned.clone(),
        };
        let app = axum::Router::new().fallback(pass).with_state(st);
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        (
            Self {
                addr,
                hang,
                hung,
                abandoned,
                task,
            },
            sim,
        )
    }
}

/// `n` completions of fresh prompts, `conc` at a time, through `base`: outcomes and wall time.
async fn batch(
    base: &str,
    n: u64,
    conc: usize,
    seed: u64,
) -> (Vec<common::runner::StreamOutcome>, Duration) {
    let client = common::runner::client();
    let t = Instant::now();
    let outs = futures::stream::iter(0..n)
        .map(|i| {
            let client = client.clone();
            async move {
                let p = format!("Batch {seed}/{i}. {}", text(seed * 1000 + i, 1200));
                common::post_to(&client, base, "/v1/completions", &completion(&p, 8), &[]).await
            }
        })
        .buffer_unordered(conc)
        .collect::<Vec<_>>()
        .await;
    (outs, t.elapsed())
}

/// Two fast pods and a third whose `/metrics` can be made to hang: their addresses, the hanging
/// front (the pods live as long as the tuple).
async fn two_pods_and_a_hanging_one() -> (Vec<SimPod>, HangingMetrics, SimPod, Vec<SocketAddr>) {
    let b = bins();
    let args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
    let sims: Vec<SimPod> = (0..2)
        .map(|_| SimPod::spawn(&b.vllm_sim, &args).expect("start vllm-sim"))
        .collect();
    let (front, hidden) = HangingMetrics::start().await;
    let mut addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    addrs.push(front.addr);
    (sims, front, hidden, addrs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_metrics_hang_does_not_delay_decisions() {
    let started = Instant::now();
    let envoy = envoy_bin();
    let b = bins();
    let (_sims, front, _hidden, addrs) = two_pods_and_a_hanging_one().await;
    let mut cfg = deploy::local_router_config(&addrs).unwrap();
    cfg.gate.hot_abs = 16.0;
    let probe_timeout = Duration::from_millis(cfg.pods.probe_timeout_ms);
    let stale_after = cfg.pods.stale_after_ms;
    let router = RouterProc::spawn(&b.kv_router, &cfg)
        .await
        .expect("start kv-router");
    router
        .wait_pods_ready(3, POLL)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nrouter stderr:\n{}", router.stderr_tail(40)));
    let envoy = EnvoyProc::spawn(
        &envoy,
        &deploy::envoy_template(BUFFERED).unwrap(),
        Some(router.grpc),
        &addrs,
    )
    .await
    .unwrap_or_else(|e| panic!("start Envoy: {e:#}"));
    let diag = || {
        format!(
            "\n--- kv-router stderr ---\n{}\n--- envoy stderr ---\n{}",
            router.stderr_tail(30),
            envoy.stderr_tail(20)
        )
    };
    let hung_pod = front.addr.to_string();
    let client = common::runner::client();
    let pods_url = format!("{}/debug/pods", router.admin_url());
    let ages = || async {
        let v = get_json(&client, &pods_url).await?;
        let mut m = BTreeMap::new();
        for p in v["pods"].as_array()? {
            m.insert(
                p["address"].as_str()?.to_string(),
                p["metrics_age_ms"].as_u64().unwrap_or(u64::MAX),
            );
        }
        Some(m)
    };

    let (base_outs, base_wall) = batch(&envoy.url(), 30, 3, 71).await;
    for o in &base_outs {
        common::served_by(o, &diag());
    }
    let base_max = base_outs.iter().map(|o| o.e2e).max().unwrap();

    front.hang.store(true, Ordering::Relaxed);
    let hang_at = Instant::now();
    // The router gave up on at least one scrape (its probe timeout), and the pod's sample is
    // now stale: the gate treats it as saturated.
    wait_for(
        "a scrape of the hung /metrics to time out and the sample to go stale",
        POLL,
        diag,
        || async {
            let a = ages().await?;
            // A second scrape means the round of the first one ended: the router stopped waiting.
            let gave_up = front.hung.load(Ordering::Relaxed) >= 2
                || front.abandoned.load(Ordering::Relaxed) >= 1;
            (gave_up && a[&hung_pod] > stale_after).then_some(())
        },
    )
    .await;
    let gave_up = hang_at.elapsed();

    // Meanwhile the other pods' samples stay fresh, and decisions are as fast as before.
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (watching, client, pods_url, hung_pod) = (
            watching.clone(),
            client.clone(),
            pods_url.clone(),
            hung_pod.clone(),
        );
        tokio::spawn(async move {
            let mut worst = 0u64;
            while watching.load(Ordering::Relaxed) {
                if let Some(v) = get_json(&client, &pods_url).await {
                    for p in v["pods"].as_array().into_iter().flatten() {
                        if p["address"] != hung_pod.as_str() {
                            worst = worst.max(p["metrics_age_ms"].as_u64().unwrap_or(u64::MAX));
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            worst
        })
    };
    let (outs, wall) = batch(&envoy.url(), 30, 3, 72).await;
    watching.store(false, Ordering::Relaxed);
    let worst_age = watcher.await.unwrap();
    let mut served: BTreeMap<String, usize> = BTreeMap::new();
    for o in &outs {
        *served.entry(common::served_by(o, &diag())).or_default() += 1;
    }
    let max = outs.iter().map(|o| o.e2e).max().unwrap();
    let m = router.metrics().await.unwrap();
    let all = metric(&m, "kv_router_decision_duration_seconds_count", &[]);
    let prefix = "kv_router_decision_duration_seconds_bucket{le=\"";
    let (le, fast) = m
        .lines()
        .filter_map(|l| {
            let (le, n) = l.strip_prefix(prefix)?.split_once("\"}")?;
            Some((le.parse::<f64>().ok()?, n.trim().parse::<f64>().ok()?))
        })
        .filter(|(le, _)| *le <= 0.1)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .expect("decision duration buckets");
    eprintln!(
        "hung /metrics: scrape abandoned and sample stale {gave_up:?} after the hang ({} scrapes \
         hung, {} abandoned); batch of 30 took {wall:?} (max {max:?}) vs {base_wall:?} (max \
         {base_max:?}) before; other pods' worst sample age {worst_age} ms; served {served:?}; \
         total {:?}",
        front.hung.load(Ordering::Relaxed),
        front.abandoned.load(Ordering::Relaxed),
        started.elapsed()
    );
    assert_eq!(
        fast,
        all,
        "a decision took longer than {le} s while a pod's /metrics hung{}",
        diag()
    );
    assert!(
        max < base_max + probe_timeout / 2 && wall < base_wall * 2 + probe_timeout / 2,
        "requests slowed down while a pod's /metrics hung: batch {wall:?} (max {max:?}) vs \
         {base_wall:?} (max {base_max:?}) before{}",
        diag()
    );
    assert!(
        worst_age < stale_after,
        "a healthy pod's sample went stale ({worst_age} ms) because another pod's /metrics hung{}",
        diag()
    );
    assert!(
        !served.contains_key(&hung_pod),
        "the pod with a stale sample still got new requests: {served:?}{}",
        diag()
    );
    assert_within_budget(started);
}

/// The same hang seen from the other pods: their load samples must keep their own pace (one
/// scrape per `scrape_interval_ms`), not wait for the hung pod's probe timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_metrics_hang_does_not_slow_the_scrape_of_the_others() {
    let started = Instant::now();
    let b = bins();
    let (_sims, front, _hidden, addrs) = two_pods_and_a_hanging_one().await;
    let mut cfg = deploy::local_router_config(&addrs).unwrap();
    // Idle pods are scraped every second by default, as long as the old stall: scrape every pod
    // at the fast interval so a stall shows.
    cfg.pods.idle_scrape_interval_ms = cfg.pods.scrape_interval_ms;
    let scrape = cfg.pods.scrape_interval_ms;
    let probe_timeout = Duration::from_millis(cfg.pods.probe_timeout_ms);
    let router = RouterProc::spawn(&b.kv_router, &cfg)
        .await
        .expect("start kv-router");
    router
        .wait_pods_ready(3, POLL)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nrouter stderr:\n{}", router.stderr_tail(40)));
    let client = common::runner::client();
    let pods_url = format!("{}/debug/pods", router.admin_url());
    let hung_pod = front.addr.to_string();

    front.hang.store(true, Ordering::Relaxed);
    // Watch the other pods' sample ages over two probe timeouts of the hung one.
    let until = Instant::now() + probe_timeout * 2 + Duration::from_millis(200);
    let mut worst: BTreeMap<String, u64> = BTreeMap::new();
    while Instant::now() < until {
        if let Some(v) = get_json(&client, &pods_url).await {
            for p in v["pods"].as_array().into_iter().flatten() {
                let a = p["address"].as_str().unwrap_or_default().to_string();
                if a != hung_pod {
                    let age = p["metrics_age_ms"].as_u64().unwrap_or(u64::MAX);
                    let w = worst.entry(a).or_default();
                    *w = (*w).max(age);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let hung = front.hung.load(Ordering::Relaxed);
    eprintln!(
        "hung /metrics: {hung} scrapes of the hung pod; the other pods' worst sample ages \
         {worst:?} ms (scrape interval {scrape} ms, probe timeout {probe_timeout:?}); total {:?}",
        started.elapsed()
    );
    assert!(
        hung >= 2,
        "the router never gave up on the hung scrape ({hung} scrapes in {:?})",
        probe_timeout * 2
    );
    assert_eq!(worst.len(), 2, "{worst:?}");
    let bound = scrape * 5;
    assert!(
        worst.values().all(|w| *w <= bound),
        "one pod's hung /metrics held back the scrape of the others: their samples aged up to \
         {worst:?} ms (scrape interval {scrape} ms, bound {bound} ms); each scrape round waits for \
         every pod's probe (up to pods.probe_timeout_ms = {probe_timeout:?}) before the next\n\
         --- kv-router stderr ---\n{}",
        router.stderr_tail(20)
    );
    assert_within_budget(started);
}
