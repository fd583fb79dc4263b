//! vLLM 0.33-compatible KV-event publisher for the simulator.
//!
//! * PUB socket: one 3-frame message `[topic, seq (8 bytes BE, from 0), msgpack batch]` per
//!   engine step that changed the cache, or several: vLLM prefills a long prompt in chunks of
//!   its per-step token budget (`max_num_batched_tokens`, 8192 by default) and publishes each
//!   chunk's blocks in that step's batch, while this engine prefills a prompt at once, so a
//!   step's events are cut into batches of at most [`STEP_BLOCKS`] blocks ([`split_steps`]). Binds when the endpoint contains `*` or `::` or is
//!   `ipc://`, otherwise connects (vLLM's rule), so a router can bind one SUB for many pods.
//! * Replay ROUTER (optional, always binds): keeps the last `buffer_steps` batches; a DEALER
//!   request `["", seq8]` gets `["", topic, seq8, payload]` for every buffered batch with
//!   `seq >= start`, then `["", "", ff×8, ""]` (vLLM ≥ 0.26 layout). Malformed requests are
//!   ignored.
//!
//! Cache events become vLLM events through [`super::translate::Translator`] (vLLM
//! `sha256_cbor` block hashes).

use std::collections::VecDeque;
use std::ops::Range;

use anyhow::{bail, Context};
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use kv_router::events::{encode_batch, KvEvent, KvEventBatch};

use super::cache::CacheEvent;
use super::translate::{Hashes, Translator};

/// Blocks per published batch: vLLM's default per-step budget of 8192 tokens in 16-token blocks.
/// A whole 128k-token prompt in one message (about 600 KiB of token ids) is more than a real
/// engine ever sends at once, and more than a router that bounds messages accepts.
pub const STEP_BLOCKS: usize = 512;

/// Cuts one engine step's events into batches of at most `max_blocks` blocks each (stored or
/// removed; a cleared cache counts one), in order, as vLLM's chunked prefill would have
/// published them over several steps. A long `BlockStored` continues in the next batch with
/// the last block of the previous part as its parent.
pub fn split_steps(events: Vec<KvEvent>, max_blocks: usize) -> Vec<Vec<KvEvent>> {
    let max = max_blocks.max(1);
    let mut out: Vec<Vec<KvEvent>> = vec![Vec::new()];
    let mut room = max;
    let push = |out: &mut Vec<Vec<KvEvent>>, room: &mut usize, e: KvEvent, n: usize| {
        if *room < n.max(1) && !out.last().is_some_and(Vec::is_empty) {
            out.push(Vec::new());
            *room = max;
        }
        *room = room.saturating_sub(n.max(1));
        out.last_mut().expect("one batch at least").push(e);
    };
    for e in events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
                kv_cache_spec_sliding_window,
            } if block_hashes.len() > room => {
                let bs = block_size as usize;
                let mut parent = parent_block_hash;
                for Range { start, end } in cuts(block_hashes.len(), room, max) {
                    let tokens = token_ids
                        .get(start * bs..(end * bs).min(token_ids.len()))
                        .unwrap_or_default()
                        .to_vec();
                    let part = KvEvent::BlockStored {
                        block_hashes: block_hashes[start..end].to_vec(),
                        parent_block_hash: parent.take(),
                        token_ids: tokens,
                        block_size,
                        lora_id,
                        medium: medium.clone(),
                        lora_name: lora_name.clone(),
                        extra_keys: extra_keys
                            .as_ref()
                            .map(|x| x.get(start..end.min(x.len())).unwrap_or_default().to_vec()),
                        group_idx,
                        kv_cache_spec_kind: kv_cache_spec_kind.clone(),
                        kv_cache_spec_sliding_window,
                    };
                    push(&mut out, &mut room, part, end - start);
                    parent = Some(block_hashes[end - 1].clone());
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } if block_hashes.len() > room => {
                for Range { start, end } in cuts(block_hashes.len(), room, max) {
                    let part = KvEvent::BlockRemoved {
                        block_hashes: block_hashes[start..end].to_vec(),
                        medium: medium.clone(),
                        group_idx,
                    };
                    push(&mut out, &mut room, part, end - start);
                }
            }
            e => {
                let n = match &e {
                    KvEvent::BlockStored { block_hashes, .. }
                    | KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
                    KvEvent::AllBlocksCleared => 1,
                };
                push(&mut out, &mut room, e, n);
            }
        }
    }
    out.retain(|b| !b.is_empty());
    out
}

/// How a run of `len` blocks is cut: the first part fills the current batch's `room` (a whole
/// batch when it is full), every later part a whole batch of `max`.
fn cuts(len: usize, room: usize, max: usize) -> Vec<Range<usize>> {
    let mut parts = Vec::new();
    let (mut start, mut take) = (0, if room == 0 { max } else { room });
    while start < len {
        let end = (start + take).min(len);
        parts.push(start..end);
        (start, take) = (end, max);
    }
    parts
}

/// Publisher settings (from the `--kv-events-*` flags).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// PUB endpoint as given (before the DP-rank offset).
    pub endpoint: String,
    /// First frame of every message.
    pub topic: String,
    /// Replay ROUTER endpoint as given, if any.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Data-parallel rank: offsets tcp ports, stamped into every batch.
    pub data_parallel_rank: i64,
    /// Publish hashes as 32-byte digests instead of u64.
    pub bytes_hashes: bool,
}

/// Where the sockets ended up (printed by the binary).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsEndpoints {
    /// PUB endpoint (bound address, or the address dialled in connect mode).
    pub publisher: String,
    /// Whether the PUB socket binds (`false` = connects).
    pub binds: bool,
    /// Bound replay endpoint.
    pub replay: Option<String>,
}

/// vLLM's bind-or-connect rule for the PUB endpoint.
pub fn is_bind_endpoint(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Applies the data-parallel rank offset like vLLM: tcp port + rank (port 0 left alone);
/// other schemes are only allowed for rank 0 (inproc is not supported by the zeromq crate).
pub fn offset_endpoint(endpoint: &str, rank: i64) -> anyhow::Result<String> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    if rank < 0 {
        bail!("data parallel rank must be >= 0, got {rank}");
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        bail!("endpoint {endpoint}: only tcp:// endpoints can be offset by a data parallel rank");
    };
    let (host, port) = rest
        .rsplit_once(':')
        .with_context(|| format!("endpoint {endpoint} has no port"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("endpoint {endpoint}: bad port"))?;
    if port == 0 {
        return Ok(endpoint.to_string());
    }
    let port = u16::try_from(i64::from(port) + rank)
        .with_context(|| format!("endpoint {endpoint}: port + rank {rank} overflows"))?;
    Ok(format!("tcp://{host}:{port}"))
}

/// Rewrites ZMQ's wildcard host for the zeromq crate: `*` = all interfaces (`0.0.0.0`), except
/// with port 0, which binds an ephemeral port on `127.0.0.1`; `[::]`/`::` = all IPv6 interfaces.
fn socket_address(endpoint: &str) -> String {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return endpoint.to_string();
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return endpoint.to_string();
    };
    let host = match host {
        "*" if port == "0" => "127.0.0.1",
        "*" => "0.0.0.0",
        "::" | "[::]" => "[::]",
        h => h,
    };
    format!("tcp://{host}:{port}")
}

fn wall_clock() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// End-of-replay sequence number (`-1` as 8 signed big-endian bytes).
pub const END_SEQ: [u8; 8] = [0xff; 8];

fn message(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).expect("at least one frame")
}

/// Binds/connects the sockets and spawns the publisher task. Send one `Vec<CacheEvent>` per
/// engine step to the returned sender (see [`super::actor::spawn`]).
pub async fn start(
    cfg: KvEventsConfig,
) -> anyhow::Result<(mpsc::UnboundedSender<Vec<CacheEvent>>, KvEventsEndpoints)> {
    let rank = cfg.data_parallel_rank;
    let endpoint = offset_endpoint(&cfg.endpoint, rank)?;
    if endpoint.starts_with("inproc://") {
        bail!("inproc:// endpoints are not supported by vllm-sim (use tcp:// or ipc://)");
    }
    let binds = is_bind_endpoint(&endpoint);
    let address = socket_address(&endpoint);
    let mut pending: Option<oneshot::Receiver<zeromq::PubSocket>> = None;
    let mut publisher = None;
    let shown = if binds {
        let mut s = zeromq::PubSocket::new();
        let ep = s
            .bind(&address)
            .await
            .with_context(|| format!("binding KV-event PUB socket on {endpoint}"))?;
        publisher = Some(s);
        ep.to_string()
    } else {
        // The zeromq crate's connect waits until the peer accepts; connect in the background
        // and drop live messages until then (they stay available for replay), like a ZMQ PUB
        // without subscribers.
        let (tx, rx) = oneshot::channel();
        let target = address.clone();
        tokio::spawn(async move {
            let mut s = zeromq::PubSocket::new();
            match s.connect(&target).await {
                Ok(()) => {
                    let _ = tx.send(s);
                }
                Err(e) => {
                    tracing::error!(endpoint = %target, error = %e, "KV-event PUB connect failed")
                }
            }
        });
        pending = Some(rx);
        address
    };
    let mut replay = None;
    let replay_shown = match &cfg.replay_endpoint {
        Some(ep) => {
            let ep = offset_endpoint(ep, rank)?;
            let mut s = zeromq::RouterSocket::new();
            let bound = s
                .bind(&socket_address(&ep))
                .await
                .with_context(|| format!("binding KV-event replay socket on {ep}"))?;
            replay = Some(s);
            Some(bound.to_string())
        }
        None => None,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let task = Publisher {
        topic: Bytes::from(cfg.topic.clone().into_bytes()),
        rank,
        translator: Translator::new(if cfg.bytes_hashes {
            Hashes::Bytes
        } else {
            Hashes::U64
        }),
        seq: 0,
        buffer: VecDeque::new(),
        buffer_steps: cfg.buffer_steps,
    };
    tokio::spawn(task.run(rx, publisher, pending, replay));
    Ok((
        tx,
        KvEventsEndpoints {
            publisher: shown,
            binds,
            replay: replay_shown,
        },
    ))
}

struct Publisher {
    topic: Bytes,
    rank: i64,
    translator: Translator,
    seq: u64,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
}

impl Publisher {
    async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Vec<CacheEvent>>,
        mut publisher: Option<zeromq::PubSocket>,
        mut pending: Option<oneshot::Receiver<zeromq::PubSocket>>,
        mut replay: Option<zeromq::RouterSocket>,
    ) {
        loop {
            tokio::select! {
                step = rx.recv() => {
                    let Some(step) = step else { return };
                    let events = self.translator.translate(step);
                    let ts = wall_clock();
                    for events in split_steps(events, STEP_BLOCKS) {
                        let batch = KvEventBatch {
                            ts,
                            events,
                            data_parallel_rank: Some(self.rank),
                        };
                        self.publish(&mut publisher, Bytes::from(encode_batch(&batch))).await;
                    }
                }
                sock = async { pending.as_mut().expect("guarded").await }, if pending.is_some() => {
                    pending = None;
                    if let Ok(s) = sock {
                        publisher = Some(s);
                    }
                }
                req = async { replay.as_mut().expect("guarded").recv().await }, if replay.is_some() => {
                    match req {
                        Ok(req) => {
                            let router = replay.as_mut().expect("guarded");
                            self.serve_replay(router, req).await;
                        }
                        Err(e) => tracing::warn!(error = %e, "KV-event replay receive failed"),
                    }
                }
            }
        }
    }

    /// Sends one batch with the next sequence number and keeps it for replay.
    async fn publish(&mut self, publisher: &mut Option<zeromq::PubSocket>, payload: Bytes) {
        let seq = self.seq;
        self.seq += 1;
        if let Some(p) = publisher.as_mut() {
            let msg = message(vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ]);
            if let Err(e) = p.send(msg).await {
                tracing::warn!(error = %e, "KV-event publish failed");
            }
        }
        if self.buffer_steps > 0 {
            if self.buffer.len() == self.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    async fn serve_replay(&self, router: &mut zeromq::RouterSocket, req: ZmqMessage) {
        let frames = req.into_vec();
        // [identity, empty delimiter, 8-byte start seq]; anything else is ignored (no reply).
        let [identity, delim, start] = frames.as_slice() else {
            tracing::warn!(
                frames = frames.len(),
                "malformed KV-event replay request ignored"
            );
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::warn!("KV-event replay request without an 8-byte sequence ignored");
            return;
        };
        if !delim.is_empty() {
            tracing::warn!("KV-event replay request without empty delimiter ignored");
            return;
        }
        let start = u64::from_be_bytes(start);
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let msg = message(vec![
                identity.clone(),
                Bytes::new(),
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ]);
            if let Err(e) = router.send(msg).await {
                tracing::warn!(error = %e, "KV-event replay send failed");
                return;
            }
        }
        let end = message(vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&END_SEQ),
            Bytes::new(),
        ]);
        if let Err(e) = router.send(end).await {
            tracing::warn!(error = %e, "KV-event replay send failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use kv_router::events::BlockHash;

    use super::*;

    fn stored(from: u64, n: u64, parent: Option<u64>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: (from..from + n).map(BlockHash::Int).collect(),
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: (0..(n * 2) as u32).collect(),
            block_size: 2,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: Some((0..n).map(|i| (i % 2 == 0).then(Vec::new)).collect()),
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }
    }

    #[test]
    fn a_long_step_is_cut_into_chained_batches_and_short_ones_stay_whole() {
        let removed = |n: u64| KvEvent::BlockRemoved {
            block_hashes: (100..100 + n).map(BlockHash::Int).collect(),
            medium: None,
            group_idx: None,
        };
        // Small events share a batch, in order.
        let small = vec![stored(1, 2, None), removed(3), KvEvent::AllBlocksCleared];
        assert_eq!(split_steps(small.clone(), 8), vec![small]);
        // 2 + 7 stored blocks and 9 removed ones, at most 4 per batch.
        let steps = split_steps(vec![removed(2), stored(10, 7, Some(9)), removed(9)], 4);
        let sizes: Vec<Vec<usize>> = steps
            .iter()
            .map(|b| {
                b.iter()
                    .map(|e| match e {
                        KvEvent::BlockStored { block_hashes, .. }
                        | KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
                        KvEvent::AllBlocksCleared => 0,
                    })
                    .collect()
            })
            .collect();
        assert_eq!(
            sizes,
            vec![vec![2, 2], vec![4], vec![1, 3], vec![4], vec![2]]
        );
        // The stored parts chain: each part's parent is the previous part's last block, and
        // each carries its own blocks' tokens and extra keys.
        let parts: Vec<&KvEvent> = steps
            .iter()
            .flatten()
            .filter(|e| matches!(e, KvEvent::BlockStored { .. }))
            .collect();
        let parents: Vec<Option<u64>> = parts
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored {
                    parent_block_hash, ..
                } => parent_block_hash.as_ref().map(BlockHash::as_u64),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(parents, vec![Some(9), Some(11), Some(15)]);
        let KvEvent::BlockStored {
            token_ids,
            extra_keys,
            ..
        } = parts[2]
        else {
            unreachable!()
        };
        assert_eq!(token_ids, &vec![12, 13]);
        assert_eq!(extra_keys.as_ref().map(Vec::len), Some(1));
    }

    #[test]
    fn bind_rule_and_rank_offsets() {
        assert!(is_bind_endpoint("tcp://*:5557"));
        assert!(is_bind_endpoint("tcp://:::5557"));
        assert!(is_bind_endpoint("ipc:///tmp/x"));
        assert!(!is_bind_endpoint("tcp://10.0.0.1:5557"));
        assert_eq!(offset_endpoint("tcp://*:5557", 2).unwrap(), "tcp://*:5559");
        assert_eq!(offset_endpoint("tcp://*:0", 2).unwrap(), "tcp://*:0");
        assert_eq!(offset_endpoint("ipc:///x", 0).unwrap(), "ipc:///x");
        assert!(offset_endpoint("ipc:///x", 1).is_err());
        assert_eq!(socket_address("tcp://*:0"), "tcp://127.0.0.1:0");
        assert_eq!(socket_address("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(
            socket_address("tcp://127.0.0.1:5557"),
            "tcp://127.0.0.1:5557"
        );
    }
}
