//! Third-party images are pinned by digest, `name:tag@sha256:…` (the tag says which release, the
//! digest makes it that build): the Dockerfile's `syntax` and `FROM`s, every container of every
//! overlay's render, and the kind demo's own manifests. An image that cannot be pinned yet is
//! listed in `UNPINNED` with the reason; a new unpinned one fails, and so does a listed one that
//! is gone or has been pinned since (take it off the list).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;

use serde_yaml::Value;

use super::{render, root, seq_of, OVERLAYS};

/// Images kept on a tag alone, and why.
const UNPINNED: &[(&str, &str)] = &[
    (
        "envoyproxy/envoy:distroless-v1.40.0",
        "no digest of this tag was found in any public source readable offline; pin it from \
         `docker buildx imagetools inspect envoyproxy/envoy:distroless-v1.40.0`",
    ),
    (
        "vllm/vllm-openai:v0.33.0",
        "no digest of this tag was found in any public source readable offline; pin it from \
         `docker buildx imagetools inspect vllm/vllm-openai:v0.33.0`",
    ),
];

/// kv-router's own image: `make image` tags it with the revision (deploy/README.md, "Image").
const OWN: &str = "ghcr.io/example/kv-router:";

/// Every image a pod template names.
fn pod_images(doc: &Value, out: &mut Vec<String>) {
    let spec = &doc["spec"]["template"]["spec"];
    for c in ["containers", "initContainers"]
        .iter()
        .flat_map(|k| seq_of(&spec[*k]))
    {
        out.push(c["image"].as_str().unwrap().to_string());
    }
}

/// Where each image is named: (image, where).
fn images() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let dockerfile = fs::read_to_string(root().join("Dockerfile")).unwrap();
    let mut stages = BTreeSet::new();
    for line in dockerfile.lines() {
        if let Some(syntax) = line.strip_prefix("# syntax=") {
            out.push((syntax.trim().to_string(), "Dockerfile syntax".into()));
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if words
            .first()
            .is_some_and(|w| w.eq_ignore_ascii_case("FROM"))
        {
            let image = words.iter().skip(1).find(|w| !w.starts_with("--")).unwrap();
            if !stages.contains(*image) {
                out.push((image.to_string(), "Dockerfile FROM".into()));
            }
            if let [.., as_, name] = words.as_slice() {
                if as_.eq_ignore_ascii_case("AS") {
                    stages.insert(name.to_string());
                }
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    for o in OVERLAYS {
        let r = render(&root().join("deploy/overlays").join(o), o, tmp.path());
        let mut imgs = Vec::new();
        for d in r.docs.iter().filter(|d| !d["spec"]["template"].is_null()) {
            pod_images(d, &mut imgs);
        }
        out.extend(imgs.into_iter().map(|i| (i, format!("overlays/{o}"))));
    }
    // The demo's baseline Envoy is a component only the demo's generated kustomization renders.
    let dir = root().join("deploy/kind/round-robin");
    for e in fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let text = fs::read_to_string(&p).unwrap();
        if p.extension().is_none_or(|x| x != "yaml") || !text.contains("template:") {
            continue;
        }
        for d in serde_yaml::Deserializer::from_str(&text) {
            let d = <Value as serde::Deserialize>::deserialize(d).unwrap();
            let mut imgs = Vec::new();
            if !d["spec"]["template"].is_null() {
                pod_images(&d, &mut imgs);
            }
            out.extend(imgs.into_iter().map(|i| (i, format!("{}", p.display()))));
        }
    }
    out
}

/// `name:tag@sha256:<64 hex>` split into (`name:tag`, digest); None when not pinned.
fn pinned(image: &str) -> Option<(&str, &str)> {
    let (named, digest) = image.split_once("@sha256:")?;
    let tagged = named.rsplit('/').next().unwrap().contains(':');
    let hex = digest.len() == 64
        && digest
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c));
    (tagged && hex).then_some((named, digest))
}

#[test]
fn third_party_images_are_pinned_by_digest_or_listed_with_a_reason() {
    let mut failures = Vec::new();
    let mut digests: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut unpinned_seen = BTreeSet::new();
    let all = images();
    assert!(
        all.iter().any(|(_, w)| w == "Dockerfile FROM") && all.len() > 10,
        "too few images found: {all:?}"
    );
    for (image, at) in &all {
        if image.starts_with(OWN) {
            continue;
        }
        match pinned(image) {
            Some((named, digest)) => {
                digests
                    .entry(named.to_string())
                    .or_default()
                    .insert(digest.to_string());
                if UNPINNED.iter().any(|(u, _)| *u == named) {
                    failures.push(format!("{named} is pinned now: take it off UNPINNED"));
                }
            }
            None if UNPINNED.iter().any(|(u, _)| u == image) => {
                unpinned_seen.insert(image.as_str());
            }
            None => failures.push(format!(
                "{at}: {image} is not pinned as name:tag@sha256:<digest> (nor in UNPINNED with a reason)"
            )),
        }
    }
    for (named, ds) in &digests {
        if ds.len() > 1 {
            failures.push(format!("{named} is pinned to several digests: {ds:?}"));
        }
    }
    for (u, _) in UNPINNED {
        if !unpinned_seen.contains(u) && !digests.contains_key(*u) {
            failures.push(format!("UNPINNED lists {u}, which nothing uses any more"));
        }
    }
    eprintln!("pinned by digest: {:?}", digests.keys().collect::<Vec<_>>());
    eprintln!("on a tag only: {unpinned_seen:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_pin_needs_the_tag_and_a_whole_sha256() {
    let d = "0123456789abcdef".repeat(4);
    assert_eq!(
        pinned(&format!("valkey/valkey:9.1.2@sha256:{d}")),
        Some(("valkey/valkey:9.1.2", d.as_str()))
    );
    assert_eq!(
        pinned(&format!("reg.example:5000/team/x:1@sha256:{d}")),
        Some(("reg.example:5000/team/x:1", d.as_str()))
    );
    for bad in [
        "valkey/valkey:9.1.2".to_string(),
        format!("valkey/valkey@sha256:{d}"),
        format!("reg.example:5000/team/x@sha256:{d}"),
        format!("valkey/valkey:9.1.2@sha256:{}", &d[1..]),
        format!("valkey/valkey:9.1.2@sha256:{}", d.to_uppercase()),
    ] {
        assert_eq!(pinned(&bad), None, "{bad}");
    }
}
