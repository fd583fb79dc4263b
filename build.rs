//! Compiles the project's own proto with a vendored protoc, so no system protoc is needed, and
//! stamps the build with its git revision (`kv-router --version`, `kv_router_build_info`).
use std::path::Path;
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure().compile_with_config(
        config,
        &["proto/kvrouter.proto"],
        &["proto"],
    )?;
    println!("cargo:rerun-if-changed=proto/kvrouter.proto");
    println!("cargo:rustc-env=KV_ROUTER_GIT_REVISION={}", revision());
    Ok(())
}

/// `KV_ROUTER_GIT_REVISION` when set (an image build has no `.git`), else the checkout's HEAD,
/// else "unknown". Only short hex revisions pass, so nothing else reaches the binary.
fn revision() -> String {
    println!("cargo:rerun-if-env-changed=KV_ROUTER_GIT_REVISION");
    let given = std::env::var("KV_ROUTER_GIT_REVISION").unwrap_or_default();
    let rev = if given.trim().is_empty() {
        git_head().unwrap_or_default()
    } else {
        given.trim().to_string()
    };
    let rev: String = rev.chars().take(12).collect();
    if rev.len() >= 7 && rev.chars().all(|c| c.is_ascii_hexdigit()) {
        rev.to_ascii_lowercase()
    } else {
        "unknown".into()
    }
}

fn git(args: &[&str]) -> Option<String> {
    let dir = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn git_head() -> Option<String> {
    // Rebuild when HEAD moves: watch HEAD, the branch it names and packed-refs, where they exist
    // (a path that does not exist would make cargo rerun this script on every build).
    let mut watch = vec![git(&["rev-parse", "--git-path", "HEAD"])?];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.extend(git(&["rev-parse", "--git-path", &branch]));
    }
    watch.extend(git(&["rev-parse", "--git-path", "packed-refs"]));
    let dir = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    for path in watch {
        let path = Path::new(&dir).join(path);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    git(&["rev-parse", "--short=12", "HEAD"])
}
