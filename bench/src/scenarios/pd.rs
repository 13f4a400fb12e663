//! Prefill/decode disaggregation side by side: the same simulated fleet of four replicas
//! behind inferlb in P/D mode (2 prefill + 2 decode, vLLM's protocol and SGLang's), inferlb
//! aggregated (4 replicas without a KV connector, `prefill_cost`), vLLM's router in P/D mode and
//! SGLang's gateway (smg) in P/D mode. Every front gets fresh replicas (cold caches), all of
//! them on the chunked scheduler, where a replica's decodes slow while it prefills.
//!
//! Workloads: the seed's agent loop (each conversation resends its growing history every turn;
//! all first turns finish before the warm turns start, so the KV moved by warm turns is counted
//! apart), a burst of fresh requests sharing one long prefix, and a replay of the first
//! requests of the Mooncake trace. Per front and workload: TTFT p50/p90/p99 and inter-token
//! latency p50/p99 (every gap between two content events of a stream, pooled), goodput
//! (requests a modelled second meeting TTFT <= 2 s and their own ITL p99 <= 100 ms), and the
//! KV tokens the simulated decode replicas pulled (`kv_tokens_transferred`, summed) per
//! request. Every time is the modelled engine's: wall time x speed.
//!
//! Then a kill scene (inferlb P/D under agent traffic, a prefill replica stopped, later a
//! decode replica: every request with no first byte at a kill must still succeed; streams
//! already cut are counted apart) and a sweep of `pd.local_prefill_tokens` on an agent loop
//! whose turns add from 64 to 6,000 tokens.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use inferlb_harness::{free_port, wait_until, Lb, LbConf, Proc, Replica, Signal, Sim};
use serde::Serialize;
use serde_json::{json, Value};

use crate::client::{filler, pct};
use crate::cluster::sim_caps;
use crate::scenarios::trace::{self, Shape};

/// TTFT bound of goodput, modelled ms.
const GOOD_TTFT_MS: f64 = 2_000.0;
/// ITL p99 bound of goodput, modelled ms.
const GOOD_ITL_MS: f64 = 100.0;
/// Tool outputs of the varied agent loop (kill scene, sweep), tokens: around every threshold.
const VARIED_TURNS: [usize; 8] = [64, 200, 500, 900, 1_500, 2_500, 4_000, 6_000];

/// The handover protocol of a P/D fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Vllm,
    Sglang,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
        }
    }
}

/// What receives the clients' requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdFront {
    /// inferlb, 2 prefill + 2 decode replicas.
    InferlbPd(Protocol),
    /// inferlb, 4 replicas without a KV connector, `prefill_cost`.
    InferlbAgg,
    /// vLLM's router, `--vllm-pd-disaggregation`.
    VllmRouter,
    /// SGLang's gateway, `smg launch --pd-disaggregation`.
    Smg,
}

impl PdFront {
    pub fn parse(s: &str) -> Option<PdFront> {
        match s {
            "inferlb-pd" => Some(PdFront::InferlbPd(Protocol::Vllm)),
            "inferlb-pd-sglang" => Some(PdFront::InferlbPd(Protocol::Sglang)),
            "inferlb-agg" => Some(PdFront::InferlbAgg),
            "vllm-router" => Some(PdFront::VllmRouter),
            "smg" => Some(PdFront::Smg),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PdFront::InferlbPd(Protocol::Vllm) => "inferlb-pd",
            PdFront::InferlbPd(Protocol::Sglang) => "inferlb-pd-sglang",
            PdFront::InferlbAgg => "inferlb-agg",
            PdFront::VllmRouter => "vllm-router",
            PdFront::Smg => "smg",
        }
    }

    /// The handover protocol its replicas speak; None: aggregated.
    fn protocol(self) -> Option<Protocol> {
        match self {
            PdFront::InferlbPd(p) => Some(p),
            PdFront::InferlbAgg => None,
            PdFront::VllmRouter => Some(Protocol::Vllm),
            PdFront::Smg => Some(Protocol::Sglang),
        }
    }

    /// How it was set up, for the report.
    fn setup(self, local_prefill_tokens: usize, idle_tokens: usize, warm: bool) -> String {
        match self {
            PdFront::InferlbPd(p) => format!(
                "2 prefill + 2 decode, pd.protocol {}, local_prefill_tokens {local_prefill_tokens}, local_prefill_idle_tokens {idle_tokens}, warm_prefill {warm}, routing prefill_cost",
                p.name()
            ),
            PdFront::InferlbAgg => "4 replicas, no KV connector, routing prefill_cost".into(),
            PdFront::VllmRouter => {
                "2 prefill + 2 decode, --kv-connector nixl --prefill-policy cache_aware --decode-policy power_of_two".into()
            }
            PdFront::Smg => {
                "2 prefill + 2 decode (sglang bootstrap), --prefill-policy cache_aware --decode-policy cache_aware".into()
            }
        }
    }
}

/// One agent loop's shape.
#[derive(Debug, Clone, Serialize)]
pub struct AgentShape {
    pub conversations: usize,
    pub turns: usize,
    pub context_tokens: usize,
    /// Tokens a turn's tool output adds; None: they vary over `VARIED_TURNS`.
    pub turn_tokens: Option<usize>,
    pub reply_tokens: usize,
}

impl AgentShape {
    fn turn_tokens(&self, c: usize, turn: usize) -> usize {
        self.turn_tokens
            .unwrap_or(VARIED_TURNS[(c * 3 + turn * 5) % VARIED_TURNS.len()])
    }

    fn describe(&self) -> String {
        let turns = match self.turn_tokens {
            Some(t) => format!("+{t} tokens a turn"),
            None => format!("+{:?} tokens a turn, varied", VARIED_TURNS),
        };
        format!(
            "{} conversations x {} turns, {}-token contexts, {turns}, {}-token replies",
            self.conversations, self.turns, self.context_tokens, self.reply_tokens
        )
    }
}

/// The scene's settings.
pub struct PdConf {
    pub speed: f64,
    pub smoke: bool,
    pub fronts: Vec<PdFront>,
    /// `pd.local_prefill_tokens` of the fronts table and the kill scene.
    pub local_prefill_tokens: usize,
    /// `pd.local_prefill_idle_tokens` of every inferlb P/D run, the sweep's included.
    pub local_prefill_idle_tokens: usize,
    /// `pd.warm_prefill` of every inferlb P/D run.
    pub warm_prefill: bool,
    /// The decode replicas' step budget under the chunked scheduler
    /// (`--max-num-batched-tokens`), when not the simulator's default (the prefill and
    /// aggregated replicas keep the default).
    pub decode_step_tokens: Option<usize>,
    pub thresholds: Vec<usize>,
    pub peers_venv: PathBuf,
    pub smg_venv: PathBuf,
    pub logs: PathBuf,
    pub agent: AgentShape,
    pub agent_cache_tokens: usize,
    pub burst: usize,
    pub burst_prefix_tokens: usize,
    pub burst_reply_tokens: usize,
    pub trace: PathBuf,
    pub trace_requests: usize,
    pub trace_load_pct: f64,
    pub trace_max_tokens: usize,
    pub trace_cache_tokens: usize,
    pub kill_agent: AgentShape,
    /// How long the kill scene's traffic runs, modelled seconds.
    pub kill_seconds: f64,
    pub sweep_agent: AgentShape,
}

impl PdConf {
    /// The scene's sizes (`smoke`: tiny ones that only check every part runs).
    pub fn sized(smoke: bool, speed: f64) -> PdConf {
        let agent = |conversations, turns, context_tokens, turn_tokens, reply_tokens| AgentShape {
            conversations,
            turns,
            context_tokens,
            turn_tokens,
            reply_tokens,
        };
        let venv = inferlb_harness::Peer::default_venv();
        let smg_venv = std::env::var_os("INFERLB_SMG_VENV")
            .map(PathBuf::from)
            .unwrap_or_else(|| venv.parent().unwrap_or(&venv).join("venv-smg"));
        let base = PdConf {
            speed,
            smoke,
            fronts: vec![],
            local_prefill_tokens: 4096,
            local_prefill_idle_tokens: 100_000,
            warm_prefill: false,
            decode_step_tokens: Some(600),
            thresholds: vec![0, 256, 1024, 4096],
            peers_venv: venv,
            smg_venv,
            logs: PathBuf::from("."),
            // The seed's agent loop.
            agent: agent(4, 8, 90_000, Some(2_000), 32),
            agent_cache_tokens: 250_000,
            // The seed's burst has a 90k-token prefix: its 3-s cold prefill alone breaks the
            // 2-s TTFT bound on every front, and goodput says nothing. 30k tokens: 1 s.
            burst: 16,
            burst_prefix_tokens: 30_000,
            burst_reply_tokens: 64,
            trace: PathBuf::new(),
            trace_requests: 300,
            trace_load_pct: 40.0,
            trace_max_tokens: 64,
            trace_cache_tokens: 500_000,
            kill_agent: agent(12, 1_000, 8_000, None, 32),
            kill_seconds: 60.0,
            sweep_agent: agent(8, 8, 20_000, None, 64),
        };
        if !smoke {
            return base;
        }
        PdConf {
            thresholds: vec![0, 1024],
            agent: agent(2, 3, 2_000, Some(300), 4),
            agent_cache_tokens: 100_000,
            burst: 3,
            burst_prefix_tokens: 2_000,
            burst_reply_tokens: 8,
            trace_requests: 12,
            trace_cache_tokens: 200_000,
            kill_agent: agent(2, 1_000, 1_000, None, 4),
            kill_seconds: 8.0,
            sweep_agent: agent(2, 3, 2_000, None, 4),
            ..base
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The fleet.

/// Fresh replicas and a front. Fields drop in order: the front before its replicas.
struct Fleet {
    lb: Option<Lb>,
    router: Option<Proc>,
    /// Prefill replicas first (p0, p1, then d0, d1), or gpu0..gpu3 when aggregated.
    sims: Vec<Sim>,
    base: String,
    _dir: tempfile::TempDir,
}

/// The KV the replicas moved, summed over the running ones.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct KvCounts {
    pub transferred: u64,
    pub pulls: u64,
    pub pull_failures: u64,
    pub prompt: u64,
    pub cached: u64,
}

impl KvCounts {
    fn since(&self, b: &KvCounts) -> KvCounts {
        KvCounts {
            transferred: self.transferred.saturating_sub(b.transferred),
            pulls: self.pulls.saturating_sub(b.pulls),
            pull_failures: self.pull_failures.saturating_sub(b.pull_failures),
            prompt: self.prompt.saturating_sub(b.prompt),
            cached: self.cached.saturating_sub(b.cached),
        }
    }
}

/// `GET path` on a loopback port: status and body (None: no answer within 2 s).
fn get_text(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let head = format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n");
    s.write_all(head.as_bytes()).ok()?;
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, text))
}

impl Fleet {
    /// Starts 4 replicas as `front` needs them, then the front; an error says why a peer did
    /// not start (nothing is left running then). Blocks the calling runtime thread.
    fn start(
        front: PdFront,
        pc: &PdConf,
        cache_tokens: usize,
        local_prefill_tokens: usize,
        log: &Path,
    ) -> Result<Fleet, String> {
        tokio::task::block_in_place(|| {
            Fleet::start_blocking(front, pc, cache_tokens, local_prefill_tokens, log)
        })
    }

    fn start_blocking(
        front: PdFront,
        pc: &PdConf,
        cache_tokens: usize,
        local_prefill_tokens: usize,
        log: &Path,
    ) -> Result<Fleet, String> {
        match front {
            PdFront::VllmRouter => {
                let p = pc.peers_venv.join("bin").join("vllm-router");
                if !p.exists() {
                    return Err(format!(
                        "{} missing (`make peers` installs it)",
                        p.display()
                    ));
                }
            }
            PdFront::Smg => {
                let p = pc.smg_venv.join("bin").join("smg");
                if !p.exists() {
                    return Err(format!(
                        "{} missing (`make peers` installs it)",
                        p.display()
                    ));
                }
            }
            _ => {}
        }
        let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
        // The replicas' logs beside the front's.
        let sim_logs = log.with_extension("sims");
        let _ = std::fs::remove_dir_all(&sim_logs);
        std::fs::create_dir_all(&sim_logs).map_err(|e| format!("{}: {e}", sim_logs.display()))?;
        let caps = sim_caps();
        let (speed, cache) = (pc.speed.to_string(), cache_tokens.to_string());
        let mut common: Vec<String> = vec!["--speed".into(), speed, "--cache-tokens".into(), cache];
        let chunked = caps.schedulers.iter().any(|s| s == "chunked");
        if chunked {
            common.extend(["--scheduler".into(), "chunked".into()]);
        }
        // (id, inferlb role, flags, bootstrap port)
        let mut plan: Vec<(String, &str, Vec<String>, Option<u16>)> = vec![];
        match front.protocol() {
            None => {
                for i in 0..4 {
                    plan.push((format!("gpu{i}"), "plain", vec![], None));
                }
            }
            Some(proto) => {
                for i in 0..2 {
                    let mut f: Vec<String> = vec!["--kv-role".into(), "producer".into()];
                    let mut boot = None;
                    if proto == Protocol::Sglang {
                        let b = free_port();
                        boot = Some(b);
                        f.extend([
                            "--pd-protocol".into(),
                            "sglang".into(),
                            "--bootstrap-port".into(),
                            b.to_string(),
                        ]);
                    }
                    plan.push((format!("p{i}"), "prefill", f, boot));
                }
                for i in 0..2 {
                    let mut f: Vec<String> = vec!["--kv-role".into(), "consumer".into()];
                    if proto == Protocol::Sglang {
                        f.extend(["--pd-protocol".into(), "sglang".into()]);
                    }
                    if let Some(n) = pc.decode_step_tokens.filter(|_| chunked) {
                        f.extend(["--max-num-batched-tokens".into(), n.to_string()]);
                    }
                    plan.push((format!("d{i}"), "decode", f, None));
                }
            }
        }
        let sims: Vec<Sim> = plan
            .iter()
            .map(|(id, _, f, _)| {
                let all: Vec<&str> = common.iter().chain(f.iter()).map(String::as_str).collect();
                Sim::spawn(&sim_logs, id, &all)
            })
            .collect();
        for s in &sims {
            s.assert_healthy();
        }
        let mut fleet = Fleet {
            lb: None,
            router: None,
            sims,
            base: String::new(),
            _dir: dir,
        };
        match front {
            PdFront::InferlbPd(_) | PdFront::InferlbAgg => {
                let learnt = caps.cache_config_info;
                let replicas = fleet
                    .sims
                    .iter()
                    .zip(&plan)
                    .map(|(s, (_, role, _, boot))| {
                        let mut extra = String::new();
                        if front != PdFront::InferlbAgg {
                            extra = format!("role: {role}");
                            if let Some(b) = boot {
                                extra.push_str(&format!(", bootstrap_port: {b}"));
                            }
                        }
                        Replica {
                            cache_tokens: (!learnt).then_some(cache_tokens as u64),
                            extra,
                            ..Replica::of(s)
                        }
                    })
                    .collect();
                let extra = match front.protocol() {
                    Some(p) if front != PdFront::InferlbAgg => format!(
                        "  pd: {{protocol: {}, local_prefill_tokens: {local_prefill_tokens}, local_prefill_idle_tokens: {}, warm_prefill: {}}}\n",
                        p.name(),
                        pc.local_prefill_idle_tokens,
                        pc.warm_prefill
                    ),
                    _ => String::new(),
                };
                let conf = LbConf {
                    threads: Some(2),
                    max_retries: Some(4),
                    routing: Some("prefill_cost".into()),
                    health_interval_seconds: Some(0.5),
                    load_poll_interval_seconds: Some((0.25 / pc.speed.max(1.0)).max(0.01)),
                    replicas,
                    extra,
                    ..LbConf::default()
                };
                let lb = Lb::start_logged(fleet._dir.path(), &[], conf, Some(log), "warn");
                fleet.base = lb.url("");
                fleet.lb = Some(lb);
            }
            PdFront::VllmRouter | PdFront::Smg => {
                let port = free_port();
                let vllm = front == PdFront::VllmRouter;
                let mut cmd = if vllm {
                    let mut c = Command::new(pc.peers_venv.join("bin").join("vllm-router"));
                    c.arg("--vllm-pd-disaggregation");
                    c
                } else {
                    let mut c = Command::new(pc.smg_venv.join("bin").join("smg"));
                    c.args(["launch", "--pd-disaggregation"]);
                    c
                };
                for (s, (_, role, _, boot)) in fleet.sims.iter().zip(&plan) {
                    if *role == "prefill" {
                        let b = boot.map_or("none".to_string(), |b| b.to_string());
                        cmd.args(["--prefill", &s.url(""), &b]);
                    } else {
                        cmd.args(["--decode", &s.url("")]);
                    }
                }
                // The cache trees' eviction interval is divided by the speed, as every
                // duration of the replicas is (vLLM's router: 120 s, smg: 60 s by default).
                let eviction = ((if vllm { 120.0 } else { 60.0 }) / pc.speed.max(1.0))
                    .round()
                    .max(1.0);
                if vllm {
                    cmd.args(["--kv-connector", "nixl"])
                        .args(["--prefill-policy", "cache_aware"])
                        .args(["--decode-policy", "power_of_two"])
                        .args(["--log-level", "warning"]);
                } else {
                    cmd.args(["--prefill-policy", "cache_aware"])
                        .args(["--decode-policy", "cache_aware"])
                        .args(["--log-level", "warn"]);
                }
                cmd.args(["--eviction-interval-secs", &eviction.to_string()])
                    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--prometheus-host", "127.0.0.1"])
                    .args(["--prometheus-port", &free_port().to_string()])
                    .args(["--worker-startup-timeout-secs", "30"])
                    .env("PYTHONUNBUFFERED", "1");
                let _ = std::fs::write(log, "");
                let mut p = Proc::spawn(front.name(), cmd, Some(log), Signal::SIGTERM)
                    .map_err(|e| format!("spawn {}: {e}", front.name()))?;
                let ready = wait_until(Duration::from_secs(60), || {
                    p.has_exited()
                        || get_text(port, "/v1/models")
                            .is_some_and(|(s, t)| s == 200 && t.contains("sim-model"))
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

    async fn kv(&self, client: &reqwest::Client) -> KvCounts {
        let mut k = KvCounts::default();
        for s in self.sims.iter().filter(|s| s.is_running()) {
            let Ok(r) = client.get(s.url("/sim/stats")).send().await else {
                continue;
            };
            let Ok(v) = r.json::<Value>().await else {
                continue;
            };
            let n = |key: &str| v[key].as_u64().unwrap_or(0);
            k.transferred += n("kv_tokens_transferred");
            k.pulls += n("kv_pulls");
            k.pull_failures += n("kv_pull_failures");
            k.prompt += n("prompt_tokens");
            k.cached += n("cached_tokens");
        }
        k
    }

    /// inferlb's `inferlb_pd*` samples, summed by name (empty for the peers).
    async fn pd_metrics(&self, client: &reqwest::Client) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        let Some(lb) = &self.lb else { return out };
        let Ok(r) = client.get(lb.admin_url("/metrics")).send().await else {
            return out;
        };
        let text = r.text().await.unwrap_or_default();
        for l in text.lines().filter(|l| l.starts_with("inferlb_pd")) {
            let Some((name, v)) = l.rsplit_once(' ') else {
                continue;
            };
            if let Ok(v) = v.parse::<f64>() {
                *out.entry(name.to_string()).or_insert(0.0) += v;
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// One streamed request, timed.

/// One streamed chat request as the client saw it (wall clock).
#[derive(Debug, Clone)]
struct Rec {
    sent: Instant,
    /// The first byte of the response body.
    first_byte: Option<Instant>,
    /// To the first non-empty content event, seconds.
    ttft: Option<f64>,
    /// Between consecutive content events, seconds.
    gaps: Vec<f64>,
    end: Instant,
    status: u16,
    /// 200 and a stream that ended with `[DONE]` without an error event.
    ok: bool,
    /// `x-inferlb-route` ("-" for the peers).
    route: String,
    reply: String,
    /// What went wrong: the body of an answer other than 200, or the first error event.
    error: Option<String>,
}

async fn send(client: &reqwest::Client, base: &str, body: &Value, keep_reply: bool) -> Rec {
    let sent = Instant::now();
    let mut r = Rec {
        sent,
        first_byte: None,
        ttft: None,
        gaps: vec![],
        end: sent,
        status: 0,
        ok: false,
        route: "-".into(),
        reply: String::new(),
        error: None,
    };
    let resp = match client
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .send()
        .await
    {
        Ok(x) => x,
        Err(e) => {
            r.end = Instant::now();
            r.error = Some(format!("no answer: {e}"));
            return r;
        }
    };
    r.status = resp.status().as_u16();
    if let Some(v) = resp
        .headers()
        .get("x-inferlb-route")
        .and_then(|v| v.to_str().ok())
    {
        r.route = v.to_string();
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = vec![];
    let (mut done, mut failed) = (false, false);
    let mut last: Option<Instant> = None;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        let now = Instant::now();
        r.first_byte.get_or_insert(now);
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for data in text.lines().filter_map(|l| l.strip_prefix("data:")) {
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if v.get("error").is_some() {
                    failed = true;
                    r.error
                        .get_or_insert_with(|| format!("error event: {data}"));
                    continue;
                }
                let Some(c) = v["choices"][0]["delta"]["content"].as_str() else {
                    continue;
                };
                if c.is_empty() {
                    continue;
                }
                match last {
                    None => r.ttft = Some((now - sent).as_secs_f64()),
                    Some(l) => r.gaps.push((now - l).as_secs_f64()),
                }
                last = Some(now);
                if keep_reply {
                    r.reply.push_str(c);
                }
            }
        }
    }
    r.end = Instant::now();
    r.ok = r.status == 200 && done && !failed;
    if !r.ok && r.error.is_none() {
        let tail = String::from_utf8_lossy(&buf)
            .chars()
            .take(300)
            .collect::<String>();
        r.error = Some(if r.status != 200 {
            format!("status {}: {tail}", r.status)
        } else {
            format!(
                "stream ended without [DONE] ({} content events)",
                r.gaps.len() + usize::from(r.ttft.is_some())
            )
        });
    }
    r
}

fn chat_body(messages: &[Value], max_tokens: usize) -> Value {
    json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": max_tokens})
}

// ---------------------------------------------------------------------------------------------
// Workloads.

/// One row of the tables.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Cell {
    pub front: String,
    pub workload: String,
    /// `pd.local_prefill_tokens` (sweep rows; the fronts table's inferlb P/D rows).
    pub threshold: Option<usize>,
    pub requests: usize,
    pub errors: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    /// Requests a modelled second meeting TTFT <= 2 s and ITL p99 <= 100 ms.
    pub goodput_rps: f64,
    /// Share of the requests meeting both.
    pub good_share: f64,
    /// KV tokens the replicas pulled, per request (agent loop: per warm turn).
    pub kv_per_request: f64,
    /// KV tokens per first turn (agent loop).
    pub kv_per_first_turn: Option<f64>,
    pub kv_pull_failures: u64,
    pub hit_rate: f64,
    /// `x-inferlb-route` of every request ("-": none).
    pub routes: BTreeMap<String, usize>,
    pub wall_seconds: f64,
    pub skipped: Option<String>,
    /// The first few failed requests: route and what went wrong.
    pub error_samples: Vec<String>,
}

/// Fills the latency, goodput and route columns from `recs`.
fn summarize(cell: &mut Cell, recs: &[Rec], speed: f64) {
    let ms = |s: f64| s * 1e3 * speed;
    let ttft: Vec<f64> = recs
        .iter()
        .filter(|r| r.ok)
        .filter_map(|r| r.ttft)
        .map(ms)
        .collect();
    let gaps: Vec<f64> = recs
        .iter()
        .filter(|r| r.ok)
        .flat_map(|r| r.gaps.iter().copied().map(ms))
        .collect();
    cell.requests = recs.len();
    cell.errors = recs.iter().filter(|r| !r.ok).count();
    cell.ttft_p50_ms = pct(&ttft, 0.5);
    cell.ttft_p90_ms = pct(&ttft, 0.9);
    cell.ttft_p99_ms = pct(&ttft, 0.99);
    cell.itl_p50_ms = pct(&gaps, 0.5);
    cell.itl_p99_ms = pct(&gaps, 0.99);
    let good = recs
        .iter()
        .filter(|r| {
            let own: Vec<f64> = r.gaps.iter().copied().map(ms).collect();
            r.ok && r.ttft.is_some_and(|t| ms(t) <= GOOD_TTFT_MS)
                && (own.is_empty() || pct(&own, 0.99) <= GOOD_ITL_MS)
        })
        .count();
    let (Some(first), Some(last)) = (
        recs.iter().map(|r| r.sent).min(),
        recs.iter().map(|r| r.end).max(),
    ) else {
        return;
    };
    let span = (last - first).as_secs_f64() * speed;
    cell.goodput_rps = good as f64 / span.max(1e-9);
    cell.good_share = good as f64 / recs.len().max(1) as f64;
    for r in recs {
        *cell.routes.entry(r.route.clone()).or_insert(0) += 1;
        if !r.ok && cell.error_samples.len() < 5 {
            cell.error_samples.push(format!(
                "route {}: {}",
                r.route,
                r.error.as_deref().unwrap_or("?")
            ));
        }
    }
}

/// The agent loop: every conversation's first turn, then (all first turns done) the warm
/// turns. Returns the first turns, the warm turns and the KV the warm turns moved.
async fn agent_loop(
    client: &reqwest::Client,
    fleet: &Fleet,
    shape: &AgentShape,
    speed: f64,
    tag: &str,
) -> (Vec<Rec>, Vec<Rec>, KvCounts, KvCounts) {
    let n = shape.conversations.max(1);
    let first_done = Arc::new(tokio::sync::Barrier::new(n + 1));
    let go = Arc::new(tokio::sync::Barrier::new(n + 1));
    let before = fleet.kv(client).await;
    let tasks: Vec<_> = (0..n)
        .map(|c| {
            let (client, base, shape) = (client.clone(), fleet.base.clone(), shape.clone());
            let (first_done, go, tag) = (first_done.clone(), go.clone(), tag.to_string());
            tokio::spawn(async move {
                let mut messages = vec![json!({"role": "system", "content": filler(&format!("{tag} conversation {c} context"), shape.context_tokens)})];
                let mut recs = vec![];
                for turn in 0..shape.turns {
                    if turn == 1 {
                        first_done.wait().await;
                        go.wait().await;
                    }
                    // The seed's tool time between turns, so conversations do not run in
                    // lockstep.
                    let think = (c as u64 * 7919 + turn as u64 * 104_729) % 1000;
                    tokio::time::sleep(Duration::from_secs_f64(think as f64 / 1000.0 / speed))
                        .await;
                    let tool = filler(
                        &format!("{tag} c{c} tool output {turn}"),
                        shape.turn_tokens(c, turn),
                    );
                    messages.push(json!({"role": "user", "content": tool}));
                    let r = send(&client, &base, &chat_body(&messages, shape.reply_tokens), true)
                        .await;
                    if r.ok {
                        messages.push(json!({"role": "assistant", "content": r.reply.clone()}));
                    } else {
                        messages.pop();
                    }
                    recs.push(r);
                }
                if shape.turns <= 1 {
                    first_done.wait().await;
                    go.wait().await;
                }
                recs
            })
        })
        .collect();
    first_done.wait().await;
    let mid = fleet.kv(client).await;
    go.wait().await;
    let (mut first, mut warm) = (vec![], vec![]);
    for t in tasks {
        if let Ok(recs) = t.await {
            for (i, r) in recs.into_iter().enumerate() {
                if i == 0 {
                    first.push(r);
                } else {
                    warm.push(r);
                }
            }
        }
    }
    let after = fleet.kv(client).await;
    (first, warm, mid.since(&before), after.since(&mid))
}

/// inferlb's warm prefills (a local turn prefilled again on an idle prefill replica), in the
/// routes column as `warm N`: they are legs, not requests.
fn warm_copies(cell: &mut Cell, metrics: &BTreeMap<String, f64>) {
    let n: f64 = metrics
        .iter()
        .filter(|(k, _)| {
            k.starts_with("inferlb_pd_legs_total{")
                && k.contains(r#"leg="warm""#)
                && k.contains(r#"outcome="ok""#)
        })
        .map(|(_, v)| v)
        .sum();
    if n > 0.0 {
        cell.routes.insert("warm".into(), n as usize);
    }
}

async fn agent_cell(
    client: &reqwest::Client,
    pc: &PdConf,
    front: PdFront,
    shape: &AgentShape,
    threshold: usize,
    workload: &str,
) -> Cell {
    let mut cell = Cell {
        front: front.name().into(),
        workload: workload.into(),
        threshold: matches!(front, PdFront::InferlbPd(_)).then_some(threshold),
        ..Cell::default()
    };
    let log = pc
        .logs
        .join(format!("pd-{}-{workload}-{threshold}.log", front.name()));
    let fleet = match Fleet::start(front, pc, pc.agent_cache_tokens, threshold, &log) {
        Ok(f) => f,
        Err(e) => {
            cell.skipped = Some(e);
            return cell;
        }
    };
    let started = Instant::now();
    let (first, warm, kv_first, kv_warm) =
        agent_loop(client, &fleet, shape, pc.speed, workload).await;
    cell.wall_seconds = started.elapsed().as_secs_f64();
    summarize(&mut cell, &warm, pc.speed);
    warm_copies(&mut cell, &fleet.pd_metrics(client).await);
    cell.errors += first.iter().filter(|r| !r.ok).count();
    cell.kv_per_request = kv_warm.transferred as f64 / warm.len().max(1) as f64;
    cell.kv_per_first_turn = Some(kv_first.transferred as f64 / first.len().max(1) as f64);
    cell.kv_pull_failures = kv_first.pull_failures + kv_warm.pull_failures;
    cell.hit_rate = kv_warm.cached as f64 / kv_warm.prompt.max(1) as f64;
    cell
}

async fn burst_cell(client: &reqwest::Client, pc: &PdConf, front: PdFront) -> Cell {
    let mut cell = Cell {
        front: front.name().into(),
        workload: "burst".into(),
        threshold: matches!(front, PdFront::InferlbPd(_)).then_some(pc.local_prefill_tokens),
        ..Cell::default()
    };
    let log = pc.logs.join(format!("pd-{}-burst.log", front.name()));
    let fleet = match Fleet::start(
        front,
        pc,
        pc.agent_cache_tokens,
        pc.local_prefill_tokens,
        &log,
    ) {
        Ok(f) => f,
        Err(e) => {
            cell.skipped = Some(e);
            return cell;
        }
    };
    let before = fleet.kv(client).await;
    let prefix = filler("pd burst shared prefix", pc.burst_prefix_tokens);
    let started = Instant::now();
    let tasks: Vec<_> = (0..pc.burst)
        .map(|i| {
            let (client, base) = (client.clone(), fleet.base.clone());
            let body = chat_body(
                &[
                    json!({"role": "system", "content": prefix.clone()}),
                    json!({"role": "user", "content": format!("subtask {i}: do your part")}),
                ],
                pc.burst_reply_tokens,
            );
            tokio::spawn(async move { send(&client, &base, &body, false).await })
        })
        .collect();
    let mut recs = vec![];
    for t in tasks {
        if let Ok(r) = t.await {
            recs.push(r);
        }
    }
    cell.wall_seconds = started.elapsed().as_secs_f64();
    let kv = fleet.kv(client).await.since(&before);
    summarize(&mut cell, &recs, pc.speed);
    warm_copies(&mut cell, &fleet.pd_metrics(client).await);
    cell.errors += pc.burst - recs.len();
    cell.kv_per_request = kv.transferred as f64 / recs.len().max(1) as f64;
    cell.kv_pull_failures = kv.pull_failures;
    cell.hit_rate = kv.cached as f64 / kv.prompt.max(1) as f64;
    cell
}

async fn trace_cell(
    client: &reqwest::Client,
    pc: &PdConf,
    front: PdFront,
    reqs: &[trace::TraceRequest],
) -> Cell {
    let mut cell = Cell {
        front: front.name().into(),
        workload: "trace".into(),
        threshold: matches!(front, PdFront::InferlbPd(_)).then_some(pc.local_prefill_tokens),
        ..Cell::default()
    };
    let log = pc.logs.join(format!("pd-{}-trace.log", front.name()));
    let fleet = match Fleet::start(
        front,
        pc,
        pc.trace_cache_tokens,
        pc.local_prefill_tokens,
        &log,
    ) {
        Ok(f) => f,
        Err(e) => {
            cell.skipped = Some(e);
            return cell;
        }
    };
    let before = fleet.kv(client).await;
    let scale = trace::scale_for(reqs, pc.trace_load_pct / 100.0, pc.speed);
    let t0 = reqs.first().map_or(0, |r| r.timestamp);
    let started = Instant::now() + Duration::from_millis(20);
    let tasks: Vec<_> = reqs
        .iter()
        .map(|r| {
            let at = started + Duration::from_secs_f64((r.timestamp - t0) as f64 * scale);
            let body = Shape::Chat.body(r, r.output_length.clamp(1, pc.trace_max_tokens));
            let (client, base) = (client.clone(), fleet.base.clone());
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                send(&client, &base, &body, false).await
            })
        })
        .collect();
    let mut recs = vec![];
    for t in tasks {
        if let Ok(r) = t.await {
            recs.push(r);
        }
    }
    cell.wall_seconds = started.elapsed().as_secs_f64();
    let kv = fleet.kv(client).await.since(&before);
    summarize(&mut cell, &recs, pc.speed);
    warm_copies(&mut cell, &fleet.pd_metrics(client).await);
    cell.errors += reqs.len() - recs.len();
    cell.kv_per_request = kv.transferred as f64 / recs.len().max(1) as f64;
    cell.kv_pull_failures = kv.pull_failures;
    cell.hit_rate = kv.cached as f64 / kv.prompt.max(1) as f64;
    cell
}

// ---------------------------------------------------------------------------------------------
// The kill scene.

#[derive(Debug, Default, Clone, Serialize)]
pub struct KillResult {
    pub setup: String,
    pub requests: usize,
    pub answered: usize,
    /// Failed requests that had no first byte at either kill (or started after): must be 0.
    pub errors_without_first_byte: usize,
    /// Failed requests whose stream had started before a kill it was in flight at.
    pub streams_cut: usize,
    /// Requests in flight with no first byte yet at each kill (prefill, then decode).
    pub waiting_at_kill: Vec<usize>,
    /// Requests streaming at each kill.
    pub streaming_at_kill: Vec<usize>,
    /// Modelled seconds from the start to each kill.
    pub kill_at_s: Vec<f64>,
    pub routes: BTreeMap<String, usize>,
    /// The failed requests that count (at most 10): sent at (modelled s), status, route.
    pub error_samples: Vec<String>,
    pub kv_pull_failures: u64,
    /// inferlb's `inferlb_pd*` samples at the end.
    pub pd_metrics: BTreeMap<String, f64>,
    pub log: String,
    pub skipped: Option<String>,
}

async fn kill_scene(client: &reqwest::Client, pc: &PdConf) -> KillResult {
    let front = PdFront::InferlbPd(Protocol::Vllm);
    let log = pc.logs.join("pd-kill-inferlb.log");
    let mut k = KillResult {
        setup: format!(
            "{}; {}; p0 stopped at 1/3 of {:.0} modelled s, d0 at 2/3",
            front.setup(
                pc.local_prefill_tokens,
                pc.local_prefill_idle_tokens,
                pc.warm_prefill
            ),
            pc.kill_agent.describe(),
            pc.kill_seconds
        ),
        log: log.display().to_string(),
        ..KillResult::default()
    };
    let mut fleet = match Fleet::start(
        front,
        pc,
        pc.agent_cache_tokens,
        pc.local_prefill_tokens,
        &log,
    ) {
        Ok(f) => f,
        Err(e) => {
            k.skipped = Some(e);
            return k;
        }
    };
    let before = fleet.kv(client).await;
    let start = Instant::now();
    let run = Duration::from_secs_f64(pc.kill_seconds / pc.speed);
    let deadline = start + run;
    let shape = pc.kill_agent.clone();
    let tasks: Vec<_> = (0..shape.conversations)
        .map(|c| {
            let (client, base, shape) = (client.clone(), fleet.base.clone(), shape.clone());
            let speed = pc.speed;
            tokio::spawn(async move {
                let mut messages = vec![json!({"role": "system", "content": filler(&format!("kill conversation {c} context"), shape.context_tokens)})];
                let mut recs = vec![];
                for turn in 0..shape.turns {
                    let think = (c as u64 * 7919 + turn as u64 * 104_729) % 1000;
                    tokio::time::sleep(Duration::from_secs_f64(think as f64 / 1000.0 / speed))
                        .await;
                    if Instant::now() >= deadline {
                        break;
                    }
                    // A history grown past four times its start begins again (a new task).
                    if messages.len() > 2 * 12 {
                        messages.truncate(1);
                    }
                    let tool = filler(&format!("kill c{c} tool output {turn}"), shape.turn_tokens(c, turn));
                    messages.push(json!({"role": "user", "content": tool}));
                    let r = send(&client, &base, &chat_body(&messages, shape.reply_tokens), true).await;
                    if r.ok {
                        messages.push(json!({"role": "assistant", "content": r.reply.clone()}));
                    } else {
                        messages.pop();
                    }
                    recs.push(r);
                }
                recs
            })
        })
        .collect();
    let mut kills = vec![];
    for (frac, idx) in [(1.0 / 3.0, 0usize), (2.0 / 3.0, 2usize)] {
        tokio::time::sleep_until((start + run.mul_f64(frac)).into()).await;
        let at = Instant::now();
        tokio::task::block_in_place(|| fleet.sims[idx].stop());
        eprintln!(
            "[pd] kill scene: {} stopped at {:.1} modelled s",
            fleet.sims[idx].id,
            (at - start).as_secs_f64() * pc.speed
        );
        kills.push(at);
    }
    let mut recs = vec![];
    for t in tasks {
        if let Ok(r) = t.await {
            recs.extend(r);
        }
    }
    let kv = fleet.kv(client).await.since(&before);
    k.kv_pull_failures = kv.pull_failures;
    k.pd_metrics = fleet.pd_metrics(client).await;
    drop(fleet);
    k.kill_at_s = kills
        .iter()
        .map(|t| (*t - start).as_secs_f64() * pc.speed)
        .collect();
    k.requests = recs.len();
    for &kill in &kills {
        let in_flight = |r: &&Rec| r.sent <= kill && r.end >= kill;
        k.waiting_at_kill.push(
            recs.iter()
                .filter(in_flight)
                .filter(|r| r.first_byte.is_none_or(|f| f > kill))
                .count(),
        );
        k.streaming_at_kill.push(
            recs.iter()
                .filter(in_flight)
                .filter(|r| r.first_byte.is_some_and(|f| f <= kill))
                .count(),
        );
    }
    for r in &recs {
        *k.routes.entry(r.route.clone()).or_insert(0) += 1;
        if r.ok {
            k.answered += 1;
            continue;
        }
        let cut = kills.iter().any(|&kill| {
            r.sent <= kill && r.end >= kill && r.first_byte.is_some_and(|f| f <= kill)
        });
        if cut {
            k.streams_cut += 1;
        } else {
            k.errors_without_first_byte += 1;
            if k.error_samples.len() < 10 {
                k.error_samples.push(format!(
                    "sent at {:.2} s, status {}, route {}, first byte {}, ended at {:.2} s: {}",
                    (r.sent - start).as_secs_f64() * pc.speed,
                    r.status,
                    r.route,
                    r.first_byte.map_or("none".into(), |f| format!(
                        "at {:.2} s",
                        (f - start).as_secs_f64() * pc.speed
                    )),
                    (r.end - start).as_secs_f64() * pc.speed,
                    r.error.as_deref().unwrap_or("?")
                ));
            }
        }
    }
    k
}

// ---------------------------------------------------------------------------------------------
// The scene.

#[derive(Debug, Default, Clone, Serialize)]
pub struct PdResult {
    pub speed: f64,
    pub scheduler: String,
    pub agent: String,
    pub agent_cache_tokens: usize,
    pub burst: String,
    pub trace: String,
    pub trace_cache_tokens: usize,
    /// How each front was set up.
    pub setups: Vec<(String, String)>,
    pub cells: Vec<Cell>,
    pub kill: Option<KillResult>,
    pub sweep_agent: String,
    pub sweep: Vec<Cell>,
    /// The threshold that won the sweep, and why.
    pub sweep_winner: Option<(usize, String)>,
    pub notes: Vec<String>,
}

/// The whole scene.
pub async fn pd(client: &reqwest::Client, pc: &PdConf) -> PdResult {
    let caps = sim_caps();
    let mut res = PdResult {
        speed: pc.speed,
        scheduler: if caps.schedulers.iter().any(|s| s == "chunked") {
            match pc.decode_step_tokens {
                Some(n) => format!("chunked (decode replicas: {n} tokens a step)"),
                None => "chunked".into(),
            }
        } else {
            "fcfs (this inferlb-sim has no chunked scheduler)".into()
        },
        agent: pc.agent.describe(),
        agent_cache_tokens: pc.agent_cache_tokens,
        burst: format!(
            "{} requests at once sharing a {}-token prefix, {}-token replies",
            pc.burst, pc.burst_prefix_tokens, pc.burst_reply_tokens
        ),
        trace_cache_tokens: pc.trace_cache_tokens,
        sweep_agent: format!(
            "{}, local_prefill_idle_tokens {} and warm_prefill {} in every row",
            pc.sweep_agent.describe(),
            pc.local_prefill_idle_tokens,
            pc.warm_prefill
        ),
        ..PdResult::default()
    };
    let note = |res: &mut PdResult, line: String| {
        eprintln!("[pd] {line}");
        res.notes.push(line);
    };
    let reqs = match trace::load(&pc.trace, pc.trace_requests) {
        Ok(r) => {
            res.trace = format!(
                "the first {} requests of `{}` ({:.0} s of trace), chat shape, max_tokens capped at {}, arrivals scaled so that 4 replicas' prefill with no cache hit would be busy {:.0}% of the time",
                r.len(),
                pc.trace.display(),
                trace::span_ms(&r) as f64 / 1e3,
                pc.trace_max_tokens,
                pc.trace_load_pct
            );
            Some(r)
        }
        Err(e) => {
            note(&mut res, format!("trace replay skipped: {e}"));
            None
        }
    };
    for &front in &pc.fronts {
        res.setups.push((
            front.name().into(),
            front.setup(
                pc.local_prefill_tokens,
                pc.local_prefill_idle_tokens,
                pc.warm_prefill,
            ),
        ));
    }
    for (i, &front) in pc.fronts.iter().enumerate() {
        eprintln!("[pd] {}: agent loop", front.name());
        let c = agent_cell(
            client,
            pc,
            front,
            &pc.agent,
            pc.local_prefill_tokens,
            "agent",
        )
        .await;
        if let Some(why) = &c.skipped {
            note(&mut res, format!("{} skipped: {why}", front.name()));
            res.cells.push(c);
            continue;
        }
        log_cell(&c);
        res.cells.push(c);
        if pc.smoke && i > 0 {
            // A smoke run checks the other workloads through the first front only.
            continue;
        }
        eprintln!("[pd] {}: burst", front.name());
        let c = burst_cell(client, pc, front).await;
        log_cell(&c);
        res.cells.push(c);
        if let Some(reqs) = &reqs {
            eprintln!("[pd] {}: trace", front.name());
            let c = trace_cell(client, pc, front, reqs).await;
            log_cell(&c);
            res.cells.push(c);
        }
    }
    eprintln!("[pd] kill scene");
    let k = kill_scene(client, pc).await;
    eprintln!(
        "[pd]   {} requests, {} errors without a first byte at a kill, {} streams cut",
        k.requests, k.errors_without_first_byte, k.streams_cut
    );
    res.kill = Some(k);
    for &t in &pc.thresholds {
        eprintln!("[pd] sweep: local_prefill_tokens {t}");
        let c = agent_cell(
            client,
            pc,
            PdFront::InferlbPd(Protocol::Vllm),
            &pc.sweep_agent,
            t,
            "sweep",
        )
        .await;
        log_cell(&c);
        res.sweep.push(c);
    }
    res.sweep_winner = winner(&res.sweep);
    res
}

fn log_cell(c: &Cell) {
    if c.skipped.is_some() {
        return;
    }
    eprintln!(
        "[pd]   {} {}: TTFT p50 {:.0} p90 {:.0} ms, ITL p99 {:.0} ms, goodput {:.2}/s, KV {:.0}/req, errors {}, {:.1} s",
        c.front, c.workload, c.ttft_p50_ms, c.ttft_p90_ms, c.itl_p99_ms, c.goodput_rps, c.kv_per_request, c.errors, c.wall_seconds
    );
}

/// The sweep's winner: the most goodput; within 5% of it, the lowest TTFT p90; then the least
/// KV moved.
fn winner(sweep: &[Cell]) -> Option<(usize, String)> {
    let rows: Vec<&Cell> = sweep
        .iter()
        .filter(|c| c.skipped.is_none() && c.threshold.is_some() && c.ttft_p90_ms.is_finite())
        .collect();
    let best = rows.iter().map(|c| c.goodput_rps).fold(f64::NAN, f64::max);
    if !best.is_finite() {
        return None;
    }
    let mut close: Vec<&&Cell> = rows
        .iter()
        .filter(|c| c.goodput_rps >= best * 0.95)
        .collect();
    close.sort_by(|a, b| {
        a.ttft_p90_ms
            .total_cmp(&b.ttft_p90_ms)
            .then(a.kv_per_request.total_cmp(&b.kv_per_request))
    });
    let w = close.first()?;
    let others: Vec<String> = rows
        .iter()
        .filter(|c| c.threshold != w.threshold)
        .map(|c| {
            format!(
                "{}: goodput {:.2}/s, TTFT p90 {:.0} ms, ITL p99 {:.0} ms, KV {:.0}/warm turn",
                c.threshold.unwrap_or(0),
                c.goodput_rps,
                c.ttft_p90_ms,
                c.itl_p99_ms,
                c.kv_per_request
            )
        })
        .collect();
    let why = format!(
        "goodput {:.2}/s (best {:.2}/s; within 5% of the best the lowest TTFT p90 wins), TTFT p90 {:.0} ms, ITL p99 {:.0} ms, KV {:.0}/warm turn; the others: {}",
        w.goodput_rps,
        best,
        w.ttft_p90_ms,
        w.itl_p99_ms,
        w.kv_per_request,
        others.join("; ")
    );
    Some((w.threshold.unwrap_or(0), why))
}

// ---------------------------------------------------------------------------------------------
// The report.

fn num(x: f64, decimals: usize) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}")
    } else {
        "-".into()
    }
}

fn routes(m: &BTreeMap<String, usize>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The scene's markdown.
pub fn table(r: &PdResult) -> String {
    let mut md = format!(
        "\nPrefill/decode disaggregation: the same 4 simulated replicas behind each front, fresh for every row (cold caches), {} scheduler, speed x{}. Times are the modelled engine's (wall x speed). ITL: every gap between two content events of a stream, pooled. Goodput: requests a modelled second with TTFT <= 2 s and their own ITL p99 <= 100 ms. KV: tokens the decode replicas pulled (the sims' `kv_tokens_transferred`, summed), per request; for the agent loop per warm turn (the first turns, all done before the warm turns start, are in the last column). Agent loop: {} ({} tokens of cache a replica; TTFT and ITL of the warm turns). Burst: {}. Trace: {} ({} tokens of cache a replica).\n",
        r.scheduler, r.speed, r.agent, r.agent_cache_tokens, r.burst, if r.trace.is_empty() { "skipped" } else { &r.trace }, r.trace_cache_tokens
    );
    md.push_str("\nFronts:\n");
    for (f, s) in &r.setups {
        md.push_str(&format!("- {f}: {s}\n"));
    }
    for n in &r.notes {
        md.push_str(&format!("- {n}\n"));
    }
    md.push_str("\n| workload | front | requests | TTFT p50 (ms) | p90 | p99 | ITL p50 (ms) | p99 | goodput (req/s) | good | KV / request | hit rate | errors | routes | KV / first turn |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for w in ["agent", "burst", "trace"] {
        for c in r
            .cells
            .iter()
            .filter(|c| c.workload == w || (w == "agent" && c.skipped.is_some()))
        {
            if let Some(why) = &c.skipped {
                md.push_str(&format!(
                    "| all | {} | skipped: {} |||||||||||||\n",
                    c.front,
                    why.replace('|', "/")
                ));
                continue;
            }
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0}% | {:.0} | {:.1}% | {} | {} | {} |\n",
                c.workload,
                c.front,
                c.requests,
                num(c.ttft_p50_ms, 0),
                num(c.ttft_p90_ms, 0),
                num(c.ttft_p99_ms, 0),
                num(c.itl_p50_ms, 0),
                num(c.itl_p99_ms, 0),
                num(c.goodput_rps, 2),
                c.good_share * 100.0,
                c.kv_per_request,
                c.hit_rate * 100.0,
                c.errors,
                routes(&c.routes),
                c.kv_per_first_turn.map_or("".into(), |x| format!("{x:.0}")),
            ));
        }
    }
    let samples: Vec<String> = r
        .cells
        .iter()
        .chain(&r.sweep)
        .flat_map(|c| {
            c.error_samples
                .iter()
                .map(move |e| format!("- {} {}: {e}", c.front, c.workload))
        })
        .collect();
    if !samples.is_empty() {
        md.push_str(&format!(
            "\nFailed requests (the first of each row):\n{}\n",
            samples.join("\n")
        ));
    }
    md.push_str(&targets(r));
    if let Some(k) = &r.kill {
        md.push_str(&format!("\nKill scene ({}):", k.setup));
        match &k.skipped {
            Some(why) => md.push_str(&format!(" skipped: {why}\n")),
            None => {
                md.push_str(&format!(
                    " {} requests, {} answered; **{} errors among requests with no first byte at a kill** (target 0); {} streams already under way cut. In flight without a first byte at the kills: {:?}; streaming: {:?}; kills at {:?} modelled s. Routes: {}. Failed KV pulls: {}. inferlb: {}.\n",
                    k.requests,
                    k.answered,
                    k.errors_without_first_byte,
                    k.streams_cut,
                    k.waiting_at_kill,
                    k.streaming_at_kill,
                    k.kill_at_s.iter().map(|x| (x * 10.0).round() / 10.0).collect::<Vec<_>>(),
                    routes(&k.routes),
                    k.kv_pull_failures,
                    k.pd_metrics
                        .iter()
                        .filter(|(_, v)| **v > 0.0)
                        .map(|(n, v)| format!("{n} {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
                for e in &k.error_samples {
                    md.push_str(&format!("  - {e}\n"));
                }
            }
        }
    }
    if !r.sweep.is_empty() {
        md.push_str(&format!(
            "\nThreshold sweep: inferlb P/D (vLLM protocol) on an agent loop of {}; `pd.local_prefill_tokens` per row.\n\n| local_prefill_tokens | warm turns | pd | pd-local | TTFT p50 (ms) | p90 | ITL p50 (ms) | p99 | goodput (req/s) | KV / warm turn | errors |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
            r.sweep_agent
        ));
        for c in &r.sweep {
            if let Some(why) = &c.skipped {
                md.push_str(&format!(
                    "| {} | skipped: {} |||||||||\n",
                    c.threshold.unwrap_or(0),
                    why.replace('|', "/")
                ));
                continue;
            }
            let n = |k: &str| c.routes.get(k).copied().unwrap_or(0);
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} |\n",
                c.threshold.unwrap_or(0),
                c.requests,
                n("pd"),
                n("pd-local"),
                num(c.ttft_p50_ms, 0),
                num(c.ttft_p90_ms, 0),
                num(c.itl_p50_ms, 0),
                num(c.itl_p99_ms, 0),
                num(c.goodput_rps, 2),
                c.kv_per_request,
                c.errors
            ));
        }
        if let Some((t, why)) = &r.sweep_winner {
            md.push_str(&format!("\nSweep winner: **{t}**: {why}.\n"));
        }
    }
    md
}

/// The issue's targets, same run: inferlb P/D against the best peer in each workload.
fn targets(r: &PdResult) -> String {
    let mut lines = vec![];
    for w in ["agent", "burst", "trace"] {
        let row = |f: &str| {
            r.cells
                .iter()
                .find(|c| c.workload == w && c.front == f && c.skipped.is_none())
        };
        let Some(me) = row("inferlb-pd") else {
            continue;
        };
        let peers: Vec<&Cell> = ["vllm-router", "smg"]
            .iter()
            .filter_map(|f| row(f))
            .collect();
        if peers.is_empty() {
            continue;
        }
        let best = |f: fn(&Cell) -> f64| peers.iter().map(|c| f(c)).fold(f64::NAN, f64::min);
        let (t90, itl) = (best(|c| c.ttft_p90_ms), best(|c| c.itl_p99_ms));
        // At the precision shown, whole ms: what the table prints is what is compared.
        let ok = |mine: f64, theirs: f64| {
            if mine.round() <= theirs.round() {
                "met"
            } else {
                "not met"
            }
        };
        let mut line = format!(
            "- {w}: TTFT p90 {} ms vs best peer {} ms ({}); ITL p99 {} ms vs {} ms ({})",
            num(me.ttft_p90_ms, 0),
            num(t90, 0),
            ok(me.ttft_p90_ms, t90),
            num(me.itl_p99_ms, 0),
            num(itl, 0),
            ok(me.itl_p99_ms, itl)
        );
        if w == "agent" {
            let kv = best(|c| c.kv_per_request);
            line.push_str(&format!(
                "; KV per warm turn {:.0} vs best peer {:.0} = {}x (target <= 0.5x: {})",
                me.kv_per_request,
                kv,
                num(me.kv_per_request / kv, 2),
                if me.kv_per_request <= 0.5 * kv {
                    "met"
                } else {
                    "not met"
                }
            ));
        }
        lines.push(line);
    }
    if lines.is_empty() {
        return String::new();
    }
    format!(
        "\nTargets (inferlb P/D, vLLM protocol, against the best of the peers that ran; times compared in whole ms, as shown):\n{}\n",
        lines.join("\n")
    )
}

/// What a smoke run must have measured.
pub fn broken(r: &PdResult) -> Vec<String> {
    let mut out = vec![];
    for c in r.cells.iter().chain(&r.sweep) {
        let ours = c.front.starts_with("inferlb");
        if c.skipped.is_some() && !ours {
            // A peer not installed: said in the notes.
            continue;
        }
        // An error through a peer router is shown in the table, not taken as inferlb's.
        let errors = ours && c.errors > 0;
        if c.skipped.is_some() || errors || c.requests == 0 || c.ttft_p50_ms.is_nan() {
            out.push(format!("pd, {} {}", c.front, c.workload));
        }
    }
    match &r.kill {
        Some(k) if k.skipped.is_none() && k.requests > 0 && k.errors_without_first_byte == 0 => {}
        _ => out.push("pd, kill scene".into()),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(t: usize, goodput: f64, p90: f64, kv: f64) -> Cell {
        Cell {
            threshold: Some(t),
            goodput_rps: goodput,
            ttft_p90_ms: p90,
            kv_per_request: kv,
            ..Cell::default()
        }
    }

    #[test]
    fn the_sweep_winner_has_the_goodput_then_the_lowest_ttft() {
        let rows = [
            cell(0, 1.0, 500.0, 2000.0),
            cell(256, 1.5, 400.0, 1500.0),
            cell(1024, 1.48, 300.0, 1000.0),
            cell(4096, 0.5, 100.0, 0.0),
        ];
        assert_eq!(winner(&rows).map(|w| w.0), Some(1024));
        assert_eq!(winner(&rows[..2]).map(|w| w.0), Some(256));
        assert_eq!(winner(&[]), None);
    }

    #[test]
    fn fronts_parse_and_varied_turns_cross_every_threshold() {
        for n in [
            "inferlb-pd",
            "inferlb-pd-sglang",
            "inferlb-agg",
            "vllm-router",
            "smg",
        ] {
            assert_eq!(PdFront::parse(n).map(|f| f.name()), Some(n));
        }
        assert!(PdFront::parse("nginx").is_none());
        let s = PdConf::sized(false, 10.0).sweep_agent;
        let sizes: std::collections::BTreeSet<usize> = (0..s.conversations)
            .flat_map(|c| (0..s.turns).map(move |t| (c, t)))
            .map(|(c, t)| s.turn_tokens(c, t))
            .collect();
        for t in [256, 1024, 4096] {
            assert!(
                sizes.iter().any(|x| *x < t) && sizes.iter().any(|x| *x > t),
                "{t}"
            );
        }
    }
}
