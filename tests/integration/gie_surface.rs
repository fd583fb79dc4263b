//! What a Gateway API Inference Extension deployment expects of its endpoint picker besides the
//! protocol, against a live kv-router behind real Envoy: gRPC health on a port of its own
//! (`listen.grpc_health`, the chart's 9003) answering for `inference-extension` and nothing but
//! health, and the GIE metric families (`inference_pool_*`, `inference_objective_*`) its
//! dashboards read.

use crate::common;

use std::time::{Duration, Instant};

use common::deploy::free_port;
use common::{completion, served_by, text, Deployment};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const FULL_DUPLEX: &str = "gie-full-duplex.yaml";

async fn check(addr: &str, service: &str) -> Result<ServingStatus, tonic::Status> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await?;
    Ok(answer.into_inner().status())
}

/// The value of the sample `series` (name and labels exactly) in `/metrics`, if present.
fn value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn the_health_port_and_the_gie_metric_families_are_served() {
    let health = format!("127.0.0.1:{}", free_port().unwrap());
    let h = health.clone();
    let d = Deployment::start_with(3, &[FULL_DUPLEX], |c| c.listen.grpc_health = h).await;
    let router = d.router.as_ref().unwrap();

    // Readiness turns SERVING within a report tick of the pods being probed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(
        check(&health, "readiness").await,
        Ok(ServingStatus::Serving)
    ) {
        assert!(
            Instant::now() < deadline,
            "the health port never said SERVING{}",
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for service in ["inference-extension", "readiness", "liveness", ""] {
        let got = check(&health, service).await;
        assert_eq!(
            got.ok(),
            Some(ServingStatus::Serving),
            "health port, {service:?}{}",
            d.diag()
        );
    }
    // The same answer on the main port; nothing but health on the health port.
    let main = router.grpc.to_string();
    assert_eq!(
        check(&main, "inference-extension").await.ok(),
        Some(ServingStatus::Serving)
    );
    let unknown = check(&health, "no-such-service").await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    let channel = Channel::from_shared(format!("http://{health}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let not_here = grpc
        .unary::<_, (), _>(
            tonic::Request::new(()),
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
                .parse()
                .unwrap(),
            tonic_prost::ProstCodec::<(), ()>::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(not_here.code(), tonic::Code::Unimplemented, "{not_here:?}");

    for i in 0..5 {
        let o = d
            .post(
                0,
                "/v1/completions",
                &completion(&text(90 + i, 800), 4),
                &[],
            )
            .await;
        served_by(&o, &d.diag());
    }
    // The pool gauges are set each second; the requests have all ended.
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let m = router.metrics().await.unwrap();
        let ready = value(&m, "inference_pool_ready_pods{name=\"default\"}");
        let running = value(
            &m,
            "inference_objective_running_requests{model_name=\"sim-model\"}",
        );
        if ready == Some(3.0) && running == Some(0.0) {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "pool gauges never settled:\n{m}{}",
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        value(&metrics, "inference_objective_request_total{model_name=\"sim-model\",target_model_name=\"sim-model\"}"),
        Some(5.0),
        "{metrics}"
    );
    for family in [
        "inference_pool_average_kv_cache_utilization{name=\"default\"}",
        "inference_pool_average_queue_size{name=\"default\"}",
        "inference_pool_average_running_requests{name=\"default\"}",
    ] {
        assert!(
            value(&metrics, family).is_some(),
            "{family} missing:\n{metrics}"
        );
    }
    for pod in d.addrs() {
        let series = format!(
            "inference_pool_per_pod_queue_size{{model_server_pod=\"{pod}\",name=\"default\"}}"
        );
        assert!(
            value(&metrics, &series).is_some(),
            "{series} missing:\n{metrics}"
        );
    }
}
