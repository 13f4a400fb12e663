//! The proxy's own cost: replicas that answer at once, reached directly, through inferlb and
//! through nginx, with the access log off on both proxies and on on both, in rounds whose order
//! rotates (no target is always first or last). Each cell is the median of the rounds with
//! their range, so a figure is one a rerun reproduces.
//!
//! Beside latency and throughput, which move with whatever else shares a 2-core machine, each
//! round reads the CPU time the answering process spent (user+system from /proc: the replica
//! for direct, inferlb, nginx's master and workers) while a fixed open-loop rate of small
//! requests passed through it: CPU per request, which moves much less.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use inferlb_harness::{
    free_port, http_status, wait_until, Lb, LbConf, Nginx, Proc, Replica, Signal, Sim,
};
use serde::Serialize;
use serde_json::json;

use crate::client::{pct, small_request};
use crate::cluster::sim_caps;
use crate::procfs;
use crate::Sizes;

/// One target, one round.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Latency {
    pub target: String,
    pub fixed_rate_rps: f64,
    pub fixed_p50_ms: f64,
    pub fixed_p99_ms: f64,
    pub saturation_rps: f64,
    pub saturation_p50_ms: f64,
    pub saturation_p99_ms: f64,
    pub errors: u64,
    pub sse_gap_p50_ms: f64,
    pub sse_gap_p99_ms: f64,
}

/// What a set of clients measured.
#[derive(Default)]
struct ClientRun {
    latencies_ms: Vec<f64>,
    errors: u64,
}

impl ClientRun {
    fn add(&mut self, other: ClientRun) {
        self.latencies_ms.extend(other.latencies_ms);
        self.errors += other.errors;
    }
}

/// Small requests sent at `rate` a second for `seconds`, open loop: each leaves at its time
/// whether or not the ones before it were answered.
async fn open_loop(client: &reqwest::Client, base: &str, rate: f64, seconds: f64) -> ClientRun {
    open_loop_bounded(client, base, rate, seconds, None).await
}

/// [`open_loop`] with at most `most` requests outstanding (None: no bound): a request whose
/// time comes while `most` are waits for one to end, and its latency counts that wait. A rate
/// past what the server can take then shows as latency, not as the client's (or the server's)
/// descriptors running out.
async fn open_loop_bounded(
    client: &reqwest::Client,
    base: &str,
    rate: f64,
    seconds: f64,
    most: Option<usize>,
) -> ClientRun {
    let n = (rate * seconds) as usize;
    let started = Instant::now();
    let slots = most.map(|m| Arc::new(tokio::sync::Semaphore::new(m)));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, base, slots) = (client.clone(), base.to_string(), slots.clone());
            let at = started + Duration::from_secs_f64(i as f64 / rate);
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                let woke = Instant::now();
                let _slot = match slots {
                    Some(slots) => Some(slots.acquire_owned().await.ok()?),
                    None => None,
                };
                let waited = woke.elapsed().as_secs_f64() * 1e3;
                Some(waited + small_request(&client, &base).await?)
            })
        })
        .collect();
    let mut run = ClientRun::default();
    for t in tasks {
        match t.await.ok().flatten() {
            Some(ms) => run.latencies_ms.push(ms),
            None => run.errors += 1,
        }
    }
    run
}

/// `inferlb-bench --drive`: [`open_loop`] against `base` at `rate`, or when `rate` is 0,
/// [`saturation`]; what it measured, in a line.
pub async fn drive(client: &reqwest::Client, base: &str, rate: f64, seconds: f64) -> String {
    let (run, how) = if rate > 0.0 {
        let run = open_loop(client, base, rate, seconds).await;
        (run, format!("at {rate} req/s"))
    } else {
        let (rps, run) = saturation(client, base, seconds).await;
        (run, format!("from 32 closed-loop clients ({rps:.0} req/s)"))
    };
    let l = &run.latencies_ms;
    format!(
        "{} requests {how} for {seconds} s: p50 {:.2} ms, p99 {:.2} ms, {} errors",
        l.len(),
        pct(l, 0.5),
        pct(l, 0.99),
        run.errors
    )
}

/// 32 closed-loop clients for `seconds`: requests a second, and what they measured.
async fn saturation(client: &reqwest::Client, base: &str, seconds: f64) -> (f64, ClientRun) {
    let started = Instant::now();
    let end = started + Duration::from_secs_f64(seconds);
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (client, base) = (client.clone(), base.to_string());
            tokio::spawn(async move {
                let mut run = ClientRun::default();
                while Instant::now() < end && run.latencies_ms.len() < 100_000 {
                    match small_request(&client, &base).await {
                        Some(ms) => run.latencies_ms.push(ms),
                        None => run.errors += 1,
                    }
                }
                run
            })
        })
        .collect();
    let mut all = ClientRun::default();
    for t in tasks {
        if let Ok(run) = t.await {
            all.add(run);
        }
    }
    let rps = all.latencies_ms.len() as f64 / started.elapsed().as_secs_f64();
    (rps, all)
}

/// Gaps between the events of `streams` streams with a steady 5 ms token interval, ms.
async fn sse_gaps(client: &reqwest::Client, base: &str, streams: usize) -> Vec<f64> {
    let mut gaps = vec![];
    for i in 0..streams {
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
    gaps
}

/// Fixed rate (200 requests/s, open loop), saturation and SSE pacing against `base`.
pub(crate) async fn overhead_target(
    client: &reqwest::Client,
    name: &str,
    base: &str,
    s: &Sizes,
) -> Latency {
    let rate = 200.0;
    let fixed = open_loop(client, base, rate, s.overhead_seconds).await;
    let (saturation_rps, sat) = saturation(client, base, s.overhead_seconds).await;
    let gaps = sse_gaps(client, base, s.overhead_sse_streams).await;
    Latency {
        target: name.into(),
        fixed_rate_rps: rate,
        fixed_p50_ms: pct(&fixed.latencies_ms, 0.5),
        fixed_p99_ms: pct(&fixed.latencies_ms, 0.99),
        saturation_rps,
        saturation_p50_ms: pct(&sat.latencies_ms, 0.5),
        saturation_p99_ms: pct(&sat.latencies_ms, 0.99),
        errors: fixed.errors + sat.errors,
        sse_gap_p50_ms: pct(&gaps, 0.5),
        sse_gap_p99_ms: pct(&gaps, 0.99),
    }
}

/// 64 requests, 32 at a time: the pool holds warm connections before a measurement starts.
pub(crate) async fn warm_up(client: &reqwest::Client, base: &str) {
    for _ in 0..2 {
        let batch = (0..32).map(|_| small_request(client, base));
        futures::future::join_all(batch).await;
    }
}

/// CPU time `pids` spent per request, µs, while `rate` small requests a second went to `base`
/// for `seconds`, open loop (NaN when a request failed or nothing was counted).
async fn cpu_at_rate(
    client: &reqwest::Client,
    base: &str,
    pids: &[u32],
    rate: f64,
    seconds: f64,
) -> f64 {
    let before = procfs::cpu_seconds(pids);
    let run = open_loop(client, base, rate, seconds).await;
    let spent = procfs::cpu_seconds(pids) - before;
    if run.errors > 0 || spent <= 0.0 || run.latencies_ms.is_empty() {
        return f64::NAN;
    }
    spent * 1e6 / run.latencies_ms.len() as f64
}

/// `requests` small requests from 32 closed-loop clients: the CPU time `pids` spent, µs a
/// request (NaN when a request failed or nothing was counted).
pub(crate) async fn cpu_per_request(
    client: &reqwest::Client,
    base: &str,
    pids: &[u32],
    requests: usize,
) -> f64 {
    let before = procfs::cpu_seconds(pids);
    let left = Arc::new(AtomicUsize::new(requests));
    let clients = (0..32).map(|_| {
        let left = left.clone();
        async move {
            let mut failed = 0;
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
            {
                if small_request(client, base).await.is_none() {
                    failed += 1;
                }
            }
            failed
        }
    });
    let failed: usize = futures::future::join_all(clients).await.into_iter().sum();
    let spent = procfs::cpu_seconds(pids) - before;
    if failed > 0 || spent <= 0.0 {
        return f64::NAN;
    }
    spent * 1e6 / requests as f64
}

/// One metric over the rounds.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// NaN everywhere when no round measured it.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return Spread {
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        Spread {
            median: pct(&v, 0.5),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    /// `median (min–max)`, or the value alone when there was one round.
    pub fn cell(&self, decimals: usize) -> String {
        if self.min == self.max || self.median.is_nan() {
            format!("{:.decimals$}", self.median)
        } else {
            format!(
                "{:.decimals$} ({:.decimals$}–{:.decimals$})",
                self.median, self.min, self.max
            )
        }
    }

    /// Each round's `f(a, b)`, for two per-round series measured in the same rounds.
    pub fn zip(a: &[f64], b: &[f64], f: impl Fn(f64, f64) -> f64) -> Spread {
        Spread::of(a.iter().zip(b).map(|(x, y)| f(*x, *y)))
    }

    /// Each round's `f(a, b)`, for two rows measured in the same rounds.
    pub fn paired(a: &Row, b: &Row, f: impl Fn(&Latency, &Latency) -> f64) -> Spread {
        Spread::of(a.rounds.iter().zip(&b.rounds).map(|(x, y)| f(x, y)))
    }
}

/// One target over every round.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Row {
    /// direct | inferlb | nginx
    pub target: String,
    /// How it was reached or set up: `http` | `https` over TLS; `logs off` | `logs on` here.
    pub variant: String,
    /// Each round's measurement.
    pub rounds: Vec<Latency>,
    pub fixed_p50_ms: Spread,
    pub fixed_p99_ms: Spread,
    pub saturation_rps: Spread,
    pub saturation_p50_ms: Spread,
    pub saturation_p99_ms: Spread,
    pub sse_gap_p50_ms: Spread,
    pub sse_gap_p99_ms: Spread,
    /// CPU time of the answering process(es) per request, µs, each round.
    pub cpu_us_rounds: Vec<f64>,
    pub cpu_us_per_request: Spread,
    /// A 400 KB chat prompt, one at a time: each round's p50 and p90, ms (plain pass only).
    pub big_p50_rounds: Vec<f64>,
    pub big_p90_rounds: Vec<f64>,
    pub big_prompt_p50_ms: Spread,
    pub big_prompt_p90_ms: Spread,
    /// Small requests open loop at 80% of nginx's saturation rate: each round's p50 and p99, ms
    /// (plain pass only).
    pub busy_p50_rounds: Vec<f64>,
    pub busy_p99_rounds: Vec<f64>,
    /// Large prompts and busy-phase requests that failed, over every round.
    pub later_errors: u64,
    pub busy_p50_ms: Spread,
    pub busy_p99_ms: Spread,
    /// Over every round.
    pub errors: u64,
}

impl Row {
    pub fn new(target: &str, variant: &str) -> Row {
        Row {
            target: target.into(),
            variant: variant.into(),
            ..Row::default()
        }
    }

    pub fn summarize(&mut self) {
        let r = &self.rounds;
        self.fixed_p50_ms = Spread::of(r.iter().map(|l| l.fixed_p50_ms));
        self.fixed_p99_ms = Spread::of(r.iter().map(|l| l.fixed_p99_ms));
        self.saturation_rps = Spread::of(r.iter().map(|l| l.saturation_rps));
        self.saturation_p50_ms = Spread::of(r.iter().map(|l| l.saturation_p50_ms));
        self.saturation_p99_ms = Spread::of(r.iter().map(|l| l.saturation_p99_ms));
        self.sse_gap_p50_ms = Spread::of(r.iter().map(|l| l.sse_gap_p50_ms));
        self.sse_gap_p99_ms = Spread::of(r.iter().map(|l| l.sse_gap_p99_ms));
        self.cpu_us_per_request = Spread::of(self.cpu_us_rounds.iter().copied());
        self.big_prompt_p50_ms = Spread::of(self.big_p50_rounds.iter().copied());
        self.big_prompt_p90_ms = Spread::of(self.big_p90_rounds.iter().copied());
        self.busy_p50_ms = Spread::of(self.busy_p50_rounds.iter().copied());
        self.busy_p99_ms = Spread::of(self.busy_p99_rounds.iter().copied());
        self.errors = r.iter().map(|l| l.errors).sum::<u64>() + self.later_errors;
    }

    /// Whether a round failed to measure it, or a request failed.
    pub fn broken(&self) -> bool {
        self.fixed_p50_ms.median.is_nan()
            || self.cpu_us_per_request.median.is_nan()
            || self.errors > 0
    }

    /// The table's cells after target and variant.
    pub fn cells(&self) -> String {
        format!(
            "{} | {} | {} | {} | {} | {} | {} | {} | {}",
            self.fixed_p50_ms.cell(2),
            self.fixed_p99_ms.cell(2),
            self.saturation_rps.cell(0),
            self.saturation_p50_ms.cell(2),
            self.saturation_p99_ms.cell(2),
            self.sse_gap_p50_ms.cell(2),
            self.sse_gap_p99_ms.cell(2),
            self.cpu_us_per_request.cell(1),
            self.errors
        )
    }
}

/// The markdown table of `rows`, the variant's column headed `variant`.
pub fn rows_table(rows: &[Row], variant: &str) -> String {
    let mut md = format!("| target | {variant} | p50 at 200 rps (ms) | p99 at 200 rps (ms) | saturation (req/s) | p50 at saturation (ms) | p99 at saturation (ms) | SSE gap p50 (ms) | SSE gap p99 (ms) | server CPU per request (µs) | errors |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for row in rows {
        md.push_str(&format!(
            "| {} | {} | {} |\n",
            row.target,
            row.variant,
            row.cells()
        ));
    }
    md
}

/// How the cells of a table over `rounds` rounds were made.
pub fn rounds_note(rounds: usize) -> String {
    if rounds == 1 {
        "1 round".to_string()
    } else {
        format!("{rounds} rounds in rotating order, each cell the median (min–max) of the rounds")
    }
}

/// Everything the plain pass measured.
#[derive(Debug, Default, Clone, Serialize)]
pub struct OverheadResult {
    pub rows: Vec<Row>,
    pub rounds: usize,
    /// Seconds of each phase (fixed rate, saturation).
    pub seconds: f64,
    /// The open-loop rate and duration of each CPU measurement.
    pub cpu_rate_rps: f64,
    pub cpu_seconds: f64,
    /// The large prompt's size (bytes) and how many were sent a round to each target.
    pub big_prompt_bytes: usize,
    pub big_prompts: usize,
    /// 80% of nginx's (logs off) median saturation rate, the rate of the busy phase (0: not run).
    pub busy_rate_rps: f64,
    /// Targets that could not be measured, and why.
    pub skipped: Vec<String>,
}

/// Two replicas (gpu0, gpu1) in `dir` that answer at once, healthy: what is left is the
/// proxy's own cost. Blocks.
pub(crate) fn instant_replicas(dir: &std::path::Path) -> Vec<Sim> {
    let flags = [
        "--speed",
        "1",
        "--cache-tokens",
        "100000",
        "--prefill-tokens-per-s",
        "1e9",
        "--decode-interval-ms",
        "5",
    ];
    let sims: Vec<Sim> = (0..2)
        .map(|i| Sim::spawn(dir, &format!("gpu{i}"), &flags))
        .collect();
    for sim in &sims {
        sim.assert_healthy();
    }
    sims
}

/// inferlb's conf in front of `sims`, as the bench's clusters run it (adaptive).
pub(crate) fn lb_conf(sims: &[Sim]) -> LbConf {
    let learnt = sim_caps().cache_config_info;
    LbConf {
        threads: Some(2),
        max_retries: Some(4),
        routing: Some("adaptive".into()),
        health_interval_seconds: Some(0.5),
        load_poll_interval_seconds: Some(0.25),
        replicas: sims
            .iter()
            .map(|sim| Replica {
                cache_tokens: (!learnt).then_some(100_000),
                ..Replica::of(sim)
            })
            .collect(),
        ..LbConf::default()
    }
}

/// `pingora-floor` (built beside this binary) in front of `upstreams`: Pingora with none of
/// inferlb's work, the floor under inferlb's cost.
struct PingoraFloor {
    port: u16,
    proc: Proc,
}

impl PingoraFloor {
    fn start(dir: &std::path::Path, upstreams: &[u16]) -> Result<PingoraFloor, String> {
        let bin = std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("pingora-floor");
        if !bin.exists() {
            return Err(format!("{} not built", bin.display()));
        }
        let port = free_port();
        let mut cmd = std::process::Command::new(&bin);
        cmd.arg(port.to_string())
            .args(upstreams.iter().map(u16::to_string));
        let log = dir.join("stderr.log");
        let proc = Proc::spawn("pingora-floor", cmd, Some(&log), Signal::SIGTERM)
            .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
        let up = wait_until(Duration::from_secs(10), || {
            http_status(port, "/health", Duration::from_secs(1)) == Some(200)
        });
        if !up {
            return Err(format!("no answer on :{port} within 10 s"));
        }
        Ok(PingoraFloor { port, proc })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// A chat request whose one user message makes the body `bytes` long (give or take a few).
fn big_prompt_body(bytes: usize) -> bytes::Bytes {
    let words = bytes.saturating_sub(80) / 5;
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "word ".repeat(words)}], "max_tokens": 1});
    serde_json::to_vec(&body).expect("a JSON body").into()
}

/// `n` large prompts sent one at a time after two unmeasured ones: each one's latency, ms (to
/// the end of the answer); a failed one is left out and counted.
async fn big_prompts(
    client: &reqwest::Client,
    base: &str,
    body: &bytes::Bytes,
    n: usize,
) -> (Vec<f64>, u64) {
    let (mut ms, mut failed) = (vec![], 0);
    for i in 0..n + 2 {
        let started = Instant::now();
        let r = client
            .post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await;
        let ok = match r {
            Ok(r) if r.status() == 200 => r.bytes().await.is_ok(),
            _ => false,
        };
        match (ok, i >= 2) {
            (true, true) => ms.push(started.elapsed().as_secs_f64() * 1e3),
            (false, _) => failed += 1,
            (true, false) => {}
        }
    }
    (ms, failed)
}

/// The open-loop rate of the CPU measurement: well under either proxy's saturation here.
const CPU_RATE: f64 = 2_000.0;

/// Requests outstanding at most in the busy phase: a balancer's clients are not unbounded, and
/// the client keeps this many connections alive (`pool_max_idle_per_host` is 256): more would
/// open and close connections until the loopback's ephemeral ports ran out (TIME_WAIT).
const BUSY_MOST_OUTSTANDING: usize = 128;

/// The large prompt's body: a long agent conversation's size.
const BIG_PROMPT_BYTES: usize = 400 * 1024;

/// Direct, inferlb and (when installed) nginx against the same two replicas, with access logs
/// off on both proxies, then on on both (to a file): `rounds` rounds (1 when `smoke`).
pub async fn overhead(
    client: &reqwest::Client,
    s: &Sizes,
    rounds: usize,
    smoke: bool,
) -> OverheadResult {
    let rounds = if smoke { 1 } else { rounds.max(1) };
    let cpu_seconds = if smoke { 0.5 } else { 4.0 };
    let mut out = OverheadResult {
        rounds,
        seconds: s.overhead_seconds,
        cpu_rate_rps: CPU_RATE,
        cpu_seconds,
        ..OverheadResult::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).expect("a scenario directory");
        d
    };
    let sims_dir = sub("sims");
    let sims = tokio::task::block_in_place(|| instant_replicas(&sims_dir));
    // inferlb as the bench's clusters run it; its access log goes to its stderr, a file.
    let start_lb = |logs: bool| {
        let conf = lb_conf(&sims);
        let d = sub(if logs { "lb-logs" } else { "lb" });
        let (log, rust_log) = if logs {
            (Some(d.join("inferlb.log")), "warn,access=info")
        } else {
            (None, "warn")
        };
        tokio::task::block_in_place(|| Lb::start_logged(&d, &[], conf, log.as_deref(), rust_log))
    };
    let lbs = [start_lb(false), start_lb(true)];
    let upstreams: Vec<u16> = sims.iter().map(|sim| sim.port).collect();
    let nginxes: Vec<Nginx> = match Nginx::find() {
        None => {
            out.skipped
                .push("nginx: not installed (make deps installs it)".into());
            vec![]
        }
        Some(bin) => [false, true]
            .into_iter()
            .filter_map(|logs| {
                let d = sub(if logs { "nginx-logs" } else { "nginx" });
                match tokio::task::block_in_place(|| {
                    Nginx::start_logged(&bin, &d, &upstreams, logs)
                }) {
                    Ok(n) => Some(n),
                    Err(e) => {
                        out.skipped.push(format!("nginx: {e}"));
                        None
                    }
                }
            })
            .collect(),
    };
    let floor_dir = sub("pingora-floor");
    let floor = match tokio::task::block_in_place(|| PingoraFloor::start(&floor_dir, &upstreams)) {
        Ok(f) => Some(f),
        Err(e) => {
            out.skipped.push(format!("Pingora alone: {e}"));
            None
        }
    };
    for s in &out.skipped {
        eprintln!("[overhead] {s}: skipped");
    }

    // (row, base URL, the answering processes)
    let mut targets: Vec<(Row, String, Vec<u32>)> = vec![];
    let sim_pid = sims[0].proc().map(|p| p.pid()).into_iter().collect();
    targets.push((Row::new("direct", "-"), sims[0].url(""), sim_pid));
    for (lb, logs) in lbs.iter().zip(["logs off", "logs on"]) {
        targets.push((Row::new("inferlb", logs), lb.url(""), vec![lb.proc.pid()]));
    }
    for n in &nginxes {
        let logs = if n.access_log.is_some() {
            "logs on"
        } else {
            "logs off"
        };
        let pids = tokio::task::block_in_place(|| procfs::with_children(n.pid()));
        targets.push((Row::new("nginx", logs), n.url(), pids));
    }
    if let Some(f) = &floor {
        targets.push((Row::new("Pingora alone", "-"), f.url(), vec![f.proc.pid()]));
    }
    out.big_prompt_bytes = BIG_PROMPT_BYTES;
    out.big_prompts = if smoke { 3 } else { 30 };
    let big_body = big_prompt_body(BIG_PROMPT_BYTES);
    let n = targets.len();
    for round in 0..rounds {
        for k in 0..n {
            let (row, base, pids) = &mut targets[(round + k) % n];
            eprintln!(
                "[overhead] round {}/{rounds}: {} ({})",
                round + 1,
                row.target,
                row.variant
            );
            warm_up(client, base).await;
            let name = format!("{} ({})", row.target, row.variant);
            row.rounds
                .push(overhead_target(client, &name, base, s).await);
            let cpu = cpu_at_rate(client, base, pids, CPU_RATE, cpu_seconds).await;
            row.cpu_us_rounds.push(cpu);
            let (big, failed) = big_prompts(client, base, &big_body, out.big_prompts).await;
            row.big_p50_rounds.push(pct(&big, 0.5));
            row.big_p90_rounds.push(pct(&big, 0.9));
            row.later_errors += failed;
        }
    }
    // Small requests at 80% of nginx's saturation rate (access log off): queueing shows at p99
    // in a proxy that is nearer its own limit at that rate.
    let nginx_sat = targets
        .iter()
        .find(|(row, _, _)| row.target == "nginx" && row.variant == "logs off")
        .map(|(row, _, _)| Spread::of(row.rounds.iter().map(|l| l.saturation_rps)).median);
    if let Some(sat) = nginx_sat.filter(|r| r.is_finite() && *r > 0.0) {
        out.busy_rate_rps = (0.8 * sat).round();
        for round in 0..rounds {
            for k in 0..n {
                let (row, base, _) = &mut targets[(round + k) % n];
                eprintln!(
                    "[overhead] round {}/{rounds}, {} req/s: {} ({})",
                    round + 1,
                    out.busy_rate_rps,
                    row.target,
                    row.variant
                );
                warm_up(client, base).await;
                let run = open_loop_bounded(
                    client,
                    base,
                    out.busy_rate_rps,
                    s.overhead_seconds,
                    Some(BUSY_MOST_OUTSTANDING),
                )
                .await;
                row.busy_p50_rounds.push(pct(&run.latencies_ms, 0.5));
                row.busy_p99_rounds.push(pct(&run.latencies_ms, 0.99));
                row.later_errors += run.errors;
            }
        }
    }
    out.rows = targets
        .into_iter()
        .map(|(mut row, _, _)| {
            row.summarize();
            row
        })
        .collect();
    // Stopped before their directory goes: the proxies, then the replicas.
    drop(nginxes);
    drop(floor);
    drop(lbs);
    drop(sims);
    out
}

/// The markdown table, with inferlb's cost against direct and nginx (each round's difference
/// or ratio, the median and range over the rounds) under it.
pub fn table(r: &OverheadResult) -> String {
    if r.rows.is_empty() {
        return String::new();
    }
    let mut md = format!(
        "\nProxy overhead (replicas answer at once; {} s at 200 req/s open loop, then {} s of 32 closed-loop clients; SSE at a 5 ms token interval; server CPU: user+system time of the answering process (the replica for direct, inferlb, nginx's master and workers) per request over {} s at {} req/s open loop; access logs off on both proxies, then on on both, to a file; {}):\n\n",
        r.seconds,
        r.seconds,
        r.cpu_seconds,
        r.cpu_rate_rps,
        rounds_note(r.rounds)
    );
    md.push_str(&rows_table(&r.rows, "access log"));
    let find = |t: &str, v: &str| r.rows.iter().find(|x| x.target == t && x.variant == v);
    for logs in ["logs off", "logs on"] {
        let (Some(i), Some(d)) = (find("inferlb", logs), find("direct", "-")) else {
            continue;
        };
        md.push_str(&format!(
            "\ninferlb ({logs}) adds {} ms at p50 and {} ms at p99 at 200 rps over direct; saturation throughput inferlb/direct = {}",
            Spread::paired(i, d, |a, b| a.fixed_p50_ms - b.fixed_p50_ms).cell(2),
            Spread::paired(i, d, |a, b| a.fixed_p99_ms - b.fixed_p99_ms).cell(2),
            Spread::paired(i, d, |a, b| a.saturation_rps / b.saturation_rps).cell(2),
        ));
        if let Some(x) = find("nginx", logs) {
            let cpu = Spread::zip(&i.cpu_us_rounds, &x.cpu_us_rounds, |a, b| a / b);
            md.push_str(&format!(
                ", inferlb/nginx = {}; CPU per request inferlb/nginx = {}",
                Spread::paired(i, x, |a, b| a.saturation_rps / b.saturation_rps).cell(2),
                cpu.cell(2),
            ));
        }
        md.push_str(".\n");
    }
    md.push_str(&format!(
        "\nA {} KB chat prompt, {} one at a time a round (to the end of the answer), and small requests open loop at {} req/s, 80% of nginx's saturation rate (logs off), for {} s a round, at most {BUSY_MOST_OUTSTANDING} outstanding (a request waiting for one of them counts its wait):\n\n| target | access log | 400 KB prompt p50 (ms) | 400 KB prompt p90 (ms) | p50 at {} req/s (ms) | p99 at {} req/s (ms) |\n|---|---|---|---|---|---|\n",
        r.big_prompt_bytes / 1024,
        r.big_prompts,
        r.busy_rate_rps,
        r.seconds,
        r.busy_rate_rps,
        r.busy_rate_rps,
    ));
    for row in &r.rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            row.target,
            row.variant,
            row.big_prompt_p50_ms.cell(2),
            row.big_prompt_p90_ms.cell(2),
            row.busy_p50_ms.cell(2),
            row.busy_p99_ms.cell(2),
        ));
    }
    let paired = |a: &[f64], b: &[f64], f: fn(f64, f64) -> f64| Spread::zip(a, b, f).cell(2);
    for logs in ["logs off", "logs on"] {
        let (Some(i), Some(d)) = (find("inferlb", logs), find("direct", "-")) else {
            continue;
        };
        md.push_str(&format!(
            "\ninferlb ({logs}): the 400 KB prompt adds {} ms at p50 over direct",
            paired(&i.big_p50_rounds, &d.big_p50_rounds, |a, b| a - b)
        ));
        if let Some(x) = find("nginx", logs) {
            md.push_str(&format!(
                " ({} ms through nginx); p99 at {} req/s inferlb/nginx = {}",
                paired(&x.big_p50_rounds, &d.big_p50_rounds, |a, b| a - b),
                r.busy_rate_rps,
                paired(&i.busy_p99_rounds, &x.busy_p99_rounds, |a, b| a / b),
            ));
        }
        md.push_str(".\n");
    }
    if let (Some(f), Some(i), Some(x)) = (
        find("Pingora alone", "-"),
        find("inferlb", "logs off"),
        find("nginx", "logs off"),
    ) {
        let cpu = |a: &Row, b: &Row| {
            Spread::zip(&a.cpu_us_rounds, &b.cpu_us_rounds, |p, q| p / q).cell(2)
        };
        md.push_str(&format!(
            "\nPingora alone (no hooks, no body read, no metrics, no log) against nginx (logs off): CPU per request {}, saturation {}; inferlb (logs off) against Pingora alone: CPU per request {}, saturation {}.\n",
            cpu(f, x),
            Spread::paired(f, x, |a, b| a.saturation_rps / b.saturation_rps).cell(2),
            cpu(i, f),
            Spread::paired(i, f, |a, b| a.saturation_rps / b.saturation_rps).cell(2),
        ));
    }
    for s in &r.skipped {
        md.push_str(&format!("\nSkipped: {s}.\n"));
    }
    md
}

/// Why the smoke run has no good measurement from this pass (empty: it has).
pub fn broken(r: &OverheadResult) -> Vec<String> {
    r.rows
        .iter()
        .filter(|row| row.broken())
        .map(|row| format!("overhead, {} ({})", row.target, row.variant))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_is_the_median_and_the_range_of_the_rounds() {
        let s = Spread::of([3.0, 1.0, f64::NAN, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(s.cell(1), "2.0 (1.0–3.0)");
        assert_eq!(Spread::of([4.0]).cell(0), "4");
        assert!(Spread::of([]).median.is_nan());
    }
}
