//! The proxy's own cost: replicas that answer at once, reached directly, through inferlb and
//! through nginx.

use std::time::{Duration, Instant};

use futures::StreamExt;
use inferlb_harness::Nginx;
use serde::Serialize;
use serde_json::json;

use crate::client::{pct, small_request};
use crate::cluster::{Cluster, ClusterSpec, Front};
use crate::Sizes;

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

/// What one closed-loop client measured.
#[derive(Default)]
struct ClientRun {
    latencies_ms: Vec<f64>,
    errors: u64,
}

/// Fixed rate, saturation and SSE pacing against `base`.
pub(crate) async fn overhead_target(
    client: &reqwest::Client,
    name: &str,
    base: &str,
    s: &Sizes,
) -> Latency {
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
    let mut lat = vec![];
    for t in tasks {
        if let Ok(run) = t.await {
            lat.extend(run.latencies_ms);
            l.errors += run.errors;
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

/// Direct, inferlb and (when installed) nginx, against the same replicas.
pub async fn overhead(client: &reqwest::Client, s: &Sizes) -> Vec<Latency> {
    // Replicas that answer at once: what is left is the proxy's own cost.
    let c = Cluster::start(&ClusterSpec {
        front: Front::Inferlb("adaptive"),
        replicas: 2,
        speed: 1.0,
        cache_tokens: 100_000,
        sim_flags: &["--prefill-tokens-per-s", "1e9", "--decode-interval-ms", "5"],
        log: None,
        spill_margin: None,
    });
    let lb = c.target();
    let direct = c.sims[0].url("");
    let mut out = vec![];
    eprintln!("[overhead] direct");
    out.push(overhead_target(client, "direct", &direct, s).await);
    eprintln!("[overhead] inferlb");
    out.push(overhead_target(client, "inferlb", &lb, s).await);
    let Some(bin) = Nginx::find() else {
        eprintln!("[overhead] nginx not installed: skipped (make deps installs it)");
        return out;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let upstreams = [c.sims[0].port, c.sims[1].port];
    // Stopped (master and workers) when it drops, before its directory goes.
    match tokio::task::block_in_place(|| Nginx::start(&bin, dir.path(), &upstreams)) {
        Ok(nginx) => {
            eprintln!("[overhead] nginx");
            out.push(overhead_target(client, "nginx", &nginx.url(), s).await);
        }
        Err(e) => eprintln!("[overhead] {e}: skipped"),
    }
    out
}
