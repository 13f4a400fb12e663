//! Agent loops through a rolling deploy: each replica drained, restarted with a slow start and
//! undrained in turn.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use crate::client::{admin_post, filler, pct, stream_chat, wait_replica};
use crate::cluster::{Cluster, ClusterSpec, Front};
use crate::{Args, Sizes};

#[derive(Debug, Default, Clone, Serialize)]
pub struct DeployPhase {
    pub phase: String,
    pub turns: usize,
    /// Share of the phase's turns served by gpu0, gpu1.
    pub share: [f64; 2],
    pub warm_ttft_p50_ms: f64,
    pub warm_ttft_p90_ms: f64,
    pub errors: usize,
    pub error_statuses: BTreeMap<u16, usize>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct DeployResult {
    pub variant: String,
    pub phases: Vec<DeployPhase>,
}

/// One turn of one conversation.
#[derive(Debug, Clone, Copy)]
struct Turn {
    /// When it was sent, seconds since the scenario started.
    sent_at_s: f64,
    /// 0 for gpu0, 1 for gpu1 (and for no answer at all, 0).
    replica: usize,
    ttft_ms: f64,
    /// A successful turn after the first: its context could be warm.
    warm: bool,
    failed: bool,
    status: u16,
}

/// The turns sent in `[from, to)` seconds, summed up as phase `name`.
fn phase(turns: &[Turn], name: &str, from: f64, to: f64) -> DeployPhase {
    let rows: Vec<&Turn> = turns
        .iter()
        .filter(|t| t.sent_at_s >= from && t.sent_at_s < to)
        .collect();
    let n = rows.len().max(1) as f64;
    let warm: Vec<f64> = rows.iter().filter(|t| t.warm).map(|t| t.ttft_ms).collect();
    DeployPhase {
        phase: name.into(),
        turns: rows.len(),
        share: [
            rows.iter().filter(|t| t.replica == 0).count() as f64 / n,
            rows.iter().filter(|t| t.replica == 1).count() as f64 / n,
        ],
        warm_ttft_p50_ms: pct(&warm, 0.5),
        warm_ttft_p90_ms: pct(&warm, 0.9),
        errors: rows.iter().filter(|t| t.failed).count(),
        error_statuses: rows
            .iter()
            .filter(|t| t.failed)
            .fold(BTreeMap::new(), |mut m, t| {
                *m.entry(t.status).or_insert(0) += 1;
                m
            }),
    }
}

/// Agent loops through a rolling deploy (drain, restart with a slow start, undrain; gpu0 then
/// gpu1): per-replica load and warm-turn TTFT before, during and after.
pub async fn deploy(
    client: &reqwest::Client,
    a: &Args,
    s: &Sizes,
    spill_margin: usize,
) -> DeployResult {
    let mut c = Cluster::start(&ClusterSpec {
        front: Front::Inferlb("adaptive"),
        replicas: 2,
        speed: a.speed,
        cache_tokens: s.cache_tokens,
        sim_flags: &[],
        log: Some(
            a.out
                .join("logs")
                .join(format!("deploy-spill{spill_margin}.log")),
        ),
        spill_margin: Some(spill_margin),
        lb_extra: "",
    });
    let base = c.target();
    let admin = c.admin_port().unwrap_or(0);
    let conversations = s.conversations * 3;
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::<Turn>::new()));
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
                    let sent_at_s = started.elapsed().as_secs_f64();
                    let o = stream_chat(&client, &base, &messages, reply).await;
                    let record = Turn {
                        sent_at_s,
                        replica: usize::from(o.replica.as_deref() == Some("gpu1")),
                        ttft_ms: o.ttft.unwrap_or(o.total).as_secs_f64() * 1e3,
                        warm: !o.failed && turn > 0,
                        failed: o.failed,
                        status: o.status,
                    };
                    if let Ok(mut l) = log.lock() {
                        l.push(record);
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
        admin_post(client, admin, &id, "drain").await;
        wait_replica(client, admin, &id, |r| r["in_flight"] == 0).await;
        c.stop_sim(i);
        tokio::time::sleep(Duration::from_millis(500)).await;
        // vLLM's slow start: refused connections, then /health failing, then healthy.
        c.sims[i].restart(&["--refuse-for", "1", "--unhealthy-for", "1"]);
        admin_post(client, admin, &id, "undrain").await;
        wait_replica(client, admin, &id, |r| r["live"] == true).await;
    }
    let after_start = started.elapsed().as_secs_f64();
    tokio::time::sleep(phase_len * 2).await;
    let end = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        let _ = l.await;
    }
    let turns = log.lock().map(|l| l.clone()).unwrap_or_default();
    // "after" is measured in its second half, once spilling had time to act.
    let settle = (end + after_start) / 2.0;
    DeployResult {
        variant: if spill_margin > 0 {
            format!("adaptive, spill_margin {spill_margin}")
        } else {
            "adaptive, no spill".into()
        },
        phases: vec![
            phase(&turns, "before", 0.0, during_start),
            phase(&turns, "during", during_start, after_start),
            phase(&turns, "after", settle, end + 1.0),
        ],
    }
}
