//! The engine model: a vLLM-like prefix cache and the timing of prefill and decode.
//!
//! Not a language model: tokens are 4 bytes of the prompt an API hands it (its rendered text,
//! or with `--tokenizer` a real tokenizer's ids, 4 bytes each: [`token_bytes`]), and
//! "generation" emits deterministic filler words. What is modelled faithfully is *cost*: only uncached prompt
//! tokens pay prefill (the last prompt token is always computed, as vLLM does), and the
//! scheduler decides when each request's prefill runs and when its tokens come out.
//!
//! # Schedulers (`--scheduler`)
//!
//! - `fcfs` (the default): prefill is one shared resource served first come, first served at
//!   `prefill_tokens_per_s`; a request's first token comes out when its prefill completes, the
//!   rest every `decode_interval` on the request's own clock. Decoding costs the prefill
//!   resource nothing, so a long prefill never delays anyone's next token, and decode load
//!   never delays a prefill. At most `max_batch` requests are admitted at once (queued for
//!   prefill, prefilling or decoding); the rest wait for a slot. A request is booked on the
//!   resource on admission, and its cache lookup counts the blocks the prefills booked ahead
//!   of it will have cached by the time its own starts, as vLLM looks a request up when it
//!   schedules it (so a request queued behind another sharing its prefix finds that prefix).
//!   A request dropped before its prefill ran still leaves its booking on the resource, but
//!   not its blocks (see `Engine::booked` for the approximations).
//! - `chunked`, as vLLM's default (v1) scheduler with chunked prefill: the engine runs in
//!   steps. Each step has a budget of `max_num_batched_tokens` tokens; every decoding request
//!   takes one token of it first, and what remains goes to prefills in arrival order, a long
//!   prompt split into chunks across steps (vLLM walks its running list in arrival order, a
//!   partial prefill among the decodes; putting decodes first is a simplification that only
//!   matters when decodes alone would fill the budget). A waiting request is scheduled (its prefix-cache
//!   lookup done, and it counts as running) when budget reaches it and fewer than `max_batch`
//!   are running; a waiting request that cannot be scheduled holds back those behind it. A
//!   step lasts `max(decode_interval, tokens in the step / prefill_tokens_per_s)`: decode and
//!   prefill tokens cost the same compute, and a step never takes less than one decode
//!   interval (a forward pass reads all the weights, however few tokens it carries). So an
//!   idle engine decodes at exactly `decode_interval`, as `fcfs` does; while a long prompt
//!   prefills, every running stream still gets a token each step, at the step time (8192
//!   tokens at 30000/s: 0.27 s) instead of waiting the whole prefill; and decode load slows
//!   prefills (it takes budget and lengthens steps). A request's first token comes out at the
//!   end of the step that computes its last prompt chunk; prompt blocks enter the prefix cache
//!   as their chunks complete. A request dropped by its client leaves at once, freeing its
//!   budget and batch slot from the next step on.
//! - `prefill-first`, as vLLM's v0 scheduler without chunked prefill: the same steps, but a
//!   step that has waiting prompts prefills them whole (in arrival order, as many as fit the
//!   budget, always at least one) and decodes nothing: a long prefill stalls every running
//!   stream for its whole duration. Decode steps run when no prompt waits.
//!
//! The stepped schedulers run one loop that plans a step, sleeps its duration and applies it;
//! steps follow each other on the loop's own clock (timer overshoot is caught up, within
//! 20 ms), so with the same arrivals the same steps happen: TTFT is whole steps and decode gaps
//! are step times, which the tests check exactly under Tokio's paused clock.
//!
//! # What `/metrics` counts
//!
//! - prefix-cache queries and hits, in prompt tokens, added when a prefill completes (hits:
//!   the leading whole blocks found cached, never the last prompt token);
//! - waiting: requests whose prefill has not started (queued behind another prefill or for a
//!   batch slot in `fcfs`; not yet scheduled in the stepped modes);
//! - running: requests prefilling (a partial prefill included) or decoding;
//! - KV-cache usage: blocks held by running requests over the cache's blocks, as vLLM computes
//!   it (a prompt block shared by several running requests counts once; cached blocks no
//!   running request holds are free, evictable, and do not count).

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inferlb_kvevents::{BlockHash, BlockRemoved, BlockStored, Event, Medium};
use lru::LruCache;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use xxhash_rust::xxh3::Xxh3;

use crate::kvpub::Sink;

/// Bytes per token: the simulator's tokenizer.
pub const BYTES_PER_TOKEN: usize = 4;

/// The simulator's token ids, the one definition the KV events and the render endpoints share:
/// each [`BYTES_PER_TOKEN`]-byte chunk of the text read as a little-endian u32, a short last
/// chunk padded with zeros.
pub fn token_ids(text: &[u8]) -> Vec<u32> {
    text.chunks(BYTES_PER_TOKEN)
        .map(|c| {
            let mut b = [0u8; BYTES_PER_TOKEN];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// Token ids as prompt bytes the engine reads back with [`token_ids`] unchanged: how a real
/// tokenizer's ids reach the cache, the events and the usage counts.
pub fn token_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_le_bytes()).collect()
}

/// How prefill and decode share the engine (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scheduler {
    /// One first-come-first-served prefill resource; decoding apart from it.
    Fcfs,
    /// Steps with a token budget: decodes first, then prefill chunks.
    Chunked,
    /// Steps where waiting prompts are prefilled whole before any decode.
    PrefillFirst,
}

impl Scheduler {
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Fcfs => "fcfs",
            Scheduler::Chunked => "chunked",
            Scheduler::PrefillFirst => "prefill-first",
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineConf {
    /// Prefill throughput, tokens per second, before the speed factor.
    pub prefill_tokens_per_s: f64,
    /// Time between two generated tokens of one request, before the speed factor.
    pub decode_interval: Duration,
    /// Requests running at once (vLLM's max_num_seqs); the rest wait.
    pub max_batch: usize,
    /// Tokens per cache block (vLLM's block_size).
    pub block_tokens: usize,
    /// Prefix-cache capacity in tokens.
    pub cache_tokens: usize,
    /// Divides every duration: 10.0 runs a scenario ten times faster.
    pub speed: f64,
    pub scheduler: Scheduler,
    /// Tokens one step may carry in the stepped schedulers (vLLM's max_num_batched_tokens).
    pub max_num_batched_tokens: usize,
}

#[derive(Default)]
pub struct Counters {
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub requests: AtomicU64,
    /// Prefilling or decoding.
    pub running: AtomicU64,
    /// Not prefilling yet.
    pub waiting: AtomicU64,
    /// Past the prefill (a subset of `running`).
    pub decoding: AtomicU64,
}

/// Blocks held by running requests: prompt blocks by hash (shared between requests), the rest
/// (a prompt's partial last block, generated tokens) by count.
#[derive(Default)]
struct KvHold {
    refs: HashMap<u64, u32>,
    own: u64,
}

/// What one request holds of `KvHold`.
#[derive(Default)]
struct SeqKv {
    /// Its first `reffed` prompt block hashes are referenced.
    reffed: usize,
    own: u64,
}

/// Blocks held for a KV handover (see [`Engine::pin`]); give them back with [`Engine::unpin`].
pub struct Pinned {
    hashes: Vec<u64>,
    kv: SeqKv,
}

/// Tokens out so far for a request in a stepped scheduler, and its cached prompt tokens.
#[derive(Debug, Clone, Copy, Default)]
struct Grant {
    tokens: usize,
    cached: usize,
}

/// A request in a stepped scheduler.
struct Entry {
    /// The prompt, kept only for KV events ([`Engine::event_text`]).
    text: Vec<u8>,
    hashes: Vec<u64>,
    prompt_tokens: usize,
    /// Prompt tokens to compute: at least one, so even an empty prompt yields a first token.
    need: usize,
    max_tokens: usize,
    cached: usize,
    /// Prompt tokens computed or found cached.
    computed: usize,
    /// Scheduled at least once: running, not waiting.
    scheduled: bool,
    granted: usize,
    kv: SeqKv,
    tx: watch::Sender<Grant>,
}

impl Entry {
    fn prefilled(&self) -> bool {
        self.scheduled && self.computed >= self.need
    }
}

#[derive(Default)]
struct Steps {
    next_id: u64,
    /// By arrival.
    seqs: BTreeMap<u64, Entry>,
    running: usize,
}

/// One step's work: (request, tokens, whether they are prefill) and how long it lasts.
struct Plan {
    work: Vec<(u64, usize, bool)>,
    duration: Duration,
}

pub struct Engine {
    pub conf: EngineConf,
    /// Chained block hash → (); LRU order is eviction order.
    cache: Mutex<LruCache<u64, ()>>,
    /// `fcfs`: when the shared prefill resource is next free.
    prefill_free_at: Mutex<Instant>,
    /// `fcfs`: the blocks of requests booked on the prefill resource whose prefill is not
    /// over, with how many such requests hold each. They are in the cache by the time a
    /// request booked later starts its prefill, so its lookup counts them: vLLM looks a
    /// request up when it schedules it, after the requests ahead of it, not when it arrives.
    /// Two approximations: a request dropped before its prefill is over takes its blocks out
    /// (those booked after it no longer count them), but one booked meanwhile keeps the
    /// shorter prefill it counted, and caches the blocks itself at its end; and a block
    /// counted as cached at booking may be evicted before the prefill starts.
    booked: Mutex<HashMap<u64, u32>>,
    /// `fcfs`: admission slots.
    batch: Arc<Semaphore>,
    /// The stepped schedulers' requests.
    steps: Mutex<Steps>,
    /// Wakes the step loop when work arrives or leaves.
    wake: Notify,
    kv: Mutex<KvHold>,
    pub counters: Counters,
    /// `--kv-events`: where each step's BlockStored and BlockRemoved go.
    events: Option<Arc<Sink>>,
}

/// Where an `fcfs` request is, for the running and waiting gauges.
#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Waiting,
    Prefilling,
    Decoding,
}

enum SeqKind {
    Fcfs {
        phase: Phase,
        hashes: Vec<u64>,
        kv: SeqKv,
        prompt_tokens: usize,
        next: Instant,
        _permit: Option<OwnedSemaphorePermit>,
        /// Its blocks count in [`Engine::booked`] (from its booking to the end of its prefill).
        booked: bool,
    },
    Stepped {
        id: u64,
        rx: watch::Receiver<Grant>,
    },
}

/// A request in the engine, from its arrival until it is dropped: it counts as waiting or
/// running meanwhile, and yields its tokens through [`Seq::next_token`]. Dropping it (the
/// reply is done, or the client went away) takes it out of the engine.
pub struct Seq<'a> {
    engine: &'a Engine,
    emitted: usize,
    kind: SeqKind,
}

/// Chained hashes of the full blocks of `text`: block i's hash covers blocks 0..=i.
pub fn block_hashes(text: &[u8], block_tokens: usize) -> Vec<u64> {
    let block_bytes = block_tokens * BYTES_PER_TOKEN;
    let mut prev = 0u64;
    text.chunks_exact(block_bytes)
        .map(|block| {
            let mut h = Xxh3::new();
            h.update(&prev.to_le_bytes());
            h.update(block);
            prev = h.digest();
            prev
        })
        .collect()
}

pub fn tokens(text: &[u8]) -> usize {
    text.len().div_ceil(BYTES_PER_TOKEN)
}

impl Engine {
    pub fn new(conf: EngineConf) -> Engine {
        Engine {
            cache: Mutex::new(LruCache::new(
                NonZeroUsize::new(Self::blocks_of(&conf)).unwrap_or(NonZeroUsize::MIN),
            )),
            prefill_free_at: Mutex::new(Instant::now()),
            booked: Mutex::new(HashMap::new()),
            batch: Arc::new(Semaphore::new(conf.max_batch.max(1))),
            steps: Mutex::new(Steps::default()),
            wake: Notify::new(),
            kv: Mutex::new(KvHold::default()),
            counters: Counters::default(),
            events: None,
            conf,
        }
    }

    /// Publishes the cache's changes as vLLM's KV events (before the engine is shared).
    pub fn set_events(&mut self, sink: Arc<Sink>) {
        self.events = Some(sink);
    }

    pub fn events(&self) -> Option<&Arc<Sink>> {
        self.events.as_ref()
    }

    /// vLLM's `reset_prefix_cache`: the cache empties, and subscribers hear `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self) {
        if let Ok(mut cache) = self.cache.lock() {
            cache.clear();
            if let Some(sink) = &self.events {
                sink.send(vec![Event::AllBlocksCleared]);
            }
        }
    }

    fn blocks_of(conf: &EngineConf) -> usize {
        (conf.cache_tokens / conf.block_tokens.max(1)).max(1)
    }

    /// The cache's size in blocks (vLLM's num_gpu_blocks).
    pub fn num_blocks(&self) -> usize {
        Self::blocks_of(&self.conf)
    }

    /// Starts the step loop of a stepped scheduler (nothing for `fcfs`). Needs a Tokio runtime.
    pub fn start(self: &Arc<Self>) {
        if self.conf.scheduler == Scheduler::Fcfs {
            return;
        }
        let engine = self.clone();
        tokio::spawn(async move { engine.step_loop().await });
    }

    pub fn scaled(&self, d: Duration) -> Duration {
        d.div_f64(self.conf.speed)
    }

    pub fn decode_interval(&self) -> Duration {
        self.scaled(self.conf.decode_interval)
    }

    /// How many leading tokens of `prompt` are in the cache; refreshes their LRU position.
    #[cfg(test)]
    pub fn lookup(&self, prompt: &[u8]) -> usize {
        self.lookup_hashes(&block_hashes(prompt, self.conf.block_tokens), true)
    }

    /// Tokens of the cached leading blocks among `hashes`; `touch` refreshes their LRU position.
    fn lookup_hashes(&self, hashes: &[u64], touch: bool) -> usize {
        let Ok(mut cache) = self.cache.lock() else {
            return 0;
        };
        let hit = hashes
            .iter()
            .take_while(|h| {
                if touch {
                    cache.get(*h).is_some()
                } else {
                    cache.peek(*h).is_some()
                }
            })
            .count();
        hit * self.conf.block_tokens
    }

    /// Puts the full blocks of `text` into the cache.
    pub fn insert(&self, text: &[u8]) {
        self.insert_blocks(&block_hashes(text, self.conf.block_tokens), 0, text);
    }

    /// Caches blocks `from..` of `hashes`, the full blocks of `text` (which may be empty when
    /// no events are published). With events on, this is one batch: the blocks new to the
    /// cache as BlockStored (chained to the block before them), evictions as BlockRemoved, in
    /// the order they happened (the sink is sent to under the cache's lock, so batches keep it).
    fn insert_blocks(&self, hashes: &[u64], from: usize, text: &[u8]) {
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        let Some(sink) = &self.events else {
            for h in &hashes[from.min(hashes.len())..] {
                cache.put(*h, ());
            }
            return;
        };
        let b = self.conf.block_tokens.max(1);
        let bb = b * BYTES_PER_TOKEN;
        let mut events: Vec<Event> = Vec::new();
        for (i, h) in hashes.iter().enumerate().skip(from) {
            let fresh = !cache.contains(h);
            if let Some((old, ())) = cache.push(*h, ()) {
                if old != *h {
                    match events.last_mut() {
                        Some(Event::BlockRemoved(r)) => r.block_hashes.push(BlockHash::Int(old)),
                        _ => events.push(Event::BlockRemoved(BlockRemoved {
                            block_hashes: vec![BlockHash::Int(old)],
                            medium: Some(Medium::Gpu),
                            ..BlockRemoved::default()
                        })),
                    }
                }
            }
            if !fresh {
                continue;
            }
            let tokens = text
                .get(i * bb..(i + 1) * bb)
                .map(token_ids)
                .unwrap_or_default();
            match events.last_mut() {
                // The run continues: this block's parent is the one just stored.
                Some(Event::BlockStored(s))
                    if s.block_hashes.last()
                        == i.checked_sub(1).map(|p| BlockHash::Int(hashes[p])).as_ref() =>
                {
                    s.block_hashes.push(BlockHash::Int(*h));
                    s.token_ids.extend(tokens);
                }
                _ => events.push(Event::BlockStored(BlockStored {
                    block_hashes: vec![BlockHash::Int(*h)],
                    parent_block_hash: i.checked_sub(1).map(|p| BlockHash::Int(hashes[p])),
                    token_ids: tokens,
                    block_size: b as u32,
                    medium: Some(Medium::Gpu),
                    ..BlockStored::default()
                })),
            }
        }
        sink.send(events);
    }

    /// The prompt's bytes as the engine keeps them for its events: all of them with events
    /// on, none otherwise.
    fn event_text(&self, prompt: &[u8]) -> Vec<u8> {
        if self.events.is_some() {
            prompt.to_vec()
        } else {
            Vec::new()
        }
    }

    /// How many leading tokens of `prompt` are in the cache (whole blocks); refreshes their LRU
    /// position, as a lookup by the scheduler does.
    pub fn cached_prefix(&self, prompt: &[u8]) -> usize {
        self.lookup_hashes(&block_hashes(prompt, self.conf.block_tokens), true)
    }

    /// Holds `prompt`'s blocks (in the cache and in KV usage) for a KV handover, until
    /// [`Engine::unpin`]: a finished prefill's blocks waiting for a decode to pull them.
    pub fn pin(&self, prompt: &[u8]) -> Pinned {
        let hashes = block_hashes(prompt, self.conf.block_tokens);
        self.insert_blocks(&hashes, 0, prompt);
        let mut kv = SeqKv::default();
        self.hold(&mut kv, &hashes, tokens(prompt));
        Pinned { hashes, kv }
    }

    pub fn unpin(&self, mut p: Pinned) {
        self.release(&mut p.kv, &p.hashes);
    }

    /// How full the prefix cache is (blocks cached, held or not).
    pub fn cache_usage(&self) -> f64 {
        self.cache
            .lock()
            .map(|c| c.len() as f64 / c.cap().get() as f64)
            .unwrap_or(0.0)
    }

    /// vLLM's KV-cache usage: blocks held by running requests over all blocks.
    pub fn kv_usage(&self) -> f64 {
        self.kv
            .lock()
            .map(|k| ((k.refs.len() as u64 + k.own) as f64 / self.num_blocks() as f64).min(1.0))
            .unwrap_or(0.0)
    }

    /// Makes `kv` hold the first `tokens` tokens of a request whose prompt blocks are `hashes`.
    fn hold(&self, kv: &mut SeqKv, hashes: &[u64], tokens: usize) {
        let b = self.conf.block_tokens.max(1);
        let full = (tokens / b).min(hashes.len()).max(kv.reffed);
        let own = (tokens.div_ceil(b).saturating_sub(full)) as u64;
        let Ok(mut k) = self.kv.lock() else {
            return;
        };
        for h in &hashes[kv.reffed..full] {
            *k.refs.entry(*h).or_insert(0) += 1;
        }
        kv.reffed = full;
        k.own = k.own - kv.own + own;
        kv.own = own;
    }

    fn release(&self, kv: &mut SeqKv, hashes: &[u64]) {
        let Ok(mut k) = self.kv.lock() else {
            return;
        };
        for h in &hashes[..kv.reffed] {
            if let Some(n) = k.refs.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    k.refs.remove(h);
                }
            }
        }
        k.own -= kv.own;
        *kv = SeqKv::default();
    }

    /// `fcfs`: books `uncached` tokens of prefill on the shared resource; returns when it
    /// starts and when it completes.
    pub fn book_prefill(&self, uncached: usize) -> (Instant, Instant) {
        let cost = self.scaled(Duration::from_secs_f64(
            uncached as f64 / self.conf.prefill_tokens_per_s,
        ));
        let now = Instant::now();
        let Ok(mut free_at) = self.prefill_free_at.lock() else {
            return (now, now + cost);
        };
        let start = (*free_at).max(now);
        *free_at = start + cost;
        (start, *free_at)
    }

    /// `fcfs`: books the prefill of a prompt of `hashes` (`prompt_tokens` long) on the shared
    /// resource, its blocks among those booked: it starts when those ahead are done, so what
    /// it finds cached then is what the cache holds now or their prefills put there. Returns
    /// when it starts, when it completes, its cached tokens, and whether its blocks count as
    /// booked (not when a lock was poisoned: then it is booked cold, apart).
    fn book_after_those_ahead(
        &self,
        hashes: &[u64],
        prompt_tokens: usize,
    ) -> (Instant, Instant, usize, bool) {
        // Held across the booking, so requests are looked up and booked in one order.
        let Ok(mut booked) = self.booked.lock() else {
            let (start, done) = self.book_prefill(prompt_tokens);
            return (start, done, 0, false);
        };
        let blocks = {
            let Ok(mut cache) = self.cache.lock() else {
                drop(booked);
                let (start, done) = self.book_prefill(prompt_tokens);
                return (start, done, 0, false);
            };
            hashes
                .iter()
                .take_while(|h| cache.get(*h).is_some() || booked.contains_key(*h))
                .count()
        };
        let cached = (blocks * self.conf.block_tokens).min(prompt_tokens.saturating_sub(1));
        let (start, done) = self.book_prefill(prompt_tokens - cached);
        for h in hashes {
            *booked.entry(*h).or_default() += 1;
        }
        (start, done, cached, true)
    }

    /// `fcfs`: a booked prefill is over, or will never be: its blocks no longer count as
    /// booked by it.
    fn unbook(&self, hashes: &[u64]) {
        let Ok(mut booked) = self.booked.lock() else {
            return;
        };
        for h in hashes {
            if let Some(n) = booked.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    booked.remove(h);
                }
            }
        }
    }

    /// Uncached prompt tokens not prefilled yet, over every request in the engine (in `fcfs`,
    /// those booked on the prefill resource).
    pub fn prefill_backlog(&self) -> u64 {
        if self.conf.scheduler == Scheduler::Fcfs {
            let left = self
                .prefill_free_at
                .lock()
                .map(|f| f.saturating_duration_since(Instant::now()))
                .unwrap_or_default();
            return (left.as_secs_f64() * self.conf.speed * self.conf.prefill_tokens_per_s).round()
                as u64;
        }
        let Ok(st) = self.steps.lock() else {
            return 0;
        };
        st.seqs
            .values()
            .map(|e| {
                let done = if e.scheduled {
                    e.computed
                } else {
                    self.lookup_hashes(&e.hashes, false)
                        .min(e.need.saturating_sub(1))
                };
                e.need.saturating_sub(done) as u64
            })
            .sum()
    }

    /// Admits a request with this prompt and runs its prefill: returns once its first token
    /// is out, with the request, its prompt tokens and how many of them were cached.
    pub async fn prefill(&self, prompt: &[u8], max_tokens: usize) -> (Seq<'_>, usize, usize) {
        let hashes = block_hashes(prompt, self.conf.block_tokens);
        let prompt_tokens = tokens(prompt);
        if self.conf.scheduler == Scheduler::Fcfs {
            self.prefill_fcfs(prompt, hashes, prompt_tokens).await
        } else {
            let text = self.event_text(prompt);
            self.prefill_stepped(text, hashes, prompt_tokens, max_tokens)
                .await
        }
    }

    async fn prefill_fcfs(
        &self,
        prompt: &[u8],
        hashes: Vec<u64>,
        prompt_tokens: usize,
    ) -> (Seq<'_>, usize, usize) {
        self.counters.waiting.fetch_add(1, Ordering::Relaxed);
        // From here on, dropping the request (the client went away) undoes its counting.
        let mut seq = Seq {
            engine: self,
            emitted: 0,
            kind: SeqKind::Fcfs {
                phase: Phase::Waiting,
                hashes,
                kv: SeqKv::default(),
                prompt_tokens,
                next: Instant::now(),
                _permit: None,
                booked: false,
            },
        };
        // The semaphore is never closed.
        let permit = self
            .batch
            .clone()
            .acquire_owned()
            .await
            .expect("batch semaphore open");
        let SeqKind::Fcfs {
            hashes,
            _permit,
            booked,
            ..
        } = &mut seq.kind
        else {
            unreachable!("an fcfs request");
        };
        *_permit = Some(permit);
        let (start, done, cached, counted) = self.book_after_those_ahead(hashes, prompt_tokens);
        *booked = counted;
        if start > Instant::now() {
            tokio::time::sleep_until(start).await;
        }
        seq.set_phase(Phase::Prefilling);
        tokio::time::sleep_until(done).await;
        if let SeqKind::Fcfs { hashes, booked, .. } = &mut seq.kind {
            self.insert_blocks(hashes, 0, prompt);
            self.unbook(hashes);
            *booked = false;
        }
        seq.set_phase(Phase::Decoding);
        let c = &self.counters;
        c.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        c.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        (seq, prompt_tokens, cached)
    }

    async fn prefill_stepped(
        &self,
        text: Vec<u8>,
        hashes: Vec<u64>,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> (Seq<'_>, usize, usize) {
        let (tx, rx) = watch::channel(Grant::default());
        let id = {
            let mut st = self.steps.lock().expect("scheduler state");
            let id = st.next_id;
            st.next_id += 1;
            st.seqs.insert(
                id,
                Entry {
                    text,
                    hashes,
                    prompt_tokens,
                    need: prompt_tokens.max(1),
                    max_tokens: max_tokens.max(1),
                    cached: 0,
                    computed: 0,
                    scheduled: false,
                    granted: 0,
                    kv: SeqKv::default(),
                    tx,
                },
            );
            self.counters.waiting.fetch_add(1, Ordering::Relaxed);
            id
        };
        let mut seq = Seq {
            engine: self,
            emitted: 0,
            kind: SeqKind::Stepped { id, rx },
        };
        self.wake.notify_one();
        let SeqKind::Stepped { rx, .. } = &mut seq.kind else {
            unreachable!("a stepped request");
        };
        let cached = rx
            .wait_for(|g| g.tokens >= 1)
            .await
            .map(|g| g.cached)
            .unwrap_or(0);
        (seq, prompt_tokens, cached)
    }

    /// Takes request `id` out of the stepped scheduler (finished, or dropped by its client).
    fn remove(&self, st: &mut Steps, id: u64) {
        let Some(mut e) = st.seqs.remove(&id) else {
            return;
        };
        let c = &self.counters;
        if e.scheduled {
            st.running -= 1;
            c.running.fetch_sub(1, Ordering::Relaxed);
            if e.computed >= e.need {
                c.decoding.fetch_sub(1, Ordering::Relaxed);
            }
        } else {
            c.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        self.release(&mut e.kv, &e.hashes);
    }

    /// Moves a waiting request to running: its prefix-cache lookup happens now, as vLLM looks
    /// a request up when it schedules it.
    fn schedule(&self, st_running: &mut usize, e: &mut Entry) {
        e.cached = self
            .lookup_hashes(&e.hashes, true)
            .min(e.need.saturating_sub(1));
        e.computed = e.cached;
        e.scheduled = true;
        *st_running += 1;
        self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        self.counters.running.fetch_add(1, Ordering::Relaxed);
    }

    /// Decides the next step, or None when there is nothing to run.
    fn plan_step(&self) -> Option<Plan> {
        let mut guard = self.steps.lock().ok()?;
        let st = &mut *guard;
        let max_batch = self.conf.max_batch.max(1);
        let mut budget = self.conf.max_num_batched_tokens.max(1);
        let mut work = Vec::new();
        let decodes = |st: &mut Steps, budget: &mut usize, work: &mut Vec<_>| {
            for (id, e) in st.seqs.iter_mut().filter(|(_, e)| e.prefilled()) {
                if *budget == 0 {
                    break;
                }
                *budget -= 1;
                work.push((*id, 1, false));
                self.hold(&mut e.kv, &e.hashes, e.prompt_tokens + e.granted + 1);
            }
        };
        if self.conf.scheduler == Scheduler::Chunked {
            decodes(st, &mut budget, &mut work);
        }
        let Steps { seqs, running, .. } = st;
        for (id, e) in seqs.iter_mut().filter(|(_, e)| !e.prefilled()) {
            if budget == 0 {
                break;
            }
            if !e.scheduled {
                if *running >= max_batch {
                    break;
                }
                if self.conf.scheduler == Scheduler::PrefillFirst && !work.is_empty() {
                    // Whole prompts only: the next one must fit what is left.
                    let cached = self
                        .lookup_hashes(&e.hashes, false)
                        .min(e.need.saturating_sub(1));
                    if e.need - cached > budget {
                        break;
                    }
                }
                self.schedule(running, e);
            }
            let left = e.need - e.computed;
            let n = match self.conf.scheduler {
                Scheduler::PrefillFirst => left,
                _ => left.min(budget),
            };
            budget = budget.saturating_sub(n);
            work.push((*id, n, true));
            self.hold(&mut e.kv, &e.hashes, e.computed + n);
        }
        if self.conf.scheduler == Scheduler::PrefillFirst && work.is_empty() {
            budget = usize::MAX;
            decodes(st, &mut budget, &mut work);
        }
        if work.is_empty() {
            return None;
        }
        let used: usize = work.iter().map(|w| w.1).sum();
        let compute = Duration::from_secs_f64(used as f64 / self.conf.prefill_tokens_per_s);
        Some(Plan {
            work,
            duration: self.scaled(compute.max(self.conf.decode_interval)),
        })
    }

    /// The step is over: prefill chunks are computed (their blocks cached), tokens come out.
    fn apply(&self, plan: &Plan) {
        let Ok(mut guard) = self.steps.lock() else {
            return;
        };
        let st = &mut *guard;
        let b = self.conf.block_tokens.max(1);
        let c = &self.counters;
        for &(id, n, prefill) in &plan.work {
            let Some(e) = st.seqs.get_mut(&id) else {
                continue; // gone meanwhile
            };
            if prefill {
                let before = (e.computed / b).min(e.hashes.len());
                e.computed += n;
                let after = (e.computed / b).min(e.hashes.len());
                self.insert_blocks(&e.hashes[..after], before, &e.text);
                if e.computed < e.need {
                    continue;
                }
                c.prompt_tokens
                    .fetch_add(e.prompt_tokens as u64, Ordering::Relaxed);
                c.cached_tokens
                    .fetch_add(e.cached as u64, Ordering::Relaxed);
                c.decoding.fetch_add(1, Ordering::Relaxed);
            }
            e.granted += 1;
            e.tx.send_replace(Grant {
                tokens: e.granted,
                cached: e.cached,
            });
            if e.granted >= e.max_tokens {
                self.remove(st, id);
            }
        }
    }

    async fn step_loop(&self) {
        // When the previous step ended, while the engine is busy: steps follow each other on
        // this clock, so timer overshoot does not slow decoding down (bounded catch-up).
        let mut clock: Option<Instant> = None;
        loop {
            let Some(plan) = self.plan_step() else {
                clock = None;
                self.wake.notified().await;
                continue;
            };
            let now = Instant::now();
            let start = match clock {
                Some(t) => t.max(now.checked_sub(Duration::from_millis(20)).unwrap_or(now)),
                None => now,
            };
            let end = start + plan.duration;
            tokio::time::sleep_until(end).await;
            self.apply(&plan);
            clock = Some(end);
        }
    }
}

impl Seq<'_> {
    /// `fcfs`: moves the request to `to`, keeping the gauges and its KV blocks right.
    fn set_phase(&mut self, to: Phase) {
        let e = self.engine;
        let SeqKind::Fcfs {
            phase,
            hashes,
            kv,
            prompt_tokens,
            ..
        } = &mut self.kind
        else {
            return;
        };
        let c = &e.counters;
        match (*phase, to) {
            (Phase::Waiting, Phase::Prefilling) => {
                c.waiting.fetch_sub(1, Ordering::Relaxed);
                c.running.fetch_add(1, Ordering::Relaxed);
                // The whole prompt is allocated when its prefill is scheduled.
                e.hold(kv, hashes, *prompt_tokens);
            }
            (Phase::Prefilling, Phase::Decoding) => {
                c.decoding.fetch_add(1, Ordering::Relaxed);
            }
            _ => return,
        }
        *phase = to;
    }

    /// Waits until this request's next token is out: the first at once (it came out of the
    /// prefill), then each at its decode pace.
    pub async fn next_token(&mut self) {
        let engine = self.engine;
        let i = self.emitted;
        self.emitted += 1;
        match &mut self.kind {
            SeqKind::Fcfs {
                hashes,
                kv,
                prompt_tokens,
                next,
                ..
            } => {
                if i == 0 {
                    *next = Instant::now();
                } else {
                    *next += engine.decode_interval();
                    tokio::time::sleep_until(*next).await;
                }
                engine.hold(kv, hashes, *prompt_tokens + i + 1);
            }
            SeqKind::Stepped { rx, .. } => {
                if i > 0 {
                    // Err: the scheduler let it go, which it does only after its last token.
                    let _ = rx.wait_for(|g| g.tokens > i).await;
                }
            }
        }
    }
}

impl Drop for Seq<'_> {
    fn drop(&mut self) {
        let e = self.engine;
        match &mut self.kind {
            SeqKind::Fcfs {
                phase,
                hashes,
                kv,
                booked,
                ..
            } => {
                if *booked {
                    e.unbook(hashes);
                }
                let c = &e.counters;
                match phase {
                    Phase::Waiting => {
                        c.waiting.fetch_sub(1, Ordering::Relaxed);
                    }
                    Phase::Prefilling => {
                        c.running.fetch_sub(1, Ordering::Relaxed);
                    }
                    Phase::Decoding => {
                        c.running.fetch_sub(1, Ordering::Relaxed);
                        c.decoding.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                e.release(kv, hashes);
            }
            SeqKind::Stepped { id, .. } => {
                if let Ok(mut st) = e.steps.lock() {
                    e.remove(&mut st, *id);
                }
                e.wake.notify_one();
            }
        }
    }
}

/// Deterministic filler text: token `i` of a reply, 4 bytes each.
pub fn token_text(seed: u64, i: usize) -> &'static str {
    const WORDS: [&str; 16] = [
        "the ", "cat ", "sat ", "on ", "a ", "mat ", "and ", "ran ", "far ", "off ", "to ", "see ",
        "new ", "sky ", "at ", "sun ",
    ];
    // Mixing the seed keeps different requests' replies apart in the cache.
    WORDS[((seed as usize).wrapping_mul(31).wrapping_add(i * 7)) % WORDS.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(scheduler: Scheduler) -> EngineConf {
        EngineConf {
            prefill_tokens_per_s: 1000.0,
            decode_interval: Duration::from_millis(10),
            max_batch: 2,
            block_tokens: 4,
            cache_tokens: 1000,
            speed: 1.0,
            scheduler,
            max_num_batched_tokens: 100,
        }
    }

    fn engine(cache_tokens: usize) -> Engine {
        Engine::new(EngineConf {
            cache_tokens,
            ..conf(Scheduler::Fcfs)
        })
    }

    fn started(conf: EngineConf) -> Arc<Engine> {
        let e = Arc::new(Engine::new(conf));
        e.start();
        e
    }

    /// A distinct prompt of `tokens` tokens.
    fn prompt(tag: u8, tokens: usize) -> Vec<u8> {
        let mut p = vec![b'a' + tag; tokens * BYTES_PER_TOKEN];
        p[0] = tag;
        p
    }

    /// Runs one request in the background: the instants its tokens come out.
    fn request(
        e: &Arc<Engine>,
        prompt: Vec<u8>,
        max_tokens: usize,
    ) -> tokio::task::JoinHandle<Vec<Instant>> {
        let e = e.clone();
        tokio::spawn(async move {
            let (mut seq, _, _) = e.prefill(&prompt, max_tokens).await;
            let mut out = vec![];
            for _ in 0..max_tokens {
                seq.next_token().await;
                out.push(Instant::now());
            }
            out
        })
    }

    fn gauges(e: &Engine) -> (u64, u64, u64) {
        let c = &e.counters;
        (
            c.running.load(Ordering::Relaxed),
            c.waiting.load(Ordering::Relaxed),
            c.decoding.load(Ordering::Relaxed),
        )
    }

    fn max_gap(times: &[Instant], from: Instant, to: Instant) -> Duration {
        times
            .windows(2)
            .filter(|w| w[1] > from && w[0] < to)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }

    #[test]
    fn a_prefix_hits_only_whole_leading_blocks() {
        let e = engine(1000);
        let text = vec![b'a'; 160]; // 40 tokens = 10 blocks
        assert_eq!(e.lookup(&text), 0);
        e.insert(&text);
        assert_eq!(e.lookup(&text), 40);
        let mut longer = text.clone();
        longer.extend_from_slice(&[b'b'; 64]);
        assert_eq!(e.lookup(&longer), 40);
        let mut changed = text.clone();
        changed[20] = b'z'; // inside block 1
        assert_eq!(e.lookup(&changed), 4);
    }

    #[test]
    fn token_ids_read_each_four_bytes_as_a_little_endian_u32() {
        let cases: [(&[u8], Vec<u32>); 3] = [
            (b"", vec![]),
            (b"abcd", vec![u32::from_le_bytes(*b"abcd")]),
            (
                b"abcdef",
                vec![u32::from_le_bytes(*b"abcd"), u32::from_le_bytes(*b"ef\0\0")],
            ),
        ];
        for (text, want) in cases {
            assert_eq!(token_ids(text), want, "{text:?}");
        }
    }

    #[test]
    fn token_bytes_are_read_back_as_the_same_ids() {
        let cases: [&[u32]; 4] = [&[], &[0], &[1, 2, 3], &[u32::MAX, 0, 151_643]];
        for ids in cases {
            let bytes = token_bytes(ids);
            assert_eq!(bytes.len(), ids.len() * BYTES_PER_TOKEN);
            assert_eq!(token_ids(&bytes), ids, "{ids:?}");
            assert_eq!(tokens(&bytes), ids.len());
        }
    }

    /// The cache's changes as KV events: new blocks chained to their parent, evictions before
    /// the block that caused them, a touched block silent, a reset as AllBlocksCleared.
    #[test]
    fn cache_changes_become_kv_events() {
        let mut e = engine(8); // two blocks of four tokens
        let (sink, mut rx) = Sink::new();
        e.set_events(Arc::new(sink));
        let text = prompt(0, 12); // three blocks
        let h = block_hashes(&text, 4);
        let bb = 4 * BYTES_PER_TOKEN;
        let int = |i: usize| BlockHash::Int(h[i]);
        let stored = |from: usize, to: usize| {
            Event::BlockStored(BlockStored {
                block_hashes: (from..to).map(int).collect(),
                parent_block_hash: from.checked_sub(1).map(int),
                token_ids: token_ids(&text[from * bb..to * bb]),
                block_size: 4,
                medium: Some(Medium::Gpu),
                ..BlockStored::default()
            })
        };
        let removed = |i: usize| {
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![int(i)],
                medium: Some(Medium::Gpu),
                ..BlockRemoved::default()
            })
        };
        e.insert(&text[..2 * bb]);
        assert_eq!(rx.try_recv().ok(), Some(vec![stored(0, 2)]));
        e.insert(&text);
        assert_eq!(rx.try_recv().ok(), Some(vec![removed(0), stored(2, 3)]));
        e.insert(&text[bb..]); // another prompt; its first block is new
        assert!(rx.try_recv().is_ok());
        e.reset_prefix_cache();
        assert_eq!(rx.try_recv().ok(), Some(vec![Event::AllBlocksCleared]));
        assert_eq!(e.lookup(&text), 0);
        e.insert(&text[..bb - 1]); // no full block: no event
        assert!(rx.try_recv().is_err());
        assert_eq!(
            e.events().map(|s| s.dropped.load(Ordering::Relaxed)),
            Some(0)
        );
    }

    #[test]
    fn lru_eviction_bounds_the_cache() {
        let e = engine(16); // 4 blocks
        e.insert(&[b'x'; 64]);
        e.insert(&[b'y'; 64]);
        assert_eq!(e.lookup(&[b'x'; 64]), 0, "evicted by the newer entry");
        assert_eq!(e.lookup(&[b'y'; 64]), 16);
        assert!(e.cache_usage() <= 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn prefill_is_one_shared_resource() {
        let e = engine(1000);
        let start = Instant::now();
        let (a0, a) = e.book_prefill(1000);
        let (b0, b) = e.book_prefill(500);
        assert_eq!((a0, a - start), (start, Duration::from_secs(1)));
        assert_eq!((b0, b - start), (a, Duration::from_millis(1500)));
    }

    /// A request queued behind another that shares its prefix finds that prefix cached when
    /// its own prefill starts, as vLLM looks a request up when it schedules it; one that
    /// arrives after a request was dropped before its prefill does not count its blocks.
    #[tokio::test(start_paused = true)]
    async fn fcfs_looks_a_request_up_after_the_prefills_booked_ahead_of_it() {
        let e = Arc::new(Engine::new(EngineConf {
            max_batch: 8,
            ..conf(Scheduler::Fcfs)
        }));
        let t0 = Instant::now();
        // 800 shared tokens, then 200 of each one's own: 1 s of prefill cold.
        let with_tail = |tag: u8| {
            let mut p = prompt(0, 800);
            p.extend(prompt(tag, 200));
            p
        };
        let leader = request(&e, with_tail(1), 1);
        tokio::time::sleep_until(t0 + Duration::from_millis(300)).await;
        let (seq, tokens, cached) = e.prefill(&with_tail(2), 1).await;
        assert_eq!((tokens, cached), (1000, 800));
        // Its 200 uncached tokens after the leader's 1000: 1.2 s from the start.
        assert_eq!(Instant::now() - t0, Duration::from_millis(1200));
        assert_eq!(leader.await.expect("leader").len(), 1);
        drop(seq);
        // A prompt booked behind another and dropped while it waits: its blocks never come.
        let _blocker = request(&e, prompt(8, 1000), 1);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let gone = {
            let e = e.clone();
            tokio::spawn(async move { e.prefill(&prompt(7, 1000), 1).await.2 })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(gauges(&e).1, 1, "it waits behind the blocker");
        gone.abort();
        let _ = gone.await;
        let (_, _, cached) = e.prefill(&prompt(7, 1000), 1).await;
        assert_eq!(cached, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn fcfs_counts_queued_prefills_as_waiting_and_the_prefilling_one_as_running() {
        let e = Arc::new(Engine::new(EngineConf {
            max_batch: 8,
            ..conf(Scheduler::Fcfs)
        }));
        let t0 = Instant::now();
        // 1000 tokens: 1 s of prefill each.
        let reqs: Vec<_> = (0..3).map(|i| request(&e, prompt(i, 1000), 200)).collect();
        tokio::time::sleep_until(t0 + Duration::from_millis(500)).await;
        assert_eq!(gauges(&e), (1, 2, 0));
        assert_eq!(e.prefill_backlog(), 2500);
        tokio::time::sleep_until(t0 + Duration::from_millis(1500)).await;
        assert_eq!(gauges(&e), (2, 1, 1), "one decoding, one prefilling");
        // The running requests hold their prompts' blocks (and the first's generated tokens).
        assert!(e.kv_usage() > 0.5, "{}", e.kv_usage());
        for r in &reqs {
            r.abort();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(gauges(&e), (0, 0, 0), "aborted requests leave the gauges");
        assert_eq!(e.kv_usage(), 0.0);
    }

    /// A decoding stream A, then a 1000-token cold prompt B: A's token instants, when B was
    /// submitted and when its first token came out.
    async fn long_prefill_beside_a_stream(e: &Arc<Engine>) -> (Vec<Instant>, Instant, Instant) {
        let a = request(e, prompt(0, 8), 150);
        tokio::time::sleep(Duration::from_millis(55)).await;
        assert_eq!(gauges(e), (1, 0, 1), "A decoding");
        let submitted = Instant::now();
        let b = request(e, prompt(1, 1000), 1);
        let b_first = b.await.unwrap()[0];
        (a.await.unwrap(), submitted, b_first)
    }

    fn within(d: Duration, lo_ms: u64, hi_ms: u64) -> bool {
        d >= Duration::from_millis(lo_ms) && d <= Duration::from_millis(hi_ms)
    }

    #[tokio::test(start_paused = true)]
    async fn fcfs_decodes_apart_from_prefill() {
        let e = started(conf(Scheduler::Fcfs));
        let (a, submitted, b_first) = long_prefill_beside_a_stream(&e).await;
        assert!(
            within(b_first - submitted, 1000, 1001),
            "{:?}",
            b_first - submitted
        );
        let gap = max_gap(&a, submitted, b_first);
        assert!(within(gap, 10, 11), "A keeps its pace: {gap:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn chunked_interleaves_a_long_prefill_with_running_decodes() {
        let e = started(conf(Scheduler::Chunked));
        let t0 = Instant::now();
        let (a, submitted, b_first) = long_prefill_beside_a_stream(&e).await;
        assert!(within(max_gap(&a, t0, submitted), 10, 11), "decode steps");
        // Steps of 1 decode + 99 prefill tokens (0.1 s): 1000 tokens take 11 steps, the last
        // one short (11 tokens), plus up to one decode step to start.
        let ttft = b_first - submitted;
        assert!(within(ttft, 1011, 1025), "{ttft:?}");
        let gap = max_gap(&a, submitted, b_first);
        assert!(within(gap, 100, 101), "A gets a token every step: {gap:?}");
        assert!(within(max_gap(&a, b_first, *a.last().unwrap()), 10, 11));
        assert_eq!(gauges(&e), (0, 0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn prefill_first_stalls_decodes_for_the_whole_prefill() {
        let e = started(conf(Scheduler::PrefillFirst));
        let (a, submitted, b_first) = long_prefill_beside_a_stream(&e).await;
        let ttft = b_first - submitted;
        assert!(within(ttft, 1000, 1011), "{ttft:?}");
        let gap = max_gap(&a, submitted, b_first + Duration::from_millis(1));
        assert!(within(gap, 1000, 1011), "A stalls: {gap:?}");
        assert_eq!(gauges(&e), (0, 0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn chunked_schedules_waiting_requests_as_budget_and_batch_allow() {
        let e = started(conf(Scheduler::Chunked)); // max_batch 2, 100 tokens a step
        let t0 = Instant::now();
        let reqs: Vec<_> = (0..3).map(|i| request(&e, prompt(i, 1000), 200)).collect();
        tokio::time::sleep_until(t0 + Duration::from_millis(450)).await;
        // A takes every step's whole budget for 10 steps: B and C are not scheduled.
        assert_eq!(gauges(&e), (1, 2, 0));
        assert_eq!(e.prefill_backlog(), 600 + 1000 + 1000, "4 steps done");
        tokio::time::sleep_until(t0 + Duration::from_millis(1050)).await;
        // A decodes, B has its first chunk, C waits for a batch slot.
        assert_eq!(gauges(&e), (2, 1, 1));
        for r in &reqs {
            r.abort();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(gauges(&e), (0, 0, 0), "aborted requests leave the gauges");
        assert_eq!(e.kv_usage(), 0.0);
        assert_eq!(e.prefill_backlog(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn kv_usage_counts_blocks_running_requests_hold_once() {
        let e = started(EngineConf {
            cache_tokens: 4000, // 1000 blocks of 4 tokens
            ..conf(Scheduler::Chunked)
        });
        // Two requests on the same 200-token prompt (50 blocks), one after the other.
        let a = request(&e, prompt(0, 200), 1000);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let one = e.kv_usage();
        assert!((0.05..0.2).contains(&one), "{one}");
        let b = request(&e, prompt(0, 200), 1000);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let two = e.kv_usage();
        assert!(
            two - one < 0.05,
            "the shared prompt counts once: {one} {two}"
        );
        a.abort();
        b.abort();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(e.kv_usage(), 0.0);
        assert!(e.cache_usage() >= 0.05, "the prompt stays cached");
    }
}
