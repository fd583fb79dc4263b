//! Load datagrams (`load_peers_bind`): each decision's load goes from the deciding replica
//! straight to every other replica in one UDP datagram, sent from the commit itself, so it
//! neither waits for a task nor queues in Redis behind the records' block keys (on a busy Redis
//! the load stream's `XADD` took ~10 ms at p50, where the simulator needs about 1 ms:
//! docs/results.md, "Load datagrams between replicas").
//!
//! - Each replica binds a UDP socket and, every [`HEARTBEAT`], writes its address and a signing
//!   key (random, per process) with an expiry ([`TTL_MS`]) to the hash `P:peers`, and reads the
//!   others' from it.
//! - A datagram carries one load, or one load's release (the deciding replica saw the pod's
//!   response start, or the request end), as a load-stream entry does, signed with HMAC-SHA256
//!   (the tag cut to [`TAG`] bytes) under the sender's key. Only a datagram signed by a replica listed in
//!   `P:peers` counts, and the first copy of a load (datagram, stream entry or record) is
//!   charged, the others skipped: a replay changes nothing, and one older than
//!   `mirror_max_lag_ms` is not charged.
//! - Best effort: a lost datagram is charged from the load stream or the record.
//!
//! Who may call: anyone who reaches the port, but only datagrams signed with a key listed in
//! `P:peers` (the same Redis access as writing the load stream) are charged; the rest are counted
//! and dropped. Cost: one fixed buffer of [`MAX_DATAGRAM`] bytes and one HMAC per datagram;
//! nothing is kept per sender.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket as StdUdpSocket};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use hmac::{Hmac, Mac};
use redis::{ConnectionAddr, IntoConnectionInfo};
use sha2::Sha256;
use tokio::net::UdpSocket;

use super::announced::{Announced, Kind};
use super::metrics::PeerDrop;
use super::state::Shared;
use super::stream::{MAX_CHARGE_MS, MAX_CHARGE_TOKENS, MAX_POD};
use crate::config::RedisConfig;
use crate::index::IndexError;
use crate::pods::PodId;

type Signer = Hmac<Sha256>;
pub(super) type Key = [u8; 32];

/// First bytes of a datagram of format version 2, the one sent: version 1 (still read, from
/// older replicas) with the message's kind ([`Kind::code`]) after the five words.
const MAGIC: &[u8; 4] = b"KVL2";
const MAGIC_V1: &[u8; 4] = b"KVL1";
/// Magic, five u64 (origin, sequence, commit µs, uncached tokens, prefill ms), kind u8, pod
/// length u16.
const HEAD: usize = 4 + 5 * 8 + 1 + 2;
const HEAD_V1: usize = HEAD - 1;
/// Bytes of the HMAC-SHA256 tag kept (128 bits).
const TAG: usize = 16;
/// The largest datagram a replica sends or reads.
pub(super) const MAX_DATAGRAM: usize = HEAD + MAX_POD + TAG;
/// How often a replica renews its entry in `P:peers` and reads the others'.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// An entry not renewed for this long is no longer sent to (and is removed).
const TTL_MS: u64 = 5_000;
/// The soonest `P:peers` is read again after a datagram from an unknown replica.
const REFRESH: Duration = Duration::from_millis(100);
/// Datagrams one decision takes from the socket at most before it reads the load (each costs
/// one HMAC, about a microsecond; the receiving task takes the rest).
const DRAIN_MAX: usize = 64;
/// Replicas sent to at most (further entries are ignored).
const MAX_PEERS: usize = 64;

/// Another replica taking load datagrams.
#[derive(Debug, Clone, PartialEq)]
struct Peer {
    origin: u64,
    addr: SocketAddr,
    key: Key,
}

/// This replica's datagram socket, its signing key and the other replicas it knows.
pub(super) struct Peers {
    origin: u64,
    key: Key,
    socket: UdpSocket,
    /// The same socket for [`Self::drain`]: read directly, not through tokio's readiness, which
    /// only the runtime's I/O driver sets (a busy runtime sets it late).
    direct: StdUdpSocket,
    known: ArcSwap<Vec<Peer>>,
    /// A datagram came from a replica not known yet (one that just started): read `P:peers`
    /// again before the next heartbeat.
    refresh: tokio::sync::Notify,
}

impl Peers {
    /// Binds `load_peers_bind` (none when empty, or when it cannot be bound: the load stream
    /// still carries the loads, and the reason is logged).
    pub(super) fn bind(cfg: &RedisConfig, origin: u64) -> Option<Arc<Self>> {
        if cfg.load_peers_bind.is_empty() {
            return None;
        }
        let socket = cfg
            .load_peers_bind
            .parse::<SocketAddr>()
            .map_err(|e| e.to_string())
            .and_then(|a| StdUdpSocket::bind(a).map_err(|e| e.to_string()))
            .and_then(|s| {
                s.set_nonblocking(true).map_err(|e| e.to_string())?;
                let direct = s.try_clone().map_err(|e| e.to_string())?;
                Ok((UdpSocket::from_std(s).map_err(|e| e.to_string())?, direct))
            });
        match socket {
            Ok((socket, direct)) => Some(Arc::new(Self {
                origin,
                key: rand::random(),
                socket,
                direct,
                known: ArcSwap::from_pointee(Vec::new()),
                refresh: tokio::sync::Notify::new(),
            })),
            Err(e) => {
                tracing::warn!(bind = %cfg.load_peers_bind, error = %e,
                    "load datagrams off: cannot bind load_peers_bind; loads travel on the load stream");
                None
            }
        }
    }

    /// Where this replica receives datagrams.
    pub(super) fn local_addr(&self) -> Option<SocketAddr> {
        self.socket.local_addr().ok()
    }

    /// Sends `a` to every other replica known (never waits: a full socket buffer drops the
    /// datagram, counted, and the load stream and record still carry the load).
    pub(super) fn send(&self, shared: &Shared, a: &Announced) {
        let peers = self.known.load();
        if peers.is_empty() {
            return;
        }
        let Some(datagram) = seal(a, &self.key) else {
            return;
        };
        for p in peers.iter() {
            match self.socket.try_send_to(&datagram, p.addr) {
                Ok(_) => {
                    shared.metrics.load_peer_sent.inc();
                }
                Err(_) => shared.metrics.load_peer_dropped(PeerDrop::SendFailed),
            }
        }
    }

    /// Renews this replica's entry in `P:peers` (when it has an address to give) and takes the
    /// others' from it.
    async fn exchange(&self, shared: &Shared, addr: Option<SocketAddr>) -> Result<(), IndexError> {
        let key = shared.schema.peers();
        let now_ms = Shared::wall_now_us() / 1_000;
        let mut pipe = redis::pipe();
        if let Some(addr) = addr {
            let entry = format!("{addr} {} {}", hex(&self.key), now_ms + TTL_MS);
            pipe.hset(&key, format!("{:016x}", self.origin), entry)
                .ignore();
        }
        pipe.hgetall(&key);
        let mut con = shared.conn.load_writes().await?;
        let (all,): (HashMap<String, String>,) =
            tokio::time::timeout(HEARTBEAT, pipe.query_async(&mut con))
                .await
                .map_err(|_| IndexError::Timeout(HEARTBEAT))?
                .map_err(|e| super::conn::to_index_error(&e))?;
        let (live, stale) = parse_peers(&all, self.origin, now_ms);
        shared.metrics.load_peers.set(live.len() as i64);
        self.known.store(Arc::new(live));
        if !stale.is_empty() {
            let _: Result<(), _> = redis::cmd("HDEL")
                .arg(&key)
                .arg(stale)
                .query_async(&mut con)
                .await;
        }
        Ok(())
    }
}

/// Keeps this replica listed in `P:peers` and its list of the others current; runs for the
/// process's life (errors are counted, and the list kept, until Redis answers again).
pub(super) async fn heartbeat(shared: Arc<Shared>, peers: Arc<Peers>, cfg: Arc<RedisConfig>) {
    let mut tick = tokio::time::interval(HEARTBEAT);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut addr = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // At most every REFRESH, however many unknown datagrams arrive.
            _ = peers.refresh.notified() => tokio::time::sleep(REFRESH).await,
        }
        if addr.is_none() {
            addr = advertised(&cfg, peers.local_addr()).await;
        }
        if let Err(e) = peers.exchange(&shared, addr).await {
            tracing::debug!(error = %e, "load peers: redis exchange failed; retrying");
            shared.metrics.mirror_errors.inc();
        }
    }
}

/// Receives the other replicas' datagrams, handing each verified load to `charge` with its age
/// (`charge` answers whether it was this load's first copy here).
pub(super) async fn receive(
    shared: Arc<Shared>,
    peers: Arc<Peers>,
    charge: impl Fn(Announced, Duration) -> bool,
) {
    // One byte more than the largest datagram: a longer one shows as too long, not cut to fit.
    let mut buf = vec![0u8; MAX_DATAGRAM + 1];
    loop {
        match peers.socket.recv_from(&mut buf).await {
            Ok((n, _)) => peers.take(&shared, &buf[..n], &charge),
            Err(e) => {
                tracing::debug!(error = %e, "load peers: receive failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

impl Peers {
    /// Takes every datagram already waiting (at most [`DRAIN_MAX`]) without waiting. A decision
    /// calls this before it reads the pods' load, so a load that reached this host before the
    /// decision began is counted even when the receiving task has not run yet (a busy runtime,
    /// or a process just given the CPU back: 10-20 ms at p99 measured on 2 cores).
    pub(super) fn drain(&self, shared: &Shared, charge: impl Fn(Announced, Duration) -> bool) {
        let mut buf = [0u8; MAX_DATAGRAM + 1];
        for _ in 0..DRAIN_MAX {
            match self.direct.recv_from(&mut buf) {
                Ok((n, _)) => self.take(shared, &buf[..n], &charge),
                Err(_) => return,
            }
        }
    }

    /// Verifies one datagram and charges its load, or counts why it was refused.
    fn take(&self, shared: &Shared, d: &[u8], charge: &impl Fn(Announced, Duration) -> bool) {
        let known = self.known.load();
        let key_of = |origin| known.iter().find(|p| p.origin == origin).map(|p| p.key);
        match open(d, key_of) {
            Ok(a) => {
                let age = Duration::from_micros(Shared::wall_now_us().saturating_sub(a.wall_us));
                shared.metrics.load_peer_lag.observe(age.as_secs_f64());
                // Releases are counted apart (`load_releases`).
                let load = !matches!(a.kind, Kind::Released(_));
                if charge(a, age) && load {
                    shared.metrics.load_peer_charges.inc();
                }
            }
            Err(why) => {
                if why == PeerDrop::UnknownSender {
                    self.refresh.notify_one();
                }
                shared.metrics.load_peer_dropped(why);
            }
        }
    }
}

/// The address the other replicas send to: `load_peers_advertise`, else the bound address
/// unless it is unspecified, else this host's address on the route to Redis (no packet is
/// sent: a UDP `connect` only picks the route) with the bound port.
async fn advertised(cfg: &RedisConfig, bound: Option<SocketAddr>) -> Option<SocketAddr> {
    let bound = bound?;
    if let Some(a) = &cfg.load_peers_advertise {
        return a
            .parse::<SocketAddr>()
            .ok()
            .or_else(|| Some(SocketAddr::new(a.parse().ok()?, bound.port())));
    }
    if !bound.ip().is_unspecified() {
        return Some(bound);
    }
    let seed = match cfg.url.as_str().into_connection_info().ok()?.addr() {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            format!(
                "{}:{port}",
                host.trim_start_matches('[').trim_end_matches(']')
            )
        }
        // A local socket: the replicas share this host.
        _ => return Some(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), bound.port())),
    };
    let redis = tokio::net::lookup_host(seed.as_str())
        .await
        .ok()?
        .find(|a| a.is_ipv4() == bound.is_ipv4())?;
    let any: IpAddr = if redis.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let probe = StdUdpSocket::bind(SocketAddr::new(any, 0)).ok()?;
    probe.connect(redis).ok()?;
    let ip = probe.local_addr().ok()?.ip();
    let addr = SocketAddr::new(ip, bound.port());
    tracing::info!(%addr, "load peers: advertising this address to the other replicas");
    Some(addr)
}

/// `a` as a signed datagram; none for a pod name longer than any datagram carries.
pub(super) fn seal(a: &Announced, key: &Key) -> Option<Vec<u8>> {
    let pod = a.pod.as_str().as_bytes();
    if pod.is_empty() || pod.len() > MAX_POD {
        return None;
    }
    let mut d = Vec::with_capacity(HEAD + pod.len() + TAG);
    d.extend_from_slice(MAGIC);
    for v in [a.origin, a.seq, a.wall_us, a.uncached_tokens, a.prefill_ms] {
        d.extend_from_slice(&v.to_be_bytes());
    }
    d.push(a.kind.code());
    d.extend_from_slice(&(pod.len() as u16).to_be_bytes());
    d.extend_from_slice(pod);
    let tag = signer(key).chain_update(&d).finalize().into_bytes();
    d.extend_from_slice(&tag[..TAG]);
    Some(d)
}

/// The load in datagram `d`, if it is well formed and signed by the replica it names (`key_of`
/// gives a known replica's key), within the bounds a record has.
fn open(d: &[u8], key_of: impl Fn(u64) -> Option<Key>) -> Result<Announced, PeerDrop> {
    let head = match d.get(..4) {
        Some(m) if m == MAGIC => HEAD,
        Some(m) if m == MAGIC_V1 => HEAD_V1,
        _ => return Err(PeerDrop::Malformed),
    };
    if d.len() < head + TAG {
        return Err(PeerDrop::Malformed);
    }
    let word = |i: usize| {
        let at = 4 + 8 * i;
        u64::from_be_bytes(d[at..at + 8].try_into().expect("8 bytes"))
    };
    let kind = match head {
        HEAD => Kind::from_code(d[4 + 5 * 8]).ok_or(PeerDrop::Malformed)?,
        _ => Kind::Load,
    };
    let pod_len = u16::from_be_bytes([d[head - 2], d[head - 1]]) as usize;
    if pod_len == 0 || pod_len > MAX_POD || d.len() != head + pod_len + TAG {
        return Err(PeerDrop::Malformed);
    }
    let origin = word(0);
    let key = key_of(origin).ok_or(PeerDrop::UnknownSender)?;
    let (body, tag) = d.split_at(head + pod_len);
    signer(&key)
        .chain_update(body)
        .verify_truncated_left(tag)
        .map_err(|_| PeerDrop::BadSignature)?;
    let pod = std::str::from_utf8(&body[head..]).map_err(|_| PeerDrop::Malformed)?;
    let (uncached_tokens, prefill_ms) = (word(3), word(4));
    if uncached_tokens > MAX_CHARGE_TOKENS || prefill_ms > MAX_CHARGE_MS {
        return Err(PeerDrop::Malformed);
    }
    Ok(Announced {
        origin,
        seq: word(1),
        pod: PodId::new(pod),
        wall_us: word(2),
        uncached_tokens,
        prefill_ms,
        kind,
    })
}

fn signer(key: &Key) -> Signer {
    Signer::new_from_slice(key).expect("HMAC takes a key of any length")
}

/// The live entries of `P:peers` other than `own`, and the fields of expired ones.
fn parse_peers(all: &HashMap<String, String>, own: u64, now_ms: u64) -> (Vec<Peer>, Vec<String>) {
    let (mut live, mut stale) = (Vec::new(), Vec::new());
    for (field, entry) in all {
        let Some(origin) = (field.len() == 16)
            .then(|| u64::from_str_radix(field, 16).ok())
            .flatten()
        else {
            continue;
        };
        let mut parts = entry.split(' ');
        let (Some(addr), Some(key), Some(expiry), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (Ok(addr), Some(key), Ok(expiry)) = (addr.parse(), unhex(key), expiry.parse::<u64>())
        else {
            continue;
        };
        if expiry < now_ms {
            stale.push(field.clone());
        } else if origin != own && live.len() < MAX_PEERS {
            live.push(Peer { origin, addr, key });
        }
    }
    live.sort_by_key(|p| p.origin);
    (live, stale)
}

fn hex(key: &Key) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn unhex(s: &str) -> Option<Key> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut key = [0u8; 32];
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(key)
}

#[cfg(test)]
mod tests {
    use super::super::announced::tests::announced;
    use super::*;

    #[test]
    fn a_sealed_load_opens_with_its_senders_key_only() {
        let (key, other): (Key, Key) = ([7; 32], [8; 32]);
        let a = announced();
        let d = seal(&a, &key).unwrap();
        assert!(d.len() <= MAX_DATAGRAM);
        assert_eq!(open(&d, |o| (o == 0xabc).then_some(key)), Ok(a.clone()));
        assert_eq!(open(&d, |_| None), Err(PeerDrop::UnknownSender));
        assert_eq!(open(&d, |_| Some(other)), Err(PeerDrop::BadSignature));
        // Any byte changed, the signature fails (or the frame no longer parses).
        for i in 0..d.len() {
            let mut bad = d.clone();
            bad[i] ^= 0x01;
            assert!(open(&bad, |_| Some(key)).is_err(), "byte {i} flipped");
        }
        for cut in [0, 3, HEAD, d.len() - 1] {
            assert_eq!(open(&d[..cut], |_| Some(key)), Err(PeerDrop::Malformed));
        }
        let mut long = d.clone();
        long.push(0);
        assert_eq!(open(&long, |_| Some(key)), Err(PeerDrop::Malformed));
    }

    #[test]
    fn every_kind_travels_and_an_older_replicas_datagram_is_a_plain_load() {
        let key = [7; 32];
        for c in 0..4 {
            let a = Announced {
                kind: Kind::from_code(c).unwrap(),
                ..announced()
            };
            assert_eq!(open(&seal(&a, &key).unwrap(), |_| Some(key)), Ok(a));
        }
        // Version 1: no kind byte.
        let a = announced();
        let mut v1 = MAGIC_V1.to_vec();
        for w in [a.origin, a.seq, a.wall_us, a.uncached_tokens, a.prefill_ms] {
            v1.extend_from_slice(&w.to_be_bytes());
        }
        let pod = a.pod.as_str().as_bytes();
        v1.extend_from_slice(&(pod.len() as u16).to_be_bytes());
        v1.extend_from_slice(pod);
        let tag = signer(&key).chain_update(&v1).finalize().into_bytes();
        v1.extend_from_slice(&tag[..TAG]);
        let old = open(&v1, |_| Some(key)).unwrap();
        assert_eq!(old.kind, Kind::Load);
        assert_eq!(old.uncached_tokens, a.uncached_tokens);
        // A kind this replica does not know is refused, however well signed.
        let mut unknown = seal(&a, &key).unwrap();
        unknown.truncate(unknown.len() - TAG);
        unknown[4 + 5 * 8] = 9;
        let tag = signer(&key).chain_update(&unknown).finalize().into_bytes();
        unknown.extend_from_slice(&tag[..TAG]);
        assert_eq!(open(&unknown, |_| Some(key)), Err(PeerDrop::Malformed));
    }

    #[test]
    fn loads_past_a_records_bounds_are_refused_even_when_signed() {
        let key = [7; 32];
        for a in [
            Announced {
                uncached_tokens: MAX_CHARGE_TOKENS + 1,
                ..announced()
            },
            Announced {
                prefill_ms: MAX_CHARGE_MS + 1,
                ..announced()
            },
        ] {
            assert_eq!(
                open(&seal(&a, &key).unwrap(), |_| Some(key)),
                Err(PeerDrop::Malformed)
            );
        }
        let long = Announced {
            pod: PodId::new("x".repeat(MAX_POD + 1).as_str()),
            ..announced()
        };
        assert_eq!(seal(&long, &key), None, "never sent");
    }

    #[test]
    fn the_peer_list_keeps_live_others_and_names_the_expired() {
        let key = [9u8; 32];
        let entry = |addr: &str, expiry: u64| format!("{addr} {} {expiry}", hex(&key));
        let all: HashMap<String, String> = [
            (format!("{:016x}", 1), entry("10.0.0.1:9004", 2_000)),
            (format!("{:016x}", 2), entry("10.0.0.2:9004", 500)),
            (format!("{:016x}", 3), entry("10.0.0.3:9004", 2_000)),
            ("short".into(), entry("10.0.0.4:9004", 2_000)),
            (format!("{:016x}", 5), "10.0.0.5:9004 nothex 2000".into()),
            (
                format!("{:016x}", 6),
                format!("{} extra", entry("10.0.0.6:1", 2_000)),
            ),
        ]
        .into_iter()
        .collect();
        let (live, stale) = parse_peers(&all, 3, 1_000);
        assert_eq!(
            live,
            vec![Peer {
                origin: 1,
                addr: "10.0.0.1:9004".parse().unwrap(),
                key
            }]
        );
        assert_eq!(stale, vec![format!("{:016x}", 2)]);
        assert_eq!(unhex(&hex(&key)), Some(key));
        assert_eq!(unhex("é".repeat(32).as_str()), None);
    }

    #[tokio::test]
    async fn a_replica_advertises_its_route_to_redis_unless_told() {
        let cfg = |advertise: Option<&str>| RedisConfig {
            url: "redis://127.0.0.1:6379".into(),
            load_peers_advertise: advertise.map(str::to_string),
            ..RedisConfig::default()
        };
        let any: SocketAddr = "0.0.0.0:9004".parse().unwrap();
        assert_eq!(
            advertised(&cfg(None), Some(any)).await,
            Some("127.0.0.1:9004".parse().unwrap())
        );
        assert_eq!(
            advertised(&cfg(Some("10.1.2.3")), Some(any)).await,
            Some("10.1.2.3:9004".parse().unwrap())
        );
        assert_eq!(
            advertised(&cfg(Some("10.1.2.3:7000")), Some(any)).await,
            Some("10.1.2.3:7000".parse().unwrap())
        );
        let bound: SocketAddr = "127.0.0.2:9004".parse().unwrap();
        assert_eq!(advertised(&cfg(None), Some(bound)).await, Some(bound));
    }
}
