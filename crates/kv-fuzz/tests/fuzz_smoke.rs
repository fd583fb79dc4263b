//! The fuzz targets on stable Rust, so `make test` runs them without nightly or cargo-fuzz: each
//! target (the `kv-fuzz` crate, the functions libFuzzer drives in `fuzz/`) over every file of its
//! seed corpus (`fuzz/corpus/<name>/`), then for a few seconds over proptest-made inputs —
//! random bytes, and corpus files with bytes flipped, cut, spliced, inserted or repeated. A
//! failure prints the shrunk input in hex: save it under `fuzz/artifacts/<name>/` and replay it
//! with `cargo +nightly fuzz run <name> <file>` (the files there are replayed here too).

use kv_fuzz as targets;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestError, TestRunner};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// The files of one directory, in name order (none if it does not exist).
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<_> = entries
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).expect("a readable file");
            (p.file_name().unwrap().to_string_lossy().into_owned(), bytes)
        })
        .collect()
}

/// The seed files of one target, then the reproducers of the crashes fixed since.
fn corpus(name: &str) -> Vec<(String, Vec<u8>)> {
    let dir = fuzz_dir().join("corpus").join(name);
    let mut seeds = files(&dir);
    assert!(!seeds.is_empty(), "{}: no seed files", dir.display());
    seeds.extend(files(&fuzz_dir().join("artifacts").join(name)));
    seeds
}

/// One change to a seed.
#[derive(Debug, Clone)]
enum Edit {
    Flip(Index, u8),
    Set(Index, u8),
    Truncate(Index),
    Delete(Index, u8),
    Insert(Index, Vec<u8>),
    Repeat(Index, u8),
    /// This seed up to a point, then another seed from a point.
    Splice(Index, Index, Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| Edit::Flip(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        any::<Index>().prop_map(Edit::Truncate),
        (any::<Index>(), any::<u8>()).prop_map(|(i, n)| Edit::Delete(i, n)),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Edit::Insert(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, n)| Edit::Repeat(i, n)),
        (any::<Index>(), any::<Index>(), any::<Index>())
            .prop_map(|(a, o, b)| Edit::Splice(a, o, b)),
    ]
}

fn apply(mut data: Vec<u8>, edits: &[Edit], seeds: &[Vec<u8>]) -> Vec<u8> {
    // A position in 0..=len.
    let at = |i: &Index, len: usize| i.index(len + 1);
    for e in edits {
        let len = data.len();
        match e {
            Edit::Flip(i, bit) if len > 0 => data[i.index(len)] ^= 1 << bit,
            Edit::Set(i, b) if len > 0 => data[i.index(len)] = *b,
            Edit::Flip(..) | Edit::Set(..) => {}
            Edit::Truncate(i) => data.truncate(at(i, len)),
            Edit::Delete(i, n) => {
                let from = at(i, len);
                data.drain(from..(from + usize::from(*n)).min(len));
            }
            Edit::Insert(i, bytes) => {
                let p = at(i, len);
                data.splice(p..p, bytes.iter().copied());
            }
            Edit::Repeat(i, n) => {
                let from = at(i, len);
                let chunk = data[from..(from + usize::from(*n)).min(len)].to_vec();
                data.splice(from..from, chunk);
            }
            Edit::Splice(a, other, b) => {
                let other = &seeds[other.index(seeds.len())];
                data.truncate(at(a, len));
                data.extend_from_slice(&other[at(b, other.len())..]);
            }
        }
    }
    data
}

/// Random bytes (one in four) or a seed with one to four edits.
fn inputs(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    let mutated = (0..n, prop::collection::vec(edit(), 1..5))
        .prop_map(move |(i, edits)| apply(seeds[i].clone(), &edits, &seeds));
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..1024),
        3 => mutated,
    ]
}

fn hex(data: &[u8]) -> String {
    data.iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs `target` over its corpus, then over generated inputs for about `budget`.
fn smoke(name: &str, target: fn(&[u8]), budget: Duration) {
    let seeds = corpus(name);
    let started = Instant::now();
    for (file, data) in &seeds {
        if let Err(e) = std::panic::catch_unwind(|| target(data)) {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{name}: seed {file} fails: {why}");
        }
    }
    // Rounds of proptest cases until the budget is spent (a runner counts its cases for good).
    let config = Config {
        cases: 500,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let strategy = inputs(seeds.into_iter().map(|(_, d)| d).collect());
    let generated = std::cell::Cell::new(0u64);
    let deadline = Instant::now() + budget;
    while Instant::now() < deadline {
        let result = TestRunner::new(config.clone()).run(&strategy, |data| {
            generated.set(generated.get() + 1);
            target(&data);
            Ok(())
        });
        match result {
            Ok(()) => {}
            Err(TestError::Fail(why, data)) => panic!(
                "{name}: {why}\nshrunk input ({} bytes, hex): {}",
                data.len(),
                hex(&data)
            ),
            Err(e) => panic!("{name}: {e}"),
        }
    }
    eprintln!(
        "{name}: corpus + {} generated inputs in {:.1?}",
        generated.get(),
        started.elapsed()
    );
}

#[test]
fn request_parser() {
    smoke(
        "request_parser",
        targets::request_parser,
        Duration::from_secs(3),
    );
}

#[test]
fn kv_events() {
    smoke("kv_events", targets::kv_events, Duration::from_secs(3));
}

#[test]
fn prometheus() {
    smoke("prometheus", targets::prometheus, Duration::from_secs(2));
}

#[test]
fn config() {
    smoke("config", targets::config, Duration::from_secs(4));
}

#[test]
fn redis_member() {
    smoke(
        "redis_member",
        targets::redis_member,
        Duration::from_secs(1),
    );
}

#[test]
fn redis_lookup_reply() {
    smoke(
        "redis_lookup_reply",
        targets::redis_lookup_reply,
        Duration::from_secs(1),
    );
}

#[test]
fn extproc() {
    smoke("extproc", targets::extproc, Duration::from_secs(7));
}

/// `cargo fuzz run` adds what it finds to `corpus/<name>/`; only small seeds belong there.
#[test]
fn seed_corpora_stay_small() {
    let root = fuzz_dir().join("corpus");
    let mut total = 0;
    for dir in std::fs::read_dir(&root).expect("fuzz/corpus") {
        let files = std::fs::read_dir(dir.expect("an entry").path()).expect("a corpus dir");
        for f in files {
            let f = f.expect("an entry");
            let len = f.metadata().expect("metadata").len();
            assert!(len <= 64 << 10, "{}: {len} bytes", f.path().display());
            total += len;
        }
    }
    assert!(total <= 1 << 20, "fuzz/corpus holds {total} bytes");
}
