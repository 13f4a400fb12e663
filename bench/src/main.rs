//! inferlb-bench: re-measures the seed's table for every routing policy, side by side, in one
//! run, against simulated replicas (`inferlb-sim`) on loopback.
//!
//! For each target (inferlb in roundrobin, affinity, adaptive and prefill_cost mode, and a
//! direct connection to one replica) it starts fresh replicas, so every target begins with
//! cold caches, and runs the seed's scenarios: agent loop, cold burst, mixed, failover. Then:
//! the agent loop through every agent API (chat, Responses full and chained, Anthropic
//! Messages), a fork of a long history into staggered siblings, several instances in front of
//! the same replicas (sharing state through Redis or not), a replay of the Mooncake trace
//! on four replicas (inferlb's policies and the peer routers, SGLang's and vLLM's), prefill/decode
//! disaggregation (inferlb P/D and aggregated, vLLM's router and SGLang's gateway in P/D mode,
//! a kill scene and a sweep of the local-prefill threshold), a rolling
//! deploy, a soak, and the proxy's own overhead against a direct connection and nginx, over
//! plain HTTP and over HTTPS (both terminating TLS with the same cipher suite). Ratios measured
//! in the same run are the result; absolute times on a shared 2-core machine are noise.
//!
//! Every process comes from `inferlb-harness` and is stopped when the scenario that started it
//! ends.

mod client;
mod cluster;
mod procfs;
mod report;
mod scenarios;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Serialize;

use cluster::{Cluster, ClusterSpec, Front};
use inferlb_harness::{Peer, PeerKind};
use scenarios::agent::{agent_loops, cold_burst, AgentResult};
use scenarios::failover::{failover, FailoverResult};
use scenarios::trace::{Policy, Shape, TraceConf};

#[derive(Parser, Debug, Clone)]
#[command(about = "inferlb's routing benchmark")]
pub struct Args {
    /// Where the markdown table, the JSON and the plot go.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Tiny sizes: checks every scenario runs (part of `make test`), measures nothing.
    #[arg(long)]
    smoke: bool,
    /// The simulator's speed factor (a 90k-token cold prefill takes 3 s / speed).
    #[arg(long, default_value_t = 10.0)]
    speed: f64,
    /// Only these targets of the seed's scenarios (comma-separated:
    /// roundrobin,affinity,adaptive,prefill_cost,direct; empty: none).
    #[arg(
        long,
        default_value = "roundrobin,affinity,adaptive,prefill_cost,direct"
    )]
    targets: String,
    /// Prefix-cache capacity of each simulated replica, in tokens (default: about two and a
    /// half 90k-token contexts, as on a card whose KV memory is the scarce resource).
    #[arg(long)]
    cache_tokens: Option<usize>,
    /// Further flags for the replicas of the seed's scenarios, space-separated (e.g.
    /// "--scheduler chunked").
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    sim_flags: String,
    /// Skip the rolling-deploy scenario.
    #[arg(long)]
    no_deploy: bool,
    /// Run the soak test: this many seconds with 1,000 concurrent connections (0: skip).
    #[arg(long, default_value_t = 180.0)]
    soak_seconds: f64,
    /// After the soak: inferlb's memory with this many streams open at once (comma-separated;
    /// smoke: 20). The bench raises its descriptor limit to 65,536 where allowed.
    #[arg(long, default_value = "1000,10000")]
    soak_streams: String,
    /// Skip the proxy-overhead pass.
    #[arg(long)]
    no_overhead: bool,
    /// Only send small chat requests to this base URL (e.g. http://127.0.0.1:8080) at
    /// `--drive-rate` a second, open loop (0: from 32 closed-loop clients), for
    /// `--drive-seconds`, print their latency and exit: load for a profiler attached to a
    /// proxy started by hand.
    #[arg(long)]
    drive: Option<String>,
    #[arg(long, default_value_t = 2000.0)]
    drive_rate: f64,
    #[arg(long, default_value_t = 20.0)]
    drive_seconds: f64,
    /// Rounds of the proxy-overhead pass (smoke: 1).
    #[arg(long, default_value_t = 3)]
    overhead_rounds: usize,
    /// Skip the proxy-overhead pass over HTTPS (inferlb and nginx terminating TLS).
    #[arg(long)]
    no_overhead_tls: bool,
    /// Rounds of the HTTPS overhead pass (smoke: 1, HTTPS rows only).
    #[arg(long, default_value_t = 3)]
    overhead_tls_rounds: usize,
    /// Skip the agent loop through every agent API.
    #[arg(long)]
    no_agent_apis: bool,
    /// inferlb policies of the agent-API table (comma-separated).
    #[arg(long, default_value = "roundrobin,adaptive,prefill_cost")]
    api_policies: String,
    /// Skip the fork scene.
    #[arg(long)]
    no_fork: bool,
    /// Skip the several-instances scene (1 instance, 3 sharing state through Redis, 3 not).
    #[arg(long)]
    no_instances: bool,
    /// Skip the overload scene (a flooding batch tenant beside an interactive one).
    #[arg(long)]
    no_overload: bool,
    /// Targets of the fork scene (comma-separated: inferlb policies, sglang, vllm).
    #[arg(
        long,
        default_value = "roundrobin,affinity,adaptive,prefill_cost,sglang,vllm"
    )]
    fork_targets: String,
    /// Skip the trace replay.
    #[arg(long)]
    no_trace: bool,
    /// The trace to replay (JSON lines: timestamp, input_length, output_length, hash_ids).
    #[arg(
        long,
        default_value = "../shared/traces/mooncake_synthetic_trace.jsonl"
    )]
    trace: PathBuf,
    /// Replay the first this many requests of the trace (smoke: 40).
    #[arg(long)]
    trace_requests: Option<usize>,
    /// Prefill load of the replay, percent (comma-separated): the first at every shape, cache
    /// and scheduler, the others at the first shape and cache only (smoke: the first).
    #[arg(long, default_value = "70,40,90")]
    trace_loads: String,
    /// Prefix-cache capacity of each of the 4 replicas in the replay, tokens (comma-separated;
    /// smoke: the first).
    #[arg(long, default_value = "2000000,500000")]
    trace_caches: String,
    /// The simulator's schedulers for the replay (comma-separated: fcfs, chunked; one the
    /// simulator does not have is skipped, said once; smoke: the last).
    #[arg(long, default_value = "fcfs,chunked")]
    trace_schedulers: String,
    /// Request shapes of the replay (comma-separated: chat, completions).
    #[arg(long, default_value = "chat,completions")]
    trace_shapes: String,
    /// Routers of the replay (comma-separated: inferlb policies, sglang, vllm).
    #[arg(long, default_value = "roundrobin,adaptive,prefill_cost,sglang,vllm")]
    trace_policies: String,
    /// The simulator's speed factor in the replay (the load percentage is what is pinned).
    #[arg(long, default_value_t = 20.0)]
    trace_speed: f64,
    /// Cap on a replayed request's max_tokens (the trace's output_length, mean 191, at most
    /// 842). Every generated token is one event through the router and the client: with the
    /// full lengths at speed 20 the 2-core machine, not the replicas, became the bottleneck.
    #[arg(long, default_value_t = 64)]
    trace_max_tokens: usize,
    /// The virtual environment holding the peer routers (default: target/venv-peers, where
    /// `make peers` installs them).
    #[arg(long)]
    peers_venv: Option<PathBuf>,
    /// Further flags for both peer routers, space-separated (e.g. "--cache-threshold 0.5").
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    peer_flags: String,
    /// Skip the prefill/decode disaggregation scene.
    #[arg(long)]
    no_pd: bool,
    /// Fronts of the P/D scene (comma-separated: inferlb-pd, inferlb-pd-sglang, inferlb-agg,
    /// vllm-router, smg).
    #[arg(
        long,
        default_value = "inferlb-pd,inferlb-pd-sglang,inferlb-agg,vllm-router,smg"
    )]
    pd_fronts: String,
    /// The simulator's speed factor in the P/D scene (default 2; smoke: 10). Faster shows the
    /// machine's CPU in the modelled ITL: a millisecond of CPU is `speed` modelled ones.
    #[arg(long)]
    pd_speed: Option<f64>,
    /// `pd.local_prefill_tokens` values of the P/D scene's sweep (comma-separated; smoke: 0,1024).
    #[arg(long, default_value = "0,256,1024,4096")]
    pd_thresholds: String,
    /// `pd.local_prefill_tokens` of inferlb P/D in the fronts table and the kill scene (its
    /// setting for decode replicas with a small step budget, `--pd-decode-max-num-batched-tokens`;
    /// the conf's default is 1024).
    #[arg(long, default_value_t = 4096)]
    pd_local_prefill_tokens: usize,
    /// `pd.local_prefill_idle_tokens` of every inferlb P/D run (0: only `local_prefill_tokens`;
    /// the conf's default is 8192).
    #[arg(long, default_value_t = 100_000)]
    pd_local_prefill_idle_tokens: usize,
    /// `pd.warm_prefill: true` in every inferlb P/D run (a local turn is prefilled again on an
    /// idle prefill replica once it was answered).
    #[arg(long)]
    pd_warm_prefill: bool,
    /// The decode replicas' step budget in the P/D scene (the simulator's
    /// `--max-num-batched-tokens` under the chunked scheduler): one decode interval's worth of
    /// prefill (20 ms at 30,000 tokens/s), so a step with a local prefill is no longer than a
    /// decode step. 0: the simulator's 8192, as every other replica keeps.
    #[arg(long, default_value_t = 600)]
    pd_decode_max_num_batched_tokens: usize,
    /// Requests of the trace the P/D scene replays (smoke: 12).
    #[arg(long)]
    pd_trace_requests: Option<usize>,
    /// Prefill load of the P/D scene's replay, percent of 4 replicas' cold prefill.
    #[arg(long, default_value_t = 40.0)]
    pd_trace_load: f64,
    /// The virtual environment holding smg, SGLang's gateway (default: `INFERLB_SMG_VENV`, else
    /// `venv-smg` beside the peers' venv, where `make peers` installs it).
    #[arg(long)]
    smg_venv: Option<PathBuf>,
    /// Run only the KV-events bench and exit: the trace on 4 replicas with a real tokenizer and
    /// KV events, as it is, with one replica restarted a third of the way in, and with 30% of
    /// the requests straight to a replica, through inferlb with its estimate, inferlb with the events, vLLM's router kv_aware and
    /// smg cache_aware (not part of a default run).
    #[arg(long)]
    kv_events_bench: bool,
    /// Requests of the trace the KV-events bench replays.
    #[arg(long, default_value_t = 1000)]
    kv_requests: usize,
    /// Prefix-cache capacity of each replica in the KV-events bench, tokens (comma-separated).
    #[arg(long, default_value = "500000,2000000")]
    kv_caches: String,
    /// Runs of each front at each cache size (the table shows their medians).
    #[arg(long, default_value_t = 3)]
    kv_runs: usize,
    /// Fronts of the KV-events bench (comma-separated: estimate, events, vllm-kv, smg).
    #[arg(long, default_value = "estimate,events,vllm-kv,smg")]
    kv_fronts: String,
    /// Workloads of the KV-events bench (comma-separated: replay, restart, direct).
    #[arg(long, default_value = "replay,restart,direct")]
    kv_workloads: String,
    /// The simulator's speed factor in the KV-events bench.
    #[arg(long, default_value_t = 10.0)]
    kv_speed: f64,
    /// Prefill load of the KV-events bench, percent of 4 replicas' cold prefill.
    #[arg(long, default_value_t = 70.0)]
    kv_load: f64,
    /// Share of the requests sent straight to a replica in the KV-events bench's direct
    /// workload, percent.
    #[arg(long, default_value_t = 30.0)]
    kv_direct_pct: f64,
}

/// A comma-separated flag's items.
fn items(list: &str) -> Vec<&str> {
    list.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

/// smg's virtual environment: `--smg-venv`, else `INFERLB_SMG_VENV`, else `venv-smg` beside the
/// peers' venv (where `make peers` puts both).
fn smg_venv(a: &Args, peers_venv: &std::path::Path) -> PathBuf {
    a.smg_venv.clone().unwrap_or_else(|| {
        std::env::var_os("INFERLB_SMG_VENV")
            .map(PathBuf::from)
            .unwrap_or_else(|| peers_venv.parent().unwrap_or(peers_venv).join("venv-smg"))
    })
}

/// Scenario sizes; `smoke` shrinks them.
#[derive(Debug, Clone, Serialize)]
pub struct Sizes {
    context_tokens: usize,
    conversations: usize,
    turns: usize,
    turn_tokens: usize,
    burst: usize,
    reply_tokens: usize,
    cache_tokens: usize,
    failover_seconds: f64,
    overhead_seconds: f64,
    /// Streams whose event gaps each overhead measurement reads.
    overhead_sse_streams: usize,
    /// Agent APIs: conversations, turns, context, tokens added a turn, each replica's cache.
    api_loops: usize,
    api_turns: usize,
    api_context_tokens: usize,
    api_turn_tokens: usize,
    api_cache_tokens: usize,
    /// Fork: the history, the siblings, ms of model time between two, each replica's cache.
    fork_history_tokens: usize,
    fork_siblings: usize,
    fork_stagger_ms: f64,
    fork_cache_tokens: usize,
}

impl Sizes {
    fn new(smoke: bool) -> Sizes {
        if smoke {
            Sizes {
                context_tokens: 2_000,
                conversations: 2,
                turns: 3,
                turn_tokens: 100,
                burst: 4,
                reply_tokens: 4,
                cache_tokens: 100_000,
                failover_seconds: 1.5,
                overhead_seconds: 0.5,
                overhead_sse_streams: 2,
                api_loops: 2,
                api_turns: 3,
                api_context_tokens: 2_000,
                api_turn_tokens: 100,
                api_cache_tokens: 100_000,
                fork_history_tokens: 3_000,
                fork_siblings: 3,
                fork_stagger_ms: 100.0,
                fork_cache_tokens: 100_000,
            }
        } else {
            Sizes {
                context_tokens: 90_000,
                conversations: 4,
                turns: 8,
                turn_tokens: 2_000,
                burst: 16,
                reply_tokens: 32,
                cache_tokens: 250_000,
                failover_seconds: 6.0,
                overhead_seconds: 5.0,
                overhead_sse_streams: 10,
                // Four ~26k-token conversations against 60k tokens of cache a replica: a
                // replica holds two of them, not all four.
                api_loops: 4,
                api_turns: 6,
                api_context_tokens: 20_000,
                api_turn_tokens: 1_000,
                api_cache_tokens: 60_000,
                fork_history_tokens: 60_000,
                fork_siblings: 8,
                fork_stagger_ms: 100.0,
                fork_cache_tokens: 250_000,
            }
        }
    }
}

/// Every scenario's numbers for one target.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TargetResult {
    target: String,
    agent: AgentResult,
    agent_hit_rate: f64,
    burst_makespan_s: f64,
    burst_errors: usize,
    mixed_agent: AgentResult,
    mixed_burst_makespan_s: f64,
    failover: FailoverResult,
    /// Burst requests per replica, alone and while the agent loops run.
    burst_split: std::collections::BTreeMap<String, usize>,
    mixed_burst_split: std::collections::BTreeMap<String, usize>,
}

/// Agent loops, cold burst, both at once, failover: each on a fresh cluster.
async fn run_target(client: &reqwest::Client, target: &str, a: &Args, s: &Sizes) -> TargetResult {
    let mut r = TargetResult {
        target: target.into(),
        ..Default::default()
    };
    let logs = a.out.join("logs");
    let _ = std::fs::create_dir_all(&logs);
    let sim_flags: Vec<&str> = a.sim_flags.split_whitespace().collect();
    let spec = |scenario: &str| ClusterSpec {
        front: if target == "direct" {
            Front::Direct
        } else {
            Front::Inferlb(target)
        },
        replicas: 2,
        speed: a.speed,
        cache_tokens: s.cache_tokens,
        sim_flags: &sim_flags,
        log: Some(logs.join(format!("{target}-{scenario}.log"))),
        spill_margin: None,
        lb_extra: "",
    };

    eprintln!("[{target}] agent loop");
    let c = Cluster::start(&spec("agent"));
    let before = c.token_counts(client).await;
    r.agent = agent_loops(client, &c.target(), s, "a", a.speed).await;
    let after = c.token_counts(client).await;
    r.agent_hit_rate =
        (after.cached - before.cached) as f64 / ((after.prompt - before.prompt).max(1)) as f64;
    drop(c);

    eprintln!("[{target}] cold burst");
    let c = Cluster::start(&spec("burst"));
    let burst = cold_burst(client, &c.target(), s, "b").await;
    (r.burst_makespan_s, r.burst_errors) = (burst.makespan_s, burst.errors);
    r.burst_split = burst.split;
    drop(c);

    eprintln!("[{target}] mixed");
    let c = Cluster::start(&spec("mixed"));
    let base = c.target();
    let (agent, burst) = tokio::join!(agent_loops(client, &base, s, "m", a.speed), async {
        // The burst lands while the loops are under way.
        tokio::time::sleep(Duration::from_secs_f64(3.0 / a.speed)).await;
        cold_burst(client, &base, s, "mb").await
    });
    r.mixed_agent = agent;
    r.mixed_burst_makespan_s = burst.makespan_s;
    r.mixed_burst_split = burst.split;
    drop(c);

    eprintln!("[{target}] failover");
    let mut c = Cluster::start(&spec("failover"));
    r.failover = failover(client, &mut c, s).await;
    r
}

/// Where a named target of the fork scene comes from.
fn front_of<'a>(name: &'a str, venv: &'a std::path::Path) -> Option<Front<'a>> {
    match name {
        "direct" => Some(Front::Direct),
        "roundrobin" | "affinity" | "adaptive" | "prefill_cost" => Some(Front::Inferlb(name)),
        other => PeerKind::parse(other).map(|k| Front::Peer(k, venv)),
    }
}

/// How long each part of the run took, seconds.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Timings(Vec<(String, f64)>);

impl Timings {
    fn since(&mut self, part: &str, started: std::time::Instant) {
        self.0.push((part.into(), started.elapsed().as_secs_f64()));
    }
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    let run_started = std::time::Instant::now();
    // Before any process starts: they inherit it (the soak's 10,000 streams need 20,000
    // descriptors in inferlb alone).
    let nofile = scenarios::soak::raise_nofile(65_536);
    let mut timings = Timings::default();
    let mut s = Sizes::new(a.smoke);
    if let Some(c) = a.cache_tokens {
        s.cache_tokens = c;
    }
    std::fs::create_dir_all(a.out.join("logs")).expect("create the output directory");
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(256)
        .timeout(Duration::from_secs(600))
        .build()
        .expect("client");
    if let Some(base) = &a.drive {
        let said = scenarios::overhead::drive(&client, base, a.drive_rate, a.drive_seconds).await;
        println!("{said}");
        return;
    }
    let venv = a.peers_venv.clone().unwrap_or_else(Peer::default_venv);
    if a.kv_events_bench {
        let mut fronts = vec![];
        for name in items(&a.kv_fronts) {
            match scenarios::kv_events::KvFront::parse(name) {
                Some(f) => fronts.push(f),
                None => eprintln!("[kv-events] unknown front {name}: skipped"),
            }
        }
        let mut workloads = vec![];
        for name in items(&a.kv_workloads) {
            match scenarios::kv_events::KvWorkload::parse(name) {
                Some(w) => workloads.push(w),
                None => eprintln!("[kv-events] unknown workload {name}: skipped"),
            }
        }
        let smg_venv = smg_venv(&a, &venv);
        let kc = scenarios::kv_events::KvConf {
            trace: a.trace.clone(),
            requests: a.kv_requests,
            caches: items(&a.kv_caches)
                .iter()
                .filter_map(|x| x.parse().ok())
                .collect(),
            runs: a.kv_runs,
            fronts,
            workloads,
            speed: a.kv_speed,
            load_pct: a.kv_load,
            max_tokens: a.trace_max_tokens.max(1),
            direct_pct: a.kv_direct_pct,
            peers_venv: venv.clone(),
            smg_venv,
            out: a.out.clone(),
        };
        if let Some(r) = scenarios::kv_events::kv_events(&client, &kc).await {
            println!("{}", scenarios::kv_events::write(&r, &a.out));
        }
        return;
    }
    cluster::set_peer_flags(a.peer_flags.split_whitespace().map(str::to_owned).collect());
    let caps = cluster::sim_caps();
    eprintln!(
        "[bench] inferlb-sim: schedulers {:?}; cache size in /metrics: {}",
        caps.schedulers,
        if caps.cache_config_info {
            "yes (inferlb learns it)"
        } else {
            "no (configured in inferlb's conf)"
        }
    );

    let t = std::time::Instant::now();
    let mut results = vec![];
    for target in items(&a.targets) {
        results.push(run_target(&client, target, &a, &s).await);
    }
    timings.since("seed scenes", t);

    let t = std::time::Instant::now();
    let apis = if a.no_agent_apis {
        None
    } else {
        let policies = items(&a.api_policies);
        Some(scenarios::agent_apis::agent_apis(&client, &a, &s, &policies).await)
    };
    timings.since("agent APIs", t);

    let t = std::time::Instant::now();
    let forked = if a.no_fork {
        None
    } else {
        let mut fronts = vec![];
        for name in items(&a.fork_targets) {
            match front_of(name, &venv) {
                Some(f) => fronts.push((name.to_string(), f)),
                None => eprintln!("[fork] unknown target {name}: skipped"),
            }
        }
        Some(scenarios::fork::fork(&client, &a, &s, &fronts).await)
    };
    timings.since("fork", t);

    let t = std::time::Instant::now();
    let several = if a.no_instances {
        None
    } else {
        Some(scenarios::instances::instances(&client, &a, a.smoke).await)
    };
    timings.since("several instances", t);

    let t = std::time::Instant::now();
    let traced = if a.no_trace {
        None
    } else {
        let nums = |list: &str| -> Vec<f64> {
            items(list)
                .iter()
                .filter_map(|x| match x.parse::<f64>() {
                    Ok(v) if v > 0.0 => Some(v),
                    _ => {
                        eprintln!("[trace] {x}: not a positive number, ignored");
                        None
                    }
                })
                .collect()
        };
        let mut loads = nums(&a.trace_loads);
        let mut caches: Vec<usize> = nums(&a.trace_caches).iter().map(|c| *c as usize).collect();
        let mut schedulers: Vec<String> = items(&a.trace_schedulers)
            .into_iter()
            .map(str::to_owned)
            .collect();
        if a.smoke {
            loads.truncate(1);
            caches.truncate(1);
            let last = schedulers.pop();
            schedulers = last.into_iter().collect();
        }
        let shapes: Vec<Shape> = items(&a.trace_shapes)
            .into_iter()
            .filter_map(|x| {
                let s = Shape::parse(x);
                if s.is_none() {
                    eprintln!("[trace] unknown shape {x}: ignored");
                }
                s
            })
            .collect();
        let policies: Vec<Policy> = items(&a.trace_policies)
            .into_iter()
            .filter_map(|x| {
                let p = Policy::parse(x);
                if p.is_none() {
                    eprintln!("[trace] unknown policy {x}: ignored");
                }
                p
            })
            .collect();
        let tc = TraceConf {
            path: a.trace.clone(),
            requests: a.trace_requests.unwrap_or(if a.smoke { 40 } else { 2000 }),
            loads,
            caches,
            schedulers,
            shapes,
            policies,
            speed: a.trace_speed,
            max_tokens: a.trace_max_tokens.max(1),
            peers_venv: venv.clone(),
        };
        scenarios::trace::trace(&client, &a, &tc).await
    };
    timings.since("trace replay", t);

    let t = std::time::Instant::now();
    let pd = if a.no_pd {
        None
    } else {
        let mut pc = scenarios::pd::PdConf::sized(
            a.smoke,
            a.pd_speed.unwrap_or(if a.smoke { 10.0 } else { 2.0 }),
        );
        for name in items(&a.pd_fronts) {
            match scenarios::pd::PdFront::parse(name) {
                Some(f) => pc.fronts.push(f),
                None => eprintln!("[pd] unknown front {name}: skipped"),
            }
        }
        if !a.smoke {
            pc.thresholds = items(&a.pd_thresholds)
                .iter()
                .filter_map(|x| x.parse().ok())
                .collect();
        }
        pc.local_prefill_tokens = a.pd_local_prefill_tokens;
        pc.local_prefill_idle_tokens = a.pd_local_prefill_idle_tokens;
        pc.warm_prefill = a.pd_warm_prefill;
        pc.decode_step_tokens = Some(a.pd_decode_max_num_batched_tokens).filter(|n| *n > 0);
        pc.smg_venv = smg_venv(&a, &venv);
        pc.peers_venv = venv.clone();
        pc.logs = a.out.join("logs");
        pc.trace = a.trace.clone();
        if let Some(n) = a.pd_trace_requests {
            pc.trace_requests = n;
        }
        pc.trace_load_pct = a.pd_trace_load;
        pc.trace_max_tokens = a.trace_max_tokens.max(1);
        Some(scenarios::pd::pd(&client, &pc).await)
    };
    timings.since("prefill/decode", t);

    let t = std::time::Instant::now();
    let deploys = if a.no_deploy {
        vec![]
    } else {
        eprintln!("[deploy] without spilling");
        let naive = scenarios::deploy::deploy(&client, &a, &s, 0).await;
        eprintln!("[deploy] with spilling");
        let spill = scenarios::deploy::deploy(&client, &a, &s, 4).await;
        vec![naive, spill]
    };
    timings.since("rolling deploy", t);

    let t = std::time::Instant::now();
    let overloaded = if a.no_overload {
        None
    } else {
        Some(scenarios::overload::overload(&client, &a, a.smoke).await)
    };
    timings.since("overload", t);

    let t = std::time::Instant::now();
    let soaked = if a.soak_seconds > 0.0 {
        let (connections, seconds) = if a.smoke {
            (50, 2.0)
        } else {
            (1000, a.soak_seconds)
        };
        eprintln!("[soak] {connections} connections for {seconds} s");
        let mut soaked = scenarios::soak::soak(&a, connections, seconds).await;
        let counts: Vec<usize> = if a.smoke {
            vec![20]
        } else {
            items(&a.soak_streams)
                .iter()
                .filter_map(|x| x.parse().ok())
                .collect()
        };
        soaked.open_streams = scenarios::soak::open_streams(&a, &counts).await;
        soaked.nofile_limit = nofile.clone();
        Some(soaked)
    } else {
        None
    };
    timings.since("soak", t);

    let t = std::time::Instant::now();
    let lat = if a.no_overhead {
        None
    } else {
        let rounds = a.overhead_rounds;
        Some(scenarios::overhead::overhead(&client, &s, rounds, a.smoke).await)
    };
    timings.since("proxy overhead", t);

    let t = std::time::Instant::now();
    let lat_tls = if a.no_overhead_tls {
        None
    } else {
        let rounds = a.overhead_tls_rounds;
        Some(scenarios::overhead_tls::overhead_tls(&client, &s, rounds, a.smoke).await)
    };
    timings.since("proxy overhead over https", t);
    timings.since("total", run_started);

    let report = report::Report {
        args: &a,
        sizes: &s,
        targets: &results,
        overhead: lat.as_ref(),
        overhead_tls: lat_tls.as_ref(),
        deploys: &deploys,
        soak: soaked.as_ref(),
        apis: apis.as_ref(),
        fork: forked.as_ref(),
        trace: traced.as_ref(),
        overload: overloaded.as_ref(),
        pd: pd.as_ref(),
        timings: &timings,
    }
    .write(&a.out);
    println!("{report}");
    if let Some(i) = &several {
        println!("{}", scenarios::instances::write(i, &a.out));
    }
    // The smoke run is a test: every scenario must have produced numbers.
    if a.smoke {
        let mut broken: Vec<String> = vec![];
        for r in &results {
            if r.agent.warm_ttft_ms.is_empty()
                || r.burst_makespan_s <= 0.0
                || r.failover.requests == 0
            {
                broken.push(format!("seed scenes, {}", r.target));
            }
        }
        for r in apis.iter().flat_map(|x| &x.rows) {
            if r.warm_ttft_ms.is_empty() || r.missing_usage > 0 || r.errors > 0 {
                broken.push(format!("agent APIs, {} via {}", r.api, r.policy));
            }
        }
        for r in forked.iter().flat_map(|x| &x.rows) {
            if r.skipped.is_none() && (r.ttft_ms.is_empty() || r.errors > 0) {
                broken.push(format!("fork, {}", r.target));
            }
        }
        if let Some(t) = &traced {
            if t.references.is_empty() {
                broken.push("trace replay, the reference".into());
            }
            for r in &t.rows {
                if r.skipped.is_none() && (r.ttft_p50_ms.is_nan() || r.errors > 0) {
                    broken.push(format!(
                        "trace replay, {} {} {}",
                        r.shape, r.scheduler, r.policy
                    ));
                }
            }
        }
        for r in overloaded.iter().flat_map(|x| &x.rows) {
            if r.answered == 0 {
                broken.push(format!("overload, {} {}", r.run, r.class));
            }
        }
        for r in several.iter().flat_map(|x| &x.rows) {
            if r.skipped.is_none() && (r.warm_ttft_ms.is_empty() || r.errors > 0) {
                broken.push(format!("several instances, {}", r.setup));
            }
        }
        for s in soaked.iter().flat_map(|k| &k.open_streams) {
            if s.open < s.streams || s.errors > 0 {
                broken.push(format!("soak, {} streams open at once", s.streams));
            }
        }
        broken.extend(pd.iter().flat_map(scenarios::pd::broken));
        broken.extend(lat.iter().flat_map(scenarios::overhead::broken));
        broken.extend(lat_tls.iter().flat_map(scenarios::overhead_tls::broken));
        if !broken.is_empty() {
            eprintln!(
                "smoke run: no measurement (or errors) from: {}",
                broken.join("; ")
            );
            std::process::exit(1);
        }
    }
}
