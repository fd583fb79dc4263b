//! Connection caps tied to the process's file-descriptor limit. Under `ulimit -n 1024`, 2,000
//! preface-only gRPC connections under the default cap of 10,000 held every descriptor: accepts
//! failed (EMFILE) and `/healthz` and the gRPC health checks with them. At start the soft
//! `RLIMIT_NOFILE` is raised to the hard one, and each port's cap is lowered to fit the rest:
//! with both ports full, [`RESERVED_FDS`] descriptors are still free for everything else.

use rustix::process::{getrlimit, setrlimit, Resource};
use serde::Serialize;
use tracing::{info, warn};

/// Descriptors kept out of both caps: Redis connections, the pods' metric scrapes and KV-event
/// sockets, the listeners, the runtime's own, tokenizer and config files.
pub const RESERVED_FDS: u64 = 256;

/// The admin port gets at most this share of the descriptors left for connections (1 / n).
const ADMIN_SHARE: u64 = 4;

/// The caps in force, as logged at start and shown in `/debug/pods`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ConnCaps {
    /// The soft `RLIMIT_NOFILE` after raising it (`None`: unlimited).
    pub nofile: Option<u64>,
    /// Descriptors kept for everything but the two ports' connections.
    pub reserved_fds: u64,
    /// gRPC connections open at once: `server.max_connections`, or fewer.
    pub grpc_max_connections: usize,
    /// Admin connections open at once.
    pub admin_max_connections: usize,
}

/// The caps for a soft limit of `nofile` descriptors: each port's configured cap, lowered so that
/// both together leave [`RESERVED_FDS`] free; the admin port takes at most a quarter of what is
/// left, the gRPC port the rest. At least one connection each, however low the limit.
pub fn caps(nofile: Option<u64>, grpc: usize, admin: usize) -> ConnCaps {
    let (grpc_max_connections, admin_max_connections) = match nofile {
        None => (grpc, admin),
        Some(limit) => {
            let free = limit.saturating_sub(RESERVED_FDS);
            let admin = admin.min(to_usize(free / ADMIN_SHARE)).max(1);
            let grpc = grpc.min(to_usize(free.saturating_sub(admin as u64))).max(1);
            (grpc, admin)
        }
    };
    ConnCaps {
        nofile,
        reserved_fds: RESERVED_FDS,
        grpc_max_connections,
        admin_max_connections,
    }
}

fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, then returns the caps (logged at info).
pub fn raise_and_cap(grpc: usize, admin: usize) -> ConnCaps {
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            warn!(error = %e, soft = ?limit.current, hard = ?limit.maximum, "could not raise the file-descriptor limit to its hard limit");
        }
    }
    let nofile = getrlimit(Resource::Nofile).current;
    let caps = caps(nofile, grpc, admin);
    if nofile.is_some_and(|n| n < RESERVED_FDS * 2) {
        warn!(
            nofile,
            "the file-descriptor limit is low: raise `ulimit -n` (the hard limit)"
        );
    }
    info!(
        nofile,
        reserved_fds = RESERVED_FDS,
        grpc_max_connections = caps.grpc_max_connections,
        admin_max_connections = caps.admin_max_connections,
        "connection caps"
    );
    caps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_caps_together_leave_the_reserve_free() {
        // `ulimit -n 1024`: 768 left, the admin port a quarter.
        let c = caps(Some(1024), 10_000, 512);
        assert_eq!(
            (c.grpc_max_connections, c.admin_max_connections),
            (576, 192)
        );
        let used = (c.grpc_max_connections + c.admin_max_connections) as u64;
        assert_eq!(used + RESERVED_FDS, 1024);
        // A high limit leaves the configured caps.
        let c = caps(Some(1 << 20), 10_000, 512);
        assert_eq!(
            (c.grpc_max_connections, c.admin_max_connections),
            (10_000, 512)
        );
        assert_eq!(caps(None, 900, 512).grpc_max_connections, 900);
        // A configured cap below what the limit allows stays.
        let c = caps(Some(4096), 900, 512);
        assert_eq!(
            (c.grpc_max_connections, c.admin_max_connections),
            (900, 512)
        );
        // Below the reserve: one connection each, never zero.
        let c = caps(Some(100), 10_000, 512);
        assert_eq!((c.grpc_max_connections, c.admin_max_connections), (1, 1));
    }
}
