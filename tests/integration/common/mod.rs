//! The end-to-end tests' helpers under the one name every test file here uses: the test kit's
//! deployment helpers (`kv_testkit::e2e`) and its modules.
#![allow(unused_imports)]

pub use kv_testkit::e2e::*;
pub use kv_testkit::{deploy, prose, runner, splitmix, trace, workload};
