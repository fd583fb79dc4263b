//! TLS on the gRPC port (ext_proc, Pick, health): a client that trusts the router's CA gets
//! answers; with `client_ca_file` (mTLS) a client without a certificate from that CA is refused
//! at the handshake, one with it is served. Certificates are made on the fly (rcgen).

use crate::common;

use std::time::Duration;

use common::deploy::{self, RouterProc, SimPod};
use common::{bins, FAST_SIM};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// A CA and a certificate it signed for 127.0.0.1 (PEM cert, PEM key).
struct Pki {
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl Pki {
    fn new() -> Self {
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = params.self_signed(&ca_key).unwrap();
        Self { ca, ca_key }
    }

    fn leaf(&self) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::IpAddress([127, 0, 0, 1].into())];
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

async fn router(
    dir: &std::path::Path,
    server: &Pki,
    clients: Option<&Pki>,
) -> (SimPod, RouterProc) {
    let bins = bins();
    let args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
    let pod = SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim");
    let mut cfg = deploy::local_router_config(&[pod.addr]).expect("router config");
    let (cert, key) = server.leaf();
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        Some(p.display().to_string())
    };
    cfg.server.tls.cert_file = write("router.pem", &cert);
    cfg.server.tls.key_file = write("router-key.pem", &key);
    if let Some(c) = clients {
        cfg.server.tls.client_ca_file = write("clients-ca.pem", &c.ca.pem());
    }
    let r = RouterProc::spawn(&bins.kv_router, &cfg)
        .await
        .expect("start kv-router");
    (pod, r)
}

/// The gRPC health answer over TLS trusting `ca`, presenting `identity` if any.
async fn health(
    r: &RouterProc,
    ca: &Pki,
    identity: Option<(String, String)>,
) -> Result<ServingStatus, String> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca.ca.pem()));
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Channel::from_shared(format!("https://{}", r.grpc))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map_err(|e| format!("check: {e}"))?;
    Ok(answer.into_inner().status())
}

/// The health answer once the router has probed its pod (NOT_SERVING until then), or the error.
async fn serving(
    r: &RouterProc,
    ca: &Pki,
    identity: Option<(String, String)>,
) -> Result<ServingStatus, String> {
    for _ in 0..100 {
        match health(r, ca, identity.clone()).await {
            Ok(ServingStatus::Serving) | Err(_) => break,
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    health(r, ca, identity).await
}

#[tokio::test]
async fn the_grpc_port_serves_tls_and_mtls_refuses_clients_without_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let server_pki = Pki::new();

    // TLS: a client trusting the CA is served; plaintext is not.
    let (_pod, r) = router(dir.path(), &server_pki, None).await;
    assert_eq!(
        serving(&r, &server_pki, None).await,
        Ok(ServingStatus::Serving)
    );
    let plain = Channel::from_shared(format!("http://{}", r.grpc))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await;
    if let Ok(channel) = plain {
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        assert!(answer.is_err(), "plaintext answered on a TLS port");
    }
    // A client that does not trust the router's CA refuses it.
    assert!(health(&r, &Pki::new(), None).await.is_err());
    drop(r);

    // mTLS: only clients with a certificate from the configured CA.
    let client_pki = Pki::new();
    let mtls_dir = tempfile::tempdir().unwrap();
    let (_pod2, r) = router(mtls_dir.path(), &server_pki, Some(&client_pki)).await;
    assert!(
        health(&r, &server_pki, None).await.is_err(),
        "a client without a certificate was served"
    );
    assert!(
        health(&r, &server_pki, Some(Pki::new().leaf()))
            .await
            .is_err(),
        "a certificate from another CA was accepted"
    );
    assert_eq!(
        serving(&r, &server_pki, Some(client_pki.leaf())).await,
        Ok(ServingStatus::Serving)
    );
}
