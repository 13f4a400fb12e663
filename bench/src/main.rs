//! inferlb-bench: re-measures the seed's table for every routing policy, side by side, in one
//! run, against simulated replicas (`inferlb-sim`) on loopback.
//!
//! For each target (inferlb in roundrobin, affinity and adaptive mode, and a direct connection
//! to one replica) it starts fresh replicas, so every target begins with cold caches, and runs
//! the scenarios: agent loop, cold burst, mixed, failover. A separate pass measures the
//! proxy's own overhead against a direct connection and nginx. Ratios measured in the same run
//! are the result; absolute times on a shared 2-core machine are noise.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

#[derive(Parser, Debug, Clone)]
#[command(about = "inferlb's routing benchmark")]
struct Args {
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
struct Sizes {
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

fn bin_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/release"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Cluster {
    sims: Vec<(u16, Option<Proc>)>,
    lb: Option<(u16, u16, Proc)>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    fn target(&self) -> String {
        match &self.lb {
            Some((port, _, _)) => format!("http://127.0.0.1:{port}"),
            None => format!("http://127.0.0.1:{}", self.sims[0].0),
        }
    }
    fn stop_sim(&mut self, i: usize) {
        self.sims[i].1 = None;
    }
}

async fn wait_http(client: &reqwest::Client, url: &str) -> bool {
    for _ in 0..250 {
        if client
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    false
}

fn spawn_sim(port: u16, id: &str, speed: f64, cache_tokens: usize, extra: &[&str]) -> Proc {
    Proc(
        Command::new(bin_dir().join("inferlb-sim"))
            .args(["--listen", &format!("127.0.0.1:{port}"), "--id", id])
            .args([
                "--speed",
                &speed.to_string(),
                "--cache-tokens",
                &cache_tokens.to_string(),
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn inferlb-sim (build the workspace first)"),
    )
}

/// Fresh replicas (cold caches) and, unless `mode` is None, inferlb in front of them.
async fn start_cluster(
    client: &reqwest::Client,
    mode: Option<&str>,
    speed: f64,
    cache: usize,
    sim_extra: &[&str],
    log: Option<PathBuf>,
    lb_extra: &str,
) -> Cluster {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sims = vec![];
    for i in 0..2 {
        let port = free_port();
        sims.push((
            port,
            Some(spawn_sim(port, &format!("gpu{i}"), speed, cache, sim_extra)),
        ));
    }
    for (port, _) in &sims {
        assert!(
            wait_http(client, &format!("http://127.0.0.1:{port}/health")).await,
            "sim did not start"
        );
    }
    let lb = match mode {
        None => None,
        Some(mode) => {
            let (port, admin) = (free_port(), free_port());
            let conf = dir.path().join("inferlb.yaml");
            let replicas: String = sims
                .iter()
                .enumerate()
                .map(|(i, (p, _))| format!("    - {{id: gpu{i}, address: \"127.0.0.1:{p}\"}}\n"))
                .collect();
            let text = format!(
                "threads: 2\npid_file: {d}/lb.pid\nupgrade_sock: {d}/lb.sock\nmax_retries: 4\n\
                 inferlb:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin}\n  routing: {mode}\n\
                 \x20 health: {{interval_seconds: 0.5}}\n  replicas:\n{replicas}{lb_extra}",
                d = dir.path().display()
            );
            std::fs::write(&conf, text).expect("write conf");
            let child = Command::new(bin_dir().join("inferlb"))
                .arg("-c")
                .arg(&conf)
                .env("RUST_LOG", "warn")
                .env_remove("ROUTING")
                .stdout(Stdio::null())
                .stderr(
                    log.and_then(|p| std::fs::File::create(p).ok())
                        .map_or_else(Stdio::null, Stdio::from),
                )
                .spawn()
                .expect("spawn inferlb");
            let proc = Proc(child);
            assert!(
                wait_http(client, &format!("http://127.0.0.1:{admin}/metrics")).await,
                "inferlb did not start"
            );
            Some((port, admin, proc))
        }
    };
    Cluster {
        sims,
        lb,
        _dir: dir,
    }
}

/// Text of about `tokens` simulator tokens (4 bytes each), distinct per `seed`.
fn filler(seed: &str, tokens: usize) -> String {
    let mut s = format!("[{seed}] ");
    let words = ["alpha ", "beta ", "gamma ", "delta ", "omega "];
    let mut i = 0;
    while s.len() < tokens * 4 {
        s.push_str(words[i % words.len()]);
        s.push_str(&format!("{i} "));
        i += 1;
    }
    s
}

/// One streamed chat request: (time to first token, reply text, cached tokens, ok).
struct Outcome {
    ttft: Option<Duration>,
    total: Duration,
    reply: String,
    status: u16,
    /// Bytes of a 200 response arrived, then the stream broke.
    cut_after_start: bool,
    failed: bool,
    /// The `x-inferlb-replica` header, when there is one.
    replica: Option<String>,
}

async fn stream_chat(
    client: &reqwest::Client,
    base: &str,
    messages: &[Value],
    max_tokens: usize,
) -> Outcome {
    let started = Instant::now();
    let body = json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": max_tokens});
    let mut out = Outcome {
        ttft: None,
        total: Duration::ZERO,
        reply: String::new(),
        status: 0,
        cut_after_start: false,
        failed: true,
        replica: None,
    };
    let resp = match client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(_) => {
            out.total = started.elapsed();
            return out;
        }
    };
    out.status = resp.status().as_u16();
    out.replica = resp
        .headers()
        .get("x-inferlb-replica")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if out.status != 200 {
        out.total = started.elapsed();
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if v.get("error").is_some() {
                continue;
            }
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                if !c.is_empty() && out.ttft.is_none() {
                    out.ttft = Some(started.elapsed());
                }
                out.reply.push_str(c);
            }
        }
    }
    out.total = started.elapsed();
    out.failed = !done;
    out.cut_after_start = !done;
    out
}

async fn sim_stats(client: &reqwest::Client, c: &Cluster) -> (u64, u64) {
    let mut total = (0, 0);
    for (port, p) in &c.sims {
        if p.is_none() {
            continue;
        }
        if let Ok(r) = client
            .get(format!("http://127.0.0.1:{port}/sim/stats"))
            .send()
            .await
        {
            if let Ok(v) = r.json::<Value>().await {
                total.0 += v["prompt_tokens"].as_u64().unwrap_or(0);
                total.1 += v["cached_tokens"].as_u64().unwrap_or(0);
            }
        }
    }
    total
}

#[derive(Debug, Default, Clone, Serialize)]
struct AgentResult {
    warm_ttft_ms: Vec<f64>,
    first_turn_ttft_ms: Vec<f64>,
    errors: usize,
}

/// Several conversations at once, each many turns over its own long context.
async fn agent_loops(
    client: &reqwest::Client,
    base: &str,
    s: &Sizes,
    tag: &str,
    speed: f64,
) -> AgentResult {
    let tasks: Vec<_> = (0..s.conversations)
        .map(|c| {
            let (client, base, s) = (client.clone(), base.to_string(), s.clone());
            let tag = tag.to_string();
            tokio::spawn(async move {
                let mut r = AgentResult::default();
                let mut messages = vec![json!({"role": "system", "content": filler(&format!("{tag} conversation {c} context"), s.context_tokens)})];
                for turn in 0..s.turns {
                    // Tool time between turns varies, so conversations do not run in lockstep
                    // (in lockstep, a plain counter would hand each one the same card every turn).
                    let think = (c as u64 * 7919 + turn as u64 * 104_729) % 1000;
                    tokio::time::sleep(Duration::from_secs_f64(think as f64 / 1000.0 / speed)).await;
                    messages.push(json!({"role": "user", "content": filler(&format!("{tag} c{c} tool output {turn}"), s.turn_tokens)}));
                    let o = stream_chat(&client, &base, &messages, s.reply_tokens).await;
                    if o.failed {
                        r.errors += 1;
                        messages.pop();
                        continue;
                    }
                    let ms = o.ttft.unwrap_or(o.total).as_secs_f64() * 1e3;
                    if turn == 0 { r.first_turn_ttft_ms.push(ms) } else { r.warm_ttft_ms.push(ms) }
                    messages.push(json!({"role": "assistant", "content": o.reply}));
                }
                r
            })
        })
        .collect();
    let mut all = AgentResult::default();
    for t in tasks {
        if let Ok(r) = t.await {
            all.warm_ttft_ms.extend(r.warm_ttft_ms);
            all.first_turn_ttft_ms.extend(r.first_turn_ttft_ms);
            all.errors += r.errors;
        }
    }
    all
}

/// `n` parallel fresh requests sharing one long prefix; returns the makespan and errors.
async fn cold_burst(client: &reqwest::Client, base: &str, s: &Sizes, tag: &str) -> (f64, usize) {
    let prefix = filler(&format!("{tag} burst shared prefix"), s.context_tokens);
    let started = Instant::now();
    let tasks: Vec<_> = (0..s.burst)
        .map(|i| {
            let (client, base) = (client.clone(), base.to_string());
            let messages = vec![
                json!({"role": "system", "content": prefix.clone()}),
                json!({"role": "user", "content": format!("subtask {i}: do your part")}),
            ];
            let reply = s.reply_tokens * 2;
            tokio::spawn(async move { stream_chat(&client, &base, &messages, reply).await.failed })
        })
        .collect();
    let mut errors = 0;
    for t in tasks {
        if t.await.unwrap_or(true) {
            errors += 1;
        }
    }
    (started.elapsed().as_secs_f64(), errors)
}

#[derive(Debug, Default, Clone, Serialize)]
struct FailoverResult {
    requests: u64,
    /// Failed before any byte of a 200 reached the client: what failover must prevent.
    errors_before_streaming: u64,
    /// Streams that began and were then cut (never retried, by design).
    streams_cut: u64,
    failovers: f64,
    /// Status codes of the failed requests (0: no response at all).
    error_statuses: std::collections::BTreeMap<u16, u64>,
}

/// Steady traffic; one replica is stopped halfway.
async fn failover(client: &reqwest::Client, c: &mut Cluster, s: &Sizes) -> FailoverResult {
    let base = c.target();
    let stop_at = Instant::now() + Duration::from_secs_f64(s.failover_seconds / 2.0);
    let end = Instant::now() + Duration::from_secs_f64(s.failover_seconds);
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let statuses = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (client, base, counts, statuses) = (
                client.clone(),
                base.clone(),
                counts.clone(),
                statuses.clone(),
            );
            tokio::spawn(async move {
                let mut i = 0;
                while Instant::now() < end && i < 10_000 {
                    let messages =
                        vec![json!({"role": "user", "content": format!("worker {w} request {i}")})];
                    let o = stream_chat(&client, &base, &messages, 8).await;
                    counts[0].fetch_add(1, Ordering::Relaxed);
                    if o.status != 200 {
                        counts[1].fetch_add(1, Ordering::Relaxed);
                        if let Ok(mut m) = statuses.lock() {
                            *m.entry(o.status).or_insert(0) += 1;
                        }
                    } else if o.cut_after_start {
                        counts[2].fetch_add(1, Ordering::Relaxed);
                    }
                    i += 1;
                    if o.status != 200 {
                        // Do not spin on a dead target.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep_until(stop_at.into()).await;
    c.stop_sim(0);
    for w in workers {
        let _ = w.await;
    }
    let failovers = match &c.lb {
        Some((_, admin, _)) => scrape_sum(client, *admin, "inferlb_failovers_total").await,
        None => 0.0,
    };
    FailoverResult {
        requests: counts[0].load(Ordering::Relaxed),
        errors_before_streaming: counts[1].load(Ordering::Relaxed),
        streams_cut: counts[2].load(Ordering::Relaxed),
        failovers,
        error_statuses: statuses.lock().map(|m| m.clone()).unwrap_or_default(),
    }
}

async fn scrape_sum(client: &reqwest::Client, admin: u16, name: &str) -> f64 {
    let Ok(r) = client
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
    else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let idx = ((s.len() - 1) as f64 * p).round() as usize;
    s[idx]
}

#[derive(Debug, Default, Clone, Serialize)]
struct TargetResult {
    target: String,
    agent: AgentResult,
    agent_hit_rate: f64,
    burst_makespan_s: f64,
    burst_errors: usize,
    mixed_agent: AgentResult,
    mixed_burst_makespan_s: f64,
    failover: FailoverResult,
}

#[derive(Debug, Default, Clone, Serialize)]
struct SoakResult {
    connections: usize,
    seconds: f64,
    requests: u64,
    streams: u64,
    errors: u64,
    rss_start_kib: u64,
    rss_end_kib: u64,
    fds_start: usize,
    fds_under_load: usize,
    fds_after: usize,
    /// RSS sampled every tenth of the run, KiB.
    rss_series_kib: Vec<u64>,
}

fn proc_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn proc_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Many connections at once for minutes: no errors, memory flat, descriptors given back.
async fn soak(a: &Args, connections: usize, seconds: f64) -> SoakResult {
    let setup = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let c = start_cluster(
        &setup,
        Some("adaptive"),
        1.0,
        100_000,
        &["--max-batch", "2048", "--decode-interval-ms", "20"],
        Some(a.out.join("logs").join("soak.log")),
        "",
    )
    .await;
    let pid = c.lb.as_ref().map(|l| l.2 .0.id()).unwrap_or(0);
    let base = c.target();
    // One connection per client task, so the count of open connections is the task count.
    let clients: Vec<reqwest::Client> = (0..connections)
        .map(|_| {
            reqwest::Client::builder()
                .no_proxy()
                .pool_max_idle_per_host(1)
                .timeout(Duration::from_secs(60))
                .build()
                .expect("client")
        })
        .collect();
    let warm = Instant::now() + Duration::from_secs_f64((seconds * 0.1).min(10.0));
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let mut result = SoakResult {
        connections,
        seconds,
        ..Default::default()
    };
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, client)| {
            let (base, counts) = (base.clone(), counts.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < end && n < 100_000 {
                    let messages =
                        vec![json!({"role": "user", "content": format!("soak {i} {n}")})];
                    let ok = if (i + n as usize).is_multiple_of(2) {
                        counts[1].fetch_add(1, Ordering::Relaxed);
                        !stream_chat(&client, &base, &messages, 25).await.failed
                    } else {
                        let body =
                            json!({"model": "sim-model", "messages": messages, "max_tokens": 5});
                        match client
                            .post(format!("{base}/v1/chat/completions"))
                            .json(&body)
                            .send()
                            .await
                        {
                            Ok(r) if r.status() == 200 => r.bytes().await.is_ok(),
                            _ => false,
                        }
                    };
                    counts[0].fetch_add(1, Ordering::Relaxed);
                    if !ok {
                        counts[2].fetch_add(1, Ordering::Relaxed);
                    }
                    n += 1;
                }
            })
        })
        .collect();
    let sampler = tokio::spawn(async move {
        let mut series = vec![];
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs_f64(seconds / 10.0)).await;
            series.push(proc_rss_kib(pid));
        }
        series
    });
    tokio::time::sleep_until(warm.into()).await;
    result.rss_start_kib = proc_rss_kib(pid);
    result.fds_start = proc_fds(pid);
    tokio::time::sleep_until((end - Duration::from_secs_f64((seconds * 0.05).min(5.0))).into())
        .await;
    result.fds_under_load = proc_fds(pid);
    for t in tasks {
        let _ = t.await;
    }
    // Every client and its connection is gone now; pooled upstream connections idle out after
    // 4 s (upstream.idle_timeout_seconds).
    tokio::time::sleep(Duration::from_secs(6)).await;
    result.rss_end_kib = proc_rss_kib(pid);
    result.fds_after = proc_fds(pid);
    result.rss_series_kib = sampler.await.unwrap_or_default();
    result.requests = counts[0].load(Ordering::Relaxed);
    result.streams = counts[1].load(Ordering::Relaxed);
    result.errors = counts[2].load(Ordering::Relaxed);
    drop(c);
    result
}

/// Polls inferlb's admin state (at most 10 s) until replica `id` satisfies `ready`.
async fn wait_replica(
    client: &reqwest::Client,
    admin: u16,
    id: &str,
    ready: impl Fn(&Value) -> bool,
) {
    for _ in 0..200 {
        let state: Value = match client
            .get(format!("http://127.0.0.1:{admin}/admin/replicas"))
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => Value::Null,
        };
        let replicas = state["replicas"].as_array().cloned().unwrap_or_default();
        if replicas.iter().any(|r| r["id"] == id && ready(r)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[derive(Debug, Default, Clone, Serialize)]
struct DeployPhase {
    phase: String,
    turns: usize,
    /// Share of the phase's turns served by gpu0, gpu1.
    share: [f64; 2],
    warm_ttft_p50_ms: f64,
    warm_ttft_p90_ms: f64,
    errors: usize,
    error_statuses: std::collections::BTreeMap<u16, usize>,
}

#[derive(Debug, Default, Clone, Serialize)]
struct DeployResult {
    variant: String,
    phases: Vec<DeployPhase>,
}

/// Agent loops through a rolling deploy (drain, restart with a slow start, undrain; gpu0 then
/// gpu1): per-replica load and warm-turn TTFT before, during and after.
async fn deploy(
    client: &reqwest::Client,
    a: &Args,
    s: &Sizes,
    spill_margin: usize,
) -> DeployResult {
    let extra = format!("  spill_margin: {spill_margin}\n");
    let mut c = start_cluster(
        client,
        Some("adaptive"),
        a.speed,
        s.cache_tokens,
        &[],
        Some(
            a.out
                .join("logs")
                .join(format!("deploy-spill{spill_margin}.log")),
        ),
        &extra,
    )
    .await;
    let base = c.target();
    let admin = c.lb.as_ref().map(|l| l.1).unwrap_or(0);
    let conversations = s.conversations * 3;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // (seconds since start, replica, ttft ms, warm turn, failed, status)
    let log = Arc::new(std::sync::Mutex::new(Vec::<(
        f64,
        usize,
        f64,
        bool,
        bool,
        u16,
    )>::new()));
    let started = Instant::now();
    let context_tokens = s.context_tokens / 4;
    let loops: Vec<_> = (0..conversations)
        .map(|conv| {
            let (client, base, stop, log) = (client.clone(), base.clone(), stop.clone(), log.clone());
            let (turn_tokens, reply, speed) = (s.turn_tokens / 4, s.reply_tokens, a.speed);
            tokio::spawn(async move {
                let mut messages = vec![json!({"role": "system", "content": filler(&format!("deploy conversation {conv}"), context_tokens)})];
                let mut turn = 0u64;
                while !stop.load(Ordering::Relaxed) && turn < 10_000 {
                    let think = (conv as u64 * 7919 + turn * 104_729) % 1000;
                    tokio::time::sleep(Duration::from_secs_f64(think as f64 / 1000.0 / speed)).await;
                    messages.push(json!({"role": "user", "content": filler(&format!("c{conv} t{turn}"), turn_tokens)}));
                    let t = started.elapsed().as_secs_f64();
                    let o = stream_chat(&client, &base, &messages, reply).await;
                    let replica = usize::from(o.replica.as_deref() == Some("gpu1"));
                    let ms = o.ttft.unwrap_or(o.total).as_secs_f64() * 1e3;
                    if let Ok(mut l) = log.lock() {
                        l.push((t, replica, ms, !o.failed && turn > 0, o.failed, o.status));
                    }
                    if o.failed {
                        messages.pop();
                    } else {
                        messages.push(json!({"role": "assistant", "content": o.reply}));
                    }
                    turn += 1;
                }
            })
        })
        .collect();
    let phase_len = Duration::from_secs_f64(if a.smoke { 1.0 } else { 6.0 });
    tokio::time::sleep(phase_len).await;
    let during_start = started.elapsed().as_secs_f64();
    for i in 0..2 {
        let id = format!("gpu{i}");
        let _ = client
            .post(format!(
                "http://127.0.0.1:{admin}/admin/replicas/{id}/drain"
            ))
            .send()
            .await;
        wait_replica(client, admin, &id, |r| r["in_flight"] == 0).await;
        let port = c.sims[i].0;
        c.stop_sim(i);
        tokio::time::sleep(Duration::from_millis(500)).await;
        c.sims[i].1 = Some(spawn_sim(
            port,
            &id,
            a.speed,
            s.cache_tokens,
            &["--refuse-for", "1", "--unhealthy-for", "1"],
        ));
        let _ = client
            .post(format!(
                "http://127.0.0.1:{admin}/admin/replicas/{id}/undrain"
            ))
            .send()
            .await;
        wait_replica(client, admin, &id, |r| r["live"] == true).await;
    }
    let after_start = started.elapsed().as_secs_f64();
    tokio::time::sleep(phase_len * 2).await;
    let end = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        let _ = l.await;
    }
    let log = log.lock().map(|l| l.clone()).unwrap_or_default();
    let phase = |name: &str, from: f64, to: f64| {
        let rows: Vec<_> = log.iter().filter(|r| r.0 >= from && r.0 < to).collect();
        let n = rows.len().max(1) as f64;
        let warm: Vec<f64> = rows.iter().filter(|r| r.3).map(|r| r.2).collect();
        DeployPhase {
            phase: name.into(),
            turns: rows.len(),
            share: [
                rows.iter().filter(|r| r.1 == 0).count() as f64 / n,
                rows.iter().filter(|r| r.1 == 1).count() as f64 / n,
            ],
            warm_ttft_p50_ms: pct(&warm, 0.5),
            warm_ttft_p90_ms: pct(&warm, 0.9),
            errors: rows.iter().filter(|r| r.4).count(),
            error_statuses: rows.iter().filter(|r| r.4).fold(
                std::collections::BTreeMap::new(),
                |mut m, r| {
                    *m.entry(r.5).or_insert(0) += 1;
                    m
                },
            ),
        }
    };
    // "after" is measured in its second half, once spilling had time to act.
    let settle = (end + after_start) / 2.0;
    DeployResult {
        variant: if spill_margin > 0 {
            format!("adaptive, spill_margin {spill_margin}")
        } else {
            "adaptive, no spill".into()
        },
        phases: vec![
            phase("before", 0.0, during_start),
            phase("during", during_start, after_start),
            phase("after", settle, end + 1.0),
        ],
    }
}

async fn run_target(client: &reqwest::Client, target: &str, a: &Args, s: &Sizes) -> TargetResult {
    let mode = (target != "direct").then_some(target);
    let mut r = TargetResult {
        target: target.into(),
        ..Default::default()
    };
    eprintln!("[{target}] agent loop");
    let logs = a.out.join("logs");
    let _ = std::fs::create_dir_all(&logs);
    let log = |scenario: &str| Some(logs.join(format!("{target}-{scenario}.log")));
    let c = start_cluster(client, mode, a.speed, s.cache_tokens, &[], log("agent"), "").await;
    let before = sim_stats(client, &c).await;
    r.agent = agent_loops(client, &c.target(), s, "a", a.speed).await;
    let after = sim_stats(client, &c).await;
    r.agent_hit_rate = (after.1 - before.1) as f64 / ((after.0 - before.0).max(1)) as f64;
    drop(c);
    eprintln!("[{target}] cold burst");
    let c = start_cluster(client, mode, a.speed, s.cache_tokens, &[], log("burst"), "").await;
    (r.burst_makespan_s, r.burst_errors) = cold_burst(client, &c.target(), s, "b").await;
    drop(c);
    eprintln!("[{target}] mixed");
    let c = start_cluster(client, mode, a.speed, s.cache_tokens, &[], log("mixed"), "").await;
    let base = c.target();
    let (agent, burst) = tokio::join!(agent_loops(client, &base, s, "m", a.speed), async {
        // The burst lands while the loops are under way.
        tokio::time::sleep(Duration::from_secs_f64(3.0 / a.speed)).await;
        cold_burst(client, &base, s, "mb").await
    });
    r.mixed_agent = agent;
    r.mixed_burst_makespan_s = burst.0;
    drop(c);
    eprintln!("[{target}] failover");
    let mut c = start_cluster(
        client,
        mode,
        a.speed,
        s.cache_tokens,
        &[],
        log("failover"),
        "",
    )
    .await;
    r.failover = failover(client, &mut c, s).await;
    r
}

#[derive(Debug, Default, Clone, Serialize)]
struct Latency {
    target: String,
    fixed_rate_rps: f64,
    fixed_p50_ms: f64,
    fixed_p99_ms: f64,
    saturation_rps: f64,
    saturation_p50_ms: f64,
    saturation_p99_ms: f64,
    errors: u64,
    sse_gap_p50_ms: f64,
    sse_gap_p99_ms: f64,
}

async fn small_request(client: &reqwest::Client, base: &str) -> Option<f64> {
    let started = Instant::now();
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1});
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .ok()?;
    if r.status() != 200 {
        return None;
    }
    r.bytes().await.ok()?;
    Some(started.elapsed().as_secs_f64() * 1e3)
}

async fn overhead_target(client: &reqwest::Client, name: &str, base: &str, s: &Sizes) -> Latency {
    let mut l = Latency {
        target: name.into(),
        ..Default::default()
    };
    // Fixed rate: 200 requests/s, open loop.
    let rate = 200.0;
    let n = (rate * s.overhead_seconds) as usize;
    let started = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, base) = (client.clone(), base.to_string());
            let at = started + Duration::from_secs_f64(i as f64 / rate);
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                small_request(&client, &base).await
            })
        })
        .collect();
    let mut lat = vec![];
    for t in tasks {
        match t.await.ok().flatten() {
            Some(ms) => lat.push(ms),
            None => l.errors += 1,
        }
    }
    l.fixed_rate_rps = rate;
    (l.fixed_p50_ms, l.fixed_p99_ms) = (pct(&lat, 0.5), pct(&lat, 0.99));
    // Saturation: 32 closed-loop clients.
    let end = Instant::now() + Duration::from_secs_f64(s.overhead_seconds);
    let sat_started = Instant::now();
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (client, base) = (client.clone(), base.to_string());
            tokio::spawn(async move {
                let mut v = vec![];
                let mut errors = 0;
                while Instant::now() < end && v.len() < 100_000 {
                    match small_request(&client, &base).await {
                        Some(ms) => v.push(ms),
                        None => errors += 1,
                    }
                }
                (v, errors)
            })
        })
        .collect();
    let mut lat = vec![];
    for t in tasks {
        if let Ok((v, e)) = t.await {
            lat.extend(v);
            l.errors += e;
        }
    }
    l.saturation_rps = lat.len() as f64 / sat_started.elapsed().as_secs_f64();
    (l.saturation_p50_ms, l.saturation_p99_ms) = (pct(&lat, 0.5), pct(&lat, 0.99));
    // SSE: gaps between events of streams with a steady 5 ms token interval.
    let mut gaps = vec![];
    for i in 0..10 {
        let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": format!("sse {i}")}], "max_tokens": 60, "stream": true});
        let Ok(r) = client
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
        else {
            continue;
        };
        let mut stream = r.bytes_stream();
        let mut last: Option<Instant> = None;
        while let Some(Ok(_)) = stream.next().await {
            let now = Instant::now();
            if let Some(prev) = last {
                gaps.push((now - prev).as_secs_f64() * 1e3);
            }
            last = Some(now);
        }
    }
    (l.sse_gap_p50_ms, l.sse_gap_p99_ms) = (pct(&gaps, 0.5), pct(&gaps, 0.99));
    l
}

fn nginx_conf(dir: &Path, port: u16, sims: &[u16]) -> PathBuf {
    let servers: String = sims
        .iter()
        .map(|p| format!("    server 127.0.0.1:{p};\n"))
        .collect();
    let d = dir.display();
    let text = format!(
        "worker_processes 2;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log;\nevents {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d};\n  proxy_temp_path {d};\n  fastcgi_temp_path {d};\n  uwsgi_temp_path {d};\n  scgi_temp_path {d};\n\
         \x20 upstream replicas {{\n{servers}    keepalive 64;\n  }}\n\
         \x20 server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://replicas;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, text).expect("nginx conf");
    path
}

async fn overhead(client: &reqwest::Client, s: &Sizes) -> Vec<Latency> {
    // Replicas that answer at once: what is left is the proxy's own cost.
    let c = start_cluster(
        client,
        Some("adaptive"),
        1.0,
        100_000,
        &["--prefill-tokens-per-s", "1e9", "--decode-interval-ms", "5"],
        None,
        "",
    )
    .await;
    let lb = c.target();
    let direct = format!("http://127.0.0.1:{}", c.sims[0].0);
    let mut out = vec![];
    eprintln!("[overhead] direct");
    out.push(overhead_target(client, "direct", &direct, s).await);
    eprintln!("[overhead] inferlb");
    out.push(overhead_target(client, "inferlb", &lb, s).await);
    let nginx_bin = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    if let Some(bin) = nginx_bin {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let conf = nginx_conf(dir.path(), port, &[c.sims[0].0, c.sims[1].0]);
        let nginx = Command::new(bin)
            .args(["-e", "stderr", "-p"])
            .arg(dir.path())
            .arg("-c")
            .arg(&conf)
            .args(["-g", "daemon off;"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        if let Ok(child) = nginx {
            let _nginx = Proc(child);
            if wait_http(client, &format!("http://127.0.0.1:{port}/health")).await {
                eprintln!("[overhead] nginx");
                out.push(
                    overhead_target(client, "nginx", &format!("http://127.0.0.1:{port}"), s).await,
                );
            }
        }
    } else {
        eprintln!("[overhead] nginx not installed: skipped (make deps installs it)");
    }
    out
}

fn table(results: &[TargetResult], lat: &[Latency], s: &Sizes, a: &Args) -> String {
    let mut md = String::new();
    if !results.is_empty() {
        md.push_str(&format!(
            "Simulated replicas: 2; context {} tokens; {} conversations x {} turns (+{} tokens a turn); burst {}; cache {} tokens a replica; speed x{}.\n\n",
            s.context_tokens, s.conversations, s.turns, s.turn_tokens, s.burst, s.cache_tokens, a.speed
        ));
        md.push_str(&targets_table(results));
    }
    md.push_str(&overhead_table(lat));
    md
}

fn targets_table(results: &[TargetResult]) -> String {
    let mut md = String::new();
    md.push_str("| target | warm-turn TTFT p50 (ms) | p90 (ms) | prefix-cache hit rate | burst makespan (s) | mixed: warm TTFT p50 (ms) | mixed: burst makespan (s) | failover: requests | errors before streaming | streams cut | failovers counted |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in results {
        md.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.1}% | {:.2} | {:.0} | {:.2} | {} | {} | {} | {} |\n",
            r.target,
            pct(&r.agent.warm_ttft_ms, 0.5),
            pct(&r.agent.warm_ttft_ms, 0.9),
            r.agent_hit_rate * 100.0,
            r.burst_makespan_s,
            pct(&r.mixed_agent.warm_ttft_ms, 0.5),
            r.mixed_burst_makespan_s,
            r.failover.requests,
            r.failover.errors_before_streaming,
            r.failover.streams_cut,
            r.failover.failovers,
        ));
    }
    let get = |t: &str| results.iter().find(|r| r.target == t);
    if let (Some(ad), Some(af), Some(rr)) = (get("adaptive"), get("affinity"), get("roundrobin")) {
        let (a50, f50, r50) = (
            pct(&ad.agent.warm_ttft_ms, 0.5),
            pct(&af.agent.warm_ttft_ms, 0.5),
            pct(&rr.agent.warm_ttft_ms, 0.5),
        );
        md.push_str(&format!(
            "\nRatios (same run): adaptive/affinity warm TTFT = {:.3} (target <= 1.05); adaptive/roundrobin warm TTFT = {:.3} (target < 0.5); adaptive/roundrobin burst makespan = {:.3} (target <= 1.03); adaptive/affinity burst makespan = {:.3}.\n",
            a50 / f50, a50 / r50, ad.burst_makespan_s / rr.burst_makespan_s, ad.burst_makespan_s / af.burst_makespan_s
        ));
    }
    md
}

fn overhead_table(lat: &[Latency]) -> String {
    let mut md = String::new();
    if !lat.is_empty() {
        md.push_str("\nProxy overhead (replicas answer at once; 200 req/s open loop, then 32 closed-loop clients; SSE at a 5 ms token interval):\n\n");
        md.push_str("| target | p50 at 200 rps (ms) | p99 at 200 rps (ms) | saturation (req/s) | p50 at saturation (ms) | p99 at saturation (ms) | errors | SSE gap p50 (ms) | SSE gap p99 (ms) |\n|---|---|---|---|---|---|---|---|---|\n");
        for l in lat {
            md.push_str(&format!(
                "| {} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {} | {:.2} | {:.2} |\n",
                l.target,
                l.fixed_p50_ms,
                l.fixed_p99_ms,
                l.saturation_rps,
                l.saturation_p50_ms,
                l.saturation_p99_ms,
                l.errors,
                l.sse_gap_p50_ms,
                l.sse_gap_p99_ms
            ));
        }
        if let (Some(d), Some(i)) = (
            lat.iter().find(|l| l.target == "direct"),
            lat.iter().find(|l| l.target == "inferlb"),
        ) {
            md.push_str(&format!(
                "\ninferlb adds {:.2} ms at p50 and {:.2} ms at p99 at 200 rps; saturation throughput inferlb/direct = {:.2}.\n",
                i.fixed_p50_ms - d.fixed_p50_ms, i.fixed_p99_ms - d.fixed_p99_ms, i.saturation_rps / d.saturation_rps
            ));
        }
    }
    md
}

fn deploy_table(deploys: &[DeployResult], s: &Sizes) -> String {
    if deploys.is_empty() {
        return String::new();
    }
    let mut md = format!(
        "\nRolling deploy ({} agent loops on {}-token contexts; gpu0 then gpu1 drained, restarted with a slow start, undrained; 'after' is the second half of the period after the deploy):\n\n",
        s.conversations * 3,
        s.context_tokens / 4
    );
    md.push_str("| variant | phase | turns | gpu0 share | gpu1 share | warm TTFT p50 (ms) | p90 (ms) | errors |\n|---|---|---|---|---|---|---|---|\n");
    for d in deploys {
        for p in &d.phases {
            md.push_str(&format!(
                "| {} | {} | {} | {:.0}% | {:.0}% | {:.0} | {:.0} | {} |\n",
                d.variant,
                p.phase,
                p.turns,
                p.share[0] * 100.0,
                p.share[1] * 100.0,
                p.warm_ttft_p50_ms,
                p.warm_ttft_p90_ms,
                p.errors
            ));
        }
    }
    md
}

/// TTFT distributions per target as an SVG (and a PNG when rsvg-convert is installed).
fn plot(results: &[TargetResult], out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let svg = out.join("ttft.svg");
    {
        let root = SVGBackend::new(&svg, (900, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let max = results
            .iter()
            .flat_map(|r| r.agent.warm_ttft_ms.iter().copied())
            .fold(1.0f64, f64::max)
            * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Warm-turn time to first token, CDF per routing target",
                ("sans-serif", 22),
            )
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..max, 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc("TTFT (ms)")
            .y_desc("fraction of turns")
            .draw()?;
        let colors = [RED, BLUE, GREEN, BLACK, MAGENTA];
        for (i, r) in results.iter().enumerate() {
            let mut v = r.agent.warm_ttft_ms.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            let n = v.len().max(1) as f64;
            let color = colors[i % colors.len()];
            chart
                .draw_series(LineSeries::new(
                    v.iter().enumerate().map(|(k, x)| (*x, (k + 1) as f64 / n)),
                    color.stroke_width(2),
                ))?
                .label(r.target.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
        root.present()?;
    }
    let png = out.join("ttft.png");
    let converted = Command::new("rsvg-convert")
        .arg("-o")
        .arg(&png)
        .arg(&svg)
        .status();
    if !converted.is_ok_and(|s| s.success()) {
        eprintln!("rsvg-convert not available: the plot is {}", svg.display());
    }
    Ok(())
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
        let naive = deploy(&client, &a, &s, 0).await;
        eprintln!("[deploy] with spilling");
        let spill = deploy(&client, &a, &s, 4).await;
        vec![naive, spill]
    };
    let soaked = if a.soak_seconds > 0.0 {
        let (n, secs) = if a.smoke {
            (50, 2.0)
        } else {
            (1000, a.soak_seconds)
        };
        eprintln!("[soak] {n} connections for {secs} s");
        Some(soak(&a, n, secs).await)
    } else {
        None
    };
    let lat = if a.no_overhead {
        vec![]
    } else {
        overhead(&client, &s).await
    };
    let mut md = table(&results, &lat, &s, &a);
    md.push_str(&deploy_table(&deploys, &s));
    if let Some(k) = &soaked {
        md.push_str(&format!(
            "\nSoak: {} concurrent connections for {:.0} s (half streams of 25 tokens, half small requests): {} requests, {} errors; inferlb RSS {} KiB after warm-up, {} KiB at the end (every tenth of the run: {:?}); file descriptors {} after warm-up, {} under load, {} once the clients left.\n",
            k.connections, k.seconds, k.requests, k.errors, k.rss_start_kib, k.rss_end_kib, k.rss_series_kib, k.fds_start, k.fds_under_load, k.fds_after
        ));
    }
    let command = format!(
        "inferlb-bench {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    let report = format!("Command: `{}`\n\n{md}", command.trim());
    std::fs::write(a.out.join("results.md"), &report).expect("write results.md");
    let raw = json!({"command": command.trim(), "sizes": s, "targets": results, "overhead": lat, "deploy": deploys, "soak": soaked});
    std::fs::write(
        a.out.join("results.json"),
        serde_json::to_vec_pretty(&raw).unwrap_or_default(),
    )
    .expect("write results.json");
    if let Err(e) = plot(&results, &a.out) {
        eprintln!("plot failed: {e}");
    }
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
