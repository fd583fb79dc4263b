//! The `kv-router` command line: an invalid configuration, tokenizer files included, stops both
//! `check-config` and `serve` with exit status 64 before any port opens.

use std::process::{Command, Output};

fn kv_router(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kv-router"))
        .args(args)
        .output()
        .expect("run kv-router")
}

fn config(dir: &std::path::Path, name: &str, yaml: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, yaml).unwrap();
    path.display().to_string()
}

const POD: &str = "pods: {static: [{address: '127.0.0.1:1'}]}\n";

#[test]
fn invalid_configs_exit_64_in_check_config_and_serve() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-tokenizer.json");
    let cases = [
        config(dir.path(), "unknown-key.yaml", "no_such_key: 1\n"),
        config(
            dir.path(),
            "bad-tokenizer.yaml",
            &format!(
                "{POD}tokenizers: [{{model: m, tokenizer_json: {}}}]\n",
                missing.display()
            ),
        ),
    ];
    for file in &cases {
        for args in [vec!["check-config", file], vec!["serve", "--config", file]] {
            let out = kv_router(&args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
            assert!(stderr.contains(file.as_str()), "names the file: {stderr}");
        }
    }
    let good = config(dir.path(), "good.yaml", POD);
    let out = kv_router(&["check-config", &good]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
