//! The cases, each a named check of what the picker made Envoy do, and the runner that warms the
//! rig up, runs them per mode and kills the picker last.

mod body;
mod routing;

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::http::{self, Resp};
use crate::rig::{PodLayout, Rig, MODEL};
use crate::{CaseResult, Mode, Options, Outcome, PickerSpec, Report};

/// GIE conformance hook: the candidates a request may go to (`ip` or `ip:port`, comma list).
pub const SELECTION: &str = "test-epp-endpoint-selection";
/// GIE conformance hook: the endpoint Envoy served the request from.
pub const SERVED: &str = "x-conformance-test-served-endpoint";
/// GIE conformance hook: the endpoint the picker chose.
pub const SELECTED: &str = "x-conformance-test-selected-endpoint";
/// GIE conformance hook: the picker's pool, `namespace/name`.
pub const POOL: &str = "x-conformance-test-epp-pool";
/// The suite's own test header: the suite's Envoy turns it into the subset hint.
pub const SUBSET: &str = "x-epp-conformance-subset";

/// What a case returns: a note on success, the reason on failure.
pub type CaseRes = Result<String, String>;

/// What a case may use.
pub struct Ctx {
    /// The mode of the Envoy it talks to.
    pub mode: Mode,
    /// `http://<listener>`.
    pub base: String,
    /// The listener (raw connections).
    pub listen: SocketAddr,
    /// Pods by role.
    pub pods: PodLayout,
    /// The HTTP client.
    pub client: reqwest::Client,
}

/// The GIE conformance tests' request body, with `nonce` in front of the prompt when given
/// (distinct prompts share no cached prefix).
pub fn completion(nonce: Option<u64>) -> Value {
    let critic = "Write as if you were a critic: San Francisco";
    let prompt = match nonce {
        Some(n) => format!("{n} {critic}"),
        None => critic.to_string(),
    };
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 4})
}

impl Ctx {
    /// POSTs the conformance completion with `headers`.
    pub async fn complete(&self, headers: &[(&str, String)]) -> Result<Resp, String> {
        self.complete_body(&completion(None), headers).await
    }

    /// POSTs `body` to `/v1/completions`.
    pub async fn complete_body(
        &self,
        body: &Value,
        headers: &[(&str, String)],
    ) -> Result<Resp, String> {
        http::post_json(&self.client, &self.base, "/v1/completions", body, headers)
            .await
            .map_err(|e| format!("{e:#}"))
    }

    /// The pod that served `r`, which must be a success from a known pod; when the picker
    /// reports the served endpoint (hooks on), it must name that pod.
    pub fn served(&self, r: &Resp) -> Result<SocketAddr, String> {
        if !(200..300).contains(&r.status) {
            return Err(format!("expected a success, got {}", r.brief()));
        }
        let pod = r
            .pod()
            .ok_or_else(|| format!("no {} header: no stub pod answered", http::POD_HEADER))?;
        if !self.pods.all().contains(&pod) {
            return Err(format!(
                "served by {pod}, which is not one of the suite's pods"
            ));
        }
        if let Some(v) = r.header(SERVED) {
            check_names(SERVED, v, pod)?;
        }
        Ok(pod)
    }

    /// Sends `n` requests with `headers` and checks each landed on one of `allowed`.
    pub async fn all_on(
        &self,
        headers: &[(&str, String)],
        allowed: &[SocketAddr],
        n: usize,
    ) -> Result<BTreeSet<SocketAddr>, String> {
        let mut seen = BTreeSet::new();
        for _ in 0..n {
            let r = self.complete(headers).await?;
            let pod = self.served(&r)?;
            if !allowed.contains(&pod) {
                return Err(format!(
                    "with {} served by {pod}, expected one of {}",
                    describe(headers),
                    list(allowed)
                ));
            }
            seen.insert(pod);
        }
        Ok(seen)
    }

    /// Sends one request with `headers` that must be refused: a non-2xx that no pod served.
    pub async fn refused(&self, headers: &[(&str, String)]) -> Result<u16, String> {
        let r = self.complete(headers).await?;
        if (200..300).contains(&r.status) || r.pod().is_some() {
            return Err(format!(
                "with {} expected a refusal (503), got {}",
                describe(headers),
                r.brief()
            ));
        }
        Ok(r.status)
    }
}

/// `value` (a header the picker set) must be `pod`'s address.
pub fn check_names(header: &str, value: &str, pod: SocketAddr) -> Result<(), String> {
    match value.trim().parse::<SocketAddr>() {
        Ok(a) if a == pod => Ok(()),
        _ => Err(format!(
            "{header} is {value:?}, but {pod} served the request"
        )),
    }
}

/// `a, b, c`.
pub fn list(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn describe(headers: &[(&str, String)]) -> String {
    if headers.is_empty() {
        return "no routing header".into();
    }
    headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A case that runs once per mode.
type ModeCase = for<'a> fn(&'a Ctx) -> std::pin::Pin<Box<dyn Future<Output = CaseRes> + 'a>>;

macro_rules! cases {
    ($($name:literal => $f:path),* $(,)?) => {
        &[$(($name, |ctx| Box::pin($f(ctx)))),*]
    };
}

/// Every per-mode case, in the order they run.
pub const MODE_CASES: &[(&str, ModeCase)] = cases![
    "routing.no-selection" => routing::no_selection,
    "hooks.served-endpoint" => routing::served_endpoint,
    "selection.ip-port" => routing::selection_ip_port,
    "selection.ip" => routing::selection_ip,
    "selection.list" => routing::selection_list,
    "selection.ipv6" => routing::selection_ipv6,
    "selection.no-match" => routing::selection_no_match,
    "subset.full" => routing::subset_full,
    "subset.partial" => routing::subset_partial,
    "subset.none-matching" => routing::subset_none,
    "body.chunked-upload" => body::chunked_upload,
    "body.header-only-get" => body::header_only_get,
    "body.invalid-json" => body::invalid_json,
    "body.missing-model" => body::missing_model,
    "body.empty-end-of-stream" => body::empty_end_of_stream,
    "body.multi-chunk-end-of-stream" => body::multi_chunk_end_of_stream,
    "stream.sse" => body::sse,
    "security.forged-destination" => routing::forged_destination,
    "security.forged-prefiller" => routing::forged_prefiller,
];

/// Names of the mode-independent cases.
pub const HEALTH_CASES: [(&str, &str); 2] = [
    ("health.inference-extension", "inference-extension"),
    (
        "health.ext-proc",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ),
];

/// Name of the last per-mode case (the suite kills the picker first).
pub const PICKER_DIES: &str = "picker-dies";

/// Every case name a full run reports, mode cases as `<mode>/<case>`.
pub fn all_names(modes: &[Mode]) -> Vec<String> {
    let mut v: Vec<String> = HEALTH_CASES.iter().map(|(n, _)| n.to_string()).collect();
    for m in modes {
        v.extend(MODE_CASES.iter().map(|(n, _)| format!("{m}/{n}")));
    }
    v.extend(modes.iter().map(|m| format!("{m}/{PICKER_DIES}")));
    v
}

/// Longest a case may run.
const CASE_TIMEOUT: Duration = Duration::from_secs(90);

fn wanted(opts: &Options, name: &str) -> bool {
    opts.only.is_empty() || opts.only.iter().any(|o| name.contains(o.as_str()))
}

/// Warms the rig up (each Envoy routes a first request, then one selected request per pod),
/// runs the health cases, every mode's cases, and last the picker-dies cases.
pub async fn run_all(
    mut rig: Rig,
    opts: &Options,
    mut progress: impl FnMut(&CaseResult),
) -> Report {
    let client = http::client();
    let mut report = Report::default();
    let mut push = |name: String, mode: Option<Mode>, outcome: Outcome| {
        let r = CaseResult {
            name,
            mode,
            outcome,
        };
        progress(&r);
        report.results.push(r);
    };
    let ctxs: Vec<Ctx> = rig
        .envoys
        .iter()
        .map(|(mode, e)| Ctx {
            mode: *mode,
            base: e.url(),
            listen: e.listen,
            pods: rig.pods.clone(),
            client: client.clone(),
        })
        .collect();
    let mut warm = Vec::new();
    for ctx in &ctxs {
        warm.push(warm_up(ctx, rig.ready_timeout).await);
    }
    for (name, service) in HEALTH_CASES {
        if wanted(opts, name) {
            let outcome = match health(rig.picker.health, service).await {
                Ok(note) => Outcome::Pass(note),
                Err(why) => Outcome::Fail(why),
            };
            push(name.to_string(), None, outcome);
        }
    }
    for (ctx, warm) in ctxs.iter().zip(&warm) {
        for (name, case) in MODE_CASES {
            let full = format!("{}/{name}", ctx.mode);
            if !wanted(opts, &full) {
                continue;
            }
            let outcome = match warm {
                Err(why) => Outcome::Fail(format!("warm-up failed: {why}")),
                Ok(()) if *name == "selection.ipv6" && ctx.pods.v6.is_none() => {
                    Outcome::Skip("no IPv6 pod (--no-ipv6)".into())
                }
                Ok(()) => match tokio::time::timeout(CASE_TIMEOUT, case(ctx)).await {
                    Ok(Ok(note)) => Outcome::Pass(note),
                    Ok(Err(why)) => Outcome::Fail(why),
                    Err(_) => Outcome::Fail(format!("no result in {CASE_TIMEOUT:?}")),
                },
            };
            push(full, Some(ctx.mode), outcome);
        }
    }
    let dies: Vec<&Ctx> = ctxs
        .iter()
        .filter(|c| wanted(opts, &format!("{}/{PICKER_DIES}", c.mode)))
        .collect();
    if !dies.is_empty() {
        let killed = matches!(opts.picker, PickerSpec::Cmd { .. }) && rig.picker.kill();
        for ctx in dies {
            let outcome = if !killed {
                Outcome::Skip("the suite did not start the picker (use --picker-cmd)".into())
            } else {
                match picker_dies(ctx).await {
                    Ok(note) => Outcome::Pass(note),
                    Err(why) => Outcome::Fail(why),
                }
            };
            push(
                format!("{}/{PICKER_DIES}", ctx.mode),
                Some(ctx.mode),
                outcome,
            );
        }
    }
    if !report.failed().is_empty() {
        let tail = rig.picker.tail(25);
        if !tail.is_empty() {
            eprintln!("{tail}");
        }
    }
    drop(rig);
    report
}

/// Waits until a plain request is served, then sends one request selecting each pod (until any
/// success) so that a picker still probing its pods has seen them all.
async fn warm_up(ctx: &Ctx, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no answer yet");
    let mut routed = false;
    while !routed {
        match ctx.complete(&[]).await {
            Ok(r) if (200..300).contains(&r.status) && r.pod().is_some() => routed = true,
            Ok(r) => last = r.brief(),
            Err(e) => last = e,
        }
        if !routed && Instant::now() > deadline {
            return Err(format!("no request routed in {timeout:?}; last: {last}"));
        }
        if !routed {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    for pod in ctx.pods.all() {
        let pod_deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let ok = matches!(
                ctx.complete(&[(SELECTION, pod.to_string())]).await,
                Ok(r) if (200..300).contains(&r.status)
            );
            if ok || Instant::now() > pod_deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// gRPC health of `service` at `addr` must answer SERVING (polled for a few seconds).
async fn health(addr: SocketAddr, service: &str) -> CaseRes {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last;
    loop {
        last = match health_once(addr, service).await {
            Ok(ServingStatus::Serving) => return Ok(format!("SERVING at {addr}")),
            Ok(s) => format!("{s:?}"),
            Err(e) => e,
        };
        if Instant::now() > deadline {
            return Err(format!(
                "grpc.health.v1 Check(service {service:?}) at {addr}: {last}, expected SERVING"
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn health_once(addr: SocketAddr, service: &str) -> Result<ServingStatus, String> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let r = HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .map_err(|s| format!("status {:?}: {}", s.code(), s.message()))?;
    Ok(ServingStatus::try_from(r.into_inner().status).unwrap_or(ServingStatus::Unknown))
}

/// With the picker killed: BUFFERED with failure_mode_allow fails open (a pod serves every
/// request); FULL_DUPLEX_STREAMED cannot (Envoy 1.40 answers 500: the body already went to the
/// picker's stream when it failed).
async fn picker_dies(ctx: &Ctx) -> CaseRes {
    let mut seen = BTreeSet::new();
    for _ in 0..3 {
        let r = ctx.complete(&[]).await?;
        match ctx.mode {
            Mode::Buffered => {
                seen.insert(
                    ctx.served(&r)
                        .map_err(|e| format!("fail-open expected: {e}"))?,
                );
            }
            Mode::FullDuplex => {
                if r.status != 500 || r.pod().is_some() {
                    return Err(format!(
                        "Envoy 1.40 cannot fail open in FULL_DUPLEX_STREAMED: expected its 500, got {}",
                        r.brief()
                    ));
                }
            }
        }
    }
    Ok(match ctx.mode {
        Mode::Buffered => format!(
            "failed open to {}",
            list(&seen.into_iter().collect::<Vec<_>>())
        ),
        Mode::FullDuplex => "500 from Envoy, as documented (no fail-open in this mode)".into(),
    })
}
