//! A replay of the Mooncake synthetic trace (`shared/traces/mooncake_synthetic_trace.jsonl`)
//! against four simulated replicas, through inferlb's policies and the peer routers.
//!
//! Each 512-token hash block of the trace becomes a fixed text of 512 simulated tokens (2048
//! bytes: the simulator counts 4 bytes a token), distinct per block id and the same every run;
//! a request's prompt is its blocks in order, the last one cut so the prompt has the trace's
//! `input_length` tokens. Two shapes: chat with one `user` message per block, and the whole
//! prompt as one `/v1/completions` prompt. `max_tokens` is the trace's `output_length`, capped
//! (`--trace-max-tokens`, 64): each generated token is an event through router and client,
//! and with the full lengths the 2-core machine's CPU, not the replicas, set the TTFT at the
//! speed the replay runs at.
//!
//! The load is pinned, not the wall clock: arrival times are scaled so that the fleet's
//! prefill, with no cache hit at all, would be busy a given share of the time (the trace's
//! input tokens over the span, against 4 replicas x `--prefill-tokens-per-s` x `--speed`).
//! Times are reported in the modelled engine's milliseconds (wall time x speed).
//!
//! The reference hit rate is the same replay against one replica whose cache holds the whole
//! fleet's capacity and whose prefill never queues: what a router that always found the
//! longest cached prefix, with the fleet's memory as one cache, could reach.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use inferlb_harness::PeerKind;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::client::{pct, stream_api, Api};
use crate::cluster::{sim_caps, Cluster, ClusterSpec, Front};
use crate::Args;

/// Tokens in one hash block of the trace.
pub const BLOCK_TOKENS: usize = 512;
/// Bytes of text per simulated token.
const BYTES_PER_TOKEN: usize = 4;
/// The simulator's default prefill rate (tokens/s before the speed factor), which the rows use.
pub const PREFILL_TOKENS_PER_S: f64 = 30_000.0;
/// Replicas in the fleet.
pub const REPLICAS: usize = 4;

/// One line of the trace.
#[derive(Debug, Clone, Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms since the trace began.
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

/// The first `n` requests of the trace at `path`.
pub fn load(path: &Path, n: usize) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = vec![];
    for (i, line) in text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .enumerate()
    {
        let r: TraceRequest = serde_json::from_str(line)
            .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
        out.push(r);
    }
    if out.is_empty() {
        return Err(format!("{}: no requests", path.display()));
    }
    Ok(out)
}

/// The text of hash block `id`: exactly 2048 bytes of ASCII, distinct from its first bytes
/// on, the same in every run.
pub fn block_text(id: u64) -> String {
    const WORDS: [&str; 16] = [
        "kv ", "cache ", "block ", "token ", "prefix ", "layer ", "head ", "query ", "key ",
        "value ", "page ", "batch ", "step ", "chunk ", "tree ", "node ",
    ];
    let bytes = BLOCK_TOKENS * BYTES_PER_TOKEN;
    let mut s = String::with_capacity(bytes + 16);
    s.push_str(&format!("[block {id}] "));
    // xorshift64*, seeded by the id.
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while s.len() < bytes {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
        s.push_str(WORDS[(r >> 60) as usize]);
    }
    s.truncate(bytes);
    s
}

/// The texts of a request's blocks, the last cut so that they add up to `input_length`
/// tokens (when the blocks hold that many).
fn block_texts(r: &TraceRequest) -> Vec<String> {
    let n = r.hash_ids.len();
    r.hash_ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let mut t = block_text(*id);
            if i + 1 == n {
                let last = r.input_length.saturating_sub(BLOCK_TOKENS * (n - 1));
                if last > 0 && last < BLOCK_TOKENS {
                    t.truncate(last * BYTES_PER_TOKEN);
                }
            }
            t
        })
        .collect()
}

/// How a trace request is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Shape {
    /// `/v1/chat/completions`, one `user` message per block.
    Chat,
    /// `/v1/completions`, the whole prompt as one string.
    Completions,
}

impl Shape {
    pub fn parse(s: &str) -> Option<Shape> {
        match s {
            "chat" => Some(Shape::Chat),
            "completions" => Some(Shape::Completions),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Shape::Chat => "chat",
            Shape::Completions => "completions",
        }
    }

    fn api(self) -> Api {
        match self {
            Shape::Chat => Api::Chat,
            Shape::Completions => Api::Completions,
        }
    }

    pub fn body(self, r: &TraceRequest, max_tokens: usize) -> Value {
        let blocks = block_texts(r);
        match self {
            Shape::Chat => {
                let messages: Vec<Value> = blocks
                    .into_iter()
                    .map(|t| json!({"role": "user", "content": t}))
                    .collect();
                json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": max_tokens})
            }
            Shape::Completions => {
                json!({"model": "sim-model", "prompt": blocks.concat(), "stream": true, "max_tokens": max_tokens})
            }
        }
    }
}

/// A router in the replay: one of inferlb's policies or a peer.
#[derive(Debug, Clone)]
pub enum Policy {
    Inferlb(String),
    Peer(PeerKind),
}

impl Policy {
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "roundrobin" | "affinity" | "adaptive" | "prefill_cost" => {
                Some(Policy::Inferlb(s.to_owned()))
            }
            other => PeerKind::parse(other).map(Policy::Peer),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Policy::Inferlb(p) => p.clone(),
            Policy::Peer(k) => format!("{} cache_aware", k.name()),
        }
    }
}

/// One replay through one router.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TraceRow {
    pub shape: String,
    /// Prefill busy share the arrivals were scaled to, percent.
    pub load_pct: f64,
    /// Each replica's prefix cache, tokens.
    pub cache_tokens: usize,
    pub scheduler: String,
    pub policy: String,
    pub requests: usize,
    pub errors: usize,
    pub error_statuses: BTreeMap<u16, usize>,
    /// Cached prompt tokens over prompt tokens, summed over the replicas' own counters.
    pub hit_rate: f64,
    pub reference_hit_rate: f64,
    pub ratio_to_reference: f64,
    /// In ms of the modelled engine (wall time x speed).
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// The busiest replica's share of the requests.
    pub max_replica_share: f64,
    pub replicas: BTreeMap<String, usize>,
    pub wall_seconds: f64,
    /// Why the row has no numbers (a peer router that did not start).
    pub skipped: Option<String>,
}

/// The ideal-router reference for one shape and cache size.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TraceReference {
    pub shape: String,
    /// Per replica in the fleet; the reference replica holds `REPLICAS` times this.
    pub cache_tokens: usize,
    pub reference_cache_tokens: usize,
    pub hit_rate: f64,
    pub errors: usize,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct TraceResult {
    pub trace: String,
    pub requests: usize,
    /// From the first request to the last, seconds of the trace.
    pub span_s: f64,
    pub input_tokens: u64,
    pub speed: f64,
    pub replicas: usize,
    pub prefill_tokens_per_s: f64,
    pub max_tokens_cap: usize,
    /// Requests whose output_length was above the cap.
    pub capped_requests: usize,
    pub rows: Vec<TraceRow>,
    pub references: Vec<TraceReference>,
    /// What was skipped and why, as printed.
    pub notes: Vec<String>,
}

/// The replay's settings, from the command line.
pub struct TraceConf {
    pub path: PathBuf,
    pub requests: usize,
    /// The first is the main load (every shape, cache, scheduler); the others sweep it at the
    /// first shape and cache.
    pub loads: Vec<f64>,
    pub caches: Vec<usize>,
    pub schedulers: Vec<String>,
    pub shapes: Vec<Shape>,
    pub policies: Vec<Policy>,
    pub speed: f64,
    pub max_tokens: usize,
    pub peers_venv: PathBuf,
}

/// What one replay saw.
#[derive(Default)]
struct Replayed {
    ttft_ms: Vec<f64>,
    errors: usize,
    statuses: BTreeMap<u16, usize>,
    replicas: BTreeMap<String, usize>,
}

/// Sends every request at its scaled arrival time (`scale`: wall seconds per trace ms) and
/// waits for all of them. TTFT in model ms.
async fn replay(
    client: &reqwest::Client,
    base: &str,
    reqs: &[TraceRequest],
    shape: Shape,
    scale: f64,
    speed: f64,
    max_tokens: usize,
) -> Replayed {
    let t0 = reqs.first().map(|r| r.timestamp).unwrap_or(0);
    let started = Instant::now() + Duration::from_millis(20);
    let tasks: Vec<_> = reqs
        .iter()
        .map(|r| {
            let at = started + Duration::from_secs_f64((r.timestamp - t0) as f64 * scale);
            let (client, base, r) = (client.clone(), base.to_string(), r.clone());
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                let body = shape.body(&r, r.output_length.clamp(1, max_tokens));
                stream_api(&client, &base, shape.api(), &body, false).await
            })
        })
        .collect();
    let mut out = Replayed::default();
    for t in tasks {
        let Ok(o) = t.await else {
            out.errors += 1;
            continue;
        };
        if let Some(r) = &o.replica {
            *out.replicas.entry(r.clone()).or_insert(0) += 1;
        }
        if o.failed {
            out.errors += 1;
            *out.statuses.entry(o.status).or_insert(0) += 1;
            continue;
        }
        out.ttft_ms
            .push(o.ttft.unwrap_or(o.total).as_secs_f64() * 1e3 * speed);
    }
    out
}

/// Wall seconds per trace ms that make the fleet's cold prefill busy `load` of the time.
pub fn scale_for(reqs: &[TraceRequest], load: f64, speed: f64) -> f64 {
    let span_ms = span_ms(reqs).max(1) as f64;
    let tokens: f64 = reqs.iter().map(|r| r.input_length as f64).sum();
    let fleet = REPLICAS as f64 * PREFILL_TOKENS_PER_S * speed;
    tokens / (load * fleet) / span_ms
}

pub fn span_ms(reqs: &[TraceRequest]) -> u64 {
    match (reqs.first(), reqs.last()) {
        (Some(a), Some(b)) => b.timestamp.saturating_sub(a.timestamp),
        _ => 0,
    }
}

/// The reference: one replica, the fleet's whole cache, prefill that never queues.
async fn reference(
    client: &reqwest::Client,
    a: &Args,
    tc: &TraceConf,
    reqs: &[TraceRequest],
    shape: Shape,
    cache: usize,
) -> TraceReference {
    let big = cache * REPLICAS;
    eprintln!(
        "[trace] reference: {} shape, one replica caching {big} tokens",
        shape.name()
    );
    let c = Cluster::start(&ClusterSpec {
        front: Front::Direct,
        replicas: 1,
        speed: tc.speed,
        cache_tokens: big,
        sim_flags: &["--prefill-tokens-per-s", "1e12", "--max-batch", "100000"],
        log: None,
        spill_margin: None,
        lb_extra: "",
    });
    let scale = scale_for(reqs, tc.loads[0] / 100.0, tc.speed);
    let before = c.token_counts(client).await;
    let r = replay(
        client,
        &c.target(),
        reqs,
        shape,
        scale,
        tc.speed,
        tc.max_tokens,
    )
    .await;
    let hit_rate = c.token_counts(client).await.hit_rate_since(&before);
    let _ = a;
    TraceReference {
        shape: shape.name().into(),
        cache_tokens: cache,
        reference_cache_tokens: big,
        hit_rate,
        errors: r.errors,
    }
}

/// One row: fresh replicas, the router, the replay.
#[allow(clippy::too_many_arguments)]
async fn row(
    client: &reqwest::Client,
    a: &Args,
    tc: &TraceConf,
    reqs: &[TraceRequest],
    shape: Shape,
    load: f64,
    cache: usize,
    scheduler: &str,
    pass_scheduler: bool,
    policy: &Policy,
    reference: f64,
) -> TraceRow {
    let mut row = TraceRow {
        shape: shape.name().into(),
        load_pct: load,
        cache_tokens: cache,
        scheduler: scheduler.into(),
        policy: policy.name(),
        requests: reqs.len(),
        reference_hit_rate: reference,
        ..TraceRow::default()
    };
    let flags: Vec<&str> = if pass_scheduler {
        vec!["--scheduler", scheduler]
    } else {
        vec![]
    };
    let name = match policy {
        Policy::Inferlb(p) => p.clone(),
        Policy::Peer(k) => k.name().to_string(),
    };
    let front = match policy {
        Policy::Inferlb(p) => Front::Inferlb(p),
        Policy::Peer(k) => Front::Peer(*k, &tc.peers_venv),
    };
    let log = a.out.join("logs").join(format!(
        "trace-{}-{}-{}-{}-{}.log",
        shape.name(),
        load,
        cache,
        scheduler,
        name
    ));
    let c = match Cluster::try_start(&ClusterSpec {
        front,
        replicas: REPLICAS,
        speed: tc.speed,
        cache_tokens: cache,
        sim_flags: &flags,
        log: Some(log),
        spill_margin: None,
        lb_extra: "",
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("[trace] {}: skipped: {e}", policy.name());
            row.skipped = Some(e);
            return row;
        }
    };
    let started = Instant::now();
    let before = c.token_counts(client).await;
    let scale = scale_for(reqs, load / 100.0, tc.speed);
    let r = replay(
        client,
        &c.target(),
        reqs,
        shape,
        scale,
        tc.speed,
        tc.max_tokens,
    )
    .await;
    row.hit_rate = c.token_counts(client).await.hit_rate_since(&before);
    row.wall_seconds = started.elapsed().as_secs_f64();
    drop(c);
    // No reuse to find at all (a tiny replay): no ratio.
    row.ratio_to_reference = if reference > 0.0 {
        row.hit_rate / reference
    } else {
        f64::NAN
    };
    row.errors = r.errors;
    row.error_statuses = r.statuses;
    row.ttft_p50_ms = pct(&r.ttft_ms, 0.5);
    row.ttft_p90_ms = pct(&r.ttft_ms, 0.9);
    row.ttft_p99_ms = pct(&r.ttft_ms, 0.99);
    let total: usize = r.replicas.values().sum();
    row.max_replica_share =
        r.replicas.values().copied().max().unwrap_or(0) as f64 / total.max(1) as f64;
    row.replicas = r.replicas;
    row
}

/// The whole replay matrix.
pub async fn trace(client: &reqwest::Client, a: &Args, tc: &TraceConf) -> Option<TraceResult> {
    let reqs = match load(&tc.path, tc.requests) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("[trace] cannot read the trace ({e}): trace replay skipped");
            return None;
        }
    };
    let mut result = TraceResult {
        trace: tc.path.display().to_string(),
        requests: reqs.len(),
        span_s: span_ms(&reqs) as f64 / 1e3,
        input_tokens: reqs.iter().map(|r| r.input_length as u64).sum(),
        speed: tc.speed,
        replicas: REPLICAS,
        prefill_tokens_per_s: PREFILL_TOKENS_PER_S,
        max_tokens_cap: tc.max_tokens,
        capped_requests: reqs
            .iter()
            .filter(|r| r.output_length > tc.max_tokens)
            .count(),
        ..TraceResult::default()
    };
    let note = |result: &mut TraceResult, line: String| {
        eprintln!("[trace] {line}");
        result.notes.push(line);
    };
    // Schedulers: passed to the simulator when it has the flag; otherwise only its own
    // (first come, first served) runs, and the others are skipped, said once.
    let caps = sim_caps();
    let mut schedulers: Vec<(String, bool)> = vec![];
    for s in &tc.schedulers {
        if caps.schedulers.is_empty() {
            if s == "fcfs" {
                schedulers.push((s.clone(), false));
            } else {
                note(&mut result, format!("scheduler {s} skipped: this inferlb-sim has no --scheduler flag (it runs fcfs only)"));
            }
        } else if caps.schedulers.contains(s) {
            schedulers.push((s.clone(), true));
        } else {
            note(
                &mut result,
                format!("scheduler {s} skipped: inferlb-sim --scheduler does not take it"),
            );
        }
    }
    // Peers that are not installed: one line each, and their rows are left out.
    let mut policies = vec![];
    for p in &tc.policies {
        match p {
            Policy::Peer(k) if !k.installed_in(&tc.peers_venv) => note(
                &mut result,
                format!(
                    "{} router skipped: not installed in {} (`make peers` installs it)",
                    k.name(),
                    tc.peers_venv.display()
                ),
            ),
            _ => policies.push(p.clone()),
        }
    }
    // The main load at every shape, cache and scheduler; the sweep at the first shape and
    // cache.
    let mut cells: Vec<(f64, Shape, usize, &(String, bool))> = vec![];
    if let Some(&main) = tc.loads.first() {
        for &shape in &tc.shapes {
            for &cache in &tc.caches {
                for s in &schedulers {
                    cells.push((main, shape, cache, s));
                }
            }
        }
    }
    if let (Some(&shape), Some(&cache)) = (tc.shapes.first(), tc.caches.first()) {
        for &load in tc.loads.iter().skip(1) {
            for s in &schedulers {
                cells.push((load, shape, cache, s));
            }
        }
    }
    let wall: f64 = cells
        .iter()
        .map(|(load, ..)| {
            (scale_for(&reqs, load / 100.0, tc.speed) * span_ms(&reqs) as f64 + 3.0)
                * policies.len() as f64
        })
        .sum();
    eprintln!(
        "[trace] {} requests, {} rows, about {:.0} minutes",
        reqs.len(),
        cells.len() * policies.len(),
        wall / 60.0
    );
    let mut refs: BTreeMap<(&'static str, usize), f64> = BTreeMap::new();
    for (load, shape, cache, (scheduler, pass)) in cells {
        let reference_hit = match refs.get(&(shape.name(), cache)) {
            Some(h) => *h,
            None => {
                let r = reference(client, a, tc, &reqs, shape, cache).await;
                let h = r.hit_rate;
                refs.insert((shape.name(), cache), h);
                result.references.push(r);
                h
            }
        };
        for policy in &policies {
            eprintln!(
                "[trace] {} shape, load {load}%, cache {cache}, {scheduler}: {}",
                shape.name(),
                policy.name()
            );
            let r = row(
                client,
                a,
                tc,
                &reqs,
                shape,
                load,
                cache,
                scheduler,
                *pass,
                policy,
                reference_hit,
            )
            .await;
            if r.skipped.is_none() {
                eprintln!(
                    "[trace]   hit rate {:.1}% ({:.2}x reference), TTFT p50 {:.0} ms, p90 {:.0} ms, errors {}, {:.1} s",
                    r.hit_rate * 100.0,
                    r.ratio_to_reference,
                    r.ttft_p50_ms,
                    r.ttft_p90_ms,
                    r.errors,
                    r.wall_seconds
                );
            }
            result.rows.push(r);
        }
    }
    Some(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input_length: usize, hash_ids: Vec<u64>) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length,
            output_length: 10,
            hash_ids,
        }
    }

    #[test]
    fn a_block_is_512_tokens_of_its_own_text() {
        let a = block_text(7);
        assert_eq!(a.len(), BLOCK_TOKENS * BYTES_PER_TOKEN);
        assert!(a.is_ascii());
        assert_eq!(a, block_text(7), "the same every time");
        let b = block_text(8);
        assert_ne!(
            a[..64],
            b[..64],
            "different from the first simulator block on"
        );
    }

    #[test]
    fn a_prompt_has_the_traces_token_count_in_either_shape() {
        let r = request(1300, vec![1, 2, 3]);
        let blocks = block_texts(&r);
        assert_eq!(blocks.iter().map(String::len).sum::<usize>(), 1300 * 4);
        assert_eq!(blocks[0], block_text(1));
        let chat = Shape::Chat.body(&r, 5);
        assert_eq!(chat["messages"].as_array().map(Vec::len), Some(3));
        assert_eq!(chat["messages"][2]["role"], "user");
        let completion = Shape::Completions.body(&r, 5);
        assert_eq!(completion["prompt"].as_str().map(str::len), Some(1300 * 4));
        assert!(completion["prompt"]
            .as_str()
            .is_some_and(|p| p.starts_with(&block_text(1))));
    }

    #[test]
    fn arrivals_are_scaled_to_the_load() {
        // 4 replicas x 30000 tokens/s at speed 1: 1.2M tokens over 10 s of trace is 100%.
        let mut a = request(600_000, vec![]);
        let mut b = request(600_000, vec![]);
        a.timestamp = 1_000;
        b.timestamp = 11_000;
        let reqs = [a, b];
        let at_full = scale_for(&reqs, 1.0, 1.0) * 10_000.0;
        assert!((at_full - 10.0).abs() < 1e-9, "{at_full}");
        let at_half = scale_for(&reqs, 0.5, 1.0) * 10_000.0;
        assert!((at_half - 20.0).abs() < 1e-9, "{at_half}");
        let faster = scale_for(&reqs, 1.0, 20.0) * 10_000.0;
        assert!((faster - 0.5).abs() < 1e-9, "{faster}");
    }

    #[test]
    fn policies_and_shapes_parse() {
        assert!(matches!(
            Policy::parse("prefill_cost"),
            Some(Policy::Inferlb(_))
        ));
        assert!(matches!(
            Policy::parse("sglang"),
            Some(Policy::Peer(PeerKind::Sglang))
        ));
        assert!(Policy::parse("nginx").is_none());
        assert_eq!(Shape::parse("completions"), Some(Shape::Completions));
        assert_eq!(Shape::parse("embeddings"), None);
    }
}
