//! ZMQ subscriber for one (pod, DP rank): a SUB socket on the pod's KV-event publisher and,
//! when configured, a DEALER on its replay socket. Runs on its own thread (libzmq sockets are
//! blocking) and hands ordered deliveries to the async side over a channel.
//!
//! Uses the `zmq` crate (libzmq 4.3, built from source by `zmq-sys`): libzmq reconnects on its
//! own and tolerates publisher restarts; the pure-Rust `zeromq` 0.4 SUB socket neither
//! reconnects nor survives a peer disconnect without hitting a `todo!()` panic.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::events::sequence::{SeqTracker, Verdict};
use zmq::SocketEvent::{DISCONNECTED, HANDSHAKE_SUCCEEDED};

/// Where to subscribe.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct SubscriptionSpec {
    /// PUB endpoint, e.g. `tcp://10.0.0.5:5557` (the subscriber connects).
    pub(crate) endpoint: String,
    /// ROUTER replay endpoint, if the pod runs one.
    pub(crate) replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (`""` = everything).
    pub(crate) topic: String,
}

/// Why a pod's state was purged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PurgeReason {
    /// Messages were lost and could not be replayed.
    Gap,
    /// The engine restarted (sequence went back).
    Restart,
}

/// What the subscriber thread hands over, in order.
#[derive(Debug)]
pub(crate) enum Delivery {
    /// A payload to decode and apply.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// The msgpack payload.
        payload: Vec<u8>,
        /// Whether it came from the replay socket.
        replayed: bool,
    },
    /// Drop everything known about this (pod, rank) before what follows.
    Purge(PurgeReason),
    /// A sequence gap was seen (counted whether or not replay healed it).
    GapSeen,
    /// A replay was attempted.
    Replay {
        /// It returned every missing message.
        complete: bool,
    },
    /// A message did not have the 3-frame shape.
    BadFrames,
}

/// Handle that stops the thread when dropped.
#[derive(Debug)]
pub(crate) struct SubscriberHandle {
    stop: Arc<AtomicBool>,
}

impl Drop for SubscriberHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Starts the subscriber thread; deliveries arrive on the returned channel.
pub(crate) fn spawn(
    spec: SubscriptionSpec,
    name: String,
) -> std::io::Result<(SubscriberHandle, mpsc::Receiver<Delivery>)> {
    let (tx, rx) = mpsc::channel(1024);
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = stop.clone();
    std::thread::Builder::new()
        .name(format!("kv-events {name}"))
        .spawn(move || run(spec, tx, thread_stop))?;
    Ok((SubscriberHandle { stop }, rx))
}

fn context() -> &'static zmq::Context {
    static CTX: std::sync::OnceLock<zmq::Context> = std::sync::OnceLock::new();
    CTX.get_or_init(zmq::Context::new)
}

fn run(spec: SubscriptionSpec, tx: mpsc::Sender<Delivery>, stop: Arc<AtomicBool>) {
    let Some(mut socket) = MonitoredSub::open(&spec) else {
        return;
    };
    let mut tracker = SeqTracker::default();
    let send = |d: Delivery| tx.blocking_send(d).is_ok();
    // Learn what the pod cached before this subscription (router restart, pod already warm, an
    // event published before the SUB joined): live messages only tell what happens next.
    socket.wait_connected(CONNECT_WAIT);
    match catch_up(&spec, &send) {
        Err(Closed) => return,
        Ok(Some(last)) => tracker.caught_up(last),
        Ok(None) => {}
    }
    while !stop.load(Ordering::Relaxed) {
        if socket.disconnected() {
            // libzmq does not reconnect after dropping a peer for an oversized message.
            debug!(endpoint = %spec.endpoint, "KV-event publisher disconnected; reconnecting");
            drop(socket);
            let Some(s) = MonitoredSub::open(&spec) else {
                return;
            };
            socket = s;
        }
        let frames = match socket.sub.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                debug!(error = %e, "KV-event receive failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let Some(seq) = frame_seq(&frames) else {
            if !send(Delivery::BadFrames) {
                return;
            }
            continue;
        };
        let payload = frames.into_iter().nth(2).expect("3 frames");
        let ok = match tracker.observe(seq) {
            Verdict::Duplicate => continue,
            Verdict::Apply => true,
            Verdict::Joined { to } => replay_into(&spec, 0, to, &send, false),
            Verdict::Gap { from, to } => {
                send(Delivery::GapSeen) && replay_into(&spec, from, to, &send, true)
            }
            Verdict::Restarted { to } => {
                send(Delivery::Purge(PurgeReason::Restart))
                    && replay_into(&spec, 0, to, &send, false)
            }
        };
        if !ok
            || !send(Delivery::Batch {
                seq,
                payload,
                replayed: false,
            })
        {
            return;
        }
    }
}

/// Largest KV-event message accepted (ZMQ_MAXMSGSIZE: libzmq drops the connection of a peer
/// that sends more). vLLM publishes one batch per engine step, and a step prefills at most
/// `max_num_batched_tokens` (8192 by default): about 40 KiB of token ids.
pub(crate) const MAX_MESSAGE_BYTES: i64 = 1 << 20;
/// Messages queued per subscription before libzmq drops new ones (the sequence gap is then
/// replayed or purged); with [`MAX_MESSAGE_BYTES`] this bounds a hostile publisher to 1 GiB.
const RECEIVE_HWM: i32 = 1_000;
/// How long a new subscription waits for its TCP connection before the catch-up replay.
const CONNECT_WAIT: Duration = Duration::from_secs(1);
/// A replay that sends nothing for this long has stopped (an engine streams its buffer without
/// pausing; a slow consumer only slows the stream, and its time does not count).
const REPLAY_IDLE: Duration = Duration::from_secs(2);
/// Longest a replay may take in all: a full 10,000-batch buffer applied behind a busy index
/// takes seconds (a 2-s limit on the whole replay cut catch-ups short and left the rest to be
/// replayed as a gap under live traffic).
const REPLAY_LIMIT: Duration = Duration::from_secs(60);

/// A SUB socket with a monitor that reports connects and disconnects.
struct MonitoredSub {
    sub: zmq::Socket,
    monitor: zmq::Socket,
    /// A disconnect read from the monitor while waiting for the connect.
    dropped: bool,
}

impl MonitoredSub {
    fn open(spec: &SubscriptionSpec) -> Option<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let open = || -> zmq::Result<Self> {
            let sub = sub_socket(spec)?;
            let addr = format!(
                "inproc://kv-sub-monitor-{}",
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let events = [DISCONNECTED, HANDSHAKE_SUCCEEDED]
                .iter()
                .fold(0, |m, e| m | i32::from(e.to_raw()));
            sub.monitor(&addr, events)?;
            let monitor = context().socket(zmq::PAIR)?;
            monitor.connect(&addr)?;
            Ok(Self {
                sub,
                monitor,
                dropped: false,
            })
        };
        open()
            .map_err(|e| warn!(endpoint = %spec.endpoint, error = %e, "cannot create KV-event subscriber"))
            .ok()
    }

    /// The next monitor event's raw id (frames: `[id u16 LE, value u32]`, endpoint), waiting
    /// up to `wait_ms`; 0 for an unreadable one.
    fn event(&self, wait_ms: i64) -> Option<u16> {
        if self.monitor.poll(zmq::POLLIN, wait_ms).ok()? == 0 {
            return None;
        }
        let frames = self.monitor.recv_multipart(zmq::DONTWAIT).ok()?;
        Some(match frames.first().and_then(|f| f.get(..2)) {
            Some(h) => u16::from_le_bytes([h[0], h[1]]),
            None => 0,
        })
    }

    /// Waits until the SUB's connection has finished its handshake, so the subscription is on
    /// its way to the publisher (or until `limit` passes).
    fn wait_connected(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.event(left.as_millis().max(1) as i64) {
                Some(e) if e == HANDSHAKE_SUCCEEDED.to_raw() => return,
                Some(e) => self.dropped |= e == DISCONNECTED.to_raw(),
                None => return,
            }
        }
    }

    /// Whether the publisher's connection dropped since the last call.
    fn disconnected(&mut self) -> bool {
        let mut any = std::mem::take(&mut self.dropped);
        while let Some(e) = self.event(0) {
            any |= e == DISCONNECTED.to_raw();
        }
        any
    }
}

fn sub_socket(spec: &SubscriptionSpec) -> zmq::Result<zmq::Socket> {
    let s = context().socket(zmq::SUB)?;
    s.set_rcvtimeo(250)?;
    s.set_reconnect_ivl(200)?;
    s.set_reconnect_ivl_max(2_000)?;
    s.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
    s.set_rcvhwm(RECEIVE_HWM)?;
    s.set_subscribe(spec.topic.as_bytes())?;
    s.connect(&spec.endpoint)?;
    Ok(s)
}

/// `[topic, seq (8 bytes BE), payload]` → seq.
fn frame_seq(frames: &[Vec<u8>]) -> Option<u64> {
    if frames.len() != 3 {
        return None;
    }
    Some(u64::from_be_bytes(frames[1].as_slice().try_into().ok()?))
}

/// Replays `from..to` into the channel. When it cannot (no replay socket, timeout, buffer no
/// longer reaching back far enough) and `purge_on_failure`, a purge is delivered instead.
/// Returns false when the receiver is gone.
fn replay_into(
    spec: &SubscriptionSpec,
    from: u64,
    to: u64,
    send: &impl Fn(Delivery) -> bool,
    purge_on_failure: bool,
) -> bool {
    if from >= to {
        return true;
    }
    let replayed = spec
        .replay_endpoint
        .as_deref()
        .and_then(|ep| match replay(ep, from, to) {
            Ok(batches) => Some(batches),
            Err(e) => {
                debug!(endpoint = ep, error = %e, "replay failed");
                None
            }
        });
    let complete = replayed.is_some();
    if spec.replay_endpoint.is_some() && !send(Delivery::Replay { complete }) {
        return false;
    }
    match replayed {
        Some(batches) => batches.into_iter().all(|(seq, payload)| {
            send(Delivery::Batch {
                seq,
                payload,
                replayed: true,
            })
        }),
        None if purge_on_failure => send(Delivery::Purge(PurgeReason::Gap)),
        None => true,
    }
}

/// Why a replay did not return everything.
#[derive(Debug, thiserror::Error)]
enum ReplayError {
    /// Socket error.
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// No end marker in time.
    #[error("no end marker before the deadline")]
    Timeout,
    /// The buffer no longer holds the first missing message.
    #[error("replay starts at {got}, needed {wanted}")]
    TooOld {
        /// First sequence number replayed.
        got: u64,
        /// First sequence number needed.
        wanted: u64,
    },
    /// A reply did not have either known layout.
    #[error("malformed replay reply")]
    Malformed,
}

const END_SEQ: [u8; 8] = [0xff; 8];

/// Asks a vLLM replay (ROUTER) socket for messages `from..to`; accepts both reply layouts
/// (with the topic frame, vLLM ≥ 0.26, and without).
fn replay(endpoint: &str, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, ReplayError> {
    let mut out = Vec::new();
    let mut first = None;
    replay_each(endpoint, from, |seq, payload| {
        first.get_or_insert(seq);
        if seq >= from && seq < to {
            out.push((seq, payload.to_vec()));
        }
        true
    })?;
    match first {
        Some(got) if got > from => Err(ReplayError::TooOld { got, wanted: from }),
        None if to > from => Err(ReplayError::TooOld {
            got: u64::MAX,
            wanted: from,
        }),
        _ if out.len() as u64 != to - from => Err(ReplayError::TooOld {
            got: first.unwrap_or(0),
            wanted: from,
        }),
        _ => Ok(out),
    }
}

/// Asks the replay socket for everything from `from` and hands each message to `each` until
/// the end marker, [`REPLAY_IDLE`] without a message, [`REPLAY_LIMIT`] in all, or `each`
/// returning false.
fn replay_each(
    endpoint: &str,
    from: u64,
    mut each: impl FnMut(u64, &[u8]) -> bool,
) -> Result<(), ReplayError> {
    let s = context().socket(zmq::DEALER)?;
    s.set_linger(0)?;
    s.set_rcvtimeo(200)?;
    s.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
    s.set_rcvhwm(RECEIVE_HWM)?;
    s.connect(endpoint)?;
    s.send_multipart([Vec::new(), from.to_be_bytes().to_vec()], 0)?;
    let limit = Instant::now() + REPLAY_LIMIT;
    let mut idle_until = Instant::now() + REPLAY_IDLE;
    loop {
        let now = Instant::now();
        if now > idle_until || now > limit {
            return Err(ReplayError::Timeout);
        }
        let frames = match s.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => return Err(e.into()),
        };
        // [b"", topic, seq, payload] (≥ 0.26) or [b"", seq, payload] (≤ 0.25).
        let (seq, payload) = match frames.len() {
            4 if frames[2].len() == 8 => (&frames[2], &frames[3]),
            3 if frames[1].len() == 8 => (&frames[1], &frames[2]),
            _ => return Err(ReplayError::Malformed),
        };
        if seq.as_slice() == END_SEQ {
            return Ok(());
        }
        let seq = u64::from_be_bytes(seq.as_slice().try_into().expect("8 bytes"));
        if !each(seq, payload) {
            return Ok(());
        }
        idle_until = Instant::now() + REPLAY_IDLE;
    }
}

/// The receiving side of the channel is gone: the subscription was stopped.
struct Closed;

/// Delivers the pod's whole replay buffer, in increasing sequence order, as it arrives (the
/// bounded channel bounds memory); returns the last sequence number delivered. A pod without
/// a replay socket, or one that does not answer, is simply followed from its next message.
fn catch_up(
    spec: &SubscriptionSpec,
    send: &impl Fn(Delivery) -> bool,
) -> Result<Option<u64>, Closed> {
    let Some(endpoint) = spec.replay_endpoint.as_deref() else {
        return Ok(None);
    };
    let mut last: Option<u64> = None;
    let (mut open, mut disordered) = (true, false);
    let outcome = replay_each(endpoint, 0, |seq, payload| {
        // An entry out of order would apply events backwards: the catch-up stops there.
        if last.is_some_and(|l| seq <= l) {
            disordered = true;
            return false;
        }
        open = send(Delivery::Batch {
            seq,
            payload: payload.to_vec(),
            replayed: true,
        });
        if open {
            last = Some(seq);
        }
        open
    });
    let outcome = match outcome {
        Ok(()) if disordered => Err(ReplayError::Malformed),
        other => other,
    };
    if let Err(e) = &outcome {
        debug!(endpoint, error = %e, "KV-event catch-up replay incomplete");
    }
    if !open
        || !send(Delivery::Replay {
            complete: outcome.is_ok(),
        })
    {
        return Err(Closed);
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A real libzmq publisher + replay ROUTER answering like vLLM 0.33.
    struct FakeEngine {
        publ: zmq::Socket,
        router: zmq::Socket,
        sent: Vec<(u64, Vec<u8>)>,
        pub_port: u16,
        replay_port: u16,
    }

    fn bound_port(socket: &zmq::Socket) -> u16 {
        let ep = socket.get_last_endpoint().unwrap().unwrap();
        ep.rsplit(':').next().unwrap().parse().unwrap()
    }

    impl FakeEngine {
        /// Binds ephemeral ports itself: probing for free ones first races other tests.
        fn new() -> Self {
            let publ = context().socket(zmq::PUB).unwrap();
            publ.bind("tcp://127.0.0.1:*").unwrap();
            let router = context().socket(zmq::ROUTER).unwrap();
            router.set_rcvtimeo(10).unwrap();
            // vLLM 0.33: 2·(buffer_steps + 1), so a whole buffer queues rather than drops.
            router.set_sndhwm(20_002).unwrap();
            router.bind("tcp://127.0.0.1:*").unwrap();
            Self {
                pub_port: bound_port(&publ),
                replay_port: bound_port(&router),
                publ,
                router,
                sent: Vec::new(),
            }
        }
        fn publish(&mut self, seq: u64, payload: &[u8], live: bool) {
            self.sent.push((seq, payload.to_vec()));
            if live {
                self.publ
                    .send_multipart(
                        [
                            b"kv@t".to_vec(),
                            seq.to_be_bytes().to_vec(),
                            payload.to_vec(),
                        ],
                        0,
                    )
                    .unwrap();
            }
        }
        fn serve_replay(&self) {
            if let Ok(frames) = self.router.recv_multipart(0) {
                let [id, empty, start] = frames.as_slice() else {
                    return;
                };
                assert!(empty.is_empty());
                let start = u64::from_be_bytes(start.as_slice().try_into().unwrap());
                for (seq, p) in self.sent.iter().filter(|(s, _)| *s >= start) {
                    self.router
                        .send_multipart(
                            [
                                id.clone(),
                                vec![],
                                b"kv@t".to_vec(),
                                seq.to_be_bytes().to_vec(),
                                p.clone(),
                            ],
                            0,
                        )
                        .unwrap();
                }
                self.router
                    .send_multipart([id.clone(), vec![], vec![], END_SEQ.to_vec(), vec![]], 0)
                    .unwrap();
            }
        }
    }

    /// A subscription to the fake engine's publisher and replay socket.
    fn with_replay(pp: u16, rp: u16) -> SubscriptionSpec {
        SubscriptionSpec {
            endpoint: format!("tcp://127.0.0.1:{pp}"),
            replay_endpoint: Some(format!("tcp://127.0.0.1:{rp}")),
            topic: "kv@".into(),
        }
    }

    fn next(rx: &mut mpsc::Receiver<Delivery>, engine: &FakeEngine) -> Delivery {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            engine.serve_replay();
            if let Ok(d) = rx.try_recv() {
                return d;
            }
            assert!(Instant::now() < deadline, "no delivery");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The next deliveries are replayed batches `wanted`, payloads `p{seq}`.
    fn expect_replayed(rx: &mut mpsc::Receiver<Delivery>, engine: &FakeEngine, wanted: &[u64]) {
        for &want in wanted {
            match next(rx, engine) {
                Delivery::Batch {
                    seq,
                    replayed: true,
                    payload,
                } => {
                    assert_eq!(seq, want);
                    assert_eq!(payload, format!("p{want}").into_bytes());
                }
                other => panic!("expected replayed batch {want}, got {other:?}"),
            }
        }
    }

    #[test]
    fn an_oversized_message_is_dropped_by_libzmq_not_buffered() {
        let engine = FakeEngine::new();
        let pp = engine.pub_port;
        let spec = SubscriptionSpec {
            endpoint: format!("tcp://127.0.0.1:{pp}"),
            replay_endpoint: None,
            topic: "kv@".into(),
        };
        let (_h, mut rx) = spawn(spec, "test".into()).unwrap();
        let big = vec![0u8; 2 * MAX_MESSAGE_BYTES as usize];
        let send = |seq: u64, p: &[u8]| {
            let frames = [b"kv@t".to_vec(), seq.to_be_bytes().to_vec(), p.to_vec()];
            engine.publ.send_multipart(frames, 0).unwrap();
        };
        // Small messages until connected, then one oversized, then small ones again.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seq = 0;
        let mut phase_big_sent = false;
        let mut after_big = 0;
        while after_big < 2 {
            assert!(
                Instant::now() < deadline,
                "small messages never arrived (big sent: {phase_big_sent}, seq {seq})"
            );
            send(seq, b"small");
            seq += 1;
            std::thread::sleep(Duration::from_millis(20));
            while let Ok(d) = rx.try_recv() {
                if let Delivery::Batch { payload, .. } = d {
                    assert!(
                        payload.len() <= MAX_MESSAGE_BYTES as usize,
                        "a 2 MiB message got through"
                    );
                    after_big += usize::from(phase_big_sent);
                }
                if !phase_big_sent {
                    send(seq, &big);
                    seq += 1;
                    phase_big_sent = true;
                }
            }
        }
    }

    #[test]
    fn gaps_are_replayed_and_restarts_purge() {
        let mut engine = FakeEngine::new();
        let (pp, rp) = (engine.pub_port, engine.replay_port);
        let spec = with_replay(pp, rp);
        let (_h, mut rx) = spawn(spec, "test".into()).unwrap();
        // The catch-up finds an empty buffer.
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Replay { complete: true }
        ));
        // Slow joiner: publish seq 0 until the subscriber sees it.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            engine
                .publ
                .send_multipart(
                    [
                        b"kv@t".to_vec(),
                        0u64.to_be_bytes().to_vec(),
                        b"p0".to_vec(),
                    ],
                    0,
                )
                .unwrap();
            std::thread::sleep(Duration::from_millis(20));
            if let Ok(d) = rx.try_recv() {
                assert!(matches!(
                    d,
                    Delivery::Batch {
                        seq: 0,
                        replayed: false,
                        ..
                    }
                ));
                break;
            }
            assert!(Instant::now() < deadline, "subscriber never joined");
        }
        engine.sent.push((0, b"p0".to_vec()));
        // Seq 1 and 2 are lost on the wire; 3 arrives: 1 and 2 come back through replay.
        engine.publish(1, b"p1", false);
        engine.publish(2, b"p2", false);
        engine.publish(3, b"p3", true);
        assert!(matches!(next(&mut rx, &engine), Delivery::GapSeen));
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Replay { complete: true }
        ));
        expect_replayed(&mut rx, &engine, &[1, 2]);
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Batch {
                seq: 3,
                replayed: false,
                ..
            }
        ));
        // The engine restarts: sequence back to 0 → purge first.
        engine.sent.clear();
        engine.publish(0, b"r0", true);
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Purge(PurgeReason::Restart)
        ));
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Batch { seq: 0, .. }
        ));
        // A gap the replay buffer no longer covers → purge.
        engine.sent.clear();
        engine.publish(9, b"r9", true);
        assert!(matches!(next(&mut rx, &engine), Delivery::GapSeen));
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Replay { complete: false }
        ));
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Purge(PurgeReason::Gap)
        ));
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Batch { seq: 9, .. }
        ));
    }

    #[test]
    fn a_late_subscriber_catches_up_from_the_replay_buffer_and_drops_live_copies() {
        let mut engine = FakeEngine::new();
        let (pp, rp) = (engine.pub_port, engine.replay_port);
        // Published before anyone subscribed: only the replay buffer has them.
        engine.publish(0, b"p0", true);
        engine.publish(1, b"p1", true);
        let spec = with_replay(pp, rp);
        let (_h, mut rx) = spawn(spec, "test".into()).unwrap();
        expect_replayed(&mut rx, &engine, &[0, 1]);
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Replay { complete: true }
        ));
        // A live copy of a caught-up message is dropped; the next one applies in order.
        engine.publish(1, b"p1", true);
        engine.publish(2, b"p2", true);
        match next(&mut rx, &engine) {
            Delivery::Batch {
                seq: 2,
                replayed: false,
                ..
            } => {}
            other => panic!("expected live batch 2, got {other:?}"),
        }
    }

    #[test]
    fn a_catch_up_longer_than_the_idle_timeout_completes_while_batches_keep_coming() {
        let mut engine = FakeEngine::new();
        let (pp, rp) = (engine.pub_port, engine.replay_port);
        // More batches than the channel holds, taken slowly: the replay as a whole lasts longer
        // than REPLAY_IDLE, though it never pauses that long (it used to be cut at 2 s).
        let n = 1024 + 1200;
        for seq in 0..n {
            engine.publish(seq, format!("p{seq}").as_bytes(), false);
        }
        let spec = with_replay(pp, rp);
        let (_h, mut rx) = spawn(spec, "test".into()).unwrap();
        let started = Instant::now();
        let deadline = started + Duration::from_secs(30);
        let mut want = 0;
        let end = loop {
            assert!(Instant::now() < deadline, "catch-up stalled at {want}");
            let Ok(d) = rx.try_recv() else {
                if want == 0 {
                    engine.serve_replay();
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            };
            match d {
                Delivery::Batch {
                    seq,
                    replayed: true,
                    ..
                } => {
                    assert_eq!(seq, want);
                    want += 1;
                    // Not synchronization: the slow consumer that stretches the catch-up.
                    std::thread::sleep(Duration::from_millis(2));
                }
                other => break other,
            }
        };
        assert!(started.elapsed() > REPLAY_IDLE, "{:?}", started.elapsed());
        assert_eq!(want, n, "every buffered batch replayed");
        assert!(
            matches!(end, Delivery::Replay { complete: true }),
            "{end:?}"
        );
    }

    #[test]
    fn a_catch_up_stops_at_an_entry_out_of_order_and_says_so() {
        let mut engine = FakeEngine::new();
        let (pp, rp) = (engine.pub_port, engine.replay_port);
        for seq in [0, 2, 1] {
            engine.publish(seq, format!("p{seq}").as_bytes(), false);
        }
        let spec = with_replay(pp, rp);
        let (_h, mut rx) = spawn(spec, "test".into()).unwrap();
        expect_replayed(&mut rx, &engine, &[0, 2]);
        assert!(matches!(
            next(&mut rx, &engine),
            Delivery::Replay { complete: false }
        ));
    }

    #[test]
    fn replay_accepts_the_old_layout_and_times_out_cleanly() {
        let router = context().socket(zmq::ROUTER).unwrap();
        router.bind("tcp://127.0.0.1:*").unwrap();
        let rp = bound_port(&router);
        let t = std::thread::spawn(move || {
            let frames = router.recv_multipart(0).unwrap();
            let id = frames[0].clone();
            // ≤ 0.25 layout: no topic frame.
            router
                .send_multipart(
                    [
                        id.clone(),
                        vec![],
                        4u64.to_be_bytes().to_vec(),
                        b"x".to_vec(),
                    ],
                    0,
                )
                .unwrap();
            router
                .send_multipart([id, vec![], END_SEQ.to_vec(), vec![]], 0)
                .unwrap();
        });
        let got = replay(&format!("tcp://127.0.0.1:{rp}"), 4, 5).unwrap();
        assert_eq!(got, vec![(4, b"x".to_vec())]);
        t.join().unwrap();
        // Nobody answering: a timeout error, not a hang.
        let silent = free_port();
        assert!(replay(&format!("tcp://127.0.0.1:{silent}"), 0, 1).is_err());
    }
}
