//! Istio's native InferencePool path against kv-router, without a cluster: the Envoy configuration
//! istiod generates for `deploy/components/gateway-api/inferencepool.yaml` (a gateway-wide
//! ext_proc filter and, on the HTTPRoute's route, an `ExtProcPerRoute` override whose gRPC service
//! is only `envoy_grpc.cluster_name: outbound|9002||kv-router.llm.svc.cluster.local`; the pool's
//! cluster with `override_host`), which the component's EnvoyFilters leave as generated, run live
//! with Envoy 1.36 (Istio 1.28's proxy) and Envoy 1.40, kv-router and simulated pods:
//! - FULL_DUPLEX_STREAMED (what istiod generates) and BUFFERED (the same gRPC service behind a
//!   buffered override, as the istio-envoyfilter path pointed at Istio's own picker cluster);
//! - every request is served by the pod kv-router picked, and kv-router decided each of them;
//! - over TLS to the picker (istiod's cluster for a DestinationRule `tls: SIMPLE`), with and
//!   without the DestinationRule's `sni`.
//!
//! Envoy names the `:authority` of an `envoy_grpc` service after its cluster unless `authority`
//! is set; `|` is not a legal authority character for the HTTP/2 stack kv-router serves with, so
//! kv-router rewrites it before that stack sees it (`server::authority`, counted in
//! `kv_router_grpc_authority_rewritten_total`), in plaintext and under its own TLS.

use crate::common;
use crate::istio_render::envoy::{decisions_by_pod, min_envoy, sum_samples, validate, Envoy};
use crate::istio_render::{docs, y, MIN_ENVOY};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::deploy::{free_port, local_router_config, RouterProc, SimPod};
use serde_yaml::Value;

const COMPONENT: &str = "deploy/components/gateway-api";
const EXT_PROC: &str = "envoy.filters.http.ext_proc";
const PER_ROUTE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute";
/// The Gateway's HTTP listener port (istiod's route configuration `http.80` on a Gateway API pod).
const GATEWAY_PORT: u64 = 80;

/// What istiod reads from the component's InferencePool, HTTPRoute and Gateway.
struct Pool {
    namespace: String,
    gateway: String,
    /// istiod's Envoy route name for the HTTPRoute's first rule: `<ns>.<name>.<rule index>`.
    route_name: String,
    picker_fqdn: String,
    picker_port: u64,
    fail_open: bool,
    target_port: u64,
}

impl Pool {
    fn read() -> Self {
        let all = docs(&format!("{COMPONENT}/inferencepool.yaml"));
        let find = |kind: &str| {
            all.iter()
                .find(|d| d["kind"] == kind)
                .unwrap_or_else(|| panic!("inferencepool.yaml has no {kind}"))
                .clone()
        };
        let (pool, route, gw) = (find("InferencePool"), find("HTTPRoute"), find("Gateway"));
        let namespace = pool["metadata"]["namespace"].as_str().unwrap().to_string();
        let epp = &pool["spec"]["endpointPickerRef"];
        let rules = route["spec"]["rules"].as_sequence().unwrap();
        assert_eq!(rules.len(), 1, "one rule: the patch names its route");
        assert_eq!(
            rules[0]["backendRefs"][0]["name"], pool["metadata"]["name"],
            "the HTTPRoute's rule goes to the pool"
        );
        assert_eq!(
            gw["spec"]["listeners"][0]["port"].as_u64(),
            Some(GATEWAY_PORT)
        );
        Self {
            route_name: format!(
                "{}.{}.0",
                route["metadata"]["namespace"].as_str().unwrap(),
                route["metadata"]["name"].as_str().unwrap()
            ),
            gateway: gw["metadata"]["name"].as_str().unwrap().to_string(),
            picker_fqdn: format!(
                "{}.{namespace}.svc.cluster.local",
                epp["name"].as_str().unwrap()
            ),
            picker_port: epp["port"]["number"].as_u64().unwrap(),
            fail_open: epp["failureMode"] == "FailOpen",
            target_port: pool["spec"]["targetPorts"][0]["number"].as_u64().unwrap(),
            namespace,
        }
    }

    /// istiod's cluster for the pool's shadow Service (`<pool>-ip-<hash>`, one endpoint per pod).
    fn pool_cluster(&self) -> String {
        format!(
            "outbound|{}||vllm-pool-ip-0.{}.svc.cluster.local",
            self.target_port, self.namespace
        )
    }

    fn picker_cluster(&self) -> String {
        format!("outbound|{}||{}", self.picker_port, self.picker_fqdn)
    }
}

fn processing_mode(full_duplex: bool) -> Value {
    if full_duplex {
        y("{request_header_mode: SEND, request_body_mode: FULL_DUPLEX_STREAMED, request_trailer_mode: SEND, \
            response_header_mode: SEND, response_body_mode: FULL_DUPLEX_STREAMED, response_trailer_mode: SEND}")
    } else {
        y("{request_header_mode: SEND, request_body_mode: BUFFERED, response_header_mode: SKIP, response_body_mode: NONE}")
    }
}

/// The per-route `ExtProcPerRoute` istiod puts on a route to an InferencePool.
fn istiod_override(pool: &Pool) -> Value {
    let mut v = y(&format!(
        "{{\"@type\": {PER_ROUTE}, overrides: {{grpc_service: {{envoy_grpc: {{cluster_name: \"{}\"}}}}, \
           failure_mode_allow: {}}}}}",
        pool.picker_cluster(),
        pool.fail_open
    ));
    v["overrides"]["processing_mode"] = processing_mode(true);
    v
}

/// The gateway-wide ext_proc filter: istiod's InferencePool filter (FULL_DUPLEX), or for the
/// buffered variant the istio-envoyfilter path's filter (disabled, enabled per route).
fn listener_filter(pool: &Pool, full_duplex: bool) -> Value {
    let mut f = if full_duplex {
        y(&format!(
            "{{name: {EXT_PROC}, typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor, \
               grpc_service: {{envoy_grpc: {{cluster_name: \"{}\"}}, timeout: 10s}}, failure_mode_allow: {}, message_timeout: 1000s, \
               metadata_options: {{receiving_namespaces: {{untyped: [envoy.lb]}}, forwarding_namespaces: {{untyped: [envoy.lb]}}}}}}}}",
            pool.picker_cluster(),
            pool.fail_open
        ))
    } else {
        y(&format!(
            "{{name: {EXT_PROC}, disabled: true, typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor, \
               grpc_service: {{envoy_grpc: {{cluster_name: \"{}\"}}}}, failure_mode_allow: true, message_timeout: 2s, \
               metadata_options: {{receiving_namespaces: {{untyped: [envoy.lb]}}}}}}}}",
            pool.picker_cluster()
        ))
    };
    f["typed_config"]["processing_mode"] = processing_mode(full_duplex);
    f
}

/// The EnvoyFilters among the component's resources.
fn component_envoyfilters() -> Vec<Value> {
    let k = &docs(&format!("{COMPONENT}/kustomization.yaml"))[0];
    k["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|r| docs(&format!("{COMPONENT}/{}", r.as_str().unwrap())))
        .filter(|d| d["kind"] == "EnvoyFilter")
        .collect()
}

/// The component's EnvoyFilters apply to the gateway and only put the header strip first in its
/// filter chain (router_headers checks what it removes): istiod's route and its ext_proc
/// override reach Envoy as istiod generates them.
fn assert_routes_untouched(pool: &Pool, filters: &[Value]) {
    for f in filters {
        let name = f["metadata"]["name"].as_str().unwrap_or("?");
        assert_eq!(
            f["metadata"]["namespace"].as_str(),
            Some(pool.namespace.as_str()),
            "{name}: an EnvoyFilter applies to the gateway only from the gateway's namespace"
        );
        let labels = f["spec"]["workloadSelector"]["labels"]
            .as_mapping()
            .unwrap();
        assert_eq!(
            labels.get("gateway.networking.k8s.io/gateway-name"),
            Some(&Value::from(pool.gateway.clone())),
            "{name}: istiod labels the Gateway's pods gateway.networking.k8s.io/gateway-name"
        );
        for cp in f["spec"]["configPatches"].as_sequence().unwrap() {
            assert!(
                cp["applyTo"] == "HTTP_FILTER"
                    && cp["patch"]["operation"] == "INSERT_FIRST"
                    && cp["patch"]["value"]["name"] == "envoy.filters.http.header_mutation",
                "{name}: only the header strip is expected; this test runs istiod's routes as \
                 generated: {cp:?}"
            );
        }
    }
}

/// A static bootstrap equivalent to what istiod sends the gateway, with `route_override` on the
/// pool's route and the picker's cluster at `picker`.
fn bootstrap(
    pool: &Pool,
    listen: u16,
    admin: u16,
    picker: SocketAddr,
    pods: &[SocketAddr],
    route: &Value,
    full_duplex: bool,
) -> Value {
    let pool_cluster = pool.pool_cluster();
    let mut b = y(&format!(
        r#"
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:
  - name: 0.0.0.0_{GATEWAY_PORT}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: outbound_0.0.0.0_{GATEWAY_PORT}
          stream_idle_timeout: 0s
          route_config:
            name: http.{GATEWAY_PORT}
            virtual_hosts: [{{ name: "*:{GATEWAY_PORT}", domains: ["*"] }}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
  clusters:
  - name: "{pool_cluster}"
    type: STATIC
    connect_timeout: 2s
    lb_policy: CLUSTER_PROVIDED
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {{ key: envoy.lb, path: [ {{ key: x-gateway-destination-endpoint }} ] }}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config: {{ "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin }}
  - name: "{picker_cluster}"
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: "{picker_cluster}"
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {picker_port} }} }} }}
"#,
        picker_cluster = pool.picker_cluster(),
        picker_port = picker.port(),
    ));
    let hcm = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    hcm["route_config"]["virtual_hosts"][0]["routes"] = Value::Sequence(vec![route.clone()]);
    let filters = hcm["http_filters"].as_sequence_mut().unwrap();
    filters.insert(0, listener_filter(pool, full_duplex));
    let eps: Vec<Value> = pods
        .iter()
        .map(|p| {
            y(&format!(
                "{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}",
                p.ip(),
                p.port()
            ))
        })
        .collect();
    b["static_resources"]["clusters"][0]["load_assignment"] = y(&format!(
        "{{cluster_name: \"{pool_cluster}\", endpoints: [{{lb_endpoints: []}}]}}"
    ));
    b["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"] =
        Value::Sequence(eps);
    b
}

/// The route istiod builds for the HTTPRoute's rule, carrying `per_route` for ext_proc.
fn istiod_route(pool: &Pool, per_route: Value) -> Value {
    let mut r = y(&format!(
        "{{name: {}, match: {{prefix: /}}, route: {{cluster: \"{}\", timeout: 3600s}}}}",
        pool.route_name,
        pool.pool_cluster()
    ));
    let mut tpfc = serde_yaml::Mapping::new();
    tpfc.insert(Value::from(EXT_PROC), per_route);
    r["typed_per_filter_config"] = Value::Mapping(tpfc);
    if !per_route_is_full_duplex(&r) {
        r["request_body_buffer_limit"] = Value::from(67_108_864u64);
    }
    r
}

fn per_route_is_full_duplex(route: &Value) -> bool {
    route["typed_per_filter_config"][EXT_PROC]["overrides"]["processing_mode"]["request_body_mode"]
        == "FULL_DUPLEX_STREAMED"
}

/// Validates `cfg` (deprecated fields fail too), then runs it until LIVE.
async fn start_envoy(bin: &Path, what: &str, cfg: impl Fn(u16, u16) -> Value) -> Envoy {
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port().unwrap(), free_port().unwrap());
    let file = dir.path().join("gateway.yaml");
    std::fs::write(&file, serde_yaml::to_string(&cfg(listen, admin)).unwrap()).unwrap();
    validate(bin, &file, what);
    Envoy::run(
        bin,
        &file,
        &["--disable-hot-restart"],
        (listen, admin),
        dir,
        what,
    )
    .await
}

/// What a round of requests through one gateway did.
struct Round {
    /// kv-router's new ext_proc streams.
    streams: f64,
    /// kv-router's new decisions per pod.
    decided: BTreeMap<String, u64>,
    /// `pod → requests` for the requests that got a 200, and the statuses of those that did not.
    served: BTreeMap<String, u64>,
    failed: Vec<String>,
}

const REQUESTS: u64 = 6;

async fn round(router: &RouterProc, envoy: &Envoy, seed: u64) -> Round {
    let metrics = || async {
        reqwest::get(format!("{}/metrics", router.admin_url()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let before = metrics().await;
    let client = reqwest::Client::new();
    let base = format!("http://{}", envoy.listen);
    let (mut served, mut failed) = (BTreeMap::new(), Vec::new());
    for i in 0..REQUESTS {
        let prompt = common::text(seed * 100 + i, 3000);
        let o = common::post_to(
            &client,
            &base,
            "/v1/completions",
            &common::completion(&prompt, 4),
            &[],
        )
        .await;
        match o.pod().filter(|_| o.ok()) {
            Some(p) => *served.entry(p.to_string()).or_default() += 1,
            None => failed.push(format!("status {:?} error {:?}", o.status, o.error)),
        }
    }
    let after = metrics().await;
    let streams = "kv_router_extproc_streams_total";
    let (d0, d1) = (decisions_by_pod(&before), decisions_by_pod(&after));
    let decided = d1
        .iter()
        .map(|(p, n)| (p.clone(), n - d0.get(p).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect();
    Round {
        streams: sum_samples(&after, streams) - sum_samples(&before, streams),
        decided,
        served,
        failed,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_inferencepool_reaches_kv_router() {
    let pool = Pool::read();
    assert_routes_untouched(&pool, &component_envoyfilters());
    let generated = istiod_route(&pool, istiod_override(&pool));
    // The buffered variant: the same gRPC service behind a BUFFERED override.
    let buffered = |route: &Value| {
        let mut per_route = route["typed_per_filter_config"][EXT_PROC].clone();
        per_route["overrides"]["processing_mode"] = processing_mode(false);
        istiod_route(&pool, per_route)
    };

    let bins = common::bins();
    let args: Vec<String> = common::FAST_SIM.iter().map(|s| s.to_string()).collect();
    let sims: Vec<SimPod> = (0..3)
        .map(|_| SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim"))
        .collect();
    let pods: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let cfg = local_router_config(&pods).unwrap();
    let router = RouterProc::spawn(&bins.kv_router, &cfg)
        .await
        .expect("start kv-router");
    router
        .wait_pods_ready(pods.len(), Duration::from_secs(10))
        .await
        .unwrap();

    let envoys = [
        (min_envoy(), format!("Envoy {MIN_ENVOY}")),
        (common::envoy_bin(), "Envoy".to_string()),
    ];
    let mut seed = 0;
    let rewritten = "kv_router_grpc_authority_rewritten_total";
    for (bin, version) in &envoys {
        // As istiod generates it: kv-router rewrites the `outbound|…` authority itself.
        for (mode, route) in [
            ("FULL_DUPLEX_STREAMED", generated.clone()),
            ("BUFFERED", buffered(&generated)),
        ] {
            seed += 1;
            let what = format!("{version}, {mode}, istiod's config as generated");
            let full_duplex = per_route_is_full_duplex(&route);
            let envoy = start_envoy(bin, &what, |listen, admin| {
                bootstrap(
                    &pool,
                    listen,
                    admin,
                    router.grpc,
                    &pods,
                    &route,
                    full_duplex,
                )
            })
            .await;
            let before = router_metrics(&router).await;
            let r = round(&router, &envoy, seed).await;
            let fixed = sum_samples(&router_metrics(&router).await, rewritten)
                - sum_samples(&before, rewritten);
            let diag = format!(
                "\n--- route ---\n{}--- envoy ---\n{}\n--- kv-router ---\n{}",
                serde_yaml::to_string(&route).unwrap(),
                envoy.stderr(),
                router.stderr_tail(20)
            );
            assert!(
                r.streams >= REQUESTS as f64,
                "{what}: kv-router saw {} ext_proc streams for {REQUESTS} requests \
                 (an `:authority: {}` it cannot accept?){diag}",
                r.streams,
                pool.picker_cluster()
            );
            assert!(
                r.failed.is_empty(),
                "{what}: failed requests {:?}{diag}",
                r.failed
            );
            assert_eq!(
                r.decided, r.served,
                "{what}: every request must be served by the pod kv-router picked{diag}"
            );
            // Each ext_proc stream is one gRPC request with Istio's authority.
            assert_eq!(fixed, r.streams, "{what}: {rewritten}{diag}");
        }
    }
}

async fn router_metrics(router: &RouterProc) -> String {
    reqwest::get(format!("{}/metrics", router.admin_url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The picker's cluster as istiod builds it for a DestinationRule `tls: SIMPLE` trusting `ca`:
/// with `sni` named, that SNI; without, Envoy's `auto_sni` and `auto_san_validation`, which take
/// the name from the request's `:authority`.
fn picker_over_tls(b: &mut Value, ca: &Path, sni: Option<&str>) {
    let c = &mut b["static_resources"]["clusters"][1];
    let mut tls = y(&format!(
        "{{name: envoy.transport_sockets.tls, typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext, \
           common_tls_context: {{alpn_protocols: [h2], validation_context: {{trusted_ca: {{filename: \"{}\"}}}}}}}}}}",
        ca.display()
    ));
    let opts = &mut c["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    match sni {
        Some(name) => tls["typed_config"]["sni"] = Value::from(name),
        None => {
            opts["upstream_http_protocol_options"] =
                y("{auto_sni: true, auto_san_validation: true}")
        }
    }
    c["transport_socket"] = tls;
}

/// TLS to the picker (kv-router's `server.tls`, a DestinationRule `tls: SIMPLE`): without the
/// DestinationRule's `sni`, Istio's `auto_sni` takes the SNI (and the name the certificate must
/// carry) from the `:authority`, so istiod's `outbound|9002||…` fails the handshake itself; with
/// the DestinationRule's `sni`, kv-router is reached and its picks honoured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_inferencepool_over_tls_reaches_kv_router_with_the_destination_rules_sni() {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};

    let pool = Pool::read();
    let generated = istiod_route(&pool, istiod_override(&pool));

    let dir = tempfile::tempdir().unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Distinct subjects: BoringSSL takes a leaf named like its issuer for a self-signed one.
    params
        .distinguished_name
        .push(DnType::CommonName, "picker CA");
    let ca = params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![pool.picker_fqdn.clone()]).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, pool.picker_fqdn.clone());
    params
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    let leaf = params.signed_by(&key, &ca, &ca_key).unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let ca_file = write("ca.pem", &ca.pem());

    let bins = common::bins();
    let args: Vec<String> = common::FAST_SIM.iter().map(|s| s.to_string()).collect();
    let sims: Vec<SimPod> = (0..2)
        .map(|_| SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim"))
        .collect();
    let pods: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let mut cfg = local_router_config(&pods).unwrap();
    cfg.server.tls.cert_file = Some(write("router.pem", &leaf.pem()).display().to_string());
    cfg.server.tls.key_file = Some(
        write("router-key.pem", &key.serialize_pem())
            .display()
            .to_string(),
    );
    let router = RouterProc::spawn(&bins.kv_router, &cfg)
        .await
        .expect("start kv-router");
    router
        .wait_pods_ready(pods.len(), Duration::from_secs(10))
        .await
        .unwrap();

    let envoys = [
        (min_envoy(), format!("Envoy {MIN_ENVOY}")),
        (common::envoy_bin(), "Envoy".to_string()),
    ];
    let sni = pool.picker_fqdn.clone();
    let mut seed = 100;
    for (bin, version) in &envoys {
        for (name, route, sni, works) in [
            // kv-router's TLS refuses the ClientHello (illegal_parameter): SNI `outbound|…`.
            ("no sni", &generated, None, false),
            // The DestinationRule's sni: the handshake passes, the authority is rewritten under it.
            ("sni", &generated, Some(sni.as_str()), true),
        ] {
            seed += 1;
            let what = format!("{version}, TLS to the picker, {name}");
            let envoy = start_envoy(bin, &what, |listen, admin| {
                let mut b = bootstrap(&pool, listen, admin, router.grpc, &pods, route, true);
                picker_over_tls(&mut b, &ca_file, sni);
                b
            })
            .await;
            let r = round(&router, &envoy, seed).await;
            let diag = format!(
                "\n--- envoy ---\n{}\n--- kv-router ---\n{}",
                envoy.stderr(),
                router.stderr_tail(20)
            );
            if works {
                assert!(
                    r.failed.is_empty() && r.streams >= REQUESTS as f64,
                    "{what}: {} streams, failed {:?}{diag}",
                    r.streams,
                    r.failed
                );
                assert_eq!(r.decided, r.served, "{what}: picks not honoured{diag}");
            } else {
                assert!(
                    r.streams == 0.0 && r.decided.is_empty(),
                    "{what}: kv-router was reached: {} streams{diag}",
                    r.streams
                );
            }
        }
    }
}
