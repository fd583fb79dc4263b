//! A pod's identity, on its own so that every module can name pods without depending on the pod
//! registry (`pods` re-exports it).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use serde::Serialize;

/// A pod's identity: the `ip:port` Envoy knows it by.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PodId(Arc<str>);

impl PodId {
    /// Wraps an address string.
    pub fn new(s: impl Into<Arc<str>>) -> Self {
        Self(s.into())
    }

    /// The `ip:port` text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PodId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<SocketAddr> for PodId {
    fn from(addr: SocketAddr) -> Self {
        Self::new(addr.to_string())
    }
}
