//! The Gateway API Inference Extension's conformance-test hooks (`conformance_test_hooks`, off by
//! default): its suite steers each request with the `test-epp-endpoint-selection` header (a
//! comma list of `ip` or `ip:port`; an `ip` selects every target port of that pod) and reads
//! three response headers: the endpoint the gateway says served the request, the one the picker
//! selected, and the picker's pool. Off by default because the header lets any client choose its
//! own pod; with hooks off it is ignored like any other client header.

use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::value::Kind;

use super::reply::{DESTINATION_SERVED_HEADER, LB_NAMESPACE};

/// Request header restricting the candidates to the endpoints it lists.
pub const SELECTION_HEADER: &str = "test-epp-endpoint-selection";
/// Response header: the endpoint the gateway reports it sent the request to.
pub const SERVED_HEADER: &str = "x-conformance-test-served-endpoint";
/// Response header: the endpoint the router selected (the primary of its list).
pub const SELECTED_HEADER: &str = "x-conformance-test-selected-endpoint";
/// Response header: the InferencePool the router picks for, `namespace/name`.
pub const POOL_HEADER: &str = "x-conformance-test-epp-pool";

/// The most entries read from one selection header; the rest are ignored.
const MAX_SELECTION: usize = 256;

/// What the hooks need besides the stream: the pool to report, when the router watches one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TestHooks {
    /// `namespace/name` of `pods.kubernetes.pool`.
    pub pool: Option<String>,
}

/// One endpoint entry: an IP (every port) or one `ip:port`; other text matches itself only.
#[derive(Debug, Clone, PartialEq)]
enum Entry {
    Ip(IpAddr),
    Addr(SocketAddr),
    Other(String),
}

impl Entry {
    fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        if s.is_empty() {
            return None;
        }
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Some(Entry::Addr(a));
        }
        let bare = s.strip_prefix('[').and_then(|r| r.strip_suffix(']'));
        match bare.unwrap_or(s).parse::<IpAddr>() {
            Ok(ip) => Some(Entry::Ip(ip)),
            Err(_) => Some(Entry::Other(s.to_string())),
        }
    }

    /// The endpoints both entries select, as one entry (each selects one IP or one address).
    fn meet(&self, other: &Entry) -> Option<Entry> {
        match (self, other) {
            (Entry::Ip(a), Entry::Ip(b)) => (a == b).then(|| self.clone()),
            (Entry::Ip(ip), Entry::Addr(a)) | (Entry::Addr(a), Entry::Ip(ip)) => {
                (a.ip() == *ip).then_some(Entry::Addr(*a))
            }
            (a, b) => (a.text() == b.text()).then(|| a.clone()),
        }
    }

    /// The form the decision's subset matching reads (`ip`, `ip:port`, `[v6]:port`).
    fn text(&self) -> String {
        match self {
            Entry::Ip(ip) => ip.to_string(),
            Entry::Addr(a) => a.to_string(),
            Entry::Other(s) => s.clone(),
        }
    }
}

/// The selection header's entries, `None` when the request has none (or lists nothing).
pub fn selection(headers: &[(String, String)]) -> Option<Vec<String>> {
    let value = headers
        .iter()
        .find(|(k, _)| k == SELECTION_HEADER)?
        .1
        .as_str();
    let mut out: Vec<String> = Vec::new();
    for e in value
        .split(',')
        .filter_map(Entry::parse)
        .take(MAX_SELECTION)
    {
        let t = e.text();
        if !out.contains(&t) {
            out.push(t);
        }
    }
    (!out.is_empty()).then_some(out)
}

/// The candidates both the gateway's subset hint and the selection allow, as one subset: each
/// entry selects one IP or one address, so the pairwise meets are exactly the intersection.
pub fn restrict(subset: Option<&[String]>, selection: Option<&[String]>) -> Option<Vec<String>> {
    match (subset, selection) {
        (None, None) => None,
        (Some(s), None) | (None, Some(s)) => Some(s.to_vec()),
        (Some(subset), Some(selection)) => {
            let subset: Vec<Entry> = subset.iter().filter_map(|s| Entry::parse(s)).collect();
            let mut out: Vec<String> = Vec::new();
            for sel in selection.iter().filter_map(|s| Entry::parse(s)) {
                for t in subset.iter().filter_map(|s| sel.meet(s)).map(|e| e.text()) {
                    if !out.contains(&t) {
                        out.push(t);
                    }
                }
            }
            Some(out)
        }
    }
}

/// The response headers the suite reads: `served` from the gateway's metadata (a `fail:` value
/// when it is missing, as the reference picker reports), `selected` the router's primary.
pub fn response_headers(
    hooks: &TestHooks,
    meta: Option<&Metadata>,
    selected: Option<&str>,
) -> Vec<(&'static str, String)> {
    let served = match meta.and_then(|m| m.filter_metadata.get(LB_NAMESPACE)) {
        None => "fail: missing envoy lb metadata".to_string(),
        Some(lb) => match lb
            .fields
            .get(DESTINATION_SERVED_HEADER)
            .and_then(|v| v.kind.as_ref())
        {
            Some(Kind::StringValue(s)) => s.clone(),
            _ => "fail: missing destination endpoint served metadata".to_string(),
        },
    };
    let mut out = vec![(SERVED_HEADER, served)];
    if let Some(primary) = selected.and_then(|d| d.split(',').next()) {
        out.push((SELECTED_HEADER, primary.to_string()));
    }
    if let Some(pool) = &hooks.pool {
        out.push((POOL_HEADER, pool.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{Struct, Value};

    fn hdr(v: &str) -> Vec<(String, String)> {
        vec![(SELECTION_HEADER.to_string(), v.to_string())]
    }

    #[test]
    fn the_selection_reads_ips_addresses_and_bracketed_v6() {
        assert_eq!(selection(&[]), None);
        assert_eq!(selection(&hdr(" , ")), None);
        assert_eq!(
            selection(&hdr(
                "10.0.0.1, 10.0.0.2:8001,[fd00::1],fd00::2,[fd00::3]:3002,10.0.0.1"
            )),
            Some(vec![
                "10.0.0.1".to_string(),
                "10.0.0.2:8001".into(),
                "fd00::1".into(),
                "fd00::2".into(),
                "[fd00::3]:3002".into(),
            ])
        );
        let long = vec!["10.0.0.1"; 10_000].join(",");
        assert_eq!(selection(&hdr(&long)).map(|v| v.len()), Some(1));
    }

    #[test]
    fn the_restriction_is_the_intersection_of_hint_and_selection() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(restrict(None, None), None);
        assert_eq!(restrict(Some(&v(&["a:1"])), None), Some(v(&["a:1"])));
        assert_eq!(
            restrict(None, Some(&v(&["10.0.0.1"]))),
            Some(v(&["10.0.0.1"]))
        );
        let hint = v(&["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2"]);
        assert_eq!(
            restrict(Some(&hint), Some(&v(&["10.0.0.1"]))),
            Some(v(&["10.0.0.1:8000", "10.0.0.1:8001"]))
        );
        assert_eq!(
            restrict(Some(&hint), Some(&v(&["10.0.0.2:9000", "10.0.0.1:8001"]))),
            Some(v(&["10.0.0.2:9000", "10.0.0.1:8001"]))
        );
        assert_eq!(
            restrict(Some(&hint), Some(&v(&["10.0.0.3"]))),
            Some(vec![]),
            "disjoint: nothing left"
        );
    }

    fn lb(served: Option<&str>) -> Metadata {
        let mut inner = Struct::default();
        if let Some(s) = served {
            inner.fields.insert(
                DESTINATION_SERVED_HEADER.to_string(),
                Value {
                    kind: Some(Kind::StringValue(s.to_string())),
                },
            );
        }
        let mut m = Metadata::default();
        m.filter_metadata.insert(LB_NAMESPACE.to_string(), inner);
        m
    }

    #[test]
    fn the_served_header_reports_only_the_gateway_metadata() {
        let hooks = TestHooks {
            pool: Some("llm/vllm-pool".into()),
        };
        let got = response_headers(
            &hooks,
            Some(&lb(Some("10.0.0.2:8000"))),
            Some("10.0.0.1:8000,10.0.0.2:8000"),
        );
        assert_eq!(
            got,
            vec![
                (SERVED_HEADER, "10.0.0.2:8000".to_string()),
                (SELECTED_HEADER, "10.0.0.1:8000".to_string()),
                (POOL_HEADER, "llm/vllm-pool".to_string()),
            ]
        );
        let none = TestHooks::default();
        assert_eq!(
            response_headers(&none, None, None),
            vec![(SERVED_HEADER, "fail: missing envoy lb metadata".to_string())]
        );
        assert_eq!(
            response_headers(&none, Some(&lb(None)), None)[0].1,
            "fail: missing destination endpoint served metadata"
        );
    }
}
