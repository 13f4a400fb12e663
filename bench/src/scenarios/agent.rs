//! Agent loops (many turns over one long context each) and cold bursts (many fresh requests
//! sharing one long prefix).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use crate::client::{filler, stream_chat};
use crate::Sizes;

#[derive(Debug, Default, Clone, Serialize)]
pub struct AgentResult {
    pub warm_ttft_ms: Vec<f64>,
    pub first_turn_ttft_ms: Vec<f64>,
    pub errors: usize,
}

/// Several conversations at once, each many turns over its own long context.
pub async fn agent_loops(
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

/// How a cold burst went.
#[derive(Debug, Default, Clone)]
pub struct BurstResult {
    /// From the first request sent to the last one finished.
    pub makespan_s: f64,
    pub errors: usize,
    /// Requests per replica (`x-inferlb-replica`; "-" without a balancer).
    pub split: BTreeMap<String, usize>,
}

/// `s.burst` parallel fresh requests sharing one long prefix.
pub async fn cold_burst(client: &reqwest::Client, base: &str, s: &Sizes, tag: &str) -> BurstResult {
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
            tokio::spawn(async move {
                let o = stream_chat(&client, &base, &messages, reply).await;
                (o.failed, o.replica)
            })
        })
        .collect();
    let mut errors = 0;
    let mut split = BTreeMap::new();
    for t in tasks {
        let (failed, replica) = t.await.unwrap_or((true, None));
        if failed {
            errors += 1;
        }
        *split
            .entry(replica.unwrap_or_else(|| "-".into()))
            .or_insert(0) += 1;
    }
    BurstResult {
        makespan_s: started.elapsed().as_secs_f64(),
        errors,
        split,
    }
}
