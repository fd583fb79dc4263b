//! Connections to the shared index: multiplexed connections that reconnect by themselves (a
//! standalone server) or a cluster connection routed by hash slot. Concurrent requests on one
//! multiplexed connection are pipelined by the client, so a batch of writes is one round trip.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::TcpSettings;
use redis::{
    ClientTlsConfig, Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, TlsCertificates,
    Value,
};
use tokio::sync::OnceCell;

use super::super::IndexError;
use crate::config::{RedisConfig, RedisMode};

/// How a connection attempt or a request may wait at most (the callers' budgets are shorter).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Open connections of one router to the shared index.
pub(super) enum Conn {
    /// One server: `lookups` spread over `pool_size` connections, writes on their own, the
    /// mirror's blocking stream reads on a third, and the load stream's on two more.
    Single {
        lookups: Vec<ConnectionManager>,
        next: AtomicUsize,
        writes: ConnectionManager,
        mirror: ConnectionManager,
        /// The load stream's writes, and its blocking reads: neither waits behind anything.
        load_writes: ConnectionManager,
        load_reads: ConnectionManager,
    },
    /// Redis Cluster: connected on first use (and retried after a failure); the mirror's
    /// blocking reads get connections of their own.
    Cluster {
        client: Box<ClusterClient>,
        conn: OnceCell<ClusterConnection>,
        mirror: OnceCell<ClusterConnection>,
        load_reads: OnceCell<ClusterConnection>,
    },
}

/// One connection to send requests on.
#[derive(Clone)]
pub(super) enum Handle {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Handle {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Handle::Single(c) => c.req_packed_command(cmd),
            Handle::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Handle::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Handle::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Handle::Single(c) => c.get_db(),
            Handle::Cluster(c) => c.get_db(),
        }
    }
}

/// Every connection's socket: `TCP_NODELAY`, which the client leaves off. Without it a small
/// command sent while an earlier reply's ACK is outstanding waits for that ACK, up to the
/// peer's 40 ms delayed-ACK timer (one replica's load reached another in 11.5 ms p50, idle).
fn tcp() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

/// The connection details of `url` with the configured credentials (which win over any in
/// the URL), on [`tcp`] sockets.
fn connection_info(
    url: &str,
    username: Option<&str>,
    password: Option<&str>,
) -> Result<redis::ConnectionInfo, String> {
    let info = url
        .into_connection_info()
        .map_err(|e| format!("index.redis.url: {}", e.kind_description()))?;
    let mut settings = info.redis_settings().clone();
    if let Some(u) = username {
        settings = settings.set_username(u);
    }
    if let Some(p) = password {
        settings = settings.set_password(p);
    }
    Ok(info.set_redis_settings(settings).set_tcp_settings(tcp()))
}

trait KindDescription {
    fn kind_description(&self) -> String;
}

impl KindDescription for RedisError {
    /// The error without its detail, which may quote the URL (and so a password).
    fn kind_description(&self) -> String {
        format!("{:?}", self.kind())
    }
}

/// The CA and client certificate of `cfg`, read at startup (`None`: system defaults).
fn tls_certificates(cfg: &RedisConfig) -> Result<Option<TlsCertificates>, String> {
    let read = |key: &str, path: &Option<String>| -> Result<Option<Vec<u8>>, String> {
        path.as_ref()
            .map(|p| {
                std::fs::read(p).map_err(|e| format!("index.redis.{key}: cannot read {p}: {e}"))
            })
            .transpose()
    };
    let root_cert = read("tls_ca_file", &cfg.tls_ca_file)?;
    let client_tls = match (
        read("tls_cert_file", &cfg.tls_cert_file)?,
        read("tls_key_file", &cfg.tls_key_file)?,
    ) {
        (Some(client_cert), Some(client_key)) => Some(ClientTlsConfig {
            client_cert,
            client_key,
        }),
        _ => None,
    };
    Ok(
        (root_cert.is_some() || client_tls.is_some()).then_some(TlsCertificates {
            client_tls,
            root_cert,
        }),
    )
}

impl Conn {
    /// Connections for `cfg` (nothing is dialled yet: the first request connects).
    pub(super) fn open(cfg: &RedisConfig, password: Option<&str>) -> Result<Self, String> {
        let username = cfg.username.as_deref();
        let tls = tls_certificates(cfg)?;
        match cfg.mode {
            RedisMode::Standalone => {
                let info = connection_info(&cfg.url, username, password)?;
                let client = match tls {
                    Some(certs) => redis::Client::build_with_tls(info, certs),
                    None => redis::Client::open(info),
                }
                .map_err(|e| format!("index.redis.url: {}", e.kind_description()))?;
                let manager = || {
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(CONNECT_TIMEOUT))
                        .set_response_timeout(Some(CONNECT_TIMEOUT))
                        .set_min_delay(Duration::from_millis(50))
                        .set_max_delay(Duration::from_secs(2))
                        .set_number_of_retries(2);
                    ConnectionManager::new_lazy_with_config(client.clone(), config)
                        .map_err(|e| format!("index.redis: {}", e.kind_description()))
                };
                let lookups = (0..cfg.pool_size.max(1))
                    .map(|_| manager())
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Conn::Single {
                    lookups,
                    next: AtomicUsize::new(0),
                    writes: manager()?,
                    mirror: manager()?,
                    load_writes: manager()?,
                    load_reads: manager()?,
                })
            }
            RedisMode::Cluster => {
                let nodes = std::iter::once(&cfg.url)
                    .chain(&cfg.cluster_seeds)
                    .map(|u| connection_info(u, username, password))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut builder = ClusterClient::builder(nodes)
                    .connection_timeout(CONNECT_TIMEOUT)
                    .response_timeout(CONNECT_TIMEOUT)
                    .tcp_settings(tcp())
                    .retries(2);
                if let Some(certs) = tls {
                    builder = builder.certs(certs);
                }
                let client = builder
                    .build()
                    .map_err(|e| format!("index.redis: {}", e.kind_description()))?;
                Ok(Conn::Cluster {
                    client: Box::new(client),
                    conn: OnceCell::new(),
                    mirror: OnceCell::new(),
                    load_reads: OnceCell::new(),
                })
            }
        }
    }

    /// A connection for a lookup.
    pub(super) async fn lookup(&self) -> Result<Handle, IndexError> {
        match self {
            Conn::Single { lookups, next, .. } => {
                let i = next.fetch_add(1, Ordering::Relaxed) % lookups.len();
                Ok(Handle::Single(lookups[i].clone()))
            }
            Conn::Cluster { .. } => self.cluster().await,
        }
    }

    /// The connection writes go through (in order).
    pub(super) async fn write(&self) -> Result<Handle, IndexError> {
        match self {
            Conn::Single { writes, .. } => Ok(Handle::Single(writes.clone())),
            Conn::Cluster { .. } => self.cluster().await,
        }
    }

    /// The connection the mirror's blocking stream reads go through (a blocked read holds up
    /// everything behind it on its connection, so it shares none).
    pub(super) async fn mirror(&self) -> Result<Handle, IndexError> {
        match self {
            Conn::Single { mirror, .. } => Ok(Handle::Single(mirror.clone())),
            Conn::Cluster { client, mirror, .. } => mirror
                .get_or_try_init(|| client.get_async_connection())
                .await
                .map(|c| Handle::Cluster(c.clone()))
                .map_err(|e| to_index_error(&e)),
        }
    }

    /// The connection the load stream's entries are added on (the cluster's shared one: its
    /// requests are not serialised behind each other's replies).
    pub(super) async fn load_writes(&self) -> Result<Handle, IndexError> {
        match self {
            Conn::Single { load_writes, .. } => Ok(Handle::Single(load_writes.clone())),
            Conn::Cluster { .. } => self.cluster().await,
        }
    }

    /// The connection the load stream's blocking reads go through.
    pub(super) async fn load_reads(&self) -> Result<Handle, IndexError> {
        match self {
            Conn::Single { load_reads, .. } => Ok(Handle::Single(load_reads.clone())),
            Conn::Cluster {
                client, load_reads, ..
            } => load_reads
                .get_or_try_init(|| client.get_async_connection())
                .await
                .map(|c| Handle::Cluster(c.clone()))
                .map_err(|e| to_index_error(&e)),
        }
    }

    async fn cluster(&self) -> Result<Handle, IndexError> {
        let Conn::Cluster { client, conn, .. } = self else {
            unreachable!("called for cluster connections only");
        };
        conn.get_or_try_init(|| client.get_async_connection())
            .await
            .map(|c| Handle::Cluster(c.clone()))
            .map_err(|e| to_index_error(&e))
    }
}

/// An index error for a Redis error, without the server's text when it could quote data.
pub(super) fn to_index_error(e: &RedisError) -> IndexError {
    use redis::ErrorKind as K;
    if e.is_timeout() {
        return IndexError::Timeout(CONNECT_TIMEOUT);
    }
    if e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error() {
        return IndexError::Connection(e.kind_description());
    }
    match e.kind() {
        K::AuthenticationFailed | K::InvalidClientConfig => {
            IndexError::Refused(e.kind_description())
        }
        K::ClusterConnectionNotFound => IndexError::Connection(e.kind_description()),
        K::Server(_) => match e.code() {
            Some("OOM") | Some("BUSY") | Some("LOADING") | Some("TRYAGAIN")
            | Some("CLUSTERDOWN") | Some("MASTERDOWN") => {
                IndexError::Overloaded(e.code().unwrap_or_default().to_string())
            }
            Some("NOAUTH") | Some("WRONGPASS") | Some("NOPERM") => {
                IndexError::Refused(e.code().unwrap_or_default().to_string())
            }
            Some("MOVED") | Some("ASK") => IndexError::Connection("slot moved".into()),
            code => IndexError::Protocol(code.unwrap_or("server error").to_string()),
        },
        _ => IndexError::Protocol(e.kind_description()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_connection_sends_small_commands_without_waiting_for_acks() {
        for url in [
            "redis://127.0.0.1:6379",
            "rediss://u:p@redis.example:6380/2",
        ] {
            let info = connection_info(url, None, None).unwrap();
            assert!(info.tcp_settings().nodelay(), "{url}");
        }
    }

    #[test]
    fn credentials_come_from_the_config_and_bad_urls_never_echo_secrets() {
        let info = connection_info("redis://127.0.0.1:1/3", Some("router"), Some("pw")).unwrap();
        assert_eq!(info.redis_settings().username(), Some("router"));
        assert_eq!(info.redis_settings().password(), Some("pw"));
        let err = connection_info("redis://u:hunter2@[bad", None, None).unwrap_err();
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[tokio::test]
    async fn opening_dials_nothing() {
        let cfg = RedisConfig {
            url: "redis://127.0.0.1:1".into(),
            ..RedisConfig::default()
        };
        assert!(Conn::open(&cfg, None).is_ok());
        let cluster = RedisConfig {
            mode: RedisMode::Cluster,
            ..cfg
        };
        let conn = Conn::open(&cluster, None).unwrap();
        assert!(conn.lookup().await.is_err(), "nobody listens on port 1");
    }
}
