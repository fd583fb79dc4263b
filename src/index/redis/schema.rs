//! The key schema of the shared index and its server-side scripts; docs/redis-schema.md says why.
//!
//! In cluster mode every key of one prompt prefix carries the prefix's root (its first router
//! block key) as hash tag, so a lookup is one script on one shard; a standalone server needs no
//! tags (`P:k:K`, `P:e:K`), and a key is then found under any root. A pod's own bookkeeping is
//! tagged by a stable hash of the pod's name, so per-pod cleanup never scans the keyspace.
//!
//! - `P:{R}:k:K` hash, pod → expiry (unix ms): entries recorded from decisions (approximate
//!   learning, or speculative entries in precise mode). The key expires with its latest entry.
//! - `P:{R}:e:K` hash, pod → `g` (a GPU copy) | `c` (offloaded only): blocks the pod's KV events
//!   say it holds. No TTL: the events remove them.
//! - `P:pod:{T}:lru` sorted set, `RK` (root ‖ key, hex) → recency sequence: the pod's recorded
//!   entries; the lowest go first once the pod is over its capacity.
//! - `P:pod:{T}:snap` sorted set, `RK` → expiry (unix ms): the pod's recorded entries when the
//!   mirrors answer lookups in approximate mode, which then writes no `P:{R}:k:K` and no `lru`.
//! - `P:pod:{T}:meta` hash: `seq` (the recency counter), `cap` (capacity from `set_capacity`).
//! - `P:pod:{T}:ev` set of `RK`: the pod's event-fed entries, for cleanup.
//! - `P:s:S` string: the pod a session (by the xxh3-64 of its id) was last sent to, expiring
//!   after the session TTL.
//! - `P:log` stream: every replica's decisions and session pins, in order, trimmed to
//!   `stream_max_len`; each replica applies the others' to its in-process mirror.
//! - `P:load` stream: each routed decision's load, published at commit ahead of its record and
//!   trimmed to about 10,000 entries; each replica charges the others' at once (`mirror_load`).
//! - `P:pods` set: the pods with recorded entries (where a mirror's snapshot starts).

use redis::Script;
use xxhash_rust::xxh3::xxh3_64;

use crate::blocks::BlockKey;
use crate::index::IndexError;
use crate::pods::PodId;

/// Builds key names under one prefix.
#[derive(Debug, Clone)]
pub(super) struct Schema {
    prefix: String,
    tag_roots: bool,
}

impl Schema {
    /// Keys under `prefix` (validated by the config: no braces, no whitespace); block keys are
    /// tagged by their root when `tag_roots` (cluster mode).
    pub(super) fn new(prefix: &str, tag_roots: bool) -> Self {
        Self {
            prefix: prefix.to_string(),
            tag_roots,
        }
    }

    fn block(&self, root: u64, kind: char, key: BlockKey) -> String {
        if self.tag_roots {
            format!("{}:{{{root:016x}}}:{kind}:{:016x}", self.prefix, key.0)
        } else {
            format!("{}:{kind}:{:016x}", self.prefix, key.0)
        }
    }

    /// Whether block keys carry their root as hash tag (cluster mode): keys under different
    /// roots may then live on different shards, so one script may not name them together.
    pub(super) fn tags_roots(&self) -> bool {
        self.tag_roots
    }

    /// Recorded entries of `key` (a prefix rooted at `root`).
    pub(super) fn recorded(&self, root: u64, key: BlockKey) -> String {
        self.block(root, 'k', key)
    }

    /// A pod's set member for (root, key). Untagged keys are identified by the key alone, so the
    /// root is left out (0): the same key reached under two roots is one entry.
    pub(super) fn member(&self, root: u64, key: BlockKey) -> String {
        member(if self.tag_roots { root } else { 0 }, key)
    }

    /// A snapshot member: a run of consecutive `keys` under `root` (see [`run_member`]).
    pub(super) fn run(&self, root: u64, keys: &[BlockKey]) -> String {
        run_member(if self.tag_roots { root } else { 0 }, keys)
    }

    /// Event-fed entries of `key`.
    pub(super) fn evented(&self, root: u64, key: BlockKey) -> String {
        self.block(root, 'e', key)
    }

    /// The pod's recency-ordered recorded entries.
    pub(super) fn lru(&self, pod: &PodId) -> String {
        format!("{}:pod:{{{}}}:lru", self.prefix, pod_tag(pod))
    }

    /// The pod's recorded entries scored by expiry: the snapshot a starting replica loads when
    /// the mirrors answer lookups (approximate mode), in place of the per-block hashes.
    pub(super) fn snapshot(&self, pod: &PodId) -> String {
        format!("{}:pod:{{{}}}:snap", self.prefix, pod_tag(pod))
    }

    /// The pod's counters (`seq`, `cap`).
    pub(super) fn meta(&self, pod: &PodId) -> String {
        format!("{}:pod:{{{}}}:meta", self.prefix, pod_tag(pod))
    }

    /// The pod's event-fed entries.
    pub(super) fn events(&self, pod: &PodId) -> String {
        format!("{}:pod:{{{}}}:ev", self.prefix, pod_tag(pod))
    }
}

impl Schema {
    /// The stream of changes every replica's mirror applies (one key: one slot in a cluster).
    pub(super) fn stream(&self) -> String {
        format!("{}:log", self.prefix)
    }

    /// The load stream: each decision's load, sent ahead of its record.
    pub(super) fn load_stream(&self) -> String {
        format!("{}:load", self.prefix)
    }

    /// Hash of the replicas taking load datagrams: replica id (hex) -> address, key, expiry.
    pub(super) fn peers(&self) -> String {
        format!("{}:peers", self.prefix)
    }

    /// The pods with recorded entries.
    pub(super) fn pods(&self) -> String {
        format!("{}:pods", self.prefix)
    }

    /// A shared session (by the hash of its id) → its pod.
    pub(super) fn session(&self, hash: u64) -> String {
        format!("{}:s:{hash:016x}", self.prefix)
    }
}

/// The hash tag of a pod's own keys: xxh3-64 of its name, so any name is a safe tag.
fn pod_tag(pod: &PodId) -> String {
    format!("{:016x}", xxh3_64(pod.as_str().as_bytes()))
}

/// A (root, key) member of a pod's sets: 32 hex digits.
pub fn member(root: u64, key: BlockKey) -> String {
    format!("{root:016x}{:016x}", key.0)
}

/// Most keys one member of a pod's snapshot set carries: a run of a prompt's consecutive blocks
/// (256 tokens at 16 per block). One member per block made the snapshot's scripts most of
/// Redis's time on make bench's synthetic window (docs/redis-schema.md, "The mirror").
pub const RUN: usize = 16;

/// A run of 1 to [`RUN`] consecutive keys under `root`, as one member of a pod's snapshot set:
/// 16 hex digits for the root, then 16 per key. A run of one key is its (root, key) [`member`].
pub fn run_member(root: u64, keys: &[BlockKey]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(16 * (1 + keys.len()));
    for word in std::iter::once(root).chain(keys.iter().map(|k| k.0)) {
        let _ = write!(s, "{word:016x}");
    }
    s
}

/// The (root, keys) a run member names; `None` for anything this router did not write (more
/// than [`RUN`] keys included).
pub fn parse_run(m: &[u8]) -> Option<(u64, Vec<BlockKey>)> {
    let words = m.len() / 16;
    if !m.len().is_multiple_of(16) || !(2..=RUN + 1).contains(&words) {
        return None;
    }
    if !m.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    // ASCII hex only, so every 16-byte slice is valid UTF-8 and parses.
    let word = |c: &[u8]| u64::from_str_radix(std::str::from_utf8(c).ok()?, 16).ok();
    let root = word(&m[..16])?;
    let keys = m[16..]
        .chunks(16)
        .map(|c| word(c).map(BlockKey))
        .collect::<Option<Vec<_>>>()?;
    Some((root, keys))
}

/// The (root, key) a member names; `None` for anything this router did not write.
pub fn parse_member(m: &[u8]) -> Option<(u64, BlockKey)> {
    // Exactly what `member` writes: 32 lower-case hex digits. Anything else is foreign, and a
    // multi-byte character across byte 16 once panicked the writer at the slice below.
    if m.len() != 32 || !m.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let s = std::str::from_utf8(m).ok()?;
    let root = u64::from_str_radix(&s[..16], 16).ok()?;
    let key = u64::from_str_radix(&s[16..], 16).ok()?;
    Some((root, BlockKey(key)))
}

/// The lookup: walks the prompt's blocks in order and stops once no candidate holds one.
/// KEYS: per block its recorded key, then (precise mode) its evented key.
/// ARGV: now (unix ms), precise (0|1), GPU weight, CPU weight, candidate pods...
/// Returns each candidate's matched weight as a string (Lua numbers would be truncated), then the
/// earliest expiry among the recorded entries it counted (`-1`: none), so a cached answer
/// never outlives them.
pub(super) const LOOKUP: &str = r#"
local now = tonumber(ARGV[1])
local precise = ARGV[2] == '1'
local gw, cw = tonumber(ARGV[3]), tonumber(ARGV[4])
local n = #ARGV - 4
-- No table is allocated per block: seen[c] == b marks candidate c as holding block b.
local cand, matched, alive, seen, w = {}, {}, {}, {}, {}
local soonest = -1
for i = 1, n do cand[ARGV[4 + i]] = i; matched[i] = 0; alive[i] = i; seen[i] = 0 end
local nalive = n
local stride = precise and 2 or 1
for b = 1, #KEYS, stride do
  if nalive == 0 then break end
  if precise then
    local h = redis.call('HGETALL', KEYS[b + 1])
    for j = 1, #h, 2 do
      local c = cand[h[j]]
      if c then seen[c] = b; if h[j + 1] == 'g' then w[c] = gw else w[c] = cw end end
    end
  end
  local h = redis.call('HGETALL', KEYS[b])
  for j = 1, #h, 2 do
    local c = cand[h[j]]
    if c and seen[c] ~= b then
      local exp = tonumber(h[j + 1]) or 0
      if exp > now then
        seen[c] = b; w[c] = gw
        if soonest < 0 or exp < soonest then soonest = exp end
      end
    end
  end
  local m = 0
  for i = 1, nalive do
    local c = alive[i]
    if seen[c] == b then matched[c] = matched[c] + w[c]; m = m + 1; alive[m] = c end
  end
  nalive = m
end
local out = {}
for i = 1, n do out[i] = tostring(matched[i]) end
out[n + 1] = tostring(soonest)
return out
"#;

/// Records entries of one pod under one root. KEYS: recorded keys. ARGV: pod, expiry (unix ms).
/// A key's TTL only grows. Which flag goes first follows `HSET`: a field it updated has a key
/// with a TTL (`GT`: a conversation re-recording its history), a new field most often a new key
/// (`NX`: a new prompt), so the second call is only for the rarer case.
pub(super) const RECORD: &str = r#"
for _, k in ipairs(KEYS) do
  local first, second = 'GT', 'NX'
  if redis.call('HSET', k, ARGV[1], ARGV[2]) == 1 then first, second = 'NX', 'GT' end
  if redis.call('PEXPIREAT', k, ARGV[2], first) == 0 then
    redis.call('PEXPIREAT', k, ARGV[2], second)
  end
end
return #KEYS
"#;

/// Deletes one pod's field from each key (all on one shard). KEYS: entry keys. ARGV: pod.
/// One script for a chunk of evicted or forgotten entries, not one `HDEL` round trip each.
pub(super) const UNSET: &str = r#"
for _, k in ipairs(KEYS) do redis.call('HDEL', k, ARGV[1]) end
return #KEYS
"#;

/// Refreshes a pod's recency and evicts past its capacity. KEYS: lru, meta.
/// ARGV: default capacity, members (prompt head first: it ends up most recent).
/// Returns the evicted members.
pub(super) const TOUCH: &str = r#"
local n = #ARGV - 1
local seq = redis.call('HINCRBY', KEYS[2], 'seq', n)
-- One variadic ZADD (callers send at most a few hundred members): half the time of one call each.
local zargs = {}
for i = 2, #ARGV do zargs[2 * i - 3] = seq - (i - 2); zargs[2 * i - 2] = ARGV[i] end
if n > 0 then redis.call('ZADD', KEYS[1], unpack(zargs)) end
local cap = tonumber(redis.call('HGET', KEYS[2], 'cap') or ARGV[1])
local over = redis.call('ZCARD', KEYS[1]) - cap
if over <= 0 then return {} end
local popped = redis.call('ZPOPMIN', KEYS[1], over)
local out = {}
for i = 1, #popped, 2 do out[#out + 1] = popped[i] end
return out
"#;

/// Records runs of one pod's entries in its snapshot set: one `ZADD GT` (a score only grows),
/// expired members dropped, the lowest scores (the least recent) evicted past its capacity,
/// counted in runs (a member holds up to a run's length of blocks).
/// KEYS: snap, meta. ARGV: default capacity (blocks), run length, now (unix ms), then score and
/// member pairs. Returns how many members it recorded.
pub(super) const SNAPSHOT: &str = r#"
local n = (#ARGV - 3) / 2
if n > 0 then redis.call('ZADD', KEYS[1], 'GT', unpack(ARGV, 4)) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
local blocks = tonumber(redis.call('HGET', KEYS[2], 'cap') or ARGV[1])
local cap = math.ceil(blocks / tonumber(ARGV[2]))
local over = redis.call('ZCARD', KEYS[1]) - cap
if over > 0 then redis.call('ZPOPMIN', KEYS[1], over) end
return n
"#;

/// Sets a pod's capacity and evicts past it. KEYS: lru or snap, meta. ARGV: capacity (blocks),
/// then blocks per member (1 for `lru`, [`RUN`] for a snapshot set of runs).
/// Returns the evicted members.
pub(super) const CAPACITY: &str = r#"
redis.call('HSET', KEYS[2], 'cap', ARGV[1])
local per = tonumber(ARGV[2] or '1')
local over = redis.call('ZCARD', KEYS[1]) - math.ceil(tonumber(ARGV[1]) / per)
if over <= 0 then return {} end
local popped = redis.call('ZPOPMIN', KEYS[1], over)
local out = {}
for i = 1, #popped, 2 do out[#out + 1] = popped[i] end
return out
"#;

/// Sets what a pod's events say about keys under one root. KEYS: per key its evented then its
/// recorded name. ARGV: pod, then per key `g` (a GPU copy), `c` (offloaded only) or `-` (not
/// held); upper case (`G`, `C`, `X`) also drops the pod's recorded entry of the key: the pod
/// reported it stored, or a decision's guess of it ended with the decision's other hits.
pub(super) const EVENTS: &str = r#"
local n = #KEYS / 2
for i = 1, n do
  local t = ARGV[i + 1]
  local l = string.lower(t)
  if l == 'x' or l == '-' then
    redis.call('HDEL', KEYS[2 * i - 1], ARGV[1])
  else
    redis.call('HSET', KEYS[2 * i - 1], ARGV[1], l)
  end
  if t ~= l then redis.call('HDEL', KEYS[2 * i], ARGV[1]) end
end
return n
"#;

/// The scripts, loaded once per process (`invoke_async` loads them again after a restart).
pub(super) struct Scripts {
    pub(super) lookup: Script,
    pub(super) record: Script,
    pub(super) touch: Script,
    pub(super) capacity: Script,
    pub(super) events: Script,
    pub(super) unset: Script,
    pub(super) snapshot: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            lookup: Script::new(LOOKUP),
            record: Script::new(RECORD),
            touch: Script::new(TOUCH),
            capacity: Script::new(CAPACITY),
            events: Script::new(EVENTS),
            unset: Script::new(UNSET),
            snapshot: Script::new(SNAPSHOT),
        }
    }
}

/// The lookup script's reply (one count per candidate, then the soonest expiry in ms, or a
/// negative number for none) as matched counts and that expiry; anything else is a protocol
/// error, never a panic (fuzzed: `fuzz/` target `redis_lookup_reply`).
pub fn decode_lookup_reply(
    out: &[String],
    pods: usize,
) -> Result<(Vec<f64>, Option<u64>), IndexError> {
    let Some((soonest, counts)) = out.split_last().filter(|(_, c)| c.len() == pods) else {
        return Err(IndexError::Protocol(format!(
            "lookup answered {} values for {pods} pods",
            out.len(),
        )));
    };
    let matched = counts
        .iter()
        .map(|s| {
            s.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| IndexError::Protocol("lookup answered a non-count".into()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let soonest_expiry = soonest
        .parse::<i64>()
        .ok()
        .and_then(|v| u64::try_from(v).ok());
    Ok((matched, soonest_expiry))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_round_trip_and_foreign_ones_are_refused() {
        let m = member(0xabc, BlockKey(u64::MAX));
        assert_eq!(m.len(), 32);
        assert_eq!(
            parse_member(m.as_bytes()),
            Some((0xabc, BlockKey(u64::MAX)))
        );
        assert_eq!(parse_member(b"not-a-member"), None);
        assert_eq!(parse_member(&[0xff; 32]), None);
    }

    #[test]
    fn runs_round_trip_a_member_is_a_run_of_one_and_foreign_ones_are_refused() {
        let keys: Vec<BlockKey> = (0..RUN as u64).map(|i| BlockKey(i * 0x0101)).collect();
        for n in 1..=RUN {
            let m = run_member(0xabc, &keys[..n]);
            assert_eq!(m.len(), 16 * (n + 1));
            assert_eq!(parse_run(m.as_bytes()), Some((0xabc, keys[..n].to_vec())));
        }
        // An older replica's one-key member loads as a run of one.
        let one = member(7, BlockKey(9));
        assert_eq!(run_member(7, &[BlockKey(9)]), one);
        assert_eq!(parse_run(one.as_bytes()), Some((7, vec![BlockKey(9)])));
        let long = run_member(1, &[keys.clone(), vec![BlockKey(1)]].concat());
        for bad in [
            long.as_bytes(),
            &long.as_bytes()[..16],
            &long.as_bytes()[..40],
            b"",
            "000000000000000100000000000000\u{416}".as_bytes(),
            b"000000000000000100000000000000A1",
        ] {
            assert_eq!(parse_run(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn only_members_this_router_writes_parse_and_none_panics() {
        // fuzz/artifacts/redis_member/crash-ca72…: a two-byte character across byte 16.
        assert_eq!(
            parse_member("fffffffffffffffО000000000000000".as_bytes()),
            None
        );
        // crash-52aa…: upper-case hex (and a sign) parsed, yet `member` never writes them.
        assert_eq!(parse_member(b"0000000000000001012345678Aa8cdef"), None);
        assert_eq!(parse_member(b"+000000000000001012345678aa8cdef"), None);
        let m = member(1, BlockKey(0x0123_4567_8aa8_cdef));
        assert_eq!(
            parse_member(m.as_bytes()),
            Some((1, BlockKey(0x0123_4567_8aa8_cdef)))
        );
    }

    #[test]
    fn a_prefix_shares_one_hash_tag_and_a_pod_gets_its_own() {
        let s = Schema::new("kvr", true);
        let (a, b) = (s.recorded(7, BlockKey(1)), s.evented(7, BlockKey(2)));
        let tag = |k: &str| k[k.find('{').unwrap()..=k.find('}').unwrap()].to_string();
        assert_eq!(tag(&a), tag(&b));
        let pod = PodId::new("10.0.0.1:8000");
        assert_eq!(tag(&s.lru(&pod)), tag(&s.meta(&pod)));
        assert_eq!(tag(&s.lru(&pod)), tag(&s.events(&pod)));
        assert_ne!(tag(&s.lru(&pod)), tag(&s.lru(&PodId::new("10.0.0.2:8000"))));
        let odd = PodId::new("pod{with}braces");
        assert!(!tag(&s.lru(&odd))[1..17].contains('{'));
        let flat = Schema::new("kvr", false);
        assert_eq!(flat.recorded(7, BlockKey(1)), flat.recorded(8, BlockKey(1)));
        assert!(!flat.recorded(7, BlockKey(1)).contains('{'));
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn lookup_replies_decode_or_are_protocol_errors() {
        assert_eq!(
            decode_lookup_reply(&strs(&["12", "0", "3.5", "1700"]), 3).unwrap(),
            (vec![12.0, 0.0, 3.5], Some(1700))
        );
        assert_eq!(
            decode_lookup_reply(&strs(&["1", "-1"]), 1).unwrap(),
            (vec![1.0], None)
        );
        for (bad, pods) in [
            (strs(&["1", "2"]), 2),
            (strs(&[]), 0),
            (strs(&["nan", "5"]), 1),
            (strs(&["-1", "5"]), 1),
            (strs(&["inf", "5"]), 1),
        ] {
            assert!(
                matches!(
                    decode_lookup_reply(&bad, pods),
                    Err(IndexError::Protocol(_))
                ),
                "{bad:?}"
            );
        }
    }
}
