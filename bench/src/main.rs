//! inferlb-bench: re-measures the seed's table for every routing policy, side by side, in one
//! run, against simulated replicas (`inferlb-sim`) on loopback.
//!
//! For each target (inferlb in roundrobin, affinity and adaptive mode, and a direct connection
//! to one replica) it starts fresh replicas, so every target begins with cold caches, and runs
//! the scenarios: agent loop, cold burst, mixed, failover. A separate pass measures the
//! proxy's own overhead against a direct connection and nginx. Ratios measured in the same run
//! are the result; absolute times on a shared 2-core machine are noise.
//!
//! Every process comes from `inferlb-harness` and is stopped when the scenario that started it
//! ends.

mod client;
mod cluster;
mod report;
mod scenarios;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Serialize;

use cluster::{Cluster, ClusterSpec};
use scenarios::agent::{agent_loops, cold_burst, AgentResult};
use scenarios::failover::{failover, FailoverResult};

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
    /// Only these targets (comma-separated: roundrobin,affinity,adaptive,direct).
    #[arg(long, default_value = "roundrobin,affinity,adaptive,direct")]
    targets: String,
    /// Prefix-cache capacity of each simulated replica, in tokens (default: about two and a
    /// half 90k-token contexts, as on a card whose KV memory is the scarce resource).
    #[arg(long)]
    cache_tokens: Option<usize>,
    /// Skip the rolling-deploy scenario.
    #[arg(long)]
    no_deploy: bool,
    /// Run the soak test: this many seconds with 1,000 concurrent connections (0: skip).
    #[arg(long, default_value_t = 180.0)]
    soak_seconds: f64,
    /// Skip the proxy-overhead pass.
    #[arg(long)]
    no_overhead: bool,
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
}

/// Agent loops, cold burst, both at once, failover: each on a fresh cluster.
async fn run_target(client: &reqwest::Client, target: &str, a: &Args, s: &Sizes) -> TargetResult {
    let mut r = TargetResult {
        target: target.into(),
        ..Default::default()
    };
    let logs = a.out.join("logs");
    let _ = std::fs::create_dir_all(&logs);
    let spec = |scenario: &str| ClusterSpec {
        routing: (target != "direct").then_some(target),
        speed: a.speed,
        cache_tokens: s.cache_tokens,
        sim_flags: &[],
        log: Some(logs.join(format!("{target}-{scenario}.log"))),
        spill_margin: None,
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
    drop(c);

    eprintln!("[{target}] failover");
    let mut c = Cluster::start(&spec("failover"));
    r.failover = failover(client, &mut c, s).await;
    r
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
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
    let mut results = vec![];
    for target in a
        .targets
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        results.push(run_target(&client, target, &a, &s).await);
    }
    let deploys = if a.no_deploy {
        vec![]
    } else {
        eprintln!("[deploy] without spilling");
        let naive = scenarios::deploy::deploy(&client, &a, &s, 0).await;
        eprintln!("[deploy] with spilling");
        let spill = scenarios::deploy::deploy(&client, &a, &s, 4).await;
        vec![naive, spill]
    };
    let soaked = if a.soak_seconds > 0.0 {
        let (connections, seconds) = if a.smoke {
            (50, 2.0)
        } else {
            (1000, a.soak_seconds)
        };
        eprintln!("[soak] {connections} connections for {seconds} s");
        Some(scenarios::soak::soak(&a, connections, seconds).await)
    } else {
        None
    };
    let lat = if a.no_overhead {
        vec![]
    } else {
        scenarios::overhead::overhead(&client, &s).await
    };
    let report = report::Report {
        args: &a,
        sizes: &s,
        targets: &results,
        overhead: &lat,
        deploys: &deploys,
        soak: soaked.as_ref(),
    }
    .write(&a.out);
    println!("{report}");
    // The smoke run is a test: every scenario must have produced numbers.
    if a.smoke {
        let broken = results.iter().any(|r| {
            r.agent.warm_ttft_ms.is_empty() || r.burst_makespan_s <= 0.0 || r.failover.requests == 0
        });
        if broken {
            eprintln!("smoke run: a scenario produced no measurement");
            std::process::exit(1);
        }
    }
}
