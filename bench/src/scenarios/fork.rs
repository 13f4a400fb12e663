//! A fork: an agent with a long history (served once, so one replica holds it) starts several
//! siblings from it, staggered, each the same history with a different last message. None of
//! them is an exact continuation of a prompt served before (the history was only ever sent
//! followed by another message), so a router that recognises only exact message-list
//! continuations sees nothing in common; the replica that holds the history could serve each
//! sibling for the price of its last message.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::client::{filler, pct, stream_api, Api};
use crate::cluster::{Cluster, ClusterSpec, Front};
use crate::{Args, Sizes};

#[derive(Debug, Default, Clone, Serialize)]
pub struct ForkRow {
    pub target: String,
    pub siblings: usize,
    pub ttft_ms: Vec<f64>,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    /// Cached prompt tokens over prompt tokens of the siblings, from the replicas' counters.
    pub hit_rate: f64,
    /// Siblings served by the replica that served the history.
    pub siblings_at_home: usize,
    pub errors: usize,
    /// Which replica served each sibling.
    pub replicas: BTreeMap<String, usize>,
    /// Set when the target could not be started (a peer router missing).
    pub skipped: Option<String>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct ForkResult {
    pub history_tokens: usize,
    pub siblings: usize,
    /// Between two siblings, ms of the modelled engine's time.
    pub stagger_ms: f64,
    pub cache_tokens: usize,
    pub rows: Vec<ForkRow>,
}

/// The long history: a system prompt and turns, `tokens` in all.
fn history(tokens: usize) -> Vec<Value> {
    let turns = 10;
    let mut m =
        vec![json!({"role": "system", "content": filler("fork system prompt", tokens / 6)})];
    let per_turn = (tokens - tokens / 6) / turns;
    for t in 0..turns {
        m.push(json!({"role": "user", "content": filler(&format!("fork tool output {t}"), per_turn * 9 / 10)}));
        m.push(json!({"role": "assistant", "content": filler(&format!("fork step {t}"), per_turn / 10)}));
    }
    m
}

fn request(history: &[Value], last: &str, reply_tokens: usize) -> Value {
    let mut messages = history.to_vec();
    messages.push(json!({"role": "user", "content": last}));
    json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": reply_tokens})
}

/// The fork scene for one target: history served once, then the staggered siblings.
async fn fork_target(
    client: &reqwest::Client,
    a: &Args,
    s: &Sizes,
    name: &str,
    front: Front<'_>,
) -> ForkRow {
    let mut row = ForkRow {
        target: name.into(),
        siblings: s.fork_siblings,
        ..ForkRow::default()
    };
    let c = match Cluster::try_start(&ClusterSpec {
        log: Some(a.out.join("logs").join(format!("fork-{name}.log"))),
        ..ClusterSpec::pair(front, a.speed, s.fork_cache_tokens)
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("[fork] {name}: skipped: {e}");
            row.skipped = Some(e);
            return row;
        }
    };
    let base = c.target();
    let h = history(s.fork_history_tokens);
    // The agent's own turn: its history, then "plan". Its replica now holds the history.
    let parent = stream_api(
        client,
        &base,
        Api::Chat,
        &request(&h, "Plan the subtasks.", s.reply_tokens),
        false,
    )
    .await;
    let home = parent.replica.clone();
    let before = c.token_counts(client).await;
    let stagger = Duration::from_secs_f64(s.fork_stagger_ms / 1e3 / a.speed);
    let started = Instant::now();
    let tasks: Vec<_> = (0..s.fork_siblings)
        .map(|i| {
            let (client, base) = (client.clone(), base.clone());
            let body = request(
                &h,
                &format!("You are sub-agent {i}: do subtask {i} of the plan and report back."),
                s.reply_tokens,
            );
            let at = started + stagger * i as u32;
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                stream_api(&client, &base, Api::Chat, &body, false).await
            })
        })
        .collect();
    for t in tasks {
        let Ok(o) = t.await else {
            row.errors += 1;
            continue;
        };
        if o.failed {
            row.errors += 1;
            continue;
        }
        row.ttft_ms
            .push(o.ttft.unwrap_or(o.total).as_secs_f64() * 1e3);
        let replica = o.replica.unwrap_or_else(|| "-".into());
        if home.as_deref() == Some(replica.as_str()) {
            row.siblings_at_home += 1;
        }
        *row.replicas.entry(replica).or_insert(0) += 1;
    }
    row.hit_rate = c.token_counts(client).await.hit_rate_since(&before);
    row.ttft_p50_ms = pct(&row.ttft_ms, 0.5);
    row.ttft_p90_ms = pct(&row.ttft_ms, 0.9);
    if parent.failed {
        row.errors += 1;
    }
    row
}

/// The fork scene for every target: inferlb's policies, then the peer routers.
pub async fn fork(
    client: &reqwest::Client,
    a: &Args,
    s: &Sizes,
    fronts: &[(String, Front<'_>)],
) -> ForkResult {
    let mut result = ForkResult {
        history_tokens: s.fork_history_tokens,
        siblings: s.fork_siblings,
        stagger_ms: s.fork_stagger_ms,
        cache_tokens: s.fork_cache_tokens,
        rows: vec![],
    };
    for (name, front) in fronts {
        eprintln!("[fork] {name}");
        result
            .rows
            .push(fork_target(client, a, s, name, *front).await);
    }
    result
}
