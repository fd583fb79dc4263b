//! The end-to-end tests' helpers under the one name every test file here uses: the test kit's
//! deployment helpers (`kv_testkit::e2e`) and its modules.
#![allow(unused_imports)]

pub use kv_testkit::e2e::*;
pub use kv_testkit::{deploy, prose, runner, splitmix, trace, workload};

use std::path::PathBuf;

pub use kv_testkit::repo_root;

/// The project's venv (`$KV_ROUTER_VENV`, else `.venv`), where `make deploy-tools` installs.
pub fn venv() -> PathBuf {
    std::env::var_os("KV_ROUTER_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv"))
}

/// A tool from the venv's `bin/`; panics with the install hint.
pub fn venv_tool(name: &str) -> PathBuf {
    let p = venv().join("bin").join(name);
    assert!(
        p.is_file(),
        "{} is missing: the deploy tests need the pinned tools of deploy/requirements.txt; \
         run `make deploy-tools` (pip-installs them into .venv)",
        p.display()
    );
    p
}
