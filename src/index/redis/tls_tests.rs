//! `rediss://`: the router reaches a TLS Redis whose certificate a private CA signed, and refuses
//! (falls back, never routes on) a server its CA does not vouch for. The TLS end is a small
//! terminating proxy in front of a real server, so the test runs with any Redis build (the
//! Valkey wheel has no TLS).

use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{crypto::ring, ServerConfig};
use tokio_rustls::TlsAcceptor;

use crate::config::RedisConfig;
use crate::index::contract::{doc_keys, pods};
use crate::index::{
    KvIndex, Local, MemoryIndex, RedisFallbackReason, RedisIndex, RedisMetrics, RedisSource, Tuning,
};
use kv_testkit::deploy::{find_redis_server, RedisProc};

/// A CA certificate (PEM) and the server certificate + key it signed for 127.0.0.1.
fn certificates() -> (String, rcgen::Certificate, KeyPair) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![SanType::IpAddress([127, 0, 0, 1].into())];
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    (ca.pem(), cert, key)
}

/// Terminates TLS on a free port and forwards to `backend`; returns the port.
async fn tls_front(cert: rcgen::Certificate, key: KeyPair, backend: std::net::SocketAddr) -> u16 {
    let config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if let Ok(mut plain) = TcpStream::connect(backend).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                }
            });
        }
    });
    port
}

fn replica(port: u16, ca_file: &std::path::Path) -> RedisIndex {
    let cfg = RedisConfig {
        // Every lookup reads Redis: these tests are about what Redis holds.
        lookups: crate::config::RedisLookups::Redis,
        url: format!("rediss://127.0.0.1:{port}"),
        tls_ca_file: Some(ca_file.display().to_string()),
        lookup_budget_ms: 1_000,
        // The first write dials and shakes hands; on a loaded CI machine that can take longer
        // than the 50 ms default, and a dropped write is not what this test is about.
        write_budget_ms: 5_000,
        ..RedisConfig::default()
    };
    let tuning = Tuning {
        record_ttl_ms: 60_000,
        default_capacity: 100,
        gpu_weight: 1.0,
        cpu_weight: 0.8,
    };
    let local = Local::Memory(MemoryIndex::new(60_000, 100));
    RedisIndex::new(&cfg, local, tuning, RedisMetrics::unregistered()).unwrap()
}

#[tokio::test]
async fn rediss_reaches_a_server_its_ca_signed_and_refuses_one_it_did_not() {
    let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
    let server = RedisProc::start(&bin).unwrap();
    let (ca, cert, key) = certificates();
    let port = tls_front(cert, key, server.addr).await;
    let dir = tempfile::tempdir().unwrap();
    let (ours, theirs) = (dir.path().join("ca.pem"), dir.path().join("other-ca.pem"));
    std::fs::write(&ours, ca).unwrap();
    std::fs::write(&theirs, certificates().0).unwrap();

    let (p, keys) = (pods(1), doc_keys(1, 3, 4));
    let writer = replica(port, &ours);
    writer.record(&p[0], &keys, 0).await.unwrap();
    writer.flush().await.unwrap();
    let reader = replica(port, &ours);
    assert_eq!(reader.lookup(&keys, &p, 1).await.unwrap(), vec![3.0]);
    assert_eq!(reader.metrics().lookups(RedisSource::Redis), 1, "over TLS");

    let stranger = replica(port, &theirs);
    assert_eq!(
        stranger.lookup(&keys, &p, 1).await.unwrap(),
        vec![0.0],
        "a server the CA did not sign is never believed"
    );
    assert_eq!(
        stranger
            .metrics()
            .fallbacks(RedisFallbackReason::Connection)
            + stranger.metrics().fallbacks(RedisFallbackReason::Protocol)
            + stranger.metrics().fallbacks(RedisFallbackReason::Refused),
        1
    );
}
