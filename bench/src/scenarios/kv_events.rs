//! The replicas' KV events against inferlb's own estimate: a replay of the Mooncake trace on
//! four simulated replicas with a real tokenizer, in three workloads ([`KvWorkload`]): the
//! replay as it is, the replay with one replica restarted a third of the way in, and the
//! replay with 30% of the requests sent straight to a replica (other clients: the front never
//! sees them).
//!
//! Fronts: inferlb `prefill_cost` with its estimate only, inferlb `prefill_cost` reading the
//! replicas' KV events (with the model's tokenizer in its conf), vLLM's router `kv_aware`
//! (subscribed to the same events) and smg `cache_aware`. Every front gets fresh replicas,
//! the same direct requests (a fixed pseudo-random draw per request index) and the same
//! restart (gpu1, when the request a third of the way in is due).
//!
//! The replicas count real tokens (`--tokenizer`, the test tokenizer of `inferlb-tokens`).
//! Each 512-token hash block of the trace becomes 512 words that the tokenizer makes one
//! token each, so a prompt has the trace's token count plus the chat template's few tokens a
//! message, and the cache sizes mean what the trace means.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use inferlb_harness::{free_port, http_status, wait_until, Lb, LbConf, Proc, Replica, Signal, Sim};
use inferlb_tokens::ModelTokens;
use serde::Serialize;
use serde_json::{json, Value};

use crate::client::{pct, scrape_sum, stream_api, Api};
use crate::cluster::{sim_caps, TokenCounts};
use crate::scenarios::trace::{self, TraceRequest, BLOCK_TOKENS};

/// Replicas in the fleet.
const REPLICAS: usize = 4;
/// The replica restarted mid-run.
const RESTARTED: usize = 1;
/// Seed of the draw that sends a request straight to a replica.
const DRAW_SEED: u64 = 0x6b76_2d65_7665_6e74;

/// A workload of the scenario: what happens to the replay besides the front's routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvWorkload {
    /// The trace as it is, every request through the front.
    Replay,
    /// gpu1 restarts (its cache gone) when the request a third of the way in is due.
    Restart,
    /// A share of the requests (`--kv-direct-pct`) goes straight to a replica.
    Direct,
}

impl KvWorkload {
    pub fn parse(s: &str) -> Option<KvWorkload> {
        match s {
            "replay" => Some(KvWorkload::Replay),
            "restart" => Some(KvWorkload::Restart),
            "direct" => Some(KvWorkload::Direct),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvWorkload::Replay => "replay",
            KvWorkload::Restart => "restart",
            KvWorkload::Direct => "direct",
        }
    }

    /// The share of requests sent straight to a replica in this workload, percent.
    fn direct_pct(self, kc: &KvConf) -> f64 {
        match self {
            KvWorkload::Direct => kc.direct_pct,
            _ => 0.0,
        }
    }
}

/// The request whose arrival restarts a replica in the restart workload: a third of the way.
fn restart_index(n: usize) -> usize {
    n / 3
}

/// A front of the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFront {
    /// inferlb prefill_cost, no events, no tokenizer: its own estimate.
    Estimate,
    /// inferlb prefill_cost subscribed to every replica's events, with the tokenizer.
    Events,
    /// vLLM's router, `--policy kv_aware`, subscribed to the same events.
    VllmKv,
    /// SGLang's gateway, `--policy cache_aware`.
    Smg,
}

impl KvFront {
    pub fn parse(s: &str) -> Option<KvFront> {
        match s {
            "estimate" => Some(KvFront::Estimate),
            "events" => Some(KvFront::Events),
            "vllm-kv" => Some(KvFront::VllmKv),
            "smg" => Some(KvFront::Smg),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvFront::Estimate => "inferlb prefill_cost (estimate)",
            KvFront::Events => "inferlb prefill_cost (KV events)",
            KvFront::VllmKv => "vllm-router kv_aware",
            KvFront::Smg => "smg cache_aware",
        }
    }

    fn short(self) -> &'static str {
        match self {
            KvFront::Estimate => "estimate",
            KvFront::Events => "events",
            KvFront::VllmKv => "vllm-kv",
            KvFront::Smg => "smg",
        }
    }
}

/// The scenario's settings.
pub struct KvConf {
    pub trace: PathBuf,
    pub requests: usize,
    pub caches: Vec<usize>,
    pub runs: usize,
    pub fronts: Vec<KvFront>,
    pub workloads: Vec<KvWorkload>,
    pub speed: f64,
    /// Prefill busy share the arrivals are scaled to, percent (as in the trace replay).
    pub load_pct: f64,
    pub max_tokens: usize,
    /// Share of the requests sent straight to a replica in the direct workload, percent.
    pub direct_pct: f64,
    pub peers_venv: PathBuf,
    pub smg_venv: PathBuf,
    pub out: PathBuf,
}

/// One run of one front.
#[derive(Debug, Default, Clone, Serialize)]
pub struct KvRun {
    pub workload: String,
    pub front: String,
    pub cache_tokens: usize,
    pub run: usize,
    pub front_requests: usize,
    pub direct_requests: usize,
    /// Cached over prompt tokens in the usage of the answers to the requests through the front.
    pub front_hit_rate: f64,
    /// Cached over prompt tokens in the replicas' own counters, every request (the restarted
    /// replica's counters read just before it stopped, added).
    pub all_hit_rate: f64,
    /// Modelled engine ms (wall x speed), requests through the front.
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    /// The p90 floor over the same requests (see [`Reference`]).
    pub ttft_p90_floor_ms: f64,
    pub front_errors: usize,
    /// Of `front_errors`, streams that broke after their 200 and before their first token: a
    /// front that holds the answer's header until then, or resumes such a stream, could still
    /// have served them.
    pub front_errors_before_token: usize,
    pub direct_errors: usize,
    /// Answers through the front that carried a usage (the hit rate's denominator).
    pub answers_with_usage: usize,
    pub error_statuses: BTreeMap<u16, usize>,
    /// Requests through the front per replica.
    pub replicas: BTreeMap<String, usize>,
    /// inferlb with events: how many cost lookups read the index, and the estimate.
    pub lookups_events: f64,
    pub lookups_estimate: f64,
    pub wall_seconds: f64,
}

/// The medians of one front's runs at one cache size.
#[derive(Debug, Default, Clone, Serialize)]
pub struct KvRow {
    pub workload: String,
    pub front: String,
    pub cache_tokens: usize,
    pub runs: usize,
    pub front_hit_rate: f64,
    pub all_hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub front_errors: f64,
    pub direct_errors: f64,
    /// The ideal router's hit rate at this cache size (see [`reference`]).
    pub reference_hit_rate: f64,
    /// The TTFT p90 no front can beat at this cache size (see [`Reference`]).
    pub ttft_p90_floor_ms: f64,
    pub skipped: Option<String>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct KvResult {
    pub trace: String,
    pub requests: usize,
    pub span_s: f64,
    pub trace_input_tokens: u64,
    /// The first request's prompt as the replicas' tokenizer counts it, against the trace.
    pub sample_prompt_tokens: usize,
    pub sample_trace_tokens: usize,
    pub speed: f64,
    pub load_pct: f64,
    pub direct_pct: f64,
    pub max_tokens_cap: usize,
    pub restart_at_s: f64,
    /// Per cache size a replica: the reference's hit rate and TTFT floor.
    pub references: BTreeMap<usize, Reference>,
    pub runs: Vec<KvRun>,
    pub rows: Vec<KvRow>,
    pub notes: Vec<String>,
}

/// What no front can beat: the reference's hit rate at one cache size, and the TTFT floor of
/// each request, its uncached tokens at a replica's prefill rate
/// ([`trace::PREFILL_TOKENS_PER_S`]) with no queue anywhere and a cache that never evicts (it
/// finds every block any earlier request computed). A run's p90 floor is the p90 of the floors
/// of the requests its own p90 is taken over ([`floor_p90`]). Where a target asks for a p90
/// below the floor, no router can meet it on this workload.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Reference {
    pub hit_rate: f64,
    /// Over every request of the trace.
    pub ttft_p90_floor_ms: f64,
    /// Each request's floor by its index, NaN where the reference got no usage.
    #[serde(skip)]
    pub floors_ms: Vec<f64>,
}

/// The p90 of the floors of the requests a run's TTFT p90 is taken over: those through the
/// front that did not fail.
fn floor_p90(sent: &[Sent], floors_ms: &[f64]) -> f64 {
    let floors: Vec<f64> = sent
        .iter()
        .filter(|s| !s.direct && !s.failed)
        .filter_map(|s| floors_ms.get(s.index).copied())
        .filter(|f| f.is_finite())
        .collect();
    pct(&floors, 0.9)
}

/// Words the tokenizer makes one token each after a space, in a fixed order.
fn one_token_words(model: &ModelTokens) -> Vec<&'static str> {
    const CANDIDATES: &[&str] = &[
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "balancer",
        "routes",
        "requests",
        "to",
        "replicas",
        "that",
        "hold",
        "their",
        "prefix",
        "in",
        "cache",
        "You",
        "are",
        "a",
        "helpful",
        "assistant",
        "What",
        "is",
        "weather",
        "like",
        "today",
        "user",
        "system",
        "function",
        "parameters",
        "object",
        "string",
        "properties",
        "required",
        "description",
        "type",
        "name",
        "city",
        "unit",
        "think",
        "reasoning",
        "The",
        "A",
    ];
    let mut out = vec![];
    for w in CANDIDATES {
        if model
            .prompt_ids(&format!(" {w}"))
            .is_ok_and(|ids| ids.len() == 1)
            && !out.contains(w)
        {
            out.push(*w);
        }
    }
    out
}

/// The text of hash block `id`, `tokens` words long: the id in base `words.len()` first (so
/// blocks differ from their first token), then a pseudo-random sequence seeded by the id.
fn block_text(words: &[&str], id: u64, tokens: usize) -> String {
    let k = words.len() as u64;
    let mut s = String::with_capacity(tokens * 8);
    let mut n = id;
    let mut digits = 0;
    while digits < tokens && (digits < 5 || n > 0) {
        s.push(' ');
        s.push_str(words[(n % k) as usize]);
        n /= k;
        digits += 1;
    }
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in digits..tokens {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
        s.push(' ');
        s.push_str(words[((r >> 32) % k) as usize]);
    }
    s
}

/// A trace request as a streamed chat body: one `user` message per block, the last cut to
/// the trace's length.
fn body(words: &[&str], r: &TraceRequest, max_tokens: usize) -> Value {
    let n = r.hash_ids.len();
    let messages: Vec<Value> = r
        .hash_ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let tokens = if i + 1 == n {
                match r.input_length.saturating_sub(BLOCK_TOKENS * (n - 1)) {
                    t if t > 0 && t < BLOCK_TOKENS => t,
                    _ => BLOCK_TOKENS,
                }
            } else {
                BLOCK_TOKENS
            };
            json!({"role": "user", "content": block_text(words, *id, tokens)})
        })
        .collect();
    json!({
        "model": "sim-model",
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens,
    })
}

/// splitmix64: the draw of request `i`.
fn draw(i: usize) -> u64 {
    let mut z = (i as u64)
        .wrapping_add(DRAW_SEED)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The replica request `i` goes to straight, or None: through the front.
fn direct_to(i: usize, pct: f64) -> Option<usize> {
    let d = draw(i);
    (((d % 10_000) as f64) < pct * 100.0).then_some(((d >> 32) % REPLICAS as u64) as usize)
}

/// Replicas, and the front before them; stopped front first.
struct Fleet {
    lb: Option<Lb>,
    router: Option<Proc>,
    sims: Vec<Sim>,
    /// Each replica's (events, replay) endpoints.
    endpoints: Vec<(String, String)>,
    base: String,
    _dir: tempfile::TempDir,
}

fn start(
    front: KvFront,
    kc: &KvConf,
    cache: usize,
    tokenizer: &Path,
    log: &Path,
) -> Result<Fleet, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let tk = tokenizer.to_string_lossy().to_string();
    let (speed, cache_s) = (kc.speed.to_string(), cache.to_string());
    // The rate the TTFT floor assumes (`Reference`).
    let rate = trace::PREFILL_TOKENS_PER_S.to_string();
    let mut sims = vec![];
    let mut endpoints = vec![];
    for i in 0..REPLICAS {
        let ev = format!("tcp://127.0.0.1:{}", free_port());
        let rp = format!("tcp://127.0.0.1:{}", free_port());
        let flags = [
            "--speed",
            &speed,
            "--cache-tokens",
            &cache_s,
            "--prefill-tokens-per-s",
            &rate,
            "--tokenizer",
            &tk,
            "--kv-events",
            &ev,
            "--kv-events-replay",
            &rp,
        ];
        sims.push(Sim::spawn(dir.path(), &format!("gpu{i}"), &flags));
        endpoints.push((ev, rp));
    }
    for s in &sims {
        if !s.wait_healthy(Duration::from_secs(20)) {
            return Err(format!("replica {} did not start: {}", s.id, s.log_text()));
        }
    }
    let mut fleet = Fleet {
        lb: None,
        router: None,
        sims,
        endpoints,
        base: String::new(),
        _dir: dir,
    };
    match front {
        KvFront::Estimate | KvFront::Events => {
            let events = front == KvFront::Events;
            let learnt = sim_caps().cache_config_info;
            let replicas = fleet
                .sims
                .iter()
                .zip(&fleet.endpoints)
                .map(|(s, (ev, rp))| Replica {
                    cache_tokens: (!learnt).then_some(cache as u64),
                    extra: if events {
                        format!("kv_events: \"{ev}\", kv_events_replay: \"{rp}\"")
                    } else {
                        String::new()
                    },
                    ..Replica::of(s)
                })
                .collect();
            let conf = LbConf {
                threads: Some(2),
                max_retries: Some(4),
                routing: Some("prefill_cost".into()),
                health_interval_seconds: Some(0.5),
                load_poll_interval_seconds: Some((0.25 / kc.speed.max(1.0)).max(0.01)),
                replicas,
                extra: if events {
                    format!("  tokenizers: {{sim-model: \"{tk}\"}}\n")
                } else {
                    String::new()
                },
                ..LbConf::default()
            };
            let lb = Lb::start_logged(fleet._dir.path(), &[], conf, Some(log), "warn");
            fleet.base = lb.url("");
            fleet.lb = Some(lb);
        }
        KvFront::VllmKv | KvFront::Smg => {
            let vllm = front == KvFront::VllmKv;
            let program = if vllm {
                kc.peers_venv.join("bin").join("vllm-router")
            } else {
                kc.smg_venv.join("bin").join("smg")
            };
            if !program.exists() {
                return Err(format!("{} is not installed", program.display()));
            }
            let port = free_port();
            let mut cmd = Command::new(program);
            if !vllm {
                cmd.arg("launch");
            }
            cmd.arg("--worker-urls");
            for s in &fleet.sims {
                cmd.arg(s.url(""));
            }
            if vllm {
                cmd.args(["--policy", "kv_aware", "--kv-event-model", "sim-model"])
                    .args(["--kv-event-block-size", "16"]);
                for (s, (ev, rp)) in fleet.sims.iter().zip(&fleet.endpoints) {
                    cmd.args(["--kv-event-source", &format!("{}={ev}", s.url(""))])
                        .args(["--kv-event-replay-source", &format!("{}={rp}", s.url(""))]);
                }
                cmd.args(["--log-level", "warning"]);
            } else {
                // The cache tree's eviction interval is divided by the speed, as every
                // duration of the replicas is (smg: 60 s by default).
                let eviction = (60.0 / kc.speed.max(1.0)).round().max(1.0);
                cmd.args(["--policy", "cache_aware"])
                    .args(["--eviction-interval-secs", &eviction.to_string()])
                    .args(["--log-level", "warn"]);
            }
            cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--prometheus-host", "127.0.0.1"])
                .args(["--prometheus-port", &free_port().to_string()])
                .args(["--worker-startup-timeout-secs", "30"])
                .env("PYTHONUNBUFFERED", "1");
            let _ = std::fs::write(log, "");
            let mut p = Proc::spawn(front.short(), cmd, Some(log), Signal::SIGTERM)
                .map_err(|e| format!("spawn {}: {e}", front.name()))?;
            let ready = wait_until(Duration::from_secs(60), || {
                p.has_exited()
                    || http_status(port, "/v1/models", Duration::from_secs(1)) == Some(200)
            });
            if !ready || p.has_exited() {
                let exit = p.try_exited();
                p.stop();
                let text = p.log_text();
                let tail: Vec<&str> = text.lines().rev().take(4).collect();
                return Err(format!(
                    "{} did not start (exit {exit:?}): {}",
                    front.name(),
                    tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
                ));
            }
            fleet.base = format!("http://127.0.0.1:{port}");
            fleet.router = Some(p);
        }
    }
    Ok(fleet)
}

/// The replicas' prompt and cached tokens, summed over those running.
async fn counts(client: &reqwest::Client, sims: &[Sim]) -> TokenCounts {
    let mut total = TokenCounts::default();
    for s in sims.iter().filter(|s| s.is_running()) {
        total = add(total, one_count(client, s).await);
    }
    total
}

async fn one_count(client: &reqwest::Client, s: &Sim) -> TokenCounts {
    let mut c = TokenCounts::default();
    if let Ok(r) = client.get(s.url("/sim/stats")).send().await {
        if let Ok(v) = r.json::<Value>().await {
            c.prompt = v["prompt_tokens"].as_u64().unwrap_or(0);
            c.cached = v["cached_tokens"].as_u64().unwrap_or(0);
        }
    }
    c
}

fn add(a: TokenCounts, b: TokenCounts) -> TokenCounts {
    TokenCounts {
        prompt: a.prompt + b.prompt,
        cached: a.cached + b.cached,
    }
}

/// One request as the client saw it.
#[derive(Serialize)]
struct Sent {
    index: usize,
    /// When it was sent, modelled ms after the first request.
    at_ms: f64,
    direct: bool,
    failed: bool,
    status: u16,
    /// To its first token, or to its end when none came.
    ttft_ms: f64,
    /// A token came: a request that failed without one was cut before its first token.
    token: bool,
    usage: Option<(u64, u64)>,
    replica: Option<String>,
    /// `x-inferlb-route`, through inferlb: why it went there.
    route: Option<String>,
}

/// One run: fresh fleet, the replay with the workload's direct requests or restart.
#[allow(clippy::too_many_arguments)]
async fn run(
    client: &reqwest::Client,
    kc: &KvConf,
    workload: KvWorkload,
    front: KvFront,
    cache: usize,
    run_no: usize,
    reqs: &[TraceRequest],
    words: &[&'static str],
    tokenizer: &Path,
    floors_ms: &[f64],
) -> Result<KvRun, String> {
    let log = kc.out.join("logs").join(format!(
        "kv-events-{}-{}-{cache}-{run_no}.log",
        workload.name(),
        front.short()
    ));
    let mut fleet = tokio::task::block_in_place(|| start(front, kc, cache, tokenizer, &log))?;
    if let (KvFront::Events, Some(lb)) = (front, &fleet.lb) {
        // Every replica's stream live before the first request.
        let admin = lb.admin_port;
        let deadline = Instant::now() + Duration::from_secs(20);
        while scrape_sum(client, admin, "inferlb_kv_events_state{").await < 2.0 * REPLICAS as f64
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    if front == KvFront::VllmKv {
        // Its subscribers start with it; give them a moment to connect.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let scale = trace::scale_for(reqs, kc.load_pct / 100.0, kc.speed);
    let t0 = reqs.first().map(|r| r.timestamp).unwrap_or(0);
    let before = counts(client, &fleet.sims).await;
    let wall = Instant::now();
    let started = wall + Duration::from_millis(50);
    let sims: Vec<String> = fleet.sims.iter().map(|s| s.url("")).collect();
    let tasks: Vec<_> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let at = started + Duration::from_secs_f64((r.timestamp - t0) as f64 * scale);
            let direct = direct_to(i, workload.direct_pct(kc));
            let base = match direct {
                Some(k) => sims[k].clone(),
                None => fleet.base.clone(),
            };
            let b = body(words, r, r.output_length.clamp(1, kc.max_tokens));
            let (client, speed) = (client.clone(), kc.speed);
            let at_ms = (r.timestamp - t0) as f64 * scale * 1e3 * speed;
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                let o = stream_api(&client, &base, Api::Chat, &b, false).await;
                Sent {
                    index: i,
                    at_ms,
                    direct: direct.is_some(),
                    failed: o.failed,
                    status: o.status,
                    ttft_ms: o.ttft.unwrap_or(o.total).as_secs_f64() * 1e3 * speed,
                    token: o.ttft.is_some(),
                    usage: o.usage,
                    replica: o.replica,
                    route: o.route,
                }
            })
        })
        .collect();
    // The restart: when its request is due. Its counters so far are kept first.
    let mut kept = TokenCounts::default();
    if workload == KvWorkload::Restart {
        let due = &reqs[restart_index(reqs.len())];
        let restart_at = started + Duration::from_secs_f64((due.timestamp - t0) as f64 * scale);
        tokio::time::sleep_until(restart_at.into()).await;
        kept = one_count(client, &fleet.sims[RESTARTED]).await;
        tokio::task::block_in_place(|| {
            fleet.sims[RESTARTED].restart(&[]);
            fleet.sims[RESTARTED].wait_healthy(Duration::from_secs(20))
        });
    }
    let mut sent = vec![];
    for t in tasks {
        if let Ok(s) = t.await {
            sent.push(s);
        }
    }
    let after = add(counts(client, &fleet.sims).await, kept);
    let mut r = KvRun {
        workload: workload.name().into(),
        front: front.name().into(),
        cache_tokens: cache,
        run: run_no,
        all_hit_rate: after.hit_rate_since(&before),
        wall_seconds: wall.elapsed().as_secs_f64(),
        ..KvRun::default()
    };
    if let (KvFront::Events, Some(lb)) = (front, &fleet.lb) {
        let admin = lb.admin_port;
        r.lookups_events = scrape_sum(
            client,
            admin,
            "inferlb_cache_lookups_total{source=\"events\"}",
        )
        .await
            + 0.0;
        r.lookups_estimate = scrape_sum(
            client,
            admin,
            "inferlb_cache_lookups_total{source=\"estimate\"}",
        )
        .await
            + 0.0;
    }
    drop(fleet);
    // Each request as the client saw it, beside the run's log: where every hit went.
    let lines: Vec<String> = sent
        .iter()
        .filter_map(|s| serde_json::to_string(s).ok())
        .collect();
    let _ = std::fs::write(
        log.with_extension("requests.jsonl"),
        lines.join("\n") + "\n",
    );
    let (mut ttft, mut prompt, mut cached) = (vec![], 0u64, 0u64);
    for s in &sent {
        if s.direct {
            r.direct_requests += 1;
            r.direct_errors += usize::from(s.failed);
            continue;
        }
        r.front_requests += 1;
        if s.failed {
            r.front_errors += 1;
            r.front_errors_before_token += usize::from(!s.token && s.status == 200);
            *r.error_statuses.entry(s.status).or_insert(0) += 1;
            continue;
        }
        ttft.push(s.ttft_ms);
        if let Some((p, c)) = s.usage {
            r.answers_with_usage += 1;
            prompt += p;
            cached += c;
        }
        if let Some(id) = &s.replica {
            *r.replicas.entry(id.clone()).or_insert(0) += 1;
        }
    }
    // Tasks that panicked count as failed requests through the front.
    r.front_errors += reqs.len() - sent.len();
    r.front_hit_rate = cached as f64 / prompt.max(1) as f64;
    r.ttft_p50_ms = pct(&ttft, 0.5);
    r.ttft_p90_ms = pct(&ttft, 0.9);
    r.ttft_p90_floor_ms = floor_p90(&sent, floors_ms);
    Ok(r)
}

/// The reference: every request, none straight and no restart, to one replica caching
/// `cache_tokens` whose prefill never queues. With the fleet's whole capacity, what a router
/// that always found the longest cached prefix, with the fleet's memory as one cache, could
/// reach (as in the trace replay); with a cache that never evicts, the TTFT floor.
async fn reference(
    client: &reqwest::Client,
    kc: &KvConf,
    cache_tokens: usize,
    reqs: &[TraceRequest],
    words: &[&'static str],
    tokenizer: &Path,
) -> Reference {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = tokenizer.to_string_lossy().to_string();
    let (speed, big) = (kc.speed.to_string(), cache_tokens.to_string());
    let flags = [
        "--speed",
        &speed,
        "--cache-tokens",
        &big,
        "--tokenizer",
        &tk,
        "--prefill-tokens-per-s",
        "1e12",
        "--max-batch",
        "100000",
    ];
    let sim = tokio::task::block_in_place(|| Sim::start(dir.path(), "reference", &flags));
    let scale = trace::scale_for(reqs, kc.load_pct / 100.0, kc.speed);
    let t0 = reqs.first().map(|r| r.timestamp).unwrap_or(0);
    let started = Instant::now() + Duration::from_millis(50);
    let tasks: Vec<_> = reqs
        .iter()
        .map(|r| {
            let at = started + Duration::from_secs_f64((r.timestamp - t0) as f64 * scale);
            let b = body(words, r, r.output_length.clamp(1, kc.max_tokens));
            let (client, base) = (client.clone(), sim.url(""));
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                stream_api(&client, &base, Api::Chat, &b, false).await
            })
        })
        .collect();
    let mut floors_ms = vec![];
    for t in tasks {
        floors_ms.push(match t.await.map(|o| o.usage) {
            Ok(Some((prompt, cached))) => {
                prompt.saturating_sub(cached) as f64 / trace::PREFILL_TOKENS_PER_S * 1e3
            }
            _ => f64::NAN,
        });
    }
    let c = one_count(client, &sim).await;
    let known: Vec<f64> = floors_ms
        .iter()
        .copied()
        .filter(|f| f.is_finite())
        .collect();
    Reference {
        hit_rate: c.hit_rate_since(&TokenCounts::default()),
        ttft_p90_floor_ms: pct(&known, 0.9),
        floors_ms,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| !x.is_nan());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Every front at every cache size, `runs` times each, runs interleaved across fronts.
pub async fn kv_events(client: &reqwest::Client, kc: &KvConf) -> Option<KvResult> {
    let reqs = match trace::load(&kc.trace, kc.requests) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("[kv-events] cannot read the trace ({e}): skipped");
            return None;
        }
    };
    let tk_dir = tempfile::tempdir().expect("tempdir");
    let tokenizer = tk_dir.path().join("tokenizer");
    std::fs::create_dir_all(&tokenizer).expect("mkdir");
    inferlb_tokens::fixture::write_dir(&tokenizer, inferlb_tokens::fixture::CHATML_TOOLS)
        .expect("the test tokenizer");
    let model = ModelTokens::from_dir(&tokenizer).expect("the test tokenizer loads");
    let words = one_token_words(&model);
    let mut result = KvResult {
        trace: kc.trace.display().to_string(),
        requests: reqs.len(),
        span_s: trace::span_ms(&reqs) as f64 / 1e3,
        trace_input_tokens: reqs.iter().map(|r| r.input_length as u64).sum(),
        speed: kc.speed,
        load_pct: kc.load_pct,
        direct_pct: kc.direct_pct,
        max_tokens_cap: kc.max_tokens,
        ..KvResult::default()
    };
    if words.len() < 8 {
        eprintln!(
            "[kv-events] the test tokenizer has only {} one-token words: skipped",
            words.len()
        );
        return None;
    }
    let sample = body(&words, &reqs[0], 1);
    result.sample_trace_tokens = reqs[0].input_length;
    result.sample_prompt_tokens = model
        .chat_ids_uncached(sample.to_string().as_bytes())
        .map(|ids| ids.len())
        .unwrap_or(0);
    let scale = trace::scale_for(&reqs, kc.load_pct / 100.0, kc.speed);
    result.restart_at_s =
        (reqs[restart_index(reqs.len())].timestamp - reqs[0].timestamp) as f64 * scale;
    let direct = (0..reqs.len())
        .filter(|i| direct_to(*i, kc.direct_pct).is_some())
        .count();
    eprintln!(
        "[kv-events] {} requests ({direct} straight to a replica), {} words of one token; the first prompt is {} tokens (trace: {}); {:.0} s a run",
        reqs.len(),
        words.len(),
        result.sample_prompt_tokens,
        result.sample_trace_tokens,
        scale * trace::span_ms(&reqs) as f64
    );
    let mut skipped: BTreeMap<&'static str, String> = BTreeMap::new();
    // A cache that holds every prompt twice over never evicts.
    let unbounded = 2 * result.trace_input_tokens as usize;
    let floor = reference(client, kc, unbounded, &reqs, &words, &tokenizer).await;
    eprintln!(
        "[kv-events] TTFT p90 floor {:.0} ms",
        floor.ttft_p90_floor_ms
    );
    for &cache in &kc.caches {
        eprintln!("[kv-events] cache {cache}: the reference");
        let h = Reference {
            ttft_p90_floor_ms: floor.ttft_p90_floor_ms,
            floors_ms: vec![],
            ..reference(client, kc, cache * REPLICAS, &reqs, &words, &tokenizer).await
        };
        eprintln!(
            "[kv-events]   reference hit rate {:.1}%",
            h.hit_rate * 100.0
        );
        result.references.insert(cache, h);
        for &workload in &kc.workloads {
            for run_no in 1..=kc.runs.max(1) {
                for &front in &kc.fronts {
                    if skipped.contains_key(front.short()) {
                        continue;
                    }
                    eprintln!(
                        "[kv-events] {}, cache {cache}, run {run_no}: {}",
                        workload.name(),
                        front.name()
                    );
                    let r = run(
                        client,
                        kc,
                        workload,
                        front,
                        cache,
                        run_no,
                        &reqs,
                        &words,
                        &tokenizer,
                        &floor.floors_ms,
                    );
                    match r.await {
                        Ok(r) => {
                            eprintln!(
                            "[kv-events]   hit rate front {:.1}%, all {:.1}%, TTFT p50 {:.0} ms p90 {:.0} ms, errors front {} ({} before a token) direct {}, {:.1} s",
                            r.front_hit_rate * 100.0,
                            r.all_hit_rate * 100.0,
                            r.ttft_p50_ms,
                            r.ttft_p90_ms,
                            r.front_errors,
                            r.front_errors_before_token,
                            r.direct_errors,
                            r.wall_seconds
                        );
                            result.runs.push(r);
                        }
                        Err(e) => {
                            let line = format!("{}: skipped: {e}", front.name());
                            eprintln!("[kv-events] {line}");
                            result.notes.push(line);
                            skipped.insert(front.short(), e);
                        }
                    }
                }
            }
        }
    }
    for &workload in &kc.workloads {
        for &cache in &kc.caches {
            for &front in &kc.fronts {
                result
                    .rows
                    .push(row(&result, &skipped, workload, cache, front));
            }
        }
    }
    Some(result)
}

/// The medians of one front's runs of one workload at one cache size.
fn row(
    result: &KvResult,
    skipped: &BTreeMap<&'static str, String>,
    workload: KvWorkload,
    cache: usize,
    front: KvFront,
) -> KvRow {
    let runs: Vec<&KvRun> = result
        .runs
        .iter()
        .filter(|r| {
            r.workload == workload.name() && r.cache_tokens == cache && r.front == front.name()
        })
        .collect();
    let m = |f: fn(&KvRun) -> f64| median(runs.iter().map(|r| f(r)).collect());
    KvRow {
        workload: workload.name().into(),
        front: front.name().into(),
        cache_tokens: cache,
        runs: runs.len(),
        front_hit_rate: m(|r| r.front_hit_rate),
        all_hit_rate: m(|r| r.all_hit_rate),
        ttft_p50_ms: m(|r| r.ttft_p50_ms),
        ttft_p90_ms: m(|r| r.ttft_p90_ms),
        front_errors: m(|r| r.front_errors as f64),
        direct_errors: m(|r| r.direct_errors as f64),
        reference_hit_rate: result
            .references
            .get(&cache)
            .map_or(f64::NAN, |r| r.hit_rate),
        ttft_p90_floor_ms: m(|r| r.ttft_p90_floor_ms),
        skipped: skipped.get(front.short()).cloned(),
    }
}

fn is_peer(front: &str) -> bool {
    front == KvFront::VllmKv.name() || front == KvFront::Smg.name()
}

/// The best of the peers' rows beside `row` (its workload and cache size): the higher hit
/// rate and the lower TTFT p90, None without a peer measured there.
fn best_peer(rows: &[KvRow], row: &KvRow) -> Option<(f64, f64)> {
    rows.iter()
        .filter(|p| {
            is_peer(&p.front)
                && p.skipped.is_none()
                && p.runs > 0
                && p.workload == row.workload
                && p.cache_tokens == row.cache_tokens
        })
        .map(|p| (p.front_hit_rate, p.ttft_p90_ms))
        .reduce(|(h, t), (h2, t2)| (h.max(h2), t.min(t2)))
}

/// The markdown table, also written with the JSON into `out`.
pub fn write(r: &KvResult, out: &Path) -> String {
    let mut md = format!(
        "KV events bench: the first {} requests of `{}` ({:.0} s of trace, {} input tokens), chat shape, one `user` message per 512-token block; 4 replicas with a real tokenizer (the test tokenizer of inferlb-tokens, each block 512 one-token words: the first prompt is {} tokens for the trace's {}), KV events on; speed x{}, arrivals scaled to {}% of the fleet's cold prefill, max_tokens capped at {}. Workloads: `replay` sends every request through the front; `restart` restarts gpu1 (its cache gone) when the request a third of the way in is due ({:.1} s in); `direct` sends {}% of the requests straight to a replica (the same pseudo-random draw for every front). Hit rate through the front: cached over prompt tokens in those answers' usage; over all: the replicas' counters; reference: every request (none straight, no restart) to one replica caching the fleet's whole capacity whose prefill never queues; p90 floor: the TTFT p90, over the same requests as the front's p90 (through the front, not failed), with no queue anywhere and a cache that never evicts (each request's uncached tokens at one replica's prefill rate), which no front can beat. TTFT in ms of the modelled engine, requests through the front. Medians of the runs shown; against the best peer: the hit rate over the higher of the peers', the TTFT p90 over the lower of theirs. The machine has 2 cores shared with other work (a full test run): absolute times are noisy.\n\n",
        r.requests,
        r.trace,
        r.span_s,
        r.trace_input_tokens,
        r.sample_prompt_tokens,
        r.sample_trace_tokens,
        r.speed,
        r.load_pct,
        r.max_tokens_cap,
        r.restart_at_s,
        r.direct_pct
    );
    md.push_str("| workload | cache a replica | front | runs | hit rate (front) | hit rate (all) | reference | TTFT p50 (ms) | p90 (ms) | p90 floor (ms) | errors (front) | errors (direct) | hit / best peer | p90 / best peer |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for row in &r.rows {
        if let Some(why) = &row.skipped {
            md.push_str(&format!(
                "| {} | {} | {} | 0 | skipped: {} | | | | | | | | | |\n",
                row.workload,
                row.cache_tokens,
                row.front,
                why.replace('|', "/")
            ));
            continue;
        }
        let (hit_vs, p90_vs) = match best_peer(&r.rows, row) {
            Some((hit, p90)) if !is_peer(&row.front) => (
                format!("{:.2}x", row.front_hit_rate / hit.max(f64::MIN_POSITIVE)),
                format!("{:.2}x", row.ttft_p90_ms / p90.max(f64::MIN_POSITIVE)),
            ),
            _ => (String::new(), String::new()),
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {:.2}% | {:.2}% | {:.2}% | {:.0} | {:.0} | {:.0} | {} | {} | {hit_vs} | {p90_vs} |\n",
            row.workload,
            row.cache_tokens,
            row.front,
            row.runs,
            row.front_hit_rate * 100.0,
            row.all_hit_rate * 100.0,
            row.reference_hit_rate * 100.0,
            row.ttft_p50_ms,
            row.ttft_p90_ms,
            row.ttft_p90_floor_ms,
            row.front_errors,
            row.direct_errors
        ));
    }
    md.push_str("\nEach run:\n\n| workload | cache | front | run | through front | direct | hit (front) | hit (all) | p50 | p90 | errors front (before a token)/direct | answers with usage | lookups events/estimate | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for x in &r.runs {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.2}% | {:.2}% | {:.0} | {:.0} | {} ({})/{} | {} | {}/{} | {:.1} |\n",
            x.workload,
            x.cache_tokens,
            x.front,
            x.run,
            x.front_requests,
            x.direct_requests,
            x.front_hit_rate * 100.0,
            x.all_hit_rate * 100.0,
            x.ttft_p50_ms,
            x.ttft_p90_ms,
            x.front_errors,
            x.front_errors_before_token,
            x.direct_errors,
            x.answers_with_usage,
            x.lookups_events,
            x.lookups_estimate,
            x.wall_seconds
        ));
    }
    for n in &r.notes {
        md.push_str(&format!("\n{n}\n"));
    }
    let _ = std::fs::write(out.join("kv_events.md"), &md);
    if let Ok(j) = serde_json::to_string_pretty(r) {
        let _ = std::fs::write(out.join("kv_events.json"), j);
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_draw_sends_about_the_share_straight_the_same_every_time() {
        let n = 10_000;
        let direct: Vec<Option<usize>> = (0..n).map(|i| direct_to(i, 30.0)).collect();
        let share = direct.iter().filter(|d| d.is_some()).count() as f64 / n as f64;
        assert!((share - 0.3).abs() < 0.02, "{share}");
        assert!(direct.iter().flatten().all(|k| *k < REPLICAS));
        assert_eq!(
            direct,
            (0..n).map(|i| direct_to(i, 30.0)).collect::<Vec<_>>()
        );
        assert!((0..n).all(|i| direct_to(i, 0.0).is_none()));
    }

    fn row(workload: &str, front: KvFront, hit: f64, p90: f64) -> KvRow {
        KvRow {
            workload: workload.into(),
            front: front.name().into(),
            cache_tokens: 500_000,
            runs: 3,
            front_hit_rate: hit,
            ttft_p90_ms: p90,
            ..KvRow::default()
        }
    }

    /// A run's floor is taken over the requests its p90 is: a request sent straight to a
    /// replica, one that failed and one the reference got no usage for are not among them.
    #[test]
    fn the_floor_is_taken_over_the_requests_the_p90_is() {
        let sent = |index, direct, failed| Sent {
            index,
            at_ms: 0.0,
            direct,
            failed,
            status: 200,
            ttft_ms: 0.0,
            token: true,
            usage: None,
            replica: None,
            route: None,
        };
        let floors = [5000.0, 100.0, 3000.0, f64::NAN];
        let all = [
            sent(0, true, false),
            sent(1, false, false),
            sent(2, false, true),
            sent(3, false, false),
        ];
        assert_eq!(super::floor_p90(&all, &floors), 100.0);
        let through = [sent(0, false, false), sent(1, false, false)];
        assert_eq!(super::floor_p90(&through, &floors), 5000.0);
        assert!(super::floor_p90(&[], &floors).is_nan());
    }

    #[test]
    fn the_best_peer_is_the_higher_hit_rate_and_the_lower_p90_of_its_own_row() {
        let rows = vec![
            row("replay", KvFront::Events, 0.07, 900.0),
            row("replay", KvFront::VllmKv, 0.03, 1500.0),
            row("replay", KvFront::Smg, 0.05, 2000.0),
            row("direct", KvFront::Events, 0.07, 900.0),
            row("direct", KvFront::Smg, 0.09, 100.0),
        ];
        assert_eq!(best_peer(&rows, &rows[0]), Some((0.05, 1500.0)));
        assert_eq!(best_peer(&rows, &rows[3]), Some((0.09, 100.0)));
        let mut skipped = rows[4].clone();
        skipped.skipped = Some("no smg".into());
        assert_eq!(best_peer(&[rows[3].clone(), skipped], &rows[3]), None);
    }

    #[test]
    fn only_the_direct_workload_sends_requests_straight_and_the_restart_is_a_third_in() {
        let kc = KvConf {
            trace: PathBuf::new(),
            requests: 0,
            caches: vec![],
            runs: 1,
            fronts: vec![],
            workloads: vec![],
            speed: 1.0,
            load_pct: 50.0,
            max_tokens: 1,
            direct_pct: 30.0,
            peers_venv: PathBuf::new(),
            smg_venv: PathBuf::new(),
            out: PathBuf::new(),
        };
        assert_eq!(KvWorkload::Direct.direct_pct(&kc), 30.0);
        assert_eq!(KvWorkload::Replay.direct_pct(&kc), 0.0);
        assert_eq!(KvWorkload::Restart.direct_pct(&kc), 0.0);
        assert_eq!(restart_index(300), 100);
        for w in ["replay", "restart", "direct"] {
            assert_eq!(KvWorkload::parse(w).map(|w| w.name()), Some(w));
        }
        assert_eq!(KvWorkload::parse("mixed"), None);
    }

    #[test]
    fn a_block_is_its_token_count_of_words_distinct_from_the_first() {
        let words = ["a", "b", "c", "d"];
        let t = block_text(&words, 7, 512);
        assert_eq!(t.split_whitespace().count(), 512);
        assert_eq!(t, block_text(&words, 7, 512));
        let u = block_text(&words, 8, 512);
        assert_ne!(t.split_whitespace().next(), u.split_whitespace().next());
        assert_eq!(block_text(&words, 7, 3).split_whitespace().count(), 3);
    }

    #[test]
    fn a_prompt_is_the_traces_token_count_with_the_test_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        inferlb_tokens::fixture::write_dir(dir.path(), inferlb_tokens::fixture::CHATML_TOOLS)
            .unwrap();
        let model = ModelTokens::from_dir(dir.path()).unwrap();
        let words = one_token_words(&model);
        assert!(words.len() >= 8, "{words:?}");
        let r = TraceRequest {
            timestamp: 0,
            input_length: 1300,
            output_length: 4,
            hash_ids: vec![1, 2, 3],
        };
        let b = body(&words, &r, 4);
        let ids = model.chat_ids_uncached(b.to_string().as_bytes()).unwrap();
        // The template adds a few tokens a message and the generation prompt.
        assert!(ids.len() >= 1300 && ids.len() < 1300 + 40, "{}", ids.len());
    }
}
