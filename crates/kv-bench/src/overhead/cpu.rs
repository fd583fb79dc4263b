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

    pub(super) fn own_thread(tid: i32) -> Self {
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

pub fn clock_ticks_per_s() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
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
