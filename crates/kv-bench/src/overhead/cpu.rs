//! CPU time from `/proc`: a process's or a thread's utime + stime, the clock tick; Envoy's
//! version.

use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why a `/proc` CPU figure could not be read.
#[derive(Debug, Error)]
pub enum CpuStatError {
    /// The stat file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The stat line did not have numeric utime/stime fields.
    #[error("malformed stat line")]
    Malformed,
}

/// utime + stime (fields 14 and 15 of `/proc/<pid>/stat`), in clock ticks.
pub fn parse_stat_ticks(stat: &str) -> Result<u64, CpuStatError> {
    // comm (field 2) may contain spaces and parentheses: fields restart after the last ')'.
    let rest = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or(CpuStatError::Malformed)?;
    let mut f = rest.split_whitespace().skip(11);
    let mut next = || -> Result<u64, CpuStatError> {
        f.next()
            .and_then(|v| v.parse().ok())
            .ok_or(CpuStatError::Malformed)
    };
    Ok(next()? + next()?)
}

/// A `/proc/…/stat` file whose CPU time is tracked.
#[derive(Debug, Clone)]
pub struct CpuSource(PathBuf);

impl CpuSource {
    pub fn process(pid: u32) -> Self {
        Self(PathBuf::from(format!("/proc/{pid}/stat")))
    }

    pub(crate) fn own_thread(tid: i32) -> Self {
        Self(PathBuf::from(format!("/proc/self/task/{tid}/stat")))
    }

    pub fn ticks(&self) -> Result<u64, CpuStatError> {
        let text = std::fs::read_to_string(&self.0).map_err(|source| CpuStatError::Read {
            path: self.0.display().to_string(),
            source,
        })?;
        parse_stat_ticks(&text)
    }
}

/// `sysconf(_SC_CLK_TCK)`: the unit of `/proc/…/stat`'s CPU times (100 where none is known).
pub fn clock_ticks_per_s() -> u64 {
    match rustix::param::clock_ticks_per_second() {
        0 => 100,
        t => t,
    }
}

pub(super) fn envoy_version(bin: &Path) -> String {
    std::process::Command::new(bin)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        // "<sha>/1.40.0/Clean/RELEASE/BoringSSL": keep the release.
        .and_then(|s| s.rsplit_once("version: ").map(|(_, v)| v.to_string()))
        .map(|v| v.split('/').nth(1).unwrap_or(&v).to_string())
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn stat_ticks_are_utime_plus_stime() {
        let line = "4242 (kv (router) x) S 1 4242 4242 0 -1 4194560 2000 0 0 0 \
                    1234 56 0 0 20 0 9 0 100 1000000 500 18446744073709551615";
        assert_eq!(parse_stat_ticks(line).unwrap(), 1290);
        assert!(matches!(
            parse_stat_ticks("1 (x) S 1 2"),
            Err(CpuStatError::Malformed)
        ));
        assert!(parse_stat_ticks("no parenthesis").is_err());
    }

    /// A thread's own id names its `/proc/self/task/<tid>/stat` (the no-op processor's CPU).
    #[test]
    fn own_thread_stat_is_found_by_its_tid() {
        let tid = std::thread::spawn(|| {
            let tid = rustix::thread::gettid().as_raw_nonzero().get();
            CpuSource::own_thread(tid).ticks().map(|_| tid)
        })
        .join()
        .unwrap();
        assert!(
            tid.as_ref().is_ok_and(|&t| t != std::process::id() as i32),
            "{tid:?}"
        );
    }

    /// USER_HZ, the unit of `/proc/…/stat`, is 100 on these architectures.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    #[test]
    fn clock_ticks_are_user_hz() {
        assert_eq!(clock_ticks_per_s(), 100);
    }

    #[test]
    fn own_process_stat_parses() {
        let me = CpuSource::process(std::process::id());
        let a = me.ticks().unwrap();
        let t = Instant::now();
        let mut x = 0u64;
        // Spins until a tick is charged: a loaded machine may give this thread little CPU.
        while me.ticks().unwrap() == a {
            x = x.wrapping_add(std::hint::black_box(1));
            assert!(t.elapsed() < Duration::from_secs(10), "no CPU tick in 10 s");
        }
        assert!(me.ticks().unwrap() > a, "{x}");
    }
}
