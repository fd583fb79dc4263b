//! The analysis scripts beside kv-bench (`scripts/*.py`, reading its `--records` and the
//! routers' decision logs): their Python unit tests, so a change that breaks them fails here.

use std::path::Path;
use std::process::Command;

#[test]
fn the_analysis_scripts_unit_tests_pass() {
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts");
    let out = Command::new("python3")
        .args(["-m", "unittest", "discover", "-s"])
        .arg(&scripts)
        .args(["-p", "test_*.py", "-v"])
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 is one of the two tools a fresh machine has (README)");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scripts' unit tests failed:\n{log}");
    assert!(log.contains("Ran "), "no test ran:\n{log}");
    assert!(!log.contains("Ran 0 tests"), "no test ran:\n{log}");
}
