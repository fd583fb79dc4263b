//! The connection caps fitted under the file-descriptor limit, through the real process: under
//! `ulimit -n 1024`, 2,000 preface-only gRPC connections under the default cap of 10,000 held
//! every descriptor, and `/healthz` and the gRPC health checks failed while they stayed.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use common::deploy::{self, RouterProc, SimPod};
use common::{bins, FAST_SIM};
use tokio::io::AsyncWriteExt;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// A router started by `sh` after `ulimit -n limit` (soft and hard), over one fast pod.
async fn router_under(limit: u64) -> (SimPod, RouterProc, tempfile::TempDir) {
    let bins = bins();
    let args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
    let pod = SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim");
    let cfg = deploy::local_router_config(&[pod.addr]).expect("router config");
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("kv-router");
    let body = format!(
        "#!/bin/sh\nulimit -n {limit} || exit 1\nexec '{}' \"$@\"\n",
        bins.kv_router.display()
    );
    std::fs::write(&script, body).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = RouterProc::spawn(&script, &cfg)
        .await
        .expect("start kv-router");
    (pod, r, dir)
}

/// This process may hold the connections it opens (it only raises its soft limit).
fn raise_own_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: l.maximum,
            maximum: l.maximum,
        },
    );
}

/// `/healthz` and gRPC readiness, each on a fresh connection, each within 2 s.
async fn probe(r: &RouterProc) -> Result<(), String> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let status = client
        .get(format!("{}/healthz", r.admin_url()))
        .send()
        .await;
    match status.as_ref().map(|s| s.status().as_u16()) {
        Ok(200) => {}
        other => return Err(format!("/healthz: {other:?}")),
    }
    let grpc = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", r.grpc))
            .unwrap()
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        let check = HealthCheckRequest {
            service: "readiness".into(),
        };
        let answer = HealthClient::new(channel).check(check).await;
        answer.map(|_| ()).map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(2), grpc).await {
        Ok(Ok(())) => Ok(()),
        other => Err(format!("gRPC readiness: {other:?}")),
    }
}

#[tokio::test]
async fn under_a_low_fd_limit_the_caps_shrink_and_probes_stay_answered() {
    const LIMIT: u64 = 1024;
    const FLOOD: usize = 2_000;
    raise_own_fd_limit();
    let (_pod, r, _dir) = router_under(LIMIT).await;
    let caps = r.debug_pods().await.unwrap()["connections"].clone();
    let n = |k: &str| caps[k].as_u64().unwrap_or_else(|| panic!("{k} in {caps}"));
    assert_eq!(n("nofile"), LIMIT, "{caps}");
    let (grpc, admin) = (n("grpc_max_connections"), n("admin_max_connections"));
    assert!(grpc + admin + n("reserved_fds") <= LIMIT, "{caps}");
    assert!(
        r.stderr_tail(400).contains("connection caps"),
        "the caps are logged at start:\n{}",
        r.stderr_tail(40)
    );
    // More preface-only connections than descriptors, all held open.
    let mut flood = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        let mut s = tokio::net::TcpStream::connect(r.grpc).await.unwrap();
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        flood.push(s);
    }
    let started = Instant::now();
    for round in 0..5 {
        if let Err(e) = probe(&r).await {
            panic!(
                "probe {round} behind {FLOOD} connections failed after {:?}: {e}\n{}",
                started.elapsed(),
                r.stderr_tail(20)
            );
        }
    }
    drop(flood);
}
