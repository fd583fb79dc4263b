//! The container image, checked without a container engine:
//! - the build stage is reproduced file for file (the build context as `.dockerignore` defines
//!   it, then the Dockerfile's `COPY`s into its `WORKDIR`) and the workspace is compiled there,
//!   locked and offline, so a manifest target or workspace member the image lacks fails here;
//! - the binaries report their version and revision.

use crate::common::repo_root as root;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

// ---- .dockerignore, as BuildKit reads it ----

/// One `.dockerignore` line: a path pattern, and whether it re-includes (`!`).
#[derive(Debug, Clone)]
struct Rule {
    segments: Vec<String>,
    include: bool,
}

fn parse_dockerignore(text: &str) -> Vec<Rule> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (include, pat) = match l.strip_prefix('!') {
                Some(p) => (true, p.trim()),
                None => (false, l),
            };
            let segments = pat
                .trim_start_matches('/')
                .split('/')
                .filter(|s| !s.is_empty() && *s != ".")
                .map(str::to_string)
                .collect();
            Rule { segments, include }
        })
        .collect()
}

/// `*`, `?` and `[...]` within one path segment (Go's `filepath.Match`).
fn segment_matches(pat: &[u8], name: &[u8]) -> bool {
    match (pat.first(), name.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            segment_matches(&pat[1..], name)
                || (!name.is_empty() && segment_matches(pat, &name[1..]))
        }
        (Some(b'?'), Some(_)) => segment_matches(&pat[1..], &name[1..]),
        (Some(b'['), Some(&c)) => {
            let Some(end) = pat.iter().position(|&b| b == b']') else {
                return false;
            };
            let class = &pat[1..end];
            let (negate, class) = match class.first() {
                Some(b'^') | Some(b'!') => (true, &class[1..]),
                _ => (false, class),
            };
            let mut hit = false;
            let mut i = 0;
            while i < class.len() {
                if i + 2 < class.len() && class[i + 1] == b'-' {
                    hit |= class[i] <= c && c <= class[i + 2];
                    i += 3;
                } else {
                    hit |= class[i] == c;
                    i += 1;
                }
            }
            hit != negate && segment_matches(&pat[end + 1..], &name[1..])
        }
        (Some(&p), Some(&c)) => p == c && segment_matches(&pat[1..], &name[1..]),
        _ => false,
    }
}

/// A pattern matches a path, or any directory above it (`**` spans any number of segments).
fn pattern_matches(pat: &[String], path: &[&str]) -> bool {
    match pat.first() {
        None => true, // the pattern named a directory above `path`
        Some(p) if p == "**" => (0..=path.len()).any(|k| pattern_matches(&pat[1..], &path[k..])),
        Some(p) => {
            !path.is_empty()
                && segment_matches(p.as_bytes(), path[0].as_bytes())
                && pattern_matches(&pat[1..], &path[1..])
        }
    }
}

/// The last rule that matches decides; a path no rule matches is in the context.
fn excluded(rules: &[Rule], rel: &str) -> bool {
    let path: Vec<&str> = rel.split('/').collect();
    rules
        .iter()
        .rev()
        .find(|r| pattern_matches(&r.segments, &path))
        .is_some_and(|r| !r.include)
}

/// Could a `!` rule re-include something under this excluded directory?
fn may_reinclude_below(rules: &[Rule], dir: &str) -> bool {
    let path: Vec<&str> = dir.split('/').collect();
    rules.iter().filter(|r| r.include).any(|r| {
        r.segments
            .iter()
            .zip(&path)
            .all(|(p, d)| p == "**" || segment_matches(p.as_bytes(), d.as_bytes()))
    })
}

/// Every file of the build context, relative to the repository root.
fn context_files(rules: &[Rule]) -> BTreeSet<String> {
    fn walk(rules: &[Rule], base: &Path, rel: &str, out: &mut BTreeSet<String>) {
        let dir = if rel.is_empty() {
            base.to_path_buf()
        } else {
            base.join(rel)
        };
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let ty = entry.file_type().unwrap();
            if ty.is_dir() {
                if !excluded(rules, &rel) || may_reinclude_below(rules, &rel) {
                    walk(rules, base, &rel, out);
                }
            } else if !excluded(rules, &rel) {
                out.insert(rel);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(rules, &root(), "", &mut out);
    out
}

// ---- the Dockerfile's build stage ----

/// The build stage's instructions, `\`-continued lines joined.
fn build_stage(dockerfile: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut cur = String::new();
    for line in dockerfile.lines() {
        let t = line.trim();
        if t.starts_with('#') && cur.is_empty() {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(head) => cur.push_str(head),
            None => {
                cur.push_str(t);
                if !cur.trim().is_empty() {
                    lines.push(std::mem::take(&mut cur));
                }
                cur.clear();
            }
        }
    }
    let start = lines
        .iter()
        .position(|l| l.starts_with("FROM ") && l.to_lowercase().ends_with(" as build"))
        .expect("a build stage: FROM … AS build");
    lines[start + 1..]
        .iter()
        .take_while(|l| !l.starts_with("FROM "))
        .cloned()
        .collect()
}

/// Copies the context into the stage's WORKDIR as its `COPY` lines say; returns that directory.
fn reproduce_stage(stage: &[String], context: &BTreeSet<String>, into: &Path) -> PathBuf {
    let mut workdir = into.to_path_buf();
    for line in stage {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("WORKDIR") => {
                workdir = into.join(words.next().unwrap().trim_start_matches('/'));
                std::fs::create_dir_all(&workdir).unwrap();
            }
            Some("COPY") => {
                let args: Vec<&str> = words.filter(|w| !w.starts_with("--")).collect();
                assert!(
                    !line.contains("--from"),
                    "build stage copies from elsewhere: {line}"
                );
                let (dest, srcs) = args.split_last().expect("COPY src… dest");
                for src in srcs {
                    assert!(
                        !src.contains(['*', '?', '[']),
                        "COPY with a wildcard is not reproduced: {line}"
                    );
                    let src = src.trim_end_matches('/').trim_start_matches("./");
                    let is_file = context.contains(src);
                    let under: Vec<&String> = context
                        .iter()
                        .filter(|f| f.starts_with(&format!("{src}/")))
                        .collect();
                    assert!(
                        is_file || !under.is_empty(),
                        "COPY {src}: not in the build context (.dockerignore leaves it out)"
                    );
                    let dest_dir = workdir.join(dest);
                    if is_file {
                        let to = if dest.ends_with('/') {
                            dest_dir.join(Path::new(src).file_name().unwrap())
                        } else {
                            dest_dir.clone()
                        };
                        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
                        std::fs::copy(root().join(src), to).unwrap();
                    }
                    for f in under {
                        let to = dest_dir.join(&f[src.len() + 1..]);
                        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
                        std::fs::copy(root().join(f), to).unwrap();
                    }
                }
            }
            _ => {}
        }
    }
    workdir
}

/// The `-p` packages and `--bin` binaries of the stage's `cargo build`.
fn cargo_build_targets(stage: &[String]) -> (Vec<String>, Vec<String>) {
    let run = stage
        .iter()
        .find(|l| l.starts_with("RUN ") && l.contains("cargo build"))
        .expect("a RUN with cargo build");
    let cmd = &run[run.find("cargo build").unwrap()..];
    let cmd = cmd.split("&&").next().unwrap();
    assert!(
        cmd.contains("--locked"),
        "the image must build from Cargo.lock: {cmd}"
    );
    let words: Vec<&str> = cmd.split_whitespace().collect();
    let after = |flag: &str| -> Vec<String> {
        words
            .windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].to_string())
            .collect()
    };
    (after("-p"), after("--bin"))
}

fn cargo(dir: &Path, args: &[&str]) -> std::process::Output {
    // The repository's own target dir: its dependencies are already built there.
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"));
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target)
        .env_remove("RUSTFLAGS")
        .output()
        .expect("run cargo")
}

#[test]
fn the_image_build_stage_compiles_from_its_own_context() {
    let rules = parse_dockerignore(&std::fs::read_to_string(root().join(".dockerignore")).unwrap());
    let context = context_files(&rules);
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let stage = build_stage(&dockerfile);
    let tmp = tempfile::Builder::new()
        .prefix("image-stage")
        .tempdir_in(root().join("target"))
        .unwrap();
    let workdir = reproduce_stage(&stage, &context, tmp.path());

    // Every package and binary the image builds is in the reproduced workspace.
    let (packages, bins) = cargo_build_targets(&stage);
    let meta = cargo(
        &workdir,
        &[
            "metadata",
            "--offline",
            "--locked",
            "--no-deps",
            "--format-version=1",
        ],
    );
    assert!(
        meta.status.success(),
        "{}",
        String::from_utf8_lossy(&meta.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&meta.stdout).unwrap();
    let pkgs = meta["packages"].as_array().unwrap();
    for p in &packages {
        assert!(
            pkgs.iter().any(|m| m["name"] == p.as_str()),
            "package {p} not in the image's workspace"
        );
    }
    for b in &bins {
        let built = pkgs
            .iter()
            .filter(|m| packages.iter().any(|p| m["name"] == p.as_str()))
            .flat_map(|m| m["targets"].as_array().unwrap())
            .any(|t| t["name"] == b.as_str() && t["kind"][0] == "bin");
        assert!(
            built,
            "binary {b} is not a target of the packages the image builds"
        );
    }

    // Compile what cargo must load to build them: every member's library, binaries and benches
    // (the targets a manifest declares; tests are discovered, and the context has none). Checked
    // with the profile and feature set of `make lint`, whose dependencies are then already compiled.
    let out = cargo(
        &workdir,
        &[
            "check",
            "--release",
            "--locked",
            "--offline",
            "--workspace",
            "--lib",
            "--bins",
            "--bench",
            "*",
            "--quiet",
        ],
    );
    assert!(
        out.status.success(),
        "the image's build stage does not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn dockerignore_follows_buildkit_rules() {
    let rules =
        parse_dockerignore("*\n!src/\n!crates/\ncrates/**/target\n# comment\n!Cargo.toml\n");
    for (path, out) in [
        ("Cargo.toml", false),
        ("Cargo.lock", true),
        ("src/main.rs", false),
        ("crates/a/src/lib.rs", false),
        ("crates/a/target/x", true),
        ("tests/integration/e2e.rs", true),
        (".git/HEAD", true),
    ] {
        assert_eq!(excluded(&rules, path), out, "{path}");
    }
    assert!(may_reinclude_below(&rules, "crates"));
    assert!(!may_reinclude_below(&rules, "target"));
    assert!(segment_matches(b"*.r[a-s]", b"main.rs"));
    assert!(!segment_matches(b"*.r[!s]", b"main.rs"));
}

#[test]
fn kv_router_reports_its_version_and_revision() {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-router"))
        .arg("--version")
        .output()
        .unwrap();
    let line = String::from_utf8(out.stdout).unwrap();
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        line.trim(),
        format!("kv-router {version} ({})", kv_router::GIT_REVISION)
    );
    // Built from a checkout, the revision is its HEAD.
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(root())
        .output();
    if let Some(head) = head.ok().filter(|h| h.status.success()) {
        assert_eq!(
            kv_router::GIT_REVISION,
            String::from_utf8_lossy(&head.stdout).trim()
        );
    }
}

/// `git` in the checkout, trimmed; None without git or a checkout.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(root())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `make -s -n image` with these variables: the commands it would run.
fn image_plan(vars: &[&str]) -> String {
    let out = Command::new("make")
        .args(["-s", "-n", "image", "CONTAINER_TOOL=docker"])
        .args(vars)
        .current_dir(root())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_image_tag_carries_the_version_and_the_revision() {
    let version = env!("CARGO_PKG_VERSION");
    // The manifests name the image by a placeholder (newName and newTag both to be set by the
    // user's kustomization, deploy/README.md "Image"): every override names this release.
    let mut seen = 0;
    for entry in walk_yaml(&root().join("deploy")) {
        let text = std::fs::read_to_string(&entry).unwrap();
        if !text.contains("kind: Kustomization") && !text.contains("images:") {
            continue;
        }
        let Ok(doc) = serde_yaml::from_str::<serde_yaml::Value>(&text) else {
            continue;
        };
        for img in doc["images"].as_sequence().into_iter().flatten() {
            if img["name"] == "kv-router" {
                seen += 1;
                assert_eq!(
                    img["newTag"].as_str(),
                    Some(version),
                    "{}: kv-router's image tag is not the crate version",
                    entry.display()
                );
            }
        }
    }
    assert!(seen >= 1, "no kustomization sets kv-router's image");
    // `make image` tags VERSION-REVISION (-dirty when tracked files changed) and stamps the
    // same revision into the binary and the image's labels; `make image-tag` prints the tag.
    let Some(head) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return; // no checkout: nothing to compare the tag with
    };
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let tag = format!("{version}-{head}{}", if dirty { "-dirty" } else { "" });
    let plan = image_plan(&[]);
    for want in [
        format!("-t kv-router:{tag} ."),
        format!("--build-arg KV_ROUTER_GIT_REVISION={head} "),
        format!("--label org.opencontainers.image.version={version} "),
        format!("--label org.opencontainers.image.revision={head} "),
    ] {
        assert!(plan.contains(&want), "make image: no `{want}` in\n{plan}");
    }
    let printed = Command::new("make")
        .args(["-s", "image-tag"])
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&printed.stdout).trim(), tag);
    // A binary built from this checkout reports the revision the tag names.
    assert!(
        tag.contains(kv_router::GIT_REVISION),
        "{tag} vs {}",
        kv_router::GIT_REVISION
    );
    // The tag or the whole name can still be chosen.
    assert!(image_plan(&["IMAGE_TAG=1.2.3"]).contains("-t kv-router:1.2.3 ."));
    assert!(image_plan(&["IMAGE=reg.example/kv-router:x"]).contains("-t reg.example/kv-router:x ."));
}

fn walk_yaml(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk_yaml(&p));
        } else if p.extension().is_some_and(|x| x == "yaml") {
            out.push(p);
        }
    }
    out
}
