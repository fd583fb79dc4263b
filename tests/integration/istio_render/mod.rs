//! The Envoy configuration an Istio ingress gateway holds for `gateway.yaml`, shaped as istiod
//! renders it (listener `0.0.0.0_8080` with the gateway's HTTP filter chain, route configuration
//! `http.8080` over RDS, the pool as an EDS cluster `outbound|8000||…`), then patched by
//! `envoyfilter.yaml` with Istio's match semantics (context, listener sub-filter, route
//! configuration port + virtual host + route name, cluster service + port). Patching follows the
//! file, so the manifests and this proof cannot drift.

pub mod envoy;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;

pub use crate::common::repo_root as root;
use serde_yaml::Value;

pub const FILTER: &str = "deploy/components/istio-envoyfilter/envoyfilter.yaml";
pub const ROUTES: &str = "deploy/components/istio-envoyfilter/gateway.yaml";
/// The default `istio-ingressgateway` Service maps port 80 to the gateway pod's 8080, so istiod
/// names the listener and route configuration after 8080 and EnvoyFilter port matches accept 80.
pub const SERVICE_PORT: u64 = 80;
pub const POD_PORT: u64 = 8080;
/// The oldest Istio the component supports and the Envoy its proxy is built on.
pub const MIN_ISTIO: &str = "1.28";
pub const MIN_ENVOY: &str = "1.36";

pub fn docs(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(root().join(path)).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

pub fn y(s: &str) -> Value {
    serde_yaml::from_str(s).unwrap()
}

/// Istio's outbound cluster name for a service port.
pub fn cluster_name(host: &str, port: u64) -> String {
    format!("outbound|{port}||{host}")
}

/// Proto-style merge as Istio's MERGE does it: messages/maps merge field by field, repeated
/// fields append, scalars are replaced.
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Mapping(b), Value::Mapping(p)) => {
            for (k, v) in p {
                match b.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Sequence(b), Value::Sequence(p)) => b.extend(p.iter().cloned()),
        (slot, v) => *slot = v.clone(),
    }
}

/// The gateway server the VirtualService binds to: its port and virtual host names.
fn gateway_server() -> (u64, Vec<String>) {
    let gw = docs(ROUTES)
        .into_iter()
        .find(|d| d["kind"] == "Gateway")
        .expect("gateway.yaml has a Gateway");
    let servers = gw["spec"]["servers"].as_sequence().unwrap();
    assert_eq!(
        servers.len(),
        1,
        "one server: the route patch names its port"
    );
    let s = &servers[0];
    assert_eq!(s["port"]["protocol"], "HTTP");
    let port = s["port"]["number"].as_u64().unwrap();
    let hosts = s["hosts"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().rsplit('/').next().unwrap().to_string())
        .collect();
    (port, hosts)
}

/// The routes istiod builds from the VirtualService: one Envoy route per http[] entry (single
/// match), named after it, to `outbound|port||host`, with Istio's route defaults.
fn routes_from_virtual_service() -> (Vec<Value>, BTreeSet<String>) {
    let vs = docs(ROUTES)
        .into_iter()
        .find(|d| d["kind"] == "VirtualService")
        .expect("gateway.yaml has a VirtualService");
    let mut routes = Vec::new();
    let mut clusters = BTreeSet::new();
    for http in vs["spec"]["http"].as_sequence().unwrap() {
        let name = http["name"].as_str().expect("every http route is named");
        let matches = http["match"].as_sequence().unwrap();
        assert_eq!(
            matches.len(),
            1,
            "{name}: one match per route keeps names 1:1"
        );
        let uri = &matches[0]["uri"];
        let m = if let Some(p) = uri["prefix"].as_str() {
            format!("{{prefix: \"{p}\", case_sensitive: true}}")
        } else if let Some(p) = uri["exact"].as_str() {
            format!("{{path: \"{p}\", case_sensitive: true}}")
        } else {
            panic!("{name}: only uri prefix/exact matches are mirrored");
        };
        let dests = http["route"].as_sequence().unwrap();
        assert_eq!(dests.len(), 1, "{name}: one destination");
        let d = &dests[0]["destination"];
        let cluster = cluster_name(
            d["host"].as_str().unwrap(),
            d["port"]["number"].as_u64().unwrap(),
        );
        let timeout = http["timeout"].as_str().unwrap_or("0s");
        routes.push(y(&format!(
            "{{name: {name}, match: {m}, \
              decorator: {{operation: \"{cluster}\"}}, \
              route: {{cluster: \"{cluster}\", timeout: {timeout}, \
                max_stream_duration: {{max_stream_duration: 0s, grpc_timeout_header_max: 0s}}, \
                retry_policy: {{retry_on: \"connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes\", \
                  num_retries: 2, retry_host_predicate: [{{name: envoy.retry_host_predicates.previous_hosts, \
                  typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate}}}}], \
                  host_selection_retry_max_attempts: 5}}}}}}"
        )));
        clusters.insert(cluster);
    }
    (routes, clusters)
}

/// What istiod sends the gateway before any EnvoyFilter, and what the patches make of it.
pub struct Gateway {
    /// LDS: the gateway's HTTP listener (its HCM takes routes over RDS).
    pub listener: Value,
    /// RDS: `http.8080`.
    pub route_config: Value,
    /// CDS: the pools' EDS clusters (+ the picker cluster once patched).
    pub clusters: Vec<Value>,
    /// EDS: one ClusterLoadAssignment per EDS cluster (one endpoint per Ready pod).
    pub assignments: Vec<Value>,
}

impl Gateway {
    /// istiod's rendering for `gateway.yaml`, with the pool's endpoints at `pods`.
    pub fn render(listen: u16, pods: &[SocketAddr]) -> Self {
        let (server_port, hosts) = gateway_server();
        let (routes, pool_clusters) = routes_from_virtual_service();
        let route_name = format!("http.{POD_PORT}");
        // Istio's gateway HTTP chain, less the Istio-proxy-only `istio.alpn` and `istio.stats`.
        // The 32 KiB connection buffer is Istio's edge setting: BUFFERED bodies must get through
        // by the route's own limit.
        let listener = y(&format!(
            r#"
name: 0.0.0.0_{POD_PORT}
address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
per_connection_buffer_limit_bytes: 32768
filter_chains:
- filters:
  - name: envoy.filters.network.http_connection_manager
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
      stat_prefix: outbound_0.0.0.0_{POD_PORT}
      rds:
        route_config_name: {route_name}
        config_source: {{ path_config_source: {{ path: RDS_PATH }}, resource_api_version: V3 }}
      use_remote_address: true
      normalize_path: true
      merge_slashes: true
      path_with_escaped_slashes_action: KEEP_UNCHANGED
      stream_idle_timeout: 0s
      server_name: istio-envoy
      forward_client_cert_details: SANITIZE_SET
      set_current_client_cert_details: {{ subject: true, dns: true, uri: true }}
      upgrade_configs: [{{ upgrade_type: websocket }}]
      http_filters:
      - name: envoy.filters.http.grpc_stats
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig
          emit_filter_state: true
          stats_for_all_methods: false
      - name: envoy.filters.http.fault
        typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault }}
      - name: envoy.filters.http.cors
        typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors }}
      - name: envoy.filters.http.router
        typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
"#
        ));
        let vhosts: Vec<Value> = hosts
            .iter()
            .map(|h| {
                let mut v = y(&format!(
                    "{{name: \"{h}:{server_port}\", domains: [\"{h}\"], include_request_attempt_count: true}}"
                ));
                v["routes"] = Value::Sequence(routes.clone());
                v
            })
            .collect();
        let mut route_config = y(&format!(
            "{{name: {route_name}, validate_clusters: false, ignore_port_in_host_matching: true, \
              max_direct_response_body_size_bytes: 1048576}}"
        ));
        route_config["virtual_hosts"] = Value::Sequence(vhosts);
        let endpoints: Vec<Value> = pods
            .iter()
            .map(|p| {
                y(&format!(
                    "{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}, \
                      health_status: HEALTHY, load_balancing_weight: 1}}",
                    p.ip(),
                    p.port()
                ))
            })
            .collect();
        let mut clusters = Vec::new();
        let mut assignments = Vec::new();
        for name in &pool_clusters {
            // istiod's EDS cluster for a service port on a gateway (Istio's default lb_policy
            // LEAST_REQUEST; HTTP/1 or 2 as the client spoke).
            clusters.push(y(&format!(
                r#"
name: "{name}"
type: EDS
eds_cluster_config:
  service_name: "{name}"
  eds_config: {{ path_config_source: {{ path: EDS_PATH }}, resource_api_version: V3 }}
connect_timeout: 10s
lb_policy: LEAST_REQUEST
circuit_breakers:
  thresholds:
  - {{ max_connections: 4294967295, max_pending_requests: 4294967295, max_requests: 4294967295, max_retries: 4294967295 }}
common_lb_config: {{}}
typed_extension_protocol_options:
  envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
    "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
    common_http_protocol_options: {{ idle_timeout: 3600s }}
    use_downstream_protocol_config: {{ http_protocol_options: {{}}, http2_protocol_options: {{}} }}
metadata: {{ filter_metadata: {{ istio: {{ services: [ {{ host: vllm.llm.svc.cluster.local, name: vllm, namespace: llm }} ] }} }} }}
"#
            )));
            let mut cla = y(&format!(
                "{{\"@type\": type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment, \
                  cluster_name: \"{name}\", endpoints: [{{locality: {{}}, lb_endpoints: []}}]}}"
            ));
            cla["endpoints"][0]["lb_endpoints"] = Value::Sequence(endpoints.clone());
            assignments.push(cla);
        }
        Self {
            listener,
            route_config,
            clusters,
            assignments,
        }
    }

    fn hcm(&mut self) -> &mut Value {
        &mut self.listener["filter_chains"][0]["filters"][0]["typed_config"]
    }

    /// Applies every patch of `envoyfilter.yaml`, matching as istiod does; the picker cluster
    /// points at `picker`.
    pub fn apply_envoyfilter(&mut self, picker: SocketAddr) {
        let filter = docs(FILTER)
            .into_iter()
            .find(|d| d["kind"] == "EnvoyFilter")
            .unwrap();
        assert_eq!(
            filter["spec"]["workloadSelector"]["labels"]["istio"], "ingressgateway",
            "the EnvoyFilter targets the ingress gateway"
        );
        let (server_port, hosts) = gateway_server();
        let mut applied = BTreeSet::new();
        for (i, p) in filter["spec"]["configPatches"]
            .as_sequence()
            .unwrap()
            .iter()
            .enumerate()
        {
            assert_eq!(p["match"]["context"], "GATEWAY", "patch {i}");
            let value = &p["patch"]["value"];
            let apply_to = p["applyTo"].as_str().unwrap();
            let op = p["patch"]["operation"].as_str().unwrap();
            match (apply_to, op) {
                ("CLUSTER", "ADD") => {
                    let mut c = value.clone();
                    // The picker's in-cluster address becomes the local kv-router.
                    let sa = &mut c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
                        ["endpoint"]["address"]["socket_address"];
                    assert_eq!(sa["address"], "kv-router.llm.svc.cluster.local");
                    assert_eq!(sa["port_value"].as_u64(), Some(9002));
                    sa["address"] = picker.ip().to_string().into();
                    sa["port_value"] = u64::from(picker.port()).into();
                    self.clusters.push(c);
                }
                ("HTTP_FILTER", "INSERT_BEFORE") => {
                    let l = &p["match"]["listener"];
                    if let Some(port) = l["portNumber"].as_u64() {
                        assert!(
                            [POD_PORT, SERVICE_PORT].contains(&port),
                            "patch {i}: port {port}"
                        );
                    }
                    let sub = &l["filterChain"]["filter"]["subFilter"]["name"];
                    assert_eq!(sub, "envoy.filters.http.router");
                    let filters = self.hcm()["http_filters"].as_sequence_mut().unwrap();
                    let at = filters
                        .iter()
                        .position(|f| f["name"] == *sub)
                        .expect("router filter");
                    filters.insert(at, value.clone());
                }
                ("HTTP_ROUTE", "MERGE") => {
                    let rc = &p["match"]["routeConfiguration"];
                    // Istio: a gateway route configuration matches the Service port mapped to
                    // the pod port it is named after; an unscoped patch hits every port.
                    assert_eq!(
                        rc["portNumber"].as_u64(),
                        Some(SERVICE_PORT),
                        "patch {i}: scope the route patch to the gateway server's port"
                    );
                    assert_eq!(server_port, SERVICE_PORT, "gateway.yaml's server port");
                    let vhost = rc["vhost"]["name"]
                        .as_str()
                        .unwrap_or_else(|| panic!("patch {i}: scope the route patch to a vhost"));
                    let want: Vec<String> =
                        hosts.iter().map(|h| format!("{h}:{server_port}")).collect();
                    assert!(
                        want.iter().any(|w| w == vhost),
                        "patch {i}: vhost {vhost} is none of the gateway's {want:?}"
                    );
                    let name = rc["vhost"]["route"]["name"].as_str().unwrap();
                    let mut hits = 0;
                    for v in self.route_config["virtual_hosts"]
                        .as_sequence_mut()
                        .unwrap()
                    {
                        if v["name"] != vhost {
                            continue;
                        }
                        for r in v["routes"].as_sequence_mut().unwrap() {
                            if r["name"] == name {
                                merge(r, value);
                                hits += 1;
                            }
                        }
                    }
                    assert_eq!(hits, 1, "HTTP_ROUTE patch matches route {name} once");
                }
                ("CLUSTER", "MERGE") => {
                    let c = &p["match"]["cluster"];
                    let name = cluster_name(
                        c["service"].as_str().unwrap(),
                        c["portNumber"].as_u64().unwrap(),
                    );
                    let cl = self
                        .clusters
                        .iter_mut()
                        .find(|x| x["name"].as_str() == Some(name.as_str()))
                        .unwrap_or_else(|| {
                            panic!("CLUSTER MERGE names {name}, which no VirtualService route uses")
                        });
                    merge(cl, value);
                }
                other => panic!("patch {i}: {other:?} is not mirrored by this test"),
            }
            applied.insert(format!("{apply_to} {op}"));
        }
        assert_eq!(
            applied,
            [
                "CLUSTER ADD",
                "CLUSTER MERGE",
                "HTTP_FILTER INSERT_BEFORE",
                "HTTP_ROUTE MERGE"
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            "the four patches a steering EnvoyFilter needs"
        );
    }

    /// The same configuration with routes and endpoints inlined, for `envoy --mode validate`
    /// (which does not read xDS files).
    pub fn static_bootstrap(&self, admin: u16) -> Value {
        let mut listener = self.listener.clone();
        let hcm = &mut listener["filter_chains"][0]["filters"][0]["typed_config"];
        hcm.as_mapping_mut().unwrap().remove("rds");
        hcm["route_config"] = self.route_config.clone();
        let clusters: Vec<Value> = self
            .clusters
            .iter()
            .map(|c| {
                let mut c = c.clone();
                if c["type"] == "EDS" {
                    let m = c.as_mapping_mut().unwrap();
                    m.remove("eds_cluster_config");
                    c["type"] = "STATIC".into();
                    let name = c["name"].clone();
                    let mut cla = self
                        .assignments
                        .iter()
                        .find(|a| a["cluster_name"] == name)
                        .unwrap()
                        .clone();
                    cla.as_mapping_mut().unwrap().remove("@type");
                    c["load_assignment"] = cla;
                }
                c
            })
            .collect();
        self.bootstrap(admin, listener, clusters)
    }

    /// The gateway as it runs: listener and clusters static, routes over RDS and endpoints over
    /// EDS from files in `dir` (the test is the control plane).
    pub fn xds_bootstrap(&self, admin: u16, dir: &Path) -> Value {
        let rds = dir.join("rds.yaml");
        let eds = dir.join("eds.yaml");
        let mut rc = self.route_config.clone();
        rc.as_mapping_mut().unwrap().insert(
            "@type".into(),
            "type.googleapis.com/envoy.config.route.v3.RouteConfiguration".into(),
        );
        write_discovery(&rds, vec![rc]);
        write_discovery(&eds, self.assignments.clone());
        let text = serde_yaml::to_string(&self.listener)
            .unwrap()
            .replace("RDS_PATH", &rds.display().to_string());
        let listener: Value = serde_yaml::from_str(&text).unwrap();
        let clusters = self
            .clusters
            .iter()
            .map(|c| {
                let text = serde_yaml::to_string(c)
                    .unwrap()
                    .replace("EDS_PATH", &eds.display().to_string());
                serde_yaml::from_str(&text).unwrap()
            })
            .collect();
        self.bootstrap(admin, listener, clusters)
    }

    fn bootstrap(&self, admin: u16, listener: Value, clusters: Vec<Value>) -> Value {
        let mut doc = y(&format!(
            "{{admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}, \
              node: {{id: router~10.0.0.1~istio-ingressgateway.istio-system~istio-system.svc.cluster.local, cluster: istio-ingressgateway.istio-system}}, \
              static_resources: {{listeners: [], clusters: []}}}}"
        ));
        doc["static_resources"]["listeners"] = Value::Sequence(vec![listener]);
        doc["static_resources"]["clusters"] = Value::Sequence(clusters);
        doc
    }
}

/// An xDS DiscoveryResponse file, written whole then renamed in (Envoy watches for moves).
pub fn write_discovery(path: &Path, resources: Vec<Value>) {
    let mut doc = y("{version_info: \"1\", resources: []}");
    doc["resources"] = Value::Sequence(resources);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_yaml::to_string(&doc).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}
