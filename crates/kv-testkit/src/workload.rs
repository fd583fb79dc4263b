//! Workloads: deterministic (under a seed) scripts of OpenAI requests.
//!
//! A workload is a set of [`Session`]s. The runner drives sessions concurrently and the requests
//! of one session one after the other; a session sees the previous answer before it builds its
//! next request (multi-turn chat feeds the real assistant reply back into the history). Open-loop
//! workloads (trace replay) use single-request sessions with [`PlannedRequest::not_before`].

use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

use super::prose::{prose, prose_tokens};
use super::splitmix::SplitMix64;

/// OpenAI endpoint a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

impl Api {
    /// Request path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }
}

/// One request a session wants to send.
#[derive(Debug, Clone)]
pub struct PlannedRequest {
    /// Endpoint.
    pub api: Api,
    /// JSON body (streaming fields included).
    pub body: Value,
    /// Extra request headers (lower-case names).
    pub headers: Vec<(String, String)>,
    /// Position of the request within its session (0-based).
    pub turn: usize,
    /// Open loop: do not send before this offset from the start of the run.
    pub not_before: Option<Duration>,
    /// Wait this long after the previous response before sending (a user reading and typing).
    pub think: Option<Duration>,
}

/// What a session learns about its previous request.
#[derive(Debug, Clone, Copy)]
pub struct Previous<'a> {
    /// Generated text (possibly empty).
    pub text: &'a str,
}

/// A sequence of dependent requests.
pub trait Session: Send {
    /// Stable id, also sent as `x-session-id` where the workload has sessions.
    fn id(&self) -> &str;
    /// The next request, or `None` when the session is over.
    fn next_request(&mut self, previous: Option<Previous<'_>>) -> Option<PlannedRequest>;
}

/// A runnable workload.
pub struct Workload {
    /// Short name for reports (`multiturn`, …).
    pub name: String,
    /// Human-readable parameters for reports.
    pub description: String,
    /// The sessions (each driven sequentially, all concurrently up to the runner's cap).
    pub sessions: Vec<Box<dyn Session>>,
    /// Requests the sessions will send (for progress display).
    pub requests: usize,
}

impl std::fmt::Debug for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workload")
            .field("name", &self.name)
            .field("description", &self.description)
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

/// Which workload to build (the CLI's `--workload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// N sessions × T turns sharing one system prompt; history grows turn by turn.
    Multiturn,
    /// G groups × P prompts: a group system prompt plus a unique question (inference-perf shape).
    SharedPrefix,
    /// Replay of a Mooncake trace (token-id prompts).
    Trace,
    /// An agent forking: rounds of B branches sent within about a second, each one long shared
    /// context plus its own suffix (the context grows a little every round).
    Fork,
}

// ------------------------------------------------------------------------------------------------
// Multi-turn chat

/// Parameters of the multi-turn workload (workloads.md §3.2).
#[derive(Debug, Clone, Serialize)]
pub struct MultiturnSpec {
    /// Concurrent conversations.
    pub sessions: usize,
    /// Turns (requests) per conversation.
    pub turns: usize,
    /// Size of the shared system prompt in bytes.
    pub system_bytes: usize,
    /// Question size range in bytes.
    pub question_bytes: (usize, usize),
    /// `max_tokens` of each request.
    pub max_tokens: u32,
    /// `model` field.
    pub model: String,
    /// Seed for every generated text.
    pub seed: u64,
    /// Pause between a response and the next turn, uniform in this range of milliseconds
    /// ((0, 0): none). Pauses keep a few sessions from falling into lockstep, where round robin
    /// would send each session's every turn to the same pod by accident.
    pub think_ms: (u64, u64),
    /// Each conversation's own document, bytes (uniform in this range; (0, 0): none), opening its
    /// first question: a long shared system prompt, then a shorter text of the conversation's own.
    pub document_bytes: (usize, usize),
    /// Send `x-session-id` (false: like chat frontends and agents that name no session).
    pub session_header: bool,
}

impl Default for MultiturnSpec {
    fn default() -> Self {
        Self {
            sessions: 16,
            turns: 6,
            system_bytes: 6 * 1024,
            question_bytes: (200, 400),
            max_tokens: 32,
            model: "sim-model".into(),
            seed: 1,
            think_ms: (0, 0),
            document_bytes: (0, 0),
            session_header: true,
        }
    }
}

impl MultiturnSpec {
    /// The shared system prompt.
    pub fn system_prompt(&self) -> String {
        let mut rng = SplitMix64::derive(self.seed, "system", 0);
        let mut s = String::from("You are a careful assistant. ");
        let rest = self.system_bytes.saturating_sub(s.len());
        prose(&mut rng, rest, &mut s);
        s
    }

    /// Builds the sessions.
    pub fn build(&self) -> Workload {
        let system = self.system_prompt();
        let sessions = (0..self.sessions)
            .map(|i| {
                Box::new(MultiturnSession {
                    id: format!("mt-{}-{i}", self.seed),
                    index: i,
                    spec: self.clone(),
                    rng: SplitMix64::derive(self.seed, "session", i as u64),
                    think_rng: SplitMix64::derive(self.seed, "think", i as u64),
                    messages: vec![json!({"role": "system", "content": system})],
                    turn: 0,
                }) as Box<dyn Session>
            })
            .collect();
        Workload {
            name: "multiturn".into(),
            description: format!(
                "{} sessions x {} turns, system {} B, {}questions {}-{} B, max_tokens {}, seed {}{}{}",
                self.sessions,
                self.turns,
                self.system_bytes,
                match self.document_bytes {
                    (_, 0) => String::new(),
                    (lo, hi) => format!("a document of {lo}-{hi} B per session, "),
                },
                self.question_bytes.0,
                self.question_bytes.1,
                self.max_tokens,
                self.seed,
                match self.think_ms {
                    (_, 0) => String::new(),
                    (lo, hi) => format!(", think {lo}-{hi} ms"),
                },
                if self.session_header { "" } else { ", no session id" }
            ),
            sessions,
            requests: self.sessions * self.turns,
        }
    }
}

struct MultiturnSession {
    id: String,
    index: usize,
    spec: MultiturnSpec,
    rng: SplitMix64,
    think_rng: SplitMix64,
    messages: Vec<Value>,
    turn: usize,
}

impl Session for MultiturnSession {
    fn id(&self) -> &str {
        &self.id
    }

    fn next_request(&mut self, previous: Option<Previous<'_>>) -> Option<PlannedRequest> {
        if let Some(p) = previous {
            self.messages
                .push(json!({"role": "assistant", "content": p.text}));
        }
        if self.turn >= self.spec.turns {
            return None;
        }
        let (lo, hi) = self.spec.question_bytes;
        let len = self.rng.range(lo.min(hi), hi.max(lo));
        let mut q = String::new();
        let (dlo, dhi) = self.spec.document_bytes;
        if self.turn == 0 && dhi > 0 {
            // Its own generator, so the questions stay those of a spec without documents.
            let mut rng = SplitMix64::derive(self.spec.seed, "document", self.index as u64);
            let len = rng.range(dlo.min(dhi), dhi.max(dlo));
            q.push_str(&format!("Document {}: ", self.index));
            prose(&mut rng, len, &mut q);
            q.push_str("\n\n");
        }
        let start = q.len();
        q.push_str(&format!("Session {} turn {}: ", self.index, self.turn));
        prose(&mut self.rng, (start + len).saturating_sub(q.len()), &mut q);
        q.pop();
        q.push('?');
        self.messages.push(json!({"role": "user", "content": q}));
        let body = json!({
            "model": self.spec.model,
            "messages": self.messages,
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": self.spec.max_tokens,
        });
        let req = PlannedRequest {
            api: Api::Chat,
            body,
            headers: if self.spec.session_header {
                vec![("x-session-id".into(), self.id.clone())]
            } else {
                Vec::new()
            },
            turn: self.turn,
            not_before: None,
            think: None,
        };
        let (lo, hi) = self.spec.think_ms;
        let req = if self.turn > 0 && hi > 0 {
            let ms = self.think_rng.range(lo.min(hi) as usize, hi as usize) as u64;
            PlannedRequest {
                think: Some(Duration::from_millis(ms)),
                ..req
            }
        } else {
            req
        };
        self.turn += 1;
        Some(req)
    }
}

// ------------------------------------------------------------------------------------------------
// Arrivals

/// When sessions start.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Arrivals {
    /// Closed loop: the runner keeps at most `concurrency` sessions in flight.
    Closed {
        /// Sessions in flight (the runner's cap).
        concurrency: usize,
    },
    /// Open loop: sessions start at Poisson times of this rate (per second).
    Poisson {
        /// Sessions per second.
        rate: f64,
    },
    /// Open loop at the workload's own times (trace timestamps), divided by `speedup`.
    Timed {
        /// Time compression (2 = twice as fast as recorded).
        speedup: f64,
    },
}

impl Arrivals {
    /// The runner's concurrency cap (open loop: none).
    pub fn concurrency(&self) -> Option<usize> {
        match self {
            Arrivals::Closed { concurrency } => Some((*concurrency).max(1)),
            _ => None,
        }
    }

    /// Short description for reports.
    pub fn describe(&self) -> String {
        match self {
            Arrivals::Closed { concurrency } => format!("closed loop, concurrency {concurrency}"),
            Arrivals::Poisson { rate } => format!("Poisson arrivals, {rate} sessions/s"),
            Arrivals::Timed { speedup } => format!("trace arrival times / {speedup}"),
        }
    }
}

/// Wraps a session so its first request is not sent before `start`.
struct Delayed {
    inner: Box<dyn Session>,
    start: Duration,
}

impl Session for Delayed {
    fn id(&self) -> &str {
        self.inner.id()
    }

    fn next_request(&mut self, previous: Option<Previous<'_>>) -> Option<PlannedRequest> {
        let mut r = self.inner.next_request(previous)?;
        if r.turn == 0 {
            r.not_before = Some(r.not_before.map_or(self.start, |t| t.max(self.start)));
        }
        Some(r)
    }
}

impl Workload {
    /// Applies Poisson session starts (seeded); other arrival kinds leave the sessions alone
    /// (closed loop is the runner's cap, timed arrivals are set by the workload).
    pub fn with_arrivals(mut self, arrivals: Arrivals, seed: u64) -> Self {
        if let Arrivals::Poisson { rate } = arrivals {
            let mut rng = SplitMix64::derive(seed, "poisson", 0);
            let mut t = 0.0f64;
            self.sessions = std::mem::take(&mut self.sessions)
                .into_iter()
                .map(|inner| {
                    let start = Duration::from_secs_f64(t);
                    // Inverse-CDF exponential gap; 1 - u keeps ln away from 0.
                    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                    t += -(1.0 - u).ln() / rate.max(1e-9);
                    Box::new(Delayed { inner, start }) as Box<dyn Session>
                })
                .collect();
        }
        self.description = format!("{}; {}", self.description, arrivals.describe());
        self
    }
}

/// A session of exactly one request.
pub(crate) struct OneShot {
    pub(crate) id: String,
    pub(crate) request: Option<PlannedRequest>,
}

impl Session for OneShot {
    fn id(&self) -> &str {
        &self.id
    }

    fn next_request(&mut self, _previous: Option<Previous<'_>>) -> Option<PlannedRequest> {
        self.request.take()
    }
}

pub(crate) fn completion_body(model: &str, prompt: Value, max_tokens: u32) -> Value {
    json!({
        "model": model,
        "prompt": prompt,
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens.max(1),
        "ignore_eos": true,
    })
}

// ------------------------------------------------------------------------------------------------
// Shared prefix

/// Parameters of the shared-prefix workload (workloads.md §3.1; sizes in the sim's tokens, i.e.
/// 4 bytes of text each).
#[derive(Debug, Clone, Serialize)]
pub struct SharedPrefixSpec {
    /// Groups (distinct system prompts).
    pub groups: usize,
    /// Prompts per group.
    pub prompts_per_group: usize,
    /// System prompt length, tokens.
    pub system_tokens: usize,
    /// Question length, tokens.
    pub question_tokens: usize,
    /// Output length, tokens.
    pub output_tokens: u32,
    /// `model` field.
    pub model: String,
    /// Seed of every text and of the request order.
    pub seed: u64,
}

impl Default for SharedPrefixSpec {
    fn default() -> Self {
        Self {
            groups: 10,
            prompts_per_group: 10,
            system_tokens: 100,
            question_tokens: 50,
            output_tokens: 50,
            model: "sim-model".into(),
            seed: 1,
        }
    }
}

impl SharedPrefixSpec {
    /// Builds the requests, groups interleaved in a seeded random order.
    pub fn build(&self) -> Workload {
        let systems: Vec<String> = (0..self.groups)
            .map(|g| {
                prose_tokens(
                    &mut SplitMix64::derive(self.seed, "group", g as u64),
                    self.system_tokens,
                )
            })
            .collect();
        let mut order: Vec<(usize, usize)> = (0..self.groups)
            .flat_map(|g| (0..self.prompts_per_group).map(move |p| (g, p)))
            .collect();
        let mut rng = SplitMix64::derive(self.seed, "order", 0);
        for i in (1..order.len()).rev() {
            order.swap(i, rng.range(0, i));
        }
        let sessions: Vec<Box<dyn Session>> = order
            .into_iter()
            .map(|(g, p)| {
                let mut q = SplitMix64::derive(
                    self.seed,
                    "question",
                    (g * self.prompts_per_group + p) as u64,
                );
                let prompt = format!(
                    "{}{}",
                    systems[g],
                    prose_tokens(&mut q, self.question_tokens)
                );
                Box::new(OneShot {
                    id: format!("sp-{}-{g}-{p}", self.seed),
                    request: Some(PlannedRequest {
                        api: Api::Completions,
                        body: completion_body(
                            &self.model,
                            Value::String(prompt),
                            self.output_tokens,
                        ),
                        headers: Vec::new(),
                        turn: 0,
                        not_before: None,
                        think: None,
                    }),
                }) as Box<dyn Session>
            })
            .collect();
        Workload {
            name: "shared-prefix".into(),
            description: format!(
                "{} groups x {} prompts, system {} / question {} / output {} tokens, seed {}",
                self.groups,
                self.prompts_per_group,
                self.system_tokens,
                self.question_tokens,
                self.output_tokens,
                self.seed
            ),
            requests: sessions.len(),
            sessions,
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Fork: many branches off one long context at once

/// Parameters of the fork workload (sizes in the sim's tokens, i.e. 4 bytes of text each).
#[derive(Debug, Clone, Serialize)]
pub struct ForkSpec {
    /// The shared context's length in the first round, tokens.
    pub prefix_tokens: usize,
    /// The context grows by this much every round (the agent went on before forking again).
    pub growth_tokens: usize,
    /// Branches per round.
    pub branches: usize,
    /// Rounds.
    pub rounds: usize,
    /// A round's branches are sent at uniform times within this many milliseconds of its start.
    pub spread_ms: u64,
    /// Milliseconds between the starts of two rounds.
    pub round_gap_ms: u64,
    /// Each branch's own suffix, tokens.
    pub suffix_tokens: usize,
    /// Output length, tokens.
    pub output_tokens: u32,
    /// Every branch sends the same `prompt_cache_key` (one agent session, as clients that key
    /// their cache by conversation do); off: branches name no session.
    pub shared_cache_key: bool,
    /// `model` field.
    pub model: String,
    /// Seed of every text and send time.
    pub seed: u64,
}

impl Default for ForkSpec {
    fn default() -> Self {
        Self {
            prefix_tokens: 8192,
            growth_tokens: 256,
            branches: 32,
            rounds: 3,
            spread_ms: 1000,
            round_gap_ms: 8000,
            suffix_tokens: 64,
            output_tokens: 16,
            shared_cache_key: false,
            model: "sim-model".into(),
            seed: 1,
        }
    }
}

impl ForkSpec {
    /// The shared context of round `round`: the first round's, then each round's growth.
    pub fn context(&self, round: usize) -> String {
        let mut s = prose_tokens(
            &mut SplitMix64::derive(self.seed, "fork-context", 0),
            self.prefix_tokens,
        );
        for r in 1..=round {
            s.push_str(&prose_tokens(
                &mut SplitMix64::derive(self.seed, "fork-growth", r as u64),
                self.growth_tokens,
            ));
        }
        s
    }

    /// Builds the requests: open loop, each branch at its own time.
    pub fn build(&self) -> Workload {
        let mut times = SplitMix64::derive(self.seed, "fork-times", 0);
        let mut sessions: Vec<(Duration, Box<dyn Session>)> = Vec::new();
        for round in 0..self.rounds {
            let context = self.context(round);
            let start = Duration::from_millis(self.round_gap_ms * round as u64);
            for b in 0..self.branches {
                let offset = Duration::from_millis(times.range(0, self.spread_ms as usize) as u64);
                let suffix = prose_tokens(
                    &mut SplitMix64::derive(
                        self.seed,
                        "fork-branch",
                        (round * self.branches + b) as u64,
                    ),
                    self.suffix_tokens,
                );
                let mut body = completion_body(
                    &self.model,
                    Value::String(format!("{context}{suffix}")),
                    self.output_tokens,
                );
                if self.shared_cache_key {
                    body["prompt_cache_key"] = Value::String(format!("fork-{}", self.seed));
                }
                let at = start + offset;
                let session = Box::new(OneShot {
                    id: format!("fork-{}-{round}-{b}", self.seed),
                    request: Some(PlannedRequest {
                        api: Api::Completions,
                        body,
                        headers: Vec::new(),
                        turn: 0,
                        not_before: Some(at),
                        think: None,
                    }),
                }) as Box<dyn Session>;
                sessions.push((at, session));
            }
        }
        sessions.sort_by_key(|(at, _)| *at);
        let sessions: Vec<Box<dyn Session>> = sessions.into_iter().map(|(_, s)| s).collect();
        Workload {
            name: "fork".into(),
            description: format!(
                "{} rounds x {} branches within {} ms, every {} ms; context {} tokens (+{} a \
                 round), suffix {} / output {} tokens{}, seed {}",
                self.rounds,
                self.branches,
                self.spread_ms,
                self.round_gap_ms,
                self.prefix_tokens,
                self.growth_tokens,
                self.suffix_tokens,
                self.output_tokens,
                if self.shared_cache_key {
                    ", one prompt_cache_key"
                } else {
                    ""
                },
                self.seed
            ),
            requests: sessions.len(),
            sessions,
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Mooncake trace replay

/// Parameters of a trace replay.
#[derive(Debug, Clone)]
pub struct TraceSpec {
    /// The trace (already cut to the requests to replay).
    pub trace: super::trace::Trace,
    /// Id → token expansion.
    pub expansion: super::trace::Expansion,
    /// Output tokens = `output_length × output_scale` (at least 1).
    pub output_scale: f64,
    /// Open loop at trace times (`Timed`) or closed loop.
    pub arrivals: Arrivals,
    /// Timed arrivals: requests sharing one timestamp spread until the next
    /// ([`super::trace::spread_clumps`]).
    pub spread_clumps: bool,
    /// `model` field.
    pub model: String,
}

impl TraceSpec {
    /// One single-request session per trace line, in trace order; `/v1/completions` with a
    /// token-id prompt, as vLLM accepts it (so router and engine blocks coincide).
    pub fn build(&self) -> Workload {
        let at_us = match self.arrivals {
            Arrivals::Timed { speedup } => self
                .trace
                .arrivals_us(speedup.max(1e-9), self.spread_clumps),
            _ => Vec::new(),
        };
        let sessions: Vec<Box<dyn Session>> = self
            .trace
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let tokens = self.expansion.prompt(r);
                let out = ((f64::from(r.output_length) * self.output_scale).round() as u32).max(1);
                Box::new(OneShot {
                    id: format!("{}-{i}", self.trace.name),
                    request: Some(PlannedRequest {
                        api: Api::Completions,
                        body: completion_body(&self.model, json!(tokens), out),
                        headers: Vec::new(),
                        turn: 0,
                        not_before: at_us.get(i).map(|&us| Duration::from_micros(us)),
                        think: None,
                    }),
                }) as Box<dyn Session>
            })
            .collect();
        let last = self.trace.records.last().map_or(0, |r| r.timestamp);
        Workload {
            name: format!("trace:{}", self.trace.name),
            description: format!(
                "requests {}..{} of {} ({:.0} s recorded), output x{}, {}{}",
                self.trace.offset,
                self.trace.offset + self.trace.records.len(),
                self.trace.name,
                last as f64 / 1e3,
                self.output_scale,
                self.arrivals.describe(),
                if self.spread_clumps && !at_us.is_empty() {
                    ", clumps spread"
                } else {
                    ""
                }
            ),
            requests: sessions.len(),
            sessions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drive(w: &mut Workload) -> Vec<Vec<PlannedRequest>> {
        w.sessions
            .iter_mut()
            .map(|s| {
                let mut out = Vec::new();
                let mut prev_text = String::new();
                let mut prev = None;
                while let Some(r) = s.next_request(prev) {
                    prev_text = format!("answer {}", r.turn);
                    out.push(r);
                    prev = Some(Previous { text: &prev_text });
                }
                let _ = &prev_text;
                out
            })
            .collect()
    }

    #[test]
    fn multiturn_is_deterministic_and_shaped() {
        let spec = MultiturnSpec {
            sessions: 3,
            turns: 4,
            ..Default::default()
        };
        let a = drive(&mut spec.build());
        let b = drive(&mut spec.build());
        assert_eq!(a.len(), 3);
        for (sa, sb) in a.iter().zip(&b) {
            assert_eq!(sa.len(), 4);
            for (ra, rb) in sa.iter().zip(sb) {
                assert_eq!(ra.body, rb.body);
            }
        }
        let sys = spec.system_prompt();
        assert!((6000..6300).contains(&sys.len()), "{}", sys.len());
        // Turn t has system + t (question, answer) pairs + the new question.
        let last = &a[1][3].body["messages"];
        let msgs = last.as_array().unwrap();
        assert_eq!(msgs.len(), 1 + 2 * 3 + 1);
        assert_eq!(msgs[0]["content"], sys);
        assert_eq!(msgs[2]["content"], "answer 0");
        let q = msgs[7]["content"].as_str().unwrap();
        assert!((200..=420).contains(&q.len()), "{}", q.len());
        // Sessions differ after the system prompt; the header carries the session id.
        assert_ne!(a[0][0].body["messages"][1], a[1][0].body["messages"][1]);
        assert_eq!(a[2][0].headers[0].0, "x-session-id");
        assert_eq!(a[0][0].body["stream"], true);
        // Another seed gives another system prompt.
        let other = MultiturnSpec {
            seed: 2,
            ..spec.clone()
        };
        assert_ne!(other.system_prompt(), sys);
    }

    #[test]
    fn documents_open_each_conversation_and_sessionless_requests_name_none() {
        let plain = MultiturnSpec {
            sessions: 2,
            turns: 3,
            ..Default::default()
        };
        let spec = MultiturnSpec {
            document_bytes: (1000, 1200),
            session_header: false,
            ..plain.clone()
        };
        let (a, p) = (drive(&mut spec.build()), drive(&mut plain.build()));
        let first = |s: &Vec<PlannedRequest>, t: usize| {
            let m = s[t].body["messages"].as_array().unwrap().clone();
            m[2 * t + 1]["content"].as_str().unwrap().to_string()
        };
        for (s, ps) in a.iter().zip(&p) {
            let q0 = first(s, 0);
            assert!(
                q0.starts_with("Document ") && (1000..1700).contains(&q0.len()),
                "{q0}"
            );
            assert!(
                q0.ends_with(&first(ps, 0)),
                "the question follows the document unchanged"
            );
            assert_eq!(first(s, 1), first(ps, 1), "later turns carry no document");
            assert!(s.iter().all(|r| r.headers.is_empty()), "no session id");
        }
        assert_ne!(
            first(&a[0], 0),
            first(&a[1], 0),
            "each conversation its own document"
        );
    }

    #[test]
    fn think_pauses_come_between_turns_in_their_range() {
        let plain = drive(&mut MultiturnSpec::default().build());
        assert!(plain.iter().flatten().all(|r| r.think.is_none()));
        let spec = MultiturnSpec {
            think_ms: (100, 1500),
            ..MultiturnSpec::default()
        };
        let sessions = drive(&mut spec.build());
        for s in &sessions {
            assert!(s[0].think.is_none(), "the first turn starts at once");
            for r in &s[1..] {
                let ms = r.think.expect("a pause").as_millis();
                assert!((100..=1500).contains(&ms), "{ms}");
            }
        }
        let again = drive(&mut spec.build());
        let pauses = |v: &Vec<Vec<PlannedRequest>>| -> Vec<_> {
            v.iter().flatten().map(|r| r.think).collect()
        };
        assert_eq!(pauses(&sessions), pauses(&again), "seeded");
        // Pauses draw from their own stream: the texts are those of the default spec.
        assert_eq!(sessions[0][1].body, plain[0][1].body);
    }

    #[test]
    fn shared_prefix_groups_share_exactly_their_system_prompt() {
        let spec = SharedPrefixSpec {
            groups: 3,
            prompts_per_group: 4,
            ..Default::default()
        };
        let reqs: Vec<PlannedRequest> = drive(&mut spec.build()).into_iter().flatten().collect();
        assert_eq!(reqs.len(), 12);
        let prompt = |r: &PlannedRequest| r.body["prompt"].as_str().unwrap().to_string();
        for r in &reqs {
            assert_eq!(prompt(r).len(), (100 + 50) * 4);
            assert_eq!(r.body["max_tokens"], 50);
        }
        let mut systems: Vec<String> = reqs.iter().map(|r| prompt(r)[..400].to_string()).collect();
        systems.sort();
        systems.dedup();
        assert_eq!(systems.len(), 3);
        let again: Vec<Value> = drive(&mut spec.build())
            .into_iter()
            .flatten()
            .map(|r| r.body)
            .collect();
        assert_eq!(
            again,
            reqs.iter().map(|r| r.body.clone()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn poisson_arrivals_are_seeded_and_have_the_rate() {
        let spec = SharedPrefixSpec {
            groups: 20,
            prompts_per_group: 50,
            ..Default::default()
        };
        let starts = |seed| -> Vec<Duration> {
            drive(
                &mut spec
                    .build()
                    .with_arrivals(Arrivals::Poisson { rate: 10.0 }, seed),
            )
            .into_iter()
            .map(|s| s[0].not_before.unwrap())
            .collect()
        };
        let a = starts(3);
        assert_eq!(a, starts(3));
        assert_ne!(a, starts(4));
        assert_eq!(a[0], Duration::ZERO);
        // 999 gaps at 10/s: about 99.9 s (σ ≈ 3.2 s).
        let last = a.last().unwrap().as_secs_f64();
        assert!((85.0..115.0).contains(&last), "{last}");
    }

    #[test]
    fn trace_requests_carry_the_expanded_tokens_and_scaled_times() {
        use super::super::trace::{Expansion, Trace, TraceRecord};
        let trace = Trace {
            name: "t".into(),
            offset: 0,
            records: vec![
                TraceRecord {
                    timestamp: 0,
                    input_length: 600,
                    output_length: 10,
                    hash_ids: vec![0, 1],
                },
                TraceRecord {
                    timestamp: 3000,
                    input_length: 100,
                    output_length: 0,
                    hash_ids: vec![0],
                },
                TraceRecord {
                    timestamp: 3000,
                    input_length: 100,
                    output_length: 0,
                    hash_ids: vec![0],
                },
            ],
        };
        let mut spec = TraceSpec {
            trace,
            expansion: Expansion::default(),
            output_scale: 0.5,
            arrivals: Arrivals::Timed { speedup: 2.0 },
            spread_clumps: false,
            model: "m".into(),
        };
        let reqs: Vec<PlannedRequest> = drive(&mut spec.build()).into_iter().flatten().collect();
        assert_eq!(reqs[0].body["prompt"].as_array().unwrap().len(), 600);
        assert_eq!(reqs[0].body["prompt"][0], 8535);
        assert_eq!(reqs[0].body["max_tokens"], 5);
        assert_eq!(reqs[1].body["max_tokens"], 1);
        assert_eq!(reqs[1].not_before, Some(Duration::from_millis(1500)));
        assert_eq!(reqs[2].not_before, reqs[1].not_before, "a clump as traced");
        assert_eq!(reqs[0].api, Api::Completions);
        spec.spread_clumps = true;
        let mut w = spec.build();
        assert!(
            w.description.ends_with("clumps spread"),
            "{}",
            w.description
        );
        let spread: Vec<Option<Duration>> = drive(&mut w)
            .into_iter()
            .flatten()
            .map(|r| r.not_before)
            .collect();
        let ms = |m: u64| Some(Duration::from_micros(m));
        assert_eq!(spread, [ms(0), ms(1_500_000), ms(1_500_500)]);
    }

    #[test]
    fn fork_rounds_branch_off_one_growing_context_within_their_spread() {
        let spec = ForkSpec {
            prefix_tokens: 200,
            growth_tokens: 20,
            branches: 5,
            rounds: 3,
            spread_ms: 300,
            round_gap_ms: 1000,
            suffix_tokens: 10,
            ..Default::default()
        };
        let w = spec.build();
        assert_eq!((w.name.as_str(), w.requests), ("fork", 15));
        let requests: Vec<PlannedRequest> =
            drive(&mut spec.build()).into_iter().flatten().collect();
        assert_eq!(requests.len(), 15);
        let prompt = |r: &PlannedRequest| r.body["prompt"].as_str().unwrap().to_string();
        let mut last = Duration::ZERO;
        for r in &requests {
            let at = r.not_before.expect("open loop");
            assert!(at >= last, "sent in time order");
            last = at;
            let round = (at.as_millis() / 1000) as usize;
            assert!(at.as_millis() as u64 - 1000 * round as u64 <= 300, "{at:?}");
            let context = spec.context(round);
            assert_eq!(context.len(), (200 + 20 * round) * 4);
            assert!(prompt(r).starts_with(&context));
            assert_eq!(prompt(r).len(), context.len() + 40);
            assert!(r.body.get("prompt_cache_key").is_none());
            assert!(r.headers.is_empty());
        }
        assert!(spec.context(2).starts_with(&spec.context(1)));
        let distinct: std::collections::BTreeSet<String> = requests.iter().map(prompt).collect();
        assert_eq!(distinct.len(), 15, "every branch has its own suffix");
        let keyed = ForkSpec {
            shared_cache_key: true,
            ..spec.clone()
        };
        let keys: std::collections::BTreeSet<String> = drive(&mut keyed.build())
            .into_iter()
            .flatten()
            .map(|r| r.body["prompt_cache_key"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(keys.len(), 1);
        let again: Vec<Value> = drive(&mut spec.build())
            .into_iter()
            .flatten()
            .map(|r| r.body)
            .collect();
        assert_eq!(
            again,
            requests.iter().map(|r| r.body.clone()).collect::<Vec<_>>()
        );
    }
}
