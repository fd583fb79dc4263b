//! Scripts and image: `deploy/kind/demo.sh` passes shellcheck; the Dockerfile passes hadolint
//! and copies only paths that exist and that `.dockerignore` keeps.

use std::fs;
use std::process::Command;

use super::{root, run, tool};
#[test]
fn kind_demo_passes_shellcheck() {
    let script = root().join("deploy/kind/demo.sh");
    run(Command::new(tool("shellcheck"))
        .args(["--severity=style", "--shell=bash"])
        .arg(&script));
    let text = fs::read_to_string(&script).unwrap();
    assert!(text.starts_with("#!/usr/bin/env bash\n"), "demo.sh shebang");
    assert!(text.contains("set -euo pipefail"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(&script).unwrap().permissions().mode();
        assert!(mode & 0o111 != 0, "demo.sh is not executable");
    }
}

/// `.dockerignore` patterns (simple globs: `dir/`, `*.ext`, `name`, `!` exceptions).
fn docker_ignored(patterns: &[String], path: &str) -> bool {
    let mut ignored = false;
    for p in patterns {
        let (neg, p) = match p.strip_prefix('!') {
            Some(rest) => (true, rest),
            None => (false, p.as_str()),
        };
        let p = p.trim_end_matches('/').trim_start_matches("./");
        let hit = if let Some(ext) = p.strip_prefix("**/*") {
            path.ends_with(ext)
        } else if let Some(ext) = p.strip_prefix('*') {
            !path.contains('/') && path.ends_with(ext)
        } else {
            path == p || path.starts_with(&format!("{p}/"))
        };
        if hit {
            ignored = !neg;
        }
    }
    ignored
}

#[test]
fn dockerfile_lints_and_copies_what_exists() {
    let dockerfile = root().join("Dockerfile");
    run(Command::new(tool("hadolint")).arg(&dockerfile));
    let text = fs::read_to_string(&dockerfile).unwrap();
    let ignore: Vec<String> = fs::read_to_string(root().join(".dockerignore"))
        .expect(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    let mut copied = 0;
    for line in text.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("COPY ") else {
            continue;
        };
        if rest.contains("--from=") {
            continue; // from a build stage, not the context
        }
        let parts: Vec<&str> = rest
            .split_whitespace()
            .filter(|p| !p.starts_with("--"))
            .collect();
        for src in &parts[..parts.len() - 1] {
            let src = src.trim_end_matches('/');
            let p = root().join(src);
            assert!(p.exists(), "Dockerfile copies {src}, which does not exist");
            assert!(
                !docker_ignored(&ignore, src),
                "Dockerfile copies {src}, which .dockerignore excludes"
            );
            copied += 1;
        }
    }
    assert!(
        copied >= 4,
        "the Dockerfile copies the sources ({copied} paths)"
    );
    for must in ["target", ".venv", ".git"] {
        assert!(
            docker_ignored(&ignore, must),
            ".dockerignore must exclude {must}"
        );
    }
    assert!(
        text.contains("USER 65532") || text.contains("USER nonroot"),
        "the runtime image runs as non-root"
    );
    assert!(
        text.contains("/usr/local/bin/kv-router") && text.contains("/usr/local/bin/vllm-sim"),
        "the image ships kv-router and vllm-sim where the manifests run them"
    );
}
