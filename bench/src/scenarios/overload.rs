//! Overload: a saturated pair of replicas with two tenants, an interactive agent (a few clients,
//! long cold prompts, one request after another) and a batch job (many clients at once, short
//! prompts, obeying `Retry-After`). The same traffic runs twice: inferlb without an `overload`
//! section (everything goes to the replicas' queues) and with one (classes, the batch key's
//! concurrency budget, a per-replica limit on queued prefill tokens). Per class: goodput
//! (answered requests a second), time to first token, the share of attempts answered 429.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use inferlb_harness::{Lb, LbConf, Sim};
use serde::Serialize;
use serde_json::json;

use crate::client::{filler, pct};
use crate::Args;

const AGENT_KEY: &str = "sk-bench-interactive";
const BATCH_KEY: &str = "sk-bench-batch-job";

/// The overload section of the protected run.
const PROTECTED: &str = "max_queued_prefill_tokens: 2000\nqueue_length: 256\n\
    queue_timeout_seconds: 10\nclasses: [interactive, batch]\n\
    keys:\n  - {name: agent, key: sk-bench-interactive, class: interactive}\n  \
    - {name: batch, key: sk-bench-batch-job, class: batch, max_concurrent: 16}\n";

#[derive(Debug, Default, Clone, Serialize)]
pub struct ClassRow {
    pub run: String,
    pub class: String,
    pub clients: usize,
    pub answered: usize,
    /// Answered requests a second over the run.
    pub goodput_per_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub attempts: usize,
    pub refused_429: usize,
    pub other_errors: usize,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct OverloadResult {
    pub seconds: f64,
    pub prefill_tokens_per_s: f64,
    pub agent_prompt_tokens: usize,
    pub batch_prompt_tokens: usize,
    pub overload_section: String,
    pub rows: Vec<ClassRow>,
}

#[derive(Default)]
struct Tally {
    ttft_ms: Vec<f64>,
    answered: usize,
    attempts: usize,
    refused: usize,
    errors: usize,
}

/// One streamed request: status, Retry-After, time to the first body byte of a 200.
async fn attempt(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    prompt: String,
) -> (u16, Option<u64>, Option<f64>) {
    let started = Instant::now();
    let body = json!({"model": "sim-model", "stream": true, "max_tokens": 16,
        "messages": [{"role": "user", "content": prompt}]});
    let resp = match client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(_) => return (0, None, None),
    };
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let mut stream = resp.bytes_stream();
    let mut first = None;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        if first.is_none() && !chunk.is_empty() && status == 200 {
            first = Some(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    (status, retry, first)
}

/// `clients` loops of one tenant until `end`; a 429 is obeyed (its Retry-After slept).
async fn tenant(
    client: &reqwest::Client,
    base: &str,
    key: &'static str,
    clients: usize,
    prompt_tokens: usize,
    end: Instant,
) -> Tally {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let loops: Vec<_> = (0..clients)
        .map(|c| {
            let (client, base, tally) = (client.clone(), base.to_string(), tally.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while Instant::now() < end && i < 100_000 {
                    i += 1;
                    let prompt = filler(&format!("{key} client {c} request {i}"), prompt_tokens);
                    let (status, retry, ttft) = attempt(&client, &base, key, prompt).await;
                    let pause = {
                        let Ok(mut t) = tally.lock() else { return };
                        t.attempts += 1;
                        match (status, ttft) {
                            (200, Some(ms)) => {
                                t.answered += 1;
                                t.ttft_ms.push(ms);
                                None
                            }
                            (429, _) => {
                                t.refused += 1;
                                Some(Duration::from_secs(retry.unwrap_or(1).clamp(1, 30)))
                            }
                            _ => {
                                t.errors += 1;
                                Some(Duration::from_millis(50))
                            }
                        }
                    };
                    if let Some(p) = pause {
                        let left = end.saturating_duration_since(Instant::now());
                        tokio::time::sleep(p.min(left)).await;
                    }
                }
            })
        })
        .collect();
    for l in loops {
        let _ = l.await;
    }
    Arc::try_unwrap(tally)
        .ok()
        .and_then(|m| m.into_inner().ok())
        .unwrap_or_default()
}

fn row(run: &str, class: &str, clients: usize, t: &Tally, seconds: f64) -> ClassRow {
    ClassRow {
        run: run.into(),
        class: class.into(),
        clients,
        answered: t.answered,
        goodput_per_s: t.answered as f64 / seconds,
        ttft_p50_ms: pct(&t.ttft_ms, 0.5),
        ttft_p99_ms: pct(&t.ttft_ms, 0.99),
        attempts: t.attempts,
        refused_429: t.refused,
        other_errors: t.errors,
    }
}

/// Both runs, each on fresh replicas.
pub async fn overload(client: &reqwest::Client, a: &Args, smoke: bool) -> OverloadResult {
    let seconds = if smoke { 3.0 } else { 30.0 };
    let (agent_clients, batch_clients) = if smoke { (1, 6) } else { (2, 32) };
    let prefill = 10_000.0;
    let (agent_tokens, batch_tokens) = (4_000, 800);
    let mut result = OverloadResult {
        seconds,
        prefill_tokens_per_s: prefill,
        agent_prompt_tokens: agent_tokens,
        batch_prompt_tokens: batch_tokens,
        overload_section: PROTECTED.into(),
        rows: vec![],
    };
    for (run, section) in [("unprotected", None), ("protected", Some(PROTECTED))] {
        let dir = tempfile::tempdir().expect("tempdir");
        let rate = prefill.to_string();
        let flags = ["--prefill-tokens-per-s", &rate, "--decode-interval-ms", "5"];
        let log = a.out.join("logs").join(format!("overload-{run}.log"));
        let (sims, lb) = tokio::task::block_in_place(|| {
            let sims: Vec<Sim> = (0..2)
                .map(|i| Sim::start(dir.path(), &format!("gpu{i}"), &flags))
                .collect();
            let conf = LbConf {
                threads: Some(2),
                max_retries: Some(4),
                routing: Some("prefill_cost".into()),
                health_interval_seconds: Some(0.5),
                api_keys: vec![AGENT_KEY.into(), BATCH_KEY.into()],
                overload: section.map(str::to_owned),
                ..LbConf::default()
            };
            let sim_refs: Vec<&Sim> = sims.iter().collect();
            let lb = Lb::start_logged(dir.path(), &sim_refs, conf, Some(&log), "warn");
            (sims, lb)
        });
        let base = lb.url("");
        eprintln!("[overload] {run}: {agent_clients} agent and {batch_clients} batch clients for {seconds} s");
        let end = Instant::now() + Duration::from_secs_f64(seconds);
        let agent = tenant(client, &base, AGENT_KEY, agent_clients, agent_tokens, end);
        let batch = tenant(client, &base, BATCH_KEY, batch_clients, batch_tokens, end);
        let (agent, batch) = tokio::join!(agent, batch);
        result
            .rows
            .push(row(run, "interactive", agent_clients, &agent, seconds));
        result
            .rows
            .push(row(run, "batch", batch_clients, &batch, seconds));
        tokio::task::block_in_place(|| drop((lb, sims)));
    }
    result
}

/// The report's table.
pub fn table(r: &OverloadResult) -> String {
    let mut md = format!(
        "\n**Overload** — two replicas at {:.0} prefill tokens/s, {:.0} s; interactive: cold {}-token prompts, one at a time per client; batch: {}-token prompts, every client at once, obeying Retry-After. Protected: `max_queued_prefill_tokens: 2000`, classes `[interactive, batch]`, batch `max_concurrent: 16`.\n\n",
        r.prefill_tokens_per_s, r.seconds, r.agent_prompt_tokens, r.batch_prompt_tokens
    );
    md.push_str("| run | class | clients | answered | goodput (req/s) | TTFT p50 (ms) | TTFT p99 (ms) | attempts | 429 rate | other errors |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for x in &r.rows {
        let rate = if x.attempts == 0 {
            0.0
        } else {
            x.refused_429 as f64 / x.attempts as f64
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.0} | {:.0} | {} | {:.1}% | {} |\n",
            x.run,
            x.class,
            x.clients,
            x.answered,
            x.goodput_per_s,
            x.ttft_p50_ms,
            x.ttft_p99_ms,
            x.attempts,
            rate * 100.0,
            x.other_errors
        ));
    }
    md
}
