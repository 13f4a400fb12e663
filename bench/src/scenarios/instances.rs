//! Several inferlb instances in front of the same replicas, with a client that sends every
//! request to the next instance (as an L4 balancer without stickiness does): one instance,
//! three sharing their routing state through Redis, three on their own. Agent loops over long
//! contexts; each variant gets fresh replicas (cold caches). Measured: warm-turn TTFT, the
//! replicas' prefix-cache hit rate, and how many warm turns reached the replica of the turn
//! before.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use inferlb_harness::{Lb, LbConf, Redis, Sim};
use serde::Serialize;
use serde_json::{json, Value};

use crate::client::{filler, pct, stream_chat};
use crate::Args;

/// The workload; `smoke` shrinks it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct InstancesSizes {
    pub replicas: usize,
    pub loops: usize,
    pub turns: usize,
    pub context_tokens: usize,
    pub turn_tokens: usize,
    pub reply_tokens: usize,
    /// Each replica's prefix cache: room for each conversation once, not on every replica.
    pub cache_tokens: usize,
}

impl InstancesSizes {
    pub fn new(smoke: bool) -> InstancesSizes {
        if smoke {
            InstancesSizes {
                replicas: 2,
                loops: 2,
                turns: 3,
                context_tokens: 2_000,
                turn_tokens: 100,
                reply_tokens: 4,
                cache_tokens: 100_000,
            }
        } else {
            // 8 conversations growing to ~28k tokens: ~224k tokens in all, against 2 x 120k
            // of cache.
            InstancesSizes {
                replicas: 2,
                loops: 8,
                turns: 8,
                context_tokens: 20_000,
                turn_tokens: 1_000,
                reply_tokens: 16,
                cache_tokens: 120_000,
            }
        }
    }
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct InstancesRow {
    /// The routing policy every instance runs.
    pub routing: String,
    pub setup: String,
    pub instances: usize,
    pub shared: bool,
    pub warm_ttft_ms: Vec<f64>,
    pub warm_ttft_p50_ms: f64,
    pub warm_ttft_p90_ms: f64,
    /// Cached prompt tokens over prompt tokens, from the replicas' counters.
    pub hit_rate: f64,
    /// Warm turns served by the replica that served the turn before.
    pub same_replica: usize,
    pub warm_turns: usize,
    /// Where each conversation's first turn went: how evenly the conversations were placed.
    pub first_turns: BTreeMap<String, usize>,
    pub errors: usize,
    /// Set when the variant could not run (no redis-server).
    pub skipped: Option<String>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct InstancesResult {
    pub sizes: Option<InstancesSizes>,
    pub speed: f64,
    pub rows: Vec<InstancesRow>,
}

/// The replicas' prompt and cached tokens, summed (`/sim/stats`).
async fn tokens(client: &reqwest::Client, sims: &[Sim]) -> (u64, u64) {
    let mut total = (0, 0);
    for s in sims {
        let stats: Option<Value> = match client.get(s.url("/sim/stats")).send().await {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        };
        let n = |k: &str| stats.as_ref().and_then(|v| v[k].as_u64()).unwrap_or(0);
        total.0 += n("prompt_tokens");
        total.1 += n("cached_tokens");
    }
    total
}

/// Fresh replicas and `instances` inferlb instances in front of them, routing by `routing`,
/// each joined to `redis` when given; blocking.
fn start(
    dir: &Path,
    a: &Args,
    s: &InstancesSizes,
    (instances, routing): (usize, &str),
    redis: Option<&Redis>,
) -> (Vec<Lb>, Vec<Sim>) {
    let (speed, cache) = (a.speed.to_string(), s.cache_tokens.to_string());
    let flags = ["--speed", &speed, "--cache-tokens", &cache];
    let sims: Vec<Sim> = (0..s.replicas)
        .map(|i| Sim::spawn(dir, &format!("gpu{i}"), &flags))
        .collect();
    sims.iter().for_each(Sim::assert_healthy);
    let refs: Vec<&Sim> = sims.iter().collect();
    let lbs = (0..instances)
        .map(|i| {
            let name = format!("lb{i}");
            let here = dir.join(&name);
            std::fs::create_dir_all(&here).expect("instance dir");
            let conf = LbConf {
                threads: Some(2),
                max_retries: Some(4),
                routing: Some(routing.into()),
                health_interval_seconds: Some(0.5),
                load_poll_interval_seconds: Some((0.25 / a.speed.max(1.0)).max(0.01)),
                extra: redis.map(|r| r.cluster_conf(&name)).unwrap_or_default(),
                ..LbConf::default()
            };
            let log = a
                .out
                .join("logs")
                .join(format!("instances-{routing}-{instances}-{name}.log"));
            Lb::start_logged(&here, &refs, conf, Some(&log), "warn")
        })
        .collect();
    (lbs, sims)
}

/// The agent loops, turn `t` of loop `c` to `bases[(c + t) % bases.len()]`.
async fn run(
    client: &reqwest::Client,
    bases: &[String],
    s: &InstancesSizes,
    speed: f64,
    tag: &str,
) -> InstancesRow {
    let tasks: Vec<_> = (0..s.loops)
        .map(|c| {
            let (client, bases, s) = (client.clone(), bases.to_vec(), *s);
            let tag = tag.to_string();
            tokio::spawn(async move {
                let mut row = InstancesRow::default();
                let mut previous: Option<String> = None;
                let context = filler(&format!("{tag} loop {c} context"), s.context_tokens);
                let mut messages = vec![json!({"role": "system", "content": context})];
                for turn in 0..s.turns {
                    // Tool time between turns, different for each loop and turn.
                    let think = (c as u64 * 3571 + turn as u64 * 7919) % 800;
                    tokio::time::sleep(Duration::from_secs_f64(think as f64 / 1e3 / speed)).await;
                    let ask = filler(&format!("{tag} loop {c} tool output {turn}"), s.turn_tokens);
                    messages.push(json!({"role": "user", "content": ask}));
                    let base = &bases[(c + turn) % bases.len()];
                    let o = stream_chat(&client, base, &messages, s.reply_tokens).await;
                    if o.failed {
                        row.errors += 1;
                        messages.pop();
                        previous = None;
                        continue;
                    }
                    if turn > 0 {
                        let ms = o.ttft.unwrap_or(o.total).as_secs_f64() * 1e3;
                        row.warm_ttft_ms.push(ms);
                        if let Some(p) = &previous {
                            row.warm_turns += 1;
                            row.same_replica += usize::from(o.replica.as_ref() == Some(p));
                        }
                    }
                    if turn == 0 {
                        let home = o.replica.clone().unwrap_or_else(|| "-".into());
                        *row.first_turns.entry(home).or_insert(0) += 1;
                    }
                    previous = o.replica.clone();
                    messages.push(json!({"role": "assistant", "content": o.reply}));
                }
                row
            })
        })
        .collect();
    let mut all = InstancesRow::default();
    for t in tasks {
        match t.await {
            Ok(r) => {
                all.warm_ttft_ms.extend(r.warm_ttft_ms);
                all.same_replica += r.same_replica;
                all.warm_turns += r.warm_turns;
                for (replica, n) in r.first_turns {
                    *all.first_turns.entry(replica).or_insert(0) += n;
                }
                all.errors += r.errors;
            }
            Err(_) => all.errors += 1,
        }
    }
    all
}

/// Under each policy: one instance, three sharing state through Redis, three on their own.
pub async fn instances(client: &reqwest::Client, a: &Args, smoke: bool) -> InstancesResult {
    let s = InstancesSizes::new(smoke);
    let mut result = InstancesResult {
        sizes: Some(s),
        speed: a.speed,
        rows: vec![],
    };
    let setups = [
        ("1 instance", 1, false),
        ("3 instances, shared state (Redis)", 3, true),
        ("3 instances, no sharing", 3, false),
    ];
    let runs = ["adaptive", "prefill_cost"]
        .into_iter()
        .flat_map(|routing| setups.map(|setup| (routing, setup)));
    for (routing, (setup, instances, shared)) in runs {
        let mut row = InstancesRow {
            routing: routing.into(),
            setup: setup.into(),
            instances,
            shared,
            ..InstancesRow::default()
        };
        if shared && Redis::find().is_none() {
            eprintln!("[instances] {setup}: skipped, redis-server is not installed (make deps)");
            row.skipped = Some("redis-server not installed".into());
            result.rows.push(row);
            continue;
        }
        eprintln!("[instances] {routing}: {setup}");
        let dir = tempfile::tempdir().expect("tempdir");
        let (redis, lbs, sims) = tokio::task::block_in_place(|| {
            let redis = shared.then(|| Redis::start(dir.path()));
            let (lbs, sims) = start(dir.path(), a, &s, (instances, routing), redis.as_ref());
            (redis, lbs, sims)
        });
        if shared {
            // Every instance adopted the (empty) shared state before the first request.
            let joined = tokio::task::block_in_place(|| {
                inferlb_harness::wait_until(Duration::from_secs(10), || {
                    lbs.iter().all(|lb| {
                        inferlb_harness::http_status(
                            lb.admin_port,
                            "/ready",
                            Duration::from_secs(1),
                        ) == Some(200)
                    })
                })
            });
            assert!(joined, "the instances did not join the cluster");
        }
        let bases: Vec<String> = lbs.iter().map(|lb| lb.url("")).collect();
        let before = tokens(client, &sims).await;
        let tag = format!("instances {routing} {instances} {shared}");
        let measured = run(client, &bases, &s, a.speed, &tag).await;
        let after = tokens(client, &sims).await;
        row.hit_rate = (after.1 - before.1) as f64 / (after.0 - before.0).max(1) as f64;
        row.warm_ttft_p50_ms = pct(&measured.warm_ttft_ms, 0.5);
        row.warm_ttft_p90_ms = pct(&measured.warm_ttft_ms, 0.9);
        row.warm_ttft_ms = measured.warm_ttft_ms;
        row.same_replica = measured.same_replica;
        row.warm_turns = measured.warm_turns;
        row.first_turns = measured.first_turns;
        row.errors = measured.errors;
        tokio::task::block_in_place(|| drop((lbs, sims, redis)));
        result.rows.push(row);
    }
    result
}

/// The "several instances" table, markdown.
pub fn table(r: &InstancesResult) -> String {
    let Some(s) = r.sizes else {
        return String::new();
    };
    let mut md = format!(
        "\n## Several instances\n\n{} agent loops x {} turns ({}k-token contexts, +{}k a turn), \
         {} replicas with {}k tokens of prefix cache each, speed x{}; the client sends every \
         request to the next instance.\n\n\
         | routing | setup | warm-turn TTFT p50 (ms) | p90 (ms) | prefix-cache hit rate | warm turns on the previous turn's replica | first turns per replica | errors |\n\
         |---|---|---|---|---|---|---|---|\n",
        s.loops,
        s.turns,
        s.context_tokens / 1000,
        s.turn_tokens as f64 / 1000.0,
        s.replicas,
        s.cache_tokens / 1000,
        r.speed
    );
    for row in &r.rows {
        if let Some(why) = &row.skipped {
            md.push_str(&format!(
                "| {} | {} | skipped: {why} | | | | | |\n",
                row.routing, row.setup
            ));
            continue;
        }
        let split: Vec<String> = row.first_turns.values().map(|n| n.to_string()).collect();
        let split = split.join("/");
        md.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} | {:.1}% | {}/{} | {} | {} |\n",
            row.routing,
            row.setup,
            row.warm_ttft_p50_ms,
            row.warm_ttft_p90_ms,
            row.hit_rate * 100.0,
            row.same_replica,
            row.warm_turns,
            split,
            row.errors
        ));
    }
    md
}

/// Writes `instances.md` and `instances.json` into `out`, and appends the table to
/// `results.md` (the report written just before); returns the table.
pub fn write(r: &InstancesResult, out: &Path) -> String {
    let md = table(r);
    let command: Vec<String> = std::env::args().skip(1).collect();
    let alone = format!("Command: `inferlb-bench {}`\n{md}", command.join(" "));
    std::fs::write(out.join("instances.md"), alone).expect("write instances.md");
    let raw = serde_json::to_string_pretty(r).expect("instances as JSON");
    std::fs::write(out.join("instances.json"), raw).expect("write instances.json");
    let results = out.join("results.md");
    if let Ok(mut text) = std::fs::read_to_string(&results) {
        text.push_str(&md);
        std::fs::write(&results, text).expect("append to results.md");
    }
    md
}
